//! The one error a settings section gives when a value breaks a rule, and
//! the rules several sections share.
//!
//! Each section (`owner`, `stream`, `search`, ...) is defined and validated
//! beside the module it configures; `config` only layers and composes them.
//! This leaf module is what they have in common, so that no section depends
//! on `config` and `config` on it in turn.

/// A value that breaks a rule: the field by its full name, and the rule.
#[derive(Debug, thiserror::Error)]
#[error("setting `{field}` is invalid: {rule}")]
pub struct InvalidSetting {
    pub field: &'static str,
    pub rule: String,
}

impl InvalidSetting {
    pub fn new(field: &'static str, rule: impl Into<String>) -> InvalidSetting {
        InvalidSetting {
            field,
            rule: rule.into(),
        }
    }
}

/// A file named by a `*_file` setting (a quote key, bearer tokens) that
/// cannot be used. Such files are read at startup, so a bad one stops the
/// start, naming the setting; never their contents.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    #[error("cannot read {field} {path}: {source}")]
    Read {
        field: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{field}: {rule}")]
    Invalid { field: &'static str, rule: String },
}

/// The shortest bearer token a setting may hold (booking service, admin):
/// shorter ones are guessable.
pub const MIN_BEARER_TOKEN_BYTES: usize = 16;

/// Every token of a bearer-token list is long enough and carries no
/// surrounding spaces (a token pasted with a line end would never match).
pub fn check_bearer_tokens(field: &'static str, tokens: &[String]) -> Result<(), InvalidSetting> {
    if tokens
        .iter()
        .any(|t| t.len() < MIN_BEARER_TOKEN_BYTES || t.trim() != t)
    {
        return Err(InvalidSetting::new(
            field,
            format!(
                "every token must be at least {MIN_BEARER_TOKEN_BYTES} bytes, without surrounding spaces"
            ),
        ));
    }
    Ok(())
}

//! The `[owner]` settings: where the owner is and how long to wait for it.

use std::time::Duration;

use serde::Deserialize;

use super::endpoint::{self, EndpointError, UrlParts};
use crate::setting::InvalidSetting;

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnerSettings {
    pub url: String,
    /// The role's password, when neither the URL nor `password_file` holds
    /// it (`crate::owner::Endpoint` says which wins).
    pub password: String,
    pub password_file: String,
    pub connect_timeout_ms: u64,
    pub query_timeout_ms: u64,
}

/// A rule of the `[owner]` section broken: the URL and the password
/// settings are parsed by `endpoint`, whose messages name the setting.
#[derive(Debug, thiserror::Error)]
pub enum OwnerSettingsError {
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error(transparent)]
    Invalid(#[from] InvalidSetting),
}

impl std::fmt::Debug for OwnerSettings {
    // Settings are logged at startup; the password, wherever it is, must not be.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnerSettings")
            .field("url", &endpoint::redacted_url(&self.url))
            .field(
                "password",
                &if self.password.is_empty() {
                    ""
                } else {
                    "<redacted>"
                },
            )
            .field("password_file", &self.password_file)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("query_timeout_ms", &self.query_timeout_ms)
            .finish()
    }
}

impl OwnerSettings {
    pub fn validate(&self) -> Result<(), OwnerSettingsError> {
        if !(self.url.starts_with("postgres://") || self.url.starts_with("postgresql://")) {
            return Err(InvalidSetting::new("owner.url", "must be a postgresql:// URL").into());
        }
        // The same parse connecting uses; files are read only when connecting.
        let url = UrlParts::parse(&self.url)?;
        if !self.password.is_empty() && !self.password_file.is_empty() {
            return Err(EndpointError::PasswordSettingsTwice.into());
        }
        if url.has_password && !(self.password.is_empty() && self.password_file.is_empty()) {
            return Err(EndpointError::PasswordTwice.into());
        }
        if self.connect_timeout_ms == 0 {
            return Err(InvalidSetting::new("owner.connect_timeout_ms", "must be above 0").into());
        }
        if self.query_timeout_ms == 0 {
            return Err(InvalidSetting::new("owner.query_timeout_ms", "must be above 0").into());
        }
        Ok(())
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    pub fn query_timeout(&self) -> Duration {
        Duration::from_millis(self.query_timeout_ms)
    }
}

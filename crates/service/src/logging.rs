//! Structured logs: the `[log]` settings and the subscriber they set up.
//!
//! It lives apart from `app` so that every entry point (`serve`, `demo`,
//! the benches) logs the same way, and apart from `config`, which only
//! layers the sections.

use std::io::IsTerminal;

use serde::Deserialize;

use crate::setting::InvalidSetting;

/// The `[log]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogSettings {
    pub format: LogFormat,
    pub level: String,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

impl LogSettings {
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.level.parse::<tracing_subscriber::EnvFilter>().is_err() {
            return Err(InvalidSetting::new(
                "log.level",
                "must be a tracing filter such as `info`",
            ));
        }
        Ok(())
    }
}

/// Logs to stderr, text or JSON, filtered by `log.level` (`RUST_LOG` wins
/// when set). Colour codes only when stderr is a terminal: a log written to
/// a file or a pipe must stay plain text for whoever greps it.
pub fn init_logging(log: &LogSettings) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match log.format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

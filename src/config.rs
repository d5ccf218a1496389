//! Settings: `config/default.toml` (compiled in), then an optional file, then
//! `VACANCY_*` environment variables, each later layer winning.
//!
//! Every setting has its documented default in `config/default.toml`, so there
//! is one place to read what a knob does. `validate` names the field and the
//! rule it broke, because a service that starts with a wrong setting fails far
//! from the cause.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::Deserialize;

pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub owner: OwnerSettings,
    pub stream: StreamSettings,
    pub model: ModelSettings,
    pub search: SearchSettings,
    pub http: HttpSettings,
    pub log: LogSettings,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnerSettings {
    pub url: String,
    pub connect_timeout_ms: u64,
    pub query_timeout_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamSettings {
    pub publication: String,
    pub slot: String,
    pub temporary_slot: bool,
    pub schema: String,
    pub reconnect_min_ms: u64,
    pub reconnect_max_ms: u64,
    pub heartbeat_interval_ms: u64,
    pub stream_in_progress: bool,
    pub slot_watch_interval_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSettings {
    pub ttl_secs: u64,
    pub refresh_batch: u32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchSettings {
    pub few_units_threshold: i32,
    pub owner_read_timeout_ms: u64,
    pub owner_read_cache_ms: u64,
    pub owner_read_connections: usize,
    pub max_lag_ms: u64,
    pub horizon_days: u32,
    pub max_stay_nights: u32,
    pub min_lsn_wait_ms: u64,
    pub when_lagging: WhenLagging,
}

/// What a search does when the copy lags past `search.max_lag_ms`.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum WhenLagging {
    /// 503 with Retry-After.
    Refuse,
    /// Read every shown room type from the owner.
    Owner,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSettings {
    pub listen: String,
    pub request_timeout_ms: u64,
    pub ready_max_lag_ms: u64,
}

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

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read settings: {0}")]
    Load(#[from] Box<figment::Error>),
    #[error("setting `{field}` is invalid: {rule}")]
    Invalid { field: &'static str, rule: String },
}

impl Settings {
    /// Loads the layers: defaults, `file` when given, then the environment.
    pub fn load(file: Option<&Path>) -> Result<Settings, ConfigError> {
        Self::load_from(file, Env::prefixed("VACANCY_"))
    }

    fn load_from(file: Option<&Path>, env: Env) -> Result<Settings, ConfigError> {
        let mut figment = Figment::from(Toml::string(DEFAULT_TOML));
        if let Some(path) = file {
            if !path.is_file() {
                return Err(ConfigError::Invalid {
                    field: "--config",
                    rule: format!("{} is not a readable file", path.display()),
                });
            }
            figment = figment.merge(Toml::file(path));
        }
        // Two documented short forms; everything else nests with "__".
        let env = env.map(|key| match key.as_str().to_ascii_lowercase().as_str() {
            "owner_url" => "owner.url".into(),
            "listen" => "http.listen".into(),
            other => other.replace("__", ".").into(),
        });
        let settings: Settings = figment.merge(env).extract().map_err(Box::new)?;
        settings.validate()?;
        Ok(settings)
    }

    /// The compiled-in defaults alone (no file, no environment): for tests
    /// and embedders that set fields directly.
    pub fn defaults() -> Settings {
        Figment::from(Toml::string(DEFAULT_TOML))
            .extract()
            .expect("config/default.toml matches Settings")
    }

    /// Checks each rule a running service depends on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn invalid(field: &'static str, rule: impl Into<String>) -> ConfigError {
            ConfigError::Invalid {
                field,
                rule: rule.into(),
            }
        }
        if !(self.owner.url.starts_with("postgres://")
            || self.owner.url.starts_with("postgresql://"))
        {
            return Err(invalid("owner.url", "must be a postgresql:// URL"));
        }
        if self.owner.url.parse::<tokio_postgres::Config>().is_err() {
            return Err(invalid(
                "owner.url",
                "is not a connection string PostgreSQL accepts",
            ));
        }
        if self.owner.connect_timeout_ms == 0 {
            return Err(invalid("owner.connect_timeout_ms", "must be above 0"));
        }
        if self.owner.query_timeout_ms == 0 {
            return Err(invalid("owner.query_timeout_ms", "must be above 0"));
        }
        for (field, name) in [
            ("stream.publication", &self.stream.publication),
            ("stream.slot", &self.stream.slot),
            ("stream.schema", &self.stream.schema),
        ] {
            if !is_identifier(name) {
                return Err(invalid(
                    field,
                    "must be 1 to 63 lowercase letters, digits or underscores, starting with a letter or underscore",
                ));
            }
        }
        if self.stream.reconnect_min_ms == 0
            || self.stream.reconnect_min_ms > self.stream.reconnect_max_ms
        {
            return Err(invalid(
                "stream.reconnect_min_ms",
                "must be above 0 and at most stream.reconnect_max_ms",
            ));
        }
        if self.stream.slot_watch_interval_ms == 0 {
            return Err(invalid("stream.slot_watch_interval_ms", "must be above 0"));
        }
        if self.model.ttl_secs == 0 {
            return Err(invalid("model.ttl_secs", "must be at least 1 second"));
        }
        if self.model.refresh_batch == 0 || self.model.refresh_batch > 10_000 {
            return Err(invalid(
                "model.refresh_batch",
                "must be between 1 and 10000",
            ));
        }
        if self.search.few_units_threshold < 0 {
            return Err(invalid("search.few_units_threshold", "must be 0 or more"));
        }
        if self.search.owner_read_timeout_ms == 0 {
            return Err(invalid("search.owner_read_timeout_ms", "must be above 0"));
        }
        if self.search.owner_read_cache_ms >= 1000 {
            return Err(invalid(
                "search.owner_read_cache_ms",
                "must be well under a second (below 1000)",
            ));
        }
        if !(1..=64).contains(&self.search.owner_read_connections) {
            return Err(invalid(
                "search.owner_read_connections",
                "must be between 1 and 64",
            ));
        }
        if self.search.max_stay_nights == 0
            || self.search.max_stay_nights > self.search.horizon_days
        {
            return Err(invalid(
                "search.max_stay_nights",
                "must be above 0 and at most search.horizon_days",
            ));
        }
        if self.http.listen.parse::<SocketAddr>().is_err() {
            return Err(invalid(
                "http.listen",
                "must be an address like 127.0.0.1:8080",
            ));
        }
        if self.http.request_timeout_ms == 0 {
            return Err(invalid("http.request_timeout_ms", "must be above 0"));
        }
        if self
            .log
            .level
            .parse::<tracing_subscriber::EnvFilter>()
            .is_err()
        {
            return Err(invalid(
                "log.level",
                "must be a tracing filter such as `info`",
            ));
        }
        Ok(())
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.owner.connect_timeout_ms)
    }

    pub fn query_timeout(&self) -> Duration {
        Duration::from_millis(self.owner.query_timeout_ms)
    }
}

/// A name we put into SQL unquoted: keep it to what needs no quoting.
fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
        && name.len() <= 63
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

#[cfg(test)]
// figment's Jail API returns its large error type; that is its signature, not ours.
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;
    use figment::Jail;

    fn load_with_env(vars: &[(&str, &str)]) -> Result<Settings, String> {
        let mut out = Err("jail did not run".to_string());
        Jail::expect_with(|jail| {
            jail.clear_env();
            for (k, v) in vars {
                jail.set_env(k, v);
            }
            out = Settings::load(None).map_err(|e| e.to_string());
            Ok(())
        });
        out
    }

    #[test]
    fn defaults_load_and_validate() {
        let s = load_with_env(&[]).expect("defaults");
        assert_eq!(s.stream.publication, "vacancy");
        assert_eq!(s.http.listen, "127.0.0.1:8080");
    }

    #[test]
    fn short_env_forms_work_as_documented() {
        let s = load_with_env(&[
            ("VACANCY_OWNER_URL", "postgresql://u@db.example:6543/shop"),
            ("VACANCY_LISTEN", "0.0.0.0:9000"),
            ("VACANCY_STREAM__SLOT", "copy_two"),
        ])
        .expect("env");
        assert_eq!(s.owner.url, "postgresql://u@db.example:6543/shop");
        assert_eq!(s.http.listen, "0.0.0.0:9000");
        assert_eq!(s.stream.slot, "copy_two");
    }

    #[test]
    fn validation_names_field_and_rule() {
        let e = load_with_env(&[("VACANCY_STREAM__SLOT", "Bad-Slot")]).unwrap_err();
        assert!(e.contains("stream.slot"), "{e}");
        let e = load_with_env(&[("VACANCY_LISTEN", "nowhere")]).unwrap_err();
        assert!(e.contains("http.listen"), "{e}");
        let e = load_with_env(&[("VACANCY_OWNER_URL", "mysql://x")]).unwrap_err();
        assert!(e.contains("owner.url"), "{e}");
        let e = load_with_env(&[("VACANCY_MODEL__TTL_SECS", "0")]).unwrap_err();
        assert!(e.contains("model.ttl_secs"), "{e}");
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = load_with_env(&[("VACANCY_STREAM__SLOTT", "x")]).unwrap_err();
        assert!(e.contains("slott"), "{e}");
    }

    #[test]
    fn config_file_layer_overrides_defaults() {
        Jail::expect_with(|jail| {
            jail.clear_env();
            jail.create_file("extra.toml", "[stream]\nslot = \"from_file\"\n")?;
            let s = Settings::load(Some(Path::new("extra.toml"))).expect("file");
            assert_eq!(s.stream.slot, "from_file");
            jail.set_env("VACANCY_STREAM__SLOT", "from_env");
            let s = Settings::load(Some(Path::new("extra.toml"))).expect("file+env");
            assert_eq!(s.stream.slot, "from_env");
            Ok(())
        });
    }
}

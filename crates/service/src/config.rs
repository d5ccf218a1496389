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

pub use crate::logging::{LogFormat, LogSettings};

pub const DEFAULT_TOML: &str = include_str!("../../../config/default.toml");

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub owner: OwnerSettings,
    pub stream: StreamSettings,
    pub model: ModelSettings,
    pub search: SearchSettings,
    pub http: HttpSettings,
    pub log: LogSettings,
    pub stale: StaleSettings,
    pub admin: AdminSettings,
}

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

impl std::fmt::Debug for OwnerSettings {
    // Settings are logged at startup; the password, wherever it is, must not be.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnerSettings")
            .field("url", &crate::owner::endpoint::redacted_url(&self.url))
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

/// The stale-read loop: quote tokens, take outcomes, bypass advice, audit.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaleSettings {
    pub quote_key: String,
    pub quote_key_file: String,
    pub booking_tokens: Vec<String>,
    pub booking_tokens_file: String,
    pub attempt_capacity: u64,
    pub attempt_ttl_secs: u64,
    pub window_secs: u64,
    pub window_buckets: u32,
    pub max_hotels: usize,
    pub top_hotels: usize,
    pub hotel_min_takes: u64,
    pub hotel_share_bound: f64,
    pub bypass_max_lag_ms: u64,
    pub max_body_bytes: usize,
    pub audit_interval_ms: u64,
    pub audit_sample: usize,
    pub audit_wait_ms: u64,
}

impl std::fmt::Debug for StaleSettings {
    // Settings are logged at startup; the key and the tokens must not be.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StaleSettings")
            .field(
                "quote_key",
                &if self.quote_key.is_empty() {
                    ""
                } else {
                    "<redacted>"
                },
            )
            .field("quote_key_file", &self.quote_key_file)
            .field(
                "booking_tokens",
                &format_args!("<{} redacted>", self.booking_tokens.len()),
            )
            .field("booking_tokens_file", &self.booking_tokens_file)
            .field("attempt_capacity", &self.attempt_capacity)
            .field("attempt_ttl_secs", &self.attempt_ttl_secs)
            .field("window_secs", &self.window_secs)
            .field("window_buckets", &self.window_buckets)
            .field("max_hotels", &self.max_hotels)
            .field("top_hotels", &self.top_hotels)
            .field("hotel_min_takes", &self.hotel_min_takes)
            .field("hotel_share_bound", &self.hotel_share_bound)
            .field("bypass_max_lag_ms", &self.bypass_max_lag_ms)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("audit_interval_ms", &self.audit_interval_ms)
            .field("audit_sample", &self.audit_sample)
            .field("audit_wait_ms", &self.audit_wait_ms)
            .finish()
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSettings {
    pub listen: String,
    pub request_timeout_ms: u64,
    pub ready_max_lag_ms: u64,
    pub max_query_bytes: usize,
    pub max_body_bytes: usize,
    pub cors_allowed_origins: Vec<String>,
    pub trust_forwarded_for: bool,
    pub rate_limit_per_sec: u32,
    pub rate_limit_burst: u32,
    pub rate_limit_max_clients: usize,
    pub shutdown_grace_ms: u64,
}

/// Operator actions (`POST /v1/admin/...`).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminSettings {
    pub tokens: Vec<String>,
    pub tokens_file: String,
}

impl std::fmt::Debug for AdminSettings {
    // Settings are logged at startup; the tokens must not be.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminSettings")
            .field("tokens", &format_args!("<{} redacted>", self.tokens.len()))
            .field("tokens_file", &self.tokens_file)
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read settings: {0}")]
    Load(#[from] Box<figment::Error>),
    #[error("setting `{field}` is invalid: {rule}")]
    Invalid { field: &'static str, rule: String },
    /// A rule of `owner.url` and the password settings (`owner::endpoint`
    /// parses them; its messages name the setting).
    #[error("invalid owner settings: {0}")]
    Owner(#[from] crate::owner::EndpointError),
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
        // The same parse connecting uses; files are read only when connecting.
        let url = crate::owner::endpoint::UrlParts::parse(&self.owner.url)?;
        if !self.owner.password.is_empty() && !self.owner.password_file.is_empty() {
            return Err(crate::owner::EndpointError::PasswordSettingsTwice.into());
        }
        if url.has_password
            && !(self.owner.password.is_empty() && self.owner.password_file.is_empty())
        {
            return Err(crate::owner::EndpointError::PasswordTwice.into());
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
        self.validate_access()?;
        self.validate_stale()?;
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

    /// Limits, CORS, the rate limit and admin tokens (`crate::access`).
    fn validate_access(&self) -> Result<(), ConfigError> {
        fn invalid(field: &'static str, rule: impl Into<String>) -> ConfigError {
            ConfigError::Invalid {
                field,
                rule: rule.into(),
            }
        }
        let h = &self.http;
        if !(256..=65_536).contains(&h.max_query_bytes) {
            return Err(invalid(
                "http.max_query_bytes",
                "must be between 256 and 65536",
            ));
        }
        if !(1024..=16 * 1024 * 1024).contains(&h.max_body_bytes) {
            return Err(invalid(
                "http.max_body_bytes",
                "must be between 1024 and 16777216",
            ));
        }
        for origin in &h.cors_allowed_origins {
            if crate::access::check_origin(origin).is_err() {
                return Err(invalid(
                    "http.cors_allowed_origins",
                    "every entry must be `*` or an origin like https://shop.example (scheme, host, optional port; no path)",
                ));
            }
        }
        if h.rate_limit_per_sec > 0 && h.rate_limit_burst == 0 {
            return Err(invalid(
                "http.rate_limit_burst",
                "must be above 0 while http.rate_limit_per_sec is on",
            ));
        }
        if !(1..=10_000_000).contains(&h.rate_limit_max_clients) {
            return Err(invalid(
                "http.rate_limit_max_clients",
                "must be between 1 and 10000000",
            ));
        }
        if h.shutdown_grace_ms == 0 {
            return Err(invalid("http.shutdown_grace_ms", "must be above 0"));
        }
        if self
            .admin
            .tokens
            .iter()
            .any(|t| t.len() < crate::stale::MIN_BOOKING_TOKEN_BYTES || t.trim() != t)
        {
            return Err(invalid(
                "admin.tokens",
                format!(
                    "every token must be at least {} bytes, without surrounding spaces",
                    crate::stale::MIN_BOOKING_TOKEN_BYTES
                ),
            ));
        }
        Ok(())
    }

    fn validate_stale(&self) -> Result<(), ConfigError> {
        fn invalid(field: &'static str, rule: impl Into<String>) -> ConfigError {
            ConfigError::Invalid {
                field,
                rule: rule.into(),
            }
        }
        let s = &self.stale;
        if !s.quote_key.is_empty() && !s.quote_key_file.is_empty() {
            return Err(invalid(
                "stale.quote_key",
                "set stale.quote_key or stale.quote_key_file, not both",
            ));
        }
        if !s.quote_key.is_empty() && s.quote_key.len() < crate::stale::token::MIN_KEY_BYTES {
            return Err(invalid(
                "stale.quote_key",
                format!(
                    "must be at least {} bytes",
                    crate::stale::token::MIN_KEY_BYTES
                ),
            ));
        }
        if s.booking_tokens
            .iter()
            .any(|t| t.len() < crate::stale::MIN_BOOKING_TOKEN_BYTES || t.trim() != t)
        {
            return Err(invalid(
                "stale.booking_tokens",
                format!(
                    "every token must be at least {} bytes, without surrounding spaces",
                    crate::stale::MIN_BOOKING_TOKEN_BYTES
                ),
            ));
        }
        if s.attempt_capacity == 0 {
            return Err(invalid("stale.attempt_capacity", "must be above 0"));
        }
        if s.attempt_ttl_secs == 0 {
            return Err(invalid("stale.attempt_ttl_secs", "must be above 0"));
        }
        if s.window_buckets == 0 || s.window_buckets > 3600 {
            return Err(invalid(
                "stale.window_buckets",
                "must be between 1 and 3600",
            ));
        }
        // Saturating: any u64 may arrive here, and the bound below refuses
        // the huge ones by name (a plain multiply would panic instead).
        if s.window_secs.saturating_mul(1000) / u64::from(s.window_buckets) < 100 {
            return Err(invalid(
                "stale.window_secs",
                "must give each of stale.window_buckets at least 100 ms",
            ));
        }
        if s.window_secs > 86_400 {
            return Err(invalid(
                "stale.window_secs",
                "must be at most a day (86400)",
            ));
        }
        if s.max_hotels == 0 {
            return Err(invalid("stale.max_hotels", "must be above 0"));
        }
        if !(1..=1000).contains(&s.top_hotels) {
            return Err(invalid("stale.top_hotels", "must be between 1 and 1000"));
        }
        if s.hotel_min_takes == 0 {
            return Err(invalid("stale.hotel_min_takes", "must be above 0"));
        }
        if !(0.0..1.0).contains(&s.hotel_share_bound) {
            return Err(invalid(
                "stale.hotel_share_bound",
                "must be a ratio from 0 up to (not including) 1",
            ));
        }
        if !(1024..=1024 * 1024).contains(&s.max_body_bytes) {
            return Err(invalid(
                "stale.max_body_bytes",
                "must be between 1024 and 1048576",
            ));
        }
        if s.audit_interval_ms > 0 && s.audit_interval_ms < 100 {
            return Err(invalid(
                "stale.audit_interval_ms",
                "must be 0 (off) or at least 100",
            ));
        }
        if !(1..=10_000).contains(&s.audit_sample) {
            return Err(invalid("stale.audit_sample", "must be between 1 and 10000"));
        }
        if s.audit_wait_ms == 0 {
            return Err(invalid("stale.audit_wait_ms", "must be above 0"));
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
        let e = load_with_env(&[("VACANCY_STALE__QUOTE_KEY", "too short")]).unwrap_err();
        assert!(e.contains("stale.quote_key"), "{e}");
        let e = load_with_env(&[("VACANCY_STALE__HOTEL_SHARE_BOUND", "1.5")]).unwrap_err();
        assert!(e.contains("stale.hotel_share_bound"), "{e}");
        let e = load_with_env(&[("VACANCY_STALE__WINDOW_BUCKETS", "0")]).unwrap_err();
        assert!(e.contains("stale.window_buckets"), "{e}");
        let e = load_with_env(&[("VACANCY_OWNER_URL", "postgresql://u@h/db?sslmode=allow")])
            .unwrap_err();
        assert!(
            e.contains("owner.url") && e.contains("sslmode=allow"),
            "{e}"
        );
        let e = load_with_env(&[(
            "VACANCY_OWNER_URL",
            "postgresql://u@h/db?sslmode=verify-full",
        )])
        .unwrap_err();
        assert!(e.contains("owner.url") && e.contains("sslrootcert"), "{e}");
        let e = load_with_env(&[
            ("VACANCY_OWNER__PASSWORD", "pw"),
            ("VACANCY_OWNER__PASSWORD_FILE", "/run/secrets/pw"),
        ])
        .unwrap_err();
        assert!(e.contains("owner.password_file"), "{e}");
        let e = load_with_env(&[
            ("VACANCY_OWNER_URL", "postgresql://u:inurl@h/db"),
            ("VACANCY_OWNER__PASSWORD", "pw"),
        ])
        .unwrap_err();
        assert!(
            e.contains("owner.url") && e.contains("owner.password"),
            "{e}"
        );
    }

    #[test]
    fn the_owner_password_comes_from_the_environment() {
        let s = load_with_env(&[("VACANCY_OWNER__PASSWORD", "from-env")]).expect("env");
        assert_eq!(s.owner.password, "from-env");
        let s =
            load_with_env(&[("VACANCY_OWNER__PASSWORD_FILE", "/run/secrets/owner")]).expect("env");
        assert_eq!(s.owner.password_file, "/run/secrets/owner");
        // Files are read when connecting, not when loading.
        assert!(s.owner.password.is_empty());
    }

    #[test]
    fn secrets_never_show_in_debug_output() {
        let s = load_with_env(&[
            (
                "VACANCY_STALE__QUOTE_KEY",
                "a-quote-key-of-thirty-two-bytes-or-more",
            ),
            (
                "VACANCY_STALE__BOOKING_TOKENS",
                "[\"booking-token-0123456789\"]",
            ),
        ])
        .expect("env");
        assert_eq!(s.stale.booking_tokens, vec!["booking-token-0123456789"]);
        let shown = format!("{s:?}");
        assert!(!shown.contains("a-quote-key"), "{shown}");
        assert!(!shown.contains("booking-token"), "{shown}");

        let s = load_with_env(&[("VACANCY_OWNER__PASSWORD", "owner-password-xyz")]).expect("env");
        let shown = format!("{s:?}");
        assert!(!shown.contains("owner-password-xyz"), "{shown}");
        assert!(
            shown.contains("127.0.0.1:5432"),
            "the URL still shows: {shown}"
        );
        let s = load_with_env(&[(
            "VACANCY_OWNER_URL",
            "postgresql://u:url-password-xyz@h/db?password=query-password-xyz",
        )])
        .expect("env");
        let shown = format!("{s:?}");
        assert!(!shown.contains("password-xyz"), "{shown}");
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

    /// Every `section.key` of `config/default.toml`.
    fn known_keys() -> Vec<String> {
        let data =
            figment::Provider::data(&Toml::string(DEFAULT_TOML)).expect("default.toml parses");
        let mut keys = Vec::new();
        for dict in data.values() {
            for (section, value) in dict {
                if let Some(inner) = value.as_dict() {
                    keys.extend(inner.keys().map(|k| format!("{section}.{k}")));
                }
            }
        }
        keys.sort();
        keys
    }

    /// Defaults with one key set to `value`, extracted and validated.
    fn with_value(key: &str, value: &serde_json::Value) -> Result<Settings, ConfigError> {
        let settings: Settings = Figment::from(Toml::string(DEFAULT_TOML))
            .merge(figment::providers::Serialized::default(key, value))
            .extract()
            .map_err(Box::new)?;
        settings.validate()?;
        Ok(settings)
    }

    /// Values of every shape, at the edges of their types.
    fn any_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        use serde_json::Value;
        let scalar = prop_oneof![
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            prop_oneof![
                Just(0u64),
                Just(1),
                Just(u64::MAX),
                Just(u64::MAX / 1000 + 1)
            ]
            .prop_map(Value::from),
            any::<f64>()
                .prop_filter("JSON numbers are finite", |f| f.is_finite())
                .prop_map(Value::from),
            any::<bool>().prop_map(Value::from),
            "\\PC{0,40}".prop_map(Value::from),
            prop_oneof![
                Just("postgresql://u@h/db"),
                Just("0.0.0.0:80"),
                Just("https://shop.example"),
                Just("refuse"),
                Just("owner"),
                Just("json"),
                Just("info"),
            ]
            .prop_map(Value::from),
        ];
        scalar.prop_recursive(2, 8, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z_]{1,8}", inner, 0..3)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// Any value for any known key: the settings load, or the error is
        /// typed and names the key (as the field, or in the rule of the
        /// field it constrains); never a panic.
        #[test]
        fn any_value_for_a_known_key_loads_or_names_the_key(
            key in proptest::sample::select(known_keys()),
            value in any_value(),
        ) {
            match with_value(&key, &value) {
                Ok(_) => {}
                Err(e) => {
                    let message = e.to_string();
                    proptest::prop_assert!(message.contains(&key), "{} for {} = {}", message, key, value);
                }
            }
        }
    }

    /// The edges of every type, for every key: exhaustive, not sampled.
    #[test]
    fn edge_values_for_every_key_load_or_name_the_key() {
        use serde_json::json;
        let edges = [
            json!(0),
            json!(1),
            json!(-1),
            json!(i64::MIN),
            json!(u64::MAX),
            json!(u64::MAX / 1000 + 1),
            json!(u32::MAX),
            json!(1e300),
            json!(-0.5),
            json!(""),
            json!(" "),
            json!("x"),
            json!(true),
            json!([]),
            json!(["x"]),
            json!({}),
        ];
        for key in known_keys() {
            for value in &edges {
                let outcome = std::panic::catch_unwind(|| with_value(&key, value));
                match outcome {
                    Err(_) => panic!("{key} = {value} panicked"),
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        let message = e.to_string();
                        assert!(message.contains(&key), "{message} for {key} = {value}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_key_list_covers_every_section() {
        let keys = known_keys();
        for section in [
            "owner.", "stream.", "model.", "search.", "http.", "log.", "stale.", "admin.",
        ] {
            assert!(keys.iter().any(|k| k.starts_with(section)), "{section}");
        }
        assert!(keys.contains(&"http.rate_limit_per_sec".to_string()));
    }
}

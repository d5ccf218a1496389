//! The `[stale]` settings: quote keys, booking tokens, the window, the
//! bypass policy and the audit.

use serde::Deserialize;

use crate::setting::{InvalidSetting, check_bearer_tokens};

use super::token::MIN_KEY_BYTES;

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
    pub max_quote_age_secs: u64,
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
            .field("max_quote_age_secs", &self.max_quote_age_secs)
            .field("bypass_max_lag_ms", &self.bypass_max_lag_ms)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("audit_interval_ms", &self.audit_interval_ms)
            .field("audit_sample", &self.audit_sample)
            .field("audit_wait_ms", &self.audit_wait_ms)
            .finish()
    }
}

impl StaleSettings {
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        fn invalid(field: &'static str, rule: impl Into<String>) -> InvalidSetting {
            InvalidSetting::new(field, rule)
        }
        if !self.quote_key.is_empty() && !self.quote_key_file.is_empty() {
            return Err(invalid(
                "stale.quote_key",
                "set stale.quote_key or stale.quote_key_file, not both",
            ));
        }
        if !self.quote_key.is_empty() && self.quote_key.len() < MIN_KEY_BYTES {
            return Err(invalid(
                "stale.quote_key",
                format!("must be at least {MIN_KEY_BYTES} bytes"),
            ));
        }
        check_bearer_tokens("stale.booking_tokens", &self.booking_tokens)?;
        if self.attempt_capacity == 0 {
            return Err(invalid("stale.attempt_capacity", "must be above 0"));
        }
        if self.attempt_ttl_secs == 0 {
            return Err(invalid("stale.attempt_ttl_secs", "must be above 0"));
        }
        if self.window_buckets == 0 || self.window_buckets > 3600 {
            return Err(invalid(
                "stale.window_buckets",
                "must be between 1 and 3600",
            ));
        }
        // Saturating: any u64 may arrive here, and the bound below refuses
        // the huge ones by name (a plain multiply would panic instead).
        if self.window_secs.saturating_mul(1000) / u64::from(self.window_buckets) < 100 {
            return Err(invalid(
                "stale.window_secs",
                "must give each of stale.window_buckets at least 100 ms",
            ));
        }
        if self.window_secs > 86_400 {
            return Err(invalid(
                "stale.window_secs",
                "must be at most a day (86400)",
            ));
        }
        if self.max_hotels == 0 {
            return Err(invalid("stale.max_hotels", "must be above 0"));
        }
        if !(1..=1000).contains(&self.top_hotels) {
            return Err(invalid("stale.top_hotels", "must be between 1 and 1000"));
        }
        if self.hotel_min_takes == 0 {
            return Err(invalid("stale.hotel_min_takes", "must be above 0"));
        }
        if !(0.0..1.0).contains(&self.hotel_share_bound) {
            return Err(invalid(
                "stale.hotel_share_bound",
                "must be a ratio from 0 up to (not including) 1",
            ));
        }
        if self.max_quote_age_secs > 86_400 * 30 {
            return Err(invalid(
                "stale.max_quote_age_secs",
                "must be 0 (quotes never expire) or at most 30 days (2592000)",
            ));
        }
        if !(1024..=1024 * 1024).contains(&self.max_body_bytes) {
            return Err(invalid(
                "stale.max_body_bytes",
                "must be between 1024 and 1048576",
            ));
        }
        if self.audit_interval_ms > 0 && self.audit_interval_ms < 100 {
            return Err(invalid(
                "stale.audit_interval_ms",
                "must be 0 (off) or at least 100",
            ));
        }
        if !(1..=10_000).contains(&self.audit_sample) {
            return Err(invalid("stale.audit_sample", "must be between 1 and 10000"));
        }
        if self.audit_wait_ms == 0 {
            return Err(invalid("stale.audit_wait_ms", "must be above 0"));
        }
        Ok(())
    }
}

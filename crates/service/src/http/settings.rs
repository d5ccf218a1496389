//! The `[http]` and `[admin]` settings: the listener, request limits,
//! CORS, the rate limit, and who may call the operators' actions.

use std::net::SocketAddr;

use serde::Deserialize;

use super::access::check_origin;
use crate::search::params::MAX_QUERY_BYTES;
use crate::setting::{InvalidSetting, check_bearer_tokens};

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
    /// Event streams one client (its address, as the rate limit keys it)
    /// may hold open at once; one more is answered 429. 0: no bound but
    /// the node's (`events::MAX_STREAMS`).
    pub max_event_streams_per_client: usize,
    pub shutdown_grace_ms: u64,
    /// Guest requests (search, availability, calendar, events) handled at
    /// once; one more is answered 503 `/problems/overloaded` at once
    /// (`http::admission`). 0: unbounded.
    pub max_guest_requests_in_flight: usize,
    /// The same for the booking service's routes (bypass, take outcomes,
    /// stale reads), a budget of their own. 0: unbounded.
    pub max_booking_requests_in_flight: usize,
    /// Threads that run guest searches and availability, apart from the
    /// server's (`http::guest_threads`). 0: on the server's runtime.
    pub guest_search_threads: usize,
}

/// Above this a budget bounds nothing a machine could run (each request in
/// flight holds a task and a connection), so a larger figure is a typo.
const MAX_IN_FLIGHT_BOUND: usize = 1_000_000;
/// More threads than this is a typo: a thread per core is the intent.
const MAX_GUEST_SEARCH_THREADS: usize = 256;

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

impl HttpSettings {
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        fn invalid(field: &'static str, rule: impl Into<String>) -> InvalidSetting {
            InvalidSetting::new(field, rule)
        }
        if self.listen.parse::<SocketAddr>().is_err() {
            return Err(invalid(
                "http.listen",
                "must be an address like 127.0.0.1:8080",
            ));
        }
        if self.request_timeout_ms == 0 {
            return Err(invalid("http.request_timeout_ms", "must be above 0"));
        }
        if !(256..=MAX_QUERY_BYTES).contains(&self.max_query_bytes) {
            return Err(invalid(
                "http.max_query_bytes",
                "must be between 256 and 65536",
            ));
        }
        if !(1024..=16 * 1024 * 1024).contains(&self.max_body_bytes) {
            return Err(invalid(
                "http.max_body_bytes",
                "must be between 1024 and 16777216",
            ));
        }
        for origin in &self.cors_allowed_origins {
            if check_origin(origin).is_err() {
                return Err(invalid(
                    "http.cors_allowed_origins",
                    "every entry must be `*` or an origin like https://shop.example (scheme, host, optional port; no path)",
                ));
            }
        }
        if self.rate_limit_per_sec > 0 && self.rate_limit_burst == 0 {
            return Err(invalid(
                "http.rate_limit_burst",
                "must be above 0 while http.rate_limit_per_sec is on",
            ));
        }
        if !(1..=10_000_000).contains(&self.rate_limit_max_clients) {
            return Err(invalid(
                "http.rate_limit_max_clients",
                "must be between 1 and 10000000",
            ));
        }
        for (field, value) in [
            (
                "http.max_guest_requests_in_flight",
                self.max_guest_requests_in_flight,
            ),
            (
                "http.max_booking_requests_in_flight",
                self.max_booking_requests_in_flight,
            ),
        ] {
            if value > MAX_IN_FLIGHT_BOUND {
                return Err(invalid(field, "must be between 0 (unbounded) and 1000000"));
            }
        }
        if self.shutdown_grace_ms == 0 {
            return Err(invalid("http.shutdown_grace_ms", "must be above 0"));
        }
        if self.guest_search_threads > MAX_GUEST_SEARCH_THREADS {
            return Err(invalid(
                "http.guest_search_threads",
                "must be between 0 (the server's runtime) and 256",
            ));
        }
        Ok(())
    }
}

impl AdminSettings {
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        check_bearer_tokens("admin.tokens", &self.tokens)
    }
}

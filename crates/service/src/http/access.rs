//! Who may call what, and how often.
//!
//! - Search (`/v1/search`, `/v1/hotels/{id}/availability`, `/v1/bypass`) is
//!   public, limited per client: one token bucket per client address
//!   (`ClientLimiter`, bounded), answered 429 with `Retry-After` when empty.
//! - `POST /v1/take-outcomes` needs a booking service token
//!   (`stale.booking_tokens`), admin actions an admin token (`admin.tokens`);
//!   both are `BearerTokens`, kept as digests, compared in constant time
//!   and never logged.
//! - Browsers may call from the origins in `http.cors_allowed_origins` only.
//!
//! The client is the TCP peer's address; the last `X-Forwarded-For` entry
//! only when `http.trust_forwarded_for` says a proxy in front of `vacancy`
//! writes it (otherwise any caller could pick its own bucket). IPv6 clients
//! are keyed by their /64, the block one subscriber usually holds, so one
//! host cannot walk its own prefix to get fresh buckets.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, HeaderValue, Method, header};
use governor::clock::{Clock, DefaultClock};
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use tower_http::cors::{AllowOrigin, CorsLayer};

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::{AdminSettings, HttpSettings};
use crate::setting::{MIN_BEARER_TOKEN_BYTES, SecretFileError};
use crate::stale::StaleSettings;

/// Where one request comes from, as far as the limiter is concerned.
pub fn client_key(
    peer: Option<&ConnectInfo<SocketAddr>>,
    headers: &HeaderMap,
    trust_forwarded_for: bool,
) -> IpAddr {
    let forwarded = trust_forwarded_for
        .then(|| last_forwarded_for(headers))
        .flatten();
    let ip = forwarded
        .or_else(|| peer.map(|ConnectInfo(addr)| addr.ip()))
        // No peer address (a router served without connect info): all such
        // callers share one bucket rather than escaping the limit.
        .unwrap_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED));
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// The address the nearest proxy appended: the last entry of the last
/// `X-Forwarded-For` header. Entries before it are the client's own claims.
fn last_forwarded_for(headers: &HeaderMap) -> Option<IpAddr> {
    let value = headers.get_all("x-forwarded-for").iter().next_back()?;
    let last = value.to_str().ok()?.rsplit(',').next()?.trim();
    last.parse().ok()
}

type Bucket = RateLimiter<NotKeyed, InMemoryState, DefaultClock>;

/// One client's bucket in the cache, in bytes, for the soak's accounting
/// (`vacancy_cache_estimated_bytes`): the `IpAddr` key, the `Arc<Bucket>`
/// (8) and its allocation (two counts and governor's limiter: its state,
/// quota and clock, rounded up to malloc's 16), and moka's own per-entry
/// cost.
pub const BUCKET_ENTRY_BYTES: u64 = (size_of::<IpAddr>()
    + size_of::<Arc<Bucket>>()
    + (16 + size_of::<Bucket>()).next_multiple_of(16)) as u64
    + crate::metrics::MOKA_ENTRY_OVERHEAD_BYTES;

/// One token bucket per client, in a cache bounded by `max_clients`.
///
/// A bucket idle for as long as it takes to refill is the same as a new one,
/// so the cache forgets it then (`time_to_idle`). Past `max_clients` the
/// cache evicts the least used: under a flood from that many addresses at
/// once, an evicted client starts over with a full bucket, and memory stays
/// bounded either way.
pub struct ClientLimiter {
    buckets: moka::sync::Cache<IpAddr, Arc<Bucket>>,
    quota: Quota,
    /// One clock for every bucket (and for reading their waits).
    clock: DefaultClock,
}

/// A refused request: try again after this long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryAfter(pub Duration);

impl RetryAfter {
    /// Whole seconds for the `Retry-After` header, never 0 (0 invites a
    /// retry that is refused again at once).
    pub fn header_secs(self) -> u64 {
        let rounded_up = self.0.as_secs() + u64::from(self.0.subsec_nanos() > 0);
        rounded_up.max(1)
    }
}

impl ClientLimiter {
    /// `None` when `per_sec` is 0: the limit is off.
    pub fn new(per_sec: u32, burst: u32, max_clients: usize) -> Option<ClientLimiter> {
        let per_sec = NonZeroU32::new(per_sec)?;
        let burst = NonZeroU32::new(burst).unwrap_or(per_sec);
        Some(Self::with_quota(
            Quota::per_second(per_sec).allow_burst(burst),
            max_clients,
        ))
    }

    fn with_quota(quota: Quota, max_clients: usize) -> ClientLimiter {
        // The time an empty bucket takes to fill again, plus a second.
        let refill = quota
            .replenish_interval()
            .saturating_mul(quota.burst_size().get())
            .saturating_add(Duration::from_secs(1));
        ClientLimiter {
            buckets: moka::sync::Cache::builder()
                .max_capacity(max_clients.max(1) as u64)
                .time_to_idle(refill)
                // Full, the least recently seen client goes: moka's default
                // (TinyLFU) admits a new key only if seen more often than
                // the one it would evict, so with the map full of busy
                // clients every new one got a fresh bucket per request and
                // was never limited.
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .build(),
            quota,
            clock: DefaultClock::default(),
        }
    }

    /// Takes one request from `client`'s bucket.
    pub fn check(&self, client: IpAddr) -> Result<(), RetryAfter> {
        let bucket = self.buckets.get_with(client, || {
            Arc::new(RateLimiter::direct_with_clock(
                self.quota,
                self.clock.clone(),
            ))
        });
        bucket
            .check()
            .map_err(|not_until| RetryAfter(not_until.wait_time_from(self.clock.now())))
    }

    /// Clients with a bucket now. moka's count trails inserts and
    /// evictions until its pending maintenance runs, so that runs first.
    pub fn entries(&self) -> u64 {
        self.buckets.run_pending_tasks();
        self.buckets.entry_count()
    }

    /// Clients with a bucket right now (after pending evictions).
    #[cfg(test)]
    fn clients(&self) -> u64 {
        self.buckets.run_pending_tasks();
        self.buckets.entry_count()
    }
}

/// Invalid `http.cors_allowed_origins` entries, named.
#[derive(Debug, thiserror::Error)]
#[error("http.cors_allowed_origins: {origin:?} is not an origin like https://example.com")]
pub struct CorsError {
    pub origin: String,
}

/// Checks one configured origin: `*`, or `scheme://host[:port]` with nothing after.
pub fn check_origin(origin: &str) -> Result<HeaderValue, CorsError> {
    let bad = || CorsError {
        origin: origin.chars().take(80).collect(),
    };
    if origin == "*" {
        return Ok(HeaderValue::from_static("*"));
    }
    let rest = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"))
        .ok_or_else(bad)?;
    let host_ok = !rest.is_empty()
        && rest
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'));
    if !host_ok {
        return Err(bad());
    }
    HeaderValue::from_str(origin).map_err(|_| bad())
}

/// The CORS policy, or `None` when no origin is allowed (browsers then get
/// no `Access-Control-Allow-Origin` and refuse cross-origin reads).
pub fn cors_layer(http: &HttpSettings) -> Result<Option<CorsLayer>, CorsError> {
    if http.cors_allowed_origins.is_empty() {
        return Ok(None);
    }
    let origins = http
        .cors_allowed_origins
        .iter()
        .map(|o| check_origin(o))
        .collect::<Result<Vec<_>, _>>()?;
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE])
            .expose_headers([
                header::RETRY_AFTER,
                header::HeaderName::from_static("vacancy-lsn"),
            ])
            .max_age(Duration::from_secs(600)),
    ))
}

/// Bearer tokens (the booking service's, the admins'), kept as SHA-256
/// digests: comparing digests in constant time hides the tokens' lengths and
/// contents alike.
pub struct BearerTokens {
    digests: Vec<[u8; 32]>,
}

impl std::fmt::Debug for BearerTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BearerTokens({} configured)", self.digests.len())
    }
}

impl BearerTokens {
    pub fn new<'a>(tokens: impl IntoIterator<Item = &'a str>) -> BearerTokens {
        BearerTokens {
            digests: tokens
                .into_iter()
                .map(|t| Sha256::digest(t.as_bytes()).into())
                .collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// Whether an `Authorization` header value carries one of the tokens.
    /// Every configured token is compared, with no early exit.
    pub fn allows(&self, authorization: Option<&[u8]>) -> bool {
        let Some(value) = authorization else {
            return false;
        };
        let Some(presented) = value
            .strip_prefix(b"Bearer ")
            .or_else(|| value.strip_prefix(b"bearer "))
        else {
            return false;
        };
        let presented: [u8; 32] = Sha256::digest(presented).into();
        let mut ok = subtle::Choice::from(0);
        for d in &self.digests {
            ok |= d.ct_eq(&presented);
        }
        bool::from(ok)
    }
}

/// Most tokens one file may list; more is a mistake, not a deployment.
const MAX_TOKENS_PER_FILE: usize = 64;

/// The booking service's tokens, from `stale.booking_tokens` and
/// `stale.booking_tokens_file`.
pub fn booking_tokens(stale: &StaleSettings) -> Result<BearerTokens, SecretFileError> {
    let from_file = load_tokens("stale.booking_tokens_file", &stale.booking_tokens_file)?;
    let tokens = BearerTokens::new(
        stale
            .booking_tokens
            .iter()
            .map(String::as_str)
            .chain(from_file.iter().map(String::as_str)),
    );
    if tokens.is_empty() {
        tracing::warn!("no stale.booking_tokens: POST /v1/take-outcomes answers 401 to every call");
    }
    Ok(tokens)
}

/// Admin tokens from `admin.tokens` and `admin.tokens_file`.
pub fn admin_tokens(admin: &AdminSettings) -> Result<BearerTokens, SecretFileError> {
    let from_file = load_tokens("admin.tokens_file", &admin.tokens_file)?;
    let tokens = BearerTokens::new(
        admin
            .tokens
            .iter()
            .map(String::as_str)
            .chain(from_file.iter().map(String::as_str)),
    );
    if tokens.is_empty() {
        tracing::info!("no admin.tokens: admin actions answer 401 to every call");
    }
    Ok(tokens)
}

/// Bearer tokens from a file: one per line; blank lines and `#` comments
/// skipped. `field` names the setting in errors (booking or admin tokens).
/// The file is read at startup, so a bad one stops the start, naming it.
fn load_tokens(field: &'static str, file: &str) -> Result<Vec<String>, SecretFileError> {
    if file.is_empty() {
        return Ok(Vec::new());
    }
    let text =
        std::fs::read_to_string(Path::new(file)).map_err(|source| SecretFileError::Read {
            field,
            path: PathBuf::from(file),
            source,
        })?;
    let tokens: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    if tokens.len() > MAX_TOKENS_PER_FILE {
        return Err(SecretFileError::Invalid {
            field,
            rule: format!("at most {MAX_TOKENS_PER_FILE} tokens"),
        });
    }
    if tokens.iter().any(|t| t.len() < MIN_BEARER_TOKEN_BYTES) {
        return Err(SecretFileError::Invalid {
            field,
            rule: format!("every token must be at least {MIN_BEARER_TOKEN_BYTES} bytes"),
        });
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_match_exactly() {
        let t = BearerTokens::new(["first-token-0123456789", "second-token-0123456789"]);
        assert!(t.allows(Some(b"Bearer second-token-0123456789")));
        assert!(t.allows(Some(b"Bearer first-token-0123456789")));
        assert!(!t.allows(Some(b"Bearer first-token-012345678")));
        assert!(!t.allows(Some(b"Bearer first-token-0123456789 ")));
        assert!(!t.allows(Some(b"Basic first-token-0123456789")));
        assert!(!t.allows(Some(b"first-token-0123456789")));
        assert!(!t.allows(None));
        assert!(!BearerTokens::new([]).allows(Some(b"Bearer ")));
    }

    #[test]
    fn tokens_load_from_files() {
        let dir = tempfile::tempdir().unwrap();
        let tokens = dir.path().join("tokens");
        std::fs::write(
            &tokens,
            "# booking service\nabcdefghijklmnop\n\n  qrstuvwxyz0123456 \n",
        )
        .unwrap();
        assert_eq!(
            load_tokens("stale.booking_tokens_file", tokens.to_str().unwrap()).unwrap(),
            vec!["abcdefghijklmnop", "qrstuvwxyz0123456"]
        );
        std::fs::write(&tokens, "tooshort\n").unwrap();
        assert!(load_tokens("stale.booking_tokens_file", tokens.to_str().unwrap()).is_err());
        assert!(load_tokens("admin.tokens_file", "/nonexistent/tokens").is_err());
    }

    fn peer(addr: &str) -> ConnectInfo<SocketAddr> {
        ConnectInfo(addr.parse().unwrap())
    }

    fn forwarded(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-forwarded-for", HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn the_peer_is_the_client_unless_a_proxy_is_trusted() {
        let p = peer("10.0.0.9:5000");
        let h = forwarded(&["1.2.3.4, 5.6.7.8"]);
        assert_eq!(
            client_key(Some(&p), &h, false),
            "10.0.0.9".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            client_key(Some(&p), &h, true),
            "5.6.7.8".parse::<IpAddr>().unwrap()
        );
        let h = forwarded(&["1.2.3.4", "9.9.9.9"]);
        assert_eq!(
            client_key(Some(&p), &h, true),
            "9.9.9.9".parse::<IpAddr>().unwrap()
        );
        // A header that is not an address falls back to the peer.
        let h = forwarded(&["nonsense"]);
        assert_eq!(
            client_key(Some(&p), &h, true),
            "10.0.0.9".parse::<IpAddr>().unwrap()
        );
    }

    #[test]
    fn ipv6_clients_share_their_64_and_mapped_v4_is_v4() {
        let h = HeaderMap::new();
        let a = client_key(Some(&peer("[2001:db8:1:2:aaaa::1]:1")), &h, false);
        let b = client_key(Some(&peer("[2001:db8:1:2:bbbb::7]:1")), &h, false);
        let c = client_key(Some(&peer("[2001:db8:1:3::1]:1")), &h, false);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let m = client_key(Some(&peer("[::ffff:10.1.2.3]:1")), &h, false);
        assert_eq!(m, "10.1.2.3".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn a_client_past_its_burst_is_refused_with_a_wait_others_are_not() {
        // Refilled once an hour: the burst cannot refill while the test runs.
        let quota = Quota::with_period(Duration::from_secs(3600))
            .unwrap()
            .allow_burst(NonZeroU32::new(3).unwrap());
        let l = ClientLimiter::with_quota(quota, 100);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        for _ in 0..3 {
            assert!(l.check(a).is_ok());
        }
        let wait = l.check(a).unwrap_err();
        assert!(wait.0 <= Duration::from_secs(3600), "{wait:?}");
        assert!(wait.header_secs() >= 1);
        assert!(l.check(b).is_ok());
        assert!(ClientLimiter::new(0, 10, 100).is_none(), "0 turns it off");
        assert!(ClientLimiter::new(5, 10, 100).is_some());
    }

    #[test]
    fn the_client_map_stays_bounded() {
        let quota = Quota::with_period(Duration::from_secs(3600))
            .unwrap()
            .allow_burst(NonZeroU32::new(2).unwrap());
        let l = ClientLimiter::with_quota(quota, 10);
        for i in 0..200u8 {
            let ip = IpAddr::from([10, 0, 1, i]);
            assert!(l.check(ip).is_ok(), "a new client has a full bucket");
        }
        assert!(l.clients() <= 10, "{} clients kept", l.clients());
    }

    /// A map full of busy clients still limits a new one.
    #[test]
    fn a_new_client_is_limited_when_the_map_is_full_of_busy_ones() {
        let quota = Quota::with_period(Duration::from_secs(3600))
            .unwrap()
            .allow_burst(NonZeroU32::new(20).unwrap());
        let l = ClientLimiter::with_quota(quota, 10);
        for i in 0..10u8 {
            for _ in 0..15 {
                let _ = l.check(IpAddr::from([10, 0, 2, i]));
            }
        }
        l.buckets.run_pending_tasks();
        let newcomer = IpAddr::from([10, 0, 3, 1]);
        let refused = (0..25)
            .filter(|_| {
                let refused = l.check(newcomer).is_err();
                l.buckets.run_pending_tasks();
                refused
            })
            .count();
        assert_eq!(refused, 5, "a burst of 20, then refused");
    }

    #[test]
    fn retry_after_is_whole_seconds_and_never_zero() {
        assert_eq!(RetryAfter(Duration::ZERO).header_secs(), 1);
        assert_eq!(RetryAfter(Duration::from_millis(1)).header_secs(), 1);
        assert_eq!(RetryAfter(Duration::from_secs(2)).header_secs(), 2);
        assert_eq!(RetryAfter(Duration::from_millis(2001)).header_secs(), 3);
    }

    #[test]
    fn origins_are_checked() {
        assert!(check_origin("https://shop.example").is_ok());
        assert!(check_origin("http://localhost:3000").is_ok());
        assert!(check_origin("*").is_ok());
        for bad in [
            "shop.example",
            "https://",
            "https://shop.example/path",
            "ftp://x",
            "https://a b",
        ] {
            assert!(check_origin(bad).is_err(), "{bad}");
        }
    }
}

//! The stale-read loop: measure how often the copy showed a unit the owner
//! then refused, and read the owner where a stale count would mislead.
//!
//! In data-flow order:
//! - [`token`]: every room type search shows carries a signed quote of what
//!   it showed (numbers, LSN, lag, copy or owner).
//! - [`outcomes`]: the booking service reports each take with that quote
//!   (`POST /v1/take-outcomes`); the ledger counts each attempt once.
//! - [`window`]: the sliding window the ledger counts into, overall and per
//!   hotel (`GET /v1/stale-reads`).
//! - [`bypass`]: the policy that says when to read the owner instead
//!   (`GET /v1/bypass`, and search for hotels that keep producing stale reads).
//! - [`audit`]: a background comparison of sampled rows with the owner.
//!
//! Architecture invariant: nothing here writes the model or the owner; the
//! owner is only read (search's bypass reads, the audit).

pub mod audit;
pub mod bypass;
pub mod outcomes;
pub mod token;
pub mod window;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use chrono::Utc;
use serde::Serialize;

use crate::config::Settings;
use crate::metrics;
use crate::model::Stay;
use crate::model::{CalendarKey, ReadModel};
use crate::stream::StreamStatus;
use audit::{Audit, AuditSettings, AuditStatus};
use bypass::{Advice, Inputs, Policy};
use outcomes::{BearerTokens, Ledger, LedgerSettings, Totals};
use token::{MIN_KEY_BYTES, QuoteKey};

/// Shortest bearer token accepted from a file (the config's are validated there).
pub const MIN_BOOKING_TOKEN_BYTES: usize = 16;
/// Most tokens one file may list; more is a mistake, not a deployment.
const MAX_BOOKING_TOKENS: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum StaleError {
    #[error("cannot read {field} {path}: {source}")]
    File {
        field: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{field}: {rule}")]
    Invalid { field: &'static str, rule: String },
}

/// Everything the loop shares between the API, search and the audit task.
pub struct StaleLoop {
    pub key: QuoteKey,
    pub ledger: Ledger,
    pub tokens: BearerTokens,
    pub policy: Policy,
    pub audit: Arc<Audit>,
    pub top_hotels: usize,
    pub max_body_bytes: usize,
    model: Arc<ReadModel>,
    status: Arc<StreamStatus>,
}

/// One question to `GET /v1/bypass`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BypassQuestion {
    pub key: CalendarKey,
    pub stay: Stay,
    pub rooms: i32,
}

/// The answer of `GET /v1/stale-reads`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct StaleReadsBody {
    pub window_secs: u64,
    /// Takes the owner answered (taken or conflict) within the window.
    pub takes: u64,
    pub conflicts: u64,
    /// Conflicts after the copy showed enough units free.
    pub stale_reads: u64,
    pub errors: u64,
    /// stale_reads / takes over the window, 0 to 1.
    pub share: f64,
    /// Takes of hotels not tracked because of `stale.max_hotels`.
    pub untracked_takes: u64,
    /// Hotels listed need at least this many takes in the window.
    pub hotel_min_takes: u64,
    pub hotels: Vec<HotelStaleReads>,
    /// Since start, not windowed.
    pub totals: Totals,
    pub audit: AuditStatus,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct HotelStaleReads {
    pub hotel_id: i64,
    pub takes: u64,
    pub conflicts: u64,
    pub stale_reads: u64,
    pub share: f64,
    /// The policy reads this hotel from the owner in search right now.
    pub bypassed: bool,
}

impl StaleLoop {
    pub fn new(
        settings: &Settings,
        model: Arc<ReadModel>,
        status: Arc<StreamStatus>,
    ) -> Result<StaleLoop, StaleError> {
        let s = &settings.stale;
        let key = match load_key(&s.quote_key, &s.quote_key_file)? {
            Some(bytes) => QuoteKey::new(&bytes),
            None => {
                tracing::warn!(
                    "no stale.quote_key or stale.quote_key_file: quotes are signed with a random key \
                     and verify only in this process (set one for restarts and replicas)"
                );
                QuoteKey::random()
            }
        };
        let file_tokens = load_tokens("stale.booking_tokens_file", &s.booking_tokens_file)?;
        let tokens = BearerTokens::new(
            s.booking_tokens
                .iter()
                .map(String::as_str)
                .chain(file_tokens.iter().map(String::as_str)),
        );
        if tokens.is_empty() {
            tracing::warn!(
                "no stale.booking_tokens: POST /v1/take-outcomes answers 401 to every call"
            );
        }
        let width = Duration::from_millis(s.window_secs * 1000 / u64::from(s.window_buckets));
        let audit = Audit::new(
            AuditSettings {
                owner: settings.owner.clone(),
                schema: settings.stream.schema.clone(),
                connect_timeout: settings.connect_timeout(),
                query_timeout: settings.query_timeout(),
                sample: s.audit_sample,
                wait: Duration::from_millis(s.audit_wait_ms),
                interval: Duration::from_millis(s.audit_interval_ms),
            },
            model.clone(),
            status.clone(),
        );
        Ok(StaleLoop {
            key,
            ledger: Ledger::new(&LedgerSettings {
                attempt_capacity: s.attempt_capacity,
                attempt_ttl: Duration::from_secs(s.attempt_ttl_secs),
                bucket_width: width,
                buckets: s.window_buckets as usize,
                max_hotels: s.max_hotels,
            }),
            tokens,
            policy: Policy {
                few_units_threshold: settings.search.few_units_threshold,
                max_lag_ms: s.bypass_max_lag_ms,
                hotel_share_bound: s.hotel_share_bound,
                hotel_min_takes: s.hotel_min_takes,
            },
            audit: Arc::new(audit),
            top_hotels: s.top_hotels,
            max_body_bytes: s.max_body_bytes,
            model,
            status,
        })
    }

    /// The hotels among `ids` that search should read from the owner now.
    pub fn bypassed_hotels(
        &self,
        ids: impl Iterator<Item = i64>,
    ) -> std::collections::HashSet<i64> {
        self.ledger
            .hotels_where(ids, |c| self.policy.hotel_flagged(c))
    }

    fn ready(&self) -> bool {
        self.model.freshness.is_loaded() && !self.status.resnapshotting.load(Ordering::Acquire)
    }

    /// The advice for one take, from the copy under one read lock.
    pub fn advise(&self, q: &BypassQuestion) -> Advice {
        let ready = self.ready();
        let lag_ms = self.model.freshness.lag_ms(Utc::now());
        let (free_units, lsn) = {
            let t = self.model.read();
            let calendar = t.calendars.get(&q.key);
            let mut min: Option<i32> = None;
            let mut missing = calendar.is_none() || !t.room_types.contains_key(&q.key);
            for night in q.stay.nights() {
                match calendar.and_then(|c| c.get(night)) {
                    Some(n) => min = Some(min.map_or(n.free(), |m| m.min(n.free()))),
                    None => missing = true,
                }
            }
            ((!missing && ready).then_some(min).flatten(), t.applied)
        };
        let reasons = self.policy.reasons(&Inputs {
            ready,
            lag_ms,
            free_units,
            rooms: q.rooms,
            hotel: self.ledger.hotel(q.key.hotel_id),
        });
        if reasons.is_empty() {
            metrics::BYPASS_ADVICE.with_label_values(&["none"]).inc();
        }
        for r in &reasons {
            metrics::BYPASS_ADVICE.with_label_values(&[r.label()]).inc();
        }
        Advice {
            bypass: !reasons.is_empty(),
            reasons,
            free_units,
            lag_ms,
            lsn,
        }
    }

    pub fn stale_reads(&self) -> StaleReadsBody {
        let overall = self.ledger.overall();
        let hotels = self
            .ledger
            .top(self.policy.hotel_min_takes, self.top_hotels)
            .into_iter()
            .map(|h| HotelStaleReads {
                hotel_id: h.hotel_id,
                takes: h.counts.takes,
                conflicts: h.counts.conflicts,
                stale_reads: h.counts.stale,
                share: h.counts.share(),
                bypassed: self.policy.hotel_flagged(&h.counts),
            })
            .collect();
        StaleReadsBody {
            window_secs: self.ledger.span().as_secs(),
            takes: overall.takes,
            conflicts: overall.conflicts,
            stale_reads: overall.stale,
            errors: overall.errors,
            share: overall.share(),
            untracked_takes: self.ledger.untracked(),
            hotel_min_takes: self.policy.hotel_min_takes,
            hotels,
            totals: self.ledger.totals(),
            audit: self.audit.status(),
        }
    }
}

/// The quote key: from the setting, or from a file (trailing newline
/// dropped); `None` when neither is set.
fn load_key(inline: &str, file: &str) -> Result<Option<Vec<u8>>, StaleError> {
    let bytes = if !file.is_empty() {
        let mut bytes = std::fs::read(file).map_err(|source| StaleError::File {
            field: "stale.quote_key_file",
            path: PathBuf::from(file),
            source,
        })?;
        while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            bytes.pop();
        }
        if bytes.len() < MIN_KEY_BYTES {
            return Err(StaleError::Invalid {
                field: "stale.quote_key_file",
                rule: format!("the key must be at least {MIN_KEY_BYTES} bytes"),
            });
        }
        bytes
    } else if !inline.is_empty() {
        inline.as_bytes().to_vec()
    } else {
        return Ok(None);
    };
    Ok(Some(bytes))
}

/// Bearer tokens from a file: one per line; blank lines and `#` comments
/// skipped. `field` names the setting in errors (booking or admin tokens).
pub(crate) fn load_tokens(field: &'static str, file: &str) -> Result<Vec<String>, StaleError> {
    if file.is_empty() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(Path::new(file)).map_err(|source| StaleError::File {
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
    if tokens.len() > MAX_BOOKING_TOKENS {
        return Err(StaleError::Invalid {
            field,
            rule: format!("at most {MAX_BOOKING_TOKENS} tokens"),
        });
    }
    if tokens.iter().any(|t| t.len() < MIN_BOOKING_TOKEN_BYTES) {
        return Err(StaleError::Invalid {
            field,
            rule: format!("every token must be at least {MIN_BOOKING_TOKEN_BYTES} bytes"),
        });
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_and_tokens_load_from_files() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, "k".repeat(40) + "\n").unwrap();
        let got = load_key("", key.to_str().unwrap()).unwrap().unwrap();
        assert_eq!(got, "k".repeat(40).into_bytes(), "newline dropped");
        std::fs::write(&key, "short\n").unwrap();
        assert!(load_key("", key.to_str().unwrap()).is_err());
        assert!(load_key("", "/nonexistent/key").is_err());
        assert_eq!(load_key("", "").unwrap(), None);

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
    }
}

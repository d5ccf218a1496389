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
mod settings;
pub mod token;
pub mod window;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use chrono::Utc;
use serde::Serialize;

use crate::metrics;
use crate::model::Stay;
use crate::model::{CalendarKey, ReadModel};
use crate::owner::OwnerSettings;
use crate::setting::SecretFileError;
use crate::stream::{StreamSettings, StreamStatus};
use audit::{Audit, AuditSettings, AuditStatus};
use bypass::{Advice, Inputs, Policy};
use outcomes::{Ledger, LedgerSettings, Totals};
pub use settings::StaleSettings;
use token::{MIN_KEY_BYTES, QuoteKey};

/// The stale-read loop's shared state: the quote key, the ledger, the
/// bypass policy and the audit, read by the API, search and the audit task.
pub struct StaleReadState {
    pub key: QuoteKey,
    pub ledger: Ledger,
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
    /// Takes the owner refused (409) within the window, whatever was shown.
    pub conflicts: u64,
    /// Stale reads: 409s after the copy showed at least the units asked for
    /// (the `source="copy"` part of
    /// `vacancy_conflicts_after_shown_available_total`).
    pub stale_reads: u64,
    /// Takes that failed for another reason (not in `takes`).
    pub errors: u64,
    /// The stale-read share: stale_reads / takes over the window, 0 to 1
    /// (`vacancy_stale_read_share_ratio`). 409s after an owner read are not
    /// in it; `totals.conflicts_by_source` has them.
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

impl StaleReadState {
    pub fn new(
        s: &StaleSettings,
        owner: &OwnerSettings,
        stream: &StreamSettings,
        few_units_threshold: i32,
        model: Arc<ReadModel>,
        status: Arc<StreamStatus>,
    ) -> Result<StaleReadState, SecretFileError> {
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
        let width = Duration::from_millis(s.window_secs * 1000 / u64::from(s.window_buckets));
        let audit = Audit::new(
            AuditSettings {
                owner: owner.clone(),
                schema: stream.schema.clone(),
                connect_timeout: owner.connect_timeout(),
                query_timeout: owner.query_timeout(),
                sample: s.audit_sample,
                wait: Duration::from_millis(s.audit_wait_ms),
                interval: Duration::from_millis(s.audit_interval_ms),
                diverging_for: Duration::from_secs(s.window_secs),
            },
            model.clone(),
            status.clone(),
        );
        Ok(StaleReadState {
            key,
            ledger: Ledger::new(&LedgerSettings {
                attempt_capacity: s.attempt_capacity,
                attempt_ttl: Duration::from_secs(s.attempt_ttl_secs),
                bucket_width: width,
                buckets: s.window_buckets as usize,
                max_hotels: s.max_hotels,
            }),
            policy: Policy {
                few_units_threshold,
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

    /// The hotels among `ids` that search should read from the owner now:
    /// those with a stale share past the bound (stale reads only: conflicts
    /// after unconfirmed copy numbers) and those the audit found diverging.
    pub fn bypassed_hotels(
        &self,
        ids: impl Iterator<Item = i64> + Clone,
    ) -> std::collections::HashSet<i64> {
        let mut flagged = self
            .ledger
            .hotels_where(ids.clone(), |c| self.policy.hotel_flagged(c));
        flagged.extend(self.audit.diverging_hotels(ids));
        flagged
    }

    fn ready(&self) -> bool {
        self.model.freshness.is_loaded() && !self.status.resnapshotting.load(Ordering::Acquire)
    }

    /// The advice for one take, from one published copy.
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
            diverging: !self
                .audit
                .diverging_hotels(std::iter::once(q.key.hotel_id))
                .is_empty(),
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
                bypassed: self.policy.hotel_flagged(&h.counts)
                    || !self
                        .audit
                        .diverging_hotels(std::iter::once(h.hotel_id))
                        .is_empty(),
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
fn load_key(inline: &str, file: &str) -> Result<Option<Vec<u8>>, SecretFileError> {
    let bytes = if !file.is_empty() {
        let mut bytes = std::fs::read(file).map_err(|source| SecretFileError::Read {
            field: "stale.quote_key_file",
            path: PathBuf::from(file),
            source,
        })?;
        while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            bytes.pop();
        }
        if bytes.len() < MIN_KEY_BYTES {
            return Err(SecretFileError::Invalid {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quote_key_loads_from_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, "k".repeat(40) + "\n").unwrap();
        let got = load_key("", key.to_str().unwrap()).unwrap().unwrap();
        assert_eq!(got, "k".repeat(40).into_bytes(), "newline dropped");
        std::fs::write(&key, "short\n").unwrap();
        assert!(load_key("", key.to_str().unwrap()).is_err());
        assert!(load_key("", "/nonexistent/key").is_err());
        assert_eq!(load_key("", "").unwrap(), None);
    }
}

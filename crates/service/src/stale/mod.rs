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
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::checkpoint::StaleCarry;
use crate::metrics;
use crate::model::Stay;
use crate::model::{CalendarKey, ReadModel};
use crate::owner::OwnerSettings;
use crate::setting::SecretFileError;
use crate::stream::StreamSettings;
use audit::{Audit, AuditSettings, AuditStatus};
use bypass::{Advice, Inputs, Policy};
use outcomes::{Ledger, LedgerSettings, Restored, Totals};
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
    /// Since start (carried over a restart by a checkpoint), not windowed.
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
        );
        Ok(StaleReadState {
            key,
            ledger: Ledger::new(&LedgerSettings {
                attempt_capacity: s.attempt_capacity,
                attempt_ttl: Duration::from_secs(s.attempt_ttl_secs),
                bucket_width: width,
                buckets: s.window_buckets as usize,
                max_hotels: s.max_hotels,
                max_quote_age: (s.max_quote_age_secs > 0)
                    .then(|| Duration::from_secs(s.max_quote_age_secs)),
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
        })
    }

    /// The fleet shares this loop: the ledger counts what the fleet's
    /// outcome stream delivers (`fleet::outcomes`), never a report posted
    /// here directly. Call before the state is shared with any task.
    pub fn shared_by_fleet(self) -> StaleReadState {
        StaleReadState {
            ledger: self.ledger.shared(),
            ..self
        }
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
        self.model.freshness.is_loaded() && !self.model.freshness.is_replacing()
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

    /// What a checkpoint carries of the loop (its window, the attempt ids
    /// it counted, its totals), measured now. Take it just before
    /// `checkpoint::write_model`, which dates it with the header's
    /// `written_at`.
    pub fn carry(&self) -> StaleCarry {
        self.ledger.carry(Instant::now())
    }

    /// Restores what a checkpoint carried (`checkpoint::Loaded::stale`),
    /// written at `written_at` (`Loaded::header.written_at()`), as of
    /// `now`: the downtime between them ages every bucket and id, and what
    /// ran out meanwhile is dropped. Call it once at start, after the load
    /// and before the API takes reports: a report counted before it would
    /// count again if it had been counted before the restart. A clock that
    /// went back since the write counts as no downtime.
    pub fn restore(
        &self,
        carry: StaleCarry,
        written_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Restored {
        let downtime = (now - written_at).to_std().unwrap_or(Duration::ZERO);
        self.ledger.restore(carry, downtime, Instant::now())
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

/// What checkpoints carry of the stale-read loop across a restart.
impl crate::stream::checkpoints::Carried for StaleReadState {
    fn carry(&self) -> StaleCarry {
        StaleReadState::carry(self)
    }

    fn restore(&self, carry: StaleCarry, written_at: DateTime<Utc>, now: DateTime<Utc>) {
        let restored = StaleReadState::restore(self, carry, written_at, now);
        match restored.ignored {
            Some(why) => tracing::info!(why, "stale-read state of the checkpoint not restored"),
            None => tracing::info!(?restored, "stale-read state restored from the checkpoint"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{self, Identity};
    use crate::lsn::Lsn;
    use crate::model::Source;
    use crate::model::Tables;
    use crate::model::xids::RingContents;
    use chrono::NaiveDate;
    use outcomes::{Outcome, Recording, ReportError, TakeOutcomeBody, TakeReport};
    use token::Quote;

    /// A loop made from `config/default.toml` (not through `crate::config`,
    /// which depends on this module), with a fixed quote key so two of them
    /// stand for one service before and after a restart; every hotel with
    /// a take is listed.
    fn state() -> StaleReadState {
        use figment::Figment;
        use figment::providers::{Format, Toml};
        let defaults = Figment::from(Toml::string(include_str!(
            "../../../../config/default.toml"
        )));
        let mut stale: StaleSettings = defaults.extract_inner("stale").unwrap();
        stale.quote_key = "k".repeat(40);
        stale.hotel_min_takes = 1;
        let owner: OwnerSettings = defaults.extract_inner("owner").unwrap();
        let stream: StreamSettings = defaults.extract_inner("stream").unwrap();
        StaleReadState::new(&stale, &owner, &stream, 2, ReadModel::new()).unwrap()
    }

    fn report(key: &QuoteKey, attempt: usize, source: Source, outcome: Outcome) -> TakeReport {
        let check_in = NaiveDate::from_ymd_opt(2030, 3, 1).unwrap();
        let check_out = NaiveDate::from_ymd_opt(2030, 3, 3).unwrap();
        let hotel_id = attempt as i64 % 5;
        let quote = Quote {
            source,
            hotel_id,
            room_type_id: 10,
            check_in,
            check_out,
            free_units: 2,
            lsn: Lsn(99),
            shown_at: DateTime::from_timestamp_millis(1_900_000_000_000).unwrap(),
            lag_ms: 40,
        };
        TakeOutcomeBody {
            attempt_id: Some(format!("attempt-{attempt}")),
            quote: Some(key.sign(&quote).unwrap()),
            hotel_id: Some(hotel_id),
            room_type_id: Some(10),
            check_in: Some(check_in),
            check_out: Some(check_out),
            rooms: Some(1),
            outcome: Some(outcome),
            commit_lsn: None,
        }
        .check(key)
        .unwrap()
    }

    /// 24 reports over 5 hotels: conflicts after copy and owner numbers
    /// (stale reads and races), takes and errors; each counted once.
    fn reports(state: &StaleReadState) -> Vec<TakeReport> {
        (0..24)
            .map(|i| {
                let outcome = match i % 4 {
                    0 | 1 => Outcome::Conflict,
                    2 => Outcome::Taken,
                    _ => Outcome::Error,
                };
                let source = if i % 3 == 0 {
                    Source::Owner
                } else {
                    Source::Copy
                };
                let r = report(&state.key, i, source, outcome);
                assert!(matches!(state.ledger.record(&r), Ok(Recording::New(_))));
                r
            })
            .collect()
    }

    fn identity() -> Identity {
        Identity {
            system_identifier: 1,
            timeline: 1,
            slot: "vacancy".to_string(),
            publication: "vacancy".to_string(),
            columns_fingerprint: vec![1],
        }
    }

    /// `/v1/stale-reads` as the API serialises it.
    fn body(state: &StaleReadState) -> serde_json::Value {
        serde_json::to_value(state.stale_reads()).unwrap()
    }

    /// Export, write, load, restore: the next process answers
    /// `/v1/stale-reads` the same; a report posted before the restart
    /// counts once when posted again after it, and another report under
    /// its id is still refused.
    #[test]
    fn stale_reads_survive_a_checkpoint() {
        let before = state();
        let sent = reports(&before);
        assert!(matches!(
            before.ledger.record(&sent[0]),
            Ok(Recording::Replay(_))
        ));
        let dir = tempfile::tempdir().unwrap();
        let written = checkpoint::write(
            dir.path(),
            &identity(),
            &Tables::default(),
            &RingContents::default(),
            &[],
            &before.carry(),
        )
        .unwrap();
        let loaded = checkpoint::load(&written.path, &identity()).unwrap();
        let after = state();
        let restored = after.restore(
            loaded.stale,
            loaded.header.written_at().unwrap(),
            Utc::now(),
        );
        assert_eq!((restored.attempts, restored.attempts_expired), (24, 0));
        assert_eq!(restored.buckets_expired, 0);
        let shown = body(&before);
        assert_eq!(shown["stale_reads"], 8, "conflicts after copy numbers");
        assert_eq!(shown["hotels"].as_array().unwrap().len(), 5);
        assert_eq!(body(&after), shown);

        // The booking service retries a report it sent before the restart.
        let stale_read = &sent[5];
        assert!(stale_read.stale_read());
        match after.ledger.record(stale_read) {
            Ok(Recording::Replay(answer)) => assert!(answer.stale_read),
            other => panic!("a retry after the restart: {other:?}"),
        }
        let mut changed = stale_read.clone();
        changed.outcome = Outcome::Taken;
        assert_eq!(
            after.ledger.record(&changed),
            Err(ReportError::AttemptReused)
        );
        let mut counted_once = shown.clone();
        counted_once["totals"]["replays"] = 2.into();
        assert_eq!(body(&after), counted_once);
        // A new attempt still counts.
        let new = report(&after.key, 99, Source::Copy, Outcome::Taken);
        assert!(matches!(after.ledger.record(&new), Ok(Recording::New(_))));
        assert_eq!(after.stale_reads().takes, before.stale_reads().takes + 1);
    }

    /// A downtime longer than the window drops every bucket (the totals,
    /// which are not windowed, stay); ids are dropped only once their own
    /// time ran out, and a report is then counted as new.
    #[test]
    fn a_downtime_longer_than_the_window_drops_its_buckets() {
        let before = state();
        let sent = reports(&before);
        let carry = before.carry();
        assert!(!carry.buckets.is_empty());
        let now = Utc::now();
        let window = chrono::Duration::from_std(before.ledger.span()).unwrap();

        let after = state();
        let restored = after.restore(
            carry.clone(),
            now - window - chrono::Duration::seconds(1),
            now,
        );
        assert_eq!(restored.buckets, 0);
        assert_eq!(restored.buckets_expired, carry.buckets.len());
        let figures = after.stale_reads();
        assert_eq!(
            (figures.takes, figures.stale_reads, figures.errors),
            (0, 0, 0)
        );
        assert!(figures.hotels.is_empty());
        assert_eq!(figures.totals, before.stale_reads().totals);
        // A day's ids outlive a five-minute window: still counted once.
        assert_eq!(restored.attempts, sent.len());
        assert!(matches!(
            after.ledger.record(&sent[1]),
            Ok(Recording::Replay(_))
        ));
        assert_eq!(after.stale_reads().takes, 0);

        // Past the ids' own time (a day by default), they are gone too.
        let days_later = state();
        let restored = days_later.restore(carry, now - chrono::Duration::days(2), now);
        assert_eq!(
            (restored.attempts, restored.attempts_expired),
            (0, sent.len())
        );
        assert!(matches!(
            days_later.ledger.record(&sent[1]),
            Ok(Recording::New(_))
        ));
        assert_eq!(days_later.stale_reads().takes, 1);
    }

    /// Two fleet nodes read one outcome stream; the second starts from a
    /// checkpoint the first wrote half-way, and reads on after the
    /// sequence in it. Both answer `/v1/stale-reads` the same: nothing
    /// counted twice, nothing dropped.
    #[test]
    fn a_fleet_node_from_a_checkpoint_agrees_with_one_that_read_it_all() {
        let first = state().shared_by_fleet();
        assert_eq!(first.ledger.begin_consuming(), 0);
        let key = first.key.clone();
        let stream: Vec<TakeReport> = (0..24)
            .map(|i| {
                let source = if i % 3 == 0 {
                    Source::Owner
                } else {
                    Source::Copy
                };
                let outcome = if i % 2 == 0 {
                    Outcome::Conflict
                } else {
                    Outcome::Taken
                };
                report(&key, i % 20, source, outcome)
            })
            .collect();
        let apply = |node: &StaleReadState, from: usize, to: usize| {
            for (i, r) in stream.iter().enumerate().take(to).skip(from) {
                let _ = node
                    .ledger
                    .apply(i as u64 + 1, r, Duration::ZERO, chrono::Utc::now());
            }
        };
        apply(&first, 0, 12);
        let dir = tempfile::tempdir().unwrap();
        let written = checkpoint::write(
            dir.path(),
            &identity(),
            &Tables::default(),
            &RingContents::default(),
            &[],
            &first.carry(),
        )
        .unwrap();
        apply(&first, 12, 24);

        let loaded = checkpoint::load(&written.path, &identity()).unwrap();
        assert_eq!(loaded.stale.outcomes_sequence, Some(12));
        let second = state().shared_by_fleet();
        let restored = second.restore(
            loaded.stale,
            loaded.header.written_at().unwrap(),
            Utc::now(),
        );
        assert_eq!(restored.ignored, None);
        let after = second.ledger.begin_consuming();
        assert_eq!(after, 12);
        apply(&second, after as usize, 24);
        assert_eq!(body(&second), body(&first));
        let totals = first.stale_reads().totals;
        // Ids 20-23 repeat ids 0-3: replays where the report is the same,
        // refused (not counted) where not.
        assert_eq!(totals.taken + totals.conflicts + totals.errors, 20);
    }

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

//! Take outcomes: what the booking service reports after each take, and the
//! ledger that counts them once.
//!
//! A report is checked (fields, the quote's signature, the quote against the
//! report), then recorded under its attempt id in a bounded `moka` cache. The
//! first report of an attempt is counted (metrics and the sliding window);
//! a retry of the same attempt gets the first answer back and counts
//! nothing. A retry that changes the report is refused: one attempt has one
//! outcome.
//!
//! A checkpoint carries the ledger to the next process (`carry`, then
//! `restore`): the window's buckets, each attempt id with its report's
//! fingerprint and the time it had left, and the totals. So a report posted
//! before a restart and again after it counts once, and another report
//! under its id is still refused.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{Datelike, NaiveDate};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::token::{Quote, QuoteError, QuoteKey};
use super::window::{AgedBucket, Counts, HotelShare, SlidingWindow};
use crate::checkpoint::{CountedAttempt, OutcomeTotals, StaleCarry, WindowBucket, WindowCounts};
use crate::lsn::Lsn;
use crate::metrics;
use crate::model::Source;

/// Longest attempt id accepted; ids are made by the caller and stored as given.
pub const MAX_ATTEMPT_ID_BYTES: usize = 200;
/// Most units one take may ask for.
pub const MAX_ROOMS: i32 = 1000;
/// Longest stay one report may name.
pub const MAX_NIGHTS: i64 = 366;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The owner took the units.
    Taken,
    /// The owner refused: not enough units (HTTP 409 in the booking service).
    Conflict,
    /// The take failed for another reason (timeout, owner error).
    Error,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Taken => "taken",
            Outcome::Conflict => "conflict",
            Outcome::Error => "error",
        }
    }
}

/// The metric label for where the shown numbers came from; `none` without a quote.
pub fn source_label(source: Option<Source>) -> &'static str {
    source.map_or("none", Source::label)
}

/// The body of `POST /v1/take-outcomes`, as sent. Every field is optional
/// here so a missing one is refused by name, not by a parser message.
/// Serialised back to JSON, it is the message a fleet node publishes
/// (`fleet::outcomes`), which every node reads with `from_json` and checks
/// again.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TakeOutcomeBody {
    /// Made by the booking service before its first report; a retry repeats it.
    pub attempt_id: Option<String>,
    /// The `quote` of the room type the guest chose, when the take came from a search.
    pub quote: Option<String>,
    pub hotel_id: Option<i64>,
    pub room_type_id: Option<i64>,
    #[schema(value_type = Option<String>, example = "2030-06-10")]
    pub check_in: Option<NaiveDate>,
    #[schema(value_type = Option<String>, example = "2030-06-12")]
    pub check_out: Option<NaiveDate>,
    pub rooms: Option<i32>,
    pub outcome: Option<Outcome>,
    /// When the take committed: its commit LSN (or an LSN at or after it).
    #[schema(value_type = Option<String>, example = "0/16B3748")]
    pub commit_lsn: Option<Lsn>,
}

/// A checked report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakeReport {
    pub attempt_id: String,
    pub quote: Option<Quote>,
    pub hotel_id: i64,
    pub room_type_id: i64,
    pub check_in: NaiveDate,
    pub check_out: NaiveDate,
    pub rooms: i32,
    pub outcome: Outcome,
    pub commit_lsn: Option<Lsn>,
    /// The quote was shown longer than `stale.max_quote_age_secs` before
    /// the report was first recorded (`Ledger`): the take counts as
    /// unquoted. Not part of the report's fingerprint, which is what the
    /// booking service sent.
    pub quote_expired: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    #[error("{field}: {detail}")]
    Invalid { field: &'static str, detail: String },
    #[error("quote: {0}")]
    Quote(#[source] QuoteError),
    #[error("quote: was issued for another {field}")]
    QuoteMismatch { field: &'static str },
    #[error("attempt_id: was reported before with a different outcome or stay")]
    AttemptReused,
}

fn invalid(field: &'static str, detail: impl Into<String>) -> ReportError {
    ReportError::Invalid {
        field,
        detail: detail.into(),
    }
}

impl TakeOutcomeBody {
    /// Parses a JSON body field by field, so a wrong type or an unknown
    /// field is refused by name (and nothing in the body is ever echoed to
    /// the log).
    pub fn from_json(body: &[u8]) -> Result<TakeOutcomeBody, ReportError> {
        use serde_json::Value;
        let value: Value =
            serde_json::from_slice(body).map_err(|_| invalid("body", "must be a JSON object"))?;
        let Value::Object(map) = value else {
            return Err(invalid("body", "must be a JSON object"));
        };
        fn field<T: serde::de::DeserializeOwned>(
            map: &serde_json::Map<String, Value>,
            name: &'static str,
            what: &str,
        ) -> Result<Option<T>, ReportError> {
            match map.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => T::deserialize(v)
                    .map(Some)
                    .map_err(|_| invalid(name, format!("must be {what}"))),
            }
        }
        const KNOWN: [&str; 9] = [
            "attempt_id",
            "quote",
            "hotel_id",
            "room_type_id",
            "check_in",
            "check_out",
            "rooms",
            "outcome",
            "commit_lsn",
        ];
        if let Some(unknown) = map.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(invalid(
                "body",
                format!(
                    "unknown field {:?}",
                    unknown.chars().take(40).collect::<String>()
                ),
            ));
        }
        Ok(TakeOutcomeBody {
            attempt_id: field(&map, "attempt_id", "a string")?,
            quote: field(&map, "quote", "the quote string of a search answer")?,
            hotel_id: field(&map, "hotel_id", "an integer")?,
            room_type_id: field(&map, "room_type_id", "an integer")?,
            check_in: field(&map, "check_in", "a date like 2030-06-10")?,
            check_out: field(&map, "check_out", "a date like 2030-06-12")?,
            rooms: field(&map, "rooms", "an integer")?,
            outcome: field(&map, "outcome", "one of taken, conflict, error")?,
            commit_lsn: field(&map, "commit_lsn", "an LSN like 0/16B3748")?,
        })
    }

    /// Checks every field and the quote (signature, then its match with the
    /// report), naming the first field that fails.
    pub fn check(self, key: &QuoteKey) -> Result<TakeReport, ReportError> {
        let attempt_id = self
            .attempt_id
            .ok_or_else(|| invalid("attempt_id", "is required"))?;
        if attempt_id.is_empty() || attempt_id.len() > MAX_ATTEMPT_ID_BYTES {
            return Err(invalid(
                "attempt_id",
                format!("must be 1 to {MAX_ATTEMPT_ID_BYTES} bytes"),
            ));
        }
        if attempt_id.chars().any(char::is_control) {
            return Err(invalid("attempt_id", "must not contain control characters"));
        }
        let hotel_id = self
            .hotel_id
            .ok_or_else(|| invalid("hotel_id", "is required"))?;
        let room_type_id = self
            .room_type_id
            .ok_or_else(|| invalid("room_type_id", "is required"))?;
        let check_in = self
            .check_in
            .ok_or_else(|| invalid("check_in", "is required (YYYY-MM-DD)"))?;
        let check_out = self
            .check_out
            .ok_or_else(|| invalid("check_out", "is required (YYYY-MM-DD)"))?;
        let nights = (check_out - check_in).num_days();
        if nights <= 0 {
            return Err(invalid("check_out", "must be after check_in"));
        }
        if nights > MAX_NIGHTS {
            return Err(invalid(
                "check_out",
                format!("a stay is at most {MAX_NIGHTS} nights"),
            ));
        }
        let rooms = self.rooms.ok_or_else(|| invalid("rooms", "is required"))?;
        if !(1..=MAX_ROOMS).contains(&rooms) {
            return Err(invalid("rooms", format!("must be 1 to {MAX_ROOMS}")));
        }
        let outcome = self
            .outcome
            .ok_or_else(|| invalid("outcome", "is required: taken, conflict or error"))?;
        if self.commit_lsn.is_some() && outcome != Outcome::Taken {
            return Err(invalid(
                "commit_lsn",
                "only a take that committed (outcome taken) has one",
            ));
        }
        let quote = match self.quote.as_deref() {
            None | Some("") => None,
            Some(token) => Some(key.verify(token).map_err(ReportError::Quote)?),
        };
        if let Some(q) = &quote {
            // The quote must describe the room this take was for; otherwise
            // its source would be credited to someone else's take.
            let mismatch = if q.hotel_id != hotel_id {
                Some("hotel_id")
            } else if q.room_type_id != room_type_id {
                Some("room_type_id")
            } else if q.check_in != check_in {
                Some("check_in")
            } else if q.check_out != check_out {
                Some("check_out")
            } else {
                None
            };
            if let Some(field) = mismatch {
                return Err(ReportError::QuoteMismatch { field });
            }
        }
        Ok(TakeReport {
            attempt_id,
            quote,
            hotel_id,
            room_type_id,
            check_in,
            check_out,
            rooms,
            outcome,
            commit_lsn: self.commit_lsn,
            quote_expired: false,
        })
    }
}

impl TakeReport {
    /// The answer to this report, whether counted now or a retry: a
    /// function of the report and of whether its quote had expired when it
    /// was first recorded.
    pub fn answer(&self) -> Recorded {
        Recorded {
            attempt_id: self.attempt_id.clone(),
            outcome: self.outcome,
            source: source_label(self.source()),
            shown_available: self.shown_available(),
            stale_read: self.stale_read(),
            quote_expired: self.quote_expired,
        }
    }

    /// Marks the quote expired when it was shown more than `max_age` before
    /// `reported_at` (`None`: quotes never expire). A quote shown "after"
    /// the report (another clock ahead) is not expired.
    ///
    /// Why: a take made long after its search says nothing of the copy's
    /// freshness (the guest's own wait let others book the room), yet as a
    /// conflict after a copy showing it counted as a stale read and could
    /// flag its hotel for bypass. Counted as unquoted instead, not refused:
    /// the take itself is still counted, no report is lost.
    pub fn expire_quote(
        &mut self,
        reported_at: chrono::DateTime<chrono::Utc>,
        max_age: Option<Duration>,
    ) {
        self.quote_expired = match (self.quote, max_age) {
            (Some(q), Some(max_age)) => (reported_at - q.shown_at)
                .to_std()
                .is_ok_and(|age| age > max_age),
            _ => false,
        };
    }

    /// The quote the take is counted under: none when it expired.
    fn counted_quote(&self) -> Option<Quote> {
        self.quote.filter(|_| !self.quote_expired)
    }

    pub fn source(&self) -> Option<Source> {
        self.counted_quote().map(|q| q.source)
    }

    /// The quote showed at least as many units free as the take asked for.
    pub fn shown_available(&self) -> bool {
        self.counted_quote()
            .is_some_and(|q| q.free_units >= self.rooms)
    }

    /// A conflict after the copy's own unconfirmed numbers (not the
    /// owner's, not a confirmed read's) showed enough units free: the stale
    /// read this loop exists to count, and the only conflicts the bypass
    /// policy acts on. After `owner` or `confirmed` numbers the copy was as
    /// fresh as the owner when the search began, so a conflict is a race
    /// between guests that no read could have avoided.
    pub fn stale_read(&self) -> bool {
        self.outcome == Outcome::Conflict
            && self.shown_available()
            && self.source().is_some_and(Source::unconfirmed_copy)
    }

    fn counts(&self) -> Counts {
        let answered = matches!(self.outcome, Outcome::Taken | Outcome::Conflict);
        Counts {
            takes: u64::from(answered),
            conflicts: u64::from(self.outcome == Outcome::Conflict),
            stale: u64::from(self.stale_read()),
            errors: u64::from(self.outcome == Outcome::Error),
        }
    }

    /// What makes two reports the same report (the quote included, so a
    /// retry that swaps the quote is a different report).
    ///
    /// Each field is hashed in a fixed binary form (lengths, big-endian
    /// numbers, days and milliseconds), not as its `Debug` text: a
    /// checkpoint carries fingerprints to the next process, perhaps another
    /// build, which must compute the same one for the same report. So this
    /// form is part of the checkpoint format: changing it needs a new
    /// `checkpoint::FORMAT_VERSION`.
    fn fingerprint(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"vacancy.take-report.1");
        h.update((self.attempt_id.len() as u64).to_be_bytes());
        h.update(self.attempt_id.as_bytes());
        match &self.quote {
            None => h.update([0u8]),
            Some(q) => {
                h.update([1u8]);
                h.update(source_label(Some(q.source)).as_bytes());
                h.update([0u8]);
                h.update(q.hotel_id.to_be_bytes());
                h.update(q.room_type_id.to_be_bytes());
                h.update(q.check_in.num_days_from_ce().to_be_bytes());
                h.update(q.check_out.num_days_from_ce().to_be_bytes());
                h.update(q.free_units.to_be_bytes());
                h.update(q.lsn.0.to_be_bytes());
                h.update(q.shown_at.timestamp_millis().to_be_bytes());
                h.update(q.lag_ms.to_be_bytes());
            }
        }
        h.update(self.hotel_id.to_be_bytes());
        h.update(self.room_type_id.to_be_bytes());
        h.update(self.check_in.num_days_from_ce().to_be_bytes());
        h.update(self.check_out.num_days_from_ce().to_be_bytes());
        h.update(self.rooms.to_be_bytes());
        h.update(self.outcome.label().as_bytes());
        h.update([0u8]);
        match self.commit_lsn {
            None => h.update([0u8]),
            Some(lsn) => {
                h.update([1u8]);
                h.update(lsn.0.to_be_bytes());
            }
        }
        h.finalize().into()
    }
}

/// The answer to a report; a retry gets the same one back.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Recorded {
    pub attempt_id: String,
    pub outcome: Outcome,
    /// copy | owner | copy_fallback | confirmed | none
    pub source: &'static str,
    /// The quote showed at least `rooms` units free.
    pub shown_available: bool,
    /// Counted as a stale read: a conflict after the copy's unconfirmed
    /// numbers (copy, copy_fallback) showed enough units.
    pub stale_read: bool,
    /// The quote was shown longer than `stale.max_quote_age_secs` before
    /// the report: the take is counted as unquoted (`source` none).
    pub quote_expired: bool,
}

/// How the ledger sizes itself.
#[derive(Debug, Clone)]
pub struct LedgerSettings {
    pub attempt_capacity: u64,
    pub attempt_ttl: Duration,
    pub bucket_width: Duration,
    pub buckets: usize,
    pub max_hotels: usize,
    /// A quote shown longer than this before its report counts as none
    /// (`TakeReport::expire_quote`); `None`: never.
    pub max_quote_age: Option<Duration>,
}

/// Totals since start, per instance (the metrics are process-wide), carried
/// over a restart by a checkpoint (the metrics are not).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Totals {
    pub taken: u64,
    pub conflicts: u64,
    pub errors: u64,
    pub stale_reads: u64,
    /// Reports that repeated an attempt id and were not counted again.
    pub replays: u64,
    /// Conflicts by the source of the quote: copy, owner, copy_fallback, confirmed, none.
    pub conflicts_by_source: std::collections::BTreeMap<String, u64>,
    pub takes_by_source: std::collections::BTreeMap<String, u64>,
}

/// What the ledger keeps of a counted attempt. Not its answer: a retry with
/// the same fingerprint is the same report, so its answer is computed again
/// from it and from `quote_expired`, equal.
struct Entry {
    fingerprint: [u8; 32],
    /// Whether the report's quote had expired when it was counted; `None`
    /// for an id a checkpoint carried (the carry does not say), whose
    /// retry is then judged at its own time. A retry comes within seconds,
    /// so only one straddling both a restart and the age limit can be
    /// answered otherwise than the first time; it is counted once either way.
    quote_expired: Option<bool>,
    /// When the ledger took the entry, and for how long from then it keeps
    /// it: `attempt_ttl` for a report (less its age, for one read from the
    /// fleet's stream), what was left for an id a checkpoint carried.
    created: Instant,
    ttl: Duration,
    /// The fleet's outcome-stream sequence of the report that won the id;
    /// 0 (no sequence) for a report posted to a standalone node and an id a
    /// checkpoint carried.
    sequence: u64,
}

impl Entry {
    fn left(&self, now: Instant) -> Duration {
        self.ttl
            .saturating_sub(now.saturating_duration_since(self.created))
    }
}

/// Each entry expires after its own `ttl`, so a carried id lives only the
/// time it had left, not a whole `attempt_ttl` again.
struct EntryExpiry;

impl moka::Expiry<String, Arc<Entry>> for EntryExpiry {
    fn expire_after_create(
        &self,
        _attempt_id: &String,
        entry: &Arc<Entry>,
        _created_at: Instant,
    ) -> Option<Duration> {
        Some(entry.ttl)
    }
}

/// What `Ledger::restore` kept of a carried state, and what had run out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Restored {
    pub buckets: usize,
    /// Buckets that left the window during the downtime.
    pub buckets_expired: usize,
    pub attempts: usize,
    /// Ids whose time ran out during the downtime.
    pub attempts_expired: usize,
    /// Why nothing was restored, when nothing was: a ledger shared by the
    /// fleet takes a carried state only before it reads the outcome stream,
    /// and only one that says where in that stream it stands.
    pub ignored: Option<&'static str>,
    /// The outcome-stream sequence the restored state includes (a fleet's
    /// checkpoint; `None` for a standalone one).
    pub outcomes_sequence: Option<u64>,
}

/// Where a ledger shared by the fleet stands in the outcome stream.
#[derive(Debug, Clone, Copy, Default)]
struct StreamPosition {
    /// Every outcome at or below this sequence is in the ledger (counted,
    /// or refused), none after it.
    applied: u64,
    /// The consumer began reading the stream: from now on the ledger's
    /// state is the stream's alone, and a checkpoint's carry is ignored.
    consuming: bool,
}

/// What won an attempt id, as the ledger holds it (`Ledger::winner`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Winner {
    /// The report asked about is the winning one (same fingerprint).
    pub same_report: bool,
    /// The outcome-stream sequence the winner was counted at (0: none).
    pub sequence: u64,
    /// Whether the winner's quote had expired when it was counted (`None`:
    /// an id a checkpoint carried).
    pub quote_expired: Option<bool>,
}

/// One remembered attempt id, in bytes, for the soak's accounting
/// (`vacancy_cache_estimated_bytes`): the key's `String` (24) and its text
/// (a UUID's 36 bytes, or the simulator's ~30, in a 48-byte allocation),
/// the `Arc<Entry>` (8) and its allocation (two counts and the entry,
/// rounded up to malloc's 16), and moka's own per-entry cost with its
/// timer wheel's node (each id expires on its own). 458 bytes measured for
/// this shape (`metrics::MOKA_TIMER_ENTRY_BYTES`).
pub const ATTEMPT_ENTRY_BYTES: u64 = (size_of::<String>()
    + 48
    + size_of::<Arc<Entry>>()
    + (16 + size_of::<Entry>()).next_multiple_of(16)) as u64
    + crate::metrics::MOKA_ENTRY_OVERHEAD_BYTES
    + crate::metrics::MOKA_TIMER_ENTRY_BYTES;

pub struct Ledger {
    /// Attempt id → the report's fingerprint. Bounded in entries and in
    /// age: a retry arrives within seconds, so a day is generous.
    attempts: moka::sync::Cache<String, Arc<Entry>>,
    attempt_ttl: Duration,
    attempt_capacity: u64,
    max_quote_age: Option<Duration>,
    /// A std Mutex: every critical section is a few hash operations, never
    /// held across an await.
    window: Mutex<SlidingWindow>,
    totals: Mutex<Totals>,
    /// `Some` once the fleet shares this ledger (`shared`): the position in
    /// the outcome stream. Held (outermost, before the window's and the
    /// totals' locks) while an outcome from the stream is recorded and
    /// while a checkpoint's carry is taken or restored, so a carry is
    /// exactly "every outcome up to `applied`".
    stream: Option<Mutex<StreamPosition>>,
    /// Held while a report posted to a standalone node is recorded (its id
    /// taken, then counted) and while a checkpoint's carry is taken: a
    /// carry between the two held the id without its counts, and a retry
    /// after a restart from that checkpoint was answered as a replay and
    /// never counted. (A shared ledger's `stream` lock does this for the
    /// fleet.) Taken after `stream` where both are.
    recording: Mutex<()>,
}

/// Whether a report was new or a retry.
#[derive(Debug, Clone, PartialEq)]
pub enum Recording {
    New(Recorded),
    Replay(Recorded),
}

impl Ledger {
    pub fn new(s: &LedgerSettings) -> Ledger {
        Ledger {
            attempts: moka::sync::Cache::builder()
                .max_capacity(s.attempt_capacity)
                .expire_after(EntryExpiry)
                // Full, the oldest ids go: moka's default (TinyLFU) admits a
                // new key only if seen more often than the one it would
                // evict, so a full cache dropped every new id (each seen
                // once), the very ones a booking service retries.
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .build(),
            attempt_ttl: s.attempt_ttl,
            attempt_capacity: s.attempt_capacity,
            max_quote_age: s.max_quote_age,
            window: Mutex::new(SlidingWindow::new(
                Instant::now(),
                s.bucket_width,
                s.buckets,
                s.max_hotels,
            )),
            totals: Mutex::new(Totals::default()),
            stream: None,
            recording: Mutex::new(()),
        }
    }

    /// This ledger counts only what the fleet's outcome stream delivers
    /// (`apply`), never a report posted to this node (`record`): every
    /// node then counts the same outcomes, in the same order.
    pub fn shared(mut self) -> Ledger {
        self.stream = Some(Mutex::new(StreamPosition::default()));
        self
    }

    pub fn is_shared(&self) -> bool {
        self.stream.is_some()
    }

    fn window(&self) -> std::sync::MutexGuard<'_, SlidingWindow> {
        self.window.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn position(&self) -> Option<std::sync::MutexGuard<'_, StreamPosition>> {
        self.stream
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Records `report` once per attempt id: a standalone node's report.
    pub fn record(&self, report: &TakeReport) -> Result<Recording, ReportError> {
        // A shared ledger counting a report of its own would disagree with
        // every other node's.
        debug_assert!(
            !self.is_shared(),
            "a shared ledger records only the stream's outcomes"
        );
        let _recording = self.recording.lock().unwrap_or_else(|p| p.into_inner());
        self.record_as(report, 0, Duration::ZERO, chrono::Utc::now())
    }

    /// The consumer of the outcome stream begins: from now on a carried
    /// state is ignored. Returns the sequence it applies after (a restored
    /// checkpoint's, or 0).
    pub fn begin_consuming(&self) -> u64 {
        let mut position = self
            .position()
            .expect("only a shared ledger consumes the stream");
        position.consuming = true;
        position.applied
    }

    /// The outcome-stream sequence this ledger holds every outcome up to
    /// (0 for a ledger not shared, or nothing applied yet).
    pub fn applied(&self) -> u64 {
        self.position().map_or(0, |p| p.applied)
    }

    /// Records the outcome the stream stored at `sequence`, at
    /// `stored_at` (the stream's clock), `age` before now: in stream order,
    /// so the first report of an id in the stream wins on every node, and
    /// a different one under the id is refused by every node. Its window
    /// bucket is that of its time, its id is kept `attempt_ttl` from then,
    /// and its quote's age is judged at `stored_at`, the same time on
    /// every node.
    pub fn apply(
        &self,
        sequence: u64,
        report: &TakeReport,
        age: Duration,
        stored_at: chrono::DateTime<chrono::Utc>,
    ) -> Result<Recording, ReportError> {
        let mut position = self
            .position()
            .expect("only a shared ledger applies the stream");
        debug_assert!(position.consuming, "applied before the consumer began");
        debug_assert!(
            sequence > position.applied,
            "outcome {sequence} applied after {}",
            position.applied
        );
        let recording = self.record_as(report, sequence, age, stored_at);
        position.applied = position.applied.max(sequence);
        recording
    }

    /// Moves past `sequence` without recording anything: a message that
    /// does not hold a valid report (every node refuses it alike).
    pub fn skip(&self, sequence: u64) {
        let mut position = self
            .position()
            .expect("only a shared ledger applies the stream");
        debug_assert!(sequence > position.applied);
        position.applied = position.applied.max(sequence);
    }

    /// The stream was made again: its sequences start over, so the
    /// position does too (to `before_first`, before the new stream's first
    /// message kept). What was counted stays counted.
    pub fn rebase(&self, before_first: u64) {
        let mut position = self
            .position()
            .expect("only a shared ledger applies the stream");
        position.applied = before_first;
    }

    /// What won `report`'s attempt id, if the ledger still holds it.
    pub fn winner(&self, report: &TakeReport) -> Option<Winner> {
        let entry = self.attempts.get(&report.attempt_id)?;
        Some(Winner {
            same_report: bool::from(entry.fingerprint.ct_eq(&report.fingerprint())),
            sequence: entry.sequence,
            quote_expired: entry.quote_expired,
        })
    }

    /// `report` with its quote judged at `reported_at` against
    /// `stale.max_quote_age_secs`.
    pub fn aged(
        &self,
        report: &TakeReport,
        reported_at: chrono::DateTime<chrono::Utc>,
    ) -> TakeReport {
        let mut aged = report.clone();
        aged.expire_quote(reported_at, self.max_quote_age);
        aged
    }

    /// Records `report` once per attempt id: counted (at `age` before now,
    /// its quote judged at `reported_at`) if its id is new, a replay if the
    /// same report won it, refused if another did.
    fn record_as(
        &self,
        report: &TakeReport,
        sequence: u64,
        age: Duration,
        reported_at: chrono::DateTime<chrono::Utc>,
    ) -> Result<Recording, ReportError> {
        let report = &self.aged(report, reported_at);
        let fingerprint = report.fingerprint();
        // `entry().or_insert_with` runs the insert once for concurrent
        // reports of one attempt: exactly one of them sees `is_fresh`.
        let entry = self
            .attempts
            .entry(report.attempt_id.clone())
            .or_insert_with(|| {
                Arc::new(Entry {
                    fingerprint,
                    quote_expired: Some(report.quote_expired),
                    created: Instant::now(),
                    // Kept `attempt_ttl` from the outcome's time, so every
                    // node forgets the id at the same moment, however late
                    // it read it. Kept a moment at least: a later report
                    // under the id in the same stream read still meets it.
                    ttl: self
                        .attempt_ttl
                        .saturating_sub(age)
                        .max(Duration::from_secs(1)),
                    sequence,
                })
            });
        if !entry.is_fresh() {
            if !bool::from(entry.value().fingerprint.ct_eq(&fingerprint)) {
                return Err(ReportError::AttemptReused);
            }
            self.totals
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .replays += 1;
            // The same fingerprint, the same report: the first answer.
            let mut first = report.clone();
            first.quote_expired = entry.value().quote_expired.unwrap_or(report.quote_expired);
            return Ok(Recording::Replay(first.answer()));
        }
        self.count(report, age);
        Ok(Recording::New(report.answer()))
    }

    /// Counts a new report, `age` before now: metrics, per-instance totals,
    /// the window. Each report is counted here and nowhere else.
    fn count(&self, report: &TakeReport, age: Duration) {
        let source = source_label(report.source());
        metrics::TAKES
            .with_label_values(&[report.outcome.label(), source])
            .inc();
        if report.quote_expired {
            metrics::EXPIRED_QUOTES.inc();
        }
        if report.outcome == Outcome::Conflict && report.shown_available() {
            metrics::CONFLICTS_AFTER_SHOWN
                .with_label_values(&[source])
                .inc();
        }
        if report.stale_read()
            && let Some(q) = report.quote
        {
            metrics::CONFLICT_SHOW_LAG.observe(f64::from(q.lag_ms) / 1000.0);
        }
        {
            let mut t = self.totals.lock().unwrap_or_else(|p| p.into_inner());
            match report.outcome {
                Outcome::Taken => t.taken += 1,
                Outcome::Conflict => {
                    t.conflicts += 1;
                    *t.conflicts_by_source.entry(source.to_string()).or_default() += 1;
                }
                Outcome::Error => t.errors += 1,
            }
            if report.outcome != Outcome::Error {
                *t.takes_by_source.entry(source.to_string()).or_default() += 1;
            }
            t.stale_reads += u64::from(report.stale_read());
        }
        let share = {
            let mut w = self.window();
            let now = Instant::now();
            w.record_aged(now, age, report.hotel_id, report.counts());
            w.overall(now).share()
        };
        metrics::STALE_SHARE.set(share);
    }

    /// The overall figures over the window; also refreshes the share gauge,
    /// which otherwise would only move when a report arrives.
    pub fn overall(&self) -> Counts {
        let counts = self.window().overall(Instant::now());
        metrics::STALE_SHARE.set(counts.share());
        counts
    }

    pub fn hotel(&self, hotel_id: i64) -> Counts {
        self.window().hotel(Instant::now(), hotel_id)
    }

    /// The hotels among `ids` whose counts `flag` says to read from the owner.
    pub fn hotels_where(
        &self,
        ids: impl Iterator<Item = i64>,
        flag: impl Fn(&Counts) -> bool,
    ) -> std::collections::HashSet<i64> {
        let mut w = self.window();
        let now = Instant::now();
        w.advance(now);
        if w.tracked_hotels() == 0 {
            return Default::default();
        }
        ids.filter(|id| flag(&w.hotel(now, *id))).collect()
    }

    pub fn top(&self, min_takes: u64, limit: usize) -> Vec<HotelShare> {
        self.window().top(Instant::now(), min_takes, limit)
    }

    pub fn untracked(&self) -> u64 {
        self.window().untracked(Instant::now())
    }

    pub fn span(&self) -> Duration {
        self.window().span()
    }

    /// Attempt ids remembered now. moka's count trails inserts and
    /// expiries until its pending maintenance runs, so that runs first.
    pub fn attempt_entries(&self) -> u64 {
        self.attempts.run_pending_tasks();
        self.attempts.entry_count()
    }

    pub fn totals(&self) -> Totals {
        self.totals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// What a checkpoint carries, measured at `now`: the window's live
    /// buckets, the attempt ids with the time each has left (at most
    /// `attempt_capacity` of them, the youngest if moka held more for a
    /// moment; in id order), and the totals. The Prometheus counters are
    /// not in it: they are the process's, and start again from zero like
    /// any restarted process's.
    pub fn carry(&self, now: Instant) -> StaleCarry {
        // Held until the state is read: no outcome of the stream is recorded
        // meanwhile, so it is exactly every outcome up to `applied`.
        let position = self.position();
        let recording = self.recording.lock().unwrap_or_else(|p| p.into_inner());
        let buckets = self
            .window()
            .buckets(now)
            .into_iter()
            .map(WindowBucket::from)
            .collect();
        // Evictions moka has queued first, so the ids carried are the ones
        // it keeps.
        self.attempts.run_pending_tasks();
        let mut attempts: Vec<CountedAttempt> = self
            .attempts
            .iter()
            .filter_map(|(attempt_id, entry)| {
                let left = entry.left(now);
                (!left.is_zero()).then(|| CountedAttempt {
                    attempt_id: attempt_id.as_ref().clone(),
                    fingerprint: entry.fingerprint,
                    left,
                })
            })
            .collect();
        let totals = OutcomeTotals::from(&self.totals());
        let outcomes_sequence = position.as_ref().map(|p| p.applied);
        // What follows reads nothing the recorders change: reports wait no
        // longer than the walk above.
        drop(recording);
        drop(position);
        let capacity = usize::try_from(self.attempt_capacity).unwrap_or(usize::MAX);
        if attempts.len() > capacity {
            // The youngest are the likeliest to be retried.
            attempts.sort_unstable_by_key(|a| std::cmp::Reverse(a.left));
            attempts.truncate(capacity);
        }
        attempts.sort_unstable_by(|a, b| a.attempt_id.cmp(&b.attempt_id));
        StaleCarry {
            buckets,
            attempts,
            totals,
            outcomes_sequence,
        }
    }

    /// Restores what `carry` gave (in the process before), aged by
    /// `downtime`: a bucket that left the window meanwhile is dropped, the
    /// others are placed relative to `now`; an id whose time ran out is
    /// dropped, the others are kept for what they have left (at most
    /// `attempt_ttl`, should the setting have shrunk). The totals are added
    /// to this process's. What was already counted here stays: restore
    /// before reports arrive, or they are counted on top (an id already
    /// here keeps its entry).
    ///
    /// A ledger shared by the fleet restores only before its consumer
    /// begins, and only a fleet node's carry (one that says which outcomes
    /// it holds): it then holds every outcome up to that sequence, and the
    /// consumer reads on from the next. Otherwise nothing is restored
    /// (`Restored::ignored` says why): a standalone node's counts are not
    /// in the stream, so no other node has them, and a ledger already
    /// reading the stream has its state from there.
    pub fn restore(&self, carry: StaleCarry, downtime: Duration, now: Instant) -> Restored {
        let mut restored = Restored {
            outcomes_sequence: carry.outcomes_sequence,
            ..Restored::default()
        };
        let mut position = self.position();
        if let Some(p) = position.as_deref_mut() {
            if p.consuming {
                restored.ignored = Some("the outcome stream is already being read");
                return restored;
            }
            let Some(sequence) = carry.outcomes_sequence else {
                restored.ignored =
                    Some("a standalone checkpoint: its outcomes are not the fleet's");
                return restored;
            };
            p.applied = sequence;
        }
        {
            let mut w = self.window();
            for bucket in carry.buckets {
                let mut aged = AgedBucket::from(bucket);
                aged.age = aged.age.saturating_add(downtime);
                if w.restore(now, aged) {
                    restored.buckets += 1;
                } else {
                    restored.buckets_expired += 1;
                }
            }
        }
        for attempt in carry.attempts {
            let left = attempt.left.saturating_sub(downtime).min(self.attempt_ttl);
            if left.is_zero() {
                restored.attempts_expired += 1;
                continue;
            }
            let entry = self.attempts.entry(attempt.attempt_id).or_insert_with(|| {
                Arc::new(Entry {
                    fingerprint: attempt.fingerprint,
                    quote_expired: None,
                    created: now,
                    ttl: left,
                    sequence: 0,
                })
            });
            restored.attempts += usize::from(entry.is_fresh());
        }
        {
            let mut t = self.totals.lock().unwrap_or_else(|p| p.into_inner());
            let carried = carry.totals;
            t.taken += carried.taken;
            t.conflicts += carried.conflicts;
            t.errors += carried.errors;
            t.stale_reads += carried.stale_reads;
            t.replays += carried.replays;
            for (source, n) in carried.conflicts_by_source {
                *t.conflicts_by_source
                    .entry(source_label(source).to_string())
                    .or_default() += n;
            }
            for (source, n) in carried.takes_by_source {
                *t.takes_by_source
                    .entry(source_label(source).to_string())
                    .or_default() += n;
            }
        }
        drop(position);
        // The share gauge follows the restored window.
        self.overall();
        restored
    }
}

impl From<Counts> for WindowCounts {
    fn from(c: Counts) -> WindowCounts {
        WindowCounts {
            takes: c.takes,
            conflicts: c.conflicts,
            stale: c.stale,
            errors: c.errors,
        }
    }
}

impl From<WindowCounts> for Counts {
    fn from(c: WindowCounts) -> Counts {
        Counts {
            takes: c.takes,
            conflicts: c.conflicts,
            stale: c.stale,
            errors: c.errors,
        }
    }
}

impl From<AgedBucket> for WindowBucket {
    fn from(b: AgedBucket) -> WindowBucket {
        WindowBucket {
            age: b.age,
            overall: b.overall.into(),
            untracked: b.untracked,
            hotels: b.hotels.into_iter().map(|(id, c)| (id, c.into())).collect(),
        }
    }
}

impl From<WindowBucket> for AgedBucket {
    fn from(b: WindowBucket) -> AgedBucket {
        AgedBucket {
            age: b.age,
            overall: b.overall.into(),
            untracked: b.untracked,
            hotels: b.hotels.into_iter().map(|(id, c)| (id, c.into())).collect(),
        }
    }
}

impl From<&Totals> for OutcomeTotals {
    fn from(t: &Totals) -> OutcomeTotals {
        // Labels back to sources: every label here came from
        // `source_label`, so each has one.
        let by_source = |of: &std::collections::BTreeMap<String, u64>| {
            of.iter()
                .filter_map(|(label, n)| {
                    let source = source_of_label(label);
                    debug_assert!(source.is_some(), "a label source_label did not make");
                    Some((source?, *n))
                })
                .collect()
        };
        OutcomeTotals {
            taken: t.taken,
            conflicts: t.conflicts,
            errors: t.errors,
            stale_reads: t.stale_reads,
            replays: t.replays,
            conflicts_by_source: by_source(&t.conflicts_by_source),
            takes_by_source: by_source(&t.takes_by_source),
        }
    }
}

/// The source `source_label` gave `label` for.
fn source_of_label(label: &str) -> Option<Option<Source>> {
    std::iter::once(None)
        .chain(Source::ALL.into_iter().map(Some))
        .find(|s| source_label(*s) == label)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;

    fn day(d: u32) -> NaiveDate {
        NaiveDate::from_ymd_opt(2030, 3, d).unwrap()
    }

    fn body(key: &QuoteKey, source: Source, free: i32, outcome: Outcome) -> TakeOutcomeBody {
        body_shown(key, source, free, outcome, chrono::TimeDelta::zero())
    }

    /// A report of a take of `free` units shown by `source`, its quote
    /// shown `ago` before now.
    fn body_shown(
        key: &QuoteKey,
        source: Source,
        free: i32,
        outcome: Outcome,
        ago: chrono::TimeDelta,
    ) -> TakeOutcomeBody {
        let quote = key
            .sign(&Quote {
                source,
                hotel_id: 1,
                room_type_id: 2,
                check_in: day(1),
                check_out: day(3),
                free_units: free,
                lsn: Lsn(99),
                shown_at: Utc::now() - ago,
                lag_ms: 40,
            })
            .unwrap();
        TakeOutcomeBody {
            attempt_id: Some("a-1".into()),
            quote: Some(quote),
            hotel_id: Some(1),
            room_type_id: Some(2),
            check_in: Some(day(1)),
            check_out: Some(day(3)),
            rooms: Some(1),
            outcome: Some(outcome),
            commit_lsn: None,
        }
    }

    /// A conflict long after a copy showing counts as a take without a
    /// quote, not as a stale read; its retry, later still, gets the same
    /// answer; a quote within the age is counted under its source.
    #[test]
    fn a_quote_older_than_the_limit_counts_as_none() {
        let key = QuoteKey::random();
        let l = ledger();
        let minutes = chrono::TimeDelta::minutes;
        let old = body_shown(&key, Source::Copy, 2, Outcome::Conflict, minutes(16))
            .check(&key)
            .unwrap();
        let Ok(Recording::New(answer)) = l.record(&old) else {
            panic!("counted")
        };
        assert!(answer.quote_expired);
        assert_eq!(
            (answer.source, answer.stale_read, answer.shown_available),
            ("none", false, false)
        );
        let t = l.totals();
        assert_eq!((t.conflicts, t.stale_reads), (1, 0));
        assert_eq!(t.takes_by_source.get("none"), Some(&1));
        assert_eq!(l.overall().stale, 0);
        assert_eq!(l.record(&old), Ok(Recording::Replay(answer)));

        let fresh = TakeOutcomeBody {
            attempt_id: Some("a-2".into()),
            ..body_shown(&key, Source::Copy, 2, Outcome::Conflict, minutes(14))
        }
        .check(&key)
        .unwrap();
        let Ok(Recording::New(answer)) = l.record(&fresh) else {
            panic!("counted")
        };
        assert!(!answer.quote_expired && answer.stale_read);
        assert_eq!(l.totals().stale_reads, 1);
    }

    /// The first answer stands: a report counted while its quote was fresh
    /// is answered so again when retried after the quote's age has passed;
    /// a fleet node judges the quote at the stream's time of the message.
    #[test]
    fn a_retry_after_the_quote_aged_gets_the_first_answer() {
        let key = QuoteKey::random();
        let l = ledger().shared();
        l.begin_consuming();
        let minutes = chrono::TimeDelta::minutes;
        let report = body_shown(&key, Source::Copy, 2, Outcome::Conflict, minutes(20))
            .check(&key)
            .unwrap();
        // Stored by the stream 19 minutes ago: judged then, on every node.
        let stored_at = Utc::now() - minutes(19);
        let age = Duration::from_secs(19 * 60);
        let Ok(Recording::New(first)) = l.apply(1, &report, age, stored_at) else {
            panic!("counted")
        };
        assert!(
            !first.quote_expired && first.stale_read,
            "a minute old when stored"
        );
        assert_eq!(l.winner(&report).and_then(|w| w.quote_expired), Some(false));
        let Ok(Recording::Replay(again)) = l.apply(2, &report, Duration::ZERO, Utc::now()) else {
            panic!("a replay")
        };
        assert_eq!(again, first);
    }

    /// With no limit a quote never expires, and a quote shown "after" its
    /// report (a clock ahead) is not expired either.
    #[test]
    fn quotes_expire_only_past_a_set_limit() {
        let key = QuoteKey::random();
        let days = chrono::TimeDelta::days;
        let mut r = body_shown(&key, Source::Copy, 2, Outcome::Conflict, days(3))
            .check(&key)
            .unwrap();
        r.expire_quote(Utc::now(), None);
        assert!(!r.quote_expired && r.stale_read());
        r.expire_quote(Utc::now(), Some(Duration::from_secs(60)));
        assert!(r.quote_expired && !r.stale_read());
        r.expire_quote(Utc::now() - days(4), Some(Duration::from_secs(60)));
        assert!(!r.quote_expired, "shown after the report: no age");
    }

    fn ledger() -> Ledger {
        Ledger::new(&LedgerSettings {
            attempt_capacity: 100,
            attempt_ttl: Duration::from_secs(60),
            bucket_width: Duration::from_secs(5),
            buckets: 60,
            max_hotels: 10,
            max_quote_age: Some(Duration::from_secs(900)),
        })
    }

    #[test]
    fn stale_read_needs_a_conflict_after_the_copy_showed_enough() {
        let key = QuoteKey::random();
        let r = body(&key, Source::Copy, 2, Outcome::Conflict)
            .check(&key)
            .unwrap();
        assert!(r.stale_read());
        let r = body(&key, Source::CopyFallback, 1, Outcome::Conflict)
            .check(&key)
            .unwrap();
        assert!(r.stale_read());
        let r = body(&key, Source::Owner, 2, Outcome::Conflict)
            .check(&key)
            .unwrap();
        assert!(r.shown_available() && !r.stale_read(), "owner numbers");
        let r = body(&key, Source::Confirmed, 2, Outcome::Conflict)
            .check(&key)
            .unwrap();
        assert!(
            r.shown_available() && !r.stale_read(),
            "confirmed numbers: a race, not a stale read"
        );
        assert_eq!(source_label(r.source()), "confirmed");
        let mut b = body(&key, Source::Copy, 1, Outcome::Conflict);
        b.rooms = Some(2);
        let r = b.check(&key).unwrap();
        assert!(!r.shown_available() && !r.stale_read(), "showed too few");
        let r = body(&key, Source::Copy, 2, Outcome::Taken)
            .check(&key)
            .unwrap();
        assert!(!r.stale_read());
        let mut b = body(&key, Source::Copy, 2, Outcome::Conflict);
        b.quote = None;
        let r = b.check(&key).unwrap();
        assert!(!r.stale_read() && r.source().is_none());
    }

    #[test]
    fn checks_name_the_field() {
        let key = QuoteKey::random();
        type Mutation = Box<dyn Fn(&mut TakeOutcomeBody)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("attempt_id", Box::new(|b| b.attempt_id = None)),
            (
                "attempt_id",
                Box::new(|b| b.attempt_id = Some("x\n".into())),
            ),
            ("hotel_id", Box::new(|b| b.hotel_id = None)),
            ("check_out", Box::new(|b| b.check_out = Some(day(1)))),
            ("rooms", Box::new(|b| b.rooms = Some(0))),
            ("outcome", Box::new(|b| b.outcome = None)),
            ("commit_lsn", Box::new(|b| b.commit_lsn = Some(Lsn(5)))),
        ];
        for (field, mutate) in cases {
            let mut b = body(&key, Source::Copy, 2, Outcome::Conflict);
            mutate(&mut b);
            match b.check(&key) {
                Err(ReportError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
        let mut b = body(&key, Source::Copy, 2, Outcome::Conflict);
        b.room_type_id = Some(3);
        assert_eq!(
            b.check(&key),
            Err(ReportError::QuoteMismatch {
                field: "room_type_id"
            })
        );
        let b = body(&QuoteKey::random(), Source::Copy, 2, Outcome::Conflict);
        assert_eq!(
            b.check(&key),
            Err(ReportError::Quote(QuoteError::BadSignature))
        );
    }

    #[test]
    fn json_bodies_are_read_field_by_field() {
        let b = TakeOutcomeBody::from_json(
            br#"{"attempt_id":"x","hotel_id":1,"room_type_id":2,"check_in":"2030-03-01",
                "check_out":"2030-03-02","rooms":1,"outcome":"taken","commit_lsn":"0/10","quote":null}"#,
        )
        .unwrap();
        assert_eq!(b.commit_lsn, Some(Lsn(16)));
        assert_eq!(b.outcome, Some(Outcome::Taken));
        assert!(b.quote.is_none());
        for (json, field) in [
            (r#"[1]"#, "body"),
            (r#"{"hotel_id":"one"}"#, "hotel_id"),
            (r#"{"outcome":"lost"}"#, "outcome"),
            (r#"{"check_in":"tomorrow"}"#, "check_in"),
            (r#"{"commit_lsn":"x"}"#, "commit_lsn"),
            (r#"{"hotel":1}"#, "body"),
            ("not json", "body"),
        ] {
            match TakeOutcomeBody::from_json(json.as_bytes()) {
                Err(ReportError::Invalid { field: f, .. }) => assert_eq!(f, field, "{json}"),
                other => panic!("{json}: {other:?}"),
            }
        }
    }

    /// A carried id keeps the time it had left, less the downtime, never
    /// more than `attempt_ttl`; a new one gets the whole `attempt_ttl`.
    #[test]
    fn carried_ids_keep_only_the_time_they_had_left() {
        let l = ledger();
        let attempt = |id: &str, left_secs: u64| CountedAttempt {
            attempt_id: id.to_string(),
            fingerprint: [3; 32],
            left: Duration::from_secs(left_secs),
        };
        let carry = StaleCarry {
            attempts: vec![attempt("a", 5), attempt("b", 600), attempt("c", 1)],
            ..StaleCarry::default()
        };
        let restored = l.restore(carry, Duration::from_secs(1), Instant::now());
        assert_eq!((restored.attempts, restored.attempts_expired), (2, 1));
        let key = QuoteKey::random();
        l.record(
            &body(&key, Source::Copy, 1, Outcome::Taken)
                .check(&key)
                .unwrap(),
        )
        .unwrap();
        let left: Vec<(String, Duration)> = l
            .carry(Instant::now())
            .attempts
            .into_iter()
            .map(|a| (a.attempt_id, a.left))
            .collect();
        let ids: Vec<&str> = left.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["a", "a-1", "b"], "in id order; c ran out");
        let within = |d: Duration, secs: u64| {
            d <= Duration::from_secs(secs) && d > Duration::from_secs(secs - 2)
        };
        assert!(
            within(left[0].1, 4),
            "5 s less the downtime: {:?}",
            left[0].1
        );
        assert!(within(left[1].1, 60), "a new report: {:?}", left[1].1);
        assert!(
            within(left[2].1, 60),
            "capped at attempt_ttl: {:?}",
            left[2].1
        );
    }

    /// What a checkpoint carries of the ids is bounded by the ledger's
    /// capacity, however many reports came.
    #[test]
    fn carried_ids_are_bounded_by_the_capacity() {
        let l = ledger();
        let key = QuoteKey::random();
        for i in 0..250 {
            let mut b = body(&key, Source::Copy, 1, Outcome::Taken);
            b.attempt_id = Some(format!("id-{i}"));
            l.record(&b.check(&key).unwrap()).unwrap();
        }
        let carried = l.carry(Instant::now());
        assert!(!carried.attempts.is_empty());
        assert!(carried.attempts.len() <= 100, "{}", carried.attempts.len());
        assert_eq!(carried.totals.taken, 250);
        assert_eq!(
            carried.totals.takes_by_source,
            vec![(Some(Source::Copy), 250)]
        );
    }

    /// A checkpoint carries fingerprints to the next build: the same
    /// report must hash the same there, so the form is pinned here, and any
    /// field changed makes another fingerprint.
    #[test]
    fn the_fingerprint_is_pinned_and_covers_every_field() {
        let report = TakeReport {
            attempt_id: "a-1".into(),
            quote: Some(Quote {
                source: Source::Copy,
                hotel_id: 1,
                room_type_id: 2,
                check_in: day(1),
                check_out: day(3),
                free_units: 4,
                lsn: Lsn(99),
                shown_at: chrono::DateTime::from_timestamp_millis(1_900_000_000_123).unwrap(),
                lag_ms: 40,
            }),
            hotel_id: 1,
            room_type_id: 2,
            check_in: day(1),
            check_out: day(3),
            rooms: 1,
            outcome: Outcome::Conflict,
            commit_lsn: None,
            quote_expired: false,
        };
        let hex: String = report
            .fingerprint()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            hex,
            "7c66a0b8f8ffb118149bf18b37b484d95624a4f98fd820c4da44bb4def3f4508"
        );
        type Mutation = fn(&mut TakeReport);
        let changes: [Mutation; 9] = [
            |r| r.attempt_id.push('x'),
            |r| r.quote = None,
            |r| r.quote.as_mut().unwrap().free_units = 5,
            |r| r.quote.as_mut().unwrap().source = Source::CopyFallback,
            |r| r.quote.as_mut().unwrap().lag_ms = 41,
            |r| r.rooms = 2,
            |r| r.check_out = day(4),
            |r| r.outcome = Outcome::Taken,
            |r| r.commit_lsn = Some(Lsn(1)),
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut other = report.clone();
            change(&mut other);
            assert_ne!(other.fingerprint(), report.fingerprint(), "change {i}");
        }
    }

    #[test]
    fn a_retry_is_answered_the_same_and_counted_once() {
        let key = QuoteKey::random();
        let l = ledger();
        let r = body(&key, Source::Copy, 3, Outcome::Conflict)
            .check(&key)
            .unwrap();
        let first = l.record(&r).unwrap();
        let second = l.record(&r).unwrap();
        let (Recording::New(a), Recording::Replay(b)) = (first, second) else {
            panic!("first new, then replay");
        };
        assert_eq!(a, b);
        assert!(a.stale_read);
        let t = l.totals();
        assert_eq!((t.conflicts, t.stale_reads, t.replays), (1, 1, 1));
        assert_eq!(l.overall().takes, 1);
        assert_eq!(l.hotel(1).stale, 1);
        // Same attempt, another outcome: refused, nothing counted.
        let mut other = r.clone();
        other.outcome = Outcome::Taken;
        assert_eq!(l.record(&other), Err(ReportError::AttemptReused));
        assert_eq!(l.totals().taken, 0);
    }

    /// A report with attempt id `id` and outcome `outcome`.
    fn numbered(key: &QuoteKey, id: usize, outcome: Outcome) -> TakeReport {
        let mut b = body(key, Source::Copy, 3, outcome);
        b.attempt_id = Some(format!("id-{id}"));
        b.check(key).unwrap()
    }

    /// A carry taken while reports are recorded holds each id with its
    /// counts or neither: an id carried without its counts would make a
    /// retry after a restart a replay that is never counted.
    #[test]
    fn a_carry_never_holds_an_id_without_its_counts() {
        let key = QuoteKey::random();
        let reports = 4_000;
        let l = Arc::new(Ledger::new(&LedgerSettings {
            attempt_capacity: 10 * reports as u64,
            attempt_ttl: Duration::from_secs(60),
            bucket_width: Duration::from_secs(5),
            buckets: 60,
            max_hotels: 10,
            max_quote_age: None,
        }));
        let sent: Vec<TakeReport> = (0..reports)
            .map(|id| numbered(&key, id, Outcome::Taken))
            .collect();
        let recorder = {
            let l = l.clone();
            std::thread::spawn(move || {
                for report in &sent {
                    l.record(report).unwrap();
                }
            })
        };
        let mut carries = 0;
        while !recorder.is_finished() || carries == 0 {
            let carry = l.carry(Instant::now());
            let counted = carry.totals.taken;
            let in_window: u64 = carry.buckets.iter().map(|b| b.overall.takes).sum();
            assert_eq!(
                (carry.attempts.len() as u64, in_window),
                (counted, counted),
                "carry {carries}: ids, window and totals must agree"
            );
            carries += 1;
        }
        recorder.join().unwrap();
    }

    /// Past its capacity the ledger forgets the oldest ids, not the newest:
    /// a retry of a recent report is still known as one and counted once.
    #[test]
    fn a_full_ledger_still_knows_its_newest_ids() {
        let key = QuoteKey::random();
        let l = ledger();
        // Each report is kept to be sent again as it was (its quote was
        // shown at a time of its own, part of its fingerprint).
        let reports: Vec<TakeReport> = (0..300)
            .map(|id| numbered(&key, id, Outcome::Taken))
            .collect();
        for report in &reports {
            assert!(matches!(l.record(report), Ok(Recording::New(_))));
            l.attempts.run_pending_tasks();
        }
        let replayed = reports[250..]
            .iter()
            .filter(|report| matches!(l.record(report), Ok(Recording::Replay(_))))
            .count();
        assert_eq!(replayed, 50, "the 50 newest ids are remembered");
        assert_eq!(l.totals().taken, 300, "no retry counted twice");
        l.attempts.run_pending_tasks();
        assert!(l.attempts.entry_count() <= 100);
    }

    /// A shared ledger counts in stream order: the first report of an id
    /// wins, the same report again is a replay, another is refused and
    /// counts nothing; the winner's sequence is kept for the answer.
    #[test]
    fn a_shared_ledger_counts_the_stream_in_order() {
        let key = QuoteKey::random();
        let l = ledger().shared();
        assert_eq!(l.begin_consuming(), 0);
        let first = numbered(&key, 1, Outcome::Conflict);
        let mut other = first.clone();
        other.outcome = Outcome::Taken;
        assert!(matches!(
            l.apply(1, &first, Duration::ZERO, Utc::now()),
            Ok(Recording::New(_))
        ));
        assert_eq!(
            l.apply(2, &other, Duration::ZERO, Utc::now()),
            Err(ReportError::AttemptReused)
        );
        assert!(matches!(
            l.apply(3, &first, Duration::ZERO, Utc::now()),
            Ok(Recording::Replay(_))
        ));
        l.skip(4);
        assert_eq!(l.applied(), 4);
        let t = l.totals();
        assert_eq!((t.conflicts, t.taken, t.replays), (1, 0, 1));
        assert_eq!(
            l.winner(&first),
            Some(Winner {
                same_report: true,
                sequence: 1,
                quote_expired: Some(false),
            })
        );
        assert_eq!(l.winner(&other).map(|w| w.same_report), Some(false));
        assert_eq!(l.winner(&numbered(&key, 2, Outcome::Taken)), None);
        // Counted at its time in the stream: one older than the window is
        // in the totals, not in the window.
        let old = numbered(&key, 5, Outcome::Taken);
        assert!(matches!(
            l.apply(5, &old, l.span() + Duration::from_secs(1), Utc::now()),
            Ok(Recording::New(_))
        ));
        assert_eq!(l.totals().taken, 1);
        assert_eq!(l.overall().takes, 1, "the conflict only");
        assert_eq!(l.carry(Instant::now()).outcomes_sequence, Some(5));
    }

    /// A standalone ledger's carry says it holds no stream position; a
    /// shared ledger takes a carry only before it consumes, and only a
    /// fleet node's.
    #[test]
    fn a_shared_ledger_restores_only_a_fleet_carry_before_it_consumes() {
        let key = QuoteKey::random();
        let standalone = ledger();
        standalone
            .record(&numbered(&key, 1, Outcome::Taken))
            .unwrap();
        let standalone_carry = standalone.carry(Instant::now());
        assert_eq!(standalone_carry.outcomes_sequence, None);

        let fleet = ledger().shared();
        let not_taken = fleet.restore(standalone_carry.clone(), Duration::ZERO, Instant::now());
        assert!(not_taken.ignored.is_some());
        assert_eq!(
            fleet.totals().taken,
            0,
            "a standalone node's counts are not the fleet's"
        );

        let source = ledger().shared();
        source.begin_consuming();
        source
            .apply(
                7,
                &numbered(&key, 1, Outcome::Taken),
                Duration::ZERO,
                Utc::now(),
            )
            .unwrap();
        let fleet_carry = source.carry(Instant::now());
        assert_eq!(fleet_carry.outcomes_sequence, Some(7));
        let taken = fleet.restore(fleet_carry.clone(), Duration::ZERO, Instant::now());
        assert_eq!((taken.ignored, taken.attempts), (None, 1));
        assert_eq!(
            fleet.begin_consuming(),
            7,
            "reads on after the carry's sequence"
        );
        assert_eq!(fleet.totals().taken, 1);
        let again = fleet.restore(fleet_carry, Duration::ZERO, Instant::now());
        assert!(again.ignored.is_some(), "not once the stream is read");
        assert_eq!(fleet.totals().taken, 1);
        // A standalone ledger restores whatever it is given, as before.
        let plain = ledger();
        let as_before = plain.restore(standalone_carry, Duration::ZERO, Instant::now());
        assert_eq!(as_before.ignored, None);
        assert_eq!(plain.totals().taken, 1);
    }

    /// A carry taken while the consumer applies is exactly "every outcome
    /// up to its sequence": never one more or one less in its counts.
    #[test]
    fn a_carry_matches_its_sequence_while_outcomes_are_applied() {
        let key = QuoteKey::random();
        let l = Arc::new(
            Ledger::new(&LedgerSettings {
                attempt_capacity: 100_000,
                attempt_ttl: Duration::from_secs(60),
                bucket_width: Duration::from_secs(5),
                buckets: 60,
                max_hotels: 10,
                max_quote_age: Some(Duration::from_secs(900)),
            })
            .shared(),
        );
        l.begin_consuming();
        let reports: Vec<TakeReport> = (1..=3000)
            .map(|i| numbered(&key, i, Outcome::Taken))
            .collect();
        let consumer = {
            let l = l.clone();
            std::thread::spawn(move || {
                for (i, report) in reports.iter().enumerate() {
                    l.apply(i as u64 + 1, report, Duration::ZERO, Utc::now())
                        .unwrap();
                }
            })
        };
        let mut seen = 0;
        while !consumer.is_finished() || seen < 3000 {
            let carry = l.carry(Instant::now());
            let at = carry.outcomes_sequence.unwrap();
            assert_eq!(carry.totals.taken, at);
            assert_eq!(carry.attempts.len() as u64, at);
            let in_window: u64 = carry.buckets.iter().map(|b| b.overall.takes).sum();
            assert_eq!(in_window, at);
            seen = at;
        }
        consumer.join().unwrap();
    }
}

//! What a checkpoint carries for the stale-read loop, as plain data.
//!
//! The loop (`crate::stale`) exports its state into these types and
//! restores from them; the checkpoint writes and reads them without
//! knowing the loop's own types. So the loop depends on the checkpoint and
//! never the other way round: the stream, which the loop reads, will write
//! checkpoints, and a dependency back from here would close a cycle.
//!
//! Times are ages, not instants: an `Instant` means nothing to the next
//! process. Each age or time left was measured when the state was taken,
//! just before the write, so the header's `written_at` dates them.

use std::time::Duration;

use crate::model::Source;

/// The stale-read loop's state across a restart: the sliding window, the
/// attempt ids already counted and the totals since the first start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StaleCarry {
    /// The window's live buckets, oldest first (ages strictly falling).
    pub buckets: Vec<WindowBucket>,
    /// Attempt ids already counted, in id order, each once.
    pub attempts: Vec<CountedAttempt>,
    pub totals: OutcomeTotals,
    /// A fleet node's: the outcome-stream sequence this state holds every
    /// outcome up to (and none after), so a node that loads it reads the
    /// stream from the next one. `None` on a standalone node, whose
    /// outcomes were posted to it alone.
    pub outcomes_sequence: Option<u64>,
}

/// One bucket of the sliding window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WindowBucket {
    /// From the bucket's start to when the state was taken.
    pub age: Duration,
    /// Every outcome in the bucket, tracked hotel or not.
    pub overall: WindowCounts,
    /// Takes of hotels the window's cap kept out.
    pub untracked: u64,
    /// Per tracked hotel, in id order, each once.
    pub hotels: Vec<(i64, WindowCounts)>,
}

/// Outcome counts over one bucket (the window's `Counts`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WindowCounts {
    pub takes: u64,
    pub conflicts: u64,
    pub stale: u64,
    pub errors: u64,
}

/// An attempt id the ledger counted: a retry of the same report is
/// answered and not counted again; another report under the id is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountedAttempt {
    pub attempt_id: String,
    /// The report's fingerprint (SHA-256 of its fields, in the fixed form
    /// `stale::outcomes` defines).
    pub fingerprint: [u8; 32],
    /// How long the ledger would still have remembered it.
    pub left: Duration,
}

/// The ledger's totals since start (`/v1/stale-reads`' `totals`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutcomeTotals {
    pub taken: u64,
    pub conflicts: u64,
    pub errors: u64,
    pub stale_reads: u64,
    pub replays: u64,
    /// Per source of the quote (`None`: no quote), each source once.
    pub conflicts_by_source: Vec<(Option<Source>, u64)>,
    pub takes_by_source: Vec<(Option<Source>, u64)>,
}

//! The `[stream]` settings: the publication, the slot and the loop's pace.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use serde::Deserialize;

use crate::model::{HeldBudget, held};
use crate::setting::InvalidSetting;

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
    /// A replication read that receives nothing for this long ends the
    /// session as dead (0: never); see `receive_timeout`.
    pub receive_timeout_ms: u64,
    /// The longest a session waits for its new slot: `CREATE_REPLICATION_SLOT`
    /// waits for every transaction open on the owner to end (see
    /// `slot_create_timeout`).
    pub slot_create_timeout_ms: u64,
    /// Past this many bytes in memory, held transactions spill to
    /// `spill_dir` (`model::held`).
    pub max_held_bytes: u64,
    /// Where held transactions spill; empty: the system's temp dir.
    pub spill_dir: String,
}

/// The least `stream.max_held_bytes`: below a spilling transaction's own
/// buffers (`held::SPILLING_BYTES`) the bound could not hold anyway.
const MIN_HELD_BYTES: u64 = 64 * 1024;

/// Spill directories already swept by this process: files of processes
/// that stopped are removed once, at the first session.
static SWEPT: LazyLock<Mutex<HashSet<PathBuf>>> = LazyLock::new(|| Mutex::new(HashSet::new()));

/// How many heartbeats a receive timeout must span at least: one late
/// heartbeat (a busy owner, a slow commit) must not end a healthy session.
const HEARTBEATS_PER_RECEIVE_TIMEOUT: u64 = 3;

impl StreamSettings {
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        for (field, name) in [
            ("stream.publication", &self.publication),
            ("stream.slot", &self.slot),
            ("stream.schema", &self.schema),
        ] {
            if !is_identifier(name) {
                return Err(InvalidSetting::new(
                    field,
                    "must be 1 to 63 lowercase letters, digits or underscores, starting with a letter or underscore",
                ));
            }
        }
        if self.reconnect_min_ms == 0 || self.reconnect_min_ms > self.reconnect_max_ms {
            return Err(InvalidSetting::new(
                "stream.reconnect_min_ms",
                "must be above 0 and at most stream.reconnect_max_ms",
            ));
        }
        if self.slot_watch_interval_ms == 0 {
            return Err(InvalidSetting::new(
                "stream.slot_watch_interval_ms",
                "must be above 0",
            ));
        }
        if self.slot_create_timeout_ms == 0 {
            return Err(InvalidSetting::new(
                "stream.slot_create_timeout_ms",
                "must be above 0",
            ));
        }
        if self.max_held_bytes < MIN_HELD_BYTES {
            return Err(InvalidSetting::new(
                "stream.max_held_bytes",
                format!("must be at least {MIN_HELD_BYTES} (64 KiB)"),
            ));
        }
        if !self.spill_dir.is_empty() && !PathBuf::from(&self.spill_dir).is_absolute() {
            return Err(InvalidSetting::new(
                "stream.spill_dir",
                "must be empty (the system temp dir) or an absolute path",
            ));
        }
        let least = self
            .heartbeat_interval_ms
            .saturating_mul(HEARTBEATS_PER_RECEIVE_TIMEOUT);
        if self.receive_timeout_ms > 0 && self.receive_timeout_ms < least {
            return Err(InvalidSetting::new(
                "stream.receive_timeout_ms",
                format!(
                    "must be 0 (off) or at least {HEARTBEATS_PER_RECEIVE_TIMEOUT} x stream.heartbeat_interval_ms ({least}): the heartbeat is what an idle owner sends"
                ),
            ));
        }
        Ok(())
    }

    /// How long a replication read may receive nothing before the session
    /// is taken for dead, like PostgreSQL's `wal_receiver_timeout`.
    ///
    /// `None` without the heartbeat: keepalives that do not move the WAL
    /// end are answered inside pg_walstream and never reach the loop, so
    /// an idle owner without heartbeats would look dead. Then only the TCP
    /// settings of `[owner]` notice a dead path.
    pub fn receive_timeout(&self) -> Option<Duration> {
        (self.receive_timeout_ms > 0 && self.heartbeat_interval_ms > 0)
            .then(|| Duration::from_millis(self.receive_timeout_ms))
    }

    /// How long a session waits for `CREATE_REPLICATION_SLOT`, which
    /// returns only once every transaction open on the owner when it began
    /// has ended (the snapshot it exports must see all or nothing of each).
    /// An `idle in transaction` session left open holds it for good; past
    /// this, the session ends with an error naming the oldest open
    /// transactions and the next one tries again. Generous on purpose: each
    /// try waits afresh for the transactions open at its own start, so on an
    /// owner whose long transactions overlap, a short bound would never let
    /// one finish.
    pub fn slot_create_timeout(&self) -> Duration {
        Duration::from_millis(self.slot_create_timeout_ms)
    }

    pub fn spill_dir(&self) -> PathBuf {
        if self.spill_dir.is_empty() {
            std::env::temp_dir()
        } else {
            PathBuf::from(&self.spill_dir)
        }
    }

    /// A new budget for one role's held transactions (a session's
    /// assembler, a replica's assembly). The first in this process sweeps
    /// the spill dir of files left by processes that stopped.
    pub fn held_budget(&self) -> HeldBudget {
        let dir = self.spill_dir();
        let first = SWEPT
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(dir.clone());
        if first {
            let removed = held::sweep_stale(&dir);
            if removed > 0 {
                tracing::info!(removed, dir = %dir.display(), "removed spill files of processes that stopped");
            }
        }
        let max = usize::try_from(self.max_held_bytes).unwrap_or(usize::MAX);
        HeldBudget::new(max, dir)
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
mod tests {
    use super::*;

    fn with(heartbeat_interval_ms: u64, receive_timeout_ms: u64) -> StreamSettings {
        StreamSettings {
            publication: "vacancy".into(),
            slot: "vacancy".into(),
            temporary_slot: false,
            schema: "public".into(),
            reconnect_min_ms: 100,
            reconnect_max_ms: 10_000,
            heartbeat_interval_ms,
            stream_in_progress: true,
            slot_watch_interval_ms: 5000,
            receive_timeout_ms,
            slot_create_timeout_ms: 1_800_000,
            max_held_bytes: 256 << 20,
            spill_dir: String::new(),
        }
    }

    #[test]
    fn the_receive_timeout_needs_the_heartbeat_and_spans_three_beats() {
        let on = with(1000, 10_000);
        on.validate().expect("the defaults");
        assert_eq!(on.receive_timeout(), Some(Duration::from_secs(10)));
        with(1000, 3000).validate().expect("three beats");
        // Off, or without the heartbeat an idle owner would look dead.
        assert_eq!(with(1000, 0).receive_timeout(), None);
        with(0, 10_000).validate().expect("no heartbeat: not armed");
        assert_eq!(with(0, 10_000).receive_timeout(), None);
        for (heartbeat, receive) in [(1000, 2999), (u64::MAX, 10_000)] {
            let e = with(heartbeat, receive).validate().unwrap_err();
            assert_eq!(e.field, "stream.receive_timeout_ms");
            assert!(e.rule.contains("stream.heartbeat_interval_ms"), "{e}");
        }
    }

    #[test]
    fn the_held_bound_and_spill_dir_are_checked() {
        let mut s = with(1000, 10_000);
        assert_eq!(s.spill_dir(), std::env::temp_dir());
        s.max_held_bytes = 1024;
        assert_eq!(s.validate().unwrap_err().field, "stream.max_held_bytes");
        s.max_held_bytes = 256 << 10;
        s.spill_dir = "relative/dir".into();
        assert_eq!(s.validate().unwrap_err().field, "stream.spill_dir");
        s.spill_dir = "/var/tmp".into();
        s.validate().expect("absolute");
        assert_eq!(s.spill_dir(), PathBuf::from("/var/tmp"));
    }
}

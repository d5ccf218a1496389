//! The projector's checkpoints: when one is loaded, when one is written,
//! and the acknowledgement they allow.
//!
//! Why here and not in `crate::checkpoint`: that module knows the file and
//! nothing of the stream. Which LSN the slot may be told, and when a file
//! may replace a snapshot, are the projector's decisions, and they need the
//! slot, the safety net's timers and the stream's status, which live here.
//!
//! - **Load** (`load_for_start`): at the first session of a process, before
//!   any snapshot: the newest checkpoint that verifies against the owner
//!   (system identifier, timeline, slot, publication, columns), then checked
//!   against the owner's WAL (not behind the file: an owner put back to an
//!   earlier point) and the slot (present, not lost, not acknowledged past
//!   the file).
//!   Anything else is a fallback to the full snapshot, with its reason in
//!   the log, in `/v1/status` and in `vacancy_checkpoint_fallbacks_total`.
//! - **Write** (`write_now`): from one published copy (immutable while
//!   held, so apply never stops), on a blocking thread, one writer at a
//!   time: every `checkpoint.interval_secs` (`run_checkpointer`), right
//!   after a snapshot, and at shutdown once apply has stopped.
//! - **Cap** (`acknowledgeable`): with checkpoints on, the slot is never
//!   told of a position past the newest durable checkpoint.
//!
//! Architecture invariant: with checkpoints on, the slot's
//! `confirmed_flush_lsn` never passes the LSN of a checkpoint that is
//! durable in the directory. So whatever kills the process, the newest
//! checkpoint plus the WAL the slot still holds is every change: no change
//! is lost, and transactions at or below the file's LSN are skipped when
//! the WAL after it is replayed.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::StreamStatus;
use super::outbox::OutboxState;
use super::refresh::Refresh;
use super::slot::SlotInfo;
use crate::checkpoint::{
    self, CheckpointError, CheckpointSettings, Identity, Loaded, StaleCarry, Written,
};
use crate::lsn::Lsn;
use crate::metrics;
use crate::model::ReadModel;

/// Why a start did not use a checkpoint it found. `reason` is a stable
/// label (the metric's), `detail` says which file and what was wrong.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Fallback {
    pub reason: &'static str,
    pub detail: String,
}

/// The checkpoint this process started from.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct LoadedFrom {
    pub file: String,
    #[schema(value_type = String)]
    pub lsn: Lsn,
    pub nights: u64,
    pub load_seconds: f64,
    /// How long before this start the file was written.
    pub age_seconds: f64,
}

/// The newest checkpoint this process wrote.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct LastWritten {
    pub file: String,
    #[schema(value_type = String)]
    pub lsn: Lsn,
    pub bytes: u64,
    pub nights: u64,
    pub write_seconds: f64,
    pub trigger: &'static str,
    pub at: DateTime<Utc>,
}

/// What `/v1/status` shows of checkpoints.
#[derive(Debug, Clone, Default, Serialize, utoipa::ToSchema)]
pub struct CheckpointReport {
    pub loaded_from: Option<LoadedFrom>,
    pub fallback: Option<Fallback>,
    pub last_written: Option<LastWritten>,
    pub last_error: Option<String>,
}

/// What triggered a write, for the log and the metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    Interval,
    /// A snapshot was just loaded: until a checkpoint covers it, a restart
    /// would take another.
    Snapshot,
    /// Graceful shutdown, after apply stopped.
    Shutdown,
}

impl Trigger {
    fn label(self) -> &'static str {
        match self {
            Trigger::Interval => "interval",
            Trigger::Snapshot => "snapshot",
            Trigger::Shutdown => "shutdown",
        }
    }
}

/// State besides the copy that a checkpoint carries across a restart: the
/// stale-read loop's windows, counted attempt ids and totals. A trait
/// because that loop (`crate::stale`) reads the stream's status, so the
/// stream cannot name it; `app` hands it over at start.
pub trait Carried: Send + Sync {
    /// What to write, taken just before the write (on its thread).
    fn carry(&self) -> StaleCarry;
    /// What a loaded checkpoint carried, written at `written_at`.
    fn restore(&self, carry: StaleCarry, written_at: DateTime<Utc>, now: DateTime<Utc>);
}

/// Checkpoints of one process: settings, who the copy belongs to, the
/// newest durable LSN, and what operators see.
pub struct Checkpoints {
    settings: CheckpointSettings,
    /// Set by each session once the owner said who it is; a write before
    /// the first session has nothing to write anyway.
    identity: Mutex<Option<Identity>>,
    /// The newest durable checkpoint's LSN (0: none yet).
    durable: AtomicU64,
    report: Mutex<CheckpointReport>,
    /// Held by the one writing thread (never across an await): a periodic
    /// write and the shutdown write must not interleave in the directory.
    writing: Mutex<()>,
    /// Wakes the checkpointer for a write now (after a snapshot).
    wake: tokio::sync::Notify,
    /// Set once by `app` before any task starts; without it (benches that
    /// run a bare projector) an empty stale-read state is written.
    carried: OnceLock<Arc<dyn Carried>>,
    /// The fleet's projector: the outbox whose stored sequence each
    /// checkpoint records, read before the copy is taken.
    outbox: OnceLock<Arc<OutboxState>>,
    /// The newest durable checkpoint with that sequence, for the fleet's
    /// uploader.
    shipped: tokio::sync::watch::Sender<Option<Durable>>,
}

/// A durable checkpoint as the fleet ships it: the file, its copy's epoch
/// and LSN, and the outbox's stored sequence read before the copy was
/// taken (every message at or below it is in the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durable {
    pub path: PathBuf,
    pub epoch: u64,
    pub lsn: Lsn,
    pub sequence: u64,
    /// The change stream `sequence` is of (`OutboxState::stored_at`); 0
    /// when the publisher had not read it yet.
    pub stream: u64,
}

impl Checkpoints {
    pub fn new(settings: CheckpointSettings) -> Arc<Checkpoints> {
        Arc::new(Checkpoints {
            settings,
            identity: Mutex::new(None),
            durable: AtomicU64::new(0),
            report: Mutex::new(CheckpointReport::default()),
            writing: Mutex::new(()),
            wake: tokio::sync::Notify::new(),
            carried: OnceLock::new(),
            outbox: OnceLock::new(),
            shipped: tokio::sync::watch::Sender::new(None),
        })
    }

    /// Records, with each checkpoint, the stored sequence of `outbox` (the
    /// fleet's projector); the first call wins.
    pub fn record_outbox(&self, outbox: Arc<OutboxState>) {
        if self.outbox.set(outbox).is_err() {
            tracing::warn!("checkpoint: the outbox was already set; the second is ignored");
        }
    }

    /// The newest durable checkpoint, with the outbox's sequence before it.
    pub fn durable_checkpoints(&self) -> tokio::sync::watch::Receiver<Option<Durable>> {
        self.shipped.subscribe()
    }

    /// Hands over the state carried besides the copy; the first call wins.
    pub fn carry_also(&self, carried: Arc<dyn Carried>) {
        if self.carried.set(carried).is_err() {
            tracing::warn!("checkpoint: the carried state was already set; the second is ignored");
        }
    }

    /// Restores what a loaded checkpoint carried besides the copy.
    pub(super) fn restore_carried(&self, carry: StaleCarry, written_at: Option<DateTime<Utc>>) {
        let (Some(carried), Some(written_at)) = (self.carried.get(), written_at) else {
            return;
        };
        carried.restore(carry, written_at, Utc::now());
    }

    pub fn enabled(&self) -> bool {
        self.settings.enabled()
    }

    pub fn interval(&self) -> Duration {
        self.settings.interval()
    }

    pub fn report(&self) -> CheckpointReport {
        self.report
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The newest durable checkpoint's LSN, if one was written or loaded.
    pub fn durable(&self) -> Option<Lsn> {
        let lsn = self.durable.load(Ordering::Acquire);
        (lsn != 0).then_some(Lsn(lsn))
    }

    /// The position the slot may be told of, the copy having applied
    /// `applied`: all of it with checkpoints off; with them on, no further
    /// than the newest durable checkpoint (0, which the server ignores,
    /// before the first).
    pub fn acknowledgeable(&self, applied: Lsn) -> Lsn {
        if !self.enabled() {
            return applied;
        }
        Lsn(applied.0.min(self.durable.load(Ordering::Acquire)))
    }

    pub(super) fn identity(&self) -> Option<Identity> {
        self.identity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(super) fn set_identity(&self, identity: Identity) {
        *self.identity.lock().unwrap_or_else(|p| p.into_inner()) = Some(identity);
    }

    /// A snapshot replaced the copy: no checkpoint covers it yet (the last
    /// one may even be of another timeline, with higher LSNs), so nothing
    /// is acknowledged until one does; ask the checkpointer for one now.
    pub fn copy_replaced(&self) {
        self.durable.store(0, Ordering::Release);
        self.wake.notify_one();
    }

    fn set_error(&self, error: Option<String>) {
        self.report
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .last_error = error;
    }

    fn fall_back(&self, reason: &'static str, detail: String) {
        tracing::warn!(reason, %detail, "checkpoint not used; taking a full snapshot");
        metrics::CHECKPOINT_FALLBACKS
            .with_label_values(&[reason])
            .inc();
        self.report
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .fallback = Some(Fallback { reason, detail });
    }

    /// The newest usable checkpoint for this start, checked against the
    /// owner (`identity`) and the slot (`slot`, as read just before), or
    /// `None` (no checkpoints, none in the directory, or a fallback, which
    /// is recorded). Reads the directory on a blocking thread.
    pub(super) async fn load_for_start(
        &self,
        identity: &Identity,
        slot: Option<&SlotInfo>,
        owner_now: Lsn,
    ) -> Option<Loaded> {
        let dir = self.settings.dir()?.to_path_buf();
        let expected = identity.clone();
        let started = Instant::now();
        let chosen = tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&dir).map_err(|source| CheckpointError::Io {
                path: dir.clone(),
                source,
            })?;
            checkpoint::choose(&dir, &expected)
        })
        .await;
        let choice = match chosen {
            Ok(Ok(choice)) => choice,
            Ok(Err(error)) => {
                self.fall_back(error.reason(), error.to_string());
                return None;
            }
            Err(join) => {
                self.fall_back("io", format!("the checkpoint reader failed: {join}"));
                return None;
            }
        };
        for skipped in &choice.skipped {
            tracing::warn!(file = %skipped.path.display(), reason = skipped.error.reason(), error = %skipped.error, "checkpoint skipped");
        }
        let Some((path, loaded)) = choice.chosen else {
            if let Some(newest) = choice.skipped.first() {
                self.fall_back(newest.error.reason(), newest.error.to_string());
            } else {
                tracing::info!("no checkpoint yet; taking a full snapshot");
            }
            return None;
        };
        let at = loaded.header.lsn();
        let file = path.display().to_string();
        // The owner's WAL behind the checkpoint, on the same system and
        // timeline: the owner was put back to an earlier point (a volume
        // snapshot restored, a base backup brought up without a new
        // timeline). The copy holds commits the owner no longer has, and a
        // stream started at the checkpoint would skip the owner's new
        // commits below it: only a snapshot is right.
        if at > owner_now {
            self.fall_back(
                "owner_behind",
                format!(
                    "{file} is at {at}, past the owner's WAL at {owner_now}: the owner was put back to an earlier point"
                ),
            );
            return None;
        }
        match slot {
            None => {
                self.fall_back(
                    "slot_missing",
                    format!(
                        "{file} is at {at}, but the slot is gone: the WAL after it is not kept"
                    ),
                );
                return None;
            }
            Some(info) if info.is_lost() => {
                self.fall_back(
                    "slot_lost",
                    format!(
                        "{file} is at {at}, but the slot is lost: the WAL after it was removed"
                    ),
                );
                return None;
            }
            Some(SlotInfo {
                confirmed_flush: Some(confirmed),
                ..
            }) if *confirmed > at => {
                self.fall_back(
                    "slot_ahead",
                    format!("{file} is at {at}, but the slot was acknowledged to {confirmed}: the changes between are gone"),
                );
                return None;
            }
            Some(_) => {}
        }
        let age = loaded.header.written_at().map_or(0.0, |w| {
            (Utc::now() - w).num_milliseconds().max(0) as f64 / 1e3
        });
        self.durable.fetch_max(at.0, Ordering::AcqRel);
        metrics::CHECKPOINT_LOADS.inc();
        let mut report = self.report.lock().unwrap_or_else(|p| p.into_inner());
        report.loaded_from = Some(LoadedFrom {
            file,
            lsn: at,
            nights: loaded.nights,
            load_seconds: started.elapsed().as_secs_f64(),
            age_seconds: age,
        });
        report.fallback = None;
        Some(loaded)
    }

    /// Writes a checkpoint of the published copy now, on a blocking thread,
    /// and raises the durable LSN. `None` when there is nothing to write:
    /// checkpoints off, no owner identity yet, no copy, or (except at
    /// shutdown) a copy no newer than the last durable checkpoint.
    pub async fn write_now(
        self: &Arc<Checkpoints>,
        model: &Arc<ReadModel>,
        refresh: &Arc<Refresh>,
        trigger: Trigger,
    ) -> Option<Result<Written, CheckpointError>> {
        let dir: PathBuf = self.settings.dir()?.to_path_buf();
        let identity = self
            .identity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()?;
        if !model.freshness.is_loaded() {
            return None;
        }
        let written_under = (identity.system_identifier, identity.timeline);
        // On the interval, a copy no newer than the last checkpoint is not
        // written again. At shutdown it is: the stale-read state it
        // carries moves without the owner (a same-named file is replaced
        // atomically by the rename).
        if trigger != Trigger::Shutdown && self.durable() >= Some(model.freshness.applied()) {
            return None;
        }
        let me = self.clone();
        let copy = model.clone();
        let timers = refresh.clone();
        let carried = self.carried.get().cloned();
        // Before the copy is taken (inside the writer): a message stored by
        // then is in the copy.
        let sequence = self.outbox.get().map(|o| o.stored_at());
        let started = Instant::now();
        let written = tokio::task::spawn_blocking(move || {
            let _one_writer = me.writing.lock().unwrap_or_else(|p| p.into_inner());
            std::fs::create_dir_all(&dir).map_err(|source| CheckpointError::Io {
                path: dir.clone(),
                source,
            })?;
            let ttl = timers.remaining();
            let stale = carried.map_or_else(StaleCarry::default, |c| c.carry());
            checkpoint::write_model(&dir, &identity, &copy, &ttl, &stale)
        })
        .await
        .unwrap_or_else(|join| {
            Err(CheckpointError::Unwritable(format!(
                "the checkpoint writer failed: {join}"
            )))
        });
        let seconds = started.elapsed().as_secs_f64();
        // A file of an owner timeline the projector has left (written while
        // a failover's session started) covers nothing the slot of the new
        // owner holds: its LSN must not raise what may be acknowledged.
        let same_owner = self
            .identity()
            .is_some_and(|now| (now.system_identifier, now.timeline) == written_under);
        match &written {
            Ok(w) if !same_owner => {
                tracing::warn!(file = %w.path.display(), "checkpoint written of an owner timeline the stream has left; it does not count as durable");
            }
            Ok(w) => {
                self.durable.fetch_max(w.name.lsn.0, Ordering::AcqRel);
                metrics::CHECKPOINT_WRITES
                    .with_label_values(&[trigger.label(), "ok"])
                    .inc();
                metrics::CHECKPOINT_WRITE_DURATION.observe(seconds);
                metrics::CHECKPOINT_BYTES.set(w.bytes as i64);
                tracing::info!(file = %w.path.display(), lsn = %w.name.lsn, bytes = w.bytes, seconds, trigger = trigger.label(), "checkpoint written");
                let mut report = self.report.lock().unwrap_or_else(|p| p.into_inner());
                report.last_written = Some(LastWritten {
                    file: w.path.display().to_string(),
                    lsn: w.name.lsn,
                    bytes: w.bytes,
                    nights: w.nights,
                    write_seconds: seconds,
                    trigger: trigger.label(),
                    at: Utc::now(),
                });
                report.last_error = None;
                drop(report);
                if let Some(sequence) = sequence {
                    self.shipped.send_replace(Some(Durable {
                        path: w.path.clone(),
                        epoch: w.epoch,
                        lsn: w.name.lsn,
                        sequence: sequence.sequence,
                        stream: sequence.stream,
                    }));
                }
            }
            Err(error) => {
                metrics::CHECKPOINT_WRITES
                    .with_label_values(&[trigger.label(), "error"])
                    .inc();
                tracing::error!(%error, trigger = trigger.label(), "checkpoint write failed; the slot stays at the last durable one");
                self.set_error(Some(error.to_string()));
            }
        }
        Some(written)
    }
}

/// Writes a checkpoint every `checkpoint.interval_secs`, and soon after a
/// snapshot, while the copy is not being rebuilt. Returns at shutdown; the
/// shutdown checkpoint is the projector's, written once apply has stopped.
/// With `only_while` (a fleet projector's "holds the slot"), checkpoints
/// are written only while it is set: a standby's would be of a follower's
/// copy, named with the stream sequence its publisher stored when it last
/// held the slot, and uploaded beside the active projector's, where a
/// replica could take one of them for the newest.
pub async fn run_checkpointer(
    checkpoints: Arc<Checkpoints>,
    model: Arc<ReadModel>,
    refresh: Arc<Refresh>,
    status: Arc<StreamStatus>,
    only_while: Option<Arc<std::sync::atomic::AtomicBool>>,
    shutdown: CancellationToken,
) {
    if !checkpoints.enabled() {
        return;
    }
    let mut ticker = tokio::time::interval(checkpoints.interval());
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await; // the first tick is immediate: nothing to write yet
    loop {
        let trigger = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = checkpoints.wake.notified() => Trigger::Snapshot,
            _ = ticker.tick() => Trigger::Interval,
        };
        // A copy being replaced serves marked stale, and its slot is being
        // replaced too: a checkpoint of it could not be resumed.
        if status.resnapshotting.load(Ordering::Acquire) {
            continue;
        }
        if only_while
            .as_ref()
            .is_some_and(|active| !active.load(Ordering::Acquire))
        {
            continue;
        }
        checkpoints.write_now(&model, &refresh, trigger).await;
    }
}

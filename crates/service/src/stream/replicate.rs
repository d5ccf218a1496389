//! The replication loop: the one writer of the read model.
//!
//! Per session: connect, make sure the publication exists, then either take
//! a new snapshot (no copy yet, or the slot is missing or lost) or resume the
//! slot from the last applied LSN. Events are assembled into whole
//! transactions, applied atomically, and only then acknowledged.
//!
//! Invariants:
//! - The flush/apply LSN sent to the server never passes what the copy has
//!   applied. It is the `end_lsn` of the last applied commit, or, when no
//!   transaction of ours is open, the WAL end a keepalive reported, so an
//!   owner that only writes other tables does not pin WAL behind the slot.
//! - `next_event` is never cancelled mid-call except to end the session (at
//!   shutdown, for a requested resnapshot, or after `stream.receive_timeout_ms`
//!   of silence, when the connection is taken for dead and dropped):
//!   keepalives are answered only inside it. Apply is synchronous and short.
//! - A session that fails is dropped whole and the next one resumes from the
//!   applied LSN; transactions delivered again are skipped by commit LSN.
//! - At shutdown the last status update carries the applied LSN, then the
//!   COPY is ended and the connection closed: the slot's
//!   `confirmed_flush_lsn` is exactly what the copy had applied.
//! - A requested resnapshot (`StreamStatus::request_resnapshot`) ends the
//!   session like shutdown does; the next one drops the slot and takes a
//!   new snapshot while the old copy serves.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use pg_walstream::{
    CancellationToken, LogicalReplicationStream, ReplicationError, ReplicationSlotOptions,
    ReplicationStreamConfig, RetryConfig, StreamingMode,
};
use rand::RngExt;

use super::StreamSettings;
use super::checkpoints::{Checkpoints, Trigger};
use super::outbox::{Outbox, Outgoing, Reserved};
use super::refresh::Refresh;
use super::slot::{self, SlotError, SlotInfo};
use super::snapshot::{self, SnapshotError, SnapshotProgress};
use super::txn::{AssembleError, Assembled, Assembler};
use crate::checkpoint::{Identity, Loaded};
use crate::index::HotelIndex;
use crate::lsn::Lsn;
use crate::metrics;
use crate::model::{ApplyError, ReadModel};
use crate::owner::identity::{Observed, OwnerPin, OwnerReport};
use crate::owner::{self, Endpoint, OwnerError, OwnerIdentity, OwnerSettings};

/// A transaction that keeps the loop from the stream this long is logged
/// (`vacancy_stream_loop_stalls_total`): a commit behind it waits that long.
const STALL: Duration = Duration::from_millis(250);

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    Owner(#[from] OwnerError),
    #[error(transparent)]
    Slot(#[from] SlotError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error("replication: {0}")]
    Replication(#[from] ReplicationError),
    #[error("stream decode: {0}")]
    Assemble(#[from] AssembleError),
    #[error("apply: {0}")]
    Apply(#[from] ApplyError),
    #[error("the slot was created but exported no snapshot")]
    NoSnapshotExported,
    /// `CREATE_REPLICATION_SLOT` did not return within
    /// `stream.slot_create_timeout_ms`: transactions open on the owner.
    #[error(
        "creating slot {slot:?} waited {after:?} (stream.slot_create_timeout_ms) for transactions open on the owner to end: {open}"
    )]
    SlotCreateTimeout {
        slot: String,
        after: Duration,
        open: String,
    },
    #[error("slot {slot:?} is still held by walsender pid {pid:?}; waiting for it to exit")]
    SlotBusy { slot: String, pid: Option<i32> },
    #[error("the outbox's carrier (the fleet's publisher) has stopped")]
    OutboxClosed,
    #[error(
        "nothing received from the owner for {0:?} (stream.receive_timeout_ms): the replication connection is taken for dead"
    )]
    ReceiveTimeout(Duration),
    /// A position no server reaches (the last of the LSN space), from a
    /// broken owner or something between: taken as the end of the WAL, it
    /// would be acknowledged and every later commit skipped as a replay.
    #[error("the owner sent the WAL position {0}, past any a server writes; the session is ended")]
    ImpossiblePosition(Lsn),
}

/// How often a session whose new slot waits on open transactions reads
/// which they are (`Projector::create_slot`): often enough for an operator
/// looking at `/v1/status`, one cheap query a second.
const SLOT_WAIT_LOOK_EVERY: Duration = Duration::from_secs(1);

/// What the session is waiting for, in `/v1/status` while it waits: cleared
/// when the wait ends however it ends (done, failed, or dropped at
/// shutdown).
struct WaitingFor<'s>(&'s StreamStatus);

impl WaitingFor<'_> {
    fn set(&self, what: String) {
        self.0.set_waiting_for(Some(what));
    }
}

impl Drop for WaitingFor<'_> {
    fn drop(&mut self) {
        self.0.set_waiting_for(None);
    }
}

/// What operators see of the stream in `/v1/status`.
#[derive(Debug, Default)]
pub struct StreamStatus {
    pub connected: AtomicBool,
    pub snapshot: SnapshotProgress,
    /// Set while a new snapshot replaces a copy that can no longer be
    /// resumed: the old copy keeps serving, marked stale.
    pub resnapshotting: AtomicBool,
    last_error: Mutex<Option<String>>,
    /// What the session waits for on the owner, while it waits (a new slot
    /// behind open transactions).
    waiting_for: Mutex<Option<String>>,
    slot: Mutex<Option<SlotInfo>>,
    /// Resnapshots asked for by an operator, and how many of those asks the
    /// last completed snapshot answered. Counters, not a flag: an ask that
    /// arrives while a snapshot is already loading wants one taken after it.
    resnapshots_requested: AtomicU64,
    resnapshots_served: AtomicU64,
    /// The running stream session's token: cancelling it ends the session at
    /// once (even inside a read), so an ask does not wait for the next event.
    session: Mutex<Option<CancellationToken>>,
    /// The owner's WAL rate, from the slot watch's samples: the last
    /// sample and a moving average in bytes per second.
    wal_rate: Mutex<Option<WalRate>>,
    /// Which owner the sessions reached (`owner::identity`), registered by
    /// the projector; none on a node that never streams (a replica).
    owner: std::sync::OnceLock<Arc<OwnerPin>>,
}

#[derive(Debug, Clone, Copy)]
struct WalRate {
    at: Instant,
    position: Lsn,
    bytes_per_second: f64,
}

impl StreamStatus {
    pub fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(crate) fn set_last_error(&self, error: Option<String>) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = error;
    }

    pub fn waiting_for(&self) -> Option<String> {
        self.waiting_for
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_waiting_for(&self, what: Option<String>) {
        *self.waiting_for.lock().unwrap_or_else(|p| p.into_inner()) = what;
    }

    pub fn slot(&self) -> Option<SlotInfo> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn set_slot(&self, info: Option<SlotInfo>) {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = info;
    }

    /// Asks the projector to take a new snapshot (and a new slot) while the
    /// current copy keeps serving; the new copy replaces it whole.
    pub fn request_resnapshot(&self) {
        self.resnapshots_requested.fetch_add(1, Ordering::SeqCst);
        let session = self.session.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(token) = session.as_ref() {
            token.cancel();
        }
    }

    /// The ask count a snapshot started now would answer, if it is ahead of
    /// what the last snapshot answered.
    pub(crate) fn pending_resnapshot(&self) -> Option<u64> {
        let requested = self.resnapshots_requested.load(Ordering::SeqCst);
        (requested > self.resnapshots_served.load(Ordering::SeqCst)).then_some(requested)
    }

    /// How many operator asks the copies swapped in so far have answered.
    pub fn resnapshots_served(&self) -> u64 {
        self.resnapshots_served.load(Ordering::SeqCst)
    }

    pub(crate) fn resnapshot_served(&self, asked: u64) {
        self.resnapshots_served.fetch_max(asked, Ordering::SeqCst);
    }

    /// Notes the owner's WAL position as the slot watch read it now.
    pub(crate) fn note_owner_wal(&self, position: Lsn) {
        let now = Instant::now();
        let mut rate = self.wal_rate.lock().unwrap_or_else(|p| p.into_inner());
        let bytes_per_second = match *rate {
            Some(last) if now > last.at => {
                let seconds = now.duration_since(last.at).as_secs_f64();
                let sample = last.position.bytes_until(position) as f64 / seconds;
                // A moving average over about ten samples: one burst does
                // not set off a warning, a steady rate does.
                last.bytes_per_second * 0.9 + sample * 0.1
            }
            Some(last) => last.bytes_per_second,
            None => 0.0,
        };
        *rate = Some(WalRate {
            at: now,
            position,
            bytes_per_second,
        });
    }

    /// The owner's recent WAL rate, in bytes per second (0 until measured).
    pub fn wal_bytes_per_second(&self) -> f64 {
        self.wal_rate
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map_or(0.0, |r| r.bytes_per_second)
    }

    /// The owner system and timeline the sessions reached, and when they
    /// last changed (`/v1/status` `owner`); `None` without a projector.
    pub fn owner_report(&self) -> Option<OwnerReport> {
        self.owner.get().map(|pin| pin.report())
    }

    /// Registers the running session's token (or clears it).
    fn set_session(&self, token: Option<CancellationToken>) {
        *self.session.lock().unwrap_or_else(|p| p.into_inner()) = token;
    }
}

/// The projector: owner stream in, read model out.
pub struct Projector {
    owner: OwnerSettings,
    stream: StreamSettings,
    model: Arc<ReadModel>,
    status: Arc<StreamStatus>,
    refresh: Arc<Refresh>,
    index: Arc<HotelIndex>,
    checkpoints: Arc<Checkpoints>,
    /// In the fleet's projector role: where applied changes are handed over
    /// (`outbox`), and what caps the slot's acknowledgement.
    outbox: Option<Outbox>,
    yield_when_slot_busy: bool,
    /// The walsender of this process's last streaming session. A session
    /// given up on a dead path leaves it on the owner, holding the slot,
    /// until the owner's `wal_sender_timeout` (60 s by default) notices;
    /// the next session ends it rather than wait (`wait_slot_released`).
    own_walsender: Mutex<Option<slot::Walsender>>,
    /// Where the last streaming session asked to start: the walsender
    /// sends nothing of what committed before it (`walsender_busy`). Above
    /// the slot's confirmed position when a checkpoint is ahead of it, so
    /// not what the stream's first keepalive says.
    session_start: Mutex<Lsn>,
    /// A session saw the owner change and the copy has not been replaced
    /// by a snapshot of the new one yet: set until that snapshot is in, so
    /// a session that fails before it does not resume the old copy there.
    owner_change_pending: AtomicBool,
}

/// Why `Projector::run_until` returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    Shutdown,
    /// Another walsender holds the slot (only with `yield_when_slot_busy`).
    SlotBusy,
    /// The outbox's carrier stopped (a fenced fleet projector).
    OutboxClosed,
}

/// How a session that did not fail ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SessionEnd {
    /// The shutdown token: the last acknowledgement is sent, the connection closed.
    Shutdown,
    /// An operator asked for a new snapshot: start the next session at once.
    Resnapshot,
}

/// Why a session took a new snapshot.
#[derive(Debug, Clone, Copy)]
enum SnapshotReason {
    Initial,
    SlotMissing,
    SlotLost,
    /// The slot was acknowledged past the copy's applied position.
    SlotAhead,
    /// An operator asked (`POST /v1/admin/resnapshot`).
    Requested,
    /// The session reached another owner system or timeline than the copy
    /// came from (a promoted standby): the copy may hold commits the new
    /// primary never had, and its LSNs mean nothing on the new timeline.
    OwnerChanged,
}

impl SnapshotReason {
    fn label(self) -> &'static str {
        match self {
            SnapshotReason::Initial => "initial",
            SnapshotReason::SlotMissing => "slot_missing",
            SnapshotReason::SlotLost => "slot_lost",
            SnapshotReason::SlotAhead => "slot_ahead",
            SnapshotReason::Requested => "requested",
            SnapshotReason::OwnerChanged => "owner_changed",
        }
    }
}

impl Projector {
    pub fn new(
        owner: OwnerSettings,
        stream: StreamSettings,
        model: Arc<ReadModel>,
        status: Arc<StreamStatus>,
        refresh: Arc<Refresh>,
        index: Arc<HotelIndex>,
        checkpoints: Arc<Checkpoints>,
    ) -> Projector {
        // The same pin every clone of these settings holds; a second
        // projector of one service (a fleet standby's next turn) shares it.
        let _ = status.owner.set(owner.pin.clone());
        Projector {
            owner,
            stream,
            model,
            status,
            refresh,
            index,
            checkpoints,
            outbox: None,
            yield_when_slot_busy: false,
            own_walsender: Mutex::new(None),
            session_start: Mutex::new(Lsn::ZERO),
            owner_change_pending: AtomicBool::new(false),
        }
    }

    /// Ends `run_until` when the slot is held by another walsender.
    pub fn yield_when_slot_busy(mut self) -> Projector {
        self.yield_when_slot_busy = true;
        self
    }

    /// Hands every committed transaction and keepalive advance to `outbox`
    /// (the fleet's projector), and acknowledges the slot only as far as
    /// its carrier stored them.
    pub fn with_outbox(mut self, outbox: Outbox) -> Projector {
        self.outbox = Some(outbox);
        self
    }

    /// Runs sessions until `shutdown`, reconnecting with backoff and jitter.
    pub async fn run(self, shutdown: CancellationToken) {
        self.run_until(&shutdown).await;
    }

    /// As `run`, and says why it stopped. With `yield_when_slot_busy`
    /// (the fleet's projector), a slot another walsender holds ends it
    /// (`RunEnd::SlotBusy`) instead of being retried, so the caller can
    /// follow the stream as a standby meanwhile.
    pub async fn run_until(&self, shutdown: &CancellationToken) -> RunEnd {
        let min = Duration::from_millis(self.stream.reconnect_min_ms);
        let max = Duration::from_millis(self.stream.reconnect_max_ms);
        let mut backoff = min;
        loop {
            let started = Instant::now();
            // Until streaming starts (connect, slot, snapshot) a session has
            // nothing to acknowledge, so shutdown may drop it where it is;
            // once streaming, the loop itself ends on shutdown after its
            // last acknowledgement.
            let outcome = match self.prepare(shutdown).await {
                Ok(Some(mut stream)) => self.stream_session(&mut stream, shutdown).await,
                Ok(None) => {
                    // Shutdown while connecting: no stream to acknowledge
                    // on, but a copy from before may be newer than the
                    // last checkpoint.
                    self.final_checkpoint().await;
                    Ok(SessionEnd::Shutdown)
                }
                Err(error) => Err(error),
            };
            self.status.connected.store(false, Ordering::Release);
            metrics::STREAM_CONNECTED.set(0);
            if shutdown.is_cancelled() {
                if !matches!(outcome, Ok(SessionEnd::Shutdown)) {
                    // Stopped by an error that raced shutdown: nothing can
                    // be acknowledged, but the copy is still worth a
                    // checkpoint for the next start.
                    self.final_checkpoint().await;
                }
                return RunEnd::Shutdown;
            }
            match outcome {
                Ok(SessionEnd::Shutdown) => return RunEnd::Shutdown,
                Ok(SessionEnd::Resnapshot) => {
                    tracing::info!("stream session ended for a requested resnapshot");
                    backoff = min;
                    continue;
                }
                Err(StreamError::SlotBusy { slot, pid }) if self.yield_when_slot_busy => {
                    tracing::info!(%slot, ?pid, "the slot is held by another walsender; standing by");
                    return RunEnd::SlotBusy;
                }
                Err(StreamError::OutboxClosed) => {
                    tracing::error!("the outbox's carrier stopped; this projector stops applying");
                    return RunEnd::OutboxClosed;
                }
                Err(error) => {
                    metrics::RECONNECTS.inc();
                    tracing::warn!(%error, "replication session ended; reconnecting");
                    self.status.set_last_error(Some(error.to_string()));
                }
            }
            // A session that ran a while was healthy: start the backoff over.
            if started.elapsed() > Duration::from_secs(30) {
                backoff = min;
            }
            let jitter = rand::rng().random_range(0.5..1.0);
            let wait = backoff.mul_f64(jitter);
            backoff = (backoff * 2).min(max);
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    self.final_checkpoint().await;
                    return RunEnd::Shutdown;
                }
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// The shutdown checkpoint, apply having stopped. Writes nothing with
    /// checkpoints off or when the last checkpoint already holds the copy.
    async fn final_checkpoint(&self) -> Option<Lsn> {
        if self.status.resnapshotting.load(Ordering::Acquire) {
            return None;
        }
        match self
            .checkpoints
            .write_now(&self.model, &self.refresh, Trigger::Shutdown)
            .await
        {
            Some(Ok(written)) => Some(written.name.lsn),
            Some(Err(_)) | None => None,
        }
    }

    /// Connects, then takes a snapshot or resumes, up to a started stream;
    /// `None` when shutdown came first.
    async fn prepare(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<Option<LogicalReplicationStream>, StreamError> {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => Ok(None),
            started = self.connect_and_start() => started.map(Some),
        }
    }

    async fn connect_and_start(&self) -> Result<LogicalReplicationStream, StreamError> {
        let s = &self.stream;
        // Resolved per session: both connections get the same URL, password
        // and TLS, and a rotated password file counts from the next session.
        let endpoint = Endpoint::from_settings(&self.owner).map_err(OwnerError::from)?;
        let mut client = endpoint.connect(self.owner.connect_timeout()).await?;
        // Held on `client` until the stream has started (it is dropped
        // then): no other projector decides about the slot meanwhile.
        self.lock_slot(&client).await?;
        slot::ensure_publication(&client, &s.publication, &s.schema).await?;
        let mut info = slot::slot_info(&client, &s.slot).await?;
        // Before anything is decided from it (a checkpoint made on it
        // loaded, the slot dropped to be made again): a slot of this name
        // in another database of the cluster is not ours to use or drop.
        if let Some(found) = &info {
            found.check_database(&s.slot)?;
        }
        if info.as_ref().is_some_and(|i| i.active) {
            // Held by a walsender: usually the last process's, which has
            // not noticed its client is gone. Wait for it (bounded; the
            // session retries) rather than take the slot from whoever holds
            // it or decide anything from a position still moving.
            info = self.wait_slot_released(&client).await?;
            // Read again: what holds the name now may be another database's.
            if let Some(found) = &info {
                found.check_database(&s.slot)?;
            }
        }
        let streaming = if s.stream_in_progress {
            StreamingMode::On
        } else {
            StreamingMode::Off
        };
        let config = ReplicationStreamConfig::builder(s.slot.clone(), s.publication.clone())
            .with_protocol_version(if s.stream_in_progress { 2 } else { 1 })
            .with_streaming_mode(streaming)
            .with_messages(true)
            .with_feedback_interval(Duration::from_secs(1))
            .with_connection_timeout(self.owner.connect_timeout())
            // Our own loop owns reconnects; the library must not retry behind it.
            .with_retry_config(RetryConfig {
                max_attempts: 1,
                ..RetryConfig::default()
            })
            .with_slot_options(ReplicationSlotOptions {
                temporary: s.temporary_slot,
                // Used only when this session creates the slot, which it
                // does only to take a snapshot.
                snapshot: Some("export".to_string()),
                ..ReplicationSlotOptions::default()
            })
            // Never create a slot behind our back: a slot made without a
            // snapshot would leave a gap no one sees.
            .with_existing_slot_required(true);
        // Opened before the snapshot-or-resume decision: its
        // IDENTIFY_SYSTEM says which cluster and timeline a checkpoint
        // must have been made on.
        let mut stream =
            LogicalReplicationStream::new(endpoint.replication_conninfo(), config).await?;
        let seen = {
            let server = stream.server_identity();
            OwnerIdentity {
                system_identifier: server.system_id(),
                timeline: server.timeline(),
            }
        };
        // The snapshot, the slot's state and the publication are read on
        // `client`: with a multi-host owner.url it must have reached the
        // same server as the stream.
        let client_reached = tokio::time::timeout(
            self.owner.query_timeout(),
            crate::owner::identity::read(&client),
        )
        .await
        .map_err(|_| OwnerError::IdentityTimeout(self.owner.query_timeout()))?
        .map_err(OwnerError::from)?;
        if client_reached != seen {
            metrics::OWNER_CONNECTIONS_REFUSED.inc();
            return Err(OwnerError::OtherServer {
                expected: seen,
                found: client_reached,
            }
            .into());
        }
        // Before the checkpoints learn the new identity: a copy of the old
        // owner must never be written under the new one's name.
        let owner_changed = self.note_owner(seen);
        if self.checkpoints.enabled() {
            let server = stream.server_identity();
            self.checkpoints.set_identity(Identity {
                system_identifier: server.system_id(),
                timeline: server.timeline(),
                slot: s.slot.clone(),
                publication: s.publication.clone(),
                columns_fingerprint: slot::columns_fingerprint(&client, &s.publication).await?,
            });
        }
        // Read before the snapshot starts: an ask that arrives later wants a
        // snapshot taken after it, so it is not marked answered by this one.
        let asked = self.status.pending_resnapshot();
        if !self.model.freshness.is_loaded() && asked.is_none() {
            self.start_from_checkpoint(&client, info.as_ref()).await?;
        }
        let reason = match &info {
            _ if !self.model.freshness.is_loaded() => Some(SnapshotReason::Initial),
            // Even with a slot of that name there (made by hand, or a
            // failover slot of a newer PostgreSQL): the copy may hold
            // commits the new primary lacks, which only a snapshot removes.
            _ if owner_changed => Some(SnapshotReason::OwnerChanged),
            None => Some(SnapshotReason::SlotMissing),
            Some(i) if i.is_lost() => Some(SnapshotReason::SlotLost),
            // Acknowledged past what the copy holds (by another process on
            // the same slot, or an operator's pg_replication_slot_advance):
            // the server would start there and the changes between would
            // never arrive.
            Some(i)
                if i.confirmed_flush
                    .is_some_and(|c| c > self.model.freshness.applied()) =>
            {
                Some(SnapshotReason::SlotAhead)
            }
            Some(_) if asked.is_some() => Some(SnapshotReason::Requested),
            Some(_) => None,
        };
        if let Some(reason) = reason {
            if info.is_some() {
                // A slot we cannot resume (no copy to resume into, or its WAL
                // is gone) only pins WAL: replace it.
                slot::drop_slot(&client, &s.slot).await?;
            }
            match reason {
                SnapshotReason::Initial => {}
                SnapshotReason::Requested => {
                    tracing::warn!(slot = %s.slot, reason = reason.label(), "resnapshot requested; taking a new snapshot while the old copy serves, marked stale");
                    self.status.resnapshotting.store(true, Ordering::Release);
                    self.model.freshness.set_replacing(true);
                }
                SnapshotReason::SlotMissing
                | SnapshotReason::SlotLost
                | SnapshotReason::SlotAhead
                | SnapshotReason::OwnerChanged => {
                    tracing::error!(slot = %s.slot, reason = reason.label(), "slot cannot be resumed; taking a new snapshot while the old copy serves, marked stale");
                    self.status.resnapshotting.store(true, Ordering::Release);
                    self.model.freshness.set_replacing(true);
                }
            }
        }

        let start_at = if let Some(reason) = reason {
            // The snapshot is the owner as of the slot's creation: its
            // age from here is the copy's lag until a commit is applied.
            let consistent_at = Utc::now();
            self.create_slot(&mut stream, &client).await?;
            let name = stream
                .exported_snapshot_name()
                .ok_or(StreamError::NoSnapshotExported)?
                .to_string();
            let tables = snapshot::load(
                &mut client,
                &name,
                &s.slot,
                &s.schema,
                &self.status.snapshot,
            )
            .await?;
            // Read after the load: the copy is as of the slot's creation,
            // and a load of millions of rows takes the better part of a
            // minute, while the owner commits on. Until the copy has
            // applied this, it is not caught up and its lag is not 0
            // (`ReadModel::replace_behind`); swapped in as "as new as the
            // owner", a node answered ready with lag 0 from a copy as old
            // as its load until the slot's watch next looked.
            let owner_now = slot::current_wal_lsn(&client).await?;
            let mut tables = self.stamp_new_copy(tables, seen, reason);
            tables.commit_time = tables.commit_time.or(Some(consistent_at));
            let at = tables.applied;
            self.refresh.reset(&tables);
            self.index.copy_coming();
            self.model.replace_behind(tables, owner_now);
            self.owner_change_pending.store(false, Ordering::Release);
            self.index.mark_all();
            self.status.resnapshotting.store(false, Ordering::Release);
            self.model.freshness.set_replacing(false);
            if let Some(asked) = asked {
                self.status.resnapshot_served(asked);
            }
            metrics::RESNAPSHOTS
                .with_label_values(&[reason.label()])
                .inc();
            // Until a checkpoint covers the new copy, a restart would take
            // another snapshot and the slot cannot be acknowledged.
            self.checkpoints.copy_replaced();
            if let Some(outbox) = &self.outbox {
                outbox.state().copy_replaced(self.model.read().epoch);
            }
            at
        } else {
            // With checkpoints on, from the newest durable one rather than
            // from what was applied: `start` tells the server its start
            // point is processed, and the slot must not pass a checkpoint.
            // What is replayed between the two is skipped by commit LSN.
            let confirmed = info.as_ref().and_then(|i| i.confirmed_flush);
            let checkpointed = self
                .checkpoints
                .acknowledgeable(self.model.freshness.applied());
            match (&self.outbox, confirmed) {
                // With an outbox, from the slot's own position: it was
                // acknowledged only as far as the carrier stored, so what
                // the copy holds past it (a checkpoint written before the
                // carrier stored it) is replayed and handed over again.
                (Some(_), Some(confirmed)) => confirmed,
                _ => checkpointed.max(confirmed.unwrap_or(Lsn::ZERO)),
            }
        };
        stream.start(Some(start_at.0)).await?;
        *self.session_start.lock().unwrap_or_else(|p| p.into_inner()) = start_at;
        self.note_own_walsender(&client).await;
        drop(client);
        self.status.connected.store(true, Ordering::Release);
        self.status.set_last_error(None);
        metrics::STREAM_CONNECTED.set(1);
        tracing::info!(slot = %s.slot, from = %start_at, "streaming");
        Ok(stream)
    }

    /// Creates the session's slot (`CREATE_REPLICATION_SLOT`), which
    /// returns only once every transaction open on the owner when it began
    /// has ended. While it waits, `/v1/status` `waiting_for` names the
    /// oldest of them (read on `client` every `SLOT_WAIT_LOOK_EVERY`); past
    /// `stream.slot_create_timeout_ms` the session ends with them as its
    /// error. The walsender creating the slot waits on those transactions
    /// and does not notice its client is gone, so given up on it is
    /// cancelled (`slot::cancel_creation`): its error drops the half-made
    /// slot, and the next session's try is not refused as a busy slot. Not
    /// at shutdown, which drops the wait where it is: the next start finds
    /// the slot busy (`SlotBusy`, retried) until those transactions end.
    async fn create_slot(
        &self,
        stream: &mut LogicalReplicationStream,
        client: &tokio_postgres::Client,
    ) -> Result<(), StreamError> {
        let limit = self.stream.slot_create_timeout();
        let deadline = tokio::time::Instant::now() + limit;
        let create = stream.ensure_replication_slot();
        tokio::pin!(create);
        let waiting = WaitingFor(&self.status);
        let mut open = String::from("none seen");
        let created = loop {
            let look_at = (tokio::time::Instant::now() + SLOT_WAIT_LOOK_EVERY).min(deadline);
            if let Ok(created) = tokio::time::timeout_at(look_at, &mut create).await {
                break created;
            }
            // Bounded like every other query, so a look never holds the
            // wait past its own bound by more than one query timeout.
            let looked = tokio::time::timeout(
                self.owner.query_timeout(),
                slot::open_transactions(client, 3),
            )
            .await;
            if let Ok(Ok(found)) = looked {
                open = if found.is_empty() {
                    "none with an xid now".to_string()
                } else {
                    found.join("; ")
                };
            }
            if tokio::time::Instant::now() >= deadline {
                // The look took a while: the slot may have been made meanwhile.
                if let Ok(created) = tokio::time::timeout(Duration::ZERO, &mut create).await {
                    break created;
                }
                let cancelled = tokio::time::timeout(
                    self.owner.query_timeout(),
                    slot::cancel_creation(client, &self.stream.slot),
                )
                .await;
                if !matches!(cancelled, Ok(Ok(()))) {
                    tracing::warn!(slot = %self.stream.slot, "could not cancel the slot's creation; the next session may find the slot busy until the owner's transactions end");
                }
                return Err(StreamError::SlotCreateTimeout {
                    slot: self.stream.slot.clone(),
                    after: limit,
                    open,
                });
            }
            tracing::warn!(slot = %self.stream.slot, %open, "creating the slot waits for transactions open on the owner");
            waiting.set(format!(
                "creating slot {:?}: transactions open on the owner must end first: {open}",
                self.stream.slot
            ));
        };
        drop(waiting);
        created.map_err(StreamError::from)
    }

    /// Notes the owner this session reached (`owner::identity`) and says
    /// whether the copy came from another one: the pin changed now or at
    /// a session that failed before its snapshot was in, or the copy (a
    /// checkpoint, a fleet bootstrap) names another timeline. Then the old
    /// copy keeps serving, marked stale, until the new snapshot is in.
    fn note_owner(&self, seen: OwnerIdentity) -> bool {
        let observed = self.owner.pin.observe(seen);
        let copy_timeline = self.model.read().timeline;
        let loaded = self.model.freshness.is_loaded();
        let copy_elsewhere = loaded && copy_timeline != 0 && copy_timeline != seen.timeline;
        if let Observed::Changed { from } = observed {
            metrics::OWNER_CHANGES.inc();
            tracing::error!(%from, to = %seen, "the owner changed (a failover, or another cluster): the copy is replaced by a new snapshot of it");
            if loaded {
                self.owner_change_pending.store(true, Ordering::Release);
            }
        } else if copy_elsewhere && !self.owner_change_pending.load(Ordering::Acquire) {
            tracing::error!(copy_timeline, to = %seen, "the copy is of another owner timeline: it is replaced by a new snapshot");
        }
        let changed = copy_elsewhere || self.owner_change_pending.load(Ordering::Acquire);
        if changed {
            self.status.resnapshotting.store(true, Ordering::Release);
            self.model.freshness.set_replacing(true);
        }
        changed
    }

    /// What a new snapshot's copy carries besides its rows: the timeline
    /// it was taken on, and an epoch past the copy it replaces. The epoch
    /// is the snapshot's consistent point, which after a failover may be
    /// below the old one's; the fleet orders epochs (a replica bootstraps
    /// again only for a newer one, the publisher drops an older one), so
    /// it must grow whatever the owner: past the copy it replaces, and past
    /// the newest epoch the change stream holds (a process started after a
    /// failover has no copy to go past, and its stream was written by the
    /// copy of the old owner). Past an owner change the xids the copy
    /// applied are forgotten (`AppliedXids::clear`).
    fn stamp_new_copy(
        &self,
        mut tables: crate::model::Tables,
        seen: OwnerIdentity,
        reason: SnapshotReason,
    ) -> crate::model::Tables {
        tables.timeline = seen.timeline;
        let replaced = self
            .model
            .freshness
            .is_loaded()
            .then(|| self.model.read().epoch);
        let in_stream = self.stream_epoch();
        tables.epoch = next_epoch(tables.epoch, replaced.max(in_stream));
        if matches!(reason, SnapshotReason::OwnerChanged) {
            self.model.xids.clear();
        }
        tables
    }

    /// Loads the newest usable checkpoint into the empty copy, if there is
    /// one (see `Checkpoints::load_for_start` for what makes one unusable).
    /// The copy is then loaded at the checkpoint's LSN and this session
    /// resumes the slot from there; ready waits until the copy has reached
    /// an owner position read after the load.
    async fn start_from_checkpoint(
        &self,
        client: &tokio_postgres::Client,
        slot_info: Option<&SlotInfo>,
    ) -> Result<(), StreamError> {
        debug_assert!(
            !self.model.freshness.is_loaded(),
            "a checkpoint is never loaded over a copy"
        );
        let Some(identity) = self.checkpoints.identity() else {
            return Ok(()); // checkpoints off
        };
        // Read before the load, to check the checkpoint against: a
        // checkpoint of this owner is never past its WAL.
        let owner_before = slot::current_wal_lsn(client).await?;
        let Some(loaded) = self
            .checkpoints
            .load_for_start(&identity, slot_info, owner_before)
            .await
        else {
            return Ok(());
        };
        let Loaded {
            header,
            tables,
            xids,
            ttl,
            nights,
            stale,
        } = loaded;
        let downtime = header
            .written_at()
            .and_then(|w| (Utc::now() - w).to_std().ok())
            .unwrap_or_default();
        // Read after the load: what this start must catch up to.
        let owner_now = slot::current_wal_lsn(client).await?;
        let at = tables.applied;
        // The ring before the copy: an owner read checked against it must
        // know every transaction the copy holds.
        self.model.xids.restore(xids);
        self.refresh.restore(&tables, &ttl, downtime);
        self.checkpoints.restore_carried(stale, header.written_at());
        self.index.copy_coming();
        self.model.replace_behind(tables, owner_now);
        self.index.mark_all();
        self.status.snapshot.loaded_from_checkpoint();
        tracing::info!(lsn = %at, nights, downtime_secs = downtime.as_secs(), catch_up_to = %owner_now, "copy loaded from a checkpoint; replaying the WAL since");
        Ok(())
    }

    /// Where this session's walsender has read the WAL to, while that is
    /// below where the session stands (`received`, or the session's start
    /// when that is higher) and past `last_seen`:
    /// it is alive and catching up, only sending nothing. Asked within
    /// `limit` (the receive timeout), so a dead path is still found within
    /// twice the receive timeout. That is how a
    /// walsender catches up: a session starts at the slot's confirmed
    /// position, but the walsender decodes from the slot's restart
    /// position, held back by the oldest transaction open when the slot
    /// last moved, and sends nothing of the commits before the start. An
    /// open transaction of hours leaves gigabytes of that, decoded in
    /// silence for longer than the receive timeout, and a session ended
    /// for it began the same silence again, forever. `None` when the
    /// walsender is not known, is gone, has not moved, or cannot be asked
    /// (the path to the owner is down, likely the reason for the silence).
    async fn walsender_busy(
        &self,
        received: Lsn,
        last_seen: Option<Lsn>,
        limit: Duration,
    ) -> Option<Lsn> {
        let walsender = (*self.own_walsender.lock().unwrap_or_else(|p| p.into_inner()))?;
        let session_start = *self.session_start.lock().unwrap_or_else(|p| p.into_inner());
        let received = received.max(session_start);
        let ask = async {
            let client = owner::connect_configured(&self.owner, self.owner.connect_timeout())
                .await
                .ok()?;
            tokio::time::timeout(
                self.owner.query_timeout(),
                slot::walsender_read_to(&client, walsender),
            )
            .await
            .ok()?
            .ok()?
        };
        let read_to = tokio::time::timeout(limit, ask).await.ok()??;
        // Still below where the session stands (past it, the walsender
        // sends what it reads: silence then means a dead path, whatever it
        // thinks it sent), and on since the last look.
        let catching_up = read_to < received && last_seen.is_none_or(|before| read_to > before);
        if catching_up {
            tracing::info!(
                walsender = walsender.pid,
                read_to = %read_to,
                "the walsender sends nothing but reads on (old WAL before this session's start): waiting"
            );
            metrics::STREAM_SILENT_CATCH_UP.inc();
            Some(read_to)
        } else {
            None
        }
    }

    /// Remembers which walsender serves the session just started (it holds
    /// the slot now). Best effort, bounded: without it, a later session
    /// waits for the owner to notice a dead one.
    async fn note_own_walsender(&self, client: &tokio_postgres::Client) {
        let read = slot::walsender(client, &self.stream.slot);
        let serving = match tokio::time::timeout(self.owner.query_timeout(), read).await {
            Ok(Ok(serving)) => serving,
            Ok(Err(error)) => {
                tracing::debug!(%error, "cannot tell which walsender serves this session");
                None
            }
            Err(_) => None,
        };
        *self.own_walsender.lock().unwrap_or_else(|p| p.into_inner()) = serving;
    }

    /// Takes the slot's session lock on `client` (`slot::try_lock_slot`),
    /// waiting at most the connect timeout for another projector's session
    /// to start streaming or end; `SlotBusy` otherwise.
    async fn lock_slot(&self, client: &tokio_postgres::Client) -> Result<(), StreamError> {
        let deadline = Instant::now() + self.owner.connect_timeout();
        // A dead peer's session is ended by the owner's keepalives, not
        // its default of hours: its lock goes with it. Every setup
        // statement on this connection is bounded by the query timeout (a
        // publication fix waits for locks behind open transactions); the
        // snapshot load lifts the bound for its own transaction.
        client
            .batch_execute(&format!(
                "SET tcp_keepalives_idle = 15; SET tcp_keepalives_interval = 5; \
                 SET tcp_keepalives_count = 3; SET statement_timeout = {}",
                self.owner.query_timeout().as_millis()
            ))
            .await
            .map_err(SlotError::from)?;
        while !slot::try_lock_slot(client, &self.stream.slot).await? {
            if Instant::now() >= deadline {
                return Err(StreamError::SlotBusy {
                    slot: self.stream.slot.clone(),
                    pid: None,
                });
            }
            tracing::info!(slot = %self.stream.slot, "another session is taking a snapshot into this slot or starting from it; waiting");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }

    /// Waits, at most the connect timeout, until no walsender holds the
    /// slot, and returns its state then; an error (and the session's retry
    /// with backoff) otherwise. A holder that is this process's own last
    /// walsender serves a connection given up on; it is ended, once.
    async fn wait_slot_released(
        &self,
        client: &tokio_postgres::Client,
    ) -> Result<Option<SlotInfo>, StreamError> {
        let deadline = Instant::now() + self.owner.connect_timeout();
        loop {
            let info = slot::slot_info(client, &self.stream.slot).await?;
            let Some(held) = info.as_ref().filter(|i| i.active) else {
                return Ok(info);
            };
            let own = self
                .own_walsender
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            if let Some(own) = own {
                match slot::end_walsender(client, &self.stream.slot, own).await {
                    Ok(true) => {
                        tracing::warn!(slot = %self.stream.slot, pid = own.pid, "ended the walsender of this process's last session, which the owner had not noticed was dead");
                    }
                    Ok(false) => {}
                    // A role that may not signal it: wait for the owner.
                    Err(error) => {
                        tracing::warn!(%error, pid = own.pid, "cannot end the walsender of this process's last session; waiting for the owner to notice");
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(StreamError::SlotBusy {
                    slot: self.stream.slot.clone(),
                    pid: held.active_pid,
                });
            }
            tracing::info!(slot = %self.stream.slot, pid = ?held.active_pid, "slot still held by a walsender; waiting");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Streams until shutdown, a requested resnapshot, or an error. The
    /// session's token is registered so `request_resnapshot` can end a read
    /// in progress; an ask that came before the registration is seen by the
    /// check right after it.
    async fn stream_session(
        &self,
        stream: &mut LogicalReplicationStream,
        shutdown: &CancellationToken,
    ) -> Result<SessionEnd, StreamError> {
        let session = shutdown.child_token();
        self.status.set_session(Some(session.clone()));
        if self.status.pending_resnapshot().is_some() {
            session.cancel();
        }
        let ended = self.stream_loop(stream, &session).await;
        self.status.set_session(None);
        match ended {
            Ok(()) => {
                // Apply has stopped. At shutdown, with checkpoints on, the
                // copy is written and made durable first, so the last
                // acknowledgement can be exactly its LSN.
                if shutdown.is_cancelled() {
                    self.final_checkpoint().await;
                }
                // The last word to the walsender: everything applied (and,
                // with checkpoints on, checkpointed) is acknowledged, then
                // the stream is dropped by the caller, which ends the COPY
                // (CopyDone) and the connection (Terminate).
                if let Some(outbox) = &self.outbox
                    && !outbox.drained_to(self.model.freshness.applied()).await
                {
                    tracing::warn!(
                        "not everything applied was stored by the outbox's carrier before the stop; the slot keeps it for the next start"
                    );
                }
                let acked = self.acknowledgeable();
                self.acknowledge(stream, acked);
                let sent = tokio::time::timeout(self.owner.connect_timeout(), stream.stop()).await;
                if sent.is_err() {
                    tracing::warn!("the final acknowledgement timed out");
                }
                let end = if shutdown.is_cancelled() {
                    SessionEnd::Shutdown
                } else {
                    SessionEnd::Resnapshot
                };
                tracing::info!(acknowledged = %acked, ?end, "stream stopped");
                Ok(end)
            }
            Err(e) => Err(e),
        }
    }

    /// Reads, assembles, applies and acknowledges until `stop` is
    /// cancelled (then `Ok`) or the session fails.
    async fn stream_loop(
        &self,
        stream: &mut LogicalReplicationStream,
        stop: &CancellationToken,
    ) -> Result<(), StreamError> {
        let mut assembler = Assembler::new(self.stream.schema.clone(), self.stream.held_budget());
        // After a read that stopped before a held frame, the next read must
        // take that frame (a boundary read would stop before it again).
        let mut take_held = false;
        let receive_timeout = self.stream.receive_timeout();
        loop {
            // A cancelled token may lose the race to a frame that is ready;
            // look before every read so the session ends promptly.
            if stop.is_cancelled() {
                return Ok(());
            }
            // Between transactions only: once per transaction, not per
            // change (each look loads the published copy), and a session
            // never ends inside one for it.
            if assembler.is_idle() && self.behind_the_stream() {
                // Ends this session (its token is cancelled); the next one
                // takes the snapshot, stamped above the stream's epoch.
                tracing::error!(
                    copy_epoch = self.model.read().epoch,
                    stream_epoch = self.stream_epoch(),
                    "the change stream holds a newer epoch than this copy: taking a new snapshot above it"
                );
                self.status.request_resnapshot();
                return Ok(());
            }
            let received_end = stream.current_lsn();
            let Some(past_received) = received_end.checked_add(1) else {
                return Err(StreamError::ImpossiblePosition(Lsn(received_end)));
            };
            let boundary = Lsn(past_received);
            let between = assembler.is_idle() && !take_held;
            take_held = false;
            let read = async {
                if between {
                    // Between transactions: read with a boundary just past what we
                    // received, so a keepalive that moves the server's position
                    // returns control to us and we can acknowledge it.
                    stream
                        .next_event_before(pg_walstream::Lsn::new(boundary.0), stop)
                        .await
                } else {
                    stream.next_event(stop).await.map(Some)
                }
            };
            // A path that drops packets fails no read: the socket just stays
            // silent, and our feedback is all the kernel would retransmit.
            // The heartbeat makes the owner send something at least every
            // interval once the walsender has caught up, so silence past
            // the timeout means the path is dead, unless the walsender is
            // still reading old WAL it sends nothing of (`walsender_busy`).
            // Dropping the read ends the session: it is never reused.
            let next = match receive_timeout {
                Some(limit) => {
                    let mut read = std::pin::pin!(read);
                    let mut read_to = None;
                    loop {
                        match tokio::time::timeout(limit, &mut read).await {
                            Ok(next) => break next,
                            Err(_) => {
                                match self.walsender_busy(Lsn(received_end), read_to, limit).await {
                                    Some(further) => read_to = Some(further),
                                    None => return Err(StreamError::ReceiveTimeout(limit)),
                                }
                            }
                        }
                    }
                }
                None => read.await,
            };
            let event = match next {
                Ok(event) => event,
                // The caller sends the last acknowledgement.
                Err(ReplicationError::Cancelled(_)) => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            let received = Lsn(stream.current_lsn());
            self.model.freshness.note_server_wal_end(received);
            let Some(event) = event else {
                if received >= boundary {
                    // A keepalive moved past everything delivered and nothing
                    // of ours is open: every commit below it is applied.
                    let Some(reserved) = self.reserve(stop).await? else {
                        return Ok(());
                    };
                    self.model.advance(received);
                    if let Some(reserved) = reserved {
                        reserved.send(Outgoing::Advanced {
                            epoch: self.model.read().epoch,
                            lsn: received,
                        });
                    }
                    self.acknowledge(stream, self.acknowledgeable());
                    stream.send_feedback().await?;
                } else {
                    // The next transaction's first frame is held for us.
                    take_held = true;
                }
                continue;
            };
            self.model.freshness.note_message(Utc::now());
            match assembler.push(&event).await? {
                Assembled::Pending => {
                    metrics::BUFFERED_CHANGES.set(assembler.buffered_changes() as i64);
                }
                Assembled::Commit(txn, messages) => {
                    let received = Instant::now();
                    let txn_lsn = txn.end_lsn;
                    // How late the commit reached the loop, by the owner's
                    // clock: the walsender's share of the lag (or the
                    // loop's, when it was not reading: see the stalls).
                    let delivery = (Utc::now() - txn.commit_time).to_std().unwrap_or_default();
                    metrics::COMMIT_TO_RECEIVE.observe(delivery.as_secs_f64());
                    let Some(reserved) = self.reserve(stop).await? else {
                        return Ok(());
                    };
                    let reserved_at = Instant::now();
                    let noted = self.index.note_transaction(&txn);
                    let noted_at = Instant::now();
                    let applied = self.model.apply(&txn);
                    self.index.note_applied(noted);
                    let applied = applied?;
                    let applied_at = Instant::now();
                    metrics::APPLY_DURATION.observe((applied_at - noted_at).as_secs_f64());
                    metrics::RECEIVE_TO_APPLY.observe((applied_at - received).as_secs_f64());
                    metrics::BUFFERED_CHANGES.set(assembler.buffered_changes() as i64);
                    let mut merges = Vec::new();
                    if applied.skipped {
                        metrics::TRANSACTIONS_SKIPPED.inc();
                    } else {
                        merges = self.refresh.after_apply(&self.model, &txn, &messages);
                        metrics::TRANSACTIONS_APPLIED.inc();
                        metrics::CHANGES_APPLIED
                            .with_label_values(&["upsert"])
                            .inc_by(applied.upserts);
                        metrics::CHANGES_APPLIED
                            .with_label_values(&["delete"])
                            .inc_by(applied.deletes);
                        metrics::CHANGES_APPLIED
                            .with_label_values(&["truncate"])
                            .inc_by(applied.truncates);
                    }
                    if let Some(reserved) = reserved {
                        // Skipped ones too: the carrier may not have stored
                        // them before a restart (see `outbox`).
                        reserved.send(Outgoing::Applied {
                            epoch: self.model.read().epoch,
                            txn,
                            merges,
                        });
                    }
                    self.acknowledge(stream, self.acknowledgeable());
                    let away = received.elapsed();
                    if away >= STALL {
                        // The next commit waits in the socket meanwhile, so
                        // it shows as a late delivery: say where this went.
                        metrics::LOOP_STALLS.inc();
                        tracing::warn!(
                            away_ms = away.as_millis(),
                            outbox_ms = (reserved_at - received).as_millis(),
                            index_ms = (noted_at - reserved_at).as_millis(),
                            apply_ms = (applied_at - noted_at).as_millis(),
                            after_apply_ms = applied_at.elapsed().as_millis(),
                            delivery_ms = delivery.as_millis(),
                            lsn = %txn_lsn,
                            "replication loop stalled after a transaction"
                        );
                    }
                }
            }
        }
    }

    /// What the slot may be told: what the copy applied, capped by what
    /// the outbox's carrier stored when there is one (the fleet's
    /// projector: the stream, durable in JetStream, is what a restart
    /// resumes from, so that rule replaces the checkpoint cap), else by
    /// the newest durable checkpoint when checkpoints are on.
    fn acknowledgeable(&self) -> Lsn {
        let applied = self.model.freshness.applied();
        match &self.outbox {
            Some(outbox) => applied.min(outbox.acknowledgeable()),
            None => self.checkpoints.acknowledgeable(applied),
        }
    }

    /// With an outbox, a place in it, taken before applying (`outbox` says
    /// why): `Ok(None)` when `stop` came first, `Ok(Some(None))` without an
    /// outbox.
    async fn reserve(
        &self,
        stop: &CancellationToken,
    ) -> Result<Option<Option<Reserved<'_>>>, StreamError> {
        let Some(outbox) = &self.outbox else {
            return Ok(Some(None));
        };
        tokio::select! {
            biased;
            _ = stop.cancelled() => Ok(None),
            reserved = outbox.reserve() => match reserved {
                Some(reserved) => Ok(Some(Some(reserved))),
                None => Err(StreamError::OutboxClosed),
            },
        }
    }

    /// The newest epoch the fleet's change stream holds, once the
    /// publisher has read it (`None`: no fleet, or not read yet).
    fn stream_epoch(&self) -> Option<u64> {
        let outbox = self.outbox.as_ref()?;
        Some(outbox.state().stream_epoch()).filter(|epoch| *epoch > 0)
    }

    /// Whether this copy is of an older epoch than the change stream holds:
    /// nothing of it can be published (`fleet::publish` drops it), so the
    /// replicas would follow no change of it, for good.
    fn behind_the_stream(&self) -> bool {
        self.stream_epoch()
            .is_some_and(|in_stream| in_stream > self.model.read().epoch)
    }

    /// Tells the server everything below `lsn` is applied (sent with the
    /// next status update). Both positions are set: pg_walstream's feedback
    /// sends the larger of the two as flushed, so a cap must hold for both.
    fn acknowledge(&self, stream: &LogicalReplicationStream, lsn: Lsn) {
        stream.shared_lsn_feedback.update_flushed_lsn(lsn.0);
        stream.shared_lsn_feedback.update_applied_lsn(lsn.0);
    }
}

/// The epoch of a new snapshot's copy: its consistent point, or one past
/// the epoch of the copy it replaces when that is not below (a failover's
/// new timeline may start below the old one). The fleet orders epochs, so
/// they only grow.
fn next_epoch(consistent_point: u64, previous: Option<u64>) -> u64 {
    match previous {
        Some(previous) if consistent_point <= previous => previous.saturating_add(1),
        _ => consistent_point,
    }
}

#[cfg(test)]
mod tests {
    use super::next_epoch;

    #[test]
    fn a_new_copys_epoch_grows_even_when_its_timeline_starts_lower() {
        assert_eq!(
            next_epoch(500, None),
            500,
            "the first copy: its consistent point"
        );
        assert_eq!(next_epoch(900, Some(500)), 900, "the same owner moved on");
        assert_eq!(
            next_epoch(300, Some(500)),
            501,
            "a promoted standby below the old copy"
        );
        assert_eq!(next_epoch(500, Some(500)), 501);
    }
}

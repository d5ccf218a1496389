//! A replica: the copy without a slot. It bootstraps from the projector's
//! newest checkpoint in the object store, then applies the change stream
//! from the sequence after it, with the same model code as the projector.
//!
//! It never writes to the owner (no refresher, no heartbeat, no slot) and
//! reads from it only the owner's identity (to check the checkpoint), its
//! WAL position (for lag and readiness, polled here, so the lag is true
//! even when the projector is dead), and what search reads for few units.
//!
//! What a reader of a replica may see is what a reader of the projector may
//! see: whole transactions, in commit order, at one LSN per answer. A
//! chunked transaction is held until its commit marker; a message at or
//! below the applied position is dropped, so a duplicate is never applied
//! twice; a message of another epoch is never applied to this copy (a newer
//! epoch makes the replica bootstrap again, serving the old copy until the
//! new one replaces it whole).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use chrono::Utc;
use futures_util::StreamExt;
use tokio_util::io::SyncIoBridge;
use tokio_util::sync::CancellationToken;

use super::FleetError;
use super::log::{ChangeLog, StreamEnds};
use super::settings::FleetSettings;
use super::store::{self, Stored};
use super::wire::{Assembly, Body, Message, Position, WireError};
use crate::checkpoint::{self, CheckpointName, Identity, Loaded};
use crate::index::HotelIndex;
use crate::lsn::Lsn;
use crate::metrics;
use crate::model::ReadModel;
use crate::owner::{self, OwnerSettings};
use crate::stream::checkpoints::Carried;
use crate::stream::{StreamStatus, slot};

/// How long a standby taking over may go without reading a message while
/// it applies the rest of the stream: past it, the projector starts from
/// what the copy holds (the slot replays the rest, or a copy behind the
/// slot takes a snapshot).
const HANDOVER_DRAIN_IDLE: Duration = Duration::from_secs(10);

/// The longest a standby taking over spends applying the rest of the
/// stream, however steadily it reads: the replicas wait for the new
/// projector meanwhile.
const HANDOVER_DRAIN_MAX: Duration = Duration::from_secs(60);

/// A standby's last stretch of following, once it was handed over: the
/// stream up to its end as read at the handover, for as long as messages
/// keep coming (`HANDOVER_DRAIN_IDLE`), within `HANDOVER_DRAIN_MAX`.
///
/// Why not one fixed bound: a session that began by reading a chunked
/// transaction again from its first chunk (`Cursor::held_from`), or a large
/// transaction's chunks, can take longer than any short bound while
/// making steady progress, and stopping it then costs the new projector a
/// snapshot when its copy is behind the slot. Only a stream that stops
/// delivering, or a drain past the hard bound, ends it early.
#[derive(Debug, Clone, Copy)]
struct Drain {
    /// The stream's last sequence at the handover.
    end: u64,
    /// The drain ends here unless a message comes first.
    idle_until: tokio::time::Instant,
    /// The drain ends here in any case.
    until: tokio::time::Instant,
}

impl Drain {
    fn new(end: u64, now: tokio::time::Instant) -> Drain {
        Drain {
            end,
            idle_until: now + HANDOVER_DRAIN_IDLE,
            until: now + HANDOVER_DRAIN_MAX,
        }
    }

    /// A message was read (applied, or read again): the stream delivers.
    fn progressed(&mut self, now: tokio::time::Instant) {
        self.idle_until = (now + HANDOVER_DRAIN_IDLE).min(self.until);
    }

    /// When the drain ends if nothing more comes: the idle deadline, which
    /// `progressed` never moves past the hard one.
    fn deadline(&self) -> tokio::time::Instant {
        debug_assert!(self.idle_until <= self.until);
        self.idle_until
    }

    /// Whether to stop following: the stream applied past its end as read
    /// at the handover, or a deadline passed.
    fn over(&self, next_sequence: u64, now: tokio::time::Instant) -> bool {
        next_sequence > self.end || now >= self.deadline()
    }
}

/// What the replica reports (`/v1/status` `fleet`).
#[derive(Debug, Default)]
pub struct ReplicaState {
    inner: Mutex<ReplicaProgress>,
}

#[derive(Debug, Default, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct ReplicaProgress {
    /// The checkpoint the copy was bootstrapped from (its object name).
    pub bootstrapped_from: Option<String>,
    /// The change stream's next sequence to apply.
    pub next_sequence: u64,
    /// The change stream's last sequence, as last read (every
    /// `fleet.owner_position_interval_ms`).
    pub stream_last_sequence: u64,
    /// The copy's epoch.
    pub epoch: u64,
    /// Why the replica is not applying, when it is not.
    pub waiting_for: Option<String>,
    pub bootstraps: u64,
}

impl ReplicaState {
    /// Messages of the stream this replica has not applied, as of the last
    /// read of the stream's end (0 before the first).
    pub fn messages_behind(&self) -> u64 {
        let p = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        (p.stream_last_sequence + 1).saturating_sub(p.next_sequence.max(1))
    }

    pub fn progress(&self) -> ReplicaProgress {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn update(&self, f: impl FnOnce(&mut ReplicaProgress)) {
        f(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

/// The replica's task and what it works on.
pub struct Replica {
    pub settings: FleetSettings,
    pub owner: OwnerSettings,
    pub slot: String,
    pub publication: String,
    /// The node's `[stream]` settings, for the bound on a chunked
    /// transaction held until its commit marker (`stream.max_held_bytes`,
    /// `stream.spill_dir`).
    pub held: crate::stream::StreamSettings,
    pub model: Arc<ReadModel>,
    pub index: Arc<HotelIndex>,
    pub status: Arc<StreamStatus>,
    pub state: Arc<ReplicaState>,
    /// The stale-read loop, which takes the checkpoint's carried state at
    /// the first bootstrap (`fleet::outcomes` reads the outcome stream on
    /// from there).
    pub stale: Arc<dyn Carried>,
}

/// How many sessions in a row may start by reading one held chunked
/// transaction again (`Cursor::held_rereads`) before the replica bootstraps.
const MAX_HELD_REREADS: u32 = 3;

/// What `Replica::apply` did with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Applied {
    /// Applied to the copy, or (a chunk) taken into the assembly.
    Taken,
    /// Nothing changed: a repeat, a message of an older epoch, or a
    /// takeover notice.
    Dropped,
}

/// The checkpoint a bootstrap may load, `newest` in the bucket, or what it
/// waits for instead: one the stream still continues (its sequence at or
/// past the stream's `first` kept, less one, and not past its `last`) and
/// of `epoch_at_least` or later, of the stream there is now. A checkpoint
/// of another stream (`Stored::stream`), or past the stream's end, names a
/// sequence of a stream since deleted and made again (an operator, a NATS
/// that lost its store): loaded, its copy would resume at a sequence of the
/// new stream that holds other changes, and skip those in between. The
/// stream's identity tells it even once the new stream has grown past the
/// old checkpoint's sequence; a name without one (written before it was
/// recorded) is told by the end alone.
fn loadable(
    newest: Option<Stored>,
    now: StreamEnds,
    epoch_at_least: u64,
) -> Result<Stored, String> {
    let StreamEnds { first, last, .. } = now;
    match newest {
        None => Err("the projector's first checkpoint".to_string()),
        Some(stored) if stored.epoch < epoch_at_least => Err(format!(
            "a checkpoint of the projector's new epoch {epoch_at_least} (the newest, {}, is of an older one)",
            stored.object_name()
        )),
        Some(stored) if stored.stream.is_some_and(|s| s != now.made_at_ns) => Err(format!(
            "the newest checkpoint ({}) is of a change stream since made again (this one was made at {:016x}); waiting for the projector's next one",
            stored.object_name(),
            now.made_at_ns
        )),
        Some(stored) if stored.sequence + 1 < first => Err(format!(
            "the newest checkpoint ({}) is older than what the stream keeps (from sequence {first}); waiting for the projector's next one",
            stored.object_name()
        )),
        Some(stored) if stored.sequence > last => Err(format!(
            "the newest checkpoint ({}) is past the stream's end (sequence {last}): the stream was made again; waiting for the projector's next one",
            stored.object_name()
        )),
        Some(stored) => Ok(stored),
    }
}

/// Whether a stream ending at `last` was made again since a consumer that
/// expects `next` read it: a stream's last sequence never goes back (its
/// limits and purges remove messages, not sequences), so a next sequence
/// more than one past it belongs to a stream since deleted.
fn made_again(next: u64, last: u64) -> bool {
    next > last.saturating_add(1)
}

/// How long an abandoned checkpoint loader may take to stop: its next read
/// fails at once, and a read stalled on the network ends at the download's
/// stall timeout (`store::open`), well within this.
const LOADER_STOP_LIMIT: Duration = Duration::from_secs(120);

/// A blocking reader that fails once `abandoned` is set: a bootstrap that
/// gave up on a download past its deadline stops the loader's thread at
/// its next read, where dropping the task's handle would leave it fetching
/// and decoding a whole copy beside every retry.
struct Abandonable<R> {
    inner: R,
    abandoned: Arc<AtomicBool>,
}

impl<R: std::io::Read> std::io::Read for Abandonable<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.abandoned.load(Ordering::Acquire) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the bootstrap gave up on this download",
            ));
        }
        self.inner.read(buf)
    }
}

/// What the client may hold of the stream ahead of the replica's apply.
const PREFETCH_BYTES: usize = 64 << 20;

/// Messages one pull of the ordered consumer asks for: as many as
/// `PREFETCH_BYTES` holds at `fleet.max_chunk_bytes` each, from 16 up to
/// the client's own 500. The client asks again at half a pull, so it holds
/// at most one and a half pulls. Unbounded, it asked for 500 messages a
/// pull whatever their size (an ordered consumer's pull sets no byte
/// bound): about 675 MB of chunks at the default size, held while a slow
/// replica spilled a large transaction to stay within its own bound.
fn prefetch_batch(max_chunk_bytes: usize) -> i64 {
    let fits = PREFETCH_BYTES / max_chunk_bytes.max(1);
    fits.clamp(16, 500) as i64
}

/// Where a session left off, kept across sessions.
#[derive(Debug, Default)]
struct Cursor {
    /// Bootstrap before applying (at the start, after a new epoch, or when
    /// the stream no longer holds `next_sequence`).
    bootstrap: bool,
    next_sequence: u64,
    /// The stream sequence of the first chunk of the transaction the
    /// session's assembly holds, while it holds one. The assembly lives
    /// only as long as its session: the next session reads the stream again
    /// from here, so a transaction whose chunks a reconnect cut in two is
    /// assembled whole, not found incomplete at its marker.
    held_from: Option<u64>,
    /// Sessions that started by reading the held transaction again from
    /// `held_from`. Past `MAX_HELD_REREADS` the replica bootstraps instead:
    /// a link that keeps failing inside one large transaction would
    /// otherwise read its first chunks again and again without getting past
    /// it, where the newest checkpoint (the projector applies a transaction
    /// before publishing it) soon holds it.
    held_rereads: u32,
    /// The last position applied (or dropped as already held).
    applied: Option<Position>,
    /// An operator's resnapshot ask (`POST /v1/admin/resnapshot`) the next
    /// bootstrap answers.
    asked: Option<u64>,
    /// The oldest epoch a bootstrap may load: the stream's, once it showed
    /// a newer one than the copy's. An older checkpoint would take the copy
    /// back and meet the new epoch again, over and over.
    epoch_at_least: u64,
    /// Which change stream `next_sequence` is a sequence of
    /// (`StreamEnds::made_at_ns`; 0 before the first bootstrap). A stream
    /// deleted and made again while this replica was away from NATS, then
    /// grown past its position, passed both checks of sequences alone: the
    /// replica resumed at its old number in the new stream, ready, and
    /// missed every change before it.
    stream: u64,
}

impl Cursor {
    /// The stream now at NATS is not the one this cursor's sequences are of.
    fn of_another_stream(&self, now: &StreamEnds) -> bool {
        self.stream != 0 && self.stream != now.made_at_ns
    }
}

impl Cursor {
    /// Where the next session reads from: the held transaction's first
    /// chunk while one is held, else the next message.
    fn resume_at(&self) -> u64 {
        self.held_from.unwrap_or(self.next_sequence)
    }
}

impl Replica {
    /// Runs sessions until `shutdown`, reconnecting with backoff.
    pub async fn run(self, shutdown: CancellationToken) {
        self.follow(&CancellationToken::new(), &shutdown).await;
    }

    /// Follows the stream (bootstrapping first) until `shutdown`, or until
    /// `handover` is cancelled: then it applies the stream up to its end as
    /// read at that moment (while it keeps coming: `Drain`) and returns. A
    /// standby projector follows this way until it takes the slot.
    pub async fn follow(&self, handover: &CancellationToken, shutdown: &CancellationToken) {
        let mut cursor = Cursor {
            bootstrap: true,
            ..Cursor::default()
        };
        let mut backoff = Duration::from_millis(100);
        loop {
            let outcome = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                outcome = self.session(&mut cursor, handover, shutdown) => outcome,
            };
            self.status.connected.store(false, Ordering::Release);
            if handover.is_cancelled() {
                return;
            }
            match outcome {
                Ok(()) => return,
                Err(FleetError::BootstrapAsked { asked }) => {
                    tracing::info!("bootstrapping again, as an operator asked");
                    cursor.bootstrap = true;
                    cursor.asked = Some(asked);
                    backoff = Duration::from_millis(100);
                    continue;
                }
                Err(FleetError::NewEpoch { ours, stream }) => {
                    tracing::info!(
                        ours,
                        stream,
                        "the projector started a new epoch; bootstrapping again"
                    );
                    cursor.bootstrap = true;
                    cursor.epoch_at_least = cursor.epoch_at_least.max(stream);
                    // Answers say so from now, not from when the new epoch's
                    // checkpoint appears: the copy follows nothing until
                    // then, and may hold commits the new one lacks (a
                    // failover). It stays ready, as every replica would be
                    // waiting alike (`http::operators::readiness`).
                    if self.model.freshness.is_loaded() {
                        self.model.freshness.set_replacing(true);
                    }
                    backoff = Duration::from_millis(100);
                    continue;
                }
                Err(error) => {
                    metrics::RECONNECTS.inc();
                    tracing::warn!(%error, "replica session ended; reconnecting");
                    self.status.set_last_error(Some(error.to_string()));
                }
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    async fn session(
        &self,
        cursor: &mut Cursor,
        handover: &CancellationToken,
        shutdown: &CancellationToken,
    ) -> Result<(), FleetError> {
        let log = ChangeLog::connect(&self.settings).await?;
        if !cursor.bootstrap {
            let ends = log.ends().await?;
            let (first, last) = (ends.first, ends.last);
            let resume_at = cursor.resume_at();
            if cursor.of_another_stream(&ends) {
                tracing::warn!(
                    next = resume_at,
                    "the change stream was made again since this replica read it; bootstrapping again"
                );
                cursor.bootstrap = true;
            } else if resume_at < first {
                tracing::warn!(
                    next = resume_at,
                    first,
                    "the stream no longer holds this replica's position; bootstrapping again"
                );
                cursor.bootstrap = true;
            } else if made_again(resume_at, last) {
                tracing::warn!(
                    next = resume_at,
                    last,
                    "the change stream ends before this replica's position: it was made again; bootstrapping again"
                );
                cursor.bootstrap = true;
            } else if let Some(from) = cursor.held_from {
                cursor.held_rereads += 1;
                if cursor.held_rereads > MAX_HELD_REREADS {
                    tracing::warn!(
                        from,
                        sessions = cursor.held_rereads,
                        "sessions keep ending inside one chunked transaction; bootstrapping again"
                    );
                    cursor.bootstrap = true;
                } else {
                    tracing::info!(
                        from,
                        "reading the chunked transaction a session ended inside again from its first chunk"
                    );
                }
            }
        }
        if cursor.bootstrap {
            self.bootstrap(&log, cursor, handover, shutdown).await?;
            if cursor.bootstrap {
                return Ok(()); // handed over (or shut down) before a copy
            }
        }
        self.consume(&log, cursor, handover, shutdown).await
    }

    /// Loads the newest checkpoint in the bucket (waiting, not ready, until
    /// there is one the stream still continues) and swaps it in whole.
    async fn bootstrap(
        &self,
        log: &ChangeLog,
        cursor: &mut Cursor,
        handover: &CancellationToken,
        shutdown: &CancellationToken,
    ) -> Result<(), FleetError> {
        // An old copy serves, marked stale, until the new one is in: it
        // applies nothing of the stream meanwhile. Marked from the start of
        // the wait for a checkpoint (up to a checkpoint interval, or longer),
        // not only once one is found.
        if self.model.freshness.is_loaded() {
            self.model.freshness.set_replacing(true);
        }
        let (newest, stream) = loop {
            let now = log.ends().await?;
            // The stream's end moves on while this copy applies nothing:
            // how far behind it falls is what readiness bounds
            // (`messages_behind`), so it is read here too, not only while
            // consuming.
            self.state.update(|p| p.stream_last_sequence = now.last);
            let newest = store::list(log).await?.pop();
            match loadable(newest, now, cursor.epoch_at_least) {
                // A checkpoint that does not say its stream was found to
                // continue this one (`loadable`).
                Ok(stored) => break (stored, stored.stream.unwrap_or(now.made_at_ns)),
                Err(waiting_for) => self.waiting(waiting_for),
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                _ = handover.cancelled() => return Ok(()),
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        };
        let identity = self.owner_identity().await?;
        let name = CheckpointName {
            timeline: identity.timeline,
            lsn: newest.lsn,
        };
        let label = PathBuf::from(name.to_string());
        let download = store::open(log, newest).await?;
        let (bytes, deadline) = (download.bytes, download.deadline);
        // Decoded as it arrives: the transfer and the decode overlap, and
        // nothing touches the disk.
        let abandoned = Arc::new(AtomicBool::new(false));
        let reader = Abandonable {
            inner: SyncIoBridge::new(download.reader),
            abandoned: abandoned.clone(),
        };
        let expected = identity.clone();
        let started = std::time::Instant::now();
        let mut loading = tokio::task::spawn_blocking(move || {
            checkpoint::load_from(reader, bytes, &label, &expected)
        });
        let loaded = match tokio::time::timeout(deadline, &mut loading).await {
            Ok(joined) => joined
                .map_err(|e| FleetError::Nats(format!("the checkpoint loader failed: {e}")))??,
            Err(_) => {
                // Stop the loader at its next read, and wait for it (a read
                // stalled on the network ends at the download's own stall
                // timeout), so a retry never runs beside it.
                abandoned.store(true, Ordering::Release);
                if tokio::time::timeout(LOADER_STOP_LIMIT, loading)
                    .await
                    .is_err()
                {
                    tracing::warn!(
                        checkpoint = newest.object_name(),
                        "the abandoned checkpoint loader did not stop in time"
                    );
                }
                return Err(FleetError::Nats(format!(
                    "downloading {} timed out",
                    newest.object_name()
                )));
            }
        };
        tracing::info!(
            checkpoint = newest.object_name(),
            bytes,
            seconds = started.elapsed().as_secs_f64(),
            "checkpoint downloaded and loaded"
        );
        self.install(loaded, newest).await?;
        cursor.bootstrap = false;
        cursor.next_sequence = newest.sequence + 1;
        cursor.stream = stream;
        cursor.held_from = None;
        cursor.held_rereads = 0;
        cursor.applied = None;
        if let Some(asked) = cursor.asked.take() {
            self.status.resnapshot_served(asked);
        }
        self.state.update(|p| {
            p.bootstrapped_from = Some(newest.object_name());
            p.next_sequence = cursor.next_sequence;
            p.epoch = newest.epoch;
            p.waiting_for = None;
            p.bootstraps += 1;
        });
        metrics::FLEET_BOOTSTRAPS.inc();
        Ok(())
    }

    fn waiting(&self, what: String) {
        tracing::info!(waiting_for = %what, "replica waiting");
        self.state.update(|p| p.waiting_for = Some(what));
    }

    async fn install(&self, loaded: Loaded, stored: Stored) -> Result<(), FleetError> {
        let Loaded {
            header,
            tables,
            xids,
            nights,
            stale,
            ..
        } = loaded;
        // Read after the load: ready waits until the copy has applied it.
        let owner_now = self.owner_position().await?;
        self.model.xids.restore(xids);
        // Before the copy: the outcome task begins once a copy is in, from
        // the sequence this state holds. Past the first bootstrap the
        // ledger reads the outcome stream already and ignores it.
        if let Some(written_at) = header.written_at() {
            self.stale.restore(stale, written_at, Utc::now());
        }
        self.index.copy_coming();
        self.model.replace_behind(tables, owner_now);
        self.model.freshness.set_replacing(false);
        self.index.mark_all();
        self.status.snapshot.loaded_from_checkpoint();
        tracing::info!(checkpoint = stored.object_name(), lsn = %stored.lsn, nights, catch_up_to = %owner_now, "replica bootstrapped from a checkpoint; applying the stream after it");
        Ok(())
    }

    /// Applies the stream from `cursor.next_sequence` until shutdown or an
    /// error.
    async fn consume(
        &self,
        log: &ChangeLog,
        cursor: &mut Cursor,
        handover: &CancellationToken,
        shutdown: &CancellationToken,
    ) -> Result<(), FleetError> {
        let stream = log.changes().await?;
        let consumer = log
            .bounded(stream.create_consumer(pull::OrderedConfig {
                filter_subject: log.settings.subject.clone(),
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: cursor.resume_at().max(1),
                },
                max_batch: prefetch_batch(log.settings.max_chunk_bytes),
                ..Default::default()
            }))
            .await?
            .map_err(|e| FleetError::Nats(format!("a consumer of {}: {e}", log.settings.stream)))?;
        let mut messages = log
            .bounded(consumer.messages())
            .await?
            .map_err(|e| FleetError::Nats(format!("consuming {}: {e}", log.settings.stream)))?;
        self.status.connected.store(true, Ordering::Release);
        self.status.set_last_error(None);
        let mut assembly = Assembly::new(self.held.held_budget());
        let mut stream_end = tokio::time::interval(log.settings.owner_position_interval());
        stream_end.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Once handed over: what is left to apply before returning.
        let mut drain: Option<Drain> = None;
        loop {
            if drain.is_some_and(|d| d.over(cursor.next_sequence, tokio::time::Instant::now())) {
                return Ok(());
            }
            let next = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                _ = handover.cancelled(), if drain.is_none() => {
                    let (_, end) = log.sequences().await?;
                    drain = Some(Drain::new(end, tokio::time::Instant::now()));
                    continue;
                }
                _ = tokio::time::sleep_until(drain.map_or_else(tokio::time::Instant::now, |d| d.deadline())), if drain.is_some() => continue,
                _ = stream_end.tick() => {
                    if let Some(asked) = self.status.pending_resnapshot() {
                        return Err(FleetError::BootstrapAsked { asked });
                    }
                    // Where the stream ends, for readiness (`messages_behind`).
                    let ends = log.ends().await?;
                    let last = ends.last;
                    self.state.update(|p| p.stream_last_sequence = last);
                    // An ordered consumer made again after the stream was
                    // (deleted and made again) waits at this replica's next
                    // sequence of the new stream, which will hold other
                    // changes: bootstrap instead.
                    if made_again(cursor.next_sequence, last) || cursor.of_another_stream(&ends) {
                        cursor.bootstrap = true;
                        return Err(FleetError::Nats(format!(
                            "the change stream ends at sequence {last}, before this replica's next ({}): it was made again; bootstrapping again",
                            cursor.next_sequence
                        )));
                    }
                    continue;
                }
                next = messages.next() => next,
            };
            let Some(next) = next else {
                return Err(FleetError::Nats(
                    "the change stream's consumer ended".into(),
                ));
            };
            if let Some(d) = drain.as_mut() {
                d.progressed(tokio::time::Instant::now());
            }
            let message = next
                .map_err(|e| FleetError::Nats(format!("consuming {}: {e}", log.settings.stream)))?;
            let sequence = message
                .info()
                .map_err(|e| FleetError::Nats(format!("a message without stream info: {e}")))?
                .stream_sequence;
            // The stream holds only the change subject, so its sequences
            // are contiguous: a jump means messages were removed (retention)
            // before this replica read them, and applying on would miss them.
            if sequence > cursor.next_sequence && cursor.next_sequence > 0 {
                tracing::warn!(
                    expected = cursor.next_sequence,
                    got = sequence,
                    "messages of the change stream are gone before this replica applied them; bootstrapping again"
                );
                cursor.bootstrap = true;
                return Err(FleetError::Nats(format!(
                    "the change stream skipped from sequence {} to {sequence}",
                    cursor.next_sequence
                )));
            }
            // Below `next_sequence`: applied before, delivered again after
            // the consumer's recreation; only the held transaction's chunks
            // are read again (into this session's new assembly).
            let again = sequence < cursor.next_sequence;
            if again && cursor.held_from.is_none_or(|from| sequence < from) {
                continue;
            }
            let decoded = Message::decode(&message.payload)?;
            let first_chunk =
                matches!(decoded.body, Body::Chunk { .. }) && decoded.position.seq == 0;
            let commit = matches!(decoded.body, Body::Commit { .. });
            let taken = self.apply(decoded, &mut assembly, cursor).await? == Applied::Taken;
            // Only a first chunk the assembly took marks where a held
            // transaction begins: one of an older epoch is dropped, and
            // marking it would have the next session read the stream again
            // from there for nothing (and, past `MAX_HELD_REREADS`
            // sessions, bootstrap for nothing).
            if first_chunk && taken {
                cursor.held_from = Some(sequence);
            } else if commit {
                cursor.held_from = None;
                cursor.held_rereads = 0;
            }
            if again {
                // Counted when first read.
                continue;
            }
            if taken {
                metrics::FLEET_MESSAGES_APPLIED.inc();
            }
            cursor.next_sequence = sequence + 1;
            self.model.freshness.note_message(Utc::now());
            self.state
                .update(|p| p.next_sequence = cursor.next_sequence);
        }
    }

    async fn apply(
        &self,
        message: Message,
        assembly: &mut Assembly,
        cursor: &mut Cursor,
    ) -> Result<Applied, FleetError> {
        let position = message.position;
        if let Body::Takeover { after } = message.body {
            tracing::info!(
                holder = format!("{:x}", message.holder),
                ?after,
                "a projector took over the change stream"
            );
            return Ok(Applied::Dropped);
        }
        let epoch = self.model.read().epoch;
        if position.epoch > epoch {
            return Err(FleetError::NewEpoch {
                ours: epoch,
                stream: position.epoch,
            });
        }
        // Chunks are not filtered by position: a transaction sent again
        // from its first chunk (after a takeover) starts over in the
        // assembly; its commit is what is filtered.
        let chunk = matches!(message.body, Body::Chunk { .. });
        if position.epoch < epoch || (!chunk && cursor.applied.is_some_and(|a| position <= a)) {
            metrics::FLEET_MESSAGES_DROPPED.inc();
            return Ok(Applied::Dropped);
        }
        match message.body {
            Body::Merge { changes } => {
                self.model.apply_merge(position.lsn(), &changes)?;
            }
            Body::Advance => self.model.advance(position.lsn()),
            Body::Takeover { .. } => {}
            body @ (Body::Chunk { .. } | Body::Commit { .. }) => {
                let assembled = match assembly.push(position, body).await {
                    Ok(assembled) => assembled,
                    Err(WireError::ChunksMissing { .. })
                        if position.lsn() <= self.model.freshness.applied() =>
                    {
                        // The copy holds this transaction already: a
                        // bootstrap from a checkpoint written while its
                        // chunks were being published starts in their
                        // middle. Its marker is a repeat.
                        cursor.applied = Some(position);
                        metrics::FLEET_MESSAGES_DROPPED.inc();
                        return Ok(Applied::Dropped);
                    }
                    Err(error @ WireError::ChunksMissing { .. }) => {
                        // Chunks the copy never had are missing, though the
                        // session read the transaction from its first chunk
                        // (`Cursor::held_from`): the stream holds it only in
                        // part (a publisher lost some). Going on would miss
                        // it; start again from the newest checkpoint, which
                        // a later one past it eventually is.
                        tracing::warn!(%error, "a chunked transaction is incomplete on the stream; bootstrapping again");
                        cursor.bootstrap = true;
                        return Err(error.into());
                    }
                    Err(error) => return Err(error.into()),
                };
                if let Some(txn) = assembled {
                    let noted = self.index.note_transaction(&txn);
                    let applied = self.model.apply(&txn);
                    self.index.note_applied(noted);
                    let applied = applied?;
                    if applied.skipped {
                        metrics::TRANSACTIONS_SKIPPED.inc();
                    } else {
                        metrics::TRANSACTIONS_APPLIED.inc();
                    }
                }
            }
        }
        // Only once applied: a message whose apply failed is delivered
        // again after the reconnect, and must not be taken for a repeat.
        if !chunk {
            cursor.applied = Some(position);
        }
        Ok(Applied::Taken)
    }

    /// Who the owner is, as a checkpoint header names it: a replica checks
    /// the projector's checkpoint against the owner it reads itself.
    async fn owner_identity(&self) -> Result<Identity, FleetError> {
        let client = owner::connect_configured(&self.owner, self.owner.connect_timeout()).await?;
        let read = async {
            // The timeline WAL is written on, not the last checkpoint's: a
            // promoted standby's lags until its first checkpoint.
            let found = owner::identity::read(&client)
                .await
                .map_err(|e| FleetError::Owner(format!("the owner's system identifier: {e}")))?;
            let columns_fingerprint = slot::columns_fingerprint(&client, &self.publication)
                .await
                .map_err(|e| FleetError::Owner(e.to_string()))?;
            Ok::<_, FleetError>((found, columns_fingerprint))
        };
        let (found, columns_fingerprint) = self.within_query_timeout(read).await?;
        Ok(Identity {
            system_identifier: found.system_identifier,
            timeline: found.timeline,
            slot: self.slot.clone(),
            publication: self.publication.clone(),
            columns_fingerprint,
        })
    }

    async fn owner_position(&self) -> Result<Lsn, FleetError> {
        let client = owner::connect_configured(&self.owner, self.owner.connect_timeout()).await?;
        self.within_query_timeout(async {
            slot::current_wal_lsn(&client)
                .await
                .map_err(|e| FleetError::Owner(e.to_string()))
        })
        .await
    }

    /// `read` on a connection of its own, bounded by the owner's query
    /// timeout: on a path that drops packets it would otherwise wait for
    /// the kernel. The connection is dropped after it either way.
    async fn within_query_timeout<T>(
        &self,
        read: impl Future<Output = Result<T, FleetError>>,
    ) -> Result<T, FleetError> {
        let limit = self.owner.query_timeout();
        tokio::time::timeout(limit, read)
            .await
            .unwrap_or_else(|_| Err(FleetError::Owner(format!("no answer within {limit:?}"))))
    }
}

/// Reads the owner's WAL position every `interval`: the replica's lag is
/// measured against the owner itself, not against the projector, so it
/// stays true when the projector or NATS is down.
pub async fn run_owner_position(
    owner: OwnerSettings,
    interval: Duration,
    model: Arc<ReadModel>,
    shutdown: CancellationToken,
) {
    let mut client: Option<tokio_postgres::Client> = None;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = owner::connect_configured(&owner, owner.connect_timeout())
                .await
                .ok();
        }
        let Some(connected) = &client else { continue };
        metrics::OWNER_READS.with_label_values(&["lag"]).inc();
        // Against the owner's flushed position, as the projector's and a
        // standalone node's lag (`stream::slot_watch`): WAL past the flush
        // holds no commit anyone can see, and an owner whose fsync stalls
        // would otherwise have its stall counted as this replica's lag.
        let read = async {
            let positions = slot::wal_positions(connected)
                .await
                .map_err(|e| e.to_string())?;
            let identity = owner::identity::read(connected)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((positions, identity))
        };
        match tokio::time::timeout(owner.query_timeout(), read).await {
            Ok(Ok((positions, identity))) => {
                model.freshness.note_server_wal_end(positions.flushed);
                note_owner_timeline(&model, identity.timeline);
            }
            Ok(Err(error)) => {
                tracing::debug!(%error, "reading the owner's position failed");
                client = None;
            }
            Err(_) => client = None,
        }
    }
}

/// Marks the copy stale when the owner writes on another timeline than the
/// copy's: a failover the projector has not made a new epoch of yet. The
/// copy's positions then do not compare with the owner's (its lag read 0,
/// the owner's new positions being below what it had seen), and it may hold
/// commits the new primary lacks. The new epoch's bootstrap installs a copy
/// of the owner's timeline and clears the mark.
fn note_owner_timeline(model: &ReadModel, owner_timeline: u32) {
    let copy_timeline = model.read().timeline;
    if copy_timeline != 0
        && owner_timeline != 0
        && owner_timeline != copy_timeline
        && model.freshness.is_loaded()
        && !model.freshness.is_replacing()
    {
        tracing::warn!(
            copy_timeline,
            owner_timeline,
            "the owner writes on another timeline than this replica's copy: answers are marked stale until a copy of the owner's timeline is in"
        );
        model.freshness.set_replacing(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy of timeline 1 while the owner writes on 2 (a failover) is
    /// marked stale; on its own timeline, or of an unknown one, it is not.
    /// A pull asks for what fits the prefetch bound at the largest chunk,
    /// within the client's range: 74 chunks of the default 900,000 bytes
    /// (about 67 MB, where 500 were 450 MB), 500 of the smallest.
    #[test]
    fn a_pull_asks_for_what_the_prefetch_bound_holds() {
        assert_eq!(prefetch_batch(900_000), 74);
        assert!(prefetch_batch(900_000) as usize * 900_000 <= PREFETCH_BYTES);
        assert_eq!(prefetch_batch(4096), 500);
        assert_eq!(prefetch_batch(16 << 20), 16);
    }

    #[test]
    fn a_copy_of_another_timeline_than_the_owners_is_marked_stale() {
        let model = ReadModel::new();
        model.replace(crate::model::Tables {
            timeline: 1,
            ..crate::model::Tables::default()
        });
        note_owner_timeline(&model, 1);
        assert!(!model.freshness.is_replacing());
        note_owner_timeline(&model, 2);
        assert!(model.freshness.is_replacing());

        let unknown = ReadModel::new();
        unknown.replace(crate::model::Tables::default());
        note_owner_timeline(&unknown, 2);
        assert!(!unknown.freshness.is_replacing());
    }

    #[test]
    fn an_abandoned_download_fails_its_next_read() {
        use std::io::Read;
        let abandoned = Arc::new(AtomicBool::new(false));
        let mut reader = Abandonable {
            inner: &b"checkpoint bytes"[..],
            abandoned: abandoned.clone(),
        };
        let mut first = [0u8; 10];
        reader.read_exact(&mut first).unwrap();
        assert_eq!(&first, b"checkpoint");
        abandoned.store(true, Ordering::Release);
        let error = reader.read(&mut first).unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);
    }

    /// After the stream showed epoch 9, the newest checkpoint of epoch 8
    /// is not loaded (it would take the copy back and meet epoch 9 again):
    /// the replica waits for one of 9, which is newest once written.
    #[test]
    fn a_bootstrap_after_a_new_epoch_waits_for_a_checkpoint_of_it() {
        let stored = |epoch, sequence| Stored {
            epoch,
            lsn: Lsn(0x500),
            sequence,
            stream: Some(7),
        };
        let kept = ends(10, 100, 7);
        assert_eq!(loadable(Some(stored(8, 40)), kept, 0), Ok(stored(8, 40)));
        let waiting = loadable(Some(stored(8, 40)), kept, 9).unwrap_err();
        assert!(waiting.contains("new epoch 9"), "{waiting}");
        assert_eq!(loadable(Some(stored(9, 41)), kept, 9), Ok(stored(9, 41)));
        assert!(
            loadable(Some(stored(9, 8)), kept, 9).is_err(),
            "trimmed past it"
        );
        assert!(loadable(None, ends(1, 0, 7), 0).is_err());
    }

    fn ends(first: u64, last: u64, made_at_ns: u64) -> StreamEnds {
        StreamEnds {
            first,
            last,
            made_at_ns,
        }
    }

    /// A stream deleted and made again starts its sequences over: a
    /// checkpoint past its end, or a consumer's next sequence past it, is
    /// of the old stream.
    #[test]
    fn a_stream_made_again_is_told_by_its_end() {
        // Named before streams were told apart: the end alone tells.
        let stored = Stored {
            epoch: 1,
            lsn: Lsn(0x500),
            sequence: 1_000,
            stream: None,
        };
        let waiting = loadable(Some(stored), ends(1, 40, 8), 0).unwrap_err();
        assert!(waiting.contains("made again"), "{waiting}");
        assert_eq!(loadable(Some(stored), ends(1, 1_000, 8), 0), Ok(stored));
        assert!(made_again(1_001, 40));
        assert!(!made_again(41, 40), "the next message to come");
        assert!(!made_again(1, 0), "an empty stream, read from its start");
    }

    /// A checkpoint of a stream since made again is refused even once the
    /// new stream has grown past its sequence, where its end no longer
    /// tells: resumed there, the copy would skip every change between the
    /// old stream's last and the new stream's first.
    #[test]
    fn a_checkpoint_of_a_stream_made_again_is_refused_past_the_new_streams_end() {
        let old = Stored {
            epoch: 1,
            lsn: Lsn(0x500),
            sequence: 1_000,
            stream: Some(7),
        };
        let grown = ends(1, 5_000, 8);
        let waiting = loadable(Some(old), grown, 0).unwrap_err();
        assert!(waiting.contains("since made again"), "{waiting}");
        let new = Stored {
            lsn: Lsn(0x900),
            sequence: 4_000,
            stream: Some(8),
            ..old
        };
        assert_eq!(loadable(Some(new), grown, 0), Ok(new));
    }

    /// A drain that keeps reading goes on past the idle bound, up to the
    /// hard one; one that stops reading ends at the idle bound; reaching the
    /// end read at the handover ends it at once.
    #[test]
    fn a_drain_lasts_while_messages_come_within_its_bound() {
        let start = tokio::time::Instant::now();
        let second = Duration::from_secs(1);
        let mut drain = Drain::new(100, start);
        assert!(!drain.over(90, start));
        assert!(drain.over(101, start), "past the end read at the handover");
        assert!(
            drain.over(90, start + HANDOVER_DRAIN_IDLE),
            "nothing read for the idle bound"
        );
        // A message every second: never idle, so only the hard bound ends it.
        let mut now = start;
        while now < start + HANDOVER_DRAIN_MAX - second {
            now += second;
            drain.progressed(now);
            assert!(!drain.over(90, now), "ended at {:?}", now - start);
        }
        assert!(
            now - start > HANDOVER_DRAIN_IDLE,
            "it went past the idle bound"
        );
        assert!(drain.over(90, start + HANDOVER_DRAIN_MAX));
        assert!(drain.deadline() <= start + HANDOVER_DRAIN_MAX);
    }
}

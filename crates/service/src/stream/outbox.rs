//! The outbox: what the replication loop applied, handed to whoever carries
//! it further (the fleet's publisher, `fleet::publish`), and how far that
//! carrier has made it durable, which caps what the slot is told.
//!
//! It lives in `stream` because it is the replication loop's contract: the
//! loop takes a place in the bounded channel *before* it applies, so an
//! applied change is always handed over. A session that stops while the
//! channel is full stops before applying, never between applying and
//! handing over: a change applied here but never handed over would be
//! missed by everyone downstream, since a resumed session skips what the
//! copy holds. Transactions the copy already held (a replay after a
//! restart) are handed over too: the carrier drops what it already stored,
//! and sends what it had not.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::lsn::Lsn;
use crate::model::{Change, Transaction};

/// What the replication loop hands over after applying.
#[derive(Debug)]
pub enum Outgoing {
    /// A transaction committed at `txn.end_lsn` in the copy of `epoch`, and
    /// the changes of the re-read merges made right after it (in order).
    Applied {
        epoch: u64,
        txn: Transaction,
        merges: Vec<Vec<Change>>,
    },
    /// The applied position moved to `lsn` with no data.
    Advanced { epoch: u64, lsn: Lsn },
}

/// The replication loop's end of the channel.
#[derive(Clone)]
pub struct Outbox {
    sender: mpsc::Sender<Outgoing>,
    state: Arc<OutboxState>,
    drain_timeout: Duration,
}

/// A reserved place in the outbox: taken before applying, used after.
pub struct Reserved<'a>(mpsc::Permit<'a, Outgoing>);

impl Reserved<'_> {
    pub fn send(self, item: Outgoing) {
        self.0.send(item);
    }
}

impl Outbox {
    /// A bounded outbox of `capacity` items and the receiving end its
    /// carrier consumes. `drain_timeout` bounds the wait at shutdown for
    /// what was handed over to be stored.
    pub fn new(capacity: usize, drain_timeout: Duration) -> (Outbox, mpsc::Receiver<Outgoing>) {
        let (sender, receiver) = mpsc::channel(capacity.max(1));
        let outbox = Outbox {
            sender,
            state: Arc::new(OutboxState::default()),
            drain_timeout,
        };
        (outbox, receiver)
    }

    /// Waits for room (the bound is what stops WAL reads while the carrier
    /// is stuck); `None` when the carrier has stopped.
    pub async fn reserve(&self) -> Option<Reserved<'_>> {
        self.sender.reserve().await.ok().map(Reserved)
    }

    /// What the slot may be told: everything handed over up to this
    /// position is stored (0 before the first).
    pub fn acknowledgeable(&self) -> Lsn {
        self.state.stored_lsn()
    }

    pub fn state(&self) -> Arc<OutboxState> {
        self.state.clone()
    }

    /// Waits (at most the drain timeout) until everything up to `lsn` is
    /// stored; says whether it was.
    pub async fn drained_to(&self, lsn: Lsn) -> bool {
        let deadline = Instant::now() + self.drain_timeout;
        while self.state.stored_lsn() < lsn {
            if Instant::now() >= deadline || self.sender.is_closed() {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }
}

/// How far the carrier got, for the slot's cap, the checkpoints and
/// `/v1/status`.
#[derive(Debug, Default)]
pub struct OutboxState {
    /// The LSN of the newest item of the current copy whose every message
    /// is stored.
    stored: Mutex<StoredItem>,
    /// The carrier's sequence (JetStream's stream sequence) of the newest
    /// message stored, and the stream it is of: read together, so a
    /// checkpoint never names a sequence of one stream as another's.
    stored_sequence: Mutex<StreamSequence>,
    connected: AtomicBool,
    last_error: Mutex<Option<String>>,
    /// The newest epoch the change stream holds, as the publisher last
    /// read it (0: none read yet). A copy of an older epoch can publish
    /// nothing there: the projector takes a new snapshot stamped above it
    /// (`replicate::next_epoch`).
    stream_epoch: AtomicU64,
    /// The newest copy epoch found behind the stream's, so each is told
    /// once, not once per message dropped.
    behind_told: AtomicU64,
    /// How many times this process took the slot over (`activated`): the
    /// publisher announces itself once per activation, and a takeover
    /// marker of another projector fences it only after its own of the
    /// same activation.
    activations: AtomicU64,
}

/// A sequence of the change stream, and which stream: one deleted and made
/// again under the same name starts its sequences over.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StreamSequence {
    /// The stream's identity (`fleet::log::StreamEnds::made_at_ns`); 0
    /// until the publisher has first read it.
    pub stream: u64,
    pub sequence: u64,
}

/// The newest item stored, and the copy (epoch) it came from.
#[derive(Debug, Default, Clone, Copy)]
struct StoredItem {
    epoch: u64,
    lsn: Lsn,
}

impl OutboxState {
    /// What the slot may be told, as far as the carrier goes: positions of
    /// the current copy only. A new copy's positions may lie below the old
    /// one's (a failover to a standby that lagged starts a timeline lower),
    /// so an old copy's stored position says nothing of the new one's.
    pub fn stored_lsn(&self) -> Lsn {
        self.stored_item().lsn
    }

    fn stored_item(&self) -> std::sync::MutexGuard<'_, StoredItem> {
        self.stored.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This process holds the slot again, with a copy of `epoch` (its
    /// follower's): its publisher announces itself anew, and nothing of
    /// a newer copy than it stored before is taken for stored
    /// (`copy_replaced`). Without it, a projector that lost the slot and
    /// won it back found the other projector's marker after its own at its
    /// first publish and stopped its process, leaving the fleet without a
    /// projector until a supervisor started one.
    pub fn activated(&self, epoch: u64) {
        self.copy_replaced(epoch);
        self.activations.fetch_add(1, Ordering::AcqRel);
    }

    /// The activation the process is in (0 before the first, and for a
    /// projector without standbys).
    pub fn activation(&self) -> u64 {
        self.activations.load(Ordering::Acquire)
    }

    /// The loop swapped in a new copy of `epoch`: nothing of it is stored
    /// yet. (Epochs only grow, `replicate::next_epoch`.)
    pub fn copy_replaced(&self, epoch: u64) {
        let mut stored = self.stored_item();
        if epoch > stored.epoch {
            *stored = StoredItem {
                epoch,
                lsn: Lsn::ZERO,
            };
        }
    }

    fn sequence_stored(&self) -> std::sync::MutexGuard<'_, StreamSequence> {
        self.stored_sequence
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// A publishing session found the change stream `stream` ending at
    /// `last`. Another stream than the one this process stored in (deleted
    /// and made again), or one that ends below what was stored in it,
    /// starts the sequences over: the next checkpoint names one of this
    /// stream, not the old one's highest, and the old stream's epoch no
    /// longer says what a copy must be above. True when it did.
    pub fn stream_is(&self, stream: u64, last: u64) -> bool {
        let mut stored = self.sequence_stored();
        let made_again = (stored.stream != 0 && stored.stream != stream) || stored.sequence > last;
        if made_again {
            stored.sequence = last;
            self.stream_epoch.store(0, Ordering::Release);
        }
        stored.stream = stream;
        made_again
    }

    /// The stream sequence of the newest message stored.
    pub fn stored_sequence(&self) -> u64 {
        self.sequence_stored().sequence
    }

    /// `stored_sequence` with the stream it is of. Read before a checkpoint
    /// takes its copy, it is a safe place to resume after in that stream:
    /// every message at or below it is in that copy.
    pub fn stored_at(&self) -> StreamSequence {
        *self.sequence_stored()
    }

    /// A message of the copy of `epoch` at `sequence` is stored; when it
    /// was the last of an item, `completes` is that item's LSN. An older
    /// copy's items (still in the channel when the copy was replaced) move
    /// only the sequence.
    pub fn note_stored(&self, epoch: u64, completes: Option<Lsn>, sequence: u64) {
        if let Some(lsn) = completes {
            let mut stored = self.stored_item();
            if epoch > stored.epoch {
                *stored = StoredItem { epoch, lsn };
            } else if epoch == stored.epoch {
                stored.lsn = stored.lsn.max(lsn);
            }
        }
        let mut stored = self.sequence_stored();
        stored.sequence = stored.sequence.max(sequence);
    }

    /// The publisher read messages of `epoch` in the change stream; true
    /// when that is newer than any it read before.
    pub fn note_stream_epoch(&self, epoch: u64) -> bool {
        self.stream_epoch.fetch_max(epoch, Ordering::AcqRel) < epoch
    }

    /// A message of the copy of `epoch` was found behind the stream's
    /// epoch; true the first time for that copy.
    pub fn note_behind(&self, epoch: u64) -> bool {
        self.behind_told.fetch_max(epoch, Ordering::AcqRel) < epoch
    }

    /// The newest epoch the change stream was found to hold (0: none yet).
    pub fn stream_epoch(&self) -> u64 {
        self.stream_epoch.load(Ordering::Acquire)
    }

    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    pub fn set_connected(&self, connected: bool) {
        self.connected.store(connected, Ordering::Release);
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn set_error(&self, error: Option<String>) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = error;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After a failover to a standby that lagged, the new copy's positions
    /// lie below what the old copy had stored: the slot of the new primary
    /// may be told only what was stored of the new copy.
    #[tokio::test]
    async fn a_new_copy_starts_with_nothing_stored_even_below_the_old_position() {
        let (outbox, _carried) = Outbox::new(4, Duration::from_millis(30));
        let state = outbox.state();
        state.note_stored(7, Some(Lsn(0x3_0000_0000)), 42);
        assert_eq!(outbox.acknowledgeable(), Lsn(0x3_0000_0000));

        state.copy_replaced(8);
        assert_eq!(outbox.acknowledgeable(), Lsn::ZERO);
        assert!(!outbox.drained_to(Lsn(0x2_8000_1000)).await);
        // An old copy's item stored late moves nothing but the sequence.
        state.note_stored(7, Some(Lsn(0x3_0000_1000)), 43);
        assert_eq!(outbox.acknowledgeable(), Lsn::ZERO);
        assert_eq!(state.stored_sequence(), 43);

        state.note_stored(8, Some(Lsn(0x2_8000_1000)), 44);
        assert_eq!(outbox.acknowledgeable(), Lsn(0x2_8000_1000));
        assert!(outbox.drained_to(Lsn(0x2_8000_1000)).await);
        // A replacement by the same or an older epoch changes nothing.
        state.copy_replaced(8);
        assert_eq!(outbox.acknowledgeable(), Lsn(0x2_8000_1000));
    }

    /// A stream deleted and made again (another identity, or an end below
    /// what was stored) starts the stored sequence over at its end, and
    /// the sequence is always read with the stream it is of.
    #[test]
    fn a_stream_made_again_starts_the_stored_sequence_over() {
        let state = OutboxState::default();
        assert!(!state.stream_is(10, 0), "the first stream read");
        state.note_stored(1, None, 500);
        assert!(!state.stream_is(10, 500), "the same stream, reconnected");
        assert_eq!(
            state.stored_at(),
            StreamSequence {
                stream: 10,
                sequence: 500
            }
        );
        // Made again, and already longer than the old one was: the old
        // stream's epoch is forgotten with it.
        state.note_stream_epoch(0x700);
        assert!(state.stream_is(11, 900));
        assert_eq!(state.stream_epoch(), 0);
        assert_eq!(
            state.stored_at(),
            StreamSequence {
                stream: 11,
                sequence: 900
            }
        );
        state.note_stored(1, None, 901);
        // Made again and shorter, seen under the same identity (a clock
        // that repeated itself): told by its end.
        assert!(state.stream_is(11, 3));
        assert_eq!(
            state.stored_at(),
            StreamSequence {
                stream: 11,
                sequence: 3
            }
        );
    }
}

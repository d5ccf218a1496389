//! The projector's side of the fleet: what it applied goes to JetStream, in
//! commit order, and the slot is acknowledged only past what JetStream
//! acknowledged.
//!
//! The replication loop hands what it applied to the outbox
//! (`stream::outbox`, where why it reserves before applying is said); the
//! publisher task sends the messages in position order, with at most
//! `fleet.max_publishes_in_flight` waiting for their acknowledgement. Each
//! carries `Nats-Msg-Id` (its position) and names the message before it, so
//! JetStream stores the stream in exactly this order or refuses: if one
//! publish is lost, every later one is refused too, and nothing is stored
//! out of order. The first publish after the stream's last stored message
//! names it by its sequence (`Nats-Expected-Last-Subject-Sequence`), one
//! after a message still in flight by its id (`Nats-Expected-Last-Msg-Id`,
//! as its sequence is not known yet). By sequence, not id, at the start:
//! nats-server 2.9 restores a stream's last message id after a restart only
//! while that message is within the duplicate window, so after an outage
//! longer than the window (120 s by default) every publish naming the last
//! id was refused, for good. On any failure the publisher
//! reads the stream's last message, drops what is already stored, and sends
//! the rest again with the same ids. While NATS is down nothing is
//! acknowledged to the slot, the outbox fills, and the replication loop
//! stops reading WAL.
//!
//! An item's messages are made one at a time, as they may go out: a
//! transaction is walked (from its spill file, when it spilled) and cut
//! into chunks as it is sent, so the publisher holds at most the messages
//! in flight and one made ahead (`vacancy_fleet_publish_buffered_bytes`),
//! never a whole transaction, however many rows it changed. An item counts
//! as stored (and the slot may pass it) only when its last message is.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::FleetError;
use super::log::ChangeLog;
use super::wire::{self, Kind, Message, Position};
use crate::lsn::Lsn;
use crate::metrics;
use crate::model::{Change, SpillError};
use crate::stream::outbox::{OutboxState, Outgoing};

/// One message ready to send: its position and holder (its id), its
/// encoding, and the LSN it completes when it is the last of its item.
struct Ready {
    position: Position,
    holder: u64,
    payload: Bytes,
    completes: Option<Lsn>,
    _counted: Buffered,
}

impl Ready {
    fn message_id(&self) -> String {
        wire::data_message_id(self.position, self.holder)
    }
}

/// Counts a payload in `vacancy_fleet_publish_buffered_bytes` while it is
/// held.
struct Buffered(usize);

static BUFFERED: AtomicUsize = AtomicUsize::new(0);
static BUFFERED_PEAK: AtomicUsize = AtomicUsize::new(0);

impl Buffered {
    fn new(bytes: usize) -> Buffered {
        let now = BUFFERED.fetch_add(bytes, Ordering::AcqRel) + bytes;
        let peak = BUFFERED_PEAK.fetch_max(now, Ordering::AcqRel).max(now);
        metrics::FLEET_PUBLISH_BUFFERED_BYTES.set(i64::try_from(now).unwrap_or(i64::MAX));
        metrics::FLEET_PUBLISH_BUFFERED_BYTES_PEAK.set(i64::try_from(peak).unwrap_or(i64::MAX));
        Buffered(bytes)
    }
}

impl Drop for Buffered {
    fn drop(&mut self) {
        let before = BUFFERED.fetch_sub(self.0, Ordering::AcqRel);
        debug_assert!(before >= self.0, "a payload uncounted twice");
        let now = before.saturating_sub(self.0);
        metrics::FLEET_PUBLISH_BUFFERED_BYTES.set(i64::try_from(now).unwrap_or(i64::MAX));
    }
}

/// One outbox item's messages, made and encoded one at a time as they are
/// sent: a spilled transaction is walked from its file, a chunk at a time,
/// and never held whole (`wire::TransactionMessages`). It lives across
/// sessions: a session that fails leaves the rest of the item here, after
/// what it puts back to send again, so the order never changes.
struct ItemMessages {
    holder: u64,
    lsn: Lsn,
    source: Source,
    /// The next message, made ahead: the one before it completes the item
    /// only if there is none.
    ahead: Option<Ready>,
}

enum Source {
    Applied {
        epoch: u64,
        max_bytes: usize,
        /// Until its commit is made; dropped then, and with it the
        /// transaction's spill file (unless another walk still holds it).
        /// Boxed: it carries the walk's reader, the other variant a message.
        transaction: Option<Box<wire::TransactionMessages>>,
        merges: std::vec::IntoIter<Vec<Change>>,
        merge: Option<wire::MergeMessages>,
        /// The sequence of the next merge's first message.
        merge_seq: u32,
    },
    Advanced(Option<Message>),
}

impl Source {
    fn next_message(&mut self, lsn: Lsn) -> Result<Option<Message>, SpillError> {
        match self {
            Source::Advanced(message) => Ok(message.take()),
            Source::Applied {
                epoch,
                max_bytes,
                transaction,
                merges,
                merge,
                merge_seq,
            } => {
                if let Some(made) = transaction {
                    if let Some(message) = made.next_message()? {
                        return Ok(Some(message));
                    }
                    *transaction = None;
                }
                loop {
                    if let Some(made) = merge {
                        if let Some(message) = made.next_message() {
                            return Ok(Some(message));
                        }
                        *merge_seq = made.next_seq();
                        *merge = None;
                    }
                    let Some(changes) = merges.by_ref().find(|m| !m.is_empty()) else {
                        return Ok(None);
                    };
                    *merge = Some(wire::MergeMessages::new(
                        *epoch, lsn, *merge_seq, changes, *max_bytes,
                    ));
                }
            }
        }
    }
}

impl ItemMessages {
    fn new(item: Outgoing, max_bytes: usize, holder: u64) -> ItemMessages {
        let (lsn, source) = match item {
            Outgoing::Applied { epoch, txn, merges } => (
                txn.end_lsn,
                Source::Applied {
                    epoch,
                    max_bytes,
                    transaction: Some(Box::new(wire::TransactionMessages::new(
                        epoch, txn, max_bytes,
                    ))),
                    merges: merges.into_iter(),
                    merge: None,
                    merge_seq: 0,
                },
            ),
            Outgoing::Advanced { epoch, lsn } => (
                lsn,
                Source::Advanced(Some(wire::advance_message(epoch, lsn))),
            ),
        };
        ItemMessages {
            holder,
            lsn,
            source,
            ahead: None,
        }
    }

    /// The next message to send, `None` after the item's last. A spilled
    /// transaction's file is read as far as the message after it.
    fn next_ready(&mut self) -> Result<Option<Ready>, SpillError> {
        let next = match self.ahead.take() {
            Some(ready) => ready,
            None => match self.make()? {
                Some(ready) => ready,
                None => return Ok(None),
            },
        };
        self.ahead = self.make()?;
        Ok(Some(Ready {
            completes: self.ahead.is_none().then_some(self.lsn),
            ..next
        }))
    }

    /// Makes and encodes the next message; its changes go once encoded.
    fn make(&mut self) -> Result<Option<Ready>, SpillError> {
        let Some(mut message) = self.source.next_message(self.lsn)? else {
            return Ok(None);
        };
        debug_assert!(message.position.kind != Kind::Takeover, "data only");
        message.holder = self.holder;
        let payload = Bytes::from(message.encode());
        Ok(Some(Ready {
            position: message.position,
            holder: message.holder,
            _counted: Buffered::new(payload.len()),
            payload,
            completes: None,
        }))
    }
}

/// Publishes the outbox until shutdown (then what was handed over before
/// it, bounded by the ack timeout), reconnecting with backoff.
pub async fn run_publisher(
    settings: super::FleetSettings,
    state: Arc<OutboxState>,
    mut outbox: mpsc::Receiver<Outgoing>,
    shutdown: CancellationToken,
) {
    // Sent but not yet acknowledged, or waiting to be sent again, in order;
    // then the rest of the item they came from, not made yet.
    let mut unsent: VecDeque<Ready> = VecDeque::new();
    let mut current: Option<ItemMessages> = None;
    let mut backoff = Duration::from_millis(100);
    // This process's mark on what it publishes; its takeover marker goes
    // first, once.
    let holder: u64 = rand::random();
    // The activation (`OutboxState::activation`) this process's takeover
    // marker was stored in, once it was.
    let mut announced: Option<u64> = None;
    loop {
        if shutdown.is_cancelled() && unsent.is_empty() && current.is_none() && outbox.is_empty() {
            return;
        }
        let log = match ChangeLog::connect(&settings).await {
            Ok(log) => log,
            Err(error) => {
                failed(&state, &error);
                if pause(&shutdown, &mut backoff).await {
                    return;
                }
                continue;
            }
        };
        state.set_connected(true);
        let session = Session {
            log: &log,
            state: &state,
            holder,
        };
        match session
            .run(
                &mut announced,
                &mut unsent,
                &mut current,
                &mut outbox,
                &shutdown,
            )
            .await
        {
            Ok(()) => return,
            Err(error @ FleetError::Spill(_)) => {
                // The transaction left the outbox and cannot be read again:
                // publishing on would skip it. Stop; the slot was not
                // acknowledged past it, so the next start sends it again.
                state.set_connected(false);
                metrics::FLEET_PUBLISH_ERRORS.inc();
                tracing::error!(%error, "stopping this projector");
                state.set_error(Some(error.to_string()));
                shutdown.cancel();
                return;
            }
            Err(error @ FleetError::Fenced { .. }) => {
                // Another projector took the stream over: nothing more of
                // ours may reach it. Stop the process; its supervisor
                // starts it again as a standby.
                state.set_connected(false);
                metrics::FLEET_PUBLISH_ERRORS.inc();
                tracing::error!(%error, "fenced: stopping this projector");
                state.set_error(Some(error.to_string()));
                shutdown.cancel();
                return;
            }
            Err(error) => {
                state.set_connected(false);
                failed(&state, &error);
                if pause(&shutdown, &mut backoff).await {
                    return;
                }
            }
        }
    }
}

fn failed(state: &OutboxState, error: &FleetError) {
    metrics::FLEET_PUBLISH_ERRORS.inc();
    tracing::warn!(%error, "publishing to JetStream failed; the slot is not acknowledged past what was stored");
    state.set_error(Some(error.to_string()));
}

/// Sleeps the backoff (doubling it, at most 5 s); true when shutdown came
/// first.
async fn pause(shutdown: &CancellationToken, backoff: &mut Duration) -> bool {
    let wait = *backoff;
    *backoff = (*backoff * 2).min(Duration::from_secs(5));
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(wait) => false,
    }
}

/// One connected publishing session.
struct Session<'a> {
    log: &'a ChangeLog,
    state: &'a OutboxState,
    holder: u64,
}

impl Session<'_> {
    /// Publishes until the outbox closes (or shutdown finds it empty). What
    /// it holds is bounded by `fleet.max_publishes_in_flight` messages of
    /// at most `fleet.max_chunk_bytes` each, plus the one made ahead: an
    /// item's next message is made only when one may go out, however large
    /// its transaction.
    async fn run(
        &self,
        announced: &mut Option<u64>,
        unsent: &mut VecDeque<Ready>,
        current: &mut Option<ItemMessages>,
        outbox: &mut mpsc::Receiver<Outgoing>,
        shutdown: &CancellationToken,
    ) -> Result<(), FleetError> {
        let log = self.log;
        let state = self.state;
        let max_bytes = log.settings.max_chunk_bytes;
        let max_in_flight = log.settings.max_publishes_in_flight.max(1);
        // A stream of another identity than the one this process stored in,
        // or one that ends below what it stored, was deleted and made again
        // (`ChangeLog::connect` makes a missing one): a checkpoint must not
        // name the old stream's sequences. Within a session the stream
        // cannot change unseen: every publish names the message before it,
        // which a stream made again does not hold.
        let ends = log.ends().await?;
        let stored_before = state.stored_sequence();
        if state.stream_is(ends.made_at_ns, ends.last) {
            tracing::warn!(
                stream_last = ends.last,
                stored = stored_before,
                "the change stream is not the one this projector stored in: it was made again"
            );
        }
        // Where the stream ends now: anything at or below it is stored.
        let last = log.last_message().await?;
        // Fenced only by a marker after this process's own of the same
        // activation: one stored while this process stood by is the
        // projector it took the slot back from.
        let activation = self.state.activation();
        if *announced == Some(activation)
            && let Some((message, _)) = &last
            && message.holder != self.holder
        {
            return Err(FleetError::Fenced { by: message.holder });
        }
        // The stream's last message, by sequence (0: none on the subject).
        let mut last_sequence = last.as_ref().map_or(0, |(_, s)| *s);
        let stored = Stored {
            data: last.as_ref().and_then(|(m, _)| m.data_position()),
            sequence: last.as_ref().map_or(0, |(_, s)| *s),
        };
        // A copy must be of this epoch or a newer one to publish here
        // (`skip_or_keep`); the projector stamps a new copy above it.
        if let Some(data) = stored.data {
            state.note_stream_epoch(data.epoch);
        }
        // Drop what is stored; it counts as acknowledged.
        let mut pending: VecDeque<Ready> = VecDeque::new();
        for ready in unsent.drain(..) {
            stored.skip_or_keep(ready, state, &mut pending);
        }
        let mut in_flight: VecDeque<(Ready, PublishAckFuture)> = VecDeque::new();
        loop {
            // Make the current item's next messages, only as many as may
            // go out now.
            while in_flight.len() + pending.len() < max_in_flight
                && let Some(item) = current.as_mut()
            {
                match item.next_ready() {
                    Ok(Some(ready)) => stored.skip_or_keep(ready, state, &mut pending),
                    // Done: the transaction (its spill file) goes.
                    Ok(None) => *current = None,
                    Err(error) => {
                        requeue(unsent, in_flight, pending, None);
                        return Err(error.into());
                    }
                }
            }
            // This process's first data goes after its takeover marker: only
            // the projector that holds the slot hands anything over, so a
            // standby's publisher announces nothing.
            let activation = self.state.activation();
            if *announced != Some(activation) && !pending.is_empty() {
                match self.announce(last_sequence, stored.data, activation).await {
                    Ok(sequence) => last_sequence = sequence,
                    Err(error) => {
                        requeue(unsent, in_flight, pending, None);
                        return Err(error);
                    }
                }
                *announced = Some(activation);
            }
            // Send what is waiting, up to the bound.
            while in_flight.len() < max_in_flight
                && let Some(ready) = pending.pop_front()
            {
                let mut publish = PublishMessage::build()
                    .payload(ready.payload.clone())
                    .message_id(ready.message_id());
                publish = match in_flight.back() {
                    Some((previous, _)) => publish.expected_last_message_id(previous.message_id()),
                    None => publish.expected_last_subject_sequence(last_sequence),
                };
                match log
                    .jetstream
                    .send_publish(log.settings.subject.clone(), publish)
                    .await
                {
                    Ok(ack) => in_flight.push_back((ready, ack)),
                    Err(error) => {
                        // After those in flight, which were sent before it.
                        pending.push_front(ready);
                        requeue(unsent, in_flight, pending, None);
                        return Err(FleetError::Nats(format!("publish: {error}")));
                    }
                }
            }
            // The acknowledgement waits at most `fleet.publish_ack_timeout_ms`
            // (the JetStream context's timeout, `ChangeLog::connect`).
            if let Some((ready, ack)) = in_flight.pop_front() {
                match ack.await {
                    Ok(ack) => {
                        metrics::FLEET_MESSAGES_PUBLISHED.inc();
                        last_sequence = ack.sequence;
                        state.note_stored(ready.position.epoch, ready.completes, ack.sequence);
                        state.set_error(None);
                    }
                    Err(error) => {
                        let wrong_order = matches!(
                            error.kind(),
                            PublishErrorKind::WrongLastMessageId
                                | PublishErrorKind::WrongLastSequence
                        );
                        requeue(unsent, in_flight, pending, Some(ready));
                        return Err(FleetError::Nats(if wrong_order {
                            format!(
                                "the stream's last message is not the one before this publish (a lost publish, or another projector): {error}"
                            )
                        } else {
                            format!("publish acknowledgement: {error}")
                        }));
                    }
                }
                continue;
            }
            if current.is_some() || !pending.is_empty() {
                continue;
            }
            // Nothing in flight, nothing left of the item: wait for the
            // replication loop.
            let item = tokio::select! {
                biased;
                item = outbox.recv() => item,
                _ = shutdown.cancelled(), if outbox.is_empty() => None,
            };
            let Some(item) = item else {
                return Ok(());
            };
            *current = Some(ItemMessages::new(item, max_bytes, self.holder));
        }
    }
}

impl Session<'_> {
    /// Publishes this process's takeover marker after the stream's last
    /// message (at `last_sequence`, 0 for none; its data position is
    /// `after`); returns the marker's sequence.
    /// Stores this process's takeover marker of `activation` after the
    /// stream's message `last_sequence`; its sequence.
    async fn announce(
        &self,
        last_sequence: u64,
        after: Option<Position>,
        activation: u64,
    ) -> Result<u64, FleetError> {
        let log = self.log;
        let marker = Message::takeover(self.holder, after);
        // One id per activation: JetStream answers a message id it stored
        // within its duplicate window as stored, at the old sequence,
        // without checking the expected last sequence. A projector that
        // took the slot back within two minutes had its second marker
        // "stored" at its first's place, then found the other projector's
        // marker after its own and stopped.
        let publish = PublishMessage::build()
            .payload(Bytes::from(marker.encode()))
            .message_id(format!("{}-{activation}", marker.message_id()))
            .expected_last_subject_sequence(last_sequence);
        let ack = log
            .jetstream
            .send_publish(log.settings.subject.clone(), publish)
            .await
            .map_err(|e| FleetError::Nats(format!("takeover marker: {e}")))?
            .await
            .map_err(|e| FleetError::Nats(format!("takeover marker: {e}")))?;
        if ack.duplicate {
            return Err(FleetError::Nats(format!(
                "takeover marker: taken for a duplicate of sequence {}, not stored",
                ack.sequence
            )));
        }
        tracing::info!(
            holder = format!("{:x}", self.holder),
            ?after,
            sequence = ack.sequence,
            "took over the change stream"
        );
        Ok(ack.sequence)
    }
}

/// The end of the change stream when a session began.
#[derive(Debug, Clone, Copy)]
struct Stored {
    /// The last data position stored.
    data: Option<Position>,
    /// The stream sequence it was stored at, or before.
    sequence: u64,
}

impl Stored {
    /// Keeps `ready` to send unless the stream already holds its position
    /// (`data`, stored at `sequence` or before). A transaction whose chunks
    /// the stream holds only in part (a projector that stopped in the
    /// middle of it) is sent again whole, from its first chunk: consumers
    /// start a transaction over at a first chunk.
    fn skip_or_keep(&self, ready: Ready, state: &OutboxState, pending: &mut VecDeque<Ready>) {
        let position = ready.position;
        let Some(stored) = self.data else {
            pending.push_back(ready);
            return;
        };
        if position.epoch < stored.epoch {
            // Another projector snapshotted since (or this one's copy is of
            // an owner whose positions went back: a restored owner, or a
            // standby promoted behind the old copy). Consumers ignore an
            // older epoch, so the message can never be of use: it is
            // dropped, never acknowledged (the slot keeps it), and the
            // projector takes a new snapshot stamped above the stream's
            // epoch (`replicate`), which replicas bootstrap from. Refused
            // instead, it stopped the publisher for good.
            state.note_stream_epoch(stored.epoch);
            if state.note_behind(position.epoch) {
                metrics::FLEET_PUBLISH_ERRORS.inc();
                tracing::error!(
                    ours = position.epoch,
                    stream = stored.epoch,
                    "the change stream holds a newer epoch than this projector's copy: nothing of it is published until a new snapshot replaces it"
                );
                state.set_error(Some(format!(
                    "the change stream is at epoch {:x}, this projector's copy at {:x}: taking a new snapshot",
                    stored.epoch, position.epoch
                )));
            }
            return;
        }
        let partly_stored = stored.kind == Kind::Chunk
            && position.epoch == stored.epoch
            && position.lsn == stored.lsn;
        if position <= stored && !partly_stored {
            // Stored by an earlier session (or process): acknowledged. Its
            // own sequence is not known, only that it is at or below the
            // stream's end: that end may name a checkpoint ("every message
            // at or below it is in the copy") only once the copy holds the
            // last position stored, not while it replays those before it
            // (a takeover whose drain stopped short of the old holder's end).
            let sequence = if position == stored { self.sequence } else { 0 };
            state.note_stored(position.epoch, ready.completes, sequence);
        } else {
            pending.push_back(ready);
        }
    }
}

/// Puts everything not acknowledged back in order, to be sent again: the
/// failed message (first sent of them all), then those in flight, then
/// those not yet sent.
fn requeue(
    unsent: &mut VecDeque<Ready>,
    in_flight: VecDeque<(Ready, PublishAckFuture)>,
    pending: VecDeque<Ready>,
    failed: Option<Ready>,
) {
    unsent.extend(failed);
    unsent.extend(in_flight.into_iter().map(|(ready, _)| ready));
    unsent.extend(pending);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{CalendarKey, HeldBudget, HeldChanges, NightCounts, Transaction};
    use chrono::{DateTime, NaiveDate, Utc};

    fn night(i: i64) -> Change {
        Change::UpsertNight {
            key: CalendarKey {
                hotel_id: i % 13,
                room_type_id: i,
            },
            night: NaiveDate::from_ymd_opt(2027, 1, 1).unwrap() + chrono::Days::new(i as u64 % 300),
            counts: NightCounts {
                total: 5,
                taken: (i % 5) as i32,
                sell_limit: None,
                price_cents: Some(12_000),
            },
        }
    }

    async fn spilled(dir: &std::path::Path, n: i64) -> Transaction {
        let mut held = HeldChanges::new(HeldBudget::new(4096, dir.to_path_buf()));
        for i in 0..n {
            held.push(1, night(i)).await.unwrap();
        }
        let changes = held.finish().await.unwrap();
        assert!(changes.spilled_bytes().is_some());
        Transaction {
            xid: 42,
            commit_lsn: Lsn(0x9000),
            end_lsn: Lsn(0x9040),
            commit_time: DateTime::<Utc>::from_timestamp_micros(1_800_000_000_000_000).unwrap(),
            changes,
        }
    }

    /// An item made one message at a time is the messages made whole
    /// (transaction, then each non-empty merge numbered on), with this
    /// process's holder, and only its last completes the item's LSN; the
    /// spill file goes once the transaction's commit is made.
    #[tokio::test]
    async fn an_item_made_one_at_a_time_is_the_same_messages_and_completes_at_its_last() {
        let dir = tempfile::tempdir().unwrap();
        let txn = spilled(dir.path(), 20_000).await;
        let merges = vec![
            (0..3).map(night).collect::<Vec<_>>(),
            Vec::new(),
            (0..2_000).map(night).collect(),
        ];
        let mut expected = wire::transaction_messages(7, &txn, 4096).unwrap();
        let mut seq = 0;
        for merge in merges.iter().filter(|m| !m.is_empty()) {
            let parts = wire::merge_messages(7, txn.end_lsn, seq, merge, 4096);
            seq += parts.len() as u32;
            expected.extend(parts);
        }
        assert!(expected.len() > 20, "{} messages", expected.len());
        let mut item = ItemMessages::new(
            Outgoing::Applied {
                epoch: 7,
                txn,
                merges,
            },
            4096,
            0xfeed,
        );
        let mut made = Vec::new();
        let mut file_gone_at = None;
        while let Some(ready) = item.next_ready().unwrap() {
            if file_gone_at.is_none() && std::fs::read_dir(dir.path()).unwrap().count() == 0 {
                file_gone_at = Some(made.len());
            }
            made.push(ready);
        }
        assert!(item.next_ready().unwrap().is_none());
        assert_eq!(made.len(), expected.len());
        for (i, (ready, mut message)) in made.iter().zip(expected).enumerate() {
            message.holder = 0xfeed;
            assert_eq!(ready.position, message.position, "message {i}");
            assert_eq!(ready.payload, Bytes::from(message.encode()), "message {i}");
            let last = i + 1 == made.len();
            assert_eq!(ready.completes, last.then_some(Lsn(0x9040)), "message {i}");
        }
        let commit = made
            .iter()
            .position(|r| r.position.kind == Kind::Commit)
            .unwrap();
        assert_eq!(
            file_gone_at,
            Some(commit),
            "the file goes once the commit marker is made (one message ahead)"
        );
    }

    /// The one message of an advance of the copy of `epoch` to `lsn`.
    fn advance_ready(epoch: u64, lsn: u64) -> Ready {
        ItemMessages::new(
            Outgoing::Advanced {
                epoch,
                lsn: Lsn(lsn),
            },
            4096,
            1,
        )
        .next_ready()
        .unwrap()
        .expect("one message")
    }

    /// A standby that took over replays what the old holder stored: each
    /// item is acknowledged, but the stream's end names a checkpoint only
    /// once the copy holds the last position stored.
    #[test]
    fn a_replay_of_stored_items_moves_the_sequence_only_at_the_last() {
        let advance = |lsn| advance_ready(1, lsn);
        let stored = Stored {
            data: Some(wire::advance_message(1, Lsn(0x900)).position),
            sequence: 100,
        };
        let state = OutboxState::default();
        let mut pending = VecDeque::new();
        stored.skip_or_keep(advance(0x500), &state, &mut pending);
        assert!(pending.is_empty(), "stored before: not sent again");
        assert_eq!(state.stored_lsn(), Lsn(0x500));
        assert_eq!(state.stored_sequence(), 0, "0x900 is not in the copy yet");

        stored.skip_or_keep(advance(0x900), &state, &mut pending);
        assert!(pending.is_empty());
        assert_eq!(state.stored_lsn(), Lsn(0x900));
        assert_eq!(state.stored_sequence(), 100);

        stored.skip_or_keep(advance(0xa00), &state, &mut pending);
        assert_eq!(pending.len(), 1, "past the end: sent");
        assert_eq!(state.stored_sequence(), 100);
    }

    /// A copy of an older epoch than the stream holds publishes nothing
    /// and acknowledges nothing; the stream's epoch is noted (the
    /// projector snapshots above it) and told once per copy.
    #[test]
    fn a_copy_behind_the_streams_epoch_publishes_nothing_and_notes_the_epoch() {
        let advance = advance_ready;
        let stored = Stored {
            data: Some(wire::advance_message(9, Lsn(0x900)).position),
            sequence: 100,
        };
        let state = OutboxState::default();
        let mut pending = VecDeque::new();
        stored.skip_or_keep(advance(5, 0xa00), &state, &mut pending);
        assert!(pending.is_empty(), "an older epoch's message is not sent");
        assert_eq!(state.stored_lsn(), Lsn::ZERO, "nor acknowledged");
        assert_eq!(state.stream_epoch(), 9);
        assert!(!state.note_behind(5), "told once for the copy of epoch 5");
        assert!(
            state.note_behind(6),
            "a newer copy found behind is told again"
        );

        // The copy stamped above the stream's epoch publishes.
        stored.skip_or_keep(advance(10, 0x100), &state, &mut pending);
        assert_eq!(pending.len(), 1);
    }

    #[test]
    fn an_advance_is_one_message_that_completes_its_lsn() {
        let mut item = ItemMessages::new(
            Outgoing::Advanced {
                epoch: 3,
                lsn: Lsn(0x500),
            },
            4096,
            1,
        );
        let ready = item.next_ready().unwrap().expect("one message");
        assert_eq!(
            ready.position,
            wire::advance_message(3, Lsn(0x500)).position
        );
        assert_eq!(ready.completes, Some(Lsn(0x500)));
        assert!(item.next_ready().unwrap().is_none());
    }
}

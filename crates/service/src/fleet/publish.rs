//! The projector's side of the fleet: what it applied goes to JetStream, in
//! commit order, and the slot is acknowledged only past what JetStream
//! acknowledged.
//!
//! The replication loop hands what it applied to the outbox
//! (`stream::outbox`, where why it reserves before applying is said); the
//! publisher task sends the messages in position order, with at most
//! `fleet.max_publishes_in_flight` waiting for their acknowledgement. Each
//! carries `Nats-Msg-Id` (its position) and `Nats-Expected-Last-Msg-Id`
//! (the message before it), so JetStream stores the stream in exactly this
//! order or refuses: if one publish is lost, every later one is refused
//! too, and nothing is stored out of order. On any failure the publisher
//! reads the stream's last message, drops what is already stored, and sends
//! the rest again with the same ids. While NATS is down nothing is
//! acknowledged to the slot, the outbox fills, and the replication loop
//! stops reading WAL.

use std::collections::VecDeque;
use std::sync::Arc;
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
use crate::stream::outbox::{OutboxState, Outgoing};

/// One message ready to send, and the LSN it completes when it is the last
/// of its item.
struct Ready {
    message: Message,
    payload: Bytes,
    completes: Option<Lsn>,
}

fn ready_messages(item: Outgoing, max_bytes: usize, holder: u64) -> Result<Vec<Ready>, FleetError> {
    let (messages, lsn) = match item {
        Outgoing::Applied { epoch, txn, merges } => {
            let lsn = txn.end_lsn;
            // A spilled transaction is read back here, and its file removed
            // when `txn` goes at the end of this function.
            let mut messages = wire::transaction_messages(epoch, &txn, max_bytes)?;
            let mut seq = 0u32;
            for merge in merges.iter().filter(|m| !m.is_empty()) {
                let parts = wire::merge_messages(epoch, lsn, seq, merge, max_bytes);
                seq += parts.len() as u32;
                messages.extend(parts);
            }
            (messages, lsn)
        }
        Outgoing::Advanced { epoch, lsn } => (vec![wire::advance_message(epoch, lsn)], lsn),
    };
    let count = messages.len();
    Ok(messages
        .into_iter()
        .enumerate()
        .map(|(i, mut message)| {
            message.holder = holder;
            Ready {
                payload: Bytes::from(message.encode()),
                message,
                completes: (i + 1 == count).then_some(lsn),
            }
        })
        .collect())
}

/// Publishes the outbox until shutdown (then what was handed over before
/// it, bounded by the ack timeout), reconnecting with backoff.
pub async fn run_publisher(
    settings: super::FleetSettings,
    state: Arc<OutboxState>,
    mut outbox: mpsc::Receiver<Outgoing>,
    shutdown: CancellationToken,
) {
    // Sent but not yet acknowledged, or waiting to be sent again, in order.
    let mut unsent: VecDeque<Ready> = VecDeque::new();
    let mut backoff = Duration::from_millis(100);
    // This process's mark on what it publishes; its takeover marker goes
    // first, once.
    let holder: u64 = rand::random();
    let mut announced = false;
    loop {
        if shutdown.is_cancelled() && unsent.is_empty() && outbox.is_empty() {
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
            .run(&mut announced, &mut unsent, &mut outbox, &shutdown)
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
    async fn run(
        &self,
        announced: &mut bool,
        unsent: &mut VecDeque<Ready>,
        outbox: &mut mpsc::Receiver<Outgoing>,
        shutdown: &CancellationToken,
    ) -> Result<(), FleetError> {
        let log = self.log;
        let state = self.state;
        let max_bytes = log.settings.max_chunk_bytes;
        let max_in_flight = log.settings.max_publishes_in_flight;
        // Where the stream ends now: anything at or below it is stored.
        let last = log.last_message().await?;
        if *announced
            && let Some((message, _)) = &last
            && message.holder != self.holder
        {
            return Err(FleetError::Fenced { by: message.holder });
        }
        let mut last_id = last.as_ref().map(|(m, _)| m.message_id());
        let last_data = last.as_ref().and_then(|(m, _)| m.data_position());
        let last_sequence = last.as_ref().map_or(0, |(_, s)| *s);
        // Drop what is stored; it counts as acknowledged.
        let mut pending: VecDeque<Ready> = VecDeque::new();
        for ready in unsent.drain(..) {
            skip_or_keep(ready, last_data, last_sequence, state, &mut pending)?;
        }
        let mut in_flight: VecDeque<(Ready, PublishAckFuture)> = VecDeque::new();
        loop {
            // This process's first data goes after its takeover marker: only
            // the projector that holds the slot hands anything over, so a
            // standby's publisher announces nothing.
            if !*announced && !pending.is_empty() {
                last_id = Some(self.announce(last_id.as_deref(), last_data).await?);
                *announced = true;
            }
            // Send what is waiting, up to the bound.
            while in_flight.len() < max_in_flight
                && let Some(ready) = pending.pop_front()
            {
                let mut publish = PublishMessage::build()
                    .payload(ready.payload.clone())
                    .message_id(ready.message.message_id());
                let previous = in_flight
                    .back()
                    .map(|(r, _)| r.message.message_id())
                    .or(last_id.clone());
                if let Some(previous) = previous {
                    publish = publish.expected_last_message_id(previous);
                }
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
            if let Some((ready, ack)) = in_flight.pop_front() {
                match ack.await {
                    Ok(ack) => {
                        metrics::FLEET_MESSAGES_PUBLISHED.inc();
                        last_id = Some(ready.message.message_id());
                        state.note_stored(ready.completes, ack.sequence);
                        state.set_error(None);
                    }
                    Err(error) => {
                        let wrong_order = error.kind() == PublishErrorKind::WrongLastMessageId;
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
            // Nothing in flight: wait for the replication loop.
            let item = tokio::select! {
                biased;
                item = outbox.recv() => item,
                _ = shutdown.cancelled(), if outbox.is_empty() => None,
            };
            let Some(item) = item else {
                return Ok(());
            };
            for ready in ready_messages(item, max_bytes, self.holder)? {
                skip_or_keep(ready, last_data, last_sequence, state, &mut pending)?;
            }
        }
    }
}

impl Session<'_> {
    /// Publishes this process's takeover marker after `last_id` (the
    /// stream's last message, whose data position is `after`); returns the
    /// marker's id.
    async fn announce(
        &self,
        last_id: Option<&str>,
        after: Option<Position>,
    ) -> Result<String, FleetError> {
        let log = self.log;
        let marker = Message::takeover(self.holder, after);
        let mut publish = PublishMessage::build()
            .payload(Bytes::from(marker.encode()))
            .message_id(marker.message_id());
        if let Some(id) = last_id {
            publish = publish.expected_last_message_id(id);
        }
        let ack = log
            .jetstream
            .send_publish(log.settings.subject.clone(), publish)
            .await
            .map_err(|e| FleetError::Nats(format!("takeover marker: {e}")))?
            .await
            .map_err(|e| FleetError::Nats(format!("takeover marker: {e}")))?;
        tracing::info!(
            holder = format!("{:x}", self.holder),
            ?after,
            sequence = ack.sequence,
            "took over the change stream"
        );
        Ok(marker.message_id())
    }
}

/// Keeps `ready` to send unless the stream already holds its position
/// (`last_data`, stored at `last_sequence` or before). A transaction whose
/// chunks the stream holds only in part (a projector that stopped in the
/// middle of it) is sent again whole, from its first chunk: consumers
/// start a transaction over at a first chunk.
fn skip_or_keep(
    ready: Ready,
    last_data: Option<Position>,
    last_sequence: u64,
    state: &OutboxState,
    pending: &mut VecDeque<Ready>,
) -> Result<(), FleetError> {
    let position = ready.message.position;
    let Some(stored) = last_data else {
        pending.push_back(ready);
        return Ok(());
    };
    if position.epoch < stored.epoch {
        return Err(FleetError::EpochBehind {
            ours: position.epoch,
            stream: stored.epoch,
        });
    }
    let partly_stored =
        stored.kind == Kind::Chunk && position.epoch == stored.epoch && position.lsn == stored.lsn;
    if position <= stored && !partly_stored {
        // Stored by an earlier session (or process): acknowledged.
        state.note_stored(ready.completes, last_sequence);
    } else {
        pending.push_back(ready);
    }
    Ok(())
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

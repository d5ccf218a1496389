//! One stale-read loop for the whole fleet: take outcomes travel through a
//! JetStream stream of their own, and every node counts all of them, in
//! that stream's order.
//!
//! Why: behind a load balancer each node sees a share of the booking
//! service's reports. Counted where they land, two nodes would give
//! different bypass advice for one hotel, and a report retried on another
//! node would count twice. So no node counts a report posted to it; it
//! publishes it, and counts what the stream delivers, like every other node:
//!
//! - **Publish** (`OutcomeStream::submit`, from `POST /v1/take-outcomes`):
//!   the report, checked as on a standalone node, goes to
//!   `fleet.outcomes_subject` with `Nats-Msg-Id` = hex SHA-256 of its
//!   attempt id (ids are the caller's, up to 200 bytes of any text), so
//!   JetStream stores one report per id within its duplicate window; a
//!   repeat is answered with the first one's sequence.
//! - **Consume** (`run`, one task per node): an ordered consumer from the
//!   sequence after what the ledger holds, reconnecting with backoff. Each
//!   message is checked again (the quote key is the fleet's) and recorded
//!   by `stale::outcomes::Ledger::apply` in stream order: the first report
//!   of an id in the stream wins on every node, a different one under the
//!   id is refused by every node, and ids are remembered for
//!   `stale.attempt_ttl_secs` (far past the stream's duplicate window). Its
//!   window bucket is that of the message's time in the stream, not of its
//!   arrival here.
//! - **Answer**: once JetStream acknowledged the publish (sequence `s`), the
//!   request waits until this node has applied `s`, then answers from the
//!   ledger: the winner's report → 200 (`Idempotent-Replayed: true` unless
//!   this very publish was the one counted), another report → 409. NATS
//!   unreachable, or `s` not applied within `fleet.request_timeout_ms` →
//!   503 (`/problems/outcomes-unavailable`): never counted here alone,
//!   which would make the nodes disagree. A publish that timed out may still
//!   have been stored; its retry is then answered as a replay.
//! - **Checkpoints** carry the ledger with the sequence it holds every
//!   outcome up to (`StaleCarry::outcomes_sequence`), taken under the
//!   ledger's stream lock, so the state and the sequence match exactly. A
//!   node starting from a checkpoint (its own, a replica's bootstrap, a
//!   standby's) restores it before this task begins, which then reads from
//!   the next sequence: nothing counted twice, nothing dropped. The task
//!   waits for the copy to be loaded, since that is when a checkpoint's
//!   carry (or none, after a snapshot) has been restored.
//! - **Retention**: if the stream no longer holds the next sequence, the
//!   node logs how many outcomes it missed and reads on from the first
//!   kept (`vacancy_fleet_outcomes_missed_total`); those outcomes count on
//!   the nodes that read them in time. A stream made again (another
//!   identity than the last session's, or one that ends before what the
//!   ledger applied) is read from its start; a session checks every
//!   `STREAM_CHECK` that its stream is still there, and makes it again if
//!   not.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::{self, message::PublishMessage};
use chrono::Utc;
use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::FleetError;
use super::log::ChangeLog;
use super::settings::FleetSettings;
use crate::metrics;
use crate::model::ReadModel;
use crate::stale::StaleReadState;
use crate::stale::outcomes::{Recording, ReportError, TakeOutcomeBody, TakeReport};

/// How often the task looks whether the copy (and so the ledger's start)
/// is in, before it begins.
const START_POLL: Duration = Duration::from_millis(100);

/// How often a session checks that its outcome stream is still the one it
/// reads. The ordered consumer of a deleted stream does not end: it keeps
/// trying to make itself again, so without the check no node made the
/// stream again and every report was answered 503, for good.
const STREAM_CHECK: Duration = Duration::from_secs(2);

/// Why a take outcome posted to a fleet node has no answer but a refusal.
#[derive(Debug, thiserror::Error)]
pub enum OutcomeError {
    /// The ledger refused it: another report under its attempt id won.
    #[error(transparent)]
    Report(#[from] ReportError),
    /// Not published: NATS unreachable, or JetStream did not acknowledge.
    #[error("the fleet's outcome stream is unavailable: {0}")]
    Unavailable(String),
    /// Stored, but this node had not counted it yet when the wait ended.
    #[error(
        "the outcome was stored (sequence {sequence}) but not yet counted by this node within {waited:?}"
    )]
    NotApplied { sequence: u64, waited: Duration },
    /// Stored in an outcome stream this node has not read yet: the stream
    /// was deleted and made again meanwhile. Its sequence says nothing of
    /// what this node counted; a retry, once the node reads the new
    /// stream, is answered from it.
    #[error(
        "the outcome stream was made again (sequence {sequence} is of a stream this node has not read yet); retry"
    )]
    StreamMadeAgain { sequence: u64 },
}

/// How far a node has counted the outcome stream: every outcome up to
/// `sequence` of the stream made at `stream` (`log::StreamEnds::made_at_ns`;
/// 0 before the first session, and known from this process's sessions only:
/// a checkpoint's carried sequence does not name its stream). One watch
/// for both, so a request never pairs a sequence with another stream's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Applied {
    stream: u64,
    sequence: u64,
}

impl Applied {
    /// Whether an acknowledged publish is of the stream this count is of,
    /// so waiting for `sequence` here waits for that message. `holder` is
    /// the stream under the name when read after the acknowledgement: the
    /// acknowledgement's, or one made later still. It must be this count's.
    /// A sequence alone does not tell: NATS's ordered consumer, its stream
    /// deleted and made again, attaches itself to the new one from the
    /// sequence after its last, so a node counts on in the new stream
    /// under the old one's name until its own check (`STREAM_CHECK`) ends
    /// the session. Past that, a stored message gets a sequence past every
    /// one its stream held, which this node counted up to at most; a
    /// duplicate's is the first message's, below the count as often as not.
    fn holds_ack(&self, sequence: u64, duplicate: bool, holder: u64) -> bool {
        holder == self.stream && (duplicate || sequence > self.sequence)
    }
}

/// The outcome stream as one node uses it: the HTTP handler publishes
/// through it and waits on it; `run` consumes.
pub struct OutcomeStream {
    settings: FleetSettings,
    stale: Arc<StaleReadState>,
    model: Arc<ReadModel>,
    /// The connection publishes go through: the consumer's latest
    /// session's (`None` before the first connected, which a request
    /// waits for, bounded). Cloned out of the watch, never borrowed
    /// across an await.
    publisher: watch::Sender<Option<jetstream::Context>>,
    /// What the ledger holds every outcome up to, and of which stream (one
    /// deleted and made again under the same name starts its sequences
    /// over), for requests waiting on their own.
    applied: watch::Sender<Applied>,
    progress: Mutex<OutcomesProgress>,
}

/// `/v1/status` `fleet.outcomes`.
#[derive(Debug, Default, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct OutcomesProgress {
    /// Connected to the outcome stream and reading it.
    pub connected: bool,
    /// Every outcome of the stream up to this sequence is counted here.
    pub applied_sequence: u64,
    /// The sequence this node began reading after: a checkpoint's (0: the
    /// stream's start). Absent until it began (it waits for the copy).
    pub started_after: Option<u64>,
    /// Outcomes that left the stream (retention) before this node read them.
    pub missed: u64,
    pub last_error: Option<String>,
}

impl OutcomeStream {
    /// `stale` must be shared by the fleet (`StaleReadState::shared_by_fleet`).
    pub fn new(
        settings: FleetSettings,
        stale: Arc<StaleReadState>,
        model: Arc<ReadModel>,
    ) -> Arc<OutcomeStream> {
        debug_assert!(
            stale.ledger.is_shared(),
            "a fleet's ledger counts the stream only"
        );
        Arc::new(OutcomeStream {
            settings,
            stale,
            model,
            publisher: watch::Sender::new(None),
            applied: watch::Sender::new(Applied::default()),
            progress: Mutex::new(OutcomesProgress::default()),
        })
    }

    pub fn progress(&self) -> OutcomesProgress {
        self.progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn update(&self, f: impl FnOnce(&mut OutcomesProgress)) {
        f(&mut self.progress.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// Publishes a checked report (`body` as posted, `report` as checked),
    /// waits until this node counted what JetStream stored for its attempt
    /// id, and answers as the ledger decided. Bounded as a whole by
    /// `fleet.request_timeout_ms`.
    pub async fn submit(
        &self,
        body: &TakeOutcomeBody,
        report: &TakeReport,
    ) -> Result<Recording, OutcomeError> {
        let budget = self.settings.request_timeout();
        let started = tokio::time::Instant::now();
        let deadline = started + budget;
        // A node just started (ready, its outcome task connecting) is
        // waited for, within the budget.
        let mut publisher = self.publisher.subscribe();
        let context = tokio::time::timeout_at(deadline, publisher.wait_for(Option::is_some))
            .await
            .map_err(|_| {
                OutcomeError::Unavailable(format!("not connected to NATS within {budget:?}"))
            })?
            .map_err(|_| OutcomeError::Unavailable("the outcome task stopped".into()))?
            .clone()
            .ok_or_else(|| OutcomeError::Unavailable("not connected to NATS".into()))?;
        // Before the publish: the count its acknowledgement is judged by.
        let before = *self.applied.borrow();
        let payload = serde_json::to_vec(body)
            .map_err(|e| OutcomeError::Unavailable(format!("the report does not encode: {e}")))?;
        let publish = PublishMessage::build()
            .message_id(message_id(&report.attempt_id))
            .payload(payload.into());
        let subject = self.settings.outcomes_subject.clone();
        let publisher = context.clone();
        let acknowledged = tokio::time::timeout_at(deadline, async move {
            publisher.send_publish(subject, publish).await?.await
        })
        .await;
        let ack = match acknowledged {
            Ok(Ok(ack)) => ack,
            Ok(Err(error)) => {
                metrics::FLEET_OUTCOMES_PUBLISHED
                    .with_label_values(&["error"])
                    .inc();
                return Err(OutcomeError::Unavailable(format!("publishing: {error}")));
            }
            Err(_) => {
                metrics::FLEET_OUTCOMES_PUBLISHED
                    .with_label_values(&["error"])
                    .inc();
                return Err(OutcomeError::Unavailable(format!(
                    "JetStream did not acknowledge within {budget:?}"
                )));
            }
        };
        metrics::FLEET_OUTCOMES_PUBLISHED
            .with_label_values(&[if ack.duplicate { "duplicate" } else { "stored" }])
            .inc();
        let sequence = ack.sequence;
        // Which stream holds it: one request more per report, the price of
        // never answering from another stream's count.
        let holder = self.stream_made_at(&context, deadline).await?;
        if !before.holds_ack(sequence, ack.duplicate, holder) {
            return Err(OutcomeError::StreamMadeAgain { sequence });
        }
        let mut applied = self.applied.subscribe();
        let reached = *tokio::time::timeout_at(
            deadline,
            applied.wait_for(|a| a.sequence >= sequence || a.stream != before.stream),
        )
        .await
        .map_err(|_| OutcomeError::NotApplied {
            sequence,
            waited: started.elapsed(),
        })?
        .map_err(|_| OutcomeError::Unavailable("the outcome consumer stopped".into()))?;
        // Made again while this request waited: the count reached is of
        // another stream than the acknowledgement's.
        if reached.stream != before.stream {
            return Err(OutcomeError::StreamMadeAgain { sequence });
        }
        // The answer as the ledger counted it: its quote judged at the
        // stream's time of the winning message (`apply`); an id the ledger
        // no longer holds, at this moment, just after that time.
        let mut counted = report.clone();
        counted.quote_expired = match self.stale.ledger.winner(report) {
            Some(winner) => winner
                .quote_expired
                .unwrap_or_else(|| self.stale.ledger.aged(report, Utc::now()).quote_expired),
            None => self.stale.ledger.aged(report, Utc::now()).quote_expired,
        };
        let answer = counted.answer();
        // Counted by this request only if its publish was stored (not a
        // duplicate) and that message won the id. An id the ledger no
        // longer holds (its capacity evicted it within this wait) is
        // answered by the publish alone: a stored message was applied as
        // new, since an id the ledger held would still be there.
        let counted_here = match self.stale.ledger.winner(report) {
            Some(winner) if !winner.same_report => {
                return Err(ReportError::AttemptReused.into());
            }
            Some(winner) => !ack.duplicate && winner.sequence == sequence,
            None => !ack.duplicate,
        };
        Ok(if counted_here {
            Recording::New(answer)
        } else {
            Recording::Replay(answer)
        })
    }

    /// When the outcome stream now under its name was made, by `deadline`,
    /// as `log::StreamEnds::made_at_ns` says it.
    async fn stream_made_at(
        &self,
        context: &jetstream::Context,
        deadline: tokio::time::Instant,
    ) -> Result<u64, OutcomeError> {
        let name = &self.settings.outcomes_stream;
        let stream = tokio::time::timeout_at(deadline, context.get_stream(name))
            .await
            .map_err(|_| OutcomeError::Unavailable(format!("{name} did not answer in time")))?
            .map_err(|e| OutcomeError::Unavailable(format!("reading {name}: {e}")))?;
        Ok(super::log::made_at_ns(
            stream.cached_info().created.unix_timestamp_nanos(),
        ))
    }

    /// Counts the message the stream stored at `sequence`, published at
    /// `published_ns` (nanoseconds since the Unix epoch, the server's
    /// clock). Holds std locks only, never awaits.
    fn apply(&self, sequence: u64, published_ns: i128, payload: &[u8]) {
        let ledger = &self.stale.ledger;
        let before = ledger.applied();
        if sequence <= before {
            return; // delivered again after the consumer's recreation
        }
        // One subject, so sequences are contiguous unless retention
        // removed messages before this node read them.
        if sequence > before + 1 {
            let missed = sequence - before - 1;
            tracing::warn!(
                expected = before + 1,
                got = sequence,
                missed,
                "outcomes left the stream before this node read them; reading on from the first kept"
            );
            metrics::FLEET_OUTCOMES_MISSED.inc_by(missed);
            self.update(|p| p.missed += missed);
        }
        let now_ns = Utc::now()
            .timestamp_nanos_opt()
            .map_or(i128::MAX, i128::from);
        // A server clock ahead of this node's: no age rather than a negative one.
        let age = Duration::from_nanos(u64::try_from(now_ns - published_ns).unwrap_or(0));
        let checked =
            TakeOutcomeBody::from_json(payload).and_then(|body| body.check(&self.stale.key));
        let result = match checked {
            Ok(report) => match ledger.apply(sequence, &report, age, stored_at(published_ns)) {
                Ok(Recording::New(_)) => "new",
                Ok(Recording::Replay(_)) => "replay",
                Err(_) => "refused",
            },
            Err(error) => {
                // Every node refuses it alike (same key, same checks).
                tracing::warn!(sequence, %error, "an outcome in the stream is not a valid report; skipped");
                ledger.skip(sequence);
                "invalid"
            }
        };
        metrics::FLEET_OUTCOMES_APPLIED
            .with_label_values(&[result])
            .inc();
        debug_assert_eq!(ledger.applied(), sequence);
        self.applied.send_modify(|a| a.sequence = sequence);
        self.update(|p| p.applied_sequence = sequence);
    }

    /// One connection and consumer, from the sequence after what the
    /// ledger holds, until shutdown or an error.
    async fn session(&self, shutdown: &CancellationToken) -> Result<(), FleetError> {
        let log = ChangeLog::connect_outcomes(&self.settings).await?;
        let ends = log.outcome_ends().await?;
        let ledger = &self.stale.ledger;
        let known = self.applied.borrow().stream;
        // Another stream than the last session's, or one that ends before
        // what this node counted: made again. Read from its start, since
        // this node counted none of it: read from its end, as before, the
        // reports other nodes put there since were never counted here, and
        // a new stream already past the old position was not noticed at all.
        if (known != 0 && known != ends.made_at_ns) || ends.last < ledger.applied() {
            let before_first = ends.first.saturating_sub(1);
            tracing::warn!(
                last = ends.last,
                applied = ledger.applied(),
                stream = %self.settings.outcomes_stream,
                "the outcome stream is not the one this node counted: it was made again; reading it from its start"
            );
            ledger.rebase(before_first);
        }
        // Stream and count together, before any publish goes through
        // this session: a request never sees one without the other.
        self.applied.send_modify(|a| {
            *a = Applied {
                stream: ends.made_at_ns,
                sequence: ledger.applied(),
            }
        });
        self.publisher.send_replace(Some(log.jetstream.clone()));
        let stream = log.outcomes().await?;
        let start_sequence = ledger.applied() + 1;
        let consumer = log
            .bounded(stream.create_consumer(pull::OrderedConfig {
                filter_subject: self.settings.outcomes_subject.clone(),
                deliver_policy: DeliverPolicy::ByStartSequence { start_sequence },
                ..Default::default()
            }))
            .await?
            .map_err(|e| {
                FleetError::Nats(format!(
                    "a consumer of {}: {e}",
                    self.settings.outcomes_stream
                ))
            })?;
        let mut messages = log.bounded(consumer.messages()).await?.map_err(|e| {
            FleetError::Nats(format!("consuming {}: {e}", self.settings.outcomes_stream))
        })?;
        self.update(|p| {
            p.connected = true;
            p.last_error = None;
        });
        tracing::info!(from = start_sequence, stream = %self.settings.outcomes_stream, "reading the outcome stream");
        let mut check =
            tokio::time::interval_at(tokio::time::Instant::now() + STREAM_CHECK, STREAM_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // No bound on this wait: an idle stream is normal, and the
            // ordered consumer's heartbeats end it when the server is gone.
            let delivered = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                _ = check.tick() => {
                    // Made again if missing; the next session reads it.
                    let now = log.outcome_ends().await?;
                    if now.made_at_ns != ends.made_at_ns {
                        return Err(FleetError::Nats(format!(
                            "the outcome stream {} was deleted and made again",
                            self.settings.outcomes_stream
                        )));
                    }
                    continue;
                }
                next = messages.next() => next,
            };
            let Some(received) = delivered else {
                return Err(FleetError::Nats(
                    "the outcome stream's consumer ended".into(),
                ));
            };
            let message = received.map_err(|e| {
                FleetError::Nats(format!("consuming {}: {e}", self.settings.outcomes_stream))
            })?;
            let (sequence, published_ns) = {
                let info = message
                    .info()
                    .map_err(|e| FleetError::Nats(format!("a message without stream info: {e}")))?;
                (info.stream_sequence, info.published.unix_timestamp_nanos())
            };
            self.apply(sequence, published_ns, &message.payload);
        }
    }
}

/// The stream's time of a message, from nanoseconds since the Unix epoch
/// (clamped into what a timestamp holds).
fn stored_at(published_ns: i128) -> chrono::DateTime<Utc> {
    let clamped =
        i64::try_from(published_ns).unwrap_or(if published_ns < 0 { i64::MIN } else { i64::MAX });
    chrono::DateTime::from_timestamp_nanos(clamped)
}

/// The message id of an attempt's report: hex SHA-256 of the attempt id,
/// a fixed-length header whatever text the caller chose as the id.
pub fn message_id(attempt_id: &str) -> String {
    Sha256::digest(attempt_id.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The node's outcome task: waits until the copy is loaded (so a
/// checkpoint's stale-read state, if any, is restored), begins the
/// ledger's consumption there, then reads the stream until shutdown,
/// reconnecting with backoff.
pub async fn run(outcomes: Arc<OutcomeStream>, shutdown: CancellationToken) {
    let mut poll = tokio::time::interval(START_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !outcomes.model.freshness.is_loaded() {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = poll.tick() => {}
        }
    }
    let after = outcomes.stale.ledger.begin_consuming();
    outcomes.applied.send_modify(|a| a.sequence = after);
    outcomes.update(|p| {
        p.started_after = Some(after);
        p.applied_sequence = after;
    });
    tracing::info!(
        after,
        "the copy is in; counting the fleet's outcomes after this sequence"
    );
    let mut backoff = Duration::from_millis(100);
    loop {
        let ended = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            ended = outcomes.session(&shutdown) => ended,
        };
        let was_connected = outcomes.progress().connected;
        outcomes.update(|p| p.connected = false);
        match ended {
            Ok(()) => return,
            Err(error) => {
                tracing::warn!(%error, "outcome stream session ended; reconnecting");
                outcomes.update(|p| p.last_error = Some(error.to_string()));
            }
        }
        if was_connected {
            backoff = Duration::from_millis(100);
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node that has not yet noticed its outcome stream was made again
    /// took a new stream's small sequence for one it had counted, and
    /// answered a report it had not counted (or a retry another node
    /// stored differently, 200 where every other node says 409).
    #[test]
    fn an_acknowledgement_of_a_stream_made_again_is_never_waited_on() {
        let counted = Applied {
            stream: 11,
            sequence: 500,
        };
        // Stored: past everything its stream held, which this node counted.
        assert!(counted.holds_ack(501, false, 11));
        assert!(
            !counted.holds_ack(3, false, 11),
            "stored at 3: another stream"
        );
        assert!(!counted.holds_ack(500, false, 11));
        // Past the count, but the stream under the name is a new one (the
        // ordered consumer may already count it under the old one's name).
        assert!(!counted.holds_ack(501, false, 12));
        // A retry's duplicate: the first message's sequence, often below
        // the count; only the stream holding it tells.
        assert!(counted.holds_ack(7, true, 11));
        assert!(!counted.holds_ack(7, true, 12), "held by a new stream");
    }

    #[test]
    fn message_ids_are_fixed_length_hex_of_the_attempt_id() {
        let id = message_id("attempt-1");
        assert_eq!(id.len(), 64);
        assert!(
            id.chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_eq!(id, message_id("attempt-1"));
        assert_ne!(id, message_id("attempt-2"));
        assert_eq!(message_id(&"x".repeat(200)).len(), 64);
    }
}

//! The fleet's shared log in NATS JetStream: one connection, the change
//! stream and the checkpoint bucket, created if missing; and the outcome
//! stream (`fleet::outcomes`), on a connection of its own.
//!
//! Every node calls `ChangeLog::connect` with the same `[fleet]` names; the
//! first creates the stream and the bucket, the others find them. Only
//! APIs that Debian's nats-server 2.9 serves are used (the crate is built
//! without its `server_2_10` features).

use std::time::Duration;

use async_nats::jetstream::{self, object_store, stream};

use super::FleetError;
use super::settings::FleetSettings;
use super::wire::Message;

/// A stream's first and last sequence, and which stream it is: one deleted
/// and made again under the same name (an operator, a NATS server that
/// lost its store) starts its sequences over, so a sequence means nothing
/// without the stream it is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamEnds {
    pub first: u64,
    pub last: u64,
    /// When the stream was made (JetStream's `created`), in nanoseconds
    /// since 1970: the stream's identity. Never 0, which means "unknown".
    pub made_at_ns: u64,
}

/// A stream's identity from its `created` time in nanoseconds since 1970,
/// which fit a u64 until 2554; a time before 1970 (a clock gone wrong)
/// reads as 1, still not "unknown" (0).
pub(super) fn made_at_ns(created_ns: i128) -> u64 {
    u64::try_from(created_ns).unwrap_or(1).max(1)
}

/// A connected JetStream context and the names it works with.
#[derive(Clone)]
pub struct ChangeLog {
    pub(super) jetstream: jetstream::Context,
    pub(super) settings: FleetSettings,
}

impl ChangeLog {
    /// Connects (bounded by `fleet.request_timeout_ms`) and makes sure the
    /// change stream and the checkpoint bucket exist.
    pub async fn connect(settings: &FleetSettings) -> Result<ChangeLog, FleetError> {
        let log = ChangeLog::connect_only(settings).await?;
        log.changes().await?;
        log.checkpoints().await?;
        Ok(log)
    }

    /// Connects and makes sure the outcome stream exists, nothing else: the
    /// outcome loop's own connection, so take outcomes are not queued
    /// behind the projector's publishes or a checkpoint's transfer.
    pub async fn connect_outcomes(settings: &FleetSettings) -> Result<ChangeLog, FleetError> {
        let log = ChangeLog::connect_only(settings).await?;
        log.outcomes().await?;
        Ok(log)
    }

    async fn connect_only(settings: &FleetSettings) -> Result<ChangeLog, FleetError> {
        let timeout = settings.request_timeout();
        let client = tokio::time::timeout(
            timeout,
            async_nats::ConnectOptions::new()
                .connection_timeout(timeout)
                .request_timeout(Some(timeout))
                .connect(settings.nats_url.as_str()),
        )
        .await
        .map_err(|_| FleetError::Nats(format!("connecting to {} timed out", settings.nats_url)))?
        .map_err(|e| FleetError::Nats(format!("cannot connect to {}: {e}", settings.nats_url)))?;
        // Awaited acknowledgements wait `timeout` (the builder's, not the
        // client's request timeout: nats.rs#1558 was about the reverse);
        // publishes past `max_ack_inflight` wait for a permit instead of
        // failing, which is the projector's bound on what is in flight.
        let jetstream = jetstream::context::ContextBuilder::new()
            .timeout(settings.publish_ack_timeout())
            .max_ack_inflight(settings.max_publishes_in_flight)
            .backpressure_on_inflight(true)
            .build(client);
        Ok(ChangeLog {
            jetstream,
            settings: settings.clone(),
        })
    }

    /// The change stream, created with the configured retention if missing.
    pub(super) async fn changes(&self) -> Result<stream::Stream, FleetError> {
        let s = &self.settings;
        self.stream_of(&s.stream, &s.subject).await
    }

    /// The outcome stream, created like the change stream if missing.
    pub(super) async fn outcomes(&self) -> Result<stream::Stream, FleetError> {
        let s = &self.settings;
        self.stream_of(&s.outcomes_stream, &s.outcomes_subject)
            .await
    }

    /// The stream `name` over the one `subject`, with the configured
    /// retention and duplicate window, created if missing.
    async fn stream_of(&self, name: &str, subject: &str) -> Result<stream::Stream, FleetError> {
        let s = &self.settings;
        let config = stream::Config {
            name: name.to_string(),
            subjects: vec![subject.to_string()],
            storage: stream::StorageType::File,
            retention: stream::RetentionPolicy::Limits,
            discard: stream::DiscardPolicy::Old,
            max_age: Duration::from_secs(s.max_age_secs),
            max_bytes: if s.max_bytes == 0 { -1 } else { s.max_bytes },
            duplicate_window: Duration::from_secs(s.duplicate_window_secs),
            ..Default::default()
        };
        self.bounded(self.jetstream.get_or_create_stream(config))
            .await?
            .map_err(|e| FleetError::Nats(format!("stream {name}: {e}")))
    }

    /// The checkpoint bucket, created (file storage) if missing.
    pub(super) async fn checkpoints(&self) -> Result<object_store::ObjectStore, FleetError> {
        let bucket = &self.settings.checkpoint_bucket;
        if let Ok(Ok(store)) = self.bounded(self.jetstream.get_object_store(bucket)).await {
            return Ok(store);
        }
        self.bounded(self.jetstream.create_object_store(object_store::Config {
            bucket: bucket.clone(),
            description: Some("vacancy checkpoints: the fleet's bootstrap".into()),
            storage: stream::StorageType::File,
            ..Default::default()
        }))
        .await?
        .map_err(|e| FleetError::Nats(format!("checkpoint bucket {bucket}: {e}")))
    }

    /// The newest message on the change subject and its stream sequence,
    /// `None` when there is none.
    pub(super) async fn last_message(&self) -> Result<Option<(Message, u64)>, FleetError> {
        let stream = self.changes().await?;
        match self
            .bounded(stream.get_last_raw_message_by_subject(&self.settings.subject))
            .await?
        {
            Ok(raw) => {
                let message = Message::decode(&raw.payload)?;
                Ok(Some((message, raw.sequence)))
            }
            Err(e)
                if e.kind()
                    == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
            {
                Ok(None)
            }
            Err(e) => Err(FleetError::Nats(format!(
                "the last message of {}: {e}",
                self.settings.stream
            ))),
        }
    }

    /// The change stream's first sequence still kept (retention may have
    /// removed older ones) and its last (0 when empty).
    pub(super) async fn sequences(&self) -> Result<(u64, u64), FleetError> {
        let ends = self.ends().await?;
        Ok((ends.first, ends.last))
    }

    /// The change stream's ends, and which stream it is.
    pub(super) async fn ends(&self) -> Result<StreamEnds, FleetError> {
        let stream = self.changes().await?;
        self.ends_of(stream).await
    }

    /// As `sequences`, of the outcome stream.
    pub(super) async fn outcome_ends(&self) -> Result<StreamEnds, FleetError> {
        let stream = self.outcomes().await?;
        self.ends_of(stream).await
    }

    async fn ends_of(&self, mut stream: stream::Stream) -> Result<StreamEnds, FleetError> {
        let name = stream.cached_info().config.name.clone();
        let info = self
            .bounded(stream.info())
            .await?
            .map_err(|e| FleetError::Nats(format!("stream {name}: {e}")))?;
        Ok(StreamEnds {
            first: info.state.first_sequence,
            last: info.state.last_sequence,
            made_at_ns: made_at_ns(info.created.unix_timestamp_nanos()),
        })
    }

    /// Bounds one JetStream request by `fleet.request_timeout_ms`.
    pub(super) async fn bounded<T>(
        &self,
        request: impl Future<Output = T>,
    ) -> Result<T, FleetError> {
        let timeout = self.settings.request_timeout();
        tokio::time::timeout(timeout, request)
            .await
            .map_err(|_| FleetError::Nats(format!("a JetStream request took over {timeout:?}")))
    }
}

//! The fleet: one projector holds the slot and publishes what it applies to
//! NATS JetStream; any number of replicas bootstrap from its checkpoints and
//! apply that stream. The owner then sees one walsender and no table COPY,
//! however many replicas serve search.
//!
//! Why NATS JetStream and not a protocol of our own: the log between one
//! slot and many copies must be durable before the slot lets the owner free
//! its WAL, must keep order, de-duplicate re-sent messages and hold the
//! checkpoints replicas start from. JetStream does all four, and Debian
//! ships its server.
//!
//! - [`settings`]: `[fleet]`: the role and the names every node shares.
//! - [`wire`]: the messages, their positions (epoch, LSN, kind, sequence),
//!   ids and chunking; a replica's assembly of chunked transactions.
//! - [`log`]: the connection, the change stream and the checkpoint bucket.
//! - [`publish`]: the projector's publisher: the outbox to JetStream, in
//!   order, acknowledged before the slot is.
//! - [`store`]: checkpoints in the object store: the projector's uploader,
//!   a replica's download.
//! - [`replica`]: bootstrap, then apply the stream; the owner position poll.
//! - [`standby`]: the projector role with failover: follow the stream like
//!   a replica until the slot is free, then project.
//! - [`outcomes`]: the fleet's one stale-read loop: take outcomes through a
//!   stream of their own, counted by every node in that stream's order.

mod log;
pub mod outcomes;
pub mod publish;
pub mod replica;
mod settings;
pub mod standby;
pub mod store;
pub mod wire;

pub use settings::{FleetSettings, Role};

use std::sync::Arc;

use crate::checkpoint::CheckpointError;
use crate::model::ApplyError;
use crate::owner::OwnerError;
use crate::stream::outbox::Outbox;

/// What goes wrong between a node and the fleet's log.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// NATS unreachable, a JetStream request refused or timed out.
    #[error("nats: {0}")]
    Nats(String),
    #[error(transparent)]
    Wire(#[from] wire::WireError),
    #[error("owner: {0}")]
    Owner(String),
    #[error(transparent)]
    OwnerConnect(#[from] OwnerError),
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] CheckpointError),
    #[error("apply: {0}")]
    Apply(#[from] ApplyError),
    /// Another projector published a takeover marker after this one's: it
    /// must publish nothing more.
    #[error("fenced: projector {by:x} took over the change stream")]
    Fenced { by: u64 },
    /// An operator asked a replica to bootstrap again (the admin
    /// resnapshot): it loads the newest checkpoint, serving meanwhile.
    #[error("an operator asked for a new bootstrap")]
    BootstrapAsked { asked: u64 },
    /// A replica met a message of a newer epoch: it bootstraps again.
    #[error("the change stream moved to epoch {stream:x}; this copy is of {ours:x}")]
    NewEpoch { ours: u64, stream: u64 },
    /// An applied transaction's spill file could not be read back to be
    /// published: the projector stops (the slot keeps it, unacknowledged,
    /// for the next start).
    #[error("publishing a spilled transaction: {0}")]
    Spill(#[from] crate::model::SpillError),
}

/// This node's part in the fleet, for `/v1/status`.
pub struct FleetStatus {
    pub role: Role,
    /// The projector's outbox (what its publisher stored).
    pub outbox: Option<Outbox>,
    /// A replica's progress (readiness follows it).
    pub replica: Option<Arc<replica::ReplicaState>>,
    /// A projector's follower, while it stands by.
    pub follower: Option<Arc<replica::ReplicaState>>,
    /// A projector: whether it holds the slot now (set by `standby`).
    pub active: Arc<std::sync::atomic::AtomicBool>,
    /// Every fleet node: the outcome stream it publishes to and counts.
    pub outcomes: Option<Arc<outcomes::OutcomeStream>>,
    /// `fleet.ready_max_messages_behind`.
    pub ready_max_messages_behind: u64,
}

impl FleetStatus {
    pub fn new(settings: &FleetSettings) -> FleetStatus {
        FleetStatus {
            role: settings.role,
            outbox: None,
            replica: None,
            follower: None,
            active: Arc::default(),
            outcomes: None,
            ready_max_messages_behind: settings.ready_max_messages_behind,
        }
    }

    pub fn report(&self) -> FleetReport {
        FleetReport {
            role: self.role.label(),
            active: (self.role == Role::Projector)
                .then(|| self.active.load(std::sync::atomic::Ordering::Acquire)),
            publisher: self.outbox.as_ref().map(|outbox| {
                let state = outbox.state();
                PublisherReport {
                    connected: state.connected(),
                    stored_lsn: state.stored_lsn(),
                    stored_sequence: state.stored_sequence(),
                    last_error: state.last_error(),
                }
            }),
            replica: self
                .replica
                .as_ref()
                .or(self.follower.as_ref())
                .map(|r| r.progress()),
            outcomes: self.outcomes.as_ref().map(|o| o.progress()),
        }
    }
}

/// `/v1/status` `fleet`.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct FleetReport {
    /// standalone, projector or replica.
    pub role: &'static str,
    /// A projector: whether it holds the slot (false: standing by).
    pub active: Option<bool>,
    /// The projector's publishing to JetStream.
    pub publisher: Option<PublisherReport>,
    /// A replica's bootstrap and position in the change stream (a
    /// projector's: while it stood by, following the stream).
    pub replica: Option<replica::ReplicaProgress>,
    /// Where this node stands in the fleet's outcome stream.
    pub outcomes: Option<outcomes::OutcomesProgress>,
}

#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct PublisherReport {
    pub connected: bool,
    /// Every change applied up to this LSN is stored in JetStream; the slot
    /// is acknowledged no further.
    #[schema(value_type = String)]
    pub stored_lsn: crate::lsn::Lsn,
    pub stored_sequence: u64,
    pub last_error: Option<String>,
}

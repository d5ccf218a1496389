//! The SOURCE side: how the owner's changes reach the copy.
//!
//! - [`slot`]: the publication and the replication slot on the owner.
//! - [`snapshot`]: the starting state, read inside the slot's exported snapshot.
//! - [`decode`]: pgoutput rows into the model's `Change`s.
//! - [`txn`]: events grouped into whole committed transactions.
//! - [`refresh`]: the TTL safety net: re-reads between DBLog watermarks.
//! - [`replicate`]: the loop: connect, snapshot or resume, apply, acknowledge,
//!   reconnect.
//! - [`checkpoints`]: when a checkpoint is loaded or written, and the
//!   acknowledgement cap it sets (the file itself is `crate::checkpoint`).
//! - [`heartbeat`]: a logical message at an interval, so an idle owner's lag
//!   stays measurable.
//! - [`slot_watch`]: the slot's state and the owner's WAL position, polled.

pub mod checkpoints;
pub mod decode;
pub mod heartbeat;
pub mod outbox;
pub mod refresh;
pub mod replicate;
mod settings;
pub mod slot;
pub mod slot_watch;
pub mod snapshot;
pub mod txn;

pub use replicate::{Projector, StreamStatus};
pub use settings::StreamSettings;

/// Prefix of the logical decoding messages `vacancy` writes (heartbeats).
pub const MESSAGE_PREFIX: &str = "vacancy";

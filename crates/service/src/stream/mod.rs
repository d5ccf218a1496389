//! The SOURCE side: how the owner's changes reach the copy.
//!
//! - [`slot`]: the publication and the replication slot on the owner.
//! - [`snapshot`]: the starting state, read inside the slot's exported snapshot.
//! - [`decode`]: pgoutput rows into the model's `Change`s.
//! - [`txn`]: events grouped into whole committed transactions.
//! - [`refresh`]: the TTL safety net: re-reads between DBLog watermarks.
//! - [`replicate`]: the loop: connect, snapshot or resume, apply, acknowledge,
//!   reconnect; plus the heartbeat and the slot watch.

pub mod decode;
pub mod refresh;
pub mod replicate;
pub mod slot;
pub mod snapshot;
pub mod txn;

pub use replicate::{Projector, StreamError, StreamStatus};

/// Prefix of the logical decoding messages `vacancy` writes (heartbeats).
pub const MESSAGE_PREFIX: &str = "vacancy";

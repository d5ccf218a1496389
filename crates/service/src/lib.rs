//! `vacancy-service`: a read copy of a booking site's room inventory that
//! serves guest search without loading the owner database.
//!
//! Layout, in the order a change flows from the owner to a guest:
//!
//! - [`owner`]: the owner database: how to reach it (URL, password, TLS), and
//!   reads that return the snapshot they saw.
//! - [`lsn`]: `Lsn`, a WAL position as PostgreSQL writes it.
//! - [`stream`]: publication and slot, the snapshot tied to the slot, the
//!   replication loop that assembles transactions and acknowledges LSNs
//!   (no further than the newest durable checkpoint, when on); when a
//!   checkpoint is loaded or written; the TTL safety net, the heartbeat and
//!   the slot watch.
//! - [`model`]: the in-memory read model of hotels, room types and nightly
//!   counts, applied one whole transaction at a time, with its freshness.
//! - [`checkpoint`]: the whole copy at one LSN in one file (hotels, room
//!   types, calendars, the applied-xid ring, the TTLs' time left, the
//!   stale-read loop's window and counted attempt ids), written atomically
//!   and read back only whole, so a restart need not copy the owner again.
//! - [`fleet`]: past one machine: the projector publishes what it applied
//!   and its checkpoints to NATS JetStream; replicas bootstrap from a
//!   checkpoint and apply that stream, with no slot of their own.
//! - [`index`]: hotels and room types in tantivy, re-indexed in batches.
//! - [`search`]: which hotels fit the party on every night; few units
//!   confirmed against the owner's WAL position (or read from the owner); a
//!   signed quote on every room type shown.
//! - [`stale`]: the stale-read loop: quote tokens, take outcomes and the
//!   stale-read share, bypass advice, the divergence audit.
//! - [`http`]: the HTTP surface: guest search, the events stream and page,
//!   the booking service's endpoints, the operators', access and errors.
//! - [`metrics`]: every Prometheus metric, defined in one place.
//! - [`logging`]: the `[log]` settings and the subscriber.
//! - [`setting`]: the error a settings section gives, and shared rules.
//! - [`config`]: settings, layered from `config/default.toml`, a file and
//!   `VACANCY_*`, composed of the sections the modules define.
//! - [`app`]: wiring: spawn the tasks, one shutdown token, the HTTP server.
//!
//! Every module is private; what the `vacancy` binary, the lab
//! (`vacancy-lab`) and the integration tests may use is the list below.
//! `metrics` alone is public as a module, because tests and benches read
//! counters back by the names the dashboards use.

mod app;
mod checkpoint;
mod config;
mod fleet;
mod http;
mod index;
mod logging;
mod lsn;
pub mod metrics;
mod model;
mod owner;
mod search;
mod setting;
mod stale;
mod stream;

pub use app::{App, AppError, PanickedTask, StopTimeout, start};
pub use checkpoint::{
    CheckpointError, CheckpointName, Choice, Header as CheckpointHeader, HeaderField, Identity,
    Loaded, Skipped, StaleCarry, Written, choose as choose_checkpoint, list as list_checkpoints,
    load as load_checkpoint, prune as prune_checkpoints, verify as verify_checkpoint,
    write as write_checkpoint, write_model as checkpoint_model,
};
pub use config::{ConfigError, Settings};
pub use fleet::wire::{Body as FleetBody, Message as FleetMessage};
pub use fleet::{FleetSettings, Role as FleetRole};
pub use index::{HotelIndex, IndexError};
pub use logging::{LogFormat, LogSettings, init_logging};
pub use lsn::{Lsn, ParseLsnError, Position};
/// What a held transaction costs in memory until it spills (`stream.max_held_bytes`).
pub use model::held::{HELD_CHANGE_BYTES, SPILLING_BYTES};
pub use model::{CalendarKey, NightCounts, ReadModel, Source};
pub use owner::endpoint::{PasswordSources, redacted_url};
pub use owner::{Endpoint, EndpointError, OwnerError, SslMode, connect};
pub use search::{FreshReads, WhenLagging};
pub use stale::token::QuoteKey;
pub use stream::checkpoints::{Checkpoints, Trigger as CheckpointTrigger};
pub use stream::refresh::{MAX_OPEN_WINDOWS, Refresh};
pub use stream::slot;
pub use stream::snapshot::SnapshotPhase;
pub use stream::{Projector, StreamStatus};

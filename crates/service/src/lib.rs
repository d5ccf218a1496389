//! `vacancy`: a read copy of a booking site's room inventory that serves guest
//! search without loading the owner database.
//!
//! Layout, in the order a change flows from the owner to a guest:
//!
//! - [`owner`]: the owner database: how to reach it (URL, password, TLS), and
//!   reads that return the snapshot they saw.
//! - [`stream`]: publication and slot, the snapshot tied to the slot, the
//!   replication loop that assembles transactions and acknowledges LSNs.
//! - [`model`]: the in-memory read model of hotels, room types and nightly
//!   counts, applied one whole transaction at a time, with its freshness.
//! - [`index`]: hotels and room types in tantivy, re-indexed in batches.
//! - [`search`]: which hotels fit the party on every night; owner reads for few
//!   units; a signed quote on every room type shown.
//! - [`stale`]: the stale-read loop: quote tokens, take outcomes and the
//!   409-after-shown-available share, bypass advice, the divergence audit.
//! - [`access`]: who may call what and how often: per-client rate limit on
//!   search, bearer tokens, CORS.
//! - [`api`]: the HTTP surface (search, take outcomes, bypass, status, calendar,
//!   health, metrics, admin resnapshot).
//! - [`events`]: a hotel's committed count changes as Server-Sent Events,
//!   fed by the model's change feed, resumable with `Last-Event-ID`.
//! - [`page`]: the guest page at `/` (plain HTML, CSS, JavaScript in the binary).
//! - [`metrics`]: every Prometheus metric, defined in one place.
//! - [`config`]: settings, layered from `config/default.toml`, a file and `VACANCY_*`.
//! - [`app`]: wiring: spawn the tasks, one shutdown token, signals.
//! - [`lsn`]: `Lsn`, a WAL position as PostgreSQL writes it.

pub mod app;
pub mod config;
pub mod http;
pub mod index;
pub mod logging;
pub mod lsn;
pub mod metrics;
pub mod model;
pub mod owner;
pub mod search;
pub mod setting;
pub mod stale;
pub mod stream;

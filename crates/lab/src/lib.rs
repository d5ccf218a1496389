//! `vacancy-lab`: what tests, measures and demonstrates the service, never
//! what runs in production. It depends on `vacancy-service`; the service
//! does not depend on it (the workspace makes that a compile error).
//!
//! Layout:
//!
//! - [`cluster`]: throwaway PostgreSQL clusters (and a streaming standby) from
//!   the machine's server binaries, removed on drop.
//! - [`schema`]: the owner's reference schema.
//! - [`seed`]: a deterministic generated dataset, loaded through COPY.
//! - [`ops`]: what the booking service does on the owner: hold, confirm,
//!   release, cancel, sweep, capacity.
//! - [`http_client`]: the one HTTP client of the lab and the tests (reqwest).
//! - [`simulator`]: booking-service guests over the real API and owner
//!   operations, reporting each take.
//! - [`demo`]: the whole job on one machine: embedded owner, seed, guests.
//! - [`bench`]: `vacancy bench ...`, each figure beside its baseline.
//! - [`measure`]: latency percentiles, read one way by every bench.
//! - [`readiness`]: bounded waits for a copy running in this process.
//! - [`owner_db`]: the owner a lab run works on, given or embedded.
//! - [`nats`]: a throwaway `nats-server` with JetStream, for the fleet.
//! - [`blackhole`]: a TCP path to the owner that can drop every packet
//!   without closing anything.

pub mod bench;
pub mod blackhole;
pub mod cluster;
pub mod demo;
pub mod http_client;
pub mod measure;
pub mod nats;
pub mod ops;
pub mod owner_db;
pub mod readiness;
pub mod schema;
pub mod seed;
pub mod simulator;

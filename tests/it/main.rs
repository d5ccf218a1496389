//! All integration tests, in one binary, against a real PostgreSQL 15 that
//! `support` starts for each test (see `vacancy::owner::cluster`).

mod support;

mod api;
mod observability;
mod owner_ops;
mod process;
mod projector;
mod search;
mod seed;
mod stale;

//! All integration tests, in one binary, against a real PostgreSQL 15 that
//! `support` starts for each test (see `vacancy_lab::cluster`).

mod support;

mod access;
mod api;
mod atomicity;
mod confirmed;
mod demo;
mod drops;
mod events;
mod failover;
mod faults;
mod fleet;
mod fleet_stale;
mod kubernetes;
mod observability;
mod overload;
mod owner_ops;
mod owner_security;
mod page;
mod process;
mod projector;
mod readiness;
mod restart;
mod search;
mod seed;
mod shutdown;
mod soak;
mod spill;
mod stale;
mod visibility;

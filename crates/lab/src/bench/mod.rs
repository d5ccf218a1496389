//! `vacancy bench`: measurements that print figures, each beside the
//! baseline its issue names, measured in the same run.
//!
//! A figure without a baseline says little on a shared 2-core virtual
//! machine whose speed drifts from hour to hour, so every command measures
//! the yardstick (pg_recvlogical, server-side COPY, the packed payload) in
//! the same process run, on the same data, and prints both side by side with
//! the machine and the exact parameters. When no `--owner-url` is given, an
//! embedded durable cluster (fsync on) is started and seeded, so the defaults
//! need nothing but the PostgreSQL binaries.
//!
//! - `apply`: decode + apply throughput of a WAL backlog, against
//!   pg_recvlogical draining the same backlog to /dev/null.
//! - `latency`: commit-to-visible latency of holds under a steady pgbench load.
//! - `snapshot`: snapshot load rate, against server-side `COPY ... TO '/dev/null'`.
//! - `memory`: resident bytes per inventory row once the copy is loaded.
//! - `faults`: recovery and divergence per fault (`crate::bench::faults`).
//! - `restart`: a restart from a checkpoint beside the first start's snapshot.
//! - `fleet`: replicas fed by a projector through NATS JetStream: their
//!   bootstrap, memory, latency and owner cost beside a standalone's.
//! - `overload`: guest searches far past capacity with admission control,
//!   beside the same flood without it and the peak of 8 and 64 connections.
//! - `soak`: the demo's booking site for an hour or more, sampling what
//!   grows with uptime (RSS less the bounded caches, descriptors, tasks,
//!   lag and search p99), with a final row-for-row check.
//!
//! Each measurement is a module named as its subcommand. This one holds the
//! command line, the owner under test (prepared once, its slots and
//! publication removed after every measurement) and what the measurements
//! share: the header, the settings, the outside tools, the owner's WAL
//! positions.

mod apply;
mod balancer;
pub mod faults;
mod fleet;
mod latency;
mod memory;
mod overload;
mod restart;
pub mod search;
mod snapshot;
pub mod soak;
pub mod stale;
mod wait;

use std::path::PathBuf;
use std::time::Duration;

use chrono::NaiveDate;
use tokio::process::Command;
use tokio_postgres::Client;

use crate::cluster::{ClusterError, ClusterOptions, DEFAULT_BIN_DIR};
use crate::owner_db::OwnerDb;
use crate::readiness::{NotReady, wait_until};
use crate::seed::{self, SeedError};
use vacancy_service::slot::{self, SlotError};
use vacancy_service::{AppError, Lsn, OwnerError, Settings, redacted_url};

/// vacancy's slot during a bench: its own name, so a bench never touches the
/// slot of a `vacancy serve` attached to the same owner.
const VACANCY_SLOT: &str = "vacancy_bench";
/// The baseline's slot (pg_recvlogical).
const RECV_SLOT: &str = "bench_recv";
/// A publication of our own for the same reason; dropped at the end.
const PUBLICATION: &str = "vacancy_bench";
/// How often a wait polls the copy. Visibility figures carry this resolution.
const POLL: Duration = Duration::from_millis(1);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// A snapshot of 73M rows takes minutes on this machine kind; beyond this, something is wrong.
const LOAD_LIMIT: Duration = Duration::from_secs(60 * 60);

/// Which measurement to run.
#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Apply throughput (row changes/s) of a WAL backlog, beside pg_recvlogical
    /// draining the same backlog to /dev/null. Writes to the owner.
    Apply {
        #[command(flatten)]
        owner: OwnerArgs,
        /// Row changes in the bulk shape (prices), and in the limits shape
        /// (sell limits set or cleared).
        #[arg(long, default_value_t = 1_000_000)]
        bulk_rows: u64,
        /// Transactions each bulk shape is split into.
        #[arg(long, default_value_t = 10)]
        bulk_transactions: u64,
        /// One-row transactions in the last shape (run by pgbench).
        #[arg(long, default_value_t = 100_000)]
        single_transactions: u64,
        /// pgbench clients for the one-row shape.
        #[arg(long, default_value_t = 4)]
        clients: u32,
    },
    /// Commit-to-visible latency of holds (p50/p99/max) under a steady pgbench
    /// load of multi-night holds. Writes to the owner.
    Latency {
        #[command(flatten)]
        owner: OwnerArgs,
        /// Background holds per second (pgbench -R).
        #[arg(long, default_value_t = 1000)]
        rate: u32,
        /// Seconds of background load (pgbench -T).
        #[arg(long, default_value_t = 20)]
        seconds: u32,
        /// pgbench clients for the background load.
        #[arg(long, default_value_t = 8)]
        clients: u32,
        /// Milliseconds between the start of two probe holds.
        #[arg(long, default_value_t = 10)]
        probe_interval_ms: u64,
    },
    /// Snapshot load rate (rows/s) beside server-side COPY of the same tables to /dev/null.
    Snapshot {
        #[command(flatten)]
        owner: OwnerArgs,
    },
    /// Resident bytes per inventory row with the copy loaded, beside the packed payload.
    Memory {
        #[command(flatten)]
        owner: OwnerArgs,
        /// Then reprice this many nights of every hotel in one owner
        /// transaction and report the peak while it applies (0: skip; the
        /// seeded nights or more: every inventory row, one transaction).
        #[arg(long, default_value_t = 0)]
        update_nights: u32,
        /// The copy's `stream.max_held_bytes` (default: the setting's,
        /// 256 MiB): past it the held transaction spills to disk.
        #[arg(long)]
        max_held_bytes: Option<u64>,
        /// The copy's `stream.spill_dir` (default: the system temp dir).
        #[arg(long)]
        spill_dir: Option<String>,
    },
    /// How long searches wait to get at the copy (in process) and what
    /// clients see, before and during the apply of one large owner
    /// transaction that reprices every hotel. Writes to the owner.
    Wait {
        #[command(flatten)]
        owner: OwnerArgs,
        /// Nights of every hotel the transaction reprices (30 at 2,000 hotels
        /// × 20 room types is 1.2M rows).
        #[arg(long, default_value_t = 30)]
        update_nights: u32,
        /// Concurrent search clients.
        #[arg(long, default_value_t = 4)]
        clients: u32,
        /// Seconds of load before the transaction.
        #[arg(long, default_value_t = 10)]
        before_secs: u64,
        /// What the second window measures: the repricing transaction, or
        /// one checkpoint's write (with checkpoints on, under holds).
        #[arg(long, value_enum, default_value_t = wait::During::Repricing)]
        during: wait::During,
    },
    /// The convergence workload once per fault (walsender, owner restarts,
    /// SIGKILL, slot dropped or invalidated, owner unreachable, failing
    /// writes): recovery time, divergent rows, failed requests.
    Faults(crate::bench::faults::FaultArgs),
    /// Time to ready of a restart from a checkpoint (after SIGTERM and a
    /// downtime under holds, and after SIGKILL) beside the first start's
    /// full snapshot, with the checkpoint's size and write time and the rows
    /// read from the owner. Writes to the owner.
    Restart {
        #[command(flatten)]
        owner: OwnerArgs,
        /// Seconds the copy is down between the graceful stop and the restart.
        #[arg(long, default_value_t = 60)]
        downtime_secs: u64,
        /// Holds per second on the owner while it is down (and before the SIGKILL).
        #[arg(long, default_value_t = 1000)]
        holds_per_second: u32,
        /// Seconds of holds between the restart and the SIGKILL.
        #[arg(long, default_value_t = 30)]
        killed_after_secs: u64,
        /// checkpoint.interval_secs for the copy under test.
        #[arg(long, default_value_t = 300)]
        interval_secs: u64,
        /// Keep the checkpoints and the copy's logs here (default: a
        /// temporary directory, removed at the end).
        #[arg(long)]
        work_dir: Option<PathBuf>,
    },
    /// A fleet (one projector publishing to a throwaway nats-server, two
    /// replicas) beside standalone copies, on the same owner data: seconds
    /// to ready and peak RSS of a replica's bootstrap beside a standalone's
    /// full snapshot; walsenders and owner rows read with one and two
    /// replicas beside one and two standalones; commit-to-visible latency of
    /// holds on a replica beside the projector under the same load. Writes
    /// to the owner.
    Fleet {
        /// An existing owner database (seeded with `vacancy seed`). When its
        /// tables are empty it is seeded with the sizes below. Default: an
        /// embedded throwaway cluster with fsync on.
        #[arg(long)]
        owner_url: Option<String>,
        /// Folder with the PostgreSQL binaries (initdb, pg_ctl, pgbench).
        #[arg(long, env = "VACANCY_PG_BIN")]
        pg_bin: Option<PathBuf>,
        #[arg(long, default_value_t = 500)]
        hotels: u32,
        #[arg(long, default_value_t = 20)]
        room_types: u32,
        #[arg(long, default_value_t = 120)]
        nights: u32,
        /// Background holds per second (pgbench -R) while latency is probed.
        #[arg(long, default_value_t = 1000)]
        rate: u32,
        /// Seconds of background holds (pgbench -T).
        #[arg(long, default_value_t = 20)]
        seconds: u32,
        /// pgbench clients for the background holds.
        #[arg(long, default_value_t = 16)]
        clients: u32,
        /// Milliseconds between the start of two probe holds.
        #[arg(long, default_value_t = 10)]
        probe_interval_ms: u64,
        /// checkpoint.interval_secs for the projector.
        #[arg(long, default_value_t = 300)]
        interval_secs: u64,
        /// Keep the checkpoints and the processes' logs here (default: a
        /// temporary directory, removed at the end).
        #[arg(long)]
        work_dir: Option<PathBuf>,
        /// Only the starts and what they cost the owner (no latency, no
        /// failover): at 73M rows the failover's row-for-row comparison
        /// reads every row of the owner and of a replica into memory.
        #[arg(long)]
        bootstrap_only: bool,
    },
    /// Guest searches far past capacity (issue 24): the same flood with
    /// admission control and without it, beside the peak throughput of 8
    /// and 64 connections, with latency per status, the server's time to shed,
    /// and /v1/bypass beside the flood. Issue 24's table used --hotels 2000.
    Overload {
        #[command(flatten)]
        owner: OwnerArgs,
        /// Concurrent client connections of the flood.
        #[arg(long, default_value_t = 2000)]
        connections: u32,
        /// Measured seconds per run.
        #[arg(long, default_value_t = 20)]
        seconds: u32,
        /// Unmeasured seconds before each run's window.
        #[arg(long, default_value_t = 3)]
        warmup_seconds: u32,
        /// http.max_guest_requests_in_flight of the admission run
        /// (default: the service's default).
        #[arg(long)]
        max_in_flight: Option<usize>,
        /// /v1/bypass requests per second beside the flood. Issue 24's
        /// table asked 5 a second; 20 give 400 answers in a 20 s window, so
        /// the p99 is not the one or two slowest of 100.
        #[arg(long, default_value_t = 20)]
        bypass_per_second: u32,
        /// The flood's guests, as a multiple of the peak run's 200s per
        /// second. The connections carry them as a load balancer's pool
        /// carries many browsers: a guest answered 503 waits out Retry-After
        /// (1 s) while its connection serves others, so the flood offers
        /// about this multiple of the peak while it is shed (issue 24: >= 5).
        #[arg(long, default_value_t = 6.0)]
        guests_over_peak: f64,
        /// `http.guest_search_threads` of every run (default: the service's
        /// default); 0 runs searches on the server's own threads.
        #[arg(long)]
        guest_search_threads: Option<usize>,
    },
    /// The demo's booking site plus steady searches for --minutes (issue 24,
    /// item 2): every 10 s the server's RSS, descriptors, tokio tasks, lag,
    /// bounded caches and search p99; after the warm-up, whether RSS less the
    /// caches grows, descriptors, tasks and p99s stay flat, and the copy
    /// equals the owner. Writes soak.csv and soak.svg; exits non-zero when a
    /// goal is missed. Writes to the owner.
    Soak(crate::bench::soak::SoakArgs),
    /// Load-test /v1/search beside the same question asked of the owner in SQL.
    Search(crate::bench::search::SearchBenchArgs),
    /// The copy's 409s (after a showing the owner refused at the moment the
    /// answer was built), take by take, with a 95% interval, for default
    /// settings, copy only and owner row reads side by side, under simulated
    /// guests racing for few units.
    Stale(crate::bench::stale::StaleBenchArgs),
}

/// Where the owner is, or the size of the embedded one to seed.
#[derive(Debug, Clone, clap::Args)]
pub struct OwnerArgs {
    /// An existing owner database (seeded with `vacancy seed`). When its
    /// tables are empty it is seeded with the sizes below. Default: an
    /// embedded throwaway cluster with fsync on.
    #[arg(long)]
    pub owner_url: Option<String>,
    /// Folder with the PostgreSQL binaries (initdb, pg_ctl, pgbench, pg_recvlogical).
    #[arg(long, env = "VACANCY_PG_BIN")]
    pub pg_bin: Option<PathBuf>,
    #[arg(long, default_value_t = 500)]
    pub hotels: u32,
    #[arg(long, default_value_t = 20)]
    pub room_types: u32,
    #[arg(long, default_value_t = 365)]
    pub nights: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Index(#[from] vacancy_service::IndexError),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error(transparent)]
    Seed(#[from] SeedError),
    #[error(transparent)]
    Owner(#[from] OwnerError),
    #[error("owner query failed: {0}")]
    Query(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Slot(#[from] SlotError),
    #[error(transparent)]
    App(#[from] AppError),
    #[error(transparent)]
    Tool(#[from] ToolError),
    #[error(transparent)]
    NotReady(#[from] NotReady),
    #[error("the owner database has no inventory rows to measure")]
    NoData,
    #[error("bench i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Faults(#[from] crate::bench::faults::FaultBenchError),
    #[error("bench search: {0}")]
    Search(#[from] crate::bench::search::SearchBenchError),
    #[error("bench stale: {0}")]
    Stale(#[from] crate::bench::stale::StaleBenchError),
    #[error("bench fleet: {0}")]
    Fleet(#[from] fleet::FleetBenchError),
    #[error("bench soak: {0}")]
    Soak(#[from] soak::SoakError),
    #[error(transparent)]
    Demo(#[from] crate::demo::DemoError),
    #[error("bench overload: {0}")]
    Overload(#[from] overload::FloodError),
}

pub async fn run(command: BenchCommand) -> Result<(), BenchError> {
    match command {
        BenchCommand::Apply {
            owner,
            bulk_rows,
            bulk_transactions,
            single_transactions,
            clients,
        } => {
            let owner = Owner::prepare(&owner).await?;
            let options = apply::ApplyOptions {
                bulk_rows,
                bulk_transactions: bulk_transactions.max(1),
                single_transactions,
                clients: clients.max(1),
            };
            owner.guarded(apply::run(&owner, &options)).await
        }
        BenchCommand::Latency {
            owner,
            rate,
            seconds,
            clients,
            probe_interval_ms,
        } => {
            let owner = Owner::prepare(&owner).await?;
            let options = latency::LatencyOptions {
                rate,
                seconds,
                clients: clients.max(1),
                probe_interval: Duration::from_millis(probe_interval_ms),
            };
            owner.guarded(latency::run(&owner, &options)).await
        }
        BenchCommand::Snapshot { owner } => {
            let owner = Owner::prepare(&owner).await?;
            owner.guarded(snapshot::run(&owner)).await
        }
        BenchCommand::Memory {
            owner,
            update_nights,
            max_held_bytes,
            spill_dir,
        } => {
            let owner = Owner::prepare(&owner).await?;
            let held = memory::Held {
                max_bytes: max_held_bytes,
                spill_dir,
            };
            owner
                .guarded(memory::run(&owner, update_nights, &held))
                .await
        }
        BenchCommand::Wait {
            owner,
            update_nights,
            clients,
            before_secs,
            during,
        } => {
            let owner = Owner::prepare(&owner).await?;
            let options = wait::WaitOptions {
                update_nights: update_nights.max(1),
                clients: clients.max(1),
                before: Duration::from_secs(before_secs),
                during,
            };
            owner.guarded(wait::run(&owner, &options)).await
        }
        BenchCommand::Restart {
            owner,
            downtime_secs,
            holds_per_second,
            killed_after_secs,
            interval_secs,
            work_dir,
        } => {
            let owner = Owner::prepare(&owner).await?;
            let options = restart::RestartOptions {
                downtime: Duration::from_secs(downtime_secs),
                holds_per_second,
                killed_after: Duration::from_secs(killed_after_secs),
                interval_secs: interval_secs.max(1),
                work_dir,
            };
            restart::run(&owner, &options).await
        }
        BenchCommand::Fleet {
            owner_url,
            pg_bin,
            hotels,
            room_types,
            nights,
            rate,
            seconds,
            clients,
            probe_interval_ms,
            interval_secs,
            work_dir,
            bootstrap_only,
        } => {
            let owner = Owner::prepare(&OwnerArgs {
                owner_url,
                pg_bin,
                hotels,
                room_types,
                nights,
            })
            .await?;
            let options = fleet::FleetOptions {
                rate: rate.max(1),
                seconds: seconds.max(3),
                clients: clients.max(1),
                probe_interval: Duration::from_millis(probe_interval_ms),
                interval_secs: interval_secs.max(1),
                work_dir,
                bootstrap_only,
            };
            owner.guarded(fleet::run(&owner, &options)).await
        }
        BenchCommand::Overload {
            owner,
            connections,
            seconds,
            warmup_seconds,
            max_in_flight,
            bypass_per_second,
            guests_over_peak,
            guest_search_threads,
        } => {
            let owner = Owner::prepare(&owner).await?;
            let options = overload::OverloadOptions {
                connections: connections.max(1),
                seconds: seconds.max(1),
                warmup_seconds,
                max_in_flight: max_in_flight
                    .unwrap_or_else(|| Settings::defaults().http.max_guest_requests_in_flight),
                bypass_per_second: bypass_per_second.max(1),
                guests_over_peak: guests_over_peak.max(1.0),
                guest_search_threads: guest_search_threads
                    .unwrap_or_else(|| Settings::defaults().http.guest_search_threads),
            };
            owner.guarded(overload::run(&owner, &options)).await
        }
        BenchCommand::Faults(args) => Ok(crate::bench::faults::run(args).await?),
        BenchCommand::Soak(args) => soak::run(args).await,
        BenchCommand::Search(args) => Ok(crate::bench::search::run(args).await?),
        BenchCommand::Stale(args) => Ok(crate::bench::stale::run(args).await?),
    }
}

/// The dense shape `vacancy seed` generates: every hotel has room types
/// `1..=room_types`, every room type every night from `first_night`.
#[derive(Debug, Clone, Copy)]
struct Shape {
    hotels: i64,
    room_types: i64,
    first_night: NaiveDate,
    nights: i64,
}

/// The owner under test.
struct Owner {
    bin_dir: PathBuf,
    shape: Shape,
    // Dropping it stops and removes an embedded cluster: declared last so
    // it outlives everything above.
    db: OwnerDb,
}

impl Owner {
    async fn prepare(args: &OwnerArgs) -> Result<Owner, BenchError> {
        let bin_dir = args
            .pg_bin
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_BIN_DIR));
        // The figures are for a durable owner, as in production.
        let cluster_options = ClusterOptions {
            bin_dir: bin_dir.clone(),
            fsync: true,
            ..ClusterOptions::default()
        };
        let db =
            OwnerDb::given_or_embedded(args.owner_url.as_deref(), cluster_options, "bench").await?;
        let client = vacancy_service::connect(&db.url, CONNECT_TIMEOUT).await?;
        if !has_inventory(&client).await? {
            seed::run_announced(&db.url, (args.hotels, args.room_types, args.nights), 1).await?;
        }
        let shape = read_shape(&client).await?;
        Ok(Owner { bin_dir, shape, db })
    }

    fn url(&self) -> &str {
        &self.db.url
    }

    /// Runs a bench, then removes the slots and publication it may have left,
    /// also when it failed (a leftover slot pins the owner's WAL).
    async fn guarded(
        &self,
        bench: impl Future<Output = Result<(), BenchError>>,
    ) -> Result<(), BenchError> {
        let result = bench.await;
        let cleaned = self.clean_up().await;
        result.and(cleaned)
    }

    async fn clean_up(&self) -> Result<(), BenchError> {
        let client = vacancy_service::connect(self.url(), CONNECT_TIMEOUT).await?;
        slot::drop_slot(&client, VACANCY_SLOT).await?;
        slot::drop_slot(&client, RECV_SLOT).await?;
        client
            .batch_execute(&format!(
                "DROP PUBLICATION IF EXISTS {PUBLICATION};
                 DROP FUNCTION IF EXISTS vacancy_bench_hold(bigint, bigint, date, int);"
            ))
            .await?;
        Ok(())
    }

    fn tool(&self, name: &str) -> Command {
        Command::new(self.bin_dir.join(name))
    }
}

async fn has_inventory(client: &Client) -> Result<bool, BenchError> {
    let exists: bool = client
        .query_one(
            "SELECT to_regclass('inventory') IS NOT NULL AND to_regclass('hotels') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    if !exists {
        return Ok(false);
    }
    Ok(client
        .query_one("SELECT EXISTS (SELECT 1 FROM inventory)", &[])
        .await?
        .get(0))
}

/// Reads the shape from the first hotel's first room type, through the
/// primary keys only: a count over 73M rows would take longer than the bench.
async fn read_shape(client: &Client) -> Result<Shape, BenchError> {
    let row = client
        .query_one(
            "WITH h AS (SELECT min(id) AS first, max(id) AS last FROM hotels),
                  r AS (SELECT min(id) AS first, max(id) AS last FROM room_types
                        WHERE hotel_id = (SELECT first FROM h))
             SELECT (SELECT last FROM h), (SELECT last FROM r), min(night), max(night)
             FROM inventory
             WHERE hotel_id = (SELECT first FROM h) AND room_type_id = (SELECT first FROM r)",
            &[],
        )
        .await?;
    let hotels: Option<i64> = row.get(0);
    let room_types: Option<i64> = row.get(1);
    let first: Option<NaiveDate> = row.get(2);
    let last: Option<NaiveDate> = row.get(3);
    match (hotels, room_types, first, last) {
        (Some(hotels), Some(room_types), Some(first), Some(last)) => Ok(Shape {
            hotels,
            room_types,
            first_night: first,
            nights: (last - first).num_days() + 1,
        }),
        _ => Err(BenchError::NoData),
    }
}

/// The command line for a report, with any password in an `--owner-url`
/// hidden. Argument by argument: the service's redaction reads everything
/// after a `?` as the URL's query, which on the whole line would swallow
/// the arguments after it.
pub(crate) fn redacted_command_line(args: &[String]) -> String {
    args.iter()
        .map(|arg| redacted_url(arg))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One owner transaction repricing the first nights of every hotel (a
/// revenue job), as `bench memory` and `bench wait` measure under it.
struct Repricing {
    sql: String,
    rows: u64,
    /// How long the owner took to run and commit it.
    committed_in: Duration,
    /// When the owner's commit returned.
    committed_at: std::time::Instant,
}

/// Runs the repricing of the first `nights` nights of every hotel as one
/// owner transaction.
async fn reprice_every_hotel(
    owner: &Owner,
    client: &Client,
    nights: i64,
) -> Result<Repricing, BenchError> {
    let sql = format!(
        "UPDATE inventory SET price_cents = coalesce(price_cents, 0) + 1 \
         WHERE night < DATE '{}' + {nights}",
        owner.shape.first_night
    );
    let sent = std::time::Instant::now();
    let rows = client.execute(&sql, &[]).await?;
    let committed_at = std::time::Instant::now();
    Ok(Repricing {
        sql,
        rows,
        committed_in: committed_at - sent,
        committed_at,
    })
}

/// Waits until the copy in `app` has applied everything the owner committed
/// so far.
async fn wait_caught_up(app: &vacancy_service::App, client: &Client) -> Result<(), BenchError> {
    let target = slot::current_wal_lsn(client).await?;
    wait_until(
        "the copy to apply the transaction",
        LOAD_LIMIT,
        POLL,
        &app.status,
        || app.model.freshness.applied() >= target,
    )
    .await?;
    Ok(())
}

fn bench_settings(url: &str) -> Settings {
    let mut settings = Settings::defaults();
    settings.owner.url = url.to_string();
    settings.stream.slot = VACANCY_SLOT.to_string();
    settings.stream.publication = PUBLICATION.to_string();
    // A heartbeat adds transactions of its own to the stream being measured.
    settings.stream.heartbeat_interval_ms = 0;
    settings
}

/// Prints the command line, the machine and the owner's durability settings.
async fn print_header(title: &str, owner: &Owner, client: &Client) -> Result<(), BenchError> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown", |(_, v)| v.trim());
    let mhz = cpuinfo
        .lines()
        .find(|l| l.starts_with("cpu MHz"))
        .and_then(|l| l.split_once(':'))
        .map_or("?", |(_, v)| v.trim());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown", |(_, v)| v.trim());
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let server = client
        .query_one(
            "SELECT current_setting('server_version'), current_setting('fsync'),
                    current_setting('synchronous_commit'), current_setting('full_page_writes'),
                    current_setting('shared_buffers'), current_setting('logical_decoding_work_mem')",
            &[],
        )
        .await?;
    let s = owner.shape;
    let args: Vec<String> = std::env::args().collect();
    println!("## vacancy bench {title}");
    println!();
    println!("command:  {}", redacted_command_line(&args));
    println!("machine:  nproc {nproc}, CPU {cpu} ({mhz} MHz), RAM {mem}");
    println!(
        "owner:    {}; PostgreSQL {}, fsync {}, synchronous_commit {}, full_page_writes {}, shared_buffers {}, logical_decoding_work_mem {}",
        owner.db.description,
        server.get::<_, String>(0),
        server.get::<_, String>(1),
        server.get::<_, String>(2),
        server.get::<_, String>(3),
        server.get::<_, String>(4),
        server.get::<_, String>(5),
    );
    println!(
        "data:     {} hotels x {} room types x {} nights from {} = {} inventory rows",
        s.hotels,
        s.room_types,
        s.nights,
        s.first_night,
        s.hotels * s.room_types * s.nights
    );
    Ok(())
}

/// An outside tool (pgbench, pg_recvlogical) that could not run or failed.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("cannot run {tool}: {source}")]
    Spawn {
        tool: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} failed ({status}): {stderr}")]
    Failed {
        tool: String,
        status: String,
        stderr: String,
    },
}

/// Runs `command` to completion; its standard output, or why it failed.
pub(crate) async fn run_tool(mut command: Command, tool: &str) -> Result<String, ToolError> {
    let out = command
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|source| ToolError::Spawn {
            tool: tool.to_string(),
            source,
        })?;
    if !out.status.success() {
        return Err(ToolError::Failed {
            tool: tool.to_string(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn flush_lsn(client: &Client) -> Result<Lsn, BenchError> {
    let lsn: tokio_postgres::types::PgLsn = client
        .query_one("SELECT pg_current_wal_flush_lsn()", &[])
        .await?
        .get(0);
    Ok(lsn.into())
}

async fn restart_lsn(client: &Client, slot: &str) -> Result<Option<Lsn>, BenchError> {
    let lsn: Option<tokio_postgres::types::PgLsn> = client
        .query_opt(
            "SELECT restart_lsn FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .and_then(|r| r.get(0));
    Ok(lsn.map(Lsn::from))
}

fn rate(rows: u64, time: Duration) -> f64 {
    rows as f64 / time.as_secs_f64().max(1e-9)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_hides_only_passwords() {
        let line = |args: &[&str]| {
            redacted_command_line(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>())
        };
        assert_eq!(
            line(&[
                "vacancy",
                "bench",
                "snapshot",
                "--owner-url",
                "postgresql://u:secret@h:5432/db",
                "--hotels",
                "20"
            ]),
            "vacancy bench snapshot --owner-url postgresql://u:<redacted>@h:5432/db --hotels 20"
        );
        assert_eq!(
            line(&[
                "--owner-url",
                "postgresql://u@h/db?sslmode=require&password=secret",
                "--nights",
                "30"
            ]),
            "--owner-url postgresql://u@h/db?sslmode=require&password=<redacted> --nights 30"
        );
        assert_eq!(
            line(&["--owner-url=postgresql://u:secret@h/db"]),
            "--owner-url=postgresql://u:<redacted>@h/db"
        );
        assert_eq!(
            line(&[
                "--owner-url",
                "postgresql://postgres@127.0.0.1:55432/postgres"
            ]),
            "--owner-url postgresql://postgres@127.0.0.1:55432/postgres"
        );
    }
}

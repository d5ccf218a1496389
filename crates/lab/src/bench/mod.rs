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

pub mod faults;
pub mod search;
pub mod stale;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::NaiveDate;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::net::TcpListener;
use tokio::process::Command;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::cluster::{ClusterError, ClusterOptions, DEFAULT_BIN_DIR};
use crate::measure::Latencies;
use crate::owner_db::OwnerDb;
use crate::readiness::{NotReady, wait_until};
use crate::seed::{self, SeedError};
use vacancy_service::app::{self, AppError};
use vacancy_service::config::Settings;
use vacancy_service::lsn::{Lsn, ParseLsnError};
use vacancy_service::metrics;
use vacancy_service::model::{CalendarKey, ReadModel};
use vacancy_service::owner::endpoint::redacted_url;
use vacancy_service::owner::{self, OwnerError};
use vacancy_service::stream::refresh::Refresh;
use vacancy_service::stream::slot::{self, SlotError};
use vacancy_service::stream::snapshot::SnapshotPhase;
use vacancy_service::stream::{Projector, StreamStatus};

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
        /// Row changes in the bulk shape.
        #[arg(long, default_value_t = 1_000_000)]
        bulk_rows: u64,
        /// Transactions the bulk shape is split into.
        #[arg(long, default_value_t = 10)]
        bulk_transactions: u64,
        /// One-row transactions in the second shape (run by pgbench).
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
    },
    /// The convergence workload once per fault (walsender, owner restarts,
    /// SIGKILL, slot dropped or invalidated, owner unreachable, failing
    /// writes): recovery time, divergent rows, failed requests.
    Faults(crate::bench::faults::FaultArgs),
    /// Load-test /v1/search beside the same question asked of the owner in SQL.
    Search(crate::bench::search::SearchBenchArgs),
    /// The 409-after-shown rate with search from the copy, beside search
    /// reading the owner, under simulated guests racing for few units.
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
    Index(#[from] vacancy_service::index::IndexError),
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
    #[error("the owner returned an LSN that does not parse: {0}")]
    BadLsn(#[from] ParseLsnError),
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
            let options = ApplyOptions {
                bulk_rows,
                bulk_transactions: bulk_transactions.max(1),
                single_transactions,
                clients: clients.max(1),
            };
            owner.guarded(apply(&owner, &options)).await
        }
        BenchCommand::Latency {
            owner,
            rate,
            seconds,
            clients,
            probe_interval_ms,
        } => {
            let owner = Owner::prepare(&owner).await?;
            let options = LatencyOptions {
                rate,
                seconds,
                clients: clients.max(1),
                probe_interval: Duration::from_millis(probe_interval_ms),
            };
            owner.guarded(latency(&owner, &options)).await
        }
        BenchCommand::Snapshot { owner } => {
            let owner = Owner::prepare(&owner).await?;
            owner.guarded(snapshot(&owner)).await
        }
        BenchCommand::Memory { owner } => {
            let owner = Owner::prepare(&owner).await?;
            owner.guarded(memory(&owner)).await
        }
        BenchCommand::Faults(args) => Ok(crate::bench::faults::run(args).await?),
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
        let client = owner::connect(&db.url, CONNECT_TIMEOUT).await?;
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
        let client = owner::connect(self.url(), CONNECT_TIMEOUT).await?;
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
fn redacted_command_line(args: &[String]) -> String {
    args.iter()
        .map(|arg| redacted_url(arg))
        .collect::<Vec<_>>()
        .join(" ")
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
    let text: String = client
        .query_one("SELECT pg_current_wal_flush_lsn()::text", &[])
        .await?
        .get(0);
    Ok(text.parse()?)
}

async fn restart_lsn(client: &Client, slot: &str) -> Result<Option<Lsn>, BenchError> {
    let text: Option<String> = client
        .query_opt(
            "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .and_then(|r| r.get(0));
    Ok(text.map(|t| t.parse()).transpose()?)
}

fn rate(rows: u64, time: Duration) -> f64 {
    rows as f64 / time.as_secs_f64().max(1e-9)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

// ---------------------------------------------------------------- apply

struct ApplyOptions {
    bulk_rows: u64,
    bulk_transactions: u64,
    single_transactions: u64,
    clients: u32,
}

struct ApplyRow {
    shape: String,
    rows: u64,
    transactions: u64,
    workload: Duration,
    wal_bytes: u64,
    recv_backlog: u64,
    vacancy_backlog: u64,
    recv: Duration,
    vacancy: Duration,
}

/// The method: both consumers are stopped while the workload runs, so its
/// WAL piles up in both slots; then each drains the same backlog alone, one
/// after the other, timed from its start until it has everything up to the
/// WAL flush position read after the last commit. That measures decoding,
/// transfer and (for vacancy) apply, not how fast the workload was written.
/// vacancy's stop and restart keeps its model (the `Projector` is given the
/// same `ReadModel`), so it resumes its slot instead of taking a new snapshot.
async fn apply(owner: &Owner, options: &ApplyOptions) -> Result<(), BenchError> {
    let client = owner::connect(owner.url(), CONNECT_TIMEOUT).await?;
    print_header("apply", owner, &client).await?;
    slot::drop_slot(&client, VACANCY_SLOT).await?;
    slot::drop_slot(&client, RECV_SLOT).await?;
    metrics::init();
    let settings = Arc::new(bench_settings(owner.url()));
    let model = ReadModel::new();
    let status = Arc::new(StreamStatus::default());
    // Shared by both sessions, as one long-lived projector would keep it.
    let refresh = Refresh::new(Duration::from_secs(settings.model.ttl_secs));

    let mut stop = CancellationToken::new();
    let projector = Projector::new(
        settings.clone(),
        model.clone(),
        status.clone(),
        refresh.clone(),
        vacancy_service::index::HotelIndex::new()?,
    );
    let mut task = tokio::spawn(projector.run(stop.clone()));
    let started = Instant::now();
    wait_until("the initial snapshot", LOAD_LIMIT, POLL, &status, || {
        model.freshness.is_loaded()
    })
    .await?;
    eprintln!("snapshot loaded in {:.1}s", started.elapsed().as_secs_f64());

    let (proto, streaming) = if settings.stream.stream_in_progress {
        ("2", "on")
    } else {
        ("1", "off")
    };
    let mut results = Vec::new();
    for single in [false, true] {
        // Moves vacancy's restart_lsn up to now (a checkpoint logs the running
        // transactions, and the projector acknowledges past them), so its
        // backlog starts where the baseline's new slot starts.
        client.batch_execute("CHECKPOINT").await?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        stop.cancel();
        let _ = task.await;

        client
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&RECV_SLOT],
            )
            .await?;
        let before = flush_lsn(&client).await?;
        let workload_started = Instant::now();
        let (shape, rows, transactions) = if single {
            eprintln!(
                "workload: {} one-row transactions",
                options.single_transactions
            );
            let rows = single_row_workload(owner, options).await?;
            (
                format!(
                    "{} one-row transactions (pgbench -c {})",
                    options.single_transactions, options.clients
                ),
                rows,
                rows,
            )
        } else {
            eprintln!(
                "workload: {} updates in {} transactions",
                options.bulk_rows, options.bulk_transactions
            );
            let rows = bulk_workload(&client, options).await?;
            (
                format!(
                    "{} updates in {} transactions",
                    options.bulk_rows, options.bulk_transactions
                ),
                rows,
                options.bulk_transactions,
            )
        };
        let workload = workload_started.elapsed();
        let target = flush_lsn(&client).await?;
        let recv_backlog = restart_lsn(&client, RECV_SLOT)
            .await?
            .map_or(0, |r| r.bytes_until(target));
        let vacancy_backlog = restart_lsn(&client, VACANCY_SLOT)
            .await?
            .map_or(0, |r| r.bytes_until(target));

        eprintln!("draining with pg_recvlogical to {target}");
        let mut recv = owner.tool("pg_recvlogical");
        recv.arg("-d")
            .arg(owner.url())
            .args(["--slot", RECV_SLOT, "--start", "--no-loop", "-F", "0"])
            .args(["-o", &format!("proto_version={proto}")])
            .args(["-o", &format!("streaming={streaming}")])
            .args(["-o", "messages=true"])
            .args(["-o", &format!("publication_names={PUBLICATION}")])
            .args(["-f", "/dev/null"])
            .arg(format!("--endpos={target}"));
        let recv_started = Instant::now();
        run_tool(recv, "pg_recvlogical").await?;
        let recv_time = recv_started.elapsed();
        slot::drop_slot(&client, RECV_SLOT).await?;

        eprintln!("draining with vacancy to {target}");
        stop = CancellationToken::new();
        let projector = Projector::new(
            settings.clone(),
            model.clone(),
            status.clone(),
            refresh.clone(),
            vacancy_service::index::HotelIndex::new()?,
        );
        let vacancy_started = Instant::now();
        task = tokio::spawn(projector.run(stop.clone()));
        wait_until("vacancy catching up", LOAD_LIMIT, POLL, &status, || {
            model.freshness.applied() >= target
        })
        .await?;
        let vacancy_time = vacancy_started.elapsed();
        if status
            .snapshot
            .loads
            .load(std::sync::atomic::Ordering::Relaxed)
            > 1
        {
            eprintln!("warning: vacancy took a new snapshot instead of resuming");
        }
        results.push(ApplyRow {
            shape,
            rows,
            transactions,
            workload,
            wal_bytes: before.bytes_until(target),
            recv_backlog,
            vacancy_backlog,
            recv: recv_time,
            vacancy: vacancy_time,
        });
    }
    stop.cancel();
    let _ = task.await;

    println!(
        "method:   both consumers stopped during the workload; each then drains the same backlog alone \
         (pg_recvlogical first, then vacancy resuming its slot), timed from its start until it has \
         everything up to the WAL flush position read after the last commit"
    );
    println!(
        "baseline: pg_recvlogical, pgoutput proto_version={proto} streaming={streaming} messages=true \
         (the options vacancy asks for), -F 0, to /dev/null"
    );
    println!();
    println!(
        "| shape | row changes | txns | WAL | workload | pg_recvlogical | rows/s | vacancy | rows/s | ratio (goal >= 0.9) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &results {
        let recv = rate(r.rows, r.recv);
        let vacancy = rate(r.rows, r.vacancy);
        println!(
            "| {} | {} | {} | {:.0} MiB | {:.1}s | {:.2}s | {:.0} | {:.2}s | {:.0} | {:.2} |",
            r.shape,
            r.rows,
            r.transactions,
            mib(r.wal_bytes),
            r.workload.as_secs_f64(),
            r.recv.as_secs_f64(),
            recv,
            r.vacancy.as_secs_f64(),
            vacancy,
            vacancy / recv,
        );
    }
    println!();
    for r in &results {
        println!(
            "backlog read from each slot's restart_lsn ({}): pg_recvlogical {:.0} MiB, vacancy {:.0} MiB",
            r.shape,
            mib(r.recv_backlog),
            mib(r.vacancy_backlog)
        );
    }
    Ok(())
}

/// Updates `bulk_rows` inventory rows (in primary-key order) in
/// `bulk_transactions` transactions; returns the rows changed.
async fn bulk_workload(client: &Client, options: &ApplyOptions) -> Result<u64, BenchError> {
    let per = (options.bulk_rows / options.bulk_transactions) as i64;
    let mut rows = 0;
    for k in 0..options.bulk_transactions as i64 {
        rows += client
            .execute(
                "UPDATE inventory i SET price_cents = coalesce(i.price_cents, 0) + 1
                 FROM (SELECT hotel_id, room_type_id, night FROM inventory
                       ORDER BY hotel_id, room_type_id, night OFFSET $1 LIMIT $2) s
                 WHERE i.hotel_id = s.hotel_id AND i.room_type_id = s.room_type_id
                   AND i.night = s.night",
                &[&(k * per), &per],
            )
            .await?;
    }
    Ok(rows)
}

/// One-row autocommit updates at random rows through pgbench; returns the
/// transactions pgbench reports as processed (each changes exactly one row).
async fn single_row_workload(owner: &Owner, options: &ApplyOptions) -> Result<u64, BenchError> {
    let s = owner.shape;
    let script = format!(
        "\\set h random(1, {})\n\\set r random(1, {})\n\\set d random(0, {})\n\
         UPDATE inventory SET price_cents = coalesce(price_cents, 0) + 1 \
         WHERE hotel_id = :h AND room_type_id = :r AND night = DATE '{}' + :d;\n",
        s.hotels,
        s.room_types,
        s.nights - 1,
        s.first_night
    );
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("one_row.sql");
    std::fs::write(&path, script)?;
    let per_client = options
        .single_transactions
        .div_ceil(u64::from(options.clients));
    let mut pgbench = owner.tool("pgbench");
    pgbench
        .args(["-n", "-f"])
        .arg(&path)
        .args(["-t", &per_client.to_string()])
        .args(["-c", &options.clients.to_string()])
        .args(["-j", &options.clients.min(2).to_string()])
        .arg(owner.url());
    let out = run_tool(pgbench, "pgbench").await?;
    Ok(pgbench_processed(&out).unwrap_or(per_client * u64::from(options.clients)))
}

fn pgbench_processed(out: &str) -> Option<u64> {
    out.lines()
        .find_map(|l| l.strip_prefix("number of transactions actually processed:"))
        .and_then(|v| v.trim().split('/').next())
        .and_then(|v| v.trim().parse().ok())
}

/// The summary lines of a pgbench run worth printing.
fn pgbench_summary(out: &str) -> Vec<&str> {
    out.lines()
        .filter(|l| {
            l.starts_with("number of transactions actually processed")
                || l.starts_with("number of failed")
                || l.starts_with("latency average")
                || l.starts_with("rate limit schedule lag")
                || l.starts_with("tps")
        })
        .collect()
}

// ---------------------------------------------------------------- latency

struct LatencyOptions {
    rate: u32,
    seconds: u32,
    clients: u32,
    probe_interval: Duration,
}

/// The guide's hold as one statement, so pgbench can drive it: lock the
/// nights in date order, give up (-1) if any is full, else insert the booking
/// and take one unit per night. Returns the first night's new `taken`, which
/// the probe waits for in the copy (`taken` only grows in this bench).
const HOLD_FUNCTION: &str = "
CREATE OR REPLACE FUNCTION vacancy_bench_hold(p_hotel bigint, p_room_type bigint, p_in date, p_nights int)
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
    free_nights int;
    first_taken int;
BEGIN
    SELECT count(*) INTO free_nights FROM (
        SELECT 1 FROM inventory
        WHERE hotel_id = p_hotel AND room_type_id = p_room_type
          AND night >= p_in AND night < p_in + p_nights
          AND coalesce(sell_limit, total) - taken >= 1
        ORDER BY night FOR UPDATE) locked;
    IF free_nights < p_nights THEN
        RETURN -1;
    END IF;
    INSERT INTO bookings (id, hotel_id, room_type_id, check_in, check_out, rooms, status, expires_at)
    VALUES (gen_random_uuid()::text, p_hotel, p_room_type, p_in, p_in + p_nights, 1, 'held',
            clock_timestamp() + interval '15 minutes');
    UPDATE inventory SET taken = taken + 1
    WHERE hotel_id = p_hotel AND room_type_id = p_room_type
      AND night >= p_in AND night < p_in + p_nights;
    SELECT taken INTO first_taken FROM inventory
    WHERE hotel_id = p_hotel AND room_type_id = p_room_type AND night = p_in;
    RETURN first_taken;
END $$";

/// Nights per hold: multi-night stays, as guests book them.
const HOLD_NIGHTS: (i32, i32) = (2, 4);

async fn latency(owner: &Owner, options: &LatencyOptions) -> Result<(), BenchError> {
    let client = owner::connect(owner.url(), CONNECT_TIMEOUT).await?;
    print_header("latency", owner, &client).await?;
    slot::drop_slot(&client, VACANCY_SLOT).await?;
    client.batch_execute(HOLD_FUNCTION).await?;
    let s = owner.shape;
    let last_start = (s.nights - i64::from(HOLD_NIGHTS.1)).max(0);

    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let app = app::start(bench_settings(owner.url()), listener)?;
    let model = app.model.clone();
    let started = Instant::now();
    wait_until(
        "the initial snapshot",
        LOAD_LIMIT,
        POLL,
        &app.status,
        || model.freshness.is_loaded(),
    )
    .await?;
    eprintln!("snapshot loaded in {:.1}s", started.elapsed().as_secs_f64());

    let script = format!(
        "\\set h random(1, {})\n\\set r random(1, {})\n\\set d random(0, {last_start})\n\
         \\set n random({}, {})\n\
         SELECT vacancy_bench_hold(:h, :r, DATE '{}' + :d, :n);\n",
        s.hotels, s.room_types, HOLD_NIGHTS.0, HOLD_NIGHTS.1, s.first_night
    );
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("hold.sql");
    std::fs::write(&path, script)?;
    let mut pgbench = owner.tool("pgbench");
    pgbench
        .args(["-n", "-f"])
        .arg(&path)
        .args(["-R", &options.rate.to_string()])
        .args(["-T", &options.seconds.to_string()])
        .args(["-c", &options.clients.to_string()])
        .args(["-j", &options.clients.min(2).to_string()])
        .arg(owner.url());
    let background = tokio::spawn(run_tool(pgbench, "pgbench"));

    // Probes start once pgbench is connected and running at its rate, and
    // stop before it winds down, so every sample is taken under the load.
    let probe_window = Duration::from_secs(u64::from(options.seconds)).saturating_sub(2 * SETTLE);
    tokio::time::sleep(SETTLE).await;
    let samples = probe(owner, &model, options.probe_interval, probe_window).await?;
    let out = background.await.map_err(std::io::Error::other)??;
    app.stop(Duration::from_secs(10)).await;

    let visible = Latencies::from_durations(&samples.visible);
    let statement = Latencies::from_durations(&samples.statement);
    // NaN prints as "NaN ms": a run too short for any probe says so in the table.
    let ms = |figure: Option<f64>| figure.unwrap_or(f64::NAN);
    println!(
        "method:   a probe task holds {}-{} nights every {:?} through the same function, notes the \
         instant its autocommit statement returned, then polls the copy every {:?} until the first \
         night's `taken` reaches the value the hold returned; pgbench runs the background holds",
        HOLD_NIGHTS.0, HOLD_NIGHTS.1, options.probe_interval, POLL
    );
    println!(
        "load:     pgbench -R {} -T {} -c {} (one `SELECT vacancy_bench_hold(...)` per transaction):",
        options.rate, options.seconds, options.clients
    );
    for line in pgbench_summary(&out) {
        println!("          {line}");
    }
    println!();
    println!(
        "| samples | p50 | p99 (goal <= 25 ms) | max | not visible in 10 s | probe holds full | probe statement p50 |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {:.1} ms | {:.1} ms | {:.1} ms | {} | {} | {:.1} ms |",
        visible.len(),
        ms(visible.percentile(0.50)),
        ms(visible.percentile(0.99)),
        ms(visible.max()),
        samples.timeouts,
        samples.full,
        ms(statement.percentile(0.50)),
    );
    Ok(())
}

/// Time for pgbench to connect its clients and settle at its rate.
const SETTLE: Duration = Duration::from_secs(1);
const VISIBLE_LIMIT: Duration = Duration::from_secs(10);

#[derive(Default)]
struct ProbeSamples {
    visible: Vec<Duration>,
    statement: Vec<Duration>,
    timeouts: u64,
    full: u64,
}

async fn probe(
    owner: &Owner,
    model: &ReadModel,
    interval: Duration,
    window: Duration,
) -> Result<ProbeSamples, BenchError> {
    let s = owner.shape;
    let client = owner::connect(owner.url(), CONNECT_TIMEOUT).await?;
    let hold = client
        .prepare("SELECT vacancy_bench_hold($1, $2, $3, $4)")
        .await?;
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut ticker = tokio::time::interval(interval.max(Duration::from_millis(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut samples = ProbeSamples::default();
    let started = Instant::now();
    let last_start = (s.nights - i64::from(HOLD_NIGHTS.1)).max(0);
    while started.elapsed() < window {
        ticker.tick().await;
        let key = CalendarKey {
            hotel_id: rng.random_range(1..=s.hotels),
            room_type_id: rng.random_range(1..=s.room_types),
        };
        let night = s.first_night + chrono::Days::new(rng.random_range(0..=last_start) as u64);
        let nights: i32 = rng.random_range(HOLD_NIGHTS.0..=HOLD_NIGHTS.1);
        let sent = Instant::now();
        let taken: i32 = client
            .query_one(&hold, &[&key.hotel_id, &key.room_type_id, &night, &nights])
            .await?
            .get(0);
        let committed = Instant::now();
        samples.statement.push(committed - sent);
        if taken < 0 {
            samples.full += 1;
            continue;
        }
        let visible = || {
            model
                .read()
                .calendars
                .get(&key)
                .and_then(|c| c.get(night))
                .is_some_and(|n| n.taken >= taken)
        };
        loop {
            if visible() {
                samples.visible.push(committed.elapsed());
                break;
            }
            if committed.elapsed() > VISIBLE_LIMIT {
                samples.timeouts += 1;
                break;
            }
            tokio::time::sleep(POLL).await;
        }
    }
    Ok(samples)
}

// ---------------------------------------------------------------- snapshot

async fn copy_baseline(client: &Client) -> Result<(u64, Duration), BenchError> {
    // The same columns and format the snapshot reads, written by the server
    // itself: what the owner spends before any network or client cost.
    let statements = [
        "COPY hotels (id, name, city, country, stars, latitude, longitude, amenities) TO '/dev/null' (FORMAT binary)",
        "COPY room_types (hotel_id, id, name, max_guests) TO '/dev/null' (FORMAT binary)",
        "COPY inventory (hotel_id, room_type_id, night, total, taken, sell_limit, price_cents) TO '/dev/null' (FORMAT binary)",
    ];
    let started = Instant::now();
    let mut rows = 0;
    for statement in statements {
        rows += client.execute(statement, &[]).await?;
    }
    Ok((rows, started.elapsed()))
}

async fn snapshot(owner: &Owner) -> Result<(), BenchError> {
    let client = owner::connect(owner.url(), CONNECT_TIMEOUT).await?;
    print_header("snapshot", owner, &client).await?;
    slot::drop_slot(&client, VACANCY_SLOT).await?;

    eprintln!("baseline: COPY to /dev/null (first run)");
    let (copy_rows, copy_first) = copy_baseline(&client).await?;

    eprintln!("vacancy: loading the snapshot");
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let app_started = Instant::now();
    let app = app::start(bench_settings(owner.url()), listener)?;
    let progress = &app.status.snapshot;
    wait_until(
        "the snapshot to start",
        LOAD_LIMIT,
        POLL,
        &app.status,
        || progress.phase() != SnapshotPhase::NotStarted,
    )
    .await?;
    let load_started = Instant::now();
    let model = app.model.clone();
    wait_until(
        "the snapshot to load",
        LOAD_LIMIT,
        POLL,
        &app.status,
        || model.freshness.is_loaded(),
    )
    .await?;
    let load = load_started.elapsed();
    let end_to_end = app_started.elapsed();
    let rows = progress
        .rows_loaded
        .load(std::sync::atomic::Ordering::Relaxed);
    app.stop(Duration::from_secs(10)).await;
    drop(model);
    slot::drop_slot(&client, VACANCY_SLOT).await?;

    eprintln!("baseline: COPY to /dev/null (second run)");
    let (_, copy_second) = copy_baseline(&client).await?;

    let vacancy = rate(rows, load);
    let copy_best = copy_first.min(copy_second);
    println!(
        "method:   vacancy timed from the snapshot phase turning `loading` (slot created, snapshot \
         exported) until the copy is swapped in; baseline: server-side binary COPY of the same \
         columns of hotels, room_types, inventory to '/dev/null', run before and after vacancy"
    );
    println!();
    println!("| | rows | time | rows/s | vs best COPY (goal >= 0.8) |");
    println!("|---|---:|---:|---:|---:|");
    println!(
        "| vacancy snapshot load | {rows} | {:.1}s | {:.0} | {:.2} |",
        load.as_secs_f64(),
        vacancy,
        vacancy / rate(copy_rows, copy_best)
    );
    println!(
        "| vacancy from start (connect, slot, snapshot) | {rows} | {:.1}s | {:.0} | |",
        end_to_end.as_secs_f64(),
        rate(rows, end_to_end)
    );
    for (label, time) in [("first", copy_first), ("second", copy_second)] {
        println!(
            "| COPY TO '/dev/null', {label} run | {copy_rows} | {:.1}s | {:.0} | |",
            time.as_secs_f64(),
            rate(copy_rows, time)
        );
    }
    Ok(())
}

// ---------------------------------------------------------------- memory

/// A `/proc/self/status` field in bytes (the kernel prints kB).
fn proc_status_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim_start_matches(':').split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

async fn memory(owner: &Owner) -> Result<(), BenchError> {
    let client = owner::connect(owner.url(), CONNECT_TIMEOUT).await?;
    print_header("memory", owner, &client).await?;
    slot::drop_slot(&client, VACANCY_SLOT).await?;

    let before = proc_status_bytes("VmRSS");
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let app = app::start(bench_settings(owner.url()), listener)?;
    let model = app.model.clone();
    wait_until(
        "the snapshot to load",
        LOAD_LIMIT,
        POLL,
        &app.status,
        || model.freshness.is_loaded(),
    )
    .await?;
    // Let the projector finish swapping and dropping what the load used.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = proc_status_bytes("VmRSS");
    let peak = proc_status_bytes("VmHWM");
    let (rows, payload, calendars, hotels, room_types) = {
        let tables = model.read();
        (
            tables.inventory_rows(),
            tables.inventory_bytes(),
            tables.calendars.len(),
            tables.hotels.len(),
            tables.room_types.len(),
        )
    };
    app.stop(Duration::from_secs(10)).await;
    if rows == 0 {
        return Err(BenchError::NoData);
    }
    let loaded = after.saturating_sub(before);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "method:   VmRSS of this process before starting vacancy and 2 s after the snapshot is \
         swapped in (same process, glibc malloc); payload = Tables::inventory_bytes()"
    );
    let _ = writeln!(out);
    let _ = writeln!(out, "| | bytes | per inventory row |");
    let _ = writeln!(out, "|---|---:|---:|");
    let _ = writeln!(
        out,
        "| RSS growth, loaded - before (goal <= 16 B/row) | {loaded} ({:.0} MiB) | {:.1} |",
        mib(loaded),
        loaded as f64 / rows as f64
    );
    let _ = writeln!(
        out,
        "| packed payload (inventory_bytes) | {payload} ({:.0} MiB) | {:.1} |",
        mib(payload),
        payload as f64 / rows as f64
    );
    let _ = writeln!(
        out,
        "| peak RSS during the load (VmHWM) | {peak} ({:.0} MiB) | {:.1} |",
        mib(peak),
        peak as f64 / rows as f64
    );
    let _ = writeln!(
        out,
        "| RSS before / after | {before} / {after} ({:.0} / {:.0} MiB) | |",
        mib(before),
        mib(after)
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "rows {rows}, calendars {calendars}, hotels {hotels}, room types {room_types}"
    );
    print!("{out}");
    Ok(())
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

    #[test]
    fn pgbench_processed_reads_the_count() {
        let out = "number of clients: 4\nnumber of transactions actually processed: 99996/100000\n";
        assert_eq!(pgbench_processed(out), Some(99996));
    }
}

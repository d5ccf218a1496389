//! `vacancy bench faults`: the convergence workload run once per fault, and
//! what each fault cost.
//!
//! A copy that is right only while nothing breaks is not worth serving, so
//! each fault is injected into a live run of the real `vacancy serve` binary
//! (a child process: a SIGKILL or SIGSTOP must hit a whole process, as it
//! would in production) while simulated guests take units on the owner
//! (`simulator`), a hotelier changes hotels, room types and capacity, and a
//! load loop searches over HTTP. After the fault is healed the runner waits
//! until the copy has applied a marker committed after the heal, lets the
//! workload run a little longer, stops it, waits until the copy has applied
//! the owner's current WAL position, and compares every hotel, room type and
//! inventory row of the copy (read through `/v1/hotels/{id}/calendar`) with
//! the owner's (`SELECT` of the whole tables). Any difference is a bug.
//!
//! What counts:
//! - seconds to recover: from the heal (owner accepting connections again,
//!   process restarted or continued, trigger dropped) until `/v1/status`
//!   shows the copy loaded, streaming, not resnapshotting, and applied past
//!   the marker;
//! - requests failed: load-loop searches that got a connection error, a
//!   timeout, or a status other than 2xx and 503; a 503 (not ready, lagging
//!   past the bound: the service refusing on purpose) is counted apart.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::NaiveDate;
use pg_walstream::CancellationToken;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;
use tokio::process::{Child, Command};
use tokio_postgres::Client;

use crate::bench::{ToolError, run_tool};
use crate::lsn::{Lsn, ParseLsnError};
use crate::model::NightCounts;
use crate::owner::cluster::{Cluster, ClusterError, ClusterOptions, StopMode};
use crate::owner::seed::{self, SeedError};
use crate::owner::{self, OwnerError};
use crate::simulator::{self, SimError, SimOptions, SimSummary, http};
use crate::stream::slot::{self, SlotError};

/// The child's slot and publication: its own, so the bench never touches a
/// `vacancy serve` attached to the same owner.
pub const SLOT: &str = "vacancy_faults";
pub const PUBLICATION: &str = "vacancy_faults";
const BOOKING_TOKEN: &str = "fault-bench-booking-token";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the runner polls `/v1/status`: the resolution of "seconds to recover".
const POLL: Duration = Duration::from_millis(50);
const HTTP_TIMEOUT: Duration = Duration::from_secs(5);
/// A trigger that makes owner writes fail as a full disk would.
const FAIL_WRITES_SQL: &str = "
CREATE OR REPLACE FUNCTION vacancy_fault_disk_full() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF random() < 0.5 THEN
        RAISE EXCEPTION 'could not extend file: No space left on device (simulated by vacancy bench faults)'
            USING ERRCODE = '53100';
    END IF;
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END $$;
DROP TRIGGER IF EXISTS vacancy_fault_disk_full ON inventory;
CREATE TRIGGER vacancy_fault_disk_full BEFORE INSERT OR UPDATE OR DELETE ON inventory
    FOR EACH ROW EXECUTE FUNCTION vacancy_fault_disk_full();";
const HEAL_WRITES_SQL: &str = "
DROP TRIGGER IF EXISTS vacancy_fault_disk_full ON inventory;
DROP FUNCTION IF EXISTS vacancy_fault_disk_full();";
/// Small enough that a few switched segments invalidate a held-back slot.
const SLOT_WAL_KEEP: &str = "48MB";

/// One fault the bench injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Fault {
    /// `pg_terminate_backend` on the walsender serving the slot.
    WalsenderTerminated,
    /// `pg_ctl restart -m fast`.
    OwnerRestartFast,
    /// `pg_ctl restart -m immediate` (crash recovery on start).
    OwnerRestartImmediate,
    /// SIGKILL of `vacancy serve`, then started again.
    VacancyKilled,
    /// The slot dropped while vacancy is stopped (SIGSTOP) and disconnected.
    SlotDropped,
    /// The slot invalidated by `max_slot_wal_keep_size` while vacancy is stopped.
    SlotInvalidated,
    /// The owner stopped for `--unreachable-secs`, then started.
    OwnerUnreachable,
    /// Owner writes fail with SQLSTATE 53100 (disk full), simulated by a trigger.
    WritesFail,
}

impl Fault {
    pub const ALL: [Fault; 8] = [
        Fault::WalsenderTerminated,
        Fault::OwnerRestartFast,
        Fault::OwnerRestartImmediate,
        Fault::VacancyKilled,
        Fault::SlotDropped,
        Fault::SlotInvalidated,
        Fault::OwnerUnreachable,
        Fault::WritesFail,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Fault::WalsenderTerminated => "walsender terminated",
            Fault::OwnerRestartFast => "owner restarted (-m fast)",
            Fault::OwnerRestartImmediate => "owner restarted (-m immediate)",
            Fault::VacancyKilled => "vacancy killed (SIGKILL), restarted",
            Fault::SlotDropped => "slot dropped while disconnected",
            Fault::SlotInvalidated => "slot invalidated (max_slot_wal_keep_size)",
            Fault::OwnerUnreachable => "owner unreachable",
            Fault::WritesFail => "owner writes fail (53100, simulated)",
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct FaultArgs {
    /// Folder with the PostgreSQL binaries (initdb, pg_ctl, postgres).
    #[arg(long, env = "VACANCY_PG_BIN")]
    pub pg_bin: Option<PathBuf>,
    #[arg(long, default_value_t = 200)]
    pub hotels: u32,
    #[arg(long, default_value_t = 10)]
    pub room_types: u32,
    #[arg(long, default_value_t = 60)]
    pub nights: u32,
    /// Run only these faults (repeat or comma-separate); default: all.
    #[arg(long, value_delimiter = ',')]
    pub fault: Vec<Fault>,
    /// How long the owner stays stopped for `owner-unreachable`.
    #[arg(long, default_value_t = 60)]
    pub unreachable_secs: u64,
    /// How long owner writes fail for `writes-fail`.
    #[arg(long, default_value_t = 10)]
    pub writes_fail_secs: u64,
    /// Simulated booking-service guests taking units on the owner.
    #[arg(long, default_value_t = 4)]
    pub guests: usize,
    /// Concurrent clients of the search load loop.
    #[arg(long, default_value_t = 2)]
    pub search_clients: usize,
    /// A fault that has not recovered within this many seconds counts as not recovered.
    #[arg(long, default_value_t = 300)]
    pub recover_limit_secs: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum FaultBenchError {
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error(transparent)]
    Seed(#[from] SeedError),
    #[error(transparent)]
    Owner(#[from] OwnerError),
    #[error("owner query failed: {}", pg_detail(.0))]
    Query(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Slot(#[from] SlotError),
    #[error(transparent)]
    Tool(#[from] ToolError),
    #[error(transparent)]
    Simulator(#[from] SimError),
    #[error("the copy returned an LSN that does not parse: {0}")]
    BadLsn(#[from] ParseLsnError),
    #[error("{what} did not happen within {limit:?}{detail}")]
    Timeout {
        what: String,
        limit: Duration,
        detail: String,
    },
    #[error("the copy answered {path} with {status}: {body}")]
    CopyRead {
        path: String,
        status: String,
        body: String,
    },
    #[error("bench i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// The server's message and SQLSTATE, which `tokio_postgres::Error`'s
/// Display leaves out ("db error").
fn pg_detail(e: &tokio_postgres::Error) -> String {
    e.as_db_error().map_or_else(
        || e.to_string(),
        |d| format!("{} ({})", d.message(), d.code().code()),
    )
}

/// How a scenario runs; the bench's defaults, or a test's smaller ones.
#[derive(Debug, Clone)]
pub struct ScenarioOptions {
    /// The `vacancy` executable to run as `vacancy serve`.
    pub exe: PathBuf,
    /// Where the child's logs and the booking token file go.
    pub work_dir: PathBuf,
    pub guests: usize,
    pub search_clients: usize,
    /// Workload before the fault, so changes are in flight when it lands.
    pub warm_up: Duration,
    /// Workload after recovery, so the resumed stream carries changes too.
    pub after: Duration,
    pub unreachable: Duration,
    pub writes_fail_for: Duration,
    pub recover_limit: Duration,
    pub seed: u64,
}

/// What the load loop saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadCounts {
    pub ok: u64,
    /// 503: not ready or lagging past the bound (refused on purpose).
    pub not_ready: u64,
    /// Connection errors, timeouts, any other non-2xx.
    pub failed: u64,
    /// Failures by kind (status code, `connect`, `timeout`).
    pub failures: BTreeMap<String, u64>,
}

impl LoadCounts {
    pub fn total(&self) -> u64 {
        self.ok + self.not_ready + self.failed
    }
}

/// Rows of the copy that differ from the owner's, or exist on one side only.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Divergence {
    /// Owner rows compared (hotels + room types + inventory).
    pub compared: u64,
    pub hotels: u64,
    pub room_types: u64,
    pub inventory: u64,
    /// The first few differences, owner value then copy value, to start
    /// an investigation from.
    pub examples: Vec<String>,
}

impl Divergence {
    pub fn total(&self) -> u64 {
        self.hotels + self.room_types + self.inventory
    }
}

/// One scenario's result: a row of the table.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub fault: Fault,
    pub recovered: bool,
    pub recover_secs: Option<f64>,
    /// `None` when the copy never caught up, so no comparison was possible.
    pub divergence: Option<Divergence>,
    pub searches: LoadCounts,
    pub takes: SimSummary,
    pub hotelier_ok: u64,
    pub hotelier_failed: u64,
    /// Snapshots taken by the (last) vacancy process, by reason, from `/metrics`.
    pub snapshots: BTreeMap<String, u64>,
    /// What the scenario could not do (the fault not injected, a wait that timed out).
    pub problem: Option<String>,
}

/// A hotel row as both sides hold it.
#[derive(Debug, Clone, PartialEq)]
pub struct HotelRow {
    pub name: String,
    pub city: String,
    pub country: Option<String>,
    pub stars: Option<i16>,
    pub latitude: Option<f64>,
    pub longitude: Option<f64>,
    pub amenities: Vec<String>,
}

/// The three tables, keyed by primary key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rows {
    pub hotels: BTreeMap<i64, HotelRow>,
    pub room_types: BTreeMap<(i64, i64), (String, i16)>,
    pub inventory: BTreeMap<(i64, i64, NaiveDate), NightCounts>,
}

/// Counts the keys whose values differ, or that only one side has.
pub fn divergence(owner: &Rows, copy: &Rows) -> Divergence {
    fn differing<K: Ord + std::fmt::Debug, V: PartialEq + std::fmt::Debug>(
        a: &BTreeMap<K, V>,
        b: &BTreeMap<K, V>,
        examples: &mut Vec<String>,
    ) -> u64 {
        let mut n = 0;
        let changed = a.iter().filter(|(k, v)| b.get(*k) != Some(*v));
        let changed = changed.map(|(k, v)| (k, Some(v), b.get(k)));
        let extra = b.iter().filter(|(k, _)| !a.contains_key(*k));
        for (key, owner, copy) in changed.chain(extra.map(|(k, v)| (k, None, Some(v)))) {
            n += 1;
            if examples.len() < 5 {
                examples.push(format!("{key:?}: owner {owner:?}, copy {copy:?}"));
            }
        }
        n
    }
    let mut examples = Vec::new();
    Divergence {
        compared: (owner.hotels.len() + owner.room_types.len() + owner.inventory.len()) as u64,
        hotels: differing(&owner.hotels, &copy.hotels, &mut examples),
        room_types: differing(&owner.room_types, &copy.room_types, &mut examples),
        inventory: differing(&owner.inventory, &copy.inventory, &mut examples),
        examples,
    }
}

// ---------------------------------------------------------------- the bench

/// `vacancy bench faults`: an embedded owner, seeded, then every fault in turn.
pub async fn run(args: FaultArgs) -> Result<(), FaultBenchError> {
    let bin_dir = args
        .pg_bin
        .clone()
        .unwrap_or_else(|| ClusterOptions::default().bin_dir);
    eprintln!("starting an embedded PostgreSQL (fsync on)");
    let options = ClusterOptions {
        bin_dir,
        fsync: true,
        ..ClusterOptions::default()
    };
    let mut cluster = tokio::task::spawn_blocking(move || Cluster::start(options))
        .await
        .map_err(std::io::Error::other)??;
    let url = cluster.create_database("faults")?;
    let report =
        seed::run_announced(&url, (args.hotels, args.room_types, args.nights), args.seed).await?;
    let work_dir = tempfile::Builder::new()
        .prefix("vacancy-faults-")
        .tempdir()?;
    let options = ScenarioOptions {
        exe: std::env::current_exe()?,
        work_dir: work_dir.path().to_path_buf(),
        guests: args.guests,
        search_clients: args.search_clients.max(1),
        warm_up: Duration::from_secs(3),
        after: Duration::from_secs(3),
        unreachable: Duration::from_secs(args.unreachable_secs),
        writes_fail_for: Duration::from_secs(args.writes_fail_secs),
        recover_limit: Duration::from_secs(args.recover_limit_secs.max(1)),
        seed: args.seed,
    };
    let faults = if args.fault.is_empty() {
        Fault::ALL.to_vec()
    } else {
        let mut f = args.fault.clone();
        f.sort();
        f.dedup();
        f
    };
    let started = Instant::now();
    let mut outcomes = Vec::new();
    for fault in faults {
        eprintln!("fault: {}", fault.label());
        let outcome = match run_scenario(&mut cluster, &url, fault, &options).await {
            Ok(o) => o,
            Err(error) => failed_outcome(fault, error.to_string()),
        };
        eprintln!(
            "  recovered {} in {:?}s, divergent {:?}, searches failed {}",
            outcome.recovered,
            outcome.recover_secs,
            outcome.divergence.as_ref().map(Divergence::total),
            outcome.searches.failed
        );
        outcomes.push(outcome);
    }
    let args_line: Vec<String> = std::env::args().collect();
    println!("## vacancy bench faults\n");
    println!("command:  {}", args_line.join(" "));
    println!(
        "data:     {} hotels x {} room types x {} nights = {} inventory rows (seed {}), embedded PostgreSQL, fsync on",
        report.hotels, args.room_types, args.nights, report.inventory_rows, args.seed
    );
    println!(
        "load:     {} simulated guests (search, hold, pay or release), a hotelier (capacity, hotel and room type changes), {} search clients; \
         owner unreachable for {} s; writes fail for {} s; whole run {:.0} s\n",
        options.guests,
        options.search_clients,
        options.unreachable.as_secs(),
        options.writes_fail_for.as_secs(),
        started.elapsed().as_secs_f64()
    );
    print!("{}", render(&outcomes));
    Ok(())
}

fn failed_outcome(fault: Fault, problem: String) -> Outcome {
    Outcome {
        fault,
        recovered: false,
        recover_secs: None,
        divergence: None,
        searches: LoadCounts::default(),
        takes: SimSummary::default(),
        hotelier_ok: 0,
        hotelier_failed: 0,
        snapshots: BTreeMap::new(),
        problem: Some(problem),
    }
}

/// The table, in Markdown, with the problems listed under it.
pub fn render(outcomes: &[Outcome]) -> String {
    let mut out = String::from(
        "| fault | recovered | seconds to recover | rows divergent (of compared) | requests failed | 503 not ready | searches | takes ok / 409 / error | hotelier writes failed | snapshots taken |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---|\n",
    );
    for o in outcomes {
        let secs = o
            .recover_secs
            .map_or_else(|| "—".to_string(), |s| format!("{s:.1}"));
        let divergent = o.divergence.as_ref().map_or_else(
            || "not compared".to_string(),
            |d| format!("{} (of {})", d.total(), d.compared),
        );
        let snapshots = if o.snapshots.is_empty() {
            "—".to_string()
        } else {
            o.snapshots
                .iter()
                .map(|(reason, n)| format!("{reason} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} / {} / {} | {} of {} | {} |\n",
            o.fault.label(),
            if o.recovered { "yes" } else { "**no**" },
            secs,
            divergent,
            o.searches.failed,
            o.searches.not_ready,
            o.searches.total(),
            o.takes.taken,
            o.takes.conflicts,
            o.takes.errors,
            o.hotelier_failed,
            o.hotelier_ok + o.hotelier_failed,
            snapshots,
        );
    }
    let notes: Vec<String> = outcomes
        .iter()
        .filter_map(|o| {
            let failures = (!o.searches.failures.is_empty())
                .then(|| format!("failed searches by kind {:?}", o.searches.failures));
            let problem = o.problem.clone();
            let examples = o
                .divergence
                .as_ref()
                .filter(|d| !d.examples.is_empty())
                .map(|d| format!("divergent rows, first: {}", d.examples.join("; ")));
            let parts: Vec<String> = [problem, examples, failures]
                .into_iter()
                .flatten()
                .collect();
            (!parts.is_empty()).then(|| format!("- {}: {}", o.fault.label(), parts.join("; ")))
        })
        .collect();
    if !notes.is_empty() {
        out += "\n";
        out += &notes.join("\n");
        out += "\n";
    }
    out
}

// ---------------------------------------------------------------- one scenario

/// Runs the workload, injects `fault`, heals it, and measures: see the module doc.
/// The child process, the slot and any fault setting are removed whatever happens.
pub async fn run_scenario(
    cluster: &mut Cluster,
    url: &str,
    fault: Fault,
    options: &ScenarioOptions,
) -> Result<Outcome, FaultBenchError> {
    let client = owner::connect(url, CONNECT_TIMEOUT).await?;
    slot::drop_slot(&client, SLOT).await?;
    drop(client);
    let name = format!("{fault:?}").to_lowercase();
    let mut serve = Serve::start(&options.exe, url, &options.work_dir, &name)?;
    let result = scenario(cluster, url, fault, options, &mut serve).await;
    serve.stop().await;
    let cleaned = clean_up(url, fault).await;
    let outcome = result?;
    cleaned?;
    Ok(outcome)
}

async fn clean_up(url: &str, fault: Fault) -> Result<(), FaultBenchError> {
    let client = connect_retrying(url, Duration::from_secs(60)).await?;
    match fault {
        Fault::WritesFail => client.batch_execute(HEAL_WRITES_SQL).await?,
        Fault::SlotInvalidated => {
            client
                .batch_execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
                .await?;
            client.batch_execute("SELECT pg_reload_conf()").await?
        }
        _ => {}
    }
    slot::drop_slot(&client, SLOT).await?;
    Ok(())
}

async fn scenario(
    cluster: &mut Cluster,
    url: &str,
    fault: Fault,
    options: &ScenarioOptions,
    serve: &mut Serve,
) -> Result<Outcome, FaultBenchError> {
    let client = owner::connect(url, CONNECT_TIMEOUT).await?;
    let target = slot::current_wal_lsn(&client).await?;
    serve
        .caught_up(target, options.recover_limit, "the first snapshot")
        .await?;
    let (hotel_ids, cities, first_night, nights) = dataset(&client).await?;

    let stop = CancellationToken::new();
    let search_counts = Arc::new(std::sync::Mutex::new(LoadCounts::default()));
    let mut searchers = Vec::new();
    for client_no in 0..options.search_clients {
        searchers.push(tokio::spawn(search_loop(
            serve.addr,
            cities.clone(),
            first_night,
            nights,
            options.seed.wrapping_add(client_no as u64),
            search_counts.clone(),
            stop.clone(),
        )));
    }
    let hotelier_counts = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let hotelier = tokio::spawn(hotelier(
        url.to_string(),
        hotel_ids.clone(),
        first_night,
        nights,
        options.seed,
        hotelier_counts.clone(),
        stop.clone(),
    ));
    let guests = (options.guests > 0).then(|| {
        let mut sim = SimOptions::hot(
            serve.addr,
            url,
            BOOKING_TOKEN,
            hotel_ids.iter().copied().take(20).collect(),
            first_night,
        );
        sim.guests = options.guests;
        sim.takes_per_guest = None;
        sim.duration = Some(Duration::from_secs(24 * 3600));
        sim.nights_span = (nights.max(3) - 2) as u32;
        sim.pause_ms = (20, 60);
        sim.hold_secs = 30;
        // Booking ids are made from the seed: a seed of its own per fault,
        // or a later scenario's holds would find the earlier ones' ids.
        sim.seed = options.seed.wrapping_mul(100).wrapping_add(fault as u64);
        sim.http_timeout = HTTP_TIMEOUT;
        tokio::spawn(simulator::run(sim, stop.clone()))
    });

    tokio::time::sleep(options.warm_up).await;
    let measured = inject_and_recover(cluster, url, fault, options, serve).await;
    let (recover_secs, mut problem) = match measured {
        Ok(Some(secs)) => {
            tokio::time::sleep(options.after).await;
            (Some(secs), None)
        }
        Ok(None) => (
            None,
            Some(format!(
                "not recovered within {:?}; last status: {}",
                options.recover_limit,
                serve.status_line().await
            )),
        ),
        Err(e) => (None, Some(e.to_string())),
    };

    stop.cancel();
    for s in searchers {
        let _ = s.await;
    }
    let _ = hotelier.await;
    let takes = match guests {
        Some(g) => match g.await {
            Ok(Ok(summary)) => summary,
            Ok(Err(e)) => {
                problem.get_or_insert(format!("simulator: {e}"));
                SimSummary::default()
            }
            Err(e) => {
                problem.get_or_insert(format!("simulator: {e}"));
                SimSummary::default()
            }
        },
        None => SimSummary::default(),
    };

    // The comparison needs the copy at the owner's position; a copy that
    // never got there is reported as not compared, not as equal.
    let divergence = match final_divergence(url, serve, options.recover_limit).await {
        Ok(d) => Some(d),
        Err(e) => {
            problem.get_or_insert(e.to_string());
            None
        }
    };
    let snapshots = serve.snapshots_taken().await;
    let searches = search_counts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    Ok(Outcome {
        fault,
        recovered: recover_secs.is_some(),
        recover_secs,
        divergence,
        searches,
        takes,
        hotelier_ok: hotelier_counts.0.load(Ordering::Relaxed),
        hotelier_failed: hotelier_counts.1.load(Ordering::Relaxed),
        snapshots,
        problem,
    })
}

async fn final_divergence(
    url: &str,
    serve: &Serve,
    limit: Duration,
) -> Result<Divergence, FaultBenchError> {
    let client = connect_retrying(url, limit).await?;
    let target = slot::current_wal_lsn(&client).await?;
    serve.caught_up(target, limit, "the final catch-up").await?;
    measure_divergence(serve.addr, &client).await
}

/// Injects the fault, heals it, and waits for recovery: the seconds from the
/// heal until the copy applied a marker committed after it, or `None` when
/// that did not happen within the limit.
async fn inject_and_recover(
    cluster: &mut Cluster,
    url: &str,
    fault: Fault,
    options: &ScenarioOptions,
    serve: &mut Serve,
) -> Result<Option<f64>, FaultBenchError> {
    let client = owner::connect(url, CONNECT_TIMEOUT).await?;
    match fault {
        Fault::WalsenderTerminated => {
            let info = wait_slot(&client, "the walsender to attach", |i| i.active).await?;
            client
                .execute(
                    "SELECT pg_terminate_backend($1)",
                    &[&info.active_pid.unwrap_or(0)],
                )
                .await?;
        }
        Fault::OwnerRestartFast | Fault::OwnerRestartImmediate => {
            let mode = if fault == Fault::OwnerRestartFast {
                StopMode::Fast
            } else {
                StopMode::Immediate
            };
            drop(client);
            tokio::task::block_in_place(|| cluster.restart(mode))?;
        }
        Fault::VacancyKilled => {
            serve.kill().await;
            wait_slot(&client, "the killed walsender to let go", |i| !i.active).await?;
            serve.restart()?;
        }
        Fault::SlotDropped => {
            serve.signal("STOP").await?;
            // The stopped process cannot answer; end its session so the slot
            // is free to drop, as it would be after a network partition.
            slot::drop_slot(&client, SLOT).await?;
            serve.signal("CONT").await?;
        }
        Fault::SlotInvalidated => {
            // ALTER SYSTEM may not run in the implicit transaction of a
            // multi-statement query: one statement per call.
            client
                .batch_execute(&format!(
                    "ALTER SYSTEM SET max_slot_wal_keep_size = '{SLOT_WAL_KEEP}'"
                ))
                .await?;
            client.batch_execute("SELECT pg_reload_conf()").await?;
            client
                .batch_execute("CREATE TABLE IF NOT EXISTS vacancy_fault_ballast (x int)")
                .await?;
            serve.signal("STOP").await?;
            let lost = invalidate_slot(&client).await;
            serve.signal("CONT").await?;
            lost?;
        }
        Fault::OwnerUnreachable => {
            drop(client);
            tokio::task::block_in_place(|| cluster.stop(StopMode::Fast))?;
            tokio::time::sleep(options.unreachable).await;
            tokio::task::block_in_place(|| cluster.start_again())?;
        }
        Fault::WritesFail => {
            client.batch_execute(FAIL_WRITES_SQL).await?;
            tokio::time::sleep(options.writes_fail_for).await;
            client.batch_execute(HEAL_WRITES_SQL).await?;
        }
    }
    let healed = Instant::now();
    let deadline = healed + options.recover_limit;
    let client = connect_retrying(url, options.recover_limit).await?;
    client
        .execute(
            "SELECT pg_logical_emit_message(true, 'vacancy.fault', 'healed')",
            &[],
        )
        .await?;
    let marker = slot::current_wal_lsn(&client).await?;
    while Instant::now() < deadline {
        if serve.recovered_past(marker).await {
            return Ok(Some(healed.elapsed().as_secs_f64()));
        }
        tokio::time::sleep(POLL).await;
    }
    Ok(None)
}

/// Switches WAL segments and checkpoints until the held-back slot is `lost`.
async fn invalidate_slot(client: &Client) -> Result<(), FaultBenchError> {
    for round in 0..60 {
        client
            .batch_execute("INSERT INTO vacancy_fault_ballast VALUES (1); SELECT pg_switch_wal();")
            .await?;
        if round % 4 == 3 {
            client.batch_execute("CHECKPOINT").await?;
            let info = slot::slot_info(client, SLOT).await?;
            if info.is_some_and(|i| i.is_lost()) {
                return Ok(());
            }
        }
    }
    Err(FaultBenchError::Timeout {
        what: "the slot to be invalidated".into(),
        limit: Duration::ZERO,
        detail: " (60 WAL segment switches)".into(),
    })
}

/// Polls the slot until `done` holds; the slot as last seen.
async fn wait_slot(
    client: &Client,
    what: &str,
    done: impl Fn(&slot::SlotInfo) -> bool,
) -> Result<slot::SlotInfo, FaultBenchError> {
    let limit = Duration::from_secs(30);
    let started = Instant::now();
    loop {
        if let Some(info) = slot::slot_info(client, SLOT).await?
            && done(&info)
        {
            return Ok(info);
        }
        if started.elapsed() > limit {
            return Err(FaultBenchError::Timeout {
                what: what.to_string(),
                limit,
                detail: String::new(),
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Connects, retrying while the owner is starting.
async fn connect_retrying(url: &str, limit: Duration) -> Result<Client, FaultBenchError> {
    let started = Instant::now();
    loop {
        match owner::connect(url, CONNECT_TIMEOUT).await {
            Ok(c) => return Ok(c),
            Err(e) if started.elapsed() > limit => return Err(e.into()),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Hotel ids, cities, the first night and the number of nights on the owner.
async fn dataset(
    client: &Client,
) -> Result<(Vec<i64>, Vec<String>, NaiveDate, i64), FaultBenchError> {
    let hotel_ids: Vec<i64> = client
        .query("SELECT id FROM hotels ORDER BY id", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let cities: Vec<String> = client
        .query(
            "SELECT city FROM hotels GROUP BY city ORDER BY count(*) DESC LIMIT 10",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let row = client
        .query_one("SELECT min(night), max(night) FROM inventory", &[])
        .await?;
    let (first, last): (Option<NaiveDate>, Option<NaiveDate>) = (row.get(0), row.get(1));
    let first = first.unwrap_or_else(|| chrono::Utc::now().date_naive());
    let nights = last.map_or(1, |l| (l - first).num_days() + 1);
    Ok((hotel_ids, cities, first, nights))
}

// ---------------------------------------------------------------- the load

async fn search_loop(
    addr: SocketAddr,
    cities: Vec<String>,
    first_night: NaiveDate,
    nights: i64,
    seed: u64,
    counts: Arc<std::sync::Mutex<LoadCounts>>,
    stop: CancellationToken,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    while !stop.is_cancelled() && !cities.is_empty() {
        let city = &cities[rng.random_range(0..cities.len())];
        let stay: i64 = rng.random_range(1..=3);
        let start = rng.random_range(0..(nights - stay).max(1));
        let check_in = first_night + chrono::Days::new(start as u64);
        let check_out = check_in + chrono::Days::new(stay as u64);
        let city: String = form_urlencoded::byte_serialize(city.as_bytes()).collect();
        let path = format!(
            "/v1/search?city={city}&check_in={check_in}&check_out={check_out}&room=2&limit=10"
        );
        let kind = match http(addr, "GET", &path, None, None, HTTP_TIMEOUT).await {
            Ok(r) if (200..300).contains(&r.status) => None,
            Ok(r) if r.status == 503 => Some(None),
            Ok(r) => Some(Some(r.status.to_string())),
            Err(simulator::HttpError::Timeout(_)) => Some(Some("timeout".to_string())),
            Err(simulator::HttpError::Io(e)) => Some(Some(format!("{:?}", e.kind()))),
            Err(e) => Some(Some(e.to_string())),
        };
        {
            let mut c = counts.lock().unwrap_or_else(|p| p.into_inner());
            match kind {
                None => c.ok += 1,
                Some(None) => c.not_ready += 1,
                Some(Some(kind)) => {
                    c.failed += 1;
                    *c.failures.entry(kind).or_default() += 1;
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
}

/// A hotelier on the owner: capacity, hotel and room type changes, new room
/// types with their nights, nights leaving the sale. Independent of the API,
/// so the owner keeps changing while vacancy is down. Counts (ok, failed).
async fn hotelier(
    url: String,
    hotel_ids: Vec<i64>,
    first_night: NaiveDate,
    nights: i64,
    seed: u64,
    counts: Arc<(AtomicU64, AtomicU64)>,
    stop: CancellationToken,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x4807_e11e);
    let mut client: Option<Client> = None;
    let mut step: i64 = 0;
    while !stop.is_cancelled() && !hotel_ids.is_empty() {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        if client.is_none() {
            client = owner::connect(&url, Duration::from_secs(2)).await.ok();
        }
        let Some(c) = client.as_mut() else {
            counts.1.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        step += 1;
        let hotel = hotel_ids[rng.random_range(0..hotel_ids.len())];
        let night = first_night + chrono::Days::new(rng.random_range(0..nights.max(1)) as u64);
        let done = match rng.random_range(0..100) {
            0..=54 => {
                let total = rng.random_range(0..12);
                crate::owner::ops::set_capacity(
                    c,
                    hotel,
                    1,
                    night,
                    night + chrono::Days::new(2),
                    Some(total),
                    None,
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
            }
            55..=74 => c
                .execute(
                    "UPDATE hotels SET name = left(name, 40) || '*', stars = 1 + (coalesce(stars, 0) + 1) % 5,
                            amenities = amenities[2:] || amenities[1:1]
                     WHERE id = $1",
                    &[&hotel],
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            75..=84 => c
                .execute(
                    "UPDATE room_types SET name = left(name, 40) || '+', max_guests = 1 + max_guests % 6
                     WHERE hotel_id = $1 AND id = 1",
                    &[&hotel],
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            85..=92 => {
                // A new room type and its nights, in one transaction.
                let id = 100_000 + seed as i64 * 1_000_000 + step;
                let sql = format!(
                    "BEGIN;
                     INSERT INTO room_types (hotel_id, id, name, max_guests) VALUES ({hotel}, {id}, 'Added', 3)
                       ON CONFLICT DO NOTHING;
                     INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
                       SELECT {hotel}, {id}, DATE '{night}' + n, 4, 12000 FROM generate_series(0, 6) n
                       ON CONFLICT DO NOTHING;
                     COMMIT;"
                );
                let r = c.batch_execute(&sql).await;
                if r.is_err() {
                    let _ = c.batch_execute("ROLLBACK").await;
                }
                r.map_err(|e| e.to_string())
            }
            _ => c
                .execute(
                    "DELETE FROM inventory WHERE hotel_id = $1 AND night = $2 AND taken = 0",
                    &[&hotel, &night],
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
        };
        match done {
            Ok(()) => counts.0.fetch_add(1, Ordering::Relaxed),
            Err(_) => {
                if c.is_closed() {
                    client = None;
                }
                counts.1.fetch_add(1, Ordering::Relaxed)
            }
        };
    }
}

// ---------------------------------------------------------------- the comparison

/// Reads every row of the owner and of the copy served at `addr` (which must
/// have applied the owner's position already) and counts the differences.
/// The copy is read per owner hotel over the owner's nights; rows the copy
/// has beyond those are counted from the totals `/v1/status` reports.
pub async fn measure_divergence(
    addr: SocketAddr,
    client: &Client,
) -> Result<Divergence, FaultBenchError> {
    let owner_rows = owner_rows(client).await?;
    let copy = copy_rows(addr, &owner_rows).await?;
    let mut d = divergence(&owner_rows, &copy);
    let status = get_json(addr, "/v1/status").await?;
    let surplus = |field: &str, seen: usize| {
        status["model"][field]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(seen as u64)
    };
    d.hotels += surplus("hotels", copy.hotels.len());
    d.room_types += surplus("room_types", copy.room_types.len());
    d.inventory += surplus("inventory_rows", copy.inventory.len());
    Ok(d)
}

pub async fn owner_rows(client: &Client) -> Result<Rows, FaultBenchError> {
    let mut rows = Rows::default();
    for r in client
        .query(
            "SELECT id, name, city, country, stars, latitude, longitude, amenities FROM hotels",
            &[],
        )
        .await?
    {
        rows.hotels.insert(
            r.get(0),
            HotelRow {
                name: r.get(1),
                city: r.get(2),
                country: r.get(3),
                stars: r.get(4),
                latitude: r.get(5),
                longitude: r.get(6),
                amenities: r.get(7),
            },
        );
    }
    for r in client
        .query("SELECT hotel_id, id, name, max_guests FROM room_types", &[])
        .await?
    {
        rows.room_types
            .insert((r.get(0), r.get(1)), (r.get(2), r.get(3)));
    }
    for r in client
        .query(
            "SELECT hotel_id, room_type_id, night, total, taken, sell_limit, price_cents FROM inventory",
            &[],
        )
        .await?
    {
        rows.inventory.insert(
            (r.get(0), r.get(1), r.get(2)),
            NightCounts {
                total: r.get(3),
                taken: r.get(4),
                sell_limit: r.get(5),
                price_cents: r.get(6),
            },
        );
    }
    Ok(rows)
}

/// The longest range one calendar request may ask for (the API's bound).
const CALENDAR_DAYS: u64 = 800;

async fn copy_rows(addr: SocketAddr, owner: &Rows) -> Result<Rows, FaultBenchError> {
    let mut rows = Rows::default();
    let nights = owner.inventory.keys().map(|k| k.2);
    let (Some(first), Some(last)) = (nights.clone().min(), nights.max()) else {
        return Ok(rows);
    };
    let end = last + chrono::Days::new(1);
    for &hotel in owner.hotels.keys() {
        let mut from = first;
        while from < end {
            let to = (from + chrono::Days::new(CALENDAR_DAYS)).min(end);
            let path = format!("/v1/hotels/{hotel}/calendar?from={from}&to={to}");
            let r = http(addr, "GET", &path, None, None, HTTP_TIMEOUT)
                .await
                .map_err(|e| FaultBenchError::CopyRead {
                    path: path.clone(),
                    status: "no answer".into(),
                    body: e.to_string(),
                })?;
            if r.status == 404 {
                break; // the copy lacks the hotel: counted as divergent by the comparison
            }
            if r.status != 200 {
                return Err(FaultBenchError::CopyRead {
                    path,
                    status: r.status.to_string(),
                    body: String::from_utf8_lossy(&r.body).into_owned(),
                });
            }
            let body = String::from_utf8_lossy(&r.body);
            parse_calendar(&body, hotel, from == first, &mut rows);
            from = to;
        }
    }
    Ok(rows)
}

/// Adds one calendar answer to `rows`; the hotel and its room types only
/// from the first range of nights (they repeat in every range).
fn parse_calendar(body: &str, hotel: i64, first_range: bool, rows: &mut Rows) {
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    let h = &v["hotel"];
    if first_range && let (Some(name), Some(city)) = (h["name"].as_str(), h["city"].as_str()) {
        rows.hotels.insert(
            hotel,
            HotelRow {
                name: name.to_string(),
                city: city.to_string(),
                country: h["country"].as_str().map(str::to_string),
                stars: h["stars"].as_i64().and_then(|s| i16::try_from(s).ok()),
                latitude: exact_number(body, "latitude"),
                longitude: exact_number(body, "longitude"),
                amenities: h["amenities"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|s| s.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default(),
            },
        );
    }
    for rt in v["room_types"].as_array().into_iter().flatten() {
        let Some(room_type) = rt["room_type_id"].as_i64() else {
            continue;
        };
        if first_range
            && let (Some(name), Some(guests)) = (rt["name"].as_str(), rt["max_guests"].as_i64())
        {
            rows.room_types.insert(
                (hotel, room_type),
                (name.to_string(), i16::try_from(guests).unwrap_or(i16::MAX)),
            );
        }
        for n in rt["nights"].as_array().into_iter().flatten() {
            let Some(night) = n["night"].as_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            let int = |k: &str| n[k].as_i64().and_then(|v| i32::try_from(v).ok());
            let (Some(total), Some(taken)) = (int("total"), int("taken")) else {
                continue;
            };
            rows.inventory.insert(
                (hotel, room_type, night),
                NightCounts {
                    total,
                    taken,
                    sell_limit: int("sell_limit"),
                    price_cents: int("price_cents"),
                },
            );
        }
    }
}

/// The first `"field": number` of a JSON text, parsed by Rust's exact
/// float parser. serde_json's default parser may land one ULP off for
/// 17-digit numbers, which would count an exact copy as divergent. The
/// first match is the hotel's: string values escape their quotes, so a
/// name cannot contain the pattern.
fn exact_number(body: &str, field: &str) -> Option<f64> {
    let pattern = format!("\"{field}\":");
    let start = body.find(&pattern)? + pattern.len();
    let rest = body.get(start..)?;
    let end = rest.find([',', '}'])?;
    rest.get(..end)?.trim().parse().ok()
}

async fn get_json(addr: SocketAddr, path: &str) -> Result<Value, FaultBenchError> {
    let r = http(addr, "GET", path, None, None, HTTP_TIMEOUT)
        .await
        .map_err(|e| FaultBenchError::CopyRead {
            path: path.to_string(),
            status: "no answer".into(),
            body: e.to_string(),
        })?;
    if r.status != 200 {
        return Err(FaultBenchError::CopyRead {
            path: path.to_string(),
            status: r.status.to_string(),
            body: String::from_utf8_lossy(&r.body).into_owned(),
        });
    }
    Ok(r.json())
}

// ---------------------------------------------------------------- the child

/// `vacancy serve` as a child process, killed on drop so a failed run
/// leaves nothing behind.
pub struct Serve {
    child: Child,
    pub addr: SocketAddr,
    exe: PathBuf,
    url: String,
    dir: PathBuf,
    name: String,
    token_file: PathBuf,
    starts: u32,
}

impl Serve {
    /// Starts `exe serve` against `url` on a free loopback port, with the
    /// bench's slot, publication and booking token; logs go to
    /// `dir/<name>-<start>.log`.
    pub fn start(exe: &Path, url: &str, dir: &Path, name: &str) -> Result<Serve, FaultBenchError> {
        let token_file = dir.join("booking-tokens");
        std::fs::write(&token_file, format!("{BOOKING_TOKEN}\n"))?;
        // A free port: bind, read it, let go. The child binds it a moment
        // later, and again after a restart, so load loops keep one address.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let child = spawn(exe, url, addr, dir, name, 1, &token_file)?;
        Ok(Serve {
            child,
            addr,
            exe: exe.to_path_buf(),
            url: url.to_string(),
            dir: dir.to_path_buf(),
            name: name.to_string(),
            token_file,
            starts: 1,
        })
    }

    /// SIGKILL: no shutdown hook runs, no last acknowledgement is sent.
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// Starts the process again on the same address.
    pub fn restart(&mut self) -> Result<(), FaultBenchError> {
        self.starts += 1;
        self.child = spawn(
            &self.exe,
            &self.url,
            self.addr,
            &self.dir,
            &self.name,
            self.starts,
            &self.token_file,
        )?;
        Ok(())
    }

    /// Sends `SIGSTOP`, `SIGCONT` or another signal by name.
    pub async fn signal(&self, name: &str) -> Result<(), FaultBenchError> {
        let Some(pid) = self.child.id() else {
            return Ok(()); // already gone
        };
        let mut kill = Command::new("kill");
        kill.args(["-s", name, &pid.to_string()]);
        run_tool(kill, "kill").await?;
        Ok(())
    }

    /// SIGTERM, then SIGKILL if it has not exited within its grace.
    pub async fn stop(&mut self) {
        let _ = self.signal("CONT").await;
        let _ = self.signal("TERM").await;
        if tokio::time::timeout(Duration::from_secs(15), self.child.wait())
            .await
            .is_err()
        {
            self.kill().await;
        }
    }

    pub async fn status(&self) -> Option<Value> {
        get_json(self.addr, "/v1/status").await.ok()
    }

    /// Loaded, streaming, not resnapshotting, applied at or past `lsn`.
    pub async fn recovered_past(&self, lsn: Lsn) -> bool {
        let Some(s) = self.status().await else {
            return false;
        };
        let applied: Option<Lsn> = s["applied_lsn"].as_str().and_then(|t| t.parse().ok());
        s["snapshot"]["phase"] == "loaded"
            && s["connected"] == true
            && s["resnapshotting"] == false
            && applied.is_some_and(|a| a >= lsn)
    }

    /// Waits until the copy is loaded and has applied `target`.
    pub async fn caught_up(
        &self,
        target: Lsn,
        limit: Duration,
        what: &str,
    ) -> Result<(), FaultBenchError> {
        let started = Instant::now();
        loop {
            if let Some(s) = self.status().await {
                let applied: Option<Lsn> = s["applied_lsn"].as_str().and_then(|t| t.parse().ok());
                if s["snapshot"]["phase"] == "loaded" && applied.is_some_and(|a| a >= target) {
                    return Ok(());
                }
            }
            if started.elapsed() > limit {
                return Err(FaultBenchError::Timeout {
                    what: format!("{what} (copy applying {target})"),
                    limit,
                    detail: format!("; last status: {}", self.status_line().await),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The status fields that say why a copy is not caught up.
    async fn status_line(&self) -> String {
        match self.status().await {
            Some(s) => format!(
                "phase {}, connected {}, resnapshotting {}, applied {}, last error {}",
                s["snapshot"]["phase"],
                s["connected"],
                s["resnapshotting"],
                s["applied_lsn"],
                s["last_error"]
            ),
            None => {
                let log = std::fs::read_to_string(
                    self.dir.join(format!("{}-{}.log", self.name, self.starts)),
                )
                .unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                format!(
                    "no answer; log ends: {}",
                    lines[lines.len().saturating_sub(3)..].join(" | ")
                )
            }
        }
    }

    /// `vacancy_resnapshots_total` by reason, from `/metrics`.
    async fn snapshots_taken(&self) -> BTreeMap<String, u64> {
        let Ok(r) = http(self.addr, "GET", "/metrics", None, None, HTTP_TIMEOUT).await else {
            return BTreeMap::new();
        };
        parse_snapshots(&String::from_utf8_lossy(&r.body))
    }
}

fn parse_snapshots(metrics: &str) -> BTreeMap<String, u64> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("vacancy_resnapshots_total{reason=\""))
        .filter_map(|rest| {
            let (reason, value) = rest.split_once("\"}")?;
            let n = value.trim().parse::<f64>().ok()? as u64;
            (n > 0).then(|| (reason.to_string(), n))
        })
        .collect()
}

fn spawn(
    exe: &Path,
    url: &str,
    addr: SocketAddr,
    dir: &Path,
    name: &str,
    start: u32,
    token_file: &Path,
) -> Result<Child, FaultBenchError> {
    let log = std::fs::File::create(dir.join(format!("{name}-{start}.log")))?;
    let child = Command::new(exe)
        .arg("serve")
        .env("VACANCY_OWNER_URL", url)
        .env("VACANCY_LISTEN", addr.to_string())
        .env("VACANCY_STREAM__SLOT", SLOT)
        .env("VACANCY_STREAM__PUBLICATION", PUBLICATION)
        .env("VACANCY_STREAM__SLOT_WATCH_INTERVAL_MS", "1000")
        .env("VACANCY_STALE__BOOKING_TOKENS_FILE", token_file)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .kill_on_drop(true)
        .spawn()?;
    Ok(child)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> Rows {
        let mut r = Rows::default();
        r.hotels.insert(
            1,
            HotelRow {
                name: "A".into(),
                city: "Lisbon".into(),
                country: Some("PT".into()),
                stars: Some(3),
                latitude: Some(38.7),
                longitude: Some(-9.1),
                amenities: vec!["wifi".into()],
            },
        );
        r.room_types.insert((1, 1), ("Double".into(), 2));
        let night = NaiveDate::from_ymd_opt(2030, 1, 1).unwrap();
        for d in 0..3 {
            r.inventory.insert(
                (1, 1, night + chrono::Days::new(d)),
                NightCounts {
                    total: 5,
                    taken: 1,
                    sell_limit: None,
                    price_cents: Some(100),
                },
            );
        }
        r
    }

    #[test]
    fn equal_copies_have_no_divergent_rows() {
        let d = divergence(&rows(), &rows());
        assert_eq!(d.total(), 0);
        assert_eq!(d.compared, 5);
    }

    #[test]
    fn a_changed_a_missing_and_an_extra_row_are_each_counted() {
        let owner = rows();
        let mut copy = rows();
        let night = NaiveDate::from_ymd_opt(2030, 1, 1).unwrap();
        copy.inventory.get_mut(&(1, 1, night)).expect("row").taken = 2;
        copy.inventory.remove(&(1, 1, night + chrono::Days::new(1)));
        copy.inventory.insert(
            (1, 1, night + chrono::Days::new(9)),
            NightCounts {
                total: 1,
                taken: 0,
                sell_limit: None,
                price_cents: None,
            },
        );
        copy.hotels.get_mut(&1).expect("hotel").amenities.clear();
        copy.room_types.insert((1, 1), ("Double".into(), 3));
        let d = divergence(&owner, &copy);
        assert_eq!((d.inventory, d.hotels, d.room_types), (3, 1, 1));
        assert_eq!(d.total(), 5);
        assert_eq!(d.examples.len(), 5, "{:?}", d.examples);
    }

    #[test]
    fn a_calendar_answer_becomes_rows() {
        let v = serde_json::json!({
            "hotel_id": 1,
            "hotel": {"id": 1, "name": "A", "city": "Lisbon", "country": "PT", "stars": 3,
                      "latitude": 38.7, "longitude": -9.1, "amenities": ["wifi"]},
            "room_types": [{"room_type_id": 1, "name": "Double", "max_guests": 2, "nights": [
                {"night": "2030-01-01", "total": 5, "taken": 1, "sell_limit": null, "price_cents": 100, "free": 4},
                {"night": "2030-01-02", "total": 5, "taken": 1, "price_cents": 100, "free": 4},
                {"night": "2030-01-03", "total": 5, "taken": 1, "sell_limit": null, "price_cents": 100, "free": 4},
                {"night": "not a date", "total": 5, "taken": 1}
            ]}]
        });
        let text = v.to_string();
        let mut parsed = Rows::default();
        parse_calendar(&text, 1, true, &mut parsed);
        assert_eq!(parsed, rows());
        let mut later = Rows::default();
        parse_calendar(&text, 1, false, &mut later);
        assert!(later.hotels.is_empty() && later.room_types.is_empty());
        assert_eq!(later.inventory.len(), 3);
    }

    #[test]
    fn coordinates_are_parsed_exactly() {
        let body = r#"{"hotel":{"name":"a \"latitude\": 1","latitude":51.55072958206283,"longitude":-0.24482051340406566,"x":null}}"#;
        assert_eq!(exact_number(body, "latitude"), Some(51.55072958206283));
        assert_eq!(exact_number(body, "longitude"), Some(-0.24482051340406566));
        assert_eq!(exact_number(body, "x"), None);
        assert_eq!(exact_number(body, "missing"), None);
        assert_eq!(exact_number("{\"latitude\":", "latitude"), None);
    }

    #[test]
    fn snapshots_are_read_from_the_metrics_text() {
        let text = "# HELP x\nvacancy_resnapshots_total{reason=\"initial\"} 1\n\
                    vacancy_resnapshots_total{reason=\"slot_lost\"} 2\n\
                    vacancy_resnapshots_total{reason=\"requested\"} 0\n";
        let got = parse_snapshots(text);
        assert_eq!(got.len(), 2);
        assert_eq!(got["slot_lost"], 2);
    }

    #[test]
    fn the_table_marks_what_did_not_recover() {
        let mut ok = failed_outcome(Fault::WalsenderTerminated, String::new());
        ok.problem = None;
        ok.recovered = true;
        ok.recover_secs = Some(1.5);
        ok.divergence = Some(Divergence {
            compared: 10,
            ..Divergence::default()
        });
        let bad = failed_outcome(Fault::SlotDropped, "slot watch timed out".into());
        let table = render(&[ok, bad]);
        assert!(
            table.contains("| walsender terminated | yes | 1.5 | 0 (of 10) |"),
            "{table}"
        );
        assert!(
            table.contains("| slot dropped while disconnected | **no** | — | not compared |"),
            "{table}"
        );
        assert!(table.contains("- slot dropped while disconnected: slot watch timed out"));
    }
}

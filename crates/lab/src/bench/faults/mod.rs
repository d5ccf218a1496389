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
//!   process restarted or continued, trigger dropped; for a huge
//!   transaction, its commit returning) until `/v1/status`
//!   shows the copy loaded, streaming, not resnapshotting, and applied past
//!   the marker;
//! - seconds to detect (packets dropped): from the first dropped packet
//!   until `/v1/status` shows the replication connection given up; (owner
//!   failovers) from the primary's stop until `/v1/status` shows a session
//!   on the new owner timeline (the promotion's time included). A failover's
//!   seconds to recover start when the promotion is done and end once the
//!   copy is of the new timeline and applied past the marker;
//! - requests failed: load-loop searches that got a connection error, a
//!   timeout, or a status other than 2xx and 503; a 503 (not ready, lagging
//!   past the bound: the service refusing on purpose) is counted apart;
//! - spilled (huge transaction): the child's spilled transactions and bytes
//!   (`/metrics`) and the files left in its spill dir after the comparison,
//!   listed under the table.
//!
//! Here: the faults, the bench's loop over them and its table. One scenario
//! is `scenario`; the search loop and the hotelier are `load`; the row by
//! row comparison is `compare`; the child process is `child`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::bench::ToolError;
use crate::cluster::{ClusterError, ClusterOptions};
use crate::owner_db::start_embedded;
use crate::seed::{self, SeedError};
use crate::simulator::{SimError, SimSummary};
use vacancy_service::OwnerError;
use vacancy_service::slot::SlotError;

mod child;
mod compare;
mod load;
mod scenario;

pub use child::Serve;
pub use compare::{Divergence, HotelRow, Rows, divergence, measure_divergence, owner_rows};
pub use scenario::run_scenario;

/// The child's slot and publication: its own, so the bench never touches a
/// `vacancy serve` attached to the same owner.
pub const SLOT: &str = "vacancy_faults";
pub const PUBLICATION: &str = "vacancy_faults";
pub(crate) const BOOKING_TOKEN: &str = "fault-bench-booking-token";
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
/// The child's `stream.max_held_bytes` for `huge-transaction`: the default
/// data's repricing holds about 60 B per row (7 MB for 120,000 rows), so
/// 1 MiB makes it spill, as 256 MiB does for 73M rows.
const HUGE_HELD_BYTES: u64 = 1024 * 1024;

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
    /// Every packet between vacancy and the owner dropped for
    /// `--unreachable-secs`, nothing refused or closed (`blackhole`); then
    /// new connections get through, the dark ones stay dark.
    PacketsDropped,
    /// The owner's streaming standby, caught up, is promoted after the
    /// primary stops (a new timeline, no slot); `vacancy serve`, the
    /// workload and the comparison name both in one multi-host URL
    /// (`target_session_attrs=read-write`). The promoted standby is the
    /// owner of every later scenario.
    OwnerFailover,
    /// As `owner-failover`, with a standby stopped for the warm-up while
    /// the copy applies the primary's writes: the new primary lacks them
    /// and starts below the copy's position.
    OwnerFailoverLagging,
    /// One owner transaction over every inventory row (a repricing), while
    /// the child's `stream.max_held_bytes` is `HUGE_HELD_BYTES`: the
    /// transaction spills to disk, is applied at its commit, and its file
    /// is removed (issue 24, item 3).
    HugeTransaction,
}

impl Fault {
    pub const ALL: [Fault; 12] = [
        Fault::WalsenderTerminated,
        Fault::OwnerRestartFast,
        Fault::OwnerRestartImmediate,
        Fault::VacancyKilled,
        Fault::SlotDropped,
        Fault::SlotInvalidated,
        Fault::OwnerUnreachable,
        Fault::WritesFail,
        Fault::PacketsDropped,
        Fault::OwnerFailover,
        Fault::OwnerFailoverLagging,
        Fault::HugeTransaction,
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
            Fault::PacketsDropped => "packets dropped (nothing refused)",
            Fault::OwnerFailover => "owner failed over to its standby",
            Fault::OwnerFailoverLagging => "owner failed over to a lagging standby",
            Fault::HugeTransaction => "one transaction over every row, past the held bound",
        }
    }

    /// The owner's standby is promoted: the scenario runs against both.
    pub fn is_failover(self) -> bool {
        matches!(self, Fault::OwnerFailover | Fault::OwnerFailoverLagging)
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
    /// How long the owner stays stopped for `owner-unreachable`, and its
    /// packets are dropped for `packets-dropped`.
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
    #[error("{what} did not happen within {limit:?}{detail}")]
    Timeout {
        what: String,
        limit: Duration,
        detail: String,
    },
    #[error("`vacancy serve` exited while waiting for {what}; its log: {}", .log.display())]
    ServerExited { what: String, log: PathBuf },
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

/// One scenario's result: a row of the table.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub fault: Fault,
    pub recovered: bool,
    pub recover_secs: Option<f64>,
    /// Packets dropped: seconds until `/v1/status` said `connected: false`.
    pub detect_secs: Option<f64>,
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
    /// `huge-transaction`: what spilled, and the files left after.
    pub spilled: Option<Spilled>,
}

/// What the child spilled in a `huge-transaction` scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spilled {
    /// `vacancy_held_spilled_transactions_total` at the end.
    pub transactions: u64,
    /// `vacancy_held_spilled_bytes_total` at the end.
    pub bytes: u64,
    /// Files in the child's `stream.spill_dir` once the copy caught up and
    /// was compared.
    pub files_left: usize,
}

/// `vacancy bench faults`: an embedded owner, seeded, then every fault in turn.
pub async fn run(args: FaultArgs) -> Result<(), FaultBenchError> {
    let bin_dir = args
        .pg_bin
        .clone()
        .unwrap_or_else(|| ClusterOptions::default().bin_dir);
    // Always embedded: the faults stop and restart the owner.
    let mut cluster = start_embedded(ClusterOptions {
        bin_dir,
        fsync: true,
        ..ClusterOptions::default()
    })
    .await?;
    let created = cluster.create_database("faults")?;
    let report = seed::run_announced(
        &created,
        (args.hotels, args.room_types, args.nights),
        args.seed,
    )
    .await?;
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
        // After a failover the owner is the promoted standby, on its own port.
        let url = cluster.url("faults");
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
    println!(
        "command:  {}",
        crate::bench::redacted_command_line(&args_line)
    );
    println!(
        "data:     {} hotels x {} room types x {} nights = {} inventory rows (seed {}), embedded PostgreSQL, fsync on",
        report.hotels, args.room_types, args.nights, report.inventory_rows, args.seed
    );
    println!(
        "load:     {} simulated guests (search, hold, pay or release), a hotelier (capacity, hotel and room type changes), {} search clients; \
         owner unreachable (or its packets dropped) for {} s; writes fail for {} s; whole run {:.0} s\n",
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
        detect_secs: None,
        divergence: None,
        searches: LoadCounts::default(),
        takes: SimSummary::default(),
        hotelier_ok: 0,
        hotelier_failed: 0,
        snapshots: BTreeMap::new(),
        problem: Some(problem),
        spilled: None,
    }
}

/// The table, in Markdown, with the problems listed under it.
pub fn render(outcomes: &[Outcome]) -> String {
    let mut out = String::from(
        "| fault | recovered | seconds to recover | rows divergent (of compared) | requests failed | 503 not ready | searches | takes ok / 409 / error | hotelier writes failed | snapshots taken | seconds to detect |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|\n",
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
            "| {} | {} | {} | {} | {} | {} | {} | {} / {} / {} | {} of {} | {} | {} |\n",
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
            o.detect_secs
                .map_or_else(|| "—".to_string(), |s| format!("{s:.1}")),
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
            let spilled = o.spilled.map(|sp| {
                format!(
                    "spilled {} transaction(s), {} bytes, at a held bound of {} bytes; spill files left after: {}",
                    sp.transactions, sp.bytes, HUGE_HELD_BYTES, sp.files_left
                )
            });
            let parts: Vec<String> = [spilled, problem, examples, failures]
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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_huge_transaction_says_what_spilled_and_what_was_left() {
        let mut huge = failed_outcome(Fault::HugeTransaction, String::new());
        huge.problem = None;
        huge.spilled = Some(Spilled {
            transactions: 1,
            bytes: 2_880_000,
            files_left: 0,
        });
        let plain = failed_outcome(Fault::WalsenderTerminated, "x".into());
        let table = render(&[huge, plain]);
        assert!(
            table.contains(&format!(
                "- one transaction over every row, past the held bound: spilled 1 transaction(s), 2880000 bytes, at a held bound of {HUGE_HELD_BYTES} bytes; spill files left after: 0"
            )),
            "{table}"
        );
        // Only the huge transaction's line speaks of spilling.
        assert!(
            table.lines().any(|l| l == "- walsender terminated: x"),
            "{table}"
        );
    }
}

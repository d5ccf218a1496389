//! `vacancy bench fleet`: what a fleet (one projector publishing to NATS
//! JetStream, replicas bootstrapping from its checkpoints) costs and
//! gains, each figure beside its baseline measured in the same run, on the
//! same owner data, with `vacancy serve` child processes:
//!
//! 1. bootstrap: seconds from spawning a process to its first 200 from
//!    `/readyz`, and its peak RSS (`VmHWM`), for a standalone first start
//!    (full snapshot, no checkpoints: the baseline) and for replicas
//!    started from the projector's uploaded checkpoint;
//! 2. owner cost: walsenders (`pg_stat_replication`), the rows the
//!    owner's sequential scans of `inventory` read during each start
//!    (`pg_stat_user_tables.seq_tup_read`) and the owner's CPU seconds
//!    across it (its processes' /proc stat), for one and two standalone
//!    copies (the baseline) and for the projector with one, two and four
//!    replicas;
//! 3. commit-to-visible latency of holds under a steady pgbench load of
//!    holds, on the projector (the baseline: it applies the slot's WAL) and
//!    on a replica (which applies what the projector published), probed
//!    in the same run under the same load; beside them, a second replica's
//!    confirmed-read wait (it reads the owner's position and waits for the
//!    stream to bring its copy there), and each replica's own owner reads;
//! 4. failover: a second projector stands by (following the stream), the
//!    active one is SIGKILLed under the same holds, and the bench times the
//!    kill to the standby's takeover and to the first transaction committed
//!    after the kill being applied on a replica; then every row of that
//!    replica is compared with the owner's;
//! 5. throughput: searches/s of one replica asked directly (the baseline),
//!    and of one and two replicas behind HAProxy (`balancer`), with the
//!    replicas' and HAProxy's CPU per search.
//!
//! The processes run one after the other where a figure is a start time
//! (on 2 cores a concurrent start would slow the one measured), and side
//! by side where the figure is what they cost together.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use chrono::NaiveDate;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;
use tokio_postgres::Client;

use super::balancer;
use super::faults::{self, Serve};
use super::{BenchError, CONNECT_TIMEOUT, Owner, mib, print_header, run_tool};
use crate::http_client::{HttpClient, HttpError, http};
use crate::measure::Latencies;
use crate::nats::{NatsServer, NatsServerError};
use vacancy_service::slot;

pub(super) struct FleetOptions {
    /// Background holds per second (pgbench -R).
    pub(super) rate: u32,
    /// Seconds of background holds (pgbench -T).
    pub(super) seconds: u32,
    /// pgbench clients.
    pub(super) clients: u32,
    /// Between the starts of two probe holds.
    pub(super) probe_interval: Duration,
    /// The projector's checkpoint.interval_secs.
    pub(super) interval_secs: u64,
    /// Keep the logs and checkpoints here (default: a temporary directory).
    pub(super) work_dir: Option<PathBuf>,
    /// Only the starts (parts 1 and 2).
    pub(super) bootstrap_only: bool,
}

/// What can go wrong in this bench beyond the owner and the child processes.
#[derive(Debug, thiserror::Error)]
pub enum FleetBenchError {
    #[error(transparent)]
    Nats(#[from] NatsServerError),
    #[error("http client: {0}")]
    Http(#[from] HttpError),
    #[error("{what} took longer than {limit:?}{detail}")]
    Timeout {
        what: String,
        limit: Duration,
        detail: String,
    },
    #[error("{what}: the process exited; its log ({log}) ends: {tail}")]
    Exited {
        what: String,
        log: String,
        tail: String,
    },
    #[error(transparent)]
    Balancer(#[from] super::balancer::BalancerError),
    #[error("a bench task failed: {0}")]
    Task(String),
}

/// The second standalone copy's slot (the first uses the faults bench's).
const SECOND_SLOT: &str = "vacancy_fleet_second";
/// The bench's admin token (`POST /v1/admin/resnapshot` on a replica).
const ADMIN_TOKEN: &str = "fleet-bench-admin-token-0123456789";
/// Required on every fleet node (quotes must verify on every node).
const QUOTE_KEY: &str = "fleet-bench-quote-key-0123456789abcdef0123";
/// How long a start may take before the bench gives up (a full snapshot of
/// 73M rows takes minutes on this machine kind).
const START_LIMIT: Duration = Duration::from_secs(30 * 60);
/// How long the projector may take to upload its first checkpoint.
const UPLOAD_LIMIT: Duration = Duration::from_secs(10 * 60);
/// How often readiness is polled: the resolution of "seconds to ready".
const READY_POLL: Duration = Duration::from_millis(20);
/// How often a probe reads a copy's calendar: the resolution of visibility.
const VISIBLE_POLL: Duration = Duration::from_millis(1);
const VISIBLE_LIMIT: Duration = Duration::from_secs(10);
const HTTP_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for pgbench to connect its clients and settle at its rate.
const SETTLE: Duration = Duration::from_secs(1);
/// Nights one probe tries before it counts the tick as full.
const PROBE_TRIES: u32 = 8;
const STOP_LIMIT: Duration = Duration::from_secs(60);

/// One process's start: what it took and what it cost the owner.
struct Start {
    label: String,
    seconds: f64,
    peak_rss_kib: Option<u64>,
    rows_loaded: Option<u64>,
    /// Rows the owner's sequential scans of `inventory` read during the start.
    seq_read: i64,
    /// Walsenders on the owner once it was ready.
    walsenders: i64,
    /// The owner's CPU seconds across the start (`None`: not a local owner).
    owner_cpu: Option<f64>,
    from: String,
}

pub(super) async fn run(owner: &Owner, o: &FleetOptions) -> Result<(), BenchError> {
    let client = vacancy_service::connect(owner.url(), CONNECT_TIMEOUT).await?;
    print_header("fleet", owner, &client).await?;
    for name in [faults::SLOT, SECOND_SLOT] {
        slot::drop_slot(&client, name).await?;
    }
    let result = measure(owner, &client, o).await;
    // A leftover slot pins the owner's WAL: removed also when a step failed
    // (the children are killed on drop, so their walsenders are gone).
    let mut cleaned = Ok(());
    for name in [faults::SLOT, SECOND_SLOT] {
        if let Err(e) = slot::drop_slot(&client, name).await {
            cleaned = Err(e.into());
        }
    }
    result.and(cleaned)
}

async fn measure(owner: &Owner, client: &Client, o: &FleetOptions) -> Result<(), BenchError> {
    let temporary = tempfile::Builder::new()
        .prefix("vacancy-fleet-")
        .tempdir()?;
    let work = o
        .work_dir
        .clone()
        .unwrap_or_else(|| temporary.path().to_path_buf());
    std::fs::create_dir_all(&work)?;
    let exe = std::env::current_exe()?;
    let nats = tokio::task::spawn_blocking(NatsServer::start)
        .await
        .map_err(|e| FleetBenchError::Task(e.to_string()))?
        .map_err(FleetBenchError::from)?;
    let nats_url = nats.url();
    let checkpoints = work.join("checkpoints");
    println!(
        "run:      nats-server -js at {nats_url}; logs in {}; projector checkpoints in {}, interval {} s",
        work.display(),
        checkpoints.display(),
        o.interval_secs
    );

    // 1. The baseline: standalone first starts, each a full snapshot on its own slot.
    eprintln!("standalone: first start (full snapshot)");
    let (mut first, first_start) = start_timed(
        client,
        "standalone, first start (full snapshot)",
        &exe,
        owner.url(),
        &work,
        "standalone-a",
        Vec::new(),
    )
    .await?;
    eprintln!("standalone: a second copy on a second slot");
    let (mut second, second_start) = start_timed(
        client,
        "2nd standalone beside it (full snapshot)",
        &exe,
        owner.url(),
        &work,
        "standalone-b",
        vec![("VACANCY_STREAM__SLOT".into(), SECOND_SLOT.into())],
    )
    .await?;
    first.stop().await;
    second.stop().await;
    for name in [faults::SLOT, SECOND_SLOT] {
        slot::drop_slot(client, name).await?;
    }

    // 2. The fleet: the projector (a full snapshot too), its first upload,
    //    then two replicas one after the other.
    // The admin token lets the bench ask replica 1 for a new bootstrap.
    let admin_tokens = work.join("admin-tokens");
    std::fs::write(&admin_tokens, format!("{ADMIN_TOKEN}\n"))?;
    let fleet_env = |role: &str| {
        vec![
            ("VACANCY_FLEET__ROLE".to_string(), role.to_string()),
            ("VACANCY_FLEET__NATS_URL".to_string(), nats_url.clone()),
            (
                "VACANCY_STALE__QUOTE_KEY".to_string(),
                QUOTE_KEY.to_string(),
            ),
            (
                "VACANCY_ADMIN__TOKENS_FILE".to_string(),
                admin_tokens.display().to_string(),
            ),
        ]
    };
    // A projector: its own checkpoint directory, the interval asked for,
    // and a stream that keeps what the two kept checkpoints need.
    let projector_env = |checkpoints: &Path| {
        let mut env = fleet_env("projector");
        env.push((
            "VACANCY_CHECKPOINT__DIR".into(),
            checkpoints.display().to_string(),
        ));
        env.push((
            "VACANCY_CHECKPOINT__INTERVAL_SECS".into(),
            o.interval_secs.to_string(),
        ));
        env.push((
            "VACANCY_FLEET__MAX_AGE_SECS".into(),
            (2 * o.interval_secs).max(3600).to_string(),
        ));
        env
    };
    eprintln!("projector: first start (full snapshot)");
    let (mut projector, projector_start) = start_timed(
        client,
        "projector, first start (full snapshot)",
        &exe,
        owner.url(),
        &work,
        "projector",
        projector_env(&checkpoints),
    )
    .await?;
    let uploaded_after = first_upload(&mut projector).await?;
    let checkpoint_bytes = projector.status().await.and_then(|s| {
        s["checkpoint"]["last_written"]["bytes"]
            .as_u64()
            .filter(|b| *b > 0)
    });
    eprintln!("replicas: two, one after the other");
    let (mut replica_one, replica_one_start) = start_timed(
        client,
        "replica 1 (projector running)",
        &exe,
        owner.url(),
        &work,
        "replica-1",
        fleet_env("replica"),
    )
    .await?;
    // Replica 2 makes every shown room type owner-fresh by a confirmed
    // read, so the latency part measures its wait on every search.
    let mut confirming = fleet_env("replica");
    confirming.push(("VACANCY_SEARCH__FRESH_READS".into(), "confirmed".into()));
    confirming.push((
        "VACANCY_SEARCH__FEW_UNITS_THRESHOLD".into(),
        CONFIRM_ALL.to_string(),
    ));
    let (mut replica_two, replica_two_start) = start_timed(
        client,
        "replica 2 (projector, replica 1 running)",
        &exe,
        owner.url(),
        &work,
        "replica-2",
        confirming,
    )
    .await?;
    // Two more: what the owner pays must not grow with the replicas.
    let mut more = Vec::new();
    for n in 3..=4 {
        let (replica, start) = start_timed(
            client,
            &format!("replica {n} (projector, {} replicas running)", n - 1),
            &exe,
            owner.url(),
            &work,
            &format!("replica-{n}"),
            fleet_env("replica"),
        )
        .await?;
        more.push((replica, start));
    }
    let walsenders_with_four = walsenders(client).await?;
    for (replica, _) in &mut more {
        replica.stop().await;
    }
    let rebootstrap = rebootstrap(&replica_one).await?;
    let more_starts: Vec<Start> = more.into_iter().map(|(_, start)| start).collect();

    let report_starts = || {
        print_starts(
            &[
                &first_start,
                &second_start,
                &projector_start,
                &replica_one_start,
                &replica_two_start,
                &more_starts[0],
                &more_starts[1],
            ],
            uploaded_after,
            checkpoint_bytes,
            walsenders_with_four,
        );
        print_rebootstrap(&rebootstrap, &replica_one_start);
    };
    if o.bootstrap_only {
        replica_two.stop().await;
        replica_one.stop().await;
        projector.stop().await;
        drop(nats);
        report_starts();
        return Ok(());
    }

    // 3. Latency under holds, on the projector and a replica at once.
    eprintln!(
        "latency: {} s of holds at {}/s, probing the projector and replica 1",
        o.seconds, o.rate
    );
    let measured = latency(owner, &work, o, &projector, &replica_one, &replica_two).await;
    let walsenders_under_load = walsenders(client).await;
    let replica_reads = [
        ("replica 1", owner_reads(&replica_one).await),
        (
            "replica 2 (confirmed reads)",
            owner_reads(&replica_two).await,
        ),
    ];

    // 4. Failover: a standby projector, then SIGKILL of the active one
    //    under holds.
    eprintln!("failover: a standby projector, then SIGKILL of the active one under holds");
    let standby_env = projector_env(&work.join("checkpoints-standby"));
    let failed_over = failover(
        owner,
        client,
        &work,
        o,
        &mut projector,
        &replica_one,
        &exe,
        standby_env,
    )
    .await;

    replica_two.stop().await;
    replica_one.stop().await;
    projector.stop().await;
    let (samples, confirmed, pgbench) = measured?;
    let walsenders_under_load = walsenders_under_load?;
    let (failover_figures, mut standby) = failed_over?;

    // 5. Throughput: two fresh replicas with default settings (the standby,
    //    now active, idle), asked directly and through HAProxy.
    eprintln!("throughput: searches/s of one replica directly, and of one and two behind HAProxy");
    let mut throughput_replicas = Vec::new();
    for n in 1..=2 {
        let (replica, _) = start_timed(
            client,
            &format!("throughput replica {n}"),
            &exe,
            owner.url(),
            &work,
            &format!("throughput-{n}"),
            fleet_env("replica"),
        )
        .await?;
        throughput_replicas.push(replica);
    }
    let throughput_rows = throughput(client, owner, &work, &throughput_replicas).await;
    for mut replica in throughput_replicas {
        replica.stop().await;
    }
    standby.stop().await;
    drop(nats);
    let throughput_rows = throughput_rows?;

    report_starts();
    println!("owner:     {walsenders_under_load} walsender(s) under the holds below");
    println!();
    println!(
        "method:   a probe holds one unit of one random night (`UPDATE inventory SET taken = taken + 1 ... \
         RETURNING taken`, autocommit) every {:?}, notes the instant the statement returned, then reads \
         /v1/hotels/<id>/calendar for that night from the projector and from replica 1 at once, each every \
         {VISIBLE_POLL:?} on a kept-alive connection, until `taken` reaches the value returned; replica 2 \
         runs meanwhile; the figures include one HTTP round trip",
        o.probe_interval
    );
    println!(
        "load:     pgbench -R {} -T {} -c {} (one single-night hold `UPDATE` per transaction, synchronous_commit as the owner has it):",
        o.rate, o.seconds, o.clients
    );
    for line in pgbench_summary(&pgbench) {
        println!("          {line}");
    }
    println!();
    println!(
        "| copy | samples | p50 | p99 | max | not visible in 10 s | probe holds full | probe statement p50 |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let statement = Latencies::from_durations(&samples.statement);
    let ms = |figure: Option<f64>| figure.unwrap_or(f64::NAN);
    for (label, visible, timeouts) in [
        (
            "projector (applies the slot's WAL)",
            &samples.projector,
            samples.projector_timeouts,
        ),
        (
            "replica 1 (applies the JetStream stream)",
            &samples.replica,
            samples.replica_timeouts,
        ),
    ] {
        let visible = Latencies::from_durations(visible);
        println!(
            "| {label} | {} | {:.1} ms | {:.1} ms | {:.1} ms | {timeouts} | {} | {:.1} ms |",
            visible.len(),
            ms(visible.percentile(0.50)),
            ms(visible.percentile(0.99)),
            ms(visible.max()),
            samples.full,
            ms(statement.percentile(0.50)),
        );
    }
    print_confirmed(&confirmed, o);
    print_owner_reads(&replica_reads);
    println!();
    println!(
        "method:   a second projector (same slot, its own checkpoint directory) follows the stream until it is \
         ready; pgbench -R {} holds run; {} s in, the active projector is SIGKILLed; the owner's \
         pg_current_wal_insert_lsn() is read right after the kill, and replica 1's /v1/status is polled every \
         {FAILOVER_POLL:?} until its applied_lsn passes it (a transaction committed after the kill, applied \
         through the new projector); once the holds end and replica 1 has applied the owner's position, every \
         row of it is compared with the owner's",
        o.rate,
        FAILOVER_AFTER.as_secs()
    );
    println!("| failover | seconds after the SIGKILL |");
    println!("|---|---:|");
    println!(
        "| the standby says it holds the slot | {:.2} |",
        failover_figures.takeover
    );
    println!(
        "| replica 1 applies a transaction committed after the kill | {:.2} |",
        failover_figures.first_applied
    );
    println!(
        "failover: {:.2} s from SIGKILL to the first transaction after it applied on a replica (goal <= 10 s); \
         divergent rows on replica 1 afterwards: {} of {} compared",
        failover_figures.first_applied, failover_figures.divergent, failover_figures.compared,
    );
    print_throughput(&throughput_rows);
    Ok(())
}

/// Seconds of each throughput run, after a warm-up of [`WARM_UP`].
const THROUGHPUT_SECONDS: u32 = 10;
const WARM_UP: u32 = 3;
/// wrk's keep-alive connections: the guest budget of one replica
/// (`http.max_guest_requests_in_flight`, 8), so the runs measure searches
/// answered, not searches shed (`vacancy bench overload` measures those).
const THROUGHPUT_CONNECTIONS: u32 = 8;
/// Distinct searches the wrk script picks from.
const THROUGHPUT_PATHS: usize = 500;

/// One throughput run: where the searches went and what came back.
struct ThroughputRow {
    label: &'static str,
    figures: balancer::WrkFigures,
    /// CPU ms per answered search: the replicas', and HAProxy's.
    replicas_cpu_ms: Option<f64>,
    haproxy_cpu_ms: Option<f64>,
}

/// wrk against replica 1 directly, then HAProxy over replica 1, then over
/// both; each run with the same random searches.
async fn throughput(
    client: &Client,
    owner: &Owner,
    work: &Path,
    replicas: &[Serve],
) -> Result<Vec<ThroughputRow>, BenchError> {
    let s = owner.shape;
    let cities = super::wait::cities(client).await?;
    let mut rng = ChaCha8Rng::seed_from_u64(24);
    let paths: Vec<String> = (0..THROUGHPUT_PATHS)
        .filter(|_| !cities.is_empty())
        .map(|_| random_search(&mut rng, &cities, s, 2))
        .collect();
    let script = balancer::write_script(work, &paths).map_err(FleetBenchError::from)?;
    let backends: Vec<std::net::SocketAddr> = replicas.iter().map(|r| r.addr).collect();
    let replica_pids: Vec<u32> = replicas.iter().filter_map(Serve::pid).collect();
    let mut rows = Vec::new();
    for (label, through, count) in [
        ("replica 1, asked directly", false, 1),
        ("HAProxy over replica 1", true, 1),
        ("HAProxy over replicas 1 and 2", true, 2),
    ] {
        let proxy = if through {
            Some(
                balancer::HaProxy::start(&backends[..count], work)
                    .await
                    .map_err(FleetBenchError::from)?,
            )
        } else {
            None
        };
        let target = proxy.as_ref().map_or(backends[0], |p| p.addr);
        balancer::run_wrk(target, &script, THROUGHPUT_CONNECTIONS, WARM_UP)
            .await
            .map_err(FleetBenchError::from)?;
        let cpu = || {
            let replicas: Option<f64> = replica_pids[..count]
                .iter()
                .map(|pid| balancer::cpu_seconds(*pid))
                .sum();
            let haproxy = proxy.as_ref().and_then(|p| balancer::cpu_seconds(p.pid));
            (replicas, haproxy)
        };
        let before = cpu();
        let figures =
            balancer::run_wrk(target, &script, THROUGHPUT_CONNECTIONS, THROUGHPUT_SECONDS)
                .await
                .map_err(FleetBenchError::from)?;
        let after = cpu();
        let answered = figures.requests.saturating_sub(figures.failed).max(1) as f64;
        let per_search =
            |b: Option<f64>, a: Option<f64>| b.zip(a).map(|(b, a)| (a - b) * 1e3 / answered);
        rows.push(ThroughputRow {
            label,
            replicas_cpu_ms: per_search(before.0, after.0),
            haproxy_cpu_ms: per_search(before.1, after.1),
            figures,
        });
    }
    Ok(rows)
}

fn print_throughput(rows: &[ThroughputRow]) {
    println!();
    println!(
        "method:   two fresh replicas (default settings; the projector idle, no holds); wrk -t1 -c{THROUGHPUT_CONNECTIONS} \
         -d{THROUGHPUT_SECONDS}s --latency, after a {WARM_UP} s warm-up, each request one of {THROUGHPUT_PATHS} \
         random searches (a city of the 20 largest, 1-3 nights, room=2, limit=10); HAProxy 2.6 (Debian), one \
         thread, round robin, keep-alive, /readyz health checks; CPU is user + system time of the replicas and \
         of HAProxy across the run (/proc), per answered search; on two cores the replicas, HAProxy and wrk \
         share the CPU, so two replicas cannot double the rate: CPU per search is the figure to compare"
    );
    println!(
        "| searches went to | searches/s | p50 | p99 | failed | replicas' CPU ms/search | HAProxy CPU ms/search |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let ms = |v: Option<f64>| v.map_or("?".to_string(), |v| format!("{v:.2} ms"));
    let cpu = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
    for row in rows {
        println!(
            "| {} | {:.0} | {} | {} | {} | {} | {} |",
            row.label,
            row.figures.per_second,
            ms(row.figures.p50_ms),
            ms(row.figures.p99_ms),
            row.figures.failed,
            cpu(row.replicas_cpu_ms),
            cpu(row.haproxy_cpu_ms),
        );
    }
}

/// When the active projector is killed, after the holds start.
const FAILOVER_AFTER: Duration = Duration::from_secs(3);
const FAILOVER_POLL: Duration = Duration::from_millis(20);
/// How long a takeover may take before the bench gives up.
const FAILOVER_LIMIT: Duration = Duration::from_secs(120);

struct Failover {
    takeover: f64,
    first_applied: f64,
    divergent: u64,
    compared: u64,
}

/// Starts a standby projector, kills `active` under holds, and times the
/// takeover as seen by the standby and by `replica`.
#[allow(clippy::too_many_arguments)]
async fn failover(
    owner: &Owner,
    client: &Client,
    work: &Path,
    o: &FleetOptions,
    active: &mut Serve,
    replica: &Serve,
    exe: &Path,
    standby_env: Vec<(String, String)>,
) -> Result<(Failover, Serve), BenchError> {
    let mut standby =
        Serve::start_with_env(exe, owner.url(), work, "projector-standby", standby_env)?;
    until_ready(&mut standby, Instant::now(), "the standby projector").await?;
    let seconds = (FAILOVER_AFTER.as_secs() as u32 * 4).max(10);
    let mut pgbench = owner.tool("pgbench");
    pgbench
        .args(["-n", "-f"])
        .arg(work.join("hold.sql"))
        .args(["-R", &o.rate.to_string()])
        .args(["-T", &seconds.to_string()])
        .args(["-c", &o.clients.to_string()])
        .args(["-j", &o.clients.min(2).to_string()])
        .arg(owner.url());
    let background = tokio::spawn(run_tool(pgbench, "pgbench"));
    tokio::time::sleep(FAILOVER_AFTER).await;
    active.kill().await;
    let killed = Instant::now();
    let after_kill: vacancy_service::Lsn = slot::current_wal_lsn(client).await?;
    let mut takeover = None;
    let mut first_applied = None;
    while takeover.is_none() || first_applied.is_none() {
        if killed.elapsed() > FAILOVER_LIMIT {
            return Err(FleetBenchError::Timeout {
                what: "the standby's takeover and a replica's first transaction after it".into(),
                limit: FAILOVER_LIMIT,
                detail: format!("; standby: {}", standby.status_line().await),
            }
            .into());
        }
        if takeover.is_none()
            && let Some(s) = standby.status().await
            && s["fleet"]["active"] == true
        {
            takeover = Some(killed.elapsed().as_secs_f64());
        }
        if first_applied.is_none()
            && let Some(s) = replica.status().await
            && let Some(applied) = s["applied_lsn"]
                .as_str()
                .and_then(|t| t.parse::<vacancy_service::Lsn>().ok())
            && applied > after_kill
        {
            first_applied = Some(killed.elapsed().as_secs_f64());
        }
        tokio::time::sleep(FAILOVER_POLL).await;
    }
    let limit = Duration::from_secs(u64::from(seconds)) + STOP_LIMIT;
    tokio::time::timeout(limit, background)
        .await
        .map_err(|_| FleetBenchError::Timeout {
            what: "pgbench to finish".into(),
            limit,
            detail: String::new(),
        })?
        .map_err(|e| FleetBenchError::Task(e.to_string()))??;
    // Every row, once the replica has applied what the owner has now.
    let target = slot::current_wal_lsn(client).await?;
    let caught_up = Instant::now();
    while !replica.recovered_past(target).await {
        if caught_up.elapsed() > FAILOVER_LIMIT {
            return Err(FleetBenchError::Timeout {
                what: format!("replica 1 to apply {target} after the failover"),
                limit: FAILOVER_LIMIT,
                detail: String::new(),
            }
            .into());
        }
        tokio::time::sleep(FAILOVER_POLL).await;
    }
    let d = faults::measure_divergence(replica.addr, client).await?;
    Ok((
        Failover {
            takeover: takeover.unwrap_or(f64::NAN),
            first_applied: first_applied.unwrap_or(f64::NAN),
            divergent: d.total(),
            compared: d.compared,
        },
        standby,
    ))
}

/// The starts' table and the bootstrap and owner lines; `starts` in the
/// order: two standalones, the projector, then the replicas (four);
/// `walsenders_with_four` counted once all four ran.
fn print_starts(
    starts: &[&Start; 7],
    uploaded_after: f64,
    checkpoint_bytes: Option<u64>,
    walsenders_with_four: i64,
) {
    println!(
        "method:   each process is `vacancy serve` (this executable) as a child; seconds to ready run from its \
         spawn to its first 200 from /readyz (polled every {READY_POLL:?}); peak RSS is VmHWM of \
         /proc/<pid>/status once ready; owner rows read are the growth of pg_stat_user_tables.seq_tup_read \
         of inventory across the start; owner CPU is the growth across the start of user + system time of \
         the owner's postmaster, its reaped children and its live children (/proc; the projector's walsender \
         and checkpointer included); walsenders are pg_stat_replication rows once it was ready"
    );
    println!(
        "          the standalones are stopped and their slots dropped before the projector starts; the \
         projector's first checkpoint ({}) was in the object store {uploaded_after:.1} s after it was \
         ready; the replicas start once it is there",
        checkpoint_bytes.map_or("size unknown".to_string(), |b| format!("{:.1} MiB", mib(b))),
    );
    println!();
    println!(
        "| start | seconds to ready | peak RSS (VmHWM) | rows loaded from the owner | owner inventory rows read by seq scans | owner CPU s | walsenders after | from |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---|");
    for s in starts {
        println!(
            "| {} | {:.2} | {} | {} | {} | {} | {} | {} |",
            s.label,
            s.seconds,
            s.peak_rss_kib
                .map_or("?".to_string(), |k| format!("{:.0} MiB", k as f64 / 1024.0)),
            s.rows_loaded.map_or("?".to_string(), |r| r.to_string()),
            s.seq_read,
            cpu(s.owner_cpu),
            s.walsenders,
            s.from
        );
    }
    println!();
    println!(
        "bootstrap: replica 1 ready in {:.2} s beside {:.2} s for the standalone's snapshot ({:.1}x); peak RSS {} beside {}",
        starts[3].seconds,
        starts[0].seconds,
        starts[0].seconds / starts[3].seconds.max(1e-9),
        rss(starts[3].peak_rss_kib),
        rss(starts[0].peak_rss_kib),
    );
    println!(
        "owner:     two standalone copies: {} walsenders, {} inventory rows read by their starts; projector + one, two, four replicas: {}, {}, {walsenders_with_four} walsender(s), {} rows read by the four replicas' starts",
        starts[1].walsenders,
        starts[0].seq_read + starts[1].seq_read,
        starts[3].walsenders,
        starts[4].walsenders,
        starts[3..].iter().map(|s| s.seq_read).sum::<i64>(),
    );
    println!(
        "owner CPU: the standalones' starts {} and {} s; replicas 1-4 {} s",
        cpu(starts[0].owner_cpu),
        cpu(starts[1].owner_cpu),
        starts[3..]
            .iter()
            .map(|s| cpu(s.owner_cpu))
            .collect::<Vec<_>>()
            .join(", "),
    );
}

fn cpu(seconds: Option<f64>) -> String {
    seconds.map_or("?".to_string(), |s| format!("{s:.2}"))
}

/// The owner's postmaster: the parent of this session's backend, when the
/// owner runs on this machine.
async fn postmaster_pid(client: &Client) -> Option<i32> {
    let backend: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .ok()?
        .get(0);
    let stat = procfs::process::Process::new(backend).ok()?.stat().ok()?;
    Some(stat.ppid)
}

/// The owner's CPU seconds so far: the postmaster's own time and its reaped
/// children's, plus every live child's (backends, walsenders, the
/// checkpointer). `None` when /proc cannot tell.
fn owner_cpu_seconds(postmaster: i32) -> Option<f64> {
    let main = procfs::process::Process::new(postmaster)
        .ok()?
        .stat()
        .ok()?;
    let reaped = u64::try_from(main.cutime + main.cstime).unwrap_or(0);
    let mut ticks = main.utime + main.stime + reaped;
    for process in procfs::process::all_processes().ok()? {
        if let Ok(stat) = process.and_then(|p| p.stat())
            && stat.ppid == postmaster
        {
            ticks += stat.utime + stat.stime;
        }
    }
    Some(ticks as f64 / procfs::ticks_per_second() as f64)
}

/// Replica 1 asked to bootstrap again (the admin resnapshot): how long it
/// took, and its peak RSS through it, when the old copy serves while the
/// new one loads.
struct Rebootstrap {
    seconds: f64,
    peak_rss_kib: Option<u64>,
}

async fn rebootstrap(replica: &Serve) -> Result<Rebootstrap, BenchError> {
    let boots = |status: &Option<Value>| {
        status
            .as_ref()
            .and_then(|s| s["fleet"]["replica"]["bootstraps"].as_u64())
            .unwrap_or(0)
    };
    let before = boots(&replica.status().await);
    let http = HttpClient::new(replica.addr, HTTP_TIMEOUT).map_err(FleetBenchError::from)?;
    let started = Instant::now();
    let asked = http
        .post_json("/v1/admin/resnapshot", Some(ADMIN_TOKEN), "")
        .await
        .map_err(FleetBenchError::from)?;
    if asked.status != 202 {
        return Err(FleetBenchError::Task(format!(
            "POST /v1/admin/resnapshot on replica 1 answered {}",
            asked.status
        ))
        .into());
    }
    while boots(&replica.status().await) <= before {
        if started.elapsed() > START_LIMIT {
            return Err(FleetBenchError::Timeout {
                what: "replica 1's second bootstrap".into(),
                limit: START_LIMIT,
                detail: String::new(),
            }
            .into());
        }
        tokio::time::sleep(READY_POLL).await;
    }
    Ok(Rebootstrap {
        seconds: started.elapsed().as_secs_f64(),
        peak_rss_kib: replica.pid().and_then(peak_rss_kib),
    })
}

fn print_rebootstrap(again: &Rebootstrap, first: &Start) {
    println!(
        "re-bootstrap: replica 1, asked again (POST /v1/admin/resnapshot), had the new copy in {:.2} s; its peak RSS through it {} (after its first bootstrap {}): the old copy serves while the new one loads",
        again.seconds,
        rss(again.peak_rss_kib),
        rss(first.peak_rss_kib),
    );
}

fn rss(kib: Option<u64>) -> String {
    kib.map_or("?".to_string(), |k| format!("{:.0} MiB", k as f64 / 1024.0))
}

/// Spawns `exe serve` and waits for its first 200 from `/readyz`; returns
/// the running process and what the start took and cost.
async fn start_timed(
    client: &Client,
    label: &str,
    exe: &Path,
    url: &str,
    work: &Path,
    name: &str,
    env: Vec<(String, String)>,
) -> Result<(Serve, Start), BenchError> {
    let before = inventory_seq_read(client).await?;
    let postmaster = postmaster_pid(client).await;
    let cpu_before = postmaster.and_then(owner_cpu_seconds);
    let started = Instant::now();
    let mut serve = Serve::start_with_env(exe, url, work, name, env)?;
    let seconds = until_ready(&mut serve, started, label).await?;
    let peak_rss_kib = serve.pid().and_then(peak_rss_kib);
    let status = serve.status().await.unwrap_or(Value::Null);
    let cpu_after = postmaster.and_then(owner_cpu_seconds);
    let after = inventory_seq_read(client).await?;
    let walsenders = walsenders(client).await?;
    let replica = &status["fleet"]["replica"];
    let load = status["checkpoint"]["loaded_from"]["load_seconds"].as_f64();
    let from = match replica["bootstrapped_from"].as_str() {
        Some(object) => match load {
            Some(load) => format!("{object} (load {load:.2} s)"),
            None => object.to_string(),
        },
        None => "snapshot".to_string(),
    };
    Ok((
        serve,
        Start {
            label: label.to_string(),
            seconds,
            peak_rss_kib,
            rows_loaded: status["snapshot"]["rows_loaded"].as_u64(),
            seq_read: after - before,
            walsenders,
            owner_cpu: cpu_before.zip(cpu_after).map(|(b, a)| a - b),
            from,
        },
    ))
}

/// Seconds from `started` until `/readyz` answers 200.
async fn until_ready(serve: &mut Serve, started: Instant, what: &str) -> Result<f64, BenchError> {
    loop {
        if let Ok(r) = http(serve.addr, "GET", "/readyz", None, None, HTTP_TIMEOUT).await
            && r.status == 200
        {
            return Ok(started.elapsed().as_secs_f64());
        }
        if serve.exited_within(Duration::ZERO).await {
            return Err(exited(serve, what).into());
        }
        if started.elapsed() > START_LIMIT {
            return Err(FleetBenchError::Timeout {
                what: format!("{what} to be ready"),
                limit: START_LIMIT,
                detail: format!("; {}", serve.status_line().await),
            }
            .into());
        }
        tokio::time::sleep(READY_POLL).await;
    }
}

fn exited(serve: &Serve, what: &str) -> FleetBenchError {
    let log = serve.log_path();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    FleetBenchError::Exited {
        what: what.to_string(),
        log: log.display().to_string(),
        tail: lines[lines.len().saturating_sub(5)..].join(" | "),
    }
}

/// Waits for the projector's first checkpoint upload (its metric); the
/// seconds it took from now.
async fn first_upload(projector: &mut Serve) -> Result<f64, BenchError> {
    let started = Instant::now();
    loop {
        if let Ok(r) = http(projector.addr, "GET", "/metrics", None, None, HTTP_TIMEOUT).await
            && uploads_ok(&String::from_utf8_lossy(&r.body)) > 0
        {
            return Ok(started.elapsed().as_secs_f64());
        }
        if projector.exited_within(Duration::ZERO).await {
            return Err(exited(projector, "the projector's first upload").into());
        }
        if started.elapsed() > UPLOAD_LIMIT {
            return Err(FleetBenchError::Timeout {
                what: "the projector's first checkpoint upload".into(),
                limit: UPLOAD_LIMIT,
                detail: format!("; {}", projector.status_line().await),
            }
            .into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `vacancy_fleet_checkpoint_uploads_total{outcome="ok"}` from `/metrics`.
fn uploads_ok(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("vacancy_fleet_checkpoint_uploads_total{outcome=\"ok\"}"))
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// `VmHWM` (peak resident set) of a process, in KiB.
fn peak_rss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vm_hwm(&text)
}

fn parse_vm_hwm(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()
}

/// `inventory`'s `seq_tup_read` so far.
async fn inventory_seq_read(client: &Client) -> Result<i64, BenchError> {
    // Stats reach the view when a backend flushes them (at most a second
    // after its transaction in PostgreSQL 15): wait that long first.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let row = client
        .query_one(
            "SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables WHERE relname = 'inventory'",
            &[],
        )
        .await?;
    Ok(row.get(0))
}

async fn walsenders(client: &Client) -> Result<i64, BenchError> {
    Ok(client
        .query_one("SELECT count(*) FROM pg_stat_replication", &[])
        .await?
        .get(0))
}

#[derive(Default)]
struct Samples {
    projector: Vec<Duration>,
    replica: Vec<Duration>,
    projector_timeouts: u64,
    replica_timeouts: u64,
    statement: Vec<Duration>,
    full: u64,
}

/// pgbench's holds in the background, probes and replica 2's confirmed
/// reads in the foreground; the samples and pgbench's output.
async fn latency(
    owner: &Owner,
    work: &Path,
    o: &FleetOptions,
    projector: &Serve,
    replica: &Serve,
    confirming: &Serve,
) -> Result<(Samples, ConfirmedReads, String), BenchError> {
    let s = owner.shape;
    let script = format!(
        "\\set h random(1, {})\n\\set r random(1, {})\n\\set n random(0, {})\n\
         UPDATE inventory SET taken = taken + 1 WHERE hotel_id = :h AND room_type_id = :r \
         AND night = DATE '{}' + :n AND taken < total;\n",
        s.hotels,
        s.room_types,
        s.nights - 1,
        s.first_night
    );
    let path = work.join("hold.sql");
    std::fs::write(&path, script)?;
    let mut pgbench = owner.tool("pgbench");
    pgbench
        .args(["-n", "-f"])
        .arg(&path)
        .args(["-R", &o.rate.to_string()])
        .args(["-T", &o.seconds.to_string()])
        .args(["-c", &o.clients.to_string()])
        .args(["-j", &o.clients.min(2).to_string()])
        .arg(owner.url());
    let background = tokio::spawn(run_tool(pgbench, "pgbench"));
    // Probes start once pgbench runs at its rate and stop before it winds
    // down, so every sample is taken under the load.
    let window = Duration::from_secs(u64::from(o.seconds)).saturating_sub(2 * SETTLE);
    tokio::time::sleep(SETTLE).await;
    let (probed, confirmed) = tokio::join!(
        probe(owner, o.probe_interval, window, projector, replica),
        confirmed_reads(owner, window, confirming),
    );
    // pgbench ends by itself after -T; bounded all the same.
    let limit = Duration::from_secs(u64::from(o.seconds)) + STOP_LIMIT;
    let out = tokio::time::timeout(limit, background)
        .await
        .map_err(|_| FleetBenchError::Timeout {
            what: "pgbench to finish".into(),
            limit,
            detail: String::new(),
        })?
        .map_err(|e| FleetBenchError::Task(e.to_string()))??;
    Ok((probed?, confirmed?, out))
}

/// The reasons a node reads the owner (`vacancy_owner_reads_total`).
const READ_REASONS: [&str; 7] = [
    "few_units",
    "min_lsn",
    "bypass",
    "position",
    "audit",
    "ttl",
    "lag",
];

/// A replica's own reads of the owner so far, by reason.
async fn owner_reads(replica: &Serve) -> Vec<f64> {
    let text = match http(replica.addr, "GET", "/metrics", None, None, HTTP_TIMEOUT).await {
        Ok(r) => r.text(),
        Err(_) => String::new(),
    };
    READ_REASONS
        .iter()
        .map(|reason| {
            counter_sum(
                &text,
                &format!("vacancy_owner_reads_total{{reason=\"{reason}\"}}"),
            )
        })
        .collect()
}

fn print_owner_reads(replicas: &[(&str, Vec<f64>); 2]) {
    println!();
    println!(
        "owner reads by the replicas themselves (their vacancy_owner_reads_total since they started, after the \
         latency part; none of them is a row of the copy):"
    );
    println!("| replica | {} |", READ_REASONS.join(" | "));
    println!("|---|{}", "---:|".repeat(READ_REASONS.len()));
    for (label, reads) in replicas {
        let cells: Vec<String> = reads.iter().map(|n| format!("{n:.0}")).collect();
        println!("| {label} | {} |", cells.join(" | "));
    }
}

/// A search of one of `cities` for a stay of 1-3 nights within the owner's
/// nights, for `room` guests, first page of 10. `cities` must not be empty.
fn random_search(rng: &mut ChaCha8Rng, cities: &[String], s: super::Shape, room: u32) -> String {
    let city: String =
        form_urlencoded::byte_serialize(cities[rng.random_range(0..cities.len())].as_bytes())
            .collect();
    let stay = rng.random_range(1..=3);
    let check_in =
        s.first_night + chrono::Days::new(rng.random_range(0..(s.nights - stay).max(1)) as u64);
    let check_out = check_in + chrono::Days::new(stay as u64);
    format!("/v1/search?city={city}&check_in={check_in}&check_out={check_out}&room={room}&limit=10")
}

/// Every shown room type is few-unit at this threshold: each search on
/// replica 2 takes a confirmed read.
const CONFIRM_ALL: u32 = 1_000_000;
/// Between two searches on replica 2.
const CONFIRMED_INTERVAL: Duration = Duration::from_millis(20);

/// Replica 2's confirmed reads under the holds.
#[derive(Default)]
struct ConfirmedReads {
    /// Whole searches, as the client saw them (an upper bound on the wait).
    searches: Vec<Duration>,
    failed: u64,
    /// Room types shown, and those that said `confirmed`.
    shown: u64,
    confirmed: u64,
    /// `vacancy_confirmed_read_wait_seconds` across the window.
    waits: TextHistogram,
    /// `vacancy_confirmed_read_fallbacks_total` across the window.
    fallbacks: f64,
}

/// Searches replica 2 every [`CONFIRMED_INTERVAL`] for `window`, and reads
/// its confirmed-read metrics before and after.
async fn confirmed_reads(
    owner: &Owner,
    window: Duration,
    replica: &Serve,
) -> Result<ConfirmedReads, BenchError> {
    let s = owner.shape;
    let client = vacancy_service::connect(owner.url(), CONNECT_TIMEOUT).await?;
    let cities = super::wait::cities(&client).await?;
    let http = HttpClient::new(replica.addr, HTTP_TIMEOUT).map_err(FleetBenchError::from)?;
    let metrics = || async {
        http.get("/metrics")
            .await
            .map(|r| r.text())
            .unwrap_or_default()
    };
    let before = metrics().await;
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let mut ticker = tokio::time::interval(CONFIRMED_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reads = ConfirmedReads::default();
    let started = Instant::now();
    while started.elapsed() < window && !cities.is_empty() {
        ticker.tick().await;
        let path = random_search(&mut rng, &cities, s, 1);
        let asked = Instant::now();
        match http.get(&path).await {
            Ok(r) if r.status == 200 => {
                reads.searches.push(asked.elapsed());
                let answer = r.json();
                for hotel in answer["results"].as_array().into_iter().flatten() {
                    for shown in hotel["room_types"].as_array().into_iter().flatten() {
                        reads.shown += 1;
                        reads.confirmed += u64::from(shown["source"] == "confirmed");
                    }
                }
            }
            _ => reads.failed += 1,
        }
    }
    let after = metrics().await;
    const WAIT: &str = "vacancy_confirmed_read_wait_seconds";
    const FALLBACKS: &str = "vacancy_confirmed_read_fallbacks_total";
    reads.waits = TextHistogram::parse(&after, WAIT).since(&TextHistogram::parse(&before, WAIT));
    reads.fallbacks = counter_sum(&after, FALLBACKS) - counter_sum(&before, FALLBACKS);
    Ok(reads)
}

fn print_confirmed(reads: &ConfirmedReads, o: &FleetOptions) {
    println!();
    println!(
        "method:   replica 2 runs with search.fresh_reads = confirmed and few_units_threshold = {CONFIRM_ALL}, so \
         every shown room type takes a confirmed read: the replica reads pg_current_wal_insert_lsn() (it writes \
         nothing) and waits until the stream brings its copy there; under the same pgbench -R {} holds, one \
         search of a random city and stay every {CONFIRMED_INTERVAL:?}; the wait is the replica's own \
         vacancy_confirmed_read_wait_seconds histogram across the window (so its p99 is a bucket bound), \
         the search figures the client's, HTTP included",
        o.rate
    );
    let searches = Latencies::from_durations(&reads.searches);
    let ms = |figure: Option<f64>| figure.unwrap_or(f64::NAN);
    println!(
        "| replica 2, confirmed reads | searches | failed | room types shown / confirmed | fallbacks to rows | wait p50 at most | wait p99 at most | search p50 | search p99 |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let bound = |q: f64| {
        reads
            .waits
            .quantile_bound(q)
            .map_or("past the last bucket".to_string(), |b| {
                format!("{:.1} ms", b * 1e3)
            })
    };
    println!(
        "| under {}/s holds | {} | {} | {} / {} | {} | {} | {} | {:.1} ms | {:.1} ms |",
        o.rate,
        searches.len(),
        reads.failed,
        reads.shown,
        reads.confirmed,
        reads.fallbacks,
        bound(0.50),
        bound(0.99),
        ms(searches.percentile(0.50)),
        ms(searches.percentile(0.99)),
    );
    println!(
        "confirmed: replica 2's confirmed-read wait p99 <= {} over {} waits (goal <= 50 ms); {} fallbacks to the owner's rows",
        bound(0.99),
        reads.waits.count,
        reads.fallbacks
    );
}

/// A Prometheus histogram as `/metrics` text shows it: each bucket's upper
/// bound and cumulative count, and the count. (Read by hand: four kinds of
/// line of one metric; a text-format parser crate would bring more than
/// it saves.)
#[derive(Debug, Default, Clone, PartialEq)]
struct TextHistogram {
    buckets: Vec<(f64, u64)>,
    count: u64,
}

impl TextHistogram {
    fn parse(metrics: &str, name: &str) -> TextHistogram {
        let bucket = format!("{name}_bucket{{le=\"");
        let count = format!("{name}_count ");
        let mut histogram = TextHistogram::default();
        for line in metrics.lines() {
            if let Some(rest) = line.strip_prefix(&bucket)
                && let Some((le, value)) = rest.split_once("\"} ")
                && let (Ok(le), Ok(value)) = (le.parse::<f64>(), value.trim().parse::<f64>())
            {
                histogram.buckets.push((le, value as u64));
            } else if let Some(value) = line.strip_prefix(&count) {
                histogram.count = value.trim().parse::<f64>().unwrap_or(0.0) as u64;
            }
        }
        histogram
    }

    /// What was observed after `earlier`.
    fn since(&self, earlier: &TextHistogram) -> TextHistogram {
        TextHistogram {
            buckets: self
                .buckets
                .iter()
                .enumerate()
                .map(|(i, (le, c))| {
                    let before = earlier.buckets.get(i).map_or(0, |(_, b)| *b);
                    (*le, c.saturating_sub(before))
                })
                .collect(),
            count: self.count.saturating_sub(earlier.count),
        }
    }

    /// The smallest finite bucket bound with at least `quantile` of the
    /// observations at or below it; `None` when there are none, or past
    /// the last finite bucket.
    fn quantile_bound(&self, quantile: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let wanted = (quantile * self.count as f64).ceil() as u64;
        self.buckets
            .iter()
            .find(|(le, c)| le.is_finite() && *c >= wanted)
            .map(|(le, _)| *le)
    }
}

/// The sum over every label set of a counter in `/metrics` text.
fn counter_sum(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum()
}

async fn probe(
    owner: &Owner,
    interval: Duration,
    window: Duration,
    projector: &Serve,
    replica: &Serve,
) -> Result<Samples, BenchError> {
    let s = owner.shape;
    let client = vacancy_service::connect(owner.url(), CONNECT_TIMEOUT).await?;
    let hold = client
        .prepare(
            "UPDATE inventory SET taken = taken + 1
             WHERE hotel_id = $1 AND room_type_id = $2 AND night = $3 AND taken < total
             RETURNING taken",
        )
        .await?;
    let projector_http =
        HttpClient::new(projector.addr, HTTP_TIMEOUT).map_err(FleetBenchError::from)?;
    let replica_http =
        HttpClient::new(replica.addr, HTTP_TIMEOUT).map_err(FleetBenchError::from)?;
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let mut ticker = tokio::time::interval(interval.max(Duration::from_millis(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut samples = Samples::default();
    let started = Instant::now();
    while started.elapsed() < window {
        ticker.tick().await;
        let mut held = None;
        for _ in 0..PROBE_TRIES {
            let hotel = rng.random_range(1..=s.hotels);
            let room_type = rng.random_range(1..=s.room_types);
            let night = s.first_night + chrono::Days::new(rng.random_range(0..s.nights) as u64);
            let sent = Instant::now();
            let row = client
                .query_opt(&hold, &[&hotel, &room_type, &night])
                .await?;
            let committed = Instant::now();
            samples.statement.push(committed - sent);
            if let Some(row) = row {
                held = Some((hotel, room_type, night, row.get::<_, i32>(0), committed));
                break;
            }
        }
        let Some((hotel, room_type, night, taken, committed)) = held else {
            samples.full += 1;
            continue;
        };
        let (on_projector, on_replica) = tokio::join!(
            visible_after(&projector_http, hotel, room_type, night, taken, committed),
            visible_after(&replica_http, hotel, room_type, night, taken, committed),
        );
        match on_projector {
            Some(d) => samples.projector.push(d),
            None => samples.projector_timeouts += 1,
        }
        match on_replica {
            Some(d) => samples.replica.push(d),
            None => samples.replica_timeouts += 1,
        }
    }
    Ok(samples)
}

/// How long after `committed` the copy at `http` showed the night's
/// `taken` at `taken` or above; `None` past [`VISIBLE_LIMIT`].
async fn visible_after(
    http: &HttpClient,
    hotel: i64,
    room_type: i64,
    night: NaiveDate,
    taken: i32,
    committed: Instant,
) -> Option<Duration> {
    let next = night + chrono::Days::new(1);
    let path = format!("/v1/hotels/{hotel}/calendar?from={night}&to={next}");
    loop {
        if let Ok(r) = http.get(&path).await
            && r.status == 200
            && night_taken(&r.json(), room_type, night).is_some_and(|t| t >= i64::from(taken))
        {
            return Some(committed.elapsed());
        }
        if committed.elapsed() > VISIBLE_LIMIT {
            return None;
        }
        tokio::time::sleep(VISIBLE_POLL).await;
    }
}

/// The `taken` of one room type's night in a calendar answer.
fn night_taken(calendar: &Value, room_type: i64, night: NaiveDate) -> Option<i64> {
    let night = night.to_string();
    calendar["room_types"]
        .as_array()?
        .iter()
        .find(|rt| rt["room_type_id"].as_i64() == Some(room_type))?["nights"]
        .as_array()?
        .iter()
        .find(|n| n["night"].as_str() == Some(night.as_str()))?["taken"]
        .as_i64()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_rss_is_read_from_proc_status() {
        let status = "Name:\tvacancy\nVmPeak:\t 2000 kB\nVmHWM:\t  123456 kB\nVmRSS:\t 100 kB\n";
        assert_eq!(parse_vm_hwm(status), Some(123_456));
        assert_eq!(parse_vm_hwm("Name:\tx\n"), None);
    }

    #[test]
    fn a_histogram_and_a_counter_are_read_from_the_metrics_text() {
        let before = "# HELP w x\nw_bucket{le=\"0.001\"} 1\nw_bucket{le=\"0.01\"} 2\nw_bucket{le=\"+Inf\"} 2\nw_count 2\nf_total{cause=\"a\"} 1\n";
        let after = "w_bucket{le=\"0.001\"} 51\nw_bucket{le=\"0.01\"} 150\nw_bucket{le=\"+Inf\"} 202\nw_count 202\nf_total{cause=\"a\"} 3\nf_total{cause=\"b\"} 4\nf_totals 100\n";
        let waits = TextHistogram::parse(after, "w").since(&TextHistogram::parse(before, "w"));
        assert_eq!(waits.count, 200);
        assert_eq!(
            waits.buckets,
            vec![(0.001, 50), (0.01, 148), (f64::INFINITY, 200)]
        );
        assert_eq!(waits.quantile_bound(0.25), Some(0.001));
        assert_eq!(waits.quantile_bound(0.5), Some(0.01));
        assert_eq!(
            waits.quantile_bound(0.99),
            None,
            "past the last finite bucket"
        );
        assert_eq!(TextHistogram::default().quantile_bound(0.5), None);
        assert_eq!(
            counter_sum(after, "f_total") - counter_sum(before, "f_total"),
            6.0
        );
    }

    #[test]
    fn uploads_are_read_from_the_metrics_text() {
        let text = "# HELP x\nvacancy_fleet_checkpoint_uploads_total{outcome=\"ok\"} 2\n\
                    vacancy_fleet_checkpoint_uploads_total{outcome=\"error\"} 1\n";
        assert_eq!(uploads_ok(text), 2);
        assert_eq!(uploads_ok(""), 0);
    }

    #[test]
    fn a_nights_taken_is_found_in_a_calendar_answer() {
        let calendar: Value = serde_json::json!({
            "room_types": [
                {"room_type_id": 1, "nights": [{"night": "2027-01-02", "taken": 3}]},
                {"room_type_id": 2, "nights": [{"night": "2027-01-02", "taken": 7}]}
            ]
        });
        let night = NaiveDate::from_ymd_opt(2027, 1, 2).expect("a date");
        assert_eq!(night_taken(&calendar, 2, night), Some(7));
        assert_eq!(night_taken(&calendar, 3, night), None);
    }
}

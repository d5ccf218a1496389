//! One scenario: start `vacancy serve`, run the workload, inject a fault,
//! heal it, wait for recovery, and compare the copy with the owner.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::NaiveDate;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::blackhole::Blackhole;
use crate::cluster::{Cluster, StopMode};
use crate::simulator::{self, SimOptions, SimSummary};
use vacancy_service::slot;

use super::child::Serve;
use super::compare::{Divergence, measure_divergence};
use super::load::{hotelier, search_loop};
use super::{
    BOOKING_TOKEN, CONNECT_TIMEOUT, FAIL_WRITES_SQL, Fault, FaultBenchError, HEAL_WRITES_SQL,
    HTTP_TIMEOUT, HUGE_HELD_BYTES, LoadCounts, Outcome, POLL, SLOT, SLOT_WAL_KEEP, ScenarioOptions,
};

/// Runs the workload, injects `fault`, heals it, and measures: see the module doc.
/// The child process, the slot and any fault setting are removed whatever happens.
pub async fn run_scenario(
    cluster: &mut Cluster,
    url: &str,
    fault: Fault,
    options: &ScenarioOptions,
) -> Result<Outcome, FaultBenchError> {
    let client = vacancy_service::connect(url, CONNECT_TIMEOUT).await?;
    slot::drop_slot(&client, SLOT).await?;
    drop(client);
    let name = format!("{fault:?}").to_lowercase();
    // A failover needs the owner's standby, and every connection of the
    // scenario (the child's, the workload's, the comparison's) names both.
    let mut standby = if fault.is_failover() {
        Some(tokio::task::block_in_place(|| cluster.start_standby(&[]))?)
    } else {
        None
    };
    let owner_url = match &standby {
        Some(s) => multi_host(url, cluster.port(), s.port()),
        None => url.to_string(),
    };
    // The child reaches the owner through a path this fault can make drop
    // every packet; the workload and the comparison reach it directly.
    let path = match fault {
        Fault::PacketsDropped => {
            Some(Blackhole::to(([127, 0, 0, 1], cluster.port()).into()).await?)
        }
        _ => None,
    };
    let child_url = path
        .as_ref()
        .map_or_else(|| owner_url.clone(), |p| p.url_for(url));
    // A huge transaction: the child holds at most HUGE_HELD_BYTES in
    // memory and spills the rest to a folder of its own, which is checked
    // for files left at the end.
    let spill_dir = options.work_dir.join(format!("spill-{name}"));
    let env = if fault == Fault::HugeTransaction {
        std::fs::create_dir_all(&spill_dir)?;
        vec![
            (
                "VACANCY_STREAM__MAX_HELD_BYTES".to_string(),
                HUGE_HELD_BYTES.to_string(),
            ),
            (
                "VACANCY_STREAM__SPILL_DIR".to_string(),
                spill_dir.display().to_string(),
            ),
        ]
    } else {
        Vec::new()
    };
    let mut serve = Serve::start_with_env(&options.exe, &child_url, &options.work_dir, &name, env)?;
    let mut result = scenario(
        cluster,
        &owner_url,
        fault,
        options,
        &mut serve,
        path.as_ref(),
        standby.as_mut(),
    )
    .await;
    if fault == Fault::HugeTransaction
        && let Ok(outcome) = result.as_mut()
    {
        outcome.spilled = Some(serve.spilled(&spill_dir).await);
    }
    serve.stop().await;
    let cleaned = clean_up(&owner_url, fault).await;
    // The promoted standby is the owner of every later scenario; the old
    // primary, stopped, is removed with the value it leaves.
    if let Some(promoted) = standby.as_mut()
        && is_primary(promoted).await
    {
        std::mem::swap(cluster, promoted);
    }
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
    path: Option<&Blackhole>,
    standby: Option<&mut Cluster>,
) -> Result<Outcome, FaultBenchError> {
    let client = vacancy_service::connect(url, CONNECT_TIMEOUT).await?;
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
    let measured = inject_and_recover(cluster, url, fault, options, serve, path, standby).await;
    let (recover_secs, detect_secs, mut problem) = match measured {
        Ok(Measured {
            recover_secs: Some(secs),
            detect_secs,
        }) => {
            tokio::time::sleep(options.after).await;
            (Some(secs), detect_secs, None)
        }
        Ok(Measured {
            recover_secs: None,
            detect_secs,
        }) => (
            None,
            detect_secs,
            Some(format!(
                "not recovered within {:?}; last status: {}",
                options.recover_limit,
                serve.status_line().await
            )),
        ),
        Err(e) => (None, None, Some(e.to_string())),
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
        detect_secs,
        divergence,
        searches,
        takes,
        hotelier_ok: hotelier_counts.0.load(Ordering::Relaxed),
        hotelier_failed: hotelier_counts.1.load(Ordering::Relaxed),
        snapshots,
        problem,
        spilled: None,
    })
}

/// One owner transaction over every inventory row, as a revenue job's
/// repricing. The workload's guests and hotelier write beside it, so it may
/// meet one of them in a deadlock, which PostgreSQL breaks by aborting one
/// side: then it is made again, a few times at most.
async fn reprice_every_row(client: &Client) -> Result<(), FaultBenchError> {
    const TRIES: u32 = 5;
    let mut tries = 0;
    loop {
        tries += 1;
        match client
            .execute(
                "UPDATE inventory SET price_cents = coalesce(price_cents, 0) + 1",
                &[],
            )
            .await
        {
            Ok(_) => return Ok(()),
            Err(e)
                if tries < TRIES
                    && e.code().is_some_and(|c| {
                        *c == tokio_postgres::error::SqlState::T_R_DEADLOCK_DETECTED
                            || *c == tokio_postgres::error::SqlState::T_R_SERIALIZATION_FAILURE
                    }) => {}
            Err(e) => return Err(e.into()),
        }
    }
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

/// What `inject_and_recover` timed.
struct Measured {
    /// From the heal until the copy applied a marker committed after it;
    /// `None` when that did not happen within the limit.
    recover_secs: Option<f64>,
    /// Packets dropped: from the first dropped packet until the node gave
    /// the replication connection up; `None` when it did not while dropping.
    detect_secs: Option<f64>,
}

/// Injects the fault, heals it, and waits for recovery.
async fn inject_and_recover(
    cluster: &mut Cluster,
    url: &str,
    fault: Fault,
    options: &ScenarioOptions,
    serve: &mut Serve,
    path: Option<&Blackhole>,
    standby: Option<&mut Cluster>,
) -> Result<Measured, FaultBenchError> {
    let mut detect_secs = None;
    // A failover: when the primary stopped, and the owner changes the node
    // has seen before it (none, for a fresh child).
    let mut failed_over: Option<(Instant, u64)> = None;
    let client = vacancy_service::connect(url, CONNECT_TIMEOUT).await?;
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
        Fault::PacketsDropped => {
            if let Some(path) = path {
                path.drop_packets();
                let dropped = Instant::now();
                while dropped.elapsed() < options.unreachable {
                    if serve
                        .status()
                        .await
                        .is_some_and(|s| s["connected"] == false)
                    {
                        detect_secs = Some(dropped.elapsed().as_secs_f64());
                        break;
                    }
                    tokio::time::sleep(POLL).await;
                }
                tokio::time::sleep(options.unreachable.saturating_sub(dropped.elapsed())).await;
                path.heal();
            }
        }
        Fault::HugeTransaction => {
            reprice_every_row(&client).await?;
        }
        Fault::OwnerFailover | Fault::OwnerFailoverLagging => {
            let Some(standby) = standby else {
                return Err(FaultBenchError::Timeout {
                    what: "a standby to promote".into(),
                    limit: Duration::ZERO,
                    detail: " (none was started)".into(),
                });
            };
            let changes_before = owner_changes(serve).await.unwrap_or(0);
            if fault == Fault::OwnerFailoverLagging {
                // The standby gets nothing more; the primary goes on taking
                // the workload's writes and the copy applies them.
                tokio::task::block_in_place(|| standby.stop(StopMode::Fast))?;
                tokio::time::sleep(options.warm_up).await;
                let ahead = slot::current_wal_lsn(&client).await?;
                serve
                    .caught_up(ahead, options.recover_limit, "the writes the standby lacks")
                    .await?;
            } else {
                let end = slot::current_wal_lsn(&client).await?;
                replayed(&standby.url("faults"), end).await?;
            }
            drop(client);
            let stopped = Instant::now();
            tokio::task::block_in_place(|| cluster.stop(StopMode::Fast))?;
            if fault == Fault::OwnerFailoverLagging {
                tokio::task::block_in_place(|| standby.start_again())?;
            }
            tokio::task::block_in_place(|| standby.promote(Duration::from_secs(60)))?;
            failed_over = Some((stopped, changes_before));
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
    let mut recover_secs = None;
    while Instant::now() < deadline {
        let on_new_owner = match failed_over {
            None => true,
            Some((stopped, changes_before)) => {
                let status = serve.status().await;
                let owner = status.as_ref().map(|s| &s["owner"]);
                let changed = owner
                    .and_then(|o| o["sessions"]["changes"].as_u64())
                    .is_some_and(|n| n > changes_before);
                if changed && detect_secs.is_none() {
                    detect_secs = Some(stopped.elapsed().as_secs_f64());
                }
                // The copy is of the timeline the sessions reached: the
                // marker's LSN compares with its position only then.
                changed
                    && owner.is_some_and(|o| {
                        o["copy_timeline"].as_u64().is_some()
                            && o["copy_timeline"] == o["sessions"]["current"]["timeline"]
                    })
            }
        };
        if on_new_owner && serve.recovered_past(marker).await {
            recover_secs = Some(healed.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    Ok(Measured {
        recover_secs,
        detect_secs,
    })
}

/// `url` with a second host, the standby's, and `target_session_attrs=read-write`:
/// whichever of the two is the primary.
fn multi_host(url: &str, primary_port: u16, standby_port: u16) -> String {
    let both = url.replacen(
        &format!("127.0.0.1:{primary_port}"),
        &format!("127.0.0.1:{primary_port},127.0.0.1:{standby_port}"),
        1,
    );
    let separator = if both.contains('?') { '&' } else { '?' };
    format!("{both}{separator}target_session_attrs=read-write")
}

/// The owner changes the node has seen (`/v1/status` `owner`).
async fn owner_changes(serve: &Serve) -> Option<u64> {
    serve.status().await?["owner"]["sessions"]["changes"].as_u64()
}

/// Whether `cluster` runs as a primary (a standby promoted, or never one).
async fn is_primary(cluster: &Cluster) -> bool {
    let Ok(client) = vacancy_service::connect(&cluster.url("faults"), CONNECT_TIMEOUT).await else {
        return false;
    };
    client
        .query_one("SELECT NOT pg_is_in_recovery()", &[])
        .await
        .is_ok_and(|row| row.get::<_, bool>(0))
}

/// Waits (bounded) until the standby at `url` has replayed `target`.
async fn replayed(url: &str, target: vacancy_service::Lsn) -> Result<(), FaultBenchError> {
    let limit = Duration::from_secs(30);
    let client = vacancy_service::connect(url, CONNECT_TIMEOUT).await?;
    let started = Instant::now();
    loop {
        let row = client
            .query_one("SELECT pg_last_wal_replay_lsn()", &[])
            .await?;
        let at: Option<tokio_postgres::types::PgLsn> = row.get(0);
        if at.is_some_and(|a| vacancy_service::Lsn::from(a) >= target) {
            return Ok(());
        }
        if started.elapsed() > limit {
            return Err(FaultBenchError::Timeout {
                what: format!("the standby to replay {target}"),
                limit,
                detail: String::new(),
            });
        }
        tokio::time::sleep(POLL).await;
    }
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
        match vacancy_service::connect(url, CONNECT_TIMEOUT).await {
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

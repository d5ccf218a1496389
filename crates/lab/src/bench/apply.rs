//! `vacancy bench apply`: decode + apply throughput of a WAL backlog,
//! beside pg_recvlogical draining the same backlog to /dev/null.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use vacancy_service::metrics;
use vacancy_service::slot;
use vacancy_service::{Checkpoints, Lsn, Projector, ReadModel, Refresh, Settings, StreamStatus};

use super::{
    BenchError, CONNECT_TIMEOUT, LOAD_LIMIT, Owner, POLL, PUBLICATION, RECV_SLOT, VACANCY_SLOT,
    bench_settings, flush_lsn, mib, print_header, rate, restart_lsn, run_tool,
};
use crate::readiness::{NotReady, wait_until};

pub(super) struct ApplyOptions {
    pub(super) bulk_rows: u64,
    pub(super) bulk_transactions: u64,
    pub(super) single_transactions: u64,
    pub(super) clients: u32,
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
pub(super) async fn run(owner: &Owner, options: &ApplyOptions) -> Result<(), BenchError> {
    let client = vacancy_service::connect(owner.url(), CONNECT_TIMEOUT).await?;
    print_header("apply", owner, &client).await?;
    slot::drop_slot(&client, VACANCY_SLOT).await?;
    slot::drop_slot(&client, RECV_SLOT).await?;
    metrics::init();
    let mut vacancy = Vacancy::new(bench_settings(owner.url()));
    let started = Instant::now();
    vacancy.start()?;
    vacancy
        .wait("the initial snapshot", |model| model.freshness.is_loaded())
        .await?;
    eprintln!("snapshot loaded in {:.1}s", started.elapsed().as_secs_f64());

    let pgoutput = PgoutputOptions::of(&vacancy.settings);
    let mut results = Vec::new();
    for shape in [Shape::Bulk, Shape::Limits, Shape::SingleRow] {
        // Moves vacancy's restart_lsn up to now (a checkpoint logs the running
        // transactions, and the projector acknowledges past them), so its
        // backlog starts where the baseline's new slot starts.
        client.batch_execute("CHECKPOINT").await?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        vacancy.stop().await?;

        client
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&RECV_SLOT],
            )
            .await?;
        let before = flush_lsn(&client).await?;
        let workload = run_workload(shape, owner, &client, options).await?;
        let target = flush_lsn(&client).await?;
        let recv_backlog = restart_lsn(&client, RECV_SLOT)
            .await?
            .map_or(0, |r| r.bytes_until(target));
        let vacancy_backlog = restart_lsn(&client, VACANCY_SLOT)
            .await?
            .map_or(0, |r| r.bytes_until(target));

        eprintln!("draining with pg_recvlogical to {target}");
        let recv = drain_with_recvlogical(owner, &pgoutput, target).await?;
        slot::drop_slot(&client, RECV_SLOT).await?;

        eprintln!("draining with vacancy to {target}");
        let vacancy_started = Instant::now();
        vacancy.start()?;
        vacancy
            .wait("vacancy catching up", |model| {
                model.freshness.applied() >= target
            })
            .await?;
        let vacancy_time = vacancy_started.elapsed();
        if vacancy.status.snapshot.loads.load(Ordering::Relaxed) > 1 {
            eprintln!("warning: vacancy took a new snapshot instead of resuming");
        }
        results.push(ApplyRow {
            shape: workload.label,
            rows: workload.rows,
            transactions: workload.transactions,
            workload: workload.elapsed,
            wal_bytes: before.bytes_until(target),
            recv_backlog,
            vacancy_backlog,
            recv,
            vacancy: vacancy_time,
        });
    }
    vacancy.stop().await?;
    print_table(&pgoutput, &results);
    Ok(())
}

/// How long the projector may take to stop once told to.
const STOP_LIMIT: Duration = Duration::from_secs(30);

/// vacancy's stream alone (no API): a projector stopped for each workload
/// and started again on the same model, status and refresh state, as one
/// long-lived projector would keep them.
struct Vacancy {
    settings: Arc<Settings>,
    model: Arc<ReadModel>,
    status: Arc<StreamStatus>,
    refresh: Arc<Refresh>,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Vacancy {
    fn new(settings: Settings) -> Vacancy {
        let refresh = Refresh::new(Duration::from_secs(settings.model.ttl_secs));
        Vacancy {
            settings: Arc::new(settings),
            model: ReadModel::new(),
            status: Arc::new(StreamStatus::default()),
            refresh,
            shutdown: CancellationToken::new(),
            task: None,
        }
    }

    fn start(&mut self) -> Result<(), BenchError> {
        let projector = Projector::new(
            self.settings.owner.clone(),
            self.settings.stream.clone(),
            self.model.clone(),
            self.status.clone(),
            self.refresh.clone(),
            vacancy_service::HotelIndex::new()?,
            // Checkpoints as the settings say (off by default): the bench
            // measures apply, and a cap would only hold the slot back.
            Checkpoints::new(self.settings.checkpoint.clone()),
        );
        self.shutdown = CancellationToken::new();
        self.task = Some(tokio::spawn(projector.run(self.shutdown.clone())));
        Ok(())
    }

    /// A projector still running after `STOP_LIMIT` would hold the slot the
    /// next drain resumes, so it fails the bench rather than skew a figure.
    async fn stop(&mut self) -> Result<(), BenchError> {
        self.shutdown.cancel();
        let Some(task) = self.task.take() else {
            return Ok(());
        };
        // A projector that panicked has stopped all the same.
        match tokio::time::timeout(STOP_LIMIT, task).await {
            Ok(_) => Ok(()),
            Err(_) => Err(NotReady {
                what: "vacancy's projector to stop",
                limit: STOP_LIMIT,
                last_error: self
                    .status
                    .last_error()
                    .unwrap_or_else(|| "none".to_string()),
            }
            .into()),
        }
    }

    async fn wait(
        &self,
        what: &'static str,
        done: impl Fn(&ReadModel) -> bool,
    ) -> Result<(), BenchError> {
        wait_until(what, LOAD_LIMIT, POLL, &self.status, || done(&self.model)).await?;
        Ok(())
    }
}

/// The pgoutput options vacancy asks for, so the baseline decodes the same stream.
struct PgoutputOptions {
    proto_version: &'static str,
    streaming: &'static str,
}

impl PgoutputOptions {
    fn of(settings: &Settings) -> PgoutputOptions {
        if settings.stream.stream_in_progress {
            PgoutputOptions {
                proto_version: "2",
                streaming: "on",
            }
        } else {
            PgoutputOptions {
                proto_version: "1",
                streaming: "off",
            }
        }
    }
}

/// The shapes of workload: few big transactions, the same of sell limits
/// (a night gaining or losing its limit changes the length of its hotel's
/// side list, `model::calendars`), many one-row ones.
#[derive(Debug, Clone, Copy)]
enum Shape {
    Bulk,
    Limits,
    SingleRow,
}

/// One workload as run: what it was, the rows it changed, in how many
/// transactions, and how long writing it took.
struct WorkloadRun {
    label: String,
    rows: u64,
    transactions: u64,
    elapsed: Duration,
}

async fn run_workload(
    shape: Shape,
    owner: &Owner,
    client: &Client,
    options: &ApplyOptions,
) -> Result<WorkloadRun, BenchError> {
    let started = Instant::now();
    match shape {
        Shape::Bulk => {
            eprintln!(
                "workload: {} updates in {} transactions",
                options.bulk_rows, options.bulk_transactions
            );
            let rows = bulk_workload(client, options, BULK_PRICE).await?;
            Ok(WorkloadRun {
                label: format!(
                    "{} updates in {} transactions",
                    options.bulk_rows, options.bulk_transactions
                ),
                rows,
                transactions: options.bulk_transactions,
                elapsed: started.elapsed(),
            })
        }
        Shape::Limits => {
            eprintln!(
                "workload: {} sell limits set or cleared in {} transactions",
                options.bulk_rows, options.bulk_transactions
            );
            let rows = bulk_workload(client, options, BULK_LIMIT).await?;
            Ok(WorkloadRun {
                label: format!(
                    "{} sell limits set or cleared in {} transactions",
                    options.bulk_rows, options.bulk_transactions
                ),
                rows,
                transactions: options.bulk_transactions,
                elapsed: started.elapsed(),
            })
        }
        Shape::SingleRow => {
            eprintln!(
                "workload: {} one-row transactions",
                options.single_transactions
            );
            let rows = single_row_workload(owner, options).await?;
            Ok(WorkloadRun {
                label: format!(
                    "{} one-row transactions (pgbench -c {})",
                    options.single_transactions, options.clients
                ),
                rows,
                transactions: rows,
                elapsed: started.elapsed(),
            })
        }
    }
}

/// pg_recvlogical reading the baseline's slot up to `target`, to /dev/null;
/// how long it took.
async fn drain_with_recvlogical(
    owner: &Owner,
    pgoutput: &PgoutputOptions,
    target: Lsn,
) -> Result<Duration, BenchError> {
    let mut recv = owner.tool("pg_recvlogical");
    recv.arg("-d")
        .arg(owner.url())
        .args(["--slot", RECV_SLOT, "--start", "--no-loop", "-F", "0"])
        .args(["-o", &format!("proto_version={}", pgoutput.proto_version)])
        .args(["-o", &format!("streaming={}", pgoutput.streaming)])
        .args(["-o", "messages=true"])
        .args(["-o", &format!("publication_names={PUBLICATION}")])
        .args(["-f", "/dev/null"])
        .arg(format!("--endpos={target}"));
    let started = Instant::now();
    run_tool(recv, "pg_recvlogical").await?;
    Ok(started.elapsed())
}

fn print_table(pgoutput: &PgoutputOptions, results: &[ApplyRow]) {
    println!(
        "method:   both consumers stopped during the workload; each then drains the same backlog alone \
         (pg_recvlogical first, then vacancy resuming its slot), timed from its start until it has \
         everything up to the WAL flush position read after the last commit"
    );
    println!(
        "baseline: pg_recvlogical, pgoutput proto_version={} streaming={} messages=true \
         (the options vacancy asks for), -F 0, to /dev/null",
        pgoutput.proto_version, pgoutput.streaming
    );
    println!();
    println!(
        "| shape | row changes | txns | WAL | workload | pg_recvlogical | rows/s | vacancy | rows/s | ratio (goal >= 0.9) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in results {
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
    for r in results {
        println!(
            "backlog read from each slot's restart_lsn ({}): pg_recvlogical {:.0} MiB, vacancy {:.0} MiB",
            r.shape,
            mib(r.recv_backlog),
            mib(r.vacancy_backlog)
        );
    }
}

/// The bulk shape's change of a row: its price.
const BULK_PRICE: &str = "price_cents = coalesce(i.price_cents, 0) + 1";
/// The limits shape's: a limit set where there is none, cleared where
/// there is one (kept where it is what allows `taken` past `total`), so
/// each run of the bench changes the side lists the other way.
const BULK_LIMIT: &str =
    "sell_limit = CASE WHEN i.sell_limit IS NULL THEN greatest(i.total, i.taken)
                              WHEN i.taken <= i.total THEN NULL ELSE i.sell_limit END";

/// Sets `set` on `bulk_rows` inventory rows (in primary-key order: room
/// type by room type within a hotel, as an owner's bulk UPDATE sends them)
/// in `bulk_transactions` transactions; returns the rows changed.
async fn bulk_workload(
    client: &Client,
    options: &ApplyOptions,
    set: &str,
) -> Result<u64, BenchError> {
    let per = (options.bulk_rows / options.bulk_transactions) as i64;
    let update = format!(
        "UPDATE inventory i SET {set}
         FROM (SELECT hotel_id, room_type_id, night FROM inventory
               ORDER BY hotel_id, room_type_id, night OFFSET $1 LIMIT $2) s
         WHERE i.hotel_id = s.hotel_id AND i.room_type_id = s.room_type_id
           AND i.night = s.night"
    );
    let mut rows = 0;
    for k in 0..options.bulk_transactions as i64 {
        rows += client.execute(&update, &[&(k * per), &per]).await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pgbench_processed_reads_the_count() {
        let out = "number of clients: 4\nnumber of transactions actually processed: 99996/100000\n";
        assert_eq!(pgbench_processed(out), Some(99996));
    }
}

//! `vacancy bench memory`: resident bytes per inventory row once the copy
//! is loaded, beside the packed payload; with `--update-nights`, the peak
//! while one owner transaction over every hotel is held (spilled to disk
//! past `stream.max_held_bytes`) and applied, and how long after its commit
//! the copy had it.

use std::fmt::Write as _;
use std::time::Duration;

use tokio::net::TcpListener;

use vacancy_service::{metrics, slot};

use super::{
    BenchError, CONNECT_TIMEOUT, LOAD_LIMIT, Owner, POLL, VACANCY_SLOT, bench_settings, mib,
    print_header, reprice_every_hotel, wait_caught_up,
};
use crate::readiness::wait_until;

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

/// The held transactions' bound and spill dir the copy runs with.
pub(super) struct Held {
    pub(super) max_bytes: Option<u64>,
    pub(super) spill_dir: Option<String>,
}

pub(super) async fn run(owner: &Owner, update_nights: u32, held: &Held) -> Result<(), BenchError> {
    let client = vacancy_service::connect(owner.url(), CONNECT_TIMEOUT).await?;
    print_header("memory", owner, &client).await?;
    slot::drop_slot(&client, VACANCY_SLOT).await?;

    let mut settings = bench_settings(owner.url());
    if let Some(max) = held.max_bytes {
        settings.stream.max_held_bytes = max;
    }
    if let Some(dir) = &held.spill_dir {
        settings.stream.spill_dir.clone_from(dir);
    }
    let max_held = settings.stream.max_held_bytes;
    let spill_dir = settings.stream.spill_dir();
    metrics::init();
    let before = proc_status_bytes("VmRSS");
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let app = vacancy_service::start(settings, listener)?;
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
    if rows == 0 {
        app.stop(Duration::from_secs(10)).await;
        return Err(BenchError::NoData);
    }
    let repriced = if update_nights > 0 {
        Some(peak_while_repricing(owner, &client, &app, update_nights, &spill_dir).await?)
    } else {
        None
    };
    app.stop(Duration::from_secs(10)).await;
    let loaded = after.saturating_sub(before);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "method:   VmRSS of this process before starting vacancy and 2 s after the snapshot is \
         swapped in (same process, mimalloc, no transparent huge pages); payload = \
         Tables::inventory_bytes()"
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
    if let Some(peak) = repriced {
        let copy = after.saturating_sub(before);
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "a transaction over every hotel: {}, {} rows; applied {:.1} s after its commit",
            peak.sql,
            peak.rows,
            peak.applied_after.as_secs_f64()
        );
        let _ = writeln!(out, "| | bytes | × the loaded copy |");
        let _ = writeln!(out, "|---|---:|---:|");
        let _ = writeln!(
            out,
            "| peak RSS growth while it was received and applied (VmHWM - before) | {} ({:.0} MiB) | {:.2} |",
            peak.peak.saturating_sub(before),
            mib(peak.peak.saturating_sub(before)),
            peak.peak.saturating_sub(before) as f64 / copy.max(1) as f64
        );
        // Held in memory: at most the bound (plus a spilling transaction's
        // write buffers), however many rows the transaction changed.
        let held_bound =
            max_held.min(HELD_CHANGE_BYTES * peak.rows) + vacancy_service::SPILLING_BYTES as u64;
        let bound = 2 * copy + held_bound;
        let _ = writeln!(
            out,
            "| bound: 2 × the copy + what is held in memory (stream.max_held_bytes {} + the spill buffers) | {} ({:.0} MiB) | {:.2} |",
            max_held,
            bound,
            mib(bound),
            bound as f64 / copy.max(1) as f64
        );
        let unbounded = 2 * copy + HELD_CHANGE_BYTES * peak.rows;
        let _ = writeln!(
            out,
            "| without the bound: 2 × the copy + {HELD_CHANGE_BYTES} B per changed row | {} ({:.0} MiB) | {:.2} |",
            unbounded,
            mib(unbounded),
            unbounded as f64 / copy.max(1) as f64
        );
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "spilled: {} transaction(s), {} bytes ({:.0} MiB, {:.1} B per changed row) to {}; the file removed {:.1} s after the commit (left: {})",
            peak.spilled_transactions,
            peak.spilled_bytes,
            mib(peak.spilled_bytes),
            peak.spilled_bytes as f64 / peak.rows.max(1) as f64,
            spill_dir.display(),
            peak.files_gone_after.as_secs_f64(),
            peak.files_left
        );
        let _ = writeln!(
            out,
            "owner: the UPDATE ran and committed in {:.1} s; load average after the apply: {}",
            peak.committed_in.as_secs_f64(),
            std::fs::read_to_string("/proc/loadavg")
                .unwrap_or_default()
                .split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    print!("{out}");
    Ok(())
}

/// The peak while one owner transaction repriced every hotel.
struct Repriced {
    sql: String,
    rows: u64,
    peak: u64,
    applied_after: Duration,
    /// From the commit until the spill file was gone (or the limit).
    files_gone_after: Duration,
    committed_in: Duration,
    spilled_transactions: u64,
    spilled_bytes: u64,
    /// This process's spill files in the spill dir once applied (0 expected).
    files_left: usize,
}

/// How long the bench waits for the spill file to go after the apply.
const FILES_GONE_LIMIT: Duration = Duration::from_secs(300);

/// What one held change is counted at (`vacancy_service::HELD_CHANGE_BYTES`).
const HELD_CHANGE_BYTES: u64 = vacancy_service::HELD_CHANGE_BYTES as u64;

/// Reprices the first `nights` nights of every hotel in one transaction and
/// returns the process's peak RSS from before it until the copy applied it.
async fn peak_while_repricing(
    owner: &Owner,
    client: &tokio_postgres::Client,
    app: &vacancy_service::App,
    nights: u32,
    spill_dir: &std::path::Path,
) -> Result<Repriced, BenchError> {
    let spilled_transactions = metrics::HELD_SPILLED_TRANSACTIONS.get();
    let spilled_bytes = metrics::HELD_SPILLED_BYTES.get();
    // Writing 5 resets VmHWM to the current RSS (proc(5), clear_refs).
    std::fs::write("/proc/self/clear_refs", "5")?;
    let repricing = reprice_every_hotel(owner, client, i64::from(nights)).await?;
    wait_caught_up(app, client).await?;
    let applied_after = repricing.committed_at.elapsed();
    // Superseded blocks are freed by the next swap or when readers let go.
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The file goes once every walk after the apply is done (the refresher
    // reads the transaction again) and the transaction is dropped.
    let ours = format!("vacancy-spill-{}-", std::process::id());
    let files = || {
        std::fs::read_dir(spill_dir).map_or(0, |entries| {
            entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(&ours))
                .count()
        })
    };
    let waiting = std::time::Instant::now();
    while files() > 0 && waiting.elapsed() < FILES_GONE_LIMIT {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let files_left = files();
    let files_gone_after = repricing.committed_at.elapsed();
    Ok(Repriced {
        sql: repricing.sql,
        rows: repricing.rows,
        peak: proc_status_bytes("VmHWM"),
        applied_after,
        files_gone_after,
        committed_in: repricing.committed_in,
        spilled_transactions: metrics::HELD_SPILLED_TRANSACTIONS.get() - spilled_transactions,
        spilled_bytes: metrics::HELD_SPILLED_BYTES.get() - spilled_bytes,
        files_left,
    })
}

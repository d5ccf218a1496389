//! `vacancy demo`: the whole job on one machine with no setup.
//!
//! It starts an embedded owner (a throwaway PostgreSQL cluster from the
//! machine's server binaries, removed on exit), loads a generated dataset,
//! starts the projector and the API, and runs a stream of guests against the
//! owner with its real operations (hold, pay or walk away, the sweeper,
//! capacity changes), printing how closely the copy follows. At the end it
//! checks that the copy equals the owner, row for row.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::Utc;
use pg_walstream::CancellationToken;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::app::{self, App};
use crate::config::Settings;
use crate::model::ReadModel;
use crate::owner::cluster::{Cluster, ClusterError, ClusterOptions};
use crate::owner::ops::{self, HoldOutcome, HoldRequest};
use crate::owner::seed::{self, SeedError, SeedOptions};
use crate::owner::{self, OwnerError};
use crate::stream::slot;

#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Attach to this owner instead of starting an embedded one.
    pub owner_url: Option<String>,
    pub pg_bin: Option<std::path::PathBuf>,
    pub listen: String,
    pub hotels: u32,
    pub room_types: u32,
    pub nights: u32,
    pub guests: usize,
    pub hold_secs: u64,
    /// Stop on its own after this long; `None` runs until Ctrl-C.
    pub duration: Option<Duration>,
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error(transparent)]
    Seed(#[from] SeedError),
    #[error(transparent)]
    Owner(#[from] OwnerError),
    #[error(transparent)]
    App(#[from] app::AppError),
    #[error(transparent)]
    Slot(#[from] slot::SlotError),
    #[error("the copy did not reach the owner's position within {0:?}")]
    NotCaughtUp(Duration),
    #[error("the copy differs from the owner in {0} inventory rows")]
    Diverged(u64),
}

/// What the demo did, printed at the end.
#[derive(Debug, Default)]
pub struct Counters {
    pub holds: AtomicU64,
    pub full: AtomicU64,
    pub confirmed: AtomicU64,
    pub walked_away: AtomicU64,
    pub swept: AtomicU64,
    pub capacity_changes: AtomicU64,
}

pub async fn run(options: DemoOptions, stop: CancellationToken) -> Result<(), DemoError> {
    let mut cluster_options = ClusterOptions::default();
    if let Some(bin) = &options.pg_bin {
        cluster_options.bin_dir = bin.clone();
    }
    // Kept alive until the end of this function: dropping it removes the cluster.
    let (_cluster, owner_url) = match &options.owner_url {
        Some(url) => (None, url.clone()),
        None => {
            eprintln!(
                "starting an embedded PostgreSQL from {}",
                cluster_options.bin_dir.display()
            );
            let cluster = tokio::task::spawn_blocking(move || Cluster::start(cluster_options))
                .await
                .map_err(|e| ClusterError::Io(std::io::Error::other(e)))??;
            let url = cluster.create_database("owner")?;
            let client = owner::connect(&url, Duration::from_secs(10)).await?;
            owner::apply_schema(&client).await?;
            (Some(cluster), url)
        }
    };
    let start = Utc::now().date_naive();
    let report = seed::run(&SeedOptions {
        owner_url: owner_url.clone(),
        hotels: options.hotels,
        room_types: options.room_types,
        nights: options.nights,
        start,
        seed: 1,
        progress: true,
    })
    .await?;
    eprintln!(
        "loaded {} hotels, {} inventory rows in {:.1}s",
        report.hotels,
        report.inventory_rows,
        report.elapsed.as_secs_f64()
    );

    let mut settings = Settings::defaults();
    settings.owner.url = owner_url.clone();
    settings.http.listen = options.listen.clone();
    let app = App::bind_and_start(settings).await?;
    println!(
        "vacancy is serving on http://{}  (try /v1/status, /metrics, /v1/hotels/1/calendar?from={start}&to={})",
        app.addr,
        start + chrono::Days::new(7)
    );

    let counters = Arc::new(Counters::default());
    let work = CancellationToken::new();
    let mut tasks = Vec::new();
    for guest in 0..options.guests {
        tasks.push(tokio::spawn(guest_loop(
            owner_url.clone(),
            guest,
            options.clone(),
            start,
            counters.clone(),
            work.clone(),
        )));
    }
    tasks.push(tokio::spawn(sweeper(
        owner_url.clone(),
        counters.clone(),
        work.clone(),
    )));

    let started = Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_secs(5));
    ticker.tick().await;
    let mut last_holds = 0;
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep_until(deadline(started, options.duration)) => break,
            _ = ticker.tick() => {
                let holds = counters.holds.load(Ordering::Relaxed);
                let f = &app.model.freshness;
                println!(
                    "takes/s {:>6.1}  full {:>5}  confirmed {:>5}  expired {:>5}  applied {}  lag {} ms",
                    (holds - last_holds) as f64 / 5.0,
                    counters.full.load(Ordering::Relaxed),
                    counters.confirmed.load(Ordering::Relaxed),
                    counters.swept.load(Ordering::Relaxed),
                    f.applied(),
                    f.lag_ms(Utc::now()),
                );
                last_holds = holds;
            }
        }
    }
    work.cancel();
    for task in tasks {
        let _ = task.await;
    }
    let client = owner::connect(&owner_url, Duration::from_secs(10)).await?;
    let diverged = verify(&app.model, &client).await?;
    println!(
        "done: {} holds, {} full, {} confirmed, {} walked away, {} expired by the sweeper, {} capacity changes; copy differs from owner in {diverged} rows",
        counters.holds.load(Ordering::Relaxed),
        counters.full.load(Ordering::Relaxed),
        counters.confirmed.load(Ordering::Relaxed),
        counters.walked_away.load(Ordering::Relaxed),
        counters.swept.load(Ordering::Relaxed),
        counters.capacity_changes.load(Ordering::Relaxed),
    );
    app.stop(Duration::from_secs(10)).await;
    if diverged > 0 {
        return Err(DemoError::Diverged(diverged));
    }
    Ok(())
}

fn deadline(started: Instant, duration: Option<Duration>) -> tokio::time::Instant {
    let d = duration.unwrap_or(Duration::from_secs(60 * 60 * 24 * 365));
    tokio::time::Instant::from_std(started + d)
}

/// One guest after another: hold a room for a short stay, then pay or walk away.
async fn guest_loop(
    url: String,
    guest: usize,
    options: DemoOptions,
    start: chrono::NaiveDate,
    counters: Arc<Counters>,
    stop: CancellationToken,
) {
    let Ok(mut client) = owner::connect(&url, Duration::from_secs(10)).await else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(guest as u64);
    let mut n = 0u64;
    while !stop.is_cancelled() {
        n += 1;
        let check_in = start
            + chrono::Days::new(
                rng.random_range(0..u64::from(options.nights.saturating_sub(8).max(1))),
            );
        let req = HoldRequest {
            booking_id: format!("demo-{guest}-{n}"),
            hotel_id: i64::from(rng.random_range(1..=options.hotels)),
            room_type_id: i64::from(rng.random_range(1..=options.room_types)),
            check_in,
            check_out: check_in + chrono::Days::new(rng.random_range(1..=4)),
            rooms: 1,
            hold_for: Duration::from_secs(options.hold_secs),
        };
        match ops::hold(&mut client, &req).await {
            Ok(HoldOutcome::Held) => {
                counters.holds.fetch_add(1, Ordering::Relaxed);
                if rng.random_range(0..100) < 60 {
                    if ops::confirm(&client, &req.booking_id).await.is_ok() {
                        counters.confirmed.fetch_add(1, Ordering::Relaxed);
                    }
                } else {
                    counters.walked_away.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(_) => {
                counters.full.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => return,
        }
        if rng.random_range(0..100) == 0 {
            let total = rng.random_range(1..20);
            if ops::set_capacity(
                &mut client,
                req.hotel_id,
                req.room_type_id,
                check_in,
                req.check_out,
                Some(total),
                None,
            )
            .await
            .is_ok()
            {
                counters.capacity_changes.fetch_add(1, Ordering::Relaxed);
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(5..50))).await;
    }
}

/// Returns the units of expired holds every second.
async fn sweeper(url: String, counters: Arc<Counters>, stop: CancellationToken) {
    let Ok(mut client) = owner::connect(&url, Duration::from_secs(10)).await else {
        return;
    };
    while !stop.is_cancelled() {
        if let Ok(n) = ops::sweep(&mut client, 500).await {
            counters.swept.fetch_add(n, Ordering::Relaxed);
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// Waits for the copy to reach the owner's position, then counts the
/// inventory rows whose values differ (or exist on one side only).
pub async fn verify(model: &ReadModel, client: &tokio_postgres::Client) -> Result<u64, DemoError> {
    let target = slot::current_wal_lsn(client).await?;
    let wait = Duration::from_secs(60);
    let deadline = Instant::now() + wait;
    while model.freshness.applied() < target {
        if Instant::now() > deadline {
            return Err(DemoError::NotCaughtUp(wait));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rows = client
        .query(
            "SELECT hotel_id, room_type_id, night, total, taken, sell_limit, price_cents FROM inventory",
            &[],
        )
        .await
        .map_err(OwnerError::from)?;
    let t = model.read();
    let mut differing = 0u64;
    for r in &rows {
        let key = crate::model::CalendarKey {
            hotel_id: r.get(0),
            room_type_id: r.get(1),
        };
        let owner = crate::model::NightCounts {
            total: r.get(3),
            taken: r.get(4),
            sell_limit: r.get(5),
            price_cents: r.get(6),
        };
        if t.calendars.get(&key).and_then(|c| c.get(r.get(2))) != Some(owner) {
            differing += 1;
        }
    }
    differing += t.inventory_rows().saturating_sub(rows.len() as u64);
    Ok(differing)
}

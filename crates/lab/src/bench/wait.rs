//! `vacancy bench wait`: how long a search waits to get at the copy, and
//! what guests see, before and during the apply of one large owner
//! transaction (a revenue job repricing every hotel's next nights), or
//! before and during the write of one checkpoint (`--during checkpoint`,
//! issue 21) while the owner takes holds, with the apply time beside it.
//!
//! The wait is read in the process, from `vacancy_search_model_wait_seconds`,
//! since a client's maximum on a shared two-core box mostly measures the
//! box. Client latencies sit beside it, in the same two windows.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use prometheus::core::Collector;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::net::TcpListener;

use prometheus::Histogram;
use tokio_util::sync::CancellationToken;
use vacancy_service::metrics::{APPLY_DURATION, SEARCH_MODEL_WAIT};
use vacancy_service::{CheckpointTrigger, slot};

use super::{
    BenchError, CONNECT_TIMEOUT, LOAD_LIMIT, Owner, POLL, VACANCY_SLOT, bench_settings,
    print_header, reprice_every_hotel, wait_caught_up,
};
use crate::http_client::HttpClient;
use crate::measure::Latencies;
use crate::readiness::wait_until;

pub(super) struct WaitOptions {
    /// Nights from the first on that the big transaction reprices, in every
    /// hotel and room type.
    pub(super) update_nights: u32,
    pub(super) clients: u32,
    /// Length of the window before the transaction.
    pub(super) before: Duration,
    pub(super) during: During,
}

/// What the second window measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum During {
    /// One owner transaction that reprices every hotel's next nights.
    Repricing,
    /// One checkpoint written from the copy (checkpoints on), while the
    /// owner takes holds so that apply runs beside it.
    Checkpoint,
}

/// Holds per second on the owner in `--during checkpoint`, so apply runs in both windows.
const CHECKPOINT_HOLDS_PER_SECOND: u32 = 200;

/// Cumulative bucket counts of the wait histogram, by upper bound (seconds).
#[derive(Debug, Clone, Default)]
pub(super) struct WaitBuckets {
    bounds: Vec<f64>,
    cumulative: Vec<u64>,
    pub(super) count: u64,
}

impl WaitBuckets {
    fn now() -> WaitBuckets {
        Self::of(&SEARCH_MODEL_WAIT)
    }

    pub(super) fn of(metric: &Histogram) -> WaitBuckets {
        let families = metric.collect();
        let Some(histogram) = families
            .first()
            .and_then(|f| f.get_metric().first())
            .map(|m| m.get_histogram().clone())
        else {
            return WaitBuckets::default();
        };
        WaitBuckets {
            bounds: histogram
                .get_bucket()
                .iter()
                .map(|b| b.upper_bound())
                .collect(),
            cumulative: histogram
                .get_bucket()
                .iter()
                .map(|b| b.cumulative_count())
                .collect(),
            count: histogram.get_sample_count(),
        }
    }

    /// The reads between `earlier` and `self`.
    pub(super) fn since(&self, earlier: &WaitBuckets) -> WaitBuckets {
        let at = |i: usize| earlier.cumulative.get(i).copied().unwrap_or(0);
        WaitBuckets {
            bounds: self.bounds.clone(),
            cumulative: self
                .cumulative
                .iter()
                .enumerate()
                .map(|(i, c)| c.saturating_sub(at(i)))
                .collect(),
            count: self.count.saturating_sub(earlier.count),
        }
    }

    /// The smallest bucket bound with at least `quantile` of the reads at or
    /// below it: an upper bound on that quantile. `None` past the last bucket.
    pub(super) fn bound_of(&self, quantile: f64) -> Option<f64> {
        let needed = (quantile * self.count as f64).ceil() as u64;
        self.bounds
            .iter()
            .zip(&self.cumulative)
            .find(|(_, c)| **c >= needed)
            .map(|(b, _)| *b)
    }
}

fn bound_text(bound: Option<f64>) -> String {
    match bound {
        Some(seconds) if seconds < 1e-3 => format!("≤ {:.0} µs", seconds * 1e6),
        Some(seconds) => format!("≤ {:.1} ms", seconds * 1e3),
        None => "> 100 ms".to_string(),
    }
}

fn ms(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.2} ms"))
}

/// Cities to search, largest first, so searches cover many hotels.
pub(super) async fn cities(client: &tokio_postgres::Client) -> Result<Vec<String>, BenchError> {
    Ok(client
        .query(
            "SELECT city FROM hotels GROUP BY city ORDER BY count(*) DESC, city LIMIT 20",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Searches until `stop`; returns when each answer came back and how long
/// it took, and how many searches failed.
async fn search_load(
    http: HttpClient,
    cities: Arc<Vec<String>>,
    first_night: chrono::NaiveDate,
    nights: u32,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> (Vec<(Instant, Duration)>, u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut answered, mut failures) = (Vec::new(), 0);
    while !stop.load(Ordering::Acquire) {
        let city: String =
            form_urlencoded::byte_serialize(cities[rng.random_range(0..cities.len())].as_bytes())
                .collect();
        let check_in = first_night + chrono::Days::new(rng.random_range(0..u64::from(nights)));
        let check_out = check_in + chrono::Days::new(rng.random_range(1..=3));
        let path =
            format!("/v1/search?city={city}&check_in={check_in}&check_out={check_out}&room=2");
        let asked = Instant::now();
        match http.get(&path).await {
            Ok(answer) if answer.status == 200 => answered.push((Instant::now(), asked.elapsed())),
            _ => failures += 1,
        }
    }
    (answered, failures)
}

/// The latencies of the answers that came back in `[from, to)`.
fn window(answered: &[(Instant, Duration)], from: Instant, to: Instant) -> Latencies {
    let inside: Vec<Duration> = answered
        .iter()
        .filter(|(at, _)| *at >= from && *at < to)
        .map(|(_, latency)| *latency)
        .collect();
    Latencies::from_durations(&inside)
}

pub(super) async fn run(owner: &Owner, options: &WaitOptions) -> Result<(), BenchError> {
    let client = vacancy_service::connect(owner.url(), CONNECT_TIMEOUT).await?;
    print_header("wait", owner, &client).await?;
    slot::drop_slot(&client, VACANCY_SLOT).await?;
    let shape = owner.shape;
    let update_nights = i64::from(options.update_nights).min(shape.nights);
    let rows_changed = shape.hotels * shape.room_types * update_nights;

    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let mut settings = bench_settings(owner.url());
    // Copy only: the owner reads of few-unit rows would measure the owner.
    settings.search.few_units_threshold = 0;
    // Kept until the end of the run: the checkpoints go here.
    let checkpoints = tempfile::Builder::new().prefix("vacancy-wait-").tempdir()?;
    if options.during == During::Checkpoint {
        settings.checkpoint.dir = checkpoints.path().display().to_string();
    }
    let app = vacancy_service::start(settings, listener)?;
    let http = HttpClient::new(app.addr, Duration::from_secs(30))
        .map_err(|e| BenchError::Io(std::io::Error::other(e.to_string())))?;
    let loaded_at = slot::current_wal_lsn(&client).await?;
    crate::readiness::wait_ready(&app, loaded_at, LOAD_LIMIT).await?;

    let cities = Arc::new(cities(&client).await?);
    if cities.is_empty() {
        return Err(BenchError::NoData);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..u64::from(options.clients))
        .map(|seed| {
            tokio::spawn(search_load(
                http.clone(),
                cities.clone(),
                shape.first_night,
                options.update_nights.max(1),
                seed,
                stop.clone(),
            ))
        })
        .collect();

    let holds_stop = CancellationToken::new();
    let holds = if options.during == During::Checkpoint {
        // The checkpoint taken right after the snapshot must be durable
        // first, or the write measured would queue behind it.
        wait_until(
            "the first checkpoint",
            LOAD_LIMIT,
            POLL,
            &app.status,
            || app.checkpoints.report().last_written.is_some(),
        )
        .await?;
        Some(tokio::spawn(super::restart::run_holds(
            owner.url().to_string(),
            owner.shape,
            CHECKPOINT_HOLDS_PER_SECOND,
            holds_stop.clone(),
        )))
    } else {
        None
    };
    let started = WaitBuckets::now();
    let apply_started = WaitBuckets::of(&APPLY_DURATION);
    let before_from = Instant::now();
    tokio::time::sleep(options.before).await;
    let before = WaitBuckets::now().since(&started);
    let before_to = Instant::now();

    let apply_before = WaitBuckets::of(&APPLY_DURATION).since(&apply_started);
    let mark = WaitBuckets::now();
    let apply_mark = WaitBuckets::of(&APPLY_DURATION);
    let (what, during_from) = match options.during {
        During::Repricing => {
            let repricing = reprice_every_hotel(owner, &client, update_nights).await?;
            let committed_at = repricing.committed_at;
            wait_caught_up(&app, &client).await?;
            let what = format!(
                "transaction: {}\n             {rows_changed} rows; the owner committed it in {:.1} s; \
                 the copy applied it {:.1} s after the commit",
                repricing.sql,
                repricing.committed_in.as_secs_f64(),
                committed_at.elapsed().as_secs_f64()
            );
            (what, committed_at)
        }
        During::Checkpoint => {
            let from = Instant::now();
            let written = app
                .checkpoints
                .write_now(&app.model, &app.refresh, CheckpointTrigger::Interval)
                .await;
            let what = match written {
                Some(Ok(w)) => format!(
                    "checkpoint:  {} bytes, {} nights, written in {:.2} s while holds were offered at {CHECKPOINT_HOLDS_PER_SECOND}/s",
                    w.bytes,
                    w.nights,
                    from.elapsed().as_secs_f64()
                ),
                Some(Err(error)) => return Err(std::io::Error::other(error.to_string()).into()),
                None => {
                    return Err(std::io::Error::other(
                        "no checkpoint was written: the copy did not move since the last",
                    )
                    .into());
                }
            };
            (what, from)
        }
    };
    let during_to = Instant::now();
    let during = WaitBuckets::now().since(&mark);
    let apply_during = WaitBuckets::of(&APPLY_DURATION).since(&apply_mark);
    holds_stop.cancel();
    stop.store(true, Ordering::Release);
    let (mut answered, mut failures) = (Vec::new(), 0);
    for c in clients {
        let (mine, failed) = c.await.unwrap_or_default();
        answered.extend(mine);
        failures += failed;
    }
    app.stop(Duration::from_secs(60)).await;
    if let Some(holds) = holds {
        holds.await.map_err(std::io::Error::other)??;
    }

    let before_client = window(&answered, before_from, before_to);
    let during_client = window(&answered, during_from, during_to);
    let mut out = String::new();
    let _ = writeln!(out, "{what}");
    let _ = writeln!(
        out,
        "load:        {} clients searching the 20 largest cities (copy only), stays in the repriced nights",
        options.clients
    );
    let _ = writeln!(
        out,
        "windows:     before = {:.0} s of load before; during = {}",
        options.before.as_secs_f64(),
        match options.during {
            During::Repricing => "from the owner's commit until the copy applied it",
            During::Checkpoint => "the checkpoint's write, from start to durable",
        }
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| window | reads of the copy | wait p99.9 (in process, goal ≤ 1 ms) | wait max (goal ≤ 10 ms) | transactions applied | apply p99 (CPU included) | apply max | searches | client p50 | client p99 | client max |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (name, wait, apply, latencies) in [
        ("before", &before, &apply_before, &before_client),
        ("during", &during, &apply_during, &during_client),
    ] {
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            wait.count,
            bound_text(wait.bound_of(0.999)),
            bound_text(wait.bound_of(1.0)),
            apply.count,
            bound_text(apply.bound_of(0.99)),
            bound_text(apply.bound_of(1.0)),
            latencies.len(),
            ms(latencies.percentile(0.5)),
            ms(latencies.percentile(0.99)),
            ms(latencies.max()),
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "wait figures are histogram bucket bounds (vacancy_search_model_wait_seconds); failed searches: {failures}"
    );
    print!("{out}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_bounds_bound_the_quantiles() {
        let earlier = WaitBuckets {
            bounds: vec![1e-6, 1e-3, 1e-2],
            cumulative: vec![10, 10, 10],
            count: 10,
        };
        let later = WaitBuckets {
            bounds: vec![1e-6, 1e-3, 1e-2],
            cumulative: vec![1_008, 1_009, 1_010],
            count: 1_010,
        };
        let window = later.since(&earlier);
        assert_eq!(window.count, 1_000);
        assert_eq!(window.bound_of(0.5), Some(1e-6));
        assert_eq!(window.bound_of(0.999), Some(1e-3));
        assert_eq!(window.bound_of(1.0), Some(1e-2));
        let slower = WaitBuckets {
            count: 1_011,
            ..later
        }
        .since(&earlier);
        assert_eq!(slower.bound_of(1.0), None, "a read past the last bucket");
    }
}

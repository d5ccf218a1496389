//! `vacancy demo`: the whole job on one machine with no setup.
//!
//! It starts an embedded owner (a throwaway PostgreSQL cluster from the
//! machine's server binaries, removed on exit) or attaches to one, loads a
//! generated dataset, starts the projector and the API (with the guest page
//! at `/`), and runs a booking site against them:
//!
//! - two crowds of booking-service guests (`crate::simulator`): a hot crowd
//!   racing for the few rooms of a handful of hotels in the biggest city
//!   (where 409s happen), and a browsing crowd spread over many hotels and
//!   dates that follows the bypass advice; both search over HTTP, hold on
//!   the owner, pay, release or walk away, and report every take with its
//!   quote to `POST /v1/take-outcomes`;
//! - the sweeper (run by the hot crowd) returning expired holds;
//! - hoteliers closing and reopening rooms (`ops::set_capacity`);
//! - a front desk cancelling paid bookings (`ops::cancel`).
//!
//! Every few seconds it prints one line of figures; at the end (on its own
//! with `duration`, or on Ctrl-C) it stops the guests, checks that the copy
//! equals the owner row for row, prints a summary and removes the cluster.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{NaiveDate, Utc};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::cluster::{ClusterError, ClusterOptions};
use crate::ops::{self, CapacityOutcome, Transition};
use crate::owner_db::OwnerDb;
use crate::readiness::{NotReady, wait_until};
use crate::seed::{self, SeedError, SeedOptions};
use crate::simulator::{self, SimError, SimOptions, SimSummary, pause};
use vacancy_service::metrics;
use vacancy_service::slot;
use vacancy_service::{App, OwnerError, Settings};

/// The demo's own slot, so it never takes over a `vacancy serve`'s slot on
/// an attached owner.
const DEMO_SLOT: &str = "vacancy_demo";
/// Hotels the hot crowd races for.
const HOT_HOTELS: i64 = 4;
/// Hotels the browsing crowd searches (a search takes at most 250 ids).
const BROWSE_HOTELS: i64 = 200;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Attach to this owner instead of starting an embedded one.
    pub owner_url: Option<String>,
    pub pg_bin: Option<std::path::PathBuf>,
    pub listen: String,
    pub hotels: u32,
    pub room_types: u32,
    pub nights: u32,
    /// Simulated booking-service guests, split between the two crowds.
    pub guests: usize,
    /// How long a hold lasts before the sweeper returns it.
    pub hold_secs: u64,
    /// Stop on its own after this long; `None` runs until Ctrl-C.
    pub duration: Option<Duration>,
    /// How often the figures line is printed.
    pub report_every: Duration,
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
    App(#[from] vacancy_service::AppError),
    #[error(transparent)]
    Slot(#[from] slot::SlotError),
    #[error(transparent)]
    Simulator(#[from] SimError),
    #[error("owner database: {0}")]
    Query(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Config(#[from] vacancy_service::ConfigError),
    #[error("the owner has no hotels with inventory to book")]
    EmptyOwner,
    #[error(transparent)]
    NotReady(#[from] NotReady),
    #[error("the copy differs from the owner in {0} inventory rows")]
    Diverged(u64),
    #[error("cannot make a directory for the demo's checkpoints: {0}")]
    CheckpointDir(std::io::Error),
}

/// What the demo's own actors (not the simulated guests) did.
#[derive(Debug, Default)]
pub struct Counters {
    pub capacity_changes: AtomicU64,
    pub cancelled: AtomicU64,
}

/// The part of the owner's data the actors work on.
#[derive(Debug, Clone)]
pub(crate) struct Dataset {
    pub(crate) city: String,
    hot_hotels: Vec<i64>,
    browse_hotels: Vec<i64>,
    /// `(hotel, room type)` of the hot hotels, for the hoteliers.
    hot_room_types: Vec<(i64, i64)>,
    pub(crate) first_night: NaiveDate,
    /// Nights on sale from `first_night` on (at least one).
    pub(crate) nights: u32,
}

pub async fn run(options: DemoOptions, stop: CancellationToken) -> Result<(), DemoError> {
    let mut cluster_options = ClusterOptions::default();
    if let Some(bin) = &options.pg_bin {
        cluster_options.bin_dir = bin.clone();
    }
    // Kept alive until the end of this function: dropping it stops the
    // server and removes its folder, on every path out (errors included).
    let owner_db =
        OwnerDb::given_or_embedded(options.owner_url.as_deref(), cluster_options, "owner").await?;
    let client = vacancy_service::connect(&owner_db.url, CONNECT_TIMEOUT).await?;
    let today = Utc::now().date_naive();
    if seed_if_empty(&client, &options, &owner_db.url, today, &stop)
        .await?
        .is_break()
    {
        eprintln!("stopped while loading; removing the cluster");
        return Ok(());
    }
    let data = dataset(&client, today).await?;

    let token = random_hex(24);
    // Checkpoints on, in a directory that lives as long as the demo: it
    // shows them being written (the log, /v1/status) as a deployment with a
    // volume would, without leaving files behind.
    let checkpoints = tempfile::tempdir().map_err(DemoError::CheckpointDir)?;
    let app = start_copy(&options, &owner_db.url, &token, checkpoints.path()).await?;
    let loaded = tokio::select! {
        biased;
        _ = stop.cancelled() => false,
        r = wait_loaded(&app, Duration::from_secs(30 * 60)) => { r?; true }
    };
    if !loaded {
        app.stop(Duration::from_secs(10)).await;
        drop_demo_slot(&owner_db).await;
        return Ok(());
    }
    print_addresses(app.addr, &data);

    let mut site = BookingSite::open(&options, &data, app.addr, &owner_db.url, &token);
    let started = Instant::now();
    report_until_done(&app, &options, started, &stop).await;
    eprintln!("stopping the guests");
    let guests = site.close().await;

    eprintln!("checking the copy against the owner, row for row");
    let verified = verify(&app, &client).await;
    println!(
        "{}",
        summary_line(&guests, &site.counters, &app, started.elapsed())
    );
    app.stop(Duration::from_secs(10)).await;
    drop(client);
    drop_demo_slot(&owner_db).await;
    let (rows, differing) = verified?;
    if differing > 0 {
        println!("verify: rows={rows} differing={differing} (the copy differs from the owner)");
        return Err(DemoError::Diverged(differing));
    }
    println!("verify: rows={rows} differing=0 (the copy equals the owner)");
    Ok(())
}

/// Loads the generated dataset into an owner with no hotels; an owner with
/// hotels is booked as it is. `Break` when `stop` came during the load.
async fn seed_if_empty(
    client: &tokio_postgres::Client,
    options: &DemoOptions,
    owner_url: &str,
    today: NaiveDate,
    stop: &CancellationToken,
) -> Result<ControlFlow<()>, DemoError> {
    crate::schema::apply(client).await?;
    let existing: i64 = client
        .query_one("SELECT count(*) FROM hotels", &[])
        .await?
        .get(0);
    if existing > 0 {
        eprintln!("the owner has {existing} hotels already; booking those");
        return Ok(ControlFlow::Continue(()));
    }
    let seed_options = SeedOptions {
        owner_url: owner_url.to_string(),
        hotels: options.hotels,
        room_types: options.room_types,
        nights: options.nights,
        start: today,
        seed: 1,
        progress: true,
    };
    let report = tokio::select! {
        biased;
        _ = stop.cancelled() => return Ok(ControlFlow::Break(())),
        r = seed::run(&seed_options) => r?,
    };
    eprintln!(
        "loaded {} hotels, {} room types, {} inventory rows in {:.1}s",
        report.hotels,
        report.room_types,
        report.inventory_rows,
        report.elapsed.as_secs_f64()
    );
    Ok(ControlFlow::Continue(()))
}

/// Starts the projector and the API on the demo's own slot, with `token` as
/// the simulated booking service's.
async fn start_copy(
    options: &DemoOptions,
    owner_url: &str,
    token: &str,
    checkpoints: &std::path::Path,
) -> Result<App, DemoError> {
    // `VACANCY_*` variables still apply (e.g. `VACANCY_ADMIN__TOKENS`, or
    // `VACANCY_STALE__BOOKING_TOKENS` for a client of its own beside the
    // simulated guests, as .ci/api-fuzz does); the demo's own owner, slot,
    // guest token and quote key win.
    let mut settings = Settings::load(None)?;
    settings.owner.url = owner_url.to_string();
    settings.http.listen = options.listen.clone();
    settings.stream.slot = DEMO_SLOT.to_string();
    settings.stale.booking_tokens.push(token.to_string());
    settings.stale.quote_key = random_hex(32);
    settings.checkpoint.dir = checkpoints.display().to_string();
    Ok(App::bind_and_start(settings).await?)
}

/// Where to look: the guest page, a busy hotel, the API.
fn print_addresses(addr: std::net::SocketAddr, data: &Dataset) {
    println!("vacancy is serving on http://{addr}");
    println!(
        "  the guest page:  http://{addr}/#/?city={}&check_in={}&check_out={}&rooms=1&guests=1",
        url_encode(&data.city),
        data.first_night,
        data.first_night + chrono::Days::new(2),
    );
    if let Some(h) = data.hot_hotels.first() {
        println!(
            "  a busy hotel:    http://{addr}/#/hotels/{h}?from={}&to={}",
            data.first_night,
            data.first_night + chrono::Days::new(14)
        );
    }
    println!(
        "  the API:         http://{addr}/v1/status, /v1/stale-reads, /metrics, /openapi.json"
    );
}

/// How long a crowd or an actor may take to stop once told to.
const STOP_GRACE: Duration = Duration::from_secs(30);

/// The booking site run against the copy and the owner: the crowds of
/// guests, the hoteliers and the front desk, all stopped by `work`.
pub(crate) struct BookingSite {
    work: CancellationToken,
    pub(crate) counters: Arc<Counters>,
    crowds: Vec<JoinHandle<Result<SimSummary, SimError>>>,
    actors: Vec<JoinHandle<()>>,
}

impl BookingSite {
    pub(crate) fn open(
        options: &DemoOptions,
        data: &Dataset,
        api: std::net::SocketAddr,
        owner_url: &str,
        token: &str,
    ) -> BookingSite {
        let work = CancellationToken::new();
        let counters = Arc::new(Counters::default());
        let run_seed = Utc::now().timestamp_micros().unsigned_abs();
        let (hot, browse) = crowds(options, data, api, owner_url, token, run_seed);
        let crowd_tasks = std::iter::once(hot)
            .chain(browse)
            .map(|crowd| tokio::spawn(simulator::run(crowd, work.clone())))
            .collect();
        let actors = vec![
            tokio::spawn(hoteliers(
                owner_url.to_string(),
                data.clone(),
                run_seed,
                counters.clone(),
                work.clone(),
            )),
            tokio::spawn(front_desk(
                owner_url.to_string(),
                run_seed,
                counters.clone(),
                work.clone(),
            )),
        ];
        BookingSite {
            work,
            counters,
            crowds: crowd_tasks,
            actors,
        }
    }

    /// Stops everyone and waits for them (each within `STOP_GRACE`); what
    /// the guests did, by their own account.
    pub(crate) async fn close(&mut self) -> SimSummary {
        self.work.cancel();
        let mut guests = SimSummary::default();
        for crowd in self.crowds.drain(..) {
            match tokio::time::timeout(STOP_GRACE, crowd).await {
                Ok(Ok(Ok(summary))) => guests.merge(&summary),
                Ok(Ok(Err(e))) => eprintln!("a crowd failed: {e}"),
                Ok(Err(e)) => eprintln!("a crowd task failed: {e}"),
                Err(_) => eprintln!("a crowd did not stop within {STOP_GRACE:?}"),
            }
        }
        for actor in self.actors.drain(..) {
            // The actors count what they did as they go: nothing to collect.
            let _ = tokio::time::timeout(STOP_GRACE, actor).await;
        }
        guests
    }
}

/// Prints a figures line every `report_every` until `stop` or the end of
/// `duration`.
async fn report_until_done(
    app: &App,
    options: &DemoOptions,
    started: Instant,
    stop: &CancellationToken,
) {
    let deadline = options
        .duration
        .map(|d| tokio::time::Instant::from_std(started + d));
    let mut ticker = tokio::time::interval(options.report_every);
    // The first tick is immediate; a line needs a period behind it.
    ticker.tick().await;
    let mut last = Figures::now(app);
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            _ = until(deadline) => break,
            _ = ticker.tick() => {
                let now = Figures::now(app);
                println!("{}", now.line(&last, started.elapsed(), app));
                last = now;
            }
        }
    }
}

/// The `summary:` line: the guests' account, the actors' counts, and the
/// stale reads `vacancy` counted. Named as everywhere else (ARCHITECTURE.md,
/// "The 409 figures"): `409s_after_shown` is the guests' count of 409s after
/// a room type was shown with enough units, whatever the source;
/// `stale_reads` is `vacancy`'s count of those whose numbers came from the
/// copy, and `stale_read_share` those per take the owner answered, over the
/// whole run (the periodic line's share is over the sliding window).
fn summary_line(guests: &SimSummary, counters: &Counters, app: &App, elapsed: Duration) -> String {
    let totals = app.stale.ledger.totals();
    let owner_takes = totals.taken + totals.conflicts;
    format!(
        "summary: searches={} takes={} taken={} conflicts={} 409s_after_shown={} stale_reads={} stale_read_share={:.4} paid={} released={} walked_away={} expired={} cancelled={} capacity_changes={} reports_recorded={} reports_failed={} seconds={:.0}",
        guests.searches - guests.search_errors,
        guests.taken + guests.conflicts,
        guests.taken,
        guests.conflicts,
        guests.conflicts_after_shown,
        totals.stale_reads,
        if owner_takes == 0 {
            0.0
        } else {
            totals.stale_reads as f64 / owner_takes as f64
        },
        guests.paid,
        guests.released,
        guests.walked_away,
        guests.swept,
        counters.cancelled.load(Ordering::Relaxed),
        counters.capacity_changes.load(Ordering::Relaxed),
        guests.reports_recorded,
        guests.reports_failed,
        elapsed.as_secs_f64(),
    )
}

/// The two crowds: a hot one (racing; sweeps expired holds) and, with more
/// than one guest, a browsing one.
fn crowds(
    options: &DemoOptions,
    data: &Dataset,
    api: std::net::SocketAddr,
    owner_url: &str,
    token: &str,
    seed: u64,
) -> (SimOptions, Option<SimOptions>) {
    let guests = options.guests.max(1);
    let hot_guests = guests.div_ceil(2);
    let mut hot = SimOptions::hot(
        api,
        owner_url,
        token,
        data.hot_hotels.clone(),
        data.first_night,
    );
    hot.guests = hot_guests;
    hot.takes_per_guest = None;
    hot.nights_span = data.nights.min(2);
    hot.stay_nights = (1, 2);
    // A guest looks at the answer a while before taking: others book meanwhile.
    hot.think_ms = (100, 2000);
    hot.hold_ms = (0, 500);
    hot.pause_ms = (0, 100);
    hot.pay_percent = 50;
    hot.release_percent = 50;
    hot.hold_secs = options.hold_secs;
    hot.sweep = true;
    hot.seed = seed;
    // Runs until the demo stops it.
    hot.duration = Some(Duration::from_secs(10 * 365 * 24 * 3600));

    let browse_guests = guests - hot_guests;
    let browse = (browse_guests > 0).then(|| {
        let mut b = hot.clone();
        b.guests = browse_guests;
        b.hotel_ids = data.browse_hotels.clone();
        b.nights_span = data.nights.saturating_sub(31).clamp(1, 60);
        b.stay_nights = (1, 4);
        b.guests_per_room = 2;
        b.think_ms = (200, 1500);
        b.hold_ms = (100, 1500);
        b.pause_ms = (50, 500);
        b.pay_percent = 70;
        b.release_percent = 60;
        b.follow_advice = true;
        b.sweep = false;
        b.seed = seed.wrapping_add(1);
        b
    });
    (hot, browse)
}

/// Which hotels the actors use: the first few of the biggest city (hot),
/// and a spread of others.
pub(crate) async fn dataset(
    client: &tokio_postgres::Client,
    today: NaiveDate,
) -> Result<Dataset, DemoError> {
    let first_night = today + chrono::Days::new(1);
    let city_row = client
        .query_opt(
            "SELECT h.city FROM hotels h
             WHERE EXISTS (SELECT 1 FROM inventory i WHERE i.hotel_id = h.id AND i.night = $1)
             GROUP BY h.city ORDER BY count(*) DESC, h.city LIMIT 1",
            &[&first_night],
        )
        .await?
        .ok_or(DemoError::EmptyOwner)?;
    let city: String = city_row.get(0);
    let ids = |rows: Vec<tokio_postgres::Row>| rows.iter().map(|r| r.get::<_, i64>(0)).collect();
    let hot_hotels: Vec<i64> = ids(client
        .query(
            "SELECT h.id FROM hotels h WHERE h.city = $1
             AND EXISTS (SELECT 1 FROM inventory i WHERE i.hotel_id = h.id AND i.night = $2)
             ORDER BY h.id LIMIT $3",
            &[&city, &first_night, &HOT_HOTELS],
        )
        .await?);
    let browse_hotels: Vec<i64> = ids(client
        .query(
            "SELECT id FROM hotels ORDER BY hashint8(id), id LIMIT $1",
            &[&BROWSE_HOTELS],
        )
        .await?);
    let hot_room_types = client
        .query(
            "SELECT hotel_id, id FROM room_types WHERE hotel_id = ANY($1) ORDER BY 1, 2",
            &[&hot_hotels],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let last: Option<NaiveDate> = client
        .query_one("SELECT max(night) FROM inventory", &[])
        .await?
        .get(0);
    let nights = last
        .map(|l| (l - first_night).num_days().max(1))
        .unwrap_or(1);
    Ok(Dataset {
        city,
        hot_hotels,
        browse_hotels,
        hot_room_types,
        first_night,
        nights: u32::try_from(nights).unwrap_or(u32::MAX),
    })
}

/// Waits for the initial snapshot, with a progress bar on stderr.
async fn wait_loaded(app: &App, limit: Duration) -> Result<(), DemoError> {
    let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("copying the owner {bar:40} {pos}/{len} rows {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let snap = &app.status.snapshot;
    // Each poll redraws the bar, so it moves as the rows arrive.
    let loaded = wait_until(
        "the copy to load the owner's snapshot",
        limit,
        Duration::from_millis(100),
        &app.status,
        || {
            bar.set_length(snap.rows_expected.load(Ordering::Relaxed));
            bar.set_position(snap.rows_loaded.load(Ordering::Relaxed));
            app.model.freshness.is_loaded()
        },
    )
    .await;
    if loaded.is_err() {
        bar.abandon();
    }
    loaded?;
    bar.finish_and_clear();
    eprintln!(
        "the copy is loaded at lsn {}",
        app.model.freshness.applied()
    );
    Ok(())
}

/// Counters read for one figures line.
struct Figures {
    at: Instant,
    searches: u64,
    takes: u64,
    owner_reads: u64,
}

impl Figures {
    fn now(app: &App) -> Figures {
        let totals = app.stale.ledger.totals();
        Figures {
            at: Instant::now(),
            searches: metrics::SEARCH_RESULTS.get_sample_count(),
            takes: totals.taken + totals.conflicts,
            owner_reads: counter_total("vacancy_owner_reads_total"),
        }
    }

    /// `searches/s, takes/s, stale-read share, owner reads/s, lag`. The
    /// share is `GET /v1/stale-reads`' `share`: 409s after the copy showed
    /// the units free, per take, over the sliding window (not the run).
    fn line(&self, before: &Figures, elapsed: Duration, app: &App) -> String {
        let secs = self.at.duration_since(before.at).as_secs_f64().max(0.001);
        let rate = |now: u64, then: u64| now.saturating_sub(then) as f64 / secs;
        let window = app.stale.ledger.overall();
        format!(
            "[{:>4}s] searches/s {:>7.1}  takes/s {:>6.1}  stale reads {:>5.2}% of takes ({}/{} in {}s)  owner reads/s {:>6.1}  lag {:>4} ms",
            elapsed.as_secs(),
            rate(self.searches, before.searches),
            rate(self.takes, before.takes),
            window.share() * 100.0,
            window.stale,
            window.takes,
            app.stale.ledger.span().as_secs(),
            rate(self.owner_reads, before.owner_reads),
            app.model.freshness.lag_ms(Utc::now()),
        )
    }
}

/// The sum of a counter family over all its labels.
fn counter_total(name: &str) -> u64 {
    metrics::REGISTRY
        .gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().iter())
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}

/// Hotels close rooms (total down to what is taken) and open them again,
/// on the hot hotels' nights, every few hundred milliseconds.
async fn hoteliers(
    url: String,
    data: Dataset,
    seed: u64,
    counters: Arc<Counters>,
    stop: CancellationToken,
) {
    let Ok(mut client) = vacancy_service::connect(&url, CONNECT_TIMEOUT).await else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x4854_4c52);
    // High season: the hot hotels start with their last few rooms on sale.
    let (from, to) = (
        data.first_night,
        data.first_night + chrono::Days::new(u64::from(data.nights.min(3))),
    );
    for &(hotel_id, room_type_id) in &data.hot_room_types {
        if stop.is_cancelled() {
            return;
        }
        let closed = client
            .execute(
                "UPDATE inventory SET total = taken + $5, sell_limit = NULL
                 WHERE hotel_id = $1 AND room_type_id = $2 AND night >= $3 AND night < $4",
                &[
                    &hotel_id,
                    &room_type_id,
                    &from,
                    &to,
                    &rng.random_range(0..=2i32),
                ],
            )
            .await;
        if closed.is_ok_and(|n| n > 0) {
            counters.capacity_changes.fetch_add(1, Ordering::Relaxed);
        }
    }
    while !stop.is_cancelled() && !data.hot_room_types.is_empty() {
        let (hotel_id, room_type_id) =
            data.hot_room_types[rng.random_range(0..data.hot_room_types.len())];
        let from = data.first_night + chrono::Days::new(rng.random_range(0..2));
        let to = from + chrono::Days::new(rng.random_range(1..=2));
        let taken = client
            .query_one(
                "SELECT max(taken) FROM inventory
                 WHERE hotel_id = $1 AND room_type_id = $2 AND night >= $3 AND night < $4",
                &[&hotel_id, &room_type_id, &from, &to],
            )
            .await
            .ok()
            .and_then(|r| r.get::<_, Option<i32>>(0));
        if let Some(taken) = taken {
            // Close every free room, or open a few: the hot hotels stay scarce.
            let total = if rng.random_range(0..100) < 60 {
                taken
            } else {
                taken + rng.random_range(1..=4)
            };
            let changed = ops::set_capacity(
                &mut client,
                hotel_id,
                room_type_id,
                from,
                to,
                Some(total),
                Some(None),
            )
            .await;
            if matches!(changed, Ok(CapacityOutcome::Changed { .. })) {
                counters.capacity_changes.fetch_add(1, Ordering::Relaxed);
            }
        }
        pause(&mut rng, (100, 400), &stop).await;
    }
}

/// Guests cancel paid bookings now and then; their units come back.
async fn front_desk(url: String, seed: u64, counters: Arc<Counters>, stop: CancellationToken) {
    let Ok(mut client) = vacancy_service::connect(&url, CONNECT_TIMEOUT).await else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x4445_534b);
    while !stop.is_cancelled() {
        pause(&mut rng, (300, 1200), &stop).await;
        let Ok(rows) = client
            .query(
                "SELECT id FROM bookings WHERE status = 'confirmed' ORDER BY created_at DESC LIMIT 20",
                &[],
            )
            .await
        else {
            continue;
        };
        if rows.is_empty() {
            continue;
        }
        let id: String = rows[rng.random_range(0..rows.len())].get(0);
        if matches!(ops::cancel(&mut client, &id).await, Ok(Transition::Done)) {
            counters.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// On an attached owner, the demo's slot would pin WAL after it exits.
async fn drop_demo_slot(owner_db: &OwnerDb) {
    if owner_db.is_embedded() {
        return; // the cluster goes away whole
    }
    match vacancy_service::connect(&owner_db.url, CONNECT_TIMEOUT).await {
        Ok(c) => {
            if let Err(e) = slot::drop_slot(&c, DEMO_SLOT).await {
                eprintln!("could not drop the demo's slot {DEMO_SLOT}: {e}");
            }
        }
        Err(e) => eprintln!("could not drop the demo's slot {DEMO_SLOT}: {e}"),
    }
}

fn random_hex(bytes: usize) -> String {
    let mut rng = rand::rng();
    (0..bytes)
        .map(|_| format!("{:02x}", rng.random::<u8>()))
        .collect()
}

fn url_encode(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// Waits for the copy to reach the owner's position, then compares every
/// inventory row: returns the rows compared and how many differ (or exist on
/// one side only).
pub async fn verify(app: &App, client: &tokio_postgres::Client) -> Result<(u64, u64), DemoError> {
    let target = slot::current_wal_lsn(client).await?;
    let model = &app.model;
    wait_until(
        "the copy to reach the owner's position",
        Duration::from_secs(60),
        Duration::from_millis(20),
        &app.status,
        || model.freshness.applied() >= target,
    )
    .await?;
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
        let key = vacancy_service::CalendarKey {
            hotel_id: r.get(0),
            room_type_id: r.get(1),
        };
        let owner = vacancy_service::NightCounts {
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
    Ok((rows.len() as u64, differing))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crowds_split_the_guests_and_never_share_booking_ids() {
        let options = DemoOptions {
            owner_url: None,
            pg_bin: None,
            listen: "127.0.0.1:0".into(),
            hotels: 10,
            room_types: 2,
            nights: 30,
            guests: 5,
            hold_secs: 7,
            duration: None,
            report_every: Duration::from_secs(5),
        };
        let data = Dataset {
            city: "Lisbon".into(),
            hot_hotels: vec![1, 2],
            browse_hotels: vec![1, 2, 3],
            hot_room_types: vec![(1, 1)],
            first_night: NaiveDate::from_ymd_opt(2030, 1, 1).unwrap(),
            nights: 30,
        };
        let addr = "127.0.0.1:1".parse().unwrap();
        let (hot, browse) = crowds(&options, &data, addr, "postgres://x", "t", 9);
        let browse = browse.expect("five guests make two crowds");
        assert_eq!(hot.guests + browse.guests, 5);
        assert_ne!(hot.seed, browse.seed, "booking ids are made from the seed");
        assert_eq!((hot.hold_secs, browse.hold_secs), (7, 7));
        assert!(hot.sweep && !browse.sweep, "one sweeper");
        assert_eq!(browse.hotel_ids, vec![1, 2, 3]);
        let one = DemoOptions {
            guests: 1,
            ..options
        };
        assert!(
            crowds(&one, &data, addr, "postgres://x", "t", 9)
                .1
                .is_none()
        );
    }
}

//! `vacancy bench stale`: the 409-after-shown rate the copy adds (issue 5).
//!
//! Guests racing for few units produce conflicts whatever search reads: a
//! unit shown free at the owner a moment ago may be gone by the time the
//! guest takes it. That floor is measured by the same simulator with search
//! reading every shown room type from the owner (`few_units_threshold` set
//! past any count); the copy's run uses the default settings. Both runs use
//! the same data, the same guests, the same seed and the same duration, one
//! after the other on the same owner, which is reset between them.

use std::time::{Duration, Instant};

use chrono::NaiveDate;
use tokio::net::TcpListener;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::cluster::{ClusterError, ClusterOptions};
use crate::owner_db::OwnerDb;
use crate::readiness::{NotReady, wait_ready};
use crate::simulator::{self, SimError, SimOptions, SimSummary};
use vacancy_service::slot::{self, SlotError};
use vacancy_service::{AppError, OwnerError, Settings};

const SLOT: &str = "vacancy_stale_bench";
const PUBLICATION: &str = "vacancy_stale_bench";
const TOKEN: &str = "stale-bench-booking-token";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
const LOAD_LIMIT: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, clap::Args)]
pub struct StaleBenchArgs {
    /// An existing, empty owner database. Default: an embedded throwaway cluster.
    #[arg(long)]
    pub owner_url: Option<String>,
    /// Hot hotels the guests search (all at once, `hotel_ids=`).
    #[arg(long, default_value_t = 20)]
    pub hotels: u32,
    #[arg(long, default_value_t = 4)]
    pub room_types: u32,
    /// Units per room type and night: few, so guests race.
    #[arg(long, default_value_t = 5)]
    pub units: u32,
    /// Nights stays start on.
    #[arg(long, default_value_t = 3)]
    pub nights: u32,
    #[arg(long, default_value_t = 32)]
    pub guests: usize,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 30)]
    pub seconds: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum StaleBenchError {
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error(transparent)]
    Owner(#[from] OwnerError),
    #[error(transparent)]
    Query(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Slot(#[from] SlotError),
    #[error(transparent)]
    App(#[from] AppError),
    #[error(transparent)]
    Simulator(#[from] SimError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    NotReady(#[from] NotReady),
}

/// One run's outcome.
struct Run {
    label: &'static str,
    summary: SimSummary,
    seconds: f64,
}

impl Run {
    fn takes(&self) -> u64 {
        self.summary.taken + self.summary.conflicts
    }

    /// Conflicts after the room was shown free, per take the owner answered.
    fn after_shown_share(&self) -> f64 {
        let takes = self.takes();
        if takes == 0 {
            return 0.0;
        }
        self.summary.conflicts_after_shown as f64 / takes as f64
    }
}

pub async fn run(args: StaleBenchArgs) -> Result<(), StaleBenchError> {
    // Declared before everything that talks to it, so it is dropped (stopped
    // and removed) last.
    let owner_db = OwnerDb::given_or_embedded(
        args.owner_url.as_deref(),
        ClusterOptions {
            fsync: true,
            extra_conf: vec!["max_connections = 200".into()],
            ..ClusterOptions::default()
        },
        "stale_bench",
    )
    .await?;
    let client = vacancy_service::connect(&owner_db.url, CONNECT_TIMEOUT).await?;
    crate::schema::apply(&client).await?;
    let first_night = chrono::Utc::now().date_naive() + chrono::Days::new(1);
    load(&client, &args, first_night).await?;

    let mut runs = Vec::new();
    for (label, threshold) in [
        ("search from the copy (default settings)", None),
        (
            "search reading the owner for every shown room type",
            Some(i32::MAX),
        ),
    ] {
        reset(&client).await?;
        let result = one_run(&args, &owner_db.url, &client, first_night, label, threshold).await;
        slot::drop_slot(&client, SLOT).await?;
        let r = result?;
        eprintln!(
            "{label}: {:.0} takes/s, 409-after-shown {:.3}%",
            r.takes() as f64 / r.seconds,
            100.0 * r.after_shown_share()
        );
        runs.push(r);
    }
    client
        .batch_execute(&format!("DROP PUBLICATION IF EXISTS {PUBLICATION}"))
        .await?;
    println!("{}", render(&args, &runs));
    Ok(())
}

async fn load(
    client: &Client,
    args: &StaleBenchArgs,
    first_night: NaiveDate,
) -> Result<(), StaleBenchError> {
    client
        .batch_execute(&format!(
            "TRUNCATE bookings, inventory, room_types, hotels;
             INSERT INTO hotels (id, name, city) SELECT h, 'Hot ' || h, 'Lisbon' FROM generate_series(1, {h}) h;
             INSERT INTO room_types (hotel_id, id, name, max_guests)
               SELECT h, r, 'Room ' || r, 2 FROM generate_series(1, {h}) h, generate_series(1, {r}) r;
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               SELECT h, r, DATE '{first_night}' + n, {u}, 10000
               FROM generate_series(1, {h}) h, generate_series(1, {r}) r, generate_series(0, {n} + 2) n;",
            h = args.hotels,
            r = args.room_types,
            u = args.units,
            n = args.nights,
        ))
        .await?;
    Ok(())
}

/// Every unit back on sale and no bookings: both runs start from the same state.
async fn reset(client: &Client) -> Result<(), StaleBenchError> {
    client
        .batch_execute("TRUNCATE bookings; UPDATE inventory SET taken = 0 WHERE taken <> 0;")
        .await?;
    Ok(())
}

async fn one_run(
    args: &StaleBenchArgs,
    url: &str,
    client: &Client,
    first_night: NaiveDate,
    label: &'static str,
    threshold: Option<i32>,
) -> Result<Run, StaleBenchError> {
    let mut settings = Settings::defaults();
    settings.owner.url = url.to_string();
    settings.stream.slot = SLOT.to_string();
    settings.stream.publication = PUBLICATION.to_string();
    settings.stale.booking_tokens = vec![TOKEN.to_string()];
    settings.search.owner_read_connections = 8;
    if let Some(t) = threshold {
        settings.search.few_units_threshold = t;
    }
    let target = slot::current_wal_lsn(client).await?;
    let app = vacancy_service::start(settings, TcpListener::bind("127.0.0.1:0").await?)?;
    let result = async {
        wait_ready(&app, target, LOAD_LIMIT).await?;
        let hotel_ids: Vec<i64> = (1..=i64::from(args.hotels)).collect();
        let mut options = SimOptions::hot(app.addr, url, TOKEN, hotel_ids, first_night);
        options.guests = args.guests;
        options.takes_per_guest = None;
        options.duration = Some(Duration::from_secs(args.seconds));
        options.nights_span = args.nights;
        options.pause_ms = (0, 0);
        options.seed = args.seed;
        let started = Instant::now();
        let summary = simulator::run(options, CancellationToken::new()).await?;
        Ok::<_, StaleBenchError>(Run {
            label,
            summary,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
    .await;
    app.stop(Duration::from_secs(10)).await;
    result
}

fn render(args: &StaleBenchArgs, runs: &[Run]) -> String {
    let mut out = String::from("## vacancy bench stale\n\n");
    out += &format!(
        "- data: {} hotels x {} room types, {} units per night, stays of 1-2 nights starting on {} nights\n",
        args.hotels, args.room_types, args.units, args.nights
    );
    out += &format!(
        "- guests: {} racing, no pause between attempts, 0-20 ms between seeing a room and taking it, {} s per run, seed {}\n\n",
        args.guests, args.seconds, args.seed
    );
    out += "| search | takes | takes/s | taken | conflicts (409) | 409 after shown free | share of takes | conflicts by source |\n|---|---:|---:|---:|---:|---:|---:|---|\n";
    for r in runs {
        out += &format!(
            "| {} | {} | {:.0} | {} | {} | {} | {:.3}% | {:?} |\n",
            r.label,
            r.takes(),
            r.takes() as f64 / r.seconds,
            r.summary.taken,
            r.summary.conflicts,
            r.summary.conflicts_after_shown,
            100.0 * r.after_shown_share(),
            r.summary.conflicts_by_source
        );
    }
    if let [copy, owner] = runs {
        out += &format!(
            "\nthe copy adds {:+.3} percentage points of 409-after-shown over the owner floor (goal <= 0.1)\n",
            100.0 * (copy.after_shown_share() - owner.after_shown_share())
        );
    }
    out
}

//! `vacancy bench stale`: the 409s after shown the copy adds (issue 5),
//! measured paired (issue 20, part 5).
//!
//! Guests racing for few units produce 409s whatever search reads: a unit
//! free at the owner when the answer was built may be gone by the time the
//! guest takes it. Two separate runs (one from the copy, one reading the
//! owner) and a difference of their 409 shares drown that floor's
//! run-to-run noise on the figure wanted, so each take is judged on its own
//! instead:
//!
//! - Every answer carries the owner's flushed WAL position read just before
//!   the search read the copy and again after its last read
//!   (`search.stamp_owner_position`).
//! - A second logical slot (`test_decoding`) logs every owner commit to
//!   `inventory` with the end of its commit record; with the state read when
//!   the slot was made, that rebuilds the owner's rows at any position.
//! - A 409 after a showing the owner refused all the while the answer was
//!   built is the copy's (or a stale owner read's: the judge ignores the
//!   `source` label); one after a showing it agreed with all along is the
//!   race floor; one where it changed its mind inside the bracket is counted
//!   apart (`judge`).
//!
//! The copy's share (its 409s per take after a showing) is reported with a
//! Wilson 95% interval, for each variant of the settings side by side, each
//! on the same data, guests and seed, one after the other on the same owner,
//! which is reset between them.

use std::time::{Duration, Instant};

use chrono::NaiveDate;
use tokio::net::TcpListener;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::cluster::{ClusterError, ClusterOptions};
use crate::http_client::HttpClient;
use crate::owner_db::OwnerDb;
use crate::readiness::{NotReady, wait_ready};
use crate::simulator::{self, SimError, SimOptions, SimSummary};
use decoding::DecodingError;
use judge::{HistoryError, JudgedTake, NightKey, NightRow, OwnerHistory, Showing, Tally};
use vacancy_service::slot::{self, SlotError};
use vacancy_service::{AppError, Lsn, OwnerError, Settings};
use wilson::{Interval, Z95};

pub mod bypass_watch;
pub mod decoding;
pub mod judge;
pub mod wilson;

const SLOT: &str = "vacancy_stale_bench";
/// The `test_decoding` slot that logs the owner's commits during a run.
const LOG_SLOT: &str = "vacancy_stale_bench_log";
/// Reading a run's log back (a few hundred thousand lines at most).
const LOG_READ_LIMIT: Duration = Duration::from_secs(300);
/// The goal: the copy's share's upper bound, at default settings.
const GOAL: f64 = 0.001;
const PUBLICATION: &str = "vacancy_stale_bench";
const TOKEN: &str = "stale-bench-booking-token";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
const LOAD_LIMIT: Duration = Duration::from_secs(300);
/// How often the hot hotels' bypass advice is sampled during a run.
const BYPASS_SAMPLE_EVERY: Duration = Duration::from_millis(250);

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
    /// Takes at default settings, the variant the goal is about. With no
    /// copy 409 seen, 3,838 bring the upper bound to 0.1 pp; at 0.05% seen
    /// (a first run), about 20,000 do.
    #[arg(long, default_value_t = 24_000)]
    pub takes: u64,
    /// Takes for each other variant: they are there to compare, not to meet
    /// the goal.
    #[arg(long, default_value_t = 6_000)]
    pub compare_takes: u64,
    /// Takes per round: paid bookings keep their units, so the hot hotels
    /// sell out after some 5,000 takes at the default sizes; every round
    /// starts again from the same state (all units on sale, no bookings).
    /// A round also ends when no check-in night has a unit left.
    #[arg(long, default_value_t = 4_000)]
    pub round_takes: u64,
    /// A variant stops after this long even short of its takes.
    #[arg(long, default_value_t = 600)]
    pub max_seconds: u64,
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
    #[error("the owner's commit log: {0}")]
    Decoding(#[from] DecodingError),
    #[error("the owner's commit log: {0}")]
    History(#[from] HistoryError),
    #[error("reading the owner's commit log took longer than {0:?}")]
    LogTimeout(Duration),
    #[error(transparent)]
    Http(#[from] crate::http_client::HttpError),
}

/// One way to run search, side by side with the others: a name and what it
/// changes in the settings. A variant more is one line in `VARIANTS`.
pub struct Variant {
    pub name: &'static str,
    pub apply: fn(&mut Settings),
}

pub const VARIANTS: &[Variant] = &[
    Variant {
        name: "default settings",
        apply: |_| {},
    },
    Variant {
        name: "confirmed reads (fresh_reads = confirmed)",
        apply: |s| s.search.fresh_reads = vacancy_service::FreshReads::Confirmed,
    },
    Variant {
        name: "row reads (fresh_reads = rows)",
        apply: |s| s.search.fresh_reads = vacancy_service::FreshReads::Rows,
    },
    Variant {
        name: "copy only (few_units_threshold = 0)",
        apply: |s| s.search.few_units_threshold = 0,
    },
    Variant {
        name: "owner row reads for every shown room type",
        apply: |s| s.search.few_units_threshold = i32::MAX,
    },
];

/// What one variant's guests did, and what the service told about them.
struct Guests {
    summary: SimSummary,
    /// Seconds the rounds took (resets between rounds not counted).
    seconds: f64,
    bypass: bypass_watch::BypassSeen,
    /// `/v1/stale-reads`' share at the end of the run.
    stale_reads_share: Option<f64>,
}

/// One variant's outcome.
struct Run {
    label: &'static str,
    summary: SimSummary,
    seconds: f64,
    tally: Tally,
    /// Copy showings checked against the rebuilt owner at the answer's own
    /// `lsn`, and how many showed what it held there: the rebuild's own test.
    copy_checked: u64,
    copy_matched: u64,
    /// `/v1/bypass` for the hot hotels, sampled through the run.
    bypass: bypass_watch::BypassSeen,
    /// `/v1/stale-reads` at the end of the run: its share and its tracked
    /// hotels with their own share.
    stale_reads_share: Option<f64>,
}

impl Run {
    /// Takes the owner answered after a showing, per second.
    fn rate(&self) -> f64 {
        self.tally.takes as f64 / self.seconds.max(0.001)
    }

    /// The copy's 409s per take after a showing, with its interval.
    fn copys_share(&self) -> Option<(f64, Interval)> {
        share(self.tally.copys, self.tally.takes)
    }

    /// The same, counting the 409s the owner changed its mind about while
    /// the answer was built as the copy's too: the bound if all were.
    fn copys_or_changed_share(&self) -> Option<(f64, Interval)> {
        share(self.tally.copys + self.tally.changed, self.tally.takes)
    }
}

fn share(hits: u64, n: u64) -> Option<(f64, Interval)> {
    Some((hits as f64 / n as f64, wilson::wilson(hits, n, Z95)?))
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
    for (i, variant) in VARIANTS.iter().enumerate() {
        let takes = if i == 0 {
            args.takes
        } else {
            args.compare_takes
        };
        reset(&client).await?;
        let result = judged_run(&args, &owner_db.url, &client, first_night, variant, takes).await;
        // Both slots go whatever happened: a slot left behind holds WAL.
        let dropped = slot::drop_slot(&client, SLOT).await;
        let log_dropped = slot::drop_slot(&client, LOG_SLOT).await;
        let r = result?;
        dropped?;
        log_dropped?;
        eprintln!(
            "{}: {} takes after a showing at {:.0}/s, {} 409s: {} the copy's, {} races, {} changed while built, {} unjudged",
            r.label,
            r.tally.takes,
            r.rate(),
            r.tally.conflicts,
            r.tally.copys,
            r.tally.races,
            r.tally.changed,
            r.tally.unjudged,
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

/// Every unit back on sale and no bookings: every variant starts from the same state.
async fn reset(client: &Client) -> Result<(), StaleBenchError> {
    client
        .batch_execute("TRUNCATE bookings; UPDATE inventory SET taken = 0 WHERE taken <> 0;")
        .await?;
    Ok(())
}

/// One variant: the log slot and the owner's state first, then the guests,
/// then the log read back and every take judged against it.
async fn judged_run(
    args: &StaleBenchArgs,
    url: &str,
    client: &Client,
    first_night: NaiveDate,
    variant: &Variant,
    takes: u64,
) -> Result<Run, StaleBenchError> {
    // One left by a bench that died on a given owner would refuse the name.
    slot::drop_slot(client, LOG_SLOT).await?;
    client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'test_decoding')",
            &[&LOG_SLOT],
        )
        .await?;
    // Read after the slot is made, with nothing writing yet; a commit that
    // slipped in between would be in both, and replaying it changes nothing.
    let initial = owner_state(client).await?;
    let Guests {
        summary,
        seconds,
        bypass,
        stale_reads_share,
    } = one_run(args, url, client, first_night, variant, takes).await?;
    let history = OwnerHistory::new(initial, read_log(client).await?)?;
    let mut tally = Tally::default();
    let (mut copy_checked, mut copy_matched) = (0, 0);
    for take in &summary.take_records {
        let showing = Showing {
            hotel_id: take.hotel_id,
            room_type_id: take.room_type_id,
            check_in: take.check_in,
            check_out: take.check_out,
            rooms: take.rooms,
        };
        tally.add(
            &history,
            &JudgedTake {
                showing,
                moment: take.owner_position,
                taken: take.taken,
            },
        );
        // The copy's numbers are the owner's at the answer's lsn: if the
        // rebuilt owner disagrees there, the log or its reading is wrong.
        if let ("copy", Some(lsn)) = (take.source.as_str(), take.answer_lsn) {
            copy_checked += 1;
            copy_matched += u64::from(history.min_free(&showing, lsn) == Some(take.free_units));
        }
    }
    Ok(Run {
        label: variant.name,
        summary,
        seconds,
        tally,
        copy_checked,
        copy_matched,
        bypass,
        stale_reads_share,
    })
}

/// Every `inventory` row as it stands.
async fn owner_state(client: &Client) -> Result<Vec<(NightKey, NightRow)>, StaleBenchError> {
    let rows = client
        .query(
            "SELECT hotel_id, room_type_id, night, total, taken, sell_limit FROM inventory",
            &[],
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok((
                NightKey {
                    hotel_id: r.try_get(0)?,
                    room_type_id: r.try_get(1)?,
                    night: r.try_get(2)?,
                },
                NightRow {
                    total: r.try_get(3)?,
                    taken: r.try_get(4)?,
                    sell_limit: r.try_get(5)?,
                },
            ))
        })
        .collect()
}

/// The commits the log slot saw, consumed from it.
async fn read_log(client: &Client) -> Result<Vec<judge::Commit>, StaleBenchError> {
    let read = client.query(
        "SELECT lsn, data FROM pg_logical_slot_get_changes($1, NULL, NULL,
             'include-xids', '1', 'include-timestamp', '1')",
        &[&LOG_SLOT],
    );
    let rows = tokio::time::timeout(LOG_READ_LIMIT, read)
        .await
        .map_err(|_| StaleBenchError::LogTimeout(LOG_READ_LIMIT))??;
    let lines = rows
        .iter()
        .map(|r| {
            let lsn: tokio_postgres::types::PgLsn = r.try_get(0)?;
            let data: &str = r.try_get(1)?;
            Ok((Lsn::from(lsn), data))
        })
        .collect::<Result<Vec<_>, tokio_postgres::Error>>()?;
    Ok(decoding::commits(lines)?)
}

/// The guests against the service set up as `variant` says, in rounds of
/// `--round-takes` until `takes`, with the bypass advice sampled meanwhile.
async fn one_run(
    args: &StaleBenchArgs,
    url: &str,
    client: &Client,
    first_night: NaiveDate,
    variant: &Variant,
    takes: u64,
) -> Result<Guests, StaleBenchError> {
    let mut settings = Settings::defaults();
    settings.owner.url = url.to_string();
    settings.stream.slot = SLOT.to_string();
    settings.stream.publication = PUBLICATION.to_string();
    settings.stale.booking_tokens = vec![TOKEN.to_string()];
    settings.search.owner_read_connections = 8;
    settings.search.stamp_owner_position = true;
    (variant.apply)(&mut settings);
    let target = slot::current_wal_lsn(client).await?;
    let app = vacancy_service::start(settings, TcpListener::bind("127.0.0.1:0").await?)?;
    let result = async {
        wait_ready(&app, target, LOAD_LIMIT).await?;
        let hotel_ids: Vec<i64> = (1..=i64::from(args.hotels)).collect();
        let http = HttpClient::new(app.addr, Duration::from_secs(10))?;
        let watch_over = CancellationToken::new();
        let watcher = tokio::spawn(bypass_watch::watch(
            http.clone(),
            hotel_ids.clone(),
            first_night,
            BYPASS_SAMPLE_EVERY,
            watch_over.clone(),
        ));
        let guests = args.guests.max(1) as u64;
        let limit = Duration::from_secs(args.max_seconds);
        let mut summary = SimSummary::default();
        let mut seconds = 0.0;
        let mut round = 0u64;
        while (summary.take_records.len() as u64) < takes && seconds < limit.as_secs_f64() {
            if round > 0 {
                // Between rounds nobody searches, and the reset is one more
                // owner commit in the log like any other.
                reset(client).await?;
            }
            let left = takes - summary.take_records.len() as u64;
            let mut options = SimOptions::hot(app.addr, url, TOKEN, hotel_ids.clone(), first_night);
            options.guests = args.guests;
            options.takes_per_guest = Some(left.min(args.round_takes.max(1)).div_ceil(guests));
            options.duration = Some(limit.saturating_sub(Duration::from_secs_f64(seconds)));
            options.nights_span = args.nights;
            options.pause_ms = (0, 0);
            // A seed per round: attempt ids carry it, so no two rounds
            // report the same attempt to the service.
            options.seed = args.seed.wrapping_add(round.wrapping_mul(1_000_003));
            options.record_takes = true;
            let started = Instant::now();
            let round_over = CancellationToken::new();
            let watcher = tokio::spawn(end_when_sold_out(
                url.to_string(),
                first_night,
                args.nights,
                round_over.clone(),
            ));
            let guests_done = simulator::run(options, round_over.clone()).await;
            round_over.cancel();
            // The watcher only ever cancels; a failed one changes nothing.
            let _ = watcher.await;
            summary.merge(&guests_done?);
            seconds += started.elapsed().as_secs_f64();
            round += 1;
        }
        watch_over.cancel();
        let bypass = watcher.await.unwrap_or_default();
        let stale_reads_share = match http.get("/v1/stale-reads").await {
            Ok(r) if r.status == 200 => r.json()["share"].as_f64(),
            _ => None,
        };
        Ok::<_, StaleBenchError>(Guests {
            summary,
            seconds,
            bypass,
            stale_reads_share,
        })
    }
    .await;
    app.stop(Duration::from_secs(10)).await;
    result
}

/// Ends a round once no check-in night has a unit left for 1.5 s in a row:
/// past that the guests only search and find nothing, until the time limit.
/// Holds come and go within milliseconds, hence more than one look.
async fn end_when_sold_out(
    url: String,
    first_night: NaiveDate,
    nights: u32,
    round_over: CancellationToken,
) {
    const LOOKS: u32 = 3;
    let Ok(client) = vacancy_service::connect(&url, CONNECT_TIMEOUT).await else {
        return;
    };
    let last_check_in = first_night + chrono::Days::new(u64::from(nights.max(1)));
    let mut empty_looks = 0;
    while empty_looks < LOOKS {
        tokio::select! {
            _ = round_over.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        let free = tokio::time::timeout(
            CONNECT_TIMEOUT,
            client.query_one(
                "SELECT count(*) FROM inventory
                 WHERE night >= $1 AND night < $2 AND coalesce(sell_limit, total) - taken > 0",
                &[&first_night, &last_check_in],
            ),
        )
        .await;
        empty_looks = match free {
            Ok(Ok(row)) if row.try_get::<_, i64>(0).is_ok_and(|n| n == 0) => empty_looks + 1,
            Ok(Ok(_)) => 0,
            // The owner did not answer: let the takes or the time limit end the round.
            _ => return,
        };
    }
    round_over.cancel();
}

fn render(args: &StaleBenchArgs, runs: &[Run]) -> String {
    let pct = |x: f64| format!("{:.3}%", 100.0 * x);
    let with_interval = |s: Option<(f64, Interval)>| match s {
        Some((p, i)) => format!("{} [{}, {}]", pct(p), pct(i.low), pct(i.high)),
        None => "-".to_string(),
    };
    let mut out = String::from("## vacancy bench stale (paired)\n\n");
    out += &format!(
        "- data: {} hotels x {} room types, {} units per night, stays of 1-2 nights starting on {} nights\n",
        args.hotels, args.room_types, args.units, args.nights
    );
    out += &format!(
        "- guests: {} racing, no pause between attempts, 0-20 ms between seeing a room and taking it; {} takes at default settings, {} for the others, in rounds of {} from the same state (at most {} s per variant), seed {}\n",
        args.guests, args.takes, args.compare_takes, args.round_takes, args.max_seconds, args.seed
    );
    out += "- each take is judged against the owner's commits at the moment its answer was built (the answer's owner_position bracket); the copy's share is its 409s per take after a showing, with a Wilson 95% interval\n\n";
    out += "| search | takes after a showing | takes/s | 409s after a showing (share) | the copy's 409s | race 409s | changed while built | unjudged | the copy's share [95%] | counting changed as the copy's [95%] | 409s after a copy showing (service's stale reads) |\n|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|\n";
    for r in runs {
        let t = &r.tally;
        out += &format!(
            "| {} | {} | {:.0} | {} ({}) | {} | {} | {} | {} | {} | {} | {} |\n",
            r.label,
            t.takes,
            r.rate(),
            t.conflicts,
            share(t.conflicts, t.takes).map_or("-".to_string(), |(p, _)| pct(p)),
            t.copys,
            t.races,
            t.changed,
            t.unjudged,
            with_interval(r.copys_share()),
            with_interval(r.copys_or_changed_share()),
            r.summary.stale_reads,
        );
    }
    out += "\n/v1/bypass for room type 1 of every hot hotel, asked every 250 ms through each run, and /v1/stale-reads at its end:\n";
    for r in runs {
        out += &format!(
            "- {}: {} rounds; {} of {} hotels flagged hotel_conflicts at some point, {} flips; stale-read share in the window at the end {}; {} failed asks\n",
            r.label,
            r.bypass.rounds,
            r.bypass.flagged.len(),
            args.hotels,
            r.bypass.flips,
            r.stale_reads_share.map_or("-".to_string(), pct),
            r.bypass.failed,
        );
    }
    out += "\nthe rebuilt owner against each copy showing at the answer's own lsn (copy showings that match / checked):";
    for r in runs {
        out += &format!(" {} {}/{};", r.label, r.copy_matched, r.copy_checked);
    }
    out += "\n";
    if let Some(default) = runs.first() {
        out += &goal_line(default);
    }
    out
}

/// Whether the first variant (default settings) meets the goal, and the
/// takes the goal needs at the share seen.
fn goal_line(r: &Run) -> String {
    let Some((p, interval)) = r.copys_share() else {
        return "\nno takes were judged: the goal cannot be checked\n".to_string();
    };
    let needed = match wilson::trials_needed(p, GOAL, Z95) {
        Some(n) => format!("{n} takes needed at the share seen"),
        None => "no number of takes would do at the share seen".to_string(),
    };
    format!(
        "\n{}: the copy's 409s are {:.3}% of takes after a showing, upper 95% bound {:.3}% (goal: at most {:.1}%, {}); {}, {} used\n",
        r.label,
        100.0 * p,
        100.0 * interval.high,
        100.0 * GOAL,
        if interval.high <= GOAL {
            "met"
        } else {
            "not met"
        },
        needed,
        r.tally.takes,
    )
}

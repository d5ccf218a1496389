//! `vacancy bench latency`: commit-to-visible latency of holds under a
//! steady pgbench load of multi-night holds.

use std::time::{Duration, Instant};

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::net::TcpListener;

use vacancy_service::slot;
use vacancy_service::{CalendarKey, ReadModel};

use super::{
    BenchError, CONNECT_TIMEOUT, LOAD_LIMIT, Owner, POLL, VACANCY_SLOT, bench_settings,
    print_header, run_tool,
};
use crate::measure::Latencies;
use crate::readiness::wait_until;

pub(super) struct LatencyOptions {
    pub(super) rate: u32,
    pub(super) seconds: u32,
    pub(super) clients: u32,
    pub(super) probe_interval: Duration,
}

/// The guide's hold as one statement, so pgbench can drive it: lock the
/// nights in date order, give up (-1) if any is full, else insert the booking
/// and take one unit per night. Returns the first night's new `taken`, which
/// the probe waits for in the copy (`taken` only grows in this bench).
const HOLD_FUNCTION: &str = "
CREATE OR REPLACE FUNCTION vacancy_bench_hold(p_hotel bigint, p_room_type bigint, p_in date, p_nights int)
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
    free_nights int;
    first_taken int;
BEGIN
    SELECT count(*) INTO free_nights FROM (
        SELECT 1 FROM inventory
        WHERE hotel_id = p_hotel AND room_type_id = p_room_type
          AND night >= p_in AND night < p_in + p_nights
          AND coalesce(sell_limit, total) - taken >= 1
        ORDER BY night FOR UPDATE) locked;
    IF free_nights < p_nights THEN
        RETURN -1;
    END IF;
    INSERT INTO bookings (id, hotel_id, room_type_id, check_in, check_out, rooms, status, expires_at)
    VALUES (gen_random_uuid()::text, p_hotel, p_room_type, p_in, p_in + p_nights, 1, 'held',
            clock_timestamp() + interval '15 minutes');
    UPDATE inventory SET taken = taken + 1
    WHERE hotel_id = p_hotel AND room_type_id = p_room_type
      AND night >= p_in AND night < p_in + p_nights;
    SELECT taken INTO first_taken FROM inventory
    WHERE hotel_id = p_hotel AND room_type_id = p_room_type AND night = p_in;
    RETURN first_taken;
END $$";

/// Nights per hold: multi-night stays, as guests book them.
const HOLD_NIGHTS: (i32, i32) = (2, 4);

pub(super) async fn run(owner: &Owner, options: &LatencyOptions) -> Result<(), BenchError> {
    let client = vacancy_service::connect(owner.url(), CONNECT_TIMEOUT).await?;
    print_header("latency", owner, &client).await?;
    slot::drop_slot(&client, VACANCY_SLOT).await?;
    client.batch_execute(HOLD_FUNCTION).await?;
    let s = owner.shape;
    let last_start = (s.nights - i64::from(HOLD_NIGHTS.1)).max(0);

    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let app = vacancy_service::start(bench_settings(owner.url()), listener)?;
    let model = app.model.clone();
    let started = Instant::now();
    wait_until(
        "the initial snapshot",
        LOAD_LIMIT,
        POLL,
        &app.status,
        || model.freshness.is_loaded(),
    )
    .await?;
    eprintln!("snapshot loaded in {:.1}s", started.elapsed().as_secs_f64());

    let script = format!(
        "\\set h random(1, {})\n\\set r random(1, {})\n\\set d random(0, {last_start})\n\
         \\set n random({}, {})\n\
         SELECT vacancy_bench_hold(:h, :r, DATE '{}' + :d, :n);\n",
        s.hotels, s.room_types, HOLD_NIGHTS.0, HOLD_NIGHTS.1, s.first_night
    );
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("hold.sql");
    std::fs::write(&path, script)?;
    let mut pgbench = owner.tool("pgbench");
    pgbench
        .args(["-n", "-f"])
        .arg(&path)
        .args(["-R", &options.rate.to_string()])
        .args(["-T", &options.seconds.to_string()])
        .args(["-c", &options.clients.to_string()])
        .args(["-j", &options.clients.min(2).to_string()])
        .arg(owner.url());
    let background = tokio::spawn(run_tool(pgbench, "pgbench"));

    // Probes start once pgbench is connected and running at its rate, and
    // stop before it winds down, so every sample is taken under the load.
    let probe_window = Duration::from_secs(u64::from(options.seconds)).saturating_sub(2 * SETTLE);
    tokio::time::sleep(SETTLE).await;
    let samples = probe(owner, &model, options.probe_interval, probe_window).await?;
    let out = background.await.map_err(std::io::Error::other)??;
    app.stop(Duration::from_secs(10)).await;

    let visible = Latencies::from_durations(&samples.visible);
    let statement = Latencies::from_durations(&samples.statement);
    // NaN prints as "NaN ms": a run too short for any probe says so in the table.
    let ms = |figure: Option<f64>| figure.unwrap_or(f64::NAN);
    println!(
        "method:   a probe task holds {}-{} nights every {:?} through the same function, notes the \
         instant its autocommit statement returned, then polls the copy every {:?} until the first \
         night's `taken` reaches the value the hold returned; pgbench runs the background holds",
        HOLD_NIGHTS.0, HOLD_NIGHTS.1, options.probe_interval, POLL
    );
    println!(
        "load:     pgbench -R {} -T {} -c {} (one `SELECT vacancy_bench_hold(...)` per transaction):",
        options.rate, options.seconds, options.clients
    );
    for line in pgbench_summary(&out) {
        println!("          {line}");
    }
    println!();
    println!(
        "| samples | p50 | p99 (goal <= 25 ms) | max | not visible in 10 s | probe holds full | probe statement p50 |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {:.1} ms | {:.1} ms | {:.1} ms | {} | {} | {:.1} ms |",
        visible.len(),
        ms(visible.percentile(0.50)),
        ms(visible.percentile(0.99)),
        ms(visible.max()),
        samples.timeouts,
        samples.full,
        ms(statement.percentile(0.50)),
    );
    Ok(())
}

/// Time for pgbench to connect its clients and settle at its rate.
const SETTLE: Duration = Duration::from_secs(1);
const VISIBLE_LIMIT: Duration = Duration::from_secs(10);

#[derive(Default)]
struct ProbeSamples {
    visible: Vec<Duration>,
    statement: Vec<Duration>,
    timeouts: u64,
    full: u64,
}

async fn probe(
    owner: &Owner,
    model: &ReadModel,
    interval: Duration,
    window: Duration,
) -> Result<ProbeSamples, BenchError> {
    let s = owner.shape;
    let client = vacancy_service::connect(owner.url(), CONNECT_TIMEOUT).await?;
    let hold = client
        .prepare("SELECT vacancy_bench_hold($1, $2, $3, $4)")
        .await?;
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut ticker = tokio::time::interval(interval.max(Duration::from_millis(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut samples = ProbeSamples::default();
    let started = Instant::now();
    let last_start = (s.nights - i64::from(HOLD_NIGHTS.1)).max(0);
    while started.elapsed() < window {
        ticker.tick().await;
        let key = CalendarKey {
            hotel_id: rng.random_range(1..=s.hotels),
            room_type_id: rng.random_range(1..=s.room_types),
        };
        let night = s.first_night + chrono::Days::new(rng.random_range(0..=last_start) as u64);
        let nights: i32 = rng.random_range(HOLD_NIGHTS.0..=HOLD_NIGHTS.1);
        let sent = Instant::now();
        let taken: i32 = client
            .query_one(&hold, &[&key.hotel_id, &key.room_type_id, &night, &nights])
            .await?
            .get(0);
        let committed = Instant::now();
        samples.statement.push(committed - sent);
        if taken < 0 {
            samples.full += 1;
            continue;
        }
        let visible = || {
            model
                .read()
                .calendars
                .get(&key)
                .and_then(|c| c.get(night))
                .is_some_and(|n| n.taken >= taken)
        };
        loop {
            if visible() {
                samples.visible.push(committed.elapsed());
                break;
            }
            if committed.elapsed() > VISIBLE_LIMIT {
                samples.timeouts += 1;
                break;
            }
            tokio::time::sleep(POLL).await;
        }
    }
    Ok(samples)
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

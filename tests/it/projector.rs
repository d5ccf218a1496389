//! The projector against a real owner: snapshot, stream, atomic apply, acks,
//! and convergence through faults. Every comparison is the whole copy against
//! the owner's tables, row for row, once the copy has applied the owner's
//! current WAL insert position.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::NaiveDate;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio_postgres::Client;
use tokio_postgres::types::PgLsn;
use vacancy_lab::cluster::{ClusterOptions, StopMode};
use vacancy_lab::ops::{self, HoldRequest};
use vacancy_service::slot;
use vacancy_service::{App, CalendarKey, Lsn, NightCounts, ReadModel, Settings};

use crate::support::{TestOwner, create_publication, least_privilege_role, wait_for};

const HOTELS: i64 = 6;
const ROOM_TYPES: i64 = 3;
const NIGHTS: i64 = 30;

fn first_night() -> NaiveDate {
    NaiveDate::from_ymd_opt(2030, 1, 1).unwrap()
}

/// A small fixed inventory, loaded with plain SQL.
pub(crate) async fn load_inventory(client: &Client) {
    client
        .batch_execute(&format!(
            "INSERT INTO hotels (id, name, city, country, stars, amenities)
               SELECT h, 'Hotel ' || h, CASE WHEN h % 2 = 0 THEN 'Lisbon' ELSE 'Porto' END, 'PT', 1 + h % 5,
                      ARRAY['wifi', 'pool']
               FROM generate_series(1, {HOTELS}) h;
             INSERT INTO room_types (hotel_id, id, name, max_guests)
               SELECT h, r, 'Room ' || r, r + 1 FROM generate_series(1, {HOTELS}) h, generate_series(1, {ROOM_TYPES}) r;
             INSERT INTO inventory (hotel_id, room_type_id, night, total, taken, sell_limit, price_cents)
               SELECT h, r, DATE '2030-01-01' + n, 3 + (h + r) % 4, 0,
                      CASE WHEN n % 7 = 0 THEN 6 + (h + r) % 4 END, 10000 + r * 1000
               FROM generate_series(1, {HOTELS}) h, generate_series(1, {ROOM_TYPES}) r,
                    generate_series(0, {NIGHTS} - 1) n;"
        ))
        .await
        .expect("load inventory");
}

pub(crate) fn settings_for(owner: &TestOwner) -> Settings {
    let mut s = Settings::defaults();
    s.owner.url = owner.url.clone();
    s.stream.reconnect_min_ms = 50;
    s.stream.reconnect_max_ms = 500;
    s.stream.slot_watch_interval_ms = 200;
    s.stream.heartbeat_interval_ms = 200;
    s
}

async fn start_app(settings: Settings) -> App {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    vacancy_service::start(settings, listener).expect("start vacancy")
}

/// Waits until the copy has applied everything committed on the owner so far.
async fn caught_up(model: &ReadModel, client: &Client) -> Lsn {
    let target = slot::current_wal_lsn(client).await.expect("current lsn");
    wait_for(
        "the copy to apply the owner's current LSN",
        Duration::from_secs(60),
        || async {
            (model.freshness.is_loaded() && model.freshness.applied() >= target).then_some(())
        },
    )
    .await;
    target
}

pub(crate) type Rows = BTreeMap<(i64, i64, NaiveDate), NightCounts>;

/// The owner's inventory the copy holds: nights of years 1900 to 2199
/// (`calendar::holds_night`; `infinity` would not even read as a `NaiveDate`).
pub(crate) async fn owner_inventory(client: &Client) -> Rows {
    client
        .query(
            "SELECT hotel_id, room_type_id, night, total, taken, sell_limit, price_cents FROM inventory
             WHERE night BETWEEN DATE '1900-01-01' AND DATE '2199-12-31'",
            &[],
        )
        .await
        .unwrap()
        .into_iter()
        .map(|r| {
            (
                (r.get(0), r.get(1), r.get(2)),
                NightCounts {
                    total: r.get(3),
                    taken: r.get(4),
                    sell_limit: r.get(5),
                    price_cents: r.get(6),
                },
            )
        })
        .collect()
}

pub(crate) fn copy_inventory(model: &ReadModel) -> Rows {
    let t = model.read();
    let mut rows = Rows::new();
    for (key, cal) in t.calendars.iter() {
        for (night, counts) in cal.iter() {
            rows.insert((key.hotel_id, key.room_type_id, night), counts);
        }
    }
    rows
}

/// Asserts the copy equals the owner, row for row, in all three tables.
pub(crate) async fn assert_converged(model: &ReadModel, client: &Client) {
    let at = caught_up(model, client).await;
    let owner_rows = owner_inventory(client).await;
    let copy_rows = copy_inventory(model);
    let differing: Vec<_> = owner_rows
        .iter()
        .filter(|(k, v)| copy_rows.get(*k) != Some(*v))
        .map(|(k, _)| *k)
        .chain(
            copy_rows
                .keys()
                .filter(|k| !owner_rows.contains_key(*k))
                .copied(),
        )
        .take(10)
        .collect();
    assert!(
        differing.is_empty(),
        "inventory differs at {at} ({} owner rows, {} copy rows), first keys: {differing:?}",
        owner_rows.len(),
        copy_rows.len()
    );
    let hotels: BTreeMap<i64, (String, String, Option<i16>, Vec<String>)> = client
        // Flattened by the owner itself, as `= ANY` reads an array of any
        // dimensions (tokio-postgres's `Vec` refuses more than one).
        .query(
            "SELECT id, name, city, stars,
                    ARRAY(SELECT a FROM unnest(amenities) a WHERE a IS NOT NULL)
             FROM hotels",
            &[],
        )
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(4))))
        .collect();
    let room_types: BTreeMap<(i64, i64), (String, i16)> = client
        .query("SELECT hotel_id, id, name, max_guests FROM room_types", &[])
        .await
        .unwrap()
        .into_iter()
        .map(|r| ((r.get(0), r.get(1)), (r.get(2), r.get(3))))
        .collect();
    let t = model.read();
    let copy_hotels: BTreeMap<i64, (String, String, Option<i16>, Vec<String>)> = t
        .hotels
        .values()
        .map(|h| {
            (
                h.id,
                (h.name.clone(), h.city.clone(), h.stars, h.amenities.clone()),
            )
        })
        .collect();
    let copy_room_types: BTreeMap<(i64, i64), (String, i16)> = t
        .room_types
        .values()
        .map(|r| ((r.hotel_id, r.id), (r.name.clone(), r.max_guests)))
        .collect();
    assert_eq!(copy_hotels, hotels, "hotels differ at {at}");
    assert_eq!(copy_room_types, room_types, "room types differ at {at}");
}

/// One random owner operation, as the booking site would run it.
async fn random_operation(client: &mut Client, rng: &mut ChaCha8Rng, worker: usize, step: usize) {
    // Ids stay unique across runs: the worker number carries the run.
    let hotel = rng.random_range(1..=HOTELS);
    let room_type = rng.random_range(1..=ROOM_TYPES);
    let start = first_night() + chrono::Days::new(rng.random_range(0..NIGHTS as u64 - 4));
    match rng.random_range(0..100) {
        0..=44 => {
            let nights = rng.random_range(1..=4);
            let req = HoldRequest {
                booking_id: format!("b-{worker}-{step}"),
                hotel_id: hotel,
                room_type_id: room_type,
                check_in: start,
                check_out: start + chrono::Days::new(nights),
                rooms: rng.random_range(1..=2),
                hold_for: Duration::from_millis(rng.random_range(1..400)),
            };
            ops::hold(client, &req).await.expect("hold");
        }
        45..=59 => {
            let id = format!("b-{worker}-{}", rng.random_range(0..=step));
            ops::confirm(client, &id).await.expect("confirm");
        }
        60..=69 => {
            let id = format!("b-{worker}-{}", rng.random_range(0..=step));
            ops::cancel(client, &id).await.expect("cancel");
        }
        70..=79 => {
            ops::sweep(client, 50).await.expect("sweep");
        }
        80..=86 => {
            let total = rng.random_range(0..8);
            ops::set_capacity(
                client,
                hotel,
                room_type,
                start,
                start + chrono::Days::new(2),
                Some(total),
                None,
            )
            .await
            .expect("set capacity");
        }
        87..=89 => {
            let through = first_night() + chrono::Days::new(NIGHTS as u64 + rng.random_range(0..5));
            ops::open_horizon(client, through)
                .await
                .expect("open horizon");
        }
        90..=92 => {
            // A past night leaves the inventory.
            client
                .execute(
                    "DELETE FROM inventory WHERE hotel_id = $1 AND night = (SELECT min(night) FROM inventory WHERE hotel_id = $1)",
                    &[&hotel],
                )
                .await
                .expect("delete past night");
        }
        93..=95 => {
            // A new hotel with a room type, or a changed one.
            let id = 1000 + (worker * 1_000 + step) as i64;
            let tx = client.transaction().await.unwrap();
            tx.execute(
                "INSERT INTO hotels (id, name, city, amenities) VALUES ($1, 'New', 'Faro', '{spa}')",
                &[&id],
            )
            .await
            .unwrap();
            tx.execute(
                "INSERT INTO room_types (hotel_id, id, name, max_guests) VALUES ($1, 1, 'Suite', 4)",
                &[&id],
            )
            .await
            .unwrap();
            tx.commit().await.unwrap();
        }
        96..=97 => {
            client
                .execute(
                    "UPDATE hotels SET name = name || '*', amenities = amenities || 'gym'::text, stars = 1 + (coalesce(stars, 0) + 1) % 5 WHERE id = $1",
                    &[&hotel],
                )
                .await
                .expect("change hotel");
        }
        _ => {
            // A key change: the night moves (old key must vanish from the copy).
            client
                .execute(
                    "UPDATE inventory SET night = night + 1000 WHERE hotel_id = $1 AND room_type_id = $2 AND night = $3 AND taken = 0",
                    &[&hotel, &room_type, &start],
                )
                .await
                .expect("move night");
        }
    }
}

/// Runs `workers` concurrent clients doing `steps` random operations each.
pub(crate) async fn run_workload(owner: &TestOwner, seed: u64, workers: usize, steps: usize) {
    let mut tasks = Vec::new();
    // Each run gets its own worker numbers, so booking and hotel ids never repeat.
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let base = RUNS.fetch_add(workers, Ordering::Relaxed);
    for worker in base..base + workers {
        let mut client = owner.client().await;
        tasks.push(tokio::spawn(async move {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (worker as u64) << 32);
            for step in 0..steps {
                random_operation(&mut client, &mut rng, worker, step).await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("worker");
    }
}

pub(crate) fn test_seed() -> u64 {
    let seed = std::env::var("VACANCY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    eprintln!("workload seed {seed} (replay with VACANCY_TEST_SEED={seed})");
    seed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converges_after_random_concurrent_operations() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let app = start_app(settings_for(&owner)).await;
    assert_converged(&app.model, &client).await;
    let seed = test_seed();
    for round in 0..3 {
        run_workload(&owner, seed.wrapping_add(round), 4, 60).await;
        assert_converged(&app.model, &client).await;
    }
    app.stop(Duration::from_secs(5)).await;
}

/// The owner's role prints dates day first and floats rounded (its own
/// `ALTER ROLE ... SET`): the replication session sets the formats decode
/// reads (`owner::endpoint`), so nights still decode through the stream and
/// a coordinate keeps every bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converges_when_the_owner_role_prints_values_its_own_way() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    client
        .batch_execute(
            "ALTER ROLE CURRENT_USER SET datestyle = 'SQL, DMY';
             ALTER ROLE CURRENT_USER SET extra_float_digits = 0;",
        )
        .await
        .unwrap();
    load_inventory(&client).await;
    let app = start_app(settings_for(&owner)).await;
    assert_converged(&app.model, &client).await;
    client
        .batch_execute(
            "UPDATE inventory SET taken = 1 WHERE night = DATE '2030-01-13';
             INSERT INTO hotels (id, name, city, latitude, longitude)
               VALUES (900, 'Far', 'Faro', 0.1::float8 + 0.2::float8, -7.930440466393123);",
        )
        .await
        .unwrap();
    assert_converged(&app.model, &client).await;
    let row = client
        .query_one("SELECT latitude, longitude FROM hotels WHERE id = 900", &[])
        .await
        .unwrap();
    let owner_coordinates: (Option<f64>, Option<f64>) = (row.get(0), row.get(1));
    let copy = app
        .model
        .read()
        .hotels
        .get(&900)
        .map(|h| (h.latitude, h.longitude));
    assert_eq!(copy, Some(owner_coordinates), "bit for bit");
    app.stop(Duration::from_secs(5)).await;
}

/// Nights no guest can stay (`infinity`, `-infinity`, BC, five-digit
/// years) stopped every copy of the owner: the snapshot refused them, the
/// stream could not decode them and the TTL re-read panicked on them. An
/// open-ended `9999-12-31` made each write to its hotel copy megabytes and
/// every checkpoint fail. They are left out of the copy and counted, on
/// every path, and the rest of the copy converges, through key changes onto
/// and off such nights too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nights_no_guest_can_stay_are_left_out_and_stop_nothing() {
    let not_held = |path: &str| {
        vacancy_service::metrics::NIGHTS_NOT_HELD
            .with_label_values(&[path])
            .get()
    };
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    client
        .batch_execute(
            "INSERT INTO inventory (hotel_id, room_type_id, night, total, taken)
               VALUES (1, 1, 'infinity', 5, 0), (1, 1, '-infinity', 5, 0),
                      (1, 2, '0044-03-15 BC', 5, 0), (1, 3, '10000-01-01', 5, 0),
                      (1, 2, '9999-12-31', 5, 0), (1, 3, '1899-12-31', 5, 0);",
        )
        .await
        .unwrap();
    let snapshot_before = not_held("snapshot");
    let mut settings = settings_for(&owner);
    // Every calendar is re-read from the owner within seconds.
    settings.model.ttl_secs = 2;
    let app = start_app(settings).await;
    assert_converged(&app.model, &client).await;
    assert!(
        not_held("snapshot") >= snapshot_before + 6,
        "the snapshot counts the six nights it left out"
    );
    let stream_before = not_held("stream");
    client
        .batch_execute(
            "INSERT INTO inventory (hotel_id, room_type_id, night, total, taken)
               VALUES (2, 1, 'infinity', 4, 1), (2, 2, '20000-06-01', 4, 1),
                      (2, 3, '9999-12-31', 4, 1);
             UPDATE inventory SET night = DATE '2030-03-01'
               WHERE hotel_id = 1 AND room_type_id = 1 AND night = 'infinity';
             UPDATE inventory SET night = 'infinity'
               WHERE hotel_id = 3 AND room_type_id = 1 AND night = DATE '2030-01-05';
             UPDATE inventory SET taken = 2 WHERE night = '10000-01-01';
             DELETE FROM inventory WHERE night = '0044-03-15 BC';
             UPDATE inventory SET taken = 1 WHERE hotel_id = 4 AND night = DATE '2030-01-02';",
        )
        .await
        .unwrap();
    assert_converged(&app.model, &client).await;
    let copy = copy_inventory(&app.model);
    assert!(copy.contains_key(&(1, 1, NaiveDate::from_ymd_opt(2030, 3, 1).unwrap())));
    assert!(!copy.contains_key(&(3, 1, NaiveDate::from_ymd_opt(2030, 1, 5).unwrap())));
    assert!(
        not_held("stream") >= stream_before + 7,
        "three inserts, the key moved onto and off infinity, the update and the delete"
    );
    wait_for(
        "a TTL re-read over a calendar with an infinity night",
        Duration::from_secs(30),
        || async { (not_held("reread") > 0).then_some(()) },
    )
    .await;
    assert!(app.model.freshness.is_loaded());
    assert_converged(&app.model, &client).await;
    // The re-reads found nothing to repair: the snapshot and the stream left
    // out the same nights the re-read leaves out, and put in all the others.
    assert_eq!(app.refresh.repaired.load(Ordering::Relaxed), 0);
    app.stop(Duration::from_secs(5)).await;
}

/// Injects `fault` in the middle of a workload and checks convergence after.
async fn converges_through(fault: &str) {
    let mut owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let settings = settings_for(&owner);
    let app = start_app(settings.clone()).await;
    caught_up(&app.model, &client).await;
    let seed = test_seed();
    run_workload(&owner, seed, 3, 30).await;
    let app = match fault {
        "walsender terminated" => {
            let n = client
                .execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'vacancy' AND active_pid IS NOT NULL",
                    &[],
                )
                .await
                .unwrap();
            assert_eq!(n, 1, "one walsender to terminate");
            app
        }
        "owner restarted fast" | "owner restarted immediate" => {
            let mode = if fault.ends_with("fast") {
                StopMode::Fast
            } else {
                StopMode::Immediate
            };
            drop(client);
            tokio::task::block_in_place(|| owner.cluster.restart(mode)).expect("restart owner");
            app
        }
        "slot dropped" => {
            slot::drop_slot(&client, "vacancy")
                .await
                .expect("drop slot");
            app
        }
        "truncate and reload" => {
            client
                .batch_execute("BEGIN; CREATE TEMP TABLE saved AS SELECT * FROM inventory; TRUNCATE inventory; COMMIT;")
                .await
                .unwrap();
            run_workload(&owner, seed ^ 7, 1, 5).await;
            client
                .batch_execute("INSERT INTO inventory SELECT * FROM saved ON CONFLICT DO NOTHING")
                .await
                .unwrap();
            app
        }
        "column added" => {
            client
                .batch_execute("ALTER TABLE inventory ADD COLUMN note text DEFAULT 'x'; ALTER TABLE hotels ADD COLUMN rating int")
                .await
                .unwrap();
            client
                .batch_execute("UPDATE inventory SET note = 'y', taken = 0 WHERE night = DATE '2030-01-05' AND taken = 0")
                .await
                .unwrap();
            app
        }
        "vacancy restarted" => {
            app.stop(Duration::from_secs(5)).await;
            start_app(settings.clone()).await
        }
        other => panic!("unknown fault {other}"),
    };
    let client = owner.client().await;
    run_workload(&owner, seed ^ 99, 3, 30).await;
    assert_converged(&app.model, &client).await;
    app.stop(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converges_through_walsender_termination() {
    converges_through("walsender terminated").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converges_through_owner_fast_restart() {
    converges_through("owner restarted fast").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converges_through_owner_immediate_restart() {
    converges_through("owner restarted immediate").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converges_through_dropped_slot() {
    converges_through("slot dropped").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converges_through_truncate_and_reload() {
    converges_through("truncate and reload").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converges_through_added_columns() {
    converges_through("column added").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converges_through_a_restart_of_vacancy() {
    converges_through("vacancy restarted").await;
}

/// A reader polling during three-night holds never sees one partly applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_never_see_half_a_hold() {
    let owner = TestOwner::start().await;
    let mut client = owner.client().await;
    client
        .batch_execute(
            "INSERT INTO hotels (id, name, city) VALUES (1, 'A', 'Lisbon');
             INSERT INTO room_types VALUES (1, 1, 'Double', 2);
             INSERT INTO inventory (hotel_id, room_type_id, night, total)
               SELECT 1, 1, DATE '2030-01-01' + n, 1000 FROM generate_series(0, 2) n;",
        )
        .await
        .unwrap();
    let app = start_app(settings_for(&owner)).await;
    caught_up(&app.model, &client).await;
    let done = Arc::new(AtomicBool::new(false));
    let model = app.model.clone();
    let stop = done.clone();
    let reader = tokio::task::spawn_blocking(move || {
        let key = CalendarKey {
            hotel_id: 1,
            room_type_id: 1,
        };
        let mut reads = 0u64;
        while !stop.load(Ordering::Acquire) {
            let t = model.read();
            let taken: Vec<i32> = t
                .calendars
                .get(&key)
                .expect("calendar")
                .iter()
                .map(|(_, c)| c.taken)
                .collect();
            assert!(
                taken.iter().all(|v| *v == taken[0]),
                "partial hold visible: {taken:?}"
            );
            reads += 1;
        }
        reads
    });
    for i in 0..200 {
        let req = HoldRequest {
            booking_id: format!("h{i}"),
            hotel_id: 1,
            room_type_id: 1,
            check_in: first_night(),
            check_out: first_night() + chrono::Days::new(3),
            rooms: 1,
            hold_for: Duration::from_secs(600),
        };
        assert_eq!(
            ops::hold(&mut client, &req).await.unwrap(),
            ops::HoldOutcome::Held
        );
    }
    caught_up(&app.model, &client).await;
    done.store(true, Ordering::Release);
    let reads = reader.await.expect("reader saw only whole holds");
    assert!(reads > 0);
    let taken: Vec<i32> = {
        let t = app.model.read();
        let key = CalendarKey {
            hotel_id: 1,
            room_type_id: 1,
        };
        t.calendars
            .get(&key)
            .expect("calendar")
            .iter()
            .map(|(_, c)| c.taken)
            .collect()
    };
    assert_eq!(taken, vec![200, 200, 200]);
    app.stop(Duration::from_secs(5)).await;
}

/// The slot's confirmed_flush_lsn (panics when there is no slot).
pub(crate) async fn confirmed_flush(client: &Client) -> Lsn {
    let confirmed: PgLsn = client
        .query_one(
            "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'vacancy'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    Lsn::from(confirmed)
}

/// The slot's confirmed_flush_lsn follows the copy, also while only tables
/// outside the publication are written (the copy must not pin the owner's WAL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_advance_while_only_other_tables_change() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let mut settings = settings_for(&owner);
    settings.stream.heartbeat_interval_ms = 0; // only keepalives may move the slot
    let app = start_app(settings).await;
    caught_up(&app.model, &client).await;
    client
        .batch_execute("UPDATE inventory SET taken = 1 WHERE night = DATE '2030-01-02'")
        .await
        .unwrap();
    let target = caught_up(&app.model, &client).await;
    wait_for(
        "confirmed_flush_lsn to pass the applied update",
        Duration::from_secs(30),
        || async { (confirmed_flush(&client).await >= target).then_some(()) },
    )
    .await;
    client
        .batch_execute("CREATE TABLE unrelated (id int); INSERT INTO unrelated SELECT generate_series(1, 10000)")
        .await
        .unwrap();
    let elsewhere = slot::current_wal_lsn(&client).await.unwrap();
    wait_for(
        "the slot to advance past writes to other tables",
        Duration::from_secs(60),
        || async { (confirmed_flush(&client).await >= elsewhere).then_some(()) },
    )
    .await;
    assert!(app.model.freshness.applied() >= elsewhere);
    app.stop(Duration::from_secs(5)).await;
}

/// A transaction larger than logical_decoding_work_mem is streamed while it
/// runs; if it rolls back, nothing of it reaches the copy; if it commits, all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_large_transactions_apply_only_at_commit() {
    let owner = TestOwner::start_with(ClusterOptions {
        extra_conf: vec!["logical_decoding_work_mem = '64kB'".into()],
        ..ClusterOptions::default()
    })
    .await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let app = start_app(settings_for(&owner)).await;
    caught_up(&app.model, &client).await;
    client
        .batch_execute("BEGIN; UPDATE inventory SET taken = 1 WHERE taken = 0; ROLLBACK;")
        .await
        .unwrap();
    // a savepoint rolled back inside a committed streamed transaction
    client
        .batch_execute(
            "BEGIN; UPDATE inventory SET price_cents = 1 WHERE hotel_id = 1;
             SAVEPOINT s; UPDATE inventory SET price_cents = 2 WHERE hotel_id = 2; ROLLBACK TO SAVEPOINT s;
             UPDATE inventory SET price_cents = 3 WHERE hotel_id = 3; COMMIT;",
        )
        .await
        .unwrap();
    assert_converged(&app.model, &client).await;
    let rows = copy_inventory(&app.model);
    assert!(
        rows.values().all(|c| c.taken == 0),
        "a rolled-back streamed transaction reached the copy"
    );
    assert!(
        rows.iter()
            .all(|((h, _, _), c)| *h != 2 || c.price_cents != Some(2))
    );
    app.stop(Duration::from_secs(5)).await;
}

/// Sell limits set and cleared on every night of a hotel in one owner
/// transaction each (1,200 rows: past the copy's queue of side-list edits,
/// which then merges on its own mid-transaction), and mixed with deletes
/// and new nights in one: the copy converges each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_set_and_cleared_in_bulk_converge() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    client
        .batch_execute(
            "INSERT INTO hotels (id, name, city, country, stars, amenities)
               VALUES (100, 'Hotel 100', 'Lisbon', 'PT', 4, ARRAY['wifi']);
             INSERT INTO room_types (hotel_id, id, name, max_guests)
               SELECT 100, r, 'Room ' || r, 2 FROM generate_series(1, 3) r;
             INSERT INTO inventory (hotel_id, room_type_id, night, total, taken, sell_limit, price_cents)
               SELECT 100, r, DATE '2030-01-01' + n, 5, n % 3, NULL, 10000
               FROM generate_series(1, 3) r, generate_series(0, 399) n
               ORDER BY r, n;",
        )
        .await
        .expect("a hotel of 1,200 nights");
    let app = start_app(settings_for(&owner)).await;
    caught_up(&app.model, &client).await;
    for step in [
        "UPDATE inventory SET sell_limit = total - 1 WHERE hotel_id = 100",
        "UPDATE inventory SET sell_limit = NULL
           WHERE hotel_id = 100 AND (night - DATE '2030-01-01') % 3 <> 0",
        "BEGIN;
         UPDATE inventory SET sell_limit = 4 WHERE hotel_id = 100 AND room_type_id <> 2;
         UPDATE inventory SET sell_limit = NULL WHERE hotel_id = 100 AND night < DATE '2030-03-01';
         DELETE FROM inventory WHERE hotel_id = 100 AND room_type_id = 3 AND night >= DATE '2030-12-01';
         INSERT INTO room_types (hotel_id, id, name, max_guests) VALUES (100, 4, 'Room 4', 2);
         INSERT INTO inventory (hotel_id, room_type_id, night, total, taken, sell_limit, price_cents)
           SELECT 100, 4, DATE '2030-01-01' + n, 7, 0, 6, 9000 FROM generate_series(0, 399) n;
         UPDATE inventory SET sell_limit = 3 WHERE hotel_id = 100 AND room_type_id = 1;
         COMMIT;",
        "UPDATE inventory SET sell_limit = NULL WHERE hotel_id = 100",
    ] {
        if let Err(error) = client.batch_execute(step).await {
            panic!("{step}: {error:?}");
        }
        assert_converged(&app.model, &client).await;
    }
    app.stop(Duration::from_secs(5)).await;
}

/// An owner with the fixed inventory and a copy of it whose calendars are
/// re-read from the owner every `ttl_secs`.
async fn loaded_with_ttl_secs(ttl_secs: u64) -> (TestOwner, Client, App) {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let mut settings = settings_for(&owner);
    settings.model.ttl_secs = ttl_secs;
    let app = start_app(settings).await;
    (owner, client, app)
}

/// While the stream cannot apply the high watermarks that close re-read
/// windows (its connection refused here), the refresher keeps at most
/// `MAX_OPEN_WINDOWS` open, and once it can, the copy converges. Before, a
/// window opened every tick, each holding its rows until it expired a
/// minute later to be read again: every calendar falling due was re-read
/// from the owner every minute for as long as the stream was out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_read_windows_stay_bounded_while_the_stream_cannot_close_them() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let vacancy_url = least_privilege_role(&client, &owner.url, None).await;
    create_publication(&client).await;
    let mut settings = settings_for(&owner);
    settings.owner.url = vacancy_url;
    // Every calendar due each second, one a window: 18 calendars would
    // open 18 windows within two seconds.
    settings.model.ttl_secs = 1;
    settings.model.refresh_batch = 1;
    let app = start_app(settings).await;
    caught_up(&app.model, &client).await;
    crate::search::hold_copy_back(&client, false).await;
    let mut most = 0;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        most = most.max(app.refresh.open_windows());
    }
    assert!(
        most > 0,
        "the refresher opened no window while the stream was out"
    );
    assert!(
        most <= vacancy_service::MAX_OPEN_WINDOWS,
        "{most} windows open at once"
    );
    crate::search::hold_copy_back(&client, true).await;
    client
        .batch_execute("UPDATE inventory SET taken = 1 WHERE hotel_id = 3")
        .await
        .unwrap();
    assert_converged(&app.model, &client).await;
    app.stop(Duration::from_secs(5)).await;
}

/// A change the stream never delivered (inventory left out of the
/// publication for a moment) does not outlive the TTL: the re-read repairs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_reread_repairs_a_change_the_stream_missed() {
    // Named, not `_`: the owner cluster lives as long as the binding.
    let (_owner, client, app) = loaded_with_ttl_secs(2).await;
    caught_up(&app.model, &client).await;
    client
        .batch_execute(
            "ALTER PUBLICATION vacancy DROP TABLE inventory;
             UPDATE inventory SET taken = 1 WHERE hotel_id = 1 AND taken = 0;
             DELETE FROM inventory WHERE hotel_id = 2 AND night = DATE '2030-01-03';
             ALTER PUBLICATION vacancy ADD TABLE inventory;",
        )
        .await
        .unwrap();
    caught_up(&app.model, &client).await;
    let owner_rows = owner_inventory(&client).await;
    assert_ne!(
        copy_inventory(&app.model),
        owner_rows,
        "the stream should have missed these changes"
    );
    wait_for(
        "the TTL re-read to repair the copy",
        Duration::from_secs(30),
        // The re-read publishes its rows before it counts them.
        || async {
            (copy_inventory(&app.model) == owner_rows
                && app.refresh.repaired.load(Ordering::Relaxed) > 0)
                .then_some(())
        },
    )
    .await;
    // Later changes still stream in.
    assert_converged(&app.model, &client).await;
    app.stop(Duration::from_secs(5)).await;
}

/// A key-changing UPDATE sends the new row without the TOASTed columns it
/// did not change (a long hotel name, a long room type name): the copy
/// takes them from the row under the old key, which it deletes in the same
/// step. Before, nothing held them under the new key and they became empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_change_keeps_the_toasted_columns_it_did_not_send() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let app = start_app(settings_for(&owner)).await;
    // 6,400 characters of hex digests: too long to stay in the row even
    // compressed, so PostgreSQL stores them out of line (TOAST).
    let long = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 200) g)";
    client
        .batch_execute(&format!(
            "INSERT INTO hotels (id, name, city, country, stars, amenities)
               VALUES (50, {long}, 'Lisbon', 'PT', 3, ARRAY['wifi']);
             INSERT INTO room_types (hotel_id, id, name, max_guests) VALUES (1, 9, {long}, 2);"
        ))
        .await
        .unwrap();
    assert_converged(&app.model, &client).await;
    // No room type points at hotel 50 and no night at room type 9, so
    // their keys may change.
    client
        .batch_execute(
            "UPDATE hotels SET id = 51, stars = 4 WHERE id = 50;
             UPDATE room_types SET id = 10, max_guests = 3 WHERE hotel_id = 1 AND id = 9;",
        )
        .await
        .unwrap();
    assert_converged(&app.model, &client).await;
    let t = app.model.read();
    assert_eq!(t.hotels.get(&51).map(|h| h.name.len()), Some(6400));
    assert!(!t.hotels.contains_key(&50));
    drop(t);
    app.stop(Duration::from_secs(5)).await;
}

/// An owner column of another type than the copy reads (`price_cents`
/// altered to `bigint`) fails the TTL re-read with an error, counted and
/// retried; it panicked in `Row::get` and took the re-read task with it, so
/// the safety net stayed off after the column was altered back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_reread_survives_a_column_of_another_type() {
    // Named, not `_`: the owner cluster lives as long as the binding.
    let (_owner, client, app) = loaded_with_ttl_secs(2).await;
    assert_converged(&app.model, &client).await;
    assert_eq!(app.refresh.failed.load(Ordering::Relaxed), 0);
    client
        .batch_execute("ALTER TABLE inventory ALTER COLUMN price_cents TYPE bigint")
        .await
        .unwrap();
    wait_for(
        "a TTL re-read of this copy to fail on the bigint column",
        Duration::from_secs(30),
        || async { (app.refresh.failed.load(Ordering::Relaxed) > 0).then_some(()) },
    )
    .await;
    client
        .batch_execute(
            "ALTER TABLE inventory ALTER COLUMN price_cents TYPE integer;
             ALTER PUBLICATION vacancy DROP TABLE inventory;
             UPDATE inventory SET taken = 1 WHERE hotel_id = 5 AND taken = 0;
             ALTER PUBLICATION vacancy ADD TABLE inventory;",
        )
        .await
        .unwrap();
    caught_up(&app.model, &client).await;
    let owner_rows = owner_inventory(&client).await;
    wait_for(
        "the TTL re-read, still running, to repair what the stream missed",
        Duration::from_secs(30),
        || async { (copy_inventory(&app.model) == owner_rows).then_some(()) },
    )
    .await;
    assert_converged(&app.model, &client).await;
    app.stop(Duration::from_secs(5)).await;
}

/// With `stream.schema` set, the TTL re-read reads that schema's
/// `inventory`. It named the table without one, so the role's
/// `search_path` chose: with a `public.inventory` beside it (a legacy
/// table, another tenant's), every re-read merged that table's rows over
/// the copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_rereads_read_the_schema_the_stream_follows() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    client
        .batch_execute(
            "CREATE SCHEMA booking;
             CREATE TABLE booking.hotels (LIKE public.hotels INCLUDING ALL);
             CREATE TABLE booking.room_types (LIKE public.room_types INCLUDING ALL);
             CREATE TABLE booking.inventory (LIKE public.inventory INCLUDING ALL);
             INSERT INTO booking.hotels SELECT * FROM public.hotels;
             INSERT INTO booking.room_types SELECT * FROM public.room_types;
             INSERT INTO booking.inventory SELECT * FROM public.inventory;
             UPDATE public.inventory SET taken = taken + 1;",
        )
        .await
        .unwrap();
    let mut settings = settings_for(&owner);
    settings.stream.schema = "booking".into();
    settings.model.ttl_secs = 2;
    let app = start_app(settings).await;
    let booking = owner.client().await;
    booking
        .batch_execute("SET search_path = booking")
        .await
        .unwrap();
    caught_up(&app.model, &booking).await;
    let merged_at_start = app.refresh.merged.load(Ordering::Relaxed);
    wait_for(
        "two TTL re-reads of every calendar to be merged",
        Duration::from_secs(60),
        || async {
            (app.refresh.merged.load(Ordering::Relaxed) >= merged_at_start + 2).then_some(())
        },
    )
    .await;
    assert_eq!(app.refresh.repaired.load(Ordering::Relaxed), 0);
    assert_eq!(copy_inventory(&app.model), owner_inventory(&booking).await);
    app.stop(Duration::from_secs(5)).await;
}

/// A snapshot's copy is as of the slot's creation, and its load takes a
/// while (most of a minute at 73M rows) as the owner commits on. Swapped in,
/// it is not caught up until it has applied what the owner committed by
/// the end of the load: it was taken as "as new as the owner", so a node
/// answered ready, with lag 0, from a copy that lacked those commits until
/// the slot's watch next looked. Here a hotel is committed while a load of
/// a million rows is under way and the stream is stopped: the loaded copy
/// lacks the hotel and says it is not caught up, until the stream goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_is_not_caught_up_with_what_the_owner_committed_during_its_load() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    // A load that takes a while: about a million more nights.
    client
        .batch_execute(
            "INSERT INTO hotels (id, name, city, country)
               SELECT h, 'Hotel ' || h, 'Porto', 'PT' FROM generate_series(1000, 1999) h;
             INSERT INTO room_types (hotel_id, id, name, max_guests)
               SELECT h, r, 'Room ' || r, 2 FROM generate_series(1000, 1999) h, generate_series(1, 3) r;
             INSERT INTO inventory (hotel_id, room_type_id, night, total, taken, price_cents)
               SELECT h, r, DATE '2030-01-01' + n, 5, 0, 10000
               FROM generate_series(1000, 1999) h, generate_series(1, 3) r, generate_series(0, 364) n;",
        )
        .await
        .unwrap();
    let mut settings = settings_for(&owner);
    // Only the copy's own position may say how far it is behind.
    settings.stream.slot_watch_interval_ms = 600_000;
    let app = start_app(settings).await;
    // Rows arrive: the slot is made and its snapshot exported (stopping its
    // walsender before could stop the slot's creation halfway).
    wait_for(
        "the snapshot's load to be under way",
        Duration::from_secs(30),
        || async { (app.status.snapshot.rows_loaded.load(Ordering::Relaxed) > 0).then_some(()) },
    )
    .await;
    // The slot is not held while the snapshot loads: its walsender is the
    // one replication connection there is.
    let walsender: i32 = client
        .query_one(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walsender'",
            &[],
        )
        .await
        .expect("one walsender")
        .get(0);
    let held = crate::confirmed::HeldStream::stop(walsender);
    client
        .batch_execute(
            "INSERT INTO hotels (id, name, city, country) VALUES (900, 'During the load', 'Porto', 'PT')",
        )
        .await
        .unwrap();
    let loaded_before_the_hotel = app.model.freshness.is_loaded();
    wait_for(
        "the snapshot's copy to be swapped in",
        Duration::from_secs(60),
        || async { app.model.freshness.is_loaded().then_some(()) },
    )
    .await;
    let in_copy = app.model.read().hotels.contains_key(&900);
    let caught_up = app.model.freshness.caught_up();
    held.release();
    assert!(
        !loaded_before_the_hotel && !in_copy,
        "the load ended before the hotel was committed: make it longer"
    );
    assert!(
        !caught_up,
        "a copy without a hotel the owner committed before it was swapped in says it is caught up"
    );
    assert_converged(&app.model, &client).await;
    assert!(app.model.read().hotels.contains_key(&900));
    app.stop(Duration::from_secs(5)).await;
}

/// A replica identity on an index that leaves out a table's key (a
/// surrogate key's index) is refused at the start, saying what to run: a
/// DELETE's old row would come without the key, and the stream would halt
/// on the first one. Once the DBA ran it, the copy loads and follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_identity_that_leaves_out_the_key_is_refused() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    client
        .batch_execute(
            "ALTER TABLE inventory ADD COLUMN row_id bigserial NOT NULL;
             CREATE UNIQUE INDEX inventory_row_id ON inventory (row_id);
             ALTER TABLE inventory REPLICA IDENTITY USING INDEX inventory_row_id;",
        )
        .await
        .unwrap();
    let app = start_app(settings_for(&owner)).await;
    let error = wait_for(
        "the start to refuse the replica identity",
        Duration::from_secs(30),
        || async {
            app.status
                .last_error()
                .filter(|e| e.contains("replica identity"))
        },
    )
    .await;
    assert!(
        error.contains("ALTER TABLE public.inventory REPLICA IDENTITY DEFAULT;"),
        "{error}"
    );
    assert!(!app.model.freshness.is_loaded());
    client
        .batch_execute("ALTER TABLE inventory REPLICA IDENTITY DEFAULT")
        .await
        .unwrap();
    caught_up(&app.model, &client).await;
    client
        .batch_execute("DELETE FROM inventory WHERE hotel_id = 1")
        .await
        .unwrap();
    assert_converged(&app.model, &client).await;
    app.stop(Duration::from_secs(5)).await;
}

/// A publication made by hand that leaves out `truncate` is fixed before
/// the copy is taken: the copy kept every row a TRUNCATE removed, until
/// the TTL (inventory) or for good (hotels). One that filters rows is
/// refused, saying what to run, and no copy is taken: the snapshot would
/// hold rows whose changes never come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publication_publishes_every_operation_and_every_row() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    client
        .batch_execute(
            "CREATE PUBLICATION vacancy FOR TABLE hotels, room_types, inventory
               WITH (publish = 'insert, update, delete')",
        )
        .await
        .unwrap();
    let app = start_app(settings_for(&owner)).await;
    caught_up(&app.model, &client).await;
    client.batch_execute("TRUNCATE inventory").await.unwrap();
    assert_converged(&app.model, &client).await;
    assert!(copy_inventory(&app.model).is_empty());
    app.stop(Duration::from_secs(5)).await;

    client
        .batch_execute(
            "ALTER PUBLICATION vacancy SET TABLE hotels, room_types, inventory WHERE (hotel_id < 3);
             SELECT pg_drop_replication_slot('vacancy');",
        )
        .await
        .unwrap();
    let app = start_app(settings_for(&owner)).await;
    let error = wait_for(
        "the start to refuse a publication that filters rows",
        Duration::from_secs(30),
        || async {
            app.status
                .last_error()
                .filter(|e| e.contains("a row filter"))
        },
    )
    .await;
    assert!(
        error.contains(
            "ALTER PUBLICATION vacancy SET TABLE public.hotels, public.room_types, public.inventory;"
        ),
        "{error}"
    );
    assert!(!app.model.freshness.is_loaded());
    app.stop(Duration::from_secs(5)).await;
}

/// An array whose lower bound is not 1 (`amenities[0] = 'spa'` makes one)
/// streams like any other: its text form (`[0:2]={spa,wifi,pool}`) was
/// refused by the decoder, which halted every copy of the owner on that one
/// legal row, replaying it forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_array_with_another_lower_bound_streams() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let app = start_app(settings_for(&owner)).await;
    caught_up(&app.model, &client).await;
    client
        .batch_execute(
            "UPDATE hotels SET amenities[0] = 'spa' WHERE id = 1;
             UPDATE inventory SET taken = 1 WHERE hotel_id = 2 AND taken = 0;",
        )
        .await
        .unwrap();
    assert_converged(&app.model, &client).await;
    let amenities = app.model.read().hotels[&1].amenities.clone();
    assert_eq!(amenities, vec!["spa", "wifi", "pool"]);
    app.stop(Duration::from_secs(5)).await;
}

/// An array of two dimensions, legal in any `text[]` column, is read as
/// the owner's `= ANY` reads it, flattened, by the snapshot (one loaded
/// before the start) and by the stream (one written after): either used to
/// halt every copy of the owner on that one row, the snapshot's binary COPY
/// and the stream's text decoder both refusing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_array_of_two_dimensions_loads_and_streams() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    client
        .batch_execute("UPDATE hotels SET amenities = '{{spa,wifi},{pool,NULL}}' WHERE id = 1")
        .await
        .unwrap();
    let app = start_app(settings_for(&owner)).await;
    caught_up(&app.model, &client).await;
    assert_eq!(
        app.model.read().hotels[&1].amenities,
        vec!["spa", "wifi", "pool"]
    );
    client
        .batch_execute(
            r#"UPDATE hotels SET amenities = '[0:1][1:2]={{gym,NULL},{sauna,"sea view"}}' WHERE id = 2;
               UPDATE inventory SET taken = 1 WHERE hotel_id = 2 AND taken = 0;"#,
        )
        .await
        .unwrap();
    assert_converged(&app.model, &client).await;
    assert_eq!(
        app.model.read().hotels[&2].amenities,
        vec!["gym", "sauna", "sea view"]
    );
    app.stop(Duration::from_secs(5)).await;
}

/// Re-reads racing a busy stream never put an older value over a newer one:
/// with every change delivered, a correct merge finds nothing to repair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_rereads_racing_the_stream_change_nothing() {
    let owner = TestOwner::start().await;
    ttl_rereads_race_the_workload(&owner, &owner.url).await;
}

/// The same race on an owner with synchronous replication, where takes
/// wait for the standby to apply them (`remote_apply`, as a site that reads
/// its standbys does) and `vacancy`'s own commits only for it to flush them
/// (`on`). The standby applies WAL 20 ms late, so every take reaches the
/// stream, and the copy, at least 20 ms before the owner lets other
/// sessions see it, also after the re-read's low watermark has committed:
/// re-reads keep meeting snapshots that hide takes the copy already shows
/// (`owner::visibility`; `visibility.rs` holds one such commit on purpose).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_rereads_racing_the_stream_change_nothing_under_synchronous_replication() {
    let owner = TestOwner::start().await;
    let standby = tokio::task::block_in_place(|| {
        owner
            .cluster
            .start_standby(&["recovery_min_apply_delay = '20ms'"])
    })
    .unwrap_or_else(|e| panic!("cannot start the standby: {e}"));
    let client = owner.client().await;
    let vacancy_url = least_privilege_role(&client, &owner.url, None).await;
    create_publication(&client).await;
    for sql in [
        "ALTER SYSTEM SET synchronous_standby_names = '*'",
        "SELECT pg_reload_conf()",
        // The workload's sessions (and the loads and checks) connect as postgres.
        "ALTER ROLE postgres SET synchronous_commit = remote_apply",
    ] {
        client.batch_execute(sql).await.unwrap();
    }
    wait_for(
        "the standby to be synchronous",
        Duration::from_secs(60),
        || async {
            let row = client
                .query_opt(
                    "SELECT 1 FROM pg_stat_replication WHERE sync_state = 'sync'",
                    &[],
                )
                .await
                .unwrap();
            row.map(|_| ())
        },
    )
    .await;
    ttl_rereads_race_the_workload(&owner, &vacancy_url).await;
    drop(standby);
}

/// Runs the random workload three times while every calendar is re-read over
/// and over, with `vacancy` connecting to the owner at `vacancy_url`.
async fn ttl_rereads_race_the_workload(owner: &TestOwner, vacancy_url: &str) {
    let client = owner.client().await;
    load_inventory(&client).await;
    let mut settings = settings_for(owner);
    settings.owner.url = vacancy_url.to_string();
    settings.model.ttl_secs = 1;
    settings.model.refresh_batch = 4;
    let app = start_app(settings).await;
    caught_up(&app.model, &client).await;
    let seed = test_seed();
    let keys: Vec<CalendarKey> = app.model.read().calendars.keys().collect();
    let racing = Arc::new(AtomicBool::new(true));
    let requester = {
        let (refresh, racing) = (app.refresh.clone(), racing.clone());
        tokio::spawn(async move {
            while racing.load(Ordering::Acquire) {
                if refresh.due_len() < keys.len() {
                    refresh.request(keys.iter().copied());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    for round in 0..3 {
        run_workload(owner, seed.wrapping_add(round), 4, 60).await;
    }
    racing.store(false, Ordering::Release);
    requester.await.unwrap();
    assert_converged(&app.model, &client).await;
    let merged = app.refresh.merged.load(Ordering::Relaxed);
    eprintln!(
        "merged {merged} due {} watched {} rereads {}",
        app.refresh.due_len(),
        app.refresh.watched(),
        vacancy_service::metrics::TTL_ROWS_REREAD.get()
    );
    assert!(merged > 0, "no TTL re-read was merged during the workload");
    assert_eq!(
        app.refresh.repaired.load(Ordering::Relaxed),
        0,
        "a re-read changed the copy although the stream delivered every change"
    );
    app.stop(Duration::from_secs(5)).await;
}

/// A new session's walsender reads the WAL from the slot's restart
/// position, held back by a transaction left open, and sends nothing of
/// what committed before the session's start: here seconds of it, far
/// past `stream.receive_timeout_ms`. The session waits for a walsender
/// that reads on (its `sent_lsn` moves) and the copy catches up. Before,
/// the silence ended the session as dead and the next one began the same
/// silence again, for as long as the transaction stayed open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_walsender_catching_up_in_silence_is_not_taken_for_dead() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let mut settings = settings_for(&owner);
    settings.stream.receive_timeout_ms = 3 * settings.stream.heartbeat_interval_ms;
    let app = start_app(settings).await;
    caught_up(&app.model, &client).await;
    let silent_before = silent_catch_ups(&app).await;

    // An xid left open: the slot's restart position stays before it.
    let open = owner.client().await;
    open.batch_execute("BEGIN; CREATE TABLE held_open (x int)")
        .await
        .expect("a transaction left open");
    // WAL of a table the copy does not follow: decoded all the same.
    client
        .batch_execute(
            "CREATE TABLE filler (x int, pad text);
             INSERT INTO filler SELECT g, repeat('x', 200) FROM generate_series(1, 1500000) g;",
        )
        .await
        .expect("filler");
    let past_filler = caught_up(&app.model, &client).await;
    wait_for(
        "the slot to be confirmed past the filler",
        Duration::from_secs(120),
        || async { (confirmed_flush(&client).await >= past_filler).then_some(()) },
    )
    .await;

    // A new session starts past the filler but reads it again first.
    let ended = client
        .execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'vacancy' AND active_pid IS NOT NULL",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(ended, 1, "one walsender to end");
    client
        .batch_execute(
            "UPDATE inventory SET taken = taken + 1
             WHERE hotel_id = 1 AND room_type_id = 1 AND night = DATE '2030-01-02'",
        )
        .await
        .unwrap();
    let target = slot::current_wal_lsn(&client).await.expect("current lsn");
    wait_for(
        "the copy to apply the change after the silent catch-up",
        Duration::from_secs(120),
        || async { (app.model.freshness.applied() >= target).then_some(()) },
    )
    .await;
    assert!(
        silent_catch_ups(&app).await > silent_before,
        "the walsender caught up in silence for longer than the receive timeout"
    );
    assert_converged(&app.model, &client).await;
    open.batch_execute("ROLLBACK").await.unwrap();
    app.stop(Duration::from_secs(5)).await;
}

/// `vacancy_stream_silent_catch_up_total` as `app` reports it.
async fn silent_catch_ups(app: &App) -> f64 {
    let (code, _, text) = crate::api::get(app.addr, "/metrics").await;
    assert_eq!(code, 200, "{text}");
    vacancy_lab::bench::soak::gauge(&text, "vacancy_stream_silent_catch_up_total", None)
        .expect("the counter is reported")
}

/// A new slot waits for every transaction open on the owner. An `idle in
/// transaction` session held it back for good, silently: `/v1/status` said
/// nothing and the session never ended. Now the status names the session
/// while the slot waits, the wait ends at `stream.slot_create_timeout_ms`
/// with it in the error, the next session tries again (the half-made slot
/// is not left busy), and once it commits the copy loads and converges.
#[tokio::test]
async fn a_slot_held_back_by_an_open_transaction_names_it_and_gives_up_in_time() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let open = owner.client().await;
    let open_pid: i32 = open
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    open.batch_execute("BEGIN; SELECT txid_current()")
        .await
        .expect("a transaction with an xid left open");

    let mut settings = settings_for(&owner);
    settings.stream.slot_create_timeout_ms = 3_000;
    let app = start_app(settings).await;
    let named = format!("pid {open_pid} (xid");
    let waiting = wait_for(
        "the status to name the open transaction",
        Duration::from_secs(30),
        || async { app.status.waiting_for().filter(|w| w.contains(&named)) },
    )
    .await;
    assert!(waiting.contains("idle in transaction"), "{waiting}");
    let error = wait_for(
        "the slot's wait to end in an error",
        Duration::from_secs(30),
        || async {
            app.status
                .last_error()
                .filter(|e| e.contains("stream.slot_create_timeout_ms"))
        },
    )
    .await;
    assert!(error.contains(&named), "{error}");
    assert!(!app.model.freshness.is_loaded());
    // The next session tries again, the transaction still open: the
    // creation given up on was cancelled, so the slot is not found busy.
    wait_for(
        "a second try at the slot, waiting on the same transaction",
        Duration::from_secs(30),
        || async { app.status.waiting_for().filter(|w| w.contains(&named)) },
    )
    .await;
    let last = app.status.last_error().unwrap_or_default();
    assert!(!last.contains("still held by walsender"), "{last}");

    open.batch_execute("COMMIT").await.unwrap();
    assert_converged(&app.model, &client).await;
    assert_eq!(app.status.waiting_for(), None);
    app.stop(Duration::from_secs(5)).await;
}

/// Slot names are the cluster's. A node pointed at another database of the
/// same cluster, with the slot name of the node that follows the first,
/// took that slot for its own: it dropped it to take its snapshot (the
/// other node lost its place in the WAL), and with a checkpoint of the
/// first database on hand it would have loaded that copy and served it as
/// this database's. Now the session refuses the slot and touches nothing.
#[tokio::test]
async fn a_slot_of_another_database_is_neither_used_nor_dropped() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let first = start_app(settings_for(&owner)).await;
    caught_up(&first.model, &client).await;
    first.stop(Duration::from_secs(5)).await;

    let second_url = owner
        .cluster
        .create_database("second")
        .expect("a second database");
    let second = vacancy_service::connect(&second_url, Duration::from_secs(10))
        .await
        .expect("connect to the second database");
    vacancy_lab::schema::apply(&second)
        .await
        .expect("the owner schema");
    let mut settings = settings_for(&owner);
    settings.owner.url = second_url;
    let app = start_app(settings).await;
    let error = wait_for(
        "the session to refuse the other database's slot",
        Duration::from_secs(30),
        || async {
            app.status
                .last_error()
                .filter(|e| e.contains("belongs to database"))
        },
    )
    .await;
    assert!(error.contains("\"second\""), "{error}");
    assert!(!app.model.freshness.is_loaded());
    let database: String = client
        .query_one(
            "SELECT database::text FROM pg_replication_slots WHERE slot_name = 'vacancy'",
            &[],
        )
        .await
        .expect("the first database's slot is still there")
        .get(0);
    assert_ne!(database, "second");
    app.stop(Duration::from_secs(5)).await;
}

//! The owner's operations against a real PostgreSQL: every outcome is checked
//! in the rows, not just in the value the operation returned.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use chrono::NaiveDate;
use tokio::sync::{Barrier, Mutex, mpsc};
use tokio_postgres::Client;
use vacancy_lab::ops::{
    self, BookingStatus, CapacityOutcome, HoldOutcome, HoldRequest, OpsError, Transition,
};

use crate::support::{TestOwner, wait_for};

/// The cluster shared by the tests of this file that run at the same time,
/// each in a schema of its own: a cluster takes seconds to start and stop, a
/// schema milliseconds. Only a weak reference lives here, so the last test
/// holding the cluster stops it (a static `Arc` would leak the server).
static SHARED: tokio::sync::Mutex<Weak<TestOwner>> = tokio::sync::Mutex::const_new(Weak::new());
static NEXT_SCHEMA: AtomicU32 = AtomicU32::new(0);

/// A fresh copy of the reference schema on the shared cluster; every client
/// of it sees only its own tables through `search_path`.
struct Db {
    _owner: Arc<TestOwner>,
    config: tokio_postgres::Config,
}

impl Db {
    async fn start() -> Db {
        let owner = {
            let mut shared = SHARED.lock().await;
            match shared.upgrade() {
                Some(owner) => owner,
                None => {
                    let owner = Arc::new(TestOwner::start().await);
                    *shared = Arc::downgrade(&owner);
                    owner
                }
            }
        };
        let schema = format!("ops_{}", NEXT_SCHEMA.fetch_add(1, Ordering::Relaxed));
        let mut config: tokio_postgres::Config = owner.url.parse().expect("test owner url");
        config
            .options(format!("-c search_path={schema}"))
            .connect_timeout(Duration::from_secs(10));
        let db = Db {
            _owner: owner,
            config,
        };
        let client = db.client().await;
        client
            .batch_execute(&format!(
                "CREATE SCHEMA {schema}; SET search_path = {schema}"
            ))
            .await
            .expect("create schema");
        vacancy_lab::schema::apply(&client)
            .await
            .expect("load config/owner-schema.sql");
        db
    }

    async fn client(&self) -> Client {
        let (client, connection) = self
            .config
            .connect(tokio_postgres::NoTls)
            .await
            .expect("connect to the test owner");
        tokio::spawn(connection);
        client
    }
}

const HOTEL: i64 = 7;
const ROOM: i64 = 3;

fn day(d: u32) -> NaiveDate {
    NaiveDate::from_ymd_opt(2030, 6, d).expect("a valid June date")
}

/// One hotel with room type `ROOM`, `nights` nights from `first`, `total` units each.
async fn room_type(client: &Client, first: NaiveDate, nights: i32, total: i32) {
    client
        .execute(
            "INSERT INTO hotels (id, name, city) VALUES ($1, 'Test', 'Lisbon')",
            &[&HOTEL],
        )
        .await
        .expect("insert hotel");
    add_room_type(client, ROOM, first, nights, total).await;
}

async fn add_room_type(client: &Client, room: i64, first: NaiveDate, nights: i32, total: i32) {
    client
        .execute(
            "INSERT INTO room_types (hotel_id, id, name, max_guests) VALUES ($1, $2, 'Double', 2)",
            &[&HOTEL, &room],
        )
        .await
        .expect("insert room type");
    client
        .execute(
            "INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
             SELECT $1, $2, $3::date + g, $4, 12000 FROM generate_series(0, $5 - 1) AS g",
            &[&HOTEL, &room, &first, &total, &nights],
        )
        .await
        .expect("insert inventory");
}

fn request(id: &str, check_in: NaiveDate, check_out: NaiveDate, rooms: i32) -> HoldRequest {
    HoldRequest {
        booking_id: id.to_owned(),
        hotel_id: HOTEL,
        room_type_id: ROOM,
        check_in,
        check_out,
        rooms,
        hold_for: Duration::from_secs(600),
    }
}

/// `taken` of `ROOM` on the nights `[from, to)`, in date order.
async fn taken(client: &Client, from: NaiveDate, to: NaiveDate) -> Vec<i32> {
    column(client, "taken", from, to).await
}

async fn totals(client: &Client, from: NaiveDate, to: NaiveDate) -> Vec<i32> {
    column(client, "total", from, to).await
}

async fn column(client: &Client, name: &str, from: NaiveDate, to: NaiveDate) -> Vec<i32> {
    let sql = format!(
        "SELECT {name} FROM inventory
         WHERE hotel_id = $1 AND room_type_id = $2 AND night >= $3 AND night < $4
         ORDER BY night"
    );
    client
        .query(&sql, &[&HOTEL, &ROOM, &from, &to])
        .await
        .expect("read inventory")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

async fn status(client: &Client, id: &str) -> Option<String> {
    client
        .query_opt("SELECT status FROM bookings WHERE id = $1", &[&id])
        .await
        .expect("read booking")
        .map(|row| row.get(0))
}

async fn booking_count(client: &Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM bookings", &[])
        .await
        .expect("count bookings")
        .get(0)
}

/// Waits until the server's clock is past the hold's stored expiry (no fixed sleep).
async fn wait_until_expired(client: &Client, id: &str) {
    wait_for("the hold to expire", Duration::from_secs(5), || async {
        let row = client
            .query_one(
                "SELECT expires_at <= clock_timestamp() FROM bookings WHERE id = $1",
                &[&id],
            )
            .await
            .expect("read expiry");
        row.get::<_, bool>(0).then_some(())
    })
    .await;
}

/// Clients shared by many tasks: each task takes one, runs, and puts it back.
struct Pool {
    give: mpsc::Sender<Client>,
    take: Mutex<mpsc::Receiver<Client>>,
}

impl Pool {
    async fn new(owner: &Db, size: usize) -> Arc<Pool> {
        let (give, take) = mpsc::channel(size);
        let clients = futures_util::future::join_all((0..size).map(|_| owner.client())).await;
        for client in clients {
            give.send(client).await.expect("pool channel open");
        }
        Arc::new(Pool {
            give,
            take: Mutex::new(take),
        })
    }

    async fn hold(&self, req: &HoldRequest) -> Result<HoldOutcome, OpsError> {
        let mut client = self
            .take
            .lock()
            .await
            .recv()
            .await
            .expect("pool channel open");
        let outcome = ops::hold(&mut client, req).await;
        self.give.send(client).await.expect("pool channel open");
        outcome
    }
}

/// Callers spawn these operations on a multi-threaded runtime, so their
/// futures must be `Send`; this only has to compile.
#[allow(dead_code)]
fn every_operation_can_be_spawned(mut client: Client) {
    tokio::spawn(async move {
        let req = request("spawned", day(10), day(11), 1);
        let _ = ops::hold(&mut client, &req).await;
        let _ = ops::confirm(&client, "spawned").await;
        let _ = ops::release(&mut client, "spawned").await;
        let _ = ops::cancel(&mut client, "spawned").await;
        let _ = ops::sweep(&mut client, 10).await;
        let _ = ops::set_capacity(&mut client, HOTEL, ROOM, day(10), day(11), Some(1), None).await;
        let _ = ops::open_horizon(&client, day(20)).await;
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_holds_for_the_last_room_sell_it_once() {
    const HOLDS: usize = 500;
    let owner = Db::start().await;
    let client = owner.client().await;
    room_type(&client, day(10), 1, 1).await;
    let pool = Pool::new(&owner, 50).await;
    // Every task is spawned and waiting before the first hold starts, so the
    // pool's 50 connections all have a hold in flight on the same row.
    let start = Arc::new(Barrier::new(HOLDS));
    let tasks: Vec<_> = (0..HOLDS)
        .map(|i| {
            let (pool, start) = (pool.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                pool.hold(&request(&format!("race-{i}"), day(10), day(11), 1))
                    .await
            })
        })
        .collect();
    let mut held = 0;
    let mut full = 0;
    for task in tasks {
        match task.await.expect("hold task").expect("hold") {
            HoldOutcome::Held => held += 1,
            HoldOutcome::Full => full += 1,
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert_eq!((held, full), (1, HOLDS - 1));
    assert_eq!(taken(&client, day(10), day(11)).await, [1]);
    assert_eq!(booking_count(&client).await, 1, "losers leave no booking");
}

#[tokio::test]
async fn a_stay_with_one_full_night_takes_no_night() {
    let owner = Db::start().await;
    let mut client = owner.client().await;
    room_type(&client, day(10), 3, 1).await;
    let blocker = request("blocker", day(11), day(12), 1);
    assert_eq!(
        ops::hold(&mut client, &blocker).await.unwrap(),
        HoldOutcome::Held
    );

    let stay = request("stay", day(10), day(13), 1);
    assert_eq!(
        ops::hold(&mut client, &stay).await.unwrap(),
        HoldOutcome::Full
    );
    assert_eq!(taken(&client, day(10), day(13)).await, [0, 1, 0]);
    assert_eq!(status(&client, "stay").await, None);

    // A night past the horizon has no row: not on sale, and again nothing taken.
    let beyond = request("beyond", day(12), day(14), 1);
    assert_eq!(
        ops::hold(&mut client, &beyond).await.unwrap(),
        HoldOutcome::NotFound
    );
    assert_eq!(taken(&client, day(10), day(13)).await, [0, 1, 0]);
    assert_eq!(booking_count(&client).await, 1);
}

#[tokio::test]
async fn the_sweeper_keeps_a_late_confirmation_and_expires_a_dead_hold_once() {
    let owner = Db::start().await;
    let mut client = owner.client().await;
    room_type(&client, day(10), 1, 2).await;
    let short = |id: &str| HoldRequest {
        hold_for: Duration::from_millis(50),
        ..request(id, day(10), day(11), 1)
    };

    // Paid after its deadline but before any sweep: its units are still
    // counted for it, so the confirmation passes and the sweeper leaves it.
    assert_eq!(
        ops::hold(&mut client, &short("paid")).await.unwrap(),
        HoldOutcome::Held
    );
    wait_until_expired(&client, "paid").await;
    assert_eq!(
        ops::confirm(&client, "paid").await.unwrap(),
        Transition::Done
    );
    assert_eq!(ops::sweep(&mut client, 100).await.unwrap(), 0);
    assert_eq!(status(&client, "paid").await.as_deref(), Some("confirmed"));
    assert_eq!(taken(&client, day(10), day(11)).await, [1]);

    // Never paid: swept once, its unit back, and a second sweep finds nothing.
    assert_eq!(
        ops::hold(&mut client, &short("left")).await.unwrap(),
        HoldOutcome::Held
    );
    assert_eq!(taken(&client, day(10), day(11)).await, [2]);
    wait_until_expired(&client, "left").await;
    assert_eq!(ops::sweep(&mut client, 100).await.unwrap(), 1);
    assert_eq!(status(&client, "left").await.as_deref(), Some("expired"));
    assert_eq!(taken(&client, day(10), day(11)).await, [1]);
    assert_eq!(ops::sweep(&mut client, 100).await.unwrap(), 0);
    assert_eq!(taken(&client, day(10), day(11)).await, [1]);
    // The payment that comes after the sweep loses.
    assert_eq!(
        ops::confirm(&client, "left").await.unwrap(),
        Transition::WrongState(BookingStatus::Expired)
    );
}

#[tokio::test]
async fn two_sweepers_return_each_expired_hold_once() {
    const HOLDS: usize = 30;
    let owner = Db::start().await;
    let mut client = owner.client().await;
    room_type(&client, day(10), 3, 100).await;
    for i in 0..HOLDS {
        let req = HoldRequest {
            hold_for: Duration::from_millis(50),
            ..request(&format!("h-{i}"), day(10), day(13), 2)
        };
        assert_eq!(
            ops::hold(&mut client, &req).await.unwrap(),
            HoldOutcome::Held
        );
    }
    assert_eq!(taken(&client, day(10), day(13)).await, [60, 60, 60]);
    wait_until_expired(&client, &format!("h-{}", HOLDS - 1)).await;

    let sweeper = |mut client: Client| async move {
        let mut swept = 0;
        loop {
            match ops::sweep(&mut client, 4).await.expect("sweep") {
                0 => return swept,
                n => swept += n,
            }
        }
    };
    let (a, b) = tokio::join!(sweeper(owner.client().await), sweeper(owner.client().await));
    assert_eq!(a + b, HOLDS as u64);
    assert_eq!(taken(&client, day(10), day(13)).await, [0, 0, 0]);
    let expired: i64 = client
        .query_one(
            "SELECT count(*) FROM bookings WHERE status = 'expired'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(expired, HOLDS as i64);
}

#[tokio::test]
async fn release_returns_exactly_the_units_taken_once() {
    let owner = Db::start().await;
    let mut client = owner.client().await;
    room_type(&client, day(10), 3, 3).await;
    let stay = request("stay", day(10), day(13), 2);
    assert_eq!(
        ops::hold(&mut client, &stay).await.unwrap(),
        HoldOutcome::Held
    );
    let other = request("other", day(11), day(12), 1);
    assert_eq!(
        ops::hold(&mut client, &other).await.unwrap(),
        HoldOutcome::Held
    );
    assert_eq!(taken(&client, day(10), day(13)).await, [2, 3, 2]);

    assert_eq!(
        ops::release(&mut client, "stay").await.unwrap(),
        Transition::Done
    );
    assert_eq!(taken(&client, day(10), day(13)).await, [0, 1, 0]);
    assert_eq!(status(&client, "stay").await.as_deref(), Some("released"));

    assert_eq!(
        ops::release(&mut client, "stay").await.unwrap(),
        Transition::WrongState(BookingStatus::Released)
    );
    assert_eq!(
        ops::confirm(&client, "stay").await.unwrap(),
        Transition::WrongState(BookingStatus::Released)
    );
    assert_eq!(taken(&client, day(10), day(13)).await, [0, 1, 0]);
    assert_eq!(
        ops::release(&mut client, "nobody").await.unwrap(),
        Transition::NotFound
    );
}

#[tokio::test]
async fn total_cannot_drop_below_taken_but_can_reach_it() {
    let owner = Db::start().await;
    let mut client = owner.client().await;
    room_type(&client, day(10), 2, 3).await;
    let stay = request("stay", day(10), day(11), 2);
    assert_eq!(
        ops::hold(&mut client, &stay).await.unwrap(),
        HoldOutcome::Held
    );

    let set_total = async |client: &mut Client, to: NaiveDate, total: i32| {
        ops::set_capacity(client, HOTEL, ROOM, day(10), to, Some(total), None)
            .await
            .unwrap()
    };
    // Night 10 has 2 taken: lowering both nights to 1 changes neither.
    assert_eq!(
        set_total(&mut client, day(12), 1).await,
        CapacityOutcome::BelowTaken
    );
    assert_eq!(totals(&client, day(10), day(12)).await, [3, 3]);

    assert_eq!(
        set_total(&mut client, day(12), 2).await,
        CapacityOutcome::Changed { nights: 2 }
    );
    assert_eq!(totals(&client, day(10), day(12)).await, [2, 2]);
    assert_eq!(taken(&client, day(10), day(12)).await, [2, 0]);
    let one_more = request("one-more", day(10), day(11), 1);
    assert_eq!(
        ops::hold(&mut client, &one_more).await.unwrap(),
        HoldOutcome::Full
    );

    // A range reaching past the horizon changes nothing either.
    assert_eq!(
        set_total(&mut client, day(13), 5).await,
        CapacityOutcome::NotFound
    );
    assert_eq!(totals(&client, day(10), day(12)).await, [2, 2]);
    assert!(matches!(
        set_total(&mut client, day(10), 5).await,
        CapacityOutcome::Invalid(_)
    ));
}

#[tokio::test]
async fn takes_stop_at_a_sell_limit_above_total() {
    let owner = Db::start().await;
    let mut client = owner.client().await;
    room_type(&client, day(10), 1, 2).await;
    let (from, to) = (day(10), day(11));
    assert_eq!(
        ops::set_capacity(&mut client, HOTEL, ROOM, from, to, None, Some(Some(3)))
            .await
            .unwrap(),
        CapacityOutcome::Changed { nights: 1 }
    );
    for i in 0..3 {
        let req = request(&format!("b-{i}"), from, to, 1);
        assert_eq!(
            ops::hold(&mut client, &req).await.unwrap(),
            HoldOutcome::Held
        );
    }
    let fourth = request("b-3", from, to, 1);
    assert_eq!(
        ops::hold(&mut client, &fourth).await.unwrap(),
        HoldOutcome::Full
    );
    assert_eq!(taken(&client, from, to).await, [3]);

    // A limit under the total is not overbooking.
    assert!(matches!(
        ops::set_capacity(&mut client, HOTEL, ROOM, from, to, None, Some(Some(1)))
            .await
            .unwrap(),
        CapacityOutcome::Invalid(_)
    ));
    // Clearing the limit would leave 3 taken over a total of 2.
    assert_eq!(
        ops::set_capacity(&mut client, HOTEL, ROOM, from, to, None, Some(None))
            .await
            .unwrap(),
        CapacityOutcome::BelowTaken
    );
    let row = client
        .query_one(
            "SELECT total, sell_limit FROM inventory WHERE hotel_id = $1 AND room_type_id = $2",
            &[&HOTEL, &ROOM],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, i32>(0), row.get::<_, Option<i32>>(1)),
        (2, Some(3))
    );
}

#[tokio::test]
async fn a_retried_hold_returns_the_existing_booking_and_takes_nothing() {
    let owner = Db::start().await;
    let mut client = owner.client().await;
    room_type(&client, day(10), 2, 5).await;
    let req = request("b-7f3a", day(10), day(12), 1);
    assert_eq!(
        ops::hold(&mut client, &req).await.unwrap(),
        HoldOutcome::Held
    );
    assert_eq!(
        ops::hold(&mut client, &req).await.unwrap(),
        HoldOutcome::AlreadyExists {
            status: BookingStatus::Held
        }
    );
    assert_eq!(taken(&client, day(10), day(12)).await, [1, 1]);
    assert_eq!(
        ops::confirm(&client, "b-7f3a").await.unwrap(),
        Transition::Done
    );
    assert_eq!(
        ops::hold(&mut client, &req).await.unwrap(),
        HoldOutcome::AlreadyExists {
            status: BookingStatus::Confirmed
        }
    );
    assert_eq!(taken(&client, day(10), day(12)).await, [1, 1]);

    // A double click: the same id from ten connections at once.
    let pool = Pool::new(&owner, 10).await;
    let clicks = futures_util::future::join_all((0..10).map(|_| {
        let pool = pool.clone();
        async move {
            pool.hold(&request("double-click", day(10), day(12), 1))
                .await
                .expect("hold")
        }
    }))
    .await;
    let held = clicks.iter().filter(|o| **o == HoldOutcome::Held).count();
    assert_eq!(held, 1, "{clicks:?}");
    assert!(clicks.iter().all(|o| matches!(
        o,
        HoldOutcome::Held
            | HoldOutcome::AlreadyExists {
                status: BookingStatus::Held
            }
    )));
    assert_eq!(taken(&client, day(10), day(12)).await, [2, 2]);
}

#[tokio::test]
async fn cancel_returns_a_confirmed_booking_and_open_horizon_adds_nights_once() {
    let owner = Db::start().await;
    let mut client = owner.client().await;
    room_type(&client, day(10), 3, 2).await;
    let stay = request("stay", day(10), day(13), 2);
    assert_eq!(
        ops::hold(&mut client, &stay).await.unwrap(),
        HoldOutcome::Held
    );
    assert_eq!(
        ops::confirm(&client, "stay").await.unwrap(),
        Transition::Done
    );
    assert_eq!(taken(&client, day(10), day(13)).await, [2, 2, 2]);
    assert_eq!(
        ops::cancel(&mut client, "stay").await.unwrap(),
        Transition::Done
    );
    assert_eq!(taken(&client, day(10), day(13)).await, [0, 0, 0]);
    assert_eq!(status(&client, "stay").await.as_deref(), Some("cancelled"));
    assert_eq!(
        ops::cancel(&mut client, "stay").await.unwrap(),
        Transition::WrongState(BookingStatus::Cancelled)
    );
    assert_eq!(taken(&client, day(10), day(13)).await, [0, 0, 0]);

    // The latest night (12) decides what new nights copy.
    assert_eq!(
        ops::set_capacity(&mut client, HOTEL, ROOM, day(12), day(13), Some(4), None)
            .await
            .unwrap(),
        CapacityOutcome::Changed { nights: 1 }
    );
    // A second room type whose rows end earlier (night 10).
    add_room_type(&client, ROOM + 1, day(10), 1, 9).await;

    // Through night 15: 13..=15 for the first type, 11..=15 for the second.
    assert_eq!(ops::open_horizon(&client, day(15)).await.unwrap(), 3 + 5);
    assert_eq!(ops::open_horizon(&client, day(15)).await.unwrap(), 0);
    assert_eq!(totals(&client, day(10), day(16)).await, [2, 2, 4, 4, 4, 4]);
    let copied: Vec<(i64, i32, Option<i32>)> = client
        .query(
            "SELECT room_type_id, total, price_cents FROM inventory
             WHERE night > '2030-06-12' ORDER BY room_type_id, night",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    assert_eq!(copied.len(), 3 + 3);
    assert!(copied[..3].iter().all(|c| *c == (ROOM, 4, Some(12000))));
    assert!(copied[3..].iter().all(|c| *c == (ROOM + 1, 9, Some(12000))));
    // The new nights are on sale.
    let later = request("later", day(14), day(16), 4);
    assert_eq!(
        ops::hold(&mut client, &later).await.unwrap(),
        HoldOutcome::Held
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_stays_racing_never_oversell_or_fail() {
    const HOLDS: usize = 200;
    const TOTAL: i32 = 6;
    let owner = Db::start().await;
    let client = owner.client().await;
    room_type(&client, day(10), 6, TOTAL).await;
    let pool = Pool::new(&owner, 20).await;
    // Stays of one to three nights over six nights: pairs that share nights
    // in every arrangement, which would deadlock without one lock order.
    let tasks: Vec<_> = (0..HOLDS)
        .map(|i| {
            let pool = pool.clone();
            let check_in = day(10 + (i % 4) as u32);
            let check_out = check_in + chrono::Days::new(1 + (i as u64 * 7) % 3);
            let req = request(&format!("s-{i}"), check_in, check_out, 1 + (i % 2) as i32);
            tokio::spawn(async move { pool.hold(&req).await })
        })
        .collect();
    for task in tasks {
        let outcome = task.await.expect("hold task").expect("no hold may fail");
        assert!(matches!(outcome, HoldOutcome::Held | HoldOutcome::Full));
    }
    // Every unit taken belongs to a held booking, night by night.
    let mismatches: i64 = client
        .query_one(
            "SELECT count(*) FROM inventory i
             WHERE i.taken > i.total
                OR i.taken <> (SELECT coalesce(sum(b.rooms), 0) FROM bookings b
                               WHERE b.status = 'held' AND b.check_in <= i.night
                                 AND b.check_out > i.night)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(mismatches, 0);
    // One-room stays fail only on a night at exactly TOTAL, and many fail.
    assert!(taken(&client, day(10), day(16)).await.contains(&TOTAL));
}

#[tokio::test]
async fn bad_requests_are_answers_not_errors() {
    let owner = Db::start().await;
    let mut client = owner.client().await;
    room_type(&client, day(10), 2, 2).await;
    let invalid = [
        request("same-day", day(10), day(10), 1),
        request("backwards", day(11), day(10), 1),
        request("no-rooms", day(10), day(11), 0),
        request("month", day(1), day(1) + chrono::Days::new(32), 1),
        request("", day(10), day(11), 1),
        request("nul\0", day(10), day(11), 1),
        HoldRequest {
            hold_for: Duration::ZERO,
            ..request("no-time", day(10), day(11), 1)
        },
    ];
    for req in &invalid {
        assert!(
            matches!(
                ops::hold(&mut client, req).await,
                Ok(HoldOutcome::Invalid(_))
            ),
            "{req:?}"
        );
    }
    let huge = request("huge", day(10), day(11), i32::MAX);
    assert_eq!(
        ops::hold(&mut client, &huge).await.unwrap(),
        HoldOutcome::Full
    );
    let elsewhere = HoldRequest {
        room_type_id: 99,
        ..request("elsewhere", day(10), day(11), 1)
    };
    assert_eq!(
        ops::hold(&mut client, &elsewhere).await.unwrap(),
        HoldOutcome::NotFound
    );
    assert_eq!(booking_count(&client).await, 0);
    assert_eq!(taken(&client, day(10), day(12)).await, [0, 0]);
    assert!(matches!(
        ops::sweep(&mut client, 0).await,
        Err(OpsError::InvalidArgument(_))
    ));
    assert_eq!(
        ops::confirm(&client, "nobody").await.unwrap(),
        Transition::NotFound
    );
    assert_eq!(
        ops::cancel(&mut client, "nobody").await.unwrap(),
        Transition::NotFound
    );
    for status in [
        BookingStatus::Held,
        BookingStatus::Confirmed,
        BookingStatus::Released,
        BookingStatus::Expired,
        BookingStatus::Cancelled,
    ] {
        assert_eq!(status.as_str().parse::<BookingStatus>(), Ok(status));
    }
    assert!("paid".parse::<BookingStatus>().is_err());
}

//! A transaction over several hotels shows on all of them or on none.
//!
//! The copy publishes each owner transaction with one swap of the whole
//! copy, each hotel's block copied on write. Swapping hotel by hotel would
//! let a reader see some hotels after a transaction and others before it.
//! Here every owner transaction sets one value on every night of every
//! room type of six hotels, in separate statements and in a changing hotel
//! order; readers poll the copy in the process and through `/v1/search`,
//! and every copy they see must hold one value throughout.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use vacancy_lab::http_client::HttpClient;
use vacancy_service::slot;
use vacancy_service::{App, ReadModel};

use crate::support::{TestOwner, wait_for};

const HOTELS: i64 = 6;
const ROOM_TYPES: i64 = 2;
const NIGHTS: i64 = 3;
const TOTAL: i64 = 100;
const TRANSACTIONS: i64 = 80;

fn first_night() -> chrono::NaiveDate {
    chrono::Utc::now().date_naive() + chrono::Days::new(1)
}

/// Every `taken` of the six hotels in one copy: one value when no
/// transaction is half shown.
fn taken_values(model: &ReadModel) -> BTreeSet<i32> {
    let copy = model.read();
    let mut seen = BTreeSet::new();
    for hotel_id in 1..=HOTELS {
        for room_type_id in 1..=ROOM_TYPES {
            let key = vacancy_service::CalendarKey {
                hotel_id,
                room_type_id,
            };
            for n in 0..NIGHTS {
                let night = first_night() + chrono::Days::new(n as u64);
                let taken = copy
                    .calendars
                    .get(&key)
                    .and_then(|c| c.get(night))
                    .map_or(-1, |counts| counts.taken);
                seen.insert(taken);
            }
        }
    }
    seen
}

/// Every `free_units` of one search over the six hotels' city.
async fn free_units_shown(client: &HttpClient) -> BTreeSet<i64> {
    let check_in = first_night();
    let check_out = check_in + chrono::Days::new(NIGHTS as u64);
    let path = format!(
        "/v1/search?city=Atomville&check_in={check_in}&check_out={check_out}&room=1&limit=50"
    );
    let answer = client.get(&path).await.expect("a search answer");
    assert_eq!(answer.status, 200, "{path}: {}", answer.text());
    let body = answer.json();
    let results = body["results"].as_array().expect("results");
    assert_eq!(
        results.len(),
        HOTELS as usize,
        "every hotel is free: {body}"
    );
    results
        .iter()
        .flat_map(|h| h["room_types"].as_array().expect("room types").iter())
        .map(|t| t["free_units"].as_i64().expect("free units"))
        .collect()
}

async fn start(owner: &TestOwner) -> App {
    let client = owner.client().await;
    client
        .batch_execute(&format!(
            "INSERT INTO hotels (id, name, city) SELECT h, 'Hotel ' || h, 'Atomville'
               FROM generate_series(1, {HOTELS}) h;
             INSERT INTO room_types (hotel_id, id, name, max_guests)
               SELECT h, rt, 'Room ' || rt, 2
               FROM generate_series(1, {HOTELS}) h, generate_series(1, {ROOM_TYPES}) rt;
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               SELECT h, rt, DATE '{}' + n, {TOTAL}, 10000
               FROM generate_series(1, {HOTELS}) h, generate_series(1, {ROOM_TYPES}) rt,
                    generate_series(0, {}) n;",
            first_night(),
            NIGHTS - 1
        ))
        .await
        .expect("load six hotels");
    let settings = crate::projector::settings_for(owner);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = vacancy_service::start(settings, listener).expect("start vacancy");
    let target = slot::current_wal_lsn(&client).await.unwrap();
    wait_for("the copy to load", Duration::from_secs(60), || async {
        (app.model.freshness.is_loaded() && app.model.freshness.applied() >= target).then_some(())
    })
    .await;
    app
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_over_several_hotels_shows_on_all_or_none() {
    let owner = TestOwner::start().await;
    let app = start(&owner).await;
    let http = HttpClient::new(app.addr, Duration::from_secs(10)).expect("an HTTP client");
    wait_for(
        "the index to be searchable",
        Duration::from_secs(60),
        || async { (http.get("/readyz").await.ok()?.status == 200).then_some(()) },
    )
    .await;

    let done = Arc::new(AtomicBool::new(false));
    // A reader on its own thread, polling the copy as fast as it can.
    let in_process = {
        let model = app.model.clone();
        let done = done.clone();
        std::thread::spawn(move || {
            let (mut polls, mut distinct) = (0u64, BTreeSet::new());
            while !done.load(Ordering::Acquire) {
                let seen = taken_values(&model);
                assert_eq!(
                    seen.len(),
                    1,
                    "one copy shows part of a transaction: {seen:?}"
                );
                distinct.extend(seen);
                polls += 1;
            }
            (polls, distinct)
        })
    };
    // A guest searching the city over HTTP.
    let over_http = {
        let done = done.clone();
        let http = http.clone();
        tokio::spawn(async move {
            let (mut answers, mut distinct) = (0u64, BTreeSet::new());
            while !done.load(Ordering::Acquire) {
                let shown = free_units_shown(&http).await;
                assert_eq!(
                    shown.len(),
                    1,
                    "one answer shows part of a transaction: {shown:?}"
                );
                distinct.extend(shown);
                answers += 1;
            }
            (answers, distinct)
        })
    };

    let writer = owner.client().await;
    for k in 1..=TRANSACTIONS {
        // One statement per hotel, in an order that turns with k, so the
        // hotels' changes reach the stream in a different order each time.
        let mut statements = String::from("BEGIN;");
        for i in 0..HOTELS {
            let hotel_id = 1 + (i + k) % HOTELS;
            statements.push_str(&format!(
                "UPDATE inventory SET taken = {k} WHERE hotel_id = {hotel_id};"
            ));
        }
        statements.push_str("COMMIT;");
        writer.batch_execute(&statements).await.expect("a write");
    }
    let end = slot::current_wal_lsn(&writer).await.unwrap();
    wait_for(
        "the copy to apply every write",
        Duration::from_secs(60),
        || async { (app.model.freshness.applied() >= end).then_some(()) },
    )
    .await;
    done.store(true, Ordering::Release);

    let (polls, seen_in_process) = in_process.join().expect("the in-process reader");
    let (answers, seen_over_http) = over_http.await.expect("the HTTP reader");
    assert_eq!(
        taken_values(&app.model),
        BTreeSet::from([TRANSACTIONS as i32]),
        "the last transaction is applied everywhere"
    );
    // The readers saw the writes happen, not only before and after.
    assert!(
        seen_in_process.len() > 2,
        "{polls} polls saw only {seen_in_process:?}"
    );
    assert!(
        answers > 0 && !seen_over_http.is_empty(),
        "{answers} answers saw {seen_over_http:?}"
    );
    app.stop(Duration::from_secs(10)).await;
}

//! The stale-read loop against a real owner: quote tokens, take outcomes,
//! bypass advice, racing simulated guests, and the divergence audit.
//!
//! Counts are read from each app's own ledger (`/v1/stale-reads`), never
//! from the process-wide Prometheus counters, which other tests in this
//! binary move at the same time.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::NaiveDate;
use serde_json::{Value, json};
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use vacancy_lab::cluster::StopMode;
use vacancy_lab::http_client::HttpResponse;
use vacancy_lab::ops;
use vacancy_lab::simulator::{self, SimOptions};
use vacancy_service::slot;
use vacancy_service::{App, QuoteKey, Settings, Source};

use crate::support::{TestOwner, wait_for};

const TOKEN: &str = "test-booking-token-0123456789";

fn day(n: u64) -> NaiveDate {
    chrono::Utc::now().date_naive() + chrono::Days::new(n)
}

fn settings_for(owner_url: &str) -> Settings {
    let mut s = Settings::defaults();
    s.owner.url = owner_url.to_string();
    s.stream.reconnect_min_ms = 50;
    s.stream.reconnect_max_ms = 500;
    s.stale.booking_tokens = vec![TOKEN.to_string()];
    s
}

async fn start(settings: Settings) -> App {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    vacancy_service::start(settings, listener).expect("start vacancy")
}

/// One hotel with room types `(id, total units)`, on sale for `nights` nights from today.
async fn hotel(client: &Client, hotel_id: i64, types: &[(i64, i32)], nights: i64) {
    let mut sql = format!(
        "INSERT INTO hotels (id, name, city) VALUES ({hotel_id}, 'Hotel {hotel_id}', 'Lisbon');"
    );
    for (rt, total) in types {
        sql.push_str(&format!(
            "INSERT INTO room_types VALUES ({hotel_id}, {rt}, 'Room {rt}', 2);
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               SELECT {hotel_id}, {rt}, DATE '{}' + n, {total}, 10000
               FROM generate_series(0, {}) n;",
            day(0),
            nights - 1
        ));
    }
    client.batch_execute(&sql).await.expect("load hotel");
}

/// Waits until the copy and the index reflect everything the owner committed.
async fn settled(app: &App, client: &Client) {
    let target = slot::current_wal_lsn(client).await.unwrap();
    wait_for("the copy to catch up", Duration::from_secs(60), || async {
        (app.model.freshness.applied() >= target && app.hotel_index.synced_lsn() >= target)
            .then_some(())
    })
    .await;
}

async fn get(app: &App, path: &str) -> HttpResponse {
    vacancy_lab::http_client::http(app.addr, "GET", path, None, None, Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

async fn post(app: &App, bearer: Option<&str>, body: &[u8]) -> HttpResponse {
    vacancy_lab::http_client::http(
        app.addr,
        "POST",
        "/v1/take-outcomes",
        bearer,
        Some(body),
        Duration::from_secs(10),
    )
    .await
    .expect("POST /v1/take-outcomes")
}

fn assert_problem(r: &HttpResponse, status: u16, kind: &str, field: Option<&str>) {
    let body = String::from_utf8_lossy(&r.body);
    assert_eq!(r.status, status, "{body}");
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let p = r.json();
    assert_eq!(p["type"], kind, "{body}");
    if let Some(f) = field {
        assert_eq!(p["field"], f, "{body}");
    }
}

fn stay_query() -> String {
    format!("check_in={}&check_out={}", day(1), day(3))
}

/// Room types of the first hotel of a search answer, by id.
fn offers(answer: &Value) -> BTreeMap<i64, Value> {
    answer["results"][0]["room_types"]
        .as_array()
        .expect("room types")
        .iter()
        .map(|t| (t["room_type_id"].as_i64().unwrap(), t.clone()))
        .collect()
}

fn report(attempt: &str, quote: Option<&str>, room_type_id: i64, outcome: &str) -> Value {
    json!({
        "attempt_id": attempt,
        "quote": quote,
        "hotel_id": 1,
        "room_type_id": room_type_id,
        "check_in": day(1),
        "check_out": day(3),
        "rooms": 1,
        "outcome": outcome,
    })
}

async fn stale_reads(app: &App) -> Value {
    let r = get(app, "/v1/stale-reads").await;
    assert_eq!(r.status, 200);
    r.json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotes_are_signed_and_take_outcomes_refuse_forgeries_and_count_retries_once() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    hotel(&client, 1, &[(1, 9), (2, 2)], 10).await;
    let mut settings = settings_for(&owner.url);
    // Quotes of every source: confirmed reads for the few-unit room type.
    settings.search.fresh_reads = vacancy_service::FreshReads::Confirmed;
    let app = start(settings).await;
    settled(&app, &client).await;

    // Every room type shown carries a quote of exactly what was shown.
    let r = get(
        &app,
        &format!("/v1/search?hotel_ids=1&room=1&{}", stay_query()),
    )
    .await;
    assert_eq!(r.status, 200);
    let shown = offers(&r.json());
    assert_eq!(shown.len(), 2);
    let key = &app.stale.key;
    for (rt, offer) in &shown {
        let q = key
            .verify(offer["quote"].as_str().unwrap())
            .expect("a quote this app signed");
        assert_eq!((q.hotel_id, q.room_type_id), (1, *rt));
        assert_eq!((q.check_in, q.check_out), (day(1), day(3)));
        assert_eq!(
            i64::from(q.free_units),
            offer["free_units"].as_i64().unwrap()
        );
        let want = if *rt == 1 {
            Source::Copy
        } else {
            Source::Confirmed
        };
        assert_eq!(q.source, want, "few units are confirmed against the owner");
        // A confirmed quote carries the position its numbers were confirmed at.
        let lsn_field = if want == Source::Confirmed {
            "confirmed_lsn"
        } else {
            "lsn"
        };
        assert_eq!(q.lsn.to_string(), r.json()[lsn_field].as_str().unwrap());
    }
    let r = get(
        &app,
        &format!("/v1/hotels/1/availability?room=1&{}", stay_query()),
    )
    .await;
    assert_eq!(r.status, 200);
    for t in r.json()["room_types"].as_array().unwrap() {
        let q = key.verify(t["quote"].as_str().unwrap()).unwrap();
        assert_eq!(q.room_type_id, t["room_type_id"].as_i64().unwrap());
        assert_eq!(i64::from(q.free_units), t["free_units"].as_i64().unwrap());
    }

    let copy_quote = shown[&1]["quote"].as_str().unwrap().to_string();
    let confirmed_quote = shown[&2]["quote"].as_str().unwrap().to_string();
    let conflict = report("attempt-1", Some(&copy_quote), 1, "conflict").to_string();

    // Without the booking service's token: 401, and nothing is counted.
    let r = post(&app, None, conflict.as_bytes()).await;
    assert_problem(&r, 401, "/problems/unauthorized", None);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    let r = post(
        &app,
        Some("test-booking-token-0123456780"),
        conflict.as_bytes(),
    )
    .await;
    assert_problem(&r, 401, "/problems/unauthorized", None);

    // An altered quote (one character changed) and a forged one (another key).
    let mut altered: Vec<char> = copy_quote.chars().collect();
    altered[40] = if altered[40] == 'A' { 'B' } else { 'A' };
    let altered: String = altered.into_iter().collect();
    let r = post(
        &app,
        Some(TOKEN),
        report("attempt-x", Some(&altered), 1, "conflict")
            .to_string()
            .as_bytes(),
    )
    .await;
    assert_problem(&r, 422, "/problems/invalid-quote", Some("quote"));
    let mut forged = key.verify(&copy_quote).unwrap();
    forged.free_units = 99;
    let forged = QuoteKey::random().sign(&forged).unwrap();
    let r = post(
        &app,
        Some(TOKEN),
        report("attempt-x", Some(&forged), 1, "conflict")
            .to_string()
            .as_bytes(),
    )
    .await;
    assert_problem(&r, 422, "/problems/invalid-quote", Some("quote"));
    // A genuine quote for another room type.
    let r = post(
        &app,
        Some(TOKEN),
        report("attempt-x", Some(&copy_quote), 2, "conflict")
            .to_string()
            .as_bytes(),
    )
    .await;
    assert_problem(&r, 422, "/problems/quote-mismatch", Some("room_type_id"));
    // Bad fields are named; an oversized body is refused.
    let mut bad = report("attempt-x", None, 1, "conflict");
    bad["hotel_id"] = json!("one");
    let r = post(&app, Some(TOKEN), bad.to_string().as_bytes()).await;
    assert_problem(&r, 400, "/problems/invalid-parameter", Some("hotel_id"));
    let mut bad = report("attempt-x", None, 1, "lost");
    bad["outcome"] = json!("lost");
    let r = post(&app, Some(TOKEN), bad.to_string().as_bytes()).await;
    assert_problem(&r, 400, "/problems/invalid-parameter", Some("outcome"));
    let mut huge = report("attempt-x", None, 1, "conflict");
    huge["attempt_id"] = json!("x".repeat(20_000));
    let r = post(&app, Some(TOKEN), huge.to_string().as_bytes()).await;
    assert_problem(&r, 413, "/problems/body-too-large", None);
    assert_eq!(stale_reads(&app).await["totals"]["conflicts"], 0);

    // A conflict after the copy showed 9 free: a stale read.
    let first = post(&app, Some(TOKEN), conflict.as_bytes()).await;
    assert_eq!(
        first.status,
        200,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    assert_eq!(first.header("idempotent-replayed"), None);
    let answer = first.json();
    assert_eq!(answer["source"], "copy");
    assert_eq!(answer["stale_read"], true);
    // The retry: the same answer, flagged as a replay, not counted again.
    let again = post(&app, Some(TOKEN), conflict.as_bytes()).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.json(), answer);
    // The same attempt with another outcome is refused.
    let r = post(
        &app,
        Some(TOKEN),
        report("attempt-1", Some(&copy_quote), 1, "taken")
            .to_string()
            .as_bytes(),
    )
    .await;
    assert_problem(&r, 409, "/problems/attempt-id-reused", Some("attempt_id"));
    // A take of a room type shown confirmed, and one without a quote.
    let mut taken = report("attempt-2", Some(&confirmed_quote), 2, "taken");
    taken["commit_lsn"] = json!("0/10");
    let r = post(&app, Some(TOKEN), taken.to_string().as_bytes()).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        (r.json()["source"].clone(), r.json()["stale_read"].clone()),
        (json!("confirmed"), json!(false))
    );
    let r = post(
        &app,
        Some(TOKEN),
        report("attempt-3", None, 1, "conflict")
            .to_string()
            .as_bytes(),
    )
    .await;
    assert_eq!(r.json()["source"], "none");

    let s = stale_reads(&app).await;
    assert_eq!(s["takes"], 3);
    assert_eq!(s["conflicts"], 2);
    assert_eq!(s["stale_reads"], 1);
    assert!(
        (s["share"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-9,
        "{s}"
    );
    assert_eq!(s["totals"]["replays"], 1);
    assert_eq!(s["totals"]["taken"], 1);
    assert_eq!(
        s["totals"]["conflicts_by_source"],
        json!({"copy": 1, "none": 1})
    );

    let r = get(&app, "/metrics").await;
    let text = String::from_utf8_lossy(&r.body);
    for name in [
        "vacancy_takes_total{outcome=\"conflict\",source=\"copy\"}",
        "vacancy_conflicts_after_shown_available_total{source=\"copy\"}",
        "vacancy_stale_read_share_ratio",
        "vacancy_conflict_show_lag_seconds_bucket",
        "vacancy_bypass_advice_total{reason=\"hotel_conflicts\"}",
        "vacancy_divergence_checked_total",
        "vacancy_divergence_mismatches_total",
        "vacancy_owner_reads_total{reason=\"audit\"}",
    ] {
        assert!(text.contains(name), "{name} missing from /metrics");
    }
    let doc = get(&app, "/openapi.json").await.json();
    assert!(doc["paths"]["/v1/take-outcomes"]["post"].is_object());
    assert!(doc["paths"]["/v1/bypass"]["get"].is_object());
    assert!(doc["paths"]["/v1/stale-reads"]["get"].is_object());
    assert!(doc["components"]["schemas"]["RoomOffer"]["properties"]["quote"].is_object());
    app.stop(Duration::from_secs(5)).await;
}

async fn advice(app: &App, hotel_id: i64, room_type_id: i64, rooms: i32) -> Value {
    let r = get(
        app,
        &format!(
            "/v1/bypass?hotel_id={hotel_id}&room_type_id={room_type_id}&rooms={rooms}&{}",
            stay_query()
        ),
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

fn reasons(advice: &Value) -> Vec<String> {
    advice["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_bypass_reason_is_triggered() {
    // not_ready: an owner that never answers, so the copy never loads.
    let mut unreachable = settings_for("postgresql://postgres@127.0.0.1:1/owner");
    unreachable.stale.audit_interval_ms = 0;
    let lost = start(unreachable).await;
    let a = advice(&lost, 1, 1, 1).await;
    assert_eq!(reasons(&a), vec!["not_ready"]);
    assert_eq!(a["bypass"], true);
    assert_eq!(a["free_units"], Value::Null);
    lost.stop(Duration::from_secs(5)).await;

    let owner = TestOwner::start().await;
    let client = owner.client().await;
    hotel(&client, 1, &[(1, 9), (2, 2)], 10).await;
    hotel(&client, 2, &[(1, 9), (2, 9)], 10).await;
    let mut settings = settings_for(&owner.url);
    // Few-unit room types confirmed, so a flagged hotel's row reads stand out.
    settings.search.fresh_reads = vacancy_service::FreshReads::Confirmed;
    settings.stale.hotel_min_takes = 4;
    settings.stale.hotel_share_bound = 0.25;
    settings.stale.bypass_max_lag_ms = 300;
    // A dropped stream stays down for the rest of the test.
    settings.stream.reconnect_min_ms = 120_000;
    settings.stream.reconnect_max_ms = 120_000;
    settings.stream.heartbeat_interval_ms = 100;
    settings.stream.slot_watch_interval_ms = 100;
    let app = start(settings).await;
    settled(&app, &client).await;

    // Room to spare: no bypass.
    let a = advice(&app, 1, 1, 1).await;
    assert_eq!(a["bypass"], false, "{a}");
    assert_eq!(a["free_units"], 9);
    // few_units: two left with a threshold of 2; and a party of 8 of 9.
    assert_eq!(reasons(&advice(&app, 1, 2, 1).await), vec!["few_units"]);
    assert_eq!(reasons(&advice(&app, 1, 1, 8).await), vec!["few_units"]);
    assert_eq!(
        reasons(&advice(&app, 1, 7, 1).await),
        vec!["few_units"],
        "a room type the copy does not know"
    );

    // hotel_conflicts: hotel 2's takes keep failing after the copy showed 9.
    let r = get(
        &app,
        &format!("/v1/search?hotel_ids=2&room=1&{}", stay_query()),
    )
    .await;
    let shown = offers(&r.json());
    assert!(shown.values().all(|t| t["source"] == "copy"));
    let quote = shown[&1]["quote"].as_str().unwrap();
    for i in 0..3 {
        let mut body = report(&format!("h2-{i}"), Some(quote), 1, "conflict");
        body["hotel_id"] = json!(2);
        let r = post(&app, Some(TOKEN), body.to_string().as_bytes()).await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(
        advice(&app, 2, 1, 1).await["bypass"],
        false,
        "three takes are too few to judge a hotel"
    );
    let mut body = report("h2-3", Some(quote), 1, "conflict");
    body["hotel_id"] = json!(2);
    assert_eq!(
        post(&app, Some(TOKEN), body.to_string().as_bytes())
            .await
            .status,
        200
    );
    assert_eq!(
        reasons(&advice(&app, 2, 1, 1).await),
        vec!["hotel_conflicts"]
    );
    assert_eq!(
        reasons(&advice(&app, 2, 2, 1).await),
        vec!["hotel_conflicts"],
        "the whole hotel"
    );
    assert_eq!(advice(&app, 1, 1, 1).await["bypass"], false, "not hotel 1");
    // Search shows the flagged hotel from the owner, the other from the copy.
    let r = get(
        &app,
        &format!("/v1/search?hotel_ids=1,2&room=1&{}", stay_query()),
    )
    .await;
    for h in r.json()["results"].as_array().unwrap() {
        for t in h["room_types"].as_array().unwrap() {
            let free = t["free_units"].as_i64().unwrap();
            let want = if h["hotel_id"] == 2 {
                "owner"
            } else if free <= 2 {
                "confirmed"
            } else {
                "copy"
            };
            assert_eq!(t["source"], want, "hotel {}: {t}", h["hotel_id"]);
        }
    }
    let s = stale_reads(&app).await;
    assert_eq!(s["hotels"][0]["hotel_id"], 2);
    assert_eq!(s["hotels"][0]["bypassed"], true);
    // Successful takes dilute the share below the bound: back to the copy.
    for i in 0..13 {
        let mut body = report(&format!("h2-ok-{i}"), None, 1, "taken");
        body["hotel_id"] = json!(2);
        assert_eq!(
            post(&app, Some(TOKEN), body.to_string().as_bytes())
                .await
                .status,
            200
        );
    }
    assert_eq!(
        advice(&app, 2, 1, 1).await["bypass"],
        false,
        "4 of 17 < 0.25"
    );
    let r = get(
        &app,
        &format!("/v1/search?hotel_ids=2&room=1&{}", stay_query()),
    )
    .await;
    assert!(offers(&r.json()).values().all(|t| t["source"] == "copy"));

    // lagging: the stream is cut and stays down while the owner moves on
    // (heartbeats), so the copy's lag grows past the bound.
    client
        .batch_execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
             WHERE slot_name = 'vacancy' AND active_pid IS NOT NULL",
        )
        .await
        .unwrap();
    let a = wait_for("the copy to lag", Duration::from_secs(30), || async {
        let a = advice(&app, 1, 1, 1).await;
        reasons(&a).contains(&"lagging".to_string()).then_some(a)
    })
    .await;
    assert_eq!(reasons(&a), vec!["lagging"]);
    assert!(a["lag_ms"].as_u64().unwrap() > 300);
    app.stop(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_guests_on_a_hot_hotel_count_every_conflict_once_with_its_source() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    hotel(&client, 1, &[(1, 4)], 5).await;
    let mut settings = settings_for(&owner.url);
    // Shown 2 to 4 free: the copy's numbers; 1 free: the owner's.
    settings.search.few_units_threshold = 1;
    let app = start(settings).await;
    settled(&app, &client).await;

    let mut options = SimOptions::hot(app.addr, &owner.url, TOKEN, vec![1], day(1));
    options.guests = 8;
    options.takes_per_guest = Some(12);
    options.report_twice = true;
    options.seed = 7;
    // Every hold goes back, so the hotel never sells out for good.
    options.pay_percent = 0;
    options.release_percent = 100;
    options.duration = Some(Duration::from_secs(90));
    let summary = simulator::run(options, Default::default())
        .await
        .expect("simulator");
    eprintln!("{summary:?}");
    let attempts = summary.taken + summary.conflicts + summary.errors;
    assert!(summary.conflicts > 0, "racing guests produced no conflict");
    assert_eq!(summary.reports_failed, 0);
    assert_eq!(summary.reports_recorded, attempts);
    assert_eq!(
        summary.reports_replayed, attempts,
        "every retry was a replay"
    );

    let s = stale_reads(&app).await;
    let totals = &s["totals"];
    assert_eq!(totals["conflicts"], summary.conflicts, "{s}");
    assert_eq!(totals["taken"], summary.taken, "{s}");
    assert_eq!(totals["errors"], summary.errors, "{s}");
    assert_eq!(totals["replays"], attempts);
    let by_source: BTreeMap<String, u64> =
        serde_json::from_value(totals["conflicts_by_source"].clone()).unwrap();
    assert_eq!(by_source, summary.conflicts_by_source);
    let takes_by_source: BTreeMap<String, u64> =
        serde_json::from_value(totals["takes_by_source"].clone()).unwrap();
    assert_eq!(takes_by_source, summary.takes_by_source);
    // Every guest picked a room type shown with enough units, so each
    // conflict on the copy's numbers is a stale read, and only those.
    let from_copy: u64 = ["copy", "copy_fallback"]
        .iter()
        .filter_map(|k| summary.conflicts_by_source.get(*k))
        .sum();
    assert_eq!(totals["stale_reads"], from_copy);
    assert_eq!(summary.stale_reads, from_copy);
    // The owner agrees on the takes: one booking per successful hold.
    let bookings: i64 = client
        .query_one("SELECT count(*) FROM bookings WHERE id LIKE 'sim-7-%'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(bookings as u64, summary.taken);
    app.stop(Duration::from_secs(5)).await;
}

/// Holds and releases rows until `stop`, so the audit races writes;
/// `done` counts the holds made so far.
async fn churn(
    url: String,
    stop: CancellationToken,
    done: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> u64 {
    let mut client = vacancy_service::connect(&url, Duration::from_secs(10))
        .await
        .unwrap();
    let mut n = 0u64;
    while !stop.is_cancelled() {
        n += 1;
        done.store(n, std::sync::atomic::Ordering::Release);
        let night = day(n % 8);
        let req = ops::HoldRequest {
            booking_id: format!("churn-{n}"),
            hotel_id: 1 + (n % 2) as i64,
            room_type_id: 1 + (n / 2 % 2) as i64,
            check_in: night,
            check_out: night + chrono::Days::new(1),
            rooms: 1,
            hold_for: Duration::from_secs(60),
        };
        let held = ops::hold(&mut client, &req).await.unwrap();
        // Two holds in three go back; the third stays, so rows also fill up.
        if held == ops::HoldOutcome::Held && !n.is_multiple_of(3) {
            ops::release(&mut client, &req.booking_id).await.unwrap();
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn divergence_audit_sees_a_missed_change_until_the_ttl_repairs_it() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    hotel(&client, 1, &[(1, 5), (2, 5)], 10).await;
    hotel(&client, 2, &[(1, 5), (2, 5)], 10).await;
    let mut settings = settings_for(&owner.url);
    settings.model.ttl_secs = 6;
    settings.stale.audit_interval_ms = 200;
    settings.stale.audit_sample = 100; // every one of the 40 rows
    let app = start(settings).await;
    settled(&app, &client).await;
    let audit = app.stale.audit.clone();
    wait_for(
        "a background audit pass",
        Duration::from_secs(30),
        || async { (audit.status().passes > 0).then_some(()) },
    )
    .await;

    // A healthy stream under writes: never a mismatch.
    let stop = CancellationToken::new();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let writer = tokio::spawn(churn(owner.url.clone(), stop.clone(), done.clone()));
    // The passes must race writes, not run before the writer has connected.
    wait_for("the writer's first holds", Duration::from_secs(30), || {
        let made = done.load(std::sync::atomic::Ordering::Acquire);
        async move { (made >= 3).then_some(()) }
    })
    .await;
    let mut checked = 0;
    for _ in 0..8 {
        let pass = audit.pass().await.expect("audit pass");
        assert_eq!(pass.mismatches, 0, "a false positive: {pass:?}");
        checked += pass.checked;
    }
    stop.cancel();
    let writes = writer.await.unwrap();
    assert!(
        writes > 0 && checked > 0,
        "writes {writes}, checked {checked}"
    );
    assert_eq!(audit.status().mismatches, 0);

    // Every calendar confirmed just now, so the TTL runs out in 6 s, not sooner.
    client
        .batch_execute("UPDATE inventory SET price_cents = price_cents")
        .await
        .unwrap();
    settled(&app, &client).await;
    client
        .batch_execute(&format!(
            "ALTER PUBLICATION vacancy DROP TABLE inventory;
             UPDATE inventory SET price_cents = 1 WHERE hotel_id = 1 AND room_type_id = 2 AND night = DATE '{}';
             UPDATE inventory SET total = 7 WHERE hotel_id = 2 AND room_type_id = 1 AND night = DATE '{}';
             ALTER PUBLICATION vacancy ADD TABLE inventory;",
            day(0),
            day(4)
        ))
        .await
        .unwrap();
    let pass = audit.pass().await.expect("audit pass");
    assert_eq!(pass.mismatches, 2, "{pass:?}");
    let mut seen: Vec<(i64, i64, NaiveDate)> = pass
        .examples
        .iter()
        .map(|k| (k.hotel_id, k.room_type_id, k.night))
        .collect();
    seen.sort();
    assert_eq!(seen, vec![(1, 2, day(0)), (2, 1, day(4))]);

    // A confirmed read trusts the copy: the hotels found diverging are read
    // from the owner (bypass reason diverging), every room type of them.
    assert_eq!(
        audit.diverging_hotels([1, 2, 3].into_iter()),
        std::collections::HashSet::from([1, 2])
    );
    assert!(
        reasons(&advice(&app, 2, 2, 1).await).contains(&"diverging".to_string()),
        "hotel 2 is diverging"
    );
    let r = get(
        &app,
        &format!("/v1/search?hotel_ids=1,2&room=1&{}", stay_query()),
    )
    .await;
    let results = r.json()["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), 2, "{}", r.json());
    for h in &results {
        for t in h["room_types"].as_array().unwrap() {
            assert_eq!(t["source"], "owner", "hotel {}: {t}", h["hotel_id"]);
        }
    }

    // The TTL safety net re-reads the calendars; a fresh pass finds nothing.
    let clean = wait_for(
        "the TTL re-read to repair the copy",
        Duration::from_secs(60),
        || async {
            let pass = audit.pass().await.ok()?;
            (pass.mismatches == 0 && pass.checked > 0).then_some(pass)
        },
    )
    .await;
    assert_eq!(clean.skipped + clean.checked, 40);
    assert!(
        app.refresh
            .repaired
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    let s = stale_reads(&app).await;
    assert!(s["audit"]["mismatches"].as_u64().unwrap() >= 2);
    assert_eq!(s["audit"]["last_pass"]["mismatches"], 0);
    app.stop(Duration::from_secs(5)).await;
}

/// Issue 21: the 409-after-shown window and `/v1/stale-reads` survive a
/// graceful restart from a checkpoint, and a take outcome posted before the
/// restart and again after it counts once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stale_read_window_and_counted_attempts_survive_a_graceful_restart() {
    let mut owner = TestOwner::start().await;
    let client = owner.client().await;
    hotel(&client, 1, &[(1, 9)], 10).await;
    let checkpoints = tempfile::tempdir().unwrap();
    let settings = || {
        let mut s = settings_for(&owner.url);
        s.checkpoint.dir = checkpoints.path().to_str().unwrap().to_string();
        // Quotes signed before the restart must verify after it.
        s.stale.quote_key = "ab".repeat(32);
        s
    };
    let app = start(settings()).await;
    settled(&app, &client).await;
    let r = get(
        &app,
        &format!("/v1/search?hotel_ids=1&room=1&{}", stay_query()),
    )
    .await;
    assert_eq!(r.status, 200);
    let quote = offers(&r.json())[&1]["quote"].as_str().unwrap().to_string();
    let conflict = report("attempt-before", Some(&quote), 1, "conflict").to_string();
    let taken = report("attempt-taken", Some(&quote), 1, "taken").to_string();
    for body in [&conflict, &taken] {
        let r = post(&app, Some(TOKEN), body.as_bytes()).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    let before = stale_reads(&app).await;
    assert_eq!(
        (before["takes"].clone(), before["stale_reads"].clone()),
        (json!(2), json!(1))
    );
    app.stop(Duration::from_secs(30)).await;

    // The owner down at the restart: the checkpoint is not loaded (its
    // first session waits for the owner), and a report the booking service
    // retries meanwhile is refused, not counted before the counts the
    // checkpoint carries.
    tokio::task::block_in_place(|| owner.cluster.stop(StopMode::Fast)).expect("stop the owner");
    let app = start(settings()).await;
    let early = post(&app, Some(TOKEN), conflict.as_bytes()).await;
    assert_problem(&early, 503, "/problems/not-ready", None);
    tokio::task::block_in_place(|| owner.cluster.start_again()).expect("start the owner");
    wait_for(
        "the copy to load from the checkpoint",
        Duration::from_secs(60),
        || async { app.model.freshness.is_loaded().then_some(()) },
    )
    .await;
    let status = get(&app, "/v1/status").await.json();
    assert!(
        status["checkpoint"]["loaded_from"].is_object(),
        "the restart loaded a checkpoint: {status}"
    );
    let after = stale_reads(&app).await;
    for field in ["takes", "conflicts", "stale_reads", "share", "totals"] {
        assert_eq!(
            after[field], before[field],
            "{field} after the restart: {after}"
        );
    }
    // The same report again: a replay, counted once.
    let again = post(&app, Some(TOKEN), conflict.as_bytes()).await;
    assert_eq!(
        again.status,
        200,
        "{}",
        String::from_utf8_lossy(&again.body)
    );
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    // Another outcome under a counted id is still refused.
    let r = post(
        &app,
        Some(TOKEN),
        report("attempt-before", Some(&quote), 1, "taken")
            .to_string()
            .as_bytes(),
    )
    .await;
    assert_problem(&r, 409, "/problems/attempt-id-reused", Some("attempt_id"));
    let last = stale_reads(&app).await;
    assert_eq!(last["takes"], before["takes"], "{last}");
    assert_eq!(last["stale_reads"], before["stale_reads"], "{last}");
    app.stop(Duration::from_secs(30)).await;
}

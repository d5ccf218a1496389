//! Admission control (issue 24, item 1) against a running `vacancy`: with
//! the guest budget full, every further guest request is answered 503
//! `/problems/overloaded` with `Retry-After: 1` and counted, while the
//! probes and the booking service's routes, on budgets of their own, keep
//! answering 200; once a place is free, guests are admitted again.
//!
//! The budget is held full deterministically, not by racing a flood: the
//! copy is held back (its replication refused) past a write the owner has,
//! and two searches ask for that write's `min_lsn` and wait
//! (`search.min_lsn_wait_ms` is long) until the test lets the copy catch up.
//! (A `min_lsn` past the owner's own position is refused at once, so it
//! cannot hold a place.)

use std::time::Duration;

use serde_json::{Value, json};
use vacancy_lab::http_client::{HttpResponse, http};
use vacancy_service::{App, Lsn, Settings, slot};

use crate::search::hold_copy_back;
use crate::support::{TestOwner, create_publication, least_privilege_role, one_hotel, wait_for};

const TOKEN: &str = "test-booking-token-overload-0123456789";
/// The guest budget under test: small, so two held searches fill it.
const GUEST_BOUND: usize = 2;

fn day(n: u64) -> chrono::NaiveDate {
    chrono::Utc::now().date_naive() + chrono::Days::new(n)
}

fn stay() -> String {
    format!("check_in={}&check_out={}", day(1), day(3))
}

async fn call(
    app_addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> HttpResponse {
    http(
        app_addr,
        method,
        path,
        Some(TOKEN),
        body,
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// A search that waits for `min_lsn` while holding its place in the guest
/// budget. A 503 means it asked while a probe held a place: ask again.
async fn held_search(addr: std::net::SocketAddr, min_lsn: Lsn) -> HttpResponse {
    let path = format!("/v1/search?city=Lisbon&{}&room=2&min_lsn={min_lsn}", stay());
    loop {
        let answer = http(addr, "GET", &path, None, None, Duration::from_secs(120))
            .await
            .unwrap_or_else(|e| panic!("held search: {e}"));
        if answer.status != 503 {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn assert_overloaded(answer: &HttpResponse, what: &str) {
    assert_eq!(answer.status, 503, "{what}: {}", answer.text());
    assert_eq!(answer.header("retry-after"), Some("1"), "{what}");
    assert_eq!(
        answer.header("content-type"),
        Some("application/problem+json"),
        "{what}"
    );
    let problem: Value = answer.json();
    assert_eq!(problem["type"], "/problems/overloaded", "{what}: {problem}");
}

/// One sample of a Prometheus series from a scrape, 0 when absent.
fn sample(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn scrape(app: &App) -> String {
    let answer = call(app.addr, "GET", "/metrics", None).await;
    assert_eq!(answer.status, 200, "/metrics under a full guest budget");
    answer.text()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_guest_budget_sheds_guests_at_once_and_never_the_probes_or_the_booking_service() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    one_hotel(&client, "Lisbon").await;
    // A role whose replication the test can refuse, to hold the copy back.
    let url = least_privilege_role(&client, &owner.url, None).await;
    create_publication(&client).await;
    let mut settings = Settings::defaults();
    settings.owner.url = url;
    settings.stale.booking_tokens = vec![TOKEN.to_string()];
    settings.http.max_guest_requests_in_flight = GUEST_BOUND;
    // The held searches wait for their min_lsn far longer than the test needs.
    settings.search.min_lsn_wait_ms = 100_000;
    settings.http.request_timeout_ms = 110_000;
    // The copy held back is not ready, nor refused, for the lag alone.
    settings.http.ready_max_lag_ms = 600_000;
    settings.search.max_lag_ms = 600_000;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = vacancy_service::start(settings, listener).expect("start vacancy");
    let addr = app.addr;
    wait_for("readyz to answer 200", Duration::from_secs(60), || async {
        (call(addr, "GET", "/readyz", None).await.status == 200).then_some(())
    })
    .await;
    let plain_search = format!("/v1/search?city=Lisbon&{}&room=2", stay());
    assert_eq!(call(addr, "GET", &plain_search, None).await.status, 200);

    // Fill the guest budget with searches that wait: the copy is held back
    // past a write the owner has, which their min_lsn names.
    hold_copy_back(&client, false).await;
    client
        .execute(
            "SELECT pg_logical_emit_message(true, 'test.overload', 'hold')",
            &[],
        )
        .await
        .expect("a write the copy does not get");
    let hold_until: Lsn = slot::current_wal_lsn(&client).await.unwrap();
    let held: Vec<_> = (0..GUEST_BOUND)
        .map(|_| tokio::spawn(held_search(addr, hold_until)))
        .collect();
    wait_for(
        "the held searches to fill the guest budget",
        Duration::from_secs(30),
        || async {
            let answer = call(addr, "GET", &plain_search, None).await;
            (answer.status == 503).then_some(())
        },
    )
    .await;
    let before = scrape(&app).await;

    // A flood of every guest route: each answered 503 overloaded, at once.
    let guest_paths = [
        plain_search.clone(),
        format!("/v1/hotels/1/availability?{}&room=2", stay()),
        format!("/v1/hotels/1/calendar?from={}&to={}", day(1), day(3)),
        "/v1/hotels/1/events".to_string(),
    ];
    let flood: Vec<_> = (0..24)
        .map(|i| {
            let path = guest_paths[i % guest_paths.len()].clone();
            tokio::spawn(async move { (call(addr, "GET", &path, None).await, path) })
        })
        .collect();
    let mut shed = 0;
    for guest in flood {
        let (answer, path) = guest.await.expect("guest task");
        assert_overloaded(&answer, &path);
        shed += 1;
    }

    // Meanwhile the probes and the booking service are answered as usual.
    for probe in ["/healthz", "/readyz", "/metrics", "/v1/stale-reads"] {
        let answer = call(addr, "GET", probe, None).await;
        assert_eq!(answer.status, 200, "{probe}: {}", answer.text());
    }
    let bypass = call(
        addr,
        "GET",
        &format!("/v1/bypass?hotel_id=1&room_type_id=1&{}&rooms=1", stay()),
        None,
    )
    .await;
    assert_eq!(bypass.status, 200, "bypass: {}", bypass.text());
    let report = json!({
        "attempt_id": "overload-1",
        "hotel_id": 1,
        "room_type_id": 1,
        "check_in": day(1),
        "check_out": day(3),
        "rooms": 1,
        "outcome": "error",
    });
    let reported = call(
        addr,
        "POST",
        "/v1/take-outcomes",
        Some(report.to_string().as_bytes()),
    )
    .await;
    assert_eq!(reported.status, 200, "take-outcomes: {}", reported.text());

    // Counted and timed, per budget. Other tests share the process-wide
    // registry, so only what this one added is compared.
    let after = scrape(&app).await;
    for series in [
        "vacancy_http_shed_total{budget=\"guest\"}",
        "vacancy_http_shed_duration_seconds_count{budget=\"guest\"}",
    ] {
        let added = sample(&after, series) - sample(&before, series);
        assert!(added >= f64::from(shed), "{series}: +{added}, {shed} shed");
    }

    // Free the places: let the copy catch up past the held searches'
    // min_lsn. They answer 200 from the copy, and a guest is admitted again.
    hold_copy_back(&client, true).await;
    for search in held {
        let answer = search.await.expect("held search task");
        assert_eq!(answer.status, 200, "held search: {}", answer.text());
    }
    // A held search's place is given back when its handler ends, which
    // can be just after its client has read the whole answer: under a
    // loaded machine the very next request could still find it taken.
    wait_for(
        "a guest to be admitted again once the budget has room",
        Duration::from_secs(10),
        || async { (call(addr, "GET", &plain_search, None).await.status == 200).then_some(()) },
    )
    .await;
}

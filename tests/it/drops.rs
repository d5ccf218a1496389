//! A network that drops packets instead of refusing them (issue 24, item
//! 5). `vacancy serve` reaches the owner through `vacancy_lab::blackhole`,
//! a path that stops forwarding without closing anything; the owner itself
//! keeps running and taking bookings. The node must notice within
//! `stream.receive_timeout_ms`, answer searches within the owner-read budget
//! meanwhile, never use again a connection that timed out (the connections
//! that went dark stay dark after the heal, as behind a firewall that lost
//! their state), and converge row for row once the path is back.

use std::time::{Duration, Instant};

use chrono::NaiveDate;
use serde_json::Value;
use vacancy_lab::blackhole::Blackhole;
use vacancy_service::slot;

use crate::api::get;
use crate::process::{Serve, assert_binary_converged};
use crate::projector::{load_inventory, run_workload, test_seed};
use crate::support::{TestOwner, wait_for};

/// `stream.receive_timeout_ms` of the node under test.
const RECEIVE_TIMEOUT: Duration = Duration::from_secs(3);
/// Room for polling and a loaded machine on top of a stated bound: an
/// assertion on time must not be flaky, only catch a wait of another order
/// (the connect timeout, 5 s, or the kernel's ~15 minutes).
const SLACK: Duration = Duration::from_secs(5);
/// `search.owner_read_timeout_ms` of the node under test: above the default
/// (300 ms), so that opening a new connection on a loaded machine fits.
const OWNER_READ_BUDGET: Duration = Duration::from_secs(1);
/// `search.owner_read_connections` (the default).
const READ_CONNECTIONS: usize = 4;
/// The hotel the searches find: two units a night, so every shown room
/// type has few units left and is read from the owner (`fresh_reads =
/// "rows"`, set here).
const HOTEL: i64 = 900;
const SEARCH_NIGHTS: u64 = 60;

fn today() -> NaiveDate {
    chrono::Utc::now().date_naive()
}

/// Searches `HOTEL`'s city for one night, `offset` days from today (each
/// search a night of its own, so no two share an owner read); the shown
/// room type's source, and how long the answer took.
async fn search_night(serve: &Serve, offset: u64) -> (String, Duration) {
    let check_in = today() + chrono::Days::new(offset);
    let check_out = check_in + chrono::Days::new(1);
    let path = format!("/v1/search?city=coimbra&check_in={check_in}&check_out={check_out}&room=1");
    let started = Instant::now();
    let (code, _, body) = get(serve.addr, &path).await;
    let took = started.elapsed();
    assert_eq!(code, 200, "{path}: {body}");
    let answer: Value = serde_json::from_str(&body).expect("search json");
    let source = answer["results"][0]["room_types"][0]["source"]
        .as_str()
        .unwrap_or_else(|| panic!("no room type shown for {path}: {body}"))
        .to_string();
    (source, took)
}

/// A series of the node's `/metrics`, by its full name and labels.
async fn metric(serve: &Serve, series: &str) -> f64 {
    let (code, _, text) = get(serve.addr, "/metrics").await;
    assert_eq!(code, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} not in /metrics"))
}

const FEW_UNIT_READ_ERRORS: &str = "vacancy_owner_read_errors_total{reason=\"few_units\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_that_drops_packets_is_noticed_in_bound_and_no_timed_out_connection_is_reused() {
    // The owner's wal_sender_timeout is 60 s: its walsender of the dead
    // session holds the slot that long unless the node ends it.
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    client
        .batch_execute(&format!(
            "INSERT INTO hotels (id, name, city) VALUES ({HOTEL}, 'Few', 'Coimbra');
             INSERT INTO room_types VALUES ({HOTEL}, 1, 'Double', 2);
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               SELECT {HOTEL}, 1, DATE '{}' + n, 2, 10000 FROM generate_series(0, {SEARCH_NIGHTS}) n;",
            today()
        ))
        .await
        .expect("the hotel with few units");
    let path = Blackhole::to(([127, 0, 0, 1], owner.cluster.port()).into())
        .await
        .expect("a path to the owner");
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start_with(
        &path.url_for(&owner.url),
        dir.path(),
        "drops",
        &[
            (
                "VACANCY_STREAM__RECEIVE_TIMEOUT_MS",
                &RECEIVE_TIMEOUT.as_millis().to_string(),
            ),
            (
                "VACANCY_SEARCH__OWNER_READ_TIMEOUT_MS",
                &OWNER_READ_BUDGET.as_millis().to_string(),
            ),
            // The row reads' connections are what this test drops.
            ("VACANCY_SEARCH__FRESH_READS", "rows"),
        ],
    );
    let target = slot::current_wal_lsn(&client)
        .await
        .expect("owner position");
    serve.caught_up(target, Duration::from_secs(60)).await;
    let mut nights = 1..SEARCH_NIGHTS;
    let mut next_night = move || nights.next().expect("a night left to search");

    // Searchable, and every read connection opened and answering.
    wait_for("the node to be ready", Duration::from_secs(30), || async {
        (get(serve.addr, "/readyz").await.0 == 200).then_some(())
    })
    .await;
    for _ in 0..READ_CONNECTIONS * 2 {
        let (source, _) = search_night(&serve, next_night()).await;
        assert_eq!(
            source, "owner",
            "read from the owner while the path is healthy"
        );
    }

    // The path drops every packet, while the owner keeps taking bookings
    // on its own connections.
    let reconnects_before = metric(&serve, "vacancy_stream_reconnects_total").await;
    let seed = test_seed();
    path.drop_packets();
    let dropped_at = Instant::now();
    let (_, noticed) = tokio::join!(
        run_workload(&owner, seed, 2, 30),
        wait_for(
            "the node to notice the dead replication connection",
            RECEIVE_TIMEOUT + SLACK * 4,
            || async {
                let status = serve.status().await?;
                (status["connected"] == false).then(|| dropped_at.elapsed())
            },
        ),
    );
    // (a) Within the stated bound: the last message came before the drop,
    // and the session ends receive_timeout_ms after it.
    assert!(
        noticed <= RECEIVE_TIMEOUT + SLACK,
        "noticed {noticed:?} after the drop; the bound is {RECEIVE_TIMEOUT:?}"
    );
    wait_for(
        "the log to name the receive timeout",
        Duration::from_secs(10),
        || async {
            std::fs::read_to_string(&serve.log)
                .ok()?
                .contains("stream.receive_timeout_ms")
                .then_some(())
        },
    )
    .await;
    assert!(metric(&serve, "vacancy_stream_reconnects_total").await > reconnects_before);

    // (b) Searches go on from the copy, each within the owner-read budget
    // plus slack, not the connect timeout or the kernel's: with the
    // whole path dark every read fails (new connections too), once each.
    let errors_before = metric(&serve, FEW_UNIT_READ_ERRORS).await;
    let dark_searches = READ_CONNECTIONS * 2;
    for _ in 0..dark_searches {
        let (source, took) = search_night(&serve, next_night()).await;
        assert_eq!(source, "copy_fallback", "the owner cannot answer");
        assert!(
            took < OWNER_READ_BUDGET + SLACK,
            "a search during the drop took {took:?}; its owner-read budget is {OWNER_READ_BUDGET:?}"
        );
    }
    let dark_errors = metric(&serve, FEW_UNIT_READ_ERRORS).await - errors_before;
    assert_eq!(
        dark_errors, dark_searches as f64,
        "one failed read per search"
    );

    // The path heals for new connections; every connection opened before
    // or during the drop stays dark. A read connection that timed out and
    // were kept would fail every read it is given from now on.
    path.heal();
    let errors_at_heal = metric(&serve, FEW_UNIT_READ_ERRORS).await;
    let mut sources = Vec::new();
    for _ in 0..READ_CONNECTIONS * 3 {
        sources.push(search_night(&serve, next_night()).await.0);
    }
    let errors_after_heal = metric(&serve, FEW_UNIT_READ_ERRORS).await - errors_at_heal;
    eprintln!(
        "drops: noticed {noticed:?} after the drop; {dark_searches} searches in the dark, {dark_errors} failed reads; after the heal {errors_after_heal} failed reads, sources {sources:?}"
    );
    // A connection costs at most the one read that found it dead (one not
    // tried during the drop may still be dark); then it is replaced.
    assert!(
        errors_after_heal <= READ_CONNECTIONS as f64,
        "{errors_after_heal} failed owner reads after the heal: a dead connection was used again; sources {sources:?}"
    );
    assert!(
        sources[READ_CONNECTIONS..].iter().all(|s| s == "owner"),
        "once each dead connection is replaced, the owner answers: {sources:?}"
    );

    // (c) The stream resumes well before the owner would notice the dead
    // session (its walsender, still holding the slot, is ended: it is this
    // process's own) and the copy converges row for row, with what was
    // written during the drop and after it.
    let resumed = wait_for(
        "the stream to resume after the heal",
        Duration::from_secs(60),
        || async {
            let status = serve.status().await?;
            (status["connected"] == true).then(|| dropped_at.elapsed())
        },
    )
    .await;
    eprintln!("drops: streaming again {resumed:?} after the drop");
    assert!(
        resumed < Duration::from_secs(50),
        "streaming again {resumed:?} after the drop: the owner's wal_sender_timeout (60 s) was waited out"
    );
    let log = std::fs::read_to_string(&serve.log).unwrap_or_default();
    assert!(
        log.contains("ended the walsender of this process's last session"),
        "the dead session's walsender was ended: {}",
        serve.log_tail()
    );
    run_workload(&owner, seed ^ 0x0d0d, 2, 20).await;
    assert_binary_converged(&serve, &client).await;
    let status = serve.status().await.expect("status");
    assert_eq!(status["connected"], true, "streaming again: {status}");
}

//! The owner fails over to its streaming standby (issue 24, item 4).
//!
//! `vacancy serve` is given a multi-host `owner.url` naming the primary and
//! its standby with `target_session_attrs=read-write`, as a production
//! owner behind a failover pair is named. The primary is stopped, the
//! standby promoted (a new timeline, no logical slot: PostgreSQL 15 does
//! not carry them), and every connection of the node must find the new
//! primary, replace the copy with a snapshot of it, and converge row for
//! row. Positions handed out on the old timeline must not be trusted on
//! the new one: an SSE reconnect with an old `Last-Event-ID` gets a fresh
//! `state`, an old `min_lsn` a `/problems/timeline-changed` answer.
//!
//! The lagging case: the standby is stopped while the primary takes more
//! writes (which the copy applies), then the primary is stopped and the
//! standby started and promoted, so the new primary lacks commits the copy
//! holds and its WAL position is below the copy's. (Pausing replay with
//! `pg_wal_replay_pause()` would not do: a promotion first replays every
//! WAL record the standby has received, paused or not.) The lost commits
//! must disappear from the copy.

use std::time::{Duration, Instant};

use serde_json::Value;
use tokio_postgres::Client;
use vacancy_lab::cluster::{Cluster, StopMode};
use vacancy_service::{Lsn, slot};

use crate::api::get;
use crate::events::SseClient;
use crate::process::{Serve, assert_binary_converged};
use crate::projector::{load_inventory, run_workload, test_seed};
use crate::support::{DB, TestOwner, wait_for};

/// A hotel the lagging test writes on the old primary only.
const LOST_HOTEL: i64 = 7777;

/// The URL libpq and tokio-postgres both read as "the read-write one of
/// these two".
fn multi_host_url(primary: &Cluster, standby: &Cluster) -> String {
    format!(
        "postgresql://postgres@127.0.0.1:{},127.0.0.1:{}/{DB}?target_session_attrs=read-write",
        primary.port(),
        standby.port()
    )
}

async fn standby_of(owner: &TestOwner) -> Cluster {
    tokio::task::block_in_place(|| owner.cluster.start_standby(&[]))
        .unwrap_or_else(|e| panic!("cannot start the standby: {e}"))
}

/// Waits until the standby has replayed everything the primary wrote so far.
async fn standby_caught_up(primary: &Client, standby: &Client) {
    let target = slot::current_wal_lsn(primary)
        .await
        .expect("primary position");
    wait_for(
        "the standby to replay the primary's WAL",
        Duration::from_secs(30),
        || async {
            let row = standby
                .query_one("SELECT pg_last_wal_replay_lsn()", &[])
                .await
                .ok()?;
            let replayed: Option<tokio_postgres::types::PgLsn> = row.get(0);
            (Lsn::from(replayed?) >= target).then_some(())
        },
    )
    .await;
}

/// `/v1/status` once the node follows `timeline` with a copy of it, is
/// ready, and has applied the owner's position now.
async fn on_timeline(serve: &Serve, timeline: u64, within: Duration) -> Value {
    wait_for(
        &format!("the node to follow timeline {timeline} with a copy of it"),
        within,
        || async {
            let status = serve.status().await?;
            let owner = &status["owner"];
            (owner["sessions"]["current"]["timeline"] == timeline
                && owner["copy_timeline"] == timeline
                && status["ready"] == true)
                .then_some(status)
        },
    )
    .await
}

/// A search's status and answer, with `min_lsn` when given.
async fn search_position(serve: &Serve, min_lsn: Option<&str>) -> (u16, Value) {
    // Search may look two years ahead at most; the answer carries its
    // position whatever it finds.
    let check_in = chrono::Utc::now().date_naive() + chrono::Days::new(1);
    let check_out = check_in + chrono::Days::new(1);
    let mut path =
        format!("/v1/search?city=lisbon&check_in={check_in}&check_out={check_out}&room=1");
    if let Some(min) = min_lsn {
        path.push_str(&format!("&min_lsn={min}"));
    }
    let (code, _, body) = get(serve.addr, &path).await;
    (code, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// What a test keeps of the old timeline to send back after the failover.
struct OldPositions {
    sse_id: String,
    position: String,
}

async fn old_positions(serve: &Serve) -> OldPositions {
    let mut sse = SseClient::connect(serve.addr, "/v1/hotels/2/events", None).await;
    let state = sse.next().await;
    assert_eq!(state.event, "state");
    let sse_id = state.id.clone().expect("a state has an id");
    assert!(sse_id.starts_with("1/"), "ids carry the timeline: {sse_id}");
    let (code, answer) = search_position(serve, None).await;
    assert_eq!(code, 200, "{answer}");
    let position = answer["position"].as_str().expect("position").to_string();
    assert!(position.starts_with("1/"), "{position}");
    // A position of the copy's own timeline is honoured.
    let (code, answer) = search_position(serve, Some(&position)).await;
    assert_eq!(code, 200, "{answer}");
    OldPositions { sse_id, position }
}

/// After the failover: the old positions are answered for what they are.
async fn old_positions_refused(serve: &Serve, old: &OldPositions) {
    let mut sse = SseClient::connect(serve.addr, "/v1/hotels/2/events", Some(&old.sse_id)).await;
    // Bounded here: a stream resumed by mistake sends only keep-alives.
    let first = tokio::time::timeout(Duration::from_secs(10), sse.next())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "no event within 10 s of a reconnect with the old timeline's Last-Event-ID {}: resumed as if it were of this one",
                old.sse_id
            )
        });
    assert_eq!(
        (first.event.as_str(), first.data["reason"].as_str()),
        ("state", Some("resume_unavailable")),
        "an old timeline's Last-Event-ID {} gets a fresh state: {first:?}",
        old.sse_id
    );
    assert!(first.id.as_deref().is_some_and(|id| id.starts_with("2/")));
    let (code, problem) = search_position(serve, Some(&old.position)).await;
    assert_eq!(code, 409, "an old timeline's min_lsn: {problem}");
    assert_eq!(problem["type"], "/problems/timeline-changed", "{problem}");
    assert_eq!(problem["field"], "min_lsn", "{problem}");
    // A bare LSN (an older client) still works as before.
    let (code, answer) = search_position(serve, Some("0/1")).await;
    assert_eq!(code, 200, "{answer}");
    let (code, answer) = search_position(serve, None).await;
    assert_eq!(code, 200);
    let position = answer["position"].as_str().unwrap_or_default().to_string();
    assert!(position.starts_with("2/"), "{answer}");
    let (code, answer) = search_position(serve, Some(&position)).await;
    assert_eq!(code, 200, "a new timeline's position: {answer}");
}

/// Sends `kill -<name>` to the node's process.
fn signal(serve: &Serve, name: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{name}"))
        .arg(serve.child.id().to_string())
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{name}");
}

async fn lag_bytes(serve: &Serve) -> u64 {
    serve.status().await.expect("status")["lag_bytes"]
        .as_u64()
        .expect("lag_bytes")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_failing_over_to_its_standby_is_followed_and_converges() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let standby = standby_of(&owner).await;
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(
        &multi_host_url(&owner.cluster, &standby),
        dir.path(),
        "failover",
    );
    let seed = test_seed();
    run_workload(&owner, seed, 2, 20).await;
    assert_binary_converged(&serve, &client).await;
    let before = on_timeline(&serve, 1, Duration::from_secs(30)).await;
    let system = before["owner"]["sessions"]["current"]["system_identifier"].clone();
    let old = old_positions(&serve).await;

    let standby_url = standby.url(DB);
    let standby_client = vacancy_service::connect(&standby_url, Duration::from_secs(10))
        .await
        .expect("connect to the standby");
    standby_caught_up(&client, &standby_client).await;
    drop(client);
    let failed_at = Instant::now();
    tokio::task::block_in_place(|| owner.cluster.stop(StopMode::Fast)).expect("stop the primary");
    tokio::task::block_in_place(|| standby.promote(Duration::from_secs(30))).expect("promote");
    let promoted = TestOwner {
        cluster: standby,
        url: standby_url,
    };
    let after = on_timeline(&serve, 2, Duration::from_secs(60)).await;
    let recovered = failed_at.elapsed();
    assert_eq!(
        after["owner"]["sessions"]["current"]["system_identifier"], system,
        "a promoted standby keeps the system identifier"
    );
    assert_eq!(after["owner"]["sessions"]["previous"]["timeline"], 1);
    assert!(
        after["owner"]["sessions"]["changed_at"].is_string(),
        "{after}"
    );

    // Writes on the new primary, past the old timeline's positions.
    let new_client = promoted.client().await;
    run_workload(&promoted, seed ^ 0xfa11, 2, 40).await;
    assert_binary_converged(&serve, &new_client).await;
    assert!(
        lag_bytes(&serve).await < 1 << 20,
        "the old timeline's WAL end is forgotten"
    );
    old_positions_refused(&serve, &old).await;
    let log = std::fs::read_to_string(&serve.log).unwrap_or_default();
    assert!(log.contains("owner_changed"), "{}", serve.log_tail());
    eprintln!("failover: ready on timeline 2 {recovered:?} after the primary stopped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_a_lagging_standby_never_had_disappear_from_the_copy() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let mut standby = standby_of(&owner).await;
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(
        &multi_host_url(&owner.cluster, &standby),
        dir.path(),
        "failover-lagging",
    );
    let seed = test_seed();
    run_workload(&owner, seed, 2, 10).await;
    assert_binary_converged(&serve, &client).await;
    {
        let standby_client = vacancy_service::connect(&standby.url(DB), Duration::from_secs(10))
            .await
            .expect("connect to the standby");
        standby_caught_up(&client, &standby_client).await;
    }
    // The standby stops receiving: what follows is lost with the primary.
    tokio::task::block_in_place(|| standby.stop(StopMode::Fast)).expect("stop the standby");
    client
        .batch_execute(&format!(
            "INSERT INTO hotels (id, name, city) VALUES ({LOST_HOTEL}, 'Lost', 'Lisbon');
             INSERT INTO room_types VALUES ({LOST_HOTEL}, 1, 'Double', 2);
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               SELECT {LOST_HOTEL}, 1, DATE '2030-01-01' + n, 5, 9000 FROM generate_series(0, 20) n;
             UPDATE inventory SET taken = taken + 1 WHERE hotel_id = 2 AND night < DATE '2030-01-10' AND taken < total;
             DELETE FROM inventory WHERE hotel_id = 4 AND night = DATE '2030-01-03';"
        ))
        .await
        .expect("the commits the standby never gets");
    run_workload(&owner, seed ^ 0x1a66, 2, 30).await;
    let old_end = slot::current_wal_lsn(&client).await.expect("position");
    serve.caught_up(old_end, Duration::from_secs(60)).await;
    let (code, _, _) = get(
        serve.addr,
        &format!("/v1/hotels/{LOST_HOTEL}/calendar?from=2030-01-01&to=2030-01-10"),
    )
    .await;
    assert_eq!(code, 200, "the copy applied the commits the standby lacks");
    let old = old_positions(&serve).await;
    let copy_applied: Lsn = serve.status().await.expect("status")["applied_lsn"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("applied_lsn");

    drop(client);
    // The node is held still while the owner fails over, and the new
    // primary is given a slot of the node's name before the node looks: a
    // failover slot, or one an operator made. Its position is the new
    // timeline's, below the copy's; resumed, it would keep the lost commits
    // and skip the new timeline's below the old position. Only the owner's
    // identity says the copy is of another history.
    signal(&serve, "STOP");
    let failed_at = Instant::now();
    tokio::task::block_in_place(|| owner.cluster.stop(StopMode::Immediate))
        .expect("stop the primary");
    tokio::task::block_in_place(|| standby.start_again()).expect("start the standby again");
    tokio::task::block_in_place(|| standby.promote(Duration::from_secs(30))).expect("promote");
    let standby_url = standby.url(DB);
    let promoted = TestOwner {
        cluster: standby,
        url: standby_url,
    };
    let new_client = promoted.client().await;
    new_client
        .batch_execute("SELECT pg_create_logical_replication_slot('vacancy', 'pgoutput')")
        .await
        .expect("a slot of the node's name on the new primary");
    signal(&serve, "CONT");
    let new_start = slot::current_wal_lsn(&new_client).await.expect("position");
    assert!(
        new_start < copy_applied,
        "the new primary ({new_start}) is below the copy ({copy_applied}): the case under test"
    );
    let status = on_timeline(&serve, 2, Duration::from_secs(60)).await;
    let recovered = failed_at.elapsed();
    // The owner's WAL end as the node knows it is the new primary's, not
    // the old one's high-water mark (which would show a lag that never ends).
    let wal_end: Lsn = status["server_wal_end"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("server_wal_end");
    assert!(
        wal_end < copy_applied,
        "the WAL end {wal_end} is the new timeline's, below the old copy's {copy_applied}"
    );
    let (code, _, body) = get(
        serve.addr,
        &format!("/v1/hotels/{LOST_HOTEL}/calendar?from=2030-01-01&to=2030-01-10"),
    )
    .await;
    assert_eq!(code, 404, "the lost hotel is gone from the copy: {body}");

    // The new timeline passes the old one's positions: an old id or
    // min_lsn now names a point the new copy has passed, and only its
    // timeline tells that it is not a point of this history.
    for round in 0..50u64 {
        if slot::current_wal_lsn(&new_client).await.expect("position") > copy_applied {
            break;
        }
        run_workload(&promoted, seed ^ 0x2b77 ^ round, 2, 20).await;
    }
    assert!(slot::current_wal_lsn(&new_client).await.expect("position") > copy_applied);
    assert_binary_converged(&serve, &new_client).await;
    assert!(lag_bytes(&serve).await < 1 << 20);
    old_positions_refused(&serve, &old).await;
    eprintln!(
        "failover-lagging: copy at {copy_applied} on timeline 1, new primary from {new_start} on 2; ready {recovered:?} after the primary stopped"
    );
}

//! `vacancy serve` stopped with SIGTERM, as a supervisor stops it: a search
//! in flight is answered, the last status update acknowledges exactly what
//! the copy applied, the process exits 0, and a new start converges.

use std::process::{Command, ExitStatus};
use std::time::Duration;

use serde_json::Value;
use vacancy_service::Lsn;
use vacancy_service::slot;

use crate::api::get;
use crate::process::{Serve, assert_binary_converged, released_slot};
use crate::projector::{load_inventory, run_workload, test_seed};
use crate::support::{TestOwner, wait_for};

/// `vacancy_http_requests_in_flight` from a scrape (the scrape itself counts).
async fn in_flight(addr: std::net::SocketAddr) -> Option<i64> {
    let (code, _, body) = get(addr, "/metrics").await;
    if code != 200 {
        return None;
    }
    body.lines()
        .find_map(|l| l.strip_prefix("vacancy_http_requests_in_flight "))
        .and_then(|v| v.trim().parse().ok())
}

/// The `acknowledged` field of the projector's last "stream stopped" line.
fn acknowledged_at_stop(log: &str) -> Option<Lsn> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["fields"]["message"] == "stream stopped")
        .filter_map(|v| v["fields"]["acknowledged"].as_str()?.parse().ok())
        .next_back()
}

pub(crate) fn sigterm(serve: &Serve) {
    let sent = Command::new("kill")
        .args(["-TERM", &serve.child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success(), "kill -TERM failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_requests_acknowledges_the_applied_lsn_and_exits_zero() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let dir = tempfile::tempdir().unwrap();
    let mut serve = Serve::start_with(
        &owner.url,
        dir.path(),
        "first",
        &[
            // The test inventory's nights are years ahead.
            ("VACANCY_SEARCH__HORIZON_DAYS", "3000"),
            // Every room type shown is read from the owner's rows, and that
            // read may wait this long: a search blocked on the owner's lock
            // below is surely in flight at SIGTERM.
            ("VACANCY_SEARCH__FRESH_READS", "rows"),
            ("VACANCY_SEARCH__FEW_UNITS_THRESHOLD", "1000"),
            ("VACANCY_SEARCH__OWNER_READ_TIMEOUT_MS", "5000"),
        ],
    );
    let seed = test_seed();
    run_workload(&owner, seed, 3, 20).await;
    // The workload may have filled or moved any hotel: one sure to be shown
    // (in Lisbon, units free on both nights), so the search below has a
    // room type to read from the owner. Its holds (`taken`) stay: the
    // workload after SIGTERM releases them.
    client
        .batch_execute(
            "INSERT INTO hotels (id, name, city, country, stars, amenities)
               VALUES (2, 'Hotel 2', 'Lisbon', 'PT', 3, ARRAY['wifi'])
               ON CONFLICT (id) DO UPDATE SET city = 'Lisbon';
             INSERT INTO room_types (hotel_id, id, name, max_guests) VALUES (2, 1, 'Room 1', 2)
               ON CONFLICT (hotel_id, id) DO UPDATE SET max_guests = greatest(room_types.max_guests, 2);
             INSERT INTO inventory (hotel_id, room_type_id, night, total, taken, sell_limit, price_cents)
               SELECT 2, 1, n, 3, 0, NULL, 10000
               FROM unnest(ARRAY[DATE '2030-01-02', DATE '2030-01-03']) n
               ON CONFLICT (hotel_id, room_type_id, night)
               DO UPDATE SET total = greatest(inventory.total, inventory.taken) + 3, sell_limit = NULL",
        )
        .await
        .expect("a room type sure to be shown");
    let path = "/v1/search?city=Lisbon&check_in=2030-01-02&check_out=2030-01-04&room=1";
    // The hotel index follows the copy a moment later.
    wait_for(
        "hotel 2 shown in Lisbon",
        Duration::from_secs(30),
        || async {
            let (code, _, body) = get(serve.addr, path).await;
            let answer: Value = serde_json::from_str(&body).ok()?;
            (code == 200
                && answer["results"]
                    .as_array()?
                    .iter()
                    .any(|h| h["hotel_id"] == 2))
            .then_some(())
        },
    )
    .await;
    let target = slot::current_wal_lsn(&client).await.unwrap();
    serve.caught_up(target, Duration::from_secs(90)).await;
    let before: Lsn = serve.status().await.expect("status")["applied_lsn"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("applied_lsn");

    // The owner's inventory locked against reads: the search's owner
    // read waits on the lock until it is released after SIGTERM. (A
    // `min_lsn` the copy lacks no longer keeps a search waiting: one past
    // the owner is refused at once.)
    let mut locker = owner.client().await;
    let lock = locker.transaction().await.expect("begin");
    lock.batch_execute("LOCK TABLE inventory IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock the inventory");
    let addr = serve.addr;
    let search = tokio::spawn(async move {
        vacancy_lab::http_client::http(addr, "GET", path, None, None, Duration::from_secs(30)).await
    });
    wait_for(
        "the search to be in flight, its owner read waiting on the lock",
        Duration::from_secs(10),
        || async {
            let waiting: i64 = client
                .query_one(
                    "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                     WHERE c.relname = 'inventory' AND NOT l.granted",
                    &[],
                )
                .await
                .ok()?
                .get(0);
            let searching = in_flight(addr).await.is_some_and(|n| n >= 2);
            (waiting > 0 && searching).then_some(())
        },
    )
    .await;

    // Owner clients are writing while the stop lands (once the lock is
    // released, right after SIGTERM).
    let (_, status) = tokio::join!(run_workload(&owner, seed ^ 0x33, 2, 20), async {
        sigterm(&serve);
        tokio::time::sleep(Duration::from_millis(200)).await;
        lock.commit().await.expect("release the lock");
        let exited: ExitStatus = wait_for(
            "vacancy serve to exit after SIGTERM",
            Duration::from_secs(30),
            || {
                let exited = serve.child.try_wait().expect("wait on the child");
                async move { exited }
            },
        )
        .await;
        exited
    });
    let log = std::fs::read_to_string(&serve.log).unwrap_or_default();
    assert!(status.success(), "exit status {status}; log:\n{log}");

    // Answered once the owner's rows could be read, not cut off.
    let answered = search
        .await
        .expect("search task")
        .expect("the search in flight at SIGTERM is answered, not cut off");
    let body = String::from_utf8_lossy(&answered.body);
    assert_eq!(answered.status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).expect("search json");
    assert!(answer["results"].is_array(), "{body}");

    let acknowledged = acknowledged_at_stop(&log)
        .unwrap_or_else(|| panic!("no \"stream stopped\" line in the log:\n{log}"));
    let confirmed = released_slot(&client).await;
    assert_eq!(
        confirmed, acknowledged,
        "the slot's confirmed_flush_lsn is the applied LSN acknowledged at stop"
    );
    assert!(
        confirmed >= before,
        "the final acknowledgement ({confirmed}) is at or past what the copy reported applied ({before})"
    );
    assert!(
        log.contains("\"stopped\""),
        "the process logged a complete stop:\n{log}"
    );

    // A new start (a new snapshot: the copy lives in memory) converges.
    let serve = Serve::start(&owner.url, dir.path(), "second");
    run_workload(&owner, seed ^ 0x5151, 3, 20).await;
    assert_binary_converged(&serve, &client).await;
}

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
            // A search with an unreachable min_lsn waits this long, then
            // reads the owner: a request that is surely in flight at SIGTERM.
            ("VACANCY_SEARCH__MIN_LSN_WAIT_MS", "3000"),
        ],
    );
    let seed = test_seed();
    run_workload(&owner, seed, 3, 20).await;
    let target = slot::current_wal_lsn(&client).await.unwrap();
    serve.caught_up(target, Duration::from_secs(90)).await;
    let before: Lsn = serve.status().await.expect("status")["applied_lsn"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("applied_lsn");

    let addr = serve.addr;
    let search = tokio::spawn(async move {
        vacancy_lab::http_client::http(
            addr,
            "GET",
            "/v1/search?city=Lisbon&check_in=2030-01-02&check_out=2030-01-04&room=2&min_lsn=FFFFFFFF/0",
            None,
            None,
            Duration::from_secs(30),
        )
        .await
    });
    wait_for(
        "the search to be in flight",
        Duration::from_secs(10),
        || async { in_flight(addr).await.filter(|n| *n >= 2) },
    )
    .await;

    // Owner clients are writing while the stop lands.
    let (_, status) = tokio::join!(run_workload(&owner, seed ^ 0x33, 2, 20), async {
        sigterm(&serve);
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

    // Answered once its min_lsn wait is over, not cut off: past the
    // owner's position, that min_lsn is then refused as no write's.
    let answered = search
        .await
        .expect("search task")
        .expect("the search in flight at SIGTERM is answered, not cut off");
    let body = String::from_utf8_lossy(&answered.body);
    assert_eq!(answered.status, 400, "{body}");
    assert!(body.contains("\"field\":\"min_lsn\""), "{body}");

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

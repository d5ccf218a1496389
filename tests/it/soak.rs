//! What `vacancy bench soak` reads from a running `vacancy` (issue 24,
//! item 2): each bounded cache's entries and estimated bytes, and the
//! runtime's alive tasks, in `/metrics`. They must follow the caches as
//! they fill, or the soak's remainder (RSS less the caches) would take a
//! filling cache for a leak, or hide one.

use std::time::Duration;

use serde_json::json;
use vacancy_lab::http_client::{HttpClient, http};
use vacancy_service::{Settings, slot};

use crate::support::{TestOwner, one_hotel, wait_for};

const TOKEN: &str = "test-booking-token-soak-0123456789abcdef";

fn day(n: u64) -> chrono::NaiveDate {
    chrono::Utc::now().date_naive() + chrono::Days::new(n)
}

/// One series of a scrape, by its full name with labels; 0 when absent.
fn sample(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn entries(scrape: &str, cache: &str) -> f64 {
    sample(
        scrape,
        &format!("vacancy_cache_entries{{cache=\"{cache}\"}}"),
    )
}

fn bytes(scrape: &str, cache: &str) -> f64 {
    sample(
        scrape,
        &format!("vacancy_cache_estimated_bytes{{cache=\"{cache}\"}}"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_each_bounded_cache_and_the_alive_tasks() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    one_hotel(&client, "Porto").await;
    let mut settings = Settings::defaults();
    settings.owner.url = owner.url.clone();
    settings.stale.booking_tokens = vec![TOKEN.to_string()];
    // The per-client limit on, with clients named by X-Forwarded-For.
    settings.http.rate_limit_per_sec = 100;
    settings.http.rate_limit_burst = 100;
    settings.http.trust_forwarded_for = true;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = vacancy_service::start(settings, listener).expect("start vacancy");
    let addr = app.addr;
    let get = |path: String| async move {
        http(addr, "GET", &path, None, None, Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    };
    wait_for("readyz to answer 200", Duration::from_secs(60), || async {
        (get("/readyz".into()).await.status == 200).then_some(())
    })
    .await;

    // Three clients search the same place: three buckets, one candidate list.
    let searches = HttpClient::new(addr, Duration::from_secs(30)).unwrap();
    let path = format!(
        "/v1/search?city=Porto&check_in={}&check_out={}&room=2",
        day(1),
        day(3)
    );
    for client_address in ["10.0.0.1", "10.0.0.2", "10.0.0.3"] {
        let answer = searches
            .send(
                searches
                    .request(reqwest::Method::GET, &path)
                    .header("x-forwarded-for", client_address),
            )
            .await
            .expect("search");
        assert_eq!(answer.status, 200, "{}", answer.text());
    }
    // Two attempts reported, one of them twice: two ids remembered.
    for attempt in ["soak-a", "soak-b", "soak-a"] {
        let report = json!({
            "attempt_id": attempt,
            "hotel_id": 1,
            "room_type_id": 1,
            "check_in": day(1),
            "check_out": day(3),
            "rooms": 1,
            "outcome": "error",
        });
        let answer = http(
            addr,
            "POST",
            "/v1/take-outcomes",
            Some(TOKEN),
            Some(report.to_string().as_bytes()),
            Duration::from_secs(30),
        )
        .await
        .expect("take outcome");
        assert_eq!(answer.status, 200, "{}", answer.text());
    }

    // The registry is the process's, shared with other tests' apps, each
    // of which sets the gauges at its own scrape: ask until a scrape of
    // this app is read whole.
    let scrape = wait_for(
        "/metrics to count this app's caches",
        Duration::from_secs(30),
        || async {
            let text = get("/metrics".into()).await.text();
            (entries(&text, "attempt_ids") == 2.0
                && entries(&text, "rate_limit_buckets") == 3.0
                && entries(&text, "search_candidates") == 1.0)
                .then_some(text)
        },
    )
    .await;
    // Bytes are entries times a size stated in the code, above moka's own
    // 245 bytes per entry.
    for cache in ["attempt_ids", "rate_limit_buckets", "search_candidates"] {
        let per_entry = bytes(&scrape, cache) / entries(&scrape, cache);
        assert!(
            per_entry > 245.0 && per_entry < 2048.0,
            "{cache}: {per_entry} bytes per entry"
        );
    }
    let per_bucket = bytes(&scrape, "rate_limit_buckets") / 3.0;
    assert_eq!(per_bucket.fract(), 0.0, "the same size for every bucket");
    assert!(
        sample(&scrape, "vacancy_runtime_alive_tasks") >= 5.0,
        "the stream, the refresher, the server and more are alive: {}",
        sample(&scrape, "vacancy_runtime_alive_tasks")
    );
    app.stop(Duration::from_secs(10)).await;
}

/// The soak's lag episodes were mostly the owner's own WAL flush stalling
/// (fsync on a busy disk): its insert position ran ahead of what it had
/// flushed, the slot watch read the insert position, and the lag counted
/// the stall although nothing the owner had committed was missing. The
/// owner position the lag counts must never pass what the owner has
/// flushed. WAL of an open transaction, on a page nobody flushes (no
/// heartbeat, nothing commits), stays past the flush position; while it
/// does, every `server_wal_end` the status shows is at most the flush
/// position read right after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_lag_counts_only_wal_the_owner_has_flushed() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    one_hotel(&client, "Porto").await;
    client
        .batch_execute("CREATE TABLE scratch (n int)")
        .await
        .expect("create scratch");
    let mut settings = Settings::defaults();
    settings.owner.url = owner.url.clone();
    // Nothing of vacancy's commits on the owner, so WAL written after the
    // last commit stays unflushed; the slot watch polls often.
    settings.stream.heartbeat_interval_ms = 0;
    settings.stream.receive_timeout_ms = 0;
    settings.stream.slot_watch_interval_ms = 20;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = vacancy_service::start(settings, listener).expect("start vacancy");
    let addr = app.addr;
    let status = || async move {
        let answer = http(
            addr,
            "GET",
            "/v1/status",
            None,
            None,
            Duration::from_secs(30),
        )
        .await
        .expect("GET /v1/status");
        let body: serde_json::Value = answer.json();
        let lsn = |field: &str| {
            body[field]
                .as_str()
                .and_then(|v| v.parse::<vacancy_service::Lsn>().ok())
                .unwrap_or_else(|| panic!("{field} in {body}"))
        };
        (lsn("applied_lsn"), lsn("server_wal_end"))
    };
    // A commit of ours applied, so the lag has a commit to measure from.
    client
        .batch_execute("UPDATE inventory SET total = 8 WHERE hotel_id = 1")
        .await
        .expect("update");
    let committed = slot::wal_positions(&client)
        .await
        .expect("positions")
        .flushed;
    wait_for(
        "the copy to apply the update",
        Duration::from_secs(60),
        || async { (status().await.0 >= committed).then_some(()) },
    )
    .await;

    let writer = owner.client().await;
    let mut unflushed_reads = 0;
    for _attempt in 0..20 {
        // Inserted, never committed: its WAL waits for someone's flush.
        writer
            .batch_execute("BEGIN; INSERT INTO scratch SELECT generate_series(1, 50)")
            .await
            .expect("open a transaction");
        let written = slot::wal_positions(&client).await.expect("positions");
        let began = std::time::Instant::now();
        // Reads while that WAL stays unflushed, for at least ten polls of
        // the slot watch.
        while began.elapsed() < Duration::from_millis(400) {
            let (_, server_wal_end) = status().await;
            let now = slot::wal_positions(&client).await.expect("positions");
            if now.flushed >= written.inserted {
                break;
            }
            assert!(
                server_wal_end <= now.flushed,
                "the lag counts WAL the owner has not flushed: server_wal_end {server_wal_end}, flushed {}, inserted {}",
                now.flushed,
                now.inserted
            );
            unflushed_reads += 1;
        }
        writer.batch_execute("ROLLBACK").await.expect("rollback");
        if began.elapsed() >= Duration::from_millis(400) && unflushed_reads > 0 {
            break;
        }
    }
    assert!(
        unflushed_reads > 0,
        "the owner flushed the open transaction's WAL every time; nothing was checked"
    );
    app.stop(Duration::from_secs(10)).await;
}

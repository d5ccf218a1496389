//! Who may call what, over real HTTP: the per-client rate limit on search,
//! the query size limit, CORS preflights, and the admin resnapshot (refused
//! without the admin token; with it, a new snapshot while the old copy
//! serves, and the copy equal to the owner after).

use std::net::SocketAddr;
use std::time::Duration;

use vacancy_lab::http_client::{self, HttpResponse};
use vacancy_service::{App, Settings};

use crate::projector::{assert_converged, load_inventory, run_workload, test_seed};
use crate::support::{TestOwner, wait_for};

const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

/// An owner nobody listens at: for tests of the HTTP surface alone (the
/// projector retries in the background; search answers 503 meanwhile).
const NO_OWNER: &str = "postgresql://vacancy@127.0.0.1:1/none";

fn settings(owner_url: &str) -> Settings {
    let mut s = Settings::defaults();
    s.owner.url = owner_url.to_string();
    s.stream.reconnect_min_ms = 50;
    s.stream.reconnect_max_ms = 500;
    s.stream.heartbeat_interval_ms = 200;
    s
}

async fn start(settings: Settings) -> App {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    vacancy_service::start(settings, listener).expect("start vacancy")
}

/// One request with any method and headers, on a connection of its own
/// (so each is a new client connection, as the old raw requests were).
async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> HttpResponse {
    http_client::request_once(addr, method, path, headers, None, Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn assert_problem(r: &HttpResponse, status: u16, kind: &str) {
    let body = String::from_utf8_lossy(&r.body);
    assert_eq!(r.status, status, "{body}");
    assert_eq!(
        r.header("content-type"),
        Some("application/problem+json"),
        "{body}"
    );
    assert_eq!(r.json()["type"], kind, "{body}");
}

const SEARCH: &str = "/v1/search?city=Lisbon&check_in=2030-01-02&check_out=2030-01-04&room=2";

/// Sends search requests as `client` until one is refused; returns how many
/// passed first and the refusal. Refill is one per second, requests take
/// milliseconds: the refusal comes right after the burst.
async fn exhaust(addr: SocketAddr, client: &str) -> (usize, HttpResponse) {
    for passed in 0..100 {
        let r = request(addr, "GET", SEARCH, &[("X-Forwarded-For", client)]).await;
        if r.status == 429 {
            return (passed, r);
        }
    }
    panic!("client {client} was never rate limited");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_is_rate_limited_per_client_with_retry_after() {
    let mut s = settings(NO_OWNER);
    s.http.rate_limit_per_sec = 1;
    s.http.rate_limit_burst = 5;
    s.http.trust_forwarded_for = true;
    let app = start(s).await;

    let (passed, refused) = exhaust(app.addr, "203.0.113.7").await;
    assert!(passed >= 5, "the whole burst passes first, got {passed}");
    assert_problem(&refused, 429, "/problems/rate-limited");
    let retry_after: u64 = refused
        .header("retry-after")
        .expect("Retry-After on a 429")
        .parse()
        .expect("whole seconds");
    assert!(retry_after >= 1, "{retry_after}");

    // The other search routes draw on the same bucket.
    let r = request(
        app.addr,
        "GET",
        "/v1/bypass?hotel_id=1&room_type_id=1&check_in=2030-01-02&check_out=2030-01-04",
        &[("X-Forwarded-For", "203.0.113.7")],
    )
    .await;
    assert_problem(&r, 429, "/problems/rate-limited");
    let r = request(
        app.addr,
        "GET",
        "/v1/hotels/1/availability?check_in=2030-01-02&check_out=2030-01-04&room=2",
        &[("X-Forwarded-For", "203.0.113.7")],
    )
    .await;
    assert_problem(&r, 429, "/problems/rate-limited");

    // Another client has its own bucket; operator routes are not limited.
    let r = request(
        app.addr,
        "GET",
        SEARCH,
        &[("X-Forwarded-For", "203.0.113.8")],
    )
    .await;
    assert_ne!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    let r = request(
        app.addr,
        "GET",
        "/v1/status",
        &[("X-Forwarded-For", "203.0.113.7")],
    )
    .await;
    assert_eq!(r.status, 200);
    app.stop(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_for_header_is_ignored_unless_trusted() {
    let mut s = settings(NO_OWNER);
    s.http.rate_limit_per_sec = 1;
    s.http.rate_limit_burst = 3;
    let app = start(s).await;
    let (passed, _) = exhaust(app.addr, "198.51.100.1").await;
    assert!(passed >= 3, "{passed}");
    // A caller cannot pick a fresh bucket by claiming another address.
    let r = request(
        app.addr,
        "GET",
        SEARCH,
        &[("X-Forwarded-For", "198.51.100.2")],
    )
    .await;
    assert_problem(&r, 429, "/problems/rate-limited");
    app.stop(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_strings_past_the_limit_are_refused_on_every_route() {
    let mut s = settings(NO_OWNER);
    s.http.max_query_bytes = 1024;
    let app = start(s).await;
    let long = "x".repeat(1025);
    for path in ["/v1/status", "/v1/search", "/v1/stale-reads", "/nowhere"] {
        let r = request(app.addr, "GET", &format!("{path}?q={long}"), &[]).await;
        assert_problem(&r, 414, "/problems/query-too-long");
        assert_eq!(r.json()["field"], "query");
    }
    let r = request(app.addr, "GET", "/v1/status?q=short", &[]).await;
    assert_eq!(r.status, 200);
    app.stop(Duration::from_secs(5)).await;
}

fn preflight(origin: &str) -> [(&str, &str); 3] {
    [
        ("Origin", origin),
        ("Access-Control-Request-Method", "GET"),
        ("Access-Control-Request-Headers", "authorization"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_preflights_are_allowed_only_for_configured_origins() {
    let mut s = settings(NO_OWNER);
    s.http.cors_allowed_origins = vec!["https://shop.example".into()];
    s.http.rate_limit_per_sec = 1;
    s.http.rate_limit_burst = 1;
    let app = start(s).await;

    let r = request(
        app.addr,
        "OPTIONS",
        SEARCH,
        &preflight("https://shop.example"),
    )
    .await;
    assert!(r.status < 300, "preflight answered {}", r.status);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://shop.example")
    );
    let methods = r.header("access-control-allow-methods").unwrap_or("");
    assert!(methods.contains("GET"), "{methods}");
    let allowed = r
        .header("access-control-allow-headers")
        .unwrap_or("")
        .to_ascii_lowercase();
    assert!(allowed.contains("authorization"), "{allowed}");

    let r = request(
        app.addr,
        "OPTIONS",
        SEARCH,
        &preflight("https://evil.example"),
    )
    .await;
    assert_eq!(r.header("access-control-allow-origin"), None);

    // Preflights are not counted against the search budget (burst 1), and
    // a refusal still carries the headers a browser needs to read it.
    let r = request(
        app.addr,
        "OPTIONS",
        SEARCH,
        &preflight("https://shop.example"),
    )
    .await;
    assert!(r.status < 300, "{}", r.status);
    let origin = [("Origin", "https://shop.example")];
    let first = request(app.addr, "GET", SEARCH, &origin).await;
    assert_ne!(first.status, 429, "the first search of the burst");
    assert_eq!(
        first.header("access-control-allow-origin"),
        Some("https://shop.example")
    );
    let refused = exhaust_with(app.addr, &origin).await;
    assert_eq!(
        refused.header("access-control-allow-origin"),
        Some("https://shop.example")
    );
    let exposed = refused
        .header("access-control-expose-headers")
        .unwrap_or("")
        .to_ascii_lowercase();
    assert!(exposed.contains("retry-after"), "{exposed}");
    app.stop(Duration::from_secs(5)).await;

    // The default: no origin is allowed.
    let app = start(settings(NO_OWNER)).await;
    let r = request(
        app.addr,
        "OPTIONS",
        SEARCH,
        &preflight("https://shop.example"),
    )
    .await;
    assert_eq!(r.header("access-control-allow-origin"), None);
    let r = request(
        app.addr,
        "GET",
        "/v1/status",
        &[("Origin", "https://shop.example")],
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("access-control-allow-origin"), None);
    app.stop(Duration::from_secs(5)).await;
}

async fn exhaust_with(addr: SocketAddr, headers: &[(&str, &str)]) -> HttpResponse {
    for _ in 0..100 {
        let r = request(addr, "GET", SEARCH, headers).await;
        if r.status == 429 {
            return r;
        }
    }
    panic!("never rate limited");
}

fn requested_resnapshots() -> u64 {
    vacancy_service::metrics::RESNAPSHOTS
        .with_label_values(&["requested"])
        .get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_resnapshot_needs_the_token_and_the_copy_converges_after() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let mut s = settings(&owner.url);
    s.admin.tokens = vec![ADMIN_TOKEN.to_string()];
    let app = start(s).await;
    assert_converged(&app.model, &client).await;

    let path = "/v1/admin/resnapshot";
    let r = request(app.addr, "POST", path, &[]).await;
    assert_problem(&r, 401, "/problems/unauthorized");
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    let wrong = format!("Bearer {ADMIN_TOKEN}x");
    let r = request(app.addr, "POST", path, &[("Authorization", &wrong)]).await;
    assert_problem(&r, 401, "/problems/unauthorized");
    let r = request(app.addr, "GET", path, &[]).await;
    assert_eq!(r.status, 405, "only POST");

    // Owner clients keep writing while the new snapshot is taken.
    let seed = test_seed();
    let before = requested_resnapshots();
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    let (_, accepted) = tokio::join!(run_workload(&owner, seed, 3, 30), async {
        request(app.addr, "POST", path, &[("Authorization", &bearer)]).await
    });
    assert_eq!(
        accepted.status,
        202,
        "{}",
        String::from_utf8_lossy(&accepted.body)
    );
    assert!(accepted.json()["applied_lsn"].is_string());
    wait_for(
        "the requested snapshot to be swapped in",
        Duration::from_secs(60),
        || async { (requested_resnapshots() > before).then_some(()) },
    )
    .await;
    // The old copy served throughout: it was never unloaded.
    assert!(app.model.freshness.is_loaded());
    run_workload(&owner, seed ^ 0x77, 3, 20).await;
    assert_converged(&app.model, &client).await;
    let status = request(app.addr, "GET", "/v1/status", &[]).await.json();
    assert_eq!(status["resnapshotting"], false, "{status}");
    assert_eq!(status["snapshot"]["phase"], "loaded", "{status}");
    app.stop(Duration::from_secs(5)).await;
}

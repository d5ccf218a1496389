//! Ready means searchable: from the first 200 of `/readyz` on, a search of a
//! city with availability is never empty, at a start and across a
//! resnapshot. (Before, `/readyz` answered 200 as soon as the copy was
//! loaded, while the search index was still empty: a load balancer then
//! sent guests to a node that told them nothing was free.)

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use vacancy_lab::http_client::HttpClient;
use vacancy_lab::seed::{self, SeedOptions};
use vacancy_service::{App, Settings};

use crate::support::{TestOwner, wait_for};

const ADMIN_TOKEN: &str = "readiness-admin-token-0123456789";

/// Enough hotels that indexing them takes a moment after the copy loads.
const HOTELS: u32 = 2000;

async fn seeded_owner() -> TestOwner {
    let owner = TestOwner::start().await;
    seed::run(&SeedOptions {
        owner_url: owner.url.clone(),
        hotels: HOTELS,
        room_types: 2,
        nights: 4,
        start: chrono::Utc::now().date_naive(),
        seed: 7,
        progress: false,
    })
    .await
    .expect("seed the owner");
    owner
}

/// The city with the most hotels that have a unit free tonight, asked of
/// the owner, so the copy must answer it with at least one hotel.
async fn city_with_availability(owner: &TestOwner) -> String {
    let client = owner.client().await;
    let row = client
        .query_one(
            "SELECT h.city FROM hotels h JOIN inventory i ON i.hotel_id = h.id
             WHERE i.night = current_date AND i.taken < i.total
             GROUP BY h.city ORDER BY count(DISTINCT h.id) DESC, h.city LIMIT 1",
            &[],
        )
        .await
        .expect("a city with a free unit tonight");
    row.get(0)
}

/// One search of `city` for tonight: the number of hotels it found.
async fn hotels_found(client: &HttpClient, city: &str) -> u64 {
    let today = chrono::Utc::now().date_naive();
    let tomorrow = today + chrono::Days::new(1);
    let city: String = form_urlencoded::byte_serialize(city.as_bytes()).collect();
    let path = format!("/v1/search?city={city}&check_in={today}&check_out={tomorrow}&room=1");
    let answer = client
        .get(&path)
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    assert_eq!(answer.status, 200, "{path}: {}", answer.text());
    let body: serde_json::Value = serde_json::from_slice(&answer.body).expect("a JSON answer");
    body["total_hotels"]
        .as_u64()
        .unwrap_or_else(|| panic!("no total_hotels in {body}"))
}

async fn ready(client: &HttpClient) -> bool {
    client.get("/readyz").await.is_ok_and(|r| r.status == 200)
}

/// Searches `city` until `done` says so, asserting each answer finds a hotel.
async fn search_never_empty<F, Fut>(client: &HttpClient, city: &str, what: &str, mut done: F) -> u32
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut searches = 0;
    while !done().await {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within 90 s"
        );
        let found = hotels_found(client, city).await;
        searches += 1;
        assert!(
            found > 0,
            "{what}: search {searches} of {city}, which has a free unit tonight, found no hotel"
        );
    }
    searches
}

fn settings(owner: &TestOwner) -> Settings {
    let mut s = crate::projector::settings_for(owner);
    s.admin.tokens = vec![ADMIN_TOKEN.to_string()];
    s
}

async fn start(settings: Settings) -> (App, HttpClient) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = vacancy_service::start(settings, listener).expect("start vacancy");
    let addr: SocketAddr = app.addr;
    let client = HttpClient::new(addr, Duration::from_secs(10)).expect("an HTTP client");
    (app, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ready_node_finds_hotels_from_its_first_ready_answer_and_across_a_resnapshot() {
    let owner = seeded_owner().await;
    let city = city_with_availability(&owner).await;
    let (app, client) = start(settings(&owner)).await;

    // The start: poll readiness closely, then search at once.
    wait_for(
        "the first 200 from /readyz",
        Duration::from_secs(60),
        || async { ready(&client).await.then_some(()) },
    )
    .await;
    let settle = Instant::now() + Duration::from_secs(1);
    let after_start = search_never_empty(&client, &city, "one second after ready", || async {
        Instant::now() >= settle
    })
    .await;

    // A resnapshot: the old copy and its index serve until the new copy is
    // swapped in and indexed; readiness returns only then.
    let served = app.status.resnapshots_served();
    let accepted = client
        .post_json("/v1/admin/resnapshot", Some(ADMIN_TOKEN), "")
        .await
        .expect("POST /v1/admin/resnapshot");
    assert_eq!(accepted.status, 202, "{}", accepted.text());
    let swapped_and_ready =
        || async { app.status.resnapshots_served() > served && ready(&client).await };
    let across = search_never_empty(&client, &city, "the resnapshot", swapped_and_ready).await;
    let settle = Instant::now() + Duration::from_secs(1);
    let after_swap = search_never_empty(&client, &city, "one second after the swap", || async {
        Instant::now() >= settle
    })
    .await;
    eprintln!(
        "readiness: {after_start} searches after the first ready, {across} across the resnapshot, {after_swap} after it"
    );
    app.stop(Duration::from_secs(5)).await;
}

//! `GET /v1/hotels/{id}/events` against a real owner: a full state first,
//! then each committed change of that hotel once, in commit order, with its
//! LSN as the id; a reconnect with `Last-Event-ID` gets exactly what it
//! missed, or a fresh state when the id is too old to resume from.

use std::net::SocketAddr;
use std::time::Duration;

use chrono::NaiveDate;
use reqwest::Method;
use reqwest::header::{ACCEPT, CONTENT_TYPE, TRANSFER_ENCODING};
use serde_json::Value;
use tokio_postgres::Client;
use vacancy_lab::http_client::{self, HttpClient};
use vacancy_lab::ops::{self, HoldOutcome, HoldRequest};
use vacancy_service::slot;
use vacancy_service::{App, Lsn, Settings};

use crate::support::{TestOwner, wait_for};

fn day(n: u64) -> NaiveDate {
    chrono::Utc::now().date_naive() + chrono::Days::new(n)
}

/// One received Server-Sent Event.
#[derive(Debug, Clone)]
pub struct SseEvent {
    pub event: String,
    pub id: Option<String>,
    pub data: Value,
}

impl SseEvent {
    /// The id's LSN (ids are `timeline/LSN`, `1/0/16B3748`).
    pub fn lsn(&self) -> Lsn {
        self.id
            .as_deref()
            .expect("every data event has an id")
            .parse::<vacancy_service::Position>()
            .expect("the id is a position")
            .lsn
    }

    /// `(room_type_id, night) -> free` of the event's nights.
    fn free(&self) -> Vec<(i64, String, i64)> {
        self.data["nights"]
            .as_array()
            .expect("nights")
            .iter()
            .map(|n| {
                (
                    n["room_type_id"].as_i64().unwrap(),
                    n["night"].as_str().unwrap().to_string(),
                    n["free"].as_i64().unwrap_or(-1),
                )
            })
            .collect()
    }
}

/// An SSE client on the lab's HTTP client: the answer's body is read as it
/// comes (one `chunk()` at a time), every wait bounded.
pub struct SseClient {
    /// Kept with its answer, so dropping the client closes the connection.
    _api: HttpClient,
    response: reqwest::Response,
    /// Bytes received and not yet handed out as events (an event may come
    /// split over chunks, or a chunk hold several).
    buffer: Vec<u8>,
}

const READ_TIMEOUT: Duration = Duration::from_secs(30);

impl SseClient {
    pub async fn connect(addr: SocketAddr, path: &str, last_event_id: Option<&str>) -> SseClient {
        // The time limit of whole exchanges does not apply to a stream that
        // stays open: each wait below has its own.
        let api = HttpClient::new(addr, READ_TIMEOUT).expect("http client");
        let mut request = api
            .request(Method::GET, path)
            .header(ACCEPT, "text/event-stream");
        if let Some(id) = last_event_id {
            request = request.header("Last-Event-ID", id);
        }
        let response = timed(request.send()).await.expect("the stream's answer");
        assert_eq!(response.status(), 200);
        let header = |name| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_ascii_lowercase()
        };
        assert_eq!(
            header(TRANSFER_ENCODING),
            "chunked",
            "a stream is sent chunked"
        );
        assert_eq!(header(CONTENT_TYPE), "text/event-stream");
        SseClient {
            _api: api,
            response,
            buffer: Vec::new(),
        }
    }

    /// The next event with data (comments and keep-alives are skipped).
    pub async fn next(&mut self) -> SseEvent {
        loop {
            if let Some(end) = self.buffer.windows(2).position(|w| w == b"\n\n") {
                let block_bytes: Vec<u8> = self.buffer.drain(..end + 2).collect();
                let block = std::str::from_utf8(&block_bytes).expect("utf-8");
                let (mut event, mut id, mut data_text) =
                    ("message".to_string(), None, String::new());
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event:") {
                        event = v.trim().to_string();
                    } else if let Some(v) = line.strip_prefix("id:") {
                        id = Some(v.trim().to_string());
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data_text.push_str(v.strip_prefix(' ').unwrap_or(v));
                    }
                }
                if data_text.is_empty() {
                    continue;
                }
                let data = serde_json::from_str(&data_text).expect("event data is JSON");
                return SseEvent { event, id, data };
            }
            let chunk = timed(self.response.chunk())
                .await
                .expect("a chunk of the stream")
                .expect("the stream ended");
            self.buffer.extend_from_slice(&chunk);
        }
    }
}

async fn timed<T, E: std::fmt::Debug>(
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(READ_TIMEOUT, f).await {
        Ok(r) => r.map_err(|e| format!("{e:?}")),
        Err(_) => panic!("no data from the event stream within {READ_TIMEOUT:?}"),
    }
}

async fn load(client: &Client) {
    let mut sql = String::new();
    for hotel in [1, 2] {
        sql.push_str(&format!(
            "INSERT INTO hotels (id, name, city) VALUES ({hotel}, 'Hotel {hotel}', 'Lisbon');"
        ));
        for (rt, total) in [(1, 5), (2, 3)] {
            sql.push_str(&format!(
                "INSERT INTO room_types VALUES ({hotel}, {rt}, 'Room {rt}', 2);
                 INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
                   SELECT {hotel}, {rt}, DATE '{}' + n, {total}, 10000 FROM generate_series(0, 9) n;",
                day(0)
            ));
        }
    }
    client.batch_execute(&sql).await.expect("load hotels");
}

async fn settled(app: &App, client: &Client) {
    let target = slot::current_wal_lsn(client).await.unwrap();
    wait_for("the copy to catch up", Duration::from_secs(60), || async {
        (app.model.freshness.applied() >= target).then_some(())
    })
    .await;
}

async fn hold(client: &mut Client, id: &str, hotel_id: i64, room_type_id: i64, nights: (u64, u64)) {
    let req = HoldRequest {
        booking_id: id.to_string(),
        hotel_id,
        room_type_id,
        check_in: day(nights.0),
        check_out: day(nights.1),
        rooms: 1,
        hold_for: Duration::from_secs(600),
    };
    assert_eq!(ops::hold(client, &req).await.unwrap(), HoldOutcome::Held);
}

/// A change event for one hold of room type `rt` over `nights`, leaving `free` units.
fn assert_change(e: &SseEvent, rt: i64, nights: (u64, u64), free: i64) {
    assert_eq!(e.event, "change", "{e:?}");
    assert_eq!(e.data["hotel_id"], 1, "only hotel 1's changes: {e:?}");
    let expected: Vec<(i64, String, i64)> = (nights.0..nights.1)
        .map(|n| (rt, day(n).to_string(), free))
        .collect();
    assert_eq!(e.free(), expected, "{e:?}");
    // The id is the position: the owner timeline, then the data's LSN.
    assert_eq!(e.data["lsn"].as_str(), Some(e.lsn().to_string().as_str()));
    assert!(
        e.id.as_deref().is_some_and(|id| id.starts_with("1/")),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_send_each_change_once_in_order_and_resume_from_last_event_id() {
    let owner = TestOwner::start().await;
    let mut client = owner.client().await;
    load(&client).await;
    let mut settings = Settings::defaults();
    settings.owner.url = owner.url.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = vacancy_service::start(settings, listener).expect("start vacancy");
    wait_for("the snapshot", Duration::from_secs(60), || async {
        app.model.freshness.is_loaded().then_some(())
    })
    .await;
    settled(&app, &client).await;

    let path = format!("/v1/hotels/1/events?from={}&to={}", day(0), day(10));
    let mut sse = SseClient::connect(app.addr, &path, None).await;
    let state = sse.next().await;
    assert_eq!(state.event, "state");
    assert_eq!(state.data["reason"], "initial");
    assert_eq!(state.data["name"], "Hotel 1");
    let nights = state.free();
    assert_eq!(nights.len(), 20, "two room types, ten nights");
    assert!(
        nights
            .iter()
            .all(|(rt, _, free)| *free == if *rt == 1 { 5 } else { 3 })
    );
    let s = state.lsn();
    assert!(s > Lsn::ZERO);

    // Three holds on hotel 1, one on hotel 2 in between (not for this stream).
    hold(&mut client, "a", 1, 1, (1, 3)).await;
    hold(&mut client, "other", 2, 1, (1, 3)).await;
    hold(&mut client, "b", 1, 1, (2, 4)).await;
    hold(&mut client, "c", 1, 2, (5, 6)).await;
    let e1 = sse.next().await;
    let e2 = sse.next().await;
    let e3 = sse.next().await;
    assert_change(&e1, 1, (1, 3), 4);
    // Night 2 now has two holds; night 3 one.
    assert_eq!(
        e2.free(),
        vec![(1, day(2).to_string(), 3), (1, day(3).to_string(), 4)]
    );
    assert_change(&e3, 2, (5, 6), 2);
    assert!(
        s < e1.lsn() && e1.lsn() < e2.lsn() && e2.lsn() < e3.lsn(),
        "commit order"
    );

    // Gone after the first change: two more commits while away.
    drop(sse);
    hold(&mut client, "d", 1, 2, (7, 9)).await;
    hold(&mut client, "e", 1, 1, (8, 9)).await;
    settled(&app, &client).await;
    let mut sse = SseClient::connect(app.addr, &path, e1.id.as_deref()).await;
    let missed: Vec<SseEvent> = vec![
        sse.next().await,
        sse.next().await,
        sse.next().await,
        sse.next().await,
    ];
    assert_eq!(
        missed.iter().map(SseEvent::lsn).collect::<Vec<_>>()[..2],
        [e2.lsn(), e3.lsn()],
        "the missed ones, from just after Last-Event-ID, not a state"
    );
    assert_change(&missed[2], 2, (7, 9), 2);
    assert_change(&missed[3], 1, (8, 9), 4);
    // Live again, and nothing sent twice: the next event is the next commit.
    hold(&mut client, "f", 1, 2, (0, 1)).await;
    let live = sse.next().await;
    assert_change(&live, 2, (0, 1), 2);
    assert!(live.lsn() > missed[3].lsn());

    // Away across a room type's edit, which the ring keeps as a resync of
    // the hotel: the resumed stream begins with a fresh state. Its first
    // event carrying the reconnect delay twice made axum panic, and the
    // browser reconnected into the same panic until the item left the ring.
    drop(sse);
    client
        .batch_execute("UPDATE room_types SET name = 'Renamed' WHERE hotel_id = 1 AND id = 1")
        .await
        .unwrap();
    settled(&app, &client).await;
    let mut resumed = SseClient::connect(app.addr, &path, live.id.as_deref()).await;
    let resync = resumed.next().await;
    assert_eq!(resync.event, "state");
    assert_eq!(resync.data["reason"], "resync");
    assert!(resync.lsn() > live.lsn());
    drop(resumed);

    // An id older than anything the ring holds: a fresh state instead.
    let mut stale = SseClient::connect(app.addr, &path, Some("0/1")).await;
    let fresh = stale.next().await;
    assert_eq!(fresh.event, "state");
    assert_eq!(fresh.data["reason"], "resume_unavailable");
    assert!(fresh.lsn() >= live.lsn());
    let night8 = fresh
        .free()
        .into_iter()
        .find(|(rt, n, _)| *rt == 1 && *n == day(8).to_string())
        .unwrap();
    assert_eq!(night8.2, 4, "the state includes every commit");

    // Unknown hotels are a 404 problem, not an empty stream.
    let r = http_client::get(app.addr, "/v1/hotels/99/events", Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(r.status, 404);
    let doc = http_client::get(app.addr, "/openapi.json", Duration::from_secs(10))
        .await
        .unwrap()
        .json();
    assert!(
        doc["paths"]["/v1/hotels/{hotel_id}/events"]["get"].is_object(),
        "the stream is in /openapi.json"
    );
    drop(stale);
    app.stop(Duration::from_secs(10)).await;
}

/// With `http.max_event_streams_per_client`, one client holds at most that
/// many streams (one more is a 429 problem with Retry-After) and gets its
/// place back when it closes one; the per-client count follows the
/// client's address, so a stream from another address is not refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_holds_at_most_its_share_of_the_streams() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load(&client).await;
    let mut settings = Settings::defaults();
    settings.owner.url = owner.url.clone();
    settings.http.max_event_streams_per_client = 2;
    settings.http.trust_forwarded_for = true;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = vacancy_service::start(settings, listener).expect("start vacancy");
    wait_for("the snapshot", Duration::from_secs(60), || async {
        app.model.freshness.is_loaded().then_some(())
    })
    .await;

    let path = format!("/v1/hotels/1/events?from={}&to={}", day(0), day(10));
    let mut first = SseClient::connect(app.addr, &path, None).await;
    assert_eq!(first.next().await.event, "state");
    let mut second = SseClient::connect(app.addr, &path, None).await;
    assert_eq!(second.next().await.event, "state");
    let refused = open_stream(app.addr, &path, None).await;
    assert_eq!(refused.0, 429);
    assert_eq!(refused.1.as_deref(), Some("2"), "Retry-After");
    assert_eq!(refused.2["type"], "/problems/rate-limited");
    // Another address (a trusted proxy's X-Forwarded-For) has its own share.
    let other = open_stream(app.addr, &path, Some("203.0.113.9")).await;
    assert_eq!(other.0, 200);

    // A closed stream gives its place back (once the server sees it close).
    drop(first);
    wait_for("a place given back", Duration::from_secs(60), || async {
        (open_stream(app.addr, &path, None).await.0 == 200).then_some(())
    })
    .await;
    drop(second);
    app.stop(Duration::from_secs(10)).await;
}

/// Opens a stream and closes it at once: its status, its Retry-After, and
/// its body when it is a problem (a stream's body is never read).
async fn open_stream(
    addr: SocketAddr,
    path: &str,
    forwarded_for: Option<&str>,
) -> (u16, Option<String>, Value) {
    let api = HttpClient::new(addr, READ_TIMEOUT).expect("http client");
    let mut request = api
        .request(Method::GET, path)
        .header(ACCEPT, "text/event-stream");
    if let Some(address) = forwarded_for {
        request = request.header("X-Forwarded-For", address);
    }
    let response = timed(request.send()).await.expect("the stream's answer");
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = if status == 200 {
        Value::Null
    } else {
        serde_json::from_slice(&timed(response.bytes()).await.expect("a problem body"))
            .expect("problem+json")
    };
    (status, retry_after, body)
}

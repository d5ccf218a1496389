//! The guest page in headless Chromium, driven over the DevTools protocol:
//! search through the form, see results with free units, price and the
//! freshness badge, open a hotel, and see its free units change when a hold
//! commits on the owner (pushed over the events stream, no reload).
//!
//! Needs Debian's `chromium`. Without it the test fails when `CI=true` and
//! otherwise prints a note and passes.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio_tungstenite::tungstenite::Message;
use vacancy_lab::ops::{self, HoldOutcome, HoldRequest};
use vacancy_service::Settings;
use vacancy_service::slot;

use crate::support::{TestOwner, wait_for};

const CHROMIUM: &str = "/usr/bin/chromium";
const WAIT: Duration = Duration::from_secs(30);

fn day(n: u64) -> chrono::NaiveDate {
    chrono::Utc::now().date_naive() + chrono::Days::new(n)
}

/// Chromium with a DevTools websocket to its one page. Killed on drop.
struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
    ws: tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
    next_id: u64,
}

impl Browser {
    async fn launch(url: &str) -> Browser {
        let profile = tempfile::tempdir().expect("profile folder");
        let mut child = Command::new(CHROMIUM)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(url)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start chromium");
        let stderr = child.stderr.take().expect("stderr");
        let mut lines = BufReader::new(stderr).lines();
        let browser_ws = tokio::time::timeout(WAIT, async {
            while let Some(line) = lines.next_line().await.expect("chromium stderr") {
                if let Some(rest) = line.split("DevTools listening on ").nth(1) {
                    return rest.trim().to_string();
                }
            }
            panic!("chromium exited before it listened for DevTools");
        })
        .await
        .expect("chromium opens DevTools within 30 s");
        // Keep draining stderr so chromium never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let port: u16 = browser_ws
            .trim_start_matches("ws://")
            .split(['/', ':'])
            .nth(1)
            .and_then(|p| p.parse().ok())
            .expect("port in the DevTools address");
        let devtools: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let page_ws = wait_for("the page target", WAIT, || async {
            let body = devtools_get(devtools, "/json/list").await?;
            let targets: Value = serde_json::from_slice(&body).ok()?;
            targets
                .as_array()?
                .iter()
                .find(|t| t["type"] == "page")
                .and_then(|t| t["webSocketDebuggerUrl"].as_str())
                .map(str::to_string)
        })
        .await;
        let (ws, _) = tokio_tungstenite::connect_async(page_ws.as_str())
            .await
            .expect("connect to the page's DevTools socket");
        Browser {
            child,
            _profile: profile,
            ws,
            next_id: 0,
        }
    }

    /// Evaluates `expression` in the page; its value (awaited, by value).
    async fn eval(&mut self, expression: &str) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let call = json!({"id": id, "method": "Runtime.evaluate", "params": {
            "expression": expression, "returnByValue": true, "awaitPromise": true}});
        self.ws
            .send(Message::text(call.to_string()))
            .await
            .expect("send to DevTools");
        let answer = tokio::time::timeout(WAIT, async {
            loop {
                let msg = self.ws.next().await.expect("DevTools open").expect("read");
                let Ok(text) = msg.to_text() else { continue };
                let v: Value = serde_json::from_str(text).unwrap_or(Value::Null);
                if v["id"] == id {
                    return v;
                }
            }
        })
        .await
        .expect("DevTools answers within 30 s");
        if let Some(e) = answer["result"].get("exceptionDetails") {
            panic!("{expression} threw: {e}");
        }
        answer["result"]["result"]["value"].clone()
    }

    /// Polls `expression` until it yields something other than null/false.
    async fn until(&mut self, what: &str, expression: &str) -> Value {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let v = self.eval(expression).await;
            if !v.is_null() && v != Value::Bool(false) {
                return v;
            }
            if tokio::time::Instant::now() > deadline {
                let body = self.eval("document.body.innerText.slice(0, 2000)").await;
                panic!("timed out waiting for {what}; the page shows:\n{body}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A GET to Chromium's DevTools HTTP endpoint: its body when it answered
/// 200 within 5 s. The endpoint accepts only a Host header that is an IP
/// address or localhost, which the client sends for `127.0.0.1:port`.
async fn devtools_get(addr: std::net::SocketAddr, path: &str) -> Option<bytes::Bytes> {
    let r = vacancy_lab::http_client::get(addr, path, Duration::from_secs(5))
        .await
        .ok()?;
    (r.status == 200).then_some(r.body)
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

fn chromium_missing() -> bool {
    if Path::new(CHROMIUM).is_file() {
        return false;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{CHROMIUM} is missing: apt-get install -y chromium (.ci/run installs it)");
    }
    eprintln!(
        "note: {CHROMIUM} is missing, so the page test is skipped; apt-get install -y chromium"
    );
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_searches_opens_a_hotel_and_shows_a_hold_live() {
    if chromium_missing() {
        return;
    }
    let owner = TestOwner::start().await;
    let mut client = owner.client().await;
    client
        .batch_execute(&format!(
            "INSERT INTO hotels (id, name, city, stars) VALUES
               (1, 'Casa Alfama', 'Lisbon', 4), (2, 'Porto Ribeira', 'Porto', 3);
             INSERT INTO room_types VALUES (1, 1, 'Double', 2), (1, 2, 'Suite', 4), (2, 1, 'Double', 2);
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               SELECT h, rt, DATE '{}' + n, 6, 12000
               FROM (VALUES (1, 1), (1, 2), (2, 1)) t(h, rt), generate_series(0, 30) n;",
            day(0)
        ))
        .await
        .expect("load hotels");
    let mut settings = Settings::defaults();
    settings.owner.url = owner.url.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = vacancy_service::start(settings, listener).expect("start vacancy");
    let target = slot::current_wal_lsn(&client).await.unwrap();
    wait_for("the copy and index", Duration::from_secs(60), || async {
        (app.model.freshness.applied() >= target && app.hotel_index.synced_lsn() >= target)
            .then_some(())
    })
    .await;

    let mut browser = Browser::launch(&format!("http://{}/", app.addr)).await;
    browser
        .until(
            "the form",
            "document.readyState === 'complete' && !!document.getElementById('search-form')",
        )
        .await;

    // Search through the form, as a guest would.
    let fill = format!(
        "(() => {{
            document.getElementById('city').value = 'Lisbon';
            document.getElementById('check-in').value = '{}';
            document.getElementById('check-out').value = '{}';
            document.getElementById('rooms').value = '1';
            document.getElementById('guests').value = '2';
            document.getElementById('search-button').click();
            return true;
        }})()",
        day(1),
        day(3)
    );
    browser.eval(&fill).await;
    browser
        .until(
            "the results",
            "document.body.dataset.searchState === 'done'",
        )
        .await;
    let results = browser
        .eval(
            "Array.from(document.querySelectorAll('#results .result')).map(r => ({
                id: r.dataset.hotelId, text: r.innerText }))",
        )
        .await;
    let results = results.as_array().expect("results");
    assert_eq!(results.len(), 1, "only the Lisbon hotel: {results:?}");
    let text = results[0]["text"].as_str().unwrap();
    assert_eq!(results[0]["id"], "1");
    assert!(text.contains("Casa Alfama"), "{text}");
    assert!(text.contains("6 free"), "free units shown: {text}");
    assert!(text.contains("€240.00"), "the stay's price: {text}");
    assert!(text.contains("copy"), "the source of the numbers: {text}");
    let badge = browser
        .eval("document.getElementById('freshness').innerText")
        .await;
    let badge = badge.as_str().unwrap();
    assert!(
        badge.starts_with("lsn ") && badge.contains("lag"),
        "{badge}"
    );

    // Open the hotel from the results.
    browser
        .eval("document.querySelector('.result[data-hotel-id=\"1\"] h2 a').click(), true")
        .await;
    browser
        .until(
            "the live hotel page",
            "document.body.dataset.hotelState === 'live'",
        )
        .await;
    let cell = |rt: i64, n: u64| {
        format!(
            "(document.querySelector('td[data-rt=\"{rt}\"][data-night=\"{}\"]') || {{dataset: {{}}}}).dataset.free",
            day(n)
        )
    };
    assert_eq!(browser.eval(&cell(1, 2)).await, "6");
    assert_eq!(browser.eval(&cell(2, 2)).await, "6");
    let name = browser
        .eval("document.getElementById('hotel-name').innerText")
        .await;
    assert_eq!(name, "Casa Alfama, Lisbon");

    // A hold commits on the owner; the open page shows it without a reload.
    let req = HoldRequest {
        booking_id: "page-test".into(),
        hotel_id: 1,
        room_type_id: 1,
        check_in: day(2),
        check_out: day(4),
        rooms: 2,
        hold_for: Duration::from_secs(600),
    };
    assert_eq!(
        ops::hold(&mut client, &req).await.unwrap(),
        HoldOutcome::Held
    );
    browser
        .until(
            "the pushed change",
            &format!(
                "{} === '4' && {}",
                cell(1, 2),
                format_args!("{} === '4'", cell(1, 3))
            ),
        )
        .await;
    assert_eq!(
        browser.eval(&cell(1, 1)).await,
        "6",
        "other nights unchanged"
    );
    assert_eq!(
        browser.eval(&cell(2, 2)).await,
        "6",
        "other room types unchanged"
    );
    let status = browser
        .eval("document.getElementById('hotel-status').innerText")
        .await;
    assert!(
        status.as_str().unwrap().contains("1 changes pushed"),
        "{status}"
    );
    let reloads = browser
        .eval("performance.getEntriesByType('navigation').length")
        .await;
    assert_eq!(reloads, 1, "no reload: the change was pushed");

    drop(browser);
    app.stop(Duration::from_secs(10)).await;
}

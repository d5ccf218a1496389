//! The guest page in headless Chromium, driven over the DevTools protocol:
//! search through the form, see results with free units, price and the
//! freshness badge, open a hotel, and see its free units change when a hold
//! commits on the owner (pushed over the events stream, no reload). On a
//! desktop screen and on a 390 px phone, the results and the hotel's
//! calendar fit the screen, measured from Chromium's layout: nothing
//! scrolls sideways and every source badge is inside the viewport.
//! `VACANCY_PAGE_SCREENSHOTS=<folder>` saves what the page showed as PNGs,
//! for a person to judge what the numbers cannot.
//!
//! Needs Debian's `chromium`. Without it the test fails when `CI=true` and
//! otherwise prints a note and passes.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use base64::Engine as _;
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

    /// Sends one DevTools command and returns its `result`, skipping the
    /// events and other answers that arrive in between.
    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let call = json!({"id": id, "method": method, "params": params});
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
        if let Some(e) = answer.get("error") {
            panic!("{method} failed: {e}");
        }
        answer["result"].clone()
    }

    /// Evaluates `expression` in the page; its value (awaited, by value).
    async fn eval(&mut self, expression: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
            )
            .await;
        if let Some(e) = result.get("exceptionDetails") {
            panic!("{expression} threw: {e}");
        }
        result["result"]["value"].clone()
    }

    /// Lays the page out as on `screen`, the way a device would: with
    /// `mobile` the page's viewport meta tag decides the layout width, as
    /// on a phone, instead of the window's.
    async fn emulate(&mut self, screen: Screen) {
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": screen.width, "height": screen.height,
                   "deviceScaleFactor": screen.scale, "mobile": screen.mobile}),
        )
        .await;
    }

    /// Writes what the page shows to `$VACANCY_PAGE_SCREENSHOTS/{name}.png`
    /// when that variable names a folder: numbers say the layout fits, a
    /// person judges whether it reads well.
    async fn screenshot(&mut self, name: &str) {
        let Some(dir) = std::env::var_os("VACANCY_PAGE_SCREENSHOTS") else {
            return;
        };
        let shot = self
            .call(
                "Page.captureScreenshot",
                json!({"format": "png", "captureBeyondViewport": true}),
            )
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().expect("screenshot data"))
            .expect("DevTools sends screenshots in standard base64");
        let path = Path::new(&dir).join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        eprintln!("screenshot: {}", path.display());
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

/// A device to lay the page out on.
#[derive(Clone, Copy)]
struct Screen {
    /// CSS pixels.
    width: u32,
    height: u32,
    scale: f64,
    mobile: bool,
}

const DESKTOP: Screen = Screen {
    width: 1280,
    height: 800,
    scale: 1.0,
    mobile: false,
};

/// A phone 390 CSS px wide (iPhone 12 to 15): the results used to scroll
/// sideways there, with the source badges past the right edge.
const PHONE: Screen = Screen {
    width: 390,
    height: 844,
    scale: 3.0,
    mobile: true,
};

/// Asserts, from the layout Chromium measured, that the page as shown on
/// `screen` fits it: the layout viewport is the screen's width at scale 1
/// (a phone zooms out a page wider than its viewport, which would hide the
/// overflow from the other checks), nothing scrolls sideways, every badge
/// lies inside the viewport, and within each room type's row no part
/// overlaps another or spills out of its box.
async fn assert_fits(browser: &mut Browser, screen: Screen, what: &str) {
    let m = browser
        .eval(
            "(() => {
                const visible = (e) => e.getClientRects().length > 0;
                const rect = (e) => { const r = e.getBoundingClientRect();
                    return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
                const inner = window.innerWidth;
                const badges = Array.from(document.querySelectorAll('.badge')).filter(visible)
                    .map((b) => ({text: b.innerText, ...rect(b)}));
                const clashes = [];
                for (const offer of document.querySelectorAll('.offer')) {
                    const parts = Array.from(offer.children).filter(visible);
                    for (const p of parts) {
                        if (p.scrollWidth > p.clientWidth + 1) {
                            clashes.push(`${p.className} '${p.innerText}' spills out of its box`);
                        }
                    }
                    for (let i = 0; i < parts.length; i++) for (let j = i + 1; j < parts.length; j++) {
                        const a = parts[i].getBoundingClientRect(), b = parts[j].getBoundingClientRect();
                        if (a.left < b.right - 0.5 && b.left < a.right - 0.5
                            && a.top < b.bottom - 0.5 && b.top < a.bottom - 0.5) {
                            clashes.push(`'${parts[i].innerText}' overlaps '${parts[j].innerText}'`);
                        }
                    }
                }
                return {inner, scale: window.visualViewport.scale,
                        scroll: document.documentElement.scrollWidth, badges, clashes,
                        offers: document.querySelectorAll('.offer').length};
            })()",
        )
        .await;
    let inner = m["inner"].as_f64().unwrap();
    assert_eq!(
        inner,
        f64::from(screen.width),
        "{what}: layout viewport width"
    );
    assert_eq!(m["scale"], 1.0, "{what}: the page is not zoomed out to fit");
    let scroll = m["scroll"].as_f64().unwrap();
    assert!(
        scroll <= inner,
        "{what}: the page scrolls sideways, {scroll} px wide in a {inner} px viewport"
    );
    let badges = m["badges"].as_array().unwrap();
    assert!(!badges.is_empty(), "{what}: no badge shown");
    for b in badges {
        let (left, right) = (b["left"].as_f64().unwrap(), b["right"].as_f64().unwrap());
        assert!(
            left >= 0.0 && right <= inner,
            "{what}: badge {} spans {left}..{right} px, outside the {inner} px viewport",
            b["text"]
        );
    }
    assert_eq!(m["clashes"], json!([]), "{what}: room type rows");
}

/// An owner with `sql` loaded, vacancy serving its copy once the copy and
/// the index hold all of it, and Chromium on the guest page at `screen`.
struct Run {
    _owner: TestOwner,
    client: tokio_postgres::Client,
    app: vacancy_service::App,
    browser: Browser,
}

impl Run {
    async fn start(sql: &str, screen: Screen) -> Run {
        let owner = TestOwner::start().await;
        let client = owner.client().await;
        client.batch_execute(sql).await.expect("load hotels");
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
        let mut browser = Browser::launch("about:blank").await;
        browser.emulate(screen).await;
        // Loaded after the emulation, so the page is laid out as it would
        // be on that device from its first paint.
        browser
            .call(
                "Page.navigate",
                json!({"url": format!("http://{}/", app.addr)}),
            )
            .await;
        browser
            .until(
                "the form",
                "document.readyState === 'complete' && !!document.getElementById('search-form')",
            )
            .await;
        Run {
            _owner: owner,
            client,
            app,
            browser,
        }
    }

    /// Searches `city` for one room for two, one night from tomorrow,
    /// through the form as a guest would, and waits for the results.
    async fn search(&mut self, city: &str) {
        let fill = format!(
            "(() => {{
                document.getElementById('city').value = '{city}';
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
        self.browser.eval(&fill).await;
        self.browser
            .until(
                "the results",
                "document.body.dataset.searchState === 'done'",
            )
            .await;
    }

    /// Opens hotel `id` from the results and waits for its live calendar.
    async fn open_hotel(&mut self, id: i64) {
        self.browser
            .eval(&format!(
                "document.querySelector('.result[data-hotel-id=\"{id}\"] h2 a').click(), true"
            ))
            .await;
        self.browser
            .until(
                "the live hotel page",
                "document.body.dataset.hotelState === 'live'",
            )
            .await;
    }

    async fn stop(self) {
        drop(self.browser);
        self.app.stop(Duration::from_secs(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_searches_opens_a_hotel_and_shows_a_hold_live() {
    if chromium_missing() {
        return;
    }
    let sql = format!(
        "INSERT INTO hotels (id, name, city, stars) VALUES
           (1, 'Casa Alfama', 'Lisbon', 4), (2, 'Porto Ribeira', 'Porto', 3);
         INSERT INTO room_types VALUES (1, 1, 'Double', 2), (1, 2, 'Suite', 4), (2, 1, 'Double', 2);
         INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
           SELECT h, rt, DATE '{}' + n, 6, 12000
           FROM (VALUES (1, 1), (1, 2), (2, 1)) t(h, rt), generate_series(0, 30) n;",
        day(0)
    );
    let mut run = Run::start(&sql, DESKTOP).await;

    // Search through the form, as a guest would.
    run.search("Lisbon").await;
    let browser = &mut run.browser;
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
    let count = browser
        .eval("document.getElementById('search-status').innerText")
        .await;
    assert!(
        count.as_str().unwrap().starts_with("1 hotel can host you"),
        "{count}"
    );
    let badge = browser
        .eval("document.getElementById('freshness').innerText")
        .await;
    let badge = badge.as_str().unwrap();
    assert!(
        badge.starts_with("lsn ") && badge.contains("lag"),
        "{badge}"
    );
    browser.screenshot("desktop-results").await;
    assert_fits(browser, DESKTOP, "desktop results").await;

    // Open the hotel from the results.
    run.open_hotel(1).await;
    let browser = &mut run.browser;
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
    assert_fits(browser, DESKTOP, "desktop hotel").await;

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
        ops::hold(&mut run.client, &req).await.unwrap(),
        HoldOutcome::Held
    );
    let browser = &mut run.browser;
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

    run.stop().await;
}

/// On a phone the results and a hotel's calendar fit the screen, with every
/// source, `confirmed` included, labelled and styled as its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_fits_a_phone_with_every_source() {
    if chromium_missing() {
        return;
    }
    // Long names, as real hotels have, and four room types: one per source.
    let sql = format!(
        "INSERT INTO hotels (id, name, city, stars) VALUES
           (1, 'Pousada de Lisboa, Praça do Comércio Grand Residences', 'Lisbon', 5);
         INSERT INTO room_types VALUES
           (1, 1, 'Superior Double with River View', 2), (1, 2, 'Family Suite with Terrace', 4),
           (1, 3, 'Classic Twin', 2), (1, 4, 'Deluxe King Balcony', 2);
         INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
           SELECT 1, rt, DATE '{}' + n, 12, 123456
           FROM generate_series(1, 4) rt, generate_series(0, 30) n;",
        day(0)
    );
    let mut run = Run::start(&sql, PHONE).await;
    let browser = &mut run.browser;
    // This owner answers every room type from the copy, and cannot be made
    // to show `copy_fallback` (an owner read that timed out) or `confirmed`
    // on cue. So the page's own fetch rewrites each room type's source in
    // the server's answer, one source per room type, before the page
    // renders it; everything else is what the server said.
    browser
        .eval(
            "(() => {
                const real = window.fetch;
                const sources = {1: 'copy', 2: 'owner', 3: 'copy_fallback', 4: 'confirmed'};
                window.fetch = async (url, init) => {
                    const r = await real(url, init);
                    if (!String(url).startsWith('/v1/search')) return r;
                    const answer = await r.json();
                    for (const h of answer.results) for (const t of h.room_types) {
                        t.source = sources[t.room_type_id];
                        if (t.source === 'confirmed') t.confirmed_lsn = answer.lsn;
                    }
                    return new Response(JSON.stringify(answer), {status: r.status, headers: r.headers});
                };
                return true;
            })()",
        )
        .await;
    run.search("Lisbon").await;
    let browser = &mut run.browser;
    browser.screenshot("phone-results").await;
    assert_fits(browser, PHONE, "phone results").await;
    let offers = browser
        .eval(
            "Array.from(document.querySelectorAll('.offer')).map((o) => {
                const b = o.querySelector('.badge');
                return {rt: o.dataset.roomTypeId, label: b.innerText, title: b.title,
                        background: getComputedStyle(b).backgroundColor};
            }).sort((a, b) => a.rt - b.rt)",
        )
        .await;
    let offers = offers.as_array().expect("offers");
    let labels: Vec<&str> = offers
        .iter()
        .map(|o| o["label"].as_str().unwrap())
        .collect();
    assert_eq!(labels, ["copy", "owner", "copy_fallback", "confirmed"]);
    let lsn = browser
        .eval("document.getElementById('freshness').dataset.lsn")
        .await;
    let confirmed_title = offers[3]["title"].as_str().unwrap();
    assert!(
        confirmed_title.contains(&format!("lsn {}", lsn.as_str().unwrap())),
        "a confirmed room type says the owner position it was confirmed at: {confirmed_title}"
    );
    // Each source has its own colour, so a guest (and whoever watches the
    // demo) tells them apart at a glance.
    let mut backgrounds: Vec<&str> = offers
        .iter()
        .map(|o| o["background"].as_str().unwrap())
        .collect();
    backgrounds.sort_unstable();
    backgrounds.dedup();
    assert_eq!(backgrounds.len(), 4, "one colour per source: {offers:?}");
    let titles: Vec<&str> = offers
        .iter()
        .map(|o| o["title"].as_str().unwrap())
        .collect();
    let mut distinct = titles.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 4, "each source explains itself: {titles:?}");

    run.open_hotel(1).await;
    let browser = &mut run.browser;
    // The calendar is wider than a phone: it scrolls inside its own box,
    // the page does not.
    let grid = browser
        .eval(
            "(() => { const w = document.querySelector('.grid-wrap');
                return w.scrollWidth > w.clientWidth; })()",
        )
        .await;
    assert_eq!(grid, true, "two weeks of nights are wider than a phone");
    browser.screenshot("phone-hotel").await;
    assert_fits(browser, PHONE, "phone hotel").await;
    // Scrolled to the last night, each row still says which room type it is.
    let pinned = browser
        .eval(
            "(() => { const w = document.querySelector('.grid-wrap');
                w.scrollLeft = w.scrollWidth;
                const box = w.getBoundingClientRect().left + w.clientLeft;
                return w.scrollLeft > 0 && Array.from(document.querySelectorAll('th.rt'))
                    .every((th) => Math.abs(th.getBoundingClientRect().left - box) < 1); })()",
        )
        .await;
    assert_eq!(pinned, true, "the room type column stays in view");
    browser.screenshot("phone-hotel-scrolled").await;
    assert_fits(browser, PHONE, "phone hotel, calendar scrolled").await;

    run.stop().await;
}

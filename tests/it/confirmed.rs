//! Confirmed reads (`search.fresh_reads = "confirmed"`, set here): a
//! few-unit room type is shown from the copy once the copy has applied an
//! owner WAL position taken after the search began.
//!
//! The stream is held back by stopping the owner's walsender (SIGSTOP): the
//! owner commits as usual, nothing reaches the copy until it is continued.

use std::time::{Duration, Instant};

use chrono::NaiveDate;
use serde_json::Value;
use tokio_postgres::Client;
use tokio_postgres::types::PgLsn;
use vacancy_lab::cluster::ClusterOptions;
use vacancy_service::{App, Lsn, Settings, slot};

use crate::api::get;
use crate::support::{TestOwner, wait_for};

fn day(n: u64) -> NaiveDate {
    chrono::Utc::now().date_naive() + chrono::Days::new(n)
}

/// Hotel 1 in Lisbon: room type 1 with 2 units (few: confirmed), room type
/// 2 with 9 (the copy's); `extra_hotel` adds hotel 2 in Porto with
/// `extra_rows` nights over four room types, for an unrelated transaction.
async fn load(client: &Client, extra_rows: u64) {
    let mut sql = format!(
        "INSERT INTO hotels (id, name, city) VALUES (1, 'Hotel 1', 'Lisbon');
         INSERT INTO room_types VALUES (1, 1, 'Room 1', 2), (1, 2, 'Room 2', 2);
         INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
           SELECT 1, rt, DATE '{}' + n, CASE rt WHEN 1 THEN 2 ELSE 9 END, 10000
           FROM generate_series(1, 2) rt, generate_series(0, 13) n;",
        day(0)
    );
    if extra_rows > 0 {
        sql.push_str(&format!(
            "INSERT INTO hotels (id, name, city) VALUES (2, 'Hotel 2', 'Porto');
             INSERT INTO room_types SELECT 2, rt, 'Room ' || rt, 2 FROM generate_series(1, 4) rt;
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               SELECT 2, rt, DATE '{}' + n, 9, 10000
               FROM generate_series(1, 4) rt, generate_series(0, {} / 4 - 1) n;",
            day(0),
            extra_rows
        ));
    }
    client.batch_execute(&sql).await.expect("load hotels");
}

async fn start(owner: &TestOwner, tune: impl FnOnce(&mut Settings)) -> App {
    let mut s = crate::projector::settings_for(owner);
    s.stale.audit_interval_ms = 0;
    s.search.fresh_reads = vacancy_service::FreshReads::Confirmed;
    tune(&mut s);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = vacancy_service::start(s, listener).expect("start vacancy");
    let client = owner.client().await;
    let target = slot::current_wal_lsn(&client).await.unwrap();
    wait_for("the copy to load", Duration::from_secs(60), || async {
        (app.model.freshness.is_loaded()
            && app.model.freshness.applied() >= target
            && app.hotel_index.synced_lsn() >= target)
            .then_some(())
    })
    .await;
    app
}

async fn insert_lsn(client: &Client) -> Lsn {
    let lsn: PgLsn = client
        .query_one("SELECT pg_current_wal_insert_lsn()", &[])
        .await
        .unwrap()
        .get(0);
    lsn.into()
}

fn search_path() -> String {
    format!(
        "/v1/search?city=Lisbon&check_in={}&check_out={}&room=1",
        day(2),
        day(5)
    )
}

/// The answer's room type `rt` of hotel 1.
fn room_type(v: &Value, rt: i64) -> Value {
    v["results"][0]["room_types"]
        .as_array()
        .unwrap_or_else(|| panic!("no hotel in {v}"))
        .iter()
        .find(|t| t["room_type_id"] == rt)
        .unwrap_or_else(|| panic!("room type {rt} missing in {v}"))
        .clone()
}

/// GET `path`, which must answer 200 with JSON.
async fn get_json(addr: std::net::SocketAddr, path: &str) -> Value {
    let (code, _, body) = get(addr, path).await;
    assert_eq!(code, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
}

/// Nudges written so far, from `/metrics` (the counter is the process's).
async fn nudges(addr: std::net::SocketAddr) -> f64 {
    let (code, _, body) = get(addr, "/metrics").await;
    assert_eq!(code, 200, "{body}");
    vacancy_lab::bench::soak::gauge(&body, "vacancy_owner_reads_total{reason=\"nudge\"}", None)
        .unwrap_or_else(|| panic!("no nudge counter in /metrics"))
}

fn lsn_of(v: &Value) -> Lsn {
    v.as_str()
        .unwrap_or_else(|| panic!("not an LSN: {v}"))
        .parse()
        .unwrap()
}

/// The walsender of vacancy's slot, stopped until continued (or dropped).
pub(crate) struct HeldStream {
    pid: i32,
}

impl HeldStream {
    /// Stops the walsender `pid` (one not holding the slot: a snapshot's,
    /// while the copy loads).
    pub(crate) fn stop(pid: i32) -> HeldStream {
        signal(pid, "-STOP");
        HeldStream { pid }
    }

    async fn hold(client: &Client) -> HeldStream {
        let pid: i32 = wait_for("the slot's walsender", Duration::from_secs(20), || async {
            client
                .query_one(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'vacancy'",
                    &[],
                )
                .await
                .ok()?
                .get::<_, Option<i32>>(0)
        })
        .await;
        HeldStream::stop(pid)
    }

    /// Continues the walsender (as dropping does, also when a test fails).
    pub(crate) fn release(self) {}
}

impl Drop for HeldStream {
    fn drop(&mut self) {
        signal(self.pid, "-CONT");
    }
}

fn signal(pid: i32, which: &str) {
    let status = std::process::Command::new("kill")
        .args([which, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {which} {pid}");
}

/// The stream is held back, the owner takes a unit, then a guest searches:
/// the answer waits for the copy to pass a position taken after the search
/// began, so it shows the take, and says where it confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_answer_shows_a_write_the_stream_was_holding_back() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load(&client, 0).await;
    let app = start(&owner, |s| {
        // Room for the hold below inside the confirmed read's half.
        s.search.owner_read_timeout_ms = 8000;
    })
    .await;
    let before = get_json(app.addr, &search_path()).await;
    assert_eq!(room_type(&before, 1)["source"], "confirmed", "{before}");
    assert_eq!(room_type(&before, 1)["free_units"], 2, "{before}");
    assert_eq!(room_type(&before, 2)["source"], "copy", "{before}");

    let held = HeldStream::hold(&client).await;
    client
        .batch_execute(&format!(
            "UPDATE inventory SET taken = taken + 1
             WHERE hotel_id = 1 AND room_type_id = 1 AND night = DATE '{}'",
            day(3)
        ))
        .await
        .unwrap();
    let after_write = insert_lsn(&client).await;
    let applied_before = app.model.freshness.applied();
    assert!(
        applied_before < after_write,
        "the copy must not have the write yet ({applied_before} vs {after_write})"
    );

    let addr = app.addr;
    let asked = Instant::now();
    let search = tokio::spawn(async move { get_json(addr, &search_path()).await });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !search.is_finished(),
        "the search must wait for the copy to confirm, not answer from it"
    );
    held.release();
    let v = tokio::time::timeout(Duration::from_secs(10), search)
        .await
        .expect("the search to end once the stream moves")
        .unwrap();
    let waited = asked.elapsed();
    let t = room_type(&v, 1);
    assert_eq!(t["source"], "confirmed", "{v}");
    assert_eq!(t["free_units"], 1, "the write is in the answer: {v}");
    let confirmed = lsn_of(&v["confirmed_lsn"]);
    assert!(
        confirmed >= after_write,
        "confirmed_lsn {confirmed} is before the owner's position {after_write} read after the write"
    );
    // The copy ranked the hotel before it had the write: the answer's own
    // LSN is older, only the confirmed room type is newer.
    assert!(lsn_of(&v["lsn"]) < after_write, "{v}");
    assert_eq!(room_type(&v, 2)["source"], "copy", "{v}");
    assert!(waited >= Duration::from_millis(400), "{waited:?}");
    // The quote says confirmed, at the confirmed position.
    let q = app
        .stale
        .key
        .verify(t["quote"].as_str().unwrap())
        .expect("a quote this app signed");
    assert_eq!(q.source, vacancy_service::Source::Confirmed);
    assert_eq!(q.lsn, confirmed);

    // A hotel's availability confirms the same way.
    let availability = get_json(
        app.addr,
        &format!(
            "/v1/hotels/1/availability?check_in={}&check_out={}&room=1",
            day(2),
            day(5)
        ),
    )
    .await;
    let listed = availability["room_types"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["room_type_id"] == 1)
        .unwrap()
        .clone();
    assert_eq!(listed["source"], "confirmed", "{availability}");
    assert_eq!(listed["free_units"], 1, "{availability}");
    assert!(
        lsn_of(&availability["confirmed_lsn"]) >= after_write,
        "{availability}"
    );
    app.stop(Duration::from_secs(5)).await;
}

/// An unrelated owner transaction is open, large enough to be streamed in
/// progress (so no keepalive may move the copy), it wrote WAL after the
/// last commit, and the heartbeat is off: the insert position the read takes
/// would not be reached until some later commit. The confirmed read nudges
/// (its own commit, `search::confirm`), so it answers at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_read_does_not_wait_for_a_heartbeat_while_an_unrelated_transaction_is_open() {
    let owner = TestOwner::start_with(ClusterOptions {
        // Stream the unrelated transaction while it runs (the smallest value).
        extra_conf: vec!["logical_decoding_work_mem = '64kB'".into()],
        ..ClusterOptions::default()
    })
    .await;
    let client = owner.client().await;
    load(&client, 4000).await;
    let app = start(&owner, |s| {
        s.stream.heartbeat_interval_ms = 0;
        s.stream.stream_in_progress = true;
        // Waiting for a commit that never comes would take all of this.
        s.search.owner_read_timeout_ms = 6000;
    })
    .await;

    // A take on hotel 1, committed, then an unrelated transaction left open.
    client
        .batch_execute(&format!(
            "UPDATE inventory SET taken = taken + 1
             WHERE hotel_id = 1 AND room_type_id = 1 AND night = DATE '{}'",
            day(2)
        ))
        .await
        .unwrap();
    let after_write = insert_lsn(&client).await;
    wait_for(
        "the copy to apply the take",
        Duration::from_secs(20),
        || async { (app.model.freshness.applied() >= after_write).then_some(()) },
    )
    .await;
    let unrelated = owner.client().await;
    unrelated
        .batch_execute(
            "BEGIN; UPDATE inventory SET price_cents = price_cents + 1 WHERE hotel_id = 2;",
        )
        .await
        .unwrap();
    let open_end = insert_lsn(&client).await;
    wait_for(
        "the open transaction to be streamed to the copy",
        Duration::from_secs(20),
        || async {
            let row = client
                .query_one(
                    "SELECT coalesce(stream_txns, 0) FROM pg_stat_replication_slots WHERE slot_name = 'vacancy'",
                    &[],
                )
                .await
                .ok()?;
            (row.get::<_, i64>(0) > 0).then_some(())
        },
    )
    .await;
    // Give keepalives their chance: none may move the copy past the open
    // transaction's WAL while it is held.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        app.model.freshness.applied() < open_end,
        "the copy stands before the open transaction's WAL ({} vs {open_end})",
        app.model.freshness.applied()
    );

    let nudges_before = nudges(app.addr).await;
    let asked = Instant::now();
    let v = get_json(app.addr, &search_path()).await;
    let took = asked.elapsed();
    assert!(
        nudges(app.addr).await > nudges_before,
        "the copy could not reach the position by itself: the read must have nudged"
    );
    let t = room_type(&v, 1);
    assert_eq!(t["source"], "confirmed", "{v}");
    assert_eq!(t["free_units"], 1, "{v}");
    assert!(lsn_of(&v["confirmed_lsn"]) >= open_end, "{v}");
    // Nothing but the nudge's own commit could carry the copy past the
    // position (no heartbeat, the open transaction held): an answer that is
    // `confirmed`, not a fallback after the 6 s budget, is the proof. How
    // long it took is printed, not asserted (no timing assertions).
    println!("the nudged confirmed read took {took:?}");
    unrelated.batch_execute("ROLLBACK").await.unwrap();
    app.stop(Duration::from_secs(5)).await;
}

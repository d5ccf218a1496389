//! The `vacancy serve` binary as operators run it: killed with SIGKILL in the
//! middle of a workload and started again, and fed one transaction of a
//! million row changes. These run the real executable in its own process,
//! so a kill loses exactly what a real crash loses and the peak memory read
//! from `/proc/<pid>/status` is the projector's alone.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use chrono::NaiveDate;
use serde_json::Value;
use tokio_postgres::Client;
use tokio_postgres::types::PgLsn;
use vacancy_service::slot;
use vacancy_service::{Lsn, NightCounts};

use crate::api::get;
use crate::projector::{Rows, load_inventory, owner_inventory, run_workload, test_seed};
use crate::support::{TestOwner, wait_for};

/// One running `vacancy serve`, killed on drop so a failed test leaves no process.
pub(crate) struct Serve {
    pub(crate) child: Child,
    pub(crate) addr: std::net::SocketAddr,
    pub(crate) log: std::path::PathBuf,
}

impl Serve {
    pub(crate) fn start(owner_url: &str, dir: &Path, name: &str) -> Serve {
        Self::start_with(owner_url, dir, name, &[])
    }

    /// As `start`, with more `VACANCY_*` settings in the environment.
    pub(crate) fn start_with(
        owner_url: &str,
        dir: &Path,
        name: &str,
        env: &[(&str, &str)],
    ) -> Serve {
        // A free port: bind, read it, let go. The binary binds it a moment later.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port");
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("log file");
        let mut command = Command::new(env!("CARGO_BIN_EXE_vacancy"));
        // The tests' own knobs share the prefix but are not settings, and the
        // binary refuses unknown `VACANCY_*` keys.
        for (key, _) in std::env::vars_os() {
            if key.to_str().is_some_and(|k| k.starts_with("VACANCY_TEST_")) {
                command.env_remove(key);
            }
        }
        let child = command
            .arg("serve")
            .env("VACANCY_OWNER_URL", owner_url)
            .env("VACANCY_LISTEN", addr.to_string())
            .env("VACANCY_STREAM__RECONNECT_MIN_MS", "50")
            .env("VACANCY_STREAM__RECONNECT_MAX_MS", "500")
            .env("VACANCY_STREAM__HEARTBEAT_INTERVAL_MS", "200")
            .env("VACANCY_LOG__FORMAT", "json")
            .envs(env.iter().copied())
            .stdout(Stdio::from(out.try_clone().expect("log file")))
            .stderr(Stdio::from(out))
            .spawn()
            .expect("start the vacancy binary");
        Serve { child, addr, log }
    }

    /// The log so far, for a failure message.
    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    pub(crate) async fn status(&self) -> Option<Value> {
        let addr = self.addr;
        let (code, _, body) = tokio::time::timeout(Duration::from_secs(5), async move {
            tokio::net::TcpStream::connect(addr).await.ok()?;
            Some(get(addr, "/v1/status").await)
        })
        .await
        .ok()??;
        (code == 200)
            .then(|| serde_json::from_str(&body).ok())
            .flatten()
    }

    /// Waits until the copy has loaded and applied everything the owner
    /// committed before `target`.
    pub(crate) async fn caught_up(&self, target: vacancy_service::Lsn, within: Duration) {
        let what = format!("vacancy serve to apply {target}");
        let reached = tokio::time::timeout(
            within,
            wait_for(&what, within, || async {
                let s = self.status().await?;
                let loaded = s["snapshot"]["phase"] == "loaded";
                let applied: vacancy_service::Lsn = s["applied_lsn"].as_str()?.parse().ok()?;
                (loaded && applied >= target).then_some(())
            }),
        )
        .await;
        assert!(
            reached.is_ok(),
            "{what} timed out; log:\n{}",
            self.log_tail()
        );
    }

    /// Bytes from a field of `/proc/<pid>/status` (VmHWM: peak resident).
    fn proc_status_bytes(&self, field: &str) -> u64 {
        let text = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }

    fn kill(&mut self) {
        // SIGKILL: no shutdown hook runs, no final ack is sent.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The copy's rows for `hotels`, read through `/v1/hotels/{id}/calendar`.
async fn copy_rows(serve: &Serve, hotels: &[i64], from: NaiveDate, to: NaiveDate) -> Rows {
    let mut rows = Rows::new();
    for &hotel in hotels {
        let mut start = from;
        while start < to {
            let end = (start + chrono::Days::new(800)).min(to);
            let (code, _, body) = get(
                serve.addr,
                &format!("/v1/hotels/{hotel}/calendar?from={start}&to={end}"),
            )
            .await;
            if code == 404 {
                break;
            }
            assert_eq!(code, 200, "calendar of hotel {hotel}: {body}");
            let v: Value = serde_json::from_str(&body).expect("calendar json");
            for rt in v["room_types"].as_array().expect("room_types") {
                let room_type = rt["room_type_id"].as_i64().expect("room_type_id");
                for n in rt["nights"].as_array().expect("nights") {
                    let night: NaiveDate = n["night"].as_str().unwrap().parse().unwrap();
                    let int = |k: &str| n[k].as_i64().map(|v| v as i32);
                    rows.insert(
                        (hotel, room_type, night),
                        NightCounts {
                            total: int("total").expect("total"),
                            taken: int("taken").expect("taken"),
                            sell_limit: int("sell_limit"),
                            price_cents: int("price_cents"),
                        },
                    );
                }
            }
            start = end;
        }
    }
    rows
}

/// Asserts the binary's copy equals the owner's inventory, row for row.
/// The slot's `confirmed_flush_lsn` once no walsender holds it (the
/// permanent slot survives a stop or a kill; its walsender exits a moment
/// after its client).
pub(crate) async fn released_slot(client: &Client) -> Lsn {
    wait_for(
        "the walsender to let go of the slot",
        Duration::from_secs(30),
        || async {
            let row = client
                .query_one(
                    "SELECT confirmed_flush_lsn, active FROM pg_replication_slots WHERE slot_name = 'vacancy'",
                    &[],
                )
                .await
                .expect("the permanent slot survives a stop");
            (!row.get::<_, bool>(1)).then(|| Lsn::from(row.get::<_, PgLsn>(0)))
        },
    )
    .await
}

pub(crate) async fn assert_binary_converged(serve: &Serve, client: &Client) {
    let target = slot::current_wal_lsn(client).await.expect("current lsn");
    serve.caught_up(target, Duration::from_secs(90)).await;
    let owner = owner_inventory(client).await;
    let hotels: Vec<i64> = client
        .query("SELECT id FROM hotels ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (Some(first), Some(last)) = (
        owner.keys().map(|k| k.2).min(),
        owner.keys().map(|k| k.2).max(),
    ) else {
        panic!("the owner has no inventory");
    };
    let copy = copy_rows(serve, &hotels, first, last + chrono::Days::new(1)).await;
    let differing: Vec<_> = owner
        .iter()
        .filter(|(k, v)| copy.get(*k) != Some(*v))
        .map(|(k, _)| *k)
        .chain(copy.keys().filter(|k| !owner.contains_key(*k)).copied())
        .collect();
    assert!(
        differing.is_empty(),
        "{} rows differ between the binary's copy and the owner at {target}, first {:?}",
        differing.len(),
        &differing[..differing.len().min(5)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_killed_with_sigkill_resumes_and_converges() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let dir = tempfile::tempdir().unwrap();
    let mut serve = Serve::start(&owner.url, dir.path(), "first");
    let target = slot::current_wal_lsn(&client).await.unwrap();
    serve.caught_up(target, Duration::from_secs(60)).await;

    let seed = test_seed();
    // The kill lands while owner clients are writing, with changes in flight.
    let (_, before_kill) = tokio::join!(run_workload(&owner, seed, 3, 40), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let status = serve.status().await;
        serve.kill();
        status
    });
    let before_kill = before_kill.expect("status before the kill");

    // The permanent slot survives the kill. The copy lives in memory only, so
    // the restart drops that slot, takes a new snapshot with a new one, and
    // must converge with what was written around the kill.
    let confirmed = released_slot(&client).await;

    let serve = Serve::start(&owner.url, dir.path(), "second");
    run_workload(&owner, seed ^ 0x5151, 3, 20).await;
    assert_binary_converged(&serve, &client).await;
    let after = serve.status().await.expect("status after restart");
    eprintln!(
        "sigkill: applied {} before the kill, slot confirmed {} at restart, applied {} after",
        before_kill["applied_lsn"], confirmed, after["applied_lsn"]
    );
}

/// One transaction of 1,000,000 row changes reaches the binary's copy whole
/// (streamed in chunks, applied at commit), and the peak memory it took is
/// printed. Compared exactly on every row of a sample of hotels, and in full
/// on the row count. `VACANCY_TEST_BIG_TXN_NIGHTS=500` makes it 5,000,000 (the
/// figure in BENCHMARKS.md; too slow for every CI run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_row_transaction_converges_and_reports_peak_memory() {
    const HOTELS: i64 = 500;
    const ROOM_TYPES: i64 = 20;
    let nights: i64 = std::env::var("VACANCY_TEST_BIG_TXN_NIGHTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|n| (1..=2000).contains(n))
        .unwrap_or(100);
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    client
        .batch_execute(&format!(
            "INSERT INTO hotels (id, name, city) SELECT h, 'Hotel ' || h, 'Lisbon' FROM generate_series(1, {HOTELS}) h;
             INSERT INTO room_types (hotel_id, id, name, max_guests)
               SELECT h, r, 'Room ' || r, 2 FROM generate_series(1, {HOTELS}) h, generate_series(1, {ROOM_TYPES}) r;
             INSERT INTO inventory (hotel_id, room_type_id, night, total, taken, price_cents)
               SELECT h, r, DATE '2030-01-01' + n, 10, 0, 10000
               FROM generate_series(1, {HOTELS}) h, generate_series(1, {ROOM_TYPES}) r, generate_series(0, {nights} - 1) n;"
        ))
        .await
        .expect("load the rows");
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(&owner.url, dir.path(), "million");
    let target = slot::current_wal_lsn(&client).await.unwrap();
    // A debug build loads about 100,000 rows a second here; scale with the data.
    let scale = (nights as u64).div_ceil(100);
    serve
        .caught_up(target, Duration::from_secs(120 * scale))
        .await;
    let loaded_peak = serve.proc_status_bytes("VmHWM:");

    client
        .batch_execute(
            "UPDATE inventory SET taken = (hotel_id + room_type_id + extract(day FROM night)::int) % 7",
        )
        .await
        .expect("one transaction updating every row");
    let target = slot::current_wal_lsn(&client).await.unwrap();
    serve
        .caught_up(target, Duration::from_secs(300 * scale))
        .await;
    let peak = serve.proc_status_bytes("VmHWM:");

    let s = serve.status().await.expect("status");
    let owner_rows: i64 = client
        .query_one("SELECT count(*) FROM inventory", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        s["model"]["inventory_rows"].as_i64(),
        Some(owner_rows),
        "row count"
    );
    // Every row of a spread of hotels, exactly.
    let sample: Vec<i64> = (1..=HOTELS).step_by(25).collect();
    let owner_sample: BTreeMap<_, _> = owner_inventory(&client)
        .await
        .into_iter()
        .filter(|(k, _)| sample.contains(&k.0))
        .collect();
    let first = NaiveDate::from_ymd_opt(2030, 1, 1).unwrap();
    let copy_sample = copy_rows(
        &serve,
        &sample,
        first,
        first + chrono::Days::new(nights as u64),
    )
    .await;
    assert_eq!(copy_sample.len(), owner_sample.len());
    let differing = owner_sample
        .iter()
        .filter(|(k, v)| copy_sample.get(*k) != Some(*v))
        .count();
    assert_eq!(differing, 0, "rows of the sampled hotels differ");
    assert!(
        copy_sample.values().any(|c| c.taken != 0),
        "the update is visible"
    );
    eprintln!(
        "one transaction of {owner_rows} row changes: peak RSS {:.0} MiB after the snapshot, {:.0} MiB after the transaction ({:.0} bytes per changed row)",
        loaded_peak as f64 / 1048576.0,
        peak as f64 / 1048576.0,
        peak.saturating_sub(loaded_peak) as f64 / owner_rows as f64
    );
}

/// A log written to a file or a pipe (a supervisor's, `2>log`) is plain
/// text: terminal colour codes only when stderr is a terminal.
#[tokio::test]
async fn a_log_written_to_a_file_carries_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    // Nobody listens on port 1: the process starts, logs and retries, which
    // is all this test needs of it.
    let serve = Serve::start_with(
        "postgresql://nobody@127.0.0.1:1/none",
        dir.path(),
        "text-log",
        &[("VACANCY_LOG__FORMAT", "text")],
    );
    let log = wait_for(
        "the listening line in the text log",
        Duration::from_secs(30),
        || async {
            let text = std::fs::read_to_string(&serve.log).unwrap_or_default();
            text.contains("listening").then_some(text)
        },
    )
    .await;
    assert!(
        !log.contains('\u{1b}'),
        "the log written to a file carries ANSI escape codes:\n{log}"
    );
}

//! The fleet (issue 22): one `vacancy serve` as projector, replicas with no
//! slot of their own, a real `nats-server` between them (started like the
//! test clusters: a throwaway store, a free port). Nothing about NATS is
//! mocked.
//!
//! What is checked: replicas converge exactly to the owner under the random
//! workload and a transaction large enough to be chunked; the owner sees one
//! walsender and one slot, and a replica starts without copying a row; a replica with no
//! checkpoint to start from waits, not ready; NATS taken away and brought
//! back, and a replica killed and restarted, lose nothing.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tokio_postgres::Client;
use vacancy_lab::nats::NatsServer;

use crate::process::{Serve, assert_binary_converged};
use crate::projector::{confirmed_flush, load_inventory, run_workload, test_seed};
use crate::support::{TestOwner, wait_for};
use vacancy_service::slot;

const QUOTE_KEY: &str = "fleet-test-quote-key-0123456789abcdef";
/// The one line of the token file: booking token and admin token alike.
pub(crate) const TOKEN: &str = "fleet-test-booking-token-0123456789";

/// What every node of the test fleet shares: NATS, the quote key, the
/// booking token (both required outside standalone).
pub(crate) fn fleet_env<'a>(
    role: &'a str,
    nats: &'a str,
    tokens: &'a str,
    extra: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    let mut env = vec![
        ("VACANCY_FLEET__ROLE", role),
        ("VACANCY_FLEET__NATS_URL", nats),
        ("VACANCY_STALE__QUOTE_KEY", QUOTE_KEY),
        ("VACANCY_STALE__BOOKING_TOKENS_FILE", tokens),
        ("VACANCY_FLEET__OWNER_POSITION_INTERVAL_MS", "200"),
        ("VACANCY_ADMIN__TOKENS_FILE", tokens),
    ];
    env.extend_from_slice(extra);
    env
}

pub(crate) struct Fleet {
    pub(crate) owner_url: String,
    pub(crate) nats_url: String,
    dir: tempfile::TempDir,
    pub(crate) tokens: String,
    checkpoints: String,
}

impl Fleet {
    pub(crate) async fn new(owner: &TestOwner, nats: &NatsServer) -> Fleet {
        let dir = tempfile::tempdir().expect("temp dir");
        let tokens = dir.path().join("booking-tokens");
        std::fs::write(&tokens, format!("{TOKEN}\n")).expect("token file");
        let checkpoints = dir.path().join("checkpoints");
        Fleet {
            owner_url: owner.url.clone(),
            nats_url: nats.url(),
            tokens: tokens.to_str().expect("utf-8").to_string(),
            checkpoints: checkpoints.to_str().expect("utf-8").to_string(),
            dir,
        }
    }

    pub(crate) fn logs(&self) -> &Path {
        self.dir.path()
    }

    /// The projector: checkpoints every second (staged in its directory,
    /// then uploaded), messages cut into chunks of at most 4 KiB so that a
    /// modest transaction already travels in many.
    fn projector(&self) -> Serve {
        self.projector_via("projector", &self.owner_url, &self.nats_url)
    }

    /// A projector named `name` (its own checkpoint directory) that reaches
    /// the owner and NATS at these addresses.
    fn projector_via(&self, name: &str, owner_url: &str, nats_url: &str) -> Serve {
        self.projector_with(name, owner_url, nats_url, &[])
    }

    /// As `projector_via`, with more settings.
    pub(crate) fn projector_with(
        &self,
        name: &str,
        owner_url: &str,
        nats_url: &str,
        more: &[(&str, &str)],
    ) -> Serve {
        let checkpoints = format!("{}-{name}", self.checkpoints);
        let mut extra = vec![
            ("VACANCY_CHECKPOINT__DIR", checkpoints.as_str()),
            ("VACANCY_CHECKPOINT__INTERVAL_SECS", "1"),
            ("VACANCY_FLEET__MAX_CHUNK_BYTES", "4096"),
            ("VACANCY_FLEET__PUBLISH_ACK_TIMEOUT_MS", "1000"),
            ("VACANCY_FLEET__REQUEST_TIMEOUT_MS", "1000"),
        ];
        extra.extend_from_slice(more);
        Serve::start_with(
            owner_url,
            self.logs(),
            name,
            &fleet_env("projector", nats_url, &self.tokens, &extra),
        )
    }

    fn replica(&self, name: &str) -> Serve {
        self.replica_with(name, &self.owner_url, &[])
    }

    /// A replica reaching the owner at `owner_url`, with more settings.
    pub(crate) fn replica_with(&self, name: &str, owner_url: &str, more: &[(&str, &str)]) -> Serve {
        let mut extra = vec![
            ("VACANCY_FLEET__REQUEST_TIMEOUT_MS", "1000"),
            // Far below what a dead projector makes it lag: a lag
            // bound would turn the replicas not-ready (see below).
            ("VACANCY_HTTP__READY_MAX_LAG_MS", "200"),
        ];
        extra.extend_from_slice(more);
        Serve::start_with(
            owner_url,
            self.logs(),
            name,
            &fleet_env("replica", &self.nats_url, &self.tokens, &extra),
        )
    }
}

pub(crate) async fn start_nats() -> NatsServer {
    tokio::task::spawn_blocking(NatsServer::start)
        .await
        .expect("nats start task")
        .unwrap_or_else(|e| panic!("cannot start the test nats-server: {e}"))
}

async fn walsenders(client: &Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM pg_stat_replication", &[])
        .await
        .expect("pg_stat_replication")
        .get(0)
}

async fn readyz(serve: &Serve) -> Option<u16> {
    let addr = serve.addr;
    tokio::time::timeout(Duration::from_secs(5), async move {
        tokio::net::TcpStream::connect(addr).await.ok()?;
        Some(crate::api::get(addr, "/readyz").await.0)
    })
    .await
    .ok()
    .flatten()
}

pub(crate) async fn wait_ready(serve: &Serve, within: Duration) {
    let what = format!("{} to be ready", serve.log.display());
    let ready = tokio::time::timeout(
        within,
        wait_for(&what, within, || async {
            (readyz(serve).await == Some(200)).then_some(())
        }),
    )
    .await;
    assert!(ready.is_ok(), "{what}; log:\n{}", serve.log_tail());
}

pub(crate) fn fleet_status(status: &Value) -> &Value {
    &status["fleet"]
}

/// Whether a projector says it holds the slot.
async fn is_active(serve: &Serve) -> bool {
    match serve.status().await {
        Some(status) => fleet_status(&status)["active"] == true,
        None => false,
    }
}

async fn wait_active(serve: &Serve, within: Duration) {
    let what = format!("{} to take the slot", serve.log.display());
    let active = tokio::time::timeout(
        within,
        wait_for(&what, within, || async {
            is_active(serve).await.then_some(())
        }),
    )
    .await;
    assert!(active.is_ok(), "{what}; log:\n{}", serve.log_tail());
}

/// A loopback TCP forwarder that a test can cut (every connection closed,
/// new ones refused) and restore: one process's link to the owner or to
/// NATS, cut while the others keep theirs.
pub(crate) struct Link {
    pub(crate) addr: std::net::SocketAddr,
    open: tokio::sync::watch::Sender<bool>,
}

impl Link {
    pub(crate) async fn to(target: std::net::SocketAddr) -> Link {
        Link::start(target, None).await
    }

    /// As `to`, forwarding each way at about `bytes_per_second`: a
    /// publisher's messages then take seconds to reach NATS (or a
    /// consumer's to reach it), so a test can cut the link in the middle
    /// of them.
    pub(crate) async fn throttled(target: std::net::SocketAddr, bytes_per_second: u64) -> Link {
        Link::start(target, Some(bytes_per_second)).await
    }

    async fn start(target: std::net::SocketAddr, bytes_per_second: Option<u64>) -> Link {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a link port");
        let addr = listener.local_addr().expect("link address");
        let (open, _) = tokio::sync::watch::channel(true);
        let watch = open.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !*watch.borrow() {
                    continue; // dropped: refused
                }
                let mut cut = watch.subscribe();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    let forwarding = async {
                        match bytes_per_second {
                            None => {
                                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound)
                                    .await;
                            }
                            Some(rate) => {
                                let (mut from_client, mut to_client) = inbound.split();
                                let (mut from_target, mut to_target) = outbound.split();
                                tokio::select! {
                                    _ = copy_at(&mut from_client, &mut to_target, rate) => {}
                                    _ = copy_at(&mut from_target, &mut to_client, rate) => {}
                                }
                            }
                        }
                    };
                    tokio::select! {
                        _ = forwarding => {}
                        _ = cut.wait_for(|open| !*open) => {}
                    }
                });
            }
        });
        Link { addr, open }
    }

    pub(crate) fn cut(&self) {
        self.open.send_replace(false);
    }

    pub(crate) fn restore(&self) {
        self.open.send_replace(true);
    }
}

/// Copies `from` to `to` until `from` ends or fails, in blocks of at most
/// 1 KiB, pausing after each so that about `bytes_per_second` go through.
async fn copy_at<R, W>(from: &mut R, to: &mut W, bytes_per_second: u64)
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut block = [0_u8; 1024];
    loop {
        let read = match from.read(&mut block).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if to.write_all(&block[..read]).await.is_err() {
            return;
        }
        let pause = Duration::from_secs_f64(read as f64 / bytes_per_second.max(1) as f64);
        tokio::time::sleep(pause).await;
    }
}

/// Every message of the change stream, in order.
async fn stream_messages(nats_url: &str) -> Vec<vacancy_service::FleetMessage> {
    change_stream(nats_url, |payload| {
        vacancy_service::FleetMessage::decode(payload).expect("decodes")
    })
    .await
}

/// Every message of the change stream, in order, each mapped by `each`
/// from its payload as it is read (so a test that keeps only a message's
/// shape never holds the stream's payloads).
pub(crate) async fn change_stream<T>(nats_url: &str, mut each: impl FnMut(&[u8]) -> T) -> Vec<T> {
    use futures_util::StreamExt;
    let mut stream = change_stream_handle(nats_url).await;
    let last = stream
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence;
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .expect("a consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut all = Vec::new();
    while let Some(next) = tokio::time::timeout(Duration::from_secs(10), messages.next())
        .await
        .expect("the stream's messages within 10 s")
    {
        let message = next.expect("a message");
        let sequence = message.info().expect("info").stream_sequence;
        all.push(each(&message.payload));
        if sequence >= last {
            break;
        }
    }
    all
}

async fn change_stream_handle(nats_url: &str) -> async_nats::jetstream::stream::Stream {
    let client = async_nats::connect(nats_url).await.expect("nats");
    async_nats::jetstream::new(client)
        .get_stream("VACANCY_CHANGES")
        .await
        .expect("the change stream")
}

/// The change stream's last sequence (0 while it is empty).
pub(crate) async fn change_stream_last_sequence(nats_url: &str) -> u64 {
    change_stream_handle(nats_url)
        .await
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_converge_exactly_with_one_walsender_and_no_table_read() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;

    // A replica started before any checkpoint exists waits, not ready.
    let early = fleet.replica("replica-early");
    let waiting = wait_for(
        "the early replica to say what it waits for",
        Duration::from_secs(30),
        || async {
            let status = early.status().await?;
            fleet_status(&status)["replica"]["waiting_for"]
                .as_str()
                .map(str::to_string)
        },
    )
    .await;
    assert!(waiting.contains("first checkpoint"), "{waiting}");
    assert_eq!(readyz(&early).await, Some(503), "ready with no copy");

    let projector = fleet.projector();
    wait_ready(&projector, Duration::from_secs(60)).await;

    // Replicas start while the owner takes writes.
    let seed = test_seed();
    let workload = run_workload(&owner, seed, 3, 60);
    // The late replica makes every shown room type owner-fresh by a
    // confirmed read, as a role that may read the tables and may not write
    // a logical message: a position written rather than read would fail,
    // and the read fall back to the owner's rows.
    client
        .batch_execute(
            "CREATE ROLE reader LOGIN;
             GRANT SELECT ON hotels, room_types, inventory TO reader;
             REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) FROM PUBLIC;
             REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, bytea) FROM PUBLIC;",
        )
        .await
        .expect("a reading role");
    let read_only = owner.url.replacen("postgres@", "reader@", 1);
    let late = fleet.replica_with(
        "replica-late",
        &read_only,
        &[
            ("VACANCY_SEARCH__FRESH_READS", "confirmed"),
            ("VACANCY_SEARCH__FEW_UNITS_THRESHOLD", "1000"),
            ("VACANCY_SEARCH__OWNER_READ_TIMEOUT_MS", "20000"),
            ("VACANCY_SEARCH__HORIZON_DAYS", "5000"),
        ],
    );
    workload.await;
    // One transaction over every inventory row: cut into many chunks.
    client
        .batch_execute("UPDATE inventory SET price_cents = coalesce(price_cents, 0) + 1")
        .await
        .expect("bulk update");
    run_workload(&owner, seed ^ 1, 2, 20).await;

    wait_ready(&early, Duration::from_secs(60)).await;
    wait_ready(&late, Duration::from_secs(60)).await;
    for serve in [&projector, &early, &late] {
        assert_binary_converged(serve, &client).await;
    }

    // A confirmed answer on the late replica: its position was read after
    // the owner's last write (a take on a room type it showed), and the
    // copy applied it.
    let path = "/v1/search?city=Lisbon&check_in=2030-01-02&check_out=2030-01-04&room=1&limit=50";
    let search = || async {
        let (code, _, body) = crate::api::get(late.addr, path).await;
        assert_eq!(code, 200, "{body}");
        serde_json::from_str::<Value>(&body).expect("json")
    };
    // The workload may have filled or moved any hotel: make one sure to be
    // shown (in Lisbon, three units free on both nights), then take one.
    let (hotel, room_type) = (2_i64, 1_i64);
    client
        .batch_execute(
            "UPDATE hotels SET city = 'Lisbon' WHERE id = 2;
             INSERT INTO room_types (hotel_id, id, name, max_guests) VALUES (2, 1, 'Room 1', 2)
               ON CONFLICT (hotel_id, id) DO UPDATE SET max_guests = greatest(room_types.max_guests, 2);
             INSERT INTO inventory (hotel_id, room_type_id, night, total, taken, sell_limit, price_cents)
               SELECT 2, 1, n, 3, 0, NULL, 10000
               FROM unnest(ARRAY[DATE '2030-01-02', DATE '2030-01-03']) n
               ON CONFLICT (hotel_id, room_type_id, night)
               DO UPDATE SET total = greatest(inventory.total, 3), taken = 0, sell_limit = NULL",
        )
        .await
        .expect("a room type sure to be shown");
    // The hotel index follows the copy a moment later (it syncs every
    // 200 ms): wait until the hotel is found in its city again.
    wait_for(
        "hotel 2 shown in Lisbon",
        Duration::from_secs(30),
        || async {
            let (code, _, body) = crate::api::get(late.addr, path).await;
            let answer: Value = serde_json::from_str(&body).ok()?;
            (code == 200
                && answer["results"]
                    .as_array()?
                    .iter()
                    .any(|h| h["hotel_id"] == hotel))
            .then_some(())
        },
    )
    .await;
    client
        .execute(
            "UPDATE inventory SET taken = taken + 1
             WHERE hotel_id = $1 AND room_type_id = $2 AND night = DATE '2030-01-02'",
            &[&hotel, &room_type],
        )
        .await
        .expect("a take");
    let written: vacancy_service::Lsn = slot::current_wal_lsn(&client).await.expect("lsn");
    let answer = search().await;
    let shown: Vec<&Value> = answer["results"]
        .as_array()
        .expect("results")
        .iter()
        .flat_map(|h| h["room_types"].as_array().expect("room types"))
        .collect();
    assert!(!shown.is_empty(), "{answer}");
    assert!(
        shown.iter().all(|t| t["source"] == "confirmed"),
        "every shown room type confirmed, none read from rows: {answer}"
    );
    let confirmed: vacancy_service::Lsn = answer["confirmed_lsn"]
        .as_str()
        .and_then(|l| l.parse().ok())
        .unwrap_or_else(|| panic!("confirmed_lsn in {answer}"));
    assert!(
        confirmed >= written,
        "confirmed at {confirmed}, before the take at {written}: {answer}"
    );
    let owner_free: i32 = client
        .query_one(
            "SELECT min(coalesce(sell_limit, total) - taken) FROM inventory
             WHERE hotel_id = $1 AND room_type_id = $2
               AND night IN (DATE '2030-01-02', DATE '2030-01-03')",
            &[&hotel, &room_type],
        )
        .await
        .expect("owner's free units")
        .get(0);
    let shown_free = answer["results"]
        .as_array()
        .and_then(|r| r.iter().find(|h| h["hotel_id"] == hotel))
        .and_then(|h| {
            h["room_types"]
                .as_array()
                .and_then(|t| t.iter().find(|t| t["room_type_id"] == room_type))
        })
        .map(|t| t["free_units"].clone());
    if owner_free > 0 {
        assert_eq!(shown_free, Some(Value::from(owner_free)), "{answer}");
    } else {
        assert_eq!(shown_free, None, "a full room type is not shown: {answer}");
    }

    // The owner's cost does not grow with replicas: one walsender, one
    // slot, and no row copied to start a replica.
    assert_eq!(walsenders(&client).await, 1, "walsenders with two replicas");
    let slots: i64 = client
        .query_one("SELECT count(*) FROM pg_replication_slots", &[])
        .await
        .expect("slots")
        .get(0);
    assert_eq!(slots, 1, "slots with two replicas");

    // The projector's status shows what JetStream stored; each replica,
    // the checkpoint it started from.
    let status = projector.status().await.expect("projector status");
    let publisher = &fleet_status(&status)["publisher"];
    assert_eq!(publisher["connected"], true, "{status}");
    assert!(
        publisher["stored_sequence"].as_u64().unwrap_or(0) > 10,
        "{status}"
    );
    for replica in [&early, &late] {
        let status = replica.status().await.expect("replica status");
        let progress = &fleet_status(&status)["replica"];
        assert!(
            progress["bootstrapped_from"]
                .as_str()
                .is_some_and(|n| n.starts_with("checkpoint-")),
            "{status}"
        );
        assert_eq!(fleet_status(&status)["role"], "replica");
        assert_eq!(status["snapshot"]["rows_loaded"], 0, "{status}");
        assert_eq!(
            status["slot"]["active"],
            Value::Null,
            "no slot watched: {status}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_down_and_a_replica_killed_lose_nothing() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let mut nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    // An outage longer than the duplicate window: nats-server 2.9 then
    // restarts without the stream's last message id, and a publisher that
    // named the message before each publish by id was refused for good.
    let projector = fleet.projector_with(
        "projector",
        &fleet.owner_url,
        &fleet.nats_url,
        &[("VACANCY_FLEET__DUPLICATE_WINDOW_SECS", "1")],
    );
    wait_ready(&projector, Duration::from_secs(60)).await;
    let mut replica = fleet.replica("replica");
    wait_ready(&replica, Duration::from_secs(60)).await;

    // NATS goes away while the owner takes writes: the projector keeps
    // applying what it can hand over, acknowledges nothing it could not
    // store, and the replica keeps serving its copy.
    let seed = test_seed();
    let confirmed_before = slot_confirmed(&client).await;
    nats.stop();
    run_workload(&owner, seed, 2, 30).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let confirmed_while_down = slot_confirmed(&client).await;
    let status = projector
        .status()
        .await
        .expect("projector status while NATS is down");
    let stored: vacancy_service::Lsn = fleet_status(&status)["publisher"]["stored_lsn"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("stored_lsn");
    assert!(
        confirmed_while_down <= stored,
        "the slot was acknowledged to {confirmed_while_down}, past what JetStream stored ({stored}); before the outage {confirmed_before}"
    );
    assert!(
        replica.status().await.is_some(),
        "the replica stopped answering while NATS was down"
    );

    let nats = tokio::task::spawn_blocking(move || {
        nats.start_again().expect("nats again");
        nats
    })
    .await
    .expect("restart task");
    run_workload(&owner, seed ^ 2, 2, 20).await;
    assert_binary_converged(&replica, &client).await;

    // A replica killed and restarted bootstraps again and converges.
    drop(replica);
    run_workload(&owner, seed ^ 3, 2, 20).await;
    replica = fleet.replica("replica-again");
    wait_ready(&replica, Duration::from_secs(60)).await;
    run_workload(&owner, seed ^ 4, 2, 10).await;
    assert_binary_converged(&replica, &client).await;
    assert_binary_converged(&projector, &client).await;
    drop(nats);
}

/// The change stream deleted (an operator, a NATS that lost its store) and
/// made again by the projector: its sequences start over. The replica that
/// was following it, and one started after, both bootstrap from a
/// checkpoint of the new stream and converge. Before, the first waited at
/// its old sequence, ready, to apply the new stream's messages from there,
/// and the second loaded a checkpoint of the old stream and did the same:
/// every change in between missed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_stream_made_again_is_followed_from_a_new_checkpoint() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    let projector = fleet.projector();
    wait_ready(&projector, Duration::from_secs(60)).await;
    let replica = fleet.replica("replica");
    wait_ready(&replica, Duration::from_secs(60)).await;
    // Many messages in the old stream, so its sequences stay ahead of the
    // new one's for the rest of the test.
    let seed = test_seed();
    run_workload(&owner, seed, 2, 100).await;
    assert_binary_converged(&replica, &client).await;
    let old_end = change_stream_last_sequence(&fleet.nats_url).await;
    async_nats::jetstream::new(async_nats::connect(&fleet.nats_url).await.expect("nats"))
        .delete_stream("VACANCY_CHANGES")
        .await
        .expect("delete the change stream");
    run_workload(&owner, seed ^ 5, 2, 10).await;
    assert_binary_converged(&replica, &client).await;
    let late = fleet.replica("late");
    wait_ready(&late, Duration::from_secs(90)).await;
    run_workload(&owner, seed ^ 6, 2, 5).await;
    assert_binary_converged(&late, &client).await;
    assert_binary_converged(&replica, &client).await;
    let new_end = change_stream_last_sequence(&fleet.nats_url).await;
    assert!(
        new_end < old_end,
        "the new stream ({new_end}) stayed below the old one's end ({old_end})"
    );
    drop(nats);
}

/// The change stream deleted and made again, then grown past the sequence
/// of the old stream's newest checkpoint before the projector writes one of
/// the new stream: a replica starting then waits for a checkpoint of the
/// new stream and converges from it. Before, the old checkpoint's sequence
/// lay within the new stream's end, so the replica loaded it, resumed in
/// the new stream there and missed every change in between, ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_a_stream_made_again_is_not_resumed_in_the_new_one() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    // The checkpoint written soon after the snapshot, then none for the
    // test's length unless asked for.
    let projector = fleet.projector_with(
        "projector",
        &fleet.owner_url,
        &fleet.nats_url,
        &[
            ("VACANCY_CHECKPOINT__INTERVAL_SECS", "600"),
            ("VACANCY_FLEET__MAX_AGE_SECS", "1200"),
        ],
    );
    wait_ready(&projector, Duration::from_secs(60)).await;
    let old_checkpoint = wait_for(
        "the checkpoint after the snapshot to be uploaded",
        Duration::from_secs(60),
        || newest_checkpoint_lsn(&fleet.nats_url),
    )
    .await;
    let old_end = change_stream_last_sequence(&fleet.nats_url).await;
    async_nats::jetstream::new(async_nats::connect(&fleet.nats_url).await.expect("nats"))
        .delete_stream("VACANCY_CHANGES")
        .await
        .expect("delete the change stream");
    run_workload(&owner, test_seed(), 2, 10).await;
    // The projector makes the stream again at its next publish, and the
    // new stream grows past the old one's end, where the old checkpoint's
    // sequence lies.
    wait_for(
        "the new stream to grow past the old one's end",
        Duration::from_secs(60),
        || async {
            let client = async_nats::connect(&fleet.nats_url).await.ok()?;
            let mut stream = async_nats::jetstream::new(client)
                .get_stream("VACANCY_CHANGES")
                .await
                .ok()?;
            let last = stream.info().await.ok()?.state.last_sequence;
            (last > old_end).then_some(())
        },
    )
    .await;
    assert_eq!(
        newest_checkpoint_lsn(&fleet.nats_url).await,
        Some(old_checkpoint),
        "no checkpoint of the new stream yet"
    );

    let late = fleet.replica("late");
    let waiting = wait_for(
        "the late replica to say what it waits for",
        Duration::from_secs(30),
        || async {
            let status = late.status().await?;
            fleet_status(&status)["replica"]["waiting_for"]
                .as_str()
                .map(str::to_string)
        },
    )
    .await;
    assert!(waiting.contains("since made again"), "{waiting}");
    assert_eq!(
        readyz(&late).await,
        Some(503),
        "ready on the old stream's checkpoint"
    );

    // A checkpoint of the new stream (the operator's resnapshot writes one
    // soon after its snapshot) lets it start.
    ask_resnapshot(&projector).await;
    wait_ready(&late, Duration::from_secs(90)).await;
    run_workload(&owner, test_seed() ^ 3, 2, 5).await;
    assert_binary_converged(&late, &client).await;
    drop(nats);
}

/// The change stream deleted and made again while a replica is cut off
/// from NATS, then grown past the replica's position before it is back:
/// the replica sees that the stream is another one (its identity, not its
/// sequences, which pass) and bootstraps from a checkpoint of the new one.
/// Before, it resumed at its old sequence in the new stream, ready, and
/// missed every change the new stream held before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_away_while_the_stream_is_made_again_does_not_resume_in_it() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    let projector = fleet.projector();
    wait_ready(&projector, Duration::from_secs(60)).await;
    let link = Link::to(([127, 0, 0, 1], nats.port()).into()).await;
    let via = format!("nats://{}", link.addr);
    let replica = Serve::start_with(
        &fleet.owner_url,
        fleet.logs(),
        "replica",
        &fleet_env(
            "replica",
            &via,
            &fleet.tokens,
            &[
                ("VACANCY_FLEET__REQUEST_TIMEOUT_MS", "1000"),
                ("VACANCY_HTTP__READY_MAX_LAG_MS", "200"),
            ],
        ),
    );
    wait_ready(&replica, Duration::from_secs(60)).await;
    let seed = test_seed();
    run_workload(&owner, seed, 2, 5).await;
    assert_binary_converged(&replica, &client).await;
    let old_end = change_stream_last_sequence(&fleet.nats_url).await;

    link.cut();
    async_nats::jetstream::new(async_nats::connect(&fleet.nats_url).await.expect("nats"))
        .delete_stream("VACANCY_CHANGES")
        .await
        .expect("delete the change stream");
    // The new stream grows well past the old one's end, where the replica
    // would resume.
    let mut round: u64 = 0;
    wait_for(
        "the new stream to grow past the old one's end",
        Duration::from_secs(120),
        || {
            round += 1;
            let owner = &owner;
            let nats_url = fleet.nats_url.clone();
            async move {
                run_workload(owner, seed ^ round, 2, 20).await;
                let client = async_nats::connect(&nats_url).await.ok()?;
                let mut stream = async_nats::jetstream::new(client)
                    .get_stream("VACANCY_CHANGES")
                    .await
                    .ok()?;
                let last = stream.info().await.ok()?.state.last_sequence;
                (last > old_end + 10).then_some(())
            }
        },
    )
    .await;
    // The projector checkpoints every second: the replica finds one of the
    // new stream to bootstrap from.
    link.restore();
    run_workload(&owner, seed ^ 99, 2, 5).await;
    assert_binary_converged(&replica, &client).await;
    drop(nats);
}

pub(crate) async fn slot_confirmed(client: &Client) -> vacancy_service::Lsn {
    let row = client
        .query_one(
            "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'vacancy'",
            &[],
        )
        .await
        .expect("the slot");
    vacancy_service::Lsn::from(row.get::<_, tokio_postgres::types::PgLsn>(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_when_the_active_projector_is_killed() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    let first = fleet.projector_via("projector-a", &fleet.owner_url, &fleet.nats_url);
    wait_active(&first, Duration::from_secs(60)).await;
    wait_ready(&first, Duration::from_secs(60)).await;
    let second = fleet.projector_via("projector-b", &fleet.owner_url, &fleet.nats_url);
    let replica = fleet.replica("replica");
    wait_ready(&replica, Duration::from_secs(60)).await;
    let seed = test_seed();
    run_workload(&owner, seed, 2, 30).await;
    // The standby follows the stream: its copy is the owner's too.
    assert_binary_converged(&second, &client).await;
    assert!(
        !is_active(&second).await,
        "two active projectors; the second's log:\n{}\nthe first's:\n{}",
        second.log_tail(),
        first.log_tail()
    );
    // Standing by, it writes no checkpoint (one of a follower's copy would
    // be uploaded beside the active projector's).
    let standby_checkpoints = std::fs::read_dir(format!("{}-projector-b", fleet.checkpoints))
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter(|e| e.path().extension().is_some_and(|x| x == "vcp"))
                .count()
        })
        .unwrap_or(0);
    assert_eq!(standby_checkpoints, 0, "the standby wrote checkpoints");

    // SIGKILL the active one while the owner takes writes.
    drop(first);
    let writes = run_workload(&owner, seed ^ 1, 2, 30);
    let takeover = wait_active(&second, Duration::from_secs(60));
    tokio::join!(writes, takeover);
    run_workload(&owner, seed ^ 2, 2, 20).await;
    assert_binary_converged(&replica, &client).await;
    assert_binary_converged(&second, &client).await;
    assert_eq!(walsenders(&client).await, 1);
}

/// A projector that lost the slot (its owner path went away while
/// another took over) stands by, and when the other one dies it takes the
/// slot back and publishes again, its process running on. Before, its
/// publisher found the other projector's takeover marker after its own
/// (stored in its first activation) and stopped the process, leaving the
/// fleet without a projector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projector_that_lost_the_slot_takes_it_back_and_publishes() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    let owner_link = Link::to(([127, 0, 0, 1], owner.cluster.port()).into()).await;
    let owner_via = owner.url.replace(
        &format!(":{}/", owner.cluster.port()),
        &format!(":{}/", owner_link.addr.port()),
    );
    let mut first = fleet.projector_via("projector-a", &owner_via, &fleet.nats_url);
    wait_active(&first, Duration::from_secs(60)).await;
    wait_ready(&first, Duration::from_secs(60)).await;
    let second = fleet.projector_via("projector-b", &fleet.owner_url, &fleet.nats_url);
    let replica = fleet.replica("replica");
    wait_ready(&replica, Duration::from_secs(60)).await;
    let seed = test_seed();
    run_workload(&owner, seed, 2, 10).await;
    assert_binary_converged(&replica, &client).await;

    // The first loses the owner; the second takes the slot over.
    owner_link.cut();
    wait_active(&second, Duration::from_secs(60)).await;
    run_workload(&owner, seed ^ 1, 2, 10).await;
    assert_binary_converged(&replica, &client).await;
    // Back on the owner, the first finds the slot taken and stands by.
    owner_link.restore();
    wait_for(
        "the first projector to stand by",
        Duration::from_secs(60),
        || async { (!is_active(&first).await).then_some(()) },
    )
    .await;
    run_workload(&owner, seed ^ 2, 2, 10).await;
    assert_binary_converged(&first, &client).await;

    // The second dies: the first takes the slot back and publishes.
    drop(second);
    wait_active(&first, Duration::from_secs(60)).await;
    run_workload(&owner, seed ^ 3, 2, 20).await;
    assert_binary_converged(&replica, &client).await;
    assert!(
        first.child.try_wait().expect("wait on the child").is_none(),
        "the projector stopped; its log:\n{}",
        first.log_tail()
    );
    assert_eq!(walsenders(&client).await, 1);
    drop(nats);
}

/// A slot is not active while its creator loads the snapshot (PostgreSQL
/// releases it at creation until `START_REPLICATION`): the creator's
/// session lock is what says the slot is taken. Here a session holds that
/// lock over an inactive slot, as a projector mid-snapshot does: a second
/// projector must neither start from the slot nor drop it, and takes it
/// over once the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_whose_creator_loads_the_snapshot_is_not_taken_over() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    crate::support::create_publication(&client).await;
    let snapshotting = owner.client().await;
    snapshotting
        .batch_execute(
            "SELECT pg_create_logical_replication_slot('vacancy', 'pgoutput');
             SELECT pg_advisory_lock(hashtextextended('vacancy.slot:' || 'vacancy', 0));",
        )
        .await
        .unwrap();
    let created = confirmed_flush(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    let projector = fleet.projector();
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        !is_active(&projector).await,
        "took a slot whose creator holds it; log:\n{}",
        projector.log_tail()
    );
    assert_eq!(
        confirmed_flush(&client).await,
        created,
        "the slot was dropped or made again; log:\n{}",
        projector.log_tail()
    );

    drop(snapshotting);
    wait_active(&projector, Duration::from_secs(60)).await;
    wait_ready(&projector, Duration::from_secs(60)).await;
    run_workload(&owner, test_seed(), 2, 20).await;
    assert_binary_converged(&projector, &client).await;
}

/// A projector stopped with SIGTERM uploads the checkpoint it writes at
/// shutdown: the bucket's newest then holds everything it applied, so a
/// replica or a standby starting next starts from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projector_stopped_uploads_its_last_checkpoint() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    // Checkpoints every hour: only the first and the one at shutdown.
    let projector = fleet.projector_with(
        "projector",
        &fleet.owner_url,
        &fleet.nats_url,
        &[
            ("VACANCY_CHECKPOINT__INTERVAL_SECS", "3600"),
            ("VACANCY_FLEET__MAX_AGE_SECS", "7200"),
        ],
    );
    wait_ready(&projector, Duration::from_secs(60)).await;
    let first = wait_for("the first upload", Duration::from_secs(30), || async {
        newest_checkpoint_lsn(&fleet.nats_url).await
    })
    .await;
    run_workload(&owner, test_seed(), 2, 20).await;
    let written = slot::current_wal_lsn(&client).await.expect("lsn");
    projector.caught_up(written, Duration::from_secs(30)).await;
    assert!(
        first < written,
        "the first checkpoint ({first}) is older than the writes ({written})"
    );
    let pid = projector.child.id().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("run kill");
    assert!(sent.success());
    let last = wait_for(
        "the checkpoint written at shutdown in the bucket",
        Duration::from_secs(30),
        || async {
            newest_checkpoint_lsn(&fleet.nats_url)
                .await
                .filter(|lsn| *lsn >= written)
        },
    )
    .await;
    assert!(last >= written, "{last} < {written}");
    drop(projector);
}

/// The LSN of the newest checkpoint in the bucket, from its object name
/// (`checkpoint-<epoch>-<lsn>-<sequence>.vcp`, hex LSN).
async fn newest_checkpoint_lsn(nats_url: &str) -> Option<vacancy_service::Lsn> {
    // A listing can hang while objects are deleted under it (the uploader
    // prunes): bounded, so the caller's wait asks again.
    tokio::time::timeout(Duration::from_secs(5), list_newest_checkpoint_lsn(nats_url))
        .await
        .ok()
        .flatten()
}

async fn list_newest_checkpoint_lsn(nats_url: &str) -> Option<vacancy_service::Lsn> {
    use futures_util::StreamExt;
    let client = async_nats::connect(nats_url).await.ok()?;
    let jetstream = async_nats::jetstream::new(client);
    let store = jetstream
        .get_object_store("vacancy-checkpoints")
        .await
        .ok()?;
    let mut list = store.list().await.ok()?;
    let mut newest = None;
    while let Some(Ok(info)) = list.next().await {
        if info.deleted {
            continue;
        }
        let lsn = info
            .name
            .strip_prefix("checkpoint-")
            .and_then(|rest| rest.split('-').nth(1))
            .and_then(|hex| u64::from_str_radix(hex, 16).ok())
            .map(vacancy_service::Lsn);
        newest = newest.max(lsn);
    }
    newest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projector_cut_off_from_the_owner_is_fenced_after_the_takeover() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    // The first projector reaches the owner and NATS through links the
    // test can cut.
    let owner_link = Link::to(([127, 0, 0, 1], owner.cluster.port()).into()).await;
    let nats_link = Link::to(([127, 0, 0, 1], nats.port()).into()).await;
    let owner_via = owner.url.replace(
        &format!(":{}/", owner.cluster.port()),
        &format!(":{}/", owner_link.addr.port()),
    );
    let nats_via = format!("nats://{}", nats_link.addr);
    let first = fleet.projector_via("projector-a", &owner_via, &nats_via);
    wait_active(&first, Duration::from_secs(60)).await;
    wait_ready(&first, Duration::from_secs(60)).await;
    let second = fleet.projector_via("projector-b", &fleet.owner_url, &fleet.nats_url);
    let replica = fleet.replica("replica");
    wait_ready(&replica, Duration::from_secs(60)).await;

    // NATS goes away for the active projector: it applies writes it
    // cannot publish. Then the owner goes away for it too: the standby
    // takes the slot and publishes those writes itself, from the WAL.
    let seed = test_seed();
    nats_link.cut();
    run_workload(&owner, seed, 2, 20).await;
    // Applied by the first projector, not published.
    let written = slot::current_wal_lsn(&client)
        .await
        .expect("owner position");
    first.caught_up(written, Duration::from_secs(60)).await;
    owner_link.cut();
    wait_active(&second, Duration::from_secs(60)).await;
    run_workload(&owner, seed ^ 1, 2, 20).await;
    assert_binary_converged(&replica, &client).await;

    // NATS comes back for the old projector, whose writes still wait to
    // be published: it finds the takeover and stops, publishing nothing.
    nats_link.restore();
    let mut first = first;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let exited = loop {
        if let Some(status) = first.child.try_wait().expect("wait on the child") {
            break status;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the fenced projector did not stop; status {:?}; its log:\n{}",
            first.status().await.map(|s| (
                s["fleet"].clone(),
                s["applied_lsn"].clone(),
                s["last_error"].clone()
            )),
            std::fs::read_to_string(&first.log)
                .unwrap_or_default()
                .lines()
                .filter(|l| !l.contains("async_nats") && !l.contains("replication session ended"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let log = std::fs::read_to_string(&first.log).unwrap_or_default();
    assert!(
        log.contains("fenced"),
        "exit {exited}; log:\n{}",
        first.log_tail()
    );

    // In the stream, nothing of the first projector comes after the
    // second one's takeover marker.
    let messages = stream_messages(&fleet.nats_url).await;
    let markers: Vec<(usize, u64)> = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| matches!(m.body, vacancy_service::FleetBody::Takeover { .. }))
        .map(|(i, m)| (i, m.holder))
        .collect();
    assert_eq!(
        markers.len(),
        2,
        "one marker per projector that published: {markers:?}"
    );
    let (takeover_at, second_holder) = markers[1];
    let first_holder = markers[0].1;
    assert_ne!(first_holder, second_holder);
    let late: Vec<_> = messages[takeover_at..]
        .iter()
        .filter(|m| m.holder == first_holder)
        .map(|m| m.position)
        .collect();
    assert!(
        late.is_empty(),
        "the fenced projector published after the takeover: {late:?}"
    );
    run_workload(&owner, seed ^ 2, 2, 10).await;
    assert_binary_converged(&replica, &client).await;
    assert_binary_converged(&second, &client).await;
    drop(nats);
}

/// `POST /v1/admin/resnapshot` with the test's admin token.
async fn ask_resnapshot(serve: &Serve) {
    let client = vacancy_lab::http_client::HttpClient::new(serve.addr, Duration::from_secs(10))
        .expect("http client");
    let accepted = client
        .post_json("/v1/admin/resnapshot", Some(TOKEN), "")
        .await
        .expect("POST /v1/admin/resnapshot");
    assert_eq!(accepted.status, 202, "{}", accepted.text());
}

async fn replica_progress(serve: &Serve) -> Option<(u64, u64)> {
    let status = serve.status().await?;
    let progress = &fleet_status(&status)["replica"];
    Some((
        progress["epoch"].as_u64()?,
        progress["bootstraps"].as_u64()?,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_epoch_and_an_operators_ask_bootstrap_a_replica_again() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    // The stream keeps 3 s of messages (two checkpoints a second apart fit).
    let projector = fleet.projector_with(
        "projector",
        &fleet.owner_url,
        &fleet.nats_url,
        &[
            ("VACANCY_FLEET__MAX_AGE_SECS", "3"),
            ("VACANCY_FLEET__DUPLICATE_WINDOW_SECS", "1"),
        ],
    );
    wait_ready(&projector, Duration::from_secs(60)).await;
    // The replica reaches NATS and the owner through links the test can
    // cut.
    let nats_link = Link::to(([127, 0, 0, 1], nats.port()).into()).await;
    let owner_link = Link::to(([127, 0, 0, 1], owner.cluster.port()).into()).await;
    let owner_via = owner.url.replace(
        &format!(":{}/", owner.cluster.port()),
        &format!(":{}/", owner_link.addr.port()),
    );
    let replica = Serve::start_with(
        &owner_via,
        fleet.logs(),
        "replica",
        &fleet_env(
            "replica",
            &format!("nats://{}", nats_link.addr),
            &fleet.tokens,
            &[
                ("VACANCY_FLEET__REQUEST_TIMEOUT_MS", "1000"),
                ("VACANCY_SEARCH__HORIZON_DAYS", "5000"),
            ],
        ),
    );
    wait_ready(&replica, Duration::from_secs(60)).await;
    let seed = test_seed();
    run_workload(&owner, seed, 2, 20).await;
    let (first_epoch, _) = replica_progress(&replica).await.expect("progress");

    // The projector takes a new snapshot: a new epoch. The replica never
    // applies its messages to the old copy; it bootstraps from the new
    // epoch's first checkpoint.
    ask_resnapshot(&projector).await;
    let (second_epoch, boots) = wait_for(
        "the replica to bootstrap into the new epoch",
        Duration::from_secs(60),
        || async {
            let (epoch, boots) = replica_progress(&replica).await?;
            (epoch != first_epoch).then_some((epoch, boots))
        },
    )
    .await;
    assert!(
        second_epoch > first_epoch,
        "epochs go up: {first_epoch} then {second_epoch}"
    );
    run_workload(&owner, seed ^ 1, 2, 20).await;
    assert_binary_converged(&replica, &client).await;

    // An operator asks the replica itself: it bootstraps again. With its
    // owner link cut, that bootstrap cannot finish (it checks the
    // checkpoint against the owner's identity): meanwhile the old copy
    // serves, and says it is stale.
    let stale_of = |path: &'static str| {
        let addr = replica.addr;
        async move {
            let (code, _, body) = crate::api::get(addr, path).await;
            (code == 200)
                .then(|| serde_json::from_str::<Value>(&body).ok())
                .flatten()
                .and_then(|v| v["stale"].as_bool())
        }
    };
    const SEARCH: &str = "/v1/search?city=Lisbon&check_in=2030-01-02&check_out=2030-01-04&room=1";
    const AVAILABILITY: &str =
        "/v1/hotels/2/availability?check_in=2030-01-02&check_out=2030-01-04&room=1";
    assert_eq!(stale_of(SEARCH).await, Some(false), "before the ask");
    assert_eq!(stale_of(AVAILABILITY).await, Some(false), "before the ask");
    owner_link.cut();
    ask_resnapshot(&replica).await;
    wait_for(
        "answers marked stale while the bootstrap waits",
        Duration::from_secs(30),
        || async { (stale_of(SEARCH).await == Some(true)).then_some(()) },
    )
    .await;
    assert_eq!(stale_of(AVAILABILITY).await, Some(true));
    owner_link.restore();
    wait_for("the asked bootstrap", Duration::from_secs(60), || async {
        let (_, now) = replica_progress(&replica).await?;
        (now > boots).then_some(())
    })
    .await;
    assert_eq!(stale_of(SEARCH).await, Some(false), "the new copy is in");
    run_workload(&owner, seed ^ 2, 2, 10).await;
    assert_binary_converged(&replica, &client).await;

    // Cut off from NATS for longer than the stream keeps messages: its
    // position is gone from the stream when the link is back, and it
    // bootstraps again from a newer checkpoint rather than skip the gap.
    let (_, before_cut) = replica_progress(&replica).await.expect("progress");
    nats_link.cut();
    run_workload(&owner, seed ^ 3, 2, 20).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    nats_link.restore();
    wait_for(
        "the replica to bootstrap past the retention gap",
        Duration::from_secs(60),
        || async {
            let (_, now) = replica_progress(&replica).await?;
            (now > before_cut).then_some(())
        },
    )
    .await;
    assert_binary_converged(&replica, &client).await;
    drop(nats);
}

/// A transaction the change stream holds only in part (a chunk missing
/// before its commit marker) is never skipped: the replica applies nothing
/// past it and bootstraps again instead of reading on. No publisher of
/// this build writes such a stream (JetStream stores a publisher's messages
/// in order, and what was not acknowledged is sent again); the test writes
/// it by hand, as a faulty publisher would. Before, the replica refused the
/// marker, reconnected, took the marker delivered again for a repeat, and
/// applied the next transaction: a missed change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_never_applies_past_a_transaction_the_stream_holds_in_part() {
    use vacancy_service::{FleetBody, FleetMessage};
    // The owner is held (not in `..`) so it runs to the end of the test.
    let ChunkedFleet {
        _owner,
        nats,
        fleet,
        replica,
        published,
        chunk,
    } = ChunkedFleet::start().await;
    let marker = published
        .iter()
        .rev()
        .find(|m| matches!(m.body, FleetBody::Commit { chunks, .. } if chunks > 0))
        .expect("a commit marker on the stream")
        .clone();
    let end = published
        .iter()
        .map(|m| m.position.lsn)
        .max()
        .expect("messages");
    // At `incomplete`: chunks 0 and 2 of three, then the marker naming
    // three. At `whole`: a transaction in one message.
    let incomplete = end + 0x1000;
    let whole = incomplete + 0x1000;
    let mut written: Vec<FleetMessage> = Vec::new();
    for seq in [0, 2] {
        let mut m = chunk.clone();
        m.position.lsn = incomplete;
        m.position.seq = seq;
        m.body = FleetBody::Chunk {
            changes: Vec::new(),
        };
        written.push(m);
    }
    for (lsn, named) in [(incomplete, 3), (whole, 0)] {
        let mut m = marker.clone();
        m.position.lsn = lsn;
        if let FleetBody::Commit {
            chunks,
            commit_lsn,
            changes,
            ..
        } = &mut m.body
        {
            *chunks = named;
            *commit_lsn = lsn - 0x10;
            changes.clear();
        }
        written.push(m);
    }
    let jetstream =
        async_nats::jetstream::new(async_nats::connect(&fleet.nats_url).await.expect("nats"));
    for m in written {
        jetstream
            .publish("vacancy.changes", m.encode().into())
            .await
            .expect("publish")
            .await
            .expect("stored");
    }

    // The replica meets the incomplete transaction (and says so in its
    // status); from then on it never applies past it, whatever follows.
    wait_for(
        "the replica to refuse the incomplete transaction",
        Duration::from_secs(30),
        || async {
            let status = replica.status().await?;
            status["last_error"]
                .as_str()?
                .contains("it names 3")
                .then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let status = replica.status().await.expect("the replica's status");
    let applied: vacancy_service::Lsn = status["applied_lsn"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("applied_lsn");
    assert!(
        applied.0 < incomplete,
        "the replica applied to {applied}, past the incomplete transaction at {incomplete:#X}"
    );
    let log = std::fs::read_to_string(&replica.log).expect("the replica's log");
    assert!(
        log.contains("a chunked transaction is incomplete on the stream; bootstrapping again"),
        "the replica bootstraps again rather than read on"
    );
    drop(nats);
}

/// A first chunk of an older epoch is dropped, and it must not mark where a
/// held transaction begins: before, it did, and the next session (after
/// NATS went away and came back) read the stream again from that chunk,
/// which after a few such sessions made the replica bootstrap for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_chunk_of_an_older_epoch_is_not_read_again_after_a_reconnect() {
    use vacancy_service::{FleetBody, FleetMessage};
    let ChunkedFleet {
        _owner,
        mut nats,
        fleet,
        replica,
        chunk,
        ..
    } = ChunkedFleet::start().await;
    let older = |seq: u32| -> FleetMessage {
        let mut m = chunk.clone();
        m.position.epoch -= 1;
        m.position.seq = seq;
        m.body = FleetBody::Chunk {
            changes: Vec::new(),
        };
        m
    };
    let first = publish_raw(&fleet.nats_url, older(0)).await;
    wait_for(
        "the replica to read the older epoch's first chunk",
        Duration::from_secs(30),
        || async { (replica_next_sequence(&replica).await? > first).then_some(()) },
    )
    .await;

    // NATS goes away and comes back: the replica's session ends, and the
    // next one starts where the stream was read to.
    nats.stop();
    wait_for(
        "the replica's session to end",
        Duration::from_secs(30),
        || async {
            let log = std::fs::read_to_string(&replica.log).ok()?;
            log.contains("replica session ended; reconnecting")
                .then_some(())
        },
    )
    .await;
    let nats = tokio::task::spawn_blocking(move || {
        nats.start_again().expect("nats again");
        nats
    })
    .await
    .expect("restart task");
    // Read once the new session is in: a later message of the same epoch.
    let second = publish_raw(&fleet.nats_url, older(1)).await;
    wait_for(
        "the replica's next session to read on",
        Duration::from_secs(60),
        || async { (replica_next_sequence(&replica).await? > second).then_some(()) },
    )
    .await;
    let log = std::fs::read_to_string(&replica.log).expect("the replica's log");
    assert!(
        !log.contains("reading the chunked transaction a session ended inside again"),
        "the next session read the stream again from a chunk the replica had dropped"
    );
    drop(nats);
}

/// A projector whose copy is of an older epoch than the change stream
/// holds takes a new snapshot stamped above the stream's epoch, and the
/// replicas follow it. The stream is given a newer epoch here by hand, as
/// the copy of an owner whose positions went back since would have left it
/// (a restored owner, or a standby promoted behind the old copy, with the
/// projector started afresh). Before, its publisher refused every message
/// of the older copy, for good: the replicas waited for a checkpoint of
/// the newer epoch that never came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projector_behind_the_streams_epoch_snapshots_above_it_and_replicas_follow() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    let projector = fleet.projector();
    let replica = fleet.replica("replica");
    run_workload(&owner, test_seed(), 2, 10).await;
    wait_ready(&projector, Duration::from_secs(60)).await;
    wait_ready(&replica, Duration::from_secs(60)).await;
    assert_binary_converged(&replica, &client).await;

    // The projector stops; the stream then ends with a newer epoch.
    let mut projector = projector;
    crate::shutdown::sigterm(&projector);
    wait_for("the projector to exit", Duration::from_secs(30), || {
        let exited = projector.child.try_wait().expect("wait on the projector");
        async move { exited }
    })
    .await;
    let mut newer = stream_messages(&fleet.nats_url)
        .await
        .pop()
        .expect("the stream holds the projector's messages");
    let old_epoch = newer.position.epoch;
    newer.position.epoch = old_epoch + (1 << 32);
    newer.body = vacancy_service::FleetBody::Advance;
    let stream_epoch = newer.position.epoch;
    publish_raw(&fleet.nats_url, newer).await;

    // Started again from its own checkpoint, of the older epoch, while the
    // owner writes on.
    let projector = fleet.projector();
    run_workload(&owner, test_seed() ^ 0xe90c, 2, 10).await;
    assert_binary_converged(&replica, &client).await;
    let status = replica.status().await.expect("the replica's status");
    let replica_epoch = fleet_status(&status)["replica"]["epoch"]
        .as_u64()
        .expect("the replica's epoch");
    assert!(
        replica_epoch > stream_epoch,
        "the replica follows a copy stamped above the stream's epoch {stream_epoch:x} (it was at {old_epoch:x}): {replica_epoch:x}"
    );
    let log = std::fs::read_to_string(&projector.log).expect("the projector's log");
    assert!(
        log.contains(
            "the change stream holds a newer epoch than this copy: taking a new snapshot above it"
        ),
        "the projector said why it took a new snapshot"
    );
}

/// Stores one message on the change stream as a publisher would; returns
/// its stream sequence.
async fn publish_raw(nats_url: &str, message: vacancy_service::FleetMessage) -> u64 {
    let jetstream = async_nats::jetstream::new(async_nats::connect(nats_url).await.expect("nats"));
    jetstream
        .publish("vacancy.changes", message.encode().into())
        .await
        .expect("publish")
        .await
        .expect("stored")
        .sequence
}

/// The change stream's next sequence a replica will apply.
async fn replica_next_sequence(serve: &Serve) -> Option<u64> {
    let status = serve.status().await?;
    fleet_status(&status)["replica"]["next_sequence"].as_u64()
}

/// A projector and a replica after one chunked owner transaction, the
/// projector stopped (nothing else publishes from then on), and what the
/// stream holds: for tests that write more to it as a faulty or older
/// publisher would.
struct ChunkedFleet {
    _owner: TestOwner,
    nats: NatsServer,
    fleet: Fleet,
    replica: Serve,
    published: Vec<vacancy_service::FleetMessage>,
    /// The last chunk on the stream, to write more like.
    chunk: vacancy_service::FleetMessage,
}

impl ChunkedFleet {
    async fn start() -> ChunkedFleet {
        let owner = TestOwner::start().await;
        let client = owner.client().await;
        load_inventory(&client).await;
        let nats = start_nats().await;
        let fleet = Fleet::new(&owner, &nats).await;
        let projector = fleet.projector();
        wait_ready(&projector, Duration::from_secs(60)).await;
        let replica = fleet.replica("replica");
        wait_ready(&replica, Duration::from_secs(60)).await;
        // Large enough to be chunked.
        client
            .batch_execute("UPDATE inventory SET price_cents = price_cents + 1")
            .await
            .expect("a large owner transaction");
        assert_binary_converged(&replica, &client).await;
        drop(projector);
        let published = stream_messages(&fleet.nats_url).await;
        let chunk = published
            .iter()
            .rev()
            .find(|m| matches!(m.body, vacancy_service::FleetBody::Chunk { .. }))
            .expect("a chunk on the stream")
            .clone();
        ChunkedFleet {
            _owner: owner,
            nats,
            fleet,
            replica,
            published,
            chunk,
        }
    }
}

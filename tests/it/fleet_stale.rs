//! One stale-read loop for the whole fleet (issue 23): take outcomes posted
//! to any node go through the fleet's outcome stream, and every node counts
//! all of them, in the stream's order. A real `nats-server`, a projector
//! and two replicas as `vacancy serve` processes (the `fleet` harness).
//!
//! What is checked: outcomes posted round-robin to two replicas, with real
//! quotes from searches on them, give the same `/v1/stale-reads` and the
//! same `/v1/bypass` advice on every node; a duplicate posted to both
//! counts once; a conflicting report under the same id is refused by both
//! (and, once stored past the stream's duplicate window, by every node
//! alike); a node cut off from NATS answers 503 and counts nothing; a
//! replica killed and restarted from a checkpoint written after some
//! outcomes agrees with the others afterwards, neither counting one twice
//! nor dropping one.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vacancy_lab::http_client::HttpResponse;
use vacancy_lab::nats::NatsServer;

use crate::fleet::{Fleet, Link, TOKEN, fleet_env, start_nats, wait_ready};
use crate::process::Serve;
use crate::projector::load_inventory;
use crate::support::{TestOwner, wait_for};

/// A stay every test hotel sells (the inventory starts 2030-01-01).
const CHECK_IN: &str = "2030-01-02";
const CHECK_OUT: &str = "2030-01-04";

/// How long the nodes may take to agree after a post was answered: the
/// issue's second (a few milliseconds here, printed; every node reads the
/// message JetStream just acknowledged).
const AGREE_WITHIN: Duration = Duration::from_secs(1);

/// What every node of this test sets besides the harness: stays in 2030
/// searchable, a hotel flagged after five takes (so bypass advice follows
/// the shared counts), and a one-second duplicate window, so a repeat
/// after it reaches the stream and every ledger must refuse or replay it.
const SHARED: [(&str, &str); 3] = [
    ("VACANCY_SEARCH__HORIZON_DAYS", "5000"),
    ("VACANCY_STALE__HOTEL_MIN_TAKES", "5"),
    ("VACANCY_FLEET__DUPLICATE_WINDOW_SECS", "1"),
];

/// One room type a search showed, with its quote.
#[derive(Debug, Clone)]
struct Offer {
    hotel_id: i64,
    room_type_id: i64,
    quote: String,
    /// Where its numbers came from: `copy`, or `owner` for a hotel the
    /// stale-read policy reads from the owner.
    source: String,
}

impl Offer {
    /// A conflict after this showing is a stale read.
    fn stale_if_conflict(&self) -> bool {
        self.source == "copy"
    }
}

/// Every room type of a search on `serve`, hotel by hotel.
async fn offers(serve: &Serve) -> Vec<Vec<Offer>> {
    let path = format!("/v1/search?city=Lisbon&check_in={CHECK_IN}&check_out={CHECK_OUT}&room=1");
    let (code, _, body) = crate::api::get(serve.addr, &path).await;
    assert_eq!(code, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).expect("json");
    answer["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|hotel| {
            let hotel_id = hotel["hotel_id"].as_i64().expect("hotel id");
            hotel["room_types"]
                .as_array()
                .expect("room types")
                .iter()
                .map(|t| Offer {
                    hotel_id,
                    room_type_id: t["room_type_id"].as_i64().expect("room type id"),
                    quote: t["quote"].as_str().expect("a quote").to_string(),
                    source: t["source"].as_str().expect("a source").to_string(),
                })
                .collect()
        })
        .collect()
}

fn report(attempt: &str, offer: &Offer, outcome: &str) -> String {
    json!({
        "attempt_id": attempt,
        "quote": offer.quote,
        "hotel_id": offer.hotel_id,
        "room_type_id": offer.room_type_id,
        "check_in": CHECK_IN,
        "check_out": CHECK_OUT,
        "rooms": 1,
        "outcome": outcome,
    })
    .to_string()
}

async fn post(serve: &Serve, body: &str) -> HttpResponse {
    vacancy_lab::http_client::http(
        serve.addr,
        "POST",
        "/v1/take-outcomes",
        Some(TOKEN),
        Some(body.as_bytes()),
        Duration::from_secs(15),
    )
    .await
    .expect("POST /v1/take-outcomes")
}

/// Posts `body` to `serve`: counted there (200, not a replay).
async fn post_new(serve: &Serve, body: &str) {
    let r = post(serve, body).await;
    assert_eq!(r.status, 200, "{}; log:\n{}", r.text(), serve.log_tail());
    assert_eq!(r.header("idempotent-replayed"), None, "{body}");
}

/// Posts `body` to `serve`: the same report was counted before (200, a replay).
async fn post_replay(serve: &Serve, body: &str) {
    let r = post(serve, body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("idempotent-replayed"), Some("true"), "{body}");
}

/// Posts `body` to `serve`: another report won its attempt id (409).
async fn post_refused(serve: &Serve, body: &str) {
    let r = post(serve, body).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.json()["type"], "/problems/attempt-id-reused");
}

/// `/v1/stale-reads` less what is each node's own (the audit of its copy,
/// the window's length).
async fn figures(serve: &Serve) -> Option<Value> {
    let (code, _, body) = crate::api::get(serve.addr, "/v1/stale-reads").await;
    if code != 200 {
        return None;
    }
    let mut all: Value = serde_json::from_str(&body).ok()?;
    let map = all.as_object_mut()?;
    map.remove("audit");
    map.remove("window_secs");
    Some(all)
}

/// `/v1/bypass` for `offer`'s stay: the advice and its reasons (the lag and
/// LSN are each copy's own).
async fn advice(serve: &Serve, offer: &Offer) -> Value {
    let path = format!(
        "/v1/bypass?hotel_id={}&room_type_id={}&check_in={CHECK_IN}&check_out={CHECK_OUT}&rooms=1",
        offer.hotel_id, offer.room_type_id
    );
    let (code, _, body) = crate::api::get(serve.addr, &path).await;
    assert_eq!(code, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).expect("json");
    json!({ "bypass": answer["bypass"], "reasons": answer["reasons"] })
}

/// What every node must show: these counts over the window and in the
/// totals. `replays` is checked for equality across nodes only (how many
/// repeats reach the stream depends on timing around its duplicate window).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Expected {
    taken: u64,
    conflicts: u64,
    stale_reads: u64,
    errors: u64,
}

impl Expected {
    /// One more report of `outcome` after `offer` was shown (every offer
    /// showed the one room asked for free).
    fn add(&mut self, offer: &Offer, outcome: &str) {
        match outcome {
            "taken" => self.taken += 1,
            "conflict" => {
                self.conflicts += 1;
                self.stale_reads += u64::from(offer.stale_if_conflict());
            }
            _ => self.errors += 1,
        }
    }

    /// Whether `f` shows these counts.
    fn shown_by(&self, f: &Value) -> bool {
        f["takes"] == self.taken + self.conflicts
            && f["conflicts"] == self.conflicts
            && f["stale_reads"] == self.stale_reads
            && f["totals"]["stale_reads"] == self.stale_reads
            && f["errors"] == self.errors
            && f["totals"]["taken"] == self.taken
            && f["totals"]["conflicts"] == self.conflicts
            && f["totals"]["errors"] == self.errors
    }
}

/// Waits until every node shows `expected` and the same figures as the
/// others; returns those figures and how long the wait took.
async fn agree(nodes: &[&Serve], expected: Expected, what: &str) -> Value {
    let started = Instant::now();
    let deadline = started + AGREE_WITHIN;
    let mut last = Vec::new();
    loop {
        last.clear();
        for node in nodes {
            last.push(figures(node).await);
        }
        let first = last[0].clone();
        let same = last.iter().all(|f| *f == first);
        if let Some(shown) = first.filter(|f| same && expected.shown_by(f)) {
            println!(
                "{what}: the nodes agreed {:?} after the last answer",
                started.elapsed()
            );
            return shown;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the nodes do not agree on {expected:?} within {AGREE_WITHIN:?}: {last:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `fleet.outcomes` of a node's `/v1/status`.
async fn outcome_progress(serve: &Serve) -> Option<Value> {
    let status = serve.status().await?;
    Some(status["fleet"]["outcomes"].clone())
}

/// A counter of a node's `/metrics`, by its full name and labels.
async fn metric(serve: &Serve, series: &str) -> f64 {
    let (code, _, text) = crate::api::get(serve.addr, "/metrics").await;
    assert_eq!(code, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} not in /metrics"))
}

/// The projector and two replicas, all ready: A with `SHARED` and a
/// request timeout of 5 s (its settings are returned, for a replica started
/// later like it), and B, with `b_env` over `SHARED`, reaching NATS through
/// a link the test can cut.
async fn start_nodes(
    fleet: &Fleet,
    nats: &NatsServer,
    b_env: &[(&'static str, &'static str)],
) -> (Serve, Serve, Serve, Link, Vec<(&'static str, &'static str)>) {
    let projector = fleet.projector_with("projector", &fleet.owner_url, &fleet.nats_url, &SHARED);
    wait_ready(&projector, Duration::from_secs(60)).await;
    let mut replica_env = SHARED.to_vec();
    replica_env.push(("VACANCY_FLEET__REQUEST_TIMEOUT_MS", "5000"));
    let a = fleet.replica_with("replica-a", &fleet.owner_url, &replica_env);
    let nats_link = Link::to(([127, 0, 0, 1], nats.port()).into()).await;
    let nats_via = format!("nats://{}", nats_link.addr);
    let mut b_settings = SHARED.to_vec();
    b_settings.extend_from_slice(b_env);
    let b = Serve::start_with(
        &fleet.owner_url,
        fleet.logs(),
        "replica-b",
        &fleet_env("replica", &nats_via, &fleet.tokens, &b_settings),
    );
    wait_ready(&a, Duration::from_secs(60)).await;
    wait_ready(&b, Duration::from_secs(60)).await;
    (projector, a, b, nats_link, replica_env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn take_outcomes_posted_to_any_replica_are_counted_once_by_every_node() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    // The second replica waits less for NATS (a 503 comes sooner).
    let (projector, a, b, nats_link, replica_env) = start_nodes(
        &fleet,
        &nats,
        &[
            ("VACANCY_FLEET__REQUEST_TIMEOUT_MS", "2000"),
            ("VACANCY_HTTP__READY_MAX_LAG_MS", "200"),
        ],
    )
    .await;

    // Quotes from searches on each replica: three hotels in Lisbon.
    let (on_a, on_b) = (offers(&a).await, offers(&b).await);
    for searched in [&on_a, &on_b] {
        assert_eq!(searched.len(), 3, "{searched:?}");
        assert!(
            searched.iter().flatten().all(|o| o.source == "copy"),
            "{searched:?}"
        );
    }
    // The first hotel's takes all conflict (stale reads: its share is 1,
    // past the bound), the second's are all taken, the third's fail.
    let outcome_of = ["conflict", "taken", "error"];

    // Round-robin over the two replicas, each report with a quote from a
    // search on the node it is posted to.
    let mut expected = Expected::default();
    for i in 0..24usize {
        let (node, offered) = if i % 2 == 0 { (&a, &on_a) } else { (&b, &on_b) };
        let hotel = i % 3;
        let offer = &offered[hotel][i % offered[hotel].len()];
        post_new(
            node,
            &report(&format!("attempt-{i}"), offer, outcome_of[hotel]),
        )
        .await;
        expected.add(offer, outcome_of[hotel]);
    }
    let round_robin = agree(&[&a, &b, &projector], expected, "round-robin").await;
    assert_eq!(round_robin["totals"]["replays"], 0, "{round_robin}");
    let flagged = round_robin["hotels"]
        .as_array()
        .expect("hotels")
        .iter()
        .filter(|h| h["bypassed"] == true)
        .map(|h| h["hotel_id"].as_i64().expect("id"))
        .collect::<Vec<_>>();
    assert_eq!(flagged, vec![on_a[0][0].hotel_id], "{round_robin}");
    // The same advice from both, for each hotel: the first is read from
    // the owner because of its stale reads, the others are not.
    for (hotel, rooms) in on_a.iter().enumerate() {
        let from_a = advice(&a, &rooms[0]).await;
        let from_b = advice(&b, &rooms[0]).await;
        assert_eq!(from_a, from_b, "hotel {}", rooms[0].hotel_id);
        let conflicts = from_a["reasons"]
            .as_array()
            .expect("reasons")
            .contains(&json!("hotel_conflicts"));
        assert_eq!(conflicts, hotel == 0, "{from_a}");
    }

    // One report posted to both replicas counts once: the second answer
    // is the first one again.
    let offer = &on_a[1][0];
    let duplicate = report("attempt-twice", offer, "taken");
    post_new(&a, &duplicate).await;
    post_replay(&b, &duplicate).await;
    expected.add(offer, "taken");
    agree(&[&a, &b, &projector], expected, "a duplicate").await;
    // Another report under that id is refused by both, and counts nothing.
    let conflicting = report("attempt-twice", offer, "conflict");
    post_refused(&a, &conflicting).await;
    post_refused(&b, &conflicting).await;
    // Past the stream's duplicate window (one message id per attempt id,
    // so a window after each stored one) the repeats are stored: every
    // node's ledger then refuses the one and replays the other, alike.
    let window = Duration::from_millis(1500);
    tokio::time::sleep(window).await;
    post_refused(&a, &conflicting).await;
    tokio::time::sleep(window).await;
    post_replay(&b, &duplicate).await;
    let repeats = agree(
        &[&a, &b, &projector],
        expected,
        "repeats past the duplicate window",
    )
    .await;
    assert!(
        repeats["totals"]["replays"].as_u64() >= Some(1),
        "{repeats}"
    );
    let refused = r#"vacancy_fleet_outcomes_applied_total{result="refused"}"#;
    let refusals = metric(&a, refused).await;
    assert!(refusals >= 1.0, "the stored conflicting report: {refusals}");
    for node in [&b, &projector] {
        assert_eq!(metric(node, refused).await, refusals, "refused alike");
    }

    // Cut off from NATS, a replica counts nothing on its own: 503, retry.
    nats_link.cut();
    let cut_off = report("attempt-cut-off", &on_b[2][0], "error");
    let unavailable = post(&b, &cut_off).await;
    assert_eq!(unavailable.status, 503, "{}", unavailable.text());
    assert_eq!(
        unavailable.json()["type"],
        "/problems/outcomes-unavailable",
        "{}",
        unavailable.text()
    );
    assert_eq!(unavailable.header("retry-after"), Some("1"));
    nats_link.restore();
    let retried = wait_for(
        "the replica back on NATS to take the report",
        Duration::from_secs(60),
        || async {
            let answer = post(&b, &cut_off).await;
            (answer.status == 200).then_some(answer)
        },
    )
    .await;
    // The first publish may have left before the cut was noticed, and be
    // stored since: then the retry is its replay. Counted once either way.
    assert_eq!(retried.json()["attempt_id"], "attempt-cut-off");
    expected.add(&on_b[2][0], "error");
    agree(
        &[&a, &b, &projector],
        expected,
        "a retry after NATS came back",
    )
    .await;

    // A checkpoint after these outcomes: the owner moves (so the interval
    // writes one), and the bucket gets it.
    client
        .batch_execute("UPDATE inventory SET price_cents = price_cents + 1 WHERE hotel_id = 1")
        .await
        .expect("an owner write");
    let counted = outcome_progress(&a).await.expect("status")["applied_sequence"]
        .as_u64()
        .expect("applied_sequence");
    let since = chrono::Utc::now();
    wait_for(
        "a checkpoint written after the outcomes",
        Duration::from_secs(30),
        || async {
            let status = projector.status().await?;
            let at: chrono::DateTime<chrono::Utc> = status["checkpoint"]["last_written"]["at"]
                .as_str()?
                .parse()
                .ok()?;
            let applied = status["fleet"]["outcomes"]["applied_sequence"].as_u64()?;
            (at > since && applied >= counted).then_some(())
        },
    )
    .await;
    // Uploaded meanwhile, in a moment (it is small).
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The second replica dies; outcomes keep coming to the first.
    drop(b);
    for i in 0..6usize {
        let hotel = i % 3;
        let offer = &on_a[hotel][0];
        post_new(
            &a,
            &report(&format!("while-down-{i}"), offer, outcome_of[hotel]),
        )
        .await;
        expected.add(offer, outcome_of[hotel]);
    }
    post_replay(&a, &report("attempt-0", &on_a[0][0], "conflict")).await;

    // Started again, it bootstraps from the bucket's checkpoint (written
    // after the outcomes above), takes the stale-read state in it, and
    // reads the outcome stream on from the sequence that state holds.
    let b_again = fleet.replica_with("replica-b-again", &fleet.owner_url, &replica_env);
    wait_ready(&b_again, Duration::from_secs(60)).await;
    let progress = wait_for(
        "the restarted replica to read the outcome stream",
        Duration::from_secs(30),
        || async {
            let progress = outcome_progress(&b_again).await?;
            (progress["connected"] == true).then_some(progress)
        },
    )
    .await;
    let started_after = progress["started_after"].as_u64().expect("started_after");
    assert!(
        started_after >= counted,
        "restored from a checkpoint holding the outcomes up to {counted} at least: {progress}"
    );
    // Its search reads the hotel the fleet's counts flagged from the
    // owner, as every node's does.
    let on_b_again = offers(&b_again).await;
    for (hotel, rooms) in on_b_again.iter().enumerate() {
        let want = if hotel == 0 { "owner" } else { "copy" };
        assert!(rooms.iter().all(|o| o.source == want), "{rooms:?}");
    }
    for i in 0..4usize {
        let (node, offered) = if i % 2 == 0 {
            (&a, &on_a)
        } else {
            (&b_again, &on_b_again)
        };
        let hotel = i % 3;
        let offer = &offered[hotel][0];
        post_new(
            node,
            &report(&format!("after-{i}"), offer, outcome_of[hotel]),
        )
        .await;
        expected.add(offer, outcome_of[hotel]);
    }
    let restarted = agree(&[&a, &b_again, &projector], expected, "after the restart").await;
    assert!(
        restarted["totals"]["replays"].as_u64() >= Some(2),
        "{restarted}"
    );
    for rooms in &on_a {
        assert_eq!(
            advice(&a, &rooms[0]).await,
            advice(&b_again, &rooms[0]).await
        );
    }
    drop(nats);
}

/// The outcome stream deleted and made again while a replica is cut off
/// from NATS: another node makes the new stream and reports go into it.
/// Back on NATS, the replica counts them too, from the new stream's start,
/// so every node agrees. Before, it took the new stream up at its end
/// (below what it had counted in the old one) and never counted them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_stream_made_again_is_counted_from_its_start_by_every_node() {
    let (_owner, nats, fleet, projector, a, b, nats_link, on_a, mut expected) =
        six_outcomes_agreed().await;

    nats_link.cut();
    async_nats::jetstream::new(async_nats::connect(&fleet.nats_url).await.expect("nats"))
        .delete_stream("VACANCY_OUTCOMES")
        .await
        .expect("delete the outcome stream");
    // Taken once a node has made the stream again (503 until then).
    let offer = &on_a[1][0];
    for i in 0..2usize {
        let body = report(&format!("new-{i}"), offer, "taken");
        wait_for(
            "the new outcome stream to take a report",
            Duration::from_secs(60),
            || async { (post(&a, &body).await.status == 200).then_some(()) },
        )
        .await;
        expected.add(offer, "taken");
    }
    nats_link.restore();
    wait_for(
        "the replica back on NATS to count the new stream",
        Duration::from_secs(60),
        || async { figures(&b).await.filter(|f| expected.shown_by(f)) },
    )
    .await;
    agree(&[&a, &b, &projector], expected, "the stream made again").await;
    drop(nats);
}

/// A fleet (a projector, replica A and replica B, B behind a link the test
/// can cut) that has counted six outcomes, alike, in the first outcome
/// stream: every node's position is past the sequences a new stream gives.
/// Returns A's offers and what the six showed.
async fn six_outcomes_agreed() -> (
    TestOwner,
    NatsServer,
    Fleet,
    Serve,
    Serve,
    Serve,
    Link,
    Vec<Vec<Offer>>,
    Expected,
) {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let nats = start_nats().await;
    let fleet = Fleet::new(&owner, &nats).await;
    let (projector, a, b, nats_link, _) = start_nodes(
        &fleet,
        &nats,
        &[("VACANCY_FLEET__REQUEST_TIMEOUT_MS", "5000")],
    )
    .await;
    let (on_a, on_b) = (offers(&a).await, offers(&b).await);
    let outcome_of = ["conflict", "taken", "error"];
    let mut expected = Expected::default();
    for i in 0..6usize {
        let (node, offered) = if i % 2 == 0 { (&a, &on_a) } else { (&b, &on_b) };
        let hotel = i % 3;
        let offer = &offered[hotel][0];
        post_new(node, &report(&format!("old-{i}"), offer, outcome_of[hotel])).await;
        expected.add(offer, outcome_of[hotel]);
    }
    agree(&[&a, &b, &projector], expected, "the first stream").await;
    (
        owner, nats, fleet, projector, a, b, nats_link, on_a, expected,
    )
}

/// The outcome stream deleted and made again at once, by someone else: a
/// node that has not yet noticed (it looks every 2 s) took the new stream's
/// first sequence for one it had counted, and answered 200 a report it had
/// not counted. Now it answers 503 until it reads the new stream, and a
/// 200 means the report is in its figures.
#[tokio::test]
async fn a_report_to_a_node_behind_a_stream_made_again_is_answered_only_once_counted() {
    let (_owner, nats, fleet, projector, a, b, _nats_link, on_a, mut expected) =
        six_outcomes_agreed().await;
    let jetstream =
        async_nats::jetstream::new(async_nats::connect(&fleet.nats_url).await.expect("nats"));
    let config = jetstream
        .get_stream("VACANCY_OUTCOMES")
        .await
        .expect("the outcome stream")
        .cached_info()
        .config
        .clone();
    jetstream
        .delete_stream("VACANCY_OUTCOMES")
        .await
        .expect("delete the outcome stream");
    jetstream
        .create_stream(config)
        .await
        .expect("make it again");

    let offer = &on_a[1][0];
    let body = report("after-remake", offer, "taken");
    expected.add(offer, "taken");
    let refused = std::cell::Cell::new(0);
    wait_for(
        "B to take the report once it reads the new stream",
        Duration::from_secs(60),
        || async {
            let answer = post(&b, &body).await;
            if answer.status == 503 {
                assert_eq!(answer.json()["type"], "/problems/outcomes-unavailable");
                refused.set(refused.get() + 1);
                return None;
            }
            assert_eq!(answer.status, 200, "{}", answer.text());
            // Answered: counted here, now, not once B looks again.
            let shown = figures(&b).await.expect("B's figures");
            assert!(
                expected.shown_by(&shown),
                "answered 200 before counting it: {shown:#}"
            );
            Some(())
        },
    )
    .await;
    println!(
        "B refused the report {} times before it read the new stream",
        refused.get()
    );
    agree(&[&a, &b, &projector], expected, "the stream made again").await;
    drop(nats);
}

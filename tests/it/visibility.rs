//! Commits the stream delivers before the owner shows them.
//!
//! PostgreSQL flushes a commit record, marks the transaction committed, and
//! only then lets other sessions see it; a synchronous standby's answer is
//! awaited in between. Here the owner names a standby that never connects
//! (`synchronous_standby_names`) and commits locally by default; one session
//! commits with `synchronous_commit = on`, so its transaction is in the WAL,
//! delivered to the copy by the logical stream, yet hidden from every other
//! session until its wait is cancelled. The reads that correct the copy (TTL
//! re-read) and judge it (divergence audit) must not take that hidden state
//! for the owner's.

use std::sync::atomic::Ordering;
use std::time::Duration;

use chrono::NaiveDate;
use tokio_postgres::Client;
use vacancy_lab::cluster::ClusterOptions;
use vacancy_service::slot;
use vacancy_service::{App, CalendarKey, Settings};

use crate::support::{TestOwner, wait_for};

const NIGHTS: i64 = 10;

fn first_night() -> NaiveDate {
    chrono::Utc::now().date_naive()
}

fn key(room_type_id: i64) -> CalendarKey {
    CalendarKey {
        hotel_id: 1,
        room_type_id,
    }
}

/// An owner whose `synchronous_commit = on` commits wait for a standby that
/// never comes; every other commit is local.
async fn owner_with_a_missing_standby() -> TestOwner {
    let owner = TestOwner::start_with(ClusterOptions {
        extra_conf: vec![
            "synchronous_standby_names = 'vacancy_test_standby'".into(),
            "synchronous_commit = local".into(),
        ],
        ..ClusterOptions::default()
    })
    .await;
    owner
        .client()
        .await
        .batch_execute(&format!(
            "INSERT INTO hotels (id, name, city) VALUES (1, 'Hotel 1', 'Lisbon');
             INSERT INTO room_types VALUES (1, 1, 'Room 1', 2), (1, 2, 'Room 2', 2);
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               SELECT 1, rt, DATE '{}' + n, 5, 10000
               FROM generate_series(1, 2) rt, generate_series(0, {}) n;",
            first_night(),
            NIGHTS - 1
        ))
        .await
        .expect("load one hotel");
    owner
}

async fn start(owner: &TestOwner, tune: impl FnOnce(&mut Settings)) -> App {
    let mut s = crate::projector::settings_for(owner);
    s.stale.audit_interval_ms = 0;
    tune(&mut s);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = vacancy_service::start(s, listener).expect("start vacancy");
    let client = owner.client().await;
    let target = slot::current_wal_lsn(&client).await.unwrap();
    wait_for("the copy to load", Duration::from_secs(60), || async {
        (app.model.freshness.is_loaded() && app.model.freshness.applied() >= target).then_some(())
    })
    .await;
    app
}

fn copy_taken(app: &App, key: CalendarKey, night: NaiveDate) -> Option<i32> {
    let t = app.model.read();
    t.calendars
        .get(&key)
        .and_then(|c| c.get(night))
        .map(|n| n.taken)
}

async fn owner_taken(client: &Client, key: CalendarKey, night: NaiveDate) -> i32 {
    client
        .query_one(
            "SELECT taken FROM inventory WHERE hotel_id = $1 AND room_type_id = $2 AND night = $3",
            &[&key.hotel_id, &key.room_type_id, &night],
        )
        .await
        .unwrap()
        .get(0)
}

/// A commit the copy has and other sessions do not see yet.
struct Hidden {
    pid: i32,
    commit: tokio::task::JoinHandle<()>,
}

impl Hidden {
    /// Takes one unit of `key` on `night` in a session that waits for the
    /// missing standby; returns once the copy shows the take, after checking
    /// that the owner still hides it.
    async fn take(owner: &TestOwner, app: &App, key: CalendarKey, night: NaiveDate) -> Hidden {
        let session = owner.client().await;
        let pid: i32 = session
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        let sql = format!(
            "SET synchronous_commit = on;
             UPDATE inventory SET taken = taken + 1
             WHERE hotel_id = {} AND room_type_id = {} AND night = DATE '{night}'",
            key.hotel_id, key.room_type_id
        );
        let commit = tokio::spawn(async move {
            // Returns (with a warning) once the wait is cancelled: the
            // transaction was committed locally all along.
            session
                .batch_execute(&sql)
                .await
                .expect("the hidden commit");
        });
        wait_for(
            "the copy to apply the hidden commit",
            Duration::from_secs(30),
            || async { (copy_taken(app, key, night) == Some(1)).then_some(()) },
        )
        .await;
        assert_eq!(
            owner_taken(&owner.client().await, key, night).await,
            0,
            "the owner should still hide the commit the stream delivered"
        );
        Hidden { pid, commit }
    }

    /// Ends the standby wait: the commit becomes visible to everyone.
    async fn reveal(self, client: &Client) {
        client
            .execute("SELECT pg_cancel_backend($1)", &[&self.pid])
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), self.commit)
            .await
            .expect("the hidden commit to return once cancelled")
            .unwrap();
    }
}

/// A transaction with an xid, left open: older than any horizon taken
/// while it stays open, never committed.
async fn open_writer(owner: &TestOwner) -> Client {
    let writer = owner.client().await;
    writer
        .batch_execute("BEGIN; SELECT pg_current_xact_id();")
        .await
        .unwrap();
    writer
}

/// Changes a row while inventory is out of the publication: the stream
/// never delivers it, so the copy is really wrong there.
async fn change_unseen_by_the_stream(client: &Client, key: CalendarKey, night: NaiveDate) {
    client
        .batch_execute(&format!(
            "ALTER PUBLICATION vacancy DROP TABLE inventory;
             UPDATE inventory SET price_cents = 1
             WHERE hotel_id = {} AND room_type_id = {} AND night = DATE '{night}';
             ALTER PUBLICATION vacancy ADD TABLE inventory;",
            key.hotel_id, key.room_type_id
        ))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_reread_never_undoes_a_commit_the_owner_still_hides() {
    let owner = owner_with_a_missing_standby().await;
    let client = owner.client().await;
    let app = start(&owner, |s| {
        // Short, so a deferred re-read is given up within the test's wait.
        s.owner.query_timeout_ms = 1000;
    })
    .await;
    let night = first_night() + chrono::Days::new(2);
    let hidden = Hidden::take(&owner, &app, key(1), night).await;

    app.refresh.request([key(1)]);
    wait_for(
        "the re-read to give up on a snapshot that hides the commit",
        Duration::from_secs(30),
        || async {
            let (deferred, merged) = (
                app.refresh.deferred.load(Ordering::Relaxed),
                app.refresh.merged.load(Ordering::Relaxed),
            );
            (deferred > 0 || merged > 0).then_some(())
        },
    )
    .await;
    assert_eq!(
        app.refresh.merged.load(Ordering::Relaxed),
        0,
        "a re-read was merged although the owner hid a commit the copy had"
    );
    assert_eq!(
        copy_taken(&app, key(1), night),
        Some(1),
        "the take was undone"
    );

    // Once the owner shows it, the re-read goes through and changes nothing.
    hidden.reveal(&client).await;
    wait_for("the re-read to merge", Duration::from_secs(30), || async {
        (app.refresh.merged.load(Ordering::Relaxed) > 0).then_some(())
    })
    .await;
    assert_eq!(copy_taken(&app, key(1), night), Some(1));
    assert_eq!(app.refresh.repaired.load(Ordering::Relaxed), 0);

    // An open writer older than the low watermark does not stop the safety
    // net: none of what it holds is committed, so the re-read settles and
    // repairs a change the stream missed.
    let writer = open_writer(&owner).await;
    change_unseen_by_the_stream(&client, key(2), night).await;
    app.refresh.request([key(2)]);
    wait_for(
        "the re-read to repair the missed change",
        Duration::from_secs(30),
        || async {
            let t = app.model.read();
            let price = t
                .calendars
                .get(&key(2))
                .and_then(|c| c.get(night))
                .and_then(|n| n.price_cents);
            (price == Some(1)).then_some(())
        },
    )
    .await;
    assert!(app.refresh.repaired.load(Ordering::Relaxed) > 0);
    assert_eq!(copy_taken(&app, key(1), night), Some(1));
    writer.batch_execute("ROLLBACK").await.unwrap();
    app.stop(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_does_not_count_a_commit_the_owner_still_hides() {
    let owner = owner_with_a_missing_standby().await;
    let client = owner.client().await;
    let app = start(&owner, |s| {
        s.stale.audit_sample = 100; // all 20 rows
        s.stale.audit_wait_ms = 1000;
    })
    .await;
    let night = first_night() + chrono::Days::new(3);
    let hidden = Hidden::take(&owner, &app, key(1), night).await;

    let pass = app.stale.audit.pass().await.expect("audit pass");
    assert_eq!(pass.mismatches, 0, "a false positive: {pass:?}");
    assert_eq!(pass.skipped, 1, "the hidden row is not judged: {pass:?}");
    assert_eq!(pass.checked, 2 * NIGHTS as u64 - 1);

    hidden.reveal(&client).await;
    let pass = app.stale.audit.pass().await.expect("audit pass");
    assert_eq!((pass.mismatches, pass.skipped), (0, 0), "{pass:?}");
    assert_eq!(pass.checked, 2 * NIGHTS as u64);

    // A real difference is still found while an older writer stays open.
    let writer = open_writer(&owner).await;
    change_unseen_by_the_stream(&client, key(2), night).await;
    let pass = app.stale.audit.pass().await.expect("audit pass");
    assert_eq!(pass.mismatches, 1, "{pass:?}");
    assert_eq!(
        (pass.examples[0].room_type_id, pass.examples[0].night),
        (2, night)
    );
    writer.batch_execute("ROLLBACK").await.unwrap();
    app.stop(Duration::from_secs(5)).await;
}

/// Issue 21: the applied-xid ring rides in the checkpoint. A copy restarted
/// from a checkpoint that holds a commit the owner still hides must not
/// trust an owner snapshot that hides it: the TTL re-read is deferred, not
/// merged over the take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_a_restart_from_a_checkpoint_a_ttl_reread_never_undoes_a_hidden_commit() {
    let owner = owner_with_a_missing_standby().await;
    let client = owner.client().await;
    let checkpoints = tempfile::tempdir().unwrap();
    let dir = checkpoints.path().to_str().unwrap().to_string();
    let tune = |s: &mut Settings| {
        s.owner.query_timeout_ms = 1000;
        s.checkpoint.dir = dir.clone();
    };
    let first = start(&owner, tune).await;
    let night = first_night() + chrono::Days::new(2);
    let hidden = Hidden::take(&owner, &first, key(1), night).await;
    // A graceful stop: the checkpoint holds the take and its xid.
    first.stop(Duration::from_secs(30)).await;

    let second = start(&owner, tune).await;
    let status = second.checkpoints.report();
    assert!(
        status.loaded_from.is_some(),
        "the restart loaded the checkpoint: {status:?}"
    );
    assert_eq!(copy_taken(&second, key(1), night), Some(1));
    assert_eq!(
        owner_taken(&client, key(1), night).await,
        0,
        "the owner still hides the commit"
    );
    second.refresh.request([key(1)]);
    wait_for(
        "the re-read to give up on a snapshot that hides the commit",
        Duration::from_secs(30),
        || async {
            let (deferred, merged) = (
                second.refresh.deferred.load(Ordering::Relaxed),
                second.refresh.merged.load(Ordering::Relaxed),
            );
            (deferred > 0 || merged > 0).then_some(())
        },
    )
    .await;
    assert_eq!(
        second.refresh.merged.load(Ordering::Relaxed),
        0,
        "after the restart, a re-read was merged although the owner hid a commit the checkpoint had"
    );
    assert_eq!(
        copy_taken(&second, key(1), night),
        Some(1),
        "the take was undone"
    );
    hidden.reveal(&client).await;
    wait_for("the re-read to merge", Duration::from_secs(30), || async {
        (second.refresh.merged.load(Ordering::Relaxed) > 0).then_some(())
    })
    .await;
    assert_eq!(copy_taken(&second, key(1), night), Some(1));
    second.stop(Duration::from_secs(5)).await;
}

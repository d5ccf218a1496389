//! Restarts from a checkpoint (issue 21): `vacancy serve` with
//! `checkpoint.dir` set, stopped with SIGTERM or SIGKILL while owner
//! clients write, then started again. It loads the newest checkpoint
//! instead of copying the owner's tables, replays the WAL since, and equals
//! the owner row for row. A checkpoint that cannot be used (corrupt,
//! truncated, the slot gone or acknowledged past it, the columns changed,
//! another cluster) leads to a full snapshot, never to a wrong copy.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use serde_json::Value;
use tokio_postgres::Client;
use tokio_postgres::types::PgLsn;
use vacancy_lab::cluster::StopMode;
use vacancy_service::Lsn;

use crate::process::{Serve, assert_binary_converged, released_slot};
use crate::projector::{load_inventory, run_workload, test_seed};
use crate::shutdown::sigterm;
use crate::support::{TestOwner, wait_for};

/// Starts `vacancy serve` with checkpoints in `checkpoints`.
fn start(owner_url: &str, logs: &Path, checkpoints: &Path, name: &str) -> Serve {
    Serve::start_with(
        owner_url,
        logs,
        name,
        &[
            (
                "VACANCY_CHECKPOINT__DIR",
                checkpoints.to_str().expect("utf-8 path"),
            ),
            // Often, so that a kill at a random moment may land in a write.
            ("VACANCY_CHECKPOINT__INTERVAL_SECS", "1"),
        ],
    )
}

/// The checkpoint files in `dir`, by name.
fn checkpoint_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "vcp"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// The LSN a checkpoint's name carries (`checkpoint-<timeline>-<lsn>.vcp`,
/// the LSN as 16 hex digits).
fn lsn_of(file: &Path) -> Lsn {
    let stem = file.file_stem().and_then(|s| s.to_str()).expect("a name");
    let hex = stem.rsplit('-').next().expect("an lsn");
    Lsn(u64::from_str_radix(hex, 16).unwrap_or_else(|_| panic!("{stem}: no lsn")))
}

async fn stop_gracefully(serve: &mut Serve) {
    sigterm(serve);
    let status: ExitStatus = wait_for(
        "vacancy serve to exit after SIGTERM",
        Duration::from_secs(60),
        || {
            let exited = serve.child.try_wait().expect("wait on the child");
            async move { exited }
        },
    )
    .await;
    assert!(
        status.success(),
        "exit status {status}; log:\n{}",
        serve.log_tail()
    );
}

/// Waits for `/v1/status` to answer once the copy is loaded, and returns it.
async fn loaded_status(serve: &Serve) -> Value {
    wait_for("the copy to load", Duration::from_secs(90), || async {
        serve.status().await.filter(|s| {
            s["snapshot"]["phase"] == "loaded" || s["checkpoint"]["loaded_from"].is_object()
        })
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_restart_loads_the_checkpoint_replays_and_converges() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let logs = tempfile::tempdir().unwrap();
    let dir = logs.path().join("checkpoints");
    let seed = test_seed();

    let mut first = start(&owner.url, logs.path(), &dir, "first");
    let (_, ()) = tokio::join!(run_workload(&owner, seed, 3, 30), async {
        let target = vacancy_service::slot::current_wal_lsn(&client)
            .await
            .unwrap();
        first.caught_up(target, Duration::from_secs(90)).await;
    });
    // Owner clients write while the stop lands.
    let (_, ()) = tokio::join!(
        run_workload(&owner, seed ^ 0x33, 2, 20),
        stop_gracefully(&mut first)
    );
    let files = checkpoint_files(&dir);
    assert_eq!(files.len(), 1, "older checkpoints are pruned: {files:?}");
    let written = lsn_of(&files[0]);
    assert_eq!(
        released_slot(&client).await,
        written,
        "the last acknowledgement is exactly the shutdown checkpoint's LSN"
    );

    // More writes while it is down, then the restart.
    run_workload(&owner, seed ^ 0x55, 3, 20).await;
    let second = start(&owner.url, logs.path(), &dir, "second");
    let status = loaded_status(&second).await;
    assert_eq!(
        status["checkpoint"]["loaded_from"]["lsn"].as_str(),
        Some(written.to_string().as_str()),
        "the restart loaded the shutdown checkpoint: {status}"
    );
    run_workload(&owner, seed ^ 0x77, 2, 20).await;
    assert_binary_converged(&second, &client).await;
    let status = second.status().await.expect("status");
    assert_eq!(
        status["snapshot"]["rows_loaded"], 0,
        "no snapshot was taken: {status}"
    );
    assert!(status["checkpoint"]["fallback"].is_null(), "{status}");
    let log = std::fs::read_to_string(&second.log).unwrap_or_default();
    assert!(
        !log.contains("snapshot loaded") && log.contains("copy loaded from a checkpoint"),
        "the restart took no snapshot:\n{}",
        second.log_tail()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_moments_resumes_from_the_newest_checkpoint_and_converges() {
    use rand::RngExt;
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let logs = tempfile::tempdir().unwrap();
    let dir = logs.path().join("checkpoints");
    let seed = test_seed();
    let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed);

    let mut loaded_from_checkpoint = 0;
    for round in 0..4u64 {
        let serve = start(&owner.url, logs.path(), &dir, &format!("round-{round}"));
        if round > 0 {
            let status = loaded_status(&serve).await;
            if status["checkpoint"]["loaded_from"].is_object() {
                loaded_from_checkpoint += 1;
            }
        }
        let workload = run_workload(&owner, seed ^ round << 8, 2, 15);
        let killer = async {
            // Up to two checkpoint intervals: a kill may land before the
            // first checkpoint, between two, or in the middle of a write.
            tokio::time::sleep(Duration::from_millis(rng.random_range(300..2_500))).await;
            drop(serve); // SIGKILL
        };
        tokio::join!(workload, killer);
    }
    let last = start(&owner.url, logs.path(), &dir, "last");
    run_workload(&owner, seed ^ 0x99, 2, 15).await;
    assert_binary_converged(&last, &client).await;
    assert!(
        loaded_from_checkpoint > 0,
        "at least one restart after SIGKILL loaded a checkpoint"
    );
}

/// A checkpoint made unusable on purpose; `reason` is the fallback the start must report.
async fn assert_falls_back(
    owner: &TestOwner,
    client: &Client,
    logs: &Path,
    dir: &Path,
    name: &str,
    reason: &str,
) {
    let serve = start(&owner.url, logs, dir, name);
    let status = loaded_status(&serve).await;
    assert_eq!(
        status["checkpoint"]["fallback"]["reason"].as_str(),
        Some(reason),
        "{name}: {status}"
    );
    assert!(
        status["checkpoint"]["loaded_from"].is_null(),
        "{name}: {status}"
    );
    run_workload(owner, test_seed(), 2, 10).await;
    assert_binary_converged(&serve, client).await;
    let metrics = crate::api::get(serve.addr, "/metrics").await.2;
    let counted = format!("vacancy_checkpoint_fallbacks_total{{reason=\"{reason}\"}} 1");
    assert!(
        metrics.contains(&counted),
        "{name}: no `{counted}` in /metrics"
    );
    let mut serve = serve;
    stop_gracefully(&mut serve).await;
}

/// Writes a fresh checkpoint: a start (from whatever the directory holds)
/// and a graceful stop.
async fn fresh_checkpoint(
    owner: &TestOwner,
    client: &Client,
    logs: &Path,
    dir: &Path,
    name: &str,
) -> PathBuf {
    let mut serve = start(&owner.url, logs, dir, name);
    let target = vacancy_service::slot::current_wal_lsn(client)
        .await
        .unwrap();
    serve.caught_up(target, Duration::from_secs(90)).await;
    run_workload(owner, test_seed(), 2, 10).await;
    stop_gracefully(&mut serve).await;
    let files = checkpoint_files(dir);
    files
        .last()
        .cloned()
        .expect("a checkpoint after a graceful stop")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_unusable_checkpoint_falls_back_to_a_snapshot_with_its_reason() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let logs = tempfile::tempdir().unwrap();
    let dir = logs.path().join("checkpoints");

    // A flipped byte in the middle of the file.
    let file = fresh_checkpoint(&owner, &client, logs.path(), &dir, "before-flip").await;
    let mut bytes = std::fs::read(&file).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    assert_falls_back(&owner, &client, logs.path(), &dir, "flipped", "corrupt").await;

    // A write cut short.
    let file = fresh_checkpoint(&owner, &client, logs.path(), &dir, "before-truncate").await;
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() * 2 / 3]).unwrap();
    assert_falls_back(&owner, &client, logs.path(), &dir, "truncated", "truncated").await;

    // The slot advanced past the checkpoint by hand: the changes between are gone.
    let _ = fresh_checkpoint(&owner, &client, logs.path(), &dir, "before-advance").await;
    run_workload(&owner, test_seed(), 2, 10).await;
    released_slot(&client).await;
    let before_advance = released_slot(&client).await;
    // A slot advances only as far as WAL is flushed, and the test
    // clusters commit asynchronously: wait for the flush to pass it.
    let flushed: PgLsn = wait_for("the owner to flush", Duration::from_secs(10), || async {
        let row = client
            .query_one("SELECT pg_current_wal_flush_lsn()", &[])
            .await
            .expect("flush position");
        let flushed: PgLsn = row.get(0);
        (Lsn::from(flushed) > before_advance).then_some(flushed)
    })
    .await;
    client
        .execute(
            "SELECT pg_replication_slot_advance('vacancy', $1)",
            &[&flushed],
        )
        .await
        .expect("advance the slot");
    let advanced = released_slot(&client).await;
    assert!(
        advanced > before_advance,
        "the slot moved: {before_advance} -> {advanced}"
    );
    assert_falls_back(&owner, &client, logs.path(), &dir, "advanced", "slot_ahead").await;

    // The slot dropped.
    let _ = fresh_checkpoint(&owner, &client, logs.path(), &dir, "before-drop").await;
    released_slot(&client).await;
    client
        .execute("SELECT pg_drop_replication_slot('vacancy')", &[])
        .await
        .expect("drop the slot");
    assert_falls_back(
        &owner,
        &client,
        logs.path(),
        &dir,
        "dropped",
        "slot_missing",
    )
    .await;

    // A column added to a published table.
    let _ = fresh_checkpoint(&owner, &client, logs.path(), &dir, "before-alter").await;
    client
        .batch_execute("ALTER TABLE hotels ADD COLUMN renovated_in int")
        .await
        .expect("add a column");
    assert_falls_back(
        &owner,
        &client,
        logs.path(),
        &dir,
        "altered",
        "columns_changed",
    )
    .await;

    // Another cluster: the same schema and data, another system identifier.
    let file = fresh_checkpoint(&owner, &client, logs.path(), &dir, "before-move").await;
    let other = TestOwner::start().await;
    let other_client = other.client().await;
    load_inventory(&other_client).await;
    other_client
        .batch_execute("ALTER TABLE hotels ADD COLUMN renovated_in int")
        .await
        .expect("the same columns");
    let moved = logs.path().join("moved");
    std::fs::create_dir_all(&moved).unwrap();
    std::fs::copy(&file, moved.join(file.file_name().unwrap())).unwrap();
    assert_falls_back(
        &other,
        &other_client,
        logs.path(),
        &moved,
        "moved",
        "other_owner",
    )
    .await;
}

/// An owner put back to an earlier point on the same system and timeline
/// (a volume snapshot restored): its WAL is behind the checkpoint, whose
/// copy holds commits the owner no longer has. The checkpoint was loaded
/// and the stream started at it, so the owner's new commits below it were
/// skipped for good; now the start falls back to a snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_past_the_owners_wal_falls_back_to_a_snapshot() {
    let mut owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let logs = tempfile::tempdir().unwrap();
    let dir = logs.path().join("checkpoints");
    // The slot, and a checkpoint it is acknowledged to.
    fresh_checkpoint(&owner, &client, logs.path(), &dir, "first").await;
    drop(client);
    let saved = logs.path().join("saved-data");
    let copy_dir = |from: &Path, to: &Path| {
        let status = std::process::Command::new("cp")
            .arg("-a")
            .arg(from)
            .arg(to)
            .status()
            .expect("run cp");
        assert!(
            status.success(),
            "cp -a {} {}",
            from.display(),
            to.display()
        );
    };
    owner.cluster.stop(StopMode::Fast).expect("stop the owner");
    copy_dir(owner.cluster.data_dir(), &saved);
    owner.cluster.start_again().expect("start the owner");
    // Commits past the saved point, and a checkpoint of them: a megabyte
    // of WAL first, so the restored owner's own writes below (its start,
    // one insert) cannot reach the checkpoint's position. With only the
    // few commits of a fresh checkpoint between, they sometimes did, and
    // the checkpoint was rightly loaded.
    let client = owner.client().await;
    client
        .execute(
            "SELECT pg_logical_emit_message(true, 'test.gap', repeat('x', 1048576))",
            &[],
        )
        .await
        .expect("a megabyte of WAL past the saved point");
    let file = fresh_checkpoint(&owner, &client, logs.path(), &dir, "second").await;
    drop(client);
    owner.cluster.stop(StopMode::Fast).expect("stop the owner");
    std::fs::remove_dir_all(owner.cluster.data_dir()).expect("remove the data directory");
    copy_dir(&saved, owner.cluster.data_dir());
    owner
        .cluster
        .start_again()
        .expect("start the restored owner");
    let client = owner.client().await;
    let owner_at = vacancy_service::slot::current_wal_lsn(&client)
        .await
        .unwrap();
    let file_at = lsn_of(&file);
    assert!(
        file_at > owner_at,
        "the restored owner ({owner_at}) is behind the checkpoint ({file_at})"
    );
    client
        .batch_execute(
            "INSERT INTO hotels (id, name, city, country) VALUES (900, 'After the restore', 'Porto', 'PT')",
        )
        .await
        .unwrap();
    assert_falls_back(
        &owner,
        &client,
        logs.path(),
        &dir,
        "restored",
        "owner_behind",
    )
    .await;
}

/// The slot's active walsender pid, if any.
async fn slot_holder(client: &Client) -> Option<i32> {
    client
        .query_one(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'vacancy'",
            &[],
        )
        .await
        .expect("the slot exists")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_still_held_is_waited_for_not_taken() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let logs = tempfile::tempdir().unwrap();
    let dir = logs.path().join("checkpoints");
    let seed = test_seed();

    let mut holder = start(&owner.url, logs.path(), &dir, "holder");
    let target = vacancy_service::slot::current_wal_lsn(&client)
        .await
        .unwrap();
    holder.caught_up(target, Duration::from_secs(90)).await;
    let pid = wait_for("the holder to stream", Duration::from_secs(30), || async {
        slot_holder(&client).await
    })
    .await;

    // A second process on the same slot and directory waits for the slot
    // instead of taking it or replacing it.
    let waiter = start(&owner.url, logs.path(), &dir, "waiter");
    wait_for(
        "the waiter to say it waits",
        Duration::from_secs(60),
        || async {
            let log = std::fs::read_to_string(&waiter.log).unwrap_or_default();
            log.contains("slot still held by a walsender").then_some(())
        },
    )
    .await;
    run_workload(&owner, seed, 2, 10).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        slot_holder(&client).await,
        Some(pid),
        "the waiter left the slot to its holder:\n{}",
        waiter.log_tail()
    );
    let status = waiter.status().await.expect("the waiter answers");
    assert!(status["checkpoint"]["loaded_from"].is_null(), "{status}");
    assert_ne!(status["snapshot"]["phase"], "loaded", "{status}");

    // Once the holder has stopped (its last checkpoint durable, the slot
    // acknowledged to it), the waiter loads that checkpoint and resumes.
    stop_gracefully(&mut holder).await;
    let last = checkpoint_files(&dir)
        .last()
        .map(|f| lsn_of(f))
        .expect("a checkpoint");
    run_workload(&owner, seed ^ 0x22, 2, 10).await;
    assert_binary_converged(&waiter, &client).await;
    let status = waiter.status().await.expect("status");
    assert_eq!(
        status["checkpoint"]["loaded_from"]["lsn"].as_str(),
        Some(last.to_string().as_str()),
        "{status}"
    );
    assert_eq!(status["snapshot"]["rows_loaded"], 0, "{status}");
}

async fn signal(serve: &Serve, name: &str) {
    let sent = std::process::Command::new("kill")
        .args(["-s", name, &serve.child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success(), "kill -s {name} failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_acknowledged_past_the_copy_is_not_resumed() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    load_inventory(&client).await;
    let logs = tempfile::tempdir().unwrap();
    let seed = test_seed();
    // Checkpoints off: the check is the resume path's own.
    let serve = Serve::start(&owner.url, logs.path(), "copy");
    let target = vacancy_service::slot::current_wal_lsn(&client)
        .await
        .unwrap();
    serve.caught_up(target, Duration::from_secs(90)).await;

    // Frozen, its walsender ended: the slot is free while the copy is
    // behind, and an operator advances it past changes the copy never saw.
    signal(&serve, "STOP").await;
    client
        .execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'vacancy'",
            &[],
        )
        .await
        .unwrap();
    released_slot(&client).await;
    run_workload(&owner, seed, 2, 10).await;
    let flushed: PgLsn = client
        .query_one("SELECT pg_current_wal_lsn()", &[])
        .await
        .unwrap()
        .get(0);
    wait_for("the owner to flush", Duration::from_secs(10), || async {
        let row = client
            .query_one("SELECT pg_current_wal_flush_lsn() >= $1", &[&flushed])
            .await
            .unwrap();
        row.get::<_, bool>(0).then_some(())
    })
    .await;
    client
        .execute(
            "SELECT pg_replication_slot_advance('vacancy', $1)",
            &[&flushed],
        )
        .await
        .expect("advance the slot");
    signal(&serve, "CONT").await;

    // Resuming there would skip the workload; the copy takes a snapshot.
    assert_binary_converged(&serve, &client).await;
    let metrics = crate::api::get(serve.addr, "/metrics").await.2;
    assert!(
        metrics.contains("vacancy_resnapshots_total{reason=\"slot_ahead\"} 1"),
        "the copy took a snapshot because the slot was ahead of it"
    );
}

//! `vacancy bench faults` runs through these same functions: the scenario
//! runner against a real owner and the `vacancy serve` binary, and the
//! divergence counter, which must see a difference when there is one (a
//! counter that always says 0 would make the bench's table worthless).

use std::path::PathBuf;
use std::time::Duration;

use vacancy_lab::bench::faults::{self, Fault, ScenarioOptions, Serve};
use vacancy_lab::seed::{self, SeedOptions};
use vacancy_service::slot;

use crate::support::TestOwner;

/// A tiny owner in the seed's shape: 8 hotels x 3 room types x 14 nights.
async fn seeded_owner() -> TestOwner {
    let owner = TestOwner::start().await;
    seed::run(&SeedOptions {
        owner_url: owner.url.clone(),
        hotels: 8,
        room_types: 3,
        nights: 14,
        start: chrono::Utc::now().date_naive(),
        seed: 3,
        progress: false,
    })
    .await
    .expect("seed the owner");
    owner
}

fn options(dir: &std::path::Path) -> ScenarioOptions {
    ScenarioOptions {
        exe: PathBuf::from(env!("CARGO_BIN_EXE_vacancy")),
        work_dir: dir.to_path_buf(),
        guests: 2,
        search_clients: 1,
        warm_up: Duration::from_millis(800),
        after: Duration::from_millis(800),
        unreachable: Duration::from_secs(2),
        writes_fail_for: Duration::from_secs(2),
        recover_limit: Duration::from_secs(40),
        seed: 5,
    }
}

/// Two scenarios end to end: the slot invalidated while vacancy is stopped
/// (it must notice `lost` and take a new snapshot) and owner writes failing
/// with 53100 (aborted transactions must never reach the copy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_scenarios_recover_with_no_divergent_rows() {
    let mut owner = seeded_owner().await;
    let dir = tempfile::tempdir().unwrap();
    let options = options(dir.path());
    for fault in [Fault::SlotInvalidated, Fault::WritesFail] {
        let outcome = faults::run_scenario(&mut owner.cluster, &owner.url, fault, &options)
            .await
            .unwrap_or_else(|e| panic!("{fault:?}: {e}"));
        assert!(
            outcome.recovered,
            "{fault:?} did not recover: {:?}",
            outcome.problem
        );
        let divergence = outcome
            .divergence
            .unwrap_or_else(|| panic!("{fault:?}: not compared: {:?}", outcome.problem));
        assert!(divergence.compared > 8 * 3 * 14, "{divergence:?}");
        assert_eq!(divergence.total(), 0, "{fault:?}: {divergence:?}");
        assert!(outcome.searches.ok > 0, "{fault:?}: {:?}", outcome.searches);
        match fault {
            Fault::SlotInvalidated => assert_eq!(
                outcome.snapshots.get("slot_lost"),
                Some(&1),
                "the slot was really lost and replaced: {:?}",
                outcome.snapshots
            ),
            _ => assert!(
                outcome.hotelier_failed + outcome.takes.errors > 0,
                "owner writes really failed (hotelier {} failed, takes {:?})",
                outcome.hotelier_failed,
                outcome.takes
            ),
        }
    }
    let table = faults::render(&[]);
    assert!(table.starts_with("| fault | recovered |"));
}

/// Changes the stream never delivered (the tables left out of the
/// publication for a moment) are counted, each row once, through the same
/// reads of the owner and of the binary's API the bench uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_divergence_counter_counts_rows_the_stream_never_delivered() {
    let owner = seeded_owner().await;
    let client = owner.client().await;
    let dir = tempfile::tempdir().unwrap();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_vacancy"));
    let mut serve = Serve::start(&exe, &owner.url, dir.path(), "divergence").unwrap();
    let limit = Duration::from_secs(40);
    let target = slot::current_wal_lsn(&client).await.unwrap();
    serve
        .caught_up(target, limit, "the snapshot")
        .await
        .unwrap();
    let clean = faults::measure_divergence(serve.addr, &client)
        .await
        .unwrap();
    assert_eq!(clean.total(), 0, "{clean:?}");

    client
        .batch_execute(&format!(
            "ALTER PUBLICATION {p} DROP TABLE inventory, hotels;
             UPDATE inventory SET price_cents = coalesce(price_cents, 0) + 7
               WHERE (hotel_id, room_type_id, night) IN
                 (SELECT hotel_id, room_type_id, night FROM inventory ORDER BY 1, 2, 3 LIMIT 3);
             DELETE FROM inventory WHERE (hotel_id, room_type_id, night) =
                 (SELECT hotel_id, room_type_id, night FROM inventory ORDER BY 1 DESC, 2 DESC, 3 DESC LIMIT 1);
             UPDATE hotels SET stars = coalesce(stars, 0) % 5 + 1 WHERE id = 2;
             ALTER PUBLICATION {p} ADD TABLE inventory, hotels;",
            p = faults::PUBLICATION
        ))
        .await
        .unwrap();
    let target = slot::current_wal_lsn(&client).await.unwrap();
    serve
        .caught_up(target, limit, "the catch-up")
        .await
        .unwrap();
    let counted = faults::measure_divergence(serve.addr, &client)
        .await
        .unwrap();
    assert_eq!(
        (counted.inventory, counted.hotels, counted.room_types),
        (4, 1, 0),
        "three changed rows and one deleted on the owner only, one hotel: {counted:?}"
    );
    serve.stop().await;
    slot::drop_slot(&client, faults::SLOT).await.unwrap();
}

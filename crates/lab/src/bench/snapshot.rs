//! `vacancy bench snapshot`: the snapshot load rate, beside server-side
//! `COPY ... TO '/dev/null'` of the same tables.

use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio_postgres::Client;

use vacancy_service::SnapshotPhase;
use vacancy_service::slot;

use super::{
    BenchError, CONNECT_TIMEOUT, LOAD_LIMIT, Owner, POLL, VACANCY_SLOT, bench_settings,
    print_header, rate,
};
use crate::readiness::wait_until;

async fn copy_baseline(client: &Client) -> Result<(u64, Duration), BenchError> {
    // The same columns and format the snapshot reads, written by the server
    // itself: what the owner spends before any network or client cost.
    let statements = [
        "COPY hotels (id, name, city, country, stars, latitude, longitude, amenities) TO '/dev/null' (FORMAT binary)",
        "COPY room_types (hotel_id, id, name, max_guests) TO '/dev/null' (FORMAT binary)",
        "COPY inventory (hotel_id, room_type_id, night, total, taken, sell_limit, price_cents) TO '/dev/null' (FORMAT binary)",
    ];
    let started = Instant::now();
    let mut rows = 0;
    for statement in statements {
        rows += client.execute(statement, &[]).await?;
    }
    Ok((rows, started.elapsed()))
}

pub(super) async fn run(owner: &Owner) -> Result<(), BenchError> {
    let client = vacancy_service::connect(owner.url(), CONNECT_TIMEOUT).await?;
    print_header("snapshot", owner, &client).await?;
    slot::drop_slot(&client, VACANCY_SLOT).await?;

    eprintln!("baseline: COPY to /dev/null (first run)");
    let (copy_rows, copy_first) = copy_baseline(&client).await?;

    eprintln!("vacancy: loading the snapshot");
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let app_started = Instant::now();
    let app = vacancy_service::start(bench_settings(owner.url()), listener)?;
    let progress = &app.status.snapshot;
    wait_until(
        "the snapshot to start",
        LOAD_LIMIT,
        POLL,
        &app.status,
        || progress.phase() != SnapshotPhase::NotStarted,
    )
    .await?;
    let load_started = Instant::now();
    let model = app.model.clone();
    wait_until(
        "the snapshot to load",
        LOAD_LIMIT,
        POLL,
        &app.status,
        || model.freshness.is_loaded(),
    )
    .await?;
    let load = load_started.elapsed();
    let end_to_end = app_started.elapsed();
    let rows = progress
        .rows_loaded
        .load(std::sync::atomic::Ordering::Relaxed);
    app.stop(Duration::from_secs(10)).await;
    drop(model);
    slot::drop_slot(&client, VACANCY_SLOT).await?;

    eprintln!("baseline: COPY to /dev/null (second run)");
    let (_, copy_second) = copy_baseline(&client).await?;

    let vacancy = rate(rows, load);
    let copy_best = copy_first.min(copy_second);
    println!(
        "method:   vacancy timed from the snapshot phase turning `loading` (slot created, snapshot \
         exported) until the copy is swapped in; baseline: server-side binary COPY of the same \
         columns of hotels, room_types, inventory to '/dev/null', run before and after vacancy"
    );
    println!();
    println!("| | rows | time | rows/s | vs best COPY (goal >= 0.8) |");
    println!("|---|---:|---:|---:|---:|");
    println!(
        "| vacancy snapshot load | {rows} | {:.1}s | {:.0} | {:.2} |",
        load.as_secs_f64(),
        vacancy,
        vacancy / rate(copy_rows, copy_best)
    );
    println!(
        "| vacancy from start (connect, slot, snapshot) | {rows} | {:.1}s | {:.0} | |",
        end_to_end.as_secs_f64(),
        rate(rows, end_to_end)
    );
    for (label, time) in [("first", copy_first), ("second", copy_second)] {
        println!(
            "| COPY TO '/dev/null', {label} run | {copy_rows} | {:.1}s | {:.0} | |",
            time.as_secs_f64(),
            rate(copy_rows, time)
        );
    }
    Ok(())
}

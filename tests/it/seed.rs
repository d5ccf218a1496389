//! `vacancy seed` against a real owner: the shape of what it loads, that a
//! seed always loads the same bytes, and that bad options are refused.

use chrono::NaiveDate;
use vacancy_lab::seed::{self, SeedError, SeedOptions};

use crate::support::TestOwner;

fn options(url: &str, hotels: u32, room_types: u32, nights: u32, seed: u64) -> SeedOptions {
    SeedOptions {
        owner_url: url.to_string(),
        hotels,
        room_types,
        nights,
        start: NaiveDate::from_ymd_opt(2026, 3, 1).expect("valid date"),
        seed,
        progress: false,
    }
}

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client
        .query_one(sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

#[tokio::test]
async fn a_small_seed_loads_every_row_in_a_realistic_shape() {
    let owner = TestOwner::start().await;
    let report = seed::run(&options(&owner.url, 30, 4, 20, 1))
        .await
        .expect("seed");
    assert_eq!(report.hotels, 30);
    assert_eq!(report.room_types, 30 * 4);
    assert_eq!(report.inventory_rows, 30 * 4 * 20);
    assert!(report.database_bytes > 0);

    let db = owner.client().await;
    assert_eq!(count(&db, "SELECT count(*) FROM hotels").await, 30);
    assert_eq!(count(&db, "SELECT count(*) FROM room_types").await, 120);
    assert_eq!(count(&db, "SELECT count(*) FROM inventory").await, 2400);
    assert_eq!(
        count(&db, "SELECT min(id) * 1000 + max(id) FROM hotels").await,
        1030,
        "hotel ids are 1..=30"
    );

    // The nights are exactly the 20 from --start, for every room type.
    let nights = db
        .query_one(
            "SELECT min(night), max(night), count(DISTINCT night) FROM inventory",
            &[],
        )
        .await
        .expect("nights");
    assert_eq!(
        nights.get::<_, NaiveDate>(0),
        NaiveDate::from_ymd_opt(2026, 3, 1).unwrap()
    );
    assert_eq!(
        nights.get::<_, NaiveDate>(1),
        NaiveDate::from_ymd_opt(2026, 3, 20).unwrap()
    );
    assert_eq!(nights.get::<_, i64>(2), 20);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM (SELECT 1 FROM inventory GROUP BY hotel_id, room_type_id \
             HAVING count(*) <> 20) wrong"
        )
        .await,
        0
    );

    // Cities: several, of unequal sizes, each with one country.
    let cities = db
        .query(
            "SELECT city, count(*), count(DISTINCT country) FROM hotels GROUP BY city ORDER BY 2 DESC",
            &[],
        )
        .await
        .expect("cities");
    assert!(cities.len() >= 5, "only {} cities", cities.len());
    let largest: i64 = cities[0].get(1);
    let smallest: i64 = cities[cities.len() - 1].get(1);
    assert!(
        largest > smallest,
        "city sizes are all {largest}: no long tail"
    );
    assert!(cities.iter().all(|c| c.get::<_, i64>(2) == 1));

    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM hotels WHERE stars NOT BETWEEN 1 AND 5 OR latitude IS NULL \
             OR longitude IS NULL OR country IS NULL OR name = ''"
        )
        .await,
        0
    );
    assert!(
        count(
            &db,
            "SELECT count(*) FROM hotels WHERE 'wifi' = ANY (amenities)"
        )
        .await
            > 0
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM room_types WHERE max_guests NOT BETWEEN 1 AND 6 OR name = ''"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM inventory WHERE total NOT BETWEEN 1 AND 50"
        )
        .await,
        0
    );
    // A room type has one size on every night.
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM (SELECT 1 FROM inventory GROUP BY hotel_id, room_type_id \
             HAVING count(DISTINCT total) > 1) varying"
        )
        .await,
        0
    );

    // Overbooking on about 5% of nights, sold-out nights, and varying prices.
    let oversold = count(
        &db,
        "SELECT count(*) FROM inventory WHERE sell_limit IS NOT NULL",
    )
    .await;
    assert!(
        (40..=250).contains(&oversold),
        "{oversold} of 2400 oversold"
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM inventory WHERE sell_limit <= total"
        )
        .await,
        0
    );
    assert!(
        count(
            &db,
            "SELECT count(*) FROM inventory WHERE taken = coalesce(sell_limit, total)"
        )
        .await
            > 0,
        "no night is sold out"
    );
    assert!(count(&db, "SELECT count(*) FROM inventory WHERE taken < total").await > 0);
    assert!(
        count(
            &db,
            "SELECT count(*) FROM inventory WHERE price_cents IS NULL OR price_cents <= 0"
        )
        .await
            == 0
    );
    assert!(
        count(
            &db,
            "SELECT count(*) FROM (SELECT 1 FROM inventory GROUP BY hotel_id, room_type_id \
             HAVING count(DISTINCT price_cents) > 1) varying"
        )
        .await
            > 60,
        "prices do not vary by night"
    );

    // The foreign keys hold (the superuser's load checks them after the COPY).
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM inventory i WHERE NOT EXISTS (SELECT 1 FROM room_types r \
             WHERE r.hotel_id = i.hotel_id AND r.id = i.room_type_id)"
        )
        .await,
        0
    );

    // The planner has statistics right away.
    assert!(
        count(
            &db,
            "SELECT count(*) FROM pg_stats WHERE tablename = 'inventory'"
        )
        .await
            > 0
    );

    // A second seed into the same database is refused and changes nothing.
    let again = seed::run(&options(&owner.url, 30, 4, 20, 1)).await;
    assert!(
        matches!(again, Err(SeedError::NotEmpty { table: "hotels" })),
        "{again:?}"
    );
    assert_eq!(count(&db, "SELECT count(*) FROM inventory").await, 2400);
}

/// One digest per table, over every column of every row in key order.
async fn fingerprint(url: &str) -> Vec<String> {
    let client = vacancy_service::connect(url, std::time::Duration::from_secs(10))
        .await
        .expect("connect");
    let mut digests = Vec::new();
    for (table, key) in [
        ("hotels", "id"),
        ("room_types", "hotel_id, id"),
        ("inventory", "hotel_id, room_type_id, night"),
    ] {
        let sql = format!("SELECT md5(string_agg(t::text, E'\\n' ORDER BY {key})) FROM {table} t");
        let digest: String = client.query_one(&sql, &[]).await.expect(&sql).get(0);
        digests.push(format!("{table} {digest}"));
    }
    digests
}

/// Also covers both load paths: `seed_a` is loaded by the superuser (foreign
/// keys checked once after the load), `seed_b` by an ordinary role that may
/// not defer them (checked row by row); both must hold the same bytes.
#[tokio::test]
async fn the_same_seed_loads_the_same_data() {
    let owner = TestOwner::start().await;
    let admin = vacancy_service::connect(
        &owner.cluster.url("postgres"),
        std::time::Duration::from_secs(10),
    )
    .await
    .expect("connect as postgres");
    for sql in [
        "CREATE ROLE loader LOGIN",
        "CREATE DATABASE seed_b OWNER loader",
    ] {
        admin.batch_execute(sql).await.expect(sql);
    }
    let seed_a = owner
        .cluster
        .create_database("seed_a")
        .expect("create database");
    let seed_b = format!(
        "postgresql://loader@127.0.0.1:{}/seed_b",
        owner.cluster.port()
    );
    let seed_c = owner
        .cluster
        .create_database("seed_c")
        .expect("create database");

    for (url, seed_value) in [(&seed_a, 42), (&seed_b, 42), (&seed_c, 43)] {
        let report = seed::run(&options(url, 40, 3, 15, seed_value))
            .await
            .unwrap_or_else(|e| panic!("seed {url}: {e}"));
        assert_eq!(report.inventory_rows, 40 * 3 * 15);
    }
    let a = fingerprint(&seed_a).await;
    let b = fingerprint(&seed_b).await;
    let c = fingerprint(&seed_c).await;
    assert_eq!(a, b, "seed 42 loaded different data twice");
    for (same, other) in a.iter().zip(&c) {
        assert_ne!(same, other, "seeds 42 and 43 loaded the same table");
    }
}

#[tokio::test]
async fn bad_options_are_typed_errors_and_load_nothing() {
    let owner = TestOwner::start().await;
    for (hotels, room_types, nights, what) in [
        (0, 4, 20, "hotels"),
        (30, 0, 20, "room-types"),
        (30, 4, 0, "nights"),
    ] {
        let result = seed::run(&options(&owner.url, hotels, room_types, nights, 1)).await;
        match result {
            Err(SeedError::Zero(option)) => assert_eq!(option, what),
            other => panic!("{hotels}/{room_types}/{nights}: {other:?}"),
        }
    }

    let mut late = options(&owner.url, 1, 1, 10, 1);
    late.start = NaiveDate::MAX;
    let result = seed::run(&late).await;
    assert!(
        matches!(result, Err(SeedError::DateOutOfRange { .. })),
        "{result:?}"
    );

    let unreachable = seed::run(&options(
        "postgresql://postgres@127.0.0.1:1/none",
        1,
        1,
        1,
        1,
    ))
    .await;
    assert!(
        matches!(unreachable, Err(SeedError::Owner(_))),
        "{unreachable:?}"
    );

    let db = owner.client().await;
    assert_eq!(count(&db, "SELECT count(*) FROM hotels").await, 0);
}

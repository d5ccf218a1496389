//! The data generator behind `vacancy seed`.
//!
//! Tests, benchmarks and the interview demo need an owner database that looks
//! like a real booking site's (a few huge cities and a long tail, small hotels
//! next to big ones, nights that sell out, overbooking) and that is large: the
//! interview size is 73 million inventory rows. So the generator is
//! deterministic per seed (two runs with the same options load byte-identical
//! data, which makes benchmarks repeatable and lets tests compare databases),
//! streams rows straight into `COPY ... FROM STDIN (FORMAT binary)` so memory
//! stays flat whatever the size, and commits only data that satisfies every
//! constraint of the reference schema (nothing in the schema is dropped or
//! altered: other tools load through it; see `defer_foreign_key_checks` for
//! the one check that is moved, not skipped).
//!
//! Every hotel draws from its own random stream, keyed by the seed and its id,
//! so a hotel's data does not depend on how hotels are batched into COPY
//! statements, and its profile can be regenerated for the inventory pass
//! instead of being kept in memory.

use std::ops::Range;
use std::pin::pin;
use std::time::{Duration, Instant};

use bytes::{BufMut, BytesMut};
use chrono::{Datelike, Days, NaiveDate, Weekday};
use futures_util::SinkExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio_postgres::Client;
use tokio_postgres::binary_copy::BinaryCopyInWriter;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use vacancy_service::OwnerError;

/// What `vacancy seed` loads.
#[derive(Debug, Clone)]
pub struct SeedOptions {
    pub owner_url: String,
    pub hotels: u32,
    pub room_types: u32,
    pub nights: u32,
    pub start: chrono::NaiveDate,
    pub seed: u64,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

/// What a seed run did, for the log and BENCHMARKS.md.
#[derive(Debug, Clone)]
pub struct SeedReport {
    pub hotels: u64,
    pub room_types: u64,
    pub inventory_rows: u64,
    pub elapsed: Duration,
    pub database_bytes: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    #[error(transparent)]
    Owner(#[from] OwnerError),
    #[error("nothing to seed: --{0} is 0 (give at least 1)")]
    Zero(&'static str),
    #[error(
        "{hotels} hotels x {room_types} room types x {nights} nights is more rows than one database load can address"
    )]
    TooLarge {
        hotels: u32,
        room_types: u32,
        nights: u32,
    },
    #[error("--start {start} plus {nights} nights runs past the last date that can be stored")]
    DateOutOfRange { start: NaiveDate, nights: u32 },
    #[error(
        "the owner database is not empty ({table} has rows): seed loads hotel ids 1..=N and \
         only into empty tables, so point --owner-url at a fresh database"
    )]
    NotEmpty { table: &'static str },
    #[error(
        "{rows} generated rows reference no loaded parent row (a generator bug); \
         the load was rolled back"
    )]
    Orphans { rows: i64 },
    #[error("loading {table} failed (nothing was committed): {source}")]
    Load {
        table: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
}

impl From<tokio_postgres::Error> for SeedError {
    fn from(error: tokio_postgres::Error) -> Self {
        SeedError::Owner(OwnerError::Query(error))
    }
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Rows per inventory COPY statement. When the foreign keys are checked row
/// by row (a role that may not defer them), each check is an AFTER trigger
/// event queued in the backend's memory until the statement ends, so one COPY
/// for 73 million rows would hold gigabytes there; a few million rows per
/// statement keeps it to tens of MB. With the checks deferred, splitting costs
/// nothing measurable.
const INVENTORY_ROWS_PER_COPY: u64 = 2_000_000;

/// Bytes handed to the connection at a time: large enough that the per-message
/// cost vanishes, small enough that memory stays flat (the COPY channel holds
/// one message, so at most a few chunks are alive).
const CHUNK_BYTES: usize = 1 << 20;

/// `run` for benchmarks, from today without a progress bar, saying on
/// stderr what it loads and how long that took (their stdout is the report).
pub async fn run_announced(
    owner_url: &str,
    (hotels, room_types, nights): (u32, u32, u32),
    seed: u64,
) -> Result<SeedReport, SeedError> {
    eprintln!("seeding {hotels} hotels x {room_types} room types x {nights} nights");
    let report = run(&SeedOptions {
        owner_url: owner_url.to_string(),
        hotels,
        room_types,
        nights,
        start: chrono::Utc::now().date_naive(),
        seed,
        progress: false,
    })
    .await?;
    eprintln!(
        "seeded {} inventory rows in {:.1}s",
        report.inventory_rows,
        report.elapsed.as_secs_f64()
    );
    Ok(report)
}

/// Loads the generated data set described by `options` into an empty owner database.
pub async fn run(options: &SeedOptions) -> Result<SeedReport, SeedError> {
    let started = Instant::now();
    let plan = Plan::new(options)?;
    let client = vacancy_service::connect(&options.owner_url, CONNECT_TIMEOUT).await?;
    crate::schema::apply(&client).await?;

    let total_rows =
        plan.hotel_count() * (1 + plan.room_types_per_hotel() * (1 + plan.night_count()));
    let progress = progress_bar(options.progress, total_rows);

    // One transaction for the whole load: a failed or interrupted seed leaves
    // the database as empty as it found it, so it can simply be run again.
    client.batch_execute("BEGIN").await?;
    let loaded = load(&client, &plan, &progress).await;
    let inventory_rows = match loaded {
        Ok(rows) => rows,
        Err(error) => {
            progress.abandon_with_message("failed");
            // The connection may be gone already; the server rolls back then too.
            let _ = client.batch_execute("ROLLBACK").await;
            return Err(error);
        }
    };
    progress.set_message("committing");
    client.batch_execute("COMMIT").await?;

    // Fresh statistics, so the first queries against the seeded owner get
    // sensible plans without waiting for autovacuum.
    progress.set_message("analyzing");
    client
        .batch_execute("ANALYZE hotels, room_types, inventory")
        .await?;
    let database_bytes: i64 = client
        .query_one("SELECT pg_database_size(current_database())", &[])
        .await?
        .get(0);
    progress.finish_with_message("done");

    Ok(SeedReport {
        hotels: plan.hotel_count(),
        room_types: plan.hotel_count() * plan.room_types_per_hotel(),
        inventory_rows,
        elapsed: started.elapsed(),
        database_bytes,
    })
}

/// Everything inside the load transaction; returns the inventory row count.
async fn load(client: &Client, plan: &Plan, progress: &ProgressBar) -> Result<u64, SeedError> {
    // The lock makes a concurrent second seed wait and then see the first
    // one's rows, instead of both passing the emptiness check.
    client
        .batch_execute("LOCK TABLE hotels, room_types, inventory IN EXCLUSIVE MODE")
        .await?;
    for table in ["hotels", "room_types", "inventory"] {
        let sql = format!("SELECT EXISTS (SELECT 1 FROM {table})");
        if client.query_one(&sql, &[]).await?.get::<_, bool>(0) {
            return Err(SeedError::NotEmpty { table });
        }
    }

    let checks_deferred = defer_foreign_key_checks(client).await?;

    progress.set_message("hotels");
    copy_hotels(client, plan, progress).await?;
    progress.set_message("room types");
    copy_room_types(client, plan, progress).await?;

    // `inventory` was proven empty under the lock above, so this TRUNCATE
    // removes nothing; it is there because a table truncated in the current
    // transaction may be loaded with COPY FREEZE, which writes the rows
    // already frozen and marked all-visible. That spares the first reader
    // and vacuum from rewriting every page of the table after the load.
    client.batch_execute("TRUNCATE inventory").await?;
    progress.set_message("inventory");
    let mut rows = 0;
    for hotels in plan.inventory_batches(INVENTORY_ROWS_PER_COPY) {
        rows += copy_inventory(client, plan, hotels, progress).await?;
    }

    if checks_deferred {
        progress.set_message("checking foreign keys");
        let orphans: i64 = client
            .query_one(
                "SELECT (SELECT count(*) FROM room_types r \
                         WHERE NOT EXISTS (SELECT 1 FROM hotels h WHERE h.id = r.hotel_id)) \
                      + (SELECT count(*) FROM inventory i \
                         WHERE NOT EXISTS (SELECT 1 FROM room_types r \
                                           WHERE r.hotel_id = i.hotel_id AND r.id = i.room_type_id))",
                &[],
            )
            .await?
            .get(0);
        if orphans > 0 {
            return Err(SeedError::Orphans { rows: orphans });
        }
    }
    Ok(rows)
}

/// Switches off the per-row foreign key triggers for this transaction when
/// the role may (superusers, or PostgreSQL 15's `GRANT SET ON PARAMETER`),
/// returning whether it did; the caller then checks the keys itself.
///
/// Why: PostgreSQL checks each inserted row's foreign key with its own
/// lookup, which on this machine made a COPY of 7.3 million inventory rows
/// take 100 s instead of 26 s. One anti-join over the loaded rows before
/// commit checks the same keys in seconds, and the commit still only happens
/// when they all hold. CHECK constraints and the primary key are not
/// triggers and stay enforced row by row. Nothing in the schema changes, and
/// `SET LOCAL` ends with the transaction.
pub(crate) async fn defer_foreign_key_checks(client: &Client) -> Result<bool, SeedError> {
    // A refused SET aborts the transaction; the savepoint confines that.
    client.batch_execute("SAVEPOINT replica_role").await?;
    match client
        .batch_execute("SET LOCAL session_replication_role = replica")
        .await
    {
        Ok(()) => {
            client
                .batch_execute("RELEASE SAVEPOINT replica_role")
                .await?;
            Ok(true)
        }
        Err(error) if error.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            tracing::info!("not allowed to defer foreign key checks; the load checks each row");
            client
                .batch_execute("ROLLBACK TO SAVEPOINT replica_role; RELEASE SAVEPOINT replica_role")
                .await?;
            Ok(false)
        }
        Err(error) => Err(error.into()),
    }
}

async fn copy_hotels(
    client: &Client,
    plan: &Plan,
    progress: &ProgressBar,
) -> Result<(), SeedError> {
    let load_error = |source| SeedError::Load {
        table: "hotels",
        source,
    };
    let sink = client
        .copy_in(
            "COPY hotels (id, name, city, country, stars, latitude, longitude, amenities) \
             FROM STDIN (FORMAT binary)",
        )
        .await
        .map_err(load_error)?;
    let types = [
        Type::INT8,
        Type::TEXT,
        Type::TEXT,
        Type::TEXT,
        Type::INT2,
        Type::FLOAT8,
        Type::FLOAT8,
        Type::TEXT_ARRAY,
    ];
    let mut writer = pin!(BinaryCopyInWriter::new(sink, &types));
    for id in plan.hotel_ids() {
        let hotel = plan.hotel(id);
        let city = &plan.cities[hotel.city];
        let row: [&(dyn ToSql + Sync); 8] = [
            &hotel.id,
            &hotel.name,
            &city.name,
            &city.country,
            &hotel.stars,
            &hotel.latitude,
            &hotel.longitude,
            &hotel.amenities,
        ];
        writer.as_mut().write(&row).await.map_err(load_error)?;
        progress.inc(1);
    }
    writer.finish().await.map_err(load_error)?;
    Ok(())
}

async fn copy_room_types(
    client: &Client,
    plan: &Plan,
    progress: &ProgressBar,
) -> Result<(), SeedError> {
    let load_error = |source| SeedError::Load {
        table: "room_types",
        source,
    };
    let sink = client
        .copy_in("COPY room_types (hotel_id, id, name, max_guests) FROM STDIN (FORMAT binary)")
        .await
        .map_err(load_error)?;
    let types = [Type::INT8, Type::INT8, Type::TEXT, Type::INT2];
    let mut writer = pin!(BinaryCopyInWriter::new(sink, &types));
    for id in plan.hotel_ids() {
        let hotel = plan.hotel(id);
        for room_type in &hotel.room_types {
            let row: [&(dyn ToSql + Sync); 4] = [
                &hotel.id,
                &room_type.id,
                &room_type.name,
                &room_type.max_guests,
            ];
            writer.as_mut().write(&row).await.map_err(load_error)?;
        }
        progress.inc(plan.room_types_per_hotel());
    }
    writer.finish().await.map_err(load_error)?;
    Ok(())
}

/// One COPY statement for the inventory of `hotels`. The rows are encoded by
/// hand into large chunks: this is the path 73 million rows take, and the
/// generic writer's per-value dispatch and 4 KiB messages cost more than the
/// generation itself.
async fn copy_inventory(
    client: &Client,
    plan: &Plan,
    hotels: Range<u64>,
    progress: &ProgressBar,
) -> Result<u64, SeedError> {
    let load_error = |source| SeedError::Load {
        table: "inventory",
        source,
    };
    let sink = client
        .copy_in(
            "COPY inventory (hotel_id, room_type_id, night, total, taken, sell_limit, price_cents) \
             FROM STDIN (FORMAT binary, FREEZE)",
        )
        .await
        .map_err(load_error)?;
    let mut sink = pin!(sink);
    let mut chunk = BytesMut::with_capacity(CHUNK_BYTES + INVENTORY_ROW_MAX_BYTES);
    chunk.put_slice(BINARY_COPY_HEADER);
    let mut chunk_rows = 0;
    let mut rows = 0;
    for hotel_id in hotels {
        let hotel = plan.hotel(hotel_id);
        for row in plan.inventory(&hotel) {
            encode_inventory_row(&mut chunk, &row);
            chunk_rows += 1;
            if chunk.len() >= CHUNK_BYTES {
                let full = std::mem::replace(
                    &mut chunk,
                    BytesMut::with_capacity(CHUNK_BYTES + INVENTORY_ROW_MAX_BYTES),
                );
                sink.send(full.freeze()).await.map_err(load_error)?;
                progress.inc(chunk_rows);
                rows += chunk_rows;
                chunk_rows = 0;
            }
        }
    }
    chunk.put_i16(-1);
    sink.send(chunk.freeze()).await.map_err(load_error)?;
    progress.inc(chunk_rows);
    rows += chunk_rows;
    let copied = sink.finish().await.map_err(load_error)?;
    debug_assert_eq!(copied, rows);
    Ok(rows)
}

/// `PGCOPY\n\377\r\n\0`, then no flags and no header extension.
const BINARY_COPY_HEADER: &[u8] = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";
const INVENTORY_ROW_MAX_BYTES: usize = 2 + 7 * 4 + 8 + 8 + 4 * 5;

/// One tuple of the binary COPY format: a field count, then each field as a
/// length (-1 for null) and its value in network byte order.
fn encode_inventory_row(out: &mut BytesMut, row: &InventoryRow) {
    out.put_i16(7);
    out.put_i32(8);
    out.put_i64(row.hotel_id);
    out.put_i32(8);
    out.put_i64(row.room_type_id);
    out.put_i32(4);
    out.put_i32(row.night);
    out.put_i32(4);
    out.put_i32(row.total);
    out.put_i32(4);
    out.put_i32(row.taken);
    match row.sell_limit {
        Some(limit) => {
            out.put_i32(4);
            out.put_i32(limit);
        }
        None => out.put_i32(-1),
    }
    out.put_i32(4);
    out.put_i32(row.price_cents);
}

fn progress_bar(enabled: bool, total_rows: u64) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total_rows), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{elapsed_precise} [{wide_bar}] {human_pos}/{human_len} rows, {per_sec}, eta {eta} {msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(Duration::from_millis(250));
    bar
}

// ---------------------------------------------------------------------------
// The generator: pure functions of the options, so tests can check them
// without a database and the loader can regenerate a hotel instead of storing it.

/// The options, validated, with what every hotel shares (cities, nights).
struct Plan {
    seed: u64,
    hotels: u32,
    room_types: u32,
    nights: Vec<Night>,
    cities: Vec<City>,
    /// Running sum of the cities' weights, for sampling a city.
    city_cumulative: Vec<f64>,
}

struct City {
    name: String,
    country: &'static str,
    latitude: f64,
    longitude: f64,
    /// How far hotels spread from the centre, in degrees of latitude.
    spread: f64,
    /// Price level: big destinations cost more.
    price_level: f64,
}

/// What every room type shares about one night.
struct Night {
    /// Days since 2000-01-01, PostgreSQL's binary `date`.
    pg_day: i32,
    /// Demand multiplier: season, weekday, and how far ahead the night is.
    demand: f64,
    /// Price multiplier: season and weekday.
    price: f64,
}

struct Hotel {
    id: i64,
    name: String,
    city: usize,
    stars: i16,
    latitude: f64,
    longitude: f64,
    amenities: Vec<&'static str>,
    /// Typical share of rooms sold on an average night.
    occupancy: f64,
    room_types: Vec<RoomType>,
}

struct RoomType {
    id: i64,
    name: String,
    max_guests: i16,
    total: i32,
    base_price: f64,
    /// How this room type sells compared with the hotel's average.
    demand: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct InventoryRow {
    hotel_id: i64,
    room_type_id: i64,
    night: i32,
    total: i32,
    taken: i32,
    sell_limit: Option<i32>,
    price_cents: i32,
}

/// Which random stream of a hotel: its profile and its nights are drawn
/// separately so that one can be regenerated without the other.
#[derive(Clone, Copy)]
enum Stream {
    Profile = 1,
    Inventory = 2,
}

impl Plan {
    fn new(options: &SeedOptions) -> Result<Plan, SeedError> {
        for (name, value) in [
            ("hotels", options.hotels),
            ("room-types", options.room_types),
            ("nights", options.nights),
        ] {
            if value == 0 {
                return Err(SeedError::Zero(name));
            }
        }
        let too_large = SeedError::TooLarge {
            hotels: options.hotels,
            room_types: options.room_types,
            nights: options.nights,
        };
        // Room type ids and row counts are carried as i64 (bigint) and u64.
        let rows = u64::from(options.hotels)
            .checked_mul(u64::from(options.room_types))
            .and_then(|n| n.checked_mul(u64::from(options.nights)))
            .filter(|&n| i64::try_from(n).is_ok());
        if rows.is_none() {
            return Err(too_large);
        }
        let nights = nights(options.start, options.nights).ok_or(SeedError::DateOutOfRange {
            start: options.start,
            nights: options.nights,
        })?;
        let cities = cities(city_count(options.hotels));
        let mut sum = 0.0;
        let city_cumulative = (0..cities.len())
            .map(|rank| {
                sum += zipf_weight(rank);
                sum
            })
            .collect();
        Ok(Plan {
            seed: options.seed,
            hotels: options.hotels,
            room_types: options.room_types,
            nights,
            cities,
            city_cumulative,
        })
    }

    fn hotel_count(&self) -> u64 {
        u64::from(self.hotels)
    }

    fn room_types_per_hotel(&self) -> u64 {
        u64::from(self.room_types)
    }

    fn night_count(&self) -> u64 {
        self.nights.len() as u64
    }

    fn hotel_ids(&self) -> Range<u64> {
        1..self.hotel_count() + 1
    }

    /// Consecutive hotel ranges covering every hotel, each holding about
    /// `rows_per_batch` inventory rows (at least one hotel).
    fn inventory_batches(&self, rows_per_batch: u64) -> impl Iterator<Item = Range<u64>> + use<> {
        let rows_per_hotel = self.room_types_per_hotel() * self.night_count();
        let per_batch = (rows_per_batch / rows_per_hotel).max(1);
        let end = self.hotel_count() + 1;
        (1..end)
            .step_by(usize::try_from(per_batch).unwrap_or(usize::MAX))
            .map(move |first| first..(first + per_batch).min(end))
    }

    /// A random stream owned by one hotel, independent of every other hotel's.
    fn rng(&self, hotel_id: u64, stream: Stream) -> ChaCha8Rng {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&self.seed.to_le_bytes());
        key[8..16].copy_from_slice(&hotel_id.to_le_bytes());
        key[16..24].copy_from_slice(&(stream as u64).to_le_bytes());
        key[24..].copy_from_slice(b"vacancy.");
        ChaCha8Rng::from_seed(key)
    }

    fn hotel(&self, hotel_id: u64) -> Hotel {
        let mut rng = self.rng(hotel_id, Stream::Profile);
        let drawn = rng.random::<f64>() * self.city_cumulative.last().copied().unwrap_or(0.0);
        let city_index = self
            .city_cumulative
            .partition_point(|&c| c <= drawn)
            .min(self.cities.len() - 1);
        let city = &self.cities[city_index];

        let stars = pick_weighted(&mut rng, &STAR_WEIGHTS) as i16 + 1;
        // Sum of three uniforms: a cheap bell shape around the centre.
        let bell = |rng: &mut ChaCha8Rng| {
            rng.random::<f64>() + rng.random::<f64>() + rng.random::<f64>() - 1.5
        };
        let latitude = (city.latitude + bell(&mut rng) * city.spread).clamp(-89.9, 89.9);
        let lon_scale = latitude.to_radians().cos().max(0.2);
        let mut longitude = city.longitude + bell(&mut rng) * city.spread / lon_scale;
        if longitude > 180.0 {
            longitude -= 360.0;
        } else if longitude < -180.0 {
            longitude += 360.0;
        }

        let name = hotel_name(&mut rng, &city.name, stars);
        let star_level = f64::from(stars - 1) / 4.0;
        let amenities = AMENITIES
            .iter()
            .filter(|a| rng.random::<f64>() < a.base + a.per_star_level * star_level)
            .map(|a| a.name)
            .collect();
        let occupancy = 0.45 + 0.4 * rng.random::<f64>();

        let kinds = room_kind_order(&mut rng, stars);
        let room_types = (0..self.room_types)
            .map(|k| {
                let kind = &ROOM_KINDS[kinds[k as usize % ROOM_KINDS.len()]];
                let round = k as usize / ROOM_KINDS.len();
                let name = match round {
                    0 => kind.name.to_string(),
                    r if r <= ROOM_VARIANTS.len() => {
                        format!("{}{}", kind.name, ROOM_VARIANTS[r - 1])
                    }
                    r => format!("{} {}", kind.name, r + 1),
                };
                let max_guests = rng.random_range(kind.guests.0..=kind.guests.1);
                // Cubing a uniform skews towards small: median about 7 units, a few near 50.
                let u: f64 = rng.random();
                let total = 1 + (50.0 * u * u * u).floor() as i32;
                let base_price = STAR_PRICE_CENTS[stars as usize - 1]
                    * kind.price
                    * city.price_level
                    * rng.random_range(0.85..1.15);
                RoomType {
                    id: i64::from(k) + 1,
                    name,
                    max_guests,
                    total,
                    base_price,
                    demand: rng.random_range(0.8..1.2),
                }
            })
            .collect();

        Hotel {
            id: hotel_id as i64,
            name,
            city: city_index,
            stars,
            latitude,
            longitude,
            amenities,
            occupancy,
            room_types,
        }
    }

    /// The hotel's rows in key order (room type, then night), which keeps the
    /// primary key's inserts at the right edge of the index.
    fn inventory<'a>(&'a self, hotel: &'a Hotel) -> impl Iterator<Item = InventoryRow> + 'a {
        let mut rng = self.rng(hotel.id as u64, Stream::Inventory);
        let nights = self.nights.len();
        (0..hotel.room_types.len() * nights).map(move |i| {
            night_row(
                &mut rng,
                hotel,
                &hotel.room_types[i / nights],
                &self.nights[i % nights],
            )
        })
    }
}

fn night_row(
    rng: &mut ChaCha8Rng,
    hotel: &Hotel,
    room_type: &RoomType,
    night: &Night,
) -> InventoryRow {
    let total = room_type.total;
    // About one night in twenty is oversold on purpose: the owner accepts more
    // bookings than rooms, expecting cancellations.
    let sell_limit =
        (rng.random::<f64>() < 0.05).then(|| total + 1 + rng.random_range(0..=total / 5));
    let cap = sell_limit.unwrap_or(total);
    let demand = hotel.occupancy * room_type.demand * night.demand;
    let noisy = demand + (rng.random::<f64>() - 0.5) * 0.5;
    // Demand above 1 fills the room type, and with a sell limit overfills it.
    let wanted = (noisy * f64::from(total) * 1.1).round();
    let taken = (wanted.max(0.0) as i32).min(cap);
    let price = room_type.base_price
        * night.price
        * (0.9 + 0.2 * demand.min(1.5))
        * rng.random_range(0.97..1.03);
    // Whole currency units, as rate sheets quote them.
    let price_cents = ((price / 100.0).round() * 100.0).clamp(100.0, f64::from(i32::MAX)) as i32;
    InventoryRow {
        hotel_id: hotel.id,
        room_type_id: room_type.id,
        night: night.pg_day,
        total,
        taken,
        sell_limit,
        price_cents,
    }
}

/// The nights from `start`, or `None` when the last one is not a storable date.
fn nights(start: NaiveDate, count: u32) -> Option<Vec<Night>> {
    let epoch = NaiveDate::from_ymd_opt(2000, 1, 1)?;
    start.checked_add_days(Days::new(u64::from(count) - 1))?;
    let mut nights = Vec::with_capacity(count as usize);
    for ahead in 0..count {
        let date = start.checked_add_days(Days::new(u64::from(ahead)))?;
        let pg_day = i32::try_from(date.signed_duration_since(epoch).num_days()).ok()?;
        // Peak in late July, trough in late January.
        let year_angle = f64::from(date.ordinal0()) / 365.0 * std::f64::consts::TAU;
        let mut season = 1.0 + 0.2 * (year_angle - 1.1 * std::f64::consts::PI).cos();
        let holidays =
            (date.month() == 12 && date.day() >= 20) || (date.month() == 1 && date.day() <= 2);
        if holidays {
            season += 0.2;
        }
        let (weekday_demand, weekday_price) = match date.weekday() {
            Weekday::Fri | Weekday::Sat => (1.15, 1.2),
            Weekday::Sun => (0.8, 0.9),
            _ => (1.0, 1.0),
        };
        // Nights far ahead have had less time to sell.
        let lead = 0.3 + 0.7 * (-f64::from(ahead) / 120.0).exp();
        nights.push(Night {
            pg_day,
            demand: season * weekday_demand * lead,
            price: season * weekday_price,
        });
    }
    Some(nights)
}

/// About one city per 50 hotels, and never fewer than 20 so that even a small
/// seed has a long tail.
fn city_count(hotels: u32) -> usize {
    (hotels as usize / 50).max(20)
}

/// Zipf with exponent 1: the largest city has twice the hotels of the second.
fn zipf_weight(rank: usize) -> f64 {
    1.0 / (rank as f64 + 1.0)
}

/// The first `count` cities by size: the real ones, then invented towns near
/// them once the list runs out.
fn cities(count: usize) -> Vec<City> {
    (0..count)
        .map(|rank| {
            let (name, country, latitude, longitude) = if rank < REAL_CITIES.len() {
                let (name, country, lat, lon) = REAL_CITIES[rank];
                (name.to_string(), country, lat, lon)
            } else {
                let n = rank - REAL_CITIES.len();
                let (_, country, lat, lon) = REAL_CITIES[n % REAL_CITIES.len()];
                let prefix = TOWN_PREFIXES[n % TOWN_PREFIXES.len()];
                let suffix = TOWN_SUFFIXES[(n / TOWN_PREFIXES.len()) % TOWN_SUFFIXES.len()];
                let cycle = n / (TOWN_PREFIXES.len() * TOWN_SUFFIXES.len());
                let name = if cycle == 0 {
                    format!("{prefix}{suffix}")
                } else {
                    format!("{prefix}{suffix} {}", cycle + 1)
                };
                // A fixed offset from the anchor city, away from its centre.
                let angle = n as f64 * 2.399;
                let distance = 0.8 + (n % 7) as f64 * 0.3;
                (
                    name,
                    country,
                    (lat + distance * angle.sin()).clamp(-80.0, 80.0),
                    lon + distance * angle.cos(),
                )
            };
            let size = 1.0 / (rank as f64 + 1.0).sqrt();
            City {
                name,
                country,
                latitude,
                longitude,
                spread: 0.015 + 0.06 * size,
                price_level: 0.85 + 0.45 * size,
            }
        })
        .collect()
}

fn pick_weighted(rng: &mut ChaCha8Rng, weights: &[u32]) -> usize {
    let total: u32 = weights.iter().sum();
    let mut drawn = rng.random_range(0..total);
    for (index, &weight) in weights.iter().enumerate() {
        if drawn < weight {
            return index;
        }
        drawn -= weight;
    }
    weights.len() - 1
}

fn hotel_name(rng: &mut ChaCha8Rng, city: &str, stars: i16) -> String {
    let adjective = NAME_ADJECTIVES[rng.random_range(0..NAME_ADJECTIVES.len())];
    let noun = NAME_NOUNS[rng.random_range(0..NAME_NOUNS.len())];
    let kind = if stars <= 2 {
        BUDGET_KINDS[rng.random_range(0..BUDGET_KINDS.len())]
    } else {
        HOTEL_KINDS[rng.random_range(0..HOTEL_KINDS.len())]
    };
    match rng.random_range(0..5) {
        0 => format!("{adjective} {noun} {kind}"),
        1 => format!("{kind} {noun}"),
        2 => format!("{city} {adjective} {kind}"),
        3 => format!("The {noun}"),
        _ => format!("{noun} {kind} {city}"),
    }
}

/// Share of hotels with 1 to 5 stars.
const STAR_WEIGHTS: [u32; 5] = [8, 17, 38, 27, 10];

/// A double room's typical nightly rate by stars, in cents.
const STAR_PRICE_CENTS: [f64; 5] = [5_500.0, 7_500.0, 11_000.0, 16_500.0, 30_000.0];

struct Amenity {
    name: &'static str,
    base: f64,
    per_star_level: f64,
}

#[rustfmt::skip]
const AMENITIES: [Amenity; 14] = [
    Amenity { name: "wifi", base: 0.9, per_star_level: 0.1 },
    Amenity { name: "parking", base: 0.4, per_star_level: 0.3 },
    Amenity { name: "breakfast", base: 0.45, per_star_level: 0.45 },
    Amenity { name: "air_conditioning", base: 0.4, per_star_level: 0.5 },
    Amenity { name: "pets", base: 0.25, per_star_level: 0.0 },
    Amenity { name: "restaurant", base: 0.15, per_star_level: 0.75 },
    Amenity { name: "bar", base: 0.2, per_star_level: 0.65 },
    Amenity { name: "gym", base: 0.05, per_star_level: 0.75 },
    Amenity { name: "pool", base: 0.05, per_star_level: 0.55 },
    Amenity { name: "spa", base: 0.0, per_star_level: 0.6 },
    Amenity { name: "airport_shuttle", base: 0.05, per_star_level: 0.3 },
    Amenity { name: "accessible", base: 0.3, per_star_level: 0.5 },
    Amenity { name: "ev_charging", base: 0.05, per_star_level: 0.25 },
    Amenity { name: "family_rooms", base: 0.35, per_star_level: 0.2 },
];

struct RoomKind {
    name: &'static str,
    guests: (i16, i16),
    /// Price relative to a double room.
    price: f64,
    /// How often hotels offer it, before the stars shift the odds.
    weight: f64,
    tier: Tier,
}

/// Who offers a room kind: a hostel has dormitory beds and no penthouse.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tier {
    Budget,
    Standard,
    Luxury,
}

#[rustfmt::skip]
const ROOM_KINDS: [RoomKind; 16] = [
    RoomKind { name: "Double", guests: (2, 2), price: 1.0, weight: 10.0, tier: Tier::Standard },
    RoomKind { name: "Twin", guests: (2, 2), price: 1.0, weight: 8.0, tier: Tier::Standard },
    RoomKind { name: "Single", guests: (1, 1), price: 0.75, weight: 6.0, tier: Tier::Standard },
    RoomKind { name: "Family", guests: (3, 5), price: 1.6, weight: 4.0, tier: Tier::Standard },
    RoomKind { name: "Triple", guests: (3, 3), price: 1.3, weight: 3.0, tier: Tier::Standard },
    RoomKind { name: "Studio", guests: (2, 3), price: 1.2, weight: 2.0, tier: Tier::Standard },
    RoomKind { name: "Quadruple", guests: (4, 4), price: 1.5, weight: 1.5, tier: Tier::Standard },
    RoomKind { name: "Apartment", guests: (4, 6), price: 2.0, weight: 1.5, tier: Tier::Standard },
    RoomKind { name: "Economy Double", guests: (2, 2), price: 0.85, weight: 2.0, tier: Tier::Budget },
    RoomKind { name: "Bed in Dormitory", guests: (1, 1), price: 0.35, weight: 1.5, tier: Tier::Budget },
    RoomKind { name: "Deluxe Double", guests: (2, 2), price: 1.35, weight: 3.0, tier: Tier::Luxury },
    RoomKind { name: "Superior Twin", guests: (2, 2), price: 1.25, weight: 2.5, tier: Tier::Luxury },
    RoomKind { name: "Junior Suite", guests: (2, 3), price: 1.8, weight: 2.0, tier: Tier::Luxury },
    RoomKind { name: "Suite", guests: (2, 4), price: 2.4, weight: 2.0, tier: Tier::Luxury },
    RoomKind { name: "Executive Suite", guests: (2, 4), price: 3.0, weight: 1.0, tier: Tier::Luxury },
    RoomKind { name: "Penthouse", guests: (4, 6), price: 4.0, weight: 0.5, tier: Tier::Luxury },
];

/// The room kinds in the order this hotel offers them (a weighted shuffle:
/// common kinds tend to come first, and the stars favour their own tier), so
/// a hotel with four room types usually has a double, but not always.
fn room_kind_order(rng: &mut ChaCha8Rng, stars: i16) -> [usize; ROOM_KINDS.len()] {
    let mut keyed = [(0.0, 0); ROOM_KINDS.len()];
    for (index, kind) in ROOM_KINDS.iter().enumerate() {
        let tier_odds = match (kind.tier, stars) {
            (Tier::Budget, 1..=2) | (Tier::Luxury, 4..=5) => 3.0,
            (Tier::Budget, 4..=5) | (Tier::Luxury, 1..=2) => 0.1,
            _ => 1.0,
        };
        // Efraimidis-Spirakis: sorting by u^(1/w) samples without replacement by weight.
        let u: f64 = rng.random();
        keyed[index] = (u.powf(1.0 / (kind.weight * tier_odds)), index);
    }
    keyed.sort_by(|a, b| b.0.total_cmp(&a.0));
    keyed.map(|(_, index)| index)
}

/// Names for the second and later rounds through `ROOM_KINDS`.
const ROOM_VARIANTS: [&str; 5] = [
    " with Balcony",
    " - Sea View",
    " - City View",
    " - Garden View",
    " - Accessible",
];

const NAME_ADJECTIVES: [&str; 16] = [
    "Grand",
    "Royal",
    "Golden",
    "Old Town",
    "Park",
    "Riverside",
    "Central",
    "Imperial",
    "Blue",
    "Silver",
    "Little",
    "Harbour",
    "Sunset",
    "Boutique",
    "Green",
    "Crown",
];

const NAME_NOUNS: [&str; 20] = [
    "Palace",
    "Garden",
    "Plaza",
    "Tower",
    "Astoria",
    "Continental",
    "Metropole",
    "Belvedere",
    "Regina",
    "Bristol",
    "Savoy",
    "Majestic",
    "Ambassador",
    "Victoria",
    "Excelsior",
    "Bellevue",
    "Europa",
    "Splendid",
    "Panorama",
    "Marina",
];

const HOTEL_KINDS: [&str; 6] = [
    "Hotel",
    "Suites",
    "Resort",
    "Residence",
    "Hotel & Spa",
    "Lodge",
];

const BUDGET_KINDS: [&str; 5] = ["Inn", "Hostel", "Guesthouse", "B&B", "Rooms"];

const TOWN_PREFIXES: [&str; 16] = [
    "Ash", "Bel", "Cor", "Dun", "Els", "Fal", "Glen", "Hal", "Kings", "Lin", "Mar", "Nor", "Ost",
    "Port", "Ros", "Val",
];

const TOWN_SUFFIXES: [&str; 12] = [
    "bury", "ford", "haven", "mont", "wick", "field", "stead", "mouth", "ton", "dale", "brook",
    "ville",
];

/// Tourist cities, roughly from the most hotels to the fewest: name, country,
/// latitude, longitude of the centre.
const REAL_CITIES: [(&str, &str, f64, f64); 120] = [
    ("London", "United Kingdom", 51.5074, -0.1278),
    ("Paris", "France", 48.8566, 2.3522),
    ("New York", "United States", 40.7128, -74.0060),
    ("Tokyo", "Japan", 35.6762, 139.6503),
    ("Barcelona", "Spain", 41.3874, 2.1686),
    ("Rome", "Italy", 41.9028, 12.4964),
    ("Istanbul", "Türkiye", 41.0082, 28.9784),
    ("Dubai", "United Arab Emirates", 25.2048, 55.2708),
    ("Bangkok", "Thailand", 13.7563, 100.5018),
    ("Amsterdam", "Netherlands", 52.3676, 4.9041),
    ("Berlin", "Germany", 52.5200, 13.4050),
    ("Madrid", "Spain", 40.4168, -3.7038),
    ("Prague", "Czechia", 50.0755, 14.4378),
    ("Vienna", "Austria", 48.2082, 16.3738),
    ("Lisbon", "Portugal", 38.7223, -9.1393),
    ("Singapore", "Singapore", 1.3521, 103.8198),
    ("Los Angeles", "United States", 34.0522, -118.2437),
    ("Milan", "Italy", 45.4642, 9.1900),
    ("Venice", "Italy", 45.4408, 12.3155),
    ("Florence", "Italy", 43.7696, 11.2558),
    ("Munich", "Germany", 48.1351, 11.5820),
    ("Budapest", "Hungary", 47.4979, 19.0402),
    ("Athens", "Greece", 37.9838, 23.7275),
    ("Dublin", "Ireland", 53.3498, -6.2603),
    ("Edinburgh", "United Kingdom", 55.9533, -3.1883),
    ("Copenhagen", "Denmark", 55.6761, 12.5683),
    ("Stockholm", "Sweden", 59.3293, 18.0686),
    ("Hong Kong", "China", 22.3193, 114.1694),
    ("Seoul", "South Korea", 37.5665, 126.9780),
    ("Kyoto", "Japan", 35.0116, 135.7681),
    ("Sydney", "Australia", -33.8688, 151.2093),
    ("Miami", "United States", 25.7617, -80.1918),
    ("Las Vegas", "United States", 36.1699, -115.1398),
    ("San Francisco", "United States", 37.7749, -122.4194),
    ("Chicago", "United States", 41.8781, -87.6298),
    ("Toronto", "Canada", 43.6532, -79.3832),
    ("Mexico City", "Mexico", 19.4326, -99.1332),
    ("Cancún", "Mexico", 21.1619, -86.8515),
    ("Rio de Janeiro", "Brazil", -22.9068, -43.1729),
    ("Buenos Aires", "Argentina", -34.6037, -58.3816),
    ("Marrakesh", "Morocco", 31.6295, -7.9811),
    ("Cape Town", "South Africa", -33.9249, 18.4241),
    ("Bali", "Indonesia", -8.6705, 115.2126),
    ("Kuala Lumpur", "Malaysia", 3.1390, 101.6869),
    ("Osaka", "Japan", 34.6937, 135.5023),
    ("Seville", "Spain", 37.3891, -5.9845),
    ("Porto", "Portugal", 41.1579, -8.6291),
    ("Nice", "France", 43.7102, 7.2620),
    ("Kraków", "Poland", 50.0647, 19.9450),
    ("Zürich", "Switzerland", 47.3769, 8.5417),
    ("Brussels", "Belgium", 50.8503, 4.3517),
    ("Oslo", "Norway", 59.9139, 10.7522),
    ("Helsinki", "Finland", 60.1699, 24.9384),
    ("Valencia", "Spain", 39.4699, -0.3763),
    ("Naples", "Italy", 40.8518, 14.2681),
    ("Málaga", "Spain", 36.7213, -4.4214),
    ("Palma", "Spain", 39.5696, 2.6502),
    ("Dubrovnik", "Croatia", 42.6507, 18.0944),
    ("Reykjavík", "Iceland", 64.1466, -21.9426),
    ("Vancouver", "Canada", 49.2827, -123.1207),
    ("Montreal", "Canada", 45.5017, -73.5673),
    ("Boston", "United States", 42.3601, -71.0589),
    ("Washington", "United States", 38.9072, -77.0369),
    ("Orlando", "United States", 28.5383, -81.3792),
    ("Honolulu", "United States", 21.3069, -157.8583),
    ("Melbourne", "Australia", -37.8136, 144.9631),
    ("Auckland", "New Zealand", -36.8485, 174.7633),
    ("Taipei", "Taiwan", 25.0330, 121.5654),
    ("Shanghai", "China", 31.2304, 121.4737),
    ("Beijing", "China", 39.9042, 116.4074),
    ("Hanoi", "Vietnam", 21.0278, 105.8342),
    ("Ho Chi Minh City", "Vietnam", 10.8231, 106.6297),
    ("Phuket", "Thailand", 7.8804, 98.3923),
    ("Chiang Mai", "Thailand", 18.7883, 98.9853),
    ("Mumbai", "India", 19.0760, 72.8777),
    ("Delhi", "India", 28.7041, 77.1025),
    ("Tel Aviv", "Israel", 32.0853, 34.7818),
    ("Abu Dhabi", "United Arab Emirates", 24.4539, 54.3773),
    ("Doha", "Qatar", 25.2854, 51.5310),
    ("Cairo", "Egypt", 30.0444, 31.2357),
    ("Lima", "Peru", -12.0464, -77.0428),
    ("Bogotá", "Colombia", 4.7110, -74.0721),
    ("São Paulo", "Brazil", -23.5558, -46.6396),
    ("Lyon", "France", 45.7640, 4.8357),
    ("Marseille", "France", 43.2965, 5.3698),
    ("Bordeaux", "France", 44.8378, -0.5792),
    ("Hamburg", "Germany", 53.5511, 9.9937),
    ("Cologne", "Germany", 50.9375, 6.9603),
    ("Frankfurt", "Germany", 50.1109, 8.6821),
    ("Salzburg", "Austria", 47.8095, 13.0550),
    ("Innsbruck", "Austria", 47.2692, 11.4041),
    ("Geneva", "Switzerland", 46.2044, 6.1432),
    ("Bologna", "Italy", 44.4949, 11.3426),
    ("Verona", "Italy", 45.4384, 10.9916),
    ("Palermo", "Italy", 38.1157, 13.3615),
    ("Granada", "Spain", 37.1773, -3.5986),
    ("Ibiza", "Spain", 38.9067, 1.4206),
    ("Split", "Croatia", 43.5081, 16.4402),
    ("Santorini", "Greece", 36.3932, 25.4615),
    ("Mykonos", "Greece", 37.4467, 25.3289),
    ("Valletta", "Malta", 35.8989, 14.5146),
    ("Bruges", "Belgium", 51.2093, 3.2247),
    ("Rotterdam", "Netherlands", 51.9244, 4.4777),
    ("Warsaw", "Poland", 52.2297, 21.0122),
    ("Tallinn", "Estonia", 59.4370, 24.7536),
    ("Riga", "Latvia", 56.9496, 24.1052),
    ("Vilnius", "Lithuania", 54.6872, 25.2797),
    ("Ljubljana", "Slovenia", 46.0569, 14.5058),
    ("Bratislava", "Slovakia", 48.1486, 17.1077),
    ("Belgrade", "Serbia", 44.7866, 20.4489),
    ("Bucharest", "Romania", 44.4268, 26.1025),
    ("Sofia", "Bulgaria", 42.6977, 23.3219),
    ("Tbilisi", "Georgia", 41.7151, 44.8271),
    ("Bergen", "Norway", 60.3913, 5.3221),
    ("Gothenburg", "Sweden", 57.7089, 11.9746),
    ("Seattle", "United States", 47.6062, -122.3321),
    ("New Orleans", "United States", 29.9511, -90.0715),
    ("Quebec City", "Canada", 46.8139, -71.2080),
    ("Queenstown", "New Zealand", -45.0312, 168.6626),
    ("Zanzibar", "Tanzania", -6.1659, 39.2026),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn options(hotels: u32, room_types: u32, nights: u32) -> SeedOptions {
        SeedOptions {
            owner_url: String::new(),
            hotels,
            room_types,
            nights,
            start: NaiveDate::from_ymd_opt(2025, 6, 1).unwrap(),
            seed: 7,
            progress: false,
        }
    }

    #[test]
    fn batches_cover_every_hotel_once_in_order() {
        let plan = Plan::new(&options(1001, 3, 10)).unwrap();
        for rows_per_batch in [1, 29, 30, 31, 299, 30_000, u64::MAX] {
            let ids: Vec<u64> = plan.inventory_batches(rows_per_batch).flatten().collect();
            assert_eq!(
                ids,
                (1..=1001).collect::<Vec<_>>(),
                "batch size {rows_per_batch}"
            );
        }
    }

    #[test]
    fn generated_rows_respect_the_schema() {
        let plan = Plan::new(&options(300, 20, 60)).unwrap();
        let mut rows = 0;
        for id in plan.hotel_ids() {
            let hotel = plan.hotel(id);
            assert!((1..=5).contains(&hotel.stars));
            assert_eq!(hotel.room_types.len(), 20);
            for room_type in &hotel.room_types {
                assert!((1..=6).contains(&room_type.max_guests));
                assert!((1..=50).contains(&room_type.total));
            }
            for row in plan.inventory(&hotel) {
                assert!(row.total >= 0 && row.taken >= 0);
                assert!(row.taken <= row.sell_limit.unwrap_or(row.total));
                assert!(row.sell_limit.is_none_or(|l| l > row.total));
                assert!(row.price_cents >= 100);
                rows += 1;
            }
        }
        assert_eq!(rows, 300 * 20 * 60);
    }

    #[test]
    fn a_hotel_is_the_same_whenever_it_is_generated() {
        let plan = Plan::new(&options(50, 4, 30)).unwrap();
        let again = Plan::new(&options(50, 4, 30)).unwrap();
        let a = plan.hotel(17);
        let b = again.hotel(17);
        assert_eq!((a.name, a.city, a.stars), (b.name, b.city, b.stars));
        let rows_a: Vec<_> = plan.inventory(&plan.hotel(17)).collect();
        let rows_b: Vec<_> = again.inventory(&again.hotel(17)).collect();
        assert_eq!(rows_a, rows_b);
    }

    #[test]
    fn many_cities_get_invented_names_without_repeats() {
        let all = cities(1000);
        let mut names: Vec<&str> = all.iter().map(|c| c.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 1000);
    }

    #[test]
    fn bad_options_are_typed_errors() {
        assert!(matches!(
            Plan::new(&options(0, 1, 1)),
            Err(SeedError::Zero("hotels"))
        ));
        assert!(matches!(
            Plan::new(&options(1, 0, 1)),
            Err(SeedError::Zero("room-types"))
        ));
        assert!(matches!(
            Plan::new(&options(1, 1, 0)),
            Err(SeedError::Zero("nights"))
        ));
        assert!(matches!(
            Plan::new(&options(u32::MAX, u32::MAX, u32::MAX)),
            Err(SeedError::TooLarge { .. })
        ));
        let mut late = options(1, 1, 10);
        late.start = NaiveDate::MAX;
        assert!(matches!(
            Plan::new(&late),
            Err(SeedError::DateOutOfRange { .. })
        ));
    }

    #[test]
    fn encoded_row_has_the_binary_copy_layout() {
        let mut out = BytesMut::new();
        let row = InventoryRow {
            hotel_id: 1,
            room_type_id: 2,
            night: 3,
            total: 4,
            taken: 5,
            sell_limit: None,
            price_cents: 6,
        };
        encode_inventory_row(&mut out, &row);
        assert_eq!(out.len(), INVENTORY_ROW_MAX_BYTES - 4);
        encode_inventory_row(
            &mut out,
            &InventoryRow {
                sell_limit: Some(7),
                ..row
            },
        );
        assert_eq!(out.len(), 2 * INVENTORY_ROW_MAX_BYTES - 4);
        assert_eq!(&out[..2], &7i16.to_be_bytes());
        assert_eq!(BINARY_COPY_HEADER.len(), 19);
    }
}

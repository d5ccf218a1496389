//! Snapshot: the copy's starting state, read inside the snapshot the slot
//! exported, so the stream continues exactly where the copy ends (no gap, no
//! overlap).
//!
//! The exported snapshot lives only until the replication connection runs
//! its next command, so it is imported first and everything else follows.
//! Rows come through binary COPY, the owner's cheapest way to hand them out.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Instant;

use futures_util::{StreamExt, pin_mut};
use tokio_postgres::Client;
use tokio_postgres::binary_copy::BinaryCopyOutStream;
use tokio_postgres::types::Type;

use crate::lsn::Lsn;
use crate::model::{CalendarKey, Change, Hotel, NightCounts, RoomType, Tables};

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot read failed: {0}")]
    Query(#[from] tokio_postgres::Error),
    #[error("the exported snapshot name {0:?} is not one PostgreSQL makes")]
    BadName(String),
    #[error("slot {0:?} vanished while its snapshot was read")]
    SlotVanished(String),
    #[error("the owner returned an LSN that does not parse: {0}")]
    BadLsn(#[from] crate::lsn::ParseLsnError),
    #[error(transparent)]
    Apply(#[from] crate::model::ApplyError),
}

/// Where a snapshot load stands, for `/v1/status`, the log and the metrics.
#[derive(Debug, Default)]
pub struct SnapshotProgress {
    phase: AtomicU8,
    pub rows_loaded: AtomicU64,
    pub rows_expected: AtomicU64,
    /// Snapshot loads completed since start (the first is the initial one).
    pub loads: AtomicU64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotPhase {
    NotStarted,
    Loading,
    Loaded,
}

impl SnapshotProgress {
    pub fn phase(&self) -> SnapshotPhase {
        match self.phase.load(Ordering::Acquire) {
            1 => SnapshotPhase::Loading,
            2 => SnapshotPhase::Loaded,
            _ => SnapshotPhase::NotStarted,
        }
    }

    fn set_phase(&self, phase: SnapshotPhase) {
        self.phase.store(phase as u8, Ordering::Release);
    }

    /// 0.0 to 1.0; an estimate while loading (the planner's row counts).
    pub fn fraction(&self) -> f64 {
        match self.phase() {
            SnapshotPhase::Loaded => 1.0,
            SnapshotPhase::NotStarted => 0.0,
            SnapshotPhase::Loading => {
                let expected = self.rows_expected.load(Ordering::Relaxed).max(1) as f64;
                (self.rows_loaded.load(Ordering::Relaxed) as f64 / expected).min(0.99)
            }
        }
    }
}

fn valid_snapshot_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
}

/// Reads the three tables inside the exported snapshot `snapshot_name` of
/// `slot`. The result's `applied` is the slot's consistent point.
pub async fn load(
    client: &mut Client,
    snapshot_name: &str,
    slot: &str,
    schema: &str,
    progress: &SnapshotProgress,
) -> Result<Tables, SnapshotError> {
    if !valid_snapshot_name(snapshot_name) {
        return Err(SnapshotError::BadName(snapshot_name.to_string()));
    }
    progress.set_phase(SnapshotPhase::Loading);
    progress.rows_loaded.store(0, Ordering::Relaxed);
    let started = Instant::now();
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    tx.batch_execute(&format!("SET TRANSACTION SNAPSHOT '{snapshot_name}'"))
        .await?;
    // A fresh slot's confirmed_flush_lsn is its consistent point: the first
    // commit the stream delivers lies at or past it.
    let consistent: Option<String> = tx
        .query_opt(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .and_then(|r| r.get(0));
    let consistent: Lsn = consistent
        .ok_or_else(|| SnapshotError::SlotVanished(slot.to_string()))?
        .parse()?;
    let expected: f64 = tx
        .query_one(
            "SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::float8 FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname IN ('hotels', 'room_types', 'inventory')",
            &[&schema],
        )
        .await?
        .get(0);
    progress
        .rows_expected
        .store(expected as u64, Ordering::Relaxed);

    let mut tables = Tables::default();
    let mut ticker = Ticker::new(started);

    let copy = tx
        .copy_out(&format!(
            "COPY {schema}.hotels (id, name, city, country, stars, latitude, longitude, amenities) TO STDOUT (FORMAT binary)"
        ))
        .await?;
    let rows = BinaryCopyOutStream::new(
        copy,
        &[
            Type::INT8,
            Type::TEXT,
            Type::TEXT,
            Type::TEXT,
            Type::INT2,
            Type::FLOAT8,
            Type::FLOAT8,
            Type::TEXT_ARRAY,
        ],
    );
    pin_mut!(rows);
    while let Some(row) = rows.next().await {
        let row = row?;
        let hotel = Hotel {
            id: row.try_get(0)?,
            name: row.try_get(1)?,
            city: row.try_get(2)?,
            country: row.try_get(3)?,
            stars: row.try_get(4)?,
            latitude: row.try_get(5)?,
            longitude: row.try_get(6)?,
            amenities: row
                .try_get::<Vec<Option<String>>>(7)?
                .into_iter()
                .flatten()
                .collect(),
        };
        tables.hotels.insert(hotel.id, hotel);
        ticker.row(progress);
    }

    let copy = tx
        .copy_out(&format!(
            "COPY {schema}.room_types (hotel_id, id, name, max_guests) TO STDOUT (FORMAT binary)"
        ))
        .await?;
    let rows = BinaryCopyOutStream::new(copy, &[Type::INT8, Type::INT8, Type::TEXT, Type::INT2]);
    pin_mut!(rows);
    while let Some(row) = rows.next().await {
        let row = row?;
        let room_type = RoomType {
            hotel_id: row.try_get(0)?,
            id: row.try_get(1)?,
            name: row.try_get(2)?,
            max_guests: row.try_get(3)?,
        };
        tables.room_types.insert(
            CalendarKey {
                hotel_id: room_type.hotel_id,
                room_type_id: room_type.id,
            },
            room_type,
        );
        ticker.row(progress);
    }

    let copy = tx
        .copy_out(&format!(
            "COPY {schema}.inventory (hotel_id, room_type_id, night, total, taken, sell_limit, price_cents) TO STDOUT (FORMAT binary)"
        ))
        .await?;
    let rows = BinaryCopyOutStream::new(
        copy,
        &[
            Type::INT8,
            Type::INT8,
            Type::DATE,
            Type::INT4,
            Type::INT4,
            Type::INT4,
            Type::INT4,
        ],
    );
    pin_mut!(rows);
    while let Some(row) = rows.next().await {
        let row = row?;
        let change = Change::UpsertNight {
            key: CalendarKey {
                hotel_id: row.try_get(0)?,
                room_type_id: row.try_get(1)?,
            },
            night: row.try_get(2)?,
            counts: NightCounts {
                total: row.try_get(3)?,
                taken: row.try_get(4)?,
                sell_limit: row.try_get(5)?,
                price_cents: row.try_get(6)?,
            },
        };
        tables.apply_change(&change)?;
        ticker.row(progress);
    }
    tx.commit().await?;
    ticker.finish(progress);
    for calendar in tables.calendars.values_mut() {
        calendar.shrink();
    }
    tables.applied = consistent;
    progress.set_phase(SnapshotPhase::Loaded);
    progress.loads.fetch_add(1, Ordering::Relaxed);
    let rows = progress.rows_loaded.load(Ordering::Relaxed);
    let secs = started.elapsed().as_secs_f64();
    tracing::info!(
        rows,
        seconds = secs,
        rows_per_second = (rows as f64 / secs.max(1e-9)) as u64,
        consistent_point = %consistent,
        "snapshot loaded"
    );
    Ok(tables)
}

/// Counts rows and logs progress about once a second.
struct Ticker {
    started: Instant,
    last_log: Instant,
    pending: u64,
}

impl Ticker {
    fn new(started: Instant) -> Ticker {
        Ticker {
            started,
            last_log: started,
            pending: 0,
        }
    }

    /// Publishes the rows counted since the last publish.
    fn finish(&mut self, progress: &SnapshotProgress) {
        progress
            .rows_loaded
            .fetch_add(self.pending, Ordering::Relaxed);
        crate::metrics::SNAPSHOT_ROWS.inc_by(self.pending);
        self.pending = 0;
    }

    fn row(&mut self, progress: &SnapshotProgress) {
        self.pending += 1;
        // Publishing per row would make the hot loop contend on one atomic.
        if self.pending == 4096 {
            let loaded = progress
                .rows_loaded
                .fetch_add(self.pending, Ordering::Relaxed)
                + self.pending;
            crate::metrics::SNAPSHOT_ROWS.inc_by(self.pending);
            self.pending = 0;
            if self.last_log.elapsed().as_secs() >= 1 {
                self.last_log = Instant::now();
                let secs = self.started.elapsed().as_secs_f64().max(1e-9);
                tracing::info!(
                    rows = loaded,
                    rows_per_second = (loaded as f64 / secs) as u64,
                    percent = (progress.fraction() * 100.0).round(),
                    "snapshot loading"
                );
            }
        }
    }
}

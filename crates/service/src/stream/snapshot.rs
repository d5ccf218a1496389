//! Snapshot: the copy's starting state, read inside the snapshot the slot
//! exported, so the stream continues exactly where the copy ends (no gap, no
//! overlap).
//!
//! The exported snapshot lives only until the replication connection runs
//! its next command, so it is imported first and everything else follows.
//! Rows come through binary COPY, the owner's cheapest way to hand them out.

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Instant;

use fallible_iterator::FallibleIterator;
use futures_util::StreamExt;
use tokio_postgres::binary_copy::BinaryCopyOutStream;
use tokio_postgres::types::{FromSql, PgLsn, Type};
use tokio_postgres::{Client, Transaction};

use crate::lsn::Lsn;
use crate::metrics;
use crate::model::calendar::{Calendar, holds_night};
use crate::model::{ApplyError, CalendarKey, Calendars, Hotel, NightCounts, RoomType, Tables};

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot read failed: {0}")]
    Query(#[from] tokio_postgres::Error),
    #[error("the exported snapshot name {0:?} is not one PostgreSQL makes")]
    BadName(String),
    #[error("slot {0:?} vanished while its snapshot was read")]
    SlotVanished(String),
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error("the inventory COPY stream is malformed: {0}")]
    BadCopy(&'static str),
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

    /// The copy was loaded from a checkpoint: loaded, with no row read
    /// from the owner (`loads` counts snapshots only, and stays).
    pub(crate) fn loaded_from_checkpoint(&self) {
        self.rows_loaded.store(0, Ordering::Relaxed);
        self.rows_expected.store(0, Ordering::Relaxed);
        self.set_phase(SnapshotPhase::Loaded);
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

/// Lays out one hotel's gathered calendars in the copy and returns the
/// emptied scratch calendars for the next hotel.
fn lay_out(
    calendars: &mut Calendars,
    hotel_id: i64,
    gathered: &mut Vec<(i64, Calendar)>,
    spare: &mut Vec<Calendar>,
) {
    calendars.insert_hotel(hotel_id, gathered);
    for (_, mut c) in gathered.drain(..) {
        c.clear();
        spare.push(c);
    }
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
    let tx = import_snapshot(client, snapshot_name).await?;
    let consistent = consistent_point(&tx, slot).await?;
    let expected = expected_rows(&tx, schema).await?;
    progress
        .rows_expected
        .store(expected as u64, Ordering::Relaxed);

    let mut tables = Tables::default();
    let mut ticker = Ticker::new(started);
    copy_hotels(&tx, schema, &mut tables, &mut ticker, progress).await?;
    copy_room_types(&tx, schema, &mut tables, &mut ticker, progress).await?;
    copy_inventory(&tx, schema, &mut tables.calendars, &mut ticker, progress).await?;
    tx.commit().await?;
    ticker.finish(progress);
    tables.calendars.shrink();
    tables.applied = consistent;
    tables.epoch = consistent.0;
    progress.set_phase(SnapshotPhase::Loaded);
    progress.loads.fetch_add(1, Ordering::Relaxed);
    log_loaded(progress, started, consistent);
    Ok(tables)
}

/// A read-only repeatable-read transaction that sees exactly the exported
/// snapshot `snapshot_name` (checked by the caller to be a snapshot name).
async fn import_snapshot<'c>(
    client: &'c mut Client,
    snapshot_name: &str,
) -> Result<Transaction<'c>, SnapshotError> {
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    tx.batch_execute(&format!("SET TRANSACTION SNAPSHOT '{snapshot_name}'"))
        .await?;
    // The session's setup statements are bounded (`statement_timeout`,
    // set by the projector); the load is not: copying 73M rows takes
    // minutes. A path that goes dark meanwhile is noticed by the
    // connection's TCP keepalives instead. Its wait for a table's lock
    // keeps that bound: a transaction that took `ACCESS EXCLUSIVE` after
    // the slot was made (an `ALTER TABLE`, a `TRUNCATE`) and stays open
    // would otherwise hold the load, silently, for as long as it lives;
    // this way the session ends with the error and the next one retries.
    tx.batch_execute(
        "SELECT set_config('lock_timeout', current_setting('statement_timeout'), true);
         SET LOCAL statement_timeout = 0",
    )
    .await?;
    Ok(tx)
}

/// The slot's consistent point. A fresh slot's confirmed_flush_lsn is its
/// consistent point: the first commit the stream delivers lies at or past it.
async fn consistent_point(tx: &Transaction<'_>, slot: &str) -> Result<Lsn, SnapshotError> {
    let confirmed_flush: Option<PgLsn> = tx
        .query_opt(
            "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .and_then(|r| r.get(0));
    confirmed_flush
        .map(Lsn::from)
        .ok_or_else(|| SnapshotError::SlotVanished(slot.to_string()))
}

/// Rows the three tables hold by the planner's estimate, for the progress.
async fn expected_rows(tx: &Transaction<'_>, schema: &str) -> Result<f64, SnapshotError> {
    Ok(tx
        .query_one(
            "SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::float8 FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname IN ('hotels', 'room_types', 'inventory')",
            &[&schema],
        )
        .await?
        .get(0))
}

async fn copy_hotels(
    tx: &Transaction<'_>,
    schema: &str,
    tables: &mut Tables,
    ticker: &mut Ticker,
    progress: &SnapshotProgress,
) -> Result<(), SnapshotError> {
    let copy = tx
        .copy_out(&format!(
            "COPY {schema}.hotels (id, name, city, country, stars, latitude, longitude, amenities) TO STDOUT (FORMAT binary)"
        ))
        .await?;
    let mut rows = pin!(BinaryCopyOutStream::new(
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
    ));
    while let Some(row) = rows.next().await.transpose()? {
        let hotel = Hotel {
            id: row.try_get(0)?,
            name: row.try_get(1)?,
            city: row.try_get(2)?,
            country: row.try_get(3)?,
            stars: row.try_get(4)?,
            latitude: row.try_get(5)?,
            longitude: row.try_get(6)?,
            amenities: row.try_get::<FlatTextArray>(7)?.0,
        };
        // The load's own copy: nothing shares it, so this never copies.
        Arc::make_mut(&mut tables.hotels).insert(hotel.id, hotel);
        ticker.row(progress);
    }
    Ok(())
}

/// A `text[]` of any dimensions, its elements in storage order and its
/// NULLs dropped, as the stream reads the same value
/// (`decode::parse_text_array`). tokio-postgres's `Vec<T>` refuses an array
/// of more than one dimension, and that refusal halted the snapshot on one
/// legal hotel row.
struct FlatTextArray(Vec<String>);

impl<'a> FromSql<'a> for FlatTextArray {
    fn from_sql(
        _: &Type,
        raw: &'a [u8],
    ) -> Result<FlatTextArray, Box<dyn std::error::Error + Sync + Send>> {
        let array = postgres_protocol::types::array_from_sql(raw)?;
        let mut elements = Vec::new();
        let mut values = array.values();
        while let Some(value) = values.next()? {
            if let Some(bytes) = value {
                elements.push(postgres_protocol::types::text_from_sql(bytes)?.to_string());
            }
        }
        Ok(FlatTextArray(elements))
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::TEXT_ARRAY
    }
}

async fn copy_room_types(
    tx: &Transaction<'_>,
    schema: &str,
    tables: &mut Tables,
    ticker: &mut Ticker,
    progress: &SnapshotProgress,
) -> Result<(), SnapshotError> {
    let copy = tx
        .copy_out(&format!(
            "COPY {schema}.room_types (hotel_id, id, name, max_guests) TO STDOUT (FORMAT binary)"
        ))
        .await?;
    let mut rows = pin!(BinaryCopyOutStream::new(
        copy,
        &[Type::INT8, Type::INT8, Type::TEXT, Type::INT2]
    ));
    while let Some(row) = rows.next().await.transpose()? {
        let room_type = RoomType {
            hotel_id: row.try_get(0)?,
            id: row.try_get(1)?,
            name: row.try_get(2)?,
            max_guests: row.try_get(3)?,
        };
        Arc::make_mut(&mut tables.room_types).insert(
            CalendarKey {
                hotel_id: room_type.hotel_id,
                room_type_id: room_type.id,
            },
            room_type,
        );
        ticker.row(progress);
    }
    Ok(())
}

/// The biggest table by far: parsed straight from the COPY bytes, and
/// gathered one hotel at a time (its rows mostly arrive together) in
/// reused per-room-type scratch calendars, then laid out once per hotel
/// at its exact size, which keeps the load at the owner's pace.
async fn copy_inventory(
    tx: &Transaction<'_>,
    schema: &str,
    calendars: &mut Calendars,
    ticker: &mut Ticker,
    progress: &SnapshotProgress,
) -> Result<(), SnapshotError> {
    let mut chunks = pin!(
        tx.copy_out(&format!(
            "COPY {schema}.inventory (hotel_id, room_type_id, night, total, taken, sell_limit, price_cents) TO STDOUT (FORMAT binary)"
        ))
        .await?
    );
    let mut rows = InventoryRows::default();
    let mut gathering: Option<i64> = None;
    let mut gathered: Vec<(i64, Calendar)> = Vec::new();
    let mut spare: Vec<Calendar> = Vec::new();
    while let Some(chunk) = chunks.next().await {
        rows.push(&chunk?);
        while let Some((key, night, counts)) = rows.next_row()? {
            let Some(night) = night else {
                metrics::NIGHTS_NOT_HELD
                    .with_label_values(&["snapshot"])
                    .inc();
                continue;
            };
            if gathering != Some(key.hotel_id) {
                if let Some(hotel_id) = gathering {
                    lay_out(calendars, hotel_id, &mut gathered, &mut spare);
                }
                gathering = Some(key.hotel_id);
            }
            scratch_calendar(&mut gathered, &mut spare, key.room_type_id).set(night, counts);
            ticker.row(progress);
        }
    }
    if let Some(hotel_id) = gathering {
        lay_out(calendars, hotel_id, &mut gathered, &mut spare);
    }
    rows.finish()
}

/// The scratch calendar gathering `room_type_id`'s nights for the hotel
/// being gathered, taken from `spare` on its first row. Rows of one room
/// type usually come together: the last one is tried first.
fn scratch_calendar<'g>(
    gathered: &'g mut Vec<(i64, Calendar)>,
    spare: &mut Vec<Calendar>,
    room_type_id: i64,
) -> &'g mut Calendar {
    let at = match gathered.iter().rposition(|(id, _)| *id == room_type_id) {
        Some(at) => at,
        None => {
            gathered.push((room_type_id, spare.pop().unwrap_or_default()));
            gathered.len() - 1
        }
    };
    &mut gathered[at].1
}

fn log_loaded(progress: &SnapshotProgress, started: Instant, consistent: Lsn) {
    let rows = progress.rows_loaded.load(Ordering::Relaxed);
    let secs = started.elapsed().as_secs_f64();
    tracing::info!(
        rows,
        seconds = secs,
        rows_per_second = (rows as f64 / secs.max(1e-9)) as u64,
        consistent_point = %consistent,
        "snapshot loaded"
    );
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

/// `COPY inventory (hotel_id, room_type_id, night, total, taken, sell_limit,
/// price_cents) TO STDOUT (FORMAT binary)`, decoded without a per-row
/// allocation. Chunks are whatever the server sent (one row per message in
/// practice); a row split across chunks waits in `buf` for the rest.
#[derive(Default)]
struct InventoryRows {
    buf: Vec<u8>,
    at: usize,
    header_read: bool,
    trailer_read: bool,
}

/// A row as the binary COPY holds it; its night is `None` when the copy
/// does not hold it (`calendar::holds_night`: `infinity`, say).
type InventoryRow = (CalendarKey, Option<chrono::NaiveDate>, NightCounts);

/// PostgreSQL's date epoch (2000-01-01) in days from the common era.
const PG_EPOCH_DAYS_FROM_CE: i32 = 730_120;
const COPY_SIGNATURE: &[u8] = b"PGCOPY\n\xff\r\n\0";

impl InventoryRows {
    fn push(&mut self, chunk: &[u8]) {
        if self.at > 0 {
            self.buf.drain(..self.at);
            self.at = 0;
        }
        self.buf.extend_from_slice(chunk);
    }

    /// The next whole row, or `None` until more bytes arrive.
    fn next_row(&mut self) -> Result<Option<InventoryRow>, SnapshotError> {
        let mut r = Reader {
            bytes: &self.buf,
            at: self.at,
        };
        if !self.header_read {
            let Some(sig) = r.take(COPY_SIGNATURE.len()) else {
                return Ok(None);
            };
            if sig != COPY_SIGNATURE {
                return Err(SnapshotError::BadCopy("no binary COPY signature"));
            }
            let (Some(_flags), Some(ext)) = (r.i32(), r.i32()) else {
                return Ok(None);
            };
            if r.take(usize::try_from(ext).map_err(|_| SnapshotError::BadCopy("header extension"))?)
                .is_none()
            {
                return Ok(None);
            }
            self.header_read = true;
            self.at = r.at;
        }
        if self.trailer_read {
            return Ok(None);
        }
        let Some(fields) = r.i16() else {
            return Ok(None);
        };
        if fields == -1 {
            self.trailer_read = true;
            self.at = r.at;
            return Ok(None);
        }
        if fields != 7 {
            return Err(SnapshotError::BadCopy("an inventory row without 7 columns"));
        }
        let mut values = [None::<i64>; 7];
        for (i, v) in values.iter_mut().enumerate() {
            let Some(len) = r.i32() else { return Ok(None) };
            *v = match len {
                -1 => None,
                8 if i < 2 => match r.take(8) {
                    Some(b) => Some(i64::from_be_bytes(b.try_into().expect("8 bytes"))),
                    None => return Ok(None),
                },
                4 if i >= 2 => match r.i32() {
                    Some(x) => Some(i64::from(x)),
                    None => return Ok(None),
                },
                _ => return Err(SnapshotError::BadCopy("a column of unexpected width")),
            };
        }
        self.at = r.at;
        let not_null =
            |v: Option<i64>| v.ok_or(SnapshotError::BadCopy("null in a NOT NULL column"));
        let days = not_null(values[2])? as i32;
        // `infinity` is i32::MAX days, `-infinity` i32::MIN: no date.
        let night = PG_EPOCH_DAYS_FROM_CE
            .checked_add(days)
            .and_then(chrono::NaiveDate::from_num_days_from_ce_opt)
            .filter(|n| holds_night(*n));
        let int = |v: Option<i64>| v.map(|x| x as i32);
        Ok(Some((
            CalendarKey {
                hotel_id: not_null(values[0])?,
                room_type_id: not_null(values[1])?,
            },
            night,
            NightCounts {
                total: not_null(values[3])? as i32,
                taken: not_null(values[4])? as i32,
                sell_limit: int(values[5]),
                price_cents: int(values[6]),
            },
        )))
    }

    /// The stream ended: it must have ended on the trailer, with nothing left over.
    fn finish(&self) -> Result<(), SnapshotError> {
        if !self.trailer_read || self.at != self.buf.len() {
            return Err(SnapshotError::BadCopy("the stream ended inside a row"));
        }
        Ok(())
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let b = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(b)
    }

    fn i32(&mut self) -> Option<i32> {
        self.take(4)
            .map(|b| i32::from_be_bytes(b.try_into().expect("4 bytes")))
    }

    fn i16(&mut self) -> Option<i16> {
        self.take(2)
            .map(|b| i16::from_be_bytes(b.try_into().expect("2 bytes")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(out: &mut Vec<u8>, v: Option<&[u8]>) {
        match v {
            Some(b) => {
                out.extend_from_slice(&(b.len() as i32).to_be_bytes());
                out.extend_from_slice(b);
            }
            None => out.extend_from_slice(&(-1i32).to_be_bytes()),
        }
    }

    type Row = (i64, i64, i32, i32, i32, Option<i32>, Option<i32>);

    fn stream(rows: &[Row]) -> Vec<u8> {
        let mut out = COPY_SIGNATURE.to_vec();
        out.extend_from_slice(&0i32.to_be_bytes());
        out.extend_from_slice(&0i32.to_be_bytes());
        for r in rows {
            out.extend_from_slice(&7i16.to_be_bytes());
            field(&mut out, Some(&r.0.to_be_bytes()));
            field(&mut out, Some(&r.1.to_be_bytes()));
            field(&mut out, Some(&r.2.to_be_bytes()));
            field(&mut out, Some(&r.3.to_be_bytes()));
            field(&mut out, Some(&r.4.to_be_bytes()));
            field(
                &mut out,
                r.5.map(|v| v.to_be_bytes()).as_ref().map(|b| &b[..]),
            );
            field(
                &mut out,
                r.6.map(|v| v.to_be_bytes()).as_ref().map(|b| &b[..]),
            );
        }
        out.extend_from_slice(&(-1i16).to_be_bytes());
        out
    }

    fn parse_in_chunks(bytes: &[u8], chunk: usize) -> Result<Vec<InventoryRow>, SnapshotError> {
        let mut rows = InventoryRows::default();
        let mut out = Vec::new();
        for c in bytes.chunks(chunk) {
            rows.push(c);
            while let Some(r) = rows.next_row()? {
                out.push(r);
            }
        }
        rows.finish()?;
        Ok(out)
    }

    #[test]
    fn rows_decode_whatever_the_chunking() {
        let bytes = stream(&[
            (1, 2, 0, 10, 3, None, Some(12_000)),
            (7, 9, 11_000, 5, 0, Some(6), None),
        ]);
        for chunk in [1, 3, 7, 64, bytes.len()] {
            let rows = parse_in_chunks(&bytes, chunk).unwrap();
            assert_eq!(rows.len(), 2);
            assert_eq!(
                rows[0].0,
                CalendarKey {
                    hotel_id: 1,
                    room_type_id: 2
                }
            );
            assert_eq!(rows[0].1, chrono::NaiveDate::from_ymd_opt(2000, 1, 1));
            assert_eq!(
                rows[0].2,
                NightCounts {
                    total: 10,
                    taken: 3,
                    sell_limit: None,
                    price_cents: Some(12_000)
                }
            );
            assert_eq!(
                rows[1].1,
                chrono::NaiveDate::from_ymd_opt(2000, 1, 1).map(|d| d + chrono::Days::new(11_000))
            );
            assert_eq!(rows[1].2.sell_limit, Some(6));
        }
    }

    #[test]
    fn nights_outside_the_held_years_decode_as_not_held() {
        // PostgreSQL's binary date: days from 2000-01-01; infinity is
        // i32::MAX, -infinity i32::MIN.
        let days_to = |y: i32, m: u32, d: u32| {
            let date = chrono::NaiveDate::from_ymd_opt(y, m, d).unwrap();
            (date - chrono::NaiveDate::from_ymd_opt(2000, 1, 1).unwrap()).num_days() as i32
        };
        let bytes = stream(&[
            (1, 2, i32::MAX, 10, 3, None, None),
            (1, 2, i32::MIN, 10, 3, None, None),
            (1, 2, days_to(0, 12, 31), 10, 3, None, None),
            (1, 2, days_to(10_000, 1, 1), 10, 3, None, None),
            (1, 2, days_to(1, 1, 1), 10, 3, None, None),
            (1, 2, days_to(9999, 12, 31), 10, 3, None, None),
            (1, 2, days_to(1899, 12, 31), 10, 3, None, None),
            (1, 2, days_to(2200, 1, 1), 10, 3, None, None),
            (1, 2, days_to(1900, 1, 1), 10, 3, None, None),
            (1, 2, days_to(2199, 12, 31), 10, 3, None, None),
        ]);
        let nights: Vec<_> = parse_in_chunks(&bytes, 5)
            .unwrap()
            .into_iter()
            .map(|r| r.1)
            .collect();
        assert_eq!(
            nights,
            [
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                chrono::NaiveDate::from_ymd_opt(1900, 1, 1),
                chrono::NaiveDate::from_ymd_opt(2199, 12, 31),
            ]
        );
    }

    #[test]
    fn a_cut_stream_or_a_foreign_one_is_an_error() {
        let bytes = stream(&[(1, 2, 0, 10, 3, None, None)]);
        assert!(matches!(
            parse_in_chunks(&bytes[..bytes.len() - 5], 4),
            Err(SnapshotError::BadCopy(_))
        ));
        let mut foreign = bytes.clone();
        foreign[0] = b'X';
        assert!(matches!(
            parse_in_chunks(&foreign, 4),
            Err(SnapshotError::BadCopy(_))
        ));
    }
}

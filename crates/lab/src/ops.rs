//! The owner's writes: hold, confirm, release, cancel, sweep, capacity, horizon.
//!
//! The booking service is not ours: `vacancy` only reads the owner database.
//! But tests, benchmarks and the demo need a real owner to race against, one
//! that takes units the way a booking site must, so every count the read model
//! copies was produced under the same rules as in production. These operations
//! follow the reservations guide the project is built on (its sections on
//! counting units per period, holds, returning expired holds and overbooking):
//!
//! - A hold is a booking row plus `taken` raised on every night of the stay in
//!   one transaction (escrow), all nights or none.
//! - Every status change is a conditional update from the status it leaves, so a
//!   confirmation and an expiry cannot both win, and units come back only when
//!   that update changed the row.
//! - Inventory rows are always locked in one order, (hotel, room type, night),
//!   so two writers that share nights queue instead of deadlocking. A deadlock or
//!   serialization failure that still happens is retried once.
//!
//! Statements go through `query_typed` / `execute_typed`: the parameter types
//! are given, so each statement is parsed, bound and run in one round trip
//! instead of a separate prepare first. That matters inside the hold, where the
//! night rows stay locked for every round trip until the commit; a named
//! statement would not pay off because each call would prepare it again.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use chrono::NaiveDate;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, GenericClient, Transaction};

/// The longest stay one hold may take; longer requests are refused before
/// they lock a month of rows.
pub const MAX_NIGHTS: i64 = 31;

/// The longest hold: the guide sizes holds from minutes (checkout) to a day
/// (a host's answer). Anything longer is a booking nobody paid for.
pub const MAX_HOLD: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// Client-made ids are stored as given; an absurd one is a bug on the caller's side.
pub const MAX_BOOKING_ID_BYTES: usize = 200;

/// A request to hold `rooms` units of a room type on every night of
/// `[check_in, check_out)` for `hold_for`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldRequest {
    /// Made by the client before its first attempt, so a retry finds its own hold.
    pub booking_id: String,
    pub hotel_id: i64,
    pub room_type_id: i64,
    pub check_in: NaiveDate,
    /// The morning the guest leaves; that night is not taken.
    pub check_out: NaiveDate,
    pub rooms: i32,
    pub hold_for: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldOutcome {
    /// The units are taken on every night and the booking is `held`.
    Held,
    /// A booking with this id exists already (a retry); nothing changed.
    AlreadyExists {
        status: BookingStatus,
    },
    /// Some night has fewer free units than requested; nothing changed.
    Full,
    /// The room type or some night of the stay is not on sale; nothing changed.
    NotFound,
    Invalid(&'static str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BookingStatus {
    Held,
    Confirmed,
    Released,
    Expired,
    Cancelled,
}

impl BookingStatus {
    /// The value stored in `bookings.status`.
    pub fn as_str(self) -> &'static str {
        match self {
            BookingStatus::Held => "held",
            BookingStatus::Confirmed => "confirmed",
            BookingStatus::Released => "released",
            BookingStatus::Expired => "expired",
            BookingStatus::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for BookingStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown booking status {0:?}")]
pub struct UnknownStatus(pub String);

impl FromStr for BookingStatus {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "held" => Ok(BookingStatus::Held),
            "confirmed" => Ok(BookingStatus::Confirmed),
            "released" => Ok(BookingStatus::Released),
            "expired" => Ok(BookingStatus::Expired),
            "cancelled" => Ok(BookingStatus::Cancelled),
            other => Err(UnknownStatus(other.to_owned())),
        }
    }
}

/// The result of a conditional status move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Done,
    /// The booking exists but its status does not allow the move.
    WrongState(BookingStatus),
    NotFound,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapacityOutcome {
    /// Every night of the range changed.
    Changed {
        nights: u64,
    },
    /// Some night has more units taken than the new count allows; nothing changed.
    BelowTaken,
    /// Some night of the range has no inventory row; nothing changed.
    NotFound,
    Invalid(&'static str),
}

#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    #[error("owner database: {0}")]
    Db(#[from] tokio_postgres::Error),
    /// A caller's argument no operation can act on (outcomes cover the rest).
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The database holds a status the schema's CHECK should have refused.
    #[error("owner database: {0}")]
    UnknownStatus(#[from] UnknownStatus),
}

impl OpsError {
    /// PostgreSQL aborted the transaction because of another one; running it
    /// again is its documented answer, not a failure to report.
    fn is_retryable(&self) -> bool {
        match self {
            OpsError::Db(e) => matches!(
                e.code(),
                Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE
                    || *c == SqlState::T_R_DEADLOCK_DETECTED
            ),
            _ => false,
        }
    }
}

/// Runs a whole-transaction attempt again once if the database aborted it for
/// a conflict; the second attempt starts from scratch. A macro rather than a
/// function over an async closure: the futures must stay `Send` so callers can
/// spawn them, and rustc cannot yet prove that through an `AsyncFnMut` bound.
macro_rules! retry_once {
    ($attempt:expr) => {
        match $attempt.await {
            Err(e) if e.is_retryable() => {
                tracing::debug!(error = %e, "owner transaction lost a conflict, retrying once");
                $attempt.await
            }
            other => other,
        }
    };
}

fn is_foreign_key_violation(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&SqlState::FOREIGN_KEY_VIOLATION)
}

/// Nights in `[from, to)`, or `None` when the range is empty or reversed.
fn nights_between(from: NaiveDate, to: NaiveDate) -> Option<i64> {
    let nights = (to - from).num_days();
    (nights > 0).then_some(nights)
}

fn validate_hold(req: &HoldRequest) -> Result<i64, &'static str> {
    if req.booking_id.is_empty() {
        return Err("booking id is empty");
    }
    if req.booking_id.len() > MAX_BOOKING_ID_BYTES {
        return Err("booking id is longer than 200 bytes");
    }
    // PostgreSQL text cannot store NUL; refusing here keeps it a business answer.
    if req.booking_id.contains('\0') {
        return Err("booking id contains a NUL character");
    }
    let Some(nights) = nights_between(req.check_in, req.check_out) else {
        return Err("check_out must be after check_in");
    };
    if nights > MAX_NIGHTS {
        return Err("stay is longer than 31 nights");
    }
    if req.rooms <= 0 {
        return Err("rooms must be positive");
    }
    if req.hold_for.is_zero() {
        return Err("hold_for must be positive");
    }
    if req.hold_for > MAX_HOLD {
        return Err("hold_for is longer than 30 days");
    }
    Ok(nights)
}

/// Holds `req.rooms` units on every night of the stay, or nothing.
///
/// A retry with the same booking id returns [`HoldOutcome::AlreadyExists`]
/// with the booking's current status and takes nothing.
pub async fn hold(client: &mut Client, req: &HoldRequest) -> Result<HoldOutcome, OpsError> {
    let nights = match validate_hold(req) {
        Ok(nights) => nights,
        Err(why) => return Ok(HoldOutcome::Invalid(why)),
    };
    retry_once!(hold_once(client, req, nights))
}

async fn hold_once(
    client: &mut Client,
    req: &HoldRequest,
    nights: i64,
) -> Result<HoldOutcome, OpsError> {
    let tx = client.transaction().await?;
    // The booking goes first: its primary key is what turns a retry into a
    // no-op, and a concurrent retry of the same id waits here for the first.
    let inserted = tx
        .execute_typed(
            "INSERT INTO bookings
                 (id, hotel_id, room_type_id, check_in, check_out, rooms, status, expires_at)
             VALUES ($1, $2, $3, $4, $5, $6, 'held',
                     clock_timestamp() + make_interval(secs => $7))
             ON CONFLICT (id) DO NOTHING",
            &[
                (&req.booking_id, Type::TEXT),
                (&req.hotel_id, Type::INT8),
                (&req.room_type_id, Type::INT8),
                (&req.check_in, Type::DATE),
                (&req.check_out, Type::DATE),
                (&req.rooms, Type::INT4),
                (&req.hold_for.as_secs_f64(), Type::FLOAT8),
            ],
        )
        .await;
    match inserted {
        Ok(1) => {}
        Ok(_) => {
            let status = booking_status(&tx, &req.booking_id).await?;
            tx.rollback().await?;
            return Ok(match status {
                Some(status) => HoldOutcome::AlreadyExists { status },
                // Bookings are never deleted, so a conflict without a row means
                // the data changed under us: report it as not there.
                None => HoldOutcome::NotFound,
            });
        }
        // The room type does not exist.
        Err(e) if is_foreign_key_violation(&e) => {
            tx.rollback().await?;
            return Ok(HoldOutcome::NotFound);
        }
        Err(e) => return Err(e.into()),
    }

    // Date order, the same order every writer of these rows uses, so two holds
    // that share nights queue on the first shared night instead of deadlocking.
    let locked = tx
        .query_typed(
            "SELECT night FROM inventory
             WHERE hotel_id = $1 AND room_type_id = $2 AND night >= $3 AND night < $4
             ORDER BY night
             FOR UPDATE",
            &[
                (&req.hotel_id, Type::INT8),
                (&req.room_type_id, Type::INT8),
                (&req.check_in, Type::DATE),
                (&req.check_out, Type::DATE),
            ],
        )
        .await?;
    if (locked.len() as i64) < nights {
        tx.rollback().await?;
        return Ok(HoldOutcome::NotFound);
    }

    // `$5 <= limit - taken` rather than `taken + $5 <= limit`: the same rule
    // without an integer overflow for an absurd `rooms`.
    let taken = tx
        .execute_typed(
            "UPDATE inventory SET taken = taken + $5
             WHERE hotel_id = $1 AND room_type_id = $2 AND night >= $3 AND night < $4
               AND $5 <= coalesce(sell_limit, total) - taken",
            &[
                (&req.hotel_id, Type::INT8),
                (&req.room_type_id, Type::INT8),
                (&req.check_in, Type::DATE),
                (&req.check_out, Type::DATE),
                (&req.rooms, Type::INT4),
            ],
        )
        .await?;
    if (taken as i64) < nights {
        tx.rollback().await?;
        return Ok(HoldOutcome::Full);
    }
    tx.commit().await?;
    Ok(HoldOutcome::Held)
}

async fn booking_status(
    client: &impl GenericClient,
    booking_id: &str,
) -> Result<Option<BookingStatus>, OpsError> {
    let row = client
        .query_typed_opt(
            "SELECT status FROM bookings WHERE id = $1",
            &[(&booking_id, Type::TEXT)],
        )
        .await?;
    match row {
        Some(row) => Ok(Some(row.try_get::<_, &str>(0)?.parse()?)),
        None => Ok(None),
    }
}

/// Moves a held booking to confirmed.
///
/// The expiry is not checked: until the sweeper marks the hold expired its
/// units are still counted for it, so a late confirmation takes nothing from
/// anyone. Once expired, the confirmation loses with `WrongState(Expired)`.
pub async fn confirm(client: &Client, booking_id: &str) -> Result<Transition, OpsError> {
    retry_once!(confirm_once(client, booking_id))
}

async fn confirm_once(client: &Client, booking_id: &str) -> Result<Transition, OpsError> {
    let mut last = None;
    // A second round only when the lookup saw `held`: the hold committed
    // between our update and our lookup, and the update deserves a retry.
    for _ in 0..2 {
        let moved = client
            .execute_typed(
                "UPDATE bookings SET status = 'confirmed' WHERE id = $1 AND status = 'held'",
                &[(&booking_id, Type::TEXT)],
            )
            .await?;
        if moved == 1 {
            return Ok(Transition::Done);
        }
        match booking_status(client, booking_id).await? {
            None => return Ok(Transition::NotFound),
            Some(BookingStatus::Held) => last = Some(BookingStatus::Held),
            Some(status) => return Ok(Transition::WrongState(status)),
        }
    }
    Ok(last.map_or(Transition::NotFound, Transition::WrongState))
}

/// Moves a held booking to released and gives its units back.
pub async fn release(client: &mut Client, booking_id: &str) -> Result<Transition, OpsError> {
    end_booking(
        client,
        booking_id,
        &[BookingStatus::Held],
        BookingStatus::Released,
    )
    .await
}

/// Moves a held or confirmed booking to cancelled and gives its units back.
pub async fn cancel(client: &mut Client, booking_id: &str) -> Result<Transition, OpsError> {
    end_booking(
        client,
        booking_id,
        &[BookingStatus::Held, BookingStatus::Confirmed],
        BookingStatus::Cancelled,
    )
    .await
}

/// The units a booking holds, as returned by the status move that ended it.
struct Units {
    hotel_id: i64,
    room_type_id: i64,
    check_in: NaiveDate,
    check_out: NaiveDate,
    rooms: i32,
}

impl Units {
    fn from_row(row: &tokio_postgres::Row) -> Result<Units, tokio_postgres::Error> {
        Ok(Units {
            hotel_id: row.try_get("hotel_id")?,
            room_type_id: row.try_get("room_type_id")?,
            check_in: row.try_get("check_in")?,
            check_out: row.try_get("check_out")?,
            rooms: row.try_get("rooms")?,
        })
    }
}

async fn end_booking(
    client: &mut Client,
    booking_id: &str,
    from: &[BookingStatus],
    to: BookingStatus,
) -> Result<Transition, OpsError> {
    let from: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
    retry_once!(end_booking_once(client, booking_id, &from, to))
}

async fn end_booking_once(
    client: &mut Client,
    booking_id: &str,
    from: &[&str],
    to: BookingStatus,
) -> Result<Transition, OpsError> {
    let mut last = None;
    // As in `confirm`: a lookup that finds a status we could have moved
    // from means the booking appeared or changed between the two reads.
    for _ in 0..2 {
        let tx = client.transaction().await?;
        let moved = tx
            .query_typed_opt(
                "UPDATE bookings SET status = $2
                 WHERE id = $1 AND status = ANY($3)
                 RETURNING hotel_id, room_type_id, check_in, check_out, rooms",
                &[
                    (&booking_id, Type::TEXT),
                    (&to.as_str(), Type::TEXT),
                    (&from, Type::TEXT_ARRAY),
                ],
            )
            .await?;
        if let Some(row) = moved {
            give_back(&tx, &[Units::from_row(&row)?]).await?;
            tx.commit().await?;
            return Ok(Transition::Done);
        }
        let status = booking_status(&tx, booking_id).await?;
        tx.rollback().await?;
        match status {
            None => return Ok(Transition::NotFound),
            Some(s) if from.contains(&s.as_str()) => last = Some(s),
            Some(s) => return Ok(Transition::WrongState(s)),
        }
    }
    Ok(last.map_or(Transition::NotFound, Transition::WrongState))
}

/// Lowers `taken` by the units of bookings whose status move just changed
/// their row, inside the caller's transaction.
///
/// Rows are locked in (hotel, room type, night) order first, the order holds
/// and capacity changes use too. A night without a row (already archived) has
/// nothing to give back and is skipped.
async fn give_back(tx: &Transaction<'_>, bookings: &[Units]) -> Result<(), OpsError> {
    // Summed per night so one statement covers a whole sweep batch, and sorted
    // so the lock order does not depend on the plan.
    let mut per_night: BTreeMap<(i64, i64, NaiveDate), i64> = BTreeMap::new();
    for b in bookings {
        for night in b.check_in.iter_days().take_while(|n| *n < b.check_out) {
            *per_night
                .entry((b.hotel_id, b.room_type_id, night))
                .or_default() += i64::from(b.rooms);
        }
    }
    if per_night.is_empty() {
        return Ok(());
    }
    let mut hotels = Vec::with_capacity(per_night.len());
    let mut room_types = Vec::with_capacity(per_night.len());
    let mut nights = Vec::with_capacity(per_night.len());
    let mut rooms = Vec::with_capacity(per_night.len());
    for ((hotel, room_type, night), n) in per_night {
        hotels.push(hotel);
        room_types.push(room_type);
        nights.push(night);
        rooms.push(n);
    }
    tx.query_typed(
        "SELECT 1 FROM inventory i
         JOIN unnest($1, $2, $3) AS u(hotel_id, room_type_id, night)
           ON i.hotel_id = u.hotel_id AND i.room_type_id = u.room_type_id AND i.night = u.night
         ORDER BY i.hotel_id, i.room_type_id, i.night
         FOR UPDATE OF i",
        &[
            (&hotels, Type::INT8_ARRAY),
            (&room_types, Type::INT8_ARRAY),
            (&nights, Type::DATE_ARRAY),
        ],
    )
    .await?;
    // A count that would go below zero was broken by someone else; the CHECK
    // refuses it and the error surfaces rather than hiding the damage.
    tx.execute_typed(
        "UPDATE inventory i SET taken = i.taken - u.rooms
         FROM unnest($1, $2, $3, $4) AS u(hotel_id, room_type_id, night, rooms)
         WHERE i.hotel_id = u.hotel_id AND i.room_type_id = u.room_type_id
           AND i.night = u.night",
        &[
            (&hotels, Type::INT8_ARRAY),
            (&room_types, Type::INT8_ARRAY),
            (&nights, Type::DATE_ARRAY),
            (&rooms, Type::INT8_ARRAY),
        ],
    )
    .await?;
    Ok(())
}

/// Marks up to `batch` expired holds as expired and gives their units back,
/// in one transaction. Returns how many holds it expired.
///
/// `SKIP LOCKED` lets several sweepers share the work, and the move rechecks
/// the stored status and expiry, so a hold confirmed or extended a moment
/// before stays as it is and no unit comes back twice.
pub async fn sweep(client: &mut Client, batch: i64) -> Result<u64, OpsError> {
    if batch <= 0 {
        return Err(OpsError::InvalidArgument("sweep batch must be positive"));
    }
    retry_once!(sweep_once(client, batch))
}

async fn sweep_once(client: &mut Client, batch: i64) -> Result<u64, OpsError> {
    let tx = client.transaction().await?;
    let ids: Vec<String> = tx
        .query_typed(
            "SELECT id FROM bookings
             WHERE status = 'held' AND expires_at <= clock_timestamp()
             ORDER BY expires_at
             LIMIT $1
             FOR UPDATE SKIP LOCKED",
            &[(&batch, Type::INT8)],
        )
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<_, _>>()?;
    if ids.is_empty() {
        tx.rollback().await?;
        return Ok(0);
    }
    // One statement, but the condition is per booking: only the rows it
    // changed come back, and only their units are returned.
    let moved = tx
        .query_typed(
            "UPDATE bookings SET status = 'expired'
             WHERE id = ANY($1) AND status = 'held' AND expires_at <= clock_timestamp()
             RETURNING hotel_id, room_type_id, check_in, check_out, rooms",
            &[(&ids, Type::TEXT_ARRAY)],
        )
        .await?
        .iter()
        .map(Units::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    give_back(&tx, &moved).await?;
    tx.commit().await?;
    Ok(moved.len() as u64)
}

/// Changes `total` and/or `sell_limit` on the nights `[from, to)`: all of them
/// or none.
///
/// `total: None` and `sell_limit: None` leave the column as it is;
/// `sell_limit: Some(None)` clears it (no overbooking). A lowered total may
/// not go below the units already taken on a night, and the limit that takes
/// check (`coalesce(sell_limit, total)`) may not either. A sell limit, when the
/// night ends up with one, must be at least its total.
pub async fn set_capacity(
    client: &mut Client,
    hotel_id: i64,
    room_type_id: i64,
    from: NaiveDate,
    to: NaiveDate,
    total: Option<i32>,
    sell_limit: Option<Option<i32>>,
) -> Result<CapacityOutcome, OpsError> {
    let Some(nights) = nights_between(from, to) else {
        return Ok(CapacityOutcome::Invalid("`to` must be after `from`"));
    };
    if total.is_none() && sell_limit.is_none() {
        return Ok(CapacityOutcome::Invalid("nothing to change"));
    }
    if total.is_some_and(|t| t < 0) {
        return Ok(CapacityOutcome::Invalid("total must not be negative"));
    }
    if let (Some(t), Some(Some(l))) = (total, sell_limit)
        && l < t
    {
        return Ok(CapacityOutcome::Invalid(
            "sell_limit must be at least total",
        ));
    }
    let (set_limit, new_limit) = match sell_limit {
        Some(limit) => (true, limit),
        None => (false, None),
    };
    let change = CapacityChange {
        hotel_id,
        room_type_id,
        from,
        to,
        nights,
        total,
        set_limit,
        new_limit,
    };
    retry_once!(set_capacity_once(client, &change))
}

/// A validated `set_capacity` call.
#[derive(Clone, Copy)]
struct CapacityChange {
    hotel_id: i64,
    room_type_id: i64,
    from: NaiveDate,
    to: NaiveDate,
    nights: i64,
    total: Option<i32>,
    /// Whether `sell_limit` changes at all; `new_limit` is its value then.
    set_limit: bool,
    new_limit: Option<i32>,
}

async fn set_capacity_once(
    client: &mut Client,
    change: &CapacityChange,
) -> Result<CapacityOutcome, OpsError> {
    let CapacityChange {
        hotel_id,
        room_type_id,
        from,
        to,
        nights,
        total,
        set_limit,
        new_limit,
    } = *change;
    let tx = client.transaction().await?;
    let locked = tx
        .query_typed(
            "SELECT total, sell_limit FROM inventory
             WHERE hotel_id = $1 AND room_type_id = $2 AND night >= $3 AND night < $4
             ORDER BY night
             FOR UPDATE",
            &[
                (&hotel_id, Type::INT8),
                (&room_type_id, Type::INT8),
                (&from, Type::DATE),
                (&to, Type::DATE),
            ],
        )
        .await?;
    if (locked.len() as i64) < nights {
        tx.rollback().await?;
        return Ok(CapacityOutcome::NotFound);
    }
    // Only one of the two may be given, so the rule between them is
    // checked against what each locked night ends up with.
    for row in &locked {
        let row_total: i32 = row.try_get("total")?;
        let row_limit: Option<i32> = row.try_get("sell_limit")?;
        let end_total = total.unwrap_or(row_total);
        let end_limit = if set_limit { new_limit } else { row_limit };
        if end_limit.is_some_and(|l| l < end_total) {
            tx.rollback().await?;
            return Ok(CapacityOutcome::Invalid(
                "sell_limit must be at least total",
            ));
        }
    }
    // The guard lives in WHERE, like every take: a lowered total stays at
    // or above taken (raising is always fine, even on an overbooked
    // night), and the limit takes check stays at or above taken.
    let changed = tx
        .execute_typed(
            "UPDATE inventory
             SET total = coalesce($5, total),
                 sell_limit = CASE WHEN $6 THEN $7 ELSE sell_limit END
             WHERE hotel_id = $1 AND room_type_id = $2 AND night >= $3 AND night < $4
               AND ($5 IS NULL OR $5 >= total OR $5 >= taken)
               AND taken <= coalesce(CASE WHEN $6 THEN $7 ELSE sell_limit END,
                                     $5, total)",
            &[
                (&hotel_id, Type::INT8),
                (&room_type_id, Type::INT8),
                (&from, Type::DATE),
                (&to, Type::DATE),
                (&total, Type::INT4),
                (&set_limit, Type::BOOL),
                (&new_limit, Type::INT4),
            ],
        )
        .await?;
    if (changed as i64) < nights {
        tx.rollback().await?;
        return Ok(CapacityOutcome::BelowTaken);
    }
    tx.commit().await?;
    Ok(CapacityOutcome::Changed { nights: changed })
}

/// The daily job that keeps the booking horizon open: for every room type,
/// adds each night after its latest one up to `through` (inclusive), copying
/// the latest night's total and price. Returns the rows inserted.
///
/// `ON CONFLICT DO NOTHING` makes a second run, or a run after a crash, add
/// nothing twice. A room type without any night is skipped: there is no total
/// to copy. The sell limit is not copied: overbooking is decided per night.
pub async fn open_horizon(client: &Client, through: NaiveDate) -> Result<u64, OpsError> {
    retry_once!(open_horizon_once(client, through))
}

async fn open_horizon_once(client: &Client, through: NaiveDate) -> Result<u64, OpsError> {
    Ok(client
        .execute_typed(
            "INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
             SELECT rt.hotel_id, rt.id, latest.night + g, latest.total, latest.price_cents
             FROM room_types rt
             CROSS JOIN LATERAL (
                 SELECT i.night, i.total, i.price_cents FROM inventory i
                 WHERE i.hotel_id = rt.hotel_id AND i.room_type_id = rt.id
                 ORDER BY i.night DESC
                 LIMIT 1
             ) latest
             CROSS JOIN LATERAL generate_series(1, $1 - latest.night) AS g
             ORDER BY 1, 2, 3
             ON CONFLICT DO NOTHING",
            &[(&through, Type::DATE)],
        )
        .await?)
}

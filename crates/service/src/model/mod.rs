//! The read model: the copy of the owner's hotels, room types and nightly
//! counts that search reads, and how fresh it is.
//!
//! Architecture invariant: only the stream's apply step writes here, and a
//! reader never sees half a transaction (a three-night hold shows on all
//! three nights or on none, a transaction over several hotels on all of them
//! or on none). The writer applies a whole owner transaction to a private
//! successor of the published copy, copy-on-write per hotel block, then
//! publishes it with one atomic pointer swap. A reader takes the published
//! copy with one atomic load and never waits for a writer, however large
//! the transaction. The LSN a reader is told is part of the copy it took.
//! No function here awaits, and none holds a lock across an `.await`.

mod applied_watch;
pub mod calendar;
pub mod calendars;
pub mod feed;
pub mod held;
pub mod room_types;
mod settings;
mod source;
mod stay;
pub mod xids;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;

use chrono::{DateTime, NaiveDate, Utc};
use serde::{Deserialize, Serialize};

pub use calendar::NightCounts;
pub use calendars::Calendars;
pub use held::{Changes, HeldBudget, HeldChanges, SpillError};
pub use room_types::RoomTypes;
pub use settings::ModelSettings;
pub use source::Source;
pub use stay::Stay;

use crate::lsn::Lsn;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hotel {
    pub id: i64,
    pub name: String,
    pub city: String,
    pub country: Option<String>,
    pub stars: Option<i16>,
    pub latitude: Option<f64>,
    pub longitude: Option<f64>,
    pub amenities: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomType {
    pub hotel_id: i64,
    pub id: i64,
    pub name: String,
    pub max_guests: i16,
}

/// One (hotel, room type): the key of a calendar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CalendarKey {
    pub hotel_id: i64,
    pub room_type_id: i64,
}

/// The owner tables the copy holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Table {
    Hotels,
    RoomTypes,
    Inventory,
}

impl Table {
    pub const ALL: [Table; 3] = [Table::Hotels, Table::RoomTypes, Table::Inventory];

    pub fn name(self) -> &'static str {
        match self {
            Table::Hotels => "hotels",
            Table::RoomTypes => "room_types",
            Table::Inventory => "inventory",
        }
    }

    pub fn from_name(name: &str) -> Option<Table> {
        Table::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// Text columns PostgreSQL may leave out of an update when their TOASTed
/// value did not change; the copy then keeps the value it has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unsent {
    pub name: bool,
    pub city: bool,
    pub country: bool,
    pub amenities: bool,
}

/// One row change, decoded from the stream or read from the owner.
///
/// A streamed transaction holds its changes until it commits, millions of
/// them in a bulk update of inventory, so the rare wide rows (hotels, room
/// types) are boxed and a change costs 48 bytes, not the 150 of a hotel.
///
/// Serializable because the fleet's projector publishes applied
/// transactions and re-read merges as changes (`fleet::wire`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Change {
    UpsertHotel {
        hotel: Box<Hotel>,
        unsent: Unsent,
    },
    DeleteHotel {
        id: i64,
    },
    UpsertRoomType {
        room_type: Box<RoomType>,
        name_unsent: bool,
    },
    DeleteRoomType {
        hotel_id: i64,
        id: i64,
    },
    UpsertNight {
        key: CalendarKey,
        night: NaiveDate,
        counts: NightCounts,
    },
    DeleteNight {
        key: CalendarKey,
        night: NaiveDate,
    },
    Truncate {
        tables: Vec<Table>,
    },
}

impl Change {
    /// The operation, as the metrics label it.
    pub fn op(&self) -> &'static str {
        match self {
            Change::UpsertHotel { .. }
            | Change::UpsertRoomType { .. }
            | Change::UpsertNight { .. } => "upsert",
            Change::DeleteHotel { .. }
            | Change::DeleteRoomType { .. }
            | Change::DeleteNight { .. } => "delete",
            Change::Truncate { .. } => "truncate",
        }
    }
}

/// A committed owner transaction, ready to apply as one unit.
#[derive(Debug, Clone, PartialEq)]
pub struct Transaction {
    /// The owner's (top-level) transaction id.
    pub xid: u32,
    /// Where the commit record starts: transactions commit in this order.
    pub commit_lsn: Lsn,
    /// Just past the commit record: what is acknowledged once applied.
    pub end_lsn: Lsn,
    pub commit_time: DateTime<Utc>,
    /// In memory, or in a spill file past `stream.max_held_bytes` (`held`):
    /// walk them with `Changes::for_each`, as often as needed.
    pub changes: Changes,
}

/// The copy's hotels by id.
pub type Hotels = HashMap<i64, Hotel, rustc_hash::FxBuildHasher>;

/// The data a reader sees, always paired with the LSN it reflects.
///
/// Cloning shares everything (hotels and room types whole, calendars per
/// hotel block); a write through the clone copies only what it changes.
/// Hotels and room types change rarely, so they are copied whole when they
/// do; calendars change with every booking, so they are copied per hotel.
#[derive(Debug, Clone, Default)]
pub struct Tables {
    pub hotels: Arc<Hotels>,
    pub room_types: Arc<RoomTypes>,
    pub calendars: Calendars,
    /// Every owner transaction that committed before this position is applied.
    pub applied: Lsn,
    /// Commit time of the last transaction applied (None right after a snapshot).
    pub commit_time: Option<DateTime<Utc>>,
    /// The copy's lineage: the consistent point of the snapshot it descends
    /// from (0: none). Kept by every transaction and checkpoint, changed
    /// only by a new snapshot, so the fleet can tell one epoch's messages
    /// from another's (`fleet::wire`).
    pub epoch: u64,
    /// The owner timeline the copy's positions are on (`IDENTIFY_SYSTEM`
    /// of the session that snapshotted it; 0: unknown). LSNs compare only
    /// within one timeline, so positions handed to guests carry it
    /// (`crate::lsn::Position`).
    pub timeline: u32,
    /// Copies swapped into this process's model before this one
    /// (`ReadModel::replace_behind`; 0 for one not swapped in): what a feed
    /// item and an event stream's state say they came from, so a stream
    /// never sends a replaced copy's change after a newer copy's state.
    /// Kept by every transaction, never written to a checkpoint.
    pub generation: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The transaction's spill file could not be read back: nothing of it
    /// is applied, and the session that fails starts it over from the slot.
    #[error(transparent)]
    Spill(#[from] SpillError),
}

/// What applying one transaction did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    pub upserts: u64,
    pub deletes: u64,
    pub truncates: u64,
    /// The transaction was already in the copy (a replay after reconnect).
    pub skipped: bool,
}

/// The row the change before deleted, for a key change's upsert that
/// follows it (`Tables::apply_change_after`).
#[derive(Debug, Default)]
pub enum JustDeleted {
    #[default]
    Nothing,
    Hotel(Hotel),
    RoomType(RoomType),
}

impl Tables {
    /// Applies one change. Used by the transaction apply and the snapshot load.
    pub fn apply_change(&mut self, change: &Change) -> Result<(), ApplyError> {
        self.apply_change_after(change, &mut JustDeleted::Nothing)
    }

    /// Applies one change of a transaction walked in order; `just_deleted`
    /// carries the row the change before it deleted.
    ///
    /// A key-changing UPDATE arrives as the delete of its old key followed at
    /// once by the upsert of its new one (`stream::decode`), and that upsert
    /// leaves out the TOASTed columns it did not change. Nothing holds them
    /// under the new key: they are taken from the row just deleted, which
    /// had them. Only a key change puts such an upsert right after a delete
    /// (an INSERT sends every column; an UPDATE that keeps its key has no
    /// delete).
    pub fn apply_change_after(
        &mut self,
        change: &Change,
        just_deleted: &mut JustDeleted,
    ) -> Result<(), ApplyError> {
        let before = std::mem::take(just_deleted);
        match change {
            Change::UpsertHotel { hotel, unsent } => {
                let mut hotel = hotel.clone();
                let moved_from = match &before {
                    JustDeleted::Hotel(old) => Some(old),
                    _ => None,
                };
                if let Some(old) = self.hotels.get(&hotel.id).or(moved_from) {
                    if unsent.name {
                        hotel.name.clone_from(&old.name);
                    }
                    if unsent.city {
                        hotel.city.clone_from(&old.city);
                    }
                    if unsent.country {
                        hotel.country.clone_from(&old.country);
                    }
                    if unsent.amenities {
                        hotel.amenities.clone_from(&old.amenities);
                    }
                }
                // An update of a column the copy does not hold (an owner's
                // `updated_at`, a popularity counter, written with each
                // booking) changes nothing here: the map is shared with the
                // published copy, and inserting copied all of it, every
                // hotel with its strings, in each such transaction.
                if self.hotels.get(&hotel.id) != Some(&*hotel) {
                    Arc::make_mut(&mut self.hotels).insert(hotel.id, *hotel);
                }
            }
            Change::DeleteHotel { id } => {
                if self.hotels.contains_key(id)
                    && let Some(old) = Arc::make_mut(&mut self.hotels).remove(id)
                {
                    *just_deleted = JustDeleted::Hotel(old);
                }
            }
            Change::UpsertRoomType {
                room_type,
                name_unsent,
            } => {
                let key = CalendarKey {
                    hotel_id: room_type.hotel_id,
                    room_type_id: room_type.id,
                };
                let mut room_type = room_type.clone();
                let moved_from = match &before {
                    JustDeleted::RoomType(old) => Some(old),
                    _ => None,
                };
                if *name_unsent && let Some(old) = self.room_types.get(&key).or(moved_from) {
                    room_type.name.clone_from(&old.name);
                }
                Arc::make_mut(&mut self.room_types).insert(key, *room_type);
            }
            Change::DeleteRoomType { hotel_id, id } => {
                let key = CalendarKey {
                    hotel_id: *hotel_id,
                    room_type_id: *id,
                };
                if self.room_types.contains_key(&key)
                    && let Some(old) = Arc::make_mut(&mut self.room_types).remove(&key)
                {
                    *just_deleted = JustDeleted::RoomType(old);
                }
            }
            Change::UpsertNight { key, night, counts } => {
                self.calendars.set(*key, *night, *counts);
            }
            Change::DeleteNight { key, night } => {
                self.calendars.remove_night(*key, *night);
            }
            Change::Truncate { tables } => {
                for table in tables {
                    match table {
                        Table::Hotels => self.hotels = Arc::default(),
                        Table::RoomTypes => self.room_types = Arc::default(),
                        Table::Inventory => self.calendars.clear(),
                    }
                }
            }
        }
        Ok(())
    }

    /// One hotel's room types, in id order.
    pub fn room_types_of(&self, hotel_id: i64) -> impl Iterator<Item = &RoomType> {
        self.room_types.of_hotel(hotel_id).iter()
    }

    pub fn inventory_rows(&self) -> u64 {
        self.calendars.rows()
    }

    /// Bytes of night data held (the packed vectors).
    pub fn inventory_bytes(&self) -> u64 {
        self.calendars.heap_bytes()
    }
}

/// Where the copy stands relative to the owner, readable without taking the copy.
#[derive(Debug, Default)]
pub struct Freshness {
    /// The owner's WAL position as last seen: what the stream reported
    /// (data and keepalives), or the owner's flushed position the slot
    /// watch read (never its insert position: WAL not yet flushed holds no
    /// commit anyone can see, and the walsender cannot send it).
    server_wal_end: AtomicU64,
    /// Mirrors `Tables::applied`, for lock-free status reads.
    applied: AtomicU64,
    /// Unix micros of the last applied commit.
    commit_time_us: AtomicI64,
    /// Unix micros when the stream last delivered anything.
    last_message_us: AtomicI64,
    /// A snapshot has been loaded: the copy is complete as of `applied`.
    loaded: AtomicBool,
    /// `applied` again, for waiters (confirmed reads) that sleep until it
    /// reaches a position instead of polling.
    watch: applied_watch::AppliedWatch,
    /// An owner position read after this start that the copy must reach
    /// before it counts as caught up: set when the copy comes from a
    /// checkpoint, whose position may be far behind (0: none).
    catch_up_to: AtomicU64,
    /// The copy is being replaced whole (a new snapshot, or a replica's new
    /// bootstrap) and follows no change until then: answers say `stale`.
    replacing: AtomicBool,
}

impl Freshness {
    pub fn applied(&self) -> Lsn {
        Lsn(self.applied.load(Ordering::Acquire))
    }

    /// Waits, at most `timeout`, until the copy has applied `target`; the
    /// applied position then, or `None` on timeout.
    pub async fn wait_applied(&self, target: Lsn, timeout: std::time::Duration) -> Option<Lsn> {
        self.watch.wait_for(target, timeout).await
    }

    pub fn server_wal_end(&self) -> Lsn {
        Lsn(self
            .server_wal_end
            .load(Ordering::Acquire)
            .max(self.applied.load(Ordering::Acquire)))
    }

    pub fn note_server_wal_end(&self, lsn: Lsn) {
        self.server_wal_end.fetch_max(lsn.0, Ordering::AcqRel);
    }

    pub fn note_message(&self, at: DateTime<Utc>) {
        self.last_message_us
            .store(at.timestamp_micros(), Ordering::Release);
    }

    pub fn is_loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire)
    }

    /// Marks the copy as being replaced (or no longer).
    pub fn set_replacing(&self, replacing: bool) {
        self.replacing.store(replacing, Ordering::Release);
    }

    /// Whether the copy served is being replaced and follows no change
    /// meanwhile: its numbers stay as of `applied` until the new one is in.
    pub fn is_replacing(&self) -> bool {
        self.replacing.load(Ordering::Acquire)
    }

    /// Whether the copy has reached the position `ReadModel::replace_behind`
    /// set (always, when none was set).
    pub fn caught_up(&self) -> bool {
        self.applied.load(Ordering::Acquire) >= self.catch_up_to.load(Ordering::Acquire)
    }

    pub fn lag_bytes(&self) -> u64 {
        self.applied().bytes_until(self.server_wal_end())
    }

    /// How far behind the owner the copy is, in time. Zero when it has
    /// applied everything the server reported (the stream, and the
    /// owner's flushed position); otherwise the age of the last applied
    /// commit (the heartbeat keeps that honest on an idle owner).
    pub fn lag_ms(&self, now: DateTime<Utc>) -> u64 {
        if self.lag_bytes() == 0 {
            return 0;
        }
        let commit = self.commit_time_us.load(Ordering::Acquire);
        if commit == 0 {
            return 0;
        }
        u64::try_from((now.timestamp_micros() - commit) / 1000).unwrap_or(0)
    }

    pub fn seconds_since_last_message(&self, now: DateTime<Utc>) -> Option<f64> {
        let at = self.last_message_us.load(Ordering::Acquire);
        (at != 0).then(|| ((now.timestamp_micros() - at) as f64 / 1e6).max(0.0))
    }

    fn publish(&self, tables: &Tables) {
        self.applied.store(tables.applied.0, Ordering::Release);
        if let Some(t) = tables.commit_time {
            self.commit_time_us
                .store(t.timestamp_micros(), Ordering::Release);
        }
        self.watch.publish(tables.applied);
    }
}

/// Whether a write's successor copy replaces the published one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Publish {
    Yes,
    /// Nothing changed, or the write failed: readers keep the copy they have.
    No,
}

/// The copy. Cheap to share: wrap in `Arc`.
#[derive(Debug, Default)]
pub struct ReadModel {
    /// The copy readers see: replaced whole, never changed in place.
    published: ArcSwap<Tables>,
    /// Held by the one writer at a time (apply, advance, merge, replace),
    /// never by a reader. It holds the copy the last swap replaced, dropped
    /// at the next swap: freeing a large transaction's superseded blocks is
    /// then the writer's work, not whichever reader let go last.
    writer: Mutex<Option<Arc<Tables>>>,
    pub freshness: Freshness,
    /// What each applied transaction changed, for pushers (`crate::http::events`);
    /// published after the swap, never waited on.
    pub feed: feed::Feed,
    /// The transactions applied, for owner reads that must see them all.
    pub xids: xids::AppliedXids,
}

impl ReadModel {
    pub fn new() -> Arc<ReadModel> {
        Arc::new(ReadModel::default())
    }

    /// A consistent copy: one atomic load, never a wait. It does not change
    /// while held; holding it long only keeps superseded blocks alive.
    pub fn read(&self) -> Arc<Tables> {
        self.published.load_full()
    }

    /// Runs `write` on a successor of the published copy and, when it says
    /// so, publishes the successor with one swap, then the freshness that
    /// describes it: a reader who sees the new applied position finds the
    /// data of it. Writers are serialised; readers are not involved.
    fn write<T>(&self, write: impl FnOnce(&mut Tables) -> (T, Publish)) -> T {
        let mut retired = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let mut next = Tables::clone(&self.published.load());
        let (outcome, publish) = write(&mut next);
        if publish == Publish::Yes {
            // The write's queued side-list edits, merged once for all of
            // them: a reader never meets a queue.
            next.calendars.settle();
            debug_assert!(next.calendars.is_settled());
            let next = Arc::new(next);
            let superseded = self.published.swap(Arc::clone(&next));
            self.freshness.publish(&next);
            // The copy before last: readers have long let go of it, so its
            // blocks are freed here, by the writer.
            *retired = Some(superseded);
        }
        outcome
    }

    /// Applies one committed owner transaction atomically. A transaction that
    /// committed before what the copy already holds is skipped: a reconnect
    /// can deliver it again, and applying it twice would be wrong for nothing.
    pub fn apply(&self, txn: &Transaction) -> Result<Applied, ApplyError> {
        // Before the change shows, so a reader's mark taken after includes it.
        self.xids.record(txn.xid);
        if txn.commit_lsn < self.published.load().applied {
            return Ok(Applied {
                skipped: true,
                ..Applied::default()
            });
        }
        // No walk to validate first: a spill file that cannot be read whole
        // fails the walk below, and a failed walk publishes nothing, so the
        // whole transaction stays unapplied.
        // (A spilled transaction's walks each read its file back: one fewer
        // is one fewer read of the file.)
        let applied = self.write(|tables| {
            // Checked again under the writer lock: the check above is only
            // a shortcut that skips taking it.
            if txn.commit_lsn < tables.applied {
                let skipped = Applied {
                    skipped: true,
                    ..Applied::default()
                };
                return (Ok(skipped), Publish::No);
            }
            let mut applied = Applied::default();
            let mut just_deleted = JustDeleted::Nothing;
            let walked = txn.changes.for_each(|change| {
                tables.apply_change_after(change, &mut just_deleted)?;
                match change.op() {
                    "upsert" => applied.upserts += 1,
                    "delete" => applied.deletes += 1,
                    _ => applied.truncates += 1,
                }
                Ok::<(), ApplyError>(())
            });
            if let Err(error) = walked {
                // Nothing is published: the copy stays as it was.
                return (Err(error), Publish::No);
            }
            tables.applied = txn.end_lsn;
            tables.commit_time = Some(txn.commit_time);
            (Ok(applied), Publish::Yes)
        })?;
        if !applied.skipped
            && let Some(mut item) = feed::FeedItem::from_transaction(txn)
        {
            // The copy that holds it: only this writer replaces copies, so
            // none came in between.
            let holder = self.published.load();
            item.timeline = holder.timeline;
            item.generation = holder.generation;
            self.feed.publish(item);
        }
        Ok(applied)
    }

    /// Advances the applied position without data: the server reported WAL
    /// past everything delivered, and nothing of ours is in flight.
    pub fn advance(&self, to: Lsn) {
        if to <= self.published.load().applied {
            return;
        }
        self.write(|tables| {
            if to <= tables.applied {
                return ((), Publish::No);
            }
            tables.applied = to;
            ((), Publish::Yes)
        });
    }

    /// Merges calendars re-read from the owner (the TTL safety net): for the
    /// calendars in `keys`, every night the read returned replaces the copy's,
    /// and a night the copy has but the read did not is removed, except the
    /// nights in `newer`, which the stream changed after the read began.
    /// Returns the nights that differed, as the changes that repaired them
    /// (the fleet's projector publishes them, `fleet::publish`). The applied
    /// LSN does not move: the read is no newer than what the stream already
    /// applied.
    pub fn merge_reread(
        &self,
        keys: &std::collections::HashSet<CalendarKey>,
        rows: &[(CalendarKey, NaiveDate, NightCounts)],
        newer: &std::collections::HashSet<(CalendarKey, NaiveDate)>,
    ) -> Vec<Change> {
        let mut owner: HashMap<CalendarKey, std::collections::BTreeMap<NaiveDate, NightCounts>> =
            keys.iter().map(|k| (*k, Default::default())).collect();
        for (key, night, counts) in rows {
            owner.entry(*key).or_default().insert(*night, *counts);
        }
        let merged = self.write(|tables| {
            let mut repairs: Vec<Change> = Vec::new();
            for (key, nights) in owner {
                let copy: Vec<(NaiveDate, NightCounts)> = tables
                    .calendars
                    .get(&key)
                    .map(|c| c.iter().collect())
                    .unwrap_or_default();
                for (night, _) in copy.iter().filter(|(n, _)| !nights.contains_key(n)) {
                    if !newer.contains(&(key, *night)) {
                        tables.calendars.remove_night(key, *night);
                        repairs.push(Change::DeleteNight { key, night: *night });
                    }
                }
                for (night, counts) in nights {
                    if newer.contains(&(key, night))
                        || tables.calendars.get(&key).and_then(|c| c.get(night)) == Some(counts)
                    {
                        continue;
                    }
                    tables.calendars.set(key, night, counts);
                    repairs.push(Change::UpsertNight { key, night, counts });
                }
            }
            if repairs.is_empty() {
                // Nothing differed: publish nothing, so readers keep their copy.
                return ((repairs, None), Publish::No);
            }
            let at = tables.applied;
            ((repairs, Some(at)), Publish::Yes)
        });
        let (repairs, at) = merged;
        if let Some(at) = at {
            // The stream did not deliver these values: open pages start over.
            let holder = self.published.load();
            self.feed.reset(at, holder.timeline, holder.generation);
        }
        repairs
    }

    /// Applies a re-read merge that the fleet's projector made at `at` (a
    /// replica): the same nights set and removed, in one swap. Skipped
    /// unless the copy is exactly at `at`: a merge made at an earlier
    /// position would put older values over newer ones. Returns whether it
    /// was applied.
    pub fn apply_merge(&self, at: Lsn, changes: &[Change]) -> Result<bool, ApplyError> {
        if self.published.load().applied != at || changes.is_empty() {
            return Ok(false);
        }
        let applied = self.write(|tables| {
            if tables.applied != at {
                return (Ok(false), Publish::No);
            }
            for change in changes {
                if let Err(error) = tables.apply_change(change) {
                    return (Err(error), Publish::No);
                }
            }
            (Ok(true), Publish::Yes)
        })?;
        if applied {
            let holder = self.published.load();
            self.feed.reset(at, holder.timeline, holder.generation);
        }
        Ok(applied)
    }

    /// Swaps in a complete copy loaded from a snapshot at `tables.applied`.
    /// Until then the old copy keeps serving.
    pub fn replace(&self, fresh: Tables) {
        self.replace_behind(fresh, Lsn::ZERO);
    }

    /// As `replace`, for a copy that must still catch up to the owner's
    /// position `catch_up_to` (a checkpoint's), set before the copy is
    /// marked loaded so no reader finds it loaded and caught up meanwhile.
    pub fn replace_behind(&self, fresh: Tables, catch_up_to: Lsn) {
        let at = fresh.applied;
        let timeline = fresh.timeline;
        // Without a commit time (a copy made without one), as current as
        // now: the lag then counts from the swap, never reads 0 while the
        // copy stays behind the owner (`Freshness::lag_ms`).
        let commit_time_us = fresh
            .commit_time
            .unwrap_or_else(Utc::now)
            .timestamp_micros();
        // The swap publishes the applied position with a plain store: a
        // resnapshot may land at a position before what a lost slot once
        // reported, so it resets rather than maxes.
        let generation = self.write(move |tables| {
            let generation = tables.generation + 1;
            *tables = fresh;
            tables.generation = generation;
            (generation, Publish::Yes)
        });
        self.freshness
            .commit_time_us
            .store(commit_time_us, Ordering::Release);
        // The owner's WAL end as last seen may be of another timeline (a
        // failover), far past anything the new copy's owner will reach
        // soon: start over from the new copy's own position, or the
        // owner's read after a checkpoint's load, so the lag reads what is
        // left to replay instead of 0 before the stream has said anything.
        self.freshness
            .server_wal_end
            .store(at.0.max(catch_up_to.0), Ordering::Release);
        // A snapshot is as new as the owner (0); a checkpoint is not.
        self.freshness
            .catch_up_to
            .store(catch_up_to.0, Ordering::Release);
        self.freshness.loaded.store(true, Ordering::Release);
        self.feed.reset(at, timeline, generation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot's copy that then applies nothing (a poison row, a held
    /// transaction, a full outbox) while the owner moves on: its lag grows
    /// from when it was current, not 0 for want of a commit time.
    #[test]
    fn a_copy_without_commits_lags_from_when_it_was_current() {
        let model = ReadModel::new();
        let snapshot_at = Utc::now() - chrono::Duration::minutes(1);
        model.replace(Tables {
            applied: Lsn(0x1000),
            commit_time: Some(snapshot_at),
            ..Tables::default()
        });
        assert_eq!(model.freshness.lag_ms(Utc::now()), 0, "caught up");
        model
            .freshness
            .note_server_wal_end(Lsn(0x1000 + (256 << 20)));
        let later = snapshot_at + chrono::Duration::minutes(10);
        assert_eq!(model.freshness.lag_ms(later), 600_000);

        let unstamped = ReadModel::new();
        unstamped.replace(Tables {
            applied: Lsn(0x1000),
            ..Tables::default()
        });
        unstamped
            .freshness
            .note_server_wal_end(Lsn(0x1000 + (256 << 20)));
        let lag = unstamped
            .freshness
            .lag_ms(Utc::now() + chrono::Duration::minutes(10));
        assert!(lag >= 600_000, "{lag}");
    }

    fn night(n: u64) -> NaiveDate {
        NaiveDate::from_ymd_opt(2027, 3, 1).unwrap() + chrono::Days::new(n)
    }

    fn upsert(hotel_id: i64, n: u64, taken: i32) -> Change {
        Change::UpsertNight {
            key: CalendarKey {
                hotel_id,
                room_type_id: 1,
            },
            night: night(n),
            counts: NightCounts {
                total: 10,
                taken,
                sell_limit: None,
                price_cents: Some(100),
            },
        }
    }

    fn txn(lsn: u64, changes: Vec<Change>) -> Transaction {
        Transaction {
            xid: lsn as u32,
            commit_lsn: Lsn(lsn),
            end_lsn: Lsn(lsn + 1),
            commit_time: DateTime::<Utc>::from_timestamp(1_800_000_000, 0).unwrap(),
            changes: changes.into(),
        }
    }

    fn taken(t: &Tables, hotel_id: i64, n: u64) -> Option<i32> {
        let key = CalendarKey {
            hotel_id,
            room_type_id: 1,
        };
        t.calendars.get(&key)?.get(night(n)).map(|c| c.taken)
    }

    /// A key change's upsert takes the TOASTed columns it did not send from
    /// the row deleted just before it; any change between them, or a plain
    /// upsert of a row that never existed, takes nothing.
    #[test]
    fn a_key_change_carries_the_unsent_columns_of_the_row_it_moves() {
        let hotel = |id: i64, name: &str| Hotel {
            id,
            name: name.to_string(),
            city: "Lisbon".to_string(),
            country: Some("PT".to_string()),
            stars: Some(3),
            latitude: None,
            longitude: None,
            amenities: vec!["wifi".to_string()],
        };
        let moved = |id: i64| Change::UpsertHotel {
            hotel: Box::new(Hotel {
                name: String::new(),
                amenities: Vec::new(),
                ..hotel(id, "")
            }),
            unsent: Unsent {
                name: true,
                amenities: true,
                ..Unsent::default()
            },
        };
        let model = ReadModel::new();
        let mut tables = Tables::default();
        tables
            .apply_change(&Change::UpsertHotel {
                hotel: Box::new(hotel(7, "A long name")),
                unsent: Unsent::default(),
            })
            .unwrap();
        tables
            .apply_change(&Change::UpsertHotel {
                hotel: Box::new(hotel(8, "Another")),
                unsent: Unsent::default(),
            })
            .unwrap();
        tables.applied = Lsn(10);
        model.replace(tables);
        model
            .apply(&txn(20, vec![Change::DeleteHotel { id: 7 }, moved(70)]))
            .unwrap();
        // The same pair with a change between: nothing carried.
        model
            .apply(&txn(
                30,
                vec![Change::DeleteHotel { id: 8 }, upsert(1, 0, 1), moved(80)],
            ))
            .unwrap();
        let t = model.read();
        assert_eq!(
            t.hotels.get(&70).map(|h| h.name.as_str()),
            Some("A long name")
        );
        assert_eq!(
            t.hotels.get(&70).map(|h| h.amenities.clone()),
            Some(vec!["wifi".to_string()])
        );
        assert!(!t.hotels.contains_key(&7));
        assert_eq!(t.hotels.get(&80).map(|h| h.name.as_str()), Some(""));
        drop(t);

        // An update of a column the copy does not hold decodes to the same
        // hotel: the published map is shared, not copied; a real change is.
        let before = model.read();
        let same = Change::UpsertHotel {
            hotel: Box::new(before.hotels[&70].clone()),
            unsent: Unsent::default(),
        };
        model.apply(&txn(40, vec![same])).unwrap();
        let after = model.read();
        assert!(Arc::ptr_eq(&before.hotels, &after.hotels));
        let renamed = Change::UpsertHotel {
            hotel: Box::new(hotel(70, "Renamed")),
            unsent: Unsent::default(),
        };
        model.apply(&txn(50, vec![renamed])).unwrap();
        let renamed_copy = model.read();
        assert!(!Arc::ptr_eq(&before.hotels, &renamed_copy.hotels));
        assert_eq!(renamed_copy.hotels[&70].name, "Renamed");
    }

    /// Three hotels with one night each, applied at LSN 10.
    fn three_hotels() -> Arc<ReadModel> {
        let model = ReadModel::new();
        let mut tables = Tables::default();
        for hotel_id in 1..=3 {
            tables.apply_change(&upsert(hotel_id, 0, 0)).unwrap();
        }
        tables.applied = Lsn(10);
        model.replace(tables);
        model
    }

    /// What a reader holds never changes under it, and publishing a
    /// transaction copies the blocks of the hotels it changed, no others.
    #[test]
    fn a_held_copy_stays_put_and_a_write_copies_only_what_it_changes() {
        let model = three_hotels();
        let held = model.read();
        let applied = model
            .apply(&txn(20, vec![upsert(1, 0, 4), upsert(2, 0, 4)]))
            .unwrap();
        assert_eq!(applied.upserts, 2);
        let now = model.read();
        assert_eq!((taken(&held, 1, 0), taken(&held, 2, 0)), (Some(0), Some(0)));
        assert_eq!(held.applied, Lsn(10));
        assert_eq!((taken(&now, 1, 0), taken(&now, 2, 0)), (Some(4), Some(4)));
        assert_eq!(now.applied, Lsn(21));
        assert_eq!(model.freshness.applied(), Lsn(21));
        // Hotel 3 is the one block both copies share.
        assert_eq!(now.calendars.blocks_shared_with(&held.calendars), 1);
        assert!(Arc::ptr_eq(&now.hotels, &held.hotels));
        assert!(Arc::ptr_eq(&now.room_types, &held.room_types));
    }

    /// A row holding a value the copy's cells use as a marker applies like
    /// any other (it was refused, and the refusal replayed forever halted
    /// every copy of the owner); a replay from before the copy's position
    /// is skipped, not applied.
    #[test]
    fn every_value_an_owner_row_holds_applies() {
        let model = three_hotels();
        let marked = NightCounts {
            total: i32::MIN,
            taken: i32::MIN,
            sell_limit: Some(i32::MIN),
            price_cents: Some(i32::MIN),
        };
        let key = CalendarKey {
            hotel_id: 3,
            room_type_id: 1,
        };
        let row = Change::UpsertNight {
            key,
            night: night(1),
            counts: marked,
        };
        let applied = model.apply(&txn(20, vec![upsert(1, 0, 7), row])).unwrap();
        assert!(!applied.skipped);
        let copy = model.read();
        assert_eq!(
            copy.calendars.get(&key).unwrap().get(night(1)),
            Some(marked)
        );
        assert_eq!(taken(&copy, 1, 0), Some(7));
        assert!(model.freshness.applied() >= Lsn(20));
        let replay = model.apply(&txn(5, vec![upsert(2, 0, 9)])).unwrap();
        assert!(replay.skipped);
        assert_eq!(taken(&model.read(), 2, 0), Some(0));
    }

    /// A streamed transaction holds every change until commit: a bulk
    /// update of millions of nights must not pay for the widest row.
    #[test]
    fn a_held_change_costs_48_bytes() {
        assert!(
            std::mem::size_of::<Change>() <= 48,
            "Change is {} bytes",
            std::mem::size_of::<Change>()
        );
    }
}

//! `Calendars`: every calendar of the copy, laid out hotel by hotel with
//! nights as rows and room types as columns.
//!
//! Search asks one thing of a city's hotels: for each room type, the fewest
//! units free over a few nights. Kept as one vector per room type, that cost
//! two cache misses per room type (the map slot, then the vector), 4,000 per
//! question for a city of 200 hotels × 20 room types, and it was half of
//! search's time. Here a hotel's room types share one block: a 3-night stay
//! is three adjacent runs of 20 × 12 bytes, so one map lookup and a handful
//! of cache lines per hotel.
//!
//! Writes pay for it where they are rare: a new room type restrides its
//! hotel's block (room types are created once, nights every day), while a
//! new night appends a row and a past night leaving drops one from the front.
//! `sell_limit`, set on few nights, lives in a sorted side list per block.

use std::collections::HashMap;
use std::sync::Arc;

use chrono::NaiveDate;

use super::CalendarKey;
use super::calendar::{ABSENT, Calendar, NightCounts, Packed, UnstorableValue, date, day};

/// One hotel's calendars.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Block {
    /// Room type ids, sorted: one column each.
    types: Vec<i64>,
    /// Nights with a row, per column; a column leaves when it reaches 0.
    present: Vec<u32>,
    /// Day (since 1970-01-01) of row 0.
    first: i32,
    /// `rows × types.len()` nights, one row per day.
    cells: Vec<Packed>,
    /// `(day, column, sell_limit)` of the nights whose limit is set, sorted.
    limits: Vec<(i32, u32, i32)>,
}

impl Block {
    fn width(&self) -> usize {
        self.types.len()
    }

    fn rows(&self) -> usize {
        self.cells.len().checked_div(self.width()).unwrap_or(0)
    }

    fn row_of(&self, d: i32) -> Option<usize> {
        let r = usize::try_from(i64::from(d) - i64::from(self.first)).ok()?;
        (r < self.rows()).then_some(r)
    }

    fn night(&self, col: usize, d: i32) -> Option<NightCounts> {
        let p = self.cells[self.row_of(d)? * self.width() + col];
        if p.total == ABSENT {
            return None;
        }
        p.unpack(self.limit_of(d, col))
    }

    fn limit_of(&self, d: i32, col: usize) -> Option<i32> {
        if self.limits.is_empty() {
            return None;
        }
        self.limits
            .binary_search_by_key(&(d, col as u32), |(d, c, _)| (*d, *c))
            .ok()
            .map(|at| self.limits[at].2)
    }

    /// The first limit on day `d` or later (`partition_point(day < d)`).
    /// Limits are spread over the block's rows, so the search starts where
    /// `d` would sit if they were spread evenly and walks from there: a
    /// line or two, where a binary search over a hotel's limits took a
    /// cache miss per step and was an eighth of a search's fold.
    fn first_limit_from(&self, d: i32) -> usize {
        const MAX_WALK: usize = 16;
        let (n, rows) = (self.limits.len(), self.rows());
        if n == 0 || rows == 0 {
            return 0;
        }
        let offset = (i64::from(d) - i64::from(self.first)).clamp(0, rows as i64) as usize;
        let mut at = (offset * n / rows).min(n);
        for _ in 0..MAX_WALK {
            if at > 0 && self.limits[at - 1].0 >= d {
                at -= 1;
            } else if at < n && self.limits[at].0 < d {
                at += 1;
            } else {
                return at;
            }
        }
        // Unevenly spread: fall back to the search.
        self.limits.partition_point(|l| l.0 < d)
    }

    fn set_limit(&mut self, d: i32, col: usize, limit: Option<i32>) {
        let found = self
            .limits
            .binary_search_by_key(&(d, col as u32), |(d, c, _)| (*d, *c));
        match (found, limit) {
            (Ok(at), Some(l)) => self.limits[at].2 = l,
            (Ok(at), None) => {
                self.limits.remove(at);
            }
            (Err(at), Some(l)) => self.limits.insert(at, (d, col as u32, l)),
            (Err(_), None) => {}
        }
    }

    /// A new, empty column at `at`: every row is rewritten once.
    fn insert_column(&mut self, at: usize, room_type_id: i64) {
        let (w, rows) = (self.width(), self.rows());
        let mut cells = Vec::with_capacity(rows * (w + 1));
        for row in self.cells.chunks_exact(w.max(1)).take(rows) {
            cells.extend_from_slice(&row[..at]);
            cells.push(Packed::EMPTY);
            cells.extend_from_slice(&row[at..]);
        }
        self.cells = cells;
        self.types.insert(at, room_type_id);
        self.present.insert(at, 0);
        for l in self.limits.iter_mut().filter(|l| l.1 as usize >= at) {
            l.1 += 1;
        }
    }

    fn remove_column(&mut self, at: usize) {
        let w = self.width();
        let mut cells = Vec::with_capacity(self.rows() * (w - 1));
        for row in self.cells.chunks_exact(w) {
            cells.extend_from_slice(&row[..at]);
            cells.extend_from_slice(&row[at + 1..]);
        }
        self.cells = cells;
        self.types.remove(at);
        self.present.remove(at);
        self.limits.retain(|l| l.1 as usize != at);
        for l in self.limits.iter_mut().filter(|l| l.1 as usize > at) {
            l.1 -= 1;
        }
        self.trim();
    }

    /// The row for day `d`, adding rows at either end as needed. Needs a column.
    fn ensure_row(&mut self, d: i32) -> usize {
        let w = self.width();
        if self.cells.is_empty() {
            self.first = d;
        }
        if d < self.first {
            let grow = (self.first - d) as usize;
            self.cells
                .splice(0..0, std::iter::repeat_n(Packed::EMPTY, grow * w));
            self.first = d;
        }
        let row = (d - self.first) as usize;
        if row >= self.rows() {
            self.cells.resize((row + 1) * w, Packed::EMPTY);
        }
        row
    }

    fn row_is_empty(&self, row: usize) -> bool {
        let w = self.width();
        self.cells[row * w..(row + 1) * w]
            .iter()
            .all(|p| p.total == ABSENT)
    }

    /// Drops empty rows at both ends, so a calendar spans what it holds.
    fn trim(&mut self) {
        let w = self.width();
        if w == 0 {
            self.cells.clear();
            self.first = 0;
            return;
        }
        let lead = (0..self.rows())
            .take_while(|&r| self.row_is_empty(r))
            .count();
        if lead > 0 {
            self.cells.drain(..lead * w);
            self.first += lead as i32;
        }
        while self.rows() > 0 && self.row_is_empty(self.rows() - 1) {
            self.cells.truncate(self.cells.len() - w);
        }
        if self.cells.is_empty() {
            self.first = 0;
        }
    }

    fn set(&mut self, room_type_id: i64, d: i32, packed: Packed, limit: Option<i32>) {
        let col = match self.types.binary_search(&room_type_id) {
            Ok(col) => col,
            Err(at) => {
                self.insert_column(at, room_type_id);
                at
            }
        };
        let at = self.ensure_row(d) * self.width() + col;
        if self.cells[at].total == ABSENT {
            self.present[col] += 1;
        }
        self.cells[at] = packed;
        self.set_limit(d, col, limit);
    }

    fn remove(&mut self, room_type_id: i64, d: i32) {
        let Ok(col) = self.types.binary_search(&room_type_id) else {
            return;
        };
        let Some(row) = self.row_of(d) else { return };
        let at = row * self.width() + col;
        if self.cells[at].total == ABSENT {
            return;
        }
        self.cells[at] = Packed::EMPTY;
        self.present[col] -= 1;
        self.set_limit(d, col, None);
        if self.present[col] == 0 {
            self.remove_column(col);
        } else {
            self.trim();
        }
    }

    fn view(&self, room_type_id: i64) -> Option<CalendarView<'_>> {
        let col = self.types.binary_search(&room_type_id).ok()?;
        Some(CalendarView { block: self, col })
    }

    fn heap_bytes(&self) -> usize {
        self.cells.capacity() * std::mem::size_of::<Packed>()
            + self.limits.capacity() * std::mem::size_of::<(i32, u32, i32)>()
            + self.types.capacity() * std::mem::size_of::<i64>()
            + self.present.capacity() * std::mem::size_of::<u32>()
    }

    fn shrink(&mut self) {
        self.cells.shrink_to_fit();
        self.limits.shrink_to_fit();
        self.types.shrink_to_fit();
        self.present.shrink_to_fit();
    }

    /// A block laid out at once from whole calendars with distinct, sorted
    /// room types, in exactly the memory it needs.
    fn from_calendars(calendars: &[(i64, Calendar)]) -> Block {
        let spans = calendars
            .iter()
            .filter(|(_, c)| !c.is_empty())
            .map(|(_, c)| (c.first_day(), c.first_day() + c.nights().len() as i32));
        let (Some(first), Some(end)) = (spans.clone().map(|s| s.0).min(), spans.map(|s| s.1).max())
        else {
            return Block::default();
        };
        let kept: Vec<&(i64, Calendar)> = calendars.iter().filter(|(_, c)| !c.is_empty()).collect();
        let w = kept.len();
        let rows = (end - first) as usize;
        let mut cells = vec![Packed::EMPTY; rows * w];
        let mut limits = Vec::new();
        for (col, (_, c)) in kept.iter().enumerate() {
            let offset = (c.first_day() - first) as usize;
            for (i, p) in c.nights().iter().enumerate() {
                cells[(offset + i) * w + col] = *p;
            }
            limits.extend(c.limits().iter().map(|&(d, l)| (d, col as u32, l)));
        }
        limits.sort_unstable();
        Block {
            types: kept.iter().map(|(id, _)| *id).collect(),
            present: kept.iter().map(|(_, c)| c.len() as u32).collect(),
            first,
            cells,
            limits,
        }
    }
}

/// How many shards the hotels are spread over. A published copy is a
/// vector of this many `Arc`s: publishing a transaction clones that vector
/// (256 reference counts, about a microsecond) and the shards it changed,
/// instead of a map of every hotel.
const SHARDS: usize = 256;

/// One shard: its hotels' blocks, each behind an `Arc` shared with every
/// published copy that has not changed it.
type Shard = HashMap<i64, Arc<Block>, rustc_hash::FxBuildHasher>;

/// Every calendar of the copy, copy-on-write: cloning it shares every
/// block, and a write copies only the block (and shard) it changes, so a
/// reader's copy never changes under it and a writer never waits for one.
///
/// Sharded rather than a persistent map (`imbl`'s HAMT): search looks up
/// hundreds of hotels per answer, and a lookup here stays one Fx probe in
/// a small map plus one pointer, where a trie walks several nodes.
/// Fx hashing: the keys are our own integers, not attacker-chosen strings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Calendars {
    shards: Vec<Arc<Shard>>,
}

impl Default for Calendars {
    fn default() -> Calendars {
        Calendars {
            shards: vec![Arc::default(); SHARDS],
        }
    }
}

/// The shard of a hotel: Fibonacci hashing of its id, since ids are
/// often dense and a plain modulus would be as good as any, but a seed
/// with a stride would pile onto a few shards.
fn shard_of(hotel_id: i64) -> usize {
    ((hotel_id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize
}

impl Calendars {
    fn block(&self, hotel_id: i64) -> Option<&Block> {
        self.shards[shard_of(hotel_id)].get(&hotel_id).map(|b| &**b)
    }

    /// The shard of `hotel_id`, copied first if a published copy shares it.
    fn shard_mut(&mut self, hotel_id: i64) -> &mut Shard {
        Arc::make_mut(&mut self.shards[shard_of(hotel_id)])
    }

    fn blocks(&self) -> impl Iterator<Item = (&i64, &Block)> + '_ {
        self.shards
            .iter()
            .flat_map(|shard| shard.iter().map(|(id, b)| (id, &**b)))
    }

    pub fn get(&self, key: &CalendarKey) -> Option<CalendarView<'_>> {
        self.block(key.hotel_id)?.view(key.room_type_id)
    }

    /// One hotel's calendars, for reading several of its room types.
    pub fn hotel(&self, hotel_id: i64) -> Option<HotelCalendars<'_>> {
        self.block(hotel_id).map(|block| HotelCalendars { block })
    }

    /// Sets one night of one calendar.
    pub fn set(
        &mut self,
        key: CalendarKey,
        night: NaiveDate,
        counts: NightCounts,
    ) -> Result<(), UnstorableValue> {
        // Checked before anything changes, so a refused row leaves no column.
        let packed = Packed::pack(counts).ok_or(UnstorableValue(i32::MIN))?;
        let block = self
            .shard_mut(key.hotel_id)
            .entry(key.hotel_id)
            .or_default();
        Arc::make_mut(block).set(key.room_type_id, day(night), packed, counts.sell_limit);
        Ok(())
    }

    /// Removes one night; a calendar left with none is gone.
    pub fn remove_night(&mut self, key: CalendarKey, night: NaiveDate) {
        let d = day(night);
        // Looked at through the shared copy first: a night that is not
        // there costs no copy of its block.
        let present = self
            .get(&key)
            .is_some_and(|view| view.block.night(view.col, d).is_some());
        if !present {
            return;
        }
        let shard = self.shard_mut(key.hotel_id);
        if let Some(block) = shard.get_mut(&key.hotel_id) {
            let block = Arc::make_mut(block);
            block.remove(key.room_type_id, d);
            if block.types.is_empty() {
                shard.remove(&key.hotel_id);
            }
        }
    }

    /// Adds a hotel's calendars, built one room type at a time (the snapshot
    /// load): laid out once at their exact size when the hotel is new, merged
    /// night by night when some of its rows came earlier.
    pub fn insert_hotel(&mut self, hotel_id: i64, calendars: &mut [(i64, Calendar)]) {
        calendars.sort_unstable_by_key(|(id, _)| *id);
        let distinct = calendars.windows(2).all(|w| w[0].0 != w[1].0);
        let shard = self.shard_mut(hotel_id);
        if distinct && !shard.contains_key(&hotel_id) {
            let block = Block::from_calendars(calendars);
            if !block.types.is_empty() {
                shard.insert(hotel_id, Arc::new(block));
            }
            return;
        }
        let block = Arc::make_mut(shard.entry(hotel_id).or_default());
        for (room_type_id, calendar) in calendars.iter() {
            for (night, counts) in calendar.iter() {
                // A calendar holds only storable values, so this always packs.
                if let Some(packed) = Packed::pack(counts) {
                    block.set(*room_type_id, day(night), packed, counts.sell_limit);
                }
            }
        }
        if block.types.is_empty() {
            shard.remove(&hotel_id);
        }
    }

    pub fn clear(&mut self) {
        *self = Calendars::default();
    }

    /// Calendars (hotel × room type) with at least one night.
    pub fn len(&self) -> usize {
        self.blocks().map(|(_, b)| b.width()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.shards.iter().all(|shard| shard.is_empty())
    }

    pub fn keys(&self) -> impl Iterator<Item = CalendarKey> + '_ {
        self.iter().map(|(k, _)| k)
    }

    pub fn iter(&self) -> impl Iterator<Item = (CalendarKey, CalendarView<'_>)> + '_ {
        self.blocks().flat_map(|(&hotel_id, block)| {
            block.types.iter().enumerate().map(move |(col, &id)| {
                (
                    CalendarKey {
                        hotel_id,
                        room_type_id: id,
                    },
                    CalendarView { block, col },
                )
            })
        })
    }

    /// Nights held, over all calendars.
    pub fn rows(&self) -> u64 {
        self.blocks()
            .flat_map(|(_, b)| b.present.iter())
            .map(|&n| u64::from(n))
            .sum()
    }

    /// Heap bytes of the night data, for the memory figures.
    pub fn heap_bytes(&self) -> u64 {
        self.blocks().map(|(_, b)| b.heap_bytes() as u64).sum()
    }

    /// Releases spare capacity after a bulk load (when nothing shares it yet;
    /// a shared block is left as it is rather than copied to shrink it).
    pub fn shrink(&mut self) {
        for shard in &mut self.shards {
            if let Some(shard) = Arc::get_mut(shard) {
                for block in shard.values_mut() {
                    if let Some(block) = Arc::get_mut(block) {
                        block.shrink();
                    }
                }
                shard.shrink_to_fit();
            }
        }
    }

    /// Blocks shared with `other` (the same allocation, not equal contents):
    /// what a published copy and its successor have in common.
    pub fn blocks_shared_with(&self, other: &Calendars) -> usize {
        self.shards
            .iter()
            .zip(&other.shards)
            .map(|(mine, theirs)| {
                mine.iter()
                    .filter(|(id, b)| theirs.get(id).is_some_and(|t| Arc::ptr_eq(b, t)))
                    .count()
            })
            .sum()
    }
}

/// One hotel's calendars.
#[derive(Debug, Clone, Copy)]
pub struct HotelCalendars<'a> {
    block: &'a Block,
}

impl<'a> HotelCalendars<'a> {
    pub fn room_type(&self, room_type_id: i64) -> Option<CalendarView<'a>> {
        self.block.view(room_type_id)
    }

    /// The hotel's room types that have nights, sorted: the order of
    /// `fold_stay`'s answer.
    pub fn room_type_ids(&self) -> &'a [i64] {
        &self.block.types
    }

    /// Folds the `nights` nights from `check_in` on into one accumulator per
    /// room type, walking the block row by row: in memory order, so the
    /// hardware prefetcher streams it (column by column, each night of each
    /// room type would be a separate cache line).
    pub fn fold_stay<T: Clone>(
        &self,
        check_in: NaiveDate,
        nights: usize,
        init: T,
        step: impl FnMut(&mut T, Option<NightCounts>),
    ) -> Vec<T> {
        let mut acc = Vec::new();
        self.fold_stay_into(check_in, nights, init, step, &mut acc);
        acc
    }

    /// `fold_stay` into a caller's vector (cleared first), so a search over
    /// hundreds of hotels reuses one allocation.
    pub fn fold_stay_into<T: Clone>(
        &self,
        check_in: NaiveDate,
        nights: usize,
        init: T,
        mut step: impl FnMut(&mut T, Option<NightCounts>),
        acc: &mut Vec<T>,
    ) {
        let b = self.block;
        let w = b.width();
        acc.clear();
        acc.resize(w, init);
        let start = day(check_in);
        // The limits are sorted by (day, column) like the rows: one search
        // for the first night, then a forward walk along with the rows.
        let mut next_limit = b.first_limit_from(start);
        for i in 0..nights {
            let row = start
                .checked_add(i as i32)
                .and_then(|d| Some((d, b.row_of(d)?)));
            match row {
                Some((d, r)) => {
                    while b.limits.get(next_limit).is_some_and(|l| l.0 < d) {
                        next_limit += 1;
                    }
                    // This night's limits, in column order: merged along
                    // the row rather than searched for per cell.
                    let mut limits = b.limits[next_limit..]
                        .iter()
                        .take_while(|l| l.0 == d)
                        .peekable();
                    for (col, (a, p)) in
                        acc.iter_mut().zip(&b.cells[r * w..(r + 1) * w]).enumerate()
                    {
                        let limit = limits.next_if(|l| l.1 as usize == col).map(|l| l.2);
                        step(a, p.unpack(limit));
                    }
                }
                None => acc.iter_mut().for_each(|a| step(a, None)),
            }
        }
    }
}

/// One calendar (hotel × room type), read in place.
#[derive(Debug, Clone, Copy)]
pub struct CalendarView<'a> {
    block: &'a Block,
    col: usize,
}

impl<'a> CalendarView<'a> {
    pub fn get(&self, night: NaiveDate) -> Option<NightCounts> {
        self.block.night(self.col, day(night))
    }

    /// Nights that have a row.
    pub fn len(&self) -> usize {
        self.block.present[self.col] as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every night with a row, in date order.
    pub fn iter(&self) -> impl Iterator<Item = (NaiveDate, NightCounts)> + use<'a> {
        let (block, col) = (self.block, self.col);
        (0..block.rows()).filter_map(move |r| {
            let d = block.first + r as i32;
            Some((date(d), block.night(col, d)?))
        })
    }

    /// The `nights` nights from `check_in` on, each `None` when it has no
    /// row: a strided walk over a few adjacent rows, the inner loop of search.
    pub fn stay(
        &self,
        check_in: NaiveDate,
        nights: usize,
    ) -> impl Iterator<Item = Option<NightCounts>> + use<'a> {
        let (block, col, d) = (self.block, self.col, day(check_in));
        (0..nights).map(move |i| block.night(col, d.checked_add(i as i32)?))
    }

    /// Nights in `[from, to)` that have a row.
    pub fn range(
        &self,
        from: NaiveDate,
        to: NaiveDate,
    ) -> impl Iterator<Item = (NaiveDate, NightCounts)> + use<'a> {
        self.iter().filter(move |(n, _)| *n >= from && *n < to)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn d(n: i64) -> NaiveDate {
        NaiveDate::from_ymd_opt(2027, 1, 1).unwrap() + chrono::Duration::days(n)
    }

    fn key(hotel_id: i64, room_type_id: i64) -> CalendarKey {
        CalendarKey {
            hotel_id,
            room_type_id,
        }
    }

    fn counts(total: i32, taken: i32, sell_limit: Option<i32>) -> NightCounts {
        NightCounts {
            total,
            taken,
            sell_limit,
            price_cents: Some(100),
        }
    }

    #[test]
    fn a_stay_reads_adjacent_rows_of_one_block() {
        let mut c = Calendars::default();
        for rt in [3, 1, 2] {
            for n in 0..10 {
                c.set(key(7, rt), d(n), counts(rt as i32, 0, None)).unwrap();
            }
        }
        let block = c.block(7).unwrap();
        assert_eq!(block.types, vec![1, 2, 3]);
        assert_eq!(block.cells.len(), 30);
        // Row 4 holds night 4 of every room type, side by side.
        let row: Vec<i32> = block.cells[12..15].iter().map(|p| p.total).collect();
        assert_eq!(row, vec![1, 2, 3]);
        let stay: Vec<_> = c.get(&key(7, 2)).unwrap().stay(d(8), 3).collect();
        assert_eq!(
            stay,
            vec![Some(counts(2, 0, None)), Some(counts(2, 0, None)), None]
        );
    }

    #[test]
    fn limits_follow_their_column_when_columns_come_and_go() {
        let mut c = Calendars::default();
        c.set(key(1, 5), d(0), counts(4, 0, Some(6))).unwrap();
        c.set(key(1, 9), d(0), counts(4, 0, Some(8))).unwrap();
        c.set(key(1, 2), d(0), counts(4, 0, None)).unwrap();
        assert_eq!(
            c.get(&key(1, 9)).unwrap().get(d(0)).unwrap().sell_limit,
            Some(8)
        );
        c.remove_night(key(1, 5), d(0));
        assert!(c.get(&key(1, 5)).is_none());
        assert_eq!(
            c.get(&key(1, 9)).unwrap().get(d(0)).unwrap().sell_limit,
            Some(8)
        );
        assert_eq!(
            c.get(&key(1, 2)).unwrap().get(d(0)).unwrap().sell_limit,
            None
        );
        c.remove_night(key(1, 9), d(0));
        c.remove_night(key(1, 2), d(0));
        assert!(c.is_empty());
    }

    #[test]
    fn a_refused_value_adds_nothing() {
        let mut c = Calendars::default();
        let bad = counts(i32::MIN, 0, None);
        assert!(c.set(key(1, 1), d(0), bad).is_err());
        assert!(c.is_empty());
        assert_eq!(c.len(), 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Set(i64, i64, i64, i32, i32, Option<i32>),
        Remove(i64, i64, i64),
        /// Load a hotel's calendars in bulk, as the snapshot does.
        Bulk(i64, Vec<(i64, i64, i32)>),
    }

    fn op() -> impl Strategy<Value = Op> {
        let hotel = 0i64..3;
        let rt = 0i64..5;
        let night = 0i64..40;
        prop_oneof![
            4 => (hotel.clone(), rt.clone(), night.clone(), 0i32..50, 0i32..50, proptest::option::of(0i32..60))
                .prop_map(|(h, r, n, t, k, s)| Op::Set(h, r, n, t, k, s)),
            3 => (hotel.clone(), rt.clone(), night.clone()).prop_map(|(h, r, n)| Op::Remove(h, r, n)),
            1 => (hotel, proptest::collection::vec((rt, night, 0i32..50), 0..30))
                .prop_map(|(h, rows)| Op::Bulk(h, rows)),
        ]
    }

    proptest! {
        /// Whatever the order of writes, the blocks answer exactly like a
        /// map from (hotel, room type, night) to counts.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec(op(), 0..200)) {
            let mut cals = Calendars::default();
            let mut map: BTreeMap<(CalendarKey, NaiveDate), NightCounts> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Set(h, r, n, t, k, s) => {
                        let c = counts(t, k, s);
                        cals.set(key(h, r), d(n), c).unwrap();
                        map.insert((key(h, r), d(n)), c);
                    }
                    Op::Remove(h, r, n) => {
                        cals.remove_night(key(h, r), d(n));
                        map.remove(&(key(h, r), d(n)));
                    }
                    Op::Bulk(h, rows) => {
                        let mut built: Vec<(i64, Calendar)> = Vec::new();
                        for (r, n, t) in rows {
                            let c = counts(t, 0, None);
                            let at = match built.iter().position(|(id, _)| *id == r) {
                                Some(at) => at,
                                None => {
                                    built.push((r, Calendar::default()));
                                    built.len() - 1
                                }
                            };
                            built[at].1.set(d(n), c).unwrap();
                            map.insert((key(h, r), d(n)), c);
                        }
                        cals.insert_hotel(h, &mut built);
                    }
                }
            }
            let mut got: Vec<_> = cals
                .iter()
                .flat_map(|(k, v)| v.iter().map(move |(n, c)| ((k, n), c)))
                .collect();
            got.sort_by_key(|(k, _)| *k);
            let want: Vec<_> = map.iter().map(|(k, c)| (*k, *c)).collect();
            prop_assert_eq!(cals.rows(), want.len() as u64);
            prop_assert_eq!(got, want);
            let keys: std::collections::BTreeSet<CalendarKey> = map.keys().map(|(k, _)| *k).collect();
            prop_assert_eq!(cals.len(), keys.len());
            for (h, block) in cals.blocks() {
                // Tight: no empty column, no empty edge row.
                prop_assert!(block.present.iter().all(|&p| p > 0), "hotel {} has an empty column", h);
                prop_assert!(block.rows() == 0 || (!block.row_is_empty(0) && !block.row_is_empty(block.rows() - 1)));
                let hotel = cals.hotel(*h).unwrap();
                for (from, nights) in [(5, 7), (-3, 5), (0, 1), (18, 3), (36, 10)] {
                    let folded = hotel.fold_stay(d(from), nights, Vec::new(), |v: &mut Vec<Option<NightCounts>>, n| v.push(n));
                    for (rt, got) in hotel.room_type_ids().iter().zip(folded) {
                        let walked: Vec<_> = cals.get(&key(*h, *rt)).unwrap().stay(d(from), nights).collect();
                        prop_assert_eq!(got, walked);
                    }
                }
                for day in -2..45 {
                    let want = block.limits.partition_point(|l| l.0 < super::day(d(day)));
                    prop_assert_eq!(block.first_limit_from(super::day(d(day))), want);
                }
                for (k, n) in map.keys() {
                    if k.hotel_id == *h {
                        let stay: Vec<_> = cals.get(k).unwrap().stay(*n, 1).collect();
                        prop_assert_eq!(stay, vec![map.get(&(*k, *n)).copied()]);
                    }
                }
            }
        }
    }
}

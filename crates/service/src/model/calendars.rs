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
//! What a night's 8-byte cell cannot say (a limited night's total, a count
//! past 16 bits) lives in sorted side lists per block (`calendar::Packed`).
//! A write that changes a side list's length queues the edit (`Unsettled`)
//! and merges the queue in one pass, so a transaction that limits every
//! night of a hotel costs a merge, not a copy of the list per night.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use chrono::NaiveDate;

use super::CalendarKey;
use super::calendar::{Calendar, NightCounts, Packed, PackedNight, WideNight, date, day};

/// Rows (days) per page. A write copies the one page it changes, not its
/// hotel's whole block: 16 rows of 20 room types are 3.8 KB, where a block
/// of two years is 175 KB and copying it cost a one-row transaction more
/// than the rest of its apply.
const PAGE_ROWS: i32 = 16;

/// One hotel's calendars.
///
/// Rows are days; each page holds `PAGE_ROWS` consecutive rows, row by row,
/// and sits behind an `Arc` shared with every published copy that has not
/// changed it. Pages are aligned to absolute days (`base` is a multiple of
/// `PAGE_ROWS`), so growing or trimming the span never moves a row to
/// another page.
///
/// The block itself sits inline in its shard's map, and every vector in it
/// is an `Arc` slice: cloning a block is a handful of reference counts (a
/// shard is cloned whole when a transaction touches it), and a search
/// reaches a night in three loads (the map's bucket, the page list, the
/// page), not five. Slices whose length search checks (`pages`, `limits`)
/// carry it in the pointer, so an empty list costs no load at all.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Block {
    /// Room type ids, sorted: one column each.
    types: Arc<[i64]>,
    /// Nights with a row, per column; a column leaves when it reaches 0.
    present: Arc<[u32]>,
    /// Day (since 1970-01-01) of page 0's first row.
    base: i32,
    /// The days with at least one night: `[first, end)`.
    first: i32,
    end: i32,
    /// `PAGE_ROWS × types.len()` nights each. Rebuilt when a page comes or
    /// goes (every 16 days at either end of a calendar, or a new column).
    pages: Arc<[Arc<[Packed]>]>,
    /// `(day, column, total)` of the nights whose limit is set (their cells
    /// hold the limit), sorted; shared like the pages, rebuilt when a limit
    /// is added or removed.
    limited: Arc<[Side<i32>]>,
    /// The nights whose cells are `WIDE`, sorted like `limited`; empty in
    /// every real hotel, which lets search fold a block's cells alone.
    wide: Arc<[Side<WideNight>]>,
}

/// Side-list edits that change a list's length (a night gains or loses its
/// limit or its wide entry), by (day, column), `None` removing: queued and
/// merged in one pass (`Block::settle`).
///
/// Inserting into a shared sorted slice copies it whole. A transaction
/// that set a sell limit on every night of a hotel of 20 room types × 730
/// nights copied its list 14,600 times: 0.2 s a hotel, and about 18 minutes
/// of apply, the copy's lag growing all along, for 5,000 such hotels. A
/// block settles on its own once its queue reaches an eighth of its list
/// (`SETTLE_AT` at least), so the merges cost about nine copies of the
/// final list, and the queue's memory stays a fraction of the list's. A
/// read within the write consults the queue (`Block::night`, the folds'
/// slow path); readers of a published copy never see one. Kept beside the
/// blocks (`Calendars::unsettled`), not in them: a block is read by every
/// search, and a field more made each one longer for a state no reader of
/// a published copy meets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Unsettled {
    limited: BTreeMap<(i32, u32), Option<i32>>,
    wide: BTreeMap<(i32, u32), Option<WideNight>>,
}

/// Queued edits a block holds at least before it merges them on its own.
const SETTLE_AT: usize = 256;

impl Unsettled {
    fn is_large(&self, limited: usize, wide: usize) -> bool {
        self.limited.len() > SETTLE_AT.max(limited / 8) || self.wide.len() > SETTLE_AT.max(wide / 8)
    }
}

/// What a block keeps beside one night's cell: `(day, column, value)`,
/// in lists sorted by day, then column, like the rows and their cells.
type Side<T> = (i32, u32, T);

/// The value kept for day `d`'s cell in `col`.
fn side_at<T: Copy>(side: &[Side<T>], d: i32, col: usize) -> Option<T> {
    if side.is_empty() {
        return None;
    }
    side.binary_search_by_key(&(d, col as u32), |(d, c, _)| (*d, *c))
        .ok()
        .map(|at| side[at].2)
}

/// The value kept for day `d`'s cell in `col`, a queued edit first.
fn side_value<T: Copy>(
    side: &[Side<T>],
    queued: Option<&BTreeMap<(i32, u32), Option<T>>>,
    d: i32,
    col: usize,
) -> Option<T> {
    match queued.and_then(|q| q.get(&(d, col as u32))) {
        Some(edit) => *edit,
        None => side_at(side, d, col),
    }
}

/// Sets or clears the value kept for the cell at `key` (day, column) where
/// that needs no change of `side`'s length: in a queued edit of that cell,
/// or in place. Returns the edit to queue otherwise.
fn side_edit<T: Copy + PartialEq>(
    side: &mut Arc<[Side<T>]>,
    queued: Option<&mut BTreeMap<(i32, u32), Option<T>>>,
    key: (i32, u32),
    value: Option<T>,
) -> Option<Option<T>> {
    if let Some(edit) = queued.and_then(|q| q.get_mut(&key)) {
        *edit = value;
        return None;
    }
    match (side.binary_search_by_key(&key, |(d, c, _)| (*d, *c)), value) {
        (Ok(at), Some(v)) => {
            if side[at].2 != v {
                Arc::make_mut(side)[at].2 = v;
            }
            None
        }
        (Ok(_), None) | (Err(_), Some(_)) => Some(value),
        (Err(_), None) => None,
    }
}

/// `side` with the queued edits merged in, in one pass: an edit replaces
/// or removes its cell's entry, or adds one.
fn merged<T: Copy>(side: &[Side<T>], queued: BTreeMap<(i32, u32), Option<T>>) -> Arc<[Side<T>]> {
    let mut out = Vec::with_capacity(side.len() + queued.len());
    let mut kept = side.iter().peekable();
    for ((d, col), edit) in queued {
        while let Some(entry) = kept.next_if(|e| (e.0, e.1) < (d, col)) {
            out.push(*entry);
        }
        // The entry the edit replaces or removes, if any.
        kept.next_if(|e| (e.0, e.1) == (d, col));
        if let Some(value) = edit {
            out.push((d, col, value));
        }
    }
    out.extend(kept);
    out.into()
}

/// A side list with its columns renumbered for a new or removed column:
/// `keep` maps an old column to its new one, `None` dropping its entries.
fn renumbered<T: Copy>(side: &mut Arc<[Side<T>]>, keep: impl Fn(u32) -> Option<u32>) {
    if side.iter().all(|e| keep(e.1) == Some(e.1)) {
        return;
    }
    *side = rebuilt(side, |entries| {
        entries.retain(|e| keep(e.1).is_some());
        for e in entries.iter_mut() {
            e.1 = keep(e.1).unwrap_or(e.1);
        }
    });
}

impl Default for Block {
    fn default() -> Block {
        Block {
            types: Arc::from([]),
            present: Arc::from([]),
            base: 0,
            first: 0,
            end: 0,
            pages: Arc::from([]),
            limited: Arc::from([]),
            wide: Arc::from([]),
        }
    }
}

/// `items` with `edit` applied, as a new shared slice: for the rare writes
/// that change a slice's length.
fn rebuilt<T: Clone>(items: &[T], edit: impl FnOnce(&mut Vec<T>)) -> Arc<[T]> {
    let mut owned = items.to_vec();
    edit(&mut owned);
    owned.into()
}

/// The first day of the page that holds day `d`.
fn page_start(d: i32) -> i32 {
    d.div_euclid(PAGE_ROWS) * PAGE_ROWS
}

impl Block {
    fn width(&self) -> usize {
        self.types.len()
    }

    /// Days spanned, `end - first`.
    fn rows(&self) -> usize {
        usize::try_from(self.end - self.first).unwrap_or(0)
    }

    fn empty_page(width: usize) -> Arc<[Packed]> {
        Arc::from(vec![Packed::EMPTY; PAGE_ROWS as usize * width])
    }

    /// Page and first cell of day `d`'s row, when `d` is in the span.
    fn locate(&self, d: i32) -> Option<(usize, usize)> {
        if d < self.first || d >= self.end {
            return None;
        }
        let r = usize::try_from(i64::from(d) - i64::from(self.base)).ok()?;
        let rows = PAGE_ROWS as usize;
        Some((r / rows, (r % rows) * self.width()))
    }

    /// Day `d`'s row: one night per column.
    fn row(&self, d: i32) -> Option<&[Packed]> {
        let (page, at) = self.locate(d)?;
        Some(&self.pages[page][at..at + self.width()])
    }

    /// Day `d`'s row to write, its page copied first if a published copy
    /// shares it. `d` must be in the span.
    fn row_mut(&mut self, d: i32) -> Option<&mut [Packed]> {
        let (page, at) = self.locate(d)?;
        let w = self.width();
        Some(&mut Arc::make_mut(&mut Arc::make_mut(&mut self.pages)[page])[at..at + w])
    }

    /// The night of `col` on day `d`, with `queued` (the block's
    /// unsettled edits, if any) over its side lists.
    fn night(&self, col: usize, d: i32, queued: Option<&Unsettled>) -> Option<NightCounts> {
        let p = self.row(d)?[col];
        if p.is_absent() {
            return None;
        }
        let wide = if p.is_wide() {
            side_value(&self.wide, queued.map(|q| &q.wide), d, col)
        } else {
            None
        };
        p.unpack(
            side_value(&self.limited, queued.map(|q| &q.limited), d, col),
            wide,
        )
    }

    /// The first entry of `side` on day `d` or later (`partition_point(day
    /// < d)`). Entries are spread over the block's rows, so the search
    /// starts where `d` would sit if they were spread evenly and walks from
    /// there: a line or two, where a binary search over a hotel's limits
    /// took a cache miss per step and was an eighth of a search's fold.
    fn first_side_from<T>(&self, side: &[Side<T>], d: i32) -> usize {
        const MAX_WALK: usize = 16;
        let (n, rows) = (side.len(), self.rows());
        if n == 0 || rows == 0 {
            return 0;
        }
        let offset = (i64::from(d) - i64::from(self.first)).clamp(0, rows as i64) as usize;
        let mut at = (offset * n / rows).min(n);
        for _ in 0..MAX_WALK {
            if at > 0 && side[at - 1].0 >= d {
                at -= 1;
            } else if at < n && side[at].0 < d {
                at += 1;
            } else {
                return at;
            }
        }
        // Unevenly spread: fall back to the search.
        side.partition_point(|l| l.0 < d)
    }

    /// Keeps beside day `d`'s cell in `col` what `packed` says goes there,
    /// and nothing else.
    fn set_sides(
        &mut self,
        d: i32,
        col: usize,
        limited_total: Option<i32>,
        wide: Option<WideNight>,
        queue: &mut Option<Unsettled>,
    ) {
        let key = (d, col as u32);
        let queued = queue.as_mut().map(|q| &mut q.limited);
        if let Some(edit) = side_edit(&mut self.limited, queued, key, limited_total) {
            queue.get_or_insert_default().limited.insert(key, edit);
        }
        let queued = queue.as_mut().map(|q| &mut q.wide);
        if let Some(edit) = side_edit(&mut self.wide, queued, key, wide) {
            queue.get_or_insert_default().wide.insert(key, edit);
        }
        if queue
            .as_ref()
            .is_some_and(|q| q.is_large(self.limited.len(), self.wide.len()))
        {
            self.settle(queue);
        }
    }

    /// Merges the queued side-list edits (`Unsettled`) into the lists.
    fn settle(&mut self, queue: &mut Option<Unsettled>) {
        let Some(queued) = queue.take() else {
            return;
        };
        let Unsettled { limited, wide } = queued;
        if !limited.is_empty() {
            self.limited = merged(&self.limited, limited);
        }
        if !wide.is_empty() {
            self.wide = merged(&self.wide, wide);
        }
    }

    /// Every page rebuilt with a cell per row for each column that `keep`
    /// maps from the old layout (`None`: a new, empty column). Columns come
    /// and go rarely (a room type's first and last night), so this is fine.
    fn relayout(&mut self, new_width: usize, keep: impl Fn(usize) -> Option<usize>) {
        let old_width = self.width();
        let rows = PAGE_ROWS as usize;
        let empty = Block::empty_page(new_width);
        self.pages = self
            .pages
            .iter()
            .map(|page| {
                // Empty pages stay one shared page (see `ensure_day`).
                if page.iter().all(|p| p.is_absent()) {
                    return empty.clone();
                }
                let mut cells = Vec::with_capacity(rows * new_width);
                for r in 0..rows {
                    cells.extend((0..new_width).map(|col| {
                        keep(col).map_or(Packed::EMPTY, |old| page[r * old_width + old])
                    }));
                }
                Arc::from(cells)
            })
            .collect();
    }

    /// A new, empty column at `at`: every page is rewritten once.
    fn insert_column(&mut self, at: usize, room_type_id: i64, queue: &mut Option<Unsettled>) {
        let width = self.width() + 1;
        self.relayout(width, |col| match col.cmp(&at) {
            std::cmp::Ordering::Less => Some(col),
            std::cmp::Ordering::Equal => None,
            std::cmp::Ordering::Greater => Some(col - 1),
        });
        // The queued edits name columns of the old layout.
        self.settle(queue);
        self.types = rebuilt(&self.types, |types| types.insert(at, room_type_id));
        self.present = rebuilt(&self.present, |present| present.insert(at, 0));
        let at = at as u32;
        let shift = |col: u32| Some(if col < at { col } else { col + 1 });
        renumbered(&mut self.limited, shift);
        renumbered(&mut self.wide, shift);
    }

    fn remove_column(&mut self, at: usize, queue: &mut Option<Unsettled>) {
        // The queued edits name columns of the old layout.
        self.settle(queue);
        let width = self.width() - 1;
        self.relayout(width, |col| Some(if col < at { col } else { col + 1 }));
        self.types = rebuilt(&self.types, |types| {
            types.remove(at);
        });
        self.present = rebuilt(&self.present, |present| {
            present.remove(at);
        });
        let at = at as u32;
        let close = |col: u32| match col.cmp(&at) {
            std::cmp::Ordering::Less => Some(col),
            std::cmp::Ordering::Equal => None,
            std::cmp::Ordering::Greater => Some(col - 1),
        };
        renumbered(&mut self.limited, close);
        renumbered(&mut self.wide, close);
        self.trim();
    }

    /// Widens the span to hold day `d`, adding pages at either end. Needs a column.
    fn ensure_day(&mut self, d: i32) {
        let w = self.width();
        if self.pages.is_empty() {
            self.base = page_start(d);
            self.pages = Arc::from([Block::empty_page(w)]);
            (self.first, self.end) = (d, d + 1);
            return;
        }
        let before = usize::try_from((self.base - page_start(d)) / PAGE_ROWS).unwrap_or(0);
        let after = usize::try_from((page_start(d) - self.base) / PAGE_ROWS + 1)
            .unwrap_or(0)
            .saturating_sub(self.pages.len());
        if before > 0 || after > 0 {
            // The pages between the old span and `d` are one shared empty
            // page, copied only when written (`row_mut`): one night far from
            // the rest (an owner's 9999-12-31) costs a pointer per page of
            // the gap, not a page per 16 days of it for every room type.
            let empty = Block::empty_page(w);
            self.pages = rebuilt(&self.pages, |pages| {
                pages.splice(0..0, std::iter::repeat_n(empty.clone(), before));
                pages.extend(std::iter::repeat_n(empty, after));
            });
            self.base = self.base.min(page_start(d));
        }
        self.first = self.first.min(d);
        self.end = self.end.max(d + 1);
    }

    fn day_is_empty(&self, d: i32) -> bool {
        self.row(d)
            .is_none_or(|row| row.iter().all(|p| p.is_absent()))
    }

    /// Narrows the span to the days with nights and drops pages outside it,
    /// so a calendar spans what it holds.
    fn trim(&mut self) {
        while self.first < self.end && self.day_is_empty(self.first) {
            self.first += 1;
        }
        while self.end > self.first && self.day_is_empty(self.end - 1) {
            self.end -= 1;
        }
        if self.width() == 0 || self.first == self.end {
            self.pages = Arc::from([]);
            (self.base, self.first, self.end) = (0, 0, 0);
            return;
        }
        let keep_from = ((page_start(self.first) - self.base) / PAGE_ROWS) as usize;
        let keep_to = ((page_start(self.end - 1) - self.base) / PAGE_ROWS) as usize + 1;
        if keep_from > 0 || keep_to < self.pages.len() {
            self.pages = self.pages[keep_from..keep_to].into();
        }
        self.base = page_start(self.first);
    }

    fn set(
        &mut self,
        room_type_id: i64,
        d: i32,
        packed: PackedNight,
        queue: &mut Option<Unsettled>,
    ) {
        let col = match self.types.binary_search(&room_type_id) {
            Ok(col) => col,
            Err(at) => {
                self.insert_column(at, room_type_id, queue);
                at
            }
        };
        self.ensure_day(d);
        let Some(row) = self.row_mut(d) else {
            debug_assert!(false, "day {d} is in the span it was just widened to");
            return;
        };
        let was_absent = row[col].is_absent();
        row[col] = packed.cell;
        if was_absent {
            Arc::make_mut(&mut self.present)[col] += 1;
        }
        self.set_sides(d, col, packed.limited_total, packed.wide, queue);
    }

    fn remove(&mut self, room_type_id: i64, d: i32, queue: &mut Option<Unsettled>) {
        let Ok(col) = self.types.binary_search(&room_type_id) else {
            return;
        };
        if self.row(d).is_none_or(|row| row[col].is_absent()) {
            return;
        }
        if let Some(row) = self.row_mut(d) {
            row[col] = Packed::EMPTY;
        }
        Arc::make_mut(&mut self.present)[col] -= 1;
        self.set_sides(d, col, None, None, queue);
        if self.present[col] == 0 {
            self.remove_column(col, queue);
        } else {
            self.trim();
        }
    }

    fn view<'a>(
        &'a self,
        room_type_id: i64,
        queued: Option<&'a Unsettled>,
    ) -> Option<CalendarView<'a>> {
        let col = self.types.binary_search(&room_type_id).ok()?;
        Some(CalendarView {
            block: self,
            col,
            queued,
        })
    }

    fn heap_bytes(&self) -> usize {
        // A run of one shared (empty) page counts once.
        let distinct_pages = self
            .pages
            .iter()
            .enumerate()
            .filter(|(i, page)| *i == 0 || !Arc::ptr_eq(page, &self.pages[i - 1]))
            .count();
        distinct_pages * PAGE_ROWS as usize * self.width() * std::mem::size_of::<Packed>()
            + self.pages.len() * std::mem::size_of::<Arc<[Packed]>>()
            + self.limited.len() * std::mem::size_of::<Side<i32>>()
            + self.wide.len() * std::mem::size_of::<Side<WideNight>>()
            + self.types.len() * std::mem::size_of::<i64>()
            + self.present.len() * std::mem::size_of::<u32>()
    }

    /// A block laid out at once from whole calendars with distinct, sorted
    /// room types, in exactly the pages it needs.
    fn from_calendars(calendars: &[(i64, Calendar)]) -> Block {
        let kept: Vec<&(i64, Calendar)> = calendars.iter().filter(|(_, c)| !c.is_empty()).collect();
        let spans = kept
            .iter()
            .map(|(_, c)| (c.first_day(), c.first_day() + c.nights().len() as i32));
        let (Some(first), Some(end)) = (spans.clone().map(|s| s.0).min(), spans.map(|s| s.1).max())
        else {
            return Block::default();
        };
        let w = kept.len();
        let base = page_start(first);
        let page_count = ((page_start(end - 1) - base) / PAGE_ROWS + 1) as usize;
        let rows = PAGE_ROWS as usize;
        let page_cells = rows * w;
        // Pages are made as a night lands in them; those none lands in are
        // one shared empty page (see `ensure_day`).
        let mut pages: Vec<Option<Vec<Packed>>> = vec![None; page_count];
        let (mut limited, mut wide) = (Vec::new(), Vec::new());
        for (col, (_, c)) in kept.iter().enumerate() {
            let offset = (c.first_day() - base) as usize;
            for (i, p) in c.nights().iter().enumerate() {
                if p.is_absent() {
                    continue;
                }
                let row = offset + i;
                let page = pages[row / rows].get_or_insert_with(|| vec![Packed::EMPTY; page_cells]);
                page[(row % rows) * w + col] = *p;
            }
            limited.extend(c.limited().iter().map(|&(d, t)| (d, col as u32, t)));
            wide.extend(c.wide().iter().map(|&(d, w)| (d, col as u32, w)));
        }
        // By (day, column): a column's entries came in day order.
        limited.sort_unstable_by_key(|e| (e.0, e.1));
        wide.sort_unstable_by_key(|e: &Side<WideNight>| (e.0, e.1));
        let empty = Block::empty_page(w);
        Block {
            types: kept.iter().map(|(id, _)| *id).collect(),
            present: kept.iter().map(|(_, c)| c.len() as u32).collect(),
            base,
            first,
            end,
            pages: pages
                .into_iter()
                .map(|page| page.map_or_else(|| empty.clone(), Arc::from))
                .collect(),
            limited: limited.into(),
            wide: wide.into(),
        }
    }
}

/// How many shards the hotels are spread over. A published copy is a
/// vector of this many `Arc`s: publishing a transaction clones that vector
/// (64 reference counts, well under a microsecond) and the shards it changed,
/// instead of a map of every hotel.
const SHARDS: usize = 64;

/// One shard: its hotels' blocks, inline (a block's clone is a few
/// reference counts, see `Block`).
type Shard = HashMap<i64, Block, rustc_hash::FxBuildHasher>;

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
    /// The queued side-list edits of the write in progress, by hotel
    /// (`Unsettled`): empty in a published copy (`settle`).
    unsettled: HashMap<i64, Unsettled, rustc_hash::FxBuildHasher>,
}

impl Default for Calendars {
    fn default() -> Calendars {
        Calendars {
            shards: vec![Arc::default(); SHARDS],
            unsettled: HashMap::default(),
        }
    }
}

/// The shard of a hotel: Fibonacci hashing of its id, since ids are
/// often dense and a plain modulus would be as good as any, but a seed
/// with a stride would pile onto a few shards.
fn shard_of(hotel_id: i64) -> usize {
    ((hotel_id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as usize
}

impl Calendars {
    fn block(&self, hotel_id: i64) -> Option<&Block> {
        self.shards[shard_of(hotel_id)].get(&hotel_id)
    }

    /// The shard of `hotel_id`, copied first if a published copy shares it.
    fn shard_mut(&mut self, hotel_id: i64) -> &mut Shard {
        Arc::make_mut(&mut self.shards[shard_of(hotel_id)])
    }

    fn blocks(&self) -> impl Iterator<Item = (&i64, &Block)> + '_ {
        self.shards.iter().flat_map(|shard| shard.iter())
    }

    pub fn get(&self, key: &CalendarKey) -> Option<CalendarView<'_>> {
        self.block(key.hotel_id)?
            .view(key.room_type_id, self.queued(key.hotel_id))
    }

    /// One hotel's calendars, for reading several of its room types.
    pub fn hotel(&self, hotel_id: i64) -> Option<HotelCalendars<'_>> {
        self.block(hotel_id).map(|block| HotelCalendars {
            block,
            queued: self.queued(hotel_id),
        })
    }

    /// The queued edits of `hotel_id`'s block, in a write that left some.
    fn queued(&self, hotel_id: i64) -> Option<&Unsettled> {
        if self.unsettled.is_empty() {
            return None;
        }
        self.unsettled.get(&hotel_id)
    }

    /// Takes `hotel_id`'s queue out for a write to its block (`keep_queue`
    /// puts it back).
    fn take_queue(&mut self, hotel_id: i64) -> Option<Unsettled> {
        if self.unsettled.is_empty() {
            return None;
        }
        self.unsettled.remove(&hotel_id)
    }

    fn keep_queue(&mut self, hotel_id: i64, queue: Option<Unsettled>) {
        if let Some(queue) = queue {
            self.unsettled.insert(hotel_id, queue);
        }
    }

    /// Sets one night of one calendar.
    pub fn set(&mut self, key: CalendarKey, night: NaiveDate, counts: NightCounts) {
        let mut queue = self.take_queue(key.hotel_id);
        let block = self
            .shard_mut(key.hotel_id)
            .entry(key.hotel_id)
            .or_default();
        block.set(
            key.room_type_id,
            day(night),
            Packed::pack(counts),
            &mut queue,
        );
        self.keep_queue(key.hotel_id, queue);
    }

    /// Merges every block's queued side-list edits: a write calls it before
    /// it publishes, so no reader of a published copy meets a queue.
    pub fn settle(&mut self) {
        for (hotel_id, queue) in std::mem::take(&mut self.unsettled) {
            if let Some(block) = self.shard_mut(hotel_id).get_mut(&hotel_id) {
                block.settle(&mut Some(queue));
            }
        }
    }

    /// Whether no block holds queued edits (a published copy's state).
    pub fn is_settled(&self) -> bool {
        self.unsettled.is_empty()
    }

    /// Removes one night; a calendar left with none is gone.
    pub fn remove_night(&mut self, key: CalendarKey, night: NaiveDate) {
        let d = day(night);
        // Looked at through the shared copy first: a night that is not
        // there costs no copy of its block.
        let present = self.get(&key).is_some_and(|view| view.get_day(d).is_some());
        if !present {
            return;
        }
        let mut queue = self.take_queue(key.hotel_id);
        let shard = self.shard_mut(key.hotel_id);
        if let Some(block) = shard.get_mut(&key.hotel_id) {
            block.remove(key.room_type_id, d, &mut queue);
            if block.types.is_empty() {
                shard.remove(&key.hotel_id);
                // Its edits went with it.
                queue = None;
            }
        }
        self.keep_queue(key.hotel_id, queue);
    }

    /// Adds a hotel's calendars, built one room type at a time (the snapshot
    /// load): laid out once at their exact size when the hotel is new, merged
    /// night by night when some of its rows came earlier.
    pub fn insert_hotel(&mut self, hotel_id: i64, calendars: &mut [(i64, Calendar)]) {
        calendars.sort_unstable_by_key(|(id, _)| *id);
        let distinct = calendars.windows(2).all(|w| w[0].0 != w[1].0);
        let mut queue = self.take_queue(hotel_id);
        let shard = self.shard_mut(hotel_id);
        if distinct && !shard.contains_key(&hotel_id) {
            let block = Block::from_calendars(calendars);
            if !block.types.is_empty() {
                shard.insert(hotel_id, block);
            }
            return;
        }
        let block = shard.entry(hotel_id).or_default();
        for (room_type_id, calendar) in calendars.iter() {
            for (night, counts) in calendar.iter() {
                block.set(*room_type_id, day(night), Packed::pack(counts), &mut queue);
            }
        }
        // A merge of whole calendars, rare (a hotel's rows split across the
        // load's batches): settled here rather than kept.
        block.settle(&mut queue);
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
            let queued = self.queued(hotel_id);
            block.types.iter().enumerate().map(move |(col, &id)| {
                (
                    CalendarKey {
                        hotel_id,
                        room_type_id: id,
                    },
                    CalendarView { block, col, queued },
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

    /// Releases the shard maps' spare capacity after a bulk load (blocks
    /// are laid out at their exact size; a shared shard is left as it is).
    pub fn shrink(&mut self) {
        for shard in &mut self.shards {
            if let Some(shard) = Arc::get_mut(shard) {
                shard.shrink_to_fit();
            }
        }
    }

    /// Blocks whose pages are shared with `other` (the same allocations,
    /// not equal contents): what a published copy and its successor have in
    /// common.
    pub fn blocks_shared_with(&self, other: &Calendars) -> usize {
        self.shards
            .iter()
            .zip(&other.shards)
            .map(|(mine, theirs)| {
                mine.iter()
                    .filter(|(id, b)| {
                        theirs
                            .get(id)
                            .is_some_and(|t| Arc::ptr_eq(&b.pages, &t.pages))
                    })
                    .count()
            })
            .sum()
    }
}

/// One hotel's calendars.
#[derive(Debug, Clone, Copy)]
pub struct HotelCalendars<'a> {
    block: &'a Block,
    /// Its queued edits, in a write that left some (`Unsettled`).
    queued: Option<&'a Unsettled>,
}

impl<'a> HotelCalendars<'a> {
    pub fn room_type(&self, room_type_id: i64) -> Option<CalendarView<'a>> {
        self.block.view(room_type_id, self.queued)
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

    /// Reads one word of each cache line that `fold_offers_into` over this
    /// stay will read, for every hotel of `hotels` (the column ids, the
    /// stay's rows), and returns a checksum of them,
    /// for the caller to pass to `std::hint::black_box`. Search calls it for
    /// a question's candidates before folding any: a fold that met each
    /// hotel's cache misses in turn spent most of ranking's time waiting.
    /// In two passes, what locates the rows (the page) for every hotel and
    /// then the rows themselves, so each pass is a short loop of loads that
    /// do not depend on one another and the misses of many hotels are in
    /// flight at once.
    pub fn touch_stays(
        hotels: impl Iterator<Item = HotelCalendars<'a>>,
        check_in: NaiveDate,
        nights: usize,
    ) -> u32 {
        /// Cells per 64-byte line, rounded down: stepping by it reads
        /// every line a row spans.
        const CELLS_PER_LINE: usize = 64 / std::mem::size_of::<Packed>();
        let start = day(check_in);
        let mut sum = 0u32;
        let mut rows: Vec<&[Packed]> = Vec::with_capacity(hotels.size_hint().0 * nights);
        for hotel in hotels {
            let b = hotel.block;
            sum = sum.wrapping_add(b.types.first().map_or(0, |&id| id as u32));
            rows.extend((0..nights).filter_map(|i| b.row(start.checked_add(i as i32)?)));
        }
        for cells in rows {
            for p in cells.iter().step_by(CELLS_PER_LINE) {
                sum = sum.wrapping_add(p.free() as u32);
            }
            if let Some(last) = cells.last() {
                sum = sum.wrapping_add(last.free() as u32);
            }
        }
        sum
    }

    /// Every column's offer over the `nights` nights from `check_in` on,
    /// into a caller's vector (cleared first): what `fold_stay_into` with an
    /// offer accumulator gives, without its generic step. Ranking folds a
    /// city's every hotel this way, and unpacking each night into a
    /// `NightCounts` of `Option`s, then matching on them, was a third of
    /// its time. A cell holds its night's free units whatever its limit,
    /// so only a row with a wide night (none in a real hotel) takes the
    /// full path. (Column by column, each accumulator held in registers
    /// over the stay's rows, measured no better: the fold waits on memory.)
    pub fn fold_offers_into(&self, check_in: NaiveDate, nights: usize, acc: &mut Vec<StayOffer>) {
        let b = self.block;
        acc.clear();
        acc.resize(b.width(), StayOffer::START);
        if nights == 0 {
            acc.iter_mut().for_each(|a| a.absent = true);
            return;
        }
        if self.queued.is_some() {
            self.fold_unsettled(check_in, nights, acc, StayOffer::add);
            return;
        }
        if !b.wide.is_empty() {
            for row in self.stay_rows(check_in, nights) {
                match row {
                    None => acc.iter_mut().for_each(|a| a.absent = true),
                    Some((cells, limited, wide)) => {
                        for (a, night) in acc.iter_mut().zip(unpacked(cells, limited, wide)) {
                            a.add(night);
                        }
                    }
                }
            }
            return;
        }
        let start = day(check_in);
        for i in 0..nights {
            match start.checked_add(i as i32).and_then(|d| b.row(d)) {
                None => acc.iter_mut().for_each(|a| a.absent = true),
                Some(cells) => {
                    for (a, p) in acc.iter_mut().zip(cells) {
                        a.add_packed(*p);
                    }
                }
            }
        }
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
        acc.clear();
        acc.resize(self.block.width(), init);
        if self.queued.is_some() {
            self.fold_unsettled(check_in, nights, acc, step);
            return;
        }
        for row in self.stay_rows(check_in, nights) {
            match row {
                Some((cells, limited, wide)) => {
                    for (a, night) in acc.iter_mut().zip(unpacked(cells, limited, wide)) {
                        step(a, night);
                    }
                }
                None => acc.iter_mut().for_each(|a| step(a, None)),
            }
        }
    }

    /// A fold of a block that holds queued side-list edits, night by night
    /// through `Block::night`, which consults them. Only a read within a
    /// write meets such a block: a published copy is settled.
    fn fold_unsettled<T>(
        &self,
        check_in: NaiveDate,
        nights: usize,
        acc: &mut [T],
        mut step: impl FnMut(&mut T, Option<NightCounts>),
    ) {
        let b = self.block;
        let start = day(check_in);
        for i in 0..nights {
            let d = start.checked_add(i as i32);
            for (col, a) in acc.iter_mut().enumerate() {
                step(a, d.and_then(|d| b.night(col, d, self.queued)));
            }
        }
    }

    /// The `nights` rows from `check_in` on, each with what its night keeps
    /// beside its cells (sorted by column, usually nothing), or `None` for
    /// a night outside the block's span. The side lists are sorted by
    /// (day, column) like the rows: one search for the first night, then a
    /// forward walk along with the rows.
    fn stay_rows(
        &self,
        check_in: NaiveDate,
        nights: usize,
    ) -> impl Iterator<Item = Option<StayRow<'a>>> + use<'a> {
        let b = self.block;
        // Walked below are the merged lists only.
        debug_assert!(
            self.queued.is_none(),
            "a stay folded while its block is unsettled"
        );
        let start = day(check_in);
        let mut limited = SideWalk::new(&b.limited, b.first_side_from(&b.limited, start));
        let mut wide = SideWalk::new(&b.wide, b.first_side_from(&b.wide, start));
        (0..nights).map(move |i| {
            let d = start.checked_add(i as i32)?;
            let cells = b.row(d)?;
            Some((cells, limited.on(d), wide.on(d)))
        })
    }
}

/// A forward walk over a side list, along the rows of a stay.
struct SideWalk<'a, T> {
    side: &'a [Side<T>],
    next: usize,
}

impl<'a, T> SideWalk<'a, T> {
    fn new(side: &'a [Side<T>], next: usize) -> SideWalk<'a, T> {
        SideWalk { side, next }
    }

    /// The entries of day `d`, which is no earlier than the last asked.
    fn on(&mut self, d: i32) -> &'a [Side<T>] {
        while self.side.get(self.next).is_some_and(|e| e.0 < d) {
            self.next += 1;
        }
        // A walk, not a search: usually the first entry looked at is
        // already of a later night.
        let on_night = self.side[self.next..]
            .iter()
            .take_while(|e| e.0 == d)
            .count();
        &self.side[self.next..self.next + on_night]
    }
}

/// One night's row of a stay, with what that night keeps beside its cells.
type StayRow<'a> = (&'a [Packed], &'a [Side<i32>], &'a [Side<WideNight>]);

/// A row's nights in column order, each unpacked with what it keeps
/// beside its cell (the night's entries, sorted by column): merged along
/// the row rather than searched for per cell.
fn unpacked<'r>(
    cells: &'r [Packed],
    limited: &'r [Side<i32>],
    wide: &'r [Side<WideNight>],
) -> impl Iterator<Item = Option<NightCounts>> + 'r {
    let mut limited = limited.iter().peekable();
    let mut wide = wide.iter().peekable();
    cells.iter().enumerate().map(move |(col, p)| {
        let total = limited.next_if(|e| e.1 as usize == col).map(|e| e.2);
        let whole = wide.next_if(|e| e.1 as usize == col).map(|e| e.2);
        p.unpack(total, whole)
    })
}

/// One room type's stay folded for ranking: the fewest units free and the
/// stay price, with what rules them out. `HotelCalendars::fold_offers_into`
/// gives one per column; `offer` is what search ranks by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StayOffer {
    min_free: i32,
    price: i64,
    /// Some night has no row (or the stay has no night).
    absent: bool,
    /// Some night has no price: the stay has none.
    unpriced: bool,
}

impl StayOffer {
    const START: StayOffer = StayOffer {
        min_free: i32::MAX,
        price: 0,
        absent: false,
        unpriced: false,
    };

    /// The fewest free units and the stay price, or `None` when some night
    /// has no row or no unit free.
    pub fn offer(&self) -> Option<(i32, Option<i64>)> {
        (!self.absent && self.min_free >= 1)
            .then_some((self.min_free, (!self.unpriced).then_some(self.price)))
    }

    /// A stay's offer from its nights walked one by one (a stay of no
    /// night has none).
    pub fn of_nights(nights: impl Iterator<Item = Option<NightCounts>>) -> StayOffer {
        let mut acc = StayOffer::START;
        let mut any = false;
        for night in nights {
            acc.add(night);
            any = true;
        }
        acc.absent |= !any;
        acc
    }

    /// One night straight from its cell, with no branch on what it holds;
    /// not a wide one (its cell does not hold its counts).
    fn add_packed(&mut self, night: Packed) {
        debug_assert!(!night.is_wide());
        self.absent |= night.is_absent();
        self.min_free = self.min_free.min(night.free());
        let (price, unpriced) = night.price_or_null();
        self.unpriced |= unpriced;
        self.price = self.price.wrapping_add(i64::from(price));
    }

    /// One night in full, sell limit included (the rare rows that have one).
    fn add(&mut self, night: Option<NightCounts>) {
        let Some(n) = night else {
            self.absent = true;
            return;
        };
        self.min_free = self.min_free.min(n.free());
        match n.price_cents {
            Some(c) => self.price = self.price.wrapping_add(i64::from(c)),
            None => self.unpriced = true,
        }
    }
}

/// One calendar (hotel × room type), read in place.
#[derive(Debug, Clone, Copy)]
pub struct CalendarView<'a> {
    block: &'a Block,
    col: usize,
    /// Its block's queued edits, in a write that left some (`Unsettled`).
    queued: Option<&'a Unsettled>,
}

impl<'a> CalendarView<'a> {
    pub fn get(&self, night: NaiveDate) -> Option<NightCounts> {
        self.get_day(day(night))
    }

    /// `get` of a day since 1970-01-01.
    fn get_day(&self, d: i32) -> Option<NightCounts> {
        self.block.night(self.col, d, self.queued)
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
        self.days().map(|(d, counts)| (date(d), counts))
    }

    /// As `iter`, with each night as its day since 1970-01-01 (the
    /// checkpoint's unit): no date conversion per night.
    pub fn days(&self) -> impl DoubleEndedIterator<Item = (i32, NightCounts)> + use<'a> {
        self.days_between(i32::MIN, i32::MAX)
    }

    /// The nights with a row on days in `[from, to)`, walked page by page:
    /// a run of the shared empty page (the gap before a far night, such as
    /// an owner's 9999-12-31, is one) is skipped whole, where a walk day by
    /// day spent a second of CPU per request on such a hotel's calendar.
    fn days_between(
        &self,
        from: i32,
        to: i32,
    ) -> impl DoubleEndedIterator<Item = (i32, NightCounts)> + use<'a> {
        let (block, col, queued) = (self.block, self.col, self.queued);
        let (from, to) = (from.max(block.first), to.min(block.end));
        let pages = if from < to {
            let page_of = |d: i32| ((d - block.base) / PAGE_ROWS) as usize;
            page_of(from)..page_of(to - 1) + 1
        } else {
            0..0
        };
        pages
            // A page at two places of one block is the shared empty one: a
            // write copies a shared page before it changes it (`row_mut`).
            .filter(move |&p| p == 0 || !Arc::ptr_eq(&block.pages[p], &block.pages[p - 1]))
            .flat_map(move |p| {
                let start = block.base + p as i32 * PAGE_ROWS;
                (start.max(from)..(start + PAGE_ROWS).min(to))
                    .filter_map(move |d| Some((d, block.night(col, d, queued)?)))
            })
    }

    /// The `nights` nights from `check_in` on, each `None` when it has no
    /// row: a strided walk over a few adjacent rows, the inner loop of search.
    pub fn stay(
        &self,
        check_in: NaiveDate,
        nights: usize,
    ) -> impl Iterator<Item = Option<NightCounts>> + use<'a> {
        let (block, col, queued, d) = (self.block, self.col, self.queued, day(check_in));
        (0..nights).map(move |i| block.night(col, d.checked_add(i as i32)?, queued))
    }

    /// Nights in `[from, to)` that have a row: only the days of the range
    /// are walked, however far the calendar spans.
    pub fn range(
        &self,
        from: NaiveDate,
        to: NaiveDate,
    ) -> impl Iterator<Item = (NaiveDate, NightCounts)> + use<'a> {
        self.days_between(day(from), day(to))
            .map(|(d, counts)| (date(d), counts))
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

    /// The offer of a stay walked night by night, written out plainly:
    /// the reference `fold_offers_into` is held to.
    fn offer_of_nights(nights: &[Option<NightCounts>]) -> Option<(i32, Option<i64>)> {
        let present: Option<Vec<NightCounts>> = nights.iter().copied().collect();
        let present = present.filter(|p| !p.is_empty())?;
        let min_free = present.iter().map(|n| n.free()).min()?;
        let price = present
            .iter()
            .map(|n| n.price_cents.map(i64::from))
            .sum::<Option<i64>>();
        (min_free >= 1).then_some((min_free, price))
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
                c.set(key(7, rt), d(n), counts(rt as i32, 0, None));
            }
        }
        let block = c.block(7).unwrap();
        assert_eq!(*block.types, [1, 2, 3]);
        assert_eq!(block.rows(), 10);
        // Night 4's row holds every room type, side by side.
        let row: Vec<i32> = block
            .row(day(d(4)))
            .unwrap()
            .iter()
            .map(|p| p.free())
            .collect();
        assert_eq!(row, vec![1, 2, 3]);
        let stay: Vec<_> = c.get(&key(7, 2)).unwrap().stay(d(8), 3).collect();
        assert_eq!(
            stay,
            vec![Some(counts(2, 0, None)), Some(counts(2, 0, None)), None]
        );
    }

    /// One night far from the rest (an owner's open-ended 9999-12-31) does
    /// not lay out the years between, by the stream, after a new room
    /// type, or by a snapshot's layout; and the gap's pages are written
    /// one at a time without touching their neighbours.
    #[test]
    fn one_far_night_does_not_lay_out_the_gap() {
        let far = NaiveDate::from_ymd_opt(9999, 12, 31).unwrap();
        let mut c = Calendars::default();
        for rt in 1..=20 {
            c.set(key(1, rt), d(0), counts(5, 0, None));
        }
        c.set(key(1, 1), far, counts(5, 0, None));
        assert!(c.heap_bytes() < 4 << 20, "{} bytes", c.heap_bytes());
        c.set(key(1, 21), d(1), counts(2, 0, None));
        assert!(
            c.heap_bytes() < 4 << 20,
            "after a new room type: {}",
            c.heap_bytes()
        );
        let published = c.clone();
        let middle = NaiveDate::from_ymd_opt(5000, 6, 1).unwrap();
        c.set(key(1, 2), middle, counts(7, 1, None));
        assert_eq!(
            c.get(&key(1, 2)).unwrap().get(middle),
            Some(counts(7, 1, None))
        );
        assert_eq!(c.get(&key(1, 3)).unwrap().get(middle), None);
        assert_eq!(published.get(&key(1, 2)).unwrap().get(middle), None);
        assert_eq!(
            c.get(&key(1, 1)).unwrap().get(far),
            Some(counts(5, 0, None))
        );
        let nights: Vec<_> = c.get(&key(1, 2)).unwrap().iter().collect();
        assert_eq!(
            nights,
            vec![(d(0), counts(5, 0, None)), (middle, counts(7, 1, None))]
        );
        let far_nights: Vec<_> = c.get(&key(1, 1)).unwrap().iter().collect();
        assert_eq!(
            far_nights,
            vec![(d(0), counts(5, 0, None)), (far, counts(5, 0, None))]
        );
        let around_middle: Vec<_> = c
            .get(&key(1, 2))
            .unwrap()
            .range(
                middle - chrono::Days::new(20),
                middle + chrono::Days::new(1),
            )
            .collect();
        assert_eq!(around_middle, vec![(middle, counts(7, 1, None))]);
        let up_to_middle = c.get(&key(1, 2)).unwrap().range(d(1), middle).count();
        assert_eq!(up_to_middle, 0);

        let mut laid_out = Calendars::default();
        let mut near = Calendar::default();
        near.set(d(0), counts(5, 0, None));
        let mut far_too = near.clone();
        far_too.set(far, counts(5, 0, None));
        laid_out.insert_hotel(1, &mut [(1, far_too), (2, near)]);
        assert!(laid_out.heap_bytes() < 4 << 20, "{}", laid_out.heap_bytes());
        assert_eq!(
            laid_out.get(&key(1, 1)).unwrap().get(far),
            Some(counts(5, 0, None))
        );
    }

    /// Nights before 1970 are negative days: stored, and read back by
    /// every room type of the hotel (a walk of the block's span dates each
    /// day before it looks at the column).
    #[test]
    fn nights_before_1970_read_back() {
        let mut c = Calendars::default();
        let old = NaiveDate::from_ymd_opt(1969, 12, 30).unwrap();
        let older = NaiveDate::from_ymd_opt(1066, 10, 14).unwrap();
        c.set(key(1, 1), old, counts(5, 1, None));
        c.set(key(1, 1), older, counts(4, 0, None));
        c.set(key(1, 2), d(0), counts(3, 0, None));
        let nights: Vec<_> = c.get(&key(1, 1)).unwrap().iter().collect();
        assert_eq!(
            nights,
            vec![(older, counts(4, 0, None)), (old, counts(5, 1, None))]
        );
        assert_eq!(
            c.get(&key(1, 1)).unwrap().get(old),
            Some(counts(5, 1, None))
        );
        assert_eq!(
            c.get(&key(1, 2)).unwrap().iter().collect::<Vec<_>>(),
            vec![(d(0), counts(3, 0, None))]
        );
    }

    /// A copy shares every page; a write to the copy copies the one page
    /// it changes, so a one-night booking does not copy its hotel's year.
    #[test]
    fn a_write_copies_one_page_of_one_hotel() {
        let mut original = Calendars::default();
        for hotel in 1..=2 {
            for rt in 1..=3 {
                for n in 0..100 {
                    original.set(key(hotel, rt), d(n), counts(5, 0, None));
                }
            }
        }
        let mut copy = original.clone();
        copy.set(key(1, 2), d(40), counts(5, 1, None));
        let (mine, theirs) = (copy.block(1).unwrap(), original.block(1).unwrap());
        let shared = mine
            .pages
            .iter()
            .zip(theirs.pages.iter())
            .filter(|(a, b)| Arc::ptr_eq(a, b))
            .count();
        assert_eq!(mine.pages.len(), theirs.pages.len());
        assert_eq!(shared, mine.pages.len() - 1);
        assert_eq!(
            copy.blocks_shared_with(&original),
            1,
            "hotel 2 is untouched"
        );
        assert_eq!(
            original.get(&key(1, 2)).unwrap().get(d(40)).unwrap().taken,
            0
        );
        assert_eq!(copy.get(&key(1, 2)).unwrap().get(d(40)).unwrap().taken, 1);
    }

    /// A transaction that limits every night of a hotel (20 room types ×
    /// 730 nights, room type by room type, as an owner's bulk UPDATE sends
    /// them) merges its list a few dozen times, not once per night, reads
    /// its own edits meanwhile, and queues at most an eighth of the list.
    #[test]
    fn a_limit_on_every_night_of_a_hotel_merges_its_list_a_few_times() {
        let (types, nights) = (20i64, 730i64);
        let mut c = Calendars::default();
        for rt in 0..types {
            for n in 0..nights {
                c.set(key(1, rt), d(n), counts(9, 1, None));
            }
        }
        c.settle();
        for (limit, want_len) in [(Some(6), (types * nights) as usize), (None, 0)] {
            let mut merges = 0;
            let mut list = Arc::as_ptr(&c.block(1).unwrap().limited);
            for rt in 0..types {
                for n in 0..nights {
                    c.set(key(1, rt), d(n), counts(9, 1, limit));
                    let block = c.block(1).unwrap();
                    if !std::ptr::eq(Arc::as_ptr(&block.limited), list) {
                        merges += 1;
                        list = Arc::as_ptr(&block.limited);
                    }
                    let queued = c.unsettled.get(&1).map_or(0, |q| q.limited.len());
                    assert!(queued <= SETTLE_AT.max(block.limited.len() / 8));
                    assert_eq!(
                        c.get(&key(1, rt)).unwrap().get(d(n)).unwrap().sell_limit,
                        limit
                    );
                }
            }
            c.settle();
            assert!(merges <= 64, "{merges} merges of the list for {limit:?}");
            let block = c.block(1).unwrap();
            assert_eq!(block.limited.len(), want_len);
            assert!(
                block
                    .limited
                    .windows(2)
                    .all(|w| (w[0].0, w[0].1) < (w[1].0, w[1].1))
            );
            for rt in 0..types {
                let nights_read: Vec<_> = c.get(&key(1, rt)).unwrap().iter().collect();
                assert_eq!(nights_read.len(), nights as usize);
                assert!(nights_read.iter().all(|(_, n)| *n == counts(9, 1, limit)));
            }
        }
    }

    #[test]
    fn limits_follow_their_column_when_columns_come_and_go() {
        let mut c = Calendars::default();
        c.set(key(1, 5), d(0), counts(4, 0, Some(6)));
        c.set(key(1, 9), d(0), counts(4, 0, Some(8)));
        c.set(key(1, 2), d(0), counts(4, 0, None));
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

    /// A cell's markers are values an owner row may hold too: kept whole
    /// beside the cell, and a stay over them folds as over any night.
    #[test]
    fn the_markers_values_are_stored_and_folded() {
        let mut c = Calendars::default();
        let marked = NightCounts {
            total: i32::MIN,
            taken: 0,
            sell_limit: Some(3),
            price_cents: Some(i32::MIN),
        };
        c.set(key(1, 1), d(0), marked);
        c.set(key(1, 1), d(1), counts(5, 1, None));
        assert_eq!(c.get(&key(1, 1)).unwrap().get(d(0)), Some(marked));
        let mut offers = Vec::new();
        c.hotel(1).unwrap().fold_offers_into(d(0), 2, &mut offers);
        let price = i64::from(i32::MIN) + i64::from(counts(5, 1, None).price_cents.unwrap());
        assert_eq!(offers[0].offer(), Some((3, Some(price))));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Set(i64, i64, i64, i32, i32, Option<i32>),
        Remove(i64, i64, i64),
        /// Load a hotel's calendars in bulk, as the snapshot does.
        Bulk(i64, Vec<(i64, i64, i32)>),
        /// Merge the queued side-list edits, as a write does before it
        /// publishes.
        Settle,
    }

    /// Mostly counts a cell holds, some that only a wide night does
    /// (past 16 bits, negative).
    fn count() -> impl Strategy<Value = i32> {
        prop_oneof![12 => 0i32..50, 1 => 65_530i32..65_540, 1 => (i32::MIN + 1)..=i32::MAX]
    }

    fn op() -> impl Strategy<Value = Op> {
        let hotel = 0i64..3;
        let rt = 0i64..5;
        let night = 0i64..40;
        prop_oneof![
            4 => (hotel.clone(), rt.clone(), night.clone(), count(), count(), proptest::option::of(count()))
                .prop_map(|(h, r, n, t, k, s)| Op::Set(h, r, n, t, k, s)),
            3 => (hotel.clone(), rt.clone(), night.clone()).prop_map(|(h, r, n)| Op::Remove(h, r, n)),
            1 => (hotel, proptest::collection::vec((rt, night, count()), 0..30))
                .prop_map(|(h, rows)| Op::Bulk(h, rows)),
            1 => Just(Op::Settle),
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
                        // Some nights unpriced, the others priced apart,
                        // so a stay's price is a sum that can be wrong.
                        let c = NightCounts {
                            price_cents: (k % 5 != 0).then_some(100 + t.rem_euclid(1000)),
                            ..counts(t, k, s)
                        };
                        cals.set(key(h, r), d(n), c);
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
                            built[at].1.set(d(n), c);
                            map.insert((key(h, r), d(n)), c);
                        }
                        cals.insert_hotel(h, &mut built);
                    }
                    Op::Settle => cals.settle(),
                }
            }
            // Read as a write reads, its edits queued, then as readers of
            // the published copy do.
            answers_like(&cals, &map)?;
            cals.settle();
            prop_assert!(cals.unsettled.is_empty());
            answers_like(&cals, &map)?;
        }
    }

    /// `cals` answers exactly like `map` for every read.
    fn answers_like(
        cals: &Calendars,
        map: &BTreeMap<(CalendarKey, NaiveDate), NightCounts>,
    ) -> Result<(), TestCaseError> {
        {
            let mut got: Vec<_> = cals
                .iter()
                .flat_map(|(k, v)| v.iter().map(move |(n, c)| ((k, n), c)))
                .collect();
            got.sort_by_key(|(k, _)| *k);
            let want: Vec<_> = map.iter().map(|(k, c)| (*k, *c)).collect();
            prop_assert_eq!(cals.rows(), want.len() as u64);
            prop_assert_eq!(got, want);
            let keys: std::collections::BTreeSet<CalendarKey> =
                map.keys().map(|(k, _)| *k).collect();
            prop_assert_eq!(cals.len(), keys.len());
            for (h, block) in cals.blocks() {
                // Tight: no empty column, no empty edge row.
                prop_assert!(
                    block.present.iter().all(|&p| p > 0),
                    "hotel {} has an empty column",
                    h
                );
                prop_assert!(
                    block.rows() > 0
                        && !block.day_is_empty(block.first)
                        && !block.day_is_empty(block.end - 1)
                );
                // Exactly the pages the span needs, aligned to absolute days.
                prop_assert_eq!(block.base, page_start(block.first));
                prop_assert_eq!(
                    block.pages.len() as i32,
                    (page_start(block.end - 1) - block.base) / PAGE_ROWS + 1
                );
                let hotel = cals.hotel(*h).unwrap();
                for (from, nights) in [(5, 7), (-3, 5), (0, 1), (18, 3), (36, 10), (5, 0), (-2, 40)]
                {
                    let folded = hotel.fold_stay(
                        d(from),
                        nights,
                        Vec::new(),
                        |v: &mut Vec<Option<NightCounts>>, n| v.push(n),
                    );
                    let mut offers = Vec::new();
                    hotel.fold_offers_into(d(from), nights, &mut offers);
                    prop_assert_eq!(offers.len(), folded.len());
                    for ((rt, got), offer) in hotel.room_type_ids().iter().zip(folded).zip(&offers)
                    {
                        let walked: Vec<_> = cals
                            .get(&key(*h, *rt))
                            .unwrap()
                            .stay(d(from), nights)
                            .collect();
                        prop_assert_eq!(offer.offer(), offer_of_nights(&walked));
                        prop_assert_eq!(got, walked);
                    }
                }
                for day in -2..45 {
                    let at = super::day(d(day));
                    let want = block.limited.partition_point(|l| l.0 < at);
                    prop_assert_eq!(block.first_side_from(&block.limited, at), want);
                    let want = block.wide.partition_point(|l| l.0 < at);
                    prop_assert_eq!(block.first_side_from(&block.wide, at), want);
                }
                for (from, to) in [(0, 40), (3, 19), (-5, 2), (16, 17), (39, 80), (20, 10)] {
                    for rt in hotel.room_type_ids() {
                        let got: Vec<_> = cals
                            .get(&key(*h, *rt))
                            .unwrap()
                            .range(d(from), d(to))
                            .collect();
                        let want: Vec<_> = map
                            .range((key(*h, *rt), d(from))..(key(*h, *rt), d(to.max(from))))
                            .map(|((_, n), c)| (*n, *c))
                            .collect();
                        prop_assert_eq!(got, want);
                    }
                }
                for (k, n) in map.keys() {
                    if k.hotel_id == *h {
                        let stay: Vec<_> = cals.get(k).unwrap().stay(*n, 1).collect();
                        prop_assert_eq!(stay, vec![map.get(&(*k, *n)).copied()]);
                    }
                }
            }
        }
        Ok(())
    }
}

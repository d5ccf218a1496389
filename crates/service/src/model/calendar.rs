//! `Calendar`: the nightly counts of one hotel's room type, packed, and the
//! 8-byte night format the copy stores.
//!
//! The copy holds up to tens of millions of nights (5,000 hotels × 20 room
//! types × 730 nights = 73 million), so a night is two `u16`s (the units a
//! take may claim up to, and those taken) and an `i32` price, 8 bytes, with
//! sentinels instead of `Option`s (see `Packed`). `sell_limit` is null on
//! most nights (it marks overbooking): the cell holds the limit in place of
//! the total then, and the total lives in a small sorted side list, so
//! search reads every night's free units from its cell alone. A count past
//! 16 bits (no real hotel's) keeps the whole night in a second side list.
//!
//! The copy itself keeps a hotel's calendars together (`calendars`); a
//! `Calendar` is one room type on its own, which the snapshot load fills
//! before a hotel is laid out.

use chrono::{Datelike, NaiveDate};
use serde::Serialize;

const NULL: i32 = i32::MIN;

/// One inventory row's values, as the owner stores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct NightCounts {
    pub total: i32,
    pub taken: i32,
    pub sell_limit: Option<i32>,
    pub price_cents: Option<i32>,
}

impl NightCounts {
    /// Units a take may still claim: the guide's `coalesce(sell_limit, total) - taken`.
    pub fn free(&self) -> i32 {
        // Saturating: an owner row may hold any `int`, and a guest's count
        // of an absurd row is better huge than a panic.
        self.sell_limit
            .unwrap_or(self.total)
            .saturating_sub(self.taken)
    }
}

/// One night as stored: 8 bytes, sentinels for what is absent.
///
/// The cell holds what search folds: `cap`, the units a take may claim up
/// to (`coalesce(sell_limit, total)`), and `taken`, so a night's free units
/// are `cap - taken` whatever its limit, with no side list to consult; and
/// the price. What a cell cannot say lives beside it, keyed by (day,
/// column), and is rare: a limited night's `total` (one night in twenty in
/// the seed), and, whole (`WideNight`, its cell marked `WIDE`), a night
/// whose `cap` or `taken` does not fit 16 bits or whose price is the
/// cell's null marker (none in any real hotel). So every value an owner
/// row may hold is stored: a value the copy refused halted every copy of
/// the owner, replaying the same transaction forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Packed {
    cap: u16,
    taken: u16,
    price_cents: i32,
}

/// `cap` of a night with no owner row.
const ABSENT_CAP: u16 = u16::MAX;
/// `cap` of a night kept whole in the wide list.
const WIDE_CAP: u16 = u16::MAX - 1;
/// The largest `cap` a cell holds itself.
const MAX_NARROW_CAP: i32 = WIDE_CAP as i32 - 1;

/// A night a cell cannot hold, kept whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WideNight {
    total: i32,
    taken: i32,
    sell_limit: Option<i32>,
    price_cents: Option<i32>,
}

/// A night packed: its cell, and what goes beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PackedNight {
    pub(super) cell: Packed,
    /// The owner's `total`, when a sell limit is set (the cell's `cap` is
    /// the limit then).
    pub(super) limited_total: Option<i32>,
    pub(super) wide: Option<WideNight>,
}

impl Packed {
    pub(super) const EMPTY: Packed = Packed {
        cap: ABSENT_CAP,
        taken: 0,
        price_cents: NULL,
    };

    /// The night, with what was kept beside its cell: the total of a
    /// limited night, the whole of a wide one (which a `WIDE` cell must
    /// have; without it the night reads as absent, and debug builds stop).
    pub(super) fn unpack(
        self,
        limited_total: Option<i32>,
        wide: Option<WideNight>,
    ) -> Option<NightCounts> {
        match self.cap {
            ABSENT_CAP => None,
            WIDE_CAP => {
                debug_assert!(wide.is_some(), "a wide cell without its night");
                let w = wide?;
                Some(NightCounts {
                    total: w.total,
                    taken: w.taken,
                    sell_limit: w.sell_limit,
                    price_cents: w.price_cents,
                })
            }
            cap => Some(NightCounts {
                total: limited_total.unwrap_or(i32::from(cap)),
                taken: i32::from(self.taken),
                sell_limit: limited_total.map(|_| i32::from(cap)),
                price_cents: (self.price_cents != NULL).then_some(self.price_cents),
            }),
        }
    }

    /// Whether the night has no owner row.
    pub(super) fn is_absent(self) -> bool {
        self.cap == ABSENT_CAP
    }

    /// Whether the night is kept whole in the wide list.
    pub(super) fn is_wide(self) -> bool {
        self.cap == WIDE_CAP
    }

    /// `cap - taken`, the units free; meaningless for an absent or wide
    /// night (its caller checks `is_absent`, and folds a wide one whole).
    pub(super) fn free(self) -> i32 {
        i32::from(self.cap) - i32::from(self.taken)
    }

    /// The price as stored and whether it is null (the stored value is then
    /// the marker, to be ignored).
    pub(super) fn price_or_null(self) -> (i32, bool) {
        (self.price_cents, self.price_cents == NULL)
    }

    pub(super) fn pack(c: NightCounts) -> PackedNight {
        let cap = c.sell_limit.unwrap_or(c.total);
        let narrow = (0..=MAX_NARROW_CAP).contains(&cap)
            && u16::try_from(c.taken).is_ok()
            && c.price_cents != Some(NULL);
        if narrow {
            PackedNight {
                cell: Packed {
                    cap: cap as u16,
                    taken: c.taken as u16,
                    price_cents: c.price_cents.unwrap_or(NULL),
                },
                limited_total: c.sell_limit.map(|_| c.total),
                wide: None,
            }
        } else {
            PackedNight {
                cell: Packed {
                    cap: WIDE_CAP,
                    taken: 0,
                    price_cents: NULL,
                },
                limited_total: None,
                wide: Some(WideNight {
                    total: c.total,
                    taken: c.taken,
                    sell_limit: c.sell_limit,
                    price_cents: c.price_cents,
                }),
            }
        }
    }
}

/// The nights of one (hotel, room type), from `first` on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Calendar {
    /// Days since 1970-01-01 of `nights[0]`.
    first: i32,
    nights: Vec<Packed>,
    present: u32,
    /// `(day, total)` of the nights whose limit is set, sorted by day.
    limited: Vec<(i32, i32)>,
    /// The nights whose cells are `WIDE`, sorted by day.
    wide: Vec<(i32, WideNight)>,
}

/// The value kept for day `d` in a side list sorted by day.
fn side_of<T: Copy>(side: &[(i32, T)], d: i32) -> Option<T> {
    if side.is_empty() {
        return None;
    }
    side.binary_search_by_key(&d, |(day, _)| *day)
        .ok()
        .map(|at| side[at].1)
}

/// Sets or clears day `d`'s value in a side list sorted by day.
fn set_side<T>(side: &mut Vec<(i32, T)>, d: i32, value: Option<T>) {
    // Past the last entry: a calendar filled in date order (a snapshot,
    // a checkpoint's load) appends or does nothing, without a search
    // per night (it was a seventh of a restart's load).
    if side.last().is_none_or(|(last, _)| *last < d) {
        if let Some(v) = value {
            side.push((d, v));
        }
        return;
    }
    match (side.binary_search_by_key(&d, |(day, _)| *day), value) {
        (Ok(at), Some(v)) => side[at].1 = v,
        (Ok(at), None) => {
            side.remove(at);
        }
        (Err(at), Some(v)) => side.insert(at, (d, v)),
        (Err(_), None) => {}
    }
}

/// The years whose nights the copy holds (`holds_night`).
pub const HELD_YEARS: std::ops::RangeInclusive<i32> = 1900..=2199;

/// Whether the copy holds a night on this date: years 1900 to 2199.
///
/// PostgreSQL's `date` runs from 4713 BC to 5874897 AD and also holds
/// `infinity` and `-infinity`. No guest can stay such a night (search
/// refuses the past and anything past its horizon), yet one such row
/// stopped every copy of the owner: the snapshot refused it, the stream
/// could not decode it and a re-read panicked on it. And a night far from
/// the rest costs its hotel's block one page entry per 16 days up to it,
/// copied on every write to the hotel: an owner's open-ended `9999-12-31`
/// made that 2.9 MB per write, and a calendar over 100 years made every
/// checkpoint fail (so the slot was never acknowledged again and the
/// owner kept its WAL). So a night outside these years is left out of the
/// copy and counted (`vacancy_nights_not_held_total`), and every path into
/// the copy (the snapshot, the stream, a re-read, a checkpoint's load)
/// applies this one rule, so they agree on what the copy holds. Three
/// centuries around today: at most 6,849 page entries a hotel (110 KB),
/// and a checkpoint's calendars fit `checkpoint::format::MAX_SPAN_DAYS`.
pub fn holds_night(night: NaiveDate) -> bool {
    HELD_YEARS.contains(&night.year())
}

/// 1970-01-01 in days from the common era.
const UNIX_EPOCH_DAYS_FROM_CE: i32 = 719_163;

pub(super) fn day(night: NaiveDate) -> i32 {
    // Dates PostgreSQL can store fit in i32 days; this is on every read of
    // a night, so plain day arithmetic rather than a Duration.
    night.num_days_from_ce() - UNIX_EPOCH_DAYS_FROM_CE
}

/// The date of a day that `day` gave, or that lies between two it gave
/// (a block's span): a night before 1970 is a negative day, which
/// `NaiveDate + Days` (unsigned) cannot take.
pub(super) fn date(day: i32) -> NaiveDate {
    let date = day
        .checked_add(UNIX_EPOCH_DAYS_FROM_CE)
        .and_then(NaiveDate::from_num_days_from_ce_opt);
    debug_assert!(date.is_some(), "day {day} is no date's");
    date.unwrap_or(NaiveDate::MIN)
}

impl Calendar {
    pub fn get(&self, night: NaiveDate) -> Option<NightCounts> {
        let i = day(night).checked_sub(self.first)?;
        self.night_at(usize::try_from(i).ok()?)
    }

    /// The night at index `i` of `nights`, with what was kept beside it
    /// joined back.
    fn night_at(&self, i: usize) -> Option<NightCounts> {
        let p = self.nights.get(i)?;
        if p.is_absent() {
            return None;
        }
        let d = self.first + i as i32;
        let wide = if p.is_wide() {
            side_of(&self.wide, d)
        } else {
            None
        };
        p.unpack(side_of(&self.limited, d), wide)
    }

    /// Keeps beside day `d`'s cell what `packed` says goes there, and
    /// nothing else.
    fn set_sides(&mut self, d: i32, packed: &PackedNight) {
        set_side(&mut self.limited, d, packed.limited_total);
        set_side(&mut self.wide, d, packed.wide);
    }

    /// Nights that have a row, in date order.
    pub fn len(&self) -> usize {
        self.present as usize
    }

    pub fn is_empty(&self) -> bool {
        self.present == 0
    }

    /// Sets one night, growing the calendar at either end as needed.
    pub fn set(&mut self, night: NaiveDate, counts: NightCounts) {
        self.set_day(day(night), counts);
    }

    /// An empty calendar laid out for the days `first..=last` in one
    /// allocation, so that filling it (a checkpoint's load, 73M nights)
    /// never grows it night by night.
    pub fn spanning(first: i32, last: i32) -> Calendar {
        debug_assert!(first <= last);
        let span = usize::try_from(i64::from(last) - i64::from(first) + 1).unwrap_or(0);
        Calendar {
            first,
            nights: vec![Packed::EMPTY; span],
            present: 0,
            limited: Vec::new(),
            wide: Vec::new(),
        }
    }

    /// As `set`, by day since 1970-01-01: a checkpoint stores nights so,
    /// and a restart loads 73M of them (two date conversions each were a
    /// measurable share of the load).
    pub fn set_day(&mut self, d: i32, counts: NightCounts) {
        let packed = Packed::pack(counts);
        if let Some(slot) = usize::try_from(i64::from(d) - i64::from(self.first))
            .ok()
            .and_then(|i| self.nights.get_mut(i))
        {
            // Within the span already laid out: no growth.
            if slot.is_absent() {
                self.present += 1;
            }
            *slot = packed.cell;
            self.set_sides(d, &packed);
            return;
        }
        if self.nights.is_empty() {
            self.first = d;
        }
        if d < self.first {
            let grow = (self.first - d) as usize;
            self.nights
                .splice(0..0, std::iter::repeat_n(Packed::EMPTY, grow));
            self.first = d;
        }
        let i = (d - self.first) as usize;
        if i >= self.nights.len() {
            self.nights.resize(i + 1, Packed::EMPTY);
        }
        if self.nights[i].is_absent() {
            self.present += 1;
        }
        self.nights[i] = packed.cell;
        self.set_sides(d, &packed);
    }

    /// Removes one night; past nights leave from the front, so trim there.
    pub fn remove(&mut self, night: NaiveDate) {
        let Some(i) = day(night)
            .checked_sub(self.first)
            .and_then(|i| usize::try_from(i).ok())
        else {
            return;
        };
        let Some(slot) = self.nights.get_mut(i) else {
            return;
        };
        if !slot.is_absent() {
            *slot = Packed::EMPTY;
            self.present -= 1;
        }
        set_side(&mut self.limited, day(night), None);
        set_side(&mut self.wide, day(night), None);
        let lead = self.nights.iter().take_while(|n| n.is_absent()).count();
        if lead > 0 {
            self.nights.drain(..lead);
            self.first += lead as i32;
        }
        while self.nights.last().is_some_and(|n| n.is_absent()) {
            self.nights.pop();
        }
        if self.nights.is_empty() {
            self.first = 0;
        }
    }

    /// Every night with a row, in date order.
    pub fn iter(&self) -> impl Iterator<Item = (NaiveDate, NightCounts)> + '_ {
        (0..self.nights.len())
            .filter_map(|i| Some((date(self.first + i as i32), self.night_at(i)?)))
    }

    /// Day of `nights()[0]`.
    pub(super) fn first_day(&self) -> i32 {
        self.first
    }

    /// Every slot from `first_day()` on, absent nights included.
    pub(super) fn nights(&self) -> &[Packed] {
        &self.nights
    }

    /// `(day, total)` of the nights whose limit is set, sorted by day.
    pub(super) fn limited(&self) -> &[(i32, i32)] {
        &self.limited
    }

    /// The nights kept whole, sorted by day.
    pub(super) fn wide(&self) -> &[(i32, WideNight)] {
        &self.wide
    }

    /// Empties the calendar but keeps its buffer for reuse.
    pub fn clear(&mut self) {
        self.nights.clear();
        self.limited.clear();
        self.wide.clear();
        self.first = 0;
        self.present = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn counts(total: i32, taken: i32) -> NightCounts {
        NightCounts {
            total,
            taken,
            sell_limit: None,
            price_cents: Some(100),
        }
    }

    fn d(n: i64) -> NaiveDate {
        NaiveDate::from_ymd_opt(2027, 1, 1).unwrap() + chrono::Duration::days(n)
    }

    #[test]
    fn packs_eight_bytes_per_night() {
        assert_eq!(std::mem::size_of::<Packed>(), 8);
    }

    /// Counts past a cell's 16 bits, negative ones, a limit below or far
    /// above the total, and the markers' neighbours all read back as set.
    #[test]
    fn any_count_reads_back_whole() {
        let edges = [
            i32::MIN,
            i32::MIN + 1,
            -1,
            0,
            1,
            65_533,
            65_534,
            65_535,
            65_536,
            i32::MAX,
        ];
        let mut c = Calendar::default();
        let mut n = 0;
        for total in edges {
            for taken in edges {
                for sell_limit in [None, Some(0), Some(65_533), Some(65_534), Some(i32::MAX)] {
                    let counts = NightCounts {
                        total,
                        taken,
                        sell_limit,
                        price_cents: [None, Some(i32::MIN), Some(0)][n as usize % 3],
                    };
                    c.set(d(n), counts);
                    assert_eq!(c.get(d(n)), Some(counts));
                    n += 1;
                }
            }
        }
        assert_eq!(c.len(), n as usize);
        // And again once every night is set: no side entry got lost.
        let mut n = 0;
        for total in edges {
            for taken in edges {
                for sell_limit in [None, Some(0), Some(65_533), Some(65_534), Some(i32::MAX)] {
                    let got = c.get(d(n)).unwrap();
                    assert_eq!(
                        (got.total, got.taken, got.sell_limit),
                        (total, taken, sell_limit)
                    );
                    n += 1;
                }
            }
        }
    }

    #[test]
    fn a_sell_limit_costs_only_the_nights_that_have_one() {
        let mut c = Calendar::default();
        for n in 0..100 {
            c.set(d(n), counts(5, 1));
        }
        c.set(
            d(7),
            NightCounts {
                sell_limit: Some(6),
                ..counts(5, 1)
            },
        );
        assert_eq!(c.get(d(7)).unwrap().sell_limit, Some(6));
        assert_eq!(c.get(d(7)).unwrap().free(), 5);
        assert_eq!(c.get(d(8)).unwrap().sell_limit, None);
        c.set(d(7), counts(5, 1));
        assert_eq!(c.get(d(7)).unwrap().sell_limit, None);
        c.remove(d(8));
        assert!(c.get(d(8)).is_none());
    }

    /// The cell's own markers are values an owner row may hold too.
    #[test]
    fn stores_the_markers_values() {
        let mut c = Calendar::default();
        let marked = NightCounts {
            total: i32::MIN,
            taken: i32::MIN,
            sell_limit: Some(i32::MIN),
            price_cents: Some(i32::MIN),
        };
        c.set(d(0), marked);
        assert_eq!(c.get(d(0)), Some(marked));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Set(i64, i32, i32, Option<i32>),
        Remove(i64),
    }

    /// Mostly counts a cell holds, some that only a wide night does.
    fn count() -> impl Strategy<Value = i32> {
        prop_oneof![8 => 0i32..50, 1 => 65_530i32..65_540, 1 => any::<i32>()]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0i64..60, count(), count(), proptest::option::of(count()))
                .prop_map(|(n, t, k, s)| Op::Set(n, t, k, s)),
            (0i64..60).prop_map(Op::Remove),
        ]
    }

    proptest! {
        /// The packed calendar behaves exactly like a map from night to counts.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec(op(), 0..200)) {
            let mut cal = Calendar::default();
            let mut map = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Set(n, t, k, s) => {
                        let c = NightCounts { total: t, taken: k, sell_limit: s, price_cents: None };
                        cal.set(d(n), c);
                        map.insert(d(n), c);
                    }
                    Op::Remove(n) => {
                        cal.remove(d(n));
                        map.remove(&d(n));
                    }
                }
            }
            let got: Vec<_> = cal.iter().collect();
            let want: Vec<_> = map.into_iter().collect();
            prop_assert_eq!(cal.len(), want.len());
            prop_assert_eq!(got, want);
        }
    }
}

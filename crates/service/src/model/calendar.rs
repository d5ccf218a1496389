//! `Calendar`: the nightly counts of one hotel's room type, packed, and the
//! 12-byte night format the copy stores.
//!
//! The copy holds up to tens of millions of nights (5,000 hotels × 20 room
//! types × 730 nights = 73 million), so a night is three `i32`s (total,
//! taken, price), 12 bytes, with sentinels instead of `Option`s; a night with
//! no owner row is `total == ABSENT`. `sell_limit` is null on most nights (it
//! marks overbooking), so the few set ones live in a small sorted side list
//! instead of four bytes on every night.
//!
//! The copy itself keeps a hotel's calendars together (`calendars`); a
//! `Calendar` is one room type on its own, which the snapshot load fills
//! before a hotel is laid out.

use chrono::{Datelike, NaiveDate};
use serde::Serialize;

pub(super) const ABSENT: i32 = i32::MIN;
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
        self.sell_limit.unwrap_or(self.total) - self.taken
    }

    /// False when a value collides with a packing marker; such a row is
    /// refused rather than stored as a wrong count.
    pub fn is_storable(&self) -> bool {
        self.total != ABSENT && self.sell_limit != Some(NULL) && self.price_cents != Some(NULL)
    }
}

/// One night as stored: 12 bytes, sentinels for what is absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Packed {
    pub(super) total: i32,
    taken: i32,
    price_cents: i32,
}

impl Packed {
    pub(super) const EMPTY: Packed = Packed {
        total: ABSENT,
        taken: 0,
        price_cents: NULL,
    };

    pub(super) fn unpack(self, sell_limit: Option<i32>) -> Option<NightCounts> {
        if self.total == ABSENT {
            return None;
        }
        Some(NightCounts {
            total: self.total,
            taken: self.taken,
            sell_limit,
            price_cents: (self.price_cents != NULL).then_some(self.price_cents),
        })
    }

    /// Whether the night has no owner row.
    pub(super) fn is_absent(self) -> bool {
        self.total == ABSENT
    }

    /// `total - taken`, the units free when no sell limit is set; wrapping,
    /// since an absent night's is meaningless (its caller checks `is_absent`).
    pub(super) fn free_without_limit(self) -> i32 {
        self.total.wrapping_sub(self.taken)
    }

    /// The price as stored and whether it is null (the stored value is then
    /// the marker, to be ignored).
    pub(super) fn price_or_null(self) -> (i32, bool) {
        (self.price_cents, self.price_cents == NULL)
    }

    pub(super) fn pack(c: NightCounts) -> Option<Packed> {
        c.is_storable().then_some(Packed {
            total: c.total,
            taken: c.taken,
            price_cents: c.price_cents.unwrap_or(NULL),
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("inventory value {0} cannot be stored (it is reserved as a marker)")]
pub struct UnstorableValue(pub i32);

/// The nights of one (hotel, room type), from `first` on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Calendar {
    /// Days since 1970-01-01 of `nights[0]`.
    first: i32,
    nights: Vec<Packed>,
    present: u32,
    /// `(day, sell_limit)` of the nights whose limit is set, sorted by day.
    limits: Vec<(i32, i32)>,
}

/// Whether the copy holds a night on this date: years 1 to 9999.
///
/// PostgreSQL's `date` runs from 4713 BC to 5874897 AD and also holds
/// `infinity` and `-infinity`. No guest can stay such a night (search
/// refuses the past and anything past its horizon), yet one such row
/// stopped every copy of the owner: the snapshot refused it, the stream
/// could not decode it and a re-read panicked on it. And a night far in
/// the future costs its hotel's block one page entry per 16 days up to it.
/// So a night outside these years is left out of the copy and counted
/// (`vacancy_nights_not_held_total`), and every path into the copy (the
/// snapshot, the stream, a re-read) applies this one rule, so they agree
/// on what the copy holds.
pub fn holds_night(night: NaiveDate) -> bool {
    (1..=9999).contains(&night.year())
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

    /// The night at index `i` of `nights`, with its limit joined back.
    fn night_at(&self, i: usize) -> Option<NightCounts> {
        let p = self.nights.get(i)?;
        if p.total == ABSENT {
            return None;
        }
        p.unpack(self.limit_of(self.first + i as i32))
    }

    fn limit_of(&self, d: i32) -> Option<i32> {
        if self.limits.is_empty() {
            return None;
        }
        self.limits
            .binary_search_by_key(&d, |(day, _)| *day)
            .ok()
            .map(|at| self.limits[at].1)
    }

    fn set_limit(&mut self, d: i32, limit: Option<i32>) {
        // Past the last limit: a calendar filled in date order (a snapshot,
        // a checkpoint's load) appends or does nothing, without a search
        // per night (it was a seventh of a restart's load).
        if self.limits.last().is_none_or(|(last, _)| *last < d) {
            if let Some(l) = limit {
                self.limits.push((d, l));
            }
            return;
        }
        match (self.limits.binary_search_by_key(&d, |(day, _)| *day), limit) {
            (Ok(at), Some(l)) => self.limits[at].1 = l,
            (Ok(at), None) => {
                self.limits.remove(at);
            }
            (Err(at), Some(l)) => self.limits.insert(at, (d, l)),
            (Err(_), None) => {}
        }
    }

    /// Nights that have a row, in date order.
    pub fn len(&self) -> usize {
        self.present as usize
    }

    pub fn is_empty(&self) -> bool {
        self.present == 0
    }

    /// Sets one night, growing the calendar at either end as needed.
    pub fn set(&mut self, night: NaiveDate, counts: NightCounts) -> Result<(), UnstorableValue> {
        self.set_day(day(night), counts)
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
            limits: Vec::new(),
        }
    }

    /// As `set`, by day since 1970-01-01: a checkpoint stores nights so,
    /// and a restart loads 73M of them (two date conversions each were a
    /// measurable share of the load).
    pub fn set_day(&mut self, d: i32, counts: NightCounts) -> Result<(), UnstorableValue> {
        let packed = Packed::pack(counts).ok_or(UnstorableValue(i32::MIN))?;
        if let Some(slot) = usize::try_from(i64::from(d) - i64::from(self.first))
            .ok()
            .and_then(|i| self.nights.get_mut(i))
        {
            // Within the span already laid out: no growth.
            if slot.total == ABSENT {
                self.present += 1;
            }
            *slot = packed;
            self.set_limit(d, counts.sell_limit);
            return Ok(());
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
        if self.nights[i].total == ABSENT {
            self.present += 1;
        }
        self.nights[i] = packed;
        self.set_limit(d, counts.sell_limit);
        Ok(())
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
        if slot.total != ABSENT {
            *slot = Packed::EMPTY;
            self.present -= 1;
        }
        self.set_limit(day(night), None);
        let lead = self.nights.iter().take_while(|n| n.total == ABSENT).count();
        if lead > 0 {
            self.nights.drain(..lead);
            self.first += lead as i32;
        }
        while self.nights.last().is_some_and(|n| n.total == ABSENT) {
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

    /// `(day, sell_limit)` of the nights whose limit is set, sorted by day.
    pub(super) fn limits(&self) -> &[(i32, i32)] {
        &self.limits
    }

    /// Empties the calendar but keeps its buffer for reuse.
    pub fn clear(&mut self) {
        self.nights.clear();
        self.limits.clear();
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
    fn packs_twelve_bytes_per_night() {
        assert_eq!(std::mem::size_of::<Packed>(), 12);
    }

    #[test]
    fn a_sell_limit_costs_only_the_nights_that_have_one() {
        let mut c = Calendar::default();
        for n in 0..100 {
            c.set(d(n), counts(5, 1)).unwrap();
        }
        c.set(
            d(7),
            NightCounts {
                sell_limit: Some(6),
                ..counts(5, 1)
            },
        )
        .unwrap();
        assert_eq!(c.get(d(7)).unwrap().sell_limit, Some(6));
        assert_eq!(c.get(d(7)).unwrap().free(), 5);
        assert_eq!(c.get(d(8)).unwrap().sell_limit, None);
        c.set(d(7), counts(5, 1)).unwrap();
        assert_eq!(c.get(d(7)).unwrap().sell_limit, None);
        c.remove(d(8));
        assert!(c.get(d(8)).is_none());
    }

    #[test]
    fn refuses_sentinel_values() {
        let mut c = Calendar::default();
        let bad = NightCounts {
            total: i32::MIN,
            ..counts(1, 0)
        };
        assert!(c.set(d(0), bad).is_err());
        assert!(c.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Set(i64, i32, i32, Option<i32>),
        Remove(i64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0i64..60, 0i32..50, 0i32..50, proptest::option::of(0i32..60))
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
                        cal.set(d(n), c).unwrap();
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

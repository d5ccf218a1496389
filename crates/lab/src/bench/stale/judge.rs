//! The paired judge: the owner's truth at the moment each answer was built,
//! and what each take after a showing was.
//!
//! The owner's truth is rebuilt from its state when the run began and the
//! log of its commits to `inventory`, each with the LSN at the end of its
//! commit record (what `test_decoding` gives through
//! `pg_logical_slot_get_changes`). A commit belongs to the owner's truth at
//! position `p` when that end is at or before `p`: the record is then
//! flushed, so the commit is visible to the owner's readers, and the copy
//! could have received it.
//!
//! The moment an answer was built is bracketed by the answer itself
//! (`owner_position`, read by the service just before it read the copy and
//! again after its last read). A showing is judged at every position in the
//! bracket where one of its nights changed: the owner refused it all along,
//! agreed all along, or changed its mind while the answer was being built.
//! The last kind is neither the copy's nor the race's for certain, so it is
//! counted apart instead of being given to either.

use std::collections::HashMap;

use chrono::NaiveDate;
use vacancy_service::Lsn;

/// One night of one room type: the owner's `inventory` primary key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NightKey {
    pub hotel_id: i64,
    pub room_type_id: i64,
    pub night: NaiveDate,
}

/// The columns of an `inventory` row a take's condition reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NightRow {
    pub total: i32,
    pub taken: i32,
    pub sell_limit: Option<i32>,
}

impl NightRow {
    /// Units a take may still have: the owner's own rule
    /// (`coalesce(sell_limit, total) - taken`), in i64 so no value overflows.
    pub fn free(&self) -> i64 {
        i64::from(self.sell_limit.unwrap_or(self.total)) - i64::from(self.taken)
    }
}

/// One committed owner transaction's changes to `inventory`: each night's
/// row after it, `None` when the row was deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// The end of the commit record.
    pub end_lsn: Lsn,
    pub changes: Vec<(NightKey, Option<NightRow>)>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HistoryError {
    #[error("commit log out of order: {later} after {earlier}")]
    OutOfOrder { earlier: Lsn, later: Lsn },
}

/// Every version of every night the run touched, by commit position.
#[derive(Debug, Default)]
pub struct OwnerHistory {
    /// Per night, ascending by LSN; the state when the run began sits at
    /// `Lsn::ZERO`.
    versions: HashMap<NightKey, Vec<(Lsn, Option<NightRow>)>>,
}

/// What a guest was shown and then tried to take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Showing {
    pub hotel_id: i64,
    pub room_type_id: i64,
    pub check_in: NaiveDate,
    pub check_out: NaiveDate,
    pub rooms: i32,
}

impl Showing {
    fn nights(&self) -> impl Iterator<Item = NightKey> + '_ {
        self.check_in
            .iter_days()
            .take_while(|n| *n < self.check_out)
            .map(|night| NightKey {
                hotel_id: self.hotel_id,
                room_type_id: self.room_type_id,
                night,
            })
    }
}

/// The owner's view of a showing over the moment its answer was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A take of the shown units would have succeeded at every position.
    Agreed,
    /// It would have been refused at every position.
    Refused,
    /// Both, at different positions within the bracket.
    Changed,
}

impl OwnerHistory {
    /// The history from the state when the run began and the commits
    /// after it, in commit order. A commit already in `initial` (the state
    /// was read just after the log began) is harmless: a change is the whole
    /// row after it, so applying it again changes nothing.
    pub fn new(
        initial: impl IntoIterator<Item = (NightKey, NightRow)>,
        commits: impl IntoIterator<Item = Commit>,
    ) -> Result<OwnerHistory, HistoryError> {
        let mut versions: HashMap<NightKey, Vec<(Lsn, Option<NightRow>)>> = HashMap::new();
        for (key, row) in initial {
            versions.insert(key, vec![(Lsn::ZERO, Some(row))]);
        }
        let mut last = Lsn::ZERO;
        for commit in commits {
            if commit.end_lsn < last {
                return Err(HistoryError::OutOfOrder {
                    earlier: last,
                    later: commit.end_lsn,
                });
            }
            last = commit.end_lsn;
            for (key, row) in commit.changes {
                versions.entry(key).or_default().push((commit.end_lsn, row));
            }
        }
        Ok(OwnerHistory { versions })
    }

    /// The row of `key` with every commit ending at or before `at` applied.
    pub fn row_at(&self, key: &NightKey, at: Lsn) -> Option<NightRow> {
        let versions = self.versions.get(key)?;
        let upto = versions.partition_point(|(lsn, _)| *lsn <= at);
        upto.checked_sub(1).and_then(|i| versions[i].1)
    }

    /// Whether the owner at `at` would take `showing.rooms` units on every
    /// night of the stay: a row for each night, with that many free.
    pub fn would_take(&self, showing: &Showing, at: Lsn) -> bool {
        let mut nights = 0;
        for key in showing.nights() {
            nights += 1;
            match self.row_at(&key, at) {
                Some(row) if row.free() >= i64::from(showing.rooms) => {}
                _ => return false,
            }
        }
        nights > 0
    }

    /// The fewest units free on the stay's nights at `at`; `None` when a
    /// night has no row.
    pub fn min_free(&self, showing: &Showing, at: Lsn) -> Option<i64> {
        showing
            .nights()
            .map(|key| self.row_at(&key, at).map(|r| r.free()))
            .min()
            .flatten()
    }

    /// The owner's view of `showing` at `before`, and at every commit that
    /// changed one of its nights after `before` up to `after`.
    pub fn verdict(&self, showing: &Showing, before: Lsn, after: Lsn) -> Verdict {
        let mut positions = vec![before];
        for key in showing.nights() {
            if let Some(versions) = self.versions.get(&key) {
                positions.extend(
                    versions
                        .iter()
                        .map(|(lsn, _)| *lsn)
                        .filter(|lsn| *lsn > before && *lsn <= after),
                );
            }
        }
        let mut agreed = false;
        let mut refused = false;
        for at in positions {
            if self.would_take(showing, at) {
                agreed = true;
            } else {
                refused = true;
            }
        }
        match (agreed, refused) {
            (true, false) => Verdict::Agreed,
            (false, true) => Verdict::Refused,
            _ => Verdict::Changed,
        }
    }
}

/// One take after a showing, as the bench recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JudgedTake {
    pub showing: Showing,
    /// The answer's bracket; `None` when the service could not stamp it.
    pub moment: Option<(Lsn, Lsn)>,
    /// True when the owner took the units, false for a 409.
    pub taken: bool,
}

/// The takes after a showing, by what the owner said at the moment the
/// answer was built and what it said to the take.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Takes the owner answered after a room type was shown with enough units.
    pub takes: u64,
    pub conflicts: u64,
    /// 409s after a showing the owner refused all the while the answer was
    /// built: the copy's (or a stale owner read's), the figure the goal bounds.
    pub copys: u64,
    /// 409s after a showing the owner agreed with all along: the race floor.
    pub races: u64,
    /// 409s after a showing the owner changed its mind about while the
    /// answer was built.
    pub changed: u64,
    /// 409s from an answer without an owner position.
    pub unjudged: u64,
    /// Takes that succeeded although the owner refused the showing at the
    /// moment (a unit came back before the take).
    pub taken_though_refused: u64,
}

impl Tally {
    pub fn add(&mut self, history: &OwnerHistory, take: &JudgedTake) {
        self.takes += 1;
        let verdict = take
            .moment
            .map(|(before, after)| history.verdict(&take.showing, before, after));
        if take.taken {
            self.taken_though_refused += u64::from(verdict == Some(Verdict::Refused));
            return;
        }
        self.conflicts += 1;
        match verdict {
            Some(Verdict::Refused) => self.copys += 1,
            Some(Verdict::Agreed) => self.races += 1,
            Some(Verdict::Changed) => self.changed += 1,
            None => self.unjudged += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn day(d: u32) -> NaiveDate {
        NaiveDate::from_ymd_opt(2030, 6, d).unwrap()
    }

    fn key(night: u32) -> NightKey {
        NightKey {
            hotel_id: 1,
            room_type_id: 2,
            night: day(night),
        }
    }

    fn row(taken: i32) -> NightRow {
        NightRow {
            total: 2,
            taken,
            sell_limit: None,
        }
    }

    fn commit(end: u64, changes: Vec<(NightKey, Option<NightRow>)>) -> Commit {
        Commit {
            end_lsn: Lsn(end),
            changes,
        }
    }

    /// Two nights with 2 units each; at 100 night 10 fills up, at 200 it
    /// frees one, at 300 night 11 is deleted.
    fn history() -> OwnerHistory {
        OwnerHistory::new(
            [(key(10), row(0)), (key(11), row(0))],
            [
                commit(100, vec![(key(10), Some(row(2)))]),
                commit(200, vec![(key(10), Some(row(1)))]),
                commit(300, vec![(key(11), None)]),
            ],
        )
        .unwrap()
    }

    fn stay(from: u32, to: u32) -> Showing {
        Showing {
            hotel_id: 1,
            room_type_id: 2,
            check_in: day(from),
            check_out: day(to),
            rooms: 1,
        }
    }

    #[test]
    fn a_commit_counts_from_its_own_end_on() {
        let h = history();
        assert_eq!(h.row_at(&key(10), Lsn(99)), Some(row(0)));
        assert_eq!(h.row_at(&key(10), Lsn(100)), Some(row(2)));
        assert_eq!(h.row_at(&key(10), Lsn(250)), Some(row(1)));
        assert_eq!(h.row_at(&key(11), Lsn(300)), None, "deleted");
        assert_eq!(h.row_at(&key(12), Lsn(300)), None, "never there");
    }

    #[test]
    fn the_take_rule_needs_every_night_with_enough_free() {
        let h = history();
        assert!(h.would_take(&stay(10, 12), Lsn(50)));
        assert!(!h.would_take(&stay(10, 12), Lsn(150)), "night 10 full");
        assert!(h.would_take(&stay(10, 12), Lsn(250)));
        assert!(!h.would_take(&stay(10, 12), Lsn(300)), "night 11 gone");
        let two = Showing {
            rooms: 2,
            ..stay(10, 11)
        };
        assert!(!h.would_take(&two, Lsn(250)), "one free, two asked");
        assert!(!h.would_take(&stay(10, 10), Lsn(50)), "no night at all");
        let limited = OwnerHistory::new(
            [(
                key(10),
                NightRow {
                    total: 5,
                    taken: 1,
                    sell_limit: Some(1),
                },
            )],
            [],
        )
        .unwrap();
        assert!(
            !limited.would_take(&stay(10, 11), Lsn(1)),
            "sell_limit rules"
        );
    }

    #[test]
    fn min_free_is_the_tightest_night() {
        let h = history();
        assert_eq!(h.min_free(&stay(10, 12), Lsn(50)), Some(2));
        assert_eq!(h.min_free(&stay(10, 12), Lsn(250)), Some(1));
        assert_eq!(h.min_free(&stay(10, 12), Lsn(300)), None, "a night gone");
    }

    #[test]
    fn a_showing_is_judged_over_the_whole_bracket() {
        let h = history();
        assert_eq!(h.verdict(&stay(10, 11), Lsn(10), Lsn(90)), Verdict::Agreed);
        assert_eq!(
            h.verdict(&stay(10, 11), Lsn(100), Lsn(150)),
            Verdict::Refused
        );
        // Full at the start, one freed at 200 while the answer was built.
        assert_eq!(
            h.verdict(&stay(10, 11), Lsn(150), Lsn(200)),
            Verdict::Changed
        );
        // A change just past the bracket is the race's, not the copy's.
        assert_eq!(h.verdict(&stay(10, 11), Lsn(10), Lsn(99)), Verdict::Agreed);
        // A change to another stay's night does not matter.
        assert_eq!(
            h.verdict(&stay(10, 11), Lsn(250), Lsn(400)),
            Verdict::Agreed
        );
    }

    #[test]
    fn takes_are_tallied_by_the_owner_at_their_moment() {
        let h = history();
        let take = |moment: Option<(u64, u64)>, taken| JudgedTake {
            showing: stay(10, 11),
            moment: moment.map(|(a, b)| (Lsn(a), Lsn(b))),
            taken,
        };
        let mut t = Tally::default();
        for j in [
            take(Some((10, 20)), false),   // race
            take(Some((120, 130)), false), // the copy's
            take(Some((150, 210)), false), // changed
            take(None, false),             // unjudged
            take(Some((120, 130)), true),  // taken though refused
            take(Some((10, 20)), true),    // plain take
        ] {
            t.add(&h, &j);
        }
        assert_eq!(
            t,
            Tally {
                takes: 6,
                conflicts: 4,
                copys: 1,
                races: 1,
                changed: 1,
                unjudged: 1,
                taken_though_refused: 1,
            }
        );
    }

    #[test]
    fn a_log_out_of_order_is_refused() {
        let err = OwnerHistory::new([], [commit(200, vec![]), commit(100, vec![])]).unwrap_err();
        assert_eq!(
            err,
            HistoryError::OutOfOrder {
                earlier: Lsn(200),
                later: Lsn(100)
            }
        );
    }
}

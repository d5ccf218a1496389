//! Bypass advice: when the booking service should not trust the copy's count
//! and read the owner instead. One policy, used by `GET /v1/bypass` and by
//! search (which reads a flagged hotel's room types from the owner).
//!
//! Reasons, each independent:
//! - `not_ready`: the copy is not loaded, or is being rebuilt.
//! - `lagging`: the copy lags the owner by more than `stale.bypass_max_lag_ms`.
//! - `few_units`: the copy shows fewer than `rooms + search.few_units_threshold`
//!   units free on some night of the stay, or has no row for one. For a
//!   single room that is exactly search's rule (`free <= threshold` is read
//!   from the owner); a bigger party needs the same margin on top of what it
//!   takes, because it is what remains after the take that a stale count can
//!   get wrong.
//! - `hotel_conflicts`: over the sliding window, this hotel had at least
//!   `stale.hotel_min_takes` takes and more than `stale.hotel_share_bound` of
//!   them were stale reads. Only stale reads count (conflicts after the copy
//!   showed enough units), not conflicts after owner reads: reading the owner
//!   is the remedy for the first and does nothing for guests racing each
//!   other. Conflicts after `confirmed` numbers do not count either: the copy
//!   had then applied an owner position taken after the search began, so it
//!   was as fresh as the owner (a race no read could have avoided). While the
//!   hotel is read from the owner it makes no new stale reads, so its share
//!   falls as takes go on and old buckets leave the window, and the hotel
//!   returns to the copy by itself.
//! - `diverging`: within `stale.window_secs`, the divergence audit found a row
//!   of this hotel that the copy shows differently from the owner although it
//!   was past the owner's read. Confirming the copy's position cannot help
//!   there (a confirmed read trusts the copy), so the hotel is read from the
//!   owner until the mark expires.
//!
//! Nothing else decides: 409s after `owner` or `confirmed` showings, and the
//! raw 409-after-shown share, are reported by source but never flag a hotel.

use serde::Serialize;

use super::window::Counts;
use crate::lsn::Lsn;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    FewUnits,
    Lagging,
    NotReady,
    HotelConflicts,
    Diverging,
}

impl Reason {
    pub const ALL: [Reason; 5] = [
        Reason::FewUnits,
        Reason::Lagging,
        Reason::NotReady,
        Reason::HotelConflicts,
        Reason::Diverging,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Reason::FewUnits => "few_units",
            Reason::Lagging => "lagging",
            Reason::NotReady => "not_ready",
            Reason::HotelConflicts => "hotel_conflicts",
            Reason::Diverging => "diverging",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    pub few_units_threshold: i32,
    pub max_lag_ms: u64,
    pub hotel_share_bound: f64,
    pub hotel_min_takes: u64,
}

/// What the copy says about one take, as the policy needs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Inputs {
    pub ready: bool,
    pub lag_ms: u64,
    /// The fewest units free over the stay; `None` when a night has no row
    /// (or the copy does not know the room type).
    pub free_units: Option<i32>,
    pub rooms: i32,
    pub hotel: Counts,
    /// The divergence audit found this hotel diverging (recently).
    pub diverging: bool,
}

/// The answer of `GET /v1/bypass`.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Advice {
    /// Read the owner before trusting this count.
    pub bypass: bool,
    pub reasons: Vec<Reason>,
    /// The copy's fewest free units over the stay; null when unknown.
    pub free_units: Option<i32>,
    pub lag_ms: u64,
    /// The LSN the copy's count reflects.
    #[schema(value_type = String, example = "0/16B3748")]
    pub lsn: Lsn,
}

impl Policy {
    /// A hotel whose recent stale reads say: show it from the owner.
    pub fn hotel_flagged(&self, c: &Counts) -> bool {
        c.takes >= self.hotel_min_takes.max(1) && c.share() > self.hotel_share_bound
    }

    pub fn reasons(&self, i: &Inputs) -> Vec<Reason> {
        let mut reasons = Vec::new();
        if !i.ready {
            reasons.push(Reason::NotReady);
        }
        if i.lag_ms > self.max_lag_ms {
            reasons.push(Reason::Lagging);
        }
        let margin = i.rooms.saturating_add(self.few_units_threshold);
        if i.ready && i.free_units.is_none_or(|f| f < margin) {
            reasons.push(Reason::FewUnits);
        }
        if self.hotel_flagged(&i.hotel) {
            reasons.push(Reason::HotelConflicts);
        }
        if i.diverging {
            reasons.push(Reason::Diverging);
        }
        reasons
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Policy = Policy {
        few_units_threshold: 2,
        max_lag_ms: 1000,
        hotel_share_bound: 0.1,
        hotel_min_takes: 10,
    };

    fn inputs() -> Inputs {
        Inputs {
            ready: true,
            lag_ms: 10,
            free_units: Some(9),
            rooms: 1,
            hotel: Counts::default(),
            diverging: false,
        }
    }

    #[test]
    fn a_fresh_copy_with_room_to_spare_needs_no_bypass() {
        assert!(P.reasons(&inputs()).is_empty());
    }

    #[test]
    fn few_units_leaves_the_threshold_on_top_of_the_party() {
        let at = |free, rooms| {
            P.reasons(&Inputs {
                free_units: free,
                rooms,
                ..inputs()
            })
        };
        // One room: the same rule search uses (free <= threshold).
        assert_eq!(at(Some(2), 1), vec![Reason::FewUnits]);
        assert!(at(Some(3), 1).is_empty());
        // Three rooms need three plus the margin.
        assert_eq!(at(Some(4), 3), vec![Reason::FewUnits]);
        assert!(at(Some(5), 3).is_empty());
        assert_eq!(at(None, 1), vec![Reason::FewUnits], "no row: ask the owner");
        assert_eq!(at(Some(0), i32::MAX), vec![Reason::FewUnits], "no overflow");
    }

    #[test]
    fn lagging_is_strictly_past_the_bound() {
        let lag = |lag_ms| P.reasons(&Inputs { lag_ms, ..inputs() });
        assert!(lag(1000).is_empty());
        assert_eq!(lag(1001), vec![Reason::Lagging]);
    }

    #[test]
    fn a_copy_that_is_not_ready_says_only_that_and_lag() {
        let r = P.reasons(&Inputs {
            ready: false,
            free_units: None,
            ..inputs()
        });
        assert_eq!(r, vec![Reason::NotReady]);
    }

    #[test]
    fn hotel_conflicts_need_enough_takes_and_a_share_above_the_bound() {
        let hotel = |takes, stale| {
            P.reasons(&Inputs {
                hotel: Counts {
                    takes,
                    conflicts: stale,
                    stale,
                    errors: 0,
                },
                ..inputs()
            })
        };
        assert!(hotel(9, 9).is_empty(), "too few takes to judge");
        assert!(hotel(10, 1).is_empty(), "exactly at the bound");
        assert_eq!(hotel(10, 2), vec![Reason::HotelConflicts]);
        assert_eq!(hotel(100, 11), vec![Reason::HotelConflicts]);
    }

    #[test]
    fn reasons_add_up() {
        let r = P.reasons(&Inputs {
            ready: true,
            lag_ms: 5000,
            free_units: Some(1),
            rooms: 1,
            hotel: Counts {
                takes: 20,
                conflicts: 10,
                stale: 10,
                errors: 0,
            },
            diverging: true,
        });
        assert_eq!(
            r,
            vec![
                Reason::Lagging,
                Reason::FewUnits,
                Reason::HotelConflicts,
                Reason::Diverging
            ]
        );
    }

    #[test]
    fn a_diverging_hotel_is_read_from_the_owner_whatever_its_share() {
        let r = P.reasons(&Inputs {
            diverging: true,
            ..inputs()
        });
        assert_eq!(r, vec![Reason::Diverging]);
    }
}

//! `Lsn`: a position in the owner's write-ahead log.
//!
//! Every answer `vacancy` gives says which LSN it reflects, and operators
//! compare it with what PostgreSQL prints, so it is shown the way PostgreSQL
//! writes it (`0/16B3748`) and parsed from that form. The owner hands LSNs
//! over as `pg_lsn` values (`PgLsn`), never as text.

use std::fmt;
use std::str::FromStr;

use tokio_postgres::types::PgLsn;

/// A WAL position. `Lsn(0)` means "none yet".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    pub const ZERO: Lsn = Lsn(0);

    /// Bytes of WAL between `self` and a later position (0 when not later).
    pub fn bytes_until(self, later: Lsn) -> u64 {
        later.0.saturating_sub(self.0)
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("not an LSN: {0:?} (expected two hex numbers like 0/16B3748)")]
pub struct ParseLsnError(pub String);

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError(s.chars().take(64).collect());
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        if hi.is_empty() || lo.is_empty() || hi.len() > 8 || lo.len() > 8 {
            return Err(err());
        }
        let hi = u32::from_str_radix(hi, 16).map_err(|_| err())?;
        let lo = u32::from_str_radix(lo, 16).map_err(|_| err())?;
        Ok(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

/// An LSN with the owner timeline it was read on: `2/0/16B3748`
/// (timeline in decimal, as `IDENTIFY_SYSTEM` and `pg_control` print it).
///
/// LSNs are only ordered within a timeline: after a failover the new
/// primary's positions start from where it branched off, and may be below
/// positions the old one handed out. So a position a guest sends back
/// (`min_lsn`, `Last-Event-ID`) says its timeline. A bare `0/16B3748` (an
/// older client, or a commit LSN read on the owner) parses with
/// `timeline: None` and is taken as a position of the copy's own timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Position {
    pub timeline: Option<u32>,
    pub lsn: Lsn,
}

impl Position {
    pub fn new(timeline: u32, lsn: Lsn) -> Position {
        Position {
            timeline: (timeline != 0).then_some(timeline),
            lsn,
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.timeline {
            Some(timeline) => write!(f, "{timeline}/{}", self.lsn),
            None => write!(f, "{}", self.lsn),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "not a position: {0:?} (expected an LSN like 0/16B3748, or a timeline and an LSN like 2/0/16B3748)"
)]
pub struct ParsePositionError(pub String);

impl FromStr for Position {
    type Err = ParsePositionError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParsePositionError(s.chars().take(64).collect());
        match s.split_once('/') {
            Some((timeline, rest)) if rest.contains('/') => {
                // Decimal, 1 to 10 digits, never 0 (PostgreSQL's timelines start at 1).
                if timeline.is_empty()
                    || timeline.len() > 10
                    || !timeline.bytes().all(|b| b.is_ascii_digit())
                {
                    return Err(err());
                }
                let timeline: u32 = timeline.parse().map_err(|_| err())?;
                if timeline == 0 {
                    return Err(err());
                }
                let lsn = rest.parse::<Lsn>().map_err(|_| err())?;
                Ok(Position {
                    timeline: Some(timeline),
                    lsn,
                })
            }
            _ => Ok(Position {
                timeline: None,
                lsn: s.parse::<Lsn>().map_err(|_| err())?,
            }),
        }
    }
}

impl From<PgLsn> for Lsn {
    fn from(lsn: PgLsn) -> Lsn {
        Lsn(u64::from(lsn))
    }
}

impl From<Lsn> for PgLsn {
    fn from(lsn: Lsn) -> PgLsn {
        PgLsn::from(lsn.0)
    }
}

impl serde::Serialize for Lsn {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Lsn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn formats_like_postgres() {
        assert_eq!(Lsn(0x16B3748).to_string(), "0/16B3748");
        assert_eq!(Lsn(0x1_0000_0000).to_string(), "1/0");
    }

    #[test]
    fn rejects_malformed() {
        for bad in ["", "0", "/1", "1/", "x/1", "1/2/3", "123456789/0", "-1/0"] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn pg_lsn_is_the_same_position() {
        let pg: PgLsn = "16/B374D848".parse().unwrap();
        assert_eq!(Lsn::from(pg), Lsn(0x16_B374_D848));
        assert_eq!(PgLsn::from(Lsn(0x16_B374_D848)), pg);
    }

    #[test]
    fn positions_carry_their_timeline_or_none() {
        let p: Position = "2/0/16B3748".parse().unwrap();
        assert_eq!(
            p,
            Position {
                timeline: Some(2),
                lsn: Lsn(0x16B3748)
            }
        );
        assert_eq!(p.to_string(), "2/0/16B3748");
        let bare: Position = "0/16B3748".parse().unwrap();
        assert_eq!(
            bare,
            Position {
                timeline: None,
                lsn: Lsn(0x16B3748)
            }
        );
        assert_eq!(bare.to_string(), "0/16B3748");
        assert_eq!(Position::new(0, Lsn(5)).timeline, None);
        for bad in [
            "",
            "0/0/1",
            "x/0/1",
            "1/2/3/4",
            "/0/1",
            "99999999999/0/1",
            "1//1",
            "1/0/",
        ] {
            assert!(bad.parse::<Position>().is_err(), "{bad} parsed");
        }
    }

    proptest! {
        #[test]
        fn round_trips(v in any::<u64>()) {
            prop_assert_eq!(Lsn(v).to_string().parse::<Lsn>(), Ok(Lsn(v)));
        }

        /// A `pg_lsn` read from the owner is the same position, shown the
        /// same way, as the text PostgreSQL would have printed for it.
        #[test]
        fn pg_lsn_converts_both_ways(v in any::<u64>()) {
            let pg = PgLsn::from(v);
            let lsn = Lsn::from(pg);
            prop_assert_eq!(lsn, Lsn(v));
            prop_assert_eq!(PgLsn::from(lsn), pg);
            prop_assert_eq!(lsn.to_string(), pg.to_string());
        }

        #[test]
        fn never_panics_on_text(s in "\\PC{0,24}") {
            let _ = s.parse::<Lsn>();
        }

        #[test]
        fn positions_round_trip(t in 1u32.., v in any::<u64>()) {
            let p = Position { timeline: Some(t), lsn: Lsn(v) };
            prop_assert_eq!(p.to_string().parse::<Position>(), Ok(p));
        }

        #[test]
        fn never_panics_on_position_text(s in "\\PC{0,24}") {
            let _ = s.parse::<Position>();
        }
    }
}

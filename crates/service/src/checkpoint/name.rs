//! Checkpoint file names: `checkpoint-TTTTTTTT-HHHHHHHH-LLLLLLLL.vcp`.
//!
//! `T` is the owner's timeline, `H`/`L` the high and low 32 bits of the
//! LSN, each as exactly 8 upper-case hex digits. Fixed width makes the
//! names sort like the (timeline, LSN) pairs they stand for, even in `ls`,
//! and the LSN reads like PostgreSQL's `H/L` with the slash (not allowed in
//! a file name) turned into a dash. Only a name of exactly this form is
//! taken for a checkpoint; anything else in the directory is left alone.

use std::fmt;

use crate::lsn::Lsn;

const PREFIX: &str = "checkpoint-";
const SUFFIX: &str = ".vcp";

/// What a checkpoint's name says: the position of its copy. Ordered by
/// timeline first: after an owner failover, LSNs on the new timeline may
/// be lower than the old timeline's, and the new timeline's are newer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CheckpointName {
    pub timeline: u32,
    pub lsn: Lsn,
}

impl CheckpointName {
    /// The name of a checkpoint file, or `None` for any other name.
    pub fn parse(file_name: &str) -> Option<CheckpointName> {
        let hex = file_name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?;
        let mut parts = hex.split('-');
        let timeline = hex8(parts.next()?)?;
        let high = hex8(parts.next()?)?;
        let low = hex8(parts.next()?)?;
        if parts.next().is_some() {
            return None;
        }
        Some(CheckpointName {
            timeline,
            lsn: Lsn((u64::from(high) << 32) | u64::from(low)),
        })
    }
}

/// Exactly 8 upper-case hex digits: one spelling per value, so two files
/// can never name the same checkpoint.
fn hex8(s: &str) -> Option<u32> {
    let canonical = s.len() == 8 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'A'..=b'F'));
    canonical.then(|| u32::from_str_radix(s, 16).ok())?
}

impl fmt::Display for CheckpointName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{PREFIX}{:08X}-{:08X}-{:08X}{SUFFIX}",
            self.timeline,
            self.lsn.0 >> 32,
            self.lsn.0 & 0xFFFF_FFFF
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_read_like_the_lsn() {
        let name = CheckpointName {
            timeline: 1,
            lsn: Lsn(0x016B_3748),
        };
        assert_eq!(
            name.to_string(),
            "checkpoint-00000001-00000000-016B3748.vcp"
        );
        assert_eq!(CheckpointName::parse(&name.to_string()), Some(name));
    }

    #[test]
    fn other_names_are_not_checkpoints() {
        for other in [
            "checkpoint-00000001-00000000-016b3748.vcp",
            "checkpoint-1-0-16B3748.vcp",
            "checkpoint-00000001-00000000-016B3748.vcp.tmp",
            "checkpoint-00000001-00000000-016B3748-00000000.vcp",
            "checkpoint-00000001-00000000.vcp",
            ".checkpoint-00000001-00000000-016B3748.vcp",
            "checkpoint-+0000001-00000000-016B3748.vcp",
            "notes.txt",
        ] {
            assert_eq!(CheckpointName::parse(other), None, "{other}");
        }
    }

    proptest! {
        /// Names round-trip, and sort (as strings) like (timeline, LSN).
        #[test]
        fn names_sort_like_positions(a in (any::<u32>(), any::<u64>()), b in (any::<u32>(), any::<u64>())) {
            let x = CheckpointName { timeline: a.0, lsn: Lsn(a.1) };
            let y = CheckpointName { timeline: b.0, lsn: Lsn(b.1) };
            prop_assert_eq!(CheckpointName::parse(&x.to_string()), Some(x));
            prop_assert_eq!(x.to_string().cmp(&y.to_string()), x.cmp(&y));
        }
    }
}

//! The owner transactions the copy has applied, by xid.
//!
//! An owner read that corrects or judges the copy must see every
//! transaction the copy already shows, and the owner cannot say which of its
//! running transactions have in fact committed (`owner::visibility`). The
//! copy can: it applied them. So each applied transaction's xid is kept
//! here, most recent last, in a bounded ring; a reader takes a [`XidMark`]
//! when it looks at the copy and later asks whether any transaction applied
//! before the mark is hidden from the owner snapshot it read in.

use std::collections::VecDeque;
use std::sync::Mutex;

/// Xids remembered: at a thousand commits a second, a minute of them, in
/// 256 KiB. An owner read that has to look further back than the ring holds
/// is treated as possibly hiding one, so a long write transaction on the
/// owner can delay re-reads and audits, never make them wrong.
const CAPACITY: usize = 65_536;

/// How far behind the newest applied xid an older one is dropped: xids
/// compare modulo 2^32, so one more than 2^31 behind would look ahead of a
/// snapshot (forever hidden, and every re-read deferred). A transaction the
/// copy applied 2^30 xids ago finished long since.
const ANCIENT: u32 = 1 << 30;

/// Whether `a` comes before `b` among 32-bit xids, which wrap around
/// (PostgreSQL's `TransactionIdPrecedes` for normal xids).
pub fn precedes(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// The ring's contents, carried across a restart by a checkpoint
/// (`crate::checkpoint`): without them, an owner snapshot that still hides
/// a checkpointed commit would be trusted after the restart.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RingContents {
    /// Sequence number of `xids[0]`: how many were forgotten.
    pub first: u64,
    /// Applied xids, in the order they were recorded, oldest first.
    pub xids: Vec<u32>,
    /// The latest (by xid order) of the forgotten ones.
    pub newest_forgotten: Option<u32>,
}

/// Everything applied up to some moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidMark(u64);

#[derive(Debug)]
pub struct AppliedXids {
    ring: Mutex<Ring>,
    capacity: usize,
}

#[derive(Debug, Default)]
struct Ring {
    /// Sequence number of `xids[0]`: how many were forgotten.
    first: u64,
    xids: VecDeque<u32>,
    /// The latest (by xid order) of the forgotten ones.
    newest_forgotten: Option<u32>,
}

impl Default for AppliedXids {
    fn default() -> Self {
        AppliedXids::with_capacity(CAPACITY)
    }
}

impl AppliedXids {
    pub fn with_capacity(capacity: usize) -> AppliedXids {
        AppliedXids {
            ring: Mutex::new(Ring::default()),
            capacity: capacity.max(1),
        }
    }

    /// Notes a committed transaction. Called before it is applied, so any
    /// mark taken once it shows in the copy includes it.
    pub fn record(&self, xid: u32) {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if ring.xids.len() == self.capacity
            && let Some(old) = ring.xids.pop_front()
        {
            ring.first += 1;
            ring.newest_forgotten = Some(match ring.newest_forgotten {
                Some(n) if precedes(old, n) => n,
                _ => old,
            });
        }
        while ring.xids.front().is_some_and(|&old| far_behind(xid, old)) {
            ring.xids.pop_front();
            ring.first += 1;
        }
        if ring.newest_forgotten.is_some_and(|n| far_behind(xid, n)) {
            ring.newest_forgotten = None;
        }
        ring.xids.push_back(xid);
    }

    /// Forgets every xid: the copy was replaced by a snapshot of another
    /// owner (a promoted standby), whose xids are not the old primary's
    /// (one applied there and lost with it would count as hidden, and
    /// defer every re-read, until the new primary's counter passed it).
    /// Everything the snapshot holds is visible to any later snapshot on
    /// its owner, so nothing needs remembering.
    pub fn clear(&self) {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let forgotten = ring.xids.len() as u64;
        ring.first += forgotten;
        ring.xids.clear();
        ring.newest_forgotten = None;
    }

    /// A copy of the ring. It holds the lock while it copies (at most
    /// `CAPACITY` xids, 256 KiB: tens of microseconds of `record` waiting).
    pub fn contents(&self) -> RingContents {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        RingContents {
            first: ring.first,
            xids: ring.xids.iter().copied().collect(),
            newest_forgotten: ring.newest_forgotten,
        }
    }

    /// Replaces the ring with `contents` (a checkpoint's, at start). When
    /// they hold more xids than this ring keeps, the oldest are forgotten
    /// as `record` would forget them: folded into `newest_forgotten`, so
    /// they still count as possibly hidden.
    pub fn restore(&self, contents: RingContents) {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let RingContents {
            first,
            xids,
            newest_forgotten,
        } = contents;
        let excess = xids.len().saturating_sub(self.capacity);
        let forgotten = xids[..excess]
            .iter()
            .copied()
            .fold(newest_forgotten, |newest, old| match newest {
                Some(n) if precedes(old, n) => Some(n),
                _ => Some(old),
            });
        *ring = Ring {
            first: first.saturating_add(excess as u64),
            xids: xids[excess..].iter().copied().collect(),
            newest_forgotten: forgotten,
        };
        debug_assert!(ring.xids.len() <= self.capacity);
    }

    /// Everything recorded so far.
    pub fn mark(&self) -> XidMark {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        XidMark(ring.first + ring.xids.len() as u64)
    }

    /// Whether some transaction recorded before `mark` may be hidden, with
    /// `hidden(xid)` saying so for one and `floor` an xid before which all
    /// are seen (a snapshot's xmin). Forgotten ones count as hidden unless
    /// all of them come before `floor`.
    pub fn any_hidden(&self, mark: XidMark, floor: u32, hidden: impl Fn(u32) -> bool) -> bool {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if ring
            .newest_forgotten
            .is_some_and(|n| !precedes(n, floor) && mark.0 > 0)
        {
            return true;
        }
        let before = mark.0.saturating_sub(ring.first);
        let before = usize::try_from(before).unwrap_or(usize::MAX);
        ring.xids
            .iter()
            .take(before)
            .any(|&x| !precedes(x, floor) && hidden(x))
    }
}

/// `older` is more than `ANCIENT` behind `newer`. Commit order is not xid
/// order (a long transaction commits after younger ones), so an xid that
/// comes before its predecessor in the ring is not far behind: it is simply
/// older by a little, which `precedes` tells.
fn far_behind(newer: u32, older: u32) -> bool {
    let behind = newer.wrapping_sub(older);
    behind > ANCIENT && !precedes(newer, older)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_transactions_before_the_mark_count() {
        let xids = AppliedXids::with_capacity(8);
        xids.record(100);
        xids.record(101);
        let mark = xids.mark();
        xids.record(102);
        let hidden_102 = |x: u32| x == 102;
        assert!(
            !xids.any_hidden(mark, 0, hidden_102),
            "102 came after the mark"
        );
        assert!(xids.any_hidden(xids.mark(), 0, hidden_102));
        assert!(xids.any_hidden(mark, 0, |x| x == 101));
        assert!(
            !xids.any_hidden(mark, 102, |x| x == 101),
            "before the floor: seen"
        );
    }

    #[test]
    fn forgotten_transactions_count_as_hidden_unless_before_the_floor() {
        let xids = AppliedXids::with_capacity(2);
        // Commit order is not xid order: 50 is forgotten after 90.
        for x in [90, 50, 60, 70] {
            xids.record(x);
        }
        let mark = xids.mark();
        let none = |_| false;
        assert!(
            xids.any_hidden(mark, 90, none),
            "90 was forgotten and is not before 90"
        );
        assert!(!xids.any_hidden(mark, 91, none));
    }

    #[test]
    fn xids_far_behind_the_newest_are_dropped_before_they_look_ahead() {
        let xids = AppliedXids::with_capacity(2);
        xids.record(10);
        xids.record(11);
        // 10 falls out of the ring: forgotten, not yet ancient.
        xids.record(12);
        let later = 12 + (1u32 << 30) + 1;
        // Now 10, 11 and 12 are all over 2^30 behind: dropped, and the
        // forgotten 11 no longer counts.
        xids.record(later);
        let mark = xids.mark();
        assert!(!xids.any_hidden(mark, later, |x| x != later));
        assert!(xids.any_hidden(mark, later, |x| x == later));
        // Past the wrap as well.
        let wrapping = AppliedXids::with_capacity(4);
        wrapping.record(u32::MAX - 5);
        wrapping.record((u32::MAX - 5).wrapping_add((1 << 30) + 10));
        assert!(!wrapping.any_hidden(wrapping.mark(), 0, |x| x == u32::MAX - 5));
    }

    /// What a checkpoint carries comes back as it was; a ring restored
    /// into a smaller one forgets the oldest, and still counts them.
    #[test]
    fn contents_restore_as_they_were() {
        let xids = AppliedXids::with_capacity(3);
        for x in [90, 50, 60, 70] {
            xids.record(x);
        }
        let contents = xids.contents();
        assert_eq!(
            contents,
            RingContents {
                first: 1,
                xids: vec![50, 60, 70],
                newest_forgotten: Some(90),
            }
        );
        let restored = AppliedXids::with_capacity(3);
        restored.restore(contents.clone());
        assert_eq!(restored.contents(), contents);
        assert_eq!(restored.mark(), xids.mark());
        let smaller = AppliedXids::with_capacity(1);
        smaller.restore(contents);
        assert_eq!(
            smaller.contents(),
            RingContents {
                first: 3,
                xids: vec![70],
                newest_forgotten: Some(90),
            }
        );
        assert!(smaller.any_hidden(smaller.mark(), 80, |_| false));
    }

    #[test]
    fn an_early_mark_stays_valid_after_the_ring_moves_on() {
        let xids = AppliedXids::with_capacity(2);
        xids.record(10);
        let mark = xids.mark();
        for x in 11..20 {
            xids.record(x);
        }
        // 10 was forgotten, with 11 to 17 after it; which of them came
        // before the mark is not kept, so only a floor past all of them
        // says 10 was seen.
        assert!(xids.any_hidden(mark, 5, |_| false));
        assert!(xids.any_hidden(mark, 17, |_| false));
        assert!(!xids.any_hidden(mark, 18, |_| false));
        // Nothing recorded before an empty mark.
        assert!(!AppliedXids::with_capacity(2).any_hidden(XidMark(0), 0, |_| true));
    }
}

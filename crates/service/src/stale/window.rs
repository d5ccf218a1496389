//! The sliding window over take outcomes: overall and per hotel.
//!
//! Time is cut into `buckets` buckets of `width` each, in a ring; an outcome
//! is added to the bucket of its time (its arrival on a standalone node, its
//! time in the outcome stream in a fleet: `record_aged`), and a bucket that
//! falls out of the window is subtracted from the running totals before its slot is
//! reused. So a read (the share of one hotel, on every search) is one hash
//! lookup, and a write touches one bucket and the totals.
//!
//! Memory is bounded: at most `max_hotels` hotels are tracked at once (the
//! totals admit a new hotel only while below the cap, and a bucket only
//! holds hotels the totals hold). Outcomes of hotels past the cap still count
//! in the overall figures and are reported as untracked.
//!
//! A checkpoint carries the window across a restart as aged buckets
//! (`buckets`, then `restore` in the next process): an `Instant` means
//! nothing to another process, but "this bucket began so long before the
//! write" does.
//!
//! Pure data: the caller passes the time, so tests step through it exactly.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Outcome counts over some span.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Takes the owner answered (taken or conflict): the share's denominator.
    pub takes: u64,
    /// Takes refused by the owner (409), whatever the quote said.
    pub conflicts: u64,
    /// Conflicts after the copy showed enough units free: the stale reads.
    pub stale: u64,
    /// Takes that failed for another reason (not in `takes`).
    pub errors: u64,
}

impl Counts {
    /// Stale reads per take, 0 when nothing was taken.
    pub fn share(&self) -> f64 {
        if self.takes == 0 {
            0.0
        } else {
            self.stale as f64 / self.takes as f64
        }
    }

    fn add(&mut self, o: &Counts) {
        self.takes += o.takes;
        self.conflicts += o.conflicts;
        self.stale += o.stale;
        self.errors += o.errors;
    }

    fn sub(&mut self, o: &Counts) {
        // Totals are sums of live buckets, so this never goes below zero;
        // saturate anyway rather than wrap if that ever stops being true.
        debug_assert!(self.takes >= o.takes && self.stale >= o.stale);
        self.takes = self.takes.saturating_sub(o.takes);
        self.conflicts = self.conflicts.saturating_sub(o.conflicts);
        self.stale = self.stale.saturating_sub(o.stale);
        self.errors = self.errors.saturating_sub(o.errors);
    }

    fn is_zero(&self) -> bool {
        *self == Counts::default()
    }
}

#[derive(Debug, Default)]
struct Bucket {
    overall: Counts,
    hotels: HashMap<i64, Counts>,
    /// Takes of hotels the cap kept out.
    untracked: u64,
}

impl Bucket {
    fn is_empty(&self) -> bool {
        self.overall.is_zero() && self.untracked == 0 && self.hotels.is_empty()
    }
}

#[derive(Debug)]
pub struct SlidingWindow {
    origin: Instant,
    width: Duration,
    ring: Vec<Bucket>,
    /// Absolute number of the newest bucket in the ring. Bucket `ring.len()`
    /// begins at `origin`: the numbers below it are buckets before the
    /// origin, where `restore` may place a bucket older than this window.
    head: u64,
    overall: Counts,
    hotels: HashMap<i64, Counts>,
    untracked: u64,
    max_hotels: usize,
}

/// One live bucket, aged: what a checkpoint carries of the window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgedBucket {
    /// From the bucket's start to the time it was taken at.
    pub age: Duration,
    pub overall: Counts,
    /// Takes of hotels the cap kept out.
    pub untracked: u64,
    /// In hotel id order; every count non-zero.
    pub hotels: Vec<(i64, Counts)>,
}

/// One hotel's figures over the window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HotelShare {
    pub hotel_id: i64,
    pub counts: Counts,
}

impl SlidingWindow {
    pub fn new(now: Instant, width: Duration, buckets: usize, max_hotels: usize) -> SlidingWindow {
        assert!(buckets > 0 && !width.is_zero(), "a window needs buckets");
        SlidingWindow {
            origin: now,
            width,
            ring: (0..buckets).map(|_| Bucket::default()).collect(),
            head: buckets as u64,
            overall: Counts::default(),
            hotels: HashMap::new(),
            untracked: 0,
            max_hotels,
        }
    }

    pub fn span(&self) -> Duration {
        self.width * self.ring.len() as u32
    }

    fn bucket_number(&self, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.origin);
        self.ring.len() as u64 + (since.as_nanos() / self.width.as_nanos()) as u64
    }

    /// Drops the buckets that fell out of the window by `now`.
    pub fn advance(&mut self, now: Instant) {
        let target = self.bucket_number(now);
        if target <= self.head {
            return;
        }
        let n = self.ring.len() as u64;
        // Past a whole window, every bucket expires: no need to step through
        // each absolute number in between.
        let first = self.head + 1;
        let from = first.max(target.saturating_sub(n - 1));
        if from > first {
            for slot in 0..self.ring.len() {
                self.expire(slot);
            }
        } else {
            for number in from..=target {
                self.expire((number % n) as usize);
            }
        }
        self.head = target;
    }

    fn expire(&mut self, slot: usize) {
        let old = std::mem::take(&mut self.ring[slot]);
        self.overall.sub(&old.overall);
        self.untracked = self.untracked.saturating_sub(old.untracked);
        for (hotel, counts) in old.hotels {
            if let Some(total) = self.hotels.get_mut(&hotel) {
                total.sub(&counts);
                if total.is_zero() {
                    self.hotels.remove(&hotel);
                }
            }
        }
    }

    /// Adds one outcome for `hotel_id` at `now`: what `record_aged` does
    /// with no age, done the plain way, so tests hold one against the other.
    #[cfg(test)]
    pub fn record(&mut self, now: Instant, hotel_id: i64, counts: Counts) {
        self.advance(now);
        let slot = (self.head % self.ring.len() as u64) as usize;
        self.ring[slot].overall.add(&counts);
        self.overall.add(&counts);
        self.add_hotel(slot, hotel_id, counts);
    }

    /// Adds one outcome for `hotel_id` that happened `age` before `now`, to
    /// the bucket that holds that instant: the fleet counts an outcome at
    /// the time its stream stored it, not when this node read it, so a node
    /// that reads late (a restart, a slow consumer) expires it when the
    /// others do. Returns whether it is in the window: an outcome as old as
    /// the span is not (the caller still counts it in its totals).
    pub fn record_aged(
        &mut self,
        now: Instant,
        age: Duration,
        hotel_id: i64,
        counts: Counts,
    ) -> bool {
        self.advance(now);
        if age >= self.span() {
            return false;
        }
        let n = self.ring.len() as i128;
        let width = self.width.as_nanos() as i128;
        let since = now.saturating_duration_since(self.origin).as_nanos() as i128;
        // In i128 from the origin, as `restore` does: the instant may lie
        // before this window began (a process younger than the outcome).
        let at = n + (since - age.as_nanos() as i128).div_euclid(width);
        let head = i128::from(self.head);
        // Later than the head only if `now` is behind a time the window
        // already advanced to (a caller's clock read before another's):
        // then it goes to the newest bucket, the latest there is.
        let number = at.min(head);
        if number <= head - n {
            return false;
        }
        let slot = number.rem_euclid(n) as usize;
        self.ring[slot].overall.add(&counts);
        self.overall.add(&counts);
        self.add_hotel(slot, hotel_id, counts);
        true
    }

    /// A hotel's part of an outcome, into bucket `slot` and the totals, or
    /// to the untracked takes past the cap. The overall counts are the
    /// caller's.
    fn add_hotel(&mut self, slot: usize, hotel_id: i64, counts: Counts) {
        let tracked = self.hotels.contains_key(&hotel_id) || self.hotels.len() < self.max_hotels;
        let bucket = &mut self.ring[slot];
        if tracked {
            bucket.hotels.entry(hotel_id).or_default().add(&counts);
            self.hotels.entry(hotel_id).or_default().add(&counts);
        } else {
            bucket.untracked += counts.takes;
            self.untracked += counts.takes;
        }
    }

    /// The live buckets at `now`, oldest first, the empty ones left out:
    /// what a checkpoint carries. At most `buckets` of them, each with at
    /// most `max_hotels` hotels (a bucket holds only hotels the totals
    /// hold).
    pub fn buckets(&mut self, now: Instant) -> Vec<AgedBucket> {
        self.advance(now);
        let n = self.ring.len() as u64;
        debug_assert!(self.head >= n, "bucket numbers start at the ring's length");
        let since = now.saturating_duration_since(self.origin);
        // How far `now` is into the newest bucket; each older one began a
        // whole width earlier.
        let into_newest = (since.as_nanos() % self.width.as_nanos()) as u64;
        let mut aged = Vec::new();
        for back in (0..n).rev() {
            let bucket = &self.ring[((self.head - back) % n) as usize];
            if bucket.is_empty() {
                continue;
            }
            let mut hotels: Vec<(i64, Counts)> =
                bucket.hotels.iter().map(|(id, c)| (*id, *c)).collect();
            hotels.sort_unstable_by_key(|(id, _)| *id);
            let widths = self
                .width
                .saturating_mul(u32::try_from(back).unwrap_or(u32::MAX));
            aged.push(AgedBucket {
                age: Duration::from_nanos(into_newest).saturating_add(widths),
                overall: bucket.overall,
                untracked: bucket.untracked,
                hotels,
            });
        }
        aged
    }

    /// Adds a bucket `buckets` gave (in this process or another), `age` old
    /// at `now`, to the bucket of this window that holds its last instant.
    /// By its end, not its start: this window's buckets need not begin
    /// where the old ones did, and placed by its end a bucket that had
    /// ended by `now` stays at least as long as it would have in the old
    /// window, at most one width longer. One still open at `now` (younger
    /// than a width) goes to the newest bucket, the latest there is, and
    /// may leave up to a width early. Its hotels go through the cap like
    /// new outcomes. Returns whether it was added: a bucket as old as the
    /// window's span has left it, and is dropped.
    pub fn restore(&mut self, now: Instant, bucket: AgedBucket) -> bool {
        self.advance(now);
        if bucket.age >= self.span() {
            return false;
        }
        let n = self.ring.len() as i128;
        let width = self.width.as_nanos() as i128;
        let since = now.saturating_duration_since(self.origin).as_nanos() as i128;
        // How long before `now` the bucket's last nanosecond was; zero
        // while the bucket has not ended yet.
        let end_before_now = (bucket.age.as_nanos() as i128 - width + 1).max(0);
        let number = n + (since - end_before_now).div_euclid(width);
        let head = i128::from(self.head);
        // age < span puts its end within the live numbers, unless `now` is
        // earlier than a time the window already advanced to.
        if number > head || number <= head - n {
            return false;
        }
        let slot = number.rem_euclid(n) as usize;
        self.ring[slot].overall.add(&bucket.overall);
        self.overall.add(&bucket.overall);
        self.ring[slot].untracked += bucket.untracked;
        self.untracked += bucket.untracked;
        for (hotel_id, counts) in bucket.hotels {
            // A hotel with nothing counted would sit in the totals until
            // its bucket expired, taking a place under the cap.
            if !counts.is_zero() {
                self.add_hotel(slot, hotel_id, counts);
            }
        }
        true
    }

    pub fn overall(&mut self, now: Instant) -> Counts {
        self.advance(now);
        self.overall
    }

    pub fn hotel(&mut self, now: Instant, hotel_id: i64) -> Counts {
        self.advance(now);
        self.hotels.get(&hotel_id).copied().unwrap_or_default()
    }

    /// Takes not attributed to a hotel because of the cap.
    pub fn untracked(&mut self, now: Instant) -> u64 {
        self.advance(now);
        self.untracked
    }

    pub fn tracked_hotels(&self) -> usize {
        self.hotels.len()
    }

    /// Hotels with at least `min_takes` takes, highest share first (then
    /// most stale reads, then id), at most `limit`.
    pub fn top(&mut self, now: Instant, min_takes: u64, limit: usize) -> Vec<HotelShare> {
        self.advance(now);
        let mut all: Vec<HotelShare> = self
            .hotels
            .iter()
            .filter(|(_, c)| c.takes >= min_takes.max(1))
            .map(|(h, c)| HotelShare {
                hotel_id: *h,
                counts: *c,
            })
            .collect();
        all.sort_by(|a, b| {
            b.counts
                .share()
                .total_cmp(&a.counts.share())
                .then(b.counts.stale.cmp(&a.counts.stale))
                .then(a.hotel_id.cmp(&b.hotel_id))
        });
        all.truncate(limit);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const W: Duration = Duration::from_secs(5);

    fn take(stale: bool) -> Counts {
        Counts {
            takes: 1,
            conflicts: u64::from(stale),
            stale: u64::from(stale),
            errors: 0,
        }
    }

    #[test]
    fn outcomes_leave_the_window_after_its_span() {
        let t0 = Instant::now();
        let mut w = SlidingWindow::new(t0, W, 60, 100);
        assert_eq!(w.span(), Duration::from_secs(300));
        w.record(t0, 1, take(true));
        w.record(t0 + Duration::from_secs(4), 1, take(false));
        w.record(t0 + Duration::from_secs(100), 2, take(false));
        let at = t0 + Duration::from_secs(299);
        assert_eq!(w.overall(at).takes, 3);
        assert_eq!(w.hotel(at, 1).stale, 1);
        // Bucket 0 (0..5 s) leaves at 300 s; bucket 20 (100..105 s) stays.
        let at = t0 + Duration::from_secs(300);
        assert_eq!(w.overall(at).takes, 1);
        assert_eq!(w.hotel(at, 1), Counts::default());
        assert_eq!(w.tracked_hotels(), 1, "an empty hotel is forgotten");
        assert_eq!(w.hotel(at, 2).takes, 1);
        assert_eq!(w.overall(t0 + Duration::from_secs(405)).takes, 0);
    }

    #[test]
    fn a_long_silence_clears_everything() {
        let t0 = Instant::now();
        let mut w = SlidingWindow::new(t0, W, 4, 100);
        for s in 0..20 {
            w.record(t0 + Duration::from_secs(s), s as i64 % 3, take(s % 2 == 0));
        }
        assert!(w.overall(t0 + Duration::from_secs(19)).takes > 0);
        assert_eq!(
            w.overall(t0 + Duration::from_secs(10_000)),
            Counts::default()
        );
        assert_eq!(w.tracked_hotels(), 0);
    }

    #[test]
    fn share_is_stale_over_takes() {
        let c = Counts {
            takes: 8,
            conflicts: 3,
            stale: 2,
            errors: 5,
        };
        assert_eq!(c.share(), 0.25);
        assert_eq!(Counts::default().share(), 0.0);
    }

    #[test]
    fn the_hotel_cap_bounds_memory_but_not_the_overall_count() {
        let t0 = Instant::now();
        let mut w = SlidingWindow::new(t0, W, 10, 2);
        for h in 0..5 {
            w.record(t0, h, take(false));
        }
        assert_eq!(w.tracked_hotels(), 2);
        assert_eq!(w.overall(t0).takes, 5);
        assert_eq!(w.untracked(t0), 3);
        // A tracked hotel keeps counting.
        w.record(t0, 1, take(true));
        assert_eq!(w.hotel(t0, 1).takes, 2);
        // Once the first two expire, others may enter.
        let later = t0 + Duration::from_secs(50);
        w.record(later, 4, take(false));
        assert_eq!(w.hotel(later, 4).takes, 1);
        assert_eq!(w.untracked(later), 0);
    }

    #[test]
    fn top_orders_by_share_and_needs_min_takes() {
        let t0 = Instant::now();
        let mut w = SlidingWindow::new(t0, W, 10, 100);
        for _ in 0..4 {
            w.record(t0, 1, take(false));
        }
        w.record(t0, 1, take(true)); // 1/5
        w.record(t0, 2, take(true));
        w.record(t0, 2, take(false)); // 1/2
        w.record(t0, 3, take(true)); // 1/1 but one take only
        let top = w.top(t0, 2, 10);
        let ids: Vec<i64> = top.iter().map(|h| h.hotel_id).collect();
        assert_eq!(ids, vec![2, 1]);
        assert_eq!(w.top(t0, 1, 1)[0].hotel_id, 3);
    }

    /// Overall, untracked and every hotel's counts at `at`.
    fn figures(w: &mut SlidingWindow, at: Instant) -> (Counts, u64, Vec<HotelShare>) {
        (w.overall(at), w.untracked(at), w.top(at, 1, usize::MAX))
    }

    /// 40 outcomes over 52 s into a 50 s window of 10 buckets, 4 hotels.
    fn busy(t0: Instant) -> (SlidingWindow, Instant) {
        let mut w = SlidingWindow::new(t0, W, 10, 100);
        for s in 0..40u64 {
            let at = t0 + Duration::from_millis(s * 1_300);
            w.record(at, (s % 4) as i64, take(s % 3 == 0));
        }
        (w, t0 + Duration::from_millis(52_000))
    }

    /// Restored into a window whose buckets begin where the old ones did,
    /// the buckets give the same figures at once and expire at the same
    /// times.
    #[test]
    fn buckets_restore_to_the_same_figures() {
        let t0 = Instant::now();
        let (mut w, at) = busy(t0);
        let aged = w.buckets(at);
        assert!(aged.windows(2).all(|p| p[0].age > p[1].age), "oldest first");
        assert!(aged.iter().all(|b| b.age < w.span()));
        assert!(w.overall(at).takes < 40, "the oldest already left");
        // Begun 10 widths after the old one: the same phase.
        let mut restored = SlidingWindow::new(t0 + Duration::from_secs(50), W, 10, 100);
        for bucket in aged {
            assert!(restored.restore(at, bucket));
        }
        for ms in (0..60_000).step_by(250) {
            let later = at + Duration::from_millis(ms);
            assert_eq!(
                figures(&mut restored, later),
                figures(&mut w, later),
                "{ms} ms on"
            );
        }
        assert_eq!(restored.overall(at + W * 10), Counts::default());
    }

    /// In a window of another phase (the next process's), the figures are
    /// the same at once, and each bucket stays at least as long as it would
    /// have, at most one width longer.
    #[test]
    fn buckets_restored_out_of_phase_never_leave_early() {
        let t0 = Instant::now();
        let (mut w, at) = busy(t0);
        let aged = w.buckets(at);
        // The newest bucket began 2 s before `at`; this window's newest
        // began 1.7 s before it, so even that one cannot leave early.
        let mut restored = SlidingWindow::new(at - Duration::from_millis(1_700), W, 10, 100);
        for bucket in aged {
            assert!(restored.restore(at, bucket));
        }
        assert_eq!(figures(&mut restored, at), figures(&mut w, at));
        // The old window's takes every 100 ms (a window only moves forward).
        let steps: Vec<Duration> = (0..600).map(|i| Duration::from_millis(i * 100)).collect();
        let old: Vec<u64> = steps.iter().map(|d| w.overall(at + *d).takes).collect();
        let per_width = (W.as_millis() / 100) as usize;
        for (i, d) in steps.iter().enumerate() {
            let takes = restored.overall(at + *d).takes;
            assert!(takes >= old[i], "{d:?} on: left early");
            assert!(
                takes <= old[i.saturating_sub(per_width)],
                "{d:?} on: stayed past a width"
            );
        }
        assert_eq!(restored.overall(at + W * 11), Counts::default());
    }

    /// Aged by a downtime, the buckets older than the span are dropped and
    /// the rest kept; a downtime of a whole span drops them all.
    #[test]
    fn a_downtime_drops_the_buckets_it_outlasted() {
        let t0 = Instant::now();
        let (mut w, at) = busy(t0);
        let aged = w.buckets(at);
        let down = Duration::from_secs(20);
        let mut restored = SlidingWindow::new(at + down, W, 10, 100);
        let kept = aged
            .iter()
            .filter(|b| {
                restored.restore(
                    at + down,
                    AgedBucket {
                        age: b.age + down,
                        ..(*b).clone()
                    },
                )
            })
            .count();
        assert!(kept > 0 && kept < aged.len(), "{kept} of {}", aged.len());
        // The same as the old window 20 s on, with nothing new.
        assert_eq!(
            figures(&mut restored, at + down),
            figures(&mut w, at + down)
        );
        let mut emptied = SlidingWindow::new(at + w.span(), W, 10, 100);
        for bucket in aged {
            let age = bucket.age + w.span();
            assert!(!emptied.restore(at + w.span(), AgedBucket { age, ..bucket }));
        }
        assert_eq!(
            figures(&mut emptied, at + w.span()),
            (Counts::default(), 0, vec![])
        );
        assert_eq!(emptied.tracked_hotels(), 0);
    }

    /// Restored hotels go through the cap like new outcomes: past it their
    /// takes are untracked, and the overall figures are whole.
    #[test]
    fn restored_hotels_respect_the_cap() {
        let t0 = Instant::now();
        let (mut w, at) = busy(t0);
        let overall = w.overall(at);
        let mut capped = SlidingWindow::new(at, W, 10, 2);
        for bucket in w.buckets(at) {
            assert!(capped.restore(at, bucket));
        }
        assert_eq!(capped.tracked_hotels(), 2);
        assert_eq!(capped.overall(at), overall);
        let tracked: u64 = capped.top(at, 1, 10).iter().map(|h| h.counts.takes).sum();
        assert_eq!(tracked + capped.untracked(at), overall.takes);
    }

    /// An outcome read late, with its age, lands where it would have on
    /// time; one older than the span is not in the window at all; one older
    /// than the window itself (a young process) still counts while inside
    /// the span.
    #[test]
    fn aged_outcomes_land_in_the_bucket_of_their_time() {
        let t0 = Instant::now();
        let mut on_time = SlidingWindow::new(t0, W, 10, 100);
        let mut late = SlidingWindow::new(t0, W, 10, 100);
        on_time.record(t0 + Duration::from_secs(3), 1, take(true));
        let read_at = t0 + Duration::from_secs(40);
        assert!(late.record_aged(read_at, Duration::from_secs(37), 1, take(true)));
        assert!(!late.record_aged(read_at, Duration::from_secs(50), 2, take(true)));
        for s in [40, 49, 50, 51] {
            let at = t0 + Duration::from_secs(s);
            assert_eq!(figures(&mut late, at), figures(&mut on_time, at), "{s} s");
        }
        assert_eq!(
            late.overall(t0 + Duration::from_secs(50)).takes,
            0,
            "left at 50 s"
        );
        // A window begun after the outcome: placed before its origin.
        let later = t0 + Duration::from_secs(20);
        let mut young = SlidingWindow::new(later, W, 10, 100);
        assert!(young.record_aged(later, Duration::from_secs(17), 1, take(false)));
        assert_eq!(young.overall(t0 + Duration::from_secs(49)).takes, 1);
        assert_eq!(young.overall(t0 + Duration::from_secs(50)).takes, 0);
    }

    proptest! {
        /// Outcomes read late, each with its age, give the figures they
        /// would have given read on time, from the late read onwards.
        #[test]
        fn aged_outcomes_match_outcomes_on_time(
            events in proptest::collection::vec((0u64..2_000, 0i64..6, any::<bool>()), 1..200),
            delay_ms in 0u64..1_000,
        ) {
            let t0 = Instant::now();
            let mut events = events;
            events.sort_by_key(|e| e.0);
            let width = Duration::from_millis(100);
            let mut on_time = SlidingWindow::new(t0, width, 8, 100);
            let mut late = SlidingWindow::new(t0, width, 8, 100);
            let read_at = t0 + Duration::from_millis(2_000 + delay_ms);
            for (ms, hotel, stale) in &events {
                let at = t0 + Duration::from_millis(*ms);
                on_time.record(at, *hotel, take(*stale));
                late.record_aged(read_at, read_at - at, *hotel, take(*stale));
            }
            for step in 0..10u64 {
                let at = read_at + Duration::from_millis(step * 90);
                prop_assert_eq!(figures(&mut late, at), figures(&mut on_time, at));
            }
        }

        /// The running totals always equal a recount of the outcomes still
        /// inside the window, whatever the arrival times.
        #[test]
        fn totals_match_a_recount(
            events in proptest::collection::vec((0u64..2_000, 0i64..6, any::<bool>()), 1..200),
        ) {
            let t0 = Instant::now();
            let buckets = 8usize;
            let mut events = events;
            events.sort_by_key(|e| e.0);
            let mut w = SlidingWindow::new(t0, Duration::from_millis(100), buckets, 100);
            for (i, (ms, hotel, stale)) in events.iter().enumerate() {
                let now = t0 + Duration::from_millis(*ms);
                w.record(now, *hotel, take(*stale));
                let bucket = ms / 100;
                let live: Vec<_> = events[..=i]
                    .iter()
                    .filter(|(m, _, _)| m / 100 + buckets as u64 > bucket)
                    .collect();
                prop_assert_eq!(w.overall(now).takes, live.len() as u64);
                for h in 0..6 {
                    let want = live.iter().filter(|(_, x, s)| *x == h && *s).count() as u64;
                    prop_assert_eq!(w.hotel(now, h).stale, want);
                }
            }
        }

        /// Whatever the outcomes and the new window's phase, restored
        /// buckets give the same figures at the moment of the restore.
        #[test]
        fn restored_figures_match(
            events in proptest::collection::vec((0u64..2_000, 0i64..6, any::<bool>()), 1..200),
            phase_ms in 0u64..2_000,
        ) {
            let t0 = Instant::now();
            let mut events = events;
            events.sort_by_key(|e| e.0);
            let mut w = SlidingWindow::new(t0, Duration::from_millis(100), 8, 100);
            for (ms, hotel, stale) in &events {
                w.record(t0 + Duration::from_millis(*ms), *hotel, take(*stale));
            }
            let at = t0 + Duration::from_millis(2_000);
            let mut restored =
                SlidingWindow::new(t0 + Duration::from_millis(phase_ms), Duration::from_millis(100), 8, 100);
            for bucket in w.buckets(at) {
                prop_assert!(restored.restore(at, bucket));
            }
            prop_assert_eq!(figures(&mut restored, at), figures(&mut w, at));
        }
    }
}

//! Where the two cores went during a run: CPU time of this process's
//! threads, grouped by what they do (their names).
//!
//! Why: client and server share the machine, and the admission run's client
//! sends five or more times the requests the peak run's does. The goal
//! "200s per second stay at 90% of the peak" reads the server's answers,
//! but on two shared cores every shed request also costs the client its
//! round trip. Splitting the time by thread says how much of a shortfall is
//! the flood's own cost and how much the server's, per request.

use std::collections::BTreeMap;

/// A group of threads, by the name their runtime gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum ThreadGroup {
    /// The flood's client (`flood` threads) and the bypass prober.
    Client,
    /// The server's runtime: accepting, reading and writing every request,
    /// shedding, and searches not handed over (`tokio-rt-worker`, the
    /// bench's own runtime, which the in-process server runs on).
    Server,
    /// The guest search threads (`http.guest_search_threads`).
    GuestSearch,
    /// Everything else: the copy's stream, the index, the refresher.
    Other,
}

impl ThreadGroup {
    fn of(comm: &str) -> ThreadGroup {
        // The kernel keeps 15 bytes of a thread's name; tokio names its
        // workers `tokio-rt-worker` (`tokio-runtime-worker` before 1.44).
        if comm.starts_with("flood") {
            ThreadGroup::Client
        } else if comm.starts_with("guest-search") {
            ThreadGroup::GuestSearch
        } else if comm.starts_with("tokio-rt-worker") || comm.starts_with("tokio-runtime-w") {
            ThreadGroup::Server
        } else {
            ThreadGroup::Other
        }
    }
}

/// CPU seconds (user + system) of every live thread, by thread id.
#[derive(Debug, Clone, Default)]
pub(super) struct ThreadTimes {
    by_thread: BTreeMap<i32, (ThreadGroup, f64)>,
}

impl ThreadTimes {
    /// This process's threads now. A thread that cannot be read (it ended
    /// meanwhile) is left out, which only loses its time.
    pub(super) fn now() -> ThreadTimes {
        let mut by_thread = BTreeMap::new();
        let Ok(me) = procfs::process::Process::myself() else {
            return ThreadTimes::default();
        };
        let Ok(tasks) = me.tasks() else {
            return ThreadTimes::default();
        };
        let ticks = procfs::ticks_per_second() as f64;
        for task in tasks.flatten() {
            if let Ok(stat) = task.stat() {
                let seconds = (stat.utime + stat.stime) as f64 / ticks;
                by_thread.insert(task.tid, (ThreadGroup::of(&stat.comm), seconds));
            }
        }
        ThreadTimes { by_thread }
    }

    /// CPU seconds spent by each group between `earlier` and `self`; a
    /// thread started meanwhile counts from 0.
    pub(super) fn since(&self, earlier: &ThreadTimes) -> BTreeMap<ThreadGroup, f64> {
        let mut spent = BTreeMap::new();
        for (tid, (group, seconds)) in &self.by_thread {
            let before = earlier.by_thread.get(tid).map_or(0.0, |(_, s)| *s);
            *spent.entry(*group).or_insert(0.0) += (seconds - before).max(0.0);
        }
        spent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_grouped_by_their_runtime_names() {
        assert_eq!(ThreadGroup::of("flood"), ThreadGroup::Client);
        assert_eq!(ThreadGroup::of("guest-search"), ThreadGroup::GuestSearch);
        assert_eq!(ThreadGroup::of("tokio-rt-worker"), ThreadGroup::Server);
        assert_eq!(ThreadGroup::of("tokio-runtime-w"), ThreadGroup::Server);
        assert_eq!(ThreadGroup::of("vacancy"), ThreadGroup::Other);
    }

    #[test]
    fn a_busy_thread_shows_its_time_in_its_group() {
        let before = ThreadTimes::now();
        // The thread spins until the measure credits its group with 50 ms
        // (five 10 ms ticks), or gives up after 10 s of wall time: a measure
        // that lost the thread or put it in another group never gets there.
        let spinner = std::thread::Builder::new()
            .name("flood-test".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let mut x = 0_u64;
                while started.elapsed() < std::time::Duration::from_secs(10) {
                    for _ in 0..100_000 {
                        x = std::hint::black_box(x.wrapping_add(1));
                    }
                    let spent = ThreadTimes::now().since(&before);
                    if spent.get(&ThreadGroup::Client).copied().unwrap_or(0.0) >= 0.05 {
                        return true;
                    }
                }
                false
            })
            .expect("spawn");
        assert!(
            spinner.join().expect("join"),
            "50 ms of spinning never showed as client time"
        );
    }
}

//! A wait for the copy's applied position, without polling.
//!
//! `Freshness` publishes every new applied position here as well as in its
//! atomic; a reader that needs the copy to reach an owner position (a
//! confirmed read, `search::confirm`) sleeps on a `tokio::sync::watch`
//! until then. Kept apart from the rest of the model so it does not care
//! how the tables themselves are swapped or locked: all it needs is to be
//! told each applied position after the data of that position is visible.

use std::time::Duration;

use tokio::sync::watch;

use crate::lsn::Lsn;

/// The latest applied position, for waiters.
#[derive(Debug)]
pub struct AppliedWatch {
    tx: watch::Sender<Lsn>,
}

impl Default for AppliedWatch {
    fn default() -> Self {
        AppliedWatch {
            tx: watch::Sender::new(Lsn(0)),
        }
    }
}

impl AppliedWatch {
    /// Tells every waiter the copy now stands at `at`. Called after the
    /// data of `at` is visible to readers, so a waiter woken here finds it.
    /// May go backwards (a resnapshot); waiters compare, they do not count.
    pub fn publish(&self, at: Lsn) {
        // `send_replace` stores even with no receiver, and never blocks
        // apply for longer than the watch's own short lock.
        self.tx.send_replace(at);
    }

    /// Waits until the published position is at or past `target`, for at
    /// most `timeout`; the position reached, or `None` on timeout.
    pub async fn wait_for(&self, target: Lsn, timeout: Duration) -> Option<Lsn> {
        let mut rx = self.tx.subscribe();
        let reached = async {
            // The sender lives as long as `self`, so this never errs while
            // we borrow it; an error would only mean no more positions.
            rx.wait_for(|at| *at >= target).await.map(|at| *at).ok()
        };
        tokio::time::timeout(timeout, reached).await.ok().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_waiter_wakes_at_the_position_and_not_before() {
        let watch = std::sync::Arc::new(AppliedWatch::default());
        watch.publish(Lsn(10));
        assert_eq!(
            watch.wait_for(Lsn(10), Duration::ZERO).await,
            Some(Lsn(10)),
            "already there: no wait"
        );
        let waiter = {
            let watch = watch.clone();
            tokio::spawn(async move { watch.wait_for(Lsn(30), Duration::from_secs(10)).await })
        };
        tokio::task::yield_now().await;
        watch.publish(Lsn(20));
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "20 is short of 30");
        watch.publish(Lsn(35));
        assert_eq!(waiter.await.unwrap(), Some(Lsn(35)));
    }

    #[tokio::test]
    async fn a_position_never_reached_times_out() {
        let watch = AppliedWatch::default();
        watch.publish(Lsn(5));
        assert_eq!(
            watch.wait_for(Lsn(6), Duration::from_millis(50)).await,
            None
        );
    }
}

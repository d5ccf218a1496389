//! The heartbeat: a transactional logical message written to the owner at
//! an interval, so the copy's lag is measured from a recent commit even
//! while the owner is idle, and the slot's position moves on an idle owner.

use std::fmt::Display;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::metrics;
use crate::owner::{self, OwnerSettings};

/// How often a task that keeps failing says so again in the log.
const FAILURE_REPEAT: Duration = Duration::from_secs(60);

/// The failures of one background task that talks to the owner: counted
/// (`vacancy_owner_task_errors_total`), logged at warn on the first after a
/// success and at most once a minute while they go on, so an operator sees
/// why (permission denied, a refused connection) rather than only what it
/// causes (a replication session taken for dead on an idle owner, a frozen
/// lag).
pub(super) struct Failures {
    task: &'static str,
    warned_at: Option<Instant>,
}

impl Failures {
    pub(super) fn new(task: &'static str) -> Failures {
        Failures {
            task,
            warned_at: None,
        }
    }

    pub(super) fn failed(&mut self, error: &dyn Display) {
        metrics::OWNER_TASK_ERRORS
            .with_label_values(&[self.task])
            .inc();
        if self
            .warned_at
            .is_none_or(|at| at.elapsed() >= FAILURE_REPEAT)
        {
            tracing::warn!(task = self.task, %error, "a background task on the owner failed; it retries every round");
            self.warned_at = Some(Instant::now());
        }
    }

    pub(super) fn succeeded(&mut self) {
        if self.warned_at.take().is_some() {
            tracing::info!(
                task = self.task,
                "the background task on the owner works again"
            );
        }
    }
}

/// Writes a transactional logical message at an interval, so the copy's lag
/// is measured from a recent commit even while the owner is idle.
///
/// With `only_while` (a fleet projector's "holds the slot"), a beat is
/// written only while it is set: a standby's heartbeat would be decoded by
/// the active projector's walsender for nothing.
pub async fn run_heartbeat(
    owner: OwnerSettings,
    interval: Duration,
    only_while: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut client = None;
    let mut failures = Failures::new("heartbeat");
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        if only_while
            .as_ref()
            .is_some_and(|active| !active.load(std::sync::atomic::Ordering::Acquire))
        {
            continue;
        }
        if client.is_none() {
            match owner::connect_configured(&owner, owner.connect_timeout()).await {
                Ok(c) => client = Some(c),
                Err(error) => {
                    failures.failed(&error);
                    continue;
                }
            }
        }
        let Some(c) = &client else { continue };
        let beat = c.execute(
            "SELECT pg_logical_emit_message(true, 'vacancy.heartbeat', now()::text)",
            &[],
        );
        match tokio::time::timeout(owner.query_timeout(), beat).await {
            Ok(Ok(_)) => failures.succeeded(),
            Ok(Err(error)) => {
                failures.failed(&error);
                client = None;
            }
            Err(_) => {
                failures.failed(&format!("no answer within {:?}", owner.query_timeout()));
                client = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_counted_each_and_warned_once_a_minute() {
        let count = || {
            metrics::OWNER_TASK_ERRORS
                .with_label_values(&["test_task"])
                .get()
        };
        let before = count();
        let mut failures = Failures::new("test_task");
        failures.failed(&"permission denied for function pg_logical_emit_message");
        let first_warning = failures.warned_at;
        assert!(first_warning.is_some());
        failures.failed(&"permission denied for function pg_logical_emit_message");
        assert_eq!(
            failures.warned_at, first_warning,
            "not warned again within a minute"
        );
        assert_eq!(count(), before + 2);
        failures.succeeded();
        assert_eq!(failures.warned_at, None, "the next failure warns again");
    }
}

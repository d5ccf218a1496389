//! Waiting for a copy running in this process: every wait is bounded, and
//! when one runs out it says what it waited for and the stream's last
//! error, which is nearly always why.

use std::time::{Duration, Instant};

use vacancy_service::{App, Lsn, StreamStatus};

/// How often `wait_ready` looks: the benches that call it time the run
/// after the wait, not the wait itself.
const READY_POLL: Duration = Duration::from_millis(50);

#[derive(Debug, thiserror::Error)]
#[error("{what} did not happen within {limit:?} (stream's last error: {last_error})")]
pub struct NotReady {
    pub what: &'static str,
    pub limit: Duration,
    pub last_error: String,
}

/// Polls `done` every `poll` until it holds, for at most `limit`.
pub async fn wait_until(
    what: &'static str,
    limit: Duration,
    poll: Duration,
    status: &StreamStatus,
    mut done: impl FnMut() -> bool,
) -> Result<(), NotReady> {
    let started = Instant::now();
    while !done() {
        if started.elapsed() > limit {
            return Err(NotReady {
                what,
                limit,
                last_error: status.last_error().unwrap_or_else(|| "none".to_string()),
            });
        }
        tokio::time::sleep(poll).await;
    }
    Ok(())
}

/// Waits until `app`'s copy is loaded and both the copy and its hotel
/// index have applied the owner's WAL up to `target`: from then on a search
/// sees everything committed before `target`.
pub async fn wait_ready(app: &App, target: Lsn, limit: Duration) -> Result<(), NotReady> {
    let freshness = &app.model.freshness;
    wait_until(
        "the copy and the index to load",
        limit,
        READY_POLL,
        &app.status,
        || {
            freshness.is_loaded()
                && freshness.applied() >= target
                && app.hotel_index.synced_lsn() >= target
        },
    )
    .await
}

//! The heartbeat: a transactional logical message written to the owner at
//! an interval, so the copy's lag is measured from a recent commit even
//! while the owner is idle, and the slot's position moves on an idle owner.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::owner::{self, OwnerSettings};

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
            client = owner::connect_configured(&owner, owner.connect_timeout())
                .await
                .ok();
        }
        let Some(c) = &client else { continue };
        let beat = c.execute(
            "SELECT pg_logical_emit_message(true, 'vacancy.heartbeat', now()::text)",
            &[],
        );
        match tokio::time::timeout(owner.query_timeout(), beat).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                tracing::debug!(%error, "heartbeat failed");
                client = None;
            }
            Err(_) => client = None,
        }
    }
}

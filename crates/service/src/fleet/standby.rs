//! The projector role with failover: any number of processes run as
//! projector with the same slot; the one whose walsender holds the slot is
//! active, the others stand by.
//!
//! PostgreSQL lets one walsender use a slot at a time, which makes the slot
//! the lock: no other coordination is needed to decide who is active. A
//! standby follows the change stream like a replica, so its copy is warm,
//! and looks at the slot at most every second. When the slot is free it
//! applies the rest of the stream, then starts the projector on its copy:
//! the projector resumes from the slot's confirmed position (the last LSN
//! the old projector had stored in JetStream, never further), re-applies
//! nothing its copy holds, and its publisher drops what the stream already
//! has. A projector that loses the slot goes back to standing by.
//!
//! Fencing is the publisher's (`publish`): each projector's first message
//! is a takeover marker, every publish names the message before it, and a
//! publisher that finds another's marker after its own stops its process.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::replica::Replica;
use crate::model::ReadModel;
use crate::owner::{self, OwnerSettings};
use crate::stream::Projector;
use crate::stream::checkpoints::Checkpoints;
use crate::stream::outbox::OutboxState;
use crate::stream::refresh::Refresh;
use crate::stream::replicate::RunEnd;
use crate::stream::slot;

/// How often a standby looks at the slot.
const SLOT_CHECK: Duration = Duration::from_secs(1);

pub struct Standby {
    /// Built with an outbox and `yield_when_slot_busy`.
    pub projector: Projector,
    /// Follows the stream while standing by (same copy as the projector).
    pub follower: Replica,
    pub owner: OwnerSettings,
    pub slot: String,
    pub model: Arc<ReadModel>,
    pub refresh: Arc<Refresh>,
    pub checkpoints: Arc<Checkpoints>,
    /// Set while this process runs the projector (`/v1/status`).
    pub active: Arc<std::sync::atomic::AtomicBool>,
    /// The publisher's state: told of each activation.
    pub outbox: Arc<OutboxState>,
}

impl Standby {
    pub async fn run(self, shutdown: CancellationToken) {
        loop {
            self.refresh.set_paused(true);
            let handover = CancellationToken::new();
            tokio::join!(
                self.follower.follow(&handover, &shutdown),
                self.until_slot_free(&handover, &shutdown),
            );
            if shutdown.is_cancelled() {
                return;
            }
            if self.model.freshness.is_loaded() {
                // The follower's copy: TTLs start afresh (spread), and a
                // checkpoint of it is written soon, so the slot can be
                // acknowledged (with checkpoints on it waits for one).
                self.refresh.reset(&self.model.read());
                self.checkpoints.copy_replaced();
            }
            self.refresh.set_paused(false);
            self.outbox.activated(self.model.read().epoch);
            tracing::info!(slot = %self.slot, "the slot is free; this projector takes over");
            self.active
                .store(true, std::sync::atomic::Ordering::Release);
            let ended = self.projector.run_until(&shutdown).await;
            self.active
                .store(false, std::sync::atomic::Ordering::Release);
            match ended {
                RunEnd::Shutdown | RunEnd::OutboxClosed => return,
                RunEnd::SlotBusy => {
                    // Like a replica, a standby has no session to say which
                    // owner is current (`OwnerPin::release`).
                    self.owner.pin.release();
                    tracing::info!(slot = %self.slot, "another projector holds the slot; standing by");
                }
            }
        }
    }

    /// Cancels `handover` once no walsender holds the slot (or there is no
    /// slot yet: the first projector of a fleet creates it).
    async fn until_slot_free(&self, handover: &CancellationToken, shutdown: &CancellationToken) {
        let mut ticker = tokio::time::interval(SLOT_CHECK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            if self.slot_free().await == Some(true) {
                handover.cancel();
                return;
            }
        }
    }

    /// Whether the slot is free: no walsender streams from it and no
    /// session holds its lock (one that created it and loads the snapshot,
    /// `slot::try_lock_slot`); `None` when the owner cannot be asked.
    async fn slot_free(&self) -> Option<bool> {
        let client = owner::connect_configured(&self.owner, self.owner.connect_timeout())
            .await
            .ok()?;
        let asked = async {
            let row = client
                .query_opt(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot],
                )
                .await
                .ok()?;
            if row.is_some_and(|r| r.get::<_, bool>(0)) {
                return Some(false);
            }
            if !slot::try_lock_slot(&client, &self.slot).await.ok()? {
                return Some(false);
            }
            slot::unlock_slot(&client, &self.slot).await.ok()?;
            Some(true)
        };
        tokio::time::timeout(self.owner.query_timeout(), asked)
            .await
            .ok()
            .flatten()
    }
}

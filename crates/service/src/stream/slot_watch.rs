//! The slot watch: reads the slot's state and the owner's WAL position at an
//! interval, for `/v1/status`, the retained-WAL metric and the lag (the
//! owner's flushed position is what the copy's lag is measured against).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::heartbeat::Failures;
use super::{StreamSettings, StreamStatus, slot};
use crate::metrics;
use crate::model::ReadModel;
use crate::owner::{self, OwnerSettings};

/// Reads the slot's state and the owner's WAL position at an interval.
pub async fn run_slot_watch(
    owner: OwnerSettings,
    stream: StreamSettings,
    model: Arc<ReadModel>,
    status: Arc<StreamStatus>,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(Duration::from_millis(stream.slot_watch_interval_ms));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut client = None;
    let mut failures = Failures::new("slot_watch");
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
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
        let read = async {
            let info = slot::slot_info(c, &stream.slot).await?;
            let wal = slot::wal_positions(c).await?;
            Ok::<_, slot::SlotError>((info, wal))
        };
        match tokio::time::timeout(owner.query_timeout(), read).await {
            Ok(Ok((info, wal))) => {
                // The lag is measured against what the owner has flushed,
                // not where it inserts: WAL past the flush is of no commit
                // anyone can see yet (a commit shows once its record is
                // flushed), and the walsender cannot send it. While the
                // owner's flush stalls (a slow fsync) the insert position
                // runs ahead, and the lag counted the stall as the copy's.
                model.freshness.note_server_wal_end(wal.flushed);
                status.note_owner_wal(wal.inserted);
                metrics::SLOT_ACTIVE.set(i64::from(info.as_ref().is_some_and(|i| i.active)));
                metrics::SLOT_RETAINED_WAL
                    .set(info.as_ref().and_then(|i| i.retained_bytes).unwrap_or(0));
                status.set_slot(info);
                failures.succeeded();
            }
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

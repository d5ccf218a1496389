//! Checkpoints in the JetStream object store: the projector uploads each
//! durable checkpoint; a replica downloads the newest to bootstrap.
//!
//! The file is the checkpoint module's format, unchanged: a replica checks
//! and loads it exactly as a restarting projector loads its own. What the
//! object adds is in its name, `checkpoint-<epoch>-<lsn>-<sequence>.vcp`:
//! the copy's epoch and LSN, and the change stream's sequence to resume
//! after (every message at or below it is in the copy), then the identity
//! of the stream that sequence is of (`-<stream>`, when it was made): a
//! stream deleted and made again starts its sequences over, and an old
//! stream's checkpoint resumed in the new one would skip every change in
//! between. Fixed-width hex and decimal, so names sort like (epoch, LSN,
//! sequence). The name carries them rather than object metadata, which
//! Debian's nats-server 2.9 era clients do not all keep. Names without the
//! stream (before 2026-12-07) still read, as of an unknown stream.

use std::path::Path;
use std::pin::Pin;
use std::time::Duration;

use async_nats::jetstream::object_store::{Object, ObjectMetadata};
use futures_util::StreamExt;
use tokio_io_timeout::TimeoutReader;
use tokio_util::sync::CancellationToken;

use super::FleetError;
use super::log::ChangeLog;
use crate::lsn::Lsn;
use crate::metrics;
use crate::stream::checkpoints::{Checkpoints, Durable};

/// A checkpoint in the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stored {
    pub epoch: u64,
    pub lsn: Lsn,
    pub sequence: u64,
    /// The change stream `sequence` is of (`log::StreamEnds::made_at_ns`);
    /// `None` in a name written before it was recorded.
    pub stream: Option<u64>,
}

impl Stored {
    pub fn object_name(&self) -> String {
        let stream = self.stream.map_or(String::new(), |s| format!("-{s:016x}"));
        format!(
            "checkpoint-{:016x}-{:016x}-{:020}{stream}.vcp",
            self.epoch, self.lsn.0, self.sequence
        )
    }

    pub fn parse(name: &str) -> Option<Stored> {
        let rest = name.strip_prefix("checkpoint-")?.strip_suffix(".vcp")?;
        let mut parts = rest.split('-');
        let (epoch, lsn, sequence) = (parts.next()?, parts.next()?, parts.next()?);
        let stream = parts.next();
        if parts.next().is_some()
            || epoch.len() != 16
            || lsn.len() != 16
            || sequence.len() != 20
            || stream.is_some_and(|s| s.len() != 16)
        {
            return None;
        }
        Some(Stored {
            epoch: u64::from_str_radix(epoch, 16).ok()?,
            lsn: Lsn(u64::from_str_radix(lsn, 16).ok()?),
            sequence: sequence.parse().ok()?,
            stream: match stream {
                Some(s) => Some(u64::from_str_radix(s, 16).ok()?),
                None => None,
            },
        })
    }
}

/// A transfer of `bytes` may take this long: a minute, plus a second per
/// 10 MiB (a 73M-row checkpoint is about 0.55 GiB).
fn transfer_timeout(bytes: u64) -> Duration {
    Duration::from_secs(60 + bytes / (10 << 20))
}

/// Uploads `file` as `stored`, then deletes all but the newest `kept`.
pub async fn upload(log: &ChangeLog, file: &Path, stored: Stored) -> Result<u64, FleetError> {
    let store = log.checkpoints().await?;
    let mut reader = tokio::fs::File::open(file)
        .await
        .map_err(|e| FleetError::Nats(format!("cannot open {}: {e}", file.display())))?;
    let bytes = reader.metadata().await.map(|m| m.len()).unwrap_or(0);
    let meta = ObjectMetadata {
        name: stored.object_name(),
        description: Some(format!(
            "vacancy checkpoint: epoch {:x}, lsn {}, stream sequence {}",
            stored.epoch, stored.lsn, stored.sequence
        )),
        // As large as a message may be: a replica's download is then a
        // seventh as many messages as at the client's 128 KiB default.
        chunk_size: Some(log.settings.max_chunk_bytes),
        ..Default::default()
    };
    tokio::time::timeout(transfer_timeout(bytes), store.put(meta, &mut reader))
        .await
        .map_err(|_| FleetError::Nats(format!("uploading {} timed out", stored.object_name())))?
        .map_err(|e| FleetError::Nats(format!("uploading {}: {e}", stored.object_name())))?;
    let all = list(log).await?;
    let kept = log.settings.checkpoints_kept as usize;
    for old in all.iter().rev().skip(kept) {
        if let Err(error) = log.bounded(store.delete(old.object_name())).await? {
            tracing::warn!(%error, name = old.object_name(), "could not delete an old checkpoint");
        }
    }
    Ok(bytes)
}

/// The checkpoints in the bucket, oldest first.
pub async fn list(log: &ChangeLog) -> Result<Vec<Stored>, FleetError> {
    let store = log.checkpoints().await?;
    let mut objects = log
        .bounded(store.list())
        .await?
        .map_err(|e| FleetError::Nats(format!("listing checkpoints: {e}")))?;
    let mut found = Vec::new();
    loop {
        let next = log.bounded(objects.next()).await?;
        let Some(info) = next else { break };
        let info = info.map_err(|e| FleetError::Nats(format!("listing checkpoints: {e}")))?;
        if info.deleted {
            continue;
        }
        if let Some(stored) = Stored::parse(&info.name) {
            found.push(stored);
        }
    }
    found.sort();
    Ok(found)
}

/// A checkpoint being downloaded, read as it arrives: `reader` yields its
/// `bytes` bytes and fails if nothing arrives for `stall`, so a blocking
/// reader (`SyncIoBridge`) never waits without a bound.
pub struct Download {
    pub reader: Pin<Box<TimeoutReader<Object>>>,
    pub bytes: u64,
    /// The bound on the whole transfer, for the caller's timeout.
    pub deadline: Duration,
}

/// Opens `stored` for reading. The object store checks the SHA-256 of
/// what it sent at its end, and the checkpoint's own trailer is checked by
/// the loader.
pub async fn open(log: &ChangeLog, stored: Stored) -> Result<Download, FleetError> {
    let store = log.checkpoints().await?;
    let object_name = stored.object_name();
    let object = log
        .bounded(store.get(&object_name))
        .await?
        .map_err(|e| FleetError::Nats(format!("downloading {object_name}: {e}")))?;
    let bytes = object.info().size as u64;
    let mut reader = TimeoutReader::new(object);
    reader.set_timeout(Some(log.settings.request_timeout()));
    Ok(Download {
        reader: Box::pin(reader),
        bytes,
        deadline: transfer_timeout(bytes),
    })
}

/// The projector's uploader: every checkpoint made durable locally (with
/// the outbox's sequence, `Checkpoints::record_outbox`) is uploaded, the
/// newest first when several wait.
///
/// It runs until `projector_done`, not until shutdown begins: the
/// projector writes a last checkpoint once apply has stopped, and that one
/// is uploaded too (one try, within the transfer timeout and the process's
/// shutdown grace), so replicas and a standby start from the newest copy.
pub async fn run_uploader(
    settings: super::FleetSettings,
    checkpoints: std::sync::Arc<Checkpoints>,
    projector_done: CancellationToken,
) {
    let mut durable = checkpoints.durable_checkpoints();
    let mut log: Option<ChangeLog> = None;
    let mut uploaded: Option<(u64, Lsn, u64)> = None;
    loop {
        let finishing = tokio::select! {
            biased;
            _ = projector_done.cancelled() => true,
            changed = durable.changed() => {
                if changed.is_err() {
                    return;
                }
                false
            }
        };
        let waiting = durable
            .borrow_and_update()
            .clone()
            .filter(|d| Some((d.epoch, d.lsn, d.sequence)) != uploaded);
        if let Some(newest) = waiting {
            // Retried (with backoff) until it is uploaded, a newer one
            // waits, or the projector has stopped (then once more).
            let mut backoff = Duration::from_millis(200);
            loop {
                match upload_one(&settings, &mut log, &newest).await {
                    Ok(None) => {
                        metrics::FLEET_CHECKPOINT_UPLOADS
                            .with_label_values(&["skipped"])
                            .inc();
                        tracing::warn!(epoch = newest.epoch, lsn = %newest.lsn, sequence = newest.sequence, "checkpoint not uploaded: its sequence is of a change stream that is not there now (made again since, or not read yet)");
                        uploaded = Some((newest.epoch, newest.lsn, newest.sequence));
                        break;
                    }
                    Ok(Some(bytes)) => {
                        metrics::FLEET_CHECKPOINT_UPLOADS
                            .with_label_values(&["ok"])
                            .inc();
                        tracing::info!(epoch = newest.epoch, lsn = %newest.lsn, sequence = newest.sequence, bytes, finishing, "checkpoint uploaded for the fleet");
                        uploaded = Some((newest.epoch, newest.lsn, newest.sequence));
                        break;
                    }
                    Err(error) => {
                        metrics::FLEET_CHECKPOINT_UPLOADS
                            .with_label_values(&["error"])
                            .inc();
                        tracing::warn!(%error, finishing, "checkpoint upload failed");
                        log = None;
                    }
                }
                if finishing {
                    break;
                }
                tokio::select! {
                    biased;
                    _ = projector_done.cancelled() => break,
                    _ = durable.changed() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
        if finishing {
            return;
        }
    }
}

/// Uploads `durable`; `Ok(None)` when it names a sequence of a stream that
/// is not there now (made again since): a replica could only be misled by
/// it, and the next checkpoint will name the stream there is. One taken
/// before the publisher first read the stream (nothing stored yet, stream
/// 0) goes up unnamed, told by the stream's end alone as before: skipped,
/// a fleet's first checkpoint after its snapshot could wait a whole
/// `checkpoint.interval_secs`, and replicas with it.
async fn upload_one(
    settings: &super::FleetSettings,
    log: &mut Option<ChangeLog>,
    durable: &Durable,
) -> Result<Option<u64>, FleetError> {
    if log.is_none() {
        *log = Some(ChangeLog::connect(settings).await?);
    }
    let Some(connected) = log.as_ref() else {
        return Err(FleetError::Nats("not connected".into()));
    };
    let now = connected.ends().await?;
    if durable.stream != 0 && durable.stream != now.made_at_ns {
        return Ok(None);
    }
    upload(
        connected,
        &durable.path,
        Stored {
            epoch: durable.epoch,
            lsn: durable.lsn,
            sequence: durable.sequence,
            stream: (durable.stream != 0).then_some(durable.stream),
        },
    )
    .await
    .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sort_like_their_fields() {
        // Named before the stream was recorded.
        let a = Stored {
            epoch: 0x16b3748,
            lsn: Lsn(0x2_0000_0010),
            sequence: 42,
            stream: None,
        };
        let b = Stored {
            epoch: 0x16b3748,
            lsn: Lsn(0x10_0000_0000),
            sequence: 7,
            stream: Some(0x1877_0000_0000_0001),
        };
        assert_eq!(Stored::parse(&a.object_name()), Some(a));
        assert_eq!(Stored::parse(&b.object_name()), Some(b));
        assert!(b.object_name().ends_with("-1877000000000001.vcp"));
        assert!(a.object_name() < b.object_name());
        assert!(a < b);
        for bad in [
            "checkpoint-1-2-3.vcp",
            "other.vcp",
            "checkpoint-.vcp",
            "checkpoint-00000000016b3748-0000000200000010-00000000000000000042-12.vcp",
            "checkpoint-00000000016b3748-0000000200000010-00000000000000000042-1877000000000001-0000000000000001.vcp",
        ] {
            assert_eq!(Stored::parse(bad), None, "{bad}");
        }
    }
}

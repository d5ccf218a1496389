//! The checkpoint directory: which files are checkpoints, in what order,
//! and which may go.
//!
//! One process writes a directory at a time (one `vacancy serve` per
//! volume); its writes and prunes are not meant to race another's.

use std::path::{Path, PathBuf};

use super::name::CheckpointName;
use super::{CheckpointError, io_error};

/// Temporary files of a write in progress: a name no checkpoint has, so a
/// write a crash cut short is never read; the next prune removes it.
pub const TEMP_PREFIX: &str = ".checkpoint-tmp-";

/// The directory's checkpoints, newest first (timeline, then LSN). Files
/// whose name is not a checkpoint's are not listed.
pub fn list(dir: &Path) -> Result<Vec<(CheckpointName, PathBuf)>, CheckpointError> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let entry = entry.map_err(io_error(dir))?;
        let file_name = entry.file_name();
        let Some(name) = file_name.to_str().and_then(CheckpointName::parse) else {
            continue;
        };
        found.push((name, entry.path()));
    }
    found.sort_unstable_by_key(|(name, _)| std::cmp::Reverse(*name));
    Ok(found)
}

/// Deletes the checkpoints ordered before `kept`, and leftover temporary
/// files, then fsyncs the directory. Call it only once `kept` is durable
/// (renamed in and the directory synced): until then the older ones are
/// what a restart would use. Returns what it deleted.
pub fn prune(dir: &Path, kept: CheckpointName) -> Result<Vec<PathBuf>, CheckpointError> {
    let mut deleted = Vec::new();
    for (name, path) in list(dir)? {
        if name < kept {
            std::fs::remove_file(&path).map_err(io_error(&path))?;
            deleted.push(path);
        }
    }
    deleted.extend(remove_temporaries(dir)?);
    if !deleted.is_empty() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_error(dir))?;
    }
    Ok(deleted)
}

/// Deletes the temporary files writes left (a process killed mid-write
/// leaves its whole partial file): called by the one writer before it
/// writes, not only after a write succeeds, since on a volume sized for
/// two copies such a leftover makes every later write fail for want of
/// space, and with them the slot's acknowledgements.
pub fn remove_temporaries(dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let mut deleted = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let entry = entry.map_err(io_error(dir))?;
        let is_temp = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(TEMP_PREFIX));
        if is_temp {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(io_error(&path))?;
            deleted.push(path);
        }
    }
    Ok(deleted)
}

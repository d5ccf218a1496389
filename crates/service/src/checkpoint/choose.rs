//! Choosing the checkpoint a start loads: the newest, by (timeline, LSN),
//! that loads whole against the owner it is for.
//!
//! A newer checkpoint that does not load (corrupt, truncated, another
//! version or owner) is skipped, with its error, and the next older one is
//! tried: each is checked on its own, so an older one is used only if it
//! is as sound as the newest would have been. Nothing is deleted here: a
//! skipped file stays for an operator to look at, until a newer checkpoint
//! is durable and the writer prunes it.

use std::path::{Path, PathBuf};

use super::CheckpointError;
use super::dir::list;
use super::format::Identity;
use super::name::CheckpointName;
use super::read::{Loaded, load};

/// A checkpoint passed over, and why.
#[derive(Debug)]
pub struct Skipped {
    pub path: PathBuf,
    pub name: CheckpointName,
    pub error: CheckpointError,
}

/// What a directory offers a start.
#[derive(Debug)]
pub struct Choice {
    /// The newest checkpoint that loaded, if any.
    pub chosen: Option<(PathBuf, Loaded)>,
    /// Newer ones that did not, newest first.
    pub skipped: Vec<Skipped>,
}

/// Loads the newest checkpoint in `dir` that verifies against `expected`.
/// An error only when the directory cannot be listed; a directory with no
/// usable checkpoint is `chosen: None`, with the reasons in `skipped`.
pub fn choose(dir: &Path, expected: &Identity) -> Result<Choice, CheckpointError> {
    let mut skipped = Vec::new();
    for (name, path) in list(dir)? {
        match load(&path, expected) {
            Ok(loaded) => {
                return Ok(Choice {
                    chosen: Some((path, loaded)),
                    skipped,
                });
            }
            Err(error) => skipped.push(Skipped { path, name, error }),
        }
    }
    Ok(Choice {
        chosen: None,
        skipped,
    })
}

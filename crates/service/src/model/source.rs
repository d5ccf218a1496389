//! Whose numbers a room type shows: the copy's, or the owner's read while
//! answering. Search sets it, quotes sign it and the stale-read loop counts
//! by it, so it lives with the model they all read.

use serde::Serialize;

/// Whose numbers a room type shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// The copy, as of the answer's LSN.
    Copy,
    /// Read from the owner while answering (few units left, or min_lsn).
    Owner,
    /// The owner should have been read but did not answer in time.
    CopyFallback,
}

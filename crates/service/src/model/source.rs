//! Whose numbers a room type shows: the copy's, the copy's once confirmed
//! against the owner's WAL position, or the owner's read while answering. Search sets it, quotes sign it and the stale-read loop counts
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
    /// The copy, read again once it had applied an owner WAL position taken
    /// after the search began (the answer's `confirmed_lsn`): everything
    /// committed on the owner before the search began is in these numbers.
    Confirmed,
}

impl Source {
    /// Every source, for a label or a code read back.
    pub const ALL: [Source; 4] = [
        Source::Copy,
        Source::Owner,
        Source::CopyFallback,
        Source::Confirmed,
    ];

    /// The label metrics and the take-outcome ledger use.
    pub fn label(self) -> &'static str {
        match self {
            Source::Copy => "copy",
            Source::Owner => "owner",
            Source::CopyFallback => "copy_fallback",
            Source::Confirmed => "confirmed",
        }
    }

    /// Numbers the copy showed without confirming them against the owner:
    /// the only ones a conflict can blame on the copy.
    pub fn unconfirmed_copy(self) -> bool {
        matches!(self, Source::Copy | Source::CopyFallback)
    }
}

//! Checkpoints: the whole copy at one LSN, in one file, so a restart can
//! load it from local disk instead of copying the owner's tables again.
//!
//! Why: every start otherwise drops the slot and runs a full snapshot, a
//! COPY of the owner's largest table (36 s at 73M rows, on the database
//! that takes the bookings, once per node of a rolling deploy). A
//! checkpoint is what the copy held at `Tables::applied`, plus what the
//! apply step, the safety net and the stale-read loop need to carry on (the
//! applied-xid ring; each calendar's TTL time left; the stale-read window's
//! buckets, the attempt ids it counted and its totals, as [`StaleCarry`]),
//! with the wall clock the times were measured at, tied to the owner,
//! slot, publication and columns it was made from (issue 21).
//!
//! In the order of a checkpoint's life:
//! - [`name`]: `checkpoint-<timeline>-<lsn>.vcp`, names that sort like the
//!   (timeline, LSN) they carry.
//! - [`carry`]: the stale-read loop's state as plain data (ages and times
//!   left, not instants), so the loop depends on this module and not the
//!   other way round.
//! - [`format`]: the bytes: magic and version, framed postcard records, a
//!   trailer with the length and a crc32c of everything before it.
//! - [`write`]: streams one copy (`ReadModel::read()`, immutable while held,
//!   so apply never stops) to a temporary file in the directory, fsyncs it,
//!   renames it into place and fsyncs the directory; then deletes the older
//!   ones.
//! - [`read`]: checks the length, the version and the header against the
//!   owner, then rebuilds the `Tables`, the xid ring, the TTLs' time left
//!   and the stale-read state in one pass while summing the checksum, which
//!   is compared before anything is returned: all or nothing.
//! - [`dir`]: lists a directory's checkpoints, newest first, and prunes.
//! - [`choose`]: the newest checkpoint that verifies, with why each newer
//!   one was skipped.
//! - [`settings`]: `[checkpoint]`, the directory (empty: off) and interval.
//!
//! Why postcard and crc32c: postcard is maintained, serde-based (the
//! records are plain derives, no schema compiler, no `unsafe` in our code),
//! and its varints make a typical night 8 bytes (a unit test holds it
//! there) instead of a fixed 20: about 600 MB at 73M nights, by that
//! arithmetic, not yet measured at that size; it encodes one value into a reused buffer, which is
//! what streaming one record at a time needs. `rkyv` reads in place without
//! decoding, but the model is rebuilt into its own paged layout anyway, and
//! its archived form wants the whole value at once. `bincode` is
//! unmaintained (RUSTSEC-2025-0141). crc32c runs on the CPU's CRC
//! instruction (SSE4.2, ARMv8) at several GB/s, so checking a whole file
//! before trusting it costs a fraction of reading it; it detects every
//! burst error up to 32 bits, which a torn or flipped write is.
//!
//! Memory: the writer holds one `BufWriter` of `write::BUFFER` (1 MiB) and
//! one record's encoding (the largest is a frame of attempt ids, at most
//! 4,096 of 244 bytes, 1 MiB; then the xid ring, at most 320 KiB at its
//! 65,536 entries, a window frame, at most 205 KB, or one calendar: about
//! 9 bytes a night, 6.4 KiB for two years), and at most 4,096 TTL entries
//! (96 KiB) filtered before a frame, so its peak is about 2.2 MiB whatever
//! the copy's size. The TTL list and the `StaleCarry` it is given are the
//! caller's: 24 bytes a calendar; for the stale-read state, its buckets
//! (at most `stale.window_buckets` × `stale.max_hotels` hotel entries of
//! 40 bytes, 12 MB at the defaults' 60 × 5,000) and its attempt ids (at
//! most `stale.attempt_capacity`, each its id plus 72 bytes: 22 MB at
//! the default 200,000 ids of 36 bytes, 54 MB if every id took the 200
//! bytes allowed). In the file the same state is smaller: a hotel
//! entry is at most 50 bytes, and 6 for an id below 8,192 with counts
//! below 128 (varints; a unit test holds it there); an attempt id at most
//! 244 bytes, 73 for a 36-byte id (a UUID) with a day left; so at the
//! defaults at most 15 MB of window and 49 MB of ids, typically 2 MB and
//! 15 MB. What
//! it costs besides is indirect: the copy it holds keeps every page that
//! apply replaces during the write alive until it ends. The reader holds
//! the `Tables` it builds (the size of the copy itself), the stale-read
//! state (as above), one hotel's calendars before they are laid out, and
//! one frame of at most `format::MAX_FRAME` (4 MiB), a bound checked
//! before it is allocated.
//!
//! Architecture invariant: a checkpoint is read only whole. Nothing from a
//! file is returned before its length, checksum, version and header have
//! been checked, and the load checks the checksum again over exactly the
//! bytes it decoded; a torn, truncated or flipped file is an error, never a
//! panic and never a partial copy.

mod carry;
mod choose;
mod dir;
mod format;
mod name;
mod read;
mod settings;
mod write;

#[cfg(test)]
mod tests;

use std::fmt;
use std::io;
use std::path::PathBuf;

pub use carry::{CountedAttempt, OutcomeTotals, StaleCarry, WindowBucket, WindowCounts};
pub use choose::{Choice, Skipped, choose};
pub use dir::{list, prune};
pub use format::{FORMAT_VERSION, Header, Identity};
pub use name::CheckpointName;
pub use read::{Loaded, load, load_from, verify};
pub use settings::CheckpointSettings;
pub use write::{Written, write, write_model};

/// A header field a checkpoint must share with the owner it is used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderField {
    SystemIdentifier,
    Timeline,
    Slot,
    Publication,
    ColumnsFingerprint,
}

impl fmt::Display for HeaderField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HeaderField::SystemIdentifier => "system identifier",
            HeaderField::Timeline => "timeline",
            HeaderField::Slot => "slot",
            HeaderField::Publication => "publication",
            HeaderField::ColumnsFingerprint => "published columns' fingerprint",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    /// Shorter than its trailer says, or without one: a write that did
    /// not finish.
    #[error("checkpoint {} is truncated: {reason}", path.display())]
    Truncated { path: PathBuf, reason: String },
    #[error(
        "checkpoint {} is corrupt: crc32c {computed:08x}, the file says {stored:08x}",
        path.display()
    )]
    Checksum {
        path: PathBuf,
        stored: u32,
        computed: u32,
    },
    #[error("{} is not a checkpoint file (no magic bytes)", path.display())]
    NotACheckpoint { path: PathBuf },
    #[error(
        "checkpoint {} has format version {found}; this build reads {FORMAT_VERSION}",
        path.display()
    )]
    Version { path: PathBuf, found: u32 },
    #[error(
        "checkpoint {} was made for another {field}: it has {found}, the owner has {expected}",
        path.display()
    )]
    Mismatch {
        path: PathBuf,
        field: HeaderField,
        found: String,
        expected: String,
    },
    /// The checksum matched but the contents break the format's rules: a
    /// bug in the writer, or a collision of the checksum.
    #[error("checkpoint {} is malformed: {reason}", path.display())]
    Malformed { path: PathBuf, reason: String },
    /// The name's (timeline, LSN) is not the header's: a file renamed by hand.
    #[error("checkpoint {} holds {found}", path.display())]
    Misnamed {
        path: PathBuf,
        found: CheckpointName,
    },
    /// The copy cannot be written as a checkpoint.
    #[error("the copy cannot be checkpointed: {0}")]
    Unwritable(String),
}

impl CheckpointError {
    /// A short, stable reason, for a log field and a metric label
    /// (`vacancy_checkpoint_fallbacks_total{reason}`, to come).
    pub fn reason(&self) -> &'static str {
        match self {
            CheckpointError::Io { .. } => "io",
            CheckpointError::Truncated { .. } => "truncated",
            CheckpointError::Checksum { .. }
            | CheckpointError::NotACheckpoint { .. }
            | CheckpointError::Malformed { .. }
            | CheckpointError::Misnamed { .. } => "corrupt",
            CheckpointError::Version { .. } => "format_version",
            CheckpointError::Mismatch { field, .. } => match field {
                HeaderField::SystemIdentifier | HeaderField::Timeline => "other_owner",
                HeaderField::Slot | HeaderField::Publication => "other_slot",
                HeaderField::ColumnsFingerprint => "columns_changed",
            },
            CheckpointError::Unwritable(_) => "unwritable",
        }
    }
}

fn io_error(path: &std::path::Path) -> impl FnOnce(io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

//! Writing a checkpoint: one copy streamed to a temporary file, made
//! durable, then renamed into place.
//!
//! The copy (`Arc<Tables>`) never changes while it is held, so the write
//! takes seconds without stopping apply. Records are encoded one at a time
//! into a reused buffer and go through a fixed `BufWriter`; nothing the
//! size of the copy is ever built. The order that makes it atomic: write,
//! fsync the file, rename it to its final name, fsync the directory (the
//! rename itself is then durable). A crash at any point leaves either the
//! old set of checkpoints and a temporary file (never read: its name is not
//! a checkpoint's), or the new checkpoint complete. Older checkpoints are
//! deleted only after that last fsync.
//!
//! Blocking: call it from `spawn_blocking` or a thread of its own.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use std::time::Duration;

use chrono::Utc;
use serde::Serialize;

use super::dir::{TEMP_PREFIX, prune};
use super::format::{
    CalendarOut, END, EndRecord, FORMAT_VERSION, Header, HotelRecord, Identity, MAGIC,
    MAX_SPAN_DAYS, RoomTypeRecord, Summing, TTL_PER_FRAME, Tag, TtlOut, XidsOut, write_frame,
};
use super::name::CheckpointName;
use super::{CheckpointError, io_error};
use crate::model::xids::RingContents;
use crate::model::{CalendarKey, ReadModel, Tables};

/// The write buffer: large enough that the disk sees big sequential
/// writes, small beside the copy.
pub const BUFFER: usize = 1 << 20;

/// A checkpoint made durable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub path: PathBuf,
    pub name: CheckpointName,
    pub bytes: u64,
    pub nights: u64,
    /// Older checkpoints deleted after this one was durable.
    pub pruned: Vec<PathBuf>,
}

/// Checkpoints the model's published copy: takes the copy, then the xid
/// ring. In that order: an xid is recorded before its transaction shows,
/// so the ring taken after the copy holds every transaction in it (and
/// perhaps a few later ones, which a restart simply records again).
/// `ttl` is the safety net's time left per calendar
/// (`stream::refresh::Refresh::remaining`), passed in so this module does
/// not depend on the stream that will call it.
pub fn write_model(
    dir: &Path,
    identity: &Identity,
    model: &ReadModel,
    ttl: &[(CalendarKey, Duration)],
) -> Result<Written, CheckpointError> {
    let tables = model.read();
    let xids = model.xids.contents();
    write(dir, identity, &tables, &xids, ttl)
}

/// Writes `tables`, `xids` and the TTLs' time left (`ttl`, one entry per
/// calendar, in key order, as `Refresh::remaining` gives it) as
/// `dir/checkpoint-<timeline>-<lsn>.vcp`, atomically, then deletes the
/// checkpoints ordered before it.
pub fn write(
    dir: &Path,
    identity: &Identity,
    tables: &Tables,
    xids: &RingContents,
    ttl: &[(CalendarKey, Duration)],
) -> Result<Written, CheckpointError> {
    let name = CheckpointName {
        timeline: identity.timeline,
        lsn: tables.applied,
    };
    let path = dir.join(name.to_string());
    // In the same directory, so the rename never crosses a file system;
    // removed on any error before the rename (tempfile's drop).
    let temp = tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .tempfile_in(dir)
        .map_err(io_error(dir))?;
    let temp_path = temp.path().to_path_buf();
    let header = Header {
        identity: identity.clone(),
        lsn: tables.applied.0,
        commit_time: tables.commit_time.map(Header::encode_time),
        written_at: Header::encode_time(Utc::now()),
    };
    let file = temp.as_file().try_clone().map_err(io_error(&temp_path))?;
    let contents = Contents { tables, xids, ttl };
    let (bytes, nights) = write_contents(file, &header, &contents, &temp_path)?;
    temp.as_file().sync_all().map_err(io_error(&temp_path))?;
    temp.persist(&path).map_err(|e| CheckpointError::Io {
        path: path.clone(),
        source: e.error,
    })?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir))?;
    // Only now is the new one durable: the older ones may go.
    let pruned = prune(dir, name)?;
    Ok(Written {
        path,
        name,
        bytes,
        nights,
        pruned,
    })
}

/// What one checkpoint holds besides its header.
#[derive(Clone, Copy)]
struct Contents<'a> {
    tables: &'a Tables,
    xids: &'a RingContents,
    ttl: &'a [(CalendarKey, Duration)],
}

/// Everything from the magic to the trailer; the file's length and the
/// nights written.
fn write_contents(
    file: File,
    header: &Header,
    contents: &Contents<'_>,
    path: &Path,
) -> Result<(u64, u64), CheckpointError> {
    let Contents { tables, xids, ttl } = *contents;
    // A key twice could make more entries than the reader's bound allows,
    // and the file would not load: not wrong, but useless.
    debug_assert!(
        ttl.windows(2).all(|w| w[0].0 < w[1].0),
        "TTL entries come one per calendar, in key order"
    );
    let mut out = Records {
        out: BufWriter::with_capacity(BUFFER, Summing::new(file)),
        scratch: Vec::with_capacity(64 << 10),
        path,
    };
    out.raw(&MAGIC)?;
    out.raw(&FORMAT_VERSION.to_le_bytes())?;
    out.record(Tag::Header, header)?;
    for hotel in tables.hotels.values() {
        out.record(Tag::Hotel, &HotelRecord::from(hotel))?;
    }
    for room_type in tables.room_types.values() {
        out.record(Tag::RoomType, &RoomTypeRecord::from(room_type))?;
    }
    let mut counts = EndRecord {
        hotels: tables.hotels.len() as u64,
        room_types: tables.room_types.len() as u64,
        calendars: 0,
        nights: 0,
        ttl_entries: 0,
    };
    // Block by block: a hotel's calendars follow one another, so the
    // reader lays each hotel out once.
    for (key, view) in tables.calendars.iter() {
        let calendar = CalendarOut { key, view };
        let Some((first, last)) = calendar.span() else {
            debug_assert!(false, "the copy keeps no empty calendar");
            continue;
        };
        if last - first >= MAX_SPAN_DAYS {
            return Err(CheckpointError::Unwritable(format!(
                "calendar {}/{} spans {} days, more than {MAX_SPAN_DAYS}",
                key.hotel_id,
                key.room_type_id,
                last - first + 1
            )));
        }
        out.record(Tag::Calendar, &calendar)?;
        counts.calendars += 1;
        counts.nights += view.len() as u64;
    }
    let ring = XidsOut {
        first: xids.first,
        xids: &xids.xids,
        newest_forgotten: xids.newest_forgotten,
    };
    out.record(Tag::Xids, &ring)?;
    // Only the calendars the copy holds (a room type, or nights): the
    // safety net may still watch one whose room type was deleted, and the
    // reader bounds the entries by what the copy holds. A frame at a time.
    let mut entries = Vec::with_capacity(TTL_PER_FRAME);
    for &(key, left) in ttl {
        if tables.room_types.contains_key(&key) || tables.calendars.get(&key).is_some() {
            entries.push((key, left));
        }
        if entries.len() == TTL_PER_FRAME {
            out.record(Tag::Ttl, &TtlOut { entries: &entries })?;
            counts.ttl_entries += entries.len() as u64;
            entries.clear();
        }
    }
    if !entries.is_empty() {
        out.record(Tag::Ttl, &TtlOut { entries: &entries })?;
        counts.ttl_entries += entries.len() as u64;
    }
    out.record(Tag::End, &counts)?;
    let summing = out
        .out
        .into_inner()
        .map_err(|e| io_error(path)(e.into_error()))?;
    let Summing {
        inner: mut file,
        crc: body_crc,
        len: body_len,
    } = summing;
    // The trailer: the whole file's length, then the crc32c of everything
    // before the crc (that length included), then the end mark.
    let total = body_len + super::format::TRAILER_LEN;
    let length = total.to_le_bytes();
    let crc = crc32c::crc32c_append(body_crc, &length);
    let mut trailer = Vec::with_capacity(super::format::TRAILER_LEN as usize);
    trailer.extend_from_slice(&length);
    trailer.extend_from_slice(&crc.to_le_bytes());
    trailer.extend_from_slice(&END);
    debug_assert_eq!(trailer.len() as u64, super::format::TRAILER_LEN);
    file.write_all(&trailer).map_err(io_error(path))?;
    Ok((total, counts.nights))
}

/// The framed, checksummed output.
struct Records<'p> {
    out: BufWriter<Summing<File>>,
    /// One record's encoding, reused: the only buffer that grows with a
    /// record, bounded by the largest one.
    scratch: Vec<u8>,
    path: &'p Path,
}

impl Records<'_> {
    fn raw(&mut self, bytes: &[u8]) -> Result<(), CheckpointError> {
        self.out.write_all(bytes).map_err(io_error(self.path))
    }

    fn record(&mut self, tag: Tag, value: &impl Serialize) -> Result<(), CheckpointError> {
        let mut buffer = std::mem::take(&mut self.scratch);
        buffer.clear();
        let encoded = postcard::to_extend(value, buffer).map_err(|e| {
            CheckpointError::Unwritable(format!("a {tag:?} record does not encode: {e}"))
        })?;
        let written = write_frame(&mut self.out, tag, &encoded).map_err(io_error(self.path));
        self.scratch = encoded;
        written
    }
}

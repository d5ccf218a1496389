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

use super::carry::{CountedAttempt, StaleCarry};
use super::dir::{TEMP_PREFIX, prune, remove_temporaries};
use super::format::{
    ATTEMPT_FRAME_BYTES, ATTEMPTS_PER_FRAME, AttemptsOut, CalendarOut, CountsRecord, END,
    EndRecord, FORMAT_VERSION, Header, HotelRecord, Identity, MAGIC, MAX_SPAN_DAYS, RoomTypeRecord,
    StaleTotalsRecord, Summing, TTL_PER_FRAME, Tag, TtlOut, WINDOW_HOTELS_PER_FRAME, WindowOut,
    XidsOut, millis, source_code, write_frame,
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
    /// The copy's epoch (`model::Tables::epoch`).
    pub epoch: u64,
    /// Older checkpoints deleted after this one was durable.
    pub pruned: Vec<PathBuf>,
}

/// Checkpoints the model's published copy: takes the copy, then the xid
/// ring. In that order: an xid is recorded before its transaction shows,
/// so the ring taken after the copy holds every transaction in it (and
/// perhaps a few later ones, which a restart simply records again).
/// `ttl` is the safety net's time left per calendar
/// (`stream::refresh::Refresh::remaining`) and `stale` the stale-read
/// loop's state (`stale::StaleReadState::carry`), both taken just before
/// the call and passed in so this module depends on neither the stream nor
/// the loop that will call it.
pub fn write_model(
    dir: &Path,
    identity: &Identity,
    model: &ReadModel,
    ttl: &[(CalendarKey, Duration)],
    stale: &StaleCarry,
) -> Result<Written, CheckpointError> {
    let tables = model.read();
    let xids = model.xids.contents();
    write(dir, identity, &tables, &xids, ttl, stale)
}

/// Writes `tables`, `xids`, the TTLs' time left (`ttl`, one entry per
/// calendar, in key order, as `Refresh::remaining` gives it) and the
/// stale-read loop's state (`stale`, its ages and times left measured
/// just before this call: the header's `written_at` dates them) as
/// `dir/checkpoint-<timeline>-<lsn>.vcp`, atomically, then deletes the
/// checkpoints ordered before it.
pub fn write(
    dir: &Path,
    identity: &Identity,
    tables: &Tables,
    xids: &RingContents,
    ttl: &[(CalendarKey, Duration)],
    stale: &StaleCarry,
) -> Result<Written, CheckpointError> {
    let name = CheckpointName {
        timeline: identity.timeline,
        lsn: tables.applied,
    };
    let path = dir.join(name.to_string());
    // A leftover of a write that was killed goes first, so it cannot take
    // the space this one needs (`dir::remove_temporaries`).
    if let Err(e) = remove_temporaries(dir) {
        tracing::warn!(error = %e, "cannot remove a checkpoint write's leftover");
    }
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
        epoch: tables.epoch,
        commit_time: tables.commit_time.map(Header::encode_time),
        written_at: Header::encode_time(Utc::now()),
    };
    let file = temp.as_file().try_clone().map_err(io_error(&temp_path))?;
    let contents = Contents {
        tables,
        xids,
        ttl,
        stale,
    };
    let (bytes, nights) = write_contents(file, &header, &contents, &temp_path)?;
    temp.as_file().sync_all().map_err(io_error(&temp_path))?;
    temp.persist(&path).map_err(|e| CheckpointError::Io {
        path: path.clone(),
        source: e.error,
    })?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir))?;
    // Only now is the new one durable: the older ones may go. A prune that
    // fails does not fail the write, which is durable all the same.
    let pruned = prune(dir, name).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot remove checkpoints older than the one written");
        Vec::new()
    });
    Ok(Written {
        path,
        name,
        bytes,
        nights,
        epoch: tables.epoch,
        pruned,
    })
}

/// What one checkpoint holds besides its header.
#[derive(Clone, Copy)]
struct Contents<'a> {
    tables: &'a Tables,
    xids: &'a RingContents,
    ttl: &'a [(CalendarKey, Duration)],
    stale: &'a StaleCarry,
}

/// Everything from the magic to the trailer; the file's length and the
/// nights written.
fn write_contents(
    file: File,
    header: &Header,
    contents: &Contents<'_>,
    path: &Path,
) -> Result<(u64, u64), CheckpointError> {
    let Contents {
        tables,
        xids,
        ttl,
        stale,
    } = *contents;
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
        window_buckets: 0,
        attempts: 0,
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
    write_stale(&mut out, stale, &mut counts)?;
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

/// The stale-read loop's records: window buckets, attempt ids, totals.
/// What the reader would refuse (buckets not oldest first, ids out of
/// order, counts that make a share above 1) is refused here as
/// `Unwritable`, so a file that will not load is never written.
fn write_stale(
    out: &mut Records<'_>,
    stale: &StaleCarry,
    counts: &mut EndRecord,
) -> Result<(), CheckpointError> {
    let unwritable = |what: &str| CheckpointError::Unwritable(format!("stale-read state: {what}"));
    let mut older_ms: Option<u64> = None;
    for bucket in &stale.buckets {
        let age_ms = millis(bucket.age);
        if older_ms.is_some_and(|older| age_ms >= older) {
            return Err(unwritable("window buckets not oldest first"));
        }
        older_ms = Some(age_ms);
        if !bucket.hotels.windows(2).all(|w| w[0].0 < w[1].0) {
            return Err(unwritable("a bucket's hotels not in id order"));
        }
        let overall = CountsRecord::from(bucket.overall);
        let sound = overall.is_sound()
            && bucket
                .hotels
                .iter()
                .all(|(_, c)| CountsRecord::from(*c).is_sound());
        if !sound {
            return Err(unwritable(
                "more stale reads than conflicts, or conflicts than takes",
            ));
        }
        // A bucket with no hotels is still one frame: its overall counts.
        let mut parts = bucket.hotels.chunks(WINDOW_HOTELS_PER_FRAME);
        let first = WindowOut {
            continues: false,
            age_ms,
            overall,
            untracked: bucket.untracked,
            hotels: parts.next().unwrap_or_default(),
        };
        out.record(Tag::Window, &first)?;
        for hotels in parts {
            let more = WindowOut {
                continues: true,
                age_ms,
                overall: CountsRecord::default(),
                untracked: 0,
                hotels,
            };
            out.record(Tag::Window, &more)?;
        }
        counts.window_buckets += 1;
    }
    if !stale
        .attempts
        .windows(2)
        .all(|w| w[0].attempt_id < w[1].attempt_id)
    {
        return Err(unwritable("attempt ids not in order, or one twice"));
    }
    if stale.attempts.iter().any(|a| a.attempt_id.is_empty()) {
        return Err(unwritable("an empty attempt id"));
    }
    for entries in attempt_frames(&stale.attempts) {
        out.record(Tag::Attempts, &AttemptsOut { entries })?;
        counts.attempts += entries.len() as u64;
    }
    let t = &stale.totals;
    let by_source = |of: &[(Option<crate::model::Source>, u64)]| -> Vec<(u8, u64)> {
        of.iter().map(|(s, n)| (source_code(*s), *n)).collect()
    };
    let totals = StaleTotalsRecord {
        taken: t.taken,
        conflicts: t.conflicts,
        errors: t.errors,
        stale_reads: t.stale_reads,
        replays: t.replays,
        conflicts_by_source: by_source(&t.conflicts_by_source),
        takes_by_source: by_source(&t.takes_by_source),
        outcomes_sequence: stale.outcomes_sequence,
    };
    let unique = |of: &[(u8, u64)]| {
        let mut codes: Vec<u8> = of.iter().map(|(c, _)| *c).collect();
        codes.sort_unstable();
        codes.windows(2).all(|w| w[0] < w[1])
    };
    if !unique(&totals.conflicts_by_source) || !unique(&totals.takes_by_source) {
        return Err(unwritable("a source twice in the totals"));
    }
    out.record(Tag::StaleTotals, &totals)
}

/// `attempts` cut into frames of at most `ATTEMPTS_PER_FRAME` entries and,
/// past the first entry, `ATTEMPT_FRAME_BYTES` of ids.
fn attempt_frames(attempts: &[CountedAttempt]) -> Vec<&[CountedAttempt]> {
    let mut frames = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, attempt) in attempts.iter().enumerate() {
        let size = attempt.attempt_id.len() + attempt.fingerprint.len();
        if i > start && (i - start == ATTEMPTS_PER_FRAME || bytes + size > ATTEMPT_FRAME_BYTES) {
            frames.push(&attempts[start..i]);
            start = i;
            bytes = 0;
        }
        bytes += size;
    }
    if start < attempts.len() {
        frames.push(&attempts[start..]);
    }
    frames
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

//! Reading a checkpoint: verify the whole file, then rebuild the copy.
//!
//! Each failure is named for what it is: `verify` reads the trailer (a
//! file without its end mark, or shorter than it says, is truncated), the
//! checksum over every byte (corrupt), then the version and the header
//! (another version, another owner, slot, publication or columns). `load`
//! decodes the records in one pass while summing, and compares the sum
//! before returning anything; when a record does not decode, it asks
//! `verify` for the cause. Nothing is returned until the last byte is
//! checked, so a checkpoint is never half loaded. Every length read from
//! the file is bounded before anything is allocated.
//!
//! Blocking: call it from `spawn_blocking` or a thread of its own.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;

use super::carry::{CountedAttempt, OutcomeTotals, StaleCarry, WindowBucket, WindowCounts};
use super::format::{
    ATTEMPTS_PER_FRAME, AttemptsRecord, CalendarRecord, CountsRecord, END, EndRecord,
    FORMAT_VERSION, FrameError, Header, HotelRecord, Identity, MAGIC, MAX_SPAN_DAYS, PREAMBLE_LEN,
    RoomTypeRecord, StaleTotalsRecord, Summing, TRAILER_LEN, Tag, TtlRecord,
    WINDOW_HOTELS_PER_FRAME, WindowRecord, XidsRecord, date, read_frame, source_of_code,
};
use super::name::CheckpointName;
use super::{CheckpointError, HeaderField, io_error};
use crate::model::calendar::{Calendar, holds_night};
use crate::model::xids::RingContents;
use crate::model::{CalendarKey, Calendars, Hotel, RoomType, RoomTypes, Tables};

/// The read buffer.
const BUFFER: usize = 1 << 20;

/// A checkpoint read whole.
#[derive(Debug)]
pub struct Loaded {
    pub header: Header,
    /// The copy as it was at `header.lsn()`.
    pub tables: Tables,
    /// The applied-xid ring, for `AppliedXids::restore`.
    pub xids: RingContents,
    /// The TTL safety net's time left per calendar when the file was
    /// written (`header.written_at()`).
    pub ttl: Vec<(CalendarKey, Duration)>,
    /// The stale-read loop's window, counted attempt ids and totals, aged
    /// as of `header.written_at()`, for `stale::StaleReadState::restore`.
    pub stale: StaleCarry,
    /// Nights read.
    pub nights: u64,
}

/// What the trailer says, once checked against the file.
#[derive(Debug, Clone, Copy)]
struct Trailer {
    len: u64,
    crc: u32,
}

/// Checks a checkpoint without building the copy: its length, its
/// checksum, its version and its header against `expected`. Returns the
/// header.
pub fn verify(path: &Path, expected: &Identity) -> Result<Header, CheckpointError> {
    let mut file = File::open(path).map_err(io_error(path))?;
    let trailer = read_trailer(&mut file, path)?;
    file.seek(SeekFrom::Start(0)).map_err(io_error(path))?;
    let mut summing = Summing::new(file.take(trailer.len - 8));
    let mut buffer = vec![0u8; BUFFER];
    loop {
        let n = summing.read(&mut buffer).map_err(io_error(path))?;
        if n == 0 {
            break;
        }
    }
    check_sum(path, trailer, summing.len, summing.crc)?;
    file = summing.inner.into_inner();
    file.seek(SeekFrom::Start(0)).map_err(io_error(path))?;
    let mut input = BufReader::new(file.take(trailer.len - TRAILER_LEN));
    let mut payload = Vec::new();
    read_preamble(&mut input, path)?;
    read_header(&mut input, &mut payload, path, expected)
}

/// Rebuilds the copy, the xid ring, the TTLs' time left and the stale-read
/// state of the checkpoint at `path`, checked as `verify` checks it.
///
/// One pass: the records are decoded while the checksum is summed, and
/// nothing is returned before the sum over every byte is checked. A decode
/// that fails first asks `verify` what is wrong with the file (truncated,
/// corrupt, another version or owner), so the error names the cause rather
/// than its symptom; a file that verifies and still does not decode is
/// malformed. (Verifying first would read the whole file twice: a third of
/// a restart's load at 73M rows.)
pub fn load(path: &Path, expected: &Identity) -> Result<Loaded, CheckpointError> {
    let mut file = File::open(path).map_err(io_error(path))?;
    let trailer = read_trailer(&mut file, path)?;
    file.seek(SeekFrom::Start(0)).map_err(io_error(path))?;
    // The records end where the trailer's length field begins; the sum
    // runs on through that field.
    let body = trailer.len - TRAILER_LEN;
    let mut input = BufReader::with_capacity(BUFFER, Summing::new(file.take(body)));
    let loaded = match decode(&mut input, path, expected) {
        Ok(loaded) => loaded,
        Err(error) => return Err(verify(path, expected).err().unwrap_or(error)),
    };
    let rest = input.fill_buf().map_err(io_error(path))?.len();
    if rest > 0 {
        return Err(malformed(path, "bytes after the end record".to_string()));
    }
    let mut summing = input.into_inner();
    if summing.len != body {
        // Shorter than its trailer said (the file changed while read).
        return Err(truncated(
            path,
            format!("{} bytes of records read of {body}", summing.len),
        ));
    }
    let mut length = [0u8; 8];
    summing.inner = summing.inner.into_inner().take(8);
    summing.read_exact(&mut length).map_err(io_error(path))?;
    check_sum(path, trailer, summing.len, summing.crc)?;
    Ok(loaded)
}

/// Rebuilds the copy from a checkpoint read as a stream of `len` bytes
/// (a download as it arrives), checked as `load` checks a file, except
/// that the trailer is read last rather than first: nothing is returned
/// before the trailer's length, end mark and checksum agree with what was
/// read. `name` stands in for the file's path in errors and in the name
/// check, so it must be the checkpoint's `CheckpointName`.
///
/// Why not download to a file and `load` it: at 73M rows the write and the
/// read of the 0.55 GiB file come on top of the transfer, where decoding
/// as it arrives overlaps the two (issue 22's bootstrap goal).
pub fn load_from(
    input: impl Read,
    len: u64,
    name: &Path,
    expected: &Identity,
) -> Result<Loaded, CheckpointError> {
    if len < PREAMBLE_LEN + TRAILER_LEN {
        return Err(truncated(name, format!("{len} bytes")));
    }
    let body = len - TRAILER_LEN;
    let mut input = BufReader::with_capacity(BUFFER, Summing::new(input.take(body)));
    let loaded = decode(&mut input, name, expected)?;
    let rest = input.fill_buf().map_err(io_error(name))?.len();
    if rest > 0 {
        return Err(malformed(name, "bytes after the end record".to_string()));
    }
    let summing = input.into_inner();
    if summing.len != body {
        return Err(truncated(
            name,
            format!("{} bytes of records read of {body}", summing.len),
        ));
    }
    let Summing {
        inner: records,
        crc: summed,
        len: read,
    } = summing;
    let mut inner = records.into_inner();
    let mut bytes = [0u8; TRAILER_LEN as usize];
    inner
        .read_exact(&mut bytes)
        .map_err(|_| truncated(name, "no trailer".to_string()))?;
    let (length, rest_of_trailer) = bytes.split_at(8);
    let (crc, end) = rest_of_trailer.split_at(4);
    if end != END {
        return Err(truncated(name, "no end mark".to_string()));
    }
    let said = u64::from_le_bytes(length.try_into().unwrap_or_default());
    if said != len {
        return Err(truncated(
            name,
            format!("{len} bytes where the trailer says {said}"),
        ));
    }
    let trailer = Trailer {
        len,
        crc: u32::from_le_bytes(crc.try_into().unwrap_or_default()),
    };
    // The sum runs on through the trailer's length field.
    check_sum(
        name,
        trailer,
        read + 8,
        crc32c::crc32c_append(summed, length),
    )?;
    let mut after = [0u8; 1];
    if inner.read(&mut after).map_err(io_error(name))? > 0 {
        return Err(malformed(name, "bytes after the trailer".to_string()));
    }
    Ok(loaded)
}

fn malformed(path: &Path, reason: String) -> CheckpointError {
    CheckpointError::Malformed {
        path: path.to_path_buf(),
        reason,
    }
}

fn truncated(path: &Path, reason: String) -> CheckpointError {
    CheckpointError::Truncated {
        path: path.to_path_buf(),
        reason,
    }
}

/// Reads the last `TRAILER_LEN` bytes and checks them against the file.
fn read_trailer(file: &mut File, path: &Path) -> Result<Trailer, CheckpointError> {
    let actual = file.metadata().map_err(io_error(path))?.len();
    if actual < PREAMBLE_LEN + TRAILER_LEN {
        return Err(truncated(path, format!("{actual} bytes")));
    }
    file.seek(SeekFrom::Start(actual - TRAILER_LEN))
        .map_err(io_error(path))?;
    let mut bytes = [0u8; TRAILER_LEN as usize];
    file.read_exact(&mut bytes).map_err(io_error(path))?;
    let (length, rest) = bytes.split_at(8);
    let (crc, end) = rest.split_at(4);
    if end != END {
        return Err(truncated(path, "no end mark".to_string()));
    }
    let len = u64::from_le_bytes(length.try_into().unwrap_or_default());
    if len != actual {
        return Err(truncated(
            path,
            format!("{actual} bytes where the trailer says {len}"),
        ));
    }
    Ok(Trailer {
        len,
        crc: u32::from_le_bytes(crc.try_into().unwrap_or_default()),
    })
}

/// Checks `summed_len` bytes summed to `summed_crc` against the trailer.
fn check_sum(
    path: &Path,
    trailer: Trailer,
    summed_len: u64,
    summed_crc: u32,
) -> Result<(), CheckpointError> {
    if summed_len != trailer.len - 8 {
        return Err(truncated(
            path,
            format!("{summed_len} bytes read of {}", trailer.len - 8),
        ));
    }
    if summed_crc != trailer.crc {
        return Err(CheckpointError::Checksum {
            path: path.to_path_buf(),
            stored: trailer.crc,
            computed: summed_crc,
        });
    }
    Ok(())
}

fn read_preamble(input: &mut impl Read, path: &Path) -> Result<(), CheckpointError> {
    let mut magic = [0u8; MAGIC.len()];
    input.read_exact(&mut magic).map_err(io_error(path))?;
    if magic != MAGIC {
        return Err(CheckpointError::NotACheckpoint {
            path: path.to_path_buf(),
        });
    }
    let mut version = [0u8; 4];
    input.read_exact(&mut version).map_err(io_error(path))?;
    let found = u32::from_le_bytes(version);
    if found != FORMAT_VERSION {
        return Err(CheckpointError::Version {
            path: path.to_path_buf(),
            found,
        });
    }
    Ok(())
}

fn read_header(
    input: &mut impl Read,
    payload: &mut Vec<u8>,
    path: &Path,
    expected: &Identity,
) -> Result<Header, CheckpointError> {
    let header: Header = next(input, payload, path, Tag::Header)?;
    let found = &header.identity;
    let differs = |field: HeaderField, found: String, expected: String| {
        Err(CheckpointError::Mismatch {
            path: path.to_path_buf(),
            field,
            found,
            expected,
        })
    };
    if found.system_identifier != expected.system_identifier {
        return differs(
            HeaderField::SystemIdentifier,
            found.system_identifier.to_string(),
            expected.system_identifier.to_string(),
        );
    }
    if found.timeline != expected.timeline {
        return differs(
            HeaderField::Timeline,
            found.timeline.to_string(),
            expected.timeline.to_string(),
        );
    }
    if found.slot != expected.slot {
        return differs(HeaderField::Slot, found.slot.clone(), expected.slot.clone());
    }
    if found.publication != expected.publication {
        return differs(
            HeaderField::Publication,
            found.publication.clone(),
            expected.publication.clone(),
        );
    }
    if found.columns_fingerprint != expected.columns_fingerprint {
        return differs(
            HeaderField::ColumnsFingerprint,
            hex(&found.columns_fingerprint),
            hex(&expected.columns_fingerprint),
        );
    }
    // The name orders the directory: it must say what the file holds.
    let held = CheckpointName {
        timeline: found.timeline,
        lsn: header.lsn(),
    };
    let named = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(CheckpointName::parse);
    if named != Some(held) {
        return Err(CheckpointError::Misnamed {
            path: path.to_path_buf(),
            found: held,
        });
    }
    Ok(header)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The next frame, which must carry `want`, decoded.
fn next<T: DeserializeOwned>(
    input: &mut impl Read,
    payload: &mut Vec<u8>,
    path: &Path,
    want: Tag,
) -> Result<T, CheckpointError> {
    let tag = frame(input, payload, path)?;
    if tag != want {
        return Err(malformed(
            path,
            format!("a {tag:?} record where a {want:?} belongs"),
        ));
    }
    decode_payload(payload, path, tag)
}

fn frame(
    input: &mut impl Read,
    payload: &mut Vec<u8>,
    path: &Path,
) -> Result<Tag, CheckpointError> {
    read_frame(input, payload).map_err(|e| match e {
        FrameError::Io(source) if source.kind() == std::io::ErrorKind::UnexpectedEof => {
            malformed(path, "the records end before the end record".to_string())
        }
        FrameError::Io(source) => CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        },
        FrameError::UnknownTag(byte) => malformed(path, format!("unknown record tag {byte}")),
        FrameError::TooLong(len) => malformed(path, format!("a record of {len} bytes")),
    })
}

fn decode_payload<T: DeserializeOwned>(
    payload: &[u8],
    path: &Path,
    tag: Tag,
) -> Result<T, CheckpointError> {
    match postcard::take_from_bytes::<T>(payload) {
        Ok((value, [])) => Ok(value),
        Ok((_, rest)) => Err(malformed(
            path,
            format!("{} bytes after a {tag:?} record", rest.len()),
        )),
        Err(e) => Err(malformed(path, format!("a {tag:?} record: {e}"))),
    }
}

/// The records after the preamble, into a copy.
fn decode(
    input: &mut impl Read,
    path: &Path,
    expected: &Identity,
) -> Result<Loaded, CheckpointError> {
    let mut payload = Vec::new();
    read_preamble(input, path)?;
    let header = read_header(input, &mut payload, path, expected)?;
    let mut hotels = crate::model::Hotels::default();
    let mut room_types = RoomTypes::default();
    let mut calendars = Calendars::default();
    let mut hotel_calendars = HotelCalendars::default();
    let mut laid_out: HashSet<i64, rustc_hash::FxBuildHasher> = HashSet::default();
    let mut counted = EndRecord {
        hotels: 0,
        room_types: 0,
        calendars: 0,
        nights: 0,
        ttl_entries: 0,
        window_buckets: 0,
        attempts: 0,
    };
    let mut xids: Option<XidsRecord> = None;
    let mut stale = StaleCarry::default();
    let mut stale_totals: Option<OutcomeTotals> = None;
    let mut ttl: Vec<(CalendarKey, Duration)> = Vec::new();
    // Records come in tag order; a step back is malformed.
    let mut last = Tag::Header;
    let end = loop {
        let tag = frame(input, &mut payload, path)?;
        if tag < last {
            return Err(malformed(
                path,
                format!("a {tag:?} record after a {last:?}"),
            ));
        }
        last = tag;
        match tag {
            Tag::Header => {
                return Err(malformed(path, "a second header".to_string()));
            }
            Tag::End => break decode_payload::<EndRecord>(&payload, path, tag)?,
            Tag::Hotel => {
                let hotel: HotelRecord = decode_payload(&payload, path, tag)?;
                let id = hotel.id;
                if hotels.insert(id, Hotel::from(hotel)).is_some() {
                    return Err(malformed(path, format!("hotel {id} twice")));
                }
                counted.hotels += 1;
            }
            Tag::RoomType => {
                let room_type: RoomTypeRecord = decode_payload(&payload, path, tag)?;
                let key = CalendarKey {
                    hotel_id: room_type.hotel_id,
                    room_type_id: room_type.id,
                };
                if room_types.insert(key, RoomType::from(room_type)).is_some() {
                    return Err(malformed(
                        path,
                        format!("room type {}/{} twice", key.hotel_id, key.room_type_id),
                    ));
                }
                counted.room_types += 1;
            }
            Tag::Calendar => {
                let record: CalendarRecord = decode_payload(&payload, path, tag)?;
                let (hotel_id, room_type_id) = (record.hotel_id, record.room_type_id);
                if hotel_calendars.hotel_id != Some(hotel_id) {
                    hotel_calendars.lay_out(&mut calendars);
                    // A hotel's calendars come together: seen again later,
                    // the file was not written by `write`.
                    if !laid_out.insert(hotel_id) {
                        return Err(malformed(
                            path,
                            format!("hotel {hotel_id}'s calendars are not together"),
                        ));
                    }
                    hotel_calendars.hotel_id = Some(hotel_id);
                }
                if hotel_calendars
                    .calendars
                    .iter()
                    .any(|(id, _)| *id == room_type_id)
                {
                    return Err(malformed(
                        path,
                        format!("calendar {hotel_id}/{room_type_id} twice"),
                    ));
                }
                let calendar = calendar_of(&record).map_err(|reason| {
                    malformed(
                        path,
                        format!("calendar {hotel_id}/{room_type_id}: {reason}"),
                    )
                })?;
                counted.calendars += 1;
                counted.nights += calendar.len() as u64;
                hotel_calendars.calendars.push((room_type_id, calendar));
            }
            Tag::Xids => {
                if xids.is_some() {
                    return Err(malformed(path, "a second xid ring".to_string()));
                }
                xids = Some(decode_payload(&payload, path, tag)?);
            }
            Tag::Ttl => {
                let record: TtlRecord = decode_payload(&payload, path, tag)?;
                // One entry per room type or calendar at most: a bound on
                // what the frames may add up to, known before they come.
                let bound = counted.room_types + counted.calendars;
                counted.ttl_entries += record.entries.len() as u64;
                if counted.ttl_entries > bound {
                    return Err(malformed(
                        path,
                        format!("more TTL entries than the {bound} room types and calendars"),
                    ));
                }
                ttl.extend(record.entries.iter().map(|&(hotel_id, room_type_id, ms)| {
                    let key = CalendarKey {
                        hotel_id,
                        room_type_id,
                    };
                    (key, Duration::from_millis(ms))
                }));
            }
            Tag::Window => {
                let record: WindowRecord = decode_payload(&payload, path, tag)?;
                window_part(&mut stale.buckets, record)
                    .map_err(|reason| malformed(path, format!("a window record: {reason}")))?;
                counted.window_buckets = stale.buckets.len() as u64;
            }
            Tag::Attempts => {
                let record: AttemptsRecord = decode_payload(&payload, path, tag)?;
                attempts_part(&mut stale.attempts, record)
                    .map_err(|reason| malformed(path, format!("an attempts record: {reason}")))?;
                counted.attempts = stale.attempts.len() as u64;
            }
            Tag::StaleTotals => {
                if stale_totals.is_some() {
                    return Err(malformed(
                        path,
                        "a second stale-read totals record".to_string(),
                    ));
                }
                let record: StaleTotalsRecord = decode_payload(&payload, path, tag)?;
                stale.outcomes_sequence = record.outcomes_sequence;
                stale_totals =
                    Some(totals_of(record).map_err(|reason| {
                        malformed(path, format!("stale-read totals: {reason}"))
                    })?);
            }
        }
    };
    hotel_calendars.lay_out(&mut calendars);
    let Some(xids) = xids else {
        return Err(malformed(path, "no xid ring".to_string()));
    };
    let Some(totals) = stale_totals else {
        return Err(malformed(path, "no stale-read totals".to_string()));
    };
    stale.totals = totals;
    if end != counted {
        return Err(malformed(
            path,
            format!("the end record counts {end:?}, the file holds {counted:?}"),
        ));
    }
    let tables = Tables {
        hotels: Arc::new(hotels),
        room_types: Arc::new(room_types),
        calendars,
        applied: header.lsn(),
        commit_time: header.commit_time(),
        epoch: header.epoch,
        timeline: header.identity.timeline,
        generation: 0,
    };
    Ok(Loaded {
        header,
        tables,
        xids: RingContents {
            first: xids.first,
            xids: xids.xids,
            newest_forgotten: xids.newest_forgotten,
        },
        ttl,
        stale,
        nights: counted.nights,
    })
}

/// Adds one window frame to `buckets`: a new bucket, younger than the one
/// before it, or (`continues`) more hotels of the one before it. Hotel ids
/// rise through a bucket's parts, so none comes twice.
fn window_part(buckets: &mut Vec<WindowBucket>, record: WindowRecord) -> Result<(), String> {
    if record.hotels.len() > WINDOW_HOTELS_PER_FRAME {
        return Err(format!("{} hotels in one frame", record.hotels.len()));
    }
    let sound = record.overall.is_sound() && record.hotels.iter().all(|(_, c)| c.is_sound());
    if !sound {
        return Err("more stale reads than conflicts, or conflicts than takes".to_string());
    }
    let age = Duration::from_millis(record.age_ms);
    if record.continues {
        let Some(previous) = buckets.last_mut() else {
            return Err("continues no bucket".to_string());
        };
        if previous.age != age || !record.overall.is_zero() || record.untracked != 0 {
            return Err("a later part that is not only hotels of its bucket".to_string());
        }
        return add_hotels(&mut previous.hotels, record.hotels);
    }
    if buckets.last().is_some_and(|older| older.age <= age) {
        return Err(format!(
            "a bucket {} ms old after a younger one",
            record.age_ms
        ));
    }
    let mut hotels = Vec::with_capacity(record.hotels.len());
    add_hotels(&mut hotels, record.hotels)?;
    buckets.push(WindowBucket {
        age,
        overall: record.overall.into(),
        untracked: record.untracked,
        hotels,
    });
    Ok(())
}

/// Appends a frame's hotels to a bucket's, each id above the last.
fn add_hotels(
    hotels: &mut Vec<(i64, WindowCounts)>,
    from: Vec<(i64, CountsRecord)>,
) -> Result<(), String> {
    for (hotel_id, counts) in from {
        if hotels.last().is_some_and(|(id, _)| *id >= hotel_id) {
            return Err(format!("hotel {hotel_id} out of order or twice"));
        }
        hotels.push((hotel_id, counts.into()));
    }
    Ok(())
}

/// Adds one frame of attempt ids: each after the one before it, so none
/// comes twice.
fn attempts_part(attempts: &mut Vec<CountedAttempt>, record: AttemptsRecord) -> Result<(), String> {
    if record.entries.len() > ATTEMPTS_PER_FRAME {
        return Err(format!("{} ids in one frame", record.entries.len()));
    }
    for (attempt_id, fingerprint, left_ms) in record.entries {
        if attempt_id.is_empty() {
            return Err("an empty attempt id".to_string());
        }
        if attempts.last().is_some_and(|a| a.attempt_id >= attempt_id) {
            return Err("attempt ids out of order or one twice".to_string());
        }
        attempts.push(CountedAttempt {
            attempt_id,
            fingerprint,
            left: Duration::from_millis(left_ms),
        });
    }
    Ok(())
}

/// The totals, each source code known and once per list.
fn totals_of(record: StaleTotalsRecord) -> Result<OutcomeTotals, String> {
    let sources = |of: Vec<(u8, u64)>| {
        let mut seen = Vec::with_capacity(of.len());
        for (code, n) in of {
            let source = source_of_code(code).ok_or_else(|| format!("source code {code}"))?;
            if seen.iter().any(|(s, _)| *s == source) {
                return Err(format!("source code {code} twice"));
            }
            seen.push((source, n));
        }
        Ok(seen)
    };
    Ok(OutcomeTotals {
        taken: record.taken,
        conflicts: record.conflicts,
        errors: record.errors,
        stale_reads: record.stale_reads,
        replays: record.replays,
        conflicts_by_source: sources(record.conflicts_by_source)?,
        takes_by_source: sources(record.takes_by_source)?,
    })
}

/// One hotel's calendars, gathered before its block is laid out at once.
#[derive(Default)]
struct HotelCalendars {
    hotel_id: Option<i64>,
    calendars: Vec<(i64, Calendar)>,
}

impl HotelCalendars {
    fn lay_out(&mut self, calendars: &mut Calendars) {
        if let Some(hotel_id) = self.hotel_id.take() {
            calendars.insert_hotel(hotel_id, &mut self.calendars);
            self.calendars.clear();
        }
    }
}

/// A calendar's nights, checked: in date order, within `MAX_SPAN_DAYS`,
/// on dates chrono can represent, with storable values.
fn calendar_of(record: &CalendarRecord) -> Result<Calendar, String> {
    let Some(first_gap) = record.nights.first().map(|n| n.gap) else {
        return Err("no nights".to_string());
    };
    let before_start = record
        .start
        .checked_sub(1)
        .ok_or_else(|| format!("starts at day {}", record.start))?;
    // Every gap checked first, and the span found, so the nights are laid
    // out in one allocation and the second walk adds without checks.
    let mut last = before_start;
    for night in &record.nights {
        last = i32::try_from(night.gap)
            .ok()
            .filter(|gap| *gap >= 1)
            .and_then(|gap| last.checked_add(gap))
            .ok_or_else(|| format!("a gap of {} days after day {last}", night.gap))?;
        if i64::from(last) - i64::from(record.start) >= i64::from(MAX_SPAN_DAYS) {
            return Err(format!("spans more than {MAX_SPAN_DAYS} days"));
        }
    }
    // Nights ascend from `start`: the first and the last being nights the
    // copy holds (`calendar::holds_night`: a checkpoint written before that
    // rule may hold a BC night, which the stream would no longer change),
    // every one is (checked once, not per night).
    for d in [record.start, last] {
        if !date(d).is_some_and(holds_night) {
            return Err(format!("day {d} is not a night the copy holds"));
        }
    }
    let first = before_start + first_gap as i32;
    let mut calendar = Calendar::spanning(first, last);
    let mut d = before_start;
    for night in &record.nights {
        d += night.gap as i32;
        calendar.set_day(d, night.counts());
    }
    debug_assert_eq!(d, last);
    Ok(calendar)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::format::NightRecord;

    /// A checkpoint written before the copy left out nights outside the
    /// held years (1 to 9999 before 2026-12-07, 1900 to 2199 since) may
    /// hold one; such a calendar is refused (the checkpoint falls
    /// back to a snapshot), so the copy never starts with a night the stream
    /// would no longer change.
    #[test]
    fn a_calendar_with_a_night_the_copy_does_not_hold_is_refused() {
        let day_of = |y: i32, m: u32, d: u32| {
            let night = chrono::NaiveDate::from_ymd_opt(y, m, d).unwrap();
            let epoch = chrono::NaiveDate::from_ymd_opt(1970, 1, 1).unwrap();
            i32::try_from((night - epoch).num_days()).unwrap()
        };
        let record = |start: i32| CalendarRecord {
            hotel_id: 1,
            room_type_id: 2,
            start,
            nights: vec![NightRecord {
                gap: 1,
                total: 5,
                taken: 0,
                sell_limit: None,
                price_cents: None,
            }],
        };
        assert!(calendar_of(&record(day_of(2030, 1, 1))).is_ok());
        assert!(calendar_of(&record(day_of(1900, 1, 1))).is_ok());
        assert!(calendar_of(&record(day_of(2199, 12, 31))).is_ok());
        for refused in [
            day_of(0, 12, 31),
            day_of(-43, 3, 15),
            day_of(10_000, 1, 1),
            day_of(1, 1, 1),
            day_of(9999, 12, 31),
        ] {
            assert!(calendar_of(&record(refused)).is_err(), "day {refused}");
        }
    }
}

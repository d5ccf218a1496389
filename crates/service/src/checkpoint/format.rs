//! The bytes of a checkpoint file, and the one place that knows them.
//!
//! ```text
//! MAGIC (8 bytes) | FORMAT_VERSION (u32 LE)
//! frame*          | tag (1 byte) | length (u32 LE) | postcard payload
//! trailer         | file length (u64 LE) | crc32c (u32 LE) | END (4 bytes)
//! ```
//!
//! Frames come in this order: one header, the hotels, the room types, the
//! calendars (a hotel's room types one after another), the applied-xid
//! ring, the TTL safety net's time left per calendar (in frames of at most
//! `TTL_PER_FRAME`), the stale-read loop's state (its window's buckets,
//! oldest first, a bucket's hotels in parts of at most
//! `WINDOW_HOTELS_PER_FRAME`; the attempt ids it counted, in id order, in
//! frames of at most `ATTEMPTS_PER_FRAME`; its totals), then an end frame
//! with the counts of each. The crc32c covers every
//! byte before it, the file length included. The version sits at a fixed
//! offset, outside any frame, so a later build can say "another version"
//! without understanding the rest.
//!
//! The model's own types are not serialised: the records here are, so a
//! field added to `Hotel` is a decision about the file format, not an
//! accident of a derive.

use std::io::{self, Read, Write};
use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use serde::ser::{SerializeSeq, SerializeStruct};
use serde::{Deserialize, Serialize, Serializer};

use super::carry::{CountedAttempt, WindowCounts};
use crate::lsn::Lsn;
use crate::model::calendars::CalendarView;
use crate::model::{CalendarKey, Hotel, NightCounts, RoomType, Source};

/// The first bytes of every checkpoint: a name, then bytes that a text-mode
/// transfer or a truncation to seven bits would change (PNG's idea).
pub const MAGIC: [u8; 8] = *b"VCPT\r\n\x1a\n";

/// Bumped on any change to what is written; a file of another version is
/// not read (the start falls back to a snapshot). Version 2 added the
/// stale-read loop's records (window, attempts, totals) and their counts
/// in the end record; so the tags after `Ttl` moved. Version 3 added the
/// copy's epoch to the header (the fleet's bootstrap format). Version 4
/// added the fleet's outcome-stream sequence to the stale-read totals
/// (`StaleTotalsRecord::outcomes_sequence`).
pub const FORMAT_VERSION: u32 = 4;

/// The last bytes of a complete file: a write that stopped early lacks them.
pub const END: [u8; 4] = *b"VEND";

/// Length, crc32c and `END`.
pub const TRAILER_LEN: u64 = 8 + 4 + 4;

/// Magic and version.
pub const PREAMBLE_LEN: u64 = MAGIC.len() as u64 + 4;

/// The largest payload a frame may declare. The largest real record is a
/// calendar of `MAX_SPAN_DAYS` nights (under 2 MiB at worst) or the xid
/// ring (65,536 xids, at most 320 KiB); a larger length is corruption, and
/// refusing it bounds what a read allocates.
pub const MAX_FRAME: u32 = 4 << 20;

/// The widest span of nights one calendar may cover: every day of the
/// years the copy holds (`calendar::HELD_YEARS`, 1900 to 2199). The copy
/// lays a calendar's span out in memory, so a wider one read from a file
/// (corrupt) could allocate without bound; every calendar the copy holds
/// fits, so a copy is always checkpointed. (At 100 years, one room type
/// with nights in 2026 and 9999 made every checkpoint fail.)
pub const MAX_SPAN_DAYS: i32 = 109_573;

/// 1970-01-01 in days from the common era: nights are written as days
/// since then, the model's own unit.
const UNIX_EPOCH_DAYS_FROM_CE: i32 = 719_163;

/// What a frame holds: its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tag {
    Header = 0,
    Hotel = 1,
    RoomType = 2,
    Calendar = 3,
    Xids = 4,
    Ttl = 5,
    Window = 6,
    Attempts = 7,
    StaleTotals = 8,
    End = 9,
}

impl Tag {
    pub fn from_byte(byte: u8) -> Option<Tag> {
        [
            Tag::Header,
            Tag::Hotel,
            Tag::RoomType,
            Tag::Calendar,
            Tag::Xids,
            Tag::Ttl,
            Tag::Window,
            Tag::Attempts,
            Tag::StaleTotals,
            Tag::End,
        ]
        .into_iter()
        .find(|t| *t as u8 == byte)
    }
}

/// Who the copy belongs to: what a checkpoint must match to be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The owner cluster's system identifier (`IDENTIFY_SYSTEM`).
    pub system_identifier: u64,
    /// The owner's timeline (`IDENTIFY_SYSTEM`); after a failover LSNs
    /// start over on a new one.
    pub timeline: u32,
    pub slot: String,
    pub publication: String,
    /// A fingerprint of the published tables' columns (names, types,
    /// order), computed by the caller: the copy's rows mean something only
    /// under the columns they were decoded with.
    pub columns_fingerprint: Vec<u8>,
}

/// The header frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub identity: Identity,
    /// The copy's `applied` position: every owner transaction that
    /// committed before it is in the file, none after.
    pub lsn: u64,
    /// The copy's lineage (`model::Tables::epoch`): the consistent point of
    /// the snapshot it descends from. New in version 3, for the fleet.
    pub epoch: u64,
    /// The copy's last commit time, as (seconds, nanoseconds) since the
    /// epoch, exactly.
    pub commit_time: Option<(i64, u32)>,
    /// When the file was written (wall clock, seconds and nanoseconds):
    /// the TTLs' time left was measured then, so a start can age them by
    /// the downtime.
    pub written_at: (i64, u32),
}

impl Header {
    pub fn lsn(&self) -> Lsn {
        Lsn(self.lsn)
    }

    pub fn commit_time(&self) -> Option<DateTime<Utc>> {
        let (secs, nanos) = self.commit_time?;
        DateTime::from_timestamp(secs, nanos)
    }

    pub fn written_at(&self) -> Option<DateTime<Utc>> {
        DateTime::from_timestamp(self.written_at.0, self.written_at.1)
    }

    pub fn encode_time(at: DateTime<Utc>) -> (i64, u32) {
        (at.timestamp(), at.timestamp_subsec_nanos())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HotelRecord {
    pub id: i64,
    pub name: String,
    pub city: String,
    pub country: Option<String>,
    pub stars: Option<i16>,
    pub latitude: Option<f64>,
    pub longitude: Option<f64>,
    pub amenities: Vec<String>,
}

impl From<&Hotel> for HotelRecord {
    fn from(h: &Hotel) -> HotelRecord {
        HotelRecord {
            id: h.id,
            name: h.name.clone(),
            city: h.city.clone(),
            country: h.country.clone(),
            stars: h.stars,
            latitude: h.latitude,
            longitude: h.longitude,
            amenities: h.amenities.clone(),
        }
    }
}

impl From<HotelRecord> for Hotel {
    fn from(h: HotelRecord) -> Hotel {
        Hotel {
            id: h.id,
            name: h.name,
            city: h.city,
            country: h.country,
            stars: h.stars,
            latitude: h.latitude,
            longitude: h.longitude,
            amenities: h.amenities,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomTypeRecord {
    pub hotel_id: i64,
    pub id: i64,
    pub name: String,
    pub max_guests: i16,
}

impl From<&RoomType> for RoomTypeRecord {
    fn from(r: &RoomType) -> RoomTypeRecord {
        RoomTypeRecord {
            hotel_id: r.hotel_id,
            id: r.id,
            name: r.name.clone(),
            max_guests: r.max_guests,
        }
    }
}

impl From<RoomTypeRecord> for RoomType {
    fn from(r: RoomTypeRecord) -> RoomType {
        RoomType {
            hotel_id: r.hotel_id,
            id: r.id,
            name: r.name,
            max_guests: r.max_guests,
        }
    }
}

/// One night: how many days after the previous night of its calendar (the
/// first counts from the day before `CalendarRecord::start`, so it is 1),
/// and every field of `NightCounts`. Varints make a typical night 6 to 9
/// bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NightRecord {
    pub gap: u32,
    pub total: i32,
    pub taken: i32,
    pub sell_limit: Option<i32>,
    pub price_cents: Option<i32>,
}

impl NightRecord {
    pub fn counts(&self) -> NightCounts {
        NightCounts {
            total: self.total,
            taken: self.taken,
            sell_limit: self.sell_limit,
            price_cents: self.price_cents,
        }
    }
}

/// One calendar as read back.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct CalendarRecord {
    pub hotel_id: i64,
    pub room_type_id: i64,
    /// Day (since 1970-01-01) of the first night.
    pub start: i32,
    pub nights: Vec<NightRecord>,
}

/// One calendar to write, serialised straight from the copy (the same
/// bytes as a `CalendarRecord`), so the writer builds no vector of nights.
pub struct CalendarOut<'a> {
    pub key: CalendarKey,
    pub view: CalendarView<'a>,
}

impl CalendarOut<'_> {
    /// The first night's day, and whether the calendar's span fits
    /// `MAX_SPAN_DAYS`.
    pub fn span(&self) -> Option<(i32, i32)> {
        // From both ends: no walk over every night just for the span.
        let mut nights = self.view.days();
        let first = nights.next()?.0;
        let last = nights.next_back().map_or(first, |(d, _)| d);
        Some((first, last))
    }
}

impl Serialize for CalendarOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let start = self.span().map_or(0, |(first, _)| first);
        let mut record = serializer.serialize_struct("CalendarRecord", 4)?;
        record.serialize_field("hotel_id", &self.key.hotel_id)?;
        record.serialize_field("room_type_id", &self.key.room_type_id)?;
        record.serialize_field("start", &start)?;
        record.serialize_field(
            "nights",
            &NightsOut {
                view: self.view,
                start,
            },
        )?;
        record.end()
    }
}

struct NightsOut<'a> {
    view: CalendarView<'a>,
    start: i32,
}

impl Serialize for NightsOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.view.len()))?;
        let mut previous = self.start - 1;
        let mut written = 0usize;
        for (d, counts) in self.view.days() {
            debug_assert!(d > previous, "a calendar's nights come in date order");
            let night_record = NightRecord {
                gap: d.abs_diff(previous),
                total: counts.total,
                taken: counts.taken,
                sell_limit: counts.sell_limit,
                price_cents: counts.price_cents,
            };
            seq.serialize_element(&night_record)?;
            previous = d;
            written += 1;
        }
        // postcard wrote the length first: a view whose count disagrees
        // with its nights would make a file that reads back wrong.
        debug_assert_eq!(written, self.view.len());
        seq.end()
    }
}

/// The applied-xid ring (`model::xids::RingContents`), as read back.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct XidsRecord {
    pub first: u64,
    pub xids: Vec<u32>,
    pub newest_forgotten: Option<u32>,
}

/// The ring to write, borrowed (the same bytes as an `XidsRecord`): up to
/// 256 KiB the writer need not copy.
#[derive(Debug, Serialize)]
pub struct XidsOut<'a> {
    pub first: u64,
    pub xids: &'a [u32],
    pub newest_forgotten: Option<u32>,
}

/// Time-left entries per TTL frame: 4,096 of at most 30 bytes each.
pub const TTL_PER_FRAME: usize = 4096;

/// Part of the TTL safety net's state, as read back: (hotel, room type,
/// milliseconds left before its re-read).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TtlRecord {
    pub entries: Vec<(i64, i64, u64)>,
}

/// Part of the TTL safety net's state to write, borrowed (the same bytes
/// as a `TtlRecord`).
pub struct TtlOut<'a> {
    pub entries: &'a [(CalendarKey, Duration)],
}

impl Serialize for TtlOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut record = serializer.serialize_struct("TtlRecord", 1)?;
        record.serialize_field("entries", &EntriesOut(self.entries))?;
        record.end()
    }
}

struct EntriesOut<'a>(&'a [(CalendarKey, Duration)]);

impl Serialize for EntriesOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.0.len()))?;
        for (key, left) in self.0 {
            seq.serialize_element(&(key.hotel_id, key.room_type_id, millis(*left)))?;
        }
        seq.end()
    }
}

/// Outcome counts as written (`carry::WindowCounts`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountsRecord {
    pub takes: u64,
    pub conflicts: u64,
    pub stale: u64,
    pub errors: u64,
}

impl CountsRecord {
    /// A stale read is a conflict, and a conflict a take: counts that say
    /// otherwise would make a share above 1.
    pub fn is_sound(&self) -> bool {
        self.stale <= self.conflicts && self.conflicts <= self.takes
    }

    pub fn is_zero(&self) -> bool {
        *self == CountsRecord::default()
    }
}

impl From<WindowCounts> for CountsRecord {
    fn from(c: WindowCounts) -> CountsRecord {
        CountsRecord {
            takes: c.takes,
            conflicts: c.conflicts,
            stale: c.stale,
            errors: c.errors,
        }
    }
}

impl From<CountsRecord> for WindowCounts {
    fn from(c: CountsRecord) -> WindowCounts {
        WindowCounts {
            takes: c.takes,
            conflicts: c.conflicts,
            stale: c.stale,
            errors: c.errors,
        }
    }
}

/// Hotels per window frame: 4,096 of at most 50 bytes each (an id and
/// four counts, varints of at most 10 bytes), so a frame stays under
/// 205 KB.
pub const WINDOW_HOTELS_PER_FRAME: usize = 4096;

/// One bucket of the stale-read window, as read back; or, when `continues`,
/// more of the previous bucket's hotels (same age, nothing else).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct WindowRecord {
    pub continues: bool,
    /// Milliseconds from the bucket's start to when the state was taken.
    pub age_ms: u64,
    pub overall: CountsRecord,
    pub untracked: u64,
    pub hotels: Vec<(i64, CountsRecord)>,
}

/// One window frame to write, its hotels borrowed (the same bytes as a
/// `WindowRecord`).
pub struct WindowOut<'a> {
    pub continues: bool,
    pub age_ms: u64,
    pub overall: CountsRecord,
    pub untracked: u64,
    pub hotels: &'a [(i64, WindowCounts)],
}

impl Serialize for WindowOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut record = serializer.serialize_struct("WindowRecord", 5)?;
        record.serialize_field("continues", &self.continues)?;
        record.serialize_field("age_ms", &self.age_ms)?;
        record.serialize_field("overall", &self.overall)?;
        record.serialize_field("untracked", &self.untracked)?;
        record.serialize_field("hotels", &HotelCountsOut(self.hotels))?;
        record.end()
    }
}

struct HotelCountsOut<'a>(&'a [(i64, WindowCounts)]);

impl Serialize for HotelCountsOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.0.len()))?;
        for &(hotel_id, counts) in self.0 {
            seq.serialize_element(&(hotel_id, CountsRecord::from(counts)))?;
        }
        seq.end()
    }
}

/// Attempt ids per frame, and the bytes of ids one frame may gather before
/// it is cut (a soft bound; ids the ledger accepts are at most 200 bytes,
/// so 4,096 of them stay under it anyway: at most 244 bytes an entry).
pub const ATTEMPTS_PER_FRAME: usize = 4096;
pub const ATTEMPT_FRAME_BYTES: usize = 1 << 20;

/// Attempt ids the stale-read ledger counted, as read back: (id, report
/// fingerprint, milliseconds it would still have been remembered).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct AttemptsRecord {
    pub entries: Vec<(String, [u8; 32], u64)>,
}

/// Attempt ids to write, borrowed (the same bytes as an `AttemptsRecord`).
pub struct AttemptsOut<'a> {
    pub entries: &'a [CountedAttempt],
}

impl Serialize for AttemptsOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut record = serializer.serialize_struct("AttemptsRecord", 1)?;
        record.serialize_field("entries", &AttemptEntriesOut(self.entries))?;
        record.end()
    }
}

struct AttemptEntriesOut<'a>(&'a [CountedAttempt]);

impl Serialize for AttemptEntriesOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.0.len()))?;
        for a in self.0 {
            seq.serialize_element(&(a.attempt_id.as_str(), &a.fingerprint, millis(a.left)))?;
        }
        seq.end()
    }
}

/// The stale-read ledger's totals (`carry::OutcomeTotals`), sources as
/// `source_code`s, and where the state stands in the fleet's outcome
/// stream (`carry::StaleCarry::outcomes_sequence`): the last record of the
/// stale-read state, so the sequence is written after everything it
/// describes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StaleTotalsRecord {
    pub taken: u64,
    pub conflicts: u64,
    pub errors: u64,
    pub stale_reads: u64,
    pub replays: u64,
    pub conflicts_by_source: Vec<(u8, u64)>,
    pub takes_by_source: Vec<(u8, u64)>,
    /// New in version 4. `None`: a standalone node's state.
    pub outcomes_sequence: Option<u64>,
}

/// A quote's source in the file: fixed numbers, not the enum's order, so
/// reordering `Source` changes no file.
pub fn source_code(source: Option<Source>) -> u8 {
    match source {
        None => 0,
        Some(Source::Copy) => 1,
        Some(Source::Owner) => 2,
        Some(Source::CopyFallback) => 3,
        Some(Source::Confirmed) => 4,
    }
}

/// The source a `source_code` stands for; `None` for a code no build wrote.
pub fn source_of_code(code: u8) -> Option<Option<Source>> {
    std::iter::once(None)
        .chain(Source::ALL.into_iter().map(Some))
        .find(|s| source_code(*s) == code)
}

/// A duration in whole milliseconds (rounded down), saturating.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The last frame: what came before it, counted, so a file cut at a frame
/// boundary by a bug (not by a torn write, which the trailer catches) is
/// still refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndRecord {
    pub hotels: u64,
    pub room_types: u64,
    pub calendars: u64,
    pub nights: u64,
    pub ttl_entries: u64,
    /// Window buckets (not frames: a bucket's later parts are not counted).
    pub window_buckets: u64,
    pub attempts: u64,
}

/// The date `d` days after 1970-01-01, when chrono can represent it.
pub fn date(d: i32) -> Option<NaiveDate> {
    NaiveDate::from_num_days_from_ce_opt(d.checked_add(UNIX_EPOCH_DAYS_FROM_CE)?)
}

/// Writes one frame: tag, length, `payload`.
pub fn write_frame(out: &mut impl Write, tag: Tag, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|len| *len <= MAX_FRAME)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a {tag:?} record of {} bytes", payload.len()),
            )
        })?;
    out.write_all(&[tag as u8])?;
    out.write_all(&len.to_le_bytes())?;
    out.write_all(payload)
}

/// Why a frame could not be read.
#[derive(Debug)]
pub enum FrameError {
    Io(io::Error),
    UnknownTag(u8),
    TooLong(u32),
}

/// Reads one frame into `payload` (cleared first, its buffer reused).
pub fn read_frame(input: &mut impl Read, payload: &mut Vec<u8>) -> Result<Tag, FrameError> {
    let mut head = [0u8; 5];
    input.read_exact(&mut head).map_err(FrameError::Io)?;
    let tag = Tag::from_byte(head[0]).ok_or(FrameError::UnknownTag(head[0]))?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
    if len > MAX_FRAME {
        return Err(FrameError::TooLong(len));
    }
    payload.clear();
    // Bounded by MAX_FRAME above, so a corrupt length cannot ask for more.
    payload.resize(len as usize, 0);
    input.read_exact(payload).map_err(FrameError::Io)?;
    Ok(tag)
}

/// A writer that counts and checksums what passes through it.
pub struct Summing<W> {
    pub inner: W,
    pub crc: u32,
    pub len: u64,
}

impl<W> Summing<W> {
    pub fn new(inner: W) -> Summing<W> {
        Summing {
            inner,
            crc: 0,
            len: 0,
        }
    }
}

impl<W: Write> Write for Summing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let written = self.inner.write(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..written]);
        self.len += written as u64;
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<R: Read> Read for Summing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let read = self.inner.read(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..read]);
        self.len += read as u64;
        Ok(read)
    }
}

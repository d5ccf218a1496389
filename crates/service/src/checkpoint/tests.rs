//! Checkpoints end to end, on a temporary directory: what is written comes
//! back equal, and a file that is not whole, not ours or not for this
//! owner is refused with an error that says which.

use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use proptest::prelude::*;

use super::format::{
    ATTEMPTS_PER_FRAME, END, PREAMBLE_LEN, TRAILER_LEN, Tag, WINDOW_HOTELS_PER_FRAME, read_frame,
    write_frame,
};
use super::*;
use crate::lsn::Lsn;
use crate::model::xids::RingContents;
use crate::model::{
    CalendarKey, Change, Hotel, NightCounts, ReadModel, RoomType, Source, Tables, Unsent,
};

fn identity(timeline: u32) -> Identity {
    Identity {
        system_identifier: 7_400_000_000_000_000_001,
        timeline,
        slot: "vacancy".to_string(),
        publication: "vacancy_pub".to_string(),
        columns_fingerprint: vec![0xde, 0xad, 0xbe, 0xef],
    }
}

fn night(n: i64) -> NaiveDate {
    NaiveDate::from_ymd_opt(2027, 1, 1).unwrap() + chrono::Duration::days(n)
}

fn hotel(id: i64) -> Hotel {
    Hotel {
        id,
        name: format!("Hotel {id}"),
        city: "Lisbon".to_string(),
        country: (id % 2 == 0).then(|| "PT".to_string()),
        stars: (id % 3 != 0).then_some((id % 5) as i16 + 1),
        latitude: Some(38.7 + id as f64 / 1000.0),
        longitude: (id % 4 != 0).then_some(-9.1),
        amenities: (0..id % 3).map(|a| format!("amenity {a}")).collect(),
    }
}

/// A night's counts from one number: some with a sell limit, some without
/// a price, negative and large values included.
fn counts(seed: i64) -> NightCounts {
    NightCounts {
        total: (seed % 40) as i32,
        taken: (seed % 7) as i32 - 1,
        sell_limit: (seed % 5 == 0).then_some((seed % 50) as i32),
        price_cents: (seed % 3 != 0).then_some((seed * 997 % 2_000_000) as i32),
    }
}

/// A copy of `hotels` hotels with `types` room types each and `nights`
/// nights, some removed (gaps in the calendars), made the way apply makes it.
fn copy(hotels: i64, types: i64, nights: i64, lsn: u64) -> Tables {
    let mut tables = Tables::default();
    for h in 1..=hotels {
        let upsert = Change::UpsertHotel {
            hotel: Box::new(hotel(h)),
            unsent: Unsent::default(),
        };
        tables.apply_change(&upsert).unwrap();
        for t in 1..=types {
            let room_type = Change::UpsertRoomType {
                room_type: Box::new(RoomType {
                    hotel_id: h,
                    id: t * 10,
                    name: format!("Room {t}"),
                    max_guests: t as i16,
                }),
                name_unsent: false,
            };
            tables.apply_change(&room_type).unwrap();
            let key = CalendarKey {
                hotel_id: h,
                room_type_id: t * 10,
            };
            for n in 0..nights {
                let change = Change::UpsertNight {
                    key,
                    night: night(n),
                    counts: counts(h * 10_000 + t * 100 + n),
                };
                tables.apply_change(&change).unwrap();
            }
            for n in (0..nights).filter(|n| (n + h + t) % 9 == 0) {
                let change = Change::DeleteNight {
                    key,
                    night: night(n),
                };
                tables.apply_change(&change).unwrap();
            }
        }
    }
    tables.applied = Lsn(lsn);
    tables.commit_time = DateTime::<Utc>::from_timestamp(1_800_000_000, 123_456_789);
    tables
}

/// Time left for every room type and calendar of `tables`, and one for a
/// calendar the copy does not hold (not written).
fn ttl_of(tables: &Tables) -> Vec<(CalendarKey, Duration)> {
    let mut keys: Vec<CalendarKey> = tables
        .room_types
        .keys()
        .chain(tables.calendars.keys())
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .enumerate()
        .map(|(i, key)| (key, Duration::from_millis(i as u64 * 7_919)))
        .collect()
}

/// No stale-read state: a loop that counted nothing.
fn none() -> StaleCarry {
    StaleCarry::default()
}

/// Counts that keep stale <= conflicts <= takes.
fn counted(n: u64) -> WindowCounts {
    WindowCounts {
        takes: n + 2,
        conflicts: n + 1,
        stale: n,
        errors: n % 3,
    }
}

/// A stale-read loop's state: buckets with and without hotels, one with
/// nothing but untracked takes' overall counts; ids that sort by byte;
/// totals by source, no quote included.
fn stale_state() -> StaleCarry {
    StaleCarry {
        buckets: vec![
            WindowBucket {
                age: Duration::from_millis(295_400),
                overall: counted(9),
                untracked: 2,
                hotels: vec![(-3, counted(1)), (7, counted(4)), (1 << 40, counted(0))],
            },
            WindowBucket {
                age: Duration::from_millis(12_345),
                overall: counted(0),
                untracked: 2,
                hotels: vec![],
            },
            WindowBucket {
                age: Duration::from_millis(400),
                overall: counted(2),
                untracked: 0,
                hotels: vec![(7, counted(2))],
            },
        ],
        attempts: vec![
            CountedAttempt {
                attempt_id: "a-1".to_string(),
                fingerprint: [7; 32],
                left: Duration::from_millis(86_399_999),
            },
            CountedAttempt {
                attempt_id: "b-2 \u{2713}".to_string(),
                fingerprint: [0; 32],
                left: Duration::from_millis(1),
            },
        ],
        totals: OutcomeTotals {
            taken: 10,
            conflicts: 4,
            errors: 1,
            stale_reads: 2,
            replays: 3,
            conflicts_by_source: vec![(Some(Source::Copy), 3), (None, 1)],
            takes_by_source: vec![
                (Some(Source::Confirmed), 5),
                (Some(Source::Copy), 8),
                (None, 1),
            ],
        },
        outcomes_sequence: Some(41),
    }
}

fn ring() -> RingContents {
    RingContents {
        first: 12,
        xids: vec![900, 901, 4_000_000_000, 903],
        newest_forgotten: Some(899),
    }
}

/// Every night of every calendar, sorted.
fn nights_of(tables: &Tables) -> Vec<(CalendarKey, NaiveDate, NightCounts)> {
    let mut all: Vec<_> = tables
        .calendars
        .iter()
        .flat_map(|(key, view)| view.iter().map(move |(n, c)| (key, n, c)))
        .collect();
    all.sort_by_key(|(key, n, _)| (*key, *n));
    all
}

fn assert_same(loaded: &Tables, written: &Tables) {
    assert_eq!(*loaded.hotels, *written.hotels);
    assert_eq!(*loaded.room_types, *written.room_types);
    assert_eq!(nights_of(loaded), nights_of(written));
    // As a reader of the written copy would see it: its queued side-list
    // edits merged, as a write merges them before it publishes.
    let mut published = written.calendars.clone();
    published.settle();
    assert_eq!(loaded.calendars, published, "the same layout");
    assert_eq!(loaded.applied, written.applied);
    assert_eq!(loaded.commit_time, written.commit_time);
}

fn flip(path: &Path, at: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at as usize] ^= 0x20;
    std::fs::write(path, bytes).unwrap();
}

/// Recomputes the trailer's checksum after a deliberate change, so the
/// checks behind the checksum can be reached.
fn reseal(path: &Path, change: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    let body = bytes.len() - TRAILER_LEN as usize;
    bytes.truncate(body);
    change(&mut bytes);
    let len = bytes.len() as u64 + TRAILER_LEN;
    bytes.extend_from_slice(&len.to_le_bytes());
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    bytes.extend_from_slice(&END);
    std::fs::write(path, bytes).unwrap();
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

#[test]
fn a_copy_comes_back_equal() {
    let dir = tempfile::tempdir().unwrap();
    let tables = copy(5, 4, 60, 0x1_0000_2000);
    let ttl = ttl_of(&tables);
    let mut with_gone = ttl.clone();
    let gone = CalendarKey {
        hotel_id: 99,
        room_type_id: 1,
    };
    with_gone.push((gone, Duration::from_secs(5)));
    let written = write(
        dir.path(),
        &identity(1),
        &tables,
        &ring(),
        &with_gone,
        &stale_state(),
    )
    .unwrap();
    assert_eq!(
        written.path.file_name().unwrap(),
        "checkpoint-00000001-00000001-00002000.vcp"
    );
    assert_eq!(written.nights, tables.inventory_rows());
    assert_eq!(
        written.bytes,
        std::fs::metadata(&written.path).unwrap().len()
    );
    let loaded = load(&written.path, &identity(1)).unwrap();
    assert_same(&loaded.tables, &tables);
    assert_eq!(loaded.xids, ring());
    assert_eq!(
        loaded.ttl, ttl,
        "every held calendar's time left; not the gone one's"
    );
    assert_eq!(loaded.stale, stale_state());
    assert_eq!(loaded.nights, tables.inventory_rows());
    let age = Utc::now() - loaded.header.written_at().unwrap();
    assert!(age >= chrono::Duration::zero() && age < chrono::Duration::minutes(1));
    assert_eq!(loaded.header.lsn(), Lsn(0x1_0000_2000));
    assert_eq!(verify(&written.path, &identity(1)).unwrap(), loaded.header);
}

/// The model's published copy and its ring, as `write_model` takes them,
/// restore into a fresh model that answers the same.
#[test]
fn a_model_restores_from_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let model = ReadModel::new();
    model.replace(copy(3, 2, 20, 500));
    for xid in [40, 41, 42] {
        model.xids.record(xid);
    }
    let ttl = ttl_of(&model.read());
    let written = write_model(dir.path(), &identity(1), &model, &ttl, &stale_state()).unwrap();
    let loaded = load(&written.path, &identity(1)).unwrap();
    let restored = ReadModel::new();
    let loaded_ttl = loaded.ttl;
    restored.replace(loaded.tables);
    restored.xids.restore(loaded.xids);
    assert_same(&restored.read(), &model.read());
    assert_eq!(restored.xids.contents(), model.xids.contents());
    assert_eq!(restored.freshness.applied(), Lsn(500));
    assert_eq!(loaded_ttl, ttl);
    assert_eq!(loaded.stale, stale_state());
}

/// What a typical night costs on disk (the module doc's size estimate): a
/// night a day after the last, a small total and taken, no sell limit, a
/// price of 129.00.
#[test]
fn a_typical_night_costs_eight_bytes() {
    let typical = super::format::NightRecord {
        gap: 1,
        total: 12,
        taken: 3,
        sell_limit: None,
        price_cents: Some(12_900),
    };
    assert_eq!(postcard::to_stdvec(&typical).unwrap().len(), 8);
}

/// What the stale-read state typically costs on disk (the module doc's
/// size estimate): a window hotel entry with an id below 8,192 and counts
/// below 128, and an attempt id that is a UUID with a day left.
#[test]
fn typical_stale_entries_cost_six_and_seventy_three_bytes() {
    let hotel = (
        4_321i64,
        super::format::CountsRecord {
            takes: 12,
            conflicts: 3,
            stale: 1,
            errors: 0,
        },
    );
    assert_eq!(postcard::to_stdvec(&hotel).unwrap().len(), 6);
    let attempt = (
        "0b6c8f3e-5a1d-4c2b-9e7f-1a2b3c4d5e6f",
        [0xabu8; 32],
        86_000_000u64,
    );
    assert_eq!(postcard::to_stdvec(&attempt).unwrap().len(), 73);
}

/// The writer streams a copy it holds while apply goes on publishing new
/// ones: transactions are applied during the write, and the file is the
/// held copy exactly, at its LSN.
#[test]
fn apply_goes_on_while_a_copy_is_written() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let dir = tempfile::tempdir().unwrap();
    let model = ReadModel::new();
    model.replace(copy(20, 5, 200, 1_000));
    let writing = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let during = Arc::new(AtomicU64::new(0));
    let applier = {
        let (model, writing, stop, during) = (
            Arc::clone(&model),
            Arc::clone(&writing),
            Arc::clone(&stop),
            Arc::clone(&during),
        );
        std::thread::spawn(move || {
            let mut lsn = 2_000u64;
            while !stop.load(Ordering::Acquire) {
                let txn = crate::model::Transaction {
                    xid: lsn as u32,
                    commit_lsn: Lsn(lsn),
                    end_lsn: Lsn(lsn + 1),
                    commit_time: DateTime::<Utc>::from_timestamp(1_900_000_000, 0).unwrap(),
                    changes: vec![Change::UpsertNight {
                        key: CalendarKey {
                            hotel_id: (lsn % 20) as i64 + 1,
                            room_type_id: 10,
                        },
                        night: night((lsn % 200) as i64),
                        counts: counts(lsn as i64),
                    }]
                    .into(),
                };
                let was_writing = writing.load(Ordering::Acquire);
                model.apply(&txn).unwrap();
                if was_writing && writing.load(Ordering::Acquire) {
                    during.fetch_add(1, Ordering::AcqRel);
                }
                lsn += 10;
            }
        })
    };
    let held = model.read();
    let before = nights_of(&held);
    writing.store(true, Ordering::Release);
    // Slow the write down enough that the applier surely runs during it.
    let mut written = None;
    while during.load(Ordering::Acquire) < 50 {
        written = Some(write(dir.path(), &identity(1), &held, &ring(), &[], &none()).unwrap());
    }
    writing.store(false, Ordering::Release);
    stop.store(true, Ordering::Release);
    applier.join().unwrap();
    let written = written.expect("written at least once");
    assert!(model.read().applied > held.applied, "apply went on");
    assert_eq!(nights_of(&held), before, "the held copy never changed");
    let loaded = load(&written.path, &identity(1)).unwrap();
    assert_same(&loaded.tables, &held);
    assert_eq!(loaded.header.lsn(), held.applied);
}

#[test]
fn an_empty_copy_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let empty = Tables::default();
    let written = write(
        dir.path(),
        &identity(1),
        &empty,
        &RingContents::default(),
        &[],
        &none(),
    )
    .unwrap();
    let loaded = load(&written.path, &identity(1)).unwrap();
    assert_same(&loaded.tables, &empty);
    assert_eq!(loaded.xids, RingContents::default());
}

#[test]
fn a_truncated_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let written = write(
        dir.path(),
        &identity(1),
        &copy(3, 3, 40, 100),
        &ring(),
        &[],
        &none(),
    )
    .unwrap();
    let whole = std::fs::read(&written.path).unwrap();
    for keep in [
        0,
        5,
        12,
        100,
        whole.len() / 2,
        whole.len() - 17,
        whole.len() - 1,
    ] {
        std::fs::write(&written.path, &whole[..keep]).unwrap();
        let refused = load(&written.path, &identity(1));
        assert!(
            matches!(refused, Err(CheckpointError::Truncated { .. })),
            "cut to {keep} bytes: {refused:?}"
        );
        assert_eq!(refused.unwrap_err().reason(), "truncated");
    }
}

/// One byte flipped anywhere is refused, and never panics; in the records
/// it is the checksum that says so.
#[test]
fn a_flipped_byte_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let written = write(
        dir.path(),
        &identity(1),
        &copy(3, 3, 40, 100),
        &ring(),
        &[],
        &none(),
    )
    .unwrap();
    let whole = std::fs::read(&written.path).unwrap();
    for at in 0..whole.len() as u64 {
        flip(&written.path, at);
        let refused = load(&written.path, &identity(1));
        assert!(refused.is_err(), "byte {at} flipped was accepted");
        std::fs::write(&written.path, &whole).unwrap();
    }
    flip(&written.path, whole.len() as u64 / 2);
    assert!(matches!(
        load(&written.path, &identity(1)),
        Err(CheckpointError::Checksum { .. })
    ));
    assert!(matches!(
        verify(&written.path, &identity(1)),
        Err(CheckpointError::Checksum { .. })
    ));
}

/// Read as a stream (a replica's download as it arrives), a checkpoint
/// loads as the file does; a stream cut short, one with a byte flipped, one
/// longer than it was said to be, or read under another name is refused.
#[test]
fn a_checkpoint_loads_from_a_stream_as_from_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let tables = copy(3, 3, 40, 100);
    let written = write(dir.path(), &identity(1), &tables, &ring(), &[], &none()).unwrap();
    let whole = std::fs::read(&written.path).unwrap();
    let len = whole.len() as u64;
    let name = PathBuf::from(written.path.file_name().unwrap());
    let streamed = load_from(whole.as_slice(), len, &name, &identity(1)).unwrap();
    let from_file = load(&written.path, &identity(1)).unwrap();
    assert_same(&streamed.tables, &tables);
    assert_eq!(streamed.header, from_file.header);
    assert_eq!(streamed.xids, from_file.xids);
    assert_eq!(streamed.nights, from_file.nights);

    for keep in [
        0,
        5,
        100,
        whole.len() / 2,
        whole.len() - 17,
        whole.len() - 1,
    ] {
        let refused = load_from(&whole[..keep], len, &name, &identity(1));
        assert!(refused.is_err(), "cut to {keep} bytes was accepted");
    }
    for at in (0..whole.len()).step_by(7) {
        let mut flipped = whole.clone();
        flipped[at] ^= 0x40;
        let refused = load_from(flipped.as_slice(), len, &name, &identity(1));
        assert!(refused.is_err(), "byte {at} flipped was accepted");
    }
    let mut middle = whole.clone();
    middle[whole.len() / 2] ^= 0x40;
    assert!(matches!(
        load_from(middle.as_slice(), len, &name, &identity(1)),
        Err(CheckpointError::Checksum { .. }) | Err(CheckpointError::Malformed { .. })
    ));
    let mut longer = whole.clone();
    longer.push(0);
    assert!(
        load_from(longer.as_slice(), len, &name, &identity(1)).is_err(),
        "a byte after the trailer"
    );
    assert!(matches!(
        load_from(whole.as_slice(), len - 1, &name, &identity(1)),
        Err(CheckpointError::Truncated { .. }) | Err(CheckpointError::Malformed { .. })
    ));
    let misnamed = PathBuf::from("checkpoint-00000001-00000001-00003000.vcp");
    assert!(matches!(
        load_from(whole.as_slice(), len, &misnamed, &identity(1)),
        Err(CheckpointError::Misnamed { .. })
    ));
    assert!(matches!(
        load_from(whole.as_slice(), len, &name, &identity(2)),
        Err(CheckpointError::Mismatch { .. })
    ));
}

/// Past the checksum: another version, not our magic, and records that
/// break the format are refused by name.
#[test]
fn a_sound_file_of_another_kind_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let written = write(
        dir.path(),
        &identity(1),
        &copy(2, 2, 10, 100),
        &ring(),
        &[],
        &none(),
    )
    .unwrap();
    let whole = std::fs::read(&written.path).unwrap();
    // The version after this build's (a version 1 file is refused alike).
    let next = FORMAT_VERSION + 1;
    reseal(&written.path, |b| {
        b[8..12].copy_from_slice(&next.to_le_bytes())
    });
    assert!(matches!(
        load(&written.path, &identity(1)),
        Err(CheckpointError::Version { found, .. }) if found == next
    ));
    std::fs::write(&written.path, &whole).unwrap();
    reseal(&written.path, |b| {
        b[8..12].copy_from_slice(&1u32.to_le_bytes())
    });
    assert!(matches!(
        load(&written.path, &identity(1)),
        Err(CheckpointError::Version { found: 1, .. })
    ));
    std::fs::write(&written.path, &whole).unwrap();
    reseal(&written.path, |b| b[0] = b'X');
    assert!(matches!(
        load(&written.path, &identity(1)),
        Err(CheckpointError::NotACheckpoint { .. })
    ));
    std::fs::write(&written.path, &whole).unwrap();
    // The end record's last byte (the nights counted) changed.
    reseal(&written.path, |b| *b.last_mut().unwrap() ^= 1);
    let refused = load(&written.path, &identity(1));
    assert!(
        matches!(refused, Err(CheckpointError::Malformed { .. })),
        "{refused:?}"
    );
    std::fs::write(&written.path, &whole).unwrap();
    // A frame declaring more than MAX_FRAME bytes is refused before it
    // is allocated. The first frame's length sits after magic, version, tag.
    reseal(&written.path, |b| {
        b[13..17].copy_from_slice(&u32::MAX.to_le_bytes())
    });
    let refused = load(&written.path, &identity(1));
    assert!(
        matches!(refused, Err(CheckpointError::Malformed { .. })),
        "{refused:?}"
    );
    std::fs::write(&written.path, &whole).unwrap();
    // Trailing bytes after the end record.
    reseal(&written.path, |b| b.push(0));
    let refused = load(&written.path, &identity(1));
    assert!(
        matches!(refused, Err(CheckpointError::Malformed { .. })),
        "{refused:?}"
    );
}

#[test]
fn a_checkpoint_for_another_owner_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let written = write(
        dir.path(),
        &identity(3),
        &copy(1, 1, 5, 100),
        &ring(),
        &[],
        &none(),
    )
    .unwrap();
    type Alter = fn(&mut Identity);
    let cases: [(HeaderField, Alter); 5] = [
        (HeaderField::SystemIdentifier, |i| i.system_identifier += 1),
        (HeaderField::Timeline, |i| i.timeline = 4),
        (HeaderField::Slot, |i| i.slot.push('2')),
        (HeaderField::Publication, |i| i.publication = "other".into()),
        (HeaderField::ColumnsFingerprint, |i| {
            i.columns_fingerprint[0] ^= 1
        }),
    ];
    for (field, change) in cases {
        let mut expected = identity(3);
        change(&mut expected);
        match verify(&written.path, &expected) {
            Err(CheckpointError::Mismatch { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
        assert!(load(&written.path, &expected).is_err());
    }
    let renamed = dir.path().join("checkpoint-00000003-00000000-000000FF.vcp");
    std::fs::rename(&written.path, &renamed).unwrap();
    assert!(matches!(
        load(&renamed, &identity(3)),
        Err(CheckpointError::Misnamed { .. })
    ));
}

#[test]
fn the_newest_valid_checkpoint_is_chosen_over_a_newer_corrupt_one() {
    let dir = tempfile::tempdir().unwrap();
    let older = write(
        dir.path(),
        &identity(1),
        &copy(2, 2, 10, 100),
        &ring(),
        &[],
        &none(),
    )
    .unwrap();
    let kept = std::fs::read(&older.path).unwrap();
    let newer = write(
        dir.path(),
        &identity(1),
        &copy(2, 2, 10, 200),
        &ring(),
        &[],
        &none(),
    )
    .unwrap();
    assert!(
        !older.path.exists(),
        "pruned once the newer one was durable"
    );
    assert_eq!(newer.pruned, vec![older.path.clone()]);
    // As if the newer one were damaged after it was written.
    std::fs::write(&older.path, kept).unwrap();
    flip(&newer.path, newer.bytes / 2);
    let choice = choose(dir.path(), &identity(1)).unwrap();
    let (path, loaded) = choice.chosen.expect("the older one loads");
    assert_eq!(path, older.path);
    assert_eq!(loaded.header.lsn(), Lsn(100));
    assert_eq!(choice.skipped.len(), 1);
    assert_eq!(choice.skipped[0].path, newer.path);
    assert_eq!(choice.skipped[0].error.reason(), "corrupt");
    // Nothing usable: no choice, every reason kept.
    flip(&older.path, 20);
    let none = choose(dir.path(), &identity(1)).unwrap();
    assert!(none.chosen.is_none());
    assert_eq!(none.skipped.len(), 2);
}

/// After a failover the new timeline's LSNs may be lower; they are newer.
#[test]
fn timeline_orders_before_lsn() {
    let dir = tempfile::tempdir().unwrap();
    let old_timeline = write(
        dir.path(),
        &identity(1),
        &copy(1, 1, 5, 5_000),
        &ring(),
        &[],
        &none(),
    )
    .unwrap();
    let kept = std::fs::read(&old_timeline.path).unwrap();
    let new_timeline = write(
        dir.path(),
        &identity(2),
        &copy(1, 1, 5, 300),
        &ring(),
        &[],
        &none(),
    )
    .unwrap();
    assert!(!old_timeline.path.exists(), "a lower timeline is older");
    std::fs::write(&old_timeline.path, kept).unwrap();
    let listed: Vec<CheckpointName> = list(dir.path()).unwrap().into_iter().map(|l| l.0).collect();
    assert_eq!(listed, vec![new_timeline.name, old_timeline.name]);
    let choice = choose(dir.path(), &identity(2)).unwrap();
    assert_eq!(choice.chosen.unwrap().0, new_timeline.path);
    assert!(choice.skipped.is_empty());
    // The old timeline's one is for another timeline: not loaded over it.
    let on_one = choose(dir.path(), &identity(1)).unwrap();
    assert_eq!(on_one.chosen.unwrap().0, old_timeline.path);
    assert_eq!(on_one.skipped[0].error.reason(), "other_owner");
}

/// A write that fails leaves the older checkpoints and no temporary file;
/// a temporary file a crash left is never listed, and goes at the next
/// successful write.
#[test]
fn older_checkpoints_go_only_after_a_newer_one_is_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let first = write(
        dir.path(),
        &identity(1),
        &copy(1, 1, 5, 100),
        &ring(),
        &[],
        &none(),
    )
    .unwrap();
    let mut too_wide = copy(1, 1, 5, 200);
    let key = CalendarKey {
        hotel_id: 1,
        room_type_id: 10,
    };
    // Wider than any calendar of held nights can be (the model itself
    // takes it; every path into the copy leaves such nights out).
    too_wide.calendars.set(key, night(120_000), counts(1));
    // A write killed halfway leaves its temporary file; the next write
    // removes it first, even one that then fails, so a leftover never
    // takes the space every later write needs.
    let crashed = dir.path().join(".checkpoint-tmp-crashed");
    std::fs::write(&crashed, b"half a checkpoint").unwrap();
    let refused = write(dir.path(), &identity(1), &too_wide, &ring(), &[], &none());
    assert!(matches!(refused, Err(CheckpointError::Unwritable(_))));
    assert_eq!(files_in(dir.path()), vec![first.name.to_string()]);
    let unrelated = dir.path().join("notes.txt");
    std::fs::write(&unrelated, b"kept").unwrap();
    assert_eq!(list(dir.path()).unwrap().len(), 1);
    let second = write(
        dir.path(),
        &identity(1),
        &copy(1, 1, 5, 300),
        &ring(),
        &[],
        &none(),
    )
    .unwrap();
    assert_eq!(
        files_in(dir.path()),
        vec![second.name.to_string(), "notes.txt".to_string()]
    );
    assert_eq!(second.pruned, vec![first.path]);
    // A checkpoint at the same position is replaced, not pruned.
    let again = write(
        dir.path(),
        &identity(1),
        &copy(1, 1, 5, 300),
        &ring(),
        &[],
        &none(),
    )
    .unwrap();
    assert!(again.pruned.is_empty());
    assert!(again.path.exists());
}

#[derive(Debug, Clone)]
enum Op {
    Night(i64, i64, i64, i64),
    Remove(i64, i64, i64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1i64..6, 1i64..5, -40i64..400, any::<i64>()).prop_map(|(h, t, n, s)| Op::Night(h, t, n, s.rem_euclid(1 << 40))),
        1 => (1i64..6, 1i64..5, -40i64..400).prop_map(|(h, t, n)| Op::Remove(h, t, n)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Any copy apply can make, with any ring, comes back equal.
    #[test]
    fn any_copy_round_trips(
        ops in proptest::collection::vec(op(), 0..300),
        hotels in 0i64..6,
        lsn in any::<u64>(),
        xids in proptest::collection::vec(any::<u32>(), 0..50),
        first in any::<u64>(),
        forgotten in proptest::option::of(any::<u32>()),
        commit in proptest::option::of((0i64..4_000_000_000, 0u32..1_000_000_000)),
        ttl_len in 0usize..6000,
        ttl_ms in any::<u64>(),
    ) {
        let mut tables = copy(hotels, 2, 3, lsn);
        for op in ops {
            let change = match op {
                Op::Night(h, t, n, s) => Change::UpsertNight {
                    key: CalendarKey { hotel_id: h, room_type_id: t },
                    night: night(n),
                    counts: counts(s),
                },
                Op::Remove(h, t, n) => Change::DeleteNight {
                    key: CalendarKey { hotel_id: h, room_type_id: t },
                    night: night(n),
                },
            };
            tables.apply_change(&change).unwrap();
        }
        tables.commit_time = commit.and_then(|(s, n)| DateTime::<Utc>::from_timestamp(s, n));
        let contents = RingContents { first, xids, newest_forgotten: forgotten };
        // Every held calendar, and calendars the copy does not hold (left
        // out): more than one TTL frame's worth, now and then.
        let mut ttl: Vec<(CalendarKey, Duration)> = ttl_of(&tables)
            .into_iter()
            .map(|(k, _)| (k, Duration::from_millis(ttl_ms)))
            .chain((0..ttl_len as i64).map(|i| (CalendarKey { hotel_id: 1_000 + i, room_type_id: 1 }, Duration::ZERO)))
            .collect();
        ttl.sort_unstable_by_key(|(k, _)| *k);
        let dir = tempfile::tempdir().unwrap();
        let written = write(dir.path(), &identity(9), &tables, &contents, &ttl, &none()).unwrap();
        let loaded = load(&written.path, &identity(9)).unwrap();
        assert_same(&loaded.tables, &tables);
        prop_assert_eq!(loaded.xids, contents);
        let held: Vec<(CalendarKey, Duration)> = ttl
            .into_iter()
            .filter(|(k, _)| tables.room_types.contains_key(k) || tables.calendars.get(k).is_some())
            .collect();
        prop_assert_eq!(loaded.ttl, held);
    }
}

/// Every frame after the preamble, the end record's included.
fn frames_of(path: &Path) -> Vec<(Tag, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let body = &bytes[PREAMBLE_LEN as usize..bytes.len() - TRAILER_LEN as usize];
    let mut input = body;
    let mut frames = Vec::new();
    while !input.is_empty() {
        let mut payload = Vec::new();
        let tag = read_frame(&mut input, &mut payload).unwrap();
        frames.push((tag, payload));
    }
    frames
}

/// Writes `frames` back after the preamble, resealed.
fn rewrite(path: &Path, frames: &[(Tag, Vec<u8>)]) {
    reseal(path, |b| {
        b.truncate(PREAMBLE_LEN as usize);
        for (tag, payload) in frames {
            write_frame(b, *tag, payload).unwrap();
        }
    });
}

/// A window bucket with more hotels than one frame holds, and more attempt
/// ids than one frame holds, come back whole and in order.
#[test]
fn stale_state_larger_than_a_frame_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let mut state = stale_state();
    state.buckets[1].hotels = (0..(2 * WINDOW_HOTELS_PER_FRAME as i64 + 5))
        .map(|h| (h * 3, counted(h as u64 % 4)))
        .collect();
    state.attempts = (0..ATTEMPTS_PER_FRAME + 100)
        .map(|i| CountedAttempt {
            attempt_id: format!("attempt-{i:06}"),
            fingerprint: [(i % 251) as u8; 32],
            left: Duration::from_millis(i as u64 * 1_000),
        })
        .collect();
    let written = write(
        dir.path(),
        &identity(1),
        &copy(1, 1, 5, 100),
        &ring(),
        &[],
        &state,
    )
    .unwrap();
    let window_frames = frames_of(&written.path)
        .iter()
        .filter(|(tag, _)| *tag == Tag::Window)
        .count();
    assert_eq!(window_frames, 3 + 2, "the large bucket in three parts");
    let loaded = load(&written.path, &identity(1)).unwrap();
    assert_eq!(loaded.stale, state);
}

/// What the reader would refuse is refused by the writer, so a file that
/// will not load is never written.
#[test]
fn stale_state_the_reader_would_refuse_is_not_written() {
    let dir = tempfile::tempdir().unwrap();
    type Spoil = fn(&mut StaleCarry);
    let cases: [(&str, Spoil); 6] = [
        ("buckets newest first", |s| s.buckets.reverse()),
        ("hotels out of order", |s| s.buckets[0].hotels.reverse()),
        ("a share above 1", |s| s.buckets[2].hotels[0].1.stale = 99),
        ("ids out of order", |s| s.attempts.reverse()),
        ("an id twice", |s| {
            s.attempts[1].attempt_id = "a-1".to_string()
        }),
        ("a source twice", |s| {
            s.totals.takes_by_source.push((None, 1))
        }),
    ];
    for (what, spoil) in cases {
        let mut state = stale_state();
        spoil(&mut state);
        let refused = write(
            dir.path(),
            &identity(1),
            &copy(1, 1, 5, 100),
            &ring(),
            &[],
            &state,
        );
        assert!(
            matches!(refused, Err(CheckpointError::Unwritable(_))),
            "{what}: {refused:?}"
        );
    }
    assert!(list(dir.path()).unwrap().is_empty());
}

/// Stale-read records that break the format behind a sound checksum are
/// refused as corrupt, by a typed error, never a panic.
#[test]
fn broken_stale_records_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut state = stale_state();
    state.attempts = (0..ATTEMPTS_PER_FRAME + 1)
        .map(|i| CountedAttempt {
            attempt_id: format!("attempt-{i:06}"),
            fingerprint: [1; 32],
            left: Duration::from_secs(60),
        })
        .collect();
    let written = write(
        dir.path(),
        &identity(1),
        &copy(1, 1, 5, 100),
        &ring(),
        &[],
        &state,
    )
    .unwrap();
    let frames = frames_of(&written.path);
    let at = |tag: Tag| frames.iter().position(|(t, _)| *t == tag).unwrap();
    let (window, attempts, totals) = (at(Tag::Window), at(Tag::Attempts), at(Tag::StaleTotals));
    type Break = Box<dyn Fn(&mut Vec<(Tag, Vec<u8>)>)>;
    let cases: Vec<(&str, Break)> = vec![
        (
            "attempt frames swapped",
            Box::new(move |f| f.swap(attempts, attempts + 1)),
        ),
        (
            "window buckets swapped",
            Box::new(move |f| f.swap(window, window + 1)),
        ),
        (
            "no totals",
            Box::new(move |f| {
                f.remove(totals);
            }),
        ),
        (
            "a second totals",
            Box::new(move |f| {
                let again = f[totals].clone();
                f.insert(totals, again);
            }),
        ),
        (
            "an unknown source",
            Box::new(move |f| {
                let record = format::StaleTotalsRecord {
                    conflicts_by_source: vec![(9, 1)],
                    ..Default::default()
                };
                f[totals].1 = postcard::to_stdvec(&record).unwrap();
            }),
        ),
        (
            "a share above 1",
            Box::new(move |f| {
                let record = format::WindowOut {
                    continues: false,
                    age_ms: 999_999,
                    overall: format::CountsRecord {
                        takes: 1,
                        conflicts: 2,
                        stale: 0,
                        errors: 0,
                    },
                    untracked: 0,
                    hotels: &[],
                };
                f[window].1 = postcard::to_stdvec(&record).unwrap();
            }),
        ),
        (
            "a part of no bucket",
            Box::new(move |f| {
                let record = format::WindowOut {
                    continues: true,
                    age_ms: 999_999,
                    overall: format::CountsRecord::default(),
                    untracked: 0,
                    hotels: &[],
                };
                f[window].1 = postcard::to_stdvec(&record).unwrap();
            }),
        ),
        (
            "a window record after the attempts",
            Box::new(move |f| {
                let part = f[window].clone();
                f.insert(totals, part);
            }),
        ),
    ];
    let whole = std::fs::read(&written.path).unwrap();
    for (what, breaks) in cases {
        let mut changed = frames.clone();
        breaks(&mut changed);
        rewrite(&written.path, &changed);
        let refused = load(&written.path, &identity(1));
        assert!(
            matches!(refused, Err(CheckpointError::Malformed { .. })),
            "{what}: {refused:?}"
        );
        assert_eq!(refused.unwrap_err().reason(), "corrupt", "{what}");
        std::fs::write(&written.path, &whole).unwrap();
    }
    // Unchanged frames rewritten load: the cases above broke only what they say.
    rewrite(&written.path, &frames);
    assert_eq!(load(&written.path, &identity(1)).unwrap().stale, state);
}

/// Counts with stale <= conflicts <= takes, any sizes.
fn sound_counts() -> impl Strategy<Value = WindowCounts> {
    (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(a, b, c, errors)| {
        let mut v = [a, b, c];
        v.sort_unstable();
        WindowCounts {
            stale: v[0],
            conflicts: v[1],
            takes: v[2],
            errors,
        }
    })
}

/// Any state the stale-read loop can carry: buckets of distinct ages,
/// oldest first; hotels and ids in order, each once; totals by any sources.
fn any_stale_state() -> impl Strategy<Value = StaleCarry> {
    use std::collections::BTreeMap;
    let bucket = (
        0u64..100_000_000,
        sound_counts(),
        any::<u64>(),
        proptest::collection::btree_map(any::<i64>(), sound_counts(), 0..40),
    );
    let attempts = proptest::collection::btree_map(
        "[a-zA-Z0-9:-]{1,60}",
        (any::<[u8; 32]>(), any::<u64>()),
        0..80,
    );
    let by_source = proptest::collection::vec(proptest::option::of(any::<u64>()), 5);
    (
        proptest::collection::vec(bucket, 0..8),
        attempts,
        any::<[u64; 5]>(),
        by_source.clone(),
        by_source,
        proptest::option::of(any::<u64>()),
    )
        .prop_map(
            |(buckets, attempts, t, conflicts, takes, outcomes_sequence)| {
                let mut by_age: BTreeMap<u64, WindowBucket> = BTreeMap::new();
                for (age_ms, overall, untracked, hotels) in buckets {
                    by_age.insert(
                        age_ms,
                        WindowBucket {
                            age: Duration::from_millis(age_ms),
                            overall,
                            untracked,
                            hotels: hotels.into_iter().collect(),
                        },
                    );
                }
                let sources = |of: Vec<Option<u64>>| -> Vec<(Option<Source>, u64)> {
                    std::iter::once(None)
                        .chain(Source::ALL.into_iter().map(Some))
                        .zip(of)
                        .filter_map(|(source, n)| Some((source, n?)))
                        .collect()
                };
                StaleCarry {
                    buckets: by_age.into_values().rev().collect(),
                    attempts: attempts
                        .into_iter()
                        .map(|(attempt_id, (fingerprint, ms))| CountedAttempt {
                            attempt_id,
                            fingerprint,
                            left: Duration::from_millis(ms),
                        })
                        .collect(),
                    totals: OutcomeTotals {
                        taken: t[0],
                        conflicts: t[1],
                        errors: t[2],
                        stale_reads: t[3],
                        replays: t[4],
                        conflicts_by_source: sources(conflicts),
                        takes_by_source: sources(takes),
                    },
                    outcomes_sequence,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Any stale-read state the loop can carry comes back equal.
    #[test]
    fn any_stale_state_round_trips(state in any_stale_state()) {
        let dir = tempfile::tempdir().unwrap();
        let written = write(dir.path(), &identity(1), &copy(1, 1, 3, 100), &ring(), &[], &state).unwrap();
        let loaded = load(&written.path, &identity(1)).unwrap();
        prop_assert_eq!(loaded.stale, state);
    }
}

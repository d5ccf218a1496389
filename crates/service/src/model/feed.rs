//! The change feed: what each applied owner transaction changed in the
//! nightly counts, in commit order, for whoever pushes changes to open pages
//! (the SSE stream in `crate::http::events`).
//!
//! `ReadModel` publishes one item per applied transaction, after its
//! copy is swapped in. Publishing never waits: the live channel is a bounded
//! `tokio::sync::broadcast` (a receiver that falls behind is told it lagged
//! and must start over from a full state), and a bounded ring keeps the
//! recent items for clients that reconnect with `Last-Event-ID`.
//!
//! Architecture invariant: an item is published only after its transaction
//! is visible to readers, so a reader that reads the model at `applied = S`
//! after subscribing sees every later change either in its read (lsn <= S)
//! or on the channel (lsn > S): no gap, and skipping items at or below S
//! means no overlap.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, NaiveDate, Utc};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::{CalendarKey, Change, NightCounts, SpillError, Table, Transaction};
use crate::lsn::Lsn;

/// Items the live channel holds before a slow receiver lags.
pub const CHANNEL_CAPACITY: usize = 1024;
/// Most transactions the ring keeps for reconnecting clients.
pub const RING_ITEMS: usize = 4096;
/// Most night changes the ring keeps, over all its items (bounds memory).
pub const RING_NIGHTS: usize = 200_000;
/// A transaction that changed more nights than this is published as "start
/// over from a full state" for the hotels it changed, instead of night by
/// night (a bulk load, a repricing). It bounds what the live channel holds:
/// a stream whose client stops reading keeps the channel's last
/// `CHANNEL_CAPACITY` items alive, at most about 100 MB of nights at 2,000
/// (at 20,000, about 1 GB).
pub const MAX_ITEM_NIGHTS: usize = 2_000;
/// Past `MAX_ITEM_NIGHTS`, the most hotels an item names; a transaction
/// that changed more has every page start over. Below it, only the pages
/// of the hotels changed rebuild their state: with every page starting
/// over, one hotel's repricing made every open stream of every hotel
/// build and send its whole state at once.
pub const MAX_ITEM_HOTELS: usize = 1_000;

/// Why `FeedItem::from_transaction`'s walk ended before the last change.
#[derive(Debug)]
enum FeedWalkEnd {
    /// Readers must start over from a full state: nothing more to collect.
    StartOver,
    /// The spill file could not be read back.
    Unreadable(SpillError),
}

impl From<SpillError> for FeedWalkEnd {
    fn from(error: SpillError) -> FeedWalkEnd {
        FeedWalkEnd::Unreadable(error)
    }
}

/// One night's new values; `None` when the night was removed (not on sale).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NightChange {
    pub key: CalendarKey,
    pub night: NaiveDate,
    pub counts: Option<NightCounts>,
}

/// Which hotels' state changed in a way a list of night changes cannot say
/// (room types added or removed, a hotel deleted, a truncate, a bulk load, a
/// new snapshot, a repair by the TTL re-read): those must start over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resync {
    None,
    Hotels(Vec<i64>),
    All,
}

/// What one applied transaction changed.
#[derive(Debug, Clone)]
pub struct FeedItem {
    /// The transaction's end LSN: the copy's `applied` once it is visible,
    /// the `lsn` any answer that includes it reports.
    pub lsn: Lsn,
    pub commit_lsn: Lsn,
    pub commit_time: Option<DateTime<Utc>>,
    /// The last value of each changed night, ordered by hotel, room type, night.
    pub nights: Vec<NightChange>,
    pub resync: Resync,
    /// Not a transaction: the copy was replaced or repaired at `lsn`, so
    /// even a reader that has seen `lsn` must start over.
    pub reset: bool,
    /// The owner timeline of the copy `lsn` is a position of (0: unknown):
    /// an event id says it, so a reconnect after a failover is not resumed.
    pub timeline: u32,
    /// The copy's `Tables::generation`: an event stream whose state came
    /// from a newer copy skips it.
    pub generation: u64,
}

impl FeedItem {
    /// The item for one committed transaction; `None` when it changed
    /// nothing a count reader cares about (a heartbeat, a hotel's name).
    pub fn from_transaction(txn: &Transaction) -> Option<FeedItem> {
        let mut resync_hotels = std::collections::BTreeSet::new();
        let mut night_changes = 0usize;
        let mut nights = BTreeMap::new();
        // Past `MAX_ITEM_NIGHTS`: the hotels changed, not their nights.
        let mut bulk = false;
        // One walk, which stops as soon as the item is "start over": a
        // spilled transaction is read back from disk for each walk, and a
        // bulk one needs only its first `MAX_ITEM_NIGHTS + 1` nights read
        // to know it is one. The map is bounded by the same figure.
        let walked = txn.changes.for_each(|change| {
            match change {
                Change::UpsertNight { key, .. } | Change::DeleteNight { key, .. } if bulk => {
                    resync_hotels.insert(key.hotel_id);
                }
                Change::UpsertNight { key, night, counts } => {
                    nights.insert((*key, *night), Some(*counts));
                    night_changes += 1;
                }
                Change::DeleteNight { key, night } => {
                    nights.insert((*key, *night), None);
                    night_changes += 1;
                }
                Change::UpsertRoomType { room_type, .. } => {
                    resync_hotels.insert(room_type.hotel_id);
                }
                Change::DeleteRoomType { hotel_id, .. } => {
                    resync_hotels.insert(*hotel_id);
                }
                Change::DeleteHotel { id } => {
                    resync_hotels.insert(*id);
                }
                Change::Truncate { tables }
                    if tables
                        .iter()
                        .any(|t| matches!(t, Table::Inventory | Table::RoomTypes)) =>
                {
                    return Err(FeedWalkEnd::StartOver);
                }
                Change::Truncate { .. } | Change::UpsertHotel { .. } => {}
            }
            if !bulk && night_changes > MAX_ITEM_NIGHTS {
                bulk = true;
                resync_hotels.extend(
                    nights
                        .keys()
                        .map(|(key, _): &(CalendarKey, _)| key.hotel_id),
                );
                nights.clear();
            }
            if resync_hotels.len() > MAX_ITEM_HOTELS {
                return Err(FeedWalkEnd::StartOver);
            }
            Ok(())
        });
        let resync_all = match walked {
            Ok(()) => false,
            Err(FeedWalkEnd::StartOver) => true,
            Err(FeedWalkEnd::Unreadable(error)) => {
                // A spill file read in part (the copy has it whole: apply
                // read it): readers cannot be told which nights, so all
                // start over.
                tracing::warn!(%error, "cannot read an applied transaction back for the feed; readers resync");
                true
            }
        };
        if resync_all {
            nights.clear();
        }
        let resync_hotels: Vec<i64> = resync_hotels.into_iter().collect();
        let resync = if resync_all {
            Resync::All
        } else if resync_hotels.is_empty() {
            Resync::None
        } else {
            Resync::Hotels(resync_hotels)
        };
        if nights.is_empty() && resync == Resync::None {
            return None;
        }
        Some(FeedItem {
            lsn: txn.end_lsn,
            commit_lsn: txn.commit_lsn,
            commit_time: Some(txn.commit_time),
            nights: nights
                .into_iter()
                .map(|((key, night), counts)| NightChange { key, night, counts })
                .collect(),
            resync,
            reset: false,
            timeline: 0,
            generation: 0,
        })
    }

    /// Whether a page of `hotel_id` must start over from a full state.
    pub fn resyncs(&self, hotel_id: i64) -> bool {
        match &self.resync {
            Resync::None => false,
            Resync::Hotels(ids) => ids.binary_search(&hotel_id).is_ok(),
            Resync::All => true,
        }
    }

    /// The changed nights of one hotel.
    pub fn nights_of(&self, hotel_id: i64) -> &[NightChange] {
        let start = self.nights.partition_point(|n| n.key.hotel_id < hotel_id);
        let end = self.nights.partition_point(|n| n.key.hotel_id <= hotel_id);
        &self.nights[start..end]
    }
}

/// The ring of recent items for reconnecting clients.
#[derive(Debug, Default)]
struct Ring {
    items: VecDeque<Arc<FeedItem>>,
    nights: usize,
    /// The smallest last-seen LSN a client may resume from: the ring holds
    /// every item after it. Moves up as items are evicted, and past a reset.
    resume_floor: Lsn,
}

/// The feed: a bounded live channel and a bounded ring. Cheap to publish to.
#[derive(Debug)]
pub struct Feed {
    sender: broadcast::Sender<Arc<FeedItem>>,
    // A std Mutex: held only to push or copy a few `Arc`s, never across an await.
    ring: Mutex<Ring>,
    /// Cancelled when the service stops, so open streams end and the HTTP
    /// server can drain.
    closed: CancellationToken,
    /// Streams open now (see `crate::http::events` for the bound).
    pub open_streams: AtomicUsize,
    /// Streams open now per client address, when the per-client bound is
    /// on (`http.max_event_streams_per_client`); an address leaves with its
    /// last stream, so at most `events::MAX_STREAMS` entries. Kept here,
    /// beside the count, because a stream's slot drops with it.
    pub streams_by_client: Mutex<HashMap<IpAddr, usize>>,
}

impl Default for Feed {
    fn default() -> Self {
        let (sender, _) = broadcast::channel(CHANNEL_CAPACITY);
        Feed {
            sender,
            ring: Mutex::default(),
            closed: CancellationToken::new(),
            open_streams: AtomicUsize::new(0),
            streams_by_client: Mutex::default(),
        }
    }
}

impl Feed {
    /// Live items from now on. Subscribe before reading the state or the
    /// ring, then skip items at or below what was read.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<FeedItem>> {
        self.sender.subscribe()
    }

    /// Publishes one applied transaction's item (in commit order: only the
    /// projector's task applies, so only it publishes).
    pub fn publish(&self, item: FeedItem) {
        let item = Arc::new(item);
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        debug_assert!(ring.items.back().is_none_or(|last| last.lsn < item.lsn));
        ring.nights += item.nights.len();
        ring.items.push_back(item.clone());
        while ring.items.len() > RING_ITEMS || (ring.nights > RING_NIGHTS && ring.items.len() > 1) {
            let Some(old) = ring.items.pop_front() else {
                break;
            };
            ring.nights -= old.nights.len();
            ring.resume_floor = old.lsn;
        }
        // Sent under the ring's lock, so a client that copies the ring after
        // subscribing misses nothing between the two. `send` never waits; it
        // fails only when nobody listens.
        let _ = self.sender.send(item);
    }

    /// Everything since a new copy was swapped in, or since a repair the
    /// stream did not deliver, is a full-state matter: every open page starts
    /// over, and no client may resume from a position at or before `at`.
    pub fn reset(&self, at: Lsn, timeline: u32, generation: u64) {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        ring.items.clear();
        ring.nights = 0;
        ring.resume_floor = Lsn(at.0.saturating_add(1));
        let _ = self.sender.send(Arc::new(FeedItem {
            lsn: at,
            commit_lsn: at,
            commit_time: None,
            nights: Vec::new(),
            resync: Resync::All,
            reset: true,
            timeline,
            generation,
        }));
    }

    /// The items after `last_seen`, or `None` when the ring no longer holds
    /// all of them (the client must start over from a full state).
    pub fn since(&self, last_seen: Lsn) -> Option<Vec<Arc<FeedItem>>> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if last_seen < ring.resume_floor {
            return None;
        }
        let start = ring.items.partition_point(|i| i.lsn <= last_seen);
        Some(ring.items.range(start..).cloned().collect())
    }

    /// Ends every open stream (the service is stopping).
    pub fn close(&self) {
        self.closed.cancel();
    }

    /// Resolves once `close` was called.
    pub async fn closed(&self) {
        self.closed.cancelled().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(hotel_id: i64, room_type_id: i64) -> CalendarKey {
        CalendarKey {
            hotel_id,
            room_type_id,
        }
    }

    fn day(n: u32) -> NaiveDate {
        NaiveDate::from_ymd_opt(2030, 1, n).unwrap()
    }

    fn counts(taken: i32) -> NightCounts {
        NightCounts {
            total: 5,
            taken,
            sell_limit: None,
            price_cents: Some(100),
        }
    }

    fn txn(end: u64, changes: Vec<Change>) -> Transaction {
        Transaction {
            xid: 1,
            commit_lsn: Lsn(end - 1),
            end_lsn: Lsn(end),
            commit_time: Utc::now(),
            changes: changes.into(),
        }
    }

    fn night(hotel: i64, n: u32, taken: i32) -> Change {
        Change::UpsertNight {
            key: key(hotel, 1),
            night: day(n),
            counts: counts(taken),
        }
    }

    #[test]
    fn an_item_keeps_the_last_value_of_each_night_grouped_by_hotel() {
        let item = FeedItem::from_transaction(&txn(
            10,
            vec![
                night(2, 1, 1),
                night(1, 1, 1),
                night(2, 1, 2),
                Change::DeleteNight {
                    key: key(1, 1),
                    night: day(2),
                },
            ],
        ))
        .unwrap();
        assert_eq!(item.lsn, Lsn(10));
        assert_eq!(item.nights.len(), 3);
        let h2 = item.nights_of(2);
        assert_eq!(h2.len(), 1);
        assert_eq!(h2[0].counts, Some(counts(2)), "the last value wins");
        assert_eq!(item.nights_of(1).len(), 2);
        assert_eq!(item.nights_of(1)[1].counts, None);
        assert!(item.nights_of(3).is_empty());
        assert!(!item.resyncs(1));
    }

    #[test]
    fn heartbeats_publish_nothing_and_structure_changes_resync() {
        assert!(FeedItem::from_transaction(&txn(10, vec![])).is_none());
        let item =
            FeedItem::from_transaction(&txn(10, vec![Change::DeleteHotel { id: 7 }])).unwrap();
        assert!(item.resyncs(7));
        assert!(!item.resyncs(8));
        let bulk: Vec<Change> = (0..=MAX_ITEM_NIGHTS)
            .map(|i| Change::UpsertNight {
                key: key(i as i64, 1),
                night: day(1),
                counts: counts(0),
            })
            .collect();
        let item = FeedItem::from_transaction(&txn(10, bulk)).unwrap();
        assert_eq!(item.resync, Resync::All, "more hotels than an item names");
        assert!(item.nights.is_empty());
        // Many nights of a few hotels: those hotels start over, no other.
        let repricing: Vec<Change> = (0..=MAX_ITEM_NIGHTS)
            .map(|i| Change::UpsertNight {
                key: key(1 + (i % 3) as i64, 1 + (i / 84) as i64),
                night: day(1 + ((i / 3) % 28) as u32),
                counts: counts(0),
            })
            .chain([night(9, 1, 1)])
            .collect();
        let item = FeedItem::from_transaction(&txn(10, repricing)).unwrap();
        assert_eq!(item.resync, Resync::Hotels(vec![1, 2, 3, 9]));
        assert!(
            item.nights.is_empty(),
            "the hotels start over; no night is listed"
        );
        assert!(item.resyncs(2) && !item.resyncs(4));
        // A truncate of counts or room types ends the walk: start over,
        // whatever came before it.
        for table in [Table::Inventory, Table::RoomTypes] {
            let item = FeedItem::from_transaction(&txn(
                10,
                vec![
                    night(1, 1, 1),
                    Change::Truncate {
                        tables: vec![table],
                    },
                    night(2, 1, 1),
                ],
            ))
            .unwrap();
            assert_eq!(item.resync, Resync::All, "{table:?}");
            assert!(item.nights.is_empty());
        }
        // One of hotels alone changes no night a page shows.
        let item = FeedItem::from_transaction(&txn(
            10,
            vec![
                night(1, 1, 1),
                Change::Truncate {
                    tables: vec![Table::Hotels],
                },
                night(2, 1, 1),
            ],
        ))
        .unwrap();
        assert_eq!(item.resync, Resync::None);
        assert_eq!(item.nights.len(), 2, "the nights after it are listed too");
    }

    #[test]
    fn the_ring_resumes_until_it_evicts_and_not_across_a_reset() {
        let feed = Feed::default();
        feed.reset(Lsn(100), 1, 1);
        assert!(
            feed.since(Lsn(100)).is_none(),
            "nothing seen after the reset"
        );
        let mut rx = feed.subscribe();
        for i in 0..(RING_ITEMS as u64 + 10) {
            let item = FeedItem::from_transaction(&txn(200 + i, vec![night(1, 1, 1)])).unwrap();
            feed.publish(item);
        }
        assert!(matches!(
            rx.try_recv(),
            Err(broadcast::error::TryRecvError::Lagged(_))
        ));
        assert!(feed.since(Lsn(200)).is_none(), "evicted");
        let tail = feed.since(Lsn(200 + RING_ITEMS as u64)).unwrap();
        assert_eq!(tail.len(), 9);
        assert!(tail.windows(2).all(|w| w[0].lsn < w[1].lsn));
        let newest = 200 + RING_ITEMS as u64 + 9;
        assert!(feed.since(Lsn(newest)).unwrap().is_empty());
        feed.reset(Lsn(newest + 5), 1, 1);
        assert!(feed.since(Lsn(newest)).is_none());
    }
}

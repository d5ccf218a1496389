//! Owner reads: the few rows a search must not show from the copy.
//!
//! When few units remain, a stale count misleads the guest most, so those
//! rows are read from the owner before the answer goes out: one query per
//! search, identical concurrent reads coalesced through a `moka` cache with a
//! TTL well under a second, a timeout, and a small set of pipelined
//! connections (a `tokio_postgres::Client` serves concurrent queries).
//! Search takes only a read sent after it began (`not_before`): numbers
//! shown as the owner's are never older than the question.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::NaiveDate;
use moka::future::Cache;
use rustc_hash::FxBuildHasher;
use tokio_postgres::{Client, Statement};

use super::SearchSettings;
use super::params::Stay;
use crate::metrics;
use crate::model::{CalendarKey, NightCounts};
use crate::owner;
use crate::owner::OwnerSettings;

/// One index range per calendar (the primary key leads with hotel, room
/// type, night), whatever the number of keys. The table is named with the
/// schema the stream follows (`stream.schema`, a checked identifier): left
/// to the role's `search_path`, a read could return another schema's
/// `inventory`.
fn read_sql(schema: &str) -> String {
    format!(
        "SELECT i.hotel_id, i.room_type_id, i.night, i.total, i.taken, i.sell_limit, i.price_cents
         FROM unnest($1::bigint[], $2::bigint[]) AS k(hotel_id, room_type_id)
         JOIN {schema}.inventory i USING (hotel_id, room_type_id)
         WHERE i.night >= $3 AND i.night < $4"
    )
}

/// An open connection and the read prepared on it.
type Prepared = (Arc<Client>, Statement);

/// Why a search read the owner (the metric's `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    FewUnits,
    MinLsn,
    Bypass,
}

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Reason::FewUnits => "few_units",
            Reason::MinLsn => "min_lsn",
            Reason::Bypass => "bypass",
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum OwnerReadError {
    #[error("the owner did not answer within {0:?}")]
    Timeout(Duration),
    #[error("owner read failed: {0}")]
    Failed(String),
}

/// What the owner holds for the calendars one read asked for, night by
/// night over the stay. Laid out once per query, not per search that shares
/// it: a page of a busy city shares one read with hundreds of searches.
#[derive(Debug)]
pub struct OwnerCalendars {
    /// Sorted by calendar; every calendar asked for, with or without rows.
    calendars: Vec<(CalendarKey, Box<[Option<NightCounts>]>)>,
    /// When the query was sent: its rows are at least this fresh.
    read_at: Instant,
}

impl OwnerCalendars {
    /// Places `rows` on the nights of `stay`; `keys` are sorted and unique.
    /// Also holds the copy's nights of a confirmed read (`Search::copy_nights`).
    pub(super) fn new(
        keys: &[CalendarKey],
        stay: Stay,
        read_at: Instant,
        rows: impl Iterator<Item = (CalendarKey, NaiveDate, NightCounts)>,
    ) -> OwnerCalendars {
        let len = usize::try_from(stay.len()).unwrap_or(0);
        let mut calendars: Vec<(CalendarKey, Box<[Option<NightCounts>]>)> = keys
            .iter()
            .map(|k| (*k, vec![None; len].into_boxed_slice()))
            .collect();
        for (key, night, counts) in rows {
            let Ok(at) = calendars.binary_search_by(|(k, _)| k.cmp(&key)) else {
                continue;
            };
            let day = (night - stay.check_in).num_days();
            if let Some(slot) = usize::try_from(day)
                .ok()
                .and_then(|d| calendars[at].1.get_mut(d))
            {
                *slot = Some(counts);
            }
        }
        OwnerCalendars { calendars, read_at }
    }

    /// The stay's nights of `key` (`None` for a night without a row), or
    /// `None` when this read did not ask for `key`.
    pub fn nights(&self, key: &CalendarKey) -> Option<&[Option<NightCounts>]> {
        let at = self.calendars.binary_search_by(|(k, _)| k.cmp(key)).ok()?;
        Some(&self.calendars[at].1)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ReadKey {
    keys: Vec<CalendarKey>,
    stay: Stay,
}

/// One cached owner read, in bytes, for the soak's accounting
/// (`vacancy_cache_estimated_bytes`). Its size follows the search, so this
/// is a typical one: a result page's 20 calendars over a 3-night stay. The
/// key (`ReadKey` and its 20 keys), the `Arc` (8) and its allocation (two
/// counts and `OwnerCalendars`), the calendars' list (a key and a boxed
/// slice each) and their nights, and moka's own per-entry cost. The TTL is
/// well under a second, so few are alive at any time.
pub const OWNER_READ_ENTRY_BYTES: u64 = (size_of::<ReadKey>()
    + TYPICAL_CALENDARS * size_of::<CalendarKey>()
    + size_of::<Arc<OwnerCalendars>>()
    + 16
    + size_of::<OwnerCalendars>()
    + TYPICAL_CALENDARS
        * (size_of::<(CalendarKey, Box<[Option<NightCounts>]>)>()
            + TYPICAL_NIGHTS * size_of::<Option<NightCounts>>()))
    as u64
    + metrics::MOKA_ENTRY_OVERHEAD_BYTES;
const TYPICAL_CALENDARS: usize = 20;
const TYPICAL_NIGHTS: usize = 3;

/// A read on a connection until it is answered. Dropped unanswered (it
/// failed, timed out, or its caller gave up first: the confirmed read's
/// fallback ends at its own share of the budget, a request is dropped),
/// it forgets the connection, since the owner may never answer it and a
/// later read pipelined behind it would wait for nothing. Forgotten only on
/// the error paths, a fallback cut short by its caller's deadline kept a
/// dead connection in the pool.
struct UnsettledRead<'r> {
    reader: &'r OwnerReader,
    slot: usize,
    client: Arc<Client>,
    settled: bool,
}

impl Drop for UnsettledRead<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.reader.forget(self.slot, &self.client);
        }
    }
}

pub struct OwnerReader {
    owner: OwnerSettings,
    /// `read_sql` of the schema the stream follows.
    sql: String,
    connect_timeout: Duration,
    timeout: Duration,
    clients: Vec<Mutex<Option<Prepared>>>,
    next: AtomicUsize,
    cache: Cache<ReadKey, Arc<OwnerCalendars>, FxBuildHasher>,
}

impl OwnerReader {
    pub fn new(owner: &OwnerSettings, settings: &SearchSettings, schema: &str) -> OwnerReader {
        OwnerReader {
            owner: owner.clone(),
            sql: read_sql(schema),
            connect_timeout: owner.connect_timeout(),
            timeout: Duration::from_millis(settings.owner_read_timeout_ms),
            clients: (0..settings.owner_read_connections)
                .map(|_| Mutex::new(None))
                .collect(),
            next: AtomicUsize::new(0),
            cache: Cache::builder()
                .eviction_listener(|_, _, cause| {
                    metrics::CACHE_EVICTIONS
                        .with_label_values(&["owner_read", metrics::removal_cause(cause)])
                        .inc();
                })
                .max_capacity(10_000)
                .time_to_live(Duration::from_millis(settings.owner_read_cache_ms))
                // A key holds a page's calendars; SipHash over them cost more
                // than the lookup it guards.
                .build_with_hasher(FxBuildHasher),
        }
    }

    /// Reads the stay's nights of `keys` from the owner, in one query, or
    /// shares a read of the same calendars and stay made within
    /// `owner_read_cache_ms`. With `not_before` (read-your-writes: when the
    /// search began), only a read sent after it will do: an earlier one may
    /// predate the guest's own write, so it is dropped and read again.
    /// Reads, errors and durations are counted once per query actually sent,
    /// not once per search that shared it.
    /// Cached reads now. moka's count trails inserts and expiries until its
    /// pending maintenance runs, so that runs first.
    pub async fn cached_reads(&self) -> u64 {
        self.cache.run_pending_tasks().await;
        self.cache.entry_count()
    }

    /// Every attempt, and the wait for a shared read, ends by `deadline`
    /// (one query at most `owner_read_timeout_ms`).
    pub async fn read(
        &self,
        keys: &[CalendarKey],
        stay: Stay,
        reason: Reason,
        not_before: Option<Instant>,
        deadline: tokio::time::Instant,
    ) -> Result<Arc<OwnerCalendars>, OwnerReadError> {
        let deadline = deadline.min(tokio::time::Instant::now() + self.timeout);
        let mut keys = keys.to_vec();
        keys.sort_unstable();
        keys.dedup();
        let key = ReadKey { keys, stay };
        let fresh_enough = |r: &OwnerCalendars| not_before.is_none_or(|t| r.read_at >= t);
        let sent = AtomicBool::new(false);
        // One budget for every attempt: a search may join a shared read
        // sent before it began, find it too old and read again, twice;
        // each with a timeout of its own, that took up to three budgets.
        let attempts = async {
            let mut result = self.shared_read(&key, reason, &sent, deadline).await;
            if result.as_deref().is_ok_and(|r| !fresh_enough(r)) {
                self.cache.invalidate(&key).await;
                result = self.shared_read(&key, reason, &sent, deadline).await;
                if result.as_deref().is_ok_and(|r| !fresh_enough(r)) {
                    // Another search put back a read older than ours may be.
                    sent.store(true, Ordering::Relaxed);
                    result = self
                        .counted_query(&key, reason, deadline)
                        .await
                        .map(Arc::new);
                }
            }
            result
        };
        // A query cut by the deadline ends by it on its own first (the same
        // instant, polled first), so it is counted as failed; this bounds
        // the wait for another search's shared read.
        let result = tokio::time::timeout_at(deadline, attempts)
            .await
            .unwrap_or(Err(OwnerReadError::Timeout(self.timeout)));
        let looked_up = if sent.load(Ordering::Relaxed) {
            "miss"
        } else {
            "hit"
        };
        metrics::CACHE_REQUESTS
            .with_label_values(&["owner_read", looked_up])
            .inc();
        result
    }

    /// The cached read of `key`, or one query for it that concurrent
    /// searches share; `sent` is set when this search sent it.
    async fn shared_read(
        &self,
        key: &ReadKey,
        reason: Reason,
        sent: &AtomicBool,
        deadline: tokio::time::Instant,
    ) -> Result<Arc<OwnerCalendars>, OwnerReadError> {
        self.cache
            .try_get_with_by_ref(key, async {
                sent.store(true, Ordering::Relaxed);
                self.counted_query(key, reason, deadline)
                    .await
                    .map(Arc::new)
            })
            .await
            .map_err(|e: Arc<OwnerReadError>| (*e).clone())
    }

    /// One query, with the timeout, counted in the metrics.
    async fn counted_query(
        &self,
        key: &ReadKey,
        reason: Reason,
        deadline: tokio::time::Instant,
    ) -> Result<OwnerCalendars, OwnerReadError> {
        metrics::OWNER_READS
            .with_label_values(&[reason.label()])
            .inc();
        let started = Instant::now();
        let result = self.query(key, deadline).await;
        metrics::OWNER_READ_DURATION
            .with_label_values(&[reason.label()])
            .observe(started.elapsed().as_secs_f64());
        if result.is_err() {
            metrics::OWNER_READ_ERRORS
                .with_label_values(&[reason.label()])
                .inc();
        }
        result
    }

    /// The owner's flushed WAL position (`pg_current_wal_flush_lsn()`), on
    /// one of the read connections, within the read timeout. Flushed, not
    /// inserted: a commit is visible to the owner's readers only once its
    /// record is flushed, and only then can the copy receive it, so this is
    /// the position a fresh read at this moment would reflect.
    pub async fn flushed_position(&self) -> Result<crate::lsn::Lsn, OwnerReadError> {
        let row = self
            .on_a_client(
                tokio::time::Instant::now() + self.timeout,
                |client, _| async move {
                    client
                        .query_one("SELECT pg_current_wal_flush_lsn()", &[])
                        .await
                },
            )
            .await?;
        row.try_get::<_, tokio_postgres::types::PgLsn>(0)
            .map(crate::lsn::Lsn::from)
            .map_err(|e| OwnerReadError::Failed(e.to_string()))
    }

    /// Runs `read` on one of the connections, all by `deadline` (at most
    /// the read timeout from the first attempt of a read).
    ///
    /// A connection whose read failed or timed out is dropped, never used
    /// again: tokio-postgres pipelines requests on a connection, so the
    /// abandoned read's answer must arrive before any later one's. On a
    /// path that drops packets it never does, and every later search on
    /// that connection would wait its whole budget for nothing until the
    /// kernel gave up (`owner.tcp_user_timeout_ms`, or about 15 minutes
    /// without it). The next read on the slot opens a new connection. So is
    /// one whose caller gave up first (`UnsettledRead`).
    async fn on_a_client<T, F, Fut>(
        &self,
        deadline: tokio::time::Instant,
        read: F,
    ) -> Result<T, OwnerReadError>
    where
        F: FnOnce(Arc<Client>, Statement) -> Fut,
        Fut: std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    {
        let timed_out = || OwnerReadError::Timeout(self.timeout);
        // A connect or prepare cut short stores nothing (`client`).
        let (slot, client, statement) = tokio::time::timeout_at(deadline, self.client())
            .await
            .map_err(|_| timed_out())??;
        let mut unsettled = UnsettledRead {
            reader: self,
            slot,
            client: client.clone(),
            settled: false,
        };
        match tokio::time::timeout_at(deadline, read(client, statement)).await {
            Ok(Ok(answer)) => {
                unsettled.settled = true;
                Ok(answer)
            }
            Ok(Err(e)) => Err(OwnerReadError::Failed(e.to_string())),
            Err(_) => Err(timed_out()),
        }
    }

    /// Empties `slot` if it still holds `client` (`UnsettledRead`): a
    /// search that already put a new connection there keeps it.
    fn forget(&self, slot: usize, client: &Arc<Client>) {
        let mut held = self.clients[slot].lock().unwrap_or_else(|p| p.into_inner());
        if held.as_ref().is_some_and(|(c, _)| Arc::ptr_eq(c, client)) {
            *held = None;
        }
    }

    /// A connection with the read prepared on it: one round trip per read.
    async fn client(&self) -> Result<(usize, Arc<Client>, Statement), OwnerReadError> {
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.clients.len();
        let existing = self.clients[slot]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some((c, s)) = existing.filter(|(c, _)| !c.is_closed()) {
            return Ok((slot, c, s));
        }
        let failed = |e: &dyn std::fmt::Display| OwnerReadError::Failed(e.to_string());
        let c = Arc::new(
            owner::connect_configured(&self.owner, self.connect_timeout)
                .await
                .map_err(|e| failed(&e))?,
        );
        let s = c.prepare(&self.sql).await.map_err(|e| failed(&e))?;
        *self.clients[slot].lock().unwrap_or_else(|p| p.into_inner()) =
            Some((c.clone(), s.clone()));
        Ok((slot, c, s))
    }

    async fn query(
        &self,
        key: &ReadKey,
        deadline: tokio::time::Instant,
    ) -> Result<OwnerCalendars, OwnerReadError> {
        let read_at = Instant::now();
        let hotels: Vec<i64> = key.keys.iter().map(|k| k.hotel_id).collect();
        let room_types: Vec<i64> = key.keys.iter().map(|k| k.room_type_id).collect();
        let stay = key.stay;
        let found = self
            .on_a_client(deadline, |client, statement| async move {
                client
                    .query(
                        &statement,
                        &[&hotels, &room_types, &stay.check_in, &stay.check_out],
                    )
                    .await
            })
            .await?;
        let mut nights = Vec::with_capacity(found.len());
        for row in &found {
            if let Some(night) =
                owner::inventory_night(row).map_err(|e| OwnerReadError::Failed(e.to_string()))?
            {
                nights.push(night);
            }
        }
        Ok(OwnerCalendars::new(
            &key.keys,
            key.stay,
            read_at,
            nights.into_iter(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_land_on_their_calendar_and_night() {
        let day = |d: u32| NaiveDate::from_ymd_opt(2030, 1, d).unwrap();
        let key = |hotel_id, room_type_id| CalendarKey {
            hotel_id,
            room_type_id,
        };
        let counts = |taken| NightCounts {
            taken,
            total: 5,
            sell_limit: None,
            price_cents: Some(100),
        };
        let stay = Stay {
            check_in: day(10),
            check_out: day(13),
        };
        let asked = [key(1, 1), key(1, 2), key(2, 7)];
        let rows = [
            (key(2, 7), day(12), counts(3)),
            (key(1, 1), day(10), counts(1)),
            (key(1, 1), day(11), counts(2)),
            // Neither asked for nor inside the stay: both are dropped.
            (key(9, 9), day(10), counts(4)),
            (key(1, 1), day(13), counts(4)),
        ];
        let read = OwnerCalendars::new(&asked, stay, Instant::now(), rows.into_iter());
        assert_eq!(
            read.nights(&key(1, 1)),
            Some(&[Some(counts(1)), Some(counts(2)), None][..])
        );
        // Asked for, no row at all: every night is missing, not "not read".
        assert_eq!(read.nights(&key(1, 2)), Some(&[None, None, None][..]));
        assert_eq!(
            read.nights(&key(2, 7)),
            Some(&[None, None, Some(counts(3))][..])
        );
        assert_eq!(read.nights(&key(9, 9)), None);
    }
}

//! Owner reads: the few rows a search must not show from the copy.
//!
//! When few units remain, a stale count misleads the guest most, so those
//! rows are read from the owner before the answer goes out: one query per
//! search, identical concurrent reads coalesced through a `moka` cache with a
//! TTL well under a second, a timeout, and a small set of pipelined
//! connections (a `tokio_postgres::Client` serves concurrent queries).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::NaiveDate;
use moka::future::Cache;
use tokio_postgres::{Client, Statement};

use super::params::Stay;
use crate::config::Settings;
use crate::metrics;
use crate::model::{CalendarKey, NightCounts};
use crate::owner;

/// One index range per calendar (the primary key leads with hotel, room
/// type, night), whatever the number of keys.
const READ_SQL: &str =
    "SELECT i.hotel_id, i.room_type_id, i.night, i.total, i.taken, i.sell_limit, i.price_cents
     FROM unnest($1::bigint[], $2::bigint[]) AS k(hotel_id, room_type_id)
     JOIN inventory i USING (hotel_id, room_type_id)
     WHERE i.night >= $3 AND i.night < $4";

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

/// Rows read: (calendar, night) → counts; a night missing here has no row.
pub type OwnerRows = Vec<(CalendarKey, NaiveDate, NightCounts)>;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ReadKey {
    keys: Vec<CalendarKey>,
    stay: Stay,
}

pub struct OwnerReader {
    owner: crate::config::OwnerSettings,
    connect_timeout: Duration,
    timeout: Duration,
    clients: Vec<Mutex<Option<Prepared>>>,
    next: AtomicUsize,
    cache: Cache<ReadKey, Arc<OwnerRows>>,
}

impl OwnerReader {
    pub fn new(settings: &Settings) -> OwnerReader {
        OwnerReader {
            owner: settings.owner.clone(),
            connect_timeout: settings.connect_timeout(),
            timeout: Duration::from_millis(settings.search.owner_read_timeout_ms),
            clients: (0..settings.search.owner_read_connections)
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
                .time_to_live(Duration::from_millis(settings.search.owner_read_cache_ms))
                .build(),
        }
    }

    /// Reads the stay's nights of `keys` from the owner, in one query.
    /// Reads, errors and durations are counted once per query actually sent,
    /// not once per search that shared it.
    pub async fn read(
        &self,
        keys: &[CalendarKey],
        stay: Stay,
        reason: Reason,
    ) -> Result<Arc<OwnerRows>, OwnerReadError> {
        let mut keys = keys.to_vec();
        keys.sort();
        keys.dedup();
        let key = ReadKey { keys, stay };
        let sent = std::sync::atomic::AtomicBool::new(false);
        let result = self
            .cache
            .try_get_with(key.clone(), async {
                sent.store(true, Ordering::Relaxed);
                metrics::OWNER_READS
                    .with_label_values(&[reason.label()])
                    .inc();
                let started = Instant::now();
                let result = match tokio::time::timeout(self.timeout, self.query(&key)).await {
                    Ok(r) => r.map(Arc::new),
                    Err(_) => Err(OwnerReadError::Timeout(self.timeout)),
                };
                metrics::OWNER_READ_DURATION
                    .with_label_values(&[reason.label()])
                    .observe(started.elapsed().as_secs_f64());
                if result.is_err() {
                    metrics::OWNER_READ_ERRORS
                        .with_label_values(&[reason.label()])
                        .inc();
                }
                result
            })
            .await
            .map_err(|e: Arc<OwnerReadError>| (*e).clone());
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
        let s = c.prepare(READ_SQL).await.map_err(|e| failed(&e))?;
        *self.clients[slot].lock().unwrap_or_else(|p| p.into_inner()) =
            Some((c.clone(), s.clone()));
        Ok((slot, c, s))
    }

    async fn query(&self, key: &ReadKey) -> Result<OwnerRows, OwnerReadError> {
        let (slot, client, statement) = self.client().await?;
        let hotels: Vec<i64> = key.keys.iter().map(|k| k.hotel_id).collect();
        let room_types: Vec<i64> = key.keys.iter().map(|k| k.room_type_id).collect();
        let rows = client
            .query(
                &statement,
                &[
                    &hotels,
                    &room_types,
                    &key.stay.check_in,
                    &key.stay.check_out,
                ],
            )
            .await
            .map_err(|e| {
                *self.clients[slot].lock().unwrap_or_else(|p| p.into_inner()) = None;
                OwnerReadError::Failed(e.to_string())
            })?;
        Ok(rows
            .iter()
            .map(|r| {
                (
                    CalendarKey {
                        hotel_id: r.get(0),
                        room_type_id: r.get(1),
                    },
                    r.get(2),
                    NightCounts {
                        total: r.get(3),
                        taken: r.get(4),
                        sell_limit: r.get(5),
                        price_cents: r.get(6),
                    },
                )
            })
            .collect())
    }
}

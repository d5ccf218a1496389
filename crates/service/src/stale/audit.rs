//! The divergence audit: sample rows of the copy, read them from the owner,
//! and count the ones that differ although the copy is past the read.
//!
//! One pass:
//! 1. Sample keys (hotel, room type, night) from the copy.
//! 2. Read those rows from the owner in one statement, with each row's
//!    `xmin` (the transaction that wrote its current version). One
//!    statement sees one snapshot.
//! 3. Then read `pg_current_wal_insert_lsn()` → `L`. Every transaction
//!    visible to that snapshot inserted its commit record before the
//!    snapshot was taken, so before `L` (the insert position only grows).
//!    Reading `L` in a later statement only makes it larger, so it is safe
//!    without a shared transaction.
//! 4. Wait (bounded) until the copy has applied `L`: by the projector's
//!    invariant, every change the snapshot saw is then in the copy.
//! 5. Compare. The copy may also hold changes newer than the snapshot, so a
//!    difference is only a suspect. Read the suspects again: a row whose
//!    `xmin` is still the same was not written since step 2, so the copy
//!    (whose applied position is before this second read) must show exactly
//!    the value read in step 2. Those count as mismatches; rows written in
//!    between are skipped (a later pass samples again). On a healthy stream
//!    the count therefore stays 0 however busy the owner is.
//!
//!    The second read must also see every transaction the copy had applied
//!    when it was compared: a commit reaches the stream before other
//!    sessions see it (for a standby round trip under synchronous
//!    replication), and a row the copy already shows changed would look
//!    unwritten to a read that misses it. So the second read returns its
//!    snapshot, checked against the xids the copy had applied
//!    (`owner::visibility`, `model::xids`), and is made again while it hides
//!    one of them; past `audit_wait_ms` the suspects are skipped.
//!
//! Neither lock nor transaction is held on the owner while waiting for the
//! copy, so the audit never slows a take.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, NaiveDate, Utc};
use rand::RngExt;
use serde::Serialize;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::lsn::Lsn;
use crate::metrics;
use crate::model::xids::XidMark;
use crate::model::{CalendarKey, NightCounts, ReadModel, Tables};
use crate::owner::visibility::{self, VisibilityError};
use crate::owner::{self, OwnerError};

/// One sampled row of the copy.
pub type Key = (CalendarKey, NaiveDate);

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("the copy is not ready to be audited")]
    NotReady,
    #[error(transparent)]
    Connect(#[from] OwnerError),
    #[error("owner read failed: {0}")]
    Query(#[from] tokio_postgres::Error),
    #[error("the owner did not answer within {0:?}")]
    Timeout(Duration),
    #[error(transparent)]
    Visibility(#[from] VisibilityError),
    #[error("the copy did not reach {target} within {waited:?}")]
    NotCaughtUp { target: Lsn, waited: Duration },
}

/// What one pass found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct PassReport {
    /// Rows compared (sampled minus skipped).
    pub checked: u64,
    /// Rows the copy shows differently from the owner, with the copy past the read.
    pub mismatches: u64,
    /// Rows written on the owner while the pass ran: not judged this time.
    pub skipped: u64,
    /// The owner position the copy was compared at (or past).
    #[schema(value_type = String, example = "0/16B3748")]
    pub lsn: Lsn,
    /// Up to ten mismatching keys (ids only, never row values).
    #[schema(value_type = Vec<Object>)]
    pub examples: Vec<MismatchKey>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct MismatchKey {
    pub hotel_id: i64,
    pub room_type_id: i64,
    pub night: NaiveDate,
}

/// The audit's figures since start, for `/v1/stale-reads`.
#[derive(Debug, Clone, Default, Serialize, utoipa::ToSchema)]
pub struct AuditStatus {
    pub enabled: bool,
    pub passes: u64,
    pub checked: u64,
    pub mismatches: u64,
    pub skipped: u64,
    pub last_pass: Option<PassReport>,
    pub last_pass_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

#[derive(Debug, Clone)]
pub struct AuditSettings {
    pub owner: crate::owner::OwnerSettings,
    pub schema: String,
    pub connect_timeout: Duration,
    pub query_timeout: Duration,
    pub sample: usize,
    pub wait: Duration,
    pub interval: Duration,
    /// How long a hotel stays marked diverging after a pass found one of
    /// its rows wrong (search gives it row reads, not confirmed ones).
    pub diverging_for: Duration,
}

/// Most hotels remembered as diverging; past it the oldest marks go first.
/// A healthy stream has none, so the bound only matters when the copy is
/// badly broken, and then the stale-read share says so too.
const MAX_DIVERGING_HOTELS: usize = 10_000;

pub struct Audit {
    settings: AuditSettings,
    model: Arc<ReadModel>,
    /// One connection, shared: a pass uses single statements only (no
    /// transaction), so concurrent passes cannot interleave inside one.
    client: Mutex<Option<Arc<Client>>>,
    passes: AtomicU64,
    checked: AtomicU64,
    mismatches: AtomicU64,
    skipped: AtomicU64,
    last: Mutex<LastPass>,
    /// Hotels with a mismatch, and when it was last found.
    diverging: Mutex<HashMap<i64, Instant>>,
    /// Some hotel has a mark (maybe expired): every search asks, and on a
    /// healthy stream this spares it the lock.
    any_diverging: AtomicBool,
}

/// The latest pass's result and when it ran, and the latest error.
#[derive(Debug, Clone, Default)]
struct LastPass {
    report: Option<PassReport>,
    at: Option<DateTime<Utc>>,
    error: Option<String>,
}

/// One row as the owner has it: the counts and the writer of this version.
#[derive(Debug, Clone, PartialEq, Eq)]
struct OwnerRow {
    counts: NightCounts,
    xmin: String,
}

impl Audit {
    pub fn new(settings: AuditSettings, model: Arc<ReadModel>) -> Audit {
        Audit {
            settings,
            model,
            client: Mutex::new(None),
            passes: AtomicU64::new(0),
            checked: AtomicU64::new(0),
            mismatches: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            last: Mutex::new(LastPass::default()),
            diverging: Mutex::new(HashMap::new()),
            any_diverging: AtomicBool::new(false),
        }
    }

    /// The hotels among `ids` a pass found diverging within
    /// `diverging_for`. A confirmed read trusts the copy, so it cannot show
    /// such a hotel's rows right; search reads them from the owner instead.
    pub fn diverging_hotels(&self, ids: impl Iterator<Item = i64>) -> HashSet<i64> {
        if !self.any_diverging.load(Ordering::Acquire) {
            return HashSet::new();
        }
        let marks = self.diverging.lock().unwrap_or_else(|p| p.into_inner());
        if marks.is_empty() {
            return HashSet::new();
        }
        let now = Instant::now();
        ids.filter(|id| {
            marks
                .get(id)
                .is_some_and(|at| now.duration_since(*at) < self.settings.diverging_for)
        })
        .collect()
    }

    /// Marks `hotels` as diverging now, forgetting expired marks (and, past
    /// the bound, the oldest).
    fn mark_diverging(&self, hotels: impl Iterator<Item = i64>) {
        let now = Instant::now();
        let mut marks = self.diverging.lock().unwrap_or_else(|p| p.into_inner());
        marks.retain(|_, at| now.duration_since(*at) < self.settings.diverging_for);
        for id in hotels {
            marks.insert(id, now);
        }
        while marks.len() > MAX_DIVERGING_HOTELS {
            let Some(oldest) = marks.iter().min_by_key(|(_, at)| **at).map(|(id, _)| *id) else {
                break;
            };
            marks.remove(&oldest);
        }
        self.any_diverging
            .store(!marks.is_empty(), Ordering::Release);
    }

    pub fn status(&self) -> AuditStatus {
        let LastPass {
            report: last_pass,
            at: last_pass_at,
            error: last_error,
        } = self.last.lock().unwrap_or_else(|p| p.into_inner()).clone();
        AuditStatus {
            enabled: !self.settings.interval.is_zero(),
            passes: self.passes.load(Ordering::Relaxed),
            checked: self.checked.load(Ordering::Relaxed),
            mismatches: self.mismatches.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
            last_pass,
            last_pass_at,
            last_error,
        }
    }

    async fn client(&self) -> Result<Arc<Client>, AuditError> {
        let existing = self
            .client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(c) = existing.filter(|c| !c.is_closed()) {
            return Ok(c);
        }
        let c = Arc::new(
            owner::connect_configured(&self.settings.owner, self.settings.connect_timeout).await?,
        );
        *self.client.lock().unwrap_or_else(|p| p.into_inner()) = Some(c.clone());
        Ok(c)
    }

    fn forget_client(&self) {
        *self.client.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Runs one pass and records its result.
    pub async fn pass(&self) -> Result<PassReport, AuditError> {
        let result = self.pass_inner().await;
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        match &result {
            Ok(report) => {
                self.passes.fetch_add(1, Ordering::Relaxed);
                self.checked.fetch_add(report.checked, Ordering::Relaxed);
                self.mismatches
                    .fetch_add(report.mismatches, Ordering::Relaxed);
                self.skipped.fetch_add(report.skipped, Ordering::Relaxed);
                metrics::DIVERGENCE_CHECKED.inc_by(report.checked);
                metrics::DIVERGENCE_MISMATCHES.inc_by(report.mismatches);
                metrics::DIVERGENCE_LAST_PASS.set(report.mismatches as i64);
                *last = LastPass {
                    report: Some(report.clone()),
                    at: Some(Utc::now()),
                    error: None,
                };
            }
            Err(e) => last.error = Some(e.to_string()),
        }
        result
    }

    async fn pass_inner(&self) -> Result<PassReport, AuditError> {
        if !self.model.freshness.is_loaded() || self.model.freshness.is_replacing() {
            return Err(AuditError::NotReady);
        }
        let keys = {
            let t = self.model.read();
            sample(&t, self.settings.sample, &mut rand::rng())
        };
        if keys.is_empty() {
            return Ok(PassReport::default());
        }
        let client = self.client().await?;
        let first = self.read_rows(&client, &keys).await?;
        let lsn = self.owner_lsn(&client).await?;
        self.wait_for(lsn).await?;
        let (suspects, applied) = {
            let t = self.model.read();
            // Everything the copy shows now was recorded before this mark.
            let applied = self.model.xids.mark();
            let suspects = keys
                .iter()
                .zip(&first)
                .enumerate()
                .filter(|(_, ((key, night), owner))| {
                    copy_value(&t, key, *night) != owner.as_ref().map(|r| r.counts)
                })
                .map(|(i, _)| i)
                .collect::<Vec<usize>>();
            (suspects, applied)
        };
        let mut report = PassReport {
            lsn,
            ..PassReport::default()
        };
        if !suspects.is_empty() {
            let again_keys: Vec<Key> = suspects.iter().map(|i| keys[*i]).collect();
            match self.reread_rows(&client, &again_keys, applied).await? {
                Some(again) => {
                    let mut diverging = Vec::new();
                    for (i, now) in suspects.iter().zip(&again) {
                        // Same version (same xmin and values), or still no
                        // row: the owner did not write it since the first read.
                        if first[*i] == *now {
                            report.mismatches += 1;
                            diverging.push(keys[*i].0.hotel_id);
                            if report.examples.len() < 10 {
                                let (key, night) = keys[*i];
                                report.examples.push(MismatchKey {
                                    hotel_id: key.hotel_id,
                                    room_type_id: key.room_type_id,
                                    night,
                                });
                            }
                        } else {
                            report.skipped += 1;
                        }
                    }
                    self.mark_diverging(diverging.into_iter());
                }
                // The owner kept hiding a commit the copy had: judged next time.
                None => report.skipped += suspects.len() as u64,
            }
        }
        report.checked = keys.len() as u64 - report.skipped;
        if report.mismatches > 0 {
            tracing::warn!(
                mismatches = report.mismatches,
                checked = report.checked,
                lsn = %lsn,
                "the copy differs from the owner"
            );
        }
        Ok(report)
    }

    /// The owner's rows for `keys`, in their order (`None` where it has none).
    async fn read_rows(
        &self,
        client: &Client,
        keys: &[Key],
    ) -> Result<Vec<Option<OwnerRow>>, AuditError> {
        let (hotels, types, nights) = key_columns(keys);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&hotels, &types, &nights];
        let rows = self
            .timed_read(client.query(&self.rows_sql(), &params))
            .await?;
        place_rows(keys.len(), &rows)
    }

    /// `read_rows` in a snapshot that sees every transaction the copy had
    /// applied by `applied`; `None` when the owner hid one of them for all
    /// of `audit_wait_ms`.
    async fn reread_rows(
        &self,
        client: &Client,
        keys: &[Key],
        applied: XidMark,
    ) -> Result<Option<Vec<Option<OwnerRow>>>, AuditError> {
        let (hotels, types, nights) = key_columns(keys);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&hotels, &types, &nights];
        let statement = visibility::seeing(&self.rows_sql());
        let read = visibility::read_seeing(
            client,
            &statement,
            &params,
            (&self.model.xids, applied),
            self.settings.wait,
        );
        match self.timed_read(read).await? {
            Some(rows) => Ok(Some(place_rows(keys.len(), &rows)?)),
            None => Ok(None),
        }
    }

    fn rows_sql(&self) -> String {
        format!(
            "SELECT k.ord, i.total, i.taken, i.sell_limit, i.price_cents, i.xmin::text
             FROM unnest($1::bigint[], $2::bigint[], $3::date[]) WITH ORDINALITY
                  AS k(hotel_id, room_type_id, night, ord)
             JOIN {}.inventory i USING (hotel_id, room_type_id, night)",
            self.settings.schema
        )
    }

    /// One owner read, counted and timed in the metrics, bounded by the
    /// query timeout plus the wait a judged read may spend.
    async fn timed_read<T, E>(
        &self,
        read: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, AuditError>
    where
        AuditError: From<E>,
    {
        metrics::OWNER_READS.with_label_values(&["audit"]).inc();
        let started = std::time::Instant::now();
        let limit = self.settings.query_timeout + self.settings.wait;
        let failed = || {
            self.forget_client();
            metrics::OWNER_READ_ERRORS
                .with_label_values(&["audit"])
                .inc();
        };
        let result = match tokio::time::timeout(limit, read).await {
            Ok(Ok(rows)) => rows,
            Ok(Err(e)) => {
                failed();
                return Err(e.into());
            }
            Err(_) => {
                failed();
                return Err(AuditError::Timeout(limit));
            }
        };
        metrics::OWNER_READ_DURATION
            .with_label_values(&["audit"])
            .observe(started.elapsed().as_secs_f64());
        Ok(result)
    }

    async fn owner_lsn(&self, client: &Client) -> Result<Lsn, AuditError> {
        let query = client.query_one("SELECT pg_current_wal_insert_lsn()", &[]);
        match tokio::time::timeout(self.settings.query_timeout, query).await {
            Ok(Ok(row)) => Ok(row.try_get::<_, tokio_postgres::types::PgLsn>(0)?.into()),
            Ok(Err(e)) => {
                self.forget_client();
                Err(e.into())
            }
            Err(_) => {
                self.forget_client();
                Err(AuditError::Timeout(self.settings.query_timeout))
            }
        }
    }

    /// Waits, bounded by `audit_wait_ms`, for the copy to apply `target`.
    async fn wait_for(&self, target: Lsn) -> Result<(), AuditError> {
        let deadline = tokio::time::Instant::now() + self.settings.wait;
        loop {
            if self.model.freshness.applied() >= target {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(AuditError::NotCaughtUp {
                    target,
                    waited: self.settings.wait,
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The keys as the three arrays the owner read unnests.
fn key_columns(keys: &[Key]) -> (Vec<i64>, Vec<i64>, Vec<NaiveDate>) {
    (
        keys.iter().map(|(k, _)| k.hotel_id).collect(),
        keys.iter().map(|(k, _)| k.room_type_id).collect(),
        keys.iter().map(|(_, n)| *n).collect(),
    )
}

/// The rows of an owner read in the order of its `n` keys.
fn place_rows(n: usize, rows: &[tokio_postgres::Row]) -> Result<Vec<Option<OwnerRow>>, AuditError> {
    let mut out = vec![None; n];
    for row in rows {
        let ord: i64 = row.try_get(0)?;
        // ORDINALITY counts from 1; a value outside the keys is ignored.
        let Some(slot) = usize::try_from(ord - 1).ok().and_then(|i| out.get_mut(i)) else {
            continue;
        };
        *slot = Some(OwnerRow {
            counts: NightCounts {
                total: row.try_get(1)?,
                taken: row.try_get(2)?,
                sell_limit: row.try_get(3)?,
                price_cents: row.try_get(4)?,
            },
            xmin: row.try_get(5)?,
        });
    }
    Ok(out)
}

/// The copy's value for one row.
fn copy_value(t: &Tables, key: &CalendarKey, night: NaiveDate) -> Option<NightCounts> {
    t.calendars.get(key).and_then(|c| c.get(night))
}

/// Up to `n` distinct rows of the copy: every row when there are at most
/// `n`, otherwise random calendars and a random night of each. Runs under
/// one copy of the model, so it allocates one pointer per calendar and no more.
pub fn sample(t: &Tables, n: usize, rng: &mut impl RngExt) -> Vec<Key> {
    if n == 0 {
        return Vec::new();
    }
    if t.inventory_rows() <= n as u64 {
        let mut all: Vec<Key> = t
            .calendars
            .iter()
            .flat_map(|(k, c)| c.iter().map(move |(night, _)| (k, night)))
            .collect();
        all.sort();
        return all;
    }
    let calendars: Vec<_> = t.calendars.iter().filter(|(_, c)| !c.is_empty()).collect();
    let mut picked = HashSet::with_capacity(n);
    // Bounded tries: duplicates are dropped, never retried forever.
    for _ in 0..n * 2 {
        if picked.len() >= n {
            break;
        }
        let (key, cal) = calendars[rng.random_range(0..calendars.len())];
        if let Some((night, _)) = cal.iter().nth(rng.random_range(0..cal.len())) {
            picked.insert((key, night));
        }
    }
    let mut out: Vec<Key> = picked.into_iter().collect();
    out.sort();
    out
}

/// Runs a pass every `interval` until shutdown. Errors are logged and the
/// next pass tries again (a copy still loading is simply not audited yet).
pub async fn run(audit: Arc<Audit>, shutdown: CancellationToken) {
    let interval = audit.settings.interval;
    if interval.is_zero() {
        return;
    }
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let pass = audit.pass();
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            result = pass => match result {
                Ok(_) | Err(AuditError::NotReady) => {}
                Err(error) => tracing::debug!(%error, "audit pass failed"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn tables(calendars: i64, nights: u64) -> Tables {
        let mut t = Tables::default();
        let day = NaiveDate::from_ymd_opt(2030, 1, 1).unwrap();
        for c in 0..calendars {
            let key = CalendarKey {
                hotel_id: c,
                room_type_id: 1,
            };
            for n in 0..nights {
                t.calendars.set(
                    key,
                    day + chrono::Days::new(n),
                    NightCounts {
                        total: 3,
                        taken: 1,
                        sell_limit: None,
                        price_cents: None,
                    },
                );
            }
        }
        t
    }

    #[test]
    fn a_small_copy_is_sampled_whole() {
        let t = tables(3, 4);
        let s = sample(&t, 12, &mut ChaCha8Rng::seed_from_u64(1));
        assert_eq!(s.len(), 12);
        assert_eq!(s.iter().collect::<HashSet<_>>().len(), 12);
    }

    #[test]
    fn a_large_copy_gives_at_most_n_distinct_existing_rows() {
        let t = tables(50, 30);
        let s = sample(&t, 20, &mut ChaCha8Rng::seed_from_u64(2));
        assert!(!s.is_empty() && s.len() <= 20);
        assert_eq!(s.iter().collect::<HashSet<_>>().len(), s.len());
        assert!(s.iter().all(|(k, n)| copy_value(&t, k, *n).is_some()));
        assert!(sample(&Tables::default(), 20, &mut ChaCha8Rng::seed_from_u64(3)).is_empty());
        assert!(sample(&t, 0, &mut ChaCha8Rng::seed_from_u64(3)).is_empty());
    }
}

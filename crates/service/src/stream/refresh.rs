//! Refresh: the TTL safety net behind the stream.
//!
//! The stream is the copy's source of truth, but a change it never delivers
//! (a table left out of the publication for a moment, say) would otherwise
//! stay wrong forever. So every calendar (one hotel's room type) carries a
//! time to live in a `moka` cache of confirmations: the stream confirms a
//! calendar whenever it applies a change to it, a re-read from the owner
//! confirms it too, and a calendar that neither confirmed within the TTL is
//! queued for a re-read.
//!
//! A re-read races the stream, and must never put an older value over a
//! newer one. It follows Netflix's DBLog watermark method: the refresher
//! registers a window, writes a low watermark (`pg_logical_emit_message`,
//! transactional, so it lands in commit order), reads the calendars, then
//! writes a high watermark. From the window's registration (not just from
//! the low watermark: WAL commit order is not visibility order, see
//! `RereadWindow::changed`) to the high watermark the projector notes every night
//! the stream changed in those calendars; at the high watermark it merges the
//! rows read, except those nights, whose stream values are at least as new.
//! A window whose watermarks do not both arrive (a reconnect, a resnapshot)
//! is abandoned and its calendars queued again.
//!
//! The read itself must see every transaction the copy applied before the
//! window was registered, or the merge would put the owner's older rows over
//! them. A commit reaches the stream before other sessions see it (for a
//! standby round trip under synchronous replication), so the read returns
//! its snapshot, which is checked against the xids the copy had applied at
//! registration (`owner::visibility`, `model::xids`); it is made again, or
//! the window given up, while such a commit is still hidden from it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::NaiveDate;
use moka::notification::RemovalCause;
use moka::sync::Cache;
use rand::RngExt;
use tokio_util::sync::CancellationToken;

use super::txn::OwnMessage;
use crate::metrics;
use crate::model::xids::XidMark;
use crate::model::{CalendarKey, Change, NightCounts, ReadModel, Table, Tables, Transaction};
use crate::owner::visibility;
use crate::owner::{self, OwnerSettings};

/// Prefix of the watermark messages; contents are `low:<id>` and `high:<id>`.
pub const WATERMARK_PREFIX: &str = "vacancy.wm";

/// How long a window may wait for its high watermark before it is abandoned.
const WINDOW_TIMEOUT: Duration = Duration::from_secs(60);

/// One calendar's confirmation: its time to live, from when it was given.
/// `at` is kept so the remaining TTL can be read back (moka does not say),
/// which a checkpoint carries across a restart.
#[derive(Debug, Clone, Copy)]
struct Confirmation {
    ttl: Duration,
    at: Instant,
}

impl Confirmation {
    fn now(ttl: Duration) -> Confirmation {
        Confirmation {
            ttl,
            at: Instant::now(),
        }
    }
}

/// Per-entry time to live: the value carries the entry's own TTL.
struct OwnTtl;

impl moka::Expiry<CalendarKey, Confirmation> for OwnTtl {
    fn expire_after_create(
        &self,
        _: &CalendarKey,
        confirmation: &Confirmation,
        _: std::time::Instant,
    ) -> Option<Duration> {
        Some(confirmation.ttl)
    }

    fn expire_after_update(
        &self,
        _: &CalendarKey,
        confirmation: &Confirmation,
        _: std::time::Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        // A confirmation starts the TTL over.
        Some(confirmation.ttl)
    }
}

/// A re-read in flight between its watermarks.
#[derive(Debug)]
struct RereadWindow {
    keys: HashSet<CalendarKey>,
    rows: Option<Vec<(CalendarKey, NaiveDate, NightCounts)>>,
    opened: bool,
    /// Nights the stream changed since the window was registered: theirs is
    /// at least as new as the read's. Counted from registration, before the
    /// low watermark is written, because PostgreSQL's commit order in the
    /// WAL is not its visibility order: a transaction whose commit record
    /// precedes the low watermark can still be invisible to the read's
    /// snapshot for a moment (committed, not yet marked so in the proc
    /// array), and counting from the low watermark would let the read's
    /// older value overwrite that transaction's change.
    changed: HashSet<(CalendarKey, NaiveDate)>,
    /// An inventory truncate since registration: every night the read saw may
    /// be older than the stream's, so the window is read again instead.
    truncated: bool,
    registered: Instant,
}

/// The safety net's shared state: confirmations, the due queue, open windows.
pub struct Refresh {
    ttl: Duration,
    confirmations: Cache<CalendarKey, Confirmation>,
    /// Calendars whose TTL ran out. Bounded by the number of calendars: a key
    /// leaves the cache when it enters here and returns only once re-read.
    due: Arc<Mutex<VecDeque<CalendarKey>>>,
    windows: Mutex<HashMap<u64, RereadWindow>>,
    next_window: AtomicU64,
    /// Nights whose re-read value differed from the copy (and was repaired).
    pub repaired: AtomicU64,
    /// Windows merged into the copy.
    pub merged: AtomicU64,
    /// Re-reads given up because the owner still hid a commit the stream had
    /// delivered (their calendars are queued again).
    pub deferred: AtomicU64,
    /// Re-reads that failed or timed out (their calendars are queued
    /// again); the process-wide count is `vacancy_owner_read_errors_total{reason="ttl"}`.
    pub failed: AtomicU64,
    /// Set while this process does not hold the slot (a fleet projector
    /// standing by): a re-read's watermarks would reach only the active
    /// projector's stream, so re-reading would cost the owner for nothing.
    paused: std::sync::atomic::AtomicBool,
}

impl Refresh {
    pub fn new(ttl: Duration) -> Arc<Refresh> {
        let due = Arc::new(Mutex::new(VecDeque::new()));
        let queue = due.clone();
        let confirmations = Cache::builder()
            .expire_after(OwnTtl)
            .eviction_listener(move |key: Arc<CalendarKey>, _, cause| {
                metrics::CACHE_EVICTIONS
                    .with_label_values(&["ttl_confirmations", metrics::removal_cause(cause)])
                    .inc();
                if cause == RemovalCause::Expired {
                    queue
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push_back(*key);
                }
            })
            .build();
        Arc::new(Refresh {
            ttl,
            confirmations,
            due,
            windows: Mutex::new(HashMap::new()),
            // Random per process: the WAL a restart from a checkpoint
            // replays carries the old process's watermarks, and one of
            // them must never close a window of this one.
            next_window: AtomicU64::new(rand::rng().random_range(1..1u64 << 62)),
            repaired: AtomicU64::new(0),
            merged: AtomicU64::new(0),
            deferred: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            paused: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn confirm(&self, key: CalendarKey) {
        self.confirmations.insert(key, Confirmation::now(self.ttl));
    }

    /// Every watched calendar with the time left before its re-read: zero
    /// for those already due or being re-read (they are re-read anew after
    /// a restart, since a window does not survive one). In key order; one
    /// entry per calendar, 24 bytes each.
    pub fn remaining(&self) -> Vec<(CalendarKey, Duration)> {
        let now = Instant::now();
        let mut left: HashMap<CalendarKey, Duration> = self
            .confirmations
            .iter()
            .map(|(key, c)| {
                (
                    *key,
                    c.ttl.saturating_sub(now.saturating_duration_since(c.at)),
                )
            })
            .collect();
        let due = self.due.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let reading: Vec<CalendarKey> = self.keys_being_read();
        for key in due.into_iter().chain(reading) {
            left.insert(key, Duration::ZERO);
        }
        let mut sorted: Vec<(CalendarKey, Duration)> = left.into_iter().collect();
        sorted.sort_unstable_by_key(|(key, _)| *key);
        sorted
    }

    /// The calendars of every open window (at most a few batches).
    fn keys_being_read<C: FromIterator<CalendarKey>>(&self) -> C {
        self.windows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .flat_map(|w| w.keys.iter().copied())
            .collect()
    }

    /// Calendars waiting for a re-read.
    pub fn due_len(&self) -> usize {
        self.due.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Calendars under watch.
    pub fn watched(&self) -> u64 {
        self.confirmations.entry_count()
    }

    /// Drops every window, timer and due calendar (a new copy comes).
    fn forget_all(&self) {
        self.windows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.confirmations.invalidate_all();
        self.confirmations.run_pending_tasks();
        self.due.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// A new copy was loaded: watch every room type's calendar, with TTLs
    /// spread over [ttl/2, ttl] so the re-reads do not all come at once, and
    /// abandon windows that began before the snapshot (their reads may be
    /// older than the snapshot).
    pub fn reset(&self, tables: &Tables) {
        self.forget_all();
        let mut rng = rand::rng();
        for key in tables.room_types.keys().chain(tables.calendars.keys()) {
            let ttl = self.ttl.mul_f64(rng.random_range(0.5..1.0));
            self.confirmations.insert(key, Confirmation::now(ttl));
        }
    }

    /// A copy was loaded from a checkpoint written `downtime` ago: watch
    /// its calendars with the time they had left then (`left`, as
    /// `remaining` gave it), less the downtime. Those whose time ran out
    /// while the service was down would all fall due at once; they are
    /// spread over [0, ttl/2] with jitter instead, and the refresher takes
    /// at most one batch per tick, which bounds the rate. A calendar of the
    /// copy that `left` does not list gets a spread TTL, as after a snapshot.
    pub fn restore(&self, tables: &Tables, left: &[(CalendarKey, Duration)], downtime: Duration) {
        self.forget_all();
        let left: HashMap<CalendarKey, Duration> = left.iter().copied().collect();
        let mut rng = rand::rng();
        // One insert per calendar (a restart of 100,000 calendars spends
        // its time here otherwise): the time it had left, less the downtime.
        for key in tables.room_types.keys().chain(tables.calendars.keys()) {
            let ttl = match left.get(&key).map(|l| l.saturating_sub(downtime)) {
                Some(rest) if !rest.is_zero() => rest.min(self.ttl),
                // Ran out while down: due soon, but not all at once.
                Some(_) => self.ttl.mul_f64(rng.random_range(0.0..0.5)),
                // Not in the file: as after a snapshot.
                None => self.ttl.mul_f64(rng.random_range(0.5..1.0)),
            };
            self.confirmations.insert(key, Confirmation::now(ttl));
        }
    }

    /// Called by the projector after each applied transaction, in commit
    /// order: confirms what the stream touched, tracks open windows, and
    /// merges a window's rows at its high watermark. Returns each merge's
    /// repairs, in order (empty when a merge changed nothing), for the
    /// fleet's projector to publish.
    pub fn after_apply(
        &self,
        model: &ReadModel,
        txn: &Transaction,
        messages: &[OwnMessage],
    ) -> Vec<Vec<Change>> {
        let mut merges: Vec<Vec<Change>> = Vec::new();
        // The transaction is walked without the windows' lock: a spilled one
        // is read back from disk (600,000 rows took seconds in a debug
        // build), and the refresher takes that lock on a runtime thread,
        // which would stall with every task queued behind it (a checkpoint's
        // writer takes it too). A window registered during the walk misses
        // this transaction's nights, which is safe: it registered after the
        // apply, so its read must see this transaction (the xid mark it
        // takes after registering includes it; see `run_refresher`).
        let watched: HashSet<CalendarKey> = self.keys_being_read();
        let mut touched: HashSet<CalendarKey> = HashSet::new();
        // Bounded by the watched calendars' nights, not by the transaction.
        let mut watched_nights: HashSet<(CalendarKey, NaiveDate)> = HashSet::new();
        let mut inventory_truncated = false;
        let walked = txn.changes.for_each(|change| {
            let (key, night) = match change {
                Change::UpsertNight { key, night, .. } | Change::DeleteNight { key, night } => {
                    (*key, Some(*night))
                }
                Change::UpsertRoomType { room_type, .. } => (
                    CalendarKey {
                        hotel_id: room_type.hotel_id,
                        room_type_id: room_type.id,
                    },
                    None,
                ),
                Change::Truncate { tables } => {
                    inventory_truncated |= tables.contains(&Table::Inventory);
                    return Ok(());
                }
                _ => return Ok(()),
            };
            touched.insert(key);
            if let Some(night) = night
                && watched.contains(&key)
            {
                watched_nights.insert((key, night));
            }
            Ok::<(), crate::model::SpillError>(())
        });
        let mut windows = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(error) = walked {
            // The nights the stream changed are known only in part: no open
            // window may merge over them; they are read again instead.
            tracing::warn!(%error, "cannot read an applied transaction back; open re-read windows are dropped");
            inventory_truncated = true;
        }
        for w in windows.values_mut() {
            // Windows registered during the walk too: read again, which is
            // never wrong, only later.
            w.truncated |= inventory_truncated;
            // From registration, not from the low watermark: see `RereadWindow::changed`.
            w.changed.extend(
                watched_nights
                    .iter()
                    .filter(|(key, _)| w.keys.contains(key))
                    .copied(),
            );
        }
        for message in messages.iter().filter(|m| m.prefix == WATERMARK_PREFIX) {
            let text = String::from_utf8_lossy(&message.content);
            let Some((kind, id)) = text.split_once(':') else {
                continue;
            };
            let Ok(id) = id.parse::<u64>() else { continue };
            match kind {
                "low" => {
                    if let Some(w) = windows.get_mut(&id) {
                        w.opened = true;
                    }
                }
                "high" => {
                    let Some(w) = windows.remove(&id) else {
                        continue;
                    };
                    match (w.opened && !w.truncated, w.rows) {
                        (true, Some(rows)) => {
                            let repairs = model.merge_reread(&w.keys, &rows, &w.changed);
                            let repaired = repairs.len() as u64;
                            merges.push(repairs);
                            self.repaired.fetch_add(repaired, Ordering::Relaxed);
                            self.merged.fetch_add(1, Ordering::Relaxed);
                            metrics::TTL_ROWS_REPAIRED.inc_by(repaired);
                            touched.extend(w.keys.iter().copied());
                        }
                        _ => self.requeue(w.keys),
                    }
                }
                _ => {}
            }
        }
        drop(windows);
        for key in touched {
            self.confirm(key);
        }
        merges
    }

    /// Pauses re-reads (a standby) or resumes them (it took the slot).
    pub fn set_paused(&self, paused: bool) {
        self.paused.store(paused, Ordering::Release);
    }

    /// Asks for a re-read of `keys` now, whatever their TTL (an operator's
    /// repair of one hotel, or a test that races re-reads with the stream).
    pub fn request(&self, keys: impl IntoIterator<Item = CalendarKey>) {
        self.due
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(keys);
    }

    fn requeue(&self, keys: HashSet<CalendarKey>) {
        self.due
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(keys);
    }

    fn take_due(&self, max: usize) -> Vec<CalendarKey> {
        let mut due = self.due.lock().unwrap_or_else(|p| p.into_inner());
        let n = due.len().min(max);
        due.drain(..n).collect()
    }

    fn register(&self, keys: &[CalendarKey]) -> u64 {
        let id = self.next_window.fetch_add(1, Ordering::Relaxed);
        self.windows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                id,
                RereadWindow {
                    keys: keys.iter().copied().collect(),
                    rows: None,
                    opened: false,
                    changed: HashSet::new(),
                    truncated: false,
                    registered: Instant::now(),
                },
            );
        id
    }

    fn set_rows(&self, id: u64, rows: Vec<(CalendarKey, NaiveDate, NightCounts)>) {
        if let Some(w) = self
            .windows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&id)
        {
            w.rows = Some(rows);
        }
    }

    fn abandon(&self, id: u64) {
        let w = self
            .windows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        if let Some(w) = w {
            self.requeue(w.keys);
        }
    }

    /// Re-read windows waiting for their high watermark.
    pub fn open_windows(&self) -> usize {
        self.windows.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Abandons windows whose high watermark never came.
    fn expire_windows(&self) {
        let stale: Vec<u64> = self
            .windows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, w)| w.registered.elapsed() > WINDOW_TIMEOUT)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.abandon(id);
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum RereadError {
    #[error(transparent)]
    Owner(#[from] owner::OwnerError),
    #[error("owner query failed: {0}")]
    Query(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Visibility(#[from] visibility::VisibilityError),
}

/// Most re-read windows open at once. A window closes when the stream
/// applies its high watermark, a few milliseconds after its read on a
/// stream that keeps up; one or two are open then. While the stream cannot
/// close them (a reconnect's backoff, a resnapshot's load, lag past
/// `WINDOW_TIMEOUT`), a window a tick would only hold its rows and expire
/// a minute later to be read again: unbounded, that re-read every falling
/// due calendar from the owner every minute and held all their rows.
/// With `model.refresh_batch` calendars each, at most 512 at the default.
pub const MAX_OPEN_WINDOWS: usize = 8;

/// The refresher task: re-reads due calendars in batches between watermarks.
pub async fn run_refresher(
    owner: OwnerSettings,
    schema: String,
    batch: usize,
    model: Arc<ReadModel>,
    refresh: Arc<Refresh>,
    shutdown: CancellationToken,
) {
    let mut client: Option<tokio_postgres::Client> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        // A copy loaded from a checkpoint first replays the WAL since it:
        // a re-read before that would only be merged into an old copy and
        // compete with the catch-up for the owner.
        if !model.freshness.caught_up() || refresh.paused.load(Ordering::Acquire) {
            continue;
        }
        // moka expires entries lazily; this is where expired ones reach `due`.
        refresh.confirmations.run_pending_tasks();
        refresh.expire_windows();
        metrics::TTL_DUE.set(refresh.due_len() as i64);
        if refresh.open_windows() >= MAX_OPEN_WINDOWS || model.freshness.is_replacing() {
            continue;
        }
        let keys = refresh.take_due(batch);
        if keys.is_empty() {
            continue;
        }
        if client.is_none() {
            client = owner::connect_configured(&owner, owner.connect_timeout())
                .await
                .ok();
        }
        let Some(c) = &client else {
            refresh.requeue(keys.into_iter().collect());
            continue;
        };
        let id = refresh.register(&keys);
        // Every transaction the copy had applied when the window opened: the
        // read must see them all (changes after it are noted in the window).
        let applied = model.xids.mark();
        let started = Instant::now();
        // Every attempt counts as a read; the failed ones also as errors.
        metrics::OWNER_READS.with_label_values(&["ttl"]).inc();
        // Half the query timeout for a hidden commit to show, so that a
        // deferral is told apart from an owner that does not answer.
        let hidden_limit = owner.query_timeout() / 2;
        let outcome = tokio::time::timeout(
            owner.query_timeout(),
            reread(
                c,
                &schema,
                id,
                &keys,
                &refresh,
                (&model, applied),
                hidden_limit,
            ),
        )
        .await;
        metrics::OWNER_READ_DURATION
            .with_label_values(&["ttl"])
            .observe(started.elapsed().as_secs_f64());
        match outcome {
            Ok(Ok(Some(rows))) => {
                metrics::TTL_ROWS_REREAD.inc_by(rows);
            }
            Ok(Ok(None)) => {
                tracing::debug!("ttl re-read deferred: the owner still hides a delivered commit");
                metrics::TTL_READS_DEFERRED.inc();
                refresh.deferred.fetch_add(1, Ordering::Relaxed);
                refresh.abandon(id);
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "ttl re-read failed");
                metrics::OWNER_READ_ERRORS.with_label_values(&["ttl"]).inc();
                refresh.failed.fetch_add(1, Ordering::Relaxed);
                refresh.abandon(id);
                client = None;
            }
            Err(_) => {
                tracing::warn!("ttl re-read timed out");
                metrics::OWNER_READ_ERRORS.with_label_values(&["ttl"]).inc();
                refresh.failed.fetch_add(1, Ordering::Relaxed);
                refresh.abandon(id);
                client = None;
            }
        }
    }
}

/// Low watermark, read, high watermark. Returns the rows read, or `None`
/// when for `hidden_limit` every read hid a transaction the copy had applied
/// by `applied` (the window is then given up, not merged).
async fn reread(
    client: &tokio_postgres::Client,
    schema: &str,
    id: u64,
    keys: &[CalendarKey],
    refresh: &Refresh,
    (model, applied): (&ReadModel, XidMark),
    hidden_limit: Duration,
) -> Result<Option<u64>, RereadError> {
    let emit = "SELECT pg_logical_emit_message(true, 'vacancy.wm', $1)";
    client.execute(emit, &[&format!("low:{id}")]).await?;
    let hotels: Vec<i64> = keys.iter().map(|k| k.hotel_id).collect();
    let room_types: Vec<i64> = keys.iter().map(|k| k.room_type_id).collect();
    // Named with its schema (`stream.schema`, a checked identifier): left
    // to the role's `search_path`, the re-read could merge another
    // schema's `inventory` over the copy.
    let read = visibility::seeing(&format!(
        "SELECT i.hotel_id, i.room_type_id, i.night, i.total, i.taken, i.sell_limit, i.price_cents
         FROM unnest($1::bigint[], $2::bigint[]) AS k(hotel_id, room_type_id)
         JOIN {schema}.inventory i USING (hotel_id, room_type_id)"
    ));
    let Some(rows) = visibility::read_seeing(
        client,
        &read,
        &[&hotels, &room_types],
        (&model.xids, applied),
        hidden_limit,
    )
    .await?
    else {
        return Ok(None);
    };
    let read = rows.len();
    let rows: Vec<(CalendarKey, NaiveDate, NightCounts)> = rows
        .iter()
        .filter_map(|row| crate::owner::inventory_night(row).transpose())
        .collect::<Result<_, _>>()?;
    crate::metrics::NIGHTS_NOT_HELD
        .with_label_values(&["reread"])
        .inc_by((read - rows.len()) as u64);
    let n = rows.len() as u64;
    refresh.set_rows(id, rows);
    client.execute(emit, &[&format!("high:{id}")]).await?;
    Ok(Some(n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lsn::Lsn;

    fn key() -> CalendarKey {
        CalendarKey {
            hotel_id: 1,
            room_type_id: 1,
        }
    }

    fn night() -> NaiveDate {
        NaiveDate::from_ymd_opt(2030, 1, 1).unwrap()
    }

    fn taken(n: i32) -> NightCounts {
        NightCounts {
            total: 10,
            taken: n,
            sell_limit: None,
            price_cents: Some(100),
        }
    }

    fn txn(lsn: u64, changes: Vec<Change>) -> Transaction {
        Transaction {
            xid: 1,
            commit_lsn: Lsn(lsn),
            end_lsn: Lsn(lsn + 1),
            commit_time: chrono::Utc::now(),
            changes: changes.into(),
        }
    }

    fn watermark(kind: &str, id: u64, lsn: u64) -> OwnMessage {
        OwnMessage {
            prefix: WATERMARK_PREFIX.into(),
            content: format!("{kind}:{id}").into_bytes(),
            lsn: Lsn(lsn),
        }
    }

    fn apply(refresh: &Refresh, model: &ReadModel, t: Transaction, messages: &[OwnMessage]) {
        model.apply(&t).unwrap();
        refresh.after_apply(model, &t, messages);
    }

    fn set(taken_units: i32) -> Change {
        Change::UpsertNight {
            key: key(),
            night: night(),
            counts: taken(taken_units),
        }
    }

    /// One re-read window over the night, which the stream first set to
    /// taken = 1: registered, then `before_low` applied by the stream (the
    /// low watermark not yet written), then the low watermark, the read
    /// (which saw `read_taken`) and the high watermark. Returns the copy.
    fn window(before_low: Vec<Change>, read_taken: i32) -> (Arc<ReadModel>, Arc<Refresh>) {
        let model = ReadModel::new();
        let refresh = Refresh::new(Duration::from_secs(3600));
        apply(&refresh, &model, txn(10, vec![set(1)]), &[]);
        let id = refresh.register(&[key()]);
        apply(&refresh, &model, txn(20, before_low), &[]);
        let low = [watermark("low", id, 30)];
        apply(&refresh, &model, txn(30, vec![]), &low);
        refresh.set_rows(id, vec![(key(), night(), taken(read_taken))]);
        let high = [watermark("high", id, 40)];
        apply(&refresh, &model, txn(40, vec![]), &high);
        (model, refresh)
    }

    /// What a checkpoint carries: each watched calendar's time left, and
    /// zero for one already due.
    #[test]
    fn remaining_ttls_count_down_and_due_calendars_have_none() {
        let refresh = Refresh::new(Duration::from_secs(3600));
        let other = CalendarKey {
            hotel_id: 2,
            room_type_id: 1,
        };
        refresh.confirm(key());
        refresh.confirm(other);
        refresh.request([other]);
        let left = refresh.remaining();
        assert_eq!(left.len(), 2);
        assert_eq!(left[0].0, key());
        assert!(left[0].1 > Duration::from_secs(3590) && left[0].1 <= Duration::from_secs(3600));
        assert_eq!(left[1], (other, Duration::ZERO));
    }

    /// A transaction whose commit record lands just before the low
    /// watermark, but which the read's snapshot did not yet see: its change
    /// must survive the merge of the read's older value.
    #[test]
    fn a_change_committed_just_before_the_low_watermark_is_not_overwritten() {
        // Committed (in WAL order) before the low watermark, but invisible to
        // the read, which still saw taken = 1.
        let (model, refresh) = window(vec![set(2)], 1);
        assert_eq!(
            refresh.merged.load(Ordering::Relaxed),
            1,
            "the window merged"
        );
        let copy = model.read().calendars.get(&key()).unwrap().get(night());
        assert_eq!(copy, Some(taken(2)), "the stream's newer value stays");
    }

    /// An inventory truncate inside a window: the read may be older than
    /// every night the stream now holds, so nothing is merged and the
    /// calendar is queued to be read again.
    #[test]
    fn a_truncate_inside_a_window_requeues_it_instead_of_merging() {
        let truncate = Change::Truncate {
            tables: vec![Table::Inventory],
        };
        let (model, refresh) = window(vec![truncate], 5);
        assert_eq!(refresh.merged.load(Ordering::Relaxed), 0, "not merged");
        assert_eq!(refresh.due_len(), 1, "queued again");
        let calendar = model.read().calendars.get(&key()).map(|c| c.get(night()));
        assert!(
            calendar.flatten().is_none(),
            "the read's row is not put back over the truncate: {calendar:?}"
        );
    }

    /// The safety net still repairs what the stream never delivered.
    #[test]
    fn a_night_the_stream_did_not_touch_takes_the_read_value() {
        let (model, refresh) = window(Vec::new(), 5);
        assert_eq!(refresh.repaired.load(Ordering::Relaxed), 1);
        let copy = model.read().calendars.get(&key()).unwrap().get(night());
        assert_eq!(copy, Some(taken(5)));
    }
}

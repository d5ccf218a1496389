//! Confirmed reads: the owner's WAL position instead of its rows (Raft's
//! ReadIndex, Materialize's real-time recency).
//!
//! A search that must show owner-fresh numbers takes a position `P` from
//! the owner, after the search began, waits until the copy has applied `P`,
//! then answers from the copy. Every transaction committed on the owner
//! before the search began inserted its commit record before `P` was taken,
//! and the copy at or past `P` has applied every commit below it (the
//! projector's invariant), so that transaction is in the answer.
//!
//! # Which position
//!
//! `P` is `pg_current_wal_insert_lsn()`, read on its own connection after
//! the search began: a read that writes nothing, needs no xid and costs the
//! owner one trivial query. It is sound: every commit the guest could have
//! seen inserted its record below it.
//!
//! Whether the copy reaches `P` promptly depends on how PostgreSQL 15 moves
//! the copy's applied position:
//!
//! - The applied position moves at commits, and at keepalives only while no
//!   transaction is held (`stream::replicate`). A logical walsender decodes
//!   only WAL that is flushed (`WalSndWaitForWal` waits for the flush
//!   position), and it pings (a keepalive with its `sentPtr`) when it has
//!   caught up with the flush and our reported position is behind.
//! - So on an owner that commits, the next commit decoded after `P` carries
//!   the copy past it; on an idle owner the copy already stands at the
//!   walsender's `sentPtr`, which is the flush position, and `P` is there
//!   too: the wait is nothing. In `vacancy bench search` (an owner idle but
//!   for the heartbeat), 4 of 104,195 confirmed reads had to nudge; 2,366
//!   of 90,808 in a run beside autovacuum's WAL (2026-12-06).
//! - The slow case is WAL inserted but not flushed after the last commit:
//!   an unrelated transaction still open, a read that pruned a page, an
//!   asynchronous commit. The walsender cannot see past the flush until the
//!   WAL writer gets to it (`wal_writer_delay`, longer once it hibernates)
//!   or some commit flushes it; and while a large open transaction is
//!   streamed to us in progress, no keepalive may advance the copy at all.
//!
//! # The nudge, for the slow case
//!
//! When the copy has not reached `P` within `NUDGE_AFTER`, a node that may
//! write to the owner writes a *transactional* logical message,
//! `pg_logical_emit_message(true, 'vacancy.confirm', '')`, on a session with
//! `synchronous_commit = local`, and the search keeps waiting for `P`:
//!
//! - The message gives its transaction an xid, so its commit flushes at once
//!   (forced `local`, so a synchronous standby is not waited for), which
//!   flushes everything below it, `P` included, and wakes the walsender.
//!   Its commit is decoded in WAL order, after every earlier commit, and
//!   applied like any other commit (held in-progress transactions or not),
//!   moving the applied position past `P`. No heartbeat is needed.
//! - A non-transactional message would not do: in PostgreSQL 15 it is not
//!   flushed (the `flush` argument came in 17), and a transaction without
//!   an xid only asks the WAL writer to flush later: on an idle 15.20 owner
//!   (`wal_writer_delay` 200 ms) its flush position passed the message 30
//!   to 155 ms after it was written, against at most 1 ms for a
//!   transactional one.
//! - Nudges are coalesced like position reads: one serves every waiter
//!   whose position was read before the nudge was sent (its end is past
//!   every such position).
//!
//! Until 2026-12-07 every position read was such a message. That cost the
//! owner an xid, a WAL record, a flush and a decode per read, and halved
//! the default's throughput in `vacancy bench search`; the nudge keeps its
//! promptness for the case that needs it.
//!
//! # On a node that never writes to the owner
//!
//! A replica, and a projector standing by, never write to the owner
//! (`fleet`), so they never nudge. Their wait is prompt while the owner
//! commits (the active projector publishes each commit, and its keepalive
//! advances and heartbeats); when it is not, the read falls back to the
//! owner's rows, which is slower but as fresh. Whether this node may write
//! is read at each nudge, since a standby becomes the active projector.
//!
//! # Coalescing
//!
//! A position read serves a search only if it was sent after that search
//! began: an older one may predate a commit the guest already saw. A search
//! joins the read in flight when that read was sent after it began;
//! otherwise it waits for that read to end and joins or starts the next
//! one (`Coalescer`). A new read gives way to the tasks ready on its worker
//! twice before it is sent, and takes its send time only then: searches
//! that reach their confirmed read meanwhile join it. That halved position
//! reads per search in `vacancy bench search` (0.58 to 0.31) at no
//! measurable cost. The query runs in its own task, so a search that gives
//! up (its budget, its request's timeout) never strands the others.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_postgres::{Client, SimpleQueryMessage};

use crate::lsn::{Lsn, Position};
use crate::metrics;
use crate::owner::{self, OwnerSettings};

/// The position: the owner's WAL insert position, read without writing,
/// and the timeline it is on (the WAL file name's first eight hex digits,
/// as `owner::identity` reads it). A node whose owner pin is unset (a fleet
/// replica runs no replication session) has no other way to tell a
/// position of a promoted standby's new timeline from one of its copy's.
const POSITION_SQL: &str =
    "SELECT p, substr(pg_walfile_name(p), 1, 8) FROM pg_current_wal_insert_lsn() p";

/// The nudge, written only when the copy is slow to reach a position (see
/// the module doc). The prefix is ours (`stream::MESSAGE_PREFIX`), so the
/// stream knows it and ignores it.
const NUDGE_SQL: &str = "SELECT pg_logical_emit_message(true, 'vacancy.confirm', '')";

/// How long a search waits for the copy to reach a position before it
/// nudges. Above a commit's flush and apply on a busy owner (the common
/// way the copy gets there), far below the WAL writer's 200 ms.
pub const NUDGE_AFTER: Duration = Duration::from_millis(2);

/// Why a confirmed read gave up (the fallback metric's `cause`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfirmError {
    #[error("the owner's position did not come within the budget")]
    PositionTimeout,
    #[error("the owner's position could not be read: {0}")]
    PositionFailed(String),
    #[error("the copy did not apply {0} within the budget")]
    ApplyTimeout(Lsn),
    /// The position was read on another owner timeline than the copy's
    /// (a failover's new snapshot is not in yet): the two do not compare.
    #[error("the owner is on another timeline than the copy")]
    OtherTimeline,
    /// The copy was replaced, since the position was reached, by one that
    /// does not hold it (a replica's bootstrap from an older checkpoint).
    #[error("the copy now read does not hold {0}")]
    CopyBehind(Position),
    /// An earlier round of the same search failed to confirm: this one
    /// reads the owner's rows at once, in what is left of the budget.
    #[error("an earlier confirmed read of this search failed")]
    FailedBefore,
}

impl ConfirmError {
    pub fn cause(&self) -> &'static str {
        match self {
            ConfirmError::PositionTimeout => "position_timeout",
            ConfirmError::PositionFailed(_) => "position_failed",
            ConfirmError::ApplyTimeout(_) => "apply_timeout",
            ConfirmError::OtherTimeline => "other_timeline",
            ConfirmError::CopyBehind(_) => "copy_behind",
            ConfirmError::FailedBefore => "failed_before",
        }
    }
}

/// How often a new round gives way to other ready tasks before it is sent.
const YIELDS_BEFORE_SEND: usize = 2;

/// One position read, in flight or done.
struct Round<T> {
    id: u64,
    /// Taken right before the query is sent: the owner runs it after
    /// this. `None` while the round waits to be sent: every caller may join
    /// it then, since it will be sent after they began.
    sent_at: Option<Instant>,
    done: watch::Receiver<Option<T>>,
}

struct Rounds<T> {
    in_flight: Option<Round<T>>,
    next_id: u64,
}

/// At most one read in flight; a caller joins it only if it was sent after
/// the caller began.
pub struct Coalescer<T> {
    rounds: Arc<Mutex<Rounds<T>>>,
}

impl<T> Default for Coalescer<T> {
    fn default() -> Self {
        Coalescer {
            rounds: Arc::new(Mutex::new(Rounds {
                in_flight: None,
                next_id: 0,
            })),
        }
    }
}

/// What a caller does next, decided under the lock.
enum Step<T> {
    /// Wait for this round's result: it was sent after the caller began.
    Join(watch::Receiver<Option<T>>),
    /// This round was sent before the caller began: wait for it to end, then look again.
    Outwait(watch::Receiver<Option<T>>),
    /// No round in flight: this caller sends one.
    Send(u64, watch::Sender<Option<T>>, watch::Receiver<Option<T>>),
}

impl<T: Clone + Send + Sync + 'static> Coalescer<T> {
    /// A result read after `began`, sharing the read in flight when it was
    /// sent after `began`; `None` when `deadline` passed first. `read`
    /// starts a new read; it runs in its own task and must end by itself
    /// (give it a timeout).
    pub async fn get<F, Fut>(
        &self,
        began: Instant,
        deadline: tokio::time::Instant,
        read: F,
    ) -> Option<T>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = T> + Send + 'static,
    {
        loop {
            let step = {
                let mut rounds = self.rounds.lock().unwrap_or_else(|p| p.into_inner());
                match &rounds.in_flight {
                    Some(r) if r.sent_at.is_none_or(|sent| sent >= began) => {
                        Step::Join(r.done.clone())
                    }
                    Some(r) => Step::Outwait(r.done.clone()),
                    None => {
                        let id = rounds.next_id;
                        rounds.next_id += 1;
                        let (tx, rx) = watch::channel(None);
                        rounds.in_flight = Some(Round {
                            id,
                            sent_at: None,
                            done: rx.clone(),
                        });
                        Step::Send(id, tx, rx)
                    }
                }
            };
            match step {
                Step::Join(rx) => return wait_done(rx, deadline).await,
                Step::Outwait(rx) => {
                    wait_done(rx, deadline).await?;
                }
                Step::Send(id, tx, rx) => {
                    let query = read();
                    let rounds = self.rounds.clone();
                    tokio::spawn(async move {
                        // Searches ready to run on this worker go first, and
                        // may join before the round is sent: fewer reads
                        // per search, for a few microseconds of latency.
                        for _ in 0..YIELDS_BEFORE_SEND {
                            tokio::task::yield_now().await;
                        }
                        {
                            let mut r = rounds.lock().unwrap_or_else(|p| p.into_inner());
                            if let Some(round) = r.in_flight.as_mut().filter(|f| f.id == id) {
                                round.sent_at = Some(Instant::now());
                            }
                        }
                        // Polled only now: the owner runs it after `sent_at`.
                        let result = query.await;
                        // Off the books before anyone hears of the result, so
                        // a caller woken by it never finds this round again.
                        {
                            let mut r = rounds.lock().unwrap_or_else(|p| p.into_inner());
                            if r.in_flight.as_ref().is_some_and(|f| f.id == id) {
                                r.in_flight = None;
                            }
                        }
                        tx.send_replace(Some(result));
                    });
                    return wait_done(rx, deadline).await;
                }
            }
        }
    }
}

/// The round's result, or `None` when `deadline` passes first (or the
/// round's task died without one).
async fn wait_done<T: Clone>(
    mut rx: watch::Receiver<Option<T>>,
    deadline: tokio::time::Instant,
) -> Option<T> {
    let done = async {
        rx.wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|v| v.clone())
    };
    tokio::time::timeout_at(deadline, done).await.ok().flatten()
}

/// The owner's position for confirmed reads, and the nudge, each coalesced
/// on a connection of its own (a nudge's flush never delays a position
/// read queued behind it).
pub struct Confirmer {
    owner: OwnerSettings,
    /// How long one round's statement (a position read or a nudge) may
    /// take, a new connection's connect timeout besides: the search's
    /// owner budget, never more than the owner's query timeout.
    /// A round a search began after cannot serve it, so it waits the round
    /// out before sending its own: bounded by the query timeout (5 s), a
    /// round stuck on a path that drops packets held every confirmed read
    /// for that long. No search can use an answer later than its budget.
    round_limit: Duration,
    positions: Lane,
    nudges: Lane,
    /// Whether this node may write the nudge: true for a standalone node,
    /// the active flag for a projector, false for a replica.
    writes: Arc<AtomicBool>,
}

/// One owner query, coalesced, on its own connection.
struct Lane {
    query: OwnerQuery,
    rounds: Coalescer<Result<Position, String>>,
    client: Arc<Mutex<Option<Arc<Client>>>>,
}

impl Lane {
    fn new(query: OwnerQuery) -> Lane {
        Lane {
            query,
            rounds: Coalescer::default(),
            client: Arc::new(Mutex::new(None)),
        }
    }

    /// The query's answer, sent after `began`; `None` when `deadline`
    /// passed first.
    async fn get(
        &self,
        owner: &OwnerSettings,
        round_limit: Duration,
        began: Instant,
        deadline: tokio::time::Instant,
    ) -> Option<Result<Position, String>> {
        let send = || {
            let (owner, client, query) = (owner.clone(), self.client.clone(), self.query);
            async move { query_owner(&owner, &client, query, round_limit).await }
        };
        self.rounds.get(began, deadline, send).await
    }
}

impl Confirmer {
    /// Rounds of at most `budget` (`search.owner_read_timeout_ms`).
    pub fn new(owner: &OwnerSettings, budget: Duration) -> Confirmer {
        Confirmer {
            owner: owner.clone(),
            round_limit: budget.min(owner.query_timeout()),
            positions: Lane::new(OwnerQuery::Position),
            nudges: Lane::new(OwnerQuery::Nudge),
            writes: Arc::new(AtomicBool::new(true)),
        }
    }

    /// Nudges only while `writes` is set.
    pub fn writing_while(mut self, writes: Arc<AtomicBool>) -> Confirmer {
        self.writes = writes;
        self
    }

    /// The owner timeline positions are read on: every connection is
    /// checked against the replication stream's (`owner::identity`).
    pub fn timeline(&self) -> Option<u32> {
        self.owner.pin.current().map(|i| i.timeline)
    }

    /// An owner position taken after `began`, by `deadline`, with the
    /// timeline it was read on (`None` only if the owner did not say).
    pub async fn position(
        &self,
        began: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Position, ConfirmError> {
        match self
            .positions
            .get(&self.owner, self.round_limit, began, deadline)
            .await
        {
            Some(Ok(position)) => Ok(position),
            Some(Err(e)) => Err(ConfirmError::PositionFailed(e)),
            None => Err(ConfirmError::PositionTimeout),
        }
    }

    /// Makes the owner flush and the stream carry the copy past every
    /// position read before `read_at`, if this node may write; `false`
    /// when it may not, or the nudge failed or did not end by `deadline`
    /// (the caller keeps waiting for the stream all the same).
    pub async fn nudge(&self, read_at: Instant, deadline: tokio::time::Instant) -> bool {
        if !self.writes.load(Ordering::Acquire) {
            return false;
        }
        matches!(
            self.nudges
                .get(&self.owner, self.round_limit, read_at, deadline)
                .await,
            Some(Ok(_))
        )
    }
}

/// The two queries a confirmed read sends.
#[derive(Debug, Clone, Copy)]
enum OwnerQuery {
    Position,
    Nudge,
}

impl OwnerQuery {
    fn sql(self) -> &'static str {
        match self {
            OwnerQuery::Position => POSITION_SQL,
            OwnerQuery::Nudge => NUDGE_SQL,
        }
    }

    /// The `reason` of the owner-read metrics.
    fn reason(self) -> &'static str {
        match self {
            OwnerQuery::Position => "position",
            OwnerQuery::Nudge => "nudge",
        }
    }
}

/// One owner query, counted like every owner read, bounded by `limit`
/// (a new connection within the connect timeout besides) so its round
/// always ends.
async fn query_owner(
    owner: &OwnerSettings,
    slot: &Mutex<Option<Arc<Client>>>,
    query: OwnerQuery,
    limit: Duration,
) -> Result<Position, String> {
    let reason = query.reason();
    metrics::OWNER_READS.with_label_values(&[reason]).inc();
    let started = Instant::now();
    let result = query_position(owner, slot, query.sql(), limit).await;
    metrics::OWNER_READ_DURATION
        .with_label_values(&[reason])
        .observe(started.elapsed().as_secs_f64());
    if result.is_err() {
        metrics::OWNER_READ_ERRORS
            .with_label_values(&[reason])
            .inc();
        // A connection that failed or hung is not trusted again.
        *slot.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
    result
}

/// The LSN in the first column of `sql`'s row, and the timeline in hex in
/// its second when it has one.
/// Connecting is bounded by the connect timeout, not `limit`: an owner a
/// few round trips away (TLS, SCRAM) takes longer to connect to than a
/// search's budget, and a round that gave up connecting would leave every
/// confirmed read without a connection for good. Once connected, each
/// statement is bounded by `limit`.
async fn query_position(
    owner: &OwnerSettings,
    slot: &Mutex<Option<Arc<Client>>>,
    sql: &'static str,
    limit: Duration,
) -> Result<Position, String> {
    let in_time = |e: tokio::time::error::Elapsed| format!("no answer within {limit:?}: {e}");
    let existing = slot.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let client = match existing.filter(|c| !c.is_closed()) {
        Some(c) => c,
        None => {
            let c = owner::connect_configured(owner, owner.connect_timeout())
                .await
                .map_err(|e| e.to_string())?;
            // Flushed locally at commit whatever the owner's default: an
            // asynchronous commit would leave the walsender waiting for the
            // WAL writer, a synchronous standby would add its round trip.
            // (Only the nudge commits; the position read writes nothing.)
            tokio::time::timeout(limit, c.batch_execute("SET synchronous_commit = local"))
                .await
                .map_err(in_time)?
                .map_err(|e| e.to_string())?;
            let c = Arc::new(c);
            *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(c.clone());
            c
        }
    };
    // The simple protocol: one round trip, where an unnamed prepared
    // statement would take two (parse, then bind and execute).
    let messages = tokio::time::timeout(limit, client.simple_query(sql))
        .await
        .map_err(in_time)?
        .map_err(|e| e.to_string())?;
    let row = messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .ok_or_else(|| format!("{sql} returned no position"))?;
    let text = row
        .get(0)
        .ok_or_else(|| format!("{sql} returned no position"))?;
    let lsn = text
        .parse::<Lsn>()
        .map_err(|e| format!("{sql} returned {text:?}: {e}"))?;
    let timeline = match row.try_get(1) {
        Ok(Some(hex)) => Some(
            u32::from_str_radix(hex, 16)
                .map_err(|e| format!("{sql} returned the timeline {hex:?}: {e}"))?,
        ),
        _ => None,
    };
    Ok(Position { timeline, lsn })
}

/// Time left of a budget that ends at `deadline`.
pub fn left(deadline: tokio::time::Instant) -> Duration {
    deadline.saturating_duration_since(tokio::time::Instant::now())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::sync::Notify;

    /// A read the test releases by hand; each read returns its own number.
    struct Reads {
        sent: AtomicU64,
        release: Notify,
    }

    impl Reads {
        fn new() -> Arc<Reads> {
            Arc::new(Reads {
                sent: AtomicU64::new(0),
                release: Notify::new(),
            })
        }

        fn read(
            self: &Arc<Self>,
        ) -> impl Fn() -> std::pin::Pin<Box<dyn Future<Output = u64> + Send>> + use<> {
            let all = self.clone();
            move || {
                let this_read = all.clone();
                let n = this_read.sent.fetch_add(1, Ordering::SeqCst) + 1;
                Box::pin(async move {
                    this_read.release.notified().await;
                    n
                })
            }
        }
    }

    /// An owner that speaks just enough of the protocol for the lanes: it
    /// lets every connection in (no password), answers `SET`, and answers
    /// the position query with 0/100 on timeline 1, except on its first
    /// connection, where the query is left unanswered as on a path that
    /// went dark.
    async fn owner_whose_first_read_hangs() -> std::net::SocketAddr {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            for connection in 0.. {
                let Ok((mut socket, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let ready: &[u8] = b"Z\0\0\0\x05I";
                    // The startup message: its length, then the rest.
                    let length = socket.read_u32().await.unwrap() as usize;
                    let mut startup = vec![0; length - 4];
                    socket.read_exact(&mut startup).await.unwrap();
                    socket.write_all(b"R\0\0\0\x08\0\0\0\0").await.unwrap();
                    socket.write_all(ready).await.unwrap();
                    loop {
                        let Ok(kind) = socket.read_u8().await else {
                            return;
                        };
                        let length = socket.read_u32().await.unwrap() as usize;
                        let mut body = vec![0; length - 4];
                        socket.read_exact(&mut body).await.unwrap();
                        if kind != b'Q' {
                            return; // Terminate
                        }
                        let mut answer = Vec::new();
                        if body.starts_with(b"SET") {
                            answer.extend_from_slice(b"C\0\0\0\x08SET\0");
                        } else if connection == 0 {
                            // Dark: the socket stays open, nothing comes back.
                            std::future::pending::<()>().await;
                        } else {
                            let mut fields = vec![0u8, 2];
                            for name in [&b"p"[..], &b"substr"[..]] {
                                fields.extend_from_slice(name);
                                fields.push(0);
                                fields.extend_from_slice(&0u32.to_be_bytes()); // table
                                fields.extend_from_slice(&0u16.to_be_bytes()); // column
                                fields.extend_from_slice(&25u32.to_be_bytes()); // text
                                fields.extend_from_slice(&(-1i16).to_be_bytes());
                                fields.extend_from_slice(&(-1i32).to_be_bytes());
                                fields.extend_from_slice(&0u16.to_be_bytes());
                            }
                            let mut row = vec![0u8, 2];
                            for value in [&b"0/100"[..], &b"00000001"[..]] {
                                row.extend_from_slice(&(value.len() as u32).to_be_bytes());
                                row.extend_from_slice(value);
                            }
                            for (kind, body) in
                                [(b'T', fields), (b'D', row), (b'C', b"SELECT 1\0".to_vec())]
                            {
                                answer.push(kind);
                                answer.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
                                answer.extend_from_slice(&body);
                            }
                        }
                        answer.extend_from_slice(ready);
                        socket.write_all(&answer).await.unwrap();
                    }
                });
            }
        });
        addr
    }

    /// A position read that never comes back holds up the searches that
    /// began after it was sent (they may not share it) only for the search
    /// budget, not for the owner's query timeout (5 s): past the budget the
    /// round ends, its connection is dropped, and the next search's read,
    /// on a new connection, is answered.
    #[tokio::test]
    async fn a_read_that_never_answers_holds_later_searches_for_one_budget() {
        let addr = owner_whose_first_read_hangs().await;
        let defaults = figment::Figment::from(
            <figment::providers::Toml as figment::providers::Format>::string(include_str!(
                "../../../../config/default.toml"
            )),
        );
        let mut owner: OwnerSettings = defaults.extract_inner("owner").unwrap();
        owner.url = format!("postgresql://vacancy@{addr}/none?sslmode=disable");
        assert!(owner.query_timeout() >= Duration::from_secs(5));
        let confirmer = Confirmer::new(&owner, Duration::from_millis(200));
        let first = confirmer
            .position(
                Instant::now(),
                tokio::time::Instant::now() + Duration::from_millis(100),
            )
            .await;
        assert_eq!(first, Err(ConfirmError::PositionTimeout));
        // Begins after the dark read was sent: it waits that read out,
        // then reads on a connection of its own.
        let second = confirmer
            .position(
                Instant::now(),
                tokio::time::Instant::now() + Duration::from_secs(3),
            )
            .await;
        assert_eq!(
            second,
            Ok(Position {
                timeline: Some(1),
                lsn: Lsn(0x100)
            })
        );
    }

    /// A caller that began at `began`, in a task of its own.
    fn caller(
        c: &Arc<Coalescer<u64>>,
        reads: &Arc<Reads>,
        began: Instant,
    ) -> tokio::task::JoinHandle<Option<u64>> {
        let (shared, read) = (c.clone(), reads.read());
        tokio::spawn(async move { shared.get(began, far(), read).await })
    }

    fn far() -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_secs(10)
    }

    /// Lets spawned tasks run up to their next wait.
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_caller_never_joins_a_read_sent_before_it_began() {
        let c = Arc::new(Coalescer::<u64>::default());
        let reads = Reads::new();
        let began_a = Instant::now();
        let a = caller(&c, &reads, began_a);
        settle().await;
        assert_eq!(reads.sent.load(Ordering::SeqCst), 1, "A sent read 1");
        // B begins after read 1 was sent: it must not share it.
        let began_b = Instant::now();
        let b = caller(&c, &reads, began_b);
        settle().await;
        assert_eq!(
            reads.sent.load(Ordering::SeqCst),
            1,
            "one read in flight at a time"
        );
        reads.release.notify_one();
        assert_eq!(a.await.unwrap(), Some(1));
        settle().await;
        assert_eq!(
            reads.sent.load(Ordering::SeqCst),
            2,
            "B sent read 2 once read 1 ended"
        );
        reads.release.notify_one();
        assert_eq!(
            b.await.unwrap(),
            Some(2),
            "B got the read sent after it began"
        );
    }

    #[tokio::test]
    async fn a_caller_that_began_before_the_round_was_sent_joins_it() {
        let c = Arc::new(Coalescer::<u64>::default());
        let reads = Reads::new();
        let a = caller(&c, &reads, Instant::now());
        // A runs: it opens round 1 and hands it to its task, which gives
        // way before sending.
        tokio::task::yield_now().await;
        assert_eq!(reads.sent.load(Ordering::SeqCst), 1);
        // B begins after the round was opened, but before it is sent.
        let began_b = Instant::now();
        let b = caller(&c, &reads, began_b);
        settle().await;
        assert_eq!(
            reads.sent.load(Ordering::SeqCst),
            1,
            "B joined the round that was not sent yet"
        );
        reads.release.notify_one();
        assert_eq!(a.await.unwrap(), Some(1));
        assert_eq!(b.await.unwrap(), Some(1));
    }

    #[tokio::test]
    async fn callers_that_began_before_a_read_was_sent_share_it() {
        let c = Arc::new(Coalescer::<u64>::default());
        let reads = Reads::new();
        // Both began before anything was sent.
        let began = Instant::now();
        let mut waiters = Vec::new();
        for _ in 0..5 {
            waiters.push(caller(&c, &reads, began));
        }
        settle().await;
        assert_eq!(reads.sent.load(Ordering::SeqCst), 1);
        reads.release.notify_one();
        for w in waiters {
            assert_eq!(w.await.unwrap(), Some(1));
        }
    }

    #[tokio::test]
    async fn a_caller_waiting_out_an_old_read_joins_the_next_one_sent_after_it_began() {
        let c = Arc::new(Coalescer::<u64>::default());
        let reads = Reads::new();
        let first = caller(&c, &reads, Instant::now());
        settle().await;
        // Two callers begin while read 1 is in flight; both outwait it, and
        // the one read sent after that serves them both.
        let began = Instant::now();
        let late: Vec<_> = (0..2).map(|_| caller(&c, &reads, began)).collect();
        settle().await;
        reads.release.notify_one();
        assert_eq!(first.await.unwrap(), Some(1));
        settle().await;
        assert_eq!(reads.sent.load(Ordering::SeqCst), 2);
        reads.release.notify_one();
        for w in late {
            assert_eq!(w.await.unwrap(), Some(2));
        }
    }

    #[tokio::test]
    async fn a_caller_gives_up_at_its_deadline_and_the_round_still_ends() {
        let c = Arc::new(Coalescer::<u64>::default());
        let reads = Reads::new();
        let soon = tokio::time::Instant::now() + Duration::from_millis(30);
        assert_eq!(c.get(Instant::now(), soon, reads.read()).await, None);
        // The read it sent is still in flight, sent before the next caller
        // began: that caller outwaits it and takes the read after.
        let began = Instant::now();
        let next = caller(&c, &reads, began);
        settle().await;
        reads.release.notify_one();
        settle().await;
        reads.release.notify_one();
        assert_eq!(
            next.await.unwrap(),
            Some(2),
            "not the read sent before it began"
        );
    }
}

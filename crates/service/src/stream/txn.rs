//! Assemble: group the stream's events into whole committed transactions.
//!
//! The read model applies a transaction only at its commit, so nothing here
//! reaches a reader early. Streamed in-progress transactions (protocol 2) are
//! held until `StreamCommit` and dropped on `StreamAbort`: after a reconnect
//! the server can resend chunks of a transaction that then aborts, and
//! applying chunks early would show changes that never committed. A `Begin`
//! or a first chunk for a transaction already held starts it over, since a
//! reconnect replays it from the start.
//!
//! Held changes count against one `HeldBudget` for all the transactions
//! held here (`stream.max_held_bytes`); past it they spill to disk
//! (`model::held`) and are still applied only at their commit. Dropping
//! the assembler (a session that ends) removes its spill files.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use pg_walstream::{ChangeEvent, EventType};

use super::decode::{DecodeError, decode};
use crate::lsn::Lsn;
use crate::model::{HeldBudget, HeldChanges, SpillError, Transaction};

/// A logical decoding message that `vacancy` itself wrote (heartbeats).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnMessage {
    pub prefix: String,
    pub content: Vec<u8>,
    pub lsn: Lsn,
}

/// What one event completed.
#[derive(Debug, Clone, PartialEq)]
pub enum Assembled {
    /// Nothing yet: the event was part of an open transaction (or ignored).
    Pending,
    /// A whole transaction committed; apply it, then acknowledge `end_lsn`.
    Commit(Transaction, Vec<OwnMessage>),
}

#[derive(Debug, thiserror::Error)]
pub enum AssembleError {
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("holding a transaction: {0}")]
    Spill(#[from] SpillError),
    #[error("the stream sent a row change outside any transaction")]
    OutsideTransaction,
}

#[derive(Debug)]
struct Open {
    xid: u32,
    changes: HeldChanges,
    messages: Vec<OwnMessage>,
}

#[derive(Debug)]
struct Streamed {
    /// Changes with the subtransaction xid they were made in, so a rolled-back
    /// savepoint drops exactly its own changes.
    changes: HeldChanges,
    messages: Vec<OwnMessage>,
}

impl Streamed {
    fn new(budget: &HeldBudget) -> Streamed {
        Streamed {
            changes: HeldChanges::new(budget.clone()),
            messages: Vec::new(),
        }
    }
}

#[derive(Debug)]
pub struct Assembler {
    schema: String,
    budget: HeldBudget,
    open: Option<Open>,
    /// The streamed transaction whose chunk is being received.
    in_chunk: Option<u32>,
    streamed: HashMap<u32, Streamed>,
}

impl Assembler {
    pub fn new(schema: impl Into<String>, budget: HeldBudget) -> Assembler {
        Assembler {
            schema: schema.into(),
            budget,
            open: None,
            in_chunk: None,
            streamed: HashMap::new(),
        }
    }

    /// True when no transaction is open or held: everything delivered so far
    /// has been handed out as a commit.
    pub fn is_idle(&self) -> bool {
        self.open.is_none() && self.in_chunk.is_none() && self.streamed.is_empty()
    }

    /// Rows held for transactions that have not committed yet.
    pub fn buffered_changes(&self) -> usize {
        self.open.as_ref().map_or(0, |o| o.changes.len())
            + self
                .streamed
                .values()
                .map(|s| s.changes.len())
                .sum::<usize>()
    }

    /// Takes one event. Async because a held transaction past the bound
    /// waits for its spill file's writer (a slow disk slows the stream, it
    /// does not grow memory or block the runtime's thread).
    pub async fn push(&mut self, event: &ChangeEvent) -> Result<Assembled, AssembleError> {
        match &event.event_type {
            EventType::Begin { transaction_id, .. } => {
                self.open = Some(Open {
                    xid: *transaction_id,
                    changes: HeldChanges::new(self.budget.clone()),
                    messages: Vec::new(),
                })
            }
            EventType::Commit {
                commit_timestamp,
                commit_lsn,
                end_lsn,
            } => {
                let (xid, changes, messages) = match self.open.take() {
                    Some(open) => (open.xid, open.changes, open.messages),
                    None => (0, HeldChanges::new(self.budget.clone()), Vec::new()),
                };
                return Ok(commit(
                    xid,
                    changes.finish().await?,
                    messages,
                    *commit_lsn,
                    *end_lsn,
                    *commit_timestamp,
                ));
            }
            EventType::StreamStart {
                transaction_id,
                first_segment,
            } => {
                self.in_chunk = Some(*transaction_id);
                if *first_segment {
                    // Replaces (and so removes the spill file of) a copy
                    // held from before a reconnect.
                    self.streamed
                        .insert(*transaction_id, Streamed::new(&self.budget));
                } else {
                    self.streamed
                        .entry(*transaction_id)
                        .or_insert_with(|| Streamed::new(&self.budget));
                }
            }
            EventType::StreamStop => self.in_chunk = None,
            EventType::StreamCommit {
                transaction_id,
                commit_lsn,
                end_lsn,
                commit_timestamp,
            } => {
                self.in_chunk = None;
                let held = self
                    .streamed
                    .remove(transaction_id)
                    .unwrap_or_else(|| Streamed::new(&self.budget));
                return Ok(commit(
                    *transaction_id,
                    held.changes.finish().await?,
                    held.messages,
                    *commit_lsn,
                    *end_lsn,
                    *commit_timestamp,
                ));
            }
            EventType::StreamAbort {
                transaction_id,
                subtransaction_xid,
                ..
            } => {
                if transaction_id == subtransaction_xid {
                    self.streamed.remove(transaction_id);
                } else if let Some(held) = self.streamed.get_mut(transaction_id) {
                    held.changes.abort_sub(*subtransaction_xid);
                }
            }
            EventType::Message {
                flags,
                prefix,
                content,
                message_lsn,
            } => {
                if !prefix.starts_with(super::MESSAGE_PREFIX) {
                    return Ok(Assembled::Pending);
                }
                let message = OwnMessage {
                    prefix: prefix.to_string(),
                    content: content.to_vec(),
                    lsn: Lsn(message_lsn.value()),
                };
                let transactional = flags & 1 == 1;
                if !transactional {
                    // Not part of any transaction: nothing to apply, but it
                    // still says how far the server got.
                    return Ok(Assembled::Pending);
                }
                if let Some(xid) = self.in_chunk {
                    self.streamed
                        .entry(xid)
                        .or_insert_with(|| Streamed::new(&self.budget))
                        .messages
                        .push(message);
                } else if let Some(open) = &mut self.open {
                    open.messages.push(message);
                }
            }
            other => {
                let changes = decode(&self.schema, other)?;
                if changes.is_empty() {
                    return Ok(Assembled::Pending);
                }
                if let Some(top) = self.in_chunk {
                    let sub = event.xid.unwrap_or(top);
                    let held = self
                        .streamed
                        .entry(top)
                        .or_insert_with(|| Streamed::new(&self.budget));
                    for change in changes {
                        held.changes.push(sub, change).await?;
                    }
                } else if let Some(open) = &mut self.open {
                    for change in changes {
                        open.changes.push(open.xid, change).await?;
                    }
                } else {
                    // A row outside any transaction would be a protocol bug;
                    // refuse it loudly rather than apply it half-known.
                    return Err(AssembleError::OutsideTransaction);
                }
            }
        }
        Ok(Assembled::Pending)
    }
}

fn commit(
    xid: u32,
    changes: crate::model::Changes,
    messages: Vec<OwnMessage>,
    commit_lsn: pg_walstream::Lsn,
    end_lsn: pg_walstream::Lsn,
    commit_time: DateTime<Utc>,
) -> Assembled {
    Assembled::Commit(
        Transaction {
            xid,
            commit_lsn: Lsn(commit_lsn.value()),
            end_lsn: Lsn(end_lsn.value()),
            commit_time,
            changes,
        },
        messages,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Change;
    use pg_walstream::{ColumnValue, Lsn as WalLsn, RowData};

    fn ev(event_type: EventType, xid: Option<u32>) -> ChangeEvent {
        ChangeEvent {
            event_type,
            lsn: WalLsn::new(1),
            metadata: None,
            xid,
        }
    }

    fn night(taken: i32) -> EventType {
        EventType::Insert {
            schema: "public".into(),
            table: "inventory".into(),
            relation_oid: 1,
            data: RowData::from_pairs(vec![
                ("hotel_id", ColumnValue::text("1")),
                ("room_type_id", ColumnValue::text("1")),
                ("night", ColumnValue::text("2027-01-01")),
                ("total", ColumnValue::text("9")),
                ("taken", ColumnValue::text(&taken.to_string())),
                ("sell_limit", ColumnValue::Null),
                ("price_cents", ColumnValue::Null),
            ]),
        }
    }

    fn begin(xid: u32) -> EventType {
        EventType::Begin {
            transaction_id: xid,
            final_lsn: WalLsn::new(100),
            commit_timestamp: Utc::now(),
        }
    }

    fn commit_ev(at: u64) -> EventType {
        EventType::Commit {
            commit_timestamp: Utc::now(),
            commit_lsn: WalLsn::new(at),
            end_lsn: WalLsn::new(at + 8),
        }
    }

    fn start(xid: u32, first: bool) -> EventType {
        EventType::StreamStart {
            transaction_id: xid,
            first_segment: first,
        }
    }

    fn stream_commit(xid: u32, at: u64) -> EventType {
        EventType::StreamCommit {
            transaction_id: xid,
            commit_lsn: WalLsn::new(at),
            end_lsn: WalLsn::new(at + 8),
            commit_timestamp: Utc::now(),
        }
    }

    fn abort(xid: u32, sub: u32) -> EventType {
        EventType::StreamAbort {
            transaction_id: xid,
            subtransaction_xid: sub,
            abort_lsn: None,
            abort_timestamp: None,
        }
    }

    fn committed(a: Assembled) -> Transaction {
        match a {
            Assembled::Commit(t, _) => t,
            Assembled::Pending => panic!("expected a commit"),
        }
    }

    fn taken_values(t: &Transaction) -> Vec<i32> {
        t.changes
            .to_vec()
            .unwrap()
            .into_iter()
            .map(|c| match c {
                Change::UpsertNight { counts, .. } => counts.taken,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[tokio::test]
    async fn nothing_leaves_before_commit() {
        let mut a = Assembler::new("public", HeldBudget::unbounded());
        assert_eq!(
            a.push(&ev(begin(5), None)).await.unwrap(),
            Assembled::Pending
        );
        assert_eq!(
            a.push(&ev(night(1), None)).await.unwrap(),
            Assembled::Pending
        );
        assert!(!a.is_idle());
        let t = committed(a.push(&ev(commit_ev(200), None)).await.unwrap());
        assert_eq!(taken_values(&t), vec![1]);
        assert_eq!(t.end_lsn, Lsn(208));
        assert_eq!(t.xid, 5, "the owner's xid goes with the transaction");
        assert!(a.is_idle());
    }

    #[tokio::test]
    async fn a_replayed_begin_starts_the_transaction_over() {
        let mut a = Assembler::new("public", HeldBudget::unbounded());
        a.push(&ev(begin(5), None)).await.unwrap();
        a.push(&ev(night(1), None)).await.unwrap();
        // reconnect: the server sends the same transaction again
        a.push(&ev(begin(5), None)).await.unwrap();
        a.push(&ev(night(1), None)).await.unwrap();
        let t = committed(a.push(&ev(commit_ev(200), None)).await.unwrap());
        assert_eq!(taken_values(&t), vec![1]);
    }

    #[tokio::test]
    async fn streamed_chunks_wait_for_stream_commit() {
        let mut a = Assembler::new("public", HeldBudget::unbounded());
        a.push(&ev(start(9, true), None)).await.unwrap();
        a.push(&ev(night(1), Some(9))).await.unwrap();
        a.push(&ev(EventType::StreamStop, None)).await.unwrap();
        // an ordinary transaction commits in between
        a.push(&ev(begin(10), None)).await.unwrap();
        a.push(&ev(night(7), None)).await.unwrap();
        assert_eq!(
            taken_values(&committed(a.push(&ev(commit_ev(150), None)).await.unwrap())),
            vec![7]
        );
        a.push(&ev(start(9, false), None)).await.unwrap();
        a.push(&ev(night(2), Some(9))).await.unwrap();
        a.push(&ev(EventType::StreamStop, None)).await.unwrap();
        let t = committed(a.push(&ev(stream_commit(9, 300), None)).await.unwrap());
        assert_eq!(taken_values(&t), vec![1, 2]);
        assert_eq!(t.xid, 9);
        assert!(a.is_idle());
    }

    #[tokio::test]
    async fn resent_chunks_then_abort_leave_nothing() {
        let mut a = Assembler::new("public", HeldBudget::unbounded());
        for _ in 0..2 {
            // the second round is the server resending after a reconnect
            a.push(&ev(start(9, true), None)).await.unwrap();
            a.push(&ev(night(1), Some(9))).await.unwrap();
            a.push(&ev(EventType::StreamStop, None)).await.unwrap();
        }
        assert_eq!(a.buffered_changes(), 1);
        a.push(&ev(abort(9, 9), None)).await.unwrap();
        assert!(a.is_idle());
        assert_eq!(a.buffered_changes(), 0);
    }

    #[tokio::test]
    async fn savepoint_abort_drops_only_its_changes() {
        let mut a = Assembler::new("public", HeldBudget::unbounded());
        a.push(&ev(start(9, true), None)).await.unwrap();
        a.push(&ev(night(1), Some(9))).await.unwrap();
        a.push(&ev(night(2), Some(11))).await.unwrap();
        a.push(&ev(night(3), Some(9))).await.unwrap();
        a.push(&ev(EventType::StreamStop, None)).await.unwrap();
        a.push(&ev(abort(9, 11), None)).await.unwrap();
        let t = committed(a.push(&ev(stream_commit(9, 300), None)).await.unwrap());
        assert_eq!(taken_values(&t), vec![1, 3]);
    }

    #[tokio::test]
    async fn a_row_outside_a_transaction_is_refused() {
        let mut a = Assembler::new("public", HeldBudget::unbounded());
        assert!(matches!(
            a.push(&ev(night(1), None)).await,
            Err(AssembleError::OutsideTransaction)
        ));
    }

    /// Past the bound: an open and a streamed transaction spill, a savepoint
    /// rolled back is left out of the file's reading, an abort and the
    /// assembler's drop (a reconnect) remove what they held.
    #[tokio::test]
    async fn held_transactions_spill_past_the_bound_and_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let budget = HeldBudget::new(16 * 1024, dir.path().to_path_buf());
        let spill_files = || std::fs::read_dir(dir.path()).unwrap().count();
        let mut a = Assembler::new("public", budget.clone());
        a.push(&ev(begin(5), None)).await.unwrap();
        for i in 0..2_000 {
            a.push(&ev(night(i), None)).await.unwrap();
        }
        assert_eq!(spill_files(), 1, "the open transaction spilled");
        let whole = committed(a.push(&ev(commit_ev(200), None)).await.unwrap());
        assert!(whole.changes.spilled_bytes().is_some());
        assert_eq!(taken_values(&whole), (0..2_000).collect::<Vec<_>>());
        assert_eq!(
            taken_values(&whole),
            (0..2_000).collect::<Vec<_>>(),
            "twice"
        );
        drop(whole);
        assert_eq!(spill_files(), 0, "applied and dropped: removed");

        a.push(&ev(start(9, true), None)).await.unwrap();
        for i in 0..3_000 {
            let sub = if i % 2 == 0 { 9 } else { 11 };
            a.push(&ev(night(i), Some(sub))).await.unwrap();
        }
        a.push(&ev(EventType::StreamStop, None)).await.unwrap();
        a.push(&ev(abort(9, 11), None)).await.unwrap();
        let streamed = committed(a.push(&ev(stream_commit(9, 300), None)).await.unwrap());
        assert_eq!(
            taken_values(&streamed),
            (0..3_000).step_by(2).collect::<Vec<_>>()
        );
        drop(streamed);

        a.push(&ev(start(12, true), None)).await.unwrap();
        for i in 0..2_000 {
            a.push(&ev(night(i), Some(12))).await.unwrap();
        }
        assert_eq!(spill_files(), 1);
        a.push(&ev(abort(12, 12), None)).await.unwrap();
        assert_eq!(spill_files(), 0, "aborted: removed");

        a.push(&ev(begin(13), None)).await.unwrap();
        for i in 0..2_000 {
            a.push(&ev(night(i), None)).await.unwrap();
        }
        assert_eq!(spill_files(), 1);
        drop(a);
        assert_eq!(spill_files(), 0, "the session ended: removed");
        assert_eq!(budget.held_bytes(), 0);
    }
}

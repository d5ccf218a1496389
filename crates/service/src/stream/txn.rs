//! Assemble: group the stream's events into whole committed transactions.
//!
//! The read model applies a transaction only at its commit, so nothing here
//! reaches a reader early. Streamed in-progress transactions (protocol 2) are
//! held until `StreamCommit` and dropped on `StreamAbort`: after a reconnect
//! the server can resend chunks of a transaction that then aborts, and
//! applying chunks early would show changes that never committed. A `Begin`
//! or a first chunk for a transaction already held starts it over, since a
//! reconnect replays it from the start.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use pg_walstream::{ChangeEvent, EventType};

use super::decode::{DecodeError, decode};
use crate::lsn::Lsn;
use crate::model::{Change, Transaction};

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

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AssembleError {
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("the stream sent a row change outside any transaction")]
    OutsideTransaction,
}

#[derive(Debug, Default)]
struct Open {
    xid: u32,
    changes: Vec<Change>,
    messages: Vec<OwnMessage>,
}

#[derive(Debug, Default)]
struct Streamed {
    /// Changes with the subtransaction xid they were made in, so a rolled-back
    /// savepoint drops exactly its own changes.
    changes: Vec<(u32, Change)>,
    messages: Vec<OwnMessage>,
}

#[derive(Debug)]
pub struct Assembler {
    schema: String,
    open: Option<Open>,
    /// The streamed transaction whose chunk is being received.
    in_chunk: Option<u32>,
    streamed: HashMap<u32, Streamed>,
}

impl Assembler {
    pub fn new(schema: impl Into<String>) -> Assembler {
        Assembler {
            schema: schema.into(),
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

    pub fn push(&mut self, event: &ChangeEvent) -> Result<Assembled, AssembleError> {
        match &event.event_type {
            EventType::Begin { transaction_id, .. } => {
                self.open = Some(Open {
                    xid: *transaction_id,
                    ..Open::default()
                })
            }
            EventType::Commit {
                commit_timestamp,
                commit_lsn,
                end_lsn,
            } => {
                let open = self.open.take().unwrap_or_default();
                return Ok(commit(
                    open.xid,
                    open.changes,
                    open.messages,
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
                    self.streamed.insert(*transaction_id, Streamed::default());
                } else {
                    self.streamed.entry(*transaction_id).or_default();
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
                let held = self.streamed.remove(transaction_id).unwrap_or_default();
                let changes = held.changes.into_iter().map(|(_, c)| c).collect();
                return Ok(commit(
                    *transaction_id,
                    changes,
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
                    held.changes.retain(|(xid, _)| xid != subtransaction_xid);
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
                    self.streamed.entry(xid).or_default().messages.push(message);
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
                    let held = self.streamed.entry(top).or_default();
                    held.changes.extend(changes.into_iter().map(|c| (sub, c)));
                } else if let Some(open) = &mut self.open {
                    open.changes.extend(changes);
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
    changes: Vec<Change>,
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
            .iter()
            .map(|c| match c {
                Change::UpsertNight { counts, .. } => counts.taken,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn nothing_leaves_before_commit() {
        let mut a = Assembler::new("public");
        assert_eq!(a.push(&ev(begin(5), None)).unwrap(), Assembled::Pending);
        assert_eq!(a.push(&ev(night(1), None)).unwrap(), Assembled::Pending);
        assert!(!a.is_idle());
        let t = committed(a.push(&ev(commit_ev(200), None)).unwrap());
        assert_eq!(taken_values(&t), vec![1]);
        assert_eq!(t.end_lsn, Lsn(208));
        assert_eq!(t.xid, 5, "the owner's xid goes with the transaction");
        assert!(a.is_idle());
    }

    #[test]
    fn a_replayed_begin_starts_the_transaction_over() {
        let mut a = Assembler::new("public");
        a.push(&ev(begin(5), None)).unwrap();
        a.push(&ev(night(1), None)).unwrap();
        // reconnect: the server sends the same transaction again
        a.push(&ev(begin(5), None)).unwrap();
        a.push(&ev(night(1), None)).unwrap();
        let t = committed(a.push(&ev(commit_ev(200), None)).unwrap());
        assert_eq!(taken_values(&t), vec![1]);
    }

    #[test]
    fn streamed_chunks_wait_for_stream_commit() {
        let mut a = Assembler::new("public");
        a.push(&ev(start(9, true), None)).unwrap();
        a.push(&ev(night(1), Some(9))).unwrap();
        a.push(&ev(EventType::StreamStop, None)).unwrap();
        // an ordinary transaction commits in between
        a.push(&ev(begin(10), None)).unwrap();
        a.push(&ev(night(7), None)).unwrap();
        assert_eq!(
            taken_values(&committed(a.push(&ev(commit_ev(150), None)).unwrap())),
            vec![7]
        );
        a.push(&ev(start(9, false), None)).unwrap();
        a.push(&ev(night(2), Some(9))).unwrap();
        a.push(&ev(EventType::StreamStop, None)).unwrap();
        let t = committed(a.push(&ev(stream_commit(9, 300), None)).unwrap());
        assert_eq!(taken_values(&t), vec![1, 2]);
        assert_eq!(t.xid, 9);
        assert!(a.is_idle());
    }

    #[test]
    fn resent_chunks_then_abort_leave_nothing() {
        let mut a = Assembler::new("public");
        for _ in 0..2 {
            // the second round is the server resending after a reconnect
            a.push(&ev(start(9, true), None)).unwrap();
            a.push(&ev(night(1), Some(9))).unwrap();
            a.push(&ev(EventType::StreamStop, None)).unwrap();
        }
        assert_eq!(a.buffered_changes(), 1);
        a.push(&ev(abort(9, 9), None)).unwrap();
        assert!(a.is_idle());
        assert_eq!(a.buffered_changes(), 0);
    }

    #[test]
    fn savepoint_abort_drops_only_its_changes() {
        let mut a = Assembler::new("public");
        a.push(&ev(start(9, true), None)).unwrap();
        a.push(&ev(night(1), Some(9))).unwrap();
        a.push(&ev(night(2), Some(11))).unwrap();
        a.push(&ev(night(3), Some(9))).unwrap();
        a.push(&ev(EventType::StreamStop, None)).unwrap();
        a.push(&ev(abort(9, 11), None)).unwrap();
        let t = committed(a.push(&ev(stream_commit(9, 300), None)).unwrap());
        assert_eq!(taken_values(&t), vec![1, 3]);
    }

    #[test]
    fn a_row_outside_a_transaction_is_refused() {
        let mut a = Assembler::new("public");
        assert_eq!(
            a.push(&ev(night(1), None)),
            Err(AssembleError::OutsideTransaction)
        );
    }
}

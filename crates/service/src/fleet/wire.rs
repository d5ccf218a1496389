//! The change stream's messages: what the projector publishes and a replica
//! applies, their ids and their order.
//!
//! Every message names its place in the stream of one epoch (`Position`):
//! the LSN it belongs to, a kind, and a sequence within that LSN. Positions
//! are totally ordered, the projector publishes them in that order, and a
//! consumer drops anything at or below what it applied, so a message that
//! JetStream stored twice (a re-sent publish past the duplicate window, a
//! projector that replayed its slot) is never applied twice.
//!
//! The message id (`Nats-Msg-Id`) is the position written out, so it is
//! deterministic: the same change re-sent gets the same id and JetStream's
//! duplicate window absorbs it. The LSN alone would collide: a re-read merge
//! shares its LSN with the high-watermark transaction it follows.
//!
//! Encoding: postcard, as the checkpoint's records (compact varints, no
//! schema to ship; the epoch and kinds are what a reader checks).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::lsn::Lsn;
use crate::model::{Change, HeldBudget, HeldChanges, SpillError, Transaction};

/// Bumped on any change to the encoding; a replica refuses another version.
pub const WIRE_VERSION: u8 = 1;

/// The kinds of message, in their order at one LSN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Kind {
    /// Part of a transaction too large for one message.
    Chunk = 0,
    /// A whole transaction, or the commit marker after its chunks.
    Commit = 1,
    /// A TTL re-read merge made right after the transaction at this LSN.
    Merge = 2,
    /// The applied position moved with no data (keepalive, heartbeat).
    Advance = 3,
    /// A projector took over the stream (see `Body::Takeover`).
    Takeover = 4,
}

impl Kind {
    fn letter(self) -> char {
        match self {
            Kind::Chunk => 'c',
            Kind::Commit => 't',
            Kind::Merge => 'm',
            Kind::Advance => 'a',
            Kind::Takeover => 'o',
        }
    }
}

/// A message's place: ordered by epoch, then LSN, kind and sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Position {
    pub epoch: u64,
    pub lsn: u64,
    pub kind: Kind,
    pub seq: u32,
}

impl Position {
    /// The `Nats-Msg-Id`: `<epoch>-<lsn>-<kind><seq>`, in hex where it is a
    /// WAL position.
    pub fn message_id(&self) -> String {
        format!(
            "{:x}-{:x}-{}{}",
            self.epoch,
            self.lsn,
            self.kind.letter(),
            self.seq
        )
    }

    pub fn lsn(&self) -> Lsn {
        Lsn(self.lsn)
    }
}

/// What a message carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Body {
    /// Changes of a transaction whose commit marker follows.
    Chunk { changes: Vec<Change> },
    /// A transaction's commit: its changes when it fits in one message
    /// (`chunks == 0`), or the marker after `chunks` chunks.
    Commit {
        xid: u32,
        commit_lsn: u64,
        commit_time_us: i64,
        chunks: u32,
        changes: Vec<Change>,
    },
    /// The nights a TTL re-read merge changed, as upserts and deletes.
    Merge { changes: Vec<Change> },
    /// No data: the applied position is now the message's LSN.
    Advance,
    /// The message's holder publishes from here on; `after` is the last
    /// data position stored before it. Consumers apply nothing of it; a
    /// publisher that finds another holder's marker after its own is fenced.
    Takeover { after: Option<Position> },
}

/// One message on the change stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub version: u8,
    /// Which projector process published it (random per process).
    pub holder: u64,
    pub position: Position,
    pub body: Body,
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("cannot decode a change-stream message: {0}")]
    Decode(#[from] postcard::Error),
    #[error("change-stream message of wire version {found}; this build reads {WIRE_VERSION}")]
    Version { found: u8 },
    #[error("the commit marker at {lsn} follows {held} chunks, it names {expected}")]
    ChunksMissing { lsn: Lsn, held: u32, expected: u32 },
    #[error("holding a chunked transaction: {0}")]
    Spill(#[from] SpillError),
}

impl Message {
    /// The message id: the position's, or for a takeover marker one of
    /// its own holder (a marker has no data position).
    pub fn message_id(&self) -> String {
        match self.body {
            Body::Takeover { .. } => format!("takeover-{:x}", self.holder),
            _ => self.position.message_id(),
        }
    }

    /// The last data position this message stands for: its own, or for a
    /// takeover marker the one it was published after.
    pub fn data_position(&self) -> Option<Position> {
        match self.body {
            Body::Takeover { after } => after,
            _ => Some(self.position),
        }
    }

    /// A takeover marker by `holder`, published after `after`.
    pub fn takeover(holder: u64, after: Option<Position>) -> Message {
        let position = after.unwrap_or(Position {
            epoch: 0,
            lsn: 0,
            kind: Kind::Takeover,
            seq: 0,
        });
        Message {
            version: WIRE_VERSION,
            holder,
            position: Position {
                kind: Kind::Takeover,
                seq: 0,
                ..position
            },
            body: Body::Takeover { after },
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        // Encoding plain data into a Vec cannot fail.
        postcard::to_stdvec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Message, WireError> {
        // The version comes first: check it before trusting the rest.
        if let Some(&found) = bytes.first()
            && found != WIRE_VERSION
        {
            return Err(WireError::Version { found });
        }
        Ok(postcard::from_bytes(bytes)?)
    }
}

/// The messages one applied transaction becomes: a single `Commit`, or
/// chunks of at most about `max_bytes` each and then a `Commit` marker. A
/// spilled transaction is read back from its file (`SpillError` if it
/// cannot be, whole).
pub fn transaction_messages(
    epoch: u64,
    txn: &Transaction,
    max_bytes: usize,
) -> Result<Vec<Message>, SpillError> {
    let commit = |chunks: u32, changes: Vec<Change>| Message {
        version: WIRE_VERSION,
        holder: 0,
        position: Position {
            epoch,
            lsn: txn.end_lsn.0,
            kind: Kind::Commit,
            seq: 0,
        },
        body: Body::Commit {
            xid: txn.xid,
            commit_lsn: txn.commit_lsn.0,
            commit_time_us: txn.commit_time.timestamp_micros(),
            chunks,
            changes,
        },
    };
    let mut pieces = Splitter::new(max_bytes);
    txn.changes.for_each(|change| {
        pieces.push(change);
        Ok::<(), SpillError>(())
    })?;
    let mut pieces = pieces.finish();
    if pieces.len() <= 1 {
        return Ok(vec![commit(0, pieces.pop().unwrap_or_default())]);
    }
    let mut messages: Vec<Message> = pieces
        .into_iter()
        .enumerate()
        .map(|(index, changes)| Message {
            version: WIRE_VERSION,
            holder: 0,
            position: Position {
                epoch,
                lsn: txn.end_lsn.0,
                kind: Kind::Chunk,
                seq: index as u32,
            },
            body: Body::Chunk { changes },
        })
        .collect();
    let chunks = messages.len() as u32;
    messages.push(commit(chunks, Vec::new()));
    Ok(messages)
}

/// The messages of one re-read merge at `lsn` (the `seq`th after that
/// LSN's transaction): like a transaction's, its changes may be cut in
/// parts, each its own `Merge` (a merge is idempotent and needs no marker:
/// it sets nights to the owner's values).
pub fn merge_messages(
    epoch: u64,
    lsn: Lsn,
    first_seq: u32,
    changes: &[Change],
    max_bytes: usize,
) -> Vec<Message> {
    split(changes, max_bytes)
        .into_iter()
        .enumerate()
        .map(|(index, part)| Message {
            version: WIRE_VERSION,
            holder: 0,
            position: Position {
                epoch,
                lsn: lsn.0,
                kind: Kind::Merge,
                seq: first_seq + index as u32,
            },
            body: Body::Merge { changes: part },
        })
        .collect()
}

pub fn advance_message(epoch: u64, lsn: Lsn) -> Message {
    Message {
        version: WIRE_VERSION,
        holder: 0,
        position: Position {
            epoch,
            lsn: lsn.0,
            kind: Kind::Advance,
            seq: 0,
        },
        body: Body::Advance,
    }
}

/// Cuts `changes` into runs whose encoding stays under `max_bytes` (a
/// single change larger than that travels alone: the server's
/// `max_payload` is what finally refuses it).
fn split(changes: &[Change], max_bytes: usize) -> Vec<Vec<Change>> {
    let mut pieces = Splitter::new(max_bytes);
    for change in changes {
        pieces.push(change);
    }
    pieces.finish()
}

/// `split`, one change at a time.
struct Splitter {
    budget: usize,
    parts: Vec<Vec<Change>>,
    current: Vec<Change>,
    size: usize,
}

impl Splitter {
    fn new(max_bytes: usize) -> Splitter {
        Splitter {
            // Room for the envelope around the changes.
            budget: max_bytes.saturating_sub(64).max(1),
            parts: Vec::new(),
            current: Vec::new(),
            size: 0,
        }
    }

    fn push(&mut self, change: &Change) {
        let one = postcard::experimental::serialized_size(change).unwrap_or(64);
        if !self.current.is_empty() && self.size + one > self.budget {
            self.parts.push(std::mem::take(&mut self.current));
            self.size = 0;
        }
        self.size += one;
        self.current.push(change.clone());
    }

    fn finish(mut self) -> Vec<Vec<Change>> {
        if !self.current.is_empty() || self.parts.is_empty() {
            self.parts.push(self.current);
        }
        self.parts
    }
}

/// A replica's assembly of chunked transactions: chunks are held until
/// their commit marker, as the projector holds pgoutput's streamed chunks,
/// in memory up to the replica's `stream.max_held_bytes` and in a spill
/// file past it (`model::held`).
#[derive(Debug)]
pub struct Assembly {
    budget: HeldBudget,
    held_lsn: Option<u64>,
    held: HeldChanges,
    chunks: u32,
}

impl Assembly {
    pub fn new(budget: HeldBudget) -> Assembly {
        Assembly {
            held: HeldChanges::new(budget.clone()),
            budget,
            held_lsn: None,
            chunks: 0,
        }
    }

    /// Takes one message; returns a transaction when its commit completes
    /// one. A first chunk (or a chunk of another LSN) starts over: a
    /// projector that took over from one that failed mid-transaction sends
    /// that transaction again from its first chunk. A chunk that is not the
    /// next one expected is a repeat and is dropped.
    pub async fn push(
        &mut self,
        position: Position,
        body: Body,
    ) -> Result<Option<Transaction>, WireError> {
        match body {
            Body::Chunk { changes } => {
                if self.held_lsn != Some(position.lsn) || position.seq == 0 {
                    self.reset();
                    self.held_lsn = Some(position.lsn);
                }
                if position.seq != self.chunks {
                    return Ok(None);
                }
                for change in changes {
                    // A replica's changes carry no subtransactions: the
                    // projector published only what committed.
                    self.held.push(0, change).await?;
                }
                self.chunks += 1;
                Ok(None)
            }
            Body::Commit {
                xid,
                commit_lsn,
                commit_time_us,
                chunks,
                changes,
            } => {
                let all = if chunks == 0 {
                    let mut inline = changes;
                    inline.shrink_to_fit();
                    crate::model::Changes::from(inline)
                } else {
                    if self.held_lsn != Some(position.lsn) || self.chunks != chunks {
                        let held = if self.held_lsn == Some(position.lsn) {
                            self.chunks
                        } else {
                            0
                        };
                        self.reset();
                        return Err(WireError::ChunksMissing {
                            lsn: position.lsn(),
                            held,
                            expected: chunks,
                        });
                    }
                    let held =
                        std::mem::replace(&mut self.held, HeldChanges::new(self.budget.clone()));
                    held.finish().await?
                };
                self.reset();
                Ok(Some(Transaction {
                    xid,
                    commit_lsn: Lsn(commit_lsn),
                    end_lsn: position.lsn(),
                    commit_time: DateTime::<Utc>::from_timestamp_micros(commit_time_us)
                        .unwrap_or_default(),
                    changes: all,
                }))
            }
            Body::Merge { .. } | Body::Advance | Body::Takeover { .. } => Ok(None),
        }
    }

    /// Drops what is held (its spill file with it).
    pub fn reset(&mut self) {
        self.held_lsn = None;
        self.held = HeldChanges::new(self.budget.clone());
        self.chunks = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{CalendarKey, NightCounts};
    use chrono::NaiveDate;

    fn night_change(i: i64) -> Change {
        Change::UpsertNight {
            key: CalendarKey {
                hotel_id: i,
                room_type_id: i * 10,
            },
            night: NaiveDate::from_ymd_opt(2027, 1, 1).unwrap() + chrono::Days::new(i as u64 % 300),
            counts: NightCounts {
                total: 5,
                taken: (i % 5) as i32,
                sell_limit: None,
                price_cents: Some(12_000),
            },
        }
    }

    fn txn(n: i64) -> Transaction {
        Transaction {
            xid: 777,
            commit_lsn: Lsn(0x1000),
            end_lsn: Lsn(0x1040),
            commit_time: DateTime::<Utc>::from_timestamp_micros(1_800_000_000_000_000).unwrap(),
            changes: (0..n).map(night_change).collect::<Vec<_>>().into(),
        }
    }

    fn through_the_wire(messages: Vec<Message>) -> Vec<Message> {
        messages
            .into_iter()
            .map(|m| Message::decode(&m.encode()).expect("decodes"))
            .collect()
    }

    #[tokio::test]
    async fn a_small_transaction_is_one_commit_and_round_trips() {
        let t = txn(3);
        let messages = through_the_wire(transaction_messages(9, &t, 4096).unwrap());
        assert_eq!(messages.len(), 1);
        let mut assembly = Assembly::new(HeldBudget::unbounded());
        let m = messages.into_iter().next().unwrap();
        assert_eq!(m.position.kind, Kind::Commit);
        let back = assembly
            .push(m.position, m.body)
            .await
            .unwrap()
            .expect("whole");
        assert_eq!(back, t);
    }

    #[tokio::test]
    async fn a_large_transaction_is_chunked_under_the_limit_and_applies_only_at_its_marker() {
        let t = txn(5_000);
        let messages = transaction_messages(9, &t, 4096).unwrap();
        assert!(messages.len() > 10, "{} messages", messages.len());
        for m in &messages {
            assert!(m.encode().len() <= 4096, "{} bytes", m.encode().len());
        }
        let mut assembly = Assembly::new(HeldBudget::unbounded());
        let mut whole = None;
        let count = messages.len();
        for (i, m) in through_the_wire(messages).into_iter().enumerate() {
            let out = assembly.push(m.position, m.body).await.unwrap();
            if i + 1 < count {
                assert!(out.is_none(), "nothing before the marker");
            } else {
                whole = out;
            }
        }
        assert_eq!(whole.expect("the marker completes it"), t);
    }

    #[tokio::test]
    async fn a_marker_without_all_its_chunks_is_refused() {
        let t = txn(5_000);
        let mut messages = transaction_messages(9, &t, 4096).unwrap();
        messages.remove(1);
        let mut assembly = Assembly::new(HeldBudget::unbounded());
        let mut refused = false;
        for m in messages {
            match assembly.push(m.position, m.body).await {
                Err(WireError::ChunksMissing { .. }) => refused = true,
                Ok(Some(_)) => panic!("applied a transaction with a chunk missing"),
                _ => {}
            }
        }
        assert!(refused);
    }

    #[tokio::test]
    async fn a_transaction_sent_again_from_its_first_chunk_assembles_once() {
        let t = txn(5_000);
        let messages = transaction_messages(9, &t, 4096).unwrap();
        let chunks = messages.len() - 1;
        // The first projector sent three chunks and died; the next sends the
        // whole transaction again; a stray repeat of chunk 1 comes between.
        let mut stream: Vec<Message> = messages[..3].to_vec();
        stream.push(messages[1].clone());
        stream.extend(messages.iter().cloned());
        let mut assembly = Assembly::new(HeldBudget::unbounded());
        let mut whole = Vec::new();
        for m in stream {
            if let Some(t) = assembly.push(m.position, m.body).await.unwrap() {
                whole.push(t);
            }
        }
        assert!(chunks > 3);
        assert_eq!(whole, vec![t], "exactly one, complete");
    }

    /// A replica with a small bound: the chunks of a large transaction go to
    /// a spill file, the marker completes it whole, and its file goes with
    /// it; a transaction sent again from its first chunk drops the file of
    /// the first attempt.
    #[tokio::test]
    async fn a_replica_spills_a_large_chunked_transaction_past_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let spill_files = || std::fs::read_dir(dir.path()).unwrap().count();
        let budget = HeldBudget::new(64 * 1024, dir.path().to_path_buf());
        let t = txn(20_000);
        let messages = transaction_messages(9, &t, 4096).unwrap();
        let mut assembly = Assembly::new(budget.clone());
        for m in messages[..messages.len() / 2].iter().cloned() {
            assert!(assembly.push(m.position, m.body).await.unwrap().is_none());
        }
        assert_eq!(spill_files(), 1, "spilled past 64 KiB");
        let mut whole = None;
        for m in messages.iter().cloned() {
            if let Some(done) = assembly.push(m.position, m.body).await.unwrap() {
                whole = Some(done);
            }
        }
        let whole = whole.expect("the marker completes it");
        assert_eq!(spill_files(), 1, "the first attempt's file is gone");
        assert!(whole.changes.spilled_bytes().is_some());
        assert_eq!(whole.changes.to_vec().unwrap(), t.changes.to_vec().unwrap());
        assert_eq!(whole.xid, t.xid);
        drop(whole);
        assert_eq!(spill_files(), 0);
        assert_eq!(budget.held_bytes(), 0);
    }

    #[test]
    fn a_takeover_marker_stands_for_the_position_before_it() {
        let before = advance_message(3, Lsn(0x500)).position;
        let marker = Message::decode(&Message::takeover(0xabc, Some(before)).encode()).unwrap();
        assert_eq!(marker.data_position(), Some(before));
        assert_eq!(marker.message_id(), "takeover-abc");
        assert_eq!(Message::takeover(1, None).data_position(), None);
    }

    #[test]
    fn positions_order_kinds_at_one_lsn_and_ids_differ() {
        let t = txn(5_000);
        let mut all = transaction_messages(1, &t, 4096).unwrap();
        all.extend(merge_messages(1, t.end_lsn, 0, &[night_change(1)], 4096));
        all.push(advance_message(1, Lsn(0x2000)));
        let positions: Vec<Position> = all.iter().map(|m| m.position).collect();
        let mut sorted = positions.clone();
        sorted.sort();
        assert_eq!(positions, sorted, "published in position order");
        let ids: std::collections::HashSet<String> =
            positions.iter().map(Position::message_id).collect();
        assert_eq!(ids.len(), positions.len(), "every id unique");
        // Deterministic: the same transaction gives the same ids.
        let again: Vec<String> = transaction_messages(1, &t, 4096)
            .unwrap()
            .iter()
            .map(|m| m.position.message_id())
            .collect();
        assert_eq!(again[0], ids_of(&all)[0]);
        // A later epoch orders after anything of an earlier one.
        assert!(advance_message(2, Lsn(1)).position > advance_message(1, Lsn(u64::MAX)).position);
    }

    fn ids_of(messages: &[Message]) -> Vec<String> {
        messages.iter().map(|m| m.position.message_id()).collect()
    }

    #[test]
    fn another_version_is_refused_before_decoding() {
        let mut bytes = advance_message(1, Lsn(5)).encode();
        bytes[0] = WIRE_VERSION + 1;
        assert!(matches!(
            Message::decode(&bytes),
            Err(WireError::Version { .. })
        ));
        assert!(Message::decode(&[WIRE_VERSION, 0xff, 0xff]).is_err());
    }
}

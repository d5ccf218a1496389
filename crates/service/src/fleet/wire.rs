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
use crate::model::held::Walk;
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

/// The `Nats-Msg-Id` of a data message: its position and the process that
/// published it. A process that sends a message again (a lost
/// acknowledgement) gets JetStream's duplicate answer; another process
/// never does. That matters when a new holder sends again, after its
/// takeover marker, the first chunks of a transaction the old holder left
/// unfinished: with the position's id alone they were duplicates within
/// JetStream's window (two minutes), answered as stored but not stored
/// after the marker, and the next chunk was refused until the window
/// passed. (What an earlier holder stored is never sent again whole: a
/// publisher reads the stream's last message and skips up to it.)
pub fn data_message_id(position: Position, holder: u64) -> String {
    format!("{}-{holder:x}", position.message_id())
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
    /// The message id: the position's and its holder's
    /// (`data_message_id`), or for a takeover marker its holder's alone (a
    /// marker has no data position).
    pub fn message_id(&self) -> String {
        match self.body {
            Body::Takeover { .. } => format!("takeover-{:x}", self.holder),
            _ => data_message_id(self.position, self.holder),
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
/// cannot be, whole). All at once: for tests; the publisher takes them one
/// at a time (`TransactionMessages`).
#[cfg(test)]
pub fn transaction_messages(
    epoch: u64,
    txn: &Transaction,
    max_bytes: usize,
) -> Result<Vec<Message>, SpillError> {
    let mut made = TransactionMessages::new(epoch, txn.clone(), max_bytes);
    let mut messages = Vec::new();
    while let Some(message) = made.next_message()? {
        messages.push(message);
    }
    Ok(messages)
}

/// One transaction's messages made one at a time while its changes are
/// walked, so that whoever publishes them holds a chunk and not the
/// transaction (73M changed rows would be about 5 GB encoded). The same
/// messages, in the same order, as the transaction cut whole: a first piece
/// that turns out to be all there is goes as a single `Commit` with its
/// changes, otherwise every piece goes as a `Chunk` (numbered from 0) and
/// a `Commit` marker naming how many follows the last. Whether there is a
/// second piece is known only when a change does not fit beside the first,
/// so a piece is made when the change after it arrives.
pub struct TransactionMessages {
    epoch: u64,
    xid: u32,
    commit_lsn: u64,
    end_lsn: u64,
    commit_time_us: i64,
    walk: Walk,
    cutter: Cutter,
    /// Chunks made so far.
    chunks: u32,
    stage: Stage,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Walking,
    /// Every chunk made; the commit marker is next.
    Marker,
    Done,
}

impl TransactionMessages {
    pub fn new(epoch: u64, txn: Transaction, max_bytes: usize) -> TransactionMessages {
        TransactionMessages {
            epoch,
            xid: txn.xid,
            commit_lsn: txn.commit_lsn.0,
            end_lsn: txn.end_lsn.0,
            commit_time_us: txn.commit_time.timestamp_micros(),
            walk: txn.changes.into_walk(),
            cutter: Cutter::new(max_bytes),
            chunks: 0,
            stage: Stage::Walking,
        }
    }

    /// The next message (`holder` 0: the publisher sets it), `None` after
    /// the commit. Reads the spill file, if any, as far as that message.
    pub fn next_message(&mut self) -> Result<Option<Message>, SpillError> {
        loop {
            match self.stage {
                Stage::Done => return Ok(None),
                Stage::Marker => {
                    self.stage = Stage::Done;
                    return Ok(Some(self.commit(self.chunks, Vec::new())));
                }
                Stage::Walking => match self.walk.next_change()? {
                    Some(change) => {
                        if let Some(piece) = self.cutter.push(change) {
                            return Ok(Some(self.chunk(piece)));
                        }
                    }
                    None => {
                        let last = self.cutter.take();
                        if self.chunks == 0 {
                            self.stage = Stage::Done;
                            return Ok(Some(self.commit(0, last)));
                        }
                        // A cut leaves the change that did not fit in the
                        // piece after it, so the last piece has one.
                        debug_assert!(!last.is_empty(), "a chunked transaction's last piece");
                        self.stage = Stage::Marker;
                        return Ok(Some(self.chunk(last)));
                    }
                },
            }
        }
    }

    fn position(&self, kind: Kind, seq: u32) -> Position {
        Position {
            epoch: self.epoch,
            lsn: self.end_lsn,
            kind,
            seq,
        }
    }

    fn chunk(&mut self, changes: Vec<Change>) -> Message {
        let position = self.position(Kind::Chunk, self.chunks);
        self.chunks += 1;
        Message {
            version: WIRE_VERSION,
            holder: 0,
            position,
            body: Body::Chunk { changes },
        }
    }

    fn commit(&self, chunks: u32, changes: Vec<Change>) -> Message {
        Message {
            version: WIRE_VERSION,
            holder: 0,
            position: self.position(Kind::Commit, 0),
            body: Body::Commit {
                xid: self.xid,
                commit_lsn: self.commit_lsn,
                commit_time_us: self.commit_time_us,
                chunks,
                changes,
            },
        }
    }
}

/// The messages of one re-read merge at `lsn` (the `seq`th after that
/// LSN's transaction): like a transaction's, its changes may be cut in
/// parts, each its own `Merge` (a merge is idempotent and needs no marker:
/// it sets nights to the owner's values). All at once: for tests.
#[cfg(test)]
pub fn merge_messages(
    epoch: u64,
    lsn: Lsn,
    first_seq: u32,
    changes: &[Change],
    max_bytes: usize,
) -> Vec<Message> {
    let mut made = MergeMessages::new(epoch, lsn, first_seq, changes.to_vec(), max_bytes);
    std::iter::from_fn(|| made.next_message()).collect()
}

/// One re-read merge's messages, made one at a time: the merge is in
/// memory already, its encoding need not be all at once.
pub struct MergeMessages {
    epoch: u64,
    lsn: u64,
    /// The sequence of the next message.
    seq: u32,
    made: u32,
    changes: std::vec::IntoIter<Change>,
    cutter: Cutter,
    done: bool,
}

impl MergeMessages {
    pub fn new(
        epoch: u64,
        lsn: Lsn,
        first_seq: u32,
        changes: Vec<Change>,
        max_bytes: usize,
    ) -> MergeMessages {
        MergeMessages {
            epoch,
            lsn: lsn.0,
            seq: first_seq,
            made: 0,
            changes: changes.into_iter(),
            cutter: Cutter::new(max_bytes),
            done: false,
        }
    }

    /// The next message, `None` after the last (an empty merge is one
    /// empty message, as cutting it whole gave; the publisher skips empty
    /// merges).
    pub fn next_message(&mut self) -> Option<Message> {
        if self.done {
            return None;
        }
        for change in self.changes.by_ref() {
            if let Some(piece) = self.cutter.push(change) {
                return Some(self.part(piece));
            }
        }
        self.done = true;
        let last = self.cutter.take();
        (!last.is_empty() || self.made == 0).then(|| self.part(last))
    }

    /// The sequence the message after this merge's last takes.
    pub fn next_seq(&self) -> u32 {
        self.seq
    }

    fn part(&mut self, changes: Vec<Change>) -> Message {
        let seq = self.seq;
        self.seq += 1;
        self.made += 1;
        Message {
            version: WIRE_VERSION,
            holder: 0,
            position: Position {
                epoch: self.epoch,
                lsn: self.lsn,
                kind: Kind::Merge,
                seq,
            },
            body: Body::Merge { changes },
        }
    }
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

/// Cuts changes, one at a time, into pieces whose encoding stays under
/// `max_bytes` (a single change larger than that travels alone: the
/// server's `max_payload` is what finally refuses it).
struct Cutter {
    budget: usize,
    current: Vec<Change>,
    size: usize,
}

impl Cutter {
    fn new(max_bytes: usize) -> Cutter {
        Cutter {
            // Room for the envelope around the changes.
            budget: max_bytes.saturating_sub(64).max(1),
            current: Vec::new(),
            size: 0,
        }
    }

    /// Adds `change` to the piece being cut; returns that piece when the
    /// change does not fit beside it (the change starts the next one).
    fn push(&mut self, change: Change) -> Option<Vec<Change>> {
        let one = postcard::experimental::serialized_size(&change).unwrap_or(64);
        let full = (!self.current.is_empty() && self.size + one > self.budget).then(|| self.take());
        self.size += one;
        self.current.push(change);
        full
    }

    /// The piece being cut, as it is.
    fn take(&mut self) -> Vec<Change> {
        self.size = 0;
        std::mem::take(&mut self.current)
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
    /// one. Only a first chunk starts over: a projector that took over from
    /// one that failed mid-transaction sends that transaction again from its
    /// first chunk. Any other chunk that is not the next one expected of the
    /// transaction held (a repeat, or a stray of another transaction) is
    /// dropped and leaves the held one whole: were it to start over, the
    /// held transaction's marker would find chunks missing and the replica
    /// would read the stream again for nothing.
    pub async fn push(
        &mut self,
        position: Position,
        body: Body,
    ) -> Result<Option<Transaction>, WireError> {
        match body {
            Body::Chunk { changes } => {
                if position.seq == 0 {
                    self.reset();
                    self.held_lsn = Some(position.lsn);
                }
                if self.held_lsn != Some(position.lsn) || position.seq != self.chunks {
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

    /// A stray chunk of another transaction (not its first) between the
    /// chunks of the one held is dropped; the held one still completes.
    #[tokio::test]
    async fn a_stray_chunk_of_another_transaction_leaves_the_held_one_whole() {
        let t = txn(5_000);
        let messages = transaction_messages(9, &t, 4096).unwrap();
        let mut other = txn(5_000);
        other.end_lsn = Lsn(0x9000);
        let stray = transaction_messages(9, &other, 4096).unwrap()[2].clone();
        assert_eq!(stray.position.kind, Kind::Chunk);
        let mut stream: Vec<Message> = messages[..2].to_vec();
        stream.push(stray);
        stream.extend(messages[2..].iter().cloned());
        let mut assembly = Assembly::new(HeldBudget::unbounded());
        let mut whole = Vec::new();
        for m in stream {
            if let Some(t) = assembly.push(m.position, m.body).await.unwrap() {
                whole.push(t);
            }
        }
        assert_eq!(whole, vec![t], "the held transaction, complete");
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

    /// Cutting whole, as the publisher did before it made messages one at
    /// a time: the reference those must match byte for byte.
    fn cut_whole(changes: &[Change], max_bytes: usize) -> Vec<Vec<Change>> {
        let budget = max_bytes.saturating_sub(64).max(1);
        let (mut parts, mut current, mut size) = (Vec::new(), Vec::new(), 0);
        for change in changes {
            let one = postcard::experimental::serialized_size(change).unwrap();
            if !current.is_empty() && size + one > budget {
                parts.push(std::mem::take(&mut current));
                size = 0;
            }
            size += one;
            current.push(change.clone());
        }
        if !current.is_empty() || parts.is_empty() {
            parts.push(current);
        }
        parts
    }

    fn whole_transaction(epoch: u64, t: &Transaction, max_bytes: usize) -> Vec<Message> {
        let position = |kind, seq| Position {
            epoch,
            lsn: t.end_lsn.0,
            kind,
            seq,
        };
        let commit = |chunks, changes| Message {
            version: WIRE_VERSION,
            holder: 0,
            position: position(Kind::Commit, 0),
            body: Body::Commit {
                xid: t.xid,
                commit_lsn: t.commit_lsn.0,
                commit_time_us: t.commit_time.timestamp_micros(),
                chunks,
                changes,
            },
        };
        let mut pieces = cut_whole(&t.changes.to_vec().unwrap(), max_bytes);
        if pieces.len() <= 1 {
            return vec![commit(0, pieces.pop().unwrap_or_default())];
        }
        let chunks = pieces.len() as u32;
        let mut messages: Vec<Message> = pieces
            .into_iter()
            .enumerate()
            .map(|(seq, changes)| Message {
                version: WIRE_VERSION,
                holder: 0,
                position: position(Kind::Chunk, seq as u32),
                body: Body::Chunk { changes },
            })
            .collect();
        messages.push(commit(chunks, Vec::new()));
        messages
    }

    fn encoded(messages: &[Message]) -> Vec<Vec<u8>> {
        messages.iter().map(Message::encode).collect()
    }

    /// Made one at a time (as the publisher sends them), a transaction's
    /// and a merge's messages are exactly those cut whole: the same
    /// pieces, positions and bytes, around every cut, in memory and
    /// spilled.
    #[tokio::test]
    async fn made_one_at_a_time_the_messages_are_those_cut_whole() {
        for max_bytes in [4096, 200, 1] {
            for n in (0..400).chain([5_000]) {
                let t = txn(n);
                assert_eq!(
                    encoded(&transaction_messages(4, &t, max_bytes).unwrap()),
                    encoded(&whole_transaction(4, &t, max_bytes)),
                    "{n} changes, {max_bytes} B"
                );
                let changes = t.changes.to_vec().unwrap();
                let whole: Vec<Message> = cut_whole(&changes, max_bytes)
                    .into_iter()
                    .enumerate()
                    .map(|(i, part)| Message {
                        version: WIRE_VERSION,
                        holder: 0,
                        position: Position {
                            epoch: 4,
                            lsn: 0x77,
                            kind: Kind::Merge,
                            seq: 3 + i as u32,
                        },
                        body: Body::Merge { changes: part },
                    })
                    .collect();
                let mut made = MergeMessages::new(4, Lsn(0x77), 3, changes, max_bytes);
                let one_at_a_time: Vec<Message> =
                    std::iter::from_fn(|| made.next_message()).collect();
                assert_eq!(encoded(&one_at_a_time), encoded(&whole), "merge of {n}");
                assert_eq!(made.next_seq(), 3 + whole.len() as u32);
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let mut held = HeldChanges::new(HeldBudget::new(4096, dir.path().to_path_buf()));
        for i in 0..20_000 {
            held.push(1, night_change(i)).await.unwrap();
        }
        let spilled = Transaction {
            changes: held.finish().await.unwrap(),
            ..txn(0)
        };
        assert!(spilled.changes.spilled_bytes().is_some());
        assert_eq!(
            encoded(&transaction_messages(4, &spilled, 4096).unwrap()),
            encoded(&whole_transaction(4, &spilled, 4096))
        );
    }

    #[test]
    fn a_takeover_marker_stands_for_the_position_before_it() {
        let before = advance_message(3, Lsn(0x500)).position;
        let marker = Message::decode(&Message::takeover(0xabc, Some(before)).encode()).unwrap();
        assert_eq!(marker.data_position(), Some(before));
        assert_eq!(marker.message_id(), "takeover-abc");
        assert_eq!(Message::takeover(1, None).data_position(), None);
    }

    /// The same message sent again by its process has the same id (a lost
    /// acknowledgement is answered as a duplicate); sent by another process
    /// it has another (a new holder's resend is stored after its marker).
    #[test]
    fn a_data_message_id_names_its_position_and_its_holder() {
        let mut first = advance_message(3, Lsn(0x500));
        first.holder = 0xa;
        let again = Message::decode(&first.encode()).unwrap();
        assert_eq!(again.message_id(), first.message_id());
        assert_eq!(first.message_id(), "3-500-a0-a");
        let mut other_holder = first.clone();
        other_holder.holder = 0xb;
        assert_ne!(other_holder.message_id(), first.message_id());
        assert_eq!(
            first.message_id(),
            data_message_id(first.position, first.holder)
        );
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

//! Held transactions: their changes in memory up to a bound, in a spill file
//! past it.
//!
//! A transaction is held from its first change to its commit (the stream's
//! open and streamed transactions, a replica's chunked one). Held in memory
//! without bound, one owner transaction over every inventory row would cost
//! gigabytes on top of the copy, so every holder of one role shares a
//! `HeldBudget`: past `stream.max_held_bytes` the holder that would grow moves
//! its changes to a spill file in `stream.spill_dir` and appends there
//! until its commit. Nothing of it is applied before the commit, and the
//! committed `Transaction` reads the file as often as it is walked (apply,
//! refresh, the fleet's chunks; the index only when `Changes::only_nights`
//! says no; the feed until it knows to start over): `Changes::for_each`
//! opens it again each time, and `Changes::into_walk` takes the changes one
//! at a time for a walker that awaits between them (the fleet's publisher).
//!
//! The file is private to the process and removed when the last handle on
//! it goes: at commit once the transaction is applied and handed on, at
//! abort, and at reconnect (the assembler, with its held transactions, is
//! dropped). Files of a process that died are swept at start
//! (`sweep_stale`): a name carries the pid and that process's start time,
//! so a process sharing the directory, or a pid reused since, is never hit.
//!
//! Writes happen on one thread per spilled transaction, fed through a
//! bounded channel, so the replication loop awaits a slow disk instead of
//! blocking its runtime thread. Reads happen where the transaction is
//! walked: apply is synchronous already, and a just-written file is read
//! back from the page cache.
//!
//! Encoding: postcard, as the checkpoint's records and the fleet's
//! messages, in checksummed blocks, so a torn or damaged file is a typed
//! error (`SpillError`), never a panic and never a half-read transaction.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use rustc_hash::FxHashSet;
use tempfile::TempPath;
use tokio::sync::{mpsc, oneshot};

use super::Change;
use crate::metrics;

/// What one held change costs in memory, counted against the bound: the
/// `Change` (48 B) with the subtransaction xid it was made in, padded to
/// 56 B, per slot of the vector's capacity (so its growth slack counts
/// too). That is the "about 60 B per changed row".
pub const HELD_CHANGE_BYTES: usize = std::mem::size_of::<(u32, Change)>();

/// A hotel's or room type's change holds its row boxed beside it: the box
/// and what its strings and amenities hold on the heap (`boxed_bytes`).
/// These are rare; inventory rows are what a bulk update holds.
pub const BOXED_ROW_BYTES: usize = 256;

/// One block of a spill file before it goes to the writer thread.
const BLOCK_BYTES: usize = 256 * 1024;

/// Blocks queued to the writer thread at most, and their bytes: a slow
/// disk slows the stream instead of growing memory. A block larger than
/// `QUEUED_BYTES` (one record past it: a hotel row with megabytes of text)
/// waits for the queue to be empty and then fills it alone, so the queue
/// holds at most `QUEUED_BYTES` or that one block; counted in blocks
/// alone, four such blocks could wait at once.
const QUEUED_BLOCKS: usize = 4;
const QUEUED_BYTES: usize = QUEUED_BLOCKS * BLOCK_BYTES;

/// A block's frame before its payload: length, records, CRC32C.
const FRAME_HEADER: usize = 12;

/// What a spilled transaction keeps in memory meanwhile (the block being
/// filled and the queue), counted against the bound.
pub const SPILLING_BYTES: usize = BLOCK_BYTES * (QUEUED_BLOCKS + 1);

/// The longest a block may wait for the writer thread, and the writer for
/// the disk at commit: a disk stuck that long fails the session, which
/// starts over from the slot.
const WRITE_TIMEOUT: Duration = Duration::from_secs(120);

/// The first bytes of every spill file, with the format's version.
const MAGIC: &[u8; 8] = b"VSPILL01";

/// The name every spill file starts with; `sweep_stale` removes only these.
pub const SPILL_PREFIX: &str = "vacancy-spill-";

#[derive(Debug, thiserror::Error)]
pub enum SpillError {
    #[error("spill file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("spill file {path} is truncated: {found} of {expected} changes")]
    Truncated {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
    #[error("spill file {path} is damaged: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error("the spill writer for {path} stopped: {what}")]
    Writer { path: PathBuf, what: String },
}

impl SpillError {
    fn io(path: &Path, source: io::Error) -> SpillError {
        SpillError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    fn corrupt(path: &Path, what: impl Into<String>) -> SpillError {
        SpillError::Corrupt {
            path: path.to_path_buf(),
            what: what.into(),
        }
    }
}

/// The bound one role's held transactions share, and where they spill.
#[derive(Clone)]
pub struct HeldBudget {
    inner: Arc<BudgetInner>,
}

struct BudgetInner {
    max_bytes: usize,
    dir: PathBuf,
    /// Bytes the holders of this budget count in memory now.
    held: AtomicUsize,
}

impl fmt::Debug for HeldBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldBudget")
            .field("max_bytes", &self.inner.max_bytes)
            .field("dir", &self.inner.dir)
            .field("held", &self.held_bytes())
            .finish()
    }
}

impl HeldBudget {
    pub fn new(max_bytes: usize, dir: PathBuf) -> HeldBudget {
        HeldBudget {
            inner: Arc::new(BudgetInner {
                max_bytes,
                dir,
                held: AtomicUsize::new(0),
            }),
        }
    }

    /// No bound (tests of other things): nothing ever spills.
    pub fn unbounded() -> HeldBudget {
        HeldBudget::new(usize::MAX, std::env::temp_dir())
    }

    /// Bytes held in memory now by this budget's transactions.
    pub fn held_bytes(&self) -> usize {
        self.inner.held.load(Ordering::Relaxed)
    }

    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    fn fits(&self, more: usize) -> bool {
        self.held_bytes().saturating_add(more) <= self.inner.max_bytes
    }

    fn add(&self, bytes: usize) {
        self.inner.held.fetch_add(bytes, Ordering::Relaxed);
    }

    fn release(&self, bytes: usize) {
        let before = self.inner.held.fetch_sub(bytes, Ordering::Relaxed);
        debug_assert!(before >= bytes, "a holder released more than it counted");
    }
}

/// A committed transaction's changes: in memory, or in a spill file read
/// again on every walk. Clones share the file; it is removed with the last.
/// Changes held in memory stay counted in their budget until the last clone
/// (or walk) of them goes: a committed transaction may wait in the fleet's
/// outbox behind a slow publisher, and what it holds there is memory the
/// bound must see, or the next transactions would not spill.
#[derive(Clone)]
pub struct Changes {
    repr: Repr,
    counted: Option<Arc<CountedBytes>>,
}

/// Bytes of a committed transaction still in memory, released from the
/// budget when dropped.
struct CountedBytes {
    budget: HeldBudget,
    bytes: usize,
}

impl Drop for CountedBytes {
    fn drop(&mut self) {
        self.budget.release(self.bytes);
    }
}

#[derive(Clone)]
enum Repr {
    Memory(Vec<Change>),
    Spilled(Arc<SpillFile>),
}

impl Changes {
    /// Changes in commit order (subtransactions rolled back left out).
    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Memory(changes) => changes.len(),
            Repr::Spilled(file) => usize::try_from(file.live).unwrap_or(usize::MAX),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The spill file's size, when the changes are in one.
    pub fn spilled_bytes(&self) -> Option<u64> {
        match &self.repr {
            Repr::Memory(_) => None,
            Repr::Spilled(file) => Some(file.bytes),
        }
    }

    /// Whether every change is a night's (an upsert or a removal of one
    /// inventory row), so a walk that looks only at hotels and room types
    /// (the index's) need not read a spill file at all. A spilled
    /// transaction answers from what its writer counted: changes of
    /// rolled-back subtransactions count too, so it may say no where a walk
    /// would say yes, never the reverse.
    pub fn only_nights(&self) -> bool {
        match &self.repr {
            Repr::Memory(changes) => changes.iter().all(is_night),
            Repr::Spilled(file) => file.not_nights == 0,
        }
    }

    /// Calls `f` with each change in order, reading the spill file again if
    /// there is one; stops at the first error, `f`'s or the file's.
    pub fn for_each<E: From<SpillError>>(
        &self,
        mut f: impl FnMut(&Change) -> Result<(), E>,
    ) -> Result<(), E> {
        match &self.repr {
            Repr::Memory(changes) => changes.iter().try_for_each(f),
            Repr::Spilled(file) => file.read(|sub, change| {
                if file.aborted.contains(&sub) {
                    Ok(())
                } else {
                    f(change)
                }
            }),
        }
    }

    /// The changes taken one at a time, in order (`Walk::next_change`): a
    /// walk that has to await between changes (the fleet's publisher, which
    /// sends each chunk as it is cut) cannot be a `for_each` closure. A
    /// spilled file is read a block at a time and stays on disk until the
    /// walk and every clone are gone.
    pub fn into_walk(self) -> Walk {
        Walk {
            _counted: self.counted,
            repr: match self.repr {
                Repr::Memory(changes) => WalkRepr::Memory(changes.into_iter()),
                Repr::Spilled(file) => WalkRepr::Spilled {
                    file,
                    records: None,
                },
            },
        }
    }

    /// All changes in memory (tests, and small transactions).
    pub fn to_vec(&self) -> Result<Vec<Change>, SpillError> {
        let mut all = Vec::with_capacity(self.len());
        self.for_each(|c| {
            all.push(c.clone());
            Ok::<(), SpillError>(())
        })?;
        Ok(all)
    }
}

impl From<Vec<Change>> for Changes {
    fn from(changes: Vec<Change>) -> Changes {
        Changes {
            repr: Repr::Memory(changes),
            counted: None,
        }
    }
}

impl Default for Changes {
    fn default() -> Changes {
        Changes::from(Vec::new())
    }
}

impl fmt::Debug for Changes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.repr {
            Repr::Memory(changes) => changes.fmt(f),
            Repr::Spilled(file) => f
                .debug_struct("Spilled")
                .field("path", &file.path())
                .field("changes", &file.live)
                .field("bytes", &file.bytes)
                .finish(),
        }
    }
}

/// Equal when they hold the same changes; spilled ones are compared by
/// file (reading two files to compare them is for tests, via `to_vec`).
impl PartialEq for Changes {
    fn eq(&self, other: &Changes) -> bool {
        match (&self.repr, &other.repr) {
            (Repr::Memory(a), Repr::Memory(b)) => a == b,
            (Repr::Spilled(a), Repr::Spilled(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// A finished spill file; removed from disk when dropped.
struct SpillFile {
    /// Declared before `lock`: the file goes first, then its lock.
    path: TempPath,
    /// Held while the file is in use (`sweep_stale`).
    _lock: std::fs::File,
    /// Records written, rolled back ones included.
    records: u64,
    /// Records that count (not in a rolled-back subtransaction).
    live: u64,
    /// Subtransactions rolled back after their changes were written.
    aborted: FxHashSet<u32>,
    bytes: u64,
    /// Records other than nights' (`Changes::only_nights`), rolled back
    /// ones included.
    not_nights: u64,
}

impl SpillFile {
    fn path(&self) -> &Path {
        &self.path
    }

    fn read<E: From<SpillError>>(
        &self,
        mut f: impl FnMut(u32, &Change) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut records = Records::open(self)?;
        while let Some((sub, change)) = records.next(self)? {
            f(sub, &change)?;
        }
        Ok(())
    }

    fn truncated(&self, found: u64) -> SpillError {
        SpillError::Truncated {
            path: self.path().to_path_buf(),
            found,
            expected: self.records,
        }
    }
}

/// A committed transaction's changes, one at a time (`Changes::into_walk`).
pub struct Walk {
    repr: WalkRepr,
    /// What the changes count in their budget, released with the walk.
    _counted: Option<Arc<CountedBytes>>,
}

enum WalkRepr {
    Memory(std::vec::IntoIter<Change>),
    Spilled {
        file: Arc<SpillFile>,
        /// Opened at the first change.
        records: Option<Records>,
    },
}

impl fmt::Debug for Walk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.repr {
            WalkRepr::Memory(rest) => f.debug_struct("Walk").field("left", &rest.len()).finish(),
            WalkRepr::Spilled { file, records } => f
                .debug_struct("Walk")
                .field("path", &file.path())
                .field("read", &records.as_ref().map_or(0, |r| r.found))
                .finish(),
        }
    }
}

impl Walk {
    /// The next change (rolled-back subtransactions left out), `None` after
    /// the last; a file that cannot be read whole is an error, as for
    /// `Changes::for_each`. Reads the disk: about 256 KiB at a time, from
    /// the page cache when the file was just written.
    pub fn next_change(&mut self) -> Result<Option<Change>, SpillError> {
        match &mut self.repr {
            WalkRepr::Memory(rest) => Ok(rest.next()),
            WalkRepr::Spilled { file, records } => {
                let records = match records {
                    Some(open) => open,
                    None => records.insert(Records::open(file)?),
                };
                while let Some((sub, change)) = records.next(file)? {
                    if !file.aborted.contains(&sub) {
                        return Ok(Some(change));
                    }
                }
                Ok(None)
            }
        }
    }
}

/// A spill file's records in order, read one block at a time: what a walk
/// holds of a spilled transaction is one block, however large the file.
struct Records {
    reader: io::BufReader<std::fs::File>,
    /// The current block's payload, and where its next record starts.
    payload: Vec<u8>,
    at: usize,
    /// Records of the current block not read yet.
    left: u32,
    /// Records read so far.
    found: u64,
    /// Bytes of the file read so far (the magic, then whole blocks).
    consumed: u64,
}

impl Records {
    fn open(file: &SpillFile) -> Result<Records, SpillError> {
        let path = file.path();
        let opened = std::fs::File::open(path).map_err(|e| SpillError::io(path, e))?;
        let mut reader = io::BufReader::with_capacity(BLOCK_BYTES, opened);
        let mut magic = [0u8; 8];
        read_full(&mut reader, &mut magic, path)?;
        if &magic != MAGIC {
            return Err(SpillError::corrupt(
                path,
                "not a spill file of this version",
            ));
        }
        Ok(Records {
            reader,
            payload: Vec::new(),
            at: 0,
            left: 0,
            found: 0,
            consumed: MAGIC.len() as u64,
        })
    }

    /// The next record (its subtransaction and change), `None` at the end
    /// of a file whose every record was found.
    fn next(&mut self, file: &SpillFile) -> Result<Option<(u32, Change)>, SpillError> {
        let path = file.path();
        while self.left == 0 {
            if self.at != self.payload.len() {
                return Err(SpillError::corrupt(path, "bytes after a block's changes"));
            }
            if !self.next_block(file)? {
                if self.found != file.records {
                    return Err(file.truncated(self.found));
                }
                return Ok(None);
            }
        }
        let ((sub, change), after) =
            postcard::take_from_bytes::<(u32, Change)>(&self.payload[self.at..])
                .map_err(|e| SpillError::corrupt(path, e.to_string()))?;
        self.at = self.payload.len() - after.len();
        self.left -= 1;
        self.found += 1;
        Ok(Some((sub, change)))
    }

    /// Reads the next block, checked; false at the end of the file.
    fn next_block(&mut self, file: &SpillFile) -> Result<bool, SpillError> {
        let path = file.path();
        let mut header = [0u8; 12];
        let got = read_some(&mut self.reader, &mut header, path)?;
        if got == 0 {
            return Ok(false);
        }
        if got < header.len() {
            return Err(file.truncated(self.found));
        }
        let [l0, l1, l2, l3, n0, n1, n2, n3, c0, c1, c2, c3] = header;
        let len = u32::from_le_bytes([l0, l1, l2, l3]);
        let count = u32::from_le_bytes([n0, n1, n2, n3]);
        let crc = u32::from_le_bytes([c0, c1, c2, c3]);
        // Blocks are cut at `BLOCK_BYTES`, but one record larger than that
        // (a hotel row with a huge text) makes a block of its own size, up
        // to what the frame holds: a fixed bound below that refused, as
        // damage, a block the writer had made, and the transaction never
        // applied. A length past what is left of what was written is
        // damage, refused before anything is allocated for it.
        let left = file
            .bytes
            .saturating_sub(self.consumed + header.len() as u64);
        if u64::from(len) > left {
            return Err(SpillError::corrupt(
                path,
                format!("a block of {len} bytes with {left} left of the file"),
            ));
        }
        self.payload.resize(len as usize, 0);
        if read_some(&mut self.reader, &mut self.payload, path)? < self.payload.len() {
            return Err(file.truncated(self.found));
        }
        if crc32c::crc32c(&self.payload) != crc {
            return Err(SpillError::corrupt(
                path,
                "a block's checksum does not match",
            ));
        }
        self.consumed += header.len() as u64 + u64::from(len);
        self.at = 0;
        self.left = count;
        Ok(true)
    }
}

/// Reads until `buf` is full or the file ends; how many bytes it read.
fn read_some(reader: &mut impl Read, buf: &mut [u8], path: &Path) -> Result<usize, SpillError> {
    let mut got = 0;
    while got < buf.len() {
        match reader.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(SpillError::io(path, e)),
        }
    }
    Ok(got)
}

fn read_full(reader: &mut impl Read, buf: &mut [u8], path: &Path) -> Result<(), SpillError> {
    if read_some(reader, buf, path)? < buf.len() {
        return Err(SpillError::Truncated {
            path: path.to_path_buf(),
            found: 0,
            expected: 0,
        });
    }
    Ok(())
}

/// One held transaction's changes, until its commit.
pub struct HeldChanges {
    budget: HeldBudget,
    /// Bytes this holder counts in the budget now.
    counted: usize,
    /// Of those, the boxed rows' estimate (`BOXED_ROW_BYTES` each).
    boxed: usize,
    state: State,
}

enum State {
    Memory(Vec<(u32, Change)>),
    Spilled(Box<SpillWriter>),
}

impl fmt::Debug for HeldChanges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldChanges")
            .field("changes", &self.len())
            .field("counted", &self.counted)
            .field("spilled", &matches!(self.state, State::Spilled(_)))
            .finish()
    }
}

impl HeldChanges {
    pub fn new(budget: HeldBudget) -> HeldChanges {
        HeldChanges {
            budget,
            counted: 0,
            boxed: 0,
            state: State::Memory(Vec::new()),
        }
    }

    /// Changes held (rolled-back subtransactions' left out).
    pub fn len(&self) -> usize {
        match &self.state {
            State::Memory(changes) => changes.len(),
            State::Spilled(writer) => usize::try_from(writer.live).unwrap_or(usize::MAX),
        }
    }

    #[cfg(test)]
    fn is_spilled(&self) -> bool {
        matches!(self.state, State::Spilled(_))
    }

    /// Holds `change`, made in subtransaction `sub` (the top-level xid when
    /// not in one). Spills first when holding it in memory would pass the
    /// budget.
    pub async fn push(&mut self, sub: u32, change: Change) -> Result<(), SpillError> {
        if let State::Memory(changes) = &self.state {
            let growth = if changes.len() == changes.capacity() {
                changes.capacity().max(4) * HELD_CHANGE_BYTES
            } else {
                0
            } + boxed_bytes(&change);
            if !self.budget.fits(growth) {
                self.spill().await?;
            }
        }
        match &mut self.state {
            State::Memory(changes) => {
                self.boxed += boxed_bytes(&change);
                changes.push((sub, change));
                let bytes = changes.capacity() * HELD_CHANGE_BYTES + self.boxed;
                self.set_counted(bytes);
                Ok(())
            }
            State::Spilled(writer) => writer.write(sub, &change).await,
        }
    }

    /// Forgets the changes of subtransaction `sub`, rolled back.
    pub fn abort_sub(&mut self, sub: u32) {
        match &mut self.state {
            State::Memory(changes) => {
                changes.retain(|(xid, _)| *xid != sub);
                self.boxed = changes.iter().map(|(_, c)| boxed_bytes(c)).sum();
                let bytes = changes.capacity() * HELD_CHANGE_BYTES + self.boxed;
                self.set_counted(bytes);
            }
            State::Spilled(writer) => writer.abort_sub(sub),
        }
    }

    /// The transaction committed: its changes, in memory or in the file.
    pub async fn finish(mut self) -> Result<Changes, SpillError> {
        let state = std::mem::replace(&mut self.state, State::Memory(Vec::new()));
        match state {
            State::Memory(changes) => {
                let mut committed =
                    Changes::from(changes.into_iter().map(|(_, c)| c).collect::<Vec<_>>());
                // The count moves to the changes: none released by this
                // holder's drop, all of it by theirs.
                committed.counted = Some(Arc::new(CountedBytes {
                    budget: self.budget.clone(),
                    bytes: std::mem::take(&mut self.counted),
                }));
                Ok(committed)
            }
            State::Spilled(writer) => {
                let file = writer.finish().await?;
                metrics::HELD_SPILLED_TRANSACTIONS.inc();
                metrics::HELD_SPILLED_BYTES.inc_by(file.bytes);
                Ok(Changes {
                    repr: Repr::Spilled(Arc::new(file)),
                    counted: None,
                })
            }
        }
    }

    /// Counts `bytes` in the budget for this holder, instead of what it
    /// counted before.
    fn set_counted(&mut self, bytes: usize) {
        self.budget.release(self.counted);
        self.budget.add(bytes);
        self.counted = bytes;
    }

    /// Moves what is in memory to a new spill file; later changes go there.
    async fn spill(&mut self) -> Result<(), SpillError> {
        let mut writer = SpillWriter::create(self.budget.dir())?;
        let State::Memory(changes) = std::mem::replace(&mut self.state, State::Memory(Vec::new()))
        else {
            return Ok(());
        };
        for (sub, change) in &changes {
            writer.write(*sub, change).await?;
        }
        drop(changes);
        self.boxed = 0;
        self.set_counted(SPILLING_BYTES);
        tracing::info!(path = %writer.path.display(), changes = writer.live, "a held transaction passed stream.max_held_bytes; spilling it to disk");
        self.state = State::Spilled(Box::new(writer));
        Ok(())
    }
}

impl Drop for HeldChanges {
    fn drop(&mut self) {
        self.budget.release(self.counted);
    }
}

fn is_night(change: &Change) -> bool {
    matches!(
        change,
        Change::UpsertNight { .. } | Change::DeleteNight { .. }
    )
}

/// What a change holds beside its own size: a flat `BOXED_ROW_BYTES` for
/// a boxed row, plus its text's heap. A flat figure alone let a hotel whose
/// amenities run to megabytes (legal text) neither count against the bound
/// nor make a transaction spill.
fn boxed_bytes(change: &Change) -> usize {
    match change {
        Change::UpsertHotel { hotel, .. } => {
            let texts = hotel.name.capacity()
                + hotel.city.capacity()
                + hotel.country.as_ref().map_or(0, String::capacity)
                + hotel.amenities.capacity() * std::mem::size_of::<String>()
                + hotel.amenities.iter().map(String::capacity).sum::<usize>();
            BOXED_ROW_BYTES + texts
        }
        Change::UpsertRoomType { room_type, .. } => BOXED_ROW_BYTES + room_type.name.capacity(),
        _ => 0,
    }
}

/// Writes one transaction's spill file through its own thread.
struct SpillWriter {
    /// Removed when dropped (an abort, a reconnect) unless finished.
    path: TempPath,
    /// An exclusive `flock` on the file, held from its creation until it is
    /// removed: what tells `sweep_stale` of another process (another node
    /// sharing the directory, in a PID namespace of its own) that the file
    /// is in use.
    lock: std::fs::File,
    /// The frame being filled: `FRAME_HEADER` bytes kept for its header,
    /// then the records (framed in place: no copy of the block to send it).
    block: Vec<u8>,
    block_records: u32,
    /// The queue's bytes (`QUEUED_BYTES` permits): a block holds
    /// `min(its length, QUEUED_BYTES)` of them until the writer wrote it.
    queued_bytes: Arc<tokio::sync::Semaphore>,
    sender: Option<mpsc::Sender<(Vec<u8>, tokio::sync::OwnedSemaphorePermit)>>,
    /// Closed by a test to stall the writer thread before each block.
    #[cfg(test)]
    gate: Arc<TestGate>,
    done: Option<oneshot::Receiver<io::Result<()>>>,
    records: u64,
    live: u64,
    bytes: u64,
    per_sub: HashMap<u32, u64>,
    aborted: FxHashSet<u32>,
    not_nights: u64,
}

impl SpillWriter {
    fn create(dir: &Path) -> Result<SpillWriter, SpillError> {
        let temp = tempfile::Builder::new()
            .prefix(&format!("{SPILL_PREFIX}{}-", *PROCESS_TAG))
            .suffix(".spill")
            .tempfile_in(dir)
            .map_err(|e| SpillError::io(dir, e))?;
        let (file, path) = temp.into_parts();
        // The same open file as the writer's (a dup), so the lock holds
        // whatever the writer thread does with its handle.
        let lock = file.try_clone().map_err(|e| SpillError::io(&path, e))?;
        lock.try_lock()
            .map_err(|e| SpillError::io(&path, io::Error::other(e)))?;
        let (sender, mut receiver) =
            mpsc::channel::<(Vec<u8>, tokio::sync::OwnedSemaphorePermit)>(QUEUED_BLOCKS);
        let (report, done) = oneshot::channel();
        let thread_path = path.to_path_buf();
        #[cfg(test)]
        let gate = Arc::new(TestGate::default());
        #[cfg(test)]
        let thread_gate = gate.clone();
        std::thread::Builder::new()
            .name("vacancy-spill".into())
            .spawn(move || {
                let mut out = BufWriter::with_capacity(BLOCK_BYTES, file);
                let written = (|| {
                    out.write_all(MAGIC)?;
                    while let Some((block, queued)) = receiver.blocking_recv() {
                        #[cfg(test)]
                        thread_gate.pass();
                        out.write_all(&block)?;
                        // Out of the queue: its bytes may be taken again.
                        drop(queued);
                    }
                    out.flush()
                })();
                if let Err(error) = &written {
                    tracing::warn!(path = %thread_path.display(), %error, "writing a spill file failed");
                }
                // The receiver may be gone (the transaction was dropped).
                let _ = report.send(written);
            })
            .map_err(|e| SpillError::io(&path, e))?;
        Ok(SpillWriter {
            path,
            lock,
            block: new_frame(),
            block_records: 0,
            queued_bytes: Arc::new(tokio::sync::Semaphore::new(QUEUED_BYTES)),
            sender: Some(sender),
            #[cfg(test)]
            gate,
            done: Some(done),
            records: 0,
            live: 0,
            bytes: MAGIC.len() as u64,
            per_sub: HashMap::new(),
            aborted: FxHashSet::default(),
            not_nights: 0,
        })
    }

    async fn write(&mut self, sub: u32, change: &Change) -> Result<(), SpillError> {
        debug_assert!(!self.aborted.contains(&sub), "a change after its rollback");
        postcard::to_io(&(sub, change), &mut self.block)
            .map_err(|e| SpillError::corrupt(&self.path, e.to_string()))?;
        self.block_records += 1;
        self.records += 1;
        self.live += 1;
        self.not_nights += u64::from(!is_night(change));
        *self.per_sub.entry(sub).or_default() += 1;
        if self.block.len() >= FRAME_HEADER + BLOCK_BYTES {
            self.send_block().await?;
        }
        Ok(())
    }

    async fn send_block(&mut self) -> Result<(), SpillError> {
        if self.block_records == 0 {
            return Ok(());
        }
        let mut framed = std::mem::replace(&mut self.block, new_frame());
        let (header, payload) = framed.split_at_mut(FRAME_HEADER);
        let len = u32::try_from(payload.len())
            .map_err(|_| SpillError::corrupt(&self.path, "a block past 4 GiB"))?;
        header[0..4].copy_from_slice(&len.to_le_bytes());
        header[4..8].copy_from_slice(&self.block_records.to_le_bytes());
        header[8..12].copy_from_slice(&crc32c::crc32c(payload).to_le_bytes());
        self.bytes += framed.len() as u64;
        self.block_records = 0;
        let Some(sender) = &self.sender else {
            return Err(self.stopped("already finished".into()));
        };
        // At most QUEUED_BYTES, so a block past it takes the whole queue.
        let permits = u32::try_from(framed.len().min(QUEUED_BYTES)).unwrap_or(u32::MAX);
        let send = async {
            let queued = self
                .queued_bytes
                .clone()
                .acquire_many_owned(permits)
                .await
                .map_err(|_| ())?;
            sender.send((framed, queued)).await.map_err(|_| ())
        };
        match tokio::time::timeout(WRITE_TIMEOUT, send).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(self.writer_error().await),
            Err(_) => Err(self.stopped(format!("no block taken for {WRITE_TIMEOUT:?}"))),
        }
    }

    /// The writer thread is gone: its own error, when it reported one.
    async fn writer_error(&mut self) -> SpillError {
        let Some(done) = self.done.take() else {
            return self.stopped("gone".into());
        };
        match tokio::time::timeout(WRITE_TIMEOUT, done).await {
            Ok(Ok(Err(source))) => SpillError::io(&self.path, source),
            _ => self.stopped("gone without a word".into()),
        }
    }

    fn stopped(&self, what: String) -> SpillError {
        SpillError::Writer {
            path: self.path.to_path_buf(),
            what,
        }
    }

    fn abort_sub(&mut self, sub: u32) {
        if let Some(n) = self.per_sub.remove(&sub) {
            self.live -= n;
        }
        self.aborted.insert(sub);
    }

    async fn finish(mut self) -> Result<SpillFile, SpillError> {
        self.send_block().await?;
        // Closing the channel lets the thread flush and report.
        self.sender = None;
        let Some(done) = self.done.take() else {
            return Err(self.stopped("gone".into()));
        };
        match tokio::time::timeout(WRITE_TIMEOUT, done).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(source))) => return Err(SpillError::io(&self.path, source)),
            Ok(Err(_)) => return Err(self.stopped("gone without a word".into())),
            Err(_) => return Err(self.stopped(format!("not flushed in {WRITE_TIMEOUT:?}"))),
        }
        Ok(SpillFile {
            path: self.path,
            _lock: self.lock,
            records: self.records,
            live: self.live,
            aborted: self.aborted,
            bytes: self.bytes,
            not_nights: self.not_nights,
        })
    }
}

/// A gate a test closes to stall a spill writer's thread: the thread
/// waits at it before writing each block, without anyone holding a lock
/// across an await.
#[cfg(test)]
#[derive(Default)]
struct TestGate {
    closed: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
}

#[cfg(test)]
impl TestGate {
    fn set_closed(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.opened.notify_all();
    }

    fn pass(&self) {
        let closed = self.closed.lock().unwrap();
        drop(self.opened.wait_while(closed, |closed| *closed).unwrap());
    }
}

/// An empty frame: room for its header, then a block's records.
fn new_frame() -> Vec<u8> {
    let mut frame = Vec::with_capacity(FRAME_HEADER + BLOCK_BYTES + 1024);
    frame.resize(FRAME_HEADER, 0);
    frame
}

/// This process in spill file names: its pid and its start time (in clock
/// ticks since boot, from /proc), so a pid reused later names another.
static PROCESS_TAG: LazyLock<String> = LazyLock::new(|| {
    let pid = std::process::id();
    format!("{pid}-{}", start_time(pid).unwrap_or(0))
});

/// A process's start time (field 22 of /proc/<pid>/stat), if it runs.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// Removes spill files in `dir` left by processes that no longer run (a
/// crash skips every drop): those no process holds the `flock` of. A file
/// in use, by this process or another sharing the directory, is locked by
/// its writer until it is removed, so it is kept; so is any file not named
/// by this module. (The names' pid and start time said it before, and
/// another node in a PID namespace of its own, its pid 1 our pid 1 too,
/// read as stopped: its files in use were removed under it.) Returns how
/// many it removed. Blocking: call it at start, off the runtime's hot path.
pub fn sweep_stale(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(SPILL_PREFIX)) else {
            continue;
        };
        if !rest.ends_with(".spill") {
            continue;
        }
        let Ok(file) = std::fs::File::open(entry.path()) else {
            continue;
        };
        if file.try_lock().is_err() {
            continue; // in use (or the lock cannot be asked): kept
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => {
                removed += 1;
                tracing::info!(path = %entry.path().display(), "removed a spill file left by a process that stopped");
            }
            Err(error) => {
                tracing::warn!(path = %entry.path().display(), %error, "cannot remove a stale spill file")
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{CalendarKey, Hotel, NightCounts, Unsent};
    use chrono::NaiveDate;

    fn night(i: i64) -> Change {
        Change::UpsertNight {
            key: CalendarKey {
                hotel_id: i % 7,
                room_type_id: i,
            },
            night: NaiveDate::from_ymd_opt(2027, 1, 1).unwrap() + chrono::Days::new(i as u64 % 400),
            counts: NightCounts {
                total: 9,
                taken: (i % 9) as i32,
                sell_limit: Some(3),
                price_cents: Some(10_000 + i as i32),
            },
        }
    }

    fn hotel(i: i64) -> Change {
        Change::UpsertHotel {
            hotel: Box::new(Hotel {
                id: i,
                name: format!("Hotel {i}"),
                city: "Lisbon".into(),
                country: None,
                stars: Some(4),
                latitude: None,
                longitude: None,
                amenities: vec!["wifi".into()],
            }),
            unsent: Unsent::default(),
        }
    }

    fn files(dir: &Path) -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect()
    }

    async fn spilled(dir: &Path, n: i64) -> (Changes, Vec<Change>) {
        let budget = HeldBudget::new(4096, dir.to_path_buf());
        let mut held = HeldChanges::new(budget.clone());
        let mut expected = Vec::new();
        for i in 0..n {
            let change = if i % 1000 == 0 { hotel(i) } else { night(i) };
            expected.push(change.clone());
            held.push(1, change).await.unwrap();
        }
        assert!(held.is_spilled(), "past 4 KiB");
        let changes = held.finish().await.unwrap();
        assert_eq!(
            budget.held_bytes(),
            0,
            "a finished transaction counts nothing"
        );
        (changes, expected)
    }

    #[tokio::test]
    async fn a_spilled_transaction_reads_back_whole_and_more_than_once() {
        let dir = tempfile::tempdir().unwrap();
        let (changes, expected) = spilled(dir.path(), 30_000).await;
        assert!(changes.spilled_bytes().unwrap() > 0);
        assert_eq!(changes.len(), expected.len());
        assert_eq!(changes.to_vec().unwrap(), expected);
        assert_eq!(changes.to_vec().unwrap(), expected, "read again");
        let copy = changes.clone();
        drop(changes);
        assert_eq!(files(dir.path()).len(), 1, "a clone keeps the file");
        drop(copy);
        assert!(files(dir.path()).is_empty(), "the last handle removes it");
    }

    /// One record larger than the old fixed bound on a block (64 MiB: a
    /// hotel whose amenities run to 65 MiB of text, legal in PostgreSQL)
    /// makes a block of its own size, read back whole. Before, the reader
    /// refused the block the writer had made as damage, and the
    /// transaction never applied.
    #[tokio::test]
    async fn a_record_larger_than_a_block_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let budget = HeldBudget::new(4096, dir.path().to_path_buf());
        let mut held = HeldChanges::new(budget.clone());
        let Change::UpsertHotel { mut hotel, unsent } = hotel(1) else {
            unreachable!()
        };
        hotel.amenities = vec!["x".repeat(65 << 20)];
        let wide = Change::UpsertHotel { hotel, unsent };
        let expected = vec![night(1), wide, night(2)];
        for change in &expected {
            held.push(1, change.clone()).await.unwrap();
        }
        assert!(held.is_spilled());
        let changes = held.finish().await.unwrap();
        assert!(changes.spilled_bytes().unwrap() > 65 << 20);
        assert_eq!(changes.to_vec().unwrap(), expected);
    }

    /// Blocks past the queue's bytes, one record each: while the writer is
    /// stuck on the first, the second waits for the queue to empty instead
    /// of joining it. Counted in blocks alone, four such blocks (megabytes
    /// each, and copied once more to be framed) could wait at once, past
    /// what `SPILLING_BYTES` counts against `stream.max_held_bytes`.
    #[tokio::test]
    async fn a_block_past_the_queues_bytes_waits_for_the_queue_to_empty() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = SpillWriter::create(dir.path()).unwrap();
        let wide = |i| {
            let Change::UpsertHotel { mut hotel, unsent } = hotel(i) else {
                unreachable!()
            };
            hotel.amenities = vec!["x".repeat(QUEUED_BYTES * 2)];
            Change::UpsertHotel { hotel, unsent }
        };
        let gate = writer.gate.clone();
        gate.set_closed(true);
        writer.write(1, &wide(1)).await.unwrap();
        let second_change = wide(2);
        {
            let second = writer.write(1, &second_change);
            tokio::pin!(second);
            let waited = tokio::time::timeout(Duration::from_millis(300), second.as_mut()).await;
            assert!(waited.is_err(), "queued beside a block past the bound");
            gate.set_closed(false);
            second.await.unwrap();
        }
        writer.write(1, &night(3)).await.unwrap();
        let file = writer.finish().await.unwrap();
        let mut read = Vec::new();
        file.read(|_, change| {
            read.push(change.clone());
            Ok::<(), SpillError>(())
        })
        .unwrap();
        assert_eq!(read, vec![wide(1), wide(2), night(3)]);
    }

    /// The index skips the walk of a transaction of nights alone; one
    /// hotel among them, even rolled back, makes it walk.
    #[tokio::test]
    async fn only_nights_is_known_without_reading_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (mixed, _) = spilled(dir.path(), 3_000).await;
        assert!(!mixed.only_nights(), "a hotel every 1,000 changes");
        let budget = HeldBudget::new(4096, dir.path().to_path_buf());
        let mut nights = HeldChanges::new(budget.clone());
        let mut rolled_back = HeldChanges::new(budget.clone());
        for i in 0..3_000 {
            nights.push(1, night(i)).await.unwrap();
            rolled_back.push(1, night(i)).await.unwrap();
        }
        rolled_back.push(2, hotel(1)).await.unwrap();
        rolled_back.abort_sub(2);
        let (nights, rolled_back) = (
            nights.finish().await.unwrap(),
            rolled_back.finish().await.unwrap(),
        );
        assert!(nights.spilled_bytes().is_some() && rolled_back.spilled_bytes().is_some());
        assert!(nights.only_nights());
        assert!(
            !rolled_back.only_nights(),
            "counted as written: may say no, never wrongly yes"
        );
        assert!(Changes::from(vec![night(1), night(2)]).only_nights());
        assert!(!Changes::from(vec![night(1), hotel(2)]).only_nights());
    }

    #[tokio::test]
    async fn a_small_transaction_stays_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let budget = HeldBudget::new(1 << 20, dir.path().to_path_buf());
        let mut held = HeldChanges::new(budget.clone());
        held.push(1, night(1)).await.unwrap();
        assert!(budget.held_bytes() >= HELD_CHANGE_BYTES);
        let changes = held.finish().await.unwrap();
        assert_eq!(changes.spilled_bytes(), None);
        assert_eq!(changes.to_vec().unwrap(), vec![night(1)]);
        assert!(files(dir.path()).is_empty());
        assert!(
            budget.held_bytes() >= HELD_CHANGE_BYTES,
            "counted while the committed changes are held"
        );
        drop(changes);
        assert_eq!(budget.held_bytes(), 0);
    }

    /// Committed transactions waiting to be carried on (the fleet's outbox
    /// behind a slow publisher) still count: the next one spills once they
    /// fill the bound, and their count goes with the last clone or walk.
    #[tokio::test]
    async fn committed_changes_count_until_their_last_handle_goes() {
        let dir = tempfile::tempdir().unwrap();
        let budget = HeldBudget::new(64 * 1024, dir.path().to_path_buf());
        let mut waiting = Vec::new();
        for _ in 0..2 {
            let mut held = HeldChanges::new(budget.clone());
            for i in 0..300 {
                held.push(1, night(i)).await.unwrap();
            }
            assert!(!held.is_spilled());
            waiting.push(held.finish().await.unwrap());
        }
        let counted = budget.held_bytes();
        assert!(counted >= 600 * HELD_CHANGE_BYTES, "{counted}");
        let mut next = HeldChanges::new(budget.clone());
        for i in 0..300 {
            next.push(1, night(i)).await.unwrap();
        }
        assert!(next.is_spilled(), "the bound sees the committed ones");
        drop(next);

        let walk = waiting.pop().unwrap().into_walk();
        let clone = waiting[0].clone();
        drop(waiting);
        assert_eq!(budget.held_bytes(), counted, "a walk and a clone hold them");
        drop(clone);
        assert!(budget.held_bytes() < counted);
        drop(walk);
        assert_eq!(budget.held_bytes(), 0);
    }

    #[tokio::test]
    async fn the_bound_counts_every_holder_of_a_budget() {
        let dir = tempfile::tempdir().unwrap();
        let budget = HeldBudget::new(64 * 1024, dir.path().to_path_buf());
        let mut first = HeldChanges::new(budget.clone());
        let mut second = HeldChanges::new(budget.clone());
        for i in 0..600 {
            first.push(1, night(i)).await.unwrap();
        }
        assert!(!first.is_spilled());
        // The second one finds the budget mostly taken.
        for i in 0..600 {
            second.push(2, night(i)).await.unwrap();
        }
        assert!(second.is_spilled());
        assert!(budget.held_bytes() <= 64 * 1024 + SPILLING_BYTES);
        drop(second);
        assert!(
            files(dir.path()).is_empty(),
            "an aborted one leaves nothing"
        );
        drop(first);
        assert_eq!(budget.held_bytes(), 0);
    }

    #[tokio::test]
    async fn a_rolled_back_subtransaction_is_left_out_in_memory_and_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        for max in [usize::MAX, 4096] {
            let budget = HeldBudget::new(max, dir.path().to_path_buf());
            let mut held = HeldChanges::new(budget);
            let mut expected = Vec::new();
            for i in 0..5_000 {
                let sub = if i % 3 == 0 { 7 } else { 5 };
                if sub == 5 {
                    expected.push(night(i));
                }
                held.push(sub, night(i)).await.unwrap();
            }
            held.abort_sub(7);
            assert_eq!(held.len(), expected.len());
            let changes = held.finish().await.unwrap();
            assert_eq!(changes.len(), expected.len());
            assert_eq!(changes.to_vec().unwrap(), expected, "max {max}");
        }
    }

    fn walked(changes: Changes) -> Result<Vec<Change>, SpillError> {
        let mut walk = changes.into_walk();
        let mut all = Vec::new();
        while let Some(change) = walk.next_change()? {
            all.push(change);
        }
        assert!(walk.next_change()?.is_none(), "stays at its end");
        Ok(all)
    }

    /// A walk takes the changes one at a time, the same ones `for_each`
    /// gives (rolled-back subtransactions left out), in memory and spilled;
    /// the file stays while a walk or a clone holds it.
    #[tokio::test]
    async fn a_walk_takes_the_changes_one_at_a_time_in_memory_and_spilled() {
        let dir = tempfile::tempdir().unwrap();
        for max in [usize::MAX, 4096] {
            let mut held = HeldChanges::new(HeldBudget::new(max, dir.path().to_path_buf()));
            for i in 0..20_000 {
                held.push(if i % 5 == 0 { 9 } else { 2 }, night(i))
                    .await
                    .unwrap();
            }
            held.abort_sub(9);
            let changes = held.finish().await.unwrap();
            let expected = changes.to_vec().unwrap();
            assert_eq!(expected.len(), 16_000);
            assert_eq!(walked(changes.clone()).unwrap(), expected, "max {max}");
            let mut walk = changes.into_walk();
            assert_eq!(walk.next_change().unwrap().as_ref(), expected.first());
            assert_eq!(
                files(dir.path()).len(),
                usize::from(max == 4096),
                "the walk keeps the file"
            );
            drop(walk);
            assert!(files(dir.path()).is_empty(), "and removes it with it");
        }
    }

    #[tokio::test]
    async fn a_walk_of_a_damaged_file_is_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        let (changes, _) = spilled(dir.path(), 30_000).await;
        let path = files(dir.path()).remove(0);
        let whole = std::fs::read(&path).unwrap();
        rewrite(&path, |b| b.truncate(whole.len() - 5));
        assert!(matches!(
            walked(changes.clone()).unwrap_err(),
            SpillError::Truncated { .. }
        ));
        rewrite(&path, |b| {
            b.clear();
            b.extend_from_slice(&whole);
            b[100] ^= 0xff;
        });
        assert!(matches!(
            walked(changes).unwrap_err(),
            SpillError::Corrupt { .. }
        ));
    }

    fn rewrite(path: &Path, edit: impl FnOnce(&mut Vec<u8>)) {
        let mut bytes = std::fs::read(path).unwrap();
        edit(&mut bytes);
        std::fs::write(path, bytes).unwrap();
    }

    #[tokio::test]
    async fn a_truncated_or_damaged_file_is_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        let (changes, _) = spilled(dir.path(), 30_000).await;
        let path = files(dir.path()).remove(0);
        let whole = std::fs::read(&path).unwrap();
        // Cut inside a block, at a block's end, and right after the magic.
        let first_block = 8 + 12 + u32::from_le_bytes(whole[8..12].try_into().unwrap()) as usize;
        for cut in [whole.len() - 5, first_block, 8, 3] {
            rewrite(&path, |b| b.truncate(cut));
            let error = changes.to_vec().unwrap_err();
            assert!(
                matches!(error, SpillError::Truncated { .. }),
                "cut at {cut}: {error}"
            );
            std::fs::write(&path, &whole).unwrap();
        }
        rewrite(&path, |b| b[100] ^= 0xff);
        assert!(matches!(
            changes.to_vec().unwrap_err(),
            SpillError::Corrupt { .. }
        ));
        rewrite(&path, |b| {
            b.copy_from_slice(&whole);
            b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        });
        assert!(matches!(
            changes.to_vec().unwrap_err(),
            SpillError::Corrupt { .. }
        ));
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(
            changes.to_vec().unwrap_err(),
            SpillError::Io { .. }
        ));
    }

    #[test]
    fn the_sweep_removes_only_spill_files_no_process_holds() {
        let dir = tempfile::tempdir().unwrap();
        // Another node's, in a PID namespace of its own (its pid 1), in use.
        let held = dir.path().join(format!("{SPILL_PREFIX}1-1-held.spill"));
        // Named like this process's, but no writer holds it: a leftover.
        let left = dir
            .path()
            .join(format!("{SPILL_PREFIX}{}-left.spill", *PROCESS_TAG));
        let other = dir.path().join("vacancy-spillover.txt");
        for path in [&held, &left, &other] {
            std::fs::write(path, b"x").unwrap();
        }
        let holder = std::fs::File::open(&held).unwrap();
        holder.try_lock().unwrap();
        // A file this process is writing.
        let writing = SpillWriter::create(dir.path()).unwrap();
        assert_eq!(sweep_stale(dir.path()), 1);
        assert!(held.exists() && other.exists() && writing.path.exists());
        assert!(!left.exists());
        drop(holder);
        assert_eq!(sweep_stale(dir.path()), 1, "its holder gone, it goes");
        assert!(!held.exists() && writing.path.exists());
    }
}

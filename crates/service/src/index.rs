//! The hotel index: hotels and room types in `tantivy`, for the "where" of a
//! search (city, free text, a box on the map, a list of ids) and its
//! attribute filters (stars, amenities).
//!
//! Only attributes that change rarely live here; nightly counts stay in the
//! read model and are joined at query time, since updating a document per
//! hold would make merges fall behind. The projector marks a hotel dirty
//! *before* it applies a transaction that touches it, and again *after*:
//! the indexer re-indexes dirty hotels in batches (one commit per batch,
//! never one per change) on a blocking thread, whenever it likes. The mark
//! before keeps `synced_lsn` a position the index fully reflects (a sync
//! that reads the applied position past the transaction finds its hotels
//! marked); the mark after makes sure a sync that took the first mark while
//! the transaction was still being applied, and so indexed the copy before
//! it, is followed by one that indexes the copy with it.

use std::collections::HashSet;
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tantivy::collector::TopDocs;
use tantivy::query::{
    AllQuery, BooleanQuery, Occur, Query, QueryParser, RangeQuery, TermQuery, TermSetQuery,
};
use tantivy::schema::{FAST, Field, INDEXED, IndexRecordOption, STORED, STRING, Schema, TEXT};
use tantivy::{Index, IndexReader, IndexWriter, ReloadPolicy, TantivyDocument, Term};
use tokio_util::sync::CancellationToken;

use crate::lsn::Lsn;
use crate::metrics;
use crate::model::{Change, ReadModel, Transaction};

#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("index: {0}")]
    Tantivy(#[from] tantivy::TantivyError),
    #[error("the free-text query does not parse: {0}")]
    BadQuery(String),
}

/// The hotels one transaction changed, as `HotelIndex::note_transaction`
/// marked them before its apply, to be marked again after it.
#[derive(Debug, Default)]
#[must_use = "mark them again once the transaction is applied: HotelIndex::note_applied"]
pub struct NotedHotels {
    hotels: HashSet<i64>,
    /// A truncate of any table, or a transaction that could not be read.
    rebuild: bool,
}

/// Where a search looks.
#[derive(Debug, Clone, PartialEq)]
pub enum Place {
    /// Exact city name, case-insensitive.
    City(String),
    /// Free text over hotel names, city and room type names.
    Text(String),
    BBox {
        min_lat: f64,
        min_lon: f64,
        max_lat: f64,
        max_lon: f64,
    },
    Ids(Vec<i64>),
}

/// The index's part of a search.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateQuery {
    pub place: Place,
    pub stars_min: Option<i16>,
    pub amenities: Vec<String>,
}

/// The candidate cache's key: the reader generation an answer came from
/// and the parts of the query it answers, compared exactly.
#[derive(Debug, PartialEq, Eq, Hash)]
struct CandidateKey {
    generation: u64,
    place: PlaceKey,
    stars_min: Option<i16>,
    amenities: Vec<String>,
}

/// A `Place` as a cache key: coordinates by their bits, since `f64` is
/// neither `Eq` nor `Hash` (a bounding box's are finite: `params` checks them).
#[derive(Debug, PartialEq, Eq, Hash)]
enum PlaceKey {
    City(String),
    Text(String),
    /// `min_lat`, `min_lon`, `max_lat`, `max_lon`, each `f64::to_bits`.
    BBox([u64; 4]),
    Ids(Vec<i64>),
}

impl CandidateKey {
    fn new(generation: u64, q: &CandidateQuery) -> CandidateKey {
        let place = match &q.place {
            Place::City(city) => PlaceKey::City(city.clone()),
            Place::Text(text) => PlaceKey::Text(text.clone()),
            Place::BBox {
                min_lat,
                min_lon,
                max_lat,
                max_lon,
            } => PlaceKey::BBox([min_lat, min_lon, max_lat, max_lon].map(|c| c.to_bits())),
            Place::Ids(ids) => PlaceKey::Ids(ids.clone()),
        };
        CandidateKey {
            generation,
            place,
            stars_min: q.stars_min,
            amenities: q.amenities.clone(),
        }
    }

    /// Bytes the key holds in its own allocations (rounded to malloc's 16).
    fn heap_bytes(&self) -> u64 {
        let allocation = |bytes: usize| bytes.next_multiple_of(16) as u64;
        let place = match &self.place {
            PlaceKey::City(text) | PlaceKey::Text(text) => allocation(text.len()),
            PlaceKey::BBox(_) => 0,
            PlaceKey::Ids(ids) => allocation(ids.len() * size_of::<i64>()),
        };
        let amenities = allocation(self.amenities.len() * size_of::<String>())
            + self
                .amenities
                .iter()
                .map(|a| allocation(a.len()))
                .sum::<u64>();
        place + amenities
    }
}

#[derive(Clone, Copy)]
struct Fields {
    hotel_id: Field,
    name: Field,
    city_text: Field,
    city: Field,
    stars: Field,
    lat: Field,
    lon: Field,
    amenity: Field,
    room_names: Field,
}

pub struct HotelIndex {
    index: Index,
    reader: IndexReader,
    writer: Mutex<IndexWriter>,
    fields: Fields,
    dirty: Mutex<HashSet<i64>>,
    rebuild: AtomicBool,
    /// Copies announced so far (`copy_coming`, right before each swap), and
    /// the newest of them whose rebuild readers now see. Equal: every hotel
    /// of the loaded copy is searchable (what `/readyz` waits for).
    copies_loaded: AtomicU64,
    /// Copies swapped into the model so far (`mark_all`): what a rebuild
    /// may claim. Not `copies_loaded`, which counts a copy before its swap:
    /// a rebuild that read that count, then the model before the swap,
    /// claimed the new copy with the old one's hotels, and `/readyz`
    /// answered 200 while searches found the old copy's candidates.
    copies_swapped: AtomicU64,
    copies_indexed: AtomicU64,
    synced: AtomicU64,
    /// `synced`, for searches that wait for it (`wait_synced`).
    synced_watch: tokio::sync::watch::Sender<u64>,
    /// A search waits for the index: sync now, not at the next tick.
    sync_asked: tokio::sync::Notify,
    /// Bumped after each reload of the reader: part of every cached
    /// answer's key, so no answer of an older reader outlives it.
    generation: AtomicU64,
    /// Recent candidate lists. Guests ask the same few places over and over
    /// (a city, with a handful of filters), and the index changes only when
    /// a hotel does; a hit saves a query that was a twentieth of a search.
    answers: moka::sync::Cache<CandidateKey, Candidates>,
}

/// Hotel ids with a relevance score, shared between cache and searches.
pub type Candidates = Arc<Vec<(i64, f32)>>;

/// The most the candidate cache holds, in bytes as `cached_bytes` counts
/// them. Keys count too: a key may be a query string of up to 4 KiB, and a
/// client asking one unknown city after another would otherwise fill a
/// bound counted in candidates with empty lists under large keys.
const CACHED_CANDIDATES_BYTES: u64 = 32 << 20;

/// One cached candidate list, without its key's heap and its candidates,
/// in bytes: the key itself, the `Arc<Vec>` (8) and its allocation (two
/// counts and the `Vec`), and moka's own per-entry cost.
pub const CANDIDATES_ENTRY_BYTES: u64 =
    (size_of::<CandidateKey>() + size_of::<Candidates>() + 16 + size_of::<Vec<(i64, f32)>>())
        as u64
        + crate::metrics::MOKA_ENTRY_OVERHEAD_BYTES;
/// One candidate in a cached list: a hotel id and its score, padded.
pub const CANDIDATE_BYTES: u64 = size_of::<(i64, f32)>() as u64;

/// What one cached list costs: the cache's weight, and the soak's
/// accounting (`vacancy_cache_estimated_bytes`).
fn cached_bytes(key: &CandidateKey, candidates: &Candidates) -> u64 {
    CANDIDATES_ENTRY_BYTES + key.heap_bytes() + candidates.len() as u64 * CANDIDATE_BYTES
}

impl HotelIndex {
    pub fn new() -> Result<Arc<HotelIndex>, IndexError> {
        HotelIndex::with_cache_bytes(CACHED_CANDIDATES_BYTES)
    }

    /// As `new`, with the candidate cache bounded at `cache_bytes`.
    fn with_cache_bytes(cache_bytes: u64) -> Result<Arc<HotelIndex>, IndexError> {
        let mut b = Schema::builder();
        let fields = Fields {
            hotel_id: b.add_u64_field("hotel_id", INDEXED | FAST | STORED),
            name: b.add_text_field("name", TEXT),
            city_text: b.add_text_field("city_text", TEXT),
            city: b.add_text_field("city", STRING),
            stars: b.add_u64_field("stars", INDEXED | FAST),
            lat: b.add_f64_field("lat", INDEXED | FAST),
            lon: b.add_f64_field("lon", INDEXED | FAST),
            amenity: b.add_text_field("amenity", STRING),
            room_names: b.add_text_field("room_names", TEXT),
        };
        let index = Index::create_in_ram(b.build());
        // One indexing thread: the copy's hotels are few, and the stream
        // already uses a core.
        let writer = index.writer_with_num_threads(1, 20_000_000)?;
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()?;
        Ok(Arc::new(HotelIndex {
            index,
            reader,
            writer: Mutex::new(writer),
            fields,
            dirty: Mutex::new(HashSet::new()),
            rebuild: AtomicBool::new(false),
            copies_loaded: AtomicU64::new(0),
            copies_swapped: AtomicU64::new(0),
            copies_indexed: AtomicU64::new(0),
            synced: AtomicU64::new(0),
            synced_watch: tokio::sync::watch::Sender::new(0),
            sync_asked: tokio::sync::Notify::new(),
            generation: AtomicU64::new(0),
            answers: moka::sync::Cache::builder()
                .max_capacity(cache_bytes)
                .weigher(|k, v| u32::try_from(cached_bytes(k, v)).unwrap_or(u32::MAX))
                // Stale generations are never asked for again; let them go.
                .time_to_idle(Duration::from_secs(60))
                .build(),
        }))
    }

    /// Cached candidate lists and their estimated bytes (`cached_bytes`:
    /// each list's fixed part, its key and its candidates, the cache's own
    /// weight). moka's counts trail inserts and evictions until its pending
    /// maintenance runs, so that runs first.
    pub fn cached_answers(&self) -> (u64, u64) {
        self.answers.run_pending_tasks();
        (self.answers.entry_count(), self.answers.weighted_size())
    }

    /// Marks the hotels whose documents must be rewritten because of `txn`.
    /// Call it before the transaction is applied, and hand what it returns
    /// to `note_applied` after (see the module doc for why both).
    pub fn note_transaction(&self, txn: &Transaction) -> NotedHotels {
        let mut noted = NotedHotels::default();
        // Nothing to index in counts alone: a reprice of every night spills
        // to disk, and this walk would read it all back for nothing.
        if txn.changes.only_nights() {
            return noted;
        }
        let walked = txn.changes.for_each(|change| {
            let id = match change {
                Change::UpsertHotel { hotel, .. } => hotel.id,
                Change::DeleteHotel { id } => *id,
                Change::UpsertRoomType { room_type, .. } => room_type.hotel_id,
                Change::DeleteRoomType { hotel_id, .. } => *hotel_id,
                Change::Truncate { .. } => {
                    noted.rebuild = true;
                    return Ok(());
                }
                _ => return Ok(()),
            };
            noted.hotels.insert(id);
            Ok::<(), crate::model::SpillError>(())
        });
        if let Err(error) = walked {
            // A spill file read in part: which hotels changed is unknown, so
            // all are re-indexed (apply, which reads it next, fails alone).
            tracing::warn!(%error, "cannot read a held transaction back; the index is rebuilt");
            noted.rebuild = true;
        }
        self.mark(&noted);
        noted
    }

    /// Marks again what `note_transaction` marked, now that the transaction
    /// is in the copy (or failed to apply, when the marks cost a re-index of
    /// hotels that did not change).
    pub fn note_applied(&self, noted: NotedHotels) {
        self.mark(&noted);
    }

    fn mark(&self, noted: &NotedHotels) {
        if !noted.hotels.is_empty() {
            self.dirty
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(noted.hotels.iter().copied());
        }
        if noted.rebuild {
            self.rebuild.store(true, Ordering::Release);
        }
    }

    /// A new copy is about to be swapped into the model: counted before
    /// the swap, so from the swap on the index does not hold the current
    /// copy (`holds_current_copy`) until a rebuild after `mark_all` does.
    /// Counted after the swap, a readiness check in between found the old
    /// count matched: ready, with the index of the copy before (empty at
    /// the first load).
    pub fn copy_coming(&self) {
        self.copies_loaded.fetch_add(1, Ordering::AcqRel);
    }

    /// Everything must be re-indexed: the copy announced by `copy_coming`
    /// was swapped into the model (call it after the swap). Counted before
    /// the flag is set: a sync that takes this flag reads the count after
    /// it, and the model after that, so it sees the new copy and may claim
    /// it. A sync that took an earlier flag reads a count without it and
    /// leaves this flag for the next sync.
    pub fn mark_all(&self) {
        self.copies_swapped.fetch_add(1, Ordering::AcqRel);
        self.rebuild.store(true, Ordering::Release);
    }

    /// Whether every hotel of the copy in the model is in the reader that
    /// answers searches: the last copy swapped in has been rebuilt, committed
    /// and reloaded. (Hotels added to it since then follow within a batch.)
    pub fn holds_current_copy(&self) -> bool {
        self.copies_indexed.load(Ordering::Acquire) >= self.copies_loaded.load(Ordering::Acquire)
    }

    /// The model position the index fully reflects.
    pub fn synced_lsn(&self) -> Lsn {
        Lsn(self.synced.load(Ordering::Acquire))
    }

    /// Re-indexes what is dirty. Blocking: run it off the async runtime.
    pub fn sync(&self, model: &ReadModel) -> Result<usize, IndexError> {
        // Read the position first: every transaction at or below it marked
        // its hotels before it was applied, so they are in the set taken next.
        let at = model.freshness.applied();
        let rebuild = self.rebuild.swap(false, Ordering::AcqRel);
        // After the flag, before the model is read: every copy counted here
        // was swapped in before this count, so the read below sees it.
        let copies_swapped = self.copies_swapped.load(Ordering::Acquire);
        let dirty: Vec<i64> =
            std::mem::take(&mut *self.dirty.lock().unwrap_or_else(|p| p.into_inner()))
                .into_iter()
                .collect();
        if !rebuild && dirty.is_empty() {
            self.synced.fetch_max(at.0, Ordering::AcqRel);
            self.publish_synced();
            return Ok(0);
        }
        // Given back if the sync fails, so the next one does the work: taken
        // and dropped, a failed rebuild left readiness waiting for another
        // copy, and failed hotels stale in the index while ready.
        let retry = (!rebuild).then(|| dirty.clone());
        let synced = self.sync_taken(model, at, rebuild, copies_swapped, dirty);
        if synced.is_err() {
            if rebuild {
                self.rebuild.store(true, Ordering::Release);
            }
            if let Some(ids) = retry {
                self.dirty
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend(ids);
            }
        }
        synced
    }

    /// `sync`'s work, once it has taken what is dirty.
    fn sync_taken(
        &self,
        model: &ReadModel,
        at: Lsn,
        rebuild: bool,
        copies_swapped: u64,
        dirty: Vec<i64>,
    ) -> Result<usize, IndexError> {
        let f = self.fields;
        let docs: Vec<(i64, Option<TantivyDocument>)> = {
            let t = model.read();
            let ids: Vec<i64> = if rebuild {
                t.hotels.keys().copied().collect()
            } else {
                dirty
            };
            ids.into_iter()
                .map(|id| {
                    let doc = t.hotels.get(&id).map(|h| {
                        let mut doc = TantivyDocument::default();
                        doc.add_u64(f.hotel_id, h.id as u64);
                        doc.add_text(f.name, &h.name);
                        doc.add_text(f.city_text, &h.city);
                        doc.add_text(f.city, h.city.to_lowercase());
                        doc.add_u64(f.stars, h.stars.unwrap_or(0).max(0) as u64);
                        if let (Some(lat), Some(lon)) = (h.latitude, h.longitude) {
                            doc.add_f64(f.lat, lat);
                            doc.add_f64(f.lon, lon);
                        }
                        for a in &h.amenities {
                            doc.add_text(f.amenity, a.to_lowercase());
                        }
                        for rt in t.room_types.of_hotel(id) {
                            doc.add_text(f.room_names, &rt.name);
                        }
                        doc
                    });
                    (id, doc)
                })
                .collect()
        };
        let started = Instant::now();
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if rebuild {
            writer.delete_all_documents()?;
        }
        let n = docs.len();
        for (id, doc) in docs {
            writer.delete_term(Term::from_field_u64(f.hotel_id, id as u64));
            if let Some(doc) = doc {
                writer.add_document(doc)?;
            }
        }
        writer.commit()?;
        drop(writer);
        self.reader.reload()?;
        self.generation.fetch_add(1, Ordering::AcqRel);
        if rebuild {
            self.copies_indexed
                .fetch_max(copies_swapped, Ordering::AcqRel);
        }
        metrics::INDEX_COMMIT_DURATION.observe(started.elapsed().as_secs_f64());
        let searcher = self.reader.searcher();
        metrics::INDEX_DOCUMENTS.set(searcher.num_docs() as i64);
        metrics::INDEX_SEGMENTS.set(searcher.segment_readers().len() as i64);
        if rebuild {
            // A new copy may stand below the last one (a failover's new
            // timeline): its position replaces the old, it does not add to it.
            self.synced.store(at.0, Ordering::Release);
        } else {
            self.synced.fetch_max(at.0, Ordering::AcqRel);
        }
        self.publish_synced();
        Ok(n)
    }

    fn publish_synced(&self) {
        self.synced_watch
            .send_replace(self.synced.load(Ordering::Acquire));
    }

    /// Waits, at most `timeout`, until the index reflects `target`, asking
    /// the indexer to sync at once; true once it does. Read-your-writes
    /// (`min_lsn`) needs it: the copy applying the guest's write says
    /// nothing of the hotels it created or moved, which candidates come
    /// from, and the indexer runs only every 200 ms.
    pub async fn wait_synced(&self, target: Lsn, timeout: std::time::Duration) -> bool {
        let mut synced = self.synced_watch.subscribe();
        if *synced.borrow_and_update() >= target.0 {
            return true;
        }
        self.sync_asked.notify_one();
        matches!(
            tokio::time::timeout(timeout, synced.wait_for(|s| *s >= target.0)).await,
            Ok(Ok(_))
        )
    }

    /// Hotel ids matching `q`, with a relevance score (1.0 when the place is
    /// not free text).
    pub fn candidates(&self, q: &CandidateQuery) -> Result<Candidates, IndexError> {
        // Read before the query runs: a reload in between stores a newer
        // answer under the older generation, never the reverse.
        let key = CandidateKey::new(self.generation.load(Ordering::Acquire), q);
        if let Some(hit) = self.answers.get(&key) {
            return Ok(hit);
        }
        let found = Arc::new(self.query(q)?);
        self.answers.insert(key, found.clone());
        Ok(found)
    }

    fn query(&self, q: &CandidateQuery) -> Result<Vec<(i64, f32)>, IndexError> {
        let f = self.fields;
        let mut clauses: Vec<(Occur, Box<dyn Query>)> = Vec::new();
        match &q.place {
            Place::City(city) => clauses.push((
                Occur::Must,
                Box::new(TermQuery::new(
                    Term::from_field_text(f.city, &city.to_lowercase()),
                    IndexRecordOption::Basic,
                )),
            )),
            Place::Text(text) => {
                let mut parser =
                    QueryParser::for_index(&self.index, vec![f.name, f.city_text, f.room_names]);
                parser.set_conjunction_by_default();
                let (query, errors) = parser.parse_query_lenient(text);
                if !errors.is_empty() && text.split_whitespace().next().is_none() {
                    return Err(IndexError::BadQuery(text.clone()));
                }
                clauses.push((Occur::Must, query));
            }
            Place::BBox {
                min_lat,
                min_lon,
                max_lat,
                max_lon,
            } => {
                clauses.push((Occur::Must, f64_range(f.lat, *min_lat, *max_lat)));
                clauses.push((Occur::Must, f64_range(f.lon, *min_lon, *max_lon)));
            }
            Place::Ids(ids) => clauses.push((
                Occur::Must,
                Box::new(TermSetQuery::new(
                    ids.iter()
                        .map(|id| Term::from_field_u64(f.hotel_id, *id as u64)),
                )),
            )),
        }
        if let Some(min) = q.stars_min {
            clauses.push((
                Occur::Must,
                Box::new(RangeQuery::new(
                    Bound::Included(Term::from_field_u64(f.stars, min.max(0) as u64)),
                    Bound::Unbounded,
                )),
            ));
        }
        for a in &q.amenities {
            clauses.push((
                Occur::Must,
                Box::new(TermQuery::new(
                    Term::from_field_text(f.amenity, &a.to_lowercase()),
                    IndexRecordOption::Basic,
                )),
            ));
        }
        if clauses.is_empty() {
            clauses.push((Occur::Must, Box::new(AllQuery)));
        }
        let query = BooleanQuery::new(clauses);
        let searcher = self.reader.searcher();
        let limit = (searcher.num_docs() as usize).max(1);
        let hits = searcher
            .search(&query, &TopDocs::with_limit(limit).order_by_score())
            .map_err(|e| match (&q.place, e) {
                // The guest's text asked for something the index cannot
                // run: `name:*` parses as an exists query, which fails on a
                // field that is not a fast one, and `nosuch:*` names none.
                // A 400, not a 500 and an error in the log per request.
                (
                    Place::Text(text),
                    tantivy::TantivyError::FieldNotFound(_)
                    | tantivy::TantivyError::SchemaError(_)
                    | tantivy::TantivyError::InvalidArgument(_),
                ) => IndexError::BadQuery(text.clone()),
                (_, e) => IndexError::Tantivy(e),
            })?;
        let mut out = Vec::with_capacity(hits.len());
        let mut columns = Vec::new();
        for reader in searcher.segment_readers() {
            columns.push(reader.fast_fields().u64("hotel_id")?);
        }
        for (score, addr) in hits {
            if let Some(id) = columns[addr.segment_ord as usize].first(addr.doc_id) {
                out.push((id as i64, score));
            }
        }
        Ok(out)
    }
}

fn f64_range(field: Field, lo: f64, hi: f64) -> Box<dyn Query> {
    Box::new(RangeQuery::new(
        Bound::Included(Term::from_field_f64(field, lo)),
        Bound::Included(Term::from_field_f64(field, hi)),
    ))
}

/// Re-indexes dirty hotels every `interval` on a blocking thread, and at
/// once when a search waits for the index (`HotelIndex::wait_synced`).
pub async fn run_indexer(
    index: Arc<HotelIndex>,
    model: Arc<ReadModel>,
    interval: Duration,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = index.sync_asked.notified() => {}
            _ = tick.tick() => {}
        }
        if !model.freshness.is_loaded() {
            continue;
        }
        let (index, model) = (index.clone(), model.clone());
        match tokio::task::spawn_blocking(move || index.sync(&model)).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                tracing::error!(%error, "index sync failed; its hotels wait for the next")
            }
            // A panic of the sync is this task's: `app::Tasks` stops the
            // process, as for any background task's.
            Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
            Err(error) => tracing::error!(%error, "index sync task failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Hotel, Table, Unsent};

    fn hotel(id: i64, city: &str) -> Change {
        Change::UpsertHotel {
            hotel: Box::new(Hotel {
                id,
                name: format!("Hotel {id}"),
                city: city.into(),
                country: None,
                stars: Some(3),
                latitude: None,
                longitude: None,
                amenities: Vec::new(),
            }),
            unsent: Unsent::default(),
        }
    }

    fn commit(model: &ReadModel, index: &HotelIndex, lsn: u64, changes: Vec<Change>) {
        let txn = Transaction {
            xid: 1,
            commit_lsn: Lsn(lsn),
            end_lsn: Lsn(lsn + 1),
            commit_time: chrono::Utc::now(),
            changes: changes.into(),
        };
        let noted = index.note_transaction(&txn);
        model.apply(&txn).unwrap();
        index.note_applied(noted);
        index.sync(model).unwrap();
    }

    fn in_city(city: &str) -> CandidateQuery {
        CandidateQuery {
            place: Place::City(city.into()),
            stars_min: None,
            amenities: Vec::new(),
        }
    }

    fn ids(c: &Candidates) -> Vec<i64> {
        let mut ids: Vec<i64> = c.iter().map(|(id, _)| *id).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn cache_keys_tell_every_part_of_a_question_apart() {
        let bbox = |min_lat| CandidateQuery {
            place: Place::BBox {
                min_lat,
                min_lon: 1.0,
                max_lat: 2.0,
                max_lon: 3.0,
            },
            stars_min: None,
            amenities: Vec::new(),
        };
        let porto = in_city("porto");
        let key = |g, q: &CandidateQuery| CandidateKey::new(g, q);
        assert_eq!(key(1, &porto), key(1, &in_city("porto")));
        assert_eq!(key(1, &bbox(0.5)), key(1, &bbox(0.5)));
        let differing = [
            key(2, &porto),
            key(1, &in_city("lisbon")),
            key(
                1,
                &CandidateQuery {
                    place: Place::Text("porto".into()),
                    ..porto.clone()
                },
            ),
            key(
                1,
                &CandidateQuery {
                    stars_min: Some(3),
                    ..porto.clone()
                },
            ),
            key(
                1,
                &CandidateQuery {
                    amenities: vec!["pool".into()],
                    ..porto.clone()
                },
            ),
        ];
        for other in &differing {
            assert_ne!(&key(1, &porto), other);
        }
        assert_ne!(key(1, &bbox(0.5)), key(1, &bbox(0.25)));
    }

    /// Text that asks for what the index cannot run is the guest's error.
    #[test]
    fn text_the_index_cannot_run_is_a_bad_query() {
        let model = ReadModel::new();
        let index = HotelIndex::new().unwrap();
        commit(&model, &index, 10, vec![hotel(1, "Porto")]);
        let text = |t: &str| CandidateQuery {
            place: Place::Text(t.into()),
            stars_min: None,
            amenities: Vec::new(),
        };
        for bad in ["name:*", "nosuch:*", "porto city_text:*"] {
            assert!(
                matches!(index.candidates(&text(bad)), Err(IndexError::BadQuery(_))),
                "{bad}"
            );
        }
        assert_eq!(ids(&index.candidates(&text("porto")).unwrap()), vec![1]);
    }

    #[test]
    fn cached_candidates_last_only_until_the_index_changes() {
        let model = ReadModel::new();
        let index = HotelIndex::new().unwrap();
        commit(
            &model,
            &index,
            10,
            vec![hotel(1, "Porto"), hotel(2, "Lisbon")],
        );

        let first = index.candidates(&in_city("porto")).unwrap();
        assert_eq!(ids(&first), vec![1]);
        let again = index.candidates(&in_city("porto")).unwrap();
        assert!(
            Arc::ptr_eq(&first, &again),
            "the second ask is served from the cache"
        );
        let other = index.candidates(&in_city("lisbon")).unwrap();
        assert_eq!(ids(&other), vec![2], "another question has its own entry");

        // A new hotel in Porto and one moving out: the next answer shows both.
        commit(
            &model,
            &index,
            20,
            vec![hotel(3, "Porto"), hotel(1, "Faro")],
        );
        let after = index.candidates(&in_city("porto")).unwrap();
        assert_eq!(ids(&after), vec![3]);

        // A sync with nothing to re-index keeps the cached answers.
        index.sync(&model).unwrap();
        let kept = index.candidates(&in_city("porto")).unwrap();
        assert!(Arc::ptr_eq(&after, &kept));
    }

    /// The indexer runs whenever its tick fires: here between the mark
    /// before an apply and the apply itself, so that sync indexes the copy
    /// without the transaction. The mark after the apply must bring it in.
    #[test]
    fn a_sync_while_a_transaction_is_applied_loses_none_of_it() {
        let model = ReadModel::new();
        let index = HotelIndex::new().unwrap();
        commit(&model, &index, 10, vec![hotel(1, "Porto")]);
        let transaction = |lsn: u64, changes: Vec<Change>| Transaction {
            xid: 2,
            commit_lsn: Lsn(lsn),
            end_lsn: Lsn(lsn + 1),
            commit_time: chrono::Utc::now(),
            changes: changes.into(),
        };

        // Hotel 1 moves, hotel 2 opens; the tick lands before the apply.
        let moved = transaction(20, vec![hotel(1, "Faro"), hotel(2, "Faro")]);
        let noted = index.note_transaction(&moved);
        index.sync(&model).unwrap();
        assert!(
            index.synced_lsn() < Lsn(21),
            "a sync before the apply does not claim it"
        );
        model.apply(&moved).unwrap();
        index.note_applied(noted);
        index.sync(&model).unwrap();
        assert!(index.synced_lsn() >= Lsn(21));
        assert_eq!(
            ids(&index.candidates(&in_city("faro")).unwrap()),
            vec![1, 2]
        );
        assert!(ids(&index.candidates(&in_city("porto")).unwrap()).is_empty());

        // A truncate of hotels and a new one in the same transaction: the
        // rebuild its mark asks for is asked again after the apply.
        let truncated = transaction(
            30,
            vec![
                Change::Truncate {
                    tables: vec![Table::Hotels],
                },
                hotel(3, "Porto"),
            ],
        );
        let noted = index.note_transaction(&truncated);
        index.sync(&model).unwrap();
        model.apply(&truncated).unwrap();
        index.note_applied(noted);
        index.sync(&model).unwrap();
        assert!(ids(&index.candidates(&in_city("faro")).unwrap()).is_empty());
        assert_eq!(ids(&index.candidates(&in_city("porto")).unwrap()), vec![3]);
    }

    /// A client asking one unknown, 4 KiB city after another fills the
    /// cache with empty lists under large keys: the bound counts the keys.
    #[test]
    fn the_candidate_cache_is_bounded_in_bytes_keys_included() {
        let index = HotelIndex::with_cache_bytes(1 << 20).unwrap();
        let model = ReadModel::new();
        commit(&model, &index, 10, vec![hotel(1, "Porto")]);
        for i in 0..1_000 {
            let city = format!("{i:04}{}", "x".repeat(4_000));
            assert!(index.candidates(&in_city(&city)).unwrap().is_empty());
        }
        let (entries, bytes) = index.cached_answers();
        assert!(bytes <= 1 << 20, "{bytes} bytes in {entries} entries");
        assert!(entries < 1_000 / 3, "{entries} entries of over 4 KiB each");
        let porto = index.candidates(&in_city("porto")).unwrap();
        let (_, with_porto) = index.cached_answers();
        assert!(with_porto <= 1 << 20);
        assert_eq!(ids(&porto), vec![1]);
    }

    /// From the moment a copy is announced (before its swap) the index
    /// does not hold the current copy, until a rebuild from the new copy
    /// after `mark_all`: a readiness check between the swap and the flag
    /// never finds the old index, empty at the first load, current.
    #[test]
    fn an_announced_copy_is_held_only_once_rebuilt_from_it() {
        let model = ReadModel::new();
        let index = HotelIndex::new().unwrap();
        assert!(index.holds_current_copy());
        index.copy_coming();
        assert!(!index.holds_current_copy(), "announced, not yet swapped");
        index.sync(&model).unwrap();
        assert!(!index.holds_current_copy(), "a sync without the flag");
        let mut copy = crate::model::Tables::default();
        copy.apply_change(&hotel(1, "Porto")).unwrap();
        copy.applied = Lsn(10);
        model.replace(copy);
        assert!(!index.holds_current_copy(), "swapped, not yet flagged");
        index.mark_all();
        index.sync(&model).unwrap();
        assert!(index.holds_current_copy());
        assert_eq!(ids(&index.candidates(&in_city("porto")).unwrap()), vec![1]);
    }

    /// A rebuild still pending (an earlier copy's, or a truncate's) when
    /// the next copy is announced, taken by a tick before that copy's
    /// swap: it indexes the copy before and must not claim the new one.
    /// It did: `/readyz` answered 200 while searches found the old copy's
    /// hotels (here, none in Porto).
    #[test]
    fn a_rebuild_pending_before_a_swap_does_not_claim_the_new_copy() {
        let model = ReadModel::new();
        let index = HotelIndex::new().unwrap();
        let copy = |id, city: &str, lsn| {
            let mut t = crate::model::Tables::default();
            t.apply_change(&hotel(id, city)).unwrap();
            t.applied = Lsn(lsn);
            t
        };
        index.copy_coming();
        model.replace(copy(1, "Lisbon", 10));
        index.mark_all();
        index.copy_coming();
        // The indexer's tick, between the announcement and the swap.
        index.sync(&model).unwrap();
        model.replace(copy(2, "Porto", 20));
        assert!(
            !index.holds_current_copy(),
            "copy 2 swapped in, never indexed"
        );
        assert!(ids(&index.candidates(&in_city("porto")).unwrap()).is_empty());
        index.mark_all();
        index.sync(&model).unwrap();
        assert!(index.holds_current_copy());
        assert_eq!(ids(&index.candidates(&in_city("porto")).unwrap()), vec![2]);
    }
}

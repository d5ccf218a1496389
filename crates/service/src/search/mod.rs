//! The query: which hotels can host this party on every night of the stay.
//!
//! Candidates come from the hotel index (where, stars, amenities); their
//! room types and nightly counts come from the read model under one read
//! lock, so an answer reflects exactly one LSN. Room types that show few
//! free units are then made owner-fresh: confirmed (`confirm`: the copy
//! read again once it has applied an owner WAL position taken after the
//! search began) or read from the owner (`owner_read`), and the answer
//! says, per room type, whose numbers it shows.
//!
//! Every room type shown carries a `quote`: a signed token of what was shown
//! (see `stale::token`), which the booking service sends back with the
//! outcome of the take. Hotels whose recent takes keep turning into stale
//! reads (`stale::bypass`) have all their room types read from the owner.
//!
//! A room type is *offered* when it has a row on every night of the stay, at
//! least one unit free on each (`coalesce(sell_limit, total) - taken`), a
//! `max_guests` that fits the smallest requested room, and, with
//! `max_price_cents`, a stay price within it. A hotel matches when every
//! requested room can be placed in an offered room type with room to spare on
//! every night (two rooms may share a type with two units free).

pub mod confirm;
pub mod owner_read;
pub mod params;
mod settings;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, NaiveDate, Utc};
use serde::Serialize;

use crate::index::{HotelIndex, IndexError, Place};
use crate::lsn::{Lsn, Position};
use crate::metrics;
use crate::model::calendars::{HotelCalendars, StayOffer};
use crate::model::room_types::Beds;
use crate::model::{CalendarKey, Hotel, NightCounts, ReadModel, Tables};
pub use crate::model::{Source, Stay};
use crate::owner::OwnerSettings;
use crate::stale::StaleReadState;
use crate::stale::token::{Quote, QuoteKey, Token};
use confirm::{ConfirmError, Confirmer};
use owner_read::{OwnerCalendars, OwnerReader, Reason};
use params::{AvailabilityRequest, Cursor, SearchRequest, Sort};
pub use settings::{FreshReads, SearchSettings, WhenLagging};

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RoomOffer {
    pub room_type_id: i64,
    pub name: String,
    pub max_guests: i16,
    /// The fewest units free on any night of the stay.
    pub free_units: i32,
    /// The whole stay, one unit; null when a night has no price.
    pub price_cents: Option<i64>,
    pub low_availability: bool,
    pub source: Source,
    /// Opaque: send it back with the take's outcome (`POST /v1/take-outcomes`).
    #[schema(value_type = String)]
    pub quote: Token,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct HotelResult {
    pub hotel_id: i64,
    pub name: String,
    pub city: String,
    pub stars: Option<i16>,
    /// The cheapest offered room type's stay price.
    pub price_cents: Option<i64>,
    pub room_types: Vec<RoomOffer>,
    /// Where the hotel sorts; computed with the match, never sent.
    #[serde(skip)]
    rank: Rank,
}

/// What the answer's order needs of a matched hotel. It is computed for
/// every match (a city's 200 hotels), while a `HotelResult`, with its room
/// types, names and quotes, is built only for the page shown.
#[derive(Debug, Clone, Copy)]
struct Rank {
    hotel_id: i64,
    stars: Option<i16>,
    /// The cheapest offered room type's stay price.
    price_cents: Option<i64>,
    /// Free units summed over the offered room types.
    free_units: i64,
    score: f32,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SearchAnswer {
    /// Every owner change committed before this LSN is in the copy's numbers.
    #[schema(value_type = String, example = "0/16B3748")]
    pub lsn: Lsn,
    /// `lsn` with the owner timeline it is on (`2/0/16B3748`): send it back
    /// as `min_lsn` for read-your-writes that survives an owner failover.
    #[schema(example = "1/0/16B3748")]
    pub position: String,
    pub lag_ms: u64,
    /// True while this node's copy is being replaced whole: a new snapshot,
    /// or on a replica a new bootstrap (a new epoch, an operator's ask, a
    /// gap in the stream). It applies no change until then, so its numbers
    /// stay as of `lsn` while `lag_ms` grows.
    pub stale: bool,
    /// The owner WAL position the `confirmed` room types were read at or
    /// past: taken on the owner after this search began, so every owner
    /// commit made before the search began is in their numbers. Null when
    /// no room type shown is `confirmed`.
    #[schema(value_type = Option<String>, example = "0/16B37A0")]
    pub confirmed_lsn: Option<Lsn>,
    pub total_hotels: usize,
    pub results: Vec<HotelResult>,
    pub next_cursor: Option<String>,
    /// Only with `search.stamp_owner_position` (a lab setting): where the
    /// owner stood while this answer was built.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner_position: Option<OwnerPosition>,
}

/// The owner's flushed WAL position read just before the search read the
/// copy and again after its last read (copy or owner): the owner's truth at
/// the moment the answer was built lies between the two. `vacancy bench
/// stale` judges each showing against the owner's commits up to there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct OwnerPosition {
    #[schema(value_type = String, example = "0/16B3748")]
    pub before: Lsn,
    #[schema(value_type = String, example = "0/16B3790")]
    pub after: Lsn,
}

#[derive(Debug, thiserror::Error)]
pub enum SearchError {
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error("no such hotel: {0}")]
    HotelNotFound(i64),
    #[error(
        "min_lsn {asked} is a position of an owner timeline this copy no longer follows (it is on timeline {timeline}: the owner failed over, and what was written there after the new primary branched off is gone); search again without min_lsn, or with a position of this answer's timeline"
    )]
    OldTimeline { asked: Position, timeline: u32 },
    /// No owner commit could have given this position: the owner has not
    /// reached it. Without this, such a `min_lsn` made every search read
    /// every candidate from the owner, on any guest's request.
    #[error(
        "min_lsn {asked} is past the owner's current position {owner}: no write could have returned it; search with a position an answer or a write gave"
    )]
    MinLsnAhead { asked: Position, owner: Position },
}

/// What search needs, shared by the handlers.
pub struct Search {
    pub model: Arc<ReadModel>,
    pub index: Arc<HotelIndex>,
    pub owner: OwnerReader,
    /// Owner positions for confirmed reads.
    confirmer: Confirmer,
    fresh_reads: FreshReads,
    /// `owner_read_timeout_ms`: one budget for a confirmed read and its
    /// fallback row read together.
    owner_budget: Duration,
    few_units: i32,
    min_lsn_wait: Duration,
    stamp_owner_position: bool,
    /// Signs the quotes. A random key until `with_stale` gives the app's.
    quotes: QuoteKey,
    /// The stale-read loop, for the hotels to read from the owner.
    stale: Option<Arc<StaleReadState>>,
}

/// What every quote of one answer shares.
#[derive(Debug, Clone, Copy)]
struct QuoteContext {
    stay: Stay,
    lsn: Lsn,
    /// The position `confirmed` room types were read at or past.
    confirmed: Option<Lsn>,
    shown_at: DateTime<Utc>,
    lag_ms: u64,
}

impl QuoteContext {
    fn sign(&self, key: &QuoteKey, k: CalendarKey, free_units: i32, source: Source) -> Token {
        let lsn = match (source, self.confirmed) {
            (Source::Confirmed, Some(at)) => at,
            _ => self.lsn,
        };
        let quote = Quote {
            source,
            hotel_id: k.hotel_id,
            room_type_id: k.room_type_id,
            check_in: self.stay.check_in,
            check_out: self.stay.check_out,
            free_units,
            lsn,
            shown_at: self.shown_at,
            lag_ms: u32::try_from(self.lag_ms).unwrap_or(u32::MAX),
        };
        // Stays are checked (1 to 30 nights) before a search runs, and
        // signing refuses only stays that do not fit in a u16.
        key.sign_token(&quote).unwrap_or_default()
    }
}

/// What one owner read gave for some calendars.
enum OwnerNights {
    Read(Arc<OwnerCalendars>),
    /// The copy's nights, read once it had applied an owner position taken
    /// after the search began.
    Confirmed(Arc<OwnerCalendars>),
    /// The copy the hotels were read from was already at or past such a
    /// position: their numbers stand, confirmed. The calendars, sorted.
    ConfirmedAsCopied(Vec<CalendarKey>),
    /// The read failed; the calendars asked for, sorted.
    Failed(Vec<CalendarKey>),
}

impl OwnerNights {
    /// The read of `keys` failed (or was not sent in time).
    fn failed(mut keys: Vec<CalendarKey>) -> OwnerNights {
        keys.sort_unstable();
        OwnerNights::Failed(keys)
    }
}

/// One room type's nights over the stay, as read from the copy.
#[derive(Debug, Clone)]
struct TypeNights {
    key: CalendarKey,
    max_guests: i16,
    /// The fewest free units and the stay price (`offer`), kept up to date
    /// with `nights` and `source`.
    offer: Option<(i32, Option<i64>)>,
    /// Night by night; left empty when only the offer is needed (the
    /// common search, where copying nights out would cost more than the rest).
    nights: Vec<Option<NightCounts>>,
    source: Source,
}

#[derive(Debug, Clone)]
struct HotelNights {
    hotel_id: i64,
    stars: Option<i16>,
    score: f32,
    types: Vec<TypeNights>,
}

/// A guess at the room types a matching hotel shows, to size the vector
/// that holds them for a whole city; a wrong guess costs a reallocation.
const SHOWN_TYPES_PER_HOTEL: usize = 8;

/// Rounds of owner reads one page may take when the owner's numbers rule
/// hotels out; past it the page is shorter and the cursor goes on.
const MAX_PAGE_ROUNDS: usize = 3;

/// The fewest free units and the stay price, or `None` when some night has
/// no row or no unit free.
pub fn offer(nights: &[Option<NightCounts>]) -> Option<(i32, Option<i64>)> {
    offer_of(nights.iter().copied())
}

/// `offer` over any walk of the stay's nights.
pub fn offer_of(nights: impl Iterator<Item = Option<NightCounts>>) -> Option<(i32, Option<i64>)> {
    StayOffer::of_nights(nights).offer()
}

/// Whether every room (guests each) fits into the room types, with
/// `free_for(g)` the units free in types of at least `g` beds. Eligible
/// types for a room are all those with enough beds, so the sets are nested
/// and Hall's condition per guest count decides it.
pub fn placeable_by(rooms: &[i16], free_for: impl Fn(i16) -> i64) -> bool {
    rooms.iter().all(|&g| {
        let need = rooms.iter().filter(|&&r| r >= g).count() as i64;
        need <= free_for(g)
    })
}

impl Search {
    /// The copy to answer from, timed: `vacancy_search_model_wait_seconds`
    /// shows that a reader never waits for apply.
    fn copy(&self) -> Arc<Tables> {
        let asked = Instant::now();
        let copy = self.model.read();
        metrics::SEARCH_MODEL_WAIT.observe(asked.elapsed().as_secs_f64());
        copy
    }

    /// `schema`: the one the stream follows (`stream.schema`), whose
    /// `inventory` the owner reads read.
    pub fn new(
        owner: &OwnerSettings,
        settings: &SearchSettings,
        schema: &str,
        model: Arc<ReadModel>,
        index: Arc<HotelIndex>,
    ) -> Search {
        Search {
            model,
            index,
            owner: OwnerReader::new(owner, settings, schema),
            confirmer: Confirmer::new(owner, Duration::from_millis(settings.owner_read_timeout_ms)),
            fresh_reads: settings.fresh_reads,
            owner_budget: Duration::from_millis(settings.owner_read_timeout_ms),
            few_units: settings.few_units_threshold,
            min_lsn_wait: Duration::from_millis(settings.min_lsn_wait_ms),
            stamp_owner_position: settings.stamp_owner_position,
            quotes: QuoteKey::random(),
            stale: None,
        }
    }

    /// Confirmed reads nudge the owner (write a logical message) only while
    /// `writes` is set (`confirm`): a replica's is never set, a projector's
    /// while it is the active one.
    pub fn nudging_while(mut self, writes: Arc<std::sync::atomic::AtomicBool>) -> Search {
        self.confirmer = self.confirmer.writing_while(writes);
        self
    }

    /// Signs quotes with the loop's key and reads the hotels its policy
    /// flags from the owner.
    pub fn with_stale(mut self, stale: Arc<StaleReadState>) -> Search {
        self.quotes = stale.key.clone();
        self.stale = Some(stale);
        self
    }

    /// The hotels among `hotel_ids` the stale-read policy says to read from the owner.
    fn bypassed(&self, hotel_ids: impl Iterator<Item = i64> + Clone) -> HashSet<i64> {
        match &self.stale {
            Some(s) => s.bypassed_hotels(hotel_ids),
            None => Default::default(),
        }
    }

    /// Waits (bounded) for the copy to apply `min_lsn`; false when it did
    /// not. Woken by the apply that reaches it, not by polling.
    ///
    /// LSNs compare only within a timeline. A position of an older
    /// timeline than the copy's (the owner failed over since the guest
    /// read or wrote it) can never be reached, and waiting for it would
    /// compare unrelated numbers: it is refused (`OldTimeline`). One of a
    /// newer timeline means the copy still follows the old owner (its new
    /// snapshot is being taken): not reached, the owner is read. A bare LSN
    /// is taken as one of the copy's timeline, as before timelines were
    /// said.
    async fn reached(&self, min_lsn: Option<Position>) -> Result<bool, SearchError> {
        let Some(target) = min_lsn else {
            return Ok(true);
        };
        let timeline = self.model.read().timeline;
        match target.timeline {
            Some(asked) if timeline != 0 && asked < timeline => {
                return Err(SearchError::OldTimeline {
                    asked: target,
                    timeline,
                });
            }
            Some(asked) if timeline != 0 && asked > timeline => {
                self.refuse_if_owner_lacks(target).await?;
                return Ok(false);
            }
            _ => {}
        }
        // A position past all the WAL the copy has heard of may be one no
        // owner commit gave (made up, or another owner's): the owner is
        // asked first, so such a question is refused at once. Asked only
        // after the wait, each held a place in the guest budget for all of
        // `min_lsn_wait_ms`, and eight a second shed every other guest.
        let heard_of = target.lsn <= self.model.freshness.server_wal_end();
        if !heard_of {
            self.refuse_if_owner_lacks(target).await?;
        }
        let reached = self
            .model
            .freshness
            .wait_applied(target.lsn, self.min_lsn_wait)
            .await
            .is_some();
        if !reached && heard_of {
            self.refuse_if_owner_lacks(target).await?;
        }
        Ok(reached)
    }

    /// `MinLsnAhead` when the owner's position (a confirmed read's, shared
    /// with the searches that read it at the same time) shows that no
    /// owner commit gave `target`: a later timeline than the owner's, or a
    /// position past it on the same one. Called only once the copy has not
    /// reached `target`, before the search reads its every candidate from
    /// the owner. When the position cannot be read in the owner budget the
    /// search goes on as before: the owner read is bounded by that budget.
    /// Also called before the wait for a `target` past the WAL the copy
    /// has heard of (`reached`).
    async fn refuse_if_owner_lacks(&self, target: Position) -> Result<(), SearchError> {
        let began = Instant::now();
        let deadline = tokio::time::Instant::now() + self.owner_budget;
        let Ok(owner) = self.confirmer.position(began, deadline).await else {
            return Ok(());
        };
        let ahead = match (target.timeline, owner.timeline) {
            (Some(asked), Some(at)) if asked != at => asked > at,
            _ => target.lsn > owner.lsn,
        };
        if ahead {
            return Err(SearchError::MinLsnAhead {
                asked: target,
                owner,
            });
        }
        Ok(())
    }

    /// Answers `req`. With `lagging`, the copy is too far behind to trust
    /// and the caller chose to read the owner instead of refusing.
    pub async fn search(
        &self,
        req: &SearchRequest,
        lagging: bool,
    ) -> Result<SearchAnswer, SearchError> {
        let asked_at = Instant::now();
        let caught_up = self.reached(req.min_lsn).await?;
        if let Some(target) = req.min_lsn.filter(|_| caught_up) {
            // The candidates come from the index: a hotel the guest's write
            // created or moved must be in it too. Past the wait, the
            // answer goes out with what the index holds.
            let left = self.min_lsn_wait.saturating_sub(asked_at.elapsed());
            self.index.wait_synced(target.lsn, left).await;
        }
        let candidates = self.index.candidates(&crate::index::CandidateQuery {
            place: req.place.clone(),
            stars_min: req.stars_min,
            amenities: req.amenities.clone(),
        })?;
        let reason = owner_read_reason(lagging, caught_up);
        let bypassed = self.bypassed(candidates.iter().map(|(id, _)| *id));
        // Read right before the copy is, so nothing the copy could hold is
        // missing from the owner's side of the bracket.
        let position_before = self.owner_position().await;
        let (copied, position, reason) = self.copy_out(&candidates, req, reason, &bypassed);
        let lsn = position.lsn;
        let ranked = match copied {
            Copied::Ranked(ranked) => ranked,
            Copied::Unranked(hotels) => {
                self.read_owner_then_rank(hotels, req, reason, &bypassed, asked_at)
                    .await
            }
        };
        let mut fresh = FreshBudget::default();
        let mut page = self
            .fill_page(ranked.from_offset, req, asked_at, position, &mut fresh)
            .await;
        // After the last read that can change what the page shows.
        let owner_position = match position_before {
            Some(before) => self
                .owner_position()
                .await
                .map(|after| OwnerPosition { before, after }),
            None => None,
        };
        self.fill_names(&mut page.results);
        // Only a position some room type shown was read at.
        let confirmed = fresh.confirmed.map(|at| at.lsn).filter(|_| {
            page.results
                .iter()
                .flat_map(|h| &h.room_types)
                .any(|o| o.source == Source::Confirmed)
        });
        let quotes = QuoteContext {
            stay: req.stay,
            lsn,
            confirmed,
            shown_at: Utc::now(),
            lag_ms: self.model.freshness.lag_ms(Utc::now()),
        };
        self.sign_quotes(&mut page.results, &quotes);
        // The copy's count, less the hotels the owner's numbers ruled out here.
        let total_hotels = ranked.total - page.ruled_out;
        Ok(SearchAnswer {
            lsn,
            position: position.to_string(),
            lag_ms: quotes.lag_ms,
            stale: self.model.freshness.is_replacing(),
            confirmed_lsn: confirmed,
            total_hotels,
            next_cursor: (page.next < total_hotels).then(|| Cursor::encode(req, page.next)),
            results: page.results,
            owner_position,
        })
    }

    /// The owner's flushed position when the lab setting asks for it; `None`
    /// when it does not or the read failed (the answer goes out unstamped
    /// rather than failing: the stamp is for judging, not for the guest).
    async fn owner_position(&self) -> Option<Lsn> {
        if !self.stamp_owner_position {
            return None;
        }
        self.owner.flushed_position().await.ok()
    }

    /// What the answer needs of the candidates, copied out of the read model
    /// from one published copy, and the LSN the copy stood at. When the copy is
    /// trusted for every candidate (the common case), every candidate is
    /// ranked straight from the calendars, and only the hotels a page may
    /// show are copied out. Otherwise the candidates are copied out whole,
    /// to be read from the owner, then ranked.
    ///
    /// Returns the reason to read the owner for this copy: `MinLsn` when
    /// it does not hold the request's `min_lsn` after all (`holds`).
    fn copy_out(
        &self,
        candidates: &[(i64, f32)],
        req: &SearchRequest,
        reason: Reason,
        bypassed: &HashSet<i64>,
    ) -> (Copied, Position, Reason) {
        let t = self.copy();
        let copied = Position::new(t.timeline, t.applied);
        let reason = if reason == Reason::FewUnits && !holds(copied, req.min_lsn) {
            Reason::MinLsn
        } else {
            reason
        };
        let located = locate(&t, candidates, req);
        let trusted = reason == Reason::FewUnits && bypassed.is_empty();
        let copied = if trusted {
            Copied::Ranked(rank_in_copy_for_page(&t, &located, req))
        } else {
            Copied::Unranked(copy_whole(&t, located, req, reason, bypassed))
        };
        (copied, Position::new(t.timeline, t.applied), reason)
    }

    /// The copy cannot be trusted for this answer (or for these hotels):
    /// reads them from the owner before matching, since the copy may be
    /// wrong either way, then ranks those that match.
    async fn read_owner_then_rank(
        &self,
        mut hotels: Vec<HotelNights>,
        req: &SearchRequest,
        reason: Reason,
        bypassed: &HashSet<i64>,
        asked_at: Instant,
    ) -> Ranked {
        self.read_owner_where_needed(&mut hotels, req.stay, reason, bypassed, asked_at)
            .await;
        let mut matched: Vec<(Rank, HotelNights)> = hotels
            .into_iter()
            .filter_map(|h| Some((self.rank(&h, &req.rooms, req.max_price_cents)?, h)))
            .collect();
        // Unstable is enough: `order` breaks every tie by hotel id.
        matched.sort_unstable_by(|a, b| order(&a.0, &b.0, req.sort));
        Ranked {
            total: matched.len(),
            from_offset: matched.into_iter().skip(req.offset).collect(),
        }
    }

    /// The page, filled in rounds from the matched hotels past the offset.
    /// Few units left: only the hotels about to be shown are read from the
    /// owner, one query for the page. A hotel the owner's numbers rule out
    /// gives its place to the next one, so a page is full when it can be;
    /// the cursor points past the hotels shown (see `Page::next`).
    async fn fill_page(
        &self,
        from_offset: Vec<(Rank, HotelNights)>,
        req: &SearchRequest,
        asked_at: Instant,
        copied: Position,
        fresh: &mut FreshBudget,
    ) -> Page {
        let mut results: Vec<HotelResult> = Vec::with_capacity(req.limit);
        let mut rest = from_offset.into_iter();
        let mut next = req.offset;
        let mut ruled_out = 0;
        for _round in 0..MAX_PAGE_ROUNDS {
            let want = req.limit.saturating_sub(results.len());
            if want == 0 {
                break;
            }
            let mut taken: Vec<HotelNights> = rest.by_ref().take(want).map(|(_, h)| h).collect();
            if taken.is_empty() {
                break;
            }
            next += taken.len();
            self.read_few_units(&mut taken, req, asked_at, copied, fresh)
                .await;
            let before = results.len();
            results.extend(
                taken
                    .iter()
                    .filter_map(|h| self.evaluate(h, &req.rooms, req.max_price_cents)),
            );
            ruled_out += taken.len() - (results.len() - before);
        }
        // Owner numbers may move a hotel within the page.
        results.sort_by(|a, b| order(&a.rank, &b.rank, req.sort));
        debug_assert!(next >= req.offset + ruled_out);
        Page {
            results,
            next: next - ruled_out,
            ruled_out,
        }
    }

    /// Every hotel taken matched in the copy; its shown room types with few
    /// units left are made owner-fresh (`fresh_nights`) before it is built.
    async fn read_few_units(
        &self,
        taken: &mut [HotelNights],
        req: &SearchRequest,
        asked_at: Instant,
        copied: Position,
        fresh: &mut FreshBudget,
    ) {
        let smallest = smallest_room(&req.rooms);
        let few: Vec<CalendarKey> = taken
            .iter()
            .flat_map(|h| h.types.iter())
            .filter(|t| {
                t.source == Source::Copy
                    && shown(t.max_guests, t.offer, smallest, req.max_price_cents)
                        .is_some_and(|(free, _)| few_units(free, req.rooms.len(), self.few_units))
            })
            .map(|t| t.key)
            .collect();
        for read in self
            .fresh_nights(few, req.stay, asked_at, copied, fresh)
            .await
            .into_iter()
            .flatten()
        {
            apply_owner_nights(taken, &read);
        }
    }

    /// Owner-fresh nights for few-unit room types: with `fresh_reads =
    /// "confirmed"`, the copy's once it has applied an owner position taken
    /// after the search began (`confirmed` keeps it for the page's later
    /// rounds, which then need no wait); the owner's rows for hotels the
    /// divergence audit found diverging (a confirmed read trusts the copy),
    /// with `fresh_reads = "rows"`, and as the fallback. Every such read of
    /// one search, over the page's rounds, shares `owner_read_timeout_ms`
    /// (`fresh`); what is not read within it shows the copy's numbers as
    /// `copy_fallback`. `copied` is the copy the hotels were read from.
    async fn fresh_nights(
        &self,
        keys: Vec<CalendarKey>,
        stay: Stay,
        asked_at: Instant,
        copied: Position,
        fresh: &mut FreshBudget,
    ) -> [Option<OwnerNights>; 2] {
        if keys.is_empty() {
            return [None, None];
        }
        let end = fresh.end(self.owner_budget);
        if self.fresh_reads == FreshReads::Rows {
            return [self.owner_nights_by(keys, stay, asked_at, end).await, None];
        }
        let diverging = self.diverging(keys.iter().map(|k| k.hotel_id));
        let (rows, trusted): (Vec<CalendarKey>, Vec<CalendarKey>) = keys
            .into_iter()
            .partition(|k| diverging.contains(&k.hotel_id));
        let (by_rows, by_confirmed) = futures_util::future::join(
            self.owner_nights_by(rows, stay, asked_at, end),
            self.confirmed_nights(trusted, stay, asked_at, copied, fresh),
        )
        .await;
        [by_rows, by_confirmed]
    }

    /// The few-unit rows of `keys` from the owner, by `end`; the keys not
    /// read by then are `Failed` (shown as the copy's, `copy_fallback`).
    async fn owner_nights_by(
        &self,
        keys: Vec<CalendarKey>,
        stay: Stay,
        asked_at: Instant,
        end: tokio::time::Instant,
    ) -> Option<OwnerNights> {
        if keys.is_empty() {
            return None;
        }
        // With almost nothing left a query would be cut before its
        // answer, and its connection dropped with it (`on_a_client`): a
        // healthy connection lost for an answer no search could use.
        if end.saturating_duration_since(tokio::time::Instant::now()) < self.owner_budget / 10 {
            return Some(OwnerNights::failed(keys));
        }
        // Bounded by `end` inside: a read not done by then is `Failed`.
        self.owner_nights(keys, stay, Reason::FewUnits, asked_at, end)
            .await
    }

    /// A confirmed read of `keys` (see `confirm`), falling back to the
    /// owner's rows within what is left of the search's one budget
    /// (`fresh`): the confirmed read may take the first half of what is
    /// left, so a fallback always has the other half. Once a confirmed read
    /// of the search failed, its later rounds go to the rows at once.
    ///
    /// When the copy the hotels were read from (`copied`) is already at or
    /// past the confirmed position, its numbers are the confirmed ones and
    /// are not read again: on an owner that is idle or slow to commit, the
    /// usual case.
    async fn confirmed_nights(
        &self,
        keys: Vec<CalendarKey>,
        stay: Stay,
        asked_at: Instant,
        copied: Position,
        fresh: &mut FreshBudget,
    ) -> Option<OwnerNights> {
        if keys.is_empty() {
            return None;
        }
        let started = tokio::time::Instant::now();
        let budget_end = fresh.end(self.owner_budget);
        let confirm_end = started + budget_end.saturating_duration_since(started) / 2;
        let reached = match (fresh.confirmed, fresh.confirm_failed) {
            (Some(at), _) => Ok(at),
            (None, false) => self.confirm(asked_at, confirm_end).await,
            (None, true) => Err(ConfirmError::FailedBefore),
        };
        // The copy the numbers come from must hold the position, on its
        // timeline: a later round of the page reuses it, and a replica's
        // bootstrap may swap in an older copy at any await. And it must be
        // of the timeline the hotels were ranked from: a failover's new
        // snapshot swapped in since would mix the old copy's ranking (which
        // may hold commits the new primary lost) with the new one's numbers.
        let read = reached.and_then(|at| {
            let t = self.model.read();
            if !self.model.freshness.is_replacing()
                && Position::new(t.timeline, at.lsn) == at
                && copied.timeline == at.timeline
                && t.applied >= at.lsn
            {
                Ok((at, t))
            } else {
                Err(ConfirmError::CopyBehind(at))
            }
        });
        match read {
            Ok((at, t)) => {
                fresh.confirmed = Some(at);
                metrics::CONFIRMED_READS.inc();
                if copied.lsn >= at.lsn && copied == Position::new(t.timeline, copied.lsn) {
                    let mut keys = keys;
                    keys.sort_unstable();
                    Some(OwnerNights::ConfirmedAsCopied(keys))
                } else {
                    Some(OwnerNights::Confirmed(Arc::new(Self::copy_nights(
                        &t, &keys, stay,
                    ))))
                }
            }
            Err(e) => {
                fresh.confirm_failed = true;
                metrics::CONFIRMED_READ_FALLBACKS
                    .with_label_values(&[e.cause()])
                    .inc();
                tracing::debug!(error = %e, "confirmed read fell back to owner rows");
                self.owner_nights_by(keys, stay, asked_at, budget_end).await
            }
        }
    }

    /// An owner position taken after `asked_at`, once the copy has applied
    /// it, by `deadline`; the wait is observed from the start of the
    /// position read to the copy reaching it.
    async fn confirm(
        &self,
        asked_at: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Position, ConfirmError> {
        let started = Instant::now();
        // A copy being replaced applies nothing until the new one is in
        // (a failover's snapshot, a replica's bootstrap): waiting for it
        // would spend the confirm half of the budget for nothing, and leave
        // the fallback only the rest.
        if self.model.freshness.is_replacing() {
            return Err(ConfirmError::OtherTimeline);
        }
        let owner_position = self.confirmer.position(asked_at, deadline).await?;
        let at = owner_position.lsn;
        // Checked before the wait too: a position of another timeline than
        // the copy's is never reached by it.
        self.on_the_copys_timeline(owner_position)?;
        let read_at = Instant::now();
        let prompt = deadline.min(tokio::time::Instant::now() + confirm::NUDGE_AFTER);
        let freshness = &self.model.freshness;
        if freshness
            .wait_applied(at, confirm::left(prompt))
            .await
            .is_none()
        {
            // Slow to come: WAL unflushed past the last commit, or a held
            // in-progress transaction. A nudge's commit ends past `at` and
            // flushes it; a node that may not write waits for the stream.
            // The copy is watched while the nudge is out: the stream often
            // carries it past `at` before the nudge's answer comes back, and
            // a slow nudge round must not hold an answer already there.
            metrics::CONFIRMED_READ_NUDGED.inc();
            let applied = freshness.wait_applied(at, confirm::left(deadline));
            tokio::pin!(applied);
            let reached = tokio::select! {
                biased;
                reached = &mut applied => reached,
                _ = self.confirmer.nudge(read_at, deadline) => applied.await,
            };
            reached.ok_or(ConfirmError::ApplyTimeout(at))?;
        }
        // Checked after the wait as well, which may span a failover's
        // session: an LSN of the new owner's timeline says nothing of an
        // old copy.
        let copy_timeline = self.on_the_copys_timeline(owner_position)?;
        metrics::CONFIRMED_READ_WAIT.observe(started.elapsed().as_secs_f64());
        Ok(Position::new(copy_timeline, at))
    }

    /// The copy's timeline, when neither a replacement nor the owner's
    /// position says the copy is of another one. The position's own
    /// timeline is what the owner said as it read it; the pin is the
    /// stream's (a replica has none).
    fn on_the_copys_timeline(&self, owner_position: Position) -> Result<u32, ConfirmError> {
        let copy_timeline = self.model.read().timeline;
        let other =
            |owner: Option<u32>| owner.is_some_and(|t| copy_timeline != 0 && t != copy_timeline);
        if self.model.freshness.is_replacing()
            || other(owner_position.timeline)
            || other(self.confirmer.timeline())
        {
            return Err(ConfirmError::OtherTimeline);
        }
        Ok(copy_timeline)
    }

    /// The stay's nights of `keys` from one published copy, `t`.
    fn copy_nights(t: &Tables, keys: &[CalendarKey], stay: Stay) -> OwnerCalendars {
        let mut sorted = keys.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let rows: Vec<(CalendarKey, NaiveDate, NightCounts)> = sorted
            .iter()
            .filter_map(|k| Some((*k, t.calendars.get(k)?)))
            .flat_map(|(k, c)| {
                stay.nights()
                    .filter_map(move |night| Some((k, night, c.get(night)?)))
            })
            .collect();
        OwnerCalendars::new(&sorted, stay, Instant::now(), rows.into_iter())
    }

    /// The hotels among `hotel_ids` the divergence audit found diverging.
    fn diverging(&self, hotel_ids: impl Iterator<Item = i64>) -> HashSet<i64> {
        match &self.stale {
            Some(s) => s.audit.diverging_hotels(hotel_ids),
            None => Default::default(),
        }
    }

    /// Signs the quote of every room type shown. Only the page shown is
    /// quoted: signing costs about a microsecond per room type, and a broad
    /// search can match thousands.
    fn sign_quotes(&self, results: &mut [HotelResult], quotes: &QuoteContext) {
        for h in results {
            for o in &mut h.room_types {
                let key = CalendarKey {
                    hotel_id: h.hotel_id,
                    room_type_id: o.room_type_id,
                };
                o.quote = quotes.sign(&self.quotes, key, o.free_units, o.source);
            }
        }
    }

    /// Names of the hotels and room types shown, read once the page is
    /// known (attributes, not counts: a rename between the two reads shows
    /// the newer name).
    fn fill_names(&self, page: &mut [HotelResult]) {
        let t = self.copy();
        for h in page {
            if let Some(hotel) = t.hotels.get(&h.hotel_id) {
                h.name.clone_from(&hotel.name);
                h.city.clone_from(&hotel.city);
            }
            // Both are sorted by room type id, so one walk pairs them; the
            // keyed lookup is there should an order ever differ.
            let mut names = t.room_types.of_hotel(h.hotel_id).iter().peekable();
            for o in &mut h.room_types {
                while names.next_if(|rt| rt.id < o.room_type_id).is_some() {}
                let key = CalendarKey {
                    hotel_id: h.hotel_id,
                    room_type_id: o.room_type_id,
                };
                let found = names
                    .next_if(|rt| rt.id == o.room_type_id)
                    .or_else(|| t.room_types.get(&key));
                if let Some(rt) = found {
                    o.name.clone_from(&rt.name);
                }
            }
        }
    }

    /// Replaces with the owner's rows, before matching, the room types the
    /// copy cannot be trusted for: every one (the copy missed `min_lsn`, or
    /// lags past the bound), or those of the hotels in `bypassed` (the
    /// stale-read policy, reason `bypass`), in two queries run side by side.
    /// Few-units reads happen later, for the page only.
    async fn read_owner_where_needed(
        &self,
        hotels: &mut [HotelNights],
        stay: Stay,
        reason: Reason,
        bypassed: &HashSet<i64>,
        asked_at: Instant,
    ) {
        let everything = reason != Reason::FewUnits;
        let mut wanted = Vec::new();
        let mut bypass = Vec::new();
        for h in hotels.iter() {
            let keys = h.types.iter().map(|t| t.key);
            if everything {
                wanted.extend(keys);
            } else if bypassed.contains(&h.hotel_id) {
                bypass.extend(keys);
            }
        }
        let end = tokio::time::Instant::now() + self.owner_budget;
        let (all, flagged) = futures_util::future::join(
            self.owner_nights(wanted, stay, reason, asked_at, end),
            self.owner_nights(bypass, stay, Reason::Bypass, asked_at, end),
        )
        .await;
        for read in [all, flagged].into_iter().flatten() {
            apply_owner_nights(hotels, &read);
        }
    }

    /// Reads `keys` from the owner by `deadline`; `None` when there is
    /// nothing to read. `asked_at` is when the search began.
    async fn owner_nights(
        &self,
        keys: Vec<CalendarKey>,
        stay: Stay,
        reason: Reason,
        asked_at: Instant,
        deadline: tokio::time::Instant,
    ) -> Option<OwnerNights> {
        if keys.is_empty() {
            return None;
        }
        // Only a read sent after this search began: one sent before may
        // miss a write the guest waits for (`min_lsn`), or a take that
        // committed meanwhile. Shown as `owner`, such a read claimed a
        // freshness it did not have, and a 409 after it counted as a race
        // no read could have avoided, hiding the hotel from the bypass
        // policy. Searches that begin together still share one read.
        let not_before = Some(asked_at);
        Some(
            match self
                .owner
                .read(&keys, stay, reason, not_before, deadline)
                .await
            {
                Ok(read) => OwnerNights::Read(read),
                Err(_) => OwnerNights::failed(keys),
            },
        )
    }

    /// Where the hotel sorts, when the party can be placed in its offered
    /// room types; `None` when it cannot.
    fn rank(&self, h: &HotelNights, rooms: &[i16], max_price: Option<i64>) -> Option<Rank> {
        let types = h
            .types
            .iter()
            .map(|t| (t.key.room_type_id, t.max_guests, t.offer));
        let mut shown_types = Vec::with_capacity(h.types.len());
        rank_of(
            h.hotel_id,
            h.stars,
            h.score,
            types,
            rooms,
            max_price,
            &mut shown_types,
        )
    }

    /// The hotel with its offered room types, when the party can be placed
    /// (exactly when `rank` says so). Quotes and names are left empty; the
    /// caller fills those it shows.
    fn evaluate(
        &self,
        h: &HotelNights,
        rooms: &[i16],
        max_price: Option<i64>,
    ) -> Option<HotelResult> {
        let rank = self.rank(h, rooms, max_price)?;
        let smallest = smallest_room(rooms);
        let mut offers: Vec<RoomOffer> = Vec::with_capacity(h.types.len());
        offers.extend(h.types.iter().filter_map(|t| {
            let (free, price) = shown(t.max_guests, t.offer, smallest, max_price)?;
            Some(RoomOffer {
                room_type_id: t.key.room_type_id,
                name: String::new(),
                max_guests: t.max_guests,
                free_units: free,
                price_cents: price,
                low_availability: free <= self.few_units,
                source: t.source,
                quote: Token::default(),
            })
        }));
        Some(HotelResult {
            hotel_id: h.hotel_id,
            name: String::new(),
            city: String::new(),
            stars: h.stars,
            price_cents: rank.price_cents,
            room_types: offers,
            rank,
        })
    }

    /// Every room type of one hotel over the stay, night by night.
    pub async fn availability(
        &self,
        hotel_id: i64,
        req: &AvailabilityRequest,
        lagging: bool,
    ) -> Result<Availability, SearchError> {
        let asked_at = Instant::now();
        let caught_up = self.reached(req.min_lsn).await?;
        let (mut hotel, lsn) = {
            let t = self.copy();
            let hotel = t
                .hotels
                .get(&hotel_id)
                .ok_or(SearchError::HotelNotFound(hotel_id))?;
            let h = read_hotel(&t, hotel, 1.0, req.stay, i16::MIN, false, &mut Vec::new());
            (h, Position::new(t.timeline, t.applied))
        };
        let position = lsn;
        let lsn = position.lsn;
        let reason = owner_read_reason(lagging, caught_up && holds(position, req.min_lsn));
        let bypassed = self.bypassed(std::iter::once(hotel_id));
        let mut fresh = FreshBudget::default();
        if reason == Reason::FewUnits && !bypassed.contains(&hotel_id) {
            let few: Vec<CalendarKey> = hotel
                .types
                .iter()
                .filter(|t| {
                    t.offer
                        .is_some_and(|(free, _)| few_units(free, req.rooms.len(), self.few_units))
                })
                .map(|t| t.key)
                .collect();
            for read in self
                .fresh_nights(few, req.stay, asked_at, position, &mut fresh)
                .await
                .into_iter()
                .flatten()
            {
                apply_owner_nights(std::slice::from_mut(&mut hotel), &read);
            }
        } else {
            self.read_owner_where_needed(
                std::slice::from_mut(&mut hotel),
                req.stay,
                reason,
                &bypassed,
                asked_at,
            )
            .await;
        }
        let names: HashMap<i64, String> = {
            let t = self.copy();
            t.room_types_of(hotel_id)
                .map(|rt| (rt.id, rt.name.clone()))
                .collect()
        };
        let confirmed = fresh
            .confirmed
            .map(|at| at.lsn)
            .filter(|_| hotel.types.iter().any(|t| t.source == Source::Confirmed));
        let quotes = QuoteContext {
            stay: req.stay,
            lsn,
            confirmed,
            shown_at: Utc::now(),
            lag_ms: self.model.freshness.lag_ms(Utc::now()),
        };
        let smallest = smallest_room(&req.rooms);
        let hotel_fits = self.evaluate(&hotel, &req.rooms, None).is_some();
        let room_types = hotel
            .types
            .iter()
            .map(|t| {
                let offered = t.offer;
                let free_units = offered.map_or(0, |(f, _)| f);
                RoomAvailability {
                    room_type_id: t.key.room_type_id,
                    name: names.get(&t.key.room_type_id).cloned().unwrap_or_default(),
                    max_guests: t.max_guests,
                    nights: req
                        .stay
                        .nights()
                        .zip(&t.nights)
                        .map(|(night, c)| NightAvailability {
                            night,
                            free_units: c.map(|c| c.free()),
                            price_cents: c.and_then(|c| c.price_cents),
                        })
                        .collect(),
                    free_units,
                    price_cents: offered.and_then(|(_, p)| p),
                    fits: offered.is_some() && t.max_guests >= smallest,
                    low_availability: offered.is_some_and(|(f, _)| f <= self.few_units),
                    source: t.source,
                    quote: quotes.sign(&self.quotes, t.key, free_units, t.source),
                }
            })
            .collect();
        Ok(Availability {
            hotel_id,
            lsn,
            position: position.to_string(),
            lag_ms: quotes.lag_ms,
            stale: self.model.freshness.is_replacing(),
            confirmed_lsn: confirmed,
            hotel_fits,
            room_types,
        })
    }
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Availability {
    pub hotel_id: i64,
    #[schema(value_type = String, example = "0/16B3748")]
    pub lsn: Lsn,
    /// As in a search answer: `lsn` with its owner timeline, for `min_lsn`.
    #[schema(example = "1/0/16B3748")]
    pub position: String,
    pub lag_ms: u64,
    /// As in a search answer.
    pub stale: bool,
    /// As in a search answer: the owner position the `confirmed` room types
    /// were read at or past; null when none is `confirmed`.
    #[schema(value_type = Option<String>, example = "0/16B37A0")]
    pub confirmed_lsn: Option<Lsn>,
    /// Every requested room can be placed on every night.
    pub hotel_fits: bool,
    pub room_types: Vec<RoomAvailability>,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RoomAvailability {
    pub room_type_id: i64,
    pub name: String,
    pub max_guests: i16,
    pub nights: Vec<NightAvailability>,
    pub free_units: i32,
    pub price_cents: Option<i64>,
    /// Free on every night and big enough for the smallest requested room.
    pub fits: bool,
    pub low_availability: bool,
    pub source: Source,
    /// Opaque: send it back with the take's outcome (`POST /v1/take-outcomes`).
    #[schema(value_type = String)]
    pub quote: Token,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct NightAvailability {
    pub night: NaiveDate,
    /// Null when the owner has no row for this night (not on sale).
    pub free_units: Option<i32>,
    pub price_cents: Option<i32>,
}

/// What one search's owner-fresh reads share across the page's rounds.
#[derive(Debug, Default)]
struct FreshBudget {
    /// When they must be done: `owner_read_timeout_ms` after the first.
    end: Option<tokio::time::Instant>,
    /// The position a round confirmed: later rounds need no wait.
    confirmed: Option<Position>,
    /// A confirmed read failed: later rounds read the rows at once, in
    /// what is left of the budget, rather than wait for the copy again.
    confirm_failed: bool,
}

impl FreshBudget {
    /// When the search's owner-fresh reads must be done, set by the first.
    fn end(&mut self, budget: Duration) -> tokio::time::Instant {
        *self
            .end
            .get_or_insert_with(|| tokio::time::Instant::now() + budget)
    }
}

/// Puts the owner's rows (or the confirmed copy's) over the copy's for the
/// calendars read; when the read failed, flags them as showing the copy's
/// numbers instead.
fn apply_owner_nights(hotels: &mut [HotelNights], read: &OwnerNights) {
    for t in hotels.iter_mut().flat_map(|h| h.types.iter_mut()) {
        match read {
            OwnerNights::Read(calendars) | OwnerNights::Confirmed(calendars) => {
                if let Some(nights) = calendars.nights(&t.key) {
                    // Nights are copied only where the caller kept the copy's
                    // (availability, and answers read whole from the owner);
                    // a page's few-unit room types need only the offer, and
                    // a copy each was an allocation per room type read.
                    if !t.nights.is_empty() {
                        t.nights = nights.to_vec();
                    }
                    t.offer = offer(nights);
                    t.source = match read {
                        OwnerNights::Confirmed(_) => Source::Confirmed,
                        _ => Source::Owner,
                    };
                }
            }
            OwnerNights::ConfirmedAsCopied(keys) => {
                if keys.binary_search(&t.key).is_ok() {
                    t.source = Source::Confirmed;
                }
            }
            OwnerNights::Failed(keys) => {
                if keys.binary_search(&t.key).is_ok() {
                    t.source = Source::CopyFallback;
                }
            }
        }
    }
}

/// What was copied out of the read model under its lock.
enum Copied {
    /// Every candidate was ranked in the copy.
    Ranked(Ranked),
    /// The candidates, to be read from the owner before they are ranked.
    Unranked(Vec<HotelNights>),
}

/// The hotels that match, in the answer's order.
struct Ranked {
    /// How many match.
    total: usize,
    /// Those from the request's offset on (when ranked in the copy, only
    /// as many as the page may show).
    from_offset: Vec<(Rank, HotelNights)>,
}

/// One page of an answer.
struct Page {
    /// The hotels shown, in the answer's order.
    results: Vec<HotelResult>,
    /// Where the next page starts: past the hotels looked at, less those
    /// the owner's numbers ruled out. Those numbers are newer than the
    /// ranking's copy, and the next page's ranking, from a copy at least as
    /// new, leaves a ruled-out hotel out too: counted, the next page began
    /// one hotel further on for each, and skipped as many. When the copy
    /// still shows one (a row read ahead of a lagging copy), the next page
    /// repeats the last hotel shown instead, which hides nothing.
    next: usize,
    /// Hotels the owner's numbers ruled out while the page was filled.
    ruled_out: usize,
}

/// Why an answer reads the owner: the copy lags past the bound, missed
/// `min_lsn`, or (otherwise) only for room types with few units left.
/// Whether a room type showing `free` units is too close to selling out
/// to show from the copy for a party of `rooms` rooms: fewer than the
/// rooms plus the threshold, the margin `/v1/bypass` gives the booking
/// service (`stale::bypass`). A type showing 4 free to a party of three
/// rooms, shown from the copy, was two sales from a 409 counted against
/// the copy, while bypass already said `few_units`. One room: `free <=
/// threshold`, as before. A threshold of 0 reads nothing (copy only).
fn few_units(free: i32, rooms: usize, threshold: i32) -> bool {
    threshold > 0
        && i64::from(free)
            < i64::try_from(rooms)
                .unwrap_or(i64::MAX)
                .saturating_add(i64::from(threshold))
}

/// Whether a copy read at `copied` holds `min_lsn`. `reached` waited for
/// the copy first, but a replica's bootstrap or a resnapshot may swap in
/// one below the target before the copy is read: answered from it as
/// caught up, the guest's own write was missing with nothing read from the
/// owner. A target of unknown timeline, or a copy of unknown timeline,
/// compares LSNs alone, as `reached` does.
fn holds(copied: Position, min_lsn: Option<Position>) -> bool {
    min_lsn.is_none_or(|target| {
        let same_timeline = match (target.timeline, copied.timeline) {
            (Some(asked), Some(copy)) => asked == copy,
            _ => true,
        };
        same_timeline && copied.lsn >= target.lsn
    })
}

fn owner_read_reason(lagging: bool, caught_up: bool) -> Reason {
    if lagging {
        Reason::Bypass
    } else if caught_up {
        Reason::FewUnits
    } else {
        Reason::MinLsn
    }
}

/// Guests in the smallest room asked for (1 when none is; a checked
/// request always asks for one).
fn smallest_room(rooms: &[i16]) -> i16 {
    rooms.iter().copied().min().unwrap_or(1)
}

/// The candidates the copy has that still match `req`, with their scores.
fn locate<'t>(
    t: &'t Tables,
    candidates: &[(i64, f32)],
    req: &SearchRequest,
) -> Vec<(&'t Hotel, f32)> {
    // Sized up front: grown one push at a time, this vector and those of
    // `rank_in_copy_for_page` cost a twentieth of a search in reallocation
    // and copying.
    let mut located = Vec::with_capacity(candidates.len());
    // Every candidate looked up first, then matched: a loop that does one
    // thing per hotel lets the cache misses of many hotels overlap (the map's
    // slot here, the city's bytes in the match), where doing both per
    // hotel waited for each hotel's misses in turn.
    located.extend(
        candidates
            .iter()
            .filter_map(|(id, score)| Some((t.hotels.get(id)?, *score))),
    );
    located.retain(|(hotel, _)| still_matches(hotel, req));
    located
}

/// Every located hotel ranked straight from the copy's calendars; only the
/// hotels from the request's offset on that the page may show are copied out.
fn rank_in_copy_for_page(t: &Tables, located: &[(&Hotel, f32)], req: &SearchRequest) -> Ranked {
    let mut folded = Vec::new();
    let mut shown_types = Vec::with_capacity(located.len() * SHOWN_TYPES_PER_HOTEL);
    let mut ranked: Vec<(Rank, std::ops::Range<usize>)> = Vec::with_capacity(located.len());
    // Most of ranking's time was waiting on memory, one hotel after the
    // other: its block, its rows, its room types. So every hotel's block
    // and room types are looked up first, then what ranking will read of
    // them is touched, then the hotels are ranked: each step is a loop of
    // loads that do not depend on one another, whose misses overlap.
    let mut found = Vec::with_capacity(located.len());
    found.extend(located.iter().map(|&(hotel, score)| {
        let calendars = t.calendars.hotel(hotel.id);
        (
            hotel,
            score,
            calendars,
            t.room_types.beds_of_hotel(hotel.id),
        )
    }));
    let nights = req.stay.len() as usize;
    let touched = HotelCalendars::touch_stays(
        found.iter().filter_map(|(_, _, calendars, _)| *calendars),
        req.stay.check_in,
        nights,
    );
    let touched = found.iter().fold(touched, |sum, (_, _, _, room_types)| {
        room_types
            .iter()
            .fold(sum, |s, rt| s.wrapping_add(rt.max_guests as u32))
    });
    // Keeps the touching loads from being optimised away.
    std::hint::black_box(touched);
    ranked.extend(
        found
            .into_iter()
            .filter_map(|(hotel, score, calendars, room_types)| {
                let start = shown_types.len();
                let rank = rank_in_copy(
                    hotel,
                    score,
                    calendars,
                    room_types,
                    req,
                    &mut folded,
                    &mut shown_types,
                )?;
                Some((rank, start..shown_types.len()))
            }),
    );
    // Unstable is enough: `order` breaks every tie by hotel id, and a
    // hotel is ranked once, so no two entries compare equal.
    ranked.sort_unstable_by(|a, b| order(&a.0, &b.0, req.sort));
    // Each round of the page takes at most `limit` hotels.
    let from_offset = ranked
        .iter()
        .skip(req.offset)
        .take(req.limit * MAX_PAGE_ROUNDS)
        .map(|(rank, types)| {
            let h = HotelNights {
                hotel_id: rank.hotel_id,
                stars: rank.stars,
                score: rank.score,
                types: shown_types[types.clone()]
                    .iter()
                    .map(|st| st.nights(rank.hotel_id))
                    .collect(),
            };
            (*rank, h)
        })
        .collect();
    Ranked {
        total: ranked.len(),
        from_offset,
    }
}

/// Every located hotel's room types copied out whole, night by night, to be
/// read from the owner before they are ranked. Room types too small for
/// every room are never shown; with few units the only reason to read the
/// owner, a hotel not bypassed keeps only the room types the copy offers.
fn copy_whole(
    t: &Tables,
    located: Vec<(&Hotel, f32)>,
    req: &SearchRequest,
    reason: Reason,
    bypassed: &HashSet<i64>,
) -> Vec<HotelNights> {
    let smallest = smallest_room(&req.rooms);
    let mut folded = Vec::new();
    located
        .into_iter()
        .map(|(hotel, score)| {
            let offered_only = reason == Reason::FewUnits && !bypassed.contains(&hotel.id);
            read_hotel(
                t,
                hotel,
                score,
                req.stay,
                smallest,
                offered_only,
                &mut folded,
            )
        })
        .collect()
}

/// A room type that may be shown (see `shown`), as ranking found it.
#[derive(Debug, Clone, Copy)]
struct ShownType {
    room_type_id: i64,
    price: Option<i64>,
    free: i32,
    max_guests: i16,
}

impl ShownType {
    fn nights(&self, hotel_id: i64) -> TypeNights {
        TypeNights {
            key: CalendarKey {
                hotel_id,
                room_type_id: self.room_type_id,
            },
            max_guests: self.max_guests,
            offer: Some((self.free, self.price)),
            nights: Vec::new(),
            source: Source::Copy,
        }
    }
}

/// Where a hotel sorts, from its room types as `(room type id, max_guests,
/// offer)`; `None` when the party cannot be placed in the ones that may be
/// shown. Those are appended to `shown_types` (and taken back off when the
/// hotel does not match), so ranking a city's hotels fills one vector
/// instead of allocating per hotel.
fn rank_of(
    hotel_id: i64,
    stars: Option<i16>,
    score: f32,
    types: impl Iterator<Item = (i64, i16, Option<(i32, Option<i64>)>)>,
    rooms: &[i16],
    max_price: Option<i64>,
    shown_types: &mut Vec<ShownType>,
) -> Option<Rank> {
    let smallest = smallest_room(rooms);
    let mut rank = Rank {
        hotel_id,
        stars,
        price_cents: None,
        free_units: 0,
        score,
    };
    let start = shown_types.len();
    for (room_type_id, max_guests, offer) in types {
        let Some((free, price)) = shown(max_guests, offer, smallest, max_price) else {
            continue;
        };
        shown_types.push(ShownType {
            room_type_id,
            price,
            free,
            max_guests,
        });
        rank.free_units += i64::from(free);
        rank.price_cents = match (rank.price_cents, price) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    let these = &shown_types[start..];
    let fits = placeable_by(rooms, |g| {
        these
            .iter()
            .filter(|t| t.max_guests >= g)
            .map(|t| i64::from(t.free))
            .sum()
    });
    if these.is_empty() || !fits {
        shown_types.truncate(start);
        return None;
    }
    Some(rank)
}

/// A room type's offer when it may be shown: enough beds for the smallest
/// room, free on every night, and within `max_price` for the stay.
fn shown(
    max_guests: i16,
    offer: Option<(i32, Option<i64>)>,
    smallest: i16,
    max_price: Option<i64>,
) -> Option<(i32, Option<i64>)> {
    let (free, price) = offer?;
    let too_dear = max_price.is_some_and(|m| price.is_none_or(|p| p > m));
    (max_guests >= smallest && !too_dear).then_some((free, price))
}

/// Folds the stay over the hotel's block into `folded` (one accumulator
/// per column); returns the block and its columns' room type ids.
fn fold_hotel<'t>(
    t: &'t Tables,
    hotel_id: i64,
    stay: Stay,
    folded: &mut Vec<StayOffer>,
) -> (Option<HotelCalendars<'t>>, &'t [i64]) {
    let calendars = t.calendars.hotel(hotel_id);
    (calendars, fold_calendars(calendars, stay, folded))
}

/// `fold_hotel` over a block already looked up; returns its columns' room
/// type ids (none without a block).
fn fold_calendars<'t>(
    calendars: Option<HotelCalendars<'t>>,
    stay: Stay,
    folded: &mut Vec<StayOffer>,
) -> &'t [i64] {
    folded.clear();
    match calendars {
        Some(c) => {
            c.fold_offers_into(stay.check_in, stay.len() as usize, folded);
            c.room_type_ids()
        }
        None => &[],
    }
}

/// The room types with at least `min_guests` beds, each with its offer over
/// the folded stay. Room types and the block's columns are both sorted by
/// id, so one forward walk pairs them (a room type without nights has no
/// column, and no offer).
fn with_offers<'a>(
    room_types: &'a [Beds],
    columns: &'a [i64],
    folded: &'a [StayOffer],
    min_guests: i16,
) -> impl Iterator<Item = (&'a Beds, Option<(i32, Option<i64>)>)> + Clone + 'a {
    let mut col = 0;
    room_types.iter().filter_map(move |rt| {
        while columns.get(col).is_some_and(|&id| id < rt.id) {
            col += 1;
        }
        if rt.max_guests < min_guests {
            return None;
        }
        let offer = if columns.get(col) == Some(&rt.id) {
            folded[col].offer()
        } else {
            None
        };
        Some((rt, offer))
    })
}

/// Where `hotel` sorts for `req`, straight from its block of the copy's
/// calendars and its room types; `None` when the copy shows no way to place
/// the party. `folded` is scratch space; the room types that may be shown
/// go on `shown_types`.
fn rank_in_copy(
    hotel: &Hotel,
    score: f32,
    calendars: Option<HotelCalendars<'_>>,
    room_types: &[Beds],
    req: &SearchRequest,
    folded: &mut Vec<StayOffer>,
    shown_types: &mut Vec<ShownType>,
) -> Option<Rank> {
    let smallest = smallest_room(&req.rooms);
    let columns = fold_calendars(calendars, req.stay, folded);
    let types =
        with_offers(room_types, columns, folded, smallest).map(|(rt, o)| (rt.id, rt.max_guests, o));
    rank_of(
        hotel.id,
        hotel.stars,
        score,
        types,
        &req.rooms,
        req.max_price_cents,
        shown_types,
    )
}

/// One hotel's room types over the stay, from the copy: those with at
/// least `min_guests` beds, and with `offered_only` only those the copy
/// shows free on every night (the rest are never shown). `folded` is
/// scratch space, kept by the caller across hotels.
fn read_hotel(
    t: &Tables,
    hotel: &Hotel,
    score: f32,
    stay: Stay,
    min_guests: i16,
    offered_only: bool,
    folded: &mut Vec<StayOffer>,
) -> HotelNights {
    let hotel_id = hotel.id;
    let len = stay.len() as usize;
    let (calendars, columns) = fold_hotel(t, hotel_id, stay, folded);
    let room_types = t.room_types.beds_of_hotel(hotel_id);
    let types = with_offers(room_types, columns, folded, min_guests)
        .filter(|(_, offer)| !offered_only || offer.is_some())
        .map(|(rt, offer)| TypeNights {
            key: CalendarKey {
                hotel_id,
                room_type_id: rt.id,
            },
            max_guests: rt.max_guests,
            offer,
            nights: match calendars.and_then(|c| c.room_type(rt.id)) {
                _ if offered_only => Vec::new(),
                Some(c) => c.stay(stay.check_in, len).collect(),
                None => vec![None; len],
            },
            source: Source::Copy,
        })
        .collect();
    HotelNights {
        hotel_id,
        stars: hotel.stars,
        score,
        types,
    }
}

/// The index may trail the copy by a batch; re-check the structured
/// conditions against the copy itself so an answer never shows a hotel that
/// no longer matches.
fn still_matches(h: &Hotel, req: &SearchRequest) -> bool {
    let place_ok = match &req.place {
        Place::City(c) if h.city.is_ascii() && c.is_ascii() => h.city.eq_ignore_ascii_case(c),
        Place::City(c) => h.city.to_lowercase() == c.to_lowercase(),
        Place::Text(_) => true,
        Place::BBox {
            min_lat,
            min_lon,
            max_lat,
            max_lon,
        } => match (h.latitude, h.longitude) {
            (Some(lat), Some(lon)) => {
                lat >= *min_lat && lat <= *max_lat && lon >= *min_lon && lon <= *max_lon
            }
            _ => false,
        },
        Place::Ids(ids) => ids.contains(&h.id),
    };
    let stars_ok = req.stars_min.is_none_or(|m| h.stars.unwrap_or(0) >= m);
    let amenities_ok = req
        .amenities
        .iter()
        .all(|a| h.amenities.iter().any(|x| x.to_lowercase() == *a));
    place_ok && stars_ok && amenities_ok
}

/// The answer's order; ties broken by hotel id so pages never overlap.
fn order(a: &Rank, b: &Rank, by: Sort) -> std::cmp::Ordering {
    let price = |r: &Rank| (r.price_cents.is_none(), r.price_cents);
    match by {
        Sort::Price => price(a).cmp(&price(b)),
        Sort::Stars => b
            .stars
            .unwrap_or(-1)
            .cmp(&a.stars.unwrap_or(-1))
            .then(price(a).cmp(&price(b))),
        Sort::Availability => b.free_units.cmp(&a.free_units),
        Sort::Relevance => b.score.total_cmp(&a.score),
    }
    .then(a.hotel_id.cmp(&b.hotel_id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn night(total: i32, taken: i32, price: Option<i32>) -> Option<NightCounts> {
        Some(NightCounts {
            total,
            taken,
            sell_limit: None,
            price_cents: price,
        })
    }

    #[test]
    fn few_units_leaves_the_margin_bypass_gives() {
        // One room: at most the threshold.
        assert!(few_units(2, 1, 2));
        assert!(!few_units(3, 1, 2));
        // Three rooms: fewer than three plus the threshold.
        assert!(few_units(4, 3, 2));
        assert!(!few_units(5, 3, 2));
        // A threshold of 0 reads nothing.
        assert!(!few_units(1, 3, 0));
    }

    #[test]
    fn a_copy_holds_a_min_lsn_at_or_below_it_on_its_timeline() {
        let at = |timeline, lsn| Position::new(timeline, Lsn(lsn));
        assert!(holds(at(2, 0x500), None));
        assert!(holds(at(2, 0x500), Some(at(2, 0x500))));
        assert!(
            !holds(at(2, 0x4ff), Some(at(2, 0x500))),
            "a copy swapped in below it"
        );
        assert!(!holds(at(2, 0x900), Some(at(3, 0x500))), "another timeline");
        assert!(holds(at(2, 0x900), Some(at(0, 0x500))), "a bare LSN");
        assert!(!holds(at(0, 0x400), Some(at(3, 0x500))));
    }

    #[test]
    fn offer_takes_the_tightest_night_and_sums_prices() {
        assert_eq!(
            offer(&[night(5, 1, Some(100)), night(5, 3, Some(120))]),
            Some((2, Some(220)))
        );
        assert_eq!(
            offer(&[night(5, 1, Some(100)), night(5, 1, None)]),
            Some((4, None))
        );
        assert_eq!(
            offer(&[night(5, 1, Some(100)), None]),
            None,
            "a missing night is not on sale"
        );
        assert_eq!(offer(&[night(5, 5, Some(100))]), None, "full");
        let over = Some(NightCounts {
            total: 2,
            taken: 2,
            sell_limit: Some(3),
            price_cents: None,
        });
        assert_eq!(offer(&[over]), Some((1, None)), "sell_limit above total");
    }

    #[test]
    fn placement_shares_types_and_respects_beds() {
        assert!(
            placeable(&[2, 2], &[(2, 2)]),
            "two rooms share a type with two free"
        );
        assert!(!placeable(&[2, 2], &[(2, 1)]));
        assert!(!placeable(&[4], &[(2, 9)]), "not enough beds");
        assert!(placeable(&[4, 1], &[(4, 1), (1, 1)]));
        assert!(!placeable(&[4, 4], &[(4, 1), (6, 0), (1, 5)]));
    }

    /// `placeable_by` over a list of (max guests, units free).
    fn placeable(rooms: &[i16], types: &[(i16, i32)]) -> bool {
        placeable_by(rooms, |g| {
            types
                .iter()
                .filter(|(m, _)| *m >= g)
                .map(|(_, f)| i64::from(*f))
                .sum()
        })
    }

    /// Brute force: try every assignment of rooms to types.
    fn brute(rooms: &[i16], types: &[(i16, i32)]) -> bool {
        fn go(rooms: &[i16], left: &mut Vec<i32>, types: &[(i16, i32)]) -> bool {
            let Some((&g, rest)) = rooms.split_first() else {
                return true;
            };
            for (i, (m, _)) in types.iter().enumerate() {
                if *m >= g && left[i] > 0 {
                    left[i] -= 1;
                    if go(rest, left, types) {
                        return true;
                    }
                    left[i] += 1;
                }
            }
            false
        }
        let mut left: Vec<i32> = types.iter().map(|t| t.1).collect();
        go(rooms, &mut left, types)
    }

    proptest! {
        #[test]
        fn placement_agrees_with_brute_force(
            rooms in proptest::collection::vec(1i16..=6, 1..=5),
            types in proptest::collection::vec((1i16..=6, 0i32..=3), 0..=5),
        ) {
            prop_assert_eq!(placeable(&rooms, &types), brute(&rooms, &types));
        }
    }
}

#[cfg(test)]
mod confirmed_tests {
    use super::*;
    use figment::Figment;
    use figment::providers::{Format, Toml};

    /// A page's later round reuses the position its first round confirmed;
    /// if the copy was swapped since for one that does not hold it (a
    /// replica's bootstrap from an older checkpoint), its numbers are not
    /// confirmed. The owner here is unreachable, so the fallback fails.
    #[tokio::test]
    async fn a_confirmed_position_the_copy_no_longer_holds_confirms_nothing() {
        // The shipped defaults, read here without `crate::config` (which
        // depends on this module).
        let defaults = Figment::from(Toml::string(include_str!(
            "../../../../config/default.toml"
        )));
        let mut owner: OwnerSettings = defaults.extract_inner("owner").unwrap();
        let mut settings: SearchSettings = defaults.extract_inner("search").unwrap();
        owner.url = "postgresql://vacancy@127.0.0.1:1/none".into();
        settings.owner_read_timeout_ms = 200;
        let model = ReadModel::new();
        let search = Search::new(
            &owner,
            &settings,
            "public",
            model.clone(),
            HotelIndex::new().unwrap(),
        );
        let key = CalendarKey {
            hotel_id: 1,
            room_type_id: 1,
        };
        let stay = Stay {
            check_in: NaiveDate::from_ymd_opt(2030, 1, 1).unwrap(),
            check_out: NaiveDate::from_ymd_opt(2030, 1, 3).unwrap(),
        };
        let at = Position::new(1, Lsn(100));
        let copy_at = |applied: u64, timeline: u32| {
            model.replace(Tables {
                applied: Lsn(applied),
                timeline,
                ..Tables::default()
            });
        };
        let confirmed_by = |nights: &Option<OwnerNights>| {
            matches!(
                nights,
                Some(OwnerNights::Confirmed(_) | OwnerNights::ConfirmedAsCopied(_))
            )
        };

        // (copy's applied LSN, its timeline, the position its hotels were
        // read at, whether their numbers may be confirmed at 1/100)
        let rounds = [
            (150, 1, Position::new(1, Lsn(150)), true),
            (50, 1, Position::new(1, Lsn(40)), false),
            (150, 2, Position::new(2, Lsn(150)), false),
        ];
        let mut fresh = FreshBudget {
            confirmed: Some(at),
            ..FreshBudget::default()
        };
        for (applied, timeline, copied, holds) in rounds {
            copy_at(applied, timeline);
            let nights = search
                .confirmed_nights(vec![key], stay, Instant::now(), copied, &mut fresh)
                .await;
            assert_eq!(
                confirmed_by(&nights),
                holds,
                "a copy at {timeline}/{applied}"
            );
        }
    }

    /// A search on `model` whose owner is `url`, with `budget_ms` for its
    /// owner-fresh reads; the shipped defaults otherwise.
    fn search_with_owner(url: String, budget_ms: u64, model: Arc<ReadModel>) -> Search {
        let defaults = Figment::from(Toml::string(include_str!(
            "../../../../config/default.toml"
        )));
        let mut owner: OwnerSettings = defaults.extract_inner("owner").unwrap();
        let mut settings: SearchSettings = defaults.extract_inner("search").unwrap();
        owner.url = url;
        settings.owner_read_timeout_ms = budget_ms;
        Search::new(
            &owner,
            &settings,
            "public",
            model,
            HotelIndex::new().unwrap(),
        )
    }

    /// A search with a budget of 300 ms on a copy at 1/100, whose owner
    /// (the listener returned, kept open) lets connections in, by the
    /// kernel's backlog, and never reads them: the startup message goes
    /// unanswered.
    fn search_of_a_silent_owner() -> (Search, Arc<ReadModel>, std::net::TcpListener) {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!(
            "postgresql://vacancy@127.0.0.1:{}/none",
            silent.local_addr().unwrap().port()
        );
        let model = ReadModel::new();
        model.replace(Tables {
            applied: Lsn(100),
            timeline: 1,
            ..Tables::default()
        });
        (search_with_owner(url, 300, model.clone()), model, silent)
    }

    fn few_units_key() -> (CalendarKey, Stay) {
        (
            CalendarKey {
                hotel_id: 1,
                room_type_id: 1,
            },
            Stay {
                check_in: NaiveDate::from_ymd_opt(2030, 1, 1).unwrap(),
                check_out: NaiveDate::from_ymd_opt(2030, 1, 3).unwrap(),
            },
        )
    }

    /// Every owner-fresh read of one search, over the page's three rounds,
    /// shares one budget: an owner that accepts connections and never
    /// answers costs the search the budget once, not once per round. On
    /// tokio's paused clock, which moves only by the timers the search
    /// waits on.
    #[tokio::test(start_paused = true)]
    async fn a_search_spends_one_owner_budget_over_the_pages_rounds() {
        let (search, _model, _silent) = search_of_a_silent_owner();
        let (key, stay) = few_units_key();
        let copied = Position::new(1, Lsn(100));
        let mut fresh = FreshBudget::default();
        let began = tokio::time::Instant::now();
        for round in 0..MAX_PAGE_ROUNDS {
            let [rows, confirmed] = search
                .fresh_nights(vec![key], stay, Instant::now(), copied, &mut fresh)
                .await;
            assert!(rows.is_none(), "no hotel diverges");
            assert!(
                matches!(confirmed, Some(OwnerNights::Failed(_))),
                "round {round}: shown as the copy's, copy_fallback"
            );
        }
        assert!(fresh.confirm_failed);
        let spent = began.elapsed();
        assert!(
            spent <= Duration::from_millis(310),
            "three rounds took {spent:?} of the clock, the budget is 300 ms"
        );
    }

    /// A copy being replaced applies nothing until the new one is in: a
    /// confirmed read gives up at once, without asking the owner (here an
    /// owner that never answers) or waiting out half the budget.
    #[tokio::test(start_paused = true)]
    async fn a_copy_being_replaced_confirms_nothing_and_waits_for_nothing() {
        let (search, model, _silent) = search_of_a_silent_owner();
        model.freshness.set_replacing(true);
        let began = tokio::time::Instant::now();
        let deadline = began + Duration::from_millis(150);
        assert_eq!(
            search.confirm(Instant::now(), deadline).await,
            Err(ConfirmError::OtherTimeline)
        );
        assert_eq!(began.elapsed(), Duration::ZERO, "no wait");
    }
}

//! A booking-service simulator: guests who search through the real HTTP API,
//! pick a room type they were shown, ask for bypass advice, take units on
//! the owner with the real operations (`vacancy_service::ops`), pay or walk away, and
//! report every take with its quote to `POST /v1/take-outcomes`.
//!
//! Used by the tests (racing guests on a hot hotel must produce conflicts,
//! each counted once with the right source), by benchmarks (the
//! copy's 409s, judged take by take in `bench stale`) and by the demo.
//!
//! The summary is the simulator's own account of what happened, kept apart
//! from what `vacancy` counted, so the two can be compared.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use chrono::NaiveDate;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::http_client::{HttpClient, HttpError};
use crate::ops::{self, HoldOutcome, HoldRequest};
use vacancy_service::OwnerError;

#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Where `vacancy` serves its API.
    pub api: SocketAddr,
    /// The owner the guests take units on.
    pub owner_url: String,
    /// The booking service's bearer token for `POST /v1/take-outcomes`.
    pub booking_token: String,
    pub guests: usize,
    /// Each guest stops after this many takes (attempts on the owner).
    pub takes_per_guest: Option<u64>,
    /// Every guest stops after this long.
    pub duration: Option<Duration>,
    /// The hotels guests search (`hotel_ids=`): few hotels = hot inventory.
    pub hotel_ids: Vec<i64>,
    /// Stays start on one of `nights_span` nights from `first_night`.
    pub first_night: NaiveDate,
    pub nights_span: u32,
    /// Stay length, inclusive range of nights.
    pub stay_nights: (u32, u32),
    /// Units one take asks for, and guests per unit.
    pub rooms: i32,
    pub guests_per_room: i16,
    /// Between seeing the answer and taking (where a count goes stale).
    pub think_ms: (u64, u64),
    /// Between a successful hold and paying or walking away.
    pub hold_ms: (u64, u64),
    /// Between one guest's attempts (the rate).
    pub pause_ms: (u64, u64),
    /// Out of 100 holds: how many pay; of the rest, `release_percent` out
    /// of 100 release the hold, the others walk away and leave it to expire.
    pub pay_percent: u32,
    pub release_percent: u32,
    /// The hold's time to live on the owner.
    pub hold_secs: u64,
    /// Run a sweeper that returns expired holds every second.
    pub sweep: bool,
    /// When the advice says bypass, check the owner first and give up
    /// (without a take) when it has too few units.
    pub follow_advice: bool,
    /// Send every report twice, as a retry after a lost answer would.
    pub report_twice: bool,
    /// Keep every take the owner answered (`SimSummary::take_records`), for
    /// a judge that replays them against the owner's commits.
    pub record_takes: bool,
    pub seed: u64,
    pub http_timeout: Duration,
}

impl SimOptions {
    /// A hot-inventory run: `guests` guests on `hotel_ids`, few pauses.
    pub fn hot(
        api: SocketAddr,
        owner_url: &str,
        booking_token: &str,
        hotel_ids: Vec<i64>,
        first_night: NaiveDate,
    ) -> SimOptions {
        SimOptions {
            api,
            owner_url: owner_url.to_string(),
            booking_token: booking_token.to_string(),
            guests: 8,
            takes_per_guest: Some(20),
            duration: Some(Duration::from_secs(120)),
            hotel_ids,
            first_night,
            nights_span: 1,
            stay_nights: (1, 2),
            rooms: 1,
            guests_per_room: 1,
            think_ms: (0, 20),
            hold_ms: (0, 20),
            pause_ms: (0, 10),
            pay_percent: 20,
            release_percent: 100,
            hold_secs: 60,
            sweep: true,
            follow_advice: false,
            report_twice: false,
            record_takes: false,
            seed: 1,
            http_timeout: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Owner(#[from] OwnerError),
    #[error("invalid options: {0}")]
    Options(&'static str),
    #[error("a guest task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    #[error("cannot build the HTTP client: {0}")]
    Http(#[from] HttpError),
}

/// What the guests did, by their own account.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimSummary {
    pub searches: u64,
    pub search_errors: u64,
    /// Searches that showed no room type the guest could take.
    pub empty_searches: u64,
    pub advice_asked: u64,
    pub advice_bypass: u64,
    /// Guests who, told to bypass, found too few units on the owner and gave up.
    pub abandoned_after_bypass: u64,
    pub taken: u64,
    pub conflicts: u64,
    pub errors: u64,
    /// By the `source` the chosen room type was shown with.
    pub takes_by_source: BTreeMap<String, u64>,
    pub conflicts_by_source: BTreeMap<String, u64>,
    /// Conflicts where the room type was shown with at least `rooms` free.
    pub conflicts_after_shown: u64,
    pub paid: u64,
    pub released: u64,
    pub walked_away: u64,
    pub swept: u64,
    /// Reports `vacancy` accepted (first time), replayed, refused or lost.
    pub reports_recorded: u64,
    pub reports_replayed: u64,
    pub reports_failed: u64,
    /// Reports `vacancy` answered as stale reads.
    pub stale_reads: u64,
    /// Every take the owner answered (taken or 409), in no particular
    /// order; only with `SimOptions::record_takes`.
    pub take_records: Vec<TakeRecord>,
}

/// One take the owner answered, with what the guest was shown before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakeRecord {
    pub hotel_id: i64,
    pub room_type_id: i64,
    pub check_in: NaiveDate,
    pub check_out: NaiveDate,
    pub rooms: i32,
    /// The `source` and `free_units` the room type was shown with.
    pub source: String,
    pub free_units: i64,
    /// The answer's `owner_position` (before, after), when it had one.
    pub owner_position: Option<(vacancy_service::Lsn, vacancy_service::Lsn)>,
    /// The answer's `lsn`: where the copy stood.
    pub answer_lsn: Option<vacancy_service::Lsn>,
    /// True when the owner took the units, false for a 409.
    pub taken: bool,
}

impl SimSummary {
    /// Adds another account (one guest's, or a whole crowd's) to this one.
    pub fn merge(&mut self, o: &SimSummary) {
        self.searches += o.searches;
        self.search_errors += o.search_errors;
        self.empty_searches += o.empty_searches;
        self.advice_asked += o.advice_asked;
        self.advice_bypass += o.advice_bypass;
        self.abandoned_after_bypass += o.abandoned_after_bypass;
        self.taken += o.taken;
        self.conflicts += o.conflicts;
        self.errors += o.errors;
        for (k, v) in &o.takes_by_source {
            *self.takes_by_source.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &o.conflicts_by_source {
            *self.conflicts_by_source.entry(k.clone()).or_default() += v;
        }
        self.conflicts_after_shown += o.conflicts_after_shown;
        self.paid += o.paid;
        self.released += o.released;
        self.walked_away += o.walked_away;
        self.swept += o.swept;
        self.reports_recorded += o.reports_recorded;
        self.reports_replayed += o.reports_replayed;
        self.reports_failed += o.reports_failed;
        self.stale_reads += o.stale_reads;
        self.take_records.extend(o.take_records.iter().cloned());
    }

    /// Conflicts per take the owner answered.
    pub fn conflict_share(&self) -> f64 {
        let takes = self.taken + self.conflicts;
        if takes == 0 {
            0.0
        } else {
            self.conflicts as f64 / takes as f64
        }
    }
}

/// Runs the guests until each reaches its limit or `stop` is cancelled.
pub async fn run(options: SimOptions, stop: CancellationToken) -> Result<SimSummary, SimError> {
    if options.guests == 0 || options.hotel_ids.is_empty() {
        return Err(SimError::Options("guests and hotel_ids must not be empty"));
    }
    if options.rooms < 1
        || options.stay_nights.0 < 1
        || options.stay_nights.0 > options.stay_nights.1
    {
        return Err(SimError::Options(
            "rooms and stay_nights must be positive ranges",
        ));
    }
    if options.takes_per_guest.is_none() && options.duration.is_none() {
        return Err(SimError::Options(
            "give takes_per_guest or duration (or both)",
        ));
    }
    let done = stop.child_token();
    if let Some(d) = options.duration {
        let done = done.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = done.cancelled() => {}
                _ = tokio::time::sleep(d) => done.cancel(),
            }
        });
    }
    // One client (one connection pool) for all the guests, as one booking
    // service would have.
    let api = HttpClient::new(options.api, options.http_timeout)?;
    let mut guests = Vec::with_capacity(options.guests);
    for guest in 0..options.guests {
        let client = vacancy_service::connect(&options.owner_url, Duration::from_secs(10)).await?;
        guests.push(tokio::spawn(guest_loop(
            options.clone(),
            guest,
            client,
            api.clone(),
            done.clone(),
        )));
    }
    let sweeper = if options.sweep {
        let client = vacancy_service::connect(&options.owner_url, Duration::from_secs(10)).await?;
        Some(tokio::spawn(sweeper(client, done.clone())))
    } else {
        None
    };
    let mut summary = SimSummary::default();
    for g in guests {
        summary.merge(&g.await?);
    }
    done.cancel();
    if let Some(s) = sweeper {
        summary.swept = s.await?;
    }
    Ok(summary)
}

/// One room type a guest was shown.
#[derive(Debug, Clone)]
struct Shown {
    hotel_id: i64,
    room_type_id: i64,
    free_units: i64,
    source: String,
    quote: String,
    /// The answer's `owner_position`, when the service stamped it.
    owner_position: Option<(vacancy_service::Lsn, vacancy_service::Lsn)>,
    /// The answer's `lsn`.
    answer_lsn: Option<vacancy_service::Lsn>,
}

/// The nights a guest asks for: `check_in` up to, not including, `check_out`.
#[derive(Debug, Clone, Copy)]
struct Stay {
    check_in: NaiveDate,
    check_out: NaiveDate,
}

/// What the owner answered a take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TakeOutcome {
    Taken,
    /// Not enough units, or a night no longer on sale: the 409.
    Conflict,
    Error,
}

impl TakeOutcome {
    /// The `outcome` of a report to `POST /v1/take-outcomes`.
    fn as_str(self) -> &'static str {
        match self {
            TakeOutcome::Taken => "taken",
            TakeOutcome::Conflict => "conflict",
            TakeOutcome::Error => "error",
        }
    }
}

/// One guest: its options, its own random draws, its owner connection, the
/// simulator's HTTP client and its account of what it did.
struct Guest {
    options: SimOptions,
    index: usize,
    /// `hotel_ids=` of every search, joined once.
    hotel_ids: String,
    rng: ChaCha8Rng,
    owner: tokio_postgres::Client,
    api: HttpClient,
    stop: CancellationToken,
    summary: SimSummary,
}

/// A guest's attempts until its limit or `stop`: search, pick a room type
/// that was shown, ask for bypass advice, take on the owner, report the
/// take, then pay, release or walk away.
async fn guest_loop(
    options: SimOptions,
    index: usize,
    owner: tokio_postgres::Client,
    api: HttpClient,
    stop: CancellationToken,
) -> SimSummary {
    let rng = ChaCha8Rng::seed_from_u64(
        options
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(index as u64),
    );
    let hotel_ids = options
        .hotel_ids
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut guest = Guest {
        options,
        index,
        hotel_ids,
        rng,
        owner,
        api,
        stop,
        summary: SimSummary::default(),
    };
    let mut attempt = 0u64;
    while !guest.stop.is_cancelled() && guest.options.takes_per_guest.is_none_or(|n| attempt < n) {
        pause(&mut guest.rng, guest.options.pause_ms, &guest.stop).await;
        let stay = guest.draw_stay();
        let Some(pick) = guest.search_and_pick(stay).await else {
            continue;
        };
        if !guest.heed_advice(&pick, stay).await {
            continue;
        }
        pause(&mut guest.rng, guest.options.think_ms, &guest.stop).await;
        attempt += 1;
        let attempt_id = format!("sim-{}-{}-{attempt}", guest.options.seed, guest.index);
        let (outcome, commit_lsn) = guest.take(&pick, stay, &attempt_id).await;
        guest.count_take(outcome, &pick);
        guest.record_take(outcome, &pick, stay);
        guest
            .report_take(&attempt_id, &pick, stay, outcome, commit_lsn)
            .await;
        if outcome == TakeOutcome::Taken {
            guest.pay_release_or_walk_away(&attempt_id).await;
        }
    }
    guest.summary
}

impl Guest {
    /// A check-in on one of the nights on sale and a stay length in range.
    fn draw_stay(&mut self) -> Stay {
        let o = &self.options;
        let check_in = o.first_night
            + chrono::Days::new(self.rng.random_range(0..u64::from(o.nights_span.max(1))));
        let check_out = check_in
            + chrono::Days::new(u64::from(
                self.rng.random_range(o.stay_nights.0..=o.stay_nights.1),
            ));
        Stay {
            check_in,
            check_out,
        }
    }

    /// Searches the hotels for `stay` and picks one of the room types shown
    /// with enough units; `None` when the search failed or showed none.
    async fn search_and_pick(&mut self, stay: Stay) -> Option<Shown> {
        let o = &self.options;
        let mut path = format!(
            "/v1/search?hotel_ids={}&check_in={}&check_out={}&sort=availability&limit=100",
            self.hotel_ids, stay.check_in, stay.check_out
        );
        for _ in 0..o.rooms {
            path.push_str(&format!("&room={}", o.guests_per_room));
        }
        self.summary.searches += 1;
        let answer = match self.api.get(&path).await {
            Ok(r) if r.status == 200 => serde_json::from_slice::<Value>(&r.body).ok(),
            _ => None,
        };
        let Some(answer) = answer else {
            self.summary.search_errors += 1;
            return None;
        };
        let shown = shown_room_types(&answer, o.rooms);
        if shown.is_empty() {
            self.summary.empty_searches += 1;
            return None;
        }
        Some(shown[self.rng.random_range(0..shown.len())].clone())
    }

    /// Asks whether to bypass the copy for `pick`; false when the guest, told
    /// to bypass and following advice, found too few units on the owner and
    /// gave up.
    async fn heed_advice(&mut self, pick: &Shown, stay: Stay) -> bool {
        let o = &self.options;
        let advice_path = format!(
            "/v1/bypass?hotel_id={}&room_type_id={}&check_in={}&check_out={}&rooms={}",
            pick.hotel_id, pick.room_type_id, stay.check_in, stay.check_out, o.rooms
        );
        self.summary.advice_asked += 1;
        let bypass = match self.api.get(&advice_path).await {
            Ok(r) if r.status == 200 => serde_json::from_slice::<Value>(&r.body)
                .ok()
                .and_then(|v| v["bypass"].as_bool())
                .unwrap_or(false),
            _ => false,
        };
        self.summary.advice_bypass += u64::from(bypass);
        if bypass
            && o.follow_advice
            && !owner_has(&self.owner, pick, stay.check_in, stay.check_out, o.rooms).await
        {
            self.summary.abandoned_after_bypass += 1;
            return false;
        }
        true
    }

    /// Holds `pick` for `stay` on the owner; with the commit's LSN when held.
    async fn take(
        &mut self,
        pick: &Shown,
        stay: Stay,
        attempt_id: &str,
    ) -> (TakeOutcome, Option<vacancy_service::Lsn>) {
        let o = &self.options;
        let req = HoldRequest {
            booking_id: attempt_id.to_string(),
            hotel_id: pick.hotel_id,
            room_type_id: pick.room_type_id,
            check_in: stay.check_in,
            check_out: stay.check_out,
            rooms: o.rooms,
            hold_for: Duration::from_secs(o.hold_secs.max(1)),
        };
        match ops::hold(&mut self.owner, &req).await {
            Ok(HoldOutcome::Held) => (TakeOutcome::Taken, current_lsn(&self.owner).await),
            Ok(HoldOutcome::Full | HoldOutcome::NotFound) => (TakeOutcome::Conflict, None),
            Ok(_) => (TakeOutcome::Error, None),
            Err(_) => {
                // The connection may be gone; the next attempt gets a new one.
                if let Ok(c) = vacancy_service::connect(&o.owner_url, Duration::from_secs(10)).await
                {
                    self.owner = c;
                }
                (TakeOutcome::Error, None)
            }
        }
    }

    /// Counts a take by its outcome and by the source `pick` was shown with.
    fn count_take(&mut self, outcome: TakeOutcome, pick: &Shown) {
        let s = &mut self.summary;
        match outcome {
            TakeOutcome::Taken => {
                s.taken += 1;
                *s.takes_by_source.entry(pick.source.clone()).or_default() += 1;
            }
            TakeOutcome::Conflict => {
                s.conflicts += 1;
                *s.takes_by_source.entry(pick.source.clone()).or_default() += 1;
                *s.conflicts_by_source
                    .entry(pick.source.clone())
                    .or_default() += 1;
                s.conflicts_after_shown +=
                    u64::from(pick.free_units >= i64::from(self.options.rooms));
            }
            TakeOutcome::Error => s.errors += 1,
        }
    }

    /// Keeps the take for a judge, when the options ask for it.
    fn record_take(&mut self, outcome: TakeOutcome, pick: &Shown, stay: Stay) {
        if !self.options.record_takes || outcome == TakeOutcome::Error {
            return;
        }
        self.summary.take_records.push(TakeRecord {
            hotel_id: pick.hotel_id,
            room_type_id: pick.room_type_id,
            check_in: stay.check_in,
            check_out: stay.check_out,
            rooms: self.options.rooms,
            source: pick.source.clone(),
            free_units: pick.free_units,
            owner_position: pick.owner_position,
            answer_lsn: pick.answer_lsn,
            taken: outcome == TakeOutcome::Taken,
        });
    }

    /// Reports the take with its quote to `POST /v1/take-outcomes` (twice
    /// when the options say so, as a retry after a lost answer would).
    async fn report_take(
        &mut self,
        attempt_id: &str,
        pick: &Shown,
        stay: Stay,
        outcome: TakeOutcome,
        commit_lsn: Option<vacancy_service::Lsn>,
    ) {
        let o = &self.options;
        let report: bytes::Bytes = serde_json::json!({
            "attempt_id": attempt_id,
            "quote": pick.quote,
            "hotel_id": pick.hotel_id,
            "room_type_id": pick.room_type_id,
            "check_in": stay.check_in,
            "check_out": stay.check_out,
            "rooms": o.rooms,
            "outcome": outcome.as_str(),
            "commit_lsn": commit_lsn,
        })
        .to_string()
        .into();
        let sends = if o.report_twice { 2 } else { 1 };
        for _ in 0..sends {
            let sent = self
                .api
                .post_json("/v1/take-outcomes", Some(&o.booking_token), report.clone())
                .await;
            let s = &mut self.summary;
            match sent {
                Ok(r) if r.status == 200 && r.header("idempotent-replayed").is_some() => {
                    s.reports_replayed += 1;
                }
                Ok(r) if r.status == 200 => {
                    let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
                    s.reports_recorded += 1;
                    s.stale_reads += u64::from(v["stale_read"].as_bool() == Some(true));
                }
                _ => s.reports_failed += 1,
            }
        }
    }

    /// After holding a while: pay, release the hold, or walk away and leave
    /// it to expire, as the options' shares say.
    async fn pay_release_or_walk_away(&mut self, attempt_id: &str) {
        let o = &self.options;
        pause(&mut self.rng, o.hold_ms, &self.stop).await;
        if self.rng.random_range(0..100) < o.pay_percent {
            if matches!(
                ops::confirm(&self.owner, attempt_id).await,
                Ok(ops::Transition::Done)
            ) {
                self.summary.paid += 1;
            }
        } else if self.rng.random_range(0..100) < o.release_percent {
            if matches!(
                ops::release(&mut self.owner, attempt_id).await,
                Ok(ops::Transition::Done)
            ) {
                self.summary.released += 1;
            }
        } else {
            self.summary.walked_away += 1;
        }
    }
}

/// The room types of an answer a guest could take `rooms` units of.
fn shown_room_types(answer: &Value, rooms: i32) -> Vec<Shown> {
    let mut out = Vec::new();
    let lsn = |v: &Value| {
        v.as_str()
            .and_then(|s| s.parse::<vacancy_service::Lsn>().ok())
    };
    let position = &answer["owner_position"];
    let owner_position = lsn(&position["before"]).zip(lsn(&position["after"]));
    let answer_lsn = lsn(&answer["lsn"]);
    for h in answer["results"].as_array().into_iter().flatten() {
        let Some(hotel_id) = h["hotel_id"].as_i64() else {
            continue;
        };
        for t in h["room_types"].as_array().into_iter().flatten() {
            let (Some(room_type_id), Some(free), Some(source), Some(quote)) = (
                t["room_type_id"].as_i64(),
                t["free_units"].as_i64(),
                t["source"].as_str(),
                t["quote"].as_str(),
            ) else {
                continue;
            };
            if free >= i64::from(rooms) {
                out.push(Shown {
                    hotel_id,
                    room_type_id,
                    free_units: free,
                    source: source.to_string(),
                    quote: quote.to_string(),
                    owner_position,
                    answer_lsn,
                });
            }
        }
    }
    out
}

/// What a booking service does when told to bypass: ask the owner.
async fn owner_has(
    client: &tokio_postgres::Client,
    pick: &Shown,
    check_in: NaiveDate,
    check_out: NaiveDate,
    rooms: i32,
) -> bool {
    let row = client
        .query_one(
            "SELECT count(*), coalesce(min(coalesce(sell_limit, total) - taken), 0)
             FROM inventory
             WHERE hotel_id = $1 AND room_type_id = $2 AND night >= $3 AND night < $4",
            &[&pick.hotel_id, &pick.room_type_id, &check_in, &check_out],
        )
        .await;
    match row {
        Ok(r) => {
            let nights: i64 = r.get(0);
            let free: i32 = r.get(1);
            nights == (check_out - check_in).num_days() && free >= rooms
        }
        // The owner did not answer: let the take itself decide.
        Err(_) => true,
    }
}

async fn current_lsn(client: &tokio_postgres::Client) -> Option<vacancy_service::Lsn> {
    client
        .query_one("SELECT pg_current_wal_insert_lsn()", &[])
        .await
        .ok()
        .map(|r| r.get::<_, tokio_postgres::types::PgLsn>(0).into())
}

/// A simulated person's pause between two actions: a random length from
/// `range` (ms), cut short when `stop` is cancelled.
pub(crate) async fn pause(rng: &mut ChaCha8Rng, range: (u64, u64), stop: &CancellationToken) {
    let ms = if range.1 > range.0 {
        rng.random_range(range.0..=range.1)
    } else {
        range.0
    };
    if ms == 0 {
        return;
    }
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
    }
}

/// Returns expired holds every second until `stop`; how many it expired.
async fn sweeper(mut client: tokio_postgres::Client, stop: CancellationToken) -> u64 {
    let mut swept = 0;
    loop {
        if let Ok(n) = ops::sweep(&mut client, 500).await {
            swept += n;
        }
        tokio::select! {
            _ = stop.cancelled() => return swept,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_room_types_with_enough_units_are_picked() {
        let answer = serde_json::json!({"results": [{"hotel_id": 1, "room_types": [
            {"room_type_id": 1, "free_units": 1, "source": "owner", "quote": "q1"},
            {"room_type_id": 2, "free_units": 3, "source": "copy", "quote": "q2"},
            {"room_type_id": 3, "free_units": 5, "source": "copy"}
        ]}]});
        let shown = shown_room_types(&answer, 2);
        assert_eq!(shown.len(), 1);
        assert_eq!(
            (shown[0].room_type_id, shown[0].source.as_str()),
            (2, "copy")
        );
        assert_eq!(shown_room_types(&answer, 1).len(), 2, "no quote, no pick");
        assert_eq!(shown[0].owner_position, None, "an unstamped answer");
    }

    #[test]
    fn a_stamped_answer_gives_its_owner_position_to_every_pick() {
        let answer = serde_json::json!({
        "owner_position": {"before": "0/100", "after": "0/1A0"},
        "results": [{"hotel_id": 1, "room_types": [
            {"room_type_id": 2, "free_units": 3, "source": "copy", "quote": "q2"}
        ]}]});
        let shown = shown_room_types(&answer, 1);
        assert_eq!(
            shown[0].owner_position,
            Some((vacancy_service::Lsn(0x100), vacancy_service::Lsn(0x1A0)))
        );
    }
}

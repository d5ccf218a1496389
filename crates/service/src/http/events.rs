//! `GET /v1/hotels/{hotel_id}/events`: a hotel's committed count changes,
//! pushed as Server-Sent Events to the open pages.
//!
//! Each stream starts with a `state` event (every room type and night of the
//! window, with the LSN it reflects), then sends one `change` event per
//! committed owner transaction that changed the hotel's nights, in commit
//! order, each with its LSN as the SSE `id`. A client that reconnects with
//! `Last-Event-ID` gets the changes it missed from the feed's ring
//! (`model::feed`), or a fresh `state` when the ring no longer holds them.
//!
//! Architecture invariant: apply never waits on a stream. The feed's channel
//! is bounded; a stream that falls behind is sent a fresh `state` (reason
//! `lagged`) instead of the items it lost. A stream never sends an item at or
//! below the LSN of what it already sent, so each change arrives once.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Extension;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, NaiveDate, Utc};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast::error::RecvError;

use super::{ApiState, Problem, access, problem};
use crate::lsn::{Lsn, Position};
use crate::model::feed::{FeedItem, NightChange};
use crate::model::{CalendarKey, NightCounts, ReadModel};

/// Most streams one process serves at once; more are answered 503.
pub const MAX_STREAMS: usize = 2048;
/// A comment line this often keeps proxies and the browser from closing an idle stream.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// What the browser waits before reconnecting (sent as the SSE `retry` field).
pub const RETRY: Duration = Duration::from_secs(2);
/// The longest window one stream may watch (two years and some, like the calendar).
const MAX_WINDOW_DAYS: i64 = 800;

#[derive(Deserialize)]
pub struct NightRangeQuery {
    from: Option<String>,
    to: Option<String>,
}

/// The nights a stream reports: `[from, to)`, at most `MAX_WINDOW_DAYS`.
#[derive(Debug, Clone, Copy)]
struct NightRange {
    from: NaiveDate,
    to: NaiveDate,
}

impl NightRange {
    /// The window asked for; a bound left out is filled in so the window
    /// is never wider than `MAX_WINDOW_DAYS`: `from` defaults to the day
    /// before `today` (a guest's today, in any time zone), or to that many
    /// days before `to`; `to` to that many days after `from`. Unbounded, a
    /// stream's every `state` carried the hotel's whole calendar, past
    /// nights the owner keeps included: megabytes per state and per
    /// reconnect, held in the buffer of a client that stops reading.
    fn parse(q: &NightRangeQuery, today: NaiveDate) -> Result<NightRange, Problem> {
        let date = |field: &'static str, v: &Option<String>| {
            v.as_deref()
                .map(|s| {
                    NaiveDate::parse_from_str(s, "%Y-%m-%d").map_err(|_| {
                        Problem::InvalidParameter {
                            field,
                            detail: "must be a date like 2027-06-10".into(),
                        }
                    })
                })
                .transpose()
        };
        let span = chrono::Days::new(MAX_WINDOW_DAYS as u64);
        let (from, to) = match (date("from", &q.from)?, date("to", &q.to)?) {
            (Some(from), Some(to)) => (from, to),
            (Some(from), None) => (from, from.checked_add_days(span).unwrap_or(NaiveDate::MAX)),
            (None, Some(to)) => (to.checked_sub_days(span).unwrap_or(NaiveDate::MIN), to),
            (None, None) => {
                let from = today.pred_opt().unwrap_or(today);
                (from, from.checked_add_days(span).unwrap_or(NaiveDate::MAX))
            }
        };
        if to <= from {
            return Err(Problem::InvalidParameter {
                field: "to",
                detail: "must be after `from`".into(),
            });
        }
        if (to - from).num_days() > MAX_WINDOW_DAYS {
            return Err(Problem::InvalidParameter {
                field: "to",
                detail: format!("the window may span at most {MAX_WINDOW_DAYS} days"),
            });
        }
        Ok(NightRange { from, to })
    }

    fn contains(&self, night: NaiveDate) -> bool {
        night >= self.from && night < self.to
    }
}

/// One night as a stream reports it; `removed` when the owner no longer
/// has the row (not on sale), and then no counts.
#[derive(Debug, Serialize)]
struct NightBody {
    room_type_id: i64,
    night: NaiveDate,
    #[serde(skip_serializing_if = "Option::is_none")]
    free: Option<i32>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    counts: Option<NightCounts>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    removed: bool,
}

impl NightBody {
    fn new(room_type_id: i64, night: NaiveDate, counts: Option<NightCounts>) -> NightBody {
        NightBody {
            room_type_id,
            night,
            free: counts.map(|c| c.free()),
            counts,
            removed: counts.is_none(),
        }
    }
}

#[derive(Debug, Serialize)]
struct RoomTypeBody {
    room_type_id: i64,
    name: String,
    max_guests: i16,
}

/// The `state` event: everything the window shows, as of `lsn`.
#[derive(Debug, Serialize)]
struct StateBody {
    hotel_id: i64,
    lsn: Lsn,
    lag_ms: u64,
    /// `initial`, `resume_unavailable`, `lagged` or `resync`.
    reason: &'static str,
    /// False once the hotel is gone from the copy.
    exists: bool,
    name: Option<String>,
    city: Option<String>,
    room_types: Vec<RoomTypeBody>,
    nights: Vec<NightBody>,
}

/// The `change` event: one committed transaction's changes to this hotel.
#[derive(Debug, Serialize)]
struct ChangeBody {
    hotel_id: i64,
    lsn: Lsn,
    commit_lsn: Lsn,
    commit_time: Option<DateTime<Utc>>,
    nights: Vec<NightBody>,
}

/// One Server-Sent Event as the OpenAPI document describes the items of the
/// `text/event-stream` answer (the fields of the SSE wire format); `data` is
/// the JSON text of a `state` or `change` body. Documentation only.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct SseEvent {
    /// `state` or `change`.
    event: String,
    /// The LSN the event reflects; send it back as `Last-Event-ID`.
    id: String,
    /// The event's body, JSON text.
    data: String,
    /// Reconnect delay in milliseconds (on the first event).
    retry: Option<u64>,
}

/// Counts the open streams, in all and per client when that is bounded;
/// the counts drop when the stream does.
struct StreamSlot {
    model: Arc<ReadModel>,
    client: Option<IpAddr>,
}

impl StreamSlot {
    /// A place for one more stream of `client`, when the node holds fewer
    /// than `MAX_STREAMS` and `client` fewer than `per_client` (0: no
    /// bound per client, and none counted).
    fn take(
        model: &Arc<ReadModel>,
        client: IpAddr,
        per_client: usize,
    ) -> Result<StreamSlot, Problem> {
        let feed = &model.feed;
        if feed.open_streams.fetch_add(1, Ordering::AcqRel) >= MAX_STREAMS {
            feed.open_streams.fetch_sub(1, Ordering::AcqRel);
            return Err(Problem::Overloaded {
                setting: "the event streams a node keeps open (fixed)",
                max_in_flight: MAX_STREAMS,
            });
        }
        // Made now, so a refusal below gives the node's place back.
        let mut slot = StreamSlot {
            model: model.clone(),
            client: None,
        };
        if per_client > 0 {
            let mut by_client = feed
                .streams_by_client
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let open = by_client.entry(client).or_insert(0);
            if *open >= per_client {
                return Err(Problem::RateLimited {
                    retry_after_secs: RETRY.as_secs(),
                });
            }
            *open += 1;
            slot.client = Some(client);
        }
        Ok(slot)
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let feed = &self.model.feed;
        feed.open_streams.fetch_sub(1, Ordering::AcqRel);
        if let Some(client) = self.client {
            let mut by_client = feed
                .streams_by_client
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if let Some(open) = by_client.get_mut(&client) {
                *open = open.saturating_sub(1);
                if *open == 0 {
                    by_client.remove(&client);
                }
            }
        }
    }
}

/// `GET /v1/hotels/{hotel_id}/events?from=&to=`.
#[utoipa::path(get, path = "/v1/hotels/{hotel_id}/events", tag = "search",
    params(
        ("hotel_id" = i64, Path, description = "hotel id"),
        ("from" = Option<String>, Query, description = "first night to report, YYYY-MM-DD (default: yesterday, UTC, or 800 days before `to`)"),
        ("to" = Option<String>, Query, description = "night after the last to report, YYYY-MM-DD (default: 800 days after `from`); a window spans at most 800 days"),
        ("Last-Event-ID" = Option<String>, Header, description = "the id (an LSN) of the last event received: resume after it"),
    ),
    responses(
        (status = 200, description = "text/event-stream: a `state` event (every room type and night of the window, id = the LSN it reflects), then one `change` event per committed owner transaction that changed this hotel's nights, in commit order, id = its LSN; a fresh `state` (reason `lagged`, `resync` or `resume_unavailable`) whenever the changes in between cannot be sent", content_type = "text/event-stream", body = SseEvent),
        (status = 400, description = "invalid parameter", content_type = "application/problem+json"),
        (status = 404, description = "no such hotel", content_type = "application/problem+json"),
        (status = 429, description = "this client has `http.max_event_streams_per_client` streams open already", content_type = "application/problem+json"),
        (status = 503, description = "not ready, or too many streams open", content_type = "application/problem+json"),
    ))]
pub async fn hotel_events(
    State(state): State<ApiState>,
    hotel_id: Result<Path<String>, PathRejection>,
    q: Result<Query<NightRangeQuery>, QueryRejection>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let hotel_id = problem::hotel_id(hotel_id)?;
    let q = problem::query(q)?;
    let window = NightRange::parse(&q, chrono::Utc::now().date_naive())?;
    let model = state.model.clone();
    if !model.freshness.is_loaded() {
        return Err(Problem::NotReady {
            reason: "the initial snapshot is not loaded yet".into(),
        });
    }
    if !model.read().hotels.contains_key(&hotel_id) {
        return Err(Problem::HotelNotFound(hotel_id));
    }
    let http = &state.settings.http;
    let client = access::client_key(
        peer.as_ref().map(|Extension(p)| p),
        &headers,
        http.trust_forwarded_for,
    );
    let slot = StreamSlot::take(&model, client, http.max_event_streams_per_client)?;
    let last_seen = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<Position>().ok());

    // Subscribe first: whatever is published from here on reaches us, and
    // anything published before is in the state or the ring we read next.
    let rx = model.feed.subscribe();
    let mut stream = HotelStream {
        model,
        hotel_id,
        window,
        rx,
        last: Lsn::ZERO,
        generation: 0,
        pending: VecDeque::new(),
        _slot: slot,
    };
    stream.start(last_seen);

    let events = futures_util::stream::unfold(stream, |mut s| async move {
        let event = s.next_event().await?;
        Some((Ok::<Event, Infallible>(event), s))
    });
    let mut response = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response();
    let h = response.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
}

/// One open stream: what it has sent and what it still has to.
struct HotelStream {
    model: Arc<ReadModel>,
    hotel_id: i64,
    window: NightRange,
    rx: tokio::sync::broadcast::Receiver<Arc<FeedItem>>,
    /// The LSN of the last event sent: nothing at or below it is sent again.
    last: Lsn,
    /// The `Tables::generation` of the copy the stream's last state (or
    /// resume) came from. Items of an older copy still queued after a swap
    /// are skipped: sent after the new copy's state, a replaced copy's
    /// change (one a failover lost, say) showed over it until the reset
    /// behind it arrived, and its id went past the state's.
    generation: u64,
    pending: VecDeque<Event>,
    _slot: StreamSlot,
}

impl HotelStream {
    /// The first events: the missed changes when the ring still holds them
    /// all, otherwise the full state.
    fn start(&mut self, last_seen: Option<Position>) {
        self.queue_first_events(last_seen);
        // The reconnect delay rides on the first event only: axum panics
        // on a second `retry` of one event, and a resumed stream's first
        // event may be a state (a missed item that resyncs the hotel).
        if let Some(first) = self.pending.pop_front() {
            self.pending.push_front(first.retry(RETRY));
        }
    }

    fn queue_first_events(&mut self, last_seen: Option<Position>) {
        let (timeline, generation) = {
            let t = self.model.read();
            (t.timeline, t.generation)
        };
        let resumable = last_seen
            // LSNs compare only within a timeline: an id of another one (the
            // owner failed over since) or without one (a release before ids
            // said it) gets a fresh state. A copy of unknown timeline (0)
            // takes bare ids, as before.
            .filter(|p| p.timeline.unwrap_or(0) == timeline)
            .map(|p| p.lsn)
            // An id from the future (another history, or made up) cannot be trusted.
            .filter(|l| *l <= self.model.freshness.applied())
            .and_then(|l| self.model.feed.since(l).map(|items| (l, items)))
            // The ring of a copy replaced since the read above, its reset
            // not yet in: its items are not this copy's changes.
            .filter(|(_, items)| items.iter().all(|i| i.generation == generation));
        let Some((from, items)) = resumable else {
            let reason = if last_seen.is_some() {
                "resume_unavailable"
            } else {
                "initial"
            };
            self.push_state(reason);
            return;
        };
        self.last = from;
        self.generation = generation;
        for item in items {
            self.push_item(&item);
        }
        if self.pending.is_empty() {
            // Tell the client where it stands (no data: nothing it missed).
            self.pending
                .push_back(Event::default().comment(format!("resumed after {from}")));
        }
    }

    /// The next event to send, waiting for one; `None` ends the stream.
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(e);
            }
            let received = tokio::select! {
                biased;
                _ = self.model.feed.closed() => return None,
                r = self.rx.recv() => r,
            };
            match received {
                Ok(item) => self.push_item(&item),
                Err(RecvError::Lagged(missed)) => {
                    tracing::debug!(
                        hotel_id = self.hotel_id,
                        missed,
                        "event stream lagged; sending a fresh state"
                    );
                    self.push_state("lagged");
                }
                Err(RecvError::Closed) => return None,
            }
        }
    }

    fn push_item(&mut self, item: &FeedItem) {
        if item.generation < self.generation {
            return;
        }
        if item.lsn <= self.last && !item.reset {
            return;
        }
        if item.reset {
            // A new copy may stand below what this stream sent (a failover's
            // new timeline): the state below sets where it stands now.
            self.last = Lsn::ZERO;
        }
        if item.resyncs(self.hotel_id) {
            self.push_state("resync");
            return;
        }
        let nights: Vec<NightBody> = item
            .nights_of(self.hotel_id)
            .iter()
            .filter(|n| self.window.contains(n.night))
            .map(|n: &NightChange| NightBody::new(n.key.room_type_id, n.night, n.counts))
            .collect();
        self.last = item.lsn;
        if nights.is_empty() {
            return;
        }
        let body = ChangeBody {
            hotel_id: self.hotel_id,
            lsn: item.lsn,
            commit_lsn: item.commit_lsn,
            commit_time: item.commit_time,
            nights,
        };
        let id = Position::new(item.timeline, item.lsn);
        self.pending.push_back(json_event("change", id, &body));
    }

    /// Reads the hotel's state from one published copy and queues it.
    fn push_state(&mut self, reason: &'static str) {
        let timeline;
        let body = {
            let t = self.model.read();
            timeline = t.timeline;
            self.generation = t.generation;
            let hotel = t.hotels.get(&self.hotel_id);
            let mut room_types = Vec::new();
            let mut nights = Vec::new();
            for rt in t.room_types_of(self.hotel_id) {
                room_types.push(RoomTypeBody {
                    room_type_id: rt.id,
                    name: rt.name.clone(),
                    max_guests: rt.max_guests,
                });
                let key = CalendarKey {
                    hotel_id: self.hotel_id,
                    room_type_id: rt.id,
                };
                if let Some(c) = t.calendars.get(&key) {
                    // The window's days only, however far the calendar spans.
                    nights.extend(
                        c.range(self.window.from, self.window.to)
                            .map(|(night, counts)| NightBody::new(rt.id, night, Some(counts))),
                    );
                }
            }
            StateBody {
                hotel_id: self.hotel_id,
                lsn: t.applied,
                lag_ms: self.model.freshness.lag_ms(Utc::now()),
                reason,
                exists: hotel.is_some(),
                name: hotel.map(|h| h.name.clone()),
                city: hotel.map(|h| h.city.clone()),
                room_types,
                nights,
            }
        };
        // Everything at or below the state's LSN is in it, and nothing
        // above: set, not maxed, since the copy may stand below what was
        // sent (a reset lost in a lag, `next_event`), and its changes past
        // the state must go out.
        self.last = body.lsn;
        let id = Position::new(timeline, body.lsn);
        self.pending.push_back(json_event("state", id, &body));
    }
}

/// An event whose id is its position with the copy's timeline (`2/0/16B3748`),
/// so a reconnect after a failover is told apart from one on this timeline.
fn json_event<T: Serialize>(name: &'static str, id: Position, body: &T) -> Event {
    let data = serde_json::to_string(body).unwrap_or_else(|_| "{}".to_string());
    Event::default().event(name).id(id.to_string()).data(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_checked_and_half_open() {
        let q = |from: Option<&str>, to: Option<&str>| NightRangeQuery {
            from: from.map(str::to_string),
            to: to.map(str::to_string),
        };
        let d = |n| NaiveDate::from_ymd_opt(2030, 1, n).unwrap();
        let today = d(10);
        let parse = |from, to| NightRange::parse(&q(from, to), today);
        let w = parse(Some("2030-01-02"), Some("2030-01-04")).unwrap();
        assert!(!w.contains(d(1)));
        assert!(w.contains(d(2)) && w.contains(d(3)));
        assert!(!w.contains(d(4)));
        assert!(parse(Some("2030-01-04"), Some("2030-01-04")).is_err());
        assert!(parse(Some("yesterday"), None).is_err());
        assert!(parse(Some("2030-01-01"), Some("2033-01-01")).is_err());
        assert!(parse(Some("9999-12-31"), None).is_ok(), "no overflow");
    }

    /// A bound left out never widens the window past `MAX_WINDOW_DAYS`:
    /// no bound at all watches yesterday and the 800 days from it.
    #[test]
    fn a_window_left_open_is_bounded() {
        let q = |from: Option<&str>, to: Option<&str>| NightRangeQuery {
            from: from.map(str::to_string),
            to: to.map(str::to_string),
        };
        let today = NaiveDate::from_ymd_opt(2030, 1, 10).unwrap();
        let days = |n| chrono::Days::new(n);
        let open = NightRange::parse(&q(None, None), today).unwrap();
        assert!(open.contains(today - days(1)) && !open.contains(today - days(2)));
        assert!(open.contains(today + days(798)) && !open.contains(today + days(799)));
        let w = NightRange::parse(&q(Some("1990-01-01"), None), today).unwrap();
        assert_eq!((w.to - w.from).num_days(), MAX_WINDOW_DAYS);
        let w = NightRange::parse(&q(None, Some("2040-01-01")), today).unwrap();
        assert_eq!((w.to - w.from).num_days(), MAX_WINDOW_DAYS);
        assert!(w.contains(NaiveDate::from_ymd_opt(2039, 12, 31).unwrap()));
    }

    /// With a bound per client, one address cannot hold more streams than
    /// it, others still can, and a closed stream gives its place back; the
    /// map forgets an address with its last stream.
    #[test]
    fn a_client_holds_at_most_its_share_of_the_streams() {
        let model = ReadModel::new();
        let one = IpAddr::from([10, 0, 0, 1]);
        let other = IpAddr::from([10, 0, 0, 2]);
        let held: Vec<StreamSlot> = (0..3)
            .map(|_| StreamSlot::take(&model, one, 3).unwrap())
            .collect();
        assert!(matches!(
            StreamSlot::take(&model, one, 3),
            Err(Problem::RateLimited { .. })
        ));
        let theirs = StreamSlot::take(&model, other, 3).unwrap();
        assert_eq!(model.feed.open_streams.load(Ordering::Acquire), 4);
        drop(held);
        assert!(
            StreamSlot::take(&model, one, 3).is_ok(),
            "places given back"
        );
        drop(theirs);
        assert_eq!(model.feed.open_streams.load(Ordering::Acquire), 0);
        assert!(model.feed.streams_by_client.lock().unwrap().is_empty());
        // No bound: nothing counted per client.
        let _unbounded: Vec<StreamSlot> = (0..10)
            .map(|_| StreamSlot::take(&model, one, 0).unwrap())
            .collect();
        assert!(model.feed.streams_by_client.lock().unwrap().is_empty());
    }

    #[test]
    fn a_removed_night_has_no_counts() {
        let d = NaiveDate::from_ymd_opt(2030, 1, 1).unwrap();
        let v = serde_json::to_value(NightBody::new(3, d, None)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"room_type_id": 3, "night": "2030-01-01", "removed": true})
        );
        let c = NightCounts {
            total: 4,
            taken: 1,
            sell_limit: Some(5),
            price_cents: None,
        };
        let v = serde_json::to_value(NightBody::new(3, d, Some(c))).unwrap();
        assert_eq!(v["free"], 4);
        assert_eq!(v["taken"], 1);
        assert!(v.get("removed").is_none());
    }

    fn stream_night() -> NaiveDate {
        NaiveDate::from_ymd_opt(2030, 1, 2).unwrap()
    }

    fn stream_counts(taken: i32) -> NightCounts {
        NightCounts {
            total: 5,
            taken,
            sell_limit: None,
            price_cents: Some(100),
        }
    }

    fn stream_key(hotel_id: i64) -> crate::model::CalendarKey {
        crate::model::CalendarKey {
            hotel_id,
            room_type_id: 1,
        }
    }

    /// A copy at `applied` with one night of hotel 1.
    fn copy_at(applied: u64) -> crate::model::Tables {
        let mut t = crate::model::Tables::default();
        t.apply_change(&crate::model::Change::UpsertNight {
            key: stream_key(1),
            night: stream_night(),
            counts: stream_counts(0),
        })
        .unwrap();
        t.applied = Lsn(applied);
        t
    }

    /// A transaction at `lsn` that takes a unit of `hotel_id`'s night.
    fn transaction(lsn: u64, hotel_id: i64) -> crate::model::Transaction {
        crate::model::Transaction {
            xid: 7,
            commit_lsn: Lsn(lsn),
            end_lsn: Lsn(lsn + 1),
            commit_time: chrono::Utc::now(),
            changes: vec![crate::model::Change::UpsertNight {
                key: stream_key(hotel_id),
                night: stream_night(),
                counts: stream_counts(1),
            }]
            .into(),
        }
    }

    /// A stream of hotel 1 over the first ten nights of 2030, subscribed now.
    fn stream_of(model: &Arc<ReadModel>) -> HotelStream {
        let window = NightRange::parse(
            &NightRangeQuery {
                from: Some("2030-01-01".into()),
                to: Some("2030-01-10".into()),
            },
            NaiveDate::from_ymd_opt(2030, 1, 1).unwrap(),
        )
        .unwrap();
        HotelStream {
            model: model.clone(),
            hotel_id: 1,
            window,
            rx: model.feed.subscribe(),
            last: Lsn::ZERO,
            generation: 0,
            pending: VecDeque::new(),
            _slot: StreamSlot::take(model, IpAddr::from([127, 0, 0, 1]), 0).unwrap(),
        }
    }

    /// A copy replaced by one below what a stream sent (a replica's
    /// bootstrap from an older checkpoint, a failover), its reset item lost
    /// in a lag: the lagged state says where the stream stands now, and
    /// the changes after it go out.
    #[tokio::test]
    async fn a_reset_lost_in_a_lag_does_not_hide_the_changes_after_it() {
        let model = ReadModel::new();
        model.replace(copy_at(1_000_000));
        let mut stream = stream_of(&model);
        stream.start(None);
        assert!(stream.next_event().await.is_some(), "the first state");
        assert_eq!(stream.last, Lsn(1_000_000));

        model.replace(copy_at(500));
        for i in 0..(crate::model::feed::CHANNEL_CAPACITY as u64 + 100) {
            model.apply(&transaction(600 + i, 2)).unwrap();
        }
        assert!(stream.next_event().await.is_some(), "the lagged state");
        assert!(stream.last < Lsn(5_000), "{}", stream.last);
        model.apply(&transaction(5_000, 1)).unwrap();
        let change = tokio::time::timeout(Duration::from_secs(1), stream.next_event()).await;
        assert!(matches!(change, Ok(Some(_))), "the change at 5000 goes out");
        assert_eq!(stream.last, Lsn(5_001));
    }

    /// A replaced copy's change still queued when a stream read its state
    /// from the new copy (a resync of the hotel, here) went out after that
    /// state: a failover's lost booking shown over the new copy, its id
    /// past the state's, until the reset queued behind it arrived.
    #[tokio::test]
    async fn an_old_copys_change_never_follows_a_new_copys_state() {
        let model = ReadModel::new();
        model.replace(copy_at(1_000));
        let mut stream = stream_of(&model);
        let mut resync = transaction(1_050, 1);
        resync.changes = vec![crate::model::Change::DeleteRoomType { hotel_id: 1, id: 9 }].into();
        model.apply(&resync).unwrap();
        model.apply(&transaction(1_100, 1)).unwrap();
        model.replace(copy_at(500));
        stream.start(None);
        assert!(stream.next_event().await.is_some(), "the state");
        assert_eq!(stream.last, Lsn(500));
        // The resync, then the old copy's change, then the reset: only the
        // reset's state may follow.
        while let Ok(Some(_)) =
            tokio::time::timeout(Duration::from_millis(200), stream.next_event()).await
        {
            assert_eq!(stream.last, Lsn(500), "an old copy's item went out");
        }
    }
}

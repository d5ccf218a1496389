//! The HTTP surface: guest search, the booking service's endpoints (take
//! outcomes, bypass advice), and operator endpoints (stale reads, status,
//! calendar, health, metrics).
//!
//! Architecture invariant: handlers only read the model; they never write it.
//! Errors are RFC 9457 problem+json with a stable `type`, built in one place
//! (`Problem`), so a client can branch on `type` and never parses prose.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{
    ConnectInfo, DefaultBodyLimit, MatchedPath, Path, Query, RawQuery, Request, State,
};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{NaiveDate, Utc};
use problem_details::ProblemDetails;
use serde::{Deserialize, Serialize};

pub mod access;
pub mod events;
pub mod page;
mod settings;

pub use settings::{AdminSettings, HttpSettings};

use crate::lsn::Lsn;
use crate::metrics;
use crate::model::{NightCounts, ReadModel};
use crate::search::params::{self, ParamError, StayRules};
use crate::search::{Search, SearchError};
use crate::search::{SearchSettings, WhenLagging};
use crate::stale::outcomes::{Recording, ReportError, TakeOutcomeBody};
use crate::stale::{BypassQuestion, StaleReadState};
use crate::stream::StreamStatus;
use crate::stream::snapshot::SnapshotPhase;
use access::{BearerTokens, ClientLimiter, CorsError};

/// What every handler may read.
#[derive(Clone)]
pub struct ApiState {
    pub model: Arc<ReadModel>,
    pub search: Arc<Search>,
    pub status: Arc<StreamStatus>,
    pub settings: Arc<ApiSettings>,
    pub stale: Arc<StaleReadState>,
    /// Tokens for `POST /v1/take-outcomes` (`stale.booking_tokens`, `stale.booking_tokens_file`).
    pub booking_tokens: Arc<BearerTokens>,
    /// Tokens for `/v1/admin/*` (`admin.tokens`, `admin.tokens_file`).
    pub admin_tokens: Arc<BearerTokens>,
}

/// The settings the handlers read: their own section, the search limits
/// they check a question against, and the names `/v1/status` shows.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    pub http: HttpSettings,
    pub search: SearchSettings,
    pub slot: String,
    pub publication: String,
}

/// The routes, their limits and the CORS policy. Fails only on a CORS
/// origin that `Settings::validate` would have refused.
pub fn router(state: ApiState) -> Result<Router, CorsError> {
    let http = &state.settings.http;
    let timeout = Duration::from_millis(http.request_timeout_ms);
    let max_query = http.max_query_bytes;
    let cors = access::cors_layer(http)?;
    let limiter = ClientLimiter::new(
        http.rate_limit_per_sec,
        http.rate_limit_burst,
        http.rate_limit_max_clients,
    )
    .map(Arc::new);
    let trust_forwarded_for = http.trust_forwarded_for;
    // Public and the most expensive to answer: limited per client.
    let search_routes = Router::new()
        .route("/v1/search", get(search))
        .route("/v1/hotels/{hotel_id}/availability", get(availability))
        .route("/v1/bypass", get(bypass))
        .route_layer(middleware::from_fn(move |req, next| {
            rate_limit(req, next, limiter.clone(), trust_forwarded_for)
        }));
    let router = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi))
        .route("/v1/status", get(status))
        .route("/v1/hotels/{hotel_id}/calendar", get(calendar))
        .route("/v1/hotels/{hotel_id}/events", get(events::hotel_events))
        .route(
            "/v1/take-outcomes",
            post(take_outcomes).layer(DefaultBodyLimit::max(state.stale.max_body_bytes)),
        )
        .route("/v1/stale-reads", get(stale_reads))
        .route("/v1/admin/resnapshot", post(resnapshot))
        .merge(search_routes)
        .merge(page::router())
        .fallback(not_found)
        // Every route: no body read past this (take-outcomes sets its own
        // above, which wins), no query string past max_query_bytes.
        .layer(DefaultBodyLimit::max(http.max_body_bytes))
        .layer(middleware::from_fn(move |req, next| {
            limit_query(req, next, max_query)
        }))
        .layer(middleware::from_fn(move |req, next| {
            observe(req, next, timeout)
        }));
    // Outermost: preflights are answered before the limiter counts them, and
    // every answer (429s too) carries the CORS headers a browser needs to read it.
    let router = match cors {
        Some(cors) => router.layer(cors),
        None => router,
    };
    Ok(router.with_state(state))
}

/// Refuses a query string longer than `http.max_query_bytes` before any
/// handler parses it.
async fn limit_query(req: Request, next: Next, max: usize) -> Response {
    if req.uri().query().is_some_and(|q| q.len() > max) {
        return Problem::QueryTooLong { limit: max }.into_response();
    }
    next.run(req).await
}

/// One request from the client's bucket, or 429 with `Retry-After`.
async fn rate_limit(
    req: Request,
    next: Next,
    limiter: Option<Arc<ClientLimiter>>,
    trust_forwarded_for: bool,
) -> Response {
    if let Some(limiter) = limiter {
        let client = access::client_key(
            req.extensions().get::<ConnectInfo<std::net::SocketAddr>>(),
            req.headers(),
            trust_forwarded_for,
        );
        // Counted by `observe` as vacancy_http_requests_total{status="429"}.
        if let Err(wait) = limiter.check(client) {
            return Problem::RateLimited {
                retry_after_secs: wait.header_secs(),
            }
            .into_response();
        }
    }
    next.run(req).await
}

/// Counts and times every request by matched route (bounded labels), and
/// bounds its duration.
async fn observe(req: Request, next: Next, timeout: Duration) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_string();
    let started = Instant::now();
    let in_flight = InFlight::enter();
    let response = match tokio::time::timeout(timeout, next.run(req)).await {
        Ok(r) => r,
        Err(_) => Problem::Timeout.into_response(),
    };
    drop(in_flight);
    metrics::HTTP_DURATION
        .with_label_values(&[&route])
        .observe(started.elapsed().as_secs_f64());
    metrics::HTTP_REQUESTS
        .with_label_values(&[&route, response.status().as_str()])
        .inc();
    response
}

/// Counts a request in flight until dropped, so a request whose client
/// went away (its future dropped) is not counted forever.
struct InFlight;

impl InFlight {
    fn enter() -> InFlight {
        metrics::HTTP_IN_FLIGHT.inc();
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        metrics::HTTP_IN_FLIGHT.dec();
    }
}

/// Every error the API answers with. `type` values are stable: clients branch on them.
#[derive(Debug)]
pub enum Problem {
    NotReady {
        reason: String,
    },
    InvalidParameter {
        field: &'static str,
        detail: String,
    },
    HotelNotFound(i64),
    NotFound,
    Timeout,
    /// No bearer token, or not one of the booking service's.
    Unauthorized,
    /// A quote this service did not issue, or one altered since.
    InvalidQuote {
        detail: String,
    },
    /// A genuine quote for another room, hotel or stay than the report's.
    QuoteMismatch {
        field: &'static str,
    },
    /// An attempt id reported before with a different report.
    AttemptReused,
    BodyTooLarge {
        limit: usize,
    },
    /// A query string longer than `http.max_query_bytes`.
    QueryTooLong {
        limit: usize,
    },
    /// This client's search budget is spent for now.
    RateLimited {
        retry_after_secs: u64,
    },
    /// No bearer token, or not one of the admins'.
    AdminUnauthorized,
}

impl Problem {
    fn parts(&self) -> (StatusCode, &'static str, &'static str, String) {
        match self {
            Problem::NotReady { reason } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "not-ready",
                "The copy is not ready to answer",
                reason.clone(),
            ),
            Problem::InvalidParameter { field, detail } => (
                StatusCode::BAD_REQUEST,
                "invalid-parameter",
                "A parameter is invalid",
                format!("{field}: {detail}"),
            ),
            Problem::HotelNotFound(id) => (
                StatusCode::NOT_FOUND,
                "hotel-not-found",
                "No such hotel",
                format!("hotel {id} is not in the copy"),
            ),
            Problem::NotFound => (
                StatusCode::NOT_FOUND,
                "not-found",
                "No such resource",
                String::new(),
            ),
            Problem::Timeout => (
                StatusCode::SERVICE_UNAVAILABLE,
                "timeout",
                "The request took too long",
                "try again".to_string(),
            ),
            Problem::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "A booking service token is required",
                "send Authorization: Bearer <token>".to_string(),
            ),
            Problem::InvalidQuote { detail } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid-quote",
                "The quote was not issued by this service",
                detail.clone(),
            ),
            Problem::QuoteMismatch { field } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "quote-mismatch",
                "The quote does not describe this take",
                format!("the quote was issued for another {field}"),
            ),
            Problem::AttemptReused => (
                StatusCode::CONFLICT,
                "attempt-id-reused",
                "This attempt id was reported with a different outcome",
                "one attempt has one outcome; use a new attempt id for a new take".to_string(),
            ),
            Problem::BodyTooLarge { limit } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "The request body is too large",
                format!("at most {limit} bytes"),
            ),
            Problem::QueryTooLong { limit } => (
                StatusCode::URI_TOO_LONG,
                "query-too-long",
                "The query string is too long",
                format!("at most {limit} bytes"),
            ),
            Problem::RateLimited { retry_after_secs } => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate-limited",
                "Too many requests from this client",
                format!("try again in {retry_after_secs} s"),
            ),
            Problem::AdminUnauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "An admin token is required",
                "send Authorization: Bearer <token>".to_string(),
            ),
        }
    }
}

#[derive(Serialize)]
struct ProblemFields {
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'static str>,
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let (status, slug, title, detail) = self.parts();
        let field = match &self {
            Problem::InvalidParameter { field, .. } | Problem::QuoteMismatch { field } => {
                Some(*field)
            }
            Problem::InvalidQuote { .. } => Some("quote"),
            Problem::AttemptReused => Some("attempt_id"),
            Problem::QueryTooLong { .. } => Some("query"),
            _ => None,
        };
        let type_uri: axum::http::Uri = format!("/problems/{slug}")
            .parse()
            .expect("static slug is a valid URI");
        let body = ProblemDetails::new()
            .with_type(type_uri)
            .with_status(status)
            .with_title(title)
            .with_detail(detail)
            .with_extensions(ProblemFields { field });
        let mut response = body.into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let Problem::RateLimited { retry_after_secs } = self {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs));
        }
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

async fn not_found() -> Problem {
    Problem::NotFound
}

#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "the process is alive", body = String)))]
async fn healthz() -> &'static str {
    "ok"
}

/// Ready once a snapshot is loaded, no resnapshot is under way, and the copy
/// lags less than `http.ready_max_lag_ms`.
fn readiness(state: &ApiState) -> Result<(), Problem> {
    let f = &state.model.freshness;
    if !f.is_loaded() {
        return Err(Problem::NotReady {
            reason: "the initial snapshot is not loaded yet".into(),
        });
    }
    if state
        .status
        .resnapshotting
        .load(std::sync::atomic::Ordering::Acquire)
    {
        return Err(Problem::NotReady {
            reason: "the copy is being rebuilt from a new snapshot".into(),
        });
    }
    let lag = f.lag_ms(Utc::now());
    if lag > state.settings.http.ready_max_lag_ms {
        return Err(Problem::NotReady {
            reason: format!("the copy lags {lag} ms behind the owner"),
        });
    }
    Ok(())
}

#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "ready: snapshot loaded and lag under the bound", body = String),
        (status = 503, description = "not ready", body = ProblemBody, content_type = "application/problem+json"),
    ))]
async fn readyz(State(state): State<ApiState>) -> Result<&'static str, Problem> {
    readiness(&state).map(|()| "ready")
}

#[derive(Serialize, utoipa::ToSchema)]
struct StatusBody {
    snapshot: SnapshotBody,
    #[schema(value_type = String, example = "0/16B3748")]
    applied_lsn: Lsn,
    #[schema(value_type = String, example = "0/16B3748")]
    server_wal_end: Lsn,
    lag_bytes: u64,
    lag_seconds: f64,
    seconds_since_last_message: Option<f64>,
    connected: bool,
    resnapshotting: bool,
    ready: bool,
    slot: SlotBody,
    last_error: Option<String>,
    model: ModelBody,
}

#[derive(Serialize, utoipa::ToSchema)]
struct SnapshotBody {
    #[schema(value_type = String, example = "loaded")]
    phase: SnapshotPhase,
    rows_loaded: u64,
    rows_expected: u64,
    progress: f64,
}

#[derive(Serialize, utoipa::ToSchema)]
struct SlotBody {
    name: String,
    publication: String,
    active: Option<bool>,
    wal_status: Option<String>,
    #[schema(value_type = Option<String>)]
    confirmed_flush_lsn: Option<Lsn>,
    retained_wal_bytes: Option<i64>,
}

#[derive(Serialize, utoipa::ToSchema)]
struct ModelBody {
    hotels: usize,
    room_types: usize,
    calendars: usize,
    inventory_rows: u64,
    inventory_bytes: u64,
}

fn model_body(model: &ReadModel) -> ModelBody {
    let t = model.read();
    ModelBody {
        hotels: t.hotels.len(),
        room_types: t.room_types.len(),
        calendars: t.calendars.len(),
        inventory_rows: t.inventory_rows(),
        inventory_bytes: t.inventory_bytes(),
    }
}

#[utoipa::path(get, path = "/v1/status", tag = "operations",
    responses((status = 200, description = "the stream, the slot and the copy", body = StatusBody)))]
async fn status(State(state): State<ApiState>) -> Json<StatusBody> {
    use std::sync::atomic::Ordering::Relaxed;
    let f = &state.model.freshness;
    let now = Utc::now();
    let snap = &state.status.snapshot;
    let slot = state.status.slot();
    Json(StatusBody {
        snapshot: SnapshotBody {
            phase: snap.phase(),
            rows_loaded: snap.rows_loaded.load(Relaxed),
            rows_expected: snap.rows_expected.load(Relaxed),
            progress: snap.fraction(),
        },
        applied_lsn: f.applied(),
        server_wal_end: f.server_wal_end(),
        lag_bytes: f.lag_bytes(),
        lag_seconds: f.lag_ms(now) as f64 / 1000.0,
        seconds_since_last_message: f.seconds_since_last_message(now),
        connected: state.status.connected.load(Relaxed),
        resnapshotting: state.status.resnapshotting.load(Relaxed),
        ready: readiness(&state).is_ok(),
        slot: SlotBody {
            name: state.settings.slot.clone(),
            publication: state.settings.publication.clone(),
            active: slot.as_ref().map(|s| s.active),
            wal_status: slot.as_ref().and_then(|s| s.wal_status.clone()),
            confirmed_flush_lsn: slot.as_ref().and_then(|s| s.confirmed_flush),
            retained_wal_bytes: slot.as_ref().and_then(|s| s.retained_bytes),
        },
        last_error: state.status.last_error(),
        model: model_body(&state.model),
    })
}

#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain")))]
async fn metrics_text(State(state): State<ApiState>) -> Response {
    let f = &state.model.freshness;
    let now = Utc::now();
    metrics::LAG_BYTES.set(f.lag_bytes() as i64);
    metrics::LAG_SECONDS.set(f.lag_ms(now) as f64 / 1000.0);
    metrics::SECONDS_SINCE_LAST_MESSAGE.set(f.seconds_since_last_message(now).unwrap_or(0.0));
    metrics::SNAPSHOT_PROGRESS.set(state.status.snapshot.fraction());
    metrics::READY.set(i64::from(readiness(&state).is_ok()));
    let m = model_body(&state.model);
    metrics::MODEL_ENTRIES
        .with_label_values(&["hotels"])
        .set(m.hotels as i64);
    metrics::MODEL_ENTRIES
        .with_label_values(&["room_types"])
        .set(m.room_types as i64);
    metrics::MODEL_ENTRIES
        .with_label_values(&["inventory"])
        .set(m.inventory_rows as i64);
    metrics::MODEL_BYTES.set(m.inventory_bytes as i64);
    // The share slides with time, not only when a report arrives.
    state.stale.ledger.overall();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics::render(),
    )
        .into_response()
}

#[derive(Deserialize)]
struct CalendarQuery {
    from: Option<String>,
    to: Option<String>,
}

#[derive(Serialize, utoipa::ToSchema)]
struct CalendarBody {
    hotel_id: i64,
    /// The hotel row as the copy holds it, so the whole copy can be compared
    /// with the owner through the API (`vacancy bench faults`).
    #[schema(value_type = Object)]
    hotel: crate::model::Hotel,
    #[schema(value_type = String, example = "0/16B3748")]
    lsn: Lsn,
    lag_ms: u64,
    room_types: Vec<RoomTypeCalendar>,
}

#[derive(Serialize, utoipa::ToSchema)]
struct RoomTypeCalendar {
    room_type_id: i64,
    name: String,
    max_guests: i16,
    nights: Vec<NightBody>,
}

#[derive(Serialize, utoipa::ToSchema)]
struct NightBody {
    night: NaiveDate,
    #[serde(flatten)]
    #[schema(inline)]
    counts: NightCounts,
    free: i32,
}

fn date_param(field: &'static str, value: Option<&str>) -> Result<NaiveDate, Problem> {
    let value = value.ok_or(Problem::InvalidParameter {
        field,
        detail: "is required (YYYY-MM-DD)".into(),
    })?;
    NaiveDate::parse_from_str(value, "%Y-%m-%d").map_err(|_| Problem::InvalidParameter {
        field,
        detail: "must be a date like 2027-06-10".into(),
    })
}

/// The longest calendar one request may ask for (a two-year horizon and some).
const MAX_CALENDAR_DAYS: i64 = 800;

/// The copy's raw values for one hotel, with the LSN they reflect.
#[utoipa::path(get, path = "/v1/hotels/{hotel_id}/calendar", tag = "operations",
    params(
        ("hotel_id" = i64, Path, description = "hotel id"),
        ("from" = String, Query, description = "first night, YYYY-MM-DD"),
        ("to" = String, Query, description = "night after the last, YYYY-MM-DD"),
    ),
    responses(
        (status = 200, description = "the copy's counts per room type and night", body = CalendarBody),
        (status = 400, description = "invalid parameter", body = ProblemBody, content_type = "application/problem+json"),
        (status = 404, description = "no such hotel", body = ProblemBody, content_type = "application/problem+json"),
        (status = 503, description = "not ready", body = ProblemBody, content_type = "application/problem+json"),
    ))]
async fn calendar(
    State(state): State<ApiState>,
    Path(hotel_id): Path<String>,
    Query(q): Query<CalendarQuery>,
) -> Result<Response, Problem> {
    let hotel_id: i64 = hotel_id.parse().map_err(|_| Problem::InvalidParameter {
        field: "hotel_id",
        detail: "must be an integer".into(),
    })?;
    let from = date_param("from", q.from.as_deref())?;
    let to = date_param("to", q.to.as_deref())?;
    if to <= from {
        return Err(Problem::InvalidParameter {
            field: "to",
            detail: "must be after `from`".into(),
        });
    }
    if (to - from).num_days() > MAX_CALENDAR_DAYS {
        return Err(Problem::InvalidParameter {
            field: "to",
            detail: format!("the range may span at most {MAX_CALENDAR_DAYS} days"),
        });
    }
    if !state.model.freshness.is_loaded() {
        return Err(Problem::NotReady {
            reason: "the initial snapshot is not loaded yet".into(),
        });
    }
    let body = {
        let t = state.model.read();
        let Some(hotel) = t.hotels.get(&hotel_id).cloned() else {
            return Err(Problem::HotelNotFound(hotel_id));
        };
        let room_types: Vec<RoomTypeCalendar> = t
            .room_types_of(hotel_id)
            .map(|rt| {
                let key = crate::model::CalendarKey {
                    hotel_id,
                    room_type_id: rt.id,
                };
                let nights = t
                    .calendars
                    .get(&key)
                    .map(|c| {
                        c.range(from, to)
                            .map(|(night, counts)| NightBody {
                                night,
                                counts,
                                free: counts.free(),
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                RoomTypeCalendar {
                    room_type_id: rt.id,
                    name: rt.name.clone(),
                    max_guests: rt.max_guests,
                    nights,
                }
            })
            .collect();
        CalendarBody {
            hotel_id,
            hotel,
            lsn: t.applied,
            lag_ms: state.model.freshness.lag_ms(Utc::now()),
            room_types,
        }
    };
    Ok(([(header::CACHE_CONTROL, "max-age=1")], Json(body)).into_response())
}

impl From<ParamError> for Problem {
    fn from(e: ParamError) -> Problem {
        Problem::InvalidParameter {
            field: e.field,
            detail: e.detail,
        }
    }
}

impl From<SearchError> for Problem {
    fn from(e: SearchError) -> Problem {
        match e {
            SearchError::HotelNotFound(id) => Problem::HotelNotFound(id),
            SearchError::Index(e) => Problem::InvalidParameter {
                field: "q",
                detail: e.to_string(),
            },
        }
    }
}

/// Searches answer from the copy while it is loaded and close enough to the
/// owner. Past the lag bound they answer 503 with Retry-After, so callers
/// back off, or, with `search.when_lagging = "owner"`, read every shown room
/// type from the owner. `Ok(true)` means "lagging: read the owner".
fn search_ready(state: &ApiState) -> Result<bool, Problem> {
    let f = &state.model.freshness;
    if !f.is_loaded() {
        return Err(Problem::NotReady {
            reason: "the initial snapshot is not loaded yet".into(),
        });
    }
    let lag = f.lag_ms(Utc::now());
    if lag > state.settings.search.max_lag_ms {
        if state.settings.search.when_lagging == WhenLagging::Owner {
            return Ok(true);
        }
        return Err(Problem::NotReady {
            reason: format!("the copy lags {lag} ms behind the owner"),
        });
    }
    Ok(false)
}

fn stay_rules(settings: &ApiSettings) -> StayRules {
    StayRules {
        today: Utc::now().date_naive(),
        horizon_days: settings.search.horizon_days,
        max_stay_nights: settings.search.max_stay_nights,
    }
}

/// A JSON answer with its freshness headers. `size_hint` is about the
/// encoded length: a search answer is tens of kilobytes, and a buffer grown
/// from axum's default 128 bytes would be copied a dozen times on the way.
fn fresh_json<T: Serialize>(lsn: Lsn, body: T, size_hint: usize) -> Response {
    let mut buf = Vec::with_capacity(size_hint);
    let mut response = match serde_json::to_writer(&mut buf, &body) {
        Ok(()) => ([(header::CONTENT_TYPE, "application/json")], buf).into_response(),
        // Only a failing Serialize impl gets here; axum answers it the same way.
        Err(_) => Json(body).into_response(),
    };
    let headers = response.headers_mut();
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("max-age=1"));
    if let Ok(v) = HeaderValue::from_str(&lsn.to_string()) {
        headers.insert("vacancy-lsn", v);
    }
    response
}

/// `GET /v1/search`: hotels that can host the party on every night.
#[utoipa::path(get, path = "/v1/search", tag = "search",
    params(
        ("city" = Option<String>, Query, description = "exact city, case-insensitive (give exactly one of city, q, bbox, hotel_ids)"),
        ("q" = Option<String>, Query, description = "free text over hotel names, city and room type names"),
        ("bbox" = Option<String>, Query, description = "min_lat,min_lon,max_lat,max_lon"),
        ("hotel_ids" = Option<String>, Query, description = "comma-separated ids, at most 250"),
        ("check_in" = String, Query, description = "YYYY-MM-DD, not in the past"),
        ("check_out" = String, Query, description = "YYYY-MM-DD, after check_in, at most 30 nights later"),
        ("room" = Vec<i32>, Query, description = "guests in one room; repeat per room, at most 8", explode = true),
        ("stars_min" = Option<i32>, Query, description = "0 to 5"),
        ("amenities" = Option<String>, Query, description = "comma-separated; all must be present"),
        ("max_price_cents" = Option<i64>, Query, description = "most a room type may cost for the whole stay"),
        ("sort" = Option<String>, Query, description = "price | stars | availability | relevance"),
        ("limit" = Option<i32>, Query, description = "1 to 100, default 20"),
        ("cursor" = Option<String>, Query, description = "next_cursor of the previous page"),
        ("min_lsn" = Option<String>, Query, description = "answer only with data at or past this LSN (read-your-writes)"),
    ),
    responses(
        (status = 200, description = "matching hotels, with the LSN and lag the answer reflects", body = crate::search::SearchAnswer),
        (status = 400, description = "invalid parameter", body = ProblemBody, content_type = "application/problem+json"),
        (status = 503, description = "the copy is not ready or lags too far", body = ProblemBody, content_type = "application/problem+json"),
    ))]
async fn search(
    State(state): State<ApiState>,
    RawQuery(query): RawQuery,
) -> Result<Response, Problem> {
    let req = params::parse_search(query.as_deref().unwrap_or(""), stay_rules(&state.settings))?;
    let lagging = search_ready(&state)?;
    let answer = state.search.search(&req, lagging).await?;
    metrics::SEARCH_RESULTS.observe(answer.total_hotels as f64);
    // Measured: about 260 bytes per room type shown, quote included.
    let hint = 512
        + 300
            * answer
                .results
                .iter()
                .map(|h| h.room_types.len())
                .sum::<usize>();
    Ok(fresh_json(answer.lsn, answer, hint))
}

/// `GET /v1/hotels/{id}/availability`: one hotel's room types, night by night.
#[utoipa::path(get, path = "/v1/hotels/{hotel_id}/availability", tag = "search",
    params(
        ("hotel_id" = i64, Path, description = "hotel id"),
        ("check_in" = String, Query, description = "YYYY-MM-DD"),
        ("check_out" = String, Query, description = "YYYY-MM-DD"),
        ("room" = Vec<i32>, Query, description = "guests in one room; repeat per room", explode = true),
        ("min_lsn" = Option<String>, Query, description = "read-your-writes LSN"),
    ),
    responses(
        (status = 200, description = "every room type night by night", body = crate::search::Availability),
        (status = 400, description = "invalid parameter", body = ProblemBody, content_type = "application/problem+json"),
        (status = 404, description = "no such hotel", body = ProblemBody, content_type = "application/problem+json"),
        (status = 503, description = "not ready", body = ProblemBody, content_type = "application/problem+json"),
    ))]
async fn availability(
    State(state): State<ApiState>,
    Path(hotel_id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, Problem> {
    let hotel_id: i64 = hotel_id.parse().map_err(|_| Problem::InvalidParameter {
        field: "hotel_id",
        detail: "must be an integer".into(),
    })?;
    let req =
        params::parse_availability(query.as_deref().unwrap_or(""), stay_rules(&state.settings))?;
    let lagging = search_ready(&state)?;
    let answer = state.search.availability(hotel_id, &req, lagging).await?;
    let nights: usize = answer.room_types.iter().map(|r| r.nights.len()).sum();
    let hint = 512 + 300 * answer.room_types.len() + 64 * nights;
    Ok(fresh_json(answer.lsn, answer, hint))
}

impl From<ReportError> for Problem {
    fn from(e: ReportError) -> Problem {
        match e {
            ReportError::Invalid { field, detail } => Problem::InvalidParameter { field, detail },
            ReportError::Quote(e) => Problem::InvalidQuote {
                detail: e.to_string(),
            },
            ReportError::QuoteMismatch { field } => Problem::QuoteMismatch { field },
            ReportError::AttemptReused => Problem::AttemptReused,
        }
    }
}

/// `POST /v1/take-outcomes`: the booking service reports one take.
///
/// Authenticated first (nothing about the body is looked at without a
/// valid token), then checked field by field, then recorded once per
/// `attempt_id`: a retry gets the first answer back with
/// `Idempotent-Replayed: true` and counts nothing.
#[utoipa::path(post, path = "/v1/take-outcomes", tag = "booking service",
    request_body = TakeOutcomeBody,
    security(("booking_token" = [])),
    responses(
        (status = 200, description = "recorded (or a retry of a recorded attempt, with Idempotent-Replayed: true)", body = crate::stale::outcomes::Recorded),
        (status = 400, description = "invalid field", body = ProblemBody, content_type = "application/problem+json"),
        (status = 401, description = "missing or wrong bearer token", body = ProblemBody, content_type = "application/problem+json"),
        (status = 409, description = "attempt id reported before with a different report", body = ProblemBody, content_type = "application/problem+json"),
        (status = 413, description = "body too large", body = ProblemBody, content_type = "application/problem+json"),
        (status = 422, description = "forged, altered or mismatched quote", body = ProblemBody, content_type = "application/problem+json"),
    ))]
async fn take_outcomes(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let authorization = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    if !state.booking_tokens.allows(authorization) {
        return Err(Problem::Unauthorized);
    }
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Problem::BodyTooLarge {
                limit: state.stale.max_body_bytes,
            }
        } else {
            Problem::InvalidParameter {
                field: "body",
                detail: "could not be read".into(),
            }
        }
    })?;
    let report = TakeOutcomeBody::from_json(&body)?.check(&state.stale.key)?;
    let (answer, replayed) = match state.stale.ledger.record(&report)? {
        Recording::New(a) => (a, false),
        Recording::Replay(a) => (a, true),
    };
    let mut response = Json(answer).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if replayed {
        headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok(response)
}

/// `GET /v1/bypass`: whether the booking service should read the owner
/// instead of trusting the copy for this take.
#[utoipa::path(get, path = "/v1/bypass", tag = "booking service",
    params(
        ("hotel_id" = i64, Query, description = "hotel id"),
        ("room_type_id" = i64, Query, description = "room type id"),
        ("check_in" = String, Query, description = "YYYY-MM-DD, not in the past"),
        ("check_out" = String, Query, description = "YYYY-MM-DD, after check_in"),
        ("rooms" = Option<i32>, Query, description = "units the take asks for, default 1"),
    ),
    responses(
        (status = 200, description = "the advice and why", body = crate::stale::bypass::Advice),
        (status = 400, description = "invalid parameter", body = ProblemBody, content_type = "application/problem+json"),
    ))]
async fn bypass(
    State(state): State<ApiState>,
    RawQuery(query): RawQuery,
) -> Result<Response, Problem> {
    let req = params::parse_bypass(query.as_deref().unwrap_or(""), stay_rules(&state.settings))?;
    let advice = state.stale.advise(&BypassQuestion {
        key: crate::model::CalendarKey {
            hotel_id: req.hotel_id,
            room_type_id: req.room_type_id,
        },
        stay: req.stay,
        rooms: req.rooms,
    });
    let mut response = Json(advice).into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(response)
}

/// `POST /v1/admin/resnapshot`: the projector takes a new snapshot (and a
/// new slot) while the current copy keeps serving, then swaps it in whole.
/// Answered 202 at once; `/v1/status` shows `resnapshotting` until done.
#[utoipa::path(post, path = "/v1/admin/resnapshot", tag = "operations",
    security(("admin_token" = [])),
    responses(
        (status = 202, description = "a new snapshot will be taken; the current copy serves meanwhile", body = ResnapshotAccepted),
        (status = 401, description = "missing or wrong admin token", body = ProblemBody, content_type = "application/problem+json"),
    ))]
async fn resnapshot(
    State(state): State<ApiState>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let authorization = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    if !state.admin_tokens.allows(authorization) {
        return Err(Problem::AdminUnauthorized);
    }
    state.status.request_resnapshot();
    tracing::warn!("resnapshot requested through the admin API");
    let body = ResnapshotAccepted {
        applied_lsn: state.model.freshness.applied(),
    };
    let mut response = (StatusCode::ACCEPTED, Json(body)).into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(response)
}

#[derive(Serialize, utoipa::ToSchema)]
struct ResnapshotAccepted {
    /// What the copy serving now reflects; the new one replaces it whole.
    #[schema(value_type = String, example = "0/16B3748")]
    applied_lsn: Lsn,
}

/// `GET /v1/stale-reads`: the 409-after-shown-available share over the
/// window, the hotels with the highest share, and the audit's findings.
#[utoipa::path(get, path = "/v1/stale-reads", tag = "operations",
    responses((status = 200, description = "the share, counts, top hotels and the audit", body = crate::stale::StaleReadsBody)))]
async fn stale_reads(State(state): State<ApiState>) -> Json<crate::stale::StaleReadsBody> {
    Json(state.stale.stale_reads())
}

/// The shape of every error body (RFC 9457), for the OpenAPI document.
#[derive(Serialize, utoipa::ToSchema)]
struct ProblemBody {
    /// Stable: clients branch on it, e.g. `/problems/invalid-parameter`.
    r#type: String,
    title: String,
    status: u16,
    detail: String,
    /// The offending parameter, for `/problems/invalid-parameter`.
    field: Option<String>,
}

#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "vacancy",
        description = "Guest search served from a read copy of a booking site's room inventory. Every answer says which owner LSN it reflects."
    ),
    paths(
        search,
        availability,
        events::hotel_events,
        take_outcomes,
        bypass,
        stale_reads,
        calendar,
        status,
        healthz,
        readyz,
        metrics_text,
        resnapshot
    ),
    components(schemas(
        ProblemBody,
        crate::search::SearchAnswer,
        crate::search::Availability,
        TakeOutcomeBody,
        crate::stale::outcomes::Recorded,
        crate::stale::bypass::Advice,
        crate::stale::StaleReadsBody,
        ResnapshotAccepted,
        events::SseEvent
    )),
    modifiers(&BookingTokenScheme, &LayerResponses)
)]
struct ApiDoc;

/// Paths whose handlers sit behind the per-client rate limit (`search_routes`
/// in `router`).
const RATE_LIMITED_PATHS: [&str; 3] = [
    "/v1/search",
    "/v1/hotels/{hotel_id}/availability",
    "/v1/bypass",
];

/// Documents the answers the middleware gives before any handler runs: 414
/// from `limit_query` on every operation, 429 from `rate_limit` on the
/// rate-limited ones. Added here, in one place, so a new route cannot miss
/// them.
struct LayerResponses;

impl utoipa::Modify for LayerResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{ContentBuilder, RefOr, Response, ResponseBuilder};
        let problem = |description: &str| -> RefOr<Response> {
            ResponseBuilder::new()
                .description(description)
                .content(
                    "application/problem+json",
                    ContentBuilder::new()
                        .schema(Some(utoipa::openapi::Ref::from_schema_name("ProblemBody")))
                        .build(),
                )
                .build()
                .into()
        };
        for (path, item) in openapi.paths.paths.iter_mut() {
            let rate_limited = RATE_LIMITED_PATHS.contains(&path.as_str());
            for op in [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.options,
                &mut item.head,
                &mut item.patch,
                &mut item.trace,
            ]
            .into_iter()
            .flatten()
            {
                op.responses.responses.insert(
                    "414".into(),
                    problem("query string longer than http.max_query_bytes"),
                );
                if rate_limited {
                    op.responses.responses.insert(
                        "429".into(),
                        problem("this client's rate limit is spent; see Retry-After"),
                    );
                }
            }
        }
    }
}

/// Declares the booking service's bearer token in the document.
struct BookingTokenScheme;

impl utoipa::Modify for BookingTokenScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "booking_token",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        components.add_security_scheme(
            "admin_token",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The OpenAPI 3 document, generated from the handlers' annotations.
async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(<ApiDoc as utoipa::OpenApi>::openapi())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regressions from the schemathesis run (.ci/api-fuzz): a long query
    /// got an undocumented 414, the rate limit an undocumented 429, and the
    /// events stream's items were documented as a bare string.
    #[test]
    fn openapi_documents_the_middleware_answers_and_sse_items() {
        let doc = serde_json::to_value(<ApiDoc as utoipa::OpenApi>::openapi()).unwrap();
        let paths = doc["paths"].as_object().unwrap();
        let mut operations = 0;
        for (path, item) in paths {
            for (method, op) in item.as_object().unwrap() {
                operations += 1;
                let responses = &op["responses"];
                assert!(
                    responses["414"]["content"]["application/problem+json"].is_object(),
                    "{method} {path}: 414 undocumented"
                );
                assert_eq!(
                    responses["429"].is_object(),
                    RATE_LIMITED_PATHS.contains(&path.as_str()),
                    "{method} {path}: 429"
                );
            }
        }
        assert!(operations >= 12, "{operations}");
        let sse = &doc["paths"]["/v1/hotels/{hotel_id}/events"]["get"]["responses"]["200"]["content"]
            ["text/event-stream"]["schema"];
        assert_eq!(sse["$ref"], "#/components/schemas/SseEvent", "{sse}");
        let event = &doc["components"]["schemas"]["SseEvent"]["properties"];
        for field in ["event", "id", "data", "retry"] {
            assert!(event[field].is_object(), "SseEvent.{field} missing");
        }
    }
}

//! The HTTP surface, one file per route group, in the order a request meets
//! them:
//!
//! - [`middleware`]: limits, the per-client rate limit, request metrics and
//!   timeouts, around every route.
//! - [`admission`]: the budgets of requests in flight (guests, the booking
//!   service; none for the probes), the excess answered 503 at once.
//! - [`guest_threads`]: the threads guest searches run on, apart from the
//!   ones that accept, shed and answer the booking service and the probes.
//! - [`guests`]: guest search and one hotel's availability.
//! - [`events`]: a hotel's committed changes as Server-Sent Events.
//! - [`page`]: the guest page at `/`.
//! - [`booking`]: the booking service's take outcomes, bypass advice and the
//!   stale-read share.
//! - [`operators`]: status, calendar, health, metrics and the admin resnapshot.
//! - [`access`]: who may call what: the rate limit's buckets, bearer tokens, CORS.
//! - [`problem`]: every error answer, as RFC 9457 problem+json.
//! - [`openapi`]: the OpenAPI document, generated from the handlers.
//!
//! Architecture invariant: handlers only read the model; they never write it.
//! Errors are RFC 9457 problem+json with a stable `type`, built in one place
//! (`Problem`), so a client can branch on `type` and never parses prose.

pub mod access;
mod admission;
mod booking;
pub mod events;
mod guest_threads;
mod guests;
mod middleware;
mod openapi;
mod operators;
pub mod page;
mod problem;
mod settings;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};

pub use guest_threads::{GuestThreads, OnGuestThreadsLayer};
pub use problem::Problem;
pub use settings::{AdminSettings, HttpSettings};

use crate::index::HotelIndex;
use crate::model::ReadModel;
use crate::search::{Search, SearchSettings};
use crate::stale::StaleReadState;
use crate::stream::StreamStatus;
use crate::stream::checkpoints::Checkpoints;
use access::{BearerTokens, ClientLimiter, CorsError};
use admission::Budget;

/// What every handler may read.
#[derive(Clone)]
pub struct ApiState {
    pub model: Arc<ReadModel>,
    pub search: Arc<Search>,
    /// Readiness waits until it holds every hotel of the loaded copy.
    pub hotel_index: Arc<HotelIndex>,
    pub status: Arc<StreamStatus>,
    /// What `/v1/status` shows of checkpoints.
    pub checkpoints: Arc<Checkpoints>,
    pub settings: Arc<ApiSettings>,
    pub stale: Arc<StaleReadState>,
    /// Tokens for `POST /v1/take-outcomes` (`stale.booking_tokens`, `stale.booking_tokens_file`).
    pub booking_tokens: Arc<BearerTokens>,
    /// Tokens for `/v1/admin/*` (`admin.tokens`, `admin.tokens_file`).
    pub admin_tokens: Arc<BearerTokens>,
    /// This node's role in the fleet and its progress there.
    pub fleet: Arc<crate::fleet::FleetStatus>,
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
/// `guest_threads`: where search and availability run (`GuestThreads`);
/// `None` runs them on the caller's runtime.
pub fn router(
    state: ApiState,
    guest_threads: Option<OnGuestThreadsLayer>,
) -> Result<Router, CorsError> {
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
    // /metrics reports how many clients have a bucket.
    let limiter_for_metrics = limiter.clone();
    let trust_forwarded_for = http.trust_forwarded_for;
    let rate_limit = axum::middleware::from_fn(move |req, next| {
        middleware::rate_limit(req, next, limiter.clone(), trust_forwarded_for)
    });
    // Guests: public, the most expensive to answer. Search and availability
    // are limited per client; all four share the guest budget, so past it a
    // guest gets a 503 at once instead of a place in a queue. The two that
    // rank and read the copy run on the guest threads (`guest_threads`);
    // the calendar and the event streams are light and stay here.
    let guest_permits = admission::permits(http.max_guest_requests_in_flight);
    let guest_threads = guest_threads.map(|layer| {
        layer.when_budget_nearly_full(guest_permits.clone(), http.max_guest_requests_in_flight)
    });
    let (search, availability) = match guest_threads {
        Some(layer) => (
            get(guests::search).layer(layer.clone()),
            get(guests::availability).layer(layer),
        ),
        None => (get(guests::search), get(guests::availability)),
    };
    let guest_routes = Router::new()
        .route("/v1/search", search)
        .route("/v1/hotels/{hotel_id}/availability", availability)
        .route_layer(rate_limit.clone())
        .route("/v1/hotels/{hotel_id}/calendar", get(operators::calendar))
        .route("/v1/hotels/{hotel_id}/events", get(events::hotel_events));
    let guest_routes = admission::admit_with(
        guest_routes,
        Budget::Guest,
        http.max_guest_requests_in_flight,
        &guest_permits,
    );
    // The booking service: a budget of its own, so a flood of guests never
    // delays or sheds its advice and reports. Bypass keeps the per-client
    // limit it had beside search (it needs no token).
    let booking_routes = Router::new()
        .route("/v1/bypass", get(booking::bypass))
        .route_layer(rate_limit)
        .route(
            "/v1/take-outcomes",
            post(booking::take_outcomes).layer(DefaultBodyLimit::max(state.stale.max_body_bytes)),
        )
        .route("/v1/stale-reads", get(booking::stale_reads));
    let booking_routes = admission::admit(
        booking_routes,
        Budget::Booking,
        http.max_booking_requests_in_flight,
    );
    // The probes and the operators' routes: no budget, so a node under a
    // flood still answers its load balancer and its scrapes.
    let router = Router::new()
        .route("/healthz", get(operators::healthz))
        .route("/readyz", get(operators::readyz))
        .route(
            "/metrics",
            get(move |state| operators::metrics_text(state, limiter_for_metrics.clone())),
        )
        .route("/openapi.json", get(openapi::openapi))
        .route("/v1/status", get(operators::status))
        .route("/v1/admin/resnapshot", post(operators::resnapshot))
        .merge(guest_routes)
        .merge(booking_routes)
        .merge(page::router())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Every route: no body read past this (take-outcomes sets its own
        // above, which wins), no query string past max_query_bytes.
        .layer(DefaultBodyLimit::max(http.max_body_bytes))
        .layer(axum::middleware::from_fn(move |req, next| {
            middleware::limit_query(req, next, max_query)
        }))
        .layer(axum::middleware::from_fn(move |req, next| {
            middleware::observe(req, next, timeout)
        }));
    // Outermost: preflights are answered before the limiter counts them, and
    // every answer (429s too) carries the CORS headers a browser needs to read it.
    let router = match cors {
        Some(cors) => router.layer(cors),
        None => router,
    };
    Ok(router.with_state(state))
}

async fn method_not_allowed() -> Problem {
    Problem::MethodNotAllowed
}

async fn not_found() -> Problem {
    Problem::NotFound
}

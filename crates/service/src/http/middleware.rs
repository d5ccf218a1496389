//! What every request passes through before a handler: the query-length
//! limit, the per-client rate limit (search routes), and request metrics with
//! the request timeout (admission control, per route group, is in
//! `admission`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, MatchedPath, Request};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::Problem;
use super::access::{self, ClientLimiter};
use super::admission::Shed;
use crate::metrics;

/// Refuses a query string longer than `http.max_query_bytes` before any
/// handler parses it.
pub(super) async fn limit_query(req: Request, next: Next, max: usize) -> Response {
    if req.uri().query().is_some_and(|q| q.len() > max) {
        return Problem::QueryTooLong { limit: max }.into_response();
    }
    next.run(req).await
}

/// One request from the client's bucket, or 429 with `Retry-After`.
pub(super) async fn rate_limit(
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
pub(super) async fn observe(req: Request, next: Next, timeout: Duration) -> Response {
    // A matched path is shared (cloning it counts a reference), where a
    // copy of its text cost an allocation per request.
    let matched = req.extensions().get::<MatchedPath>().cloned();
    let started = Instant::now();
    let in_flight = InFlight::enter();
    let response = match tokio::time::timeout(timeout, next.run(req)).await {
        Ok(r) => r,
        Err(_) => Problem::Timeout.into_response(),
    };
    drop(in_flight);
    if let Some(Shed(budget)) = response.extensions().get::<Shed>() {
        metrics::HTTP_SHED_DURATION
            .with_label_values(&[budget.as_str()])
            .observe(started.elapsed().as_secs_f64());
    }
    let route = matched.as_ref().map_or("unmatched", |p| p.as_str());
    metrics::HTTP_DURATION
        .with_label_values(&[route])
        .observe(started.elapsed().as_secs_f64());
    metrics::HTTP_REQUESTS
        .with_label_values(&[route, response.status().as_str()])
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

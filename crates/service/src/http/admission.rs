//! Admission control: each group of routes has a budget of requests in
//! flight, and a request past it is answered at once with 503
//! `/problems/overloaded` and `Retry-After: 1` instead of waiting in a queue.
//!
//! Why: past capacity (about 3,100 searches/s on two cores, issue 24) more
//! concurrent searches do not raise throughput, they only lengthen every
//! guest's wait, up to the request timeout. A fast 503 lets the load
//! balancer send the guest to another node, and the searches admitted keep
//! the latency of a machine at capacity, not of one with a growing queue.
//!
//! The budgets are separate so one group's flood never delays another: the
//! guests' routes share one, the booking service's another, and the probes
//! (`/healthz`, `/readyz`, `/metrics`) have none, so a node never looks
//! dead or not ready to its load balancer because guests flood it.
//!
//! Built from `tower`'s layers: a [`GlobalConcurrencyLimitLayer`] (one
//! semaphore shared by every route of the group; `ConcurrencyLimitLayer`
//! would give each route its own) under a [`LoadShedLayer`], which turns
//! "no permit free" into an immediate `Overloaded` error instead of a wait,
//! mapped to the answer by axum's [`HandleErrorLayer`]. A permit is held
//! until the handler has produced its response (an SSE stream's body goes
//! on without one: open streams have their own bound, `MAX_STREAMS`).

use std::sync::Arc;

use axum::Router;
use axum::error_handling::HandleErrorLayer;
use axum::response::{IntoResponse, Response};
use tokio::sync::Semaphore;
use tower::BoxError;
use tower::ServiceBuilder;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::load_shed::LoadShedLayer;
use tower::load_shed::error::Overloaded;

use super::Problem;
use crate::metrics;

/// A group of routes that shares one bound on requests in flight. The
/// name is the `budget` label of `vacancy_http_shed_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Budget {
    /// `/v1/search`, `/v1/hotels/{id}/availability`, `/calendar`, `/events`
    /// (`http.max_guest_requests_in_flight`).
    Guest,
    /// `/v1/bypass`, `POST /v1/take-outcomes`, `/v1/stale-reads`
    /// (`http.max_booking_requests_in_flight`).
    Booking,
}

impl Budget {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Budget::Guest => "guest",
            Budget::Booking => "booking",
        }
    }

    /// The setting that bounds it, named in the answer so an operator
    /// reading a 503 knows what to look at.
    fn setting(self) -> &'static str {
        match self {
            Budget::Guest => "http.max_guest_requests_in_flight",
            Budget::Booking => "http.max_booking_requests_in_flight",
        }
    }
}

/// Marks a shed answer for `middleware::observe`, which times it from the
/// request's arrival (`vacancy_http_shed_duration_seconds`): the time a
/// client measures under a flood is mostly its own.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shed(pub(super) Budget);

/// Puts every route added to `routes` so far behind `budget`: at most
/// `max_in_flight` of their requests are handled at once, the rest answered
/// 503 at once. `max_in_flight` 0 leaves them unbounded (`Settings` says so).
pub(super) fn admit<S>(routes: Router<S>, budget: Budget, max_in_flight: usize) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    admit_with(routes, budget, max_in_flight, &permits(max_in_flight))
}

/// The budget's permits, shared so others can see how full it is (the
/// guest threads hand a search over only when it is nearly full).
pub(super) fn permits(max_in_flight: usize) -> Arc<Semaphore> {
    Arc::new(Semaphore::new(max_in_flight))
}

/// As `admit`, with the budget's permits made by `permits`.
pub(super) fn admit_with<S>(
    routes: Router<S>,
    budget: Budget,
    max_in_flight: usize,
    permits: &Arc<Semaphore>,
) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    if max_in_flight == 0 {
        return routes;
    }
    routes.route_layer(
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(move |error: BoxError| async move {
                shed_answer(budget, max_in_flight, &error)
            }))
            .layer(LoadShedLayer::new())
            .layer(GlobalConcurrencyLimitLayer::with_semaphore(permits.clone())),
    )
}

/// The answer to a request past the budget. The only error this stack can
/// produce is `Overloaded` (the routes under it are infallible); anything
/// else would be a change to the stack, logged so it is not mistaken for load.
fn shed_answer(budget: Budget, max_in_flight: usize, error: &BoxError) -> Response {
    if !error.is::<Overloaded>() {
        tracing::error!(budget = budget.as_str(), %error, "admission stack failed; answered as overloaded");
    }
    metrics::HTTP_SHED
        .with_label_values(&[budget.as_str()])
        .inc();
    let mut response = Problem::Overloaded {
        setting: budget.setting(),
        max_in_flight,
    }
    .into_response();
    response.extensions_mut().insert(Shed(budget));
    response
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::body::Body;
    use axum::http::{Request, StatusCode, header};
    use axum::routing::get;
    use tokio::sync::Semaphore;
    use tower::ServiceExt;

    use super::*;

    const BUDGETS: [Budget; 2] = [Budget::Guest, Budget::Booking];

    /// A route whose requests count themselves in `entered`, then each wait
    /// for one permit of `gate`, so the test decides when they finish.
    fn held_route(gate: Arc<Semaphore>, entered: Arc<AtomicUsize>, bound: usize) -> Router {
        let routes = Router::new().route(
            "/held",
            get(move || {
                let gate = gate.clone();
                let entered = entered.clone();
                async move {
                    entered.fetch_add(1, Ordering::SeqCst);
                    gate.acquire().await.expect("gate open").forget();
                    "done"
                }
            }),
        );
        admit(routes, Budget::Guest, bound)
    }

    fn request() -> Request<Body> {
        Request::get("/held").body(Body::empty()).expect("request")
    }

    async fn until_entered(entered: &AtomicUsize, n: usize) {
        while entered.load(Ordering::SeqCst) < n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn past_the_bound_answers_503_at_once_and_admits_again_once_a_place_is_free() {
        let gate = Arc::new(Semaphore::new(0));
        let entered = Arc::new(AtomicUsize::new(0));
        let app = held_route(gate.clone(), entered.clone(), 2);
        let first = tokio::spawn(app.clone().oneshot(request()));
        let second = tokio::spawn(app.clone().oneshot(request()));
        until_entered(&entered, 2).await;

        let shed = app.clone().oneshot(request()).await.expect("infallible");
        assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            shed.headers()
                .get(header::RETRY_AFTER)
                .map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );
        assert!(matches!(
            shed.extensions().get::<Shed>(),
            Some(Shed(Budget::Guest))
        ));
        let body = axum::body::to_bytes(shed.into_body(), 64 * 1024)
            .await
            .expect("body");
        let problem: serde_json::Value = serde_json::from_slice(&body).expect("problem+json");
        assert_eq!(problem["type"], "/problems/overloaded");
        assert_eq!(entered.load(Ordering::SeqCst), 2, "the shed one never ran");

        gate.add_permits(1);
        let done = first.await.expect("task").expect("infallible");
        assert_eq!(done.status(), StatusCode::OK);
        // A place is free again: the next request is admitted and runs.
        let admitted = tokio::spawn(app.clone().oneshot(request()));
        until_entered(&entered, 3).await;
        gate.add_permits(2);
        for held in [admitted, second] {
            let answer = held.await.expect("task").expect("infallible");
            assert_eq!(answer.status(), StatusCode::OK);
        }
    }

    #[tokio::test]
    async fn a_bound_of_zero_admits_everything() {
        let gate = Arc::new(Semaphore::new(0));
        let entered = Arc::new(AtomicUsize::new(0));
        let app = held_route(gate.clone(), entered.clone(), 0);
        let held: Vec<_> = (0..8)
            .map(|_| tokio::spawn(app.clone().oneshot(request())))
            .collect();
        until_entered(&entered, 8).await;
        gate.add_permits(8);
        for h in held {
            let answer = h.await.expect("task").expect("infallible");
            assert_eq!(answer.status(), StatusCode::OK);
        }
    }

    #[test]
    fn every_budget_is_in_the_first_scrape() {
        metrics::init();
        let text = metrics::render();
        for budget in BUDGETS {
            for name in [
                "vacancy_http_shed_total",
                "vacancy_http_shed_duration_seconds_count",
            ] {
                let series = format!("{name}{{budget=\"{}\"}}", budget.as_str());
                assert!(text.contains(&series), "{series} missing from:\n{text}");
            }
        }
    }
}

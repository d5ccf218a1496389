//! Guest searches run on threads of their own, apart from the threads that
//! accept connections, shed the excess and answer the booking service and
//! the probes.
//!
//! Why: a search is CPU work (ranking every candidate of a city from the
//! copy), and on the server's own runtime the threads answering
//! `/v1/bypass` and `/readyz` would be the same threads, busy ranking.
//! Admission control bounds how many searches run at once, but under a
//! flood those few keep every core busy, and an answer of a tenth of a
//! millisecond then waits for the kernel to give a busy thread its turn
//! (issue 24: bypass p99 over 20 ms beside a flood). Here the server's
//! threads mostly sleep on the network, so the kernel runs them as soon as a
//! request arrives, ahead of the searching threads; the budgets are then
//! separate in CPU as well as in places in flight.
//!
//! Only when the guest budget is nearly full: a hand-over wakes a parked
//! guest thread and then the server's thread again, which at a few searches
//! in flight cost more than it saves (measured: 0.32 → 0.43 CPU ms per search
//! in `vacancy bench search`, 4 clients, when every search was handed over).
//! Under a flood the budget is full all the time, the guest threads never
//! park, and the hand-over is cheap; below it searches run where they
//! arrive, as without these threads. "Nearly full": at most a quarter of
//! the budget's permits free ([`HAND_OVER_WHEN_FREE_AT_MOST`]).
//!
//! The work moves, not the admission: the guest budget's permit is taken on
//! the server's runtime, before the request is handed over, and the hand
//! over is a task aborted when its request is dropped (the client went away,
//! or `http.request_timeout_ms` passed), so a dropped request does not keep
//! a searching thread busy past its next await while its permit is free.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

use tokio::runtime::{Handle, Runtime};
use tokio::sync::Semaphore;
use tokio_util::task::AbortOnDropHandle;
use tower::{Layer, Service};

use super::Problem;

/// The share of the guest budget that must be in use before a search is
/// handed over: at most this fraction of its permits free (1/4: 2 of 8).
const HAND_OVER_WHEN_FREE_AT_MOST: f64 = 0.25;

/// The runtime guest searches run on; shut down (without waiting) when dropped.
pub struct GuestThreads {
    /// `Some` until dropped: a runtime dropped inside another runtime's task
    /// panics, so `drop` takes it out and shuts it down in the background.
    runtime: Option<Runtime>,
}

impl std::fmt::Debug for GuestThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestThreads").finish_non_exhaustive()
    }
}

impl GuestThreads {
    /// `threads` workers (`http.guest_search_threads`); `None` for 0, which
    /// leaves searches on the server's runtime.
    pub fn start(threads: usize) -> std::io::Result<Option<GuestThreads>> {
        if threads == 0 {
            return Ok(None);
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("guest-search")
            .enable_all()
            .build()?;
        Ok(Some(GuestThreads {
            runtime: Some(runtime),
        }))
    }

    /// Hands every request over; `when_budget_nearly_full` narrows it.
    pub fn layer(&self) -> Option<OnGuestThreadsLayer> {
        self.runtime.as_ref().map(|runtime| OnGuestThreadsLayer {
            handle: runtime.handle().clone(),
            busy: None,
        })
    }
}

impl Drop for GuestThreads {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Searches still running are aborted; their requests were bounded
            // by the shutdown's own grace before the app let go of this.
            runtime.shutdown_background();
        }
    }
}

/// Runs a route's handler on the guest threads.
#[derive(Clone)]
pub struct OnGuestThreadsLayer {
    handle: Handle,
    busy: Option<Busy>,
}

/// When a request is handed over: while its budget has at most
/// `free_at_most` permits free (the request's own already taken).
#[derive(Clone)]
struct Busy {
    permits: Arc<Semaphore>,
    free_at_most: usize,
}

impl OnGuestThreadsLayer {
    /// Hands a request over only while the budget that `permits` are of
    /// (`max_in_flight` of them; 0: no budget, every request is handed
    /// over) is nearly full.
    pub fn when_budget_nearly_full(
        self,
        permits: Arc<Semaphore>,
        max_in_flight: usize,
    ) -> OnGuestThreadsLayer {
        if max_in_flight == 0 {
            return self;
        }
        // Rounded down: with a budget of 1 to 3, a request is handed over
        // only when it holds the last permit.
        let free_at_most = (max_in_flight as f64 * HAND_OVER_WHEN_FREE_AT_MOST) as usize;
        OnGuestThreadsLayer {
            busy: Some(Busy {
                permits,
                free_at_most,
            }),
            ..self
        }
    }
}

impl<S> Layer<S> for OnGuestThreadsLayer {
    type Service = OnGuestThreads<S>;

    fn layer(&self, inner: S) -> Self::Service {
        OnGuestThreads {
            inner,
            handle: self.handle.clone(),
            busy: self.busy.clone(),
        }
    }
}

#[derive(Clone)]
pub struct OnGuestThreads<S> {
    inner: S,
    handle: Handle,
    busy: Option<Busy>,
}

impl<S> Service<Request> for OnGuestThreads<S>
where
    S: Service<Request, Response = Response, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // Creating the handler's future runs none of it: all of its work is
        // done where it is polled, on the guest threads.
        let handler = self.inner.call(request);
        let quiet = self
            .busy
            .as_ref()
            .is_some_and(|b| b.permits.available_permits() > b.free_at_most);
        if quiet {
            return Box::pin(handler);
        }
        let task = AbortOnDropHandle::new(self.handle.spawn(handler));
        Box::pin(async move {
            match task.await {
                Ok(answered) => answered,
                Err(failed) => {
                    // Cancelled: the guest runtime is shutting down with the
                    // app. Panicked: a bug, logged; either way the guest gets
                    // a problem answer instead of a dropped connection.
                    if failed.is_panic() {
                        tracing::error!(error = %failed, "a guest search panicked");
                        Ok(Problem::Internal.into_response())
                    } else {
                        Ok(Problem::NotReady {
                            reason: "the service is shutting down".to_string(),
                        }
                        .into_response())
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use axum::Router;
    use axum::body::Body;
    use axum::http::StatusCode;
    use axum::routing::get;
    use tower::ServiceExt;

    use super::*;

    async fn thread_name() -> String {
        std::thread::current().name().unwrap_or("").to_string()
    }

    async fn panics() -> &'static str {
        panic!("a handler bug")
    }

    fn router(threads: &GuestThreads) -> Router {
        let layer = threads.layer().expect("threads > 0");
        Router::new()
            .route("/name", get(thread_name).layer(layer.clone()))
            .route("/panic", get(panics).layer(layer))
            .route("/here", get(thread_name))
    }

    async fn body_of(router: &Router, path: &str) -> (StatusCode, String) {
        let response = router
            .clone()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    #[tokio::test]
    async fn a_layered_route_runs_on_the_guest_threads_and_others_do_not() {
        let threads = GuestThreads::start(1).unwrap().unwrap();
        let router = router(&threads);
        assert_eq!(
            body_of(&router, "/name").await,
            (StatusCode::OK, "guest-search".to_string())
        );
        let (status, here) = body_of(&router, "/here").await;
        assert_eq!(status, StatusCode::OK);
        assert_ne!(here, "guest-search");
    }

    #[tokio::test]
    async fn a_search_is_handed_over_only_while_the_budget_is_nearly_full() {
        let threads = GuestThreads::start(1).unwrap().unwrap();
        let permits = Arc::new(Semaphore::new(8));
        let layer = threads
            .layer()
            .unwrap()
            .when_budget_nearly_full(permits.clone(), 8);
        let router = Router::new().route("/name", get(thread_name).layer(layer));
        // 5 of 8 in use (3 free): runs where it arrived.
        let held = permits.clone().acquire_many_owned(5).await.unwrap();
        let (_, here) = body_of(&router, "/name").await;
        assert_ne!(here, "guest-search", "handed over below the mark");
        // 6 of 8 in use (2 free, a quarter): handed over.
        let more = permits.clone().acquire_owned().await.unwrap();
        assert_eq!(body_of(&router, "/name").await.1, "guest-search");
        drop((held, more));
        assert_ne!(body_of(&router, "/name").await.1, "guest-search");
    }

    #[tokio::test]
    async fn a_panicking_handler_is_answered_with_a_problem() {
        let threads = GuestThreads::start(1).unwrap().unwrap();
        let (status, body) = body_of(&router(&threads), "/panic").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(body.contains("/problems/internal"), "{body}");
    }

    #[tokio::test]
    async fn zero_threads_leave_searches_where_they_are() {
        assert!(GuestThreads::start(0).unwrap().is_none());
    }

    #[tokio::test]
    async fn dropping_the_threads_inside_a_runtime_does_not_panic() {
        let threads = GuestThreads::start(2).unwrap().unwrap();
        drop(threads);
    }
}

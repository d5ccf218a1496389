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
use tokio::runtime::{Handle, Runtime};
use tokio_util::task::AbortOnDropHandle;
use tower::{Layer, Service};

use super::Problem;

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

    pub fn layer(&self) -> Option<OnGuestThreadsLayer> {
        self.runtime.as_ref().map(|runtime| OnGuestThreadsLayer {
            handle: runtime.handle().clone(),
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
}

impl<S> Layer<S> for OnGuestThreadsLayer {
    type Service = OnGuestThreads<S>;

    fn layer(&self, inner: S) -> Self::Service {
        OnGuestThreads {
            inner,
            handle: self.handle.clone(),
        }
    }
}

#[derive(Clone)]
pub struct OnGuestThreads<S> {
    inner: S,
    handle: Handle,
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

//! The load generator of `vacancy bench overload`, apart from the server it
//! floods.
//!
//! Why its own threads and runtime: inside the server's runtime, thousands
//! of client tasks queue beside the server's own, and every latency measured
//! is mostly the client's scheduling (the bypass prober's too). On threads of
//! their own, the kernel shares the two cores between client and server as
//! it does between `wrk` and a server.
//!
//! Why hyper's connection-level client rather than the lab's pooled
//! `HttpClient`: each connection is owned by one task (the bench is the
//! pool, as a load balancer is), which costs the client a fraction of a
//! pooled request and leaves the cores to the server measured.
//!
//! Guests and connections: `connections` connections carry `guests` guests
//! between them, as a load balancer's pool to a backend carries many
//! browsers. A guest answered 503 waits out the `Retry-After`
//! it was given (at most [`MAX_BACKOFF`]) before it asks again, and its
//! connection carries the other guests meanwhile; a guest answered otherwise
//! asks again at once (a closed loop, like `wrk`'s connections).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::{SendRequest, handshake};
use hyper::header::{HOST, RETRY_AFTER};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tokio::net::TcpStream;

/// A request over loopback past this counts as failed (the service's own
/// request timeout, 5 s by default, answers first).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest back-off a guest takes, whatever `Retry-After` says: the
/// issue's bound, so a long back-off cannot meet the goals by cutting the load.
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// A connection that failed is opened again after this, so a refused
/// connect does not spin.
const RECONNECT_PAUSE: Duration = Duration::from_millis(50);
/// How often an idle connection (every guest backing off) looks at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(100);

/// What one guest saw of one request.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sample {
    /// When the answer (or the failure) came back.
    pub(super) at: Instant,
    pub(super) latency: Duration,
    /// 0: no answer (a connection error or the client's timeout).
    pub(super) status: u16,
}

impl Sample {
    pub(super) fn sent(&self) -> Instant {
        self.at - self.latency
    }
}

/// When a guest asks again after an answer that was not a 503.
#[derive(Debug, Clone, Copy)]
pub(super) enum Pace {
    /// At once: the flood's guests.
    ClosedLoop,
    /// A steady rate, one request per period: the bypass prober.
    Every(Duration),
}

/// The path of a guest's next request, drawn from the connection's generator.
pub(super) type PathOf = Arc<dyn Fn(&mut ChaCha8Rng) -> String + Send + Sync>;

pub(super) struct FloodPlan {
    pub(super) addr: SocketAddr,
    pub(super) connections: u32,
    /// Guests in all, spread over the connections as evenly as they go.
    pub(super) guests: u32,
    pub(super) pace: Pace,
    pub(super) path_of: PathOf,
    /// Workers of the generator's runtime: 1 is a current-thread runtime.
    pub(super) worker_threads: usize,
    /// Seeds the connections' generators, so two floods differ.
    pub(super) seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum FloodError {
    #[error("the load generator's runtime: {0}")]
    Runtime(std::io::Error),
    #[error("the load generator's thread panicked")]
    Panicked,
    #[error("the load generator's thread did not stop within {0:?}")]
    NotStopped(Duration),
}

/// A running flood: its thread, and the flag that stops it.
pub(super) struct Flood {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Sample>>,
}

impl Flood {
    /// Starts the flood on a thread and runtime of its own.
    pub(super) fn start(plan: FloodPlan) -> Result<Flood, FloodError> {
        let runtime = if plan.worker_threads <= 1 {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(plan.worker_threads)
                .thread_name("flood")
                .enable_all()
                .build()
        }
        .map_err(FloodError::Runtime)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop_seen = stop.clone();
        let thread = std::thread::Builder::new()
            .name("flood".to_string())
            .spawn(move || runtime.block_on(flood(plan, stop_seen)))
            .map_err(FloodError::Runtime)?;
        Ok(Flood { stop, thread })
    }

    /// Stops every connection after its request in flight and returns every
    /// guest's samples. Waits on a blocking thread, at most `limit`.
    pub(super) async fn finish(self, limit: Duration) -> Result<Vec<Sample>, FloodError> {
        self.stop.store(true, Ordering::Release);
        let thread = self.thread;
        let joined =
            tokio::time::timeout(limit, tokio::task::spawn_blocking(move || thread.join()))
                .await
                .map_err(|_| FloodError::NotStopped(limit))?;
        match joined {
            Ok(Ok(samples)) => Ok(samples),
            Ok(Err(_)) | Err(_) => Err(FloodError::Panicked),
        }
    }
}

async fn flood(plan: FloodPlan, stop: Arc<AtomicBool>) -> Vec<Sample> {
    let connections: Vec<_> = (0..plan.connections)
        .map(|index| {
            let stop = stop.clone();
            let path_of = plan.path_of.clone();
            let seed = plan
                .seed
                .wrapping_mul(1_000_003)
                .wrapping_add(u64::from(index));
            let share = plan.guests / plan.connections.max(1)
                + u32::from(index < plan.guests % plan.connections.max(1));
            tokio::spawn(drive(
                plan.addr,
                share.max(1) as usize,
                plan.pace,
                path_of,
                seed,
                stop,
            ))
        })
        .collect();
    let mut samples = Vec::new();
    for connection in connections {
        // A connection's task ends only when the flag is set; one that
        // panicked loses its own samples, not the others'.
        samples.extend(connection.await.unwrap_or_default());
    }
    samples
}

/// One connection and its guests, until the stop flag is set.
async fn drive(
    addr: SocketAddr,
    guests: usize,
    pace: Pace,
    path_of: PathOf,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> Vec<Sample> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut samples = Vec::new();
    // When each guest may ask next.
    let mut due = vec![Instant::now(); guests];
    let mut sender: Option<SendRequest<Empty<Bytes>>> = None;
    while !stop.load(Ordering::Acquire) {
        let Some((guest, guest_due)) = due.iter().copied().enumerate().min_by_key(|&(_, at)| at)
        else {
            break;
        };
        let now = Instant::now();
        if guest_due > now {
            tokio::time::sleep_until(guest_due.min(now + STOP_POLL).into()).await;
            continue;
        }
        let path = path_of(&mut rng);
        let sent = Instant::now();
        let answer = tokio::time::timeout(CLIENT_TIMEOUT, exchange(&mut sender, addr, &path)).await;
        let at = Instant::now();
        let (status, backoff) = match answer {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) | Err(_) => {
                // A connection that failed or timed out is not reused.
                sender = None;
                tokio::time::sleep(RECONNECT_PAUSE).await;
                (0, None)
            }
        };
        samples.push(Sample {
            at,
            latency: at - sent,
            status,
        });
        due[guest] = match (backoff, pace) {
            (Some(wait), _) => at + wait,
            (None, Pace::ClosedLoop) => at,
            (None, Pace::Every(period)) => sent + period,
        };
    }
    samples
}

#[derive(Debug, thiserror::Error)]
enum ExchangeError {
    #[error("connect: {0}")]
    Connect(#[from] std::io::Error),
    #[error("http: {0}")]
    Http(#[from] hyper::Error),
    #[error("request: {0}")]
    Request(#[from] hyper::http::Error),
}

/// One request on the connection (opened first when there is none): its
/// status and, for a 503, how long the guest backs off (its `Retry-After`,
/// at most [`MAX_BACKOFF`]; that bound when it names none in whole seconds).
/// The body is read whole, so the connection can carry the next request.
async fn exchange(
    sender: &mut Option<SendRequest<Empty<Bytes>>>,
    addr: SocketAddr,
    path: &str,
) -> Result<(u16, Option<Duration>), ExchangeError> {
    let open = match sender.take() {
        Some(open) if !open.is_closed() => open,
        _ => connect(addr).await?,
    };
    let connection = sender.insert(open);
    connection.ready().await?;
    let request = Request::get(path)
        .header(HOST, addr.to_string())
        .body(Empty::<Bytes>::new())?;
    let response = connection.send_request(request).await?;
    let status = response.status();
    let backoff = (status == StatusCode::SERVICE_UNAVAILABLE).then(|| {
        response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(MAX_BACKOFF, Duration::from_secs)
            .min(MAX_BACKOFF)
    });
    response.into_body().collect().await?;
    Ok((status.as_u16(), backoff))
}

async fn connect(addr: SocketAddr) -> Result<SendRequest<Empty<Bytes>>, ExchangeError> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = handshake(TokioIo::new(stream)).await?;
    // The connection's own task reads and writes the socket; it ends when
    // the sender is dropped or the server closes.
    tokio::spawn(connection);
    Ok(sender)
}

//! Wiring: start the projector, the heartbeat, the slot watch (both in
//! `stream`), the
//! divergence audit and the HTTP server under one shutdown token, and stop
//! them in order. A task that panics stops them all (`Tasks`).
//!
//! `start` takes an already bound listener, so tests and the demo can bind
//! port 0 and learn the address.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use futures_util::FutureExt as _;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::fleet::{self, Role};
use crate::http::{self, ApiSettings, ApiState};
use crate::index::{self, HotelIndex};
use crate::metrics;
use crate::model::ReadModel;
use crate::owner;
use crate::search::Search;
use crate::stale::{self, StaleReadState};
use crate::stream::checkpoints::{self, Checkpoints};
use crate::stream::outbox::Outbox;
use crate::stream::refresh::{self, Refresh};
use crate::stream::{Projector, StreamStatus, heartbeat, slot_watch};

/// A running `vacancy`: its copy, its stream status, and how to stop it.
pub struct App {
    pub model: Arc<ReadModel>,
    pub status: Arc<StreamStatus>,
    pub refresh: Arc<Refresh>,
    pub hotel_index: Arc<HotelIndex>,
    /// Quote key, take-outcome ledger, bypass policy, divergence audit.
    pub stale: Arc<StaleReadState>,
    /// Where the copy came from and the newest checkpoint written.
    pub checkpoints: Arc<Checkpoints>,
    pub addr: std::net::SocketAddr,
    shutdown: CancellationToken,
    tasks: Tasks,
    /// Where guest searches run (`http.guest_search_threads`); shut down
    /// after the tasks, when the app is dropped.
    _guest_threads: Option<http::GuestThreads>,
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Index(#[from] crate::index::IndexError),
    #[error(transparent)]
    SecretFile(#[from] crate::setting::SecretFileError),
    #[error(transparent)]
    Cors(#[from] http::access::CorsError),
    #[error(transparent)]
    Owner(#[from] owner::EndpointError),
}

/// Tasks still running when the shutdown grace ran out.
#[derive(Debug, thiserror::Error)]
#[error("tasks did not stop within {grace:?}")]
pub struct StopTimeout {
    pub grace: Duration,
}

/// Starts every task; returns once the HTTP listener is serving.
pub fn start(settings: Settings, listener: TcpListener) -> Result<App, AppError> {
    metrics::init();
    let settings = Arc::new(settings);
    let model = ReadModel::new();
    let status = Arc::new(StreamStatus::default());
    let shutdown = CancellationToken::new();
    let addr = listener.local_addr()?;

    // Read once here so a missing password or root file stops the start
    // with its name; every connect reads them again (rotation).
    let owner_tls = owner::Endpoint::from_settings(&settings.owner)?.ssl_mode();
    let own_stale = StaleReadState::new(
        &settings.stale,
        &settings.owner,
        &settings.stream,
        settings.search.few_units_threshold,
        model.clone(),
    )?;
    // In a fleet the ledger counts the fleet's outcome stream, never a
    // report posted here alone.
    let stale = Arc::new(if settings.fleet.is_fleet() {
        own_stale.shared_by_fleet()
    } else {
        own_stale
    });
    let outcomes = settings.fleet.is_fleet().then(|| {
        fleet::outcomes::OutcomeStream::new(settings.fleet.clone(), stale.clone(), model.clone())
    });
    let booking_tokens = Arc::new(http::access::booking_tokens(&settings.stale)?);
    let admin_tokens = Arc::new(http::access::admin_tokens(&settings.admin)?);
    let checkpoints = Checkpoints::new(settings.checkpoint.clone());
    checkpoints.carry_also(stale.clone());
    let (fleet_status, outbox_receiver) = fleet_parts(&settings, outcomes.clone());
    if let Some(outbox) = &fleet_status.outbox {
        checkpoints.record_outbox(outbox.state());
    }
    let refresh = Refresh::new(Duration::from_secs(settings.model.ttl_secs));
    let hotel_index = HotelIndex::new()?;
    // Built before any task starts, so a bad setting leaves nothing running.
    let search = Arc::new(
        Search::new(
            &settings.owner,
            &settings.search,
            &settings.stream.schema,
            model.clone(),
            hotel_index.clone(),
        )
        .with_stale(stale.clone())
        .nudging_while(match settings.fleet.role {
            Role::Standalone => Arc::new(AtomicBool::new(true)),
            Role::Projector => fleet_status.active.clone(),
            Role::Replica => Arc::new(AtomicBool::new(false)),
        }),
    );
    let guest_threads = http::GuestThreads::start(settings.http.guest_search_threads)?;
    let router = http::router(
        ApiState {
            model: model.clone(),
            search,
            hotel_index: hotel_index.clone(),
            status: status.clone(),
            checkpoints: checkpoints.clone(),
            settings: Arc::new(ApiSettings {
                http: settings.http.clone(),
                search: settings.search.clone(),
                slot: settings.stream.slot.clone(),
                publication: settings.stream.publication.clone(),
            }),
            stale: stale.clone(),
            booking_tokens,
            admin_tokens,
            fleet: fleet_status.clone(),
        },
        guest_threads.as_ref().and_then(http::GuestThreads::layer),
    )?;
    let mut tasks = Tasks::new(shutdown.clone());
    tasks.spawn(
        "index",
        index::run_indexer(
            hotel_index.clone(),
            model.clone(),
            Duration::from_millis(200),
            shutdown.clone(),
        ),
    );
    // A replica's task, or a standby projector's follower: the same copy,
    // index and status as everything else here.
    let replica_of = |state| fleet::replica::Replica {
        settings: settings.fleet.clone(),
        owner: settings.owner.clone(),
        slot: settings.stream.slot.clone(),
        publication: settings.stream.publication.clone(),
        held: settings.stream.clone(),
        model: model.clone(),
        index: hotel_index.clone(),
        status: status.clone(),
        state,
        stale: stale.clone(),
    };
    match settings.fleet.role {
        Role::Standalone | Role::Projector => {
            let projector = Projector::new(
                settings.owner.clone(),
                settings.stream.clone(),
                model.clone(),
                status.clone(),
                refresh.clone(),
                hotel_index.clone(),
                checkpoints.clone(),
            );
            match (&fleet_status.outbox, outbox_receiver) {
                (Some(outbox), Some(receiver)) => {
                    let standby = fleet::standby::Standby {
                        projector: projector.with_outbox(outbox.clone()).yield_when_slot_busy(),
                        follower: replica_of(fleet_status.follower.clone().unwrap_or_default()),
                        owner: settings.owner.clone(),
                        slot: settings.stream.slot.clone(),
                        model: model.clone(),
                        refresh: refresh.clone(),
                        checkpoints: checkpoints.clone(),
                        active: fleet_status.active.clone(),
                        outbox: outbox.state(),
                    };
                    // The uploader outlives the projector, whose last
                    // checkpoint is written after shutdown begins.
                    let projector_done = CancellationToken::new();
                    let done = projector_done.clone();
                    let standby_shutdown = shutdown.clone();
                    tasks.spawn("standby", async move {
                        // Dropped when the projector ends, by a return or a
                        // panic's unwind alike: the uploader never waits
                        // out the grace for a projector that is gone.
                        let _done = done.drop_guard();
                        standby.run(standby_shutdown).await;
                    });
                    tasks.spawn(
                        "publisher",
                        fleet::publish::run_publisher(
                            settings.fleet.clone(),
                            outbox.state(),
                            receiver,
                            shutdown.clone(),
                        ),
                    );
                    tasks.spawn(
                        "uploader",
                        fleet::store::run_uploader(
                            settings.fleet.clone(),
                            checkpoints.clone(),
                            projector_done,
                        ),
                    );
                }
                _ => tasks.spawn("projector", projector.run(shutdown.clone())),
            }
            // A fleet projector checkpoints and beats only while it holds
            // the slot; a standalone node always does.
            let only_while_active = fleet_status
                .outbox
                .is_some()
                .then(|| fleet_status.active.clone());
            tasks.spawn(
                "checkpointer",
                checkpoints::run_checkpointer(
                    checkpoints.clone(),
                    model.clone(),
                    refresh.clone(),
                    status.clone(),
                    only_while_active.clone(),
                    shutdown.clone(),
                ),
            );
            tasks.spawn(
                "refresher",
                refresh::run_refresher(
                    settings.owner.clone(),
                    settings.stream.schema.clone(),
                    settings.model.refresh_batch as usize,
                    model.clone(),
                    refresh.clone(),
                    shutdown.clone(),
                ),
            );
            if settings.stream.heartbeat_interval_ms > 0 {
                tasks.spawn(
                    "heartbeat",
                    heartbeat::run_heartbeat(
                        settings.owner.clone(),
                        Duration::from_millis(settings.stream.heartbeat_interval_ms),
                        only_while_active,
                        shutdown.clone(),
                    ),
                );
            }
            tasks.spawn(
                "slot_watch",
                slot_watch::run_slot_watch(
                    settings.owner.clone(),
                    settings.stream.clone(),
                    model.clone(),
                    status.clone(),
                    shutdown.clone(),
                ),
            );
        }
        Role::Replica => {
            // No slot, no refresher, no heartbeat: a replica never writes
            // to the owner.
            let replica = replica_of(fleet_status.replica.clone().unwrap_or_default());
            tasks.spawn("replica", replica.run(shutdown.clone()));
            tasks.spawn(
                "owner_position",
                fleet::replica::run_owner_position(
                    settings.owner.clone(),
                    settings.fleet.owner_position_interval(),
                    model.clone(),
                    shutdown.clone(),
                ),
            );
        }
    }

    tasks.spawn(
        "audit",
        stale::audit::run(stale.audit.clone(), shutdown.clone()),
    );
    if let Some(outcomes) = outcomes {
        tasks.spawn("outcomes", fleet::outcomes::run(outcomes, shutdown.clone()));
    }

    let http_shutdown = shutdown.clone();
    let events_model = model.clone();
    tasks.spawn("http", async move {
        // The peer address is the rate limit's client (http::access).
        let service = router.into_make_service_with_connect_info::<std::net::SocketAddr>();
        // On shutdown: stop accepting, let requests in flight finish (each is
        // bounded by http.request_timeout_ms; `App::stop` bounds the whole).
        let serving = axum::serve(listener, service).with_graceful_shutdown(async move {
            http_shutdown.cancelled().await;
            // Event streams never finish on their own: end them so the drain can.
            events_model.feed.close();
        });
        if let Err(error) = serving.await {
            tracing::error!(%error, "http server failed");
        }
    });
    tracing::info!(%addr, owner_sslmode = %owner_tls, "listening");
    Ok(App {
        model,
        status,
        refresh,
        hotel_index,
        stale,
        checkpoints,
        addr,
        shutdown,
        tasks,
        _guest_threads: guest_threads,
    })
}

/// The process's background tasks, each spawned with a name.
///
/// A task that panics stops the process: logged at error, named by
/// `App::panicked_task`, and `vacancy serve` exits non-zero, so a
/// supervisor restarts it whole (from a checkpoint, cheaply). Before, the
/// panic ended that task alone and the process served on without it: a
/// TTL re-read that panicked on one owner row left the safety net off with
/// nothing to show for it.
struct Tasks {
    handles: Vec<JoinHandle<()>>,
    shutdown: CancellationToken,
    panicked: Arc<std::sync::OnceLock<&'static str>>,
}

impl Tasks {
    fn new(shutdown: CancellationToken) -> Tasks {
        Tasks {
            handles: Vec::new(),
            shutdown,
            panicked: Arc::default(),
        }
    }

    fn spawn(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        let shutdown = self.shutdown.clone();
        let panicked = self.panicked.clone();
        self.handles.push(tokio::spawn(async move {
            // The task's state is dropped with it: nothing of it is observed
            // after the unwind, so no broken invariant can be seen.
            if let Err(payload) = std::panic::AssertUnwindSafe(task).catch_unwind().await {
                let message = payload
                    .downcast_ref::<&str>()
                    .copied()
                    .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                    .unwrap_or("(no message)");
                tracing::error!(
                    task = name,
                    panic = message,
                    "a background task panicked: stopping"
                );
                // The first one is the cause; the rest may follow from it.
                let _ = panicked.set(name);
                shutdown.cancel();
            }
        }));
    }
}

/// The first background task that panicked (`App::panicked`).
#[derive(Debug, Clone)]
pub struct PanickedTask(Arc<std::sync::OnceLock<&'static str>>);

impl PanickedTask {
    pub fn name(&self) -> Option<&'static str> {
        self.0.get().copied()
    }
}

/// The fleet's parts for this role: the projector's outbox (and its
/// receiving end, for the publisher), a replica's progress, and every
/// fleet node's outcome stream.
fn fleet_parts(
    settings: &Settings,
    outcomes: Option<Arc<fleet::outcomes::OutcomeStream>>,
) -> (
    Arc<fleet::FleetStatus>,
    Option<tokio::sync::mpsc::Receiver<crate::stream::outbox::Outgoing>>,
) {
    let role = settings.fleet.role;
    let mut status = fleet::FleetStatus::new(&settings.fleet);
    status.outcomes = outcomes;
    match role {
        Role::Standalone => (Arc::new(status), None),
        Role::Projector => {
            let (outbox, receiver) = Outbox::new(
                settings.fleet.max_publishes_in_flight,
                settings.fleet.publish_ack_timeout(),
            );
            status.outbox = Some(outbox);
            status.follower = Some(Arc::default());
            (Arc::new(status), Some(receiver))
        }
        Role::Replica => {
            status.replica = Some(Arc::default());
            (Arc::new(status), None)
        }
    }
}

impl App {
    /// Binds `settings.http.listen` and starts.
    pub async fn bind_and_start(settings: Settings) -> Result<App, AppError> {
        let listener = TcpListener::bind(&settings.http.listen)
            .await
            .map_err(|source| AppError::Bind {
                addr: settings.http.listen.clone(),
                source,
            })?;
        start(settings, listener)
    }

    /// A token that stops everything when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stops every task: the stream sends its final status update, the HTTP
    /// server drains requests in flight; all bounded by `grace`.
    pub async fn stop(self, grace: Duration) {
        if let Err(error) = self.stop_within(grace).await {
            tracing::warn!(%error, "shutdown incomplete");
        }
    }

    /// As `stop`, but says whether everything stopped within `grace`, so
    /// `vacancy serve` can exit non-zero when it did not (the last
    /// acknowledgement may then be missing, and a supervisor should know).
    pub async fn stop_within(self, grace: Duration) -> Result<(), StopTimeout> {
        self.shutdown.cancel();
        let all = futures_util::future::join_all(self.tasks.handles);
        tokio::time::timeout(grace, all)
            .await
            .map(|_| ())
            .map_err(|_| StopTimeout { grace })
    }

    /// Names the background task whose panic stopped the process, if one
    /// does: also one that panics during the shutdown (a last checkpoint, a
    /// last acknowledgement), so read it after `stop_within`.
    pub fn panicked(&self) -> PanickedTask {
        PanickedTask(self.tasks.panicked.clone())
    }

    /// Waits until the shutdown token is cancelled (by a signal, a caller,
    /// or a background task's panic).
    pub async fn stopped(&self) {
        self.shutdown.cancelled().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_task_that_panics_stops_the_process_and_is_named() {
        let shutdown = CancellationToken::new();
        let mut tasks = Tasks::new(shutdown.clone());
        tasks.spawn("finishes", async {});
        for handle in tasks.handles.drain(..) {
            handle.await.expect("the wrapper itself never panics");
        }
        assert!(
            !shutdown.is_cancelled(),
            "a task that returns stops nothing"
        );
        assert_eq!(tasks.panicked.get(), None);

        tasks.spawn("breaks", async { panic!("an owner row it could not read") });
        tasks.spawn("breaks later", async {
            tokio::task::yield_now().await;
            panic!("after the first")
        });
        for handle in tasks.handles.drain(..) {
            handle.await.expect("the wrapper itself never panics");
        }
        assert!(shutdown.is_cancelled());
        assert_eq!(tasks.panicked.get(), Some(&"breaks"));
    }
}

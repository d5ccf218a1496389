//! Wiring: start the projector, the heartbeat, the slot watch, the
//! divergence audit and the HTTP server under one shutdown token, and stop
//! them in order.
//!
//! `start` takes an already bound listener, so tests and the demo can bind
//! port 0 and learn the address.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::api::{self, ApiState};
use crate::config::Settings;
use crate::index::{self, HotelIndex};
use crate::metrics;
use crate::model::ReadModel;
use crate::owner;
use crate::search::Search;
use crate::stale::{self, StaleLoop};
use crate::stream::refresh::{self, Refresh};
use crate::stream::{Projector, StreamStatus, slot};

/// A running `vacancy`: its copy, its stream status, and how to stop it.
pub struct App {
    pub model: Arc<ReadModel>,
    pub status: Arc<StreamStatus>,
    pub refresh: Arc<Refresh>,
    pub hotel_index: Arc<HotelIndex>,
    /// Quote key, take-outcome ledger, bypass policy, divergence audit.
    pub stale: Arc<StaleLoop>,
    pub addr: std::net::SocketAddr,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
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
    Stale(#[from] stale::StaleError),
    #[error(transparent)]
    Cors(#[from] crate::access::CorsError),
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
    let stale = Arc::new(StaleLoop::new(&settings, model.clone(), status.clone())?);
    let admin_tokens = Arc::new(crate::access::admin_tokens(&settings.admin)?);
    let refresh = Refresh::new(Duration::from_secs(settings.model.ttl_secs));
    let hotel_index = HotelIndex::new()?;
    // Built before any task starts, so a bad setting leaves nothing running.
    let search = Arc::new(
        Search::new(&settings, model.clone(), hotel_index.clone()).with_stale(stale.clone()),
    );
    let router = api::router(ApiState {
        model: model.clone(),
        search,
        status: status.clone(),
        settings: settings.clone(),
        stale: stale.clone(),
        admin_tokens,
    })?;
    let projector = Projector::new(
        settings.clone(),
        model.clone(),
        status.clone(),
        refresh.clone(),
        hotel_index.clone(),
    );
    let mut tasks = vec![
        tokio::spawn(projector.run(shutdown.clone())),
        tokio::spawn(refresh::run_refresher(
            settings.clone(),
            model.clone(),
            refresh.clone(),
            shutdown.clone(),
        )),
        tokio::spawn(index::run_indexer(
            hotel_index.clone(),
            model.clone(),
            Duration::from_millis(200),
            shutdown.clone(),
        )),
    ];
    if settings.stream.heartbeat_interval_ms > 0 {
        tasks.push(tokio::spawn(heartbeat(settings.clone(), shutdown.clone())));
    }
    tasks.push(tokio::spawn(watch_slot(
        settings.clone(),
        model.clone(),
        status.clone(),
        shutdown.clone(),
    )));

    tasks.push(tokio::spawn(stale::audit::run(
        stale.audit.clone(),
        shutdown.clone(),
    )));

    let http_shutdown = shutdown.clone();
    let events_model = model.clone();
    tasks.push(tokio::spawn(async move {
        // The peer address is the rate limit's client (crate::access).
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
    }));
    tracing::info!(%addr, owner_sslmode = %owner_tls, "listening");
    Ok(App {
        model,
        status,
        refresh,
        hotel_index,
        stale,
        addr,
        shutdown,
        tasks,
    })
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
        let all = futures_util::future::join_all(self.tasks);
        tokio::time::timeout(grace, all)
            .await
            .map(|_| ())
            .map_err(|_| StopTimeout { grace })
    }

    /// Waits until the shutdown token is cancelled (by a signal or a caller).
    pub async fn stopped(&self) {
        self.shutdown.cancelled().await;
    }
}

/// Writes a transactional logical message at an interval, so the copy's lag
/// is measured from a recent commit even while the owner is idle.
async fn heartbeat(settings: Arc<Settings>, shutdown: CancellationToken) {
    let interval = Duration::from_millis(settings.stream.heartbeat_interval_ms);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut client = None;
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        if client.is_none() {
            client = owner::connect_configured(&settings.owner, settings.connect_timeout())
                .await
                .ok();
        }
        let Some(c) = &client else { continue };
        let beat = c.execute(
            "SELECT pg_logical_emit_message(true, 'vacancy.heartbeat', now()::text)",
            &[],
        );
        match tokio::time::timeout(settings.query_timeout(), beat).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                tracing::debug!(%error, "heartbeat failed");
                client = None;
            }
            Err(_) => client = None,
        }
    }
}

/// Reads the slot's state and the owner's WAL position at an interval.
async fn watch_slot(
    settings: Arc<Settings>,
    model: Arc<ReadModel>,
    status: Arc<StreamStatus>,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(Duration::from_millis(
        settings.stream.slot_watch_interval_ms,
    ));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut client = None;
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        if client.is_none() {
            client = owner::connect_configured(&settings.owner, settings.connect_timeout())
                .await
                .ok();
        }
        let Some(c) = &client else { continue };
        let read = async {
            let info = slot::slot_info(c, &settings.stream.slot).await?;
            let wal = slot::current_wal_lsn(c).await?;
            Ok::<_, slot::SlotError>((info, wal))
        };
        match tokio::time::timeout(settings.query_timeout(), read).await {
            Ok(Ok((info, wal))) => {
                model.freshness.note_server_wal_end(wal);
                metrics::SLOT_ACTIVE.set(i64::from(info.as_ref().is_some_and(|i| i.active)));
                metrics::SLOT_RETAINED_WAL
                    .set(info.as_ref().and_then(|i| i.retained_bytes).unwrap_or(0));
                status.set_slot(info);
            }
            Ok(Err(error)) => {
                tracing::debug!(%error, "slot watch failed");
                client = None;
            }
            Err(_) => client = None,
        }
    }
}

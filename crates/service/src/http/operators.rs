//! The operators' endpoints: health and readiness, `/v1/status`,
//! `/metrics`, one hotel's raw calendar, and the admin resnapshot.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{NaiveDate, Utc};
use serde::{Deserialize, Serialize};

use super::access::ClientLimiter;
use super::problem::ProblemBody;
use super::{ApiState, Problem, problem};
use crate::lsn::Lsn;
use crate::metrics;
use crate::model::{NightCounts, ReadModel};
use crate::owner::identity::OwnerReport;
use crate::stream::checkpoints::CheckpointReport;
use crate::stream::snapshot::SnapshotPhase;

#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "the process is alive", body = String)))]
pub(super) async fn healthz() -> &'static str {
    "ok"
}

/// Ready once a snapshot is loaded, no resnapshot is under way, every hotel
/// of the loaded copy is in the search index, and the copy lags less than
/// `http.ready_max_lag_ms`.
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
    if !state.hotel_index.holds_current_copy() {
        // A loaded copy whose hotels are not yet in the index answers every
        // search with nothing: behind a load balancer, a guest would be told
        // nothing is free.
        return Err(Problem::NotReady {
            reason: "the search index is being built for the loaded copy".into(),
        });
    }
    if !f.caught_up() {
        // Loaded from a checkpoint and still replaying the WAL since: the
        // copy may be minutes old, whatever the lag figure says before the
        // stream has reported the owner's position.
        return Err(Problem::NotReady {
            reason: format!(
                "the copy loaded from a checkpoint is catching up: applied {}, the owner was at {} after this start",
                f.applied(),
                f.server_wal_end()
            ),
        });
    }
    if let Some(replica) = &state.fleet.replica {
        // A replica: its own lag behind the change stream decides, not the
        // owner lag, which every replica shares when the projector or NATS
        // is down (all not-ready at once would be a site outage).
        let behind = replica.messages_behind();
        if behind > state.fleet.ready_max_messages_behind {
            return Err(Problem::NotReady {
                reason: format!("the replica is {behind} messages behind the change stream's end"),
            });
        }
        return Ok(());
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
        (status = 200, description = "ready: snapshot loaded, every hotel of it searchable, lag under the bound (a fleet replica: within fleet.ready_max_messages_behind of the change stream's end, whatever the owner lag)", body = String),
        (status = 503, description = "not ready", body = ProblemBody, content_type = "application/problem+json"),
    ))]
pub(super) async fn readyz(State(state): State<ApiState>) -> Result<&'static str, Problem> {
    readiness(&state).map(|()| "ready")
}

#[derive(Serialize, utoipa::ToSchema)]
pub(super) struct StatusBody {
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
    /// What the replication session waits for on the owner, while it
    /// waits: a new slot behind transactions open on the owner, named.
    waiting_for: Option<String>,
    model: ModelBody,
    checkpoint: CheckpointBody,
    fleet: crate::fleet::FleetReport,
    owner: OwnerBody,
}

/// Checkpoints: on or off, where the copy came from, the newest written,
/// and what a crash now would replay.
#[derive(Serialize, utoipa::ToSchema)]
struct CheckpointBody {
    enabled: bool,
    #[schema(value_type = Option<String>)]
    durable_lsn: Option<Lsn>,
    /// WAL applied but not yet covered by a durable checkpoint: the slot is
    /// not told of it, the owner keeps it, and a crash now replays it.
    unacknowledged_bytes: u64,
    /// Set when the owner's `max_slot_wal_keep_size` leaves less room than
    /// the WAL of about one checkpoint interval at the recent rate: the slot
    /// could be lost before the next checkpoint lets the owner free it.
    wal_warning: Option<String>,
    #[serde(flatten)]
    report: CheckpointReport,
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
pub(super) async fn status(State(state): State<ApiState>) -> Json<StatusBody> {
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
        waiting_for: state.status.waiting_for(),
        model: model_body(&state.model),
        checkpoint: checkpoint_body(&state),
        fleet: state.fleet.report(),
        owner: OwnerBody {
            sessions: state.status.owner_report(),
            copy_timeline: state.model.read().timeline,
        },
    })
}

/// `/v1/status` `owner`: which owner the copy follows (issue 24's failover).
#[derive(Serialize, utoipa::ToSchema)]
struct OwnerBody {
    /// The system identifier and timeline the replication sessions reached,
    /// the one before the last change, when the change was seen and how
    /// many there were; null on a node that does not stream (a replica).
    sessions: Option<OwnerReport>,
    /// The owner timeline the copy's positions are on (0: unknown). It
    /// differs from `sessions.current.timeline` while a failover's new
    /// snapshot is being taken.
    copy_timeline: u32,
}

fn unacknowledged_bytes(state: &ApiState) -> u64 {
    let applied = state.model.freshness.applied();
    if !state.checkpoints.enabled() {
        return 0;
    }
    state
        .checkpoints
        .durable()
        .map_or(0, |durable| durable.bytes_until(applied))
}

fn checkpoint_body(state: &ApiState) -> CheckpointBody {
    let slot = state.status.slot();
    let wal_warning = if state.checkpoints.enabled() {
        slot.as_ref().and_then(|s| s.safe_wal_bytes).and_then(|safe| {
            let rate = state.status.wal_bytes_per_second();
            let interval = state.checkpoints.interval().as_secs_f64();
            let needed = rate * interval;
            (needed >= safe as f64 * 0.8).then(|| {
                format!(
                    "the owner writes about {rate:.0} bytes/s of WAL, {needed:.0} per checkpoint interval of {interval} s, and the slot has {safe} bytes left before max_slot_wal_keep_size invalidates it"
                )
            })
        })
    } else {
        None
    };
    CheckpointBody {
        enabled: state.checkpoints.enabled(),
        durable_lsn: state.checkpoints.durable(),
        unacknowledged_bytes: unacknowledged_bytes(state),
        wal_warning,
        report: state.checkpoints.report(),
    }
}

#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain")))]
pub(super) async fn metrics_text(
    State(state): State<ApiState>,
    limiter: Option<Arc<ClientLimiter>>,
) -> Response {
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
    metrics::CHECKPOINT_UNACKNOWLEDGED.set(unacknowledged_bytes(&state) as i64);
    set_cache_sizes(&state, limiter.as_deref()).await;
    metrics::RUNTIME_ALIVE_TASKS.set(
        i64::try_from(
            tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks(),
        )
        .unwrap_or(i64::MAX),
    );
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

/// The bounded caches' entries and estimated bytes, as of this scrape.
async fn set_cache_sizes(state: &ApiState, limiter: Option<&ClientLimiter>) {
    let attempts = state.stale.ledger.attempt_entries();
    metrics::set_cache_size(
        "attempt_ids",
        attempts,
        attempts * crate::stale::outcomes::ATTEMPT_ENTRY_BYTES,
    );
    // No limiter (the limit is off): no buckets.
    let buckets = limiter.map_or(0, ClientLimiter::entries);
    metrics::set_cache_size(
        "rate_limit_buckets",
        buckets,
        buckets * super::access::BUCKET_ENTRY_BYTES,
    );
    let (answers, answer_bytes) = state.hotel_index.cached_answers();
    metrics::set_cache_size("search_candidates", answers, answer_bytes);
    let reads = state.search.owner.cached_reads().await;
    metrics::set_cache_size(
        "owner_read",
        reads,
        reads * crate::search::owner_read::OWNER_READ_ENTRY_BYTES,
    );
}

#[derive(Deserialize)]
pub(super) struct CalendarQuery {
    from: Option<String>,
    to: Option<String>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub(super) struct CalendarBody {
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
pub(super) async fn calendar(
    State(state): State<ApiState>,
    hotel_id: Result<Path<String>, PathRejection>,
    q: Result<Query<CalendarQuery>, QueryRejection>,
) -> Result<Response, Problem> {
    let hotel_id = problem::hotel_id(hotel_id)?;
    let q = problem::query(q)?;
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

/// `POST /v1/admin/resnapshot`: the projector takes a new snapshot (and a
/// new slot) while the current copy keeps serving, then swaps it in whole;
/// in the fleet that starts a new epoch, and every replica bootstraps from
/// its first checkpoint. On a replica: it bootstraps again from the newest
/// checkpoint.
/// Answered 202 at once; `/v1/status` shows `resnapshotting` until done.
#[utoipa::path(post, path = "/v1/admin/resnapshot", tag = "operations",
    security(("admin_token" = [])),
    responses(
        (status = 202, description = "a new snapshot will be taken (a replica: a new bootstrap); the current copy serves meanwhile", body = ResnapshotAccepted),
        (status = 401, description = "missing or wrong admin token", body = ProblemBody, content_type = "application/problem+json"),
    ))]
pub(super) async fn resnapshot(
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
pub(super) struct ResnapshotAccepted {
    /// What the copy serving now reflects; the new one replaces it whole.
    #[schema(value_type = String, example = "0/16B3748")]
    applied_lsn: Lsn,
}

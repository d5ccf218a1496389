//! The booking service's endpoints: `POST /v1/take-outcomes` (each take
//! with its quote), `GET /v1/bypass` (when to read the owner instead) and
//! `GET /v1/stale-reads` (the stale-read share).

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::guests::stay_rules;
use super::problem::ProblemBody;
use super::{ApiState, Problem};
use crate::search::params;
use crate::stale::BypassQuestion;
use crate::stale::outcomes::{Recording, TakeOutcomeBody};

/// `POST /v1/take-outcomes`: the booking service reports one take.
///
/// Authenticated first (nothing about the body is looked at without a
/// valid token), then checked field by field, then recorded once per
/// `attempt_id`: a retry gets the first answer back with
/// `Idempotent-Replayed: true` and counts nothing. In a fleet the report
/// is published to the fleet's outcome stream and answered once this node
/// counted it from there (`fleet::outcomes`), so every node counts it, and
/// the same way; when that stream cannot be reached the answer is 503.
/// So is a report to a node whose copy is not loaded yet, whose restored
/// checkpoint may still bring the counts a report must not add to twice.

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
        (status = 503, description = "the copy is not loaded yet (`/problems/not-ready`), or a fleet node could not publish the report to the fleet's outcome stream, or had not counted it from there in time; nothing was counted here alone: send it again", body = ProblemBody, content_type = "application/problem+json"),
    ))]
pub(super) async fn take_outcomes(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let authorization = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    if !state.booking_tokens.allows(authorization) {
        return Err(Problem::Unauthorized);
    }
    // Reports are taken once the copy is loaded. Until then a checkpoint's
    // carried counts and attempt ids may yet be restored (the first
    // session loads it, which waits for the owner): a report counted
    // before them counted twice when it had been counted before the
    // restart (the booking service retries one whose answer a shutdown
    // cut off), and its id no longer told a replay from a reuse.
    if !state.model.freshness.is_loaded() {
        return Err(Problem::NotReady {
            reason: "the copy is not loaded yet: take outcomes are counted once it is".into(),
        });
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
    let posted = TakeOutcomeBody::from_json(&body)?;
    let report = posted.clone().check(&state.stale.key)?;
    let recording = match &state.fleet.outcomes {
        Some(outcomes) => outcomes.submit(&posted, &report).await?,
        None => state.stale.ledger.record(&report)?,
    };
    let (answer, replayed) = match recording {
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
        ("check_in" = String, Query, description = "YYYY-MM-DD, not in the past anywhere (not before the date in UTC-12)"),
        ("check_out" = String, Query, description = "YYYY-MM-DD, after check_in"),
        ("rooms" = Option<i32>, Query, description = "units the take asks for, default 1"),
    ),
    responses(
        (status = 200, description = "the advice and why", body = crate::stale::bypass::Advice),
        (status = 400, description = "invalid parameter", body = ProblemBody, content_type = "application/problem+json"),
    ))]
pub(super) async fn bypass(
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

/// `GET /v1/stale-reads`: the stale-read share (409s after the copy showed
/// the units free, per take) over the window, the hotels with the highest
/// share, and the audit's findings.
#[utoipa::path(get, path = "/v1/stale-reads", tag = "operations",
    responses((status = 200, description = "the stale-read share (409s after the copy showed the units free, per take the owner answered, over the window), counts, top hotels and the audit", body = crate::stale::StaleReadsBody)))]
pub(super) async fn stale_reads(
    State(state): State<ApiState>,
) -> Json<crate::stale::StaleReadsBody> {
    Json(state.stale.stale_reads())
}

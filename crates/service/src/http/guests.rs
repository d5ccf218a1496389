//! Guest search: `GET /v1/search` and `GET /v1/hotels/{id}/availability`,
//! answered from the copy with the LSN and lag they reflect.

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use serde::Serialize;

use super::problem::ProblemBody;
use super::{ApiSettings, ApiState, Problem, problem};
use crate::lsn::Lsn;
use crate::metrics;
use crate::search::WhenLagging;
use crate::search::params::{self, StayRules};

/// Searches answer from the copy while it is loaded and close enough to the
/// owner. Past the lag bound they answer 503 with Retry-After, so callers
/// back off, or, with `search.when_lagging = "owner"`, read every shown room
/// type from the owner. `Ok(true)` means "lagging: read the owner".
fn search_ready(state: &ApiState) -> Result<bool, Problem> {
    let f = &state.model.freshness;
    if !f.is_loaded() {
        return Err(Problem::NotReady {
            reason: "the initial snapshot is not loaded yet".into(),
        });
    }
    let lag = f.lag_ms(Utc::now());
    if lag > state.settings.search.max_lag_ms {
        if state.settings.search.when_lagging == WhenLagging::Owner {
            return Ok(true);
        }
        return Err(Problem::NotReady {
            reason: format!("the copy lags {lag} ms behind the owner"),
        });
    }
    Ok(false)
}

pub(super) fn stay_rules(settings: &ApiSettings) -> StayRules {
    StayRules {
        today: earliest_date_anywhere(Utc::now()),
        horizon_days: settings.search.horizon_days,
        max_stay_nights: settings.search.max_stay_nights,
    }
}

/// The earliest calendar date it still is somewhere on Earth at `now`
/// (UTC−12): the first night a guest may still book. The owner's hotels
/// keep their own time zones, which the copy does not know; with the UTC
/// date, a guest in New York booking tonight after 20:00 was refused,
/// "check_in must not be in the past", on search, availability and bypass.
fn earliest_date_anywhere(now: chrono::DateTime<Utc>) -> chrono::NaiveDate {
    (now - chrono::Duration::hours(12)).date_naive()
}

/// A JSON answer with its freshness headers. `size_hint` is about the
/// encoded length: a search answer is tens of kilobytes, and a buffer grown
/// from axum's default 128 bytes would be copied a dozen times on the way.
fn fresh_json<T: Serialize>(lsn: Lsn, body: T, size_hint: usize) -> Response {
    let mut buf = Vec::with_capacity(size_hint);
    let mut response = match serde_json::to_writer(&mut buf, &body) {
        Ok(()) => ([(header::CONTENT_TYPE, "application/json")], buf).into_response(),
        // Only a failing Serialize impl gets here; axum answers it the same way.
        Err(_) => Json(body).into_response(),
    };
    let headers = response.headers_mut();
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("max-age=1"));
    if let Ok(v) = HeaderValue::from_str(&lsn.to_string()) {
        headers.insert("vacancy-lsn", v);
    }
    response
}

/// `GET /v1/search`: hotels that can host the party on every night.
#[utoipa::path(get, path = "/v1/search", tag = "search",
    params(
        ("city" = Option<String>, Query, description = "exact city, case-insensitive (give exactly one of city, q, bbox, hotel_ids)"),
        ("q" = Option<String>, Query, description = "free text over hotel names, city and room type names"),
        ("bbox" = Option<String>, Query, description = "min_lat,min_lon,max_lat,max_lon"),
        ("hotel_ids" = Option<String>, Query, description = "comma-separated ids, at most 250"),
        ("check_in" = String, Query, description = "YYYY-MM-DD, not in the past anywhere (not before the date in UTC-12)"),
        ("check_out" = String, Query, description = "YYYY-MM-DD, after check_in, at most 30 nights later"),
        ("room" = Vec<i32>, Query, description = "guests in one room; repeat per room, at most 8", explode = true),
        ("stars_min" = Option<i32>, Query, description = "0 to 5"),
        ("amenities" = Option<String>, Query, description = "comma-separated; all must be present"),
        ("max_price_cents" = Option<i64>, Query, description = "most a room type may cost for the whole stay"),
        ("sort" = Option<String>, Query, description = "price | stars | availability | relevance"),
        ("limit" = Option<i32>, Query, description = "1 to 100, default 20"),
        ("cursor" = Option<String>, Query, description = "next_cursor of the previous page"),
        ("min_lsn" = Option<String>, Query, description = "answer only with data at or past this position (read-your-writes): an answer's `position` (timeline/LSN, 1/0/16B3748), or a bare LSN taken as one of the copy's timeline"),
    ),
    responses(
        (status = 200, description = "matching hotels, with the LSN and lag the answer reflects", body = crate::search::SearchAnswer),
        (status = 400, description = "invalid parameter", body = ProblemBody, content_type = "application/problem+json"),
        (status = 409, description = "`/problems/timeline-changed`: min_lsn is of an owner timeline the copy no longer follows (the owner failed over)", body = ProblemBody, content_type = "application/problem+json"),
        (status = 503, description = "the copy is not ready or lags too far", body = ProblemBody, content_type = "application/problem+json"),
    ))]
pub(super) async fn search(
    State(state): State<ApiState>,
    RawQuery(query): RawQuery,
) -> Result<Response, Problem> {
    let req = params::parse_search(query.as_deref().unwrap_or(""), stay_rules(&state.settings))?;
    let lagging = search_ready(&state)?;
    let answer = state.search.search(&req, lagging).await?;
    metrics::SEARCH_RESULTS.observe(answer.total_hotels as f64);
    // Measured: about 260 bytes per room type shown, quote included.
    let hint = 512
        + 300
            * answer
                .results
                .iter()
                .map(|h| h.room_types.len())
                .sum::<usize>();
    Ok(fresh_json(answer.lsn, answer, hint))
}

/// `GET /v1/hotels/{id}/availability`: one hotel's room types, night by night.
#[utoipa::path(get, path = "/v1/hotels/{hotel_id}/availability", tag = "search",
    params(
        ("hotel_id" = i64, Path, description = "hotel id"),
        ("check_in" = String, Query, description = "YYYY-MM-DD"),
        ("check_out" = String, Query, description = "YYYY-MM-DD"),
        ("room" = Vec<i32>, Query, description = "guests in one room; repeat per room", explode = true),
        ("min_lsn" = Option<String>, Query, description = "read-your-writes position: an answer's `position` (1/0/16B3748) or a bare LSN"),
    ),
    responses(
        (status = 200, description = "every room type night by night", body = crate::search::Availability),
        (status = 400, description = "invalid parameter", body = ProblemBody, content_type = "application/problem+json"),
        (status = 404, description = "no such hotel", body = ProblemBody, content_type = "application/problem+json"),
        (status = 409, description = "`/problems/timeline-changed`: min_lsn is of an owner timeline the copy no longer follows", body = ProblemBody, content_type = "application/problem+json"),
        (status = 503, description = "not ready", body = ProblemBody, content_type = "application/problem+json"),
    ))]
pub(super) async fn availability(
    State(state): State<ApiState>,
    hotel_id: Result<Path<String>, PathRejection>,
    RawQuery(query): RawQuery,
) -> Result<Response, Problem> {
    let hotel_id = problem::hotel_id(hotel_id)?;
    let req =
        params::parse_availability(query.as_deref().unwrap_or(""), stay_rules(&state.settings))?;
    let lagging = search_ready(&state)?;
    let answer = state.search.availability(hotel_id, &req, lagging).await?;
    let nights: usize = answer.room_types.iter().map(|r| r.nights.len()).sum();
    let hint = 512 + 300 * answer.room_types.len() + 64 * nights;
    Ok(fresh_json(answer.lsn, answer, hint))
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    #[test]
    fn tonight_in_the_americas_is_still_bookable_after_midnight_utc() {
        // 21:00 in New York (EDT) on the 10th is 01:00 UTC on the 11th.
        let now = Utc.with_ymd_and_hms(2027, 6, 11, 1, 0, 0).unwrap();
        let tenth = chrono::NaiveDate::from_ymd_opt(2027, 6, 10).unwrap();
        assert_eq!(earliest_date_anywhere(now), tenth);
        // Once it is past noon UTC, the 10th has ended everywhere.
        let noon = Utc.with_ymd_and_hms(2027, 6, 11, 12, 0, 0).unwrap();
        assert_eq!(earliest_date_anywhere(noon), tenth.succ_opt().unwrap());
    }
}

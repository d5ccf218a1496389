//! Every error answer: RFC 9457 `application/problem+json` with a stable
//! `type`, and the one place where the modules' error kinds become HTTP
//! statuses.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use problem_details::ProblemDetails;
use serde::Serialize;

use axum::extract::Path;
use axum::extract::Query;
use axum::extract::rejection::{PathRejection, QueryRejection};

use crate::fleet::outcomes::OutcomeError;
use crate::index::IndexError;
use crate::search::SearchError;
use crate::search::params::ParamError;
use crate::stale::outcomes::ReportError;

/// Every error the API answers with. `type` values are stable: clients branch on them.
#[derive(Debug)]
pub enum Problem {
    NotReady {
        reason: String,
    },
    InvalidParameter {
        field: &'static str,
        detail: String,
    },
    HotelNotFound(i64),
    NotFound,
    /// A handler failed in a way no input explains (a bug; it is logged).
    Internal,
    Timeout,
    /// No bearer token, or not one of the booking service's.
    Unauthorized,
    /// A quote this service did not issue, or one altered since.
    InvalidQuote {
        detail: String,
    },
    /// A genuine quote for another room, hotel or stay than the report's.
    QuoteMismatch {
        field: &'static str,
    },
    /// An attempt id reported before with a different report.
    AttemptReused,
    BodyTooLarge {
        limit: usize,
    },
    /// A query string longer than `http.max_query_bytes`.
    QueryTooLong {
        limit: usize,
    },
    /// This client's search budget is spent for now.
    RateLimited {
        retry_after_secs: u64,
    },
    /// No bearer token, or not one of the admins'.
    AdminUnauthorized,
    /// The route's budget of requests in flight is full (`http::admission`):
    /// answered at once rather than queued. Retry here after `Retry-After`
    /// or on another node.
    Overloaded {
        setting: &'static str,
        max_in_flight: usize,
    },
    /// A fleet node could not put a take outcome through the fleet's
    /// outcome stream (NATS unreachable, no acknowledgement, or not counted
    /// back in time). Nothing was counted; a retry is safe.
    OutcomesUnavailable {
        detail: String,
    },
    /// A `min_lsn` of an owner timeline the copy no longer follows (the
    /// owner failed over): it can never be reached, so it is refused
    /// rather than waited for.
    TimelineChanged {
        detail: String,
    },
    /// The path exists, not for this method (`POST /v1/search`).
    MethodNotAllowed,
}

/// The `{hotel_id}` of a route's path, an integer, or the problem: a path
/// segment that is not UTF-8 is refused by axum before any handler, with a
/// plain-text answer unless mapped here.
pub(super) fn hotel_id(path: Result<Path<String>, PathRejection>) -> Result<i64, Problem> {
    let invalid = |detail: String| Problem::InvalidParameter {
        field: "hotel_id",
        detail,
    };
    let Path(text) = path.map_err(|rejection| invalid(rejection.body_text()))?;
    text.parse()
        .map_err(|_| invalid("must be an integer".to_string()))
}

/// A route's query string as its fields, or the problem (a field given
/// twice, one of the wrong kind): axum's own answer is plain text.
pub(super) fn query<T>(query: Result<Query<T>, QueryRejection>) -> Result<T, Problem> {
    query
        .map(|Query(fields)| fields)
        .map_err(|rejection| Problem::InvalidParameter {
            field: "query",
            detail: rejection.body_text(),
        })
}

impl Problem {
    fn parts(&self) -> (StatusCode, &'static str, &'static str, String) {
        match self {
            Problem::NotReady { reason } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "not-ready",
                "The copy is not ready to answer",
                reason.clone(),
            ),
            Problem::InvalidParameter { field, detail } => (
                StatusCode::BAD_REQUEST,
                "invalid-parameter",
                "A parameter is invalid",
                format!("{field}: {detail}"),
            ),
            Problem::HotelNotFound(id) => (
                StatusCode::NOT_FOUND,
                "hotel-not-found",
                "No such hotel",
                format!("hotel {id} is not in the copy"),
            ),
            Problem::NotFound => (
                StatusCode::NOT_FOUND,
                "not-found",
                "No such resource",
                String::new(),
            ),
            Problem::Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "The request failed inside the service",
                "the error is logged; try again".to_string(),
            ),
            Problem::Timeout => (
                StatusCode::SERVICE_UNAVAILABLE,
                "timeout",
                "The request took too long",
                "try again".to_string(),
            ),
            Problem::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "A booking service token is required",
                "send Authorization: Bearer <token>".to_string(),
            ),
            Problem::InvalidQuote { detail } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid-quote",
                "The quote was not issued by this service",
                detail.clone(),
            ),
            Problem::QuoteMismatch { field } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "quote-mismatch",
                "The quote does not describe this take",
                format!("the quote was issued for another {field}"),
            ),
            Problem::AttemptReused => (
                StatusCode::CONFLICT,
                "attempt-id-reused",
                "This attempt id was reported with a different outcome",
                "one attempt has one outcome; use a new attempt id for a new take".to_string(),
            ),
            Problem::BodyTooLarge { limit } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "The request body is too large",
                format!("at most {limit} bytes"),
            ),
            Problem::QueryTooLong { limit } => (
                StatusCode::URI_TOO_LONG,
                "query-too-long",
                "The query string is too long",
                format!("at most {limit} bytes"),
            ),
            Problem::RateLimited { retry_after_secs } => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate-limited",
                "Too many requests from this client",
                format!("try again in {retry_after_secs} s"),
            ),
            Problem::AdminUnauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "An admin token is required",
                "send Authorization: Bearer <token>".to_string(),
            ),
            Problem::Overloaded {
                setting,
                max_in_flight,
            } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                "Too many requests in flight; try again",
                format!(
                    "{max_in_flight} requests of this kind are in flight ({setting}); try again in 1 s, here or on another node"
                ),
            ),
            Problem::OutcomesUnavailable { detail } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "outcomes-unavailable",
                "The fleet's take-outcome stream is unavailable; the report was not counted here",
                format!("{detail}; send the same report again"),
            ),
            Problem::MethodNotAllowed => (
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "This path does not take this method",
                "see /openapi.json for the methods each path takes".to_string(),
            ),
            Problem::TimelineChanged { detail } => (
                StatusCode::CONFLICT,
                "timeline-changed",
                "The position is on an owner timeline this copy no longer follows",
                detail.clone(),
            ),
        }
    }
}

#[derive(Serialize)]
struct ProblemFields {
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'static str>,
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let (status, slug, title, detail) = self.parts();
        let field = match &self {
            Problem::InvalidParameter { field, .. } | Problem::QuoteMismatch { field } => {
                Some(*field)
            }
            Problem::InvalidQuote { .. } => Some("quote"),
            Problem::AttemptReused => Some("attempt_id"),
            Problem::QueryTooLong { .. } => Some("query"),
            Problem::TimelineChanged { .. } => Some("min_lsn"),
            _ => None,
        };
        let type_uri: axum::http::Uri = format!("/problems/{slug}")
            .parse()
            .expect("static slug is a valid URI");
        let body = ProblemDetails::new()
            .with_type(type_uri)
            .with_status(status)
            .with_title(title)
            .with_detail(detail)
            .with_extensions(ProblemFields { field });
        let mut response = body.into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let Problem::RateLimited { retry_after_secs } = self {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs));
        }
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<ParamError> for Problem {
    fn from(e: ParamError) -> Problem {
        Problem::InvalidParameter {
            field: e.field,
            detail: e.detail,
        }
    }
}

impl From<SearchError> for Problem {
    fn from(e: SearchError) -> Problem {
        match e {
            SearchError::HotelNotFound(id) => Problem::HotelNotFound(id),
            SearchError::Index(IndexError::BadQuery(detail)) => {
                Problem::InvalidParameter { field: "q", detail }
            }
            // The index itself failed: nothing the client sent explains it.
            SearchError::Index(error @ IndexError::Tantivy(_)) => {
                tracing::error!(%error, "search index failed");
                Problem::Internal
            }
            old @ SearchError::OldTimeline { .. } => Problem::TimelineChanged {
                detail: old.to_string(),
            },
            ahead @ SearchError::MinLsnAhead { .. } => Problem::InvalidParameter {
                field: "min_lsn",
                detail: ahead.to_string(),
            },
        }
    }
}

impl From<ReportError> for Problem {
    fn from(e: ReportError) -> Problem {
        match e {
            ReportError::Invalid { field, detail } => Problem::InvalidParameter { field, detail },
            ReportError::Quote(e) => Problem::InvalidQuote {
                detail: e.to_string(),
            },
            ReportError::QuoteMismatch { field } => Problem::QuoteMismatch { field },
            ReportError::AttemptReused => Problem::AttemptReused,
        }
    }
}

impl From<OutcomeError> for Problem {
    fn from(e: OutcomeError) -> Problem {
        match e {
            OutcomeError::Report(report) => Problem::from(report),
            unavailable @ (OutcomeError::Unavailable(_)
            | OutcomeError::NotApplied { .. }
            | OutcomeError::StreamMadeAgain { .. }) => Problem::OutcomesUnavailable {
                detail: unavailable.to_string(),
            },
        }
    }
}

/// The shape of every error body (RFC 9457), for the OpenAPI document.
#[derive(Serialize, utoipa::ToSchema)]
pub(super) struct ProblemBody {
    /// Stable: clients branch on it, e.g. `/problems/invalid-parameter`.
    r#type: String,
    title: String,
    status: u16,
    detail: String,
    /// The offending parameter, for `/problems/invalid-parameter`.
    field: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A free-text query the index refuses is the client's; the index
    /// failing is not, and is never blamed on `q`.
    #[test]
    fn an_index_failure_is_internal_and_a_bad_query_is_the_clients() {
        let failed = Problem::from(SearchError::Index(IndexError::Tantivy(
            tantivy::TantivyError::InternalError("segment gone".into()),
        )));
        assert_eq!(
            failed.into_response().status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        let bad = Problem::from(SearchError::Index(IndexError::BadQuery("blank".into())));
        assert!(matches!(bad, Problem::InvalidParameter { field: "q", .. }));
    }
}

//! The OpenAPI 3 document (`GET /openapi.json`), generated from the
//! handlers' annotations, plus the answers the middleware gives before any
//! handler runs.

use axum::Json;

use super::problem::ProblemBody;
use super::{booking, events, guests, operators};
use crate::stale::outcomes::TakeOutcomeBody;

#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "vacancy",
        description = "Guest search served from a read copy of a booking site's room inventory. Every answer says which owner LSN it reflects."
    ),
    paths(
        guests::search,
        guests::availability,
        events::hotel_events,
        booking::take_outcomes,
        booking::bypass,
        booking::stale_reads,
        operators::calendar,
        operators::status,
        operators::healthz,
        operators::readyz,
        operators::metrics_text,
        operators::resnapshot
    ),
    components(schemas(
        ProblemBody,
        crate::search::SearchAnswer,
        crate::search::OwnerPosition,
        crate::search::Availability,
        TakeOutcomeBody,
        crate::stale::outcomes::Recorded,
        crate::stale::bypass::Advice,
        crate::stale::StaleReadsBody,
        operators::ResnapshotAccepted,
        events::SseEvent
    )),
    modifiers(&BookingTokenScheme, &LayerResponses)
)]
struct ApiDoc;

/// Paths whose handlers sit behind the per-client rate limit (`search_routes`
/// in `router`).
const RATE_LIMITED_PATHS: [&str; 3] = [
    "/v1/search",
    "/v1/hotels/{hotel_id}/availability",
    "/v1/bypass",
];

/// Paths behind a budget of requests in flight (`admission::admit` in
/// `router`: the guests' and the booking service's), which may answer 503
/// `/problems/overloaded`. The probes are not: they have no budget.
const ADMITTED_PATHS: [&str; 7] = [
    "/v1/search",
    "/v1/hotels/{hotel_id}/availability",
    "/v1/hotels/{hotel_id}/calendar",
    "/v1/hotels/{hotel_id}/events",
    "/v1/bypass",
    "/v1/take-outcomes",
    "/v1/stale-reads",
];

/// Documents the answers the middleware gives before any handler runs: 414
/// from `limit_query` on every operation, 429 from `rate_limit` on the
/// rate-limited ones, 503 from admission control on the admitted ones (kept
/// where a handler documents its own 503). Added here, in one place, so a
/// new route cannot miss them.
struct LayerResponses;

impl utoipa::Modify for LayerResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{ContentBuilder, RefOr, Response, ResponseBuilder};
        let problem = |description: &str| -> RefOr<Response> {
            ResponseBuilder::new()
                .description(description)
                .content(
                    "application/problem+json",
                    ContentBuilder::new()
                        .schema(Some(utoipa::openapi::Ref::from_schema_name("ProblemBody")))
                        .build(),
                )
                .build()
                .into()
        };
        for (path, item) in openapi.paths.paths.iter_mut() {
            let rate_limited = RATE_LIMITED_PATHS.contains(&path.as_str());
            let admitted = ADMITTED_PATHS.contains(&path.as_str());
            for op in [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.options,
                &mut item.head,
                &mut item.patch,
                &mut item.trace,
            ]
            .into_iter()
            .flatten()
            {
                op.responses.responses.insert(
                    "414".into(),
                    problem("query string longer than http.max_query_bytes"),
                );
                if rate_limited {
                    op.responses.responses.insert(
                        "429".into(),
                        problem("this client's rate limit is spent; see Retry-After"),
                    );
                }
                if admitted {
                    op.responses.responses.entry("503".into()).or_insert_with(|| {
                        problem("not ready, or too many requests in flight (/problems/overloaded); see Retry-After")
                    });
                }
            }
        }
    }
}

/// Declares the booking service's bearer token in the document.
struct BookingTokenScheme;

impl utoipa::Modify for BookingTokenScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "booking_token",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        components.add_security_scheme(
            "admin_token",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The OpenAPI 3 document, generated from the handlers' annotations.
pub(super) async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(<ApiDoc as utoipa::OpenApi>::openapi())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regressions from the schemathesis run (.ci/api-fuzz): a long query
    /// got an undocumented 414, the rate limit an undocumented 429, and the
    /// events stream's items were documented as a bare string.
    #[test]
    fn openapi_documents_the_middleware_answers_and_sse_items() {
        let doc = serde_json::to_value(<ApiDoc as utoipa::OpenApi>::openapi()).unwrap();
        let paths = doc["paths"].as_object().unwrap();
        let mut operations = 0;
        for (path, item) in paths {
            for (method, op) in item.as_object().unwrap() {
                operations += 1;
                let responses = &op["responses"];
                assert!(
                    responses["414"]["content"]["application/problem+json"].is_object(),
                    "{method} {path}: 414 undocumented"
                );
                // The events route documents its own 429 (a client's share
                // of the streams, `http.max_event_streams_per_client`).
                let limited_per_client = RATE_LIMITED_PATHS.contains(&path.as_str())
                    || path == "/v1/hotels/{hotel_id}/events";
                assert_eq!(
                    responses["429"].is_object(),
                    limited_per_client,
                    "{method} {path}: 429"
                );
                if ADMITTED_PATHS.contains(&path.as_str()) {
                    assert!(
                        responses["503"].is_object(),
                        "{method} {path}: 503 overloaded undocumented"
                    );
                }
            }
        }
        assert!(operations >= 12, "{operations}");
        for path in ADMITTED_PATHS {
            assert!(paths.contains_key(path), "{path} is not in the document");
        }
        let sse = &doc["paths"]["/v1/hotels/{hotel_id}/events"]["get"]["responses"]["200"]["content"]
            ["text/event-stream"]["schema"];
        assert_eq!(sse["$ref"], "#/components/schemas/SseEvent", "{sse}");
        let event = &doc["components"]["schemas"]["SseEvent"]["properties"];
        for field in ["event", "id", "data", "retry"] {
            assert!(event[field].is_object(), "SseEvent.{field} missing");
        }
        // `/v1/status` documents the fleet part, and every schema it refers
        // to is in the document (a missing one fails the API fuzz run).
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        let fleet = &schemas["StatusBody"]["properties"]["fleet"];
        assert!(fleet.is_object(), "StatusBody.fleet missing");
        let text = doc.to_string();
        for reference in text.split("\"#/components/schemas/").skip(1) {
            let name = reference.split('"').next().unwrap();
            assert!(
                schemas.contains_key(name),
                "{name} is referred to but not defined"
            );
        }
    }
}

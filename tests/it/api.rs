//! The operator endpoints over real HTTP against a running `vacancy`.

use std::time::Duration;

use vacancy_service::Settings;

use crate::support::{TestOwner, wait_for};

/// A GET through the lab's HTTP client: status, headers (lowercase names)
/// and the body as text. Panics when no answer comes within 10 s.
pub async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, Vec<(String, String)>, String) {
    let r = vacancy_lab::http_client::get(addr, path, Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let headers = r
        .headers
        .iter()
        .map(|(name, value)| {
            (
                name.as_str().to_string(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect();
    (r.status, headers, r.text())
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_calendar_health_and_problems() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    client
        .batch_execute(
            "INSERT INTO hotels (id, name, city) VALUES (7, 'Seven', 'Lisbon');
             INSERT INTO room_types VALUES (7, 1, 'Double', 2), (7, 2, 'Suite', 4);
             INSERT INTO inventory (hotel_id, room_type_id, night, total, taken, sell_limit, price_cents)
               VALUES (7, 1, '2030-01-01', 5, 2, NULL, 9000), (7, 1, '2030-01-02', 5, 5, 6, 9100),
                      (7, 2, '2030-01-01', 1, 0, NULL, NULL);",
        )
        .await
        .unwrap();
    let mut settings = Settings::defaults();
    settings.owner.url = owner.url.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = vacancy_service::start(settings, listener).unwrap();
    let addr = app.addr;

    assert_eq!(get(addr, "/healthz").await.0, 200);
    wait_for("readyz to answer 200", Duration::from_secs(30), || async {
        (get(addr, "/readyz").await.0 == 200).then_some(())
    })
    .await;

    // Ready means the copy is loaded and fresh enough; the stream connects
    // a round trip later (START_REPLICATION), so status may say so after.
    let status = wait_for(
        "status to say connected",
        Duration::from_secs(30),
        || async {
            let (code, _, body) = get(addr, "/v1/status").await;
            assert_eq!(code, 200);
            let status: serde_json::Value = serde_json::from_str(&body).unwrap();
            (status["connected"] == true).then_some(status)
        },
    )
    .await;
    assert_eq!(status["snapshot"]["phase"], "loaded");
    assert_eq!(status["model"]["inventory_rows"], 3);
    let applied = status["applied_lsn"].as_str().unwrap();
    assert!(applied.parse::<vacancy_service::Lsn>().is_ok(), "{applied}");

    let (code, headers, body) =
        get(addr, "/v1/hotels/7/calendar?from=2030-01-01&to=2030-01-03").await;
    assert_eq!(code, 200, "{body}");
    assert!(header(&headers, "cache-control").is_some());
    let cal: serde_json::Value = serde_json::from_str(&body).unwrap();
    let double = &cal["room_types"][0];
    assert_eq!(double["room_type_id"], 1);
    assert_eq!(double["nights"][0]["free"], 3);
    assert_eq!(double["nights"][1]["free"], 1, "sell_limit 6 − taken 5");
    assert_eq!(
        cal["room_types"][1]["nights"][0]["price_cents"],
        serde_json::Value::Null
    );

    for (path, code, kind, field) in [
        (
            "/v1/hotels/7/calendar?from=2030-01-03&to=2030-01-01",
            400,
            "/problems/invalid-parameter",
            Some("to"),
        ),
        (
            "/v1/hotels/7/calendar?from=tomorrow&to=2030-01-01",
            400,
            "/problems/invalid-parameter",
            Some("from"),
        ),
        (
            "/v1/hotels/x/calendar?from=2030-01-01&to=2030-01-02",
            400,
            "/problems/invalid-parameter",
            Some("hotel_id"),
        ),
        (
            "/v1/hotels/7/calendar?to=2030-01-02",
            400,
            "/problems/invalid-parameter",
            Some("from"),
        ),
        (
            "/v1/hotels/99/calendar?from=2030-01-01&to=2030-01-02",
            404,
            "/problems/hotel-not-found",
            None,
        ),
        (
            "/v1/hotels/%FF/calendar?from=2030-01-01&to=2030-01-02",
            400,
            "/problems/invalid-parameter",
            Some("hotel_id"),
        ),
        (
            "/v1/hotels/%FF/availability?check_in=2030-01-01&check_out=2030-01-02&room=1",
            400,
            "/problems/invalid-parameter",
            Some("hotel_id"),
        ),
        (
            "/v1/hotels/7/calendar?from=2030-01-01&from=2030-01-02&to=2030-01-03",
            400,
            "/problems/invalid-parameter",
            Some("query"),
        ),
        (
            "/v1/hotels/7/events?from=2030-01-01&from=2030-01-02",
            400,
            "/problems/invalid-parameter",
            Some("query"),
        ),
        ("/nowhere", 404, "/problems/not-found", None),
    ] {
        let (got, headers, body) = get(addr, path).await;
        assert_eq!(got, code, "{path}: {body}");
        assert_eq!(
            header(&headers, "content-type"),
            Some("application/problem+json"),
            "{path}"
        );
        let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(problem["type"], kind, "{path}");
        assert_eq!(problem["status"], code, "{path}");
        if let Some(field) = field {
            assert_eq!(problem["field"], field, "{path}");
        }
    }

    // A path that exists, with a method it does not take.
    let client = vacancy_lab::http_client::HttpClient::new(addr, Duration::from_secs(10)).unwrap();
    let wrong_method = client
        .send(client.request(reqwest::Method::POST, "/v1/search"))
        .await
        .unwrap();
    assert_eq!(wrong_method.status, 405);
    assert_eq!(
        wrong_method.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(wrong_method.json()["type"], "/problems/method-not-allowed");

    // Every event stream a node keeps is open: overloaded, not "not ready"
    // (the copy is ready; a balancer must not take the node out for it).
    let open = app
        .model
        .feed
        .open_streams
        .swap(1 << 20, std::sync::atomic::Ordering::AcqRel);
    let (code, headers, body) = get(addr, "/v1/hotels/7/events").await;
    app.model
        .feed
        .open_streams
        .store(open, std::sync::atomic::Ordering::Release);
    assert_eq!(code, 503, "{body}");
    assert!(header(&headers, "retry-after").is_some());
    let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(problem["type"], "/problems/overloaded");

    let (code, _, doc) = get(addr, "/openapi.json").await;
    assert_eq!(code, 200);
    let doc: serde_json::Value = serde_json::from_str(&doc).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for path in [
        "/v1/search",
        "/v1/hotels/{hotel_id}/availability",
        "/v1/hotels/{hotel_id}/calendar",
        "/v1/status",
        "/readyz",
    ] {
        assert!(
            doc["paths"][path]["get"].is_object(),
            "{path} missing from /openapi.json"
        );
    }
    let answer = &doc["components"]["schemas"]["SearchAnswer"]["properties"];
    for field in ["lsn", "lag_ms", "results", "next_cursor", "total_hotels"] {
        assert!(answer[field].is_object(), "SearchAnswer.{field} missing");
    }

    let (code, _, metrics) = get(addr, "/metrics").await;
    assert_eq!(code, 200);
    for name in [
        "vacancy_build_info",
        "vacancy_stream_connected",
        "vacancy_http_requests_total",
        "vacancy_snapshot_rows_loaded_total",
        "vacancy_stream_lag_bytes",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
    app.stop(Duration::from_secs(5)).await;
}

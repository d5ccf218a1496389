//! The operator endpoints over real HTTP against a running `vacancy`.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vacancy_service::Settings;

use crate::support::{TestOwner, wait_for};

/// A minimal HTTP/1.1 GET: status, headers (lowercased names) and body.
pub async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, Vec<(String, String)>, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .expect("response in time")
        .unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").expect("http response");
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    // Bodies here are small; chunked encoding wraps them in a size line.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body.split("\r\n")
            .collect::<Vec<_>>()
            .chunks(2)
            .filter_map(|c| c.get(1).copied())
            .collect::<String>()
    } else {
        body.to_string()
    };
    (status, headers, body)
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

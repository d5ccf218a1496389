//! The workload beside the guests: a search loop over HTTP (counting what a
//! fault costs the people searching) and a hotelier changing hotels, room
//! types and capacity on the owner.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::NaiveDate;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::http_client::{HttpClient, HttpError};

use super::{HTTP_TIMEOUT, LoadCounts};

pub(super) async fn search_loop(
    addr: SocketAddr,
    cities: Vec<String>,
    first_night: NaiveDate,
    nights: i64,
    seed: u64,
    counts: Arc<std::sync::Mutex<LoadCounts>>,
    stop: CancellationToken,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // One client, one pool, as a guest's browser keeps: a fault then costs
    // what it costs a real client, not a connect per search.
    let client = match HttpClient::new(addr, HTTP_TIMEOUT) {
        Ok(client) => client,
        Err(error) => {
            let mut c = counts.lock().unwrap_or_else(|p| p.into_inner());
            c.failed += 1;
            *c.failures.entry(error.to_string()).or_default() += 1;
            return;
        }
    };
    while !stop.is_cancelled() && !cities.is_empty() {
        let city = &cities[rng.random_range(0..cities.len())];
        let stay: i64 = rng.random_range(1..=3);
        let start = rng.random_range(0..(nights - stay).max(1));
        let check_in = first_night + chrono::Days::new(start as u64);
        let check_out = check_in + chrono::Days::new(stay as u64);
        let city: String = form_urlencoded::byte_serialize(city.as_bytes()).collect();
        let path = format!(
            "/v1/search?city={city}&check_in={check_in}&check_out={check_out}&room=2&limit=10"
        );
        let kind = match client.get(&path).await {
            Ok(r) if (200..300).contains(&r.status) => None,
            Ok(r) if r.status == 503 => Some(None),
            Ok(r) => Some(Some(r.status.to_string())),
            Err(HttpError::Timeout(_)) => Some(Some("timeout".to_string())),
            Err(HttpError::Io(e)) => Some(Some(format!("{:?}", e.kind()))),
            Err(e) => Some(Some(e.to_string())),
        };
        {
            let mut c = counts.lock().unwrap_or_else(|p| p.into_inner());
            match kind {
                None => c.ok += 1,
                Some(None) => c.not_ready += 1,
                Some(Some(kind)) => {
                    c.failed += 1;
                    *c.failures.entry(kind).or_default() += 1;
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
}

/// A hotelier on the owner: capacity, hotel and room type changes, new room
/// types with their nights, nights leaving the sale. Independent of the API,
/// so the owner keeps changing while vacancy is down. Counts (ok, failed).
pub(super) async fn hotelier(
    url: String,
    hotel_ids: Vec<i64>,
    first_night: NaiveDate,
    nights: i64,
    seed: u64,
    counts: Arc<(AtomicU64, AtomicU64)>,
    stop: CancellationToken,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x4807_e11e);
    let mut client: Option<Client> = None;
    let mut step: i64 = 0;
    while !stop.is_cancelled() && !hotel_ids.is_empty() {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        if client.is_none() {
            client = vacancy_service::connect(&url, Duration::from_secs(2))
                .await
                .ok();
        }
        let Some(c) = client.as_mut() else {
            counts.1.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        step += 1;
        let hotel = hotel_ids[rng.random_range(0..hotel_ids.len())];
        let night = first_night + chrono::Days::new(rng.random_range(0..nights.max(1)) as u64);
        let done = match rng.random_range(0..100) {
            0..=54 => {
                let total = rng.random_range(0..12);
                crate::ops::set_capacity(
                    c,
                    hotel,
                    1,
                    night,
                    night + chrono::Days::new(2),
                    Some(total),
                    None,
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
            }
            55..=74 => c
                .execute(
                    "UPDATE hotels SET name = left(name, 40) || '*', stars = 1 + (coalesce(stars, 0) + 1) % 5,
                            amenities = amenities[2:] || amenities[1:1]
                     WHERE id = $1",
                    &[&hotel],
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            75..=84 => c
                .execute(
                    "UPDATE room_types SET name = left(name, 40) || '+', max_guests = 1 + max_guests % 6
                     WHERE hotel_id = $1 AND id = 1",
                    &[&hotel],
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            85..=92 => {
                // A new room type and its nights, in one transaction.
                let id = 100_000 + seed as i64 * 1_000_000 + step;
                let sql = format!(
                    "BEGIN;
                     INSERT INTO room_types (hotel_id, id, name, max_guests) VALUES ({hotel}, {id}, 'Added', 3)
                       ON CONFLICT DO NOTHING;
                     INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
                       SELECT {hotel}, {id}, DATE '{night}' + n, 4, 12000 FROM generate_series(0, 6) n
                       ON CONFLICT DO NOTHING;
                     COMMIT;"
                );
                let r = c.batch_execute(&sql).await;
                if r.is_err() {
                    let _ = c.batch_execute("ROLLBACK").await;
                }
                r.map_err(|e| e.to_string())
            }
            _ => c
                .execute(
                    "DELETE FROM inventory WHERE hotel_id = $1 AND night = $2 AND taken = 0",
                    &[&hotel, &night],
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
        };
        match done {
            Ok(()) => counts.0.fetch_add(1, Ordering::Relaxed),
            Err(_) => {
                if c.is_closed() {
                    client = None;
                }
                counts.1.fetch_add(1, Ordering::Relaxed)
            }
        };
    }
}

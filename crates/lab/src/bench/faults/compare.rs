//! The comparison: every hotel, room type and inventory row of the owner
//! against the copy served over HTTP. Any difference is a bug.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use chrono::NaiveDate;
use serde_json::Value;
use tokio_postgres::Client;

use crate::http_client::http;
use vacancy_service::NightCounts;

use super::{FaultBenchError, HTTP_TIMEOUT};

/// Rows of the copy that differ from the owner's, or exist on one side only.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Divergence {
    /// Owner rows compared (hotels + room types + inventory).
    pub compared: u64,
    pub hotels: u64,
    pub room_types: u64,
    pub inventory: u64,
    /// The first few differences, owner value then copy value, to start
    /// an investigation from.
    pub examples: Vec<String>,
}

impl Divergence {
    pub fn total(&self) -> u64 {
        self.hotels + self.room_types + self.inventory
    }
}

/// A hotel row as both sides hold it.
#[derive(Debug, Clone, PartialEq)]
pub struct HotelRow {
    pub name: String,
    pub city: String,
    pub country: Option<String>,
    pub stars: Option<i16>,
    pub latitude: Option<f64>,
    pub longitude: Option<f64>,
    pub amenities: Vec<String>,
}

/// The three tables, keyed by primary key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rows {
    pub hotels: BTreeMap<i64, HotelRow>,
    pub room_types: BTreeMap<(i64, i64), (String, i16)>,
    pub inventory: BTreeMap<(i64, i64, NaiveDate), NightCounts>,
}

/// Counts the keys whose values differ, or that only one side has.
pub fn divergence(owner: &Rows, copy: &Rows) -> Divergence {
    fn differing<K: Ord + std::fmt::Debug, V: PartialEq + std::fmt::Debug>(
        a: &BTreeMap<K, V>,
        b: &BTreeMap<K, V>,
        examples: &mut Vec<String>,
    ) -> u64 {
        let mut n = 0;
        let changed = a.iter().filter(|(k, v)| b.get(*k) != Some(*v));
        let changed = changed.map(|(k, v)| (k, Some(v), b.get(k)));
        let extra = b.iter().filter(|(k, _)| !a.contains_key(*k));
        for (key, owner, copy) in changed.chain(extra.map(|(k, v)| (k, None, Some(v)))) {
            n += 1;
            if examples.len() < 5 {
                examples.push(format!("{key:?}: owner {owner:?}, copy {copy:?}"));
            }
        }
        n
    }
    let mut examples = Vec::new();
    Divergence {
        compared: (owner.hotels.len() + owner.room_types.len() + owner.inventory.len()) as u64,
        hotels: differing(&owner.hotels, &copy.hotels, &mut examples),
        room_types: differing(&owner.room_types, &copy.room_types, &mut examples),
        inventory: differing(&owner.inventory, &copy.inventory, &mut examples),
        examples,
    }
}

/// Reads every row of the owner and of the copy served at `addr` (which must
/// have applied the owner's position already) and counts the differences.
/// The copy is read per owner hotel over the owner's nights; rows the copy
/// has beyond those are counted from the totals `/v1/status` reports.
pub async fn measure_divergence(
    addr: SocketAddr,
    client: &Client,
) -> Result<Divergence, FaultBenchError> {
    let owner_rows = owner_rows(client).await?;
    let copy = copy_rows(addr, &owner_rows).await?;
    let mut d = divergence(&owner_rows, &copy);
    let status = get_json(addr, "/v1/status").await?;
    let surplus = |field: &str, seen: usize| {
        status["model"][field]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(seen as u64)
    };
    d.hotels += surplus("hotels", copy.hotels.len());
    d.room_types += surplus("room_types", copy.room_types.len());
    d.inventory += surplus("inventory_rows", copy.inventory.len());
    Ok(d)
}

pub async fn owner_rows(client: &Client) -> Result<Rows, FaultBenchError> {
    let mut rows = Rows::default();
    for r in client
        .query(
            "SELECT id, name, city, country, stars, latitude, longitude, amenities FROM hotels",
            &[],
        )
        .await?
    {
        rows.hotels.insert(
            r.get(0),
            HotelRow {
                name: r.get(1),
                city: r.get(2),
                country: r.get(3),
                stars: r.get(4),
                latitude: r.get(5),
                longitude: r.get(6),
                amenities: r.get(7),
            },
        );
    }
    for r in client
        .query("SELECT hotel_id, id, name, max_guests FROM room_types", &[])
        .await?
    {
        rows.room_types
            .insert((r.get(0), r.get(1)), (r.get(2), r.get(3)));
    }
    for r in client
        .query(
            "SELECT hotel_id, room_type_id, night, total, taken, sell_limit, price_cents FROM inventory",
            &[],
        )
        .await?
    {
        rows.inventory.insert(
            (r.get(0), r.get(1), r.get(2)),
            NightCounts {
                total: r.get(3),
                taken: r.get(4),
                sell_limit: r.get(5),
                price_cents: r.get(6),
            },
        );
    }
    Ok(rows)
}

/// The longest range one calendar request may ask for (the API's bound).
const CALENDAR_DAYS: u64 = 800;

async fn copy_rows(addr: SocketAddr, owner: &Rows) -> Result<Rows, FaultBenchError> {
    let mut rows = Rows::default();
    let nights = owner.inventory.keys().map(|k| k.2);
    let (Some(first), Some(last)) = (nights.clone().min(), nights.max()) else {
        return Ok(rows);
    };
    let end = last + chrono::Days::new(1);
    for &hotel in owner.hotels.keys() {
        let mut from = first;
        while from < end {
            let to = (from + chrono::Days::new(CALENDAR_DAYS)).min(end);
            let path = format!("/v1/hotels/{hotel}/calendar?from={from}&to={to}");
            let r = http(addr, "GET", &path, None, None, HTTP_TIMEOUT)
                .await
                .map_err(|e| FaultBenchError::CopyRead {
                    path: path.clone(),
                    status: "no answer".into(),
                    body: e.to_string(),
                })?;
            if r.status == 404 {
                break; // the copy lacks the hotel: counted as divergent by the comparison
            }
            if r.status != 200 {
                return Err(FaultBenchError::CopyRead {
                    path,
                    status: r.status.to_string(),
                    body: String::from_utf8_lossy(&r.body).into_owned(),
                });
            }
            let body = String::from_utf8_lossy(&r.body);
            parse_calendar(&body, hotel, from == first, &mut rows);
            from = to;
        }
    }
    Ok(rows)
}

/// Adds one calendar answer to `rows`; the hotel and its room types only
/// from the first range of nights (they repeat in every range).
fn parse_calendar(body: &str, hotel: i64, first_range: bool, rows: &mut Rows) {
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    let h = &v["hotel"];
    if first_range && let (Some(name), Some(city)) = (h["name"].as_str(), h["city"].as_str()) {
        rows.hotels.insert(
            hotel,
            HotelRow {
                name: name.to_string(),
                city: city.to_string(),
                country: h["country"].as_str().map(str::to_string),
                stars: h["stars"].as_i64().and_then(|s| i16::try_from(s).ok()),
                // Exact, with serde_json's float_roundtrip (see Cargo.toml).
                latitude: h["latitude"].as_f64(),
                longitude: h["longitude"].as_f64(),
                amenities: h["amenities"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|s| s.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default(),
            },
        );
    }
    for rt in v["room_types"].as_array().into_iter().flatten() {
        let Some(room_type) = rt["room_type_id"].as_i64() else {
            continue;
        };
        if first_range
            && let (Some(name), Some(guests)) = (rt["name"].as_str(), rt["max_guests"].as_i64())
        {
            rows.room_types.insert(
                (hotel, room_type),
                (name.to_string(), i16::try_from(guests).unwrap_or(i16::MAX)),
            );
        }
        for n in rt["nights"].as_array().into_iter().flatten() {
            let Some(night) = n["night"].as_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            let int = |k: &str| n[k].as_i64().and_then(|v| i32::try_from(v).ok());
            let (Some(total), Some(taken)) = (int("total"), int("taken")) else {
                continue;
            };
            rows.inventory.insert(
                (hotel, room_type, night),
                NightCounts {
                    total,
                    taken,
                    sell_limit: int("sell_limit"),
                    price_cents: int("price_cents"),
                },
            );
        }
    }
}

pub(super) async fn get_json(addr: SocketAddr, path: &str) -> Result<Value, FaultBenchError> {
    let r = http(addr, "GET", path, None, None, HTTP_TIMEOUT)
        .await
        .map_err(|e| FaultBenchError::CopyRead {
            path: path.to_string(),
            status: "no answer".into(),
            body: e.to_string(),
        })?;
    if r.status != 200 {
        return Err(FaultBenchError::CopyRead {
            path: path.to_string(),
            status: r.status.to_string(),
            body: String::from_utf8_lossy(&r.body).into_owned(),
        });
    }
    Ok(r.json())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> Rows {
        let mut r = Rows::default();
        r.hotels.insert(
            1,
            HotelRow {
                name: "A".into(),
                city: "Lisbon".into(),
                country: Some("PT".into()),
                stars: Some(3),
                latitude: Some(38.7),
                longitude: Some(-9.1),
                amenities: vec!["wifi".into()],
            },
        );
        r.room_types.insert((1, 1), ("Double".into(), 2));
        let night = NaiveDate::from_ymd_opt(2030, 1, 1).unwrap();
        for d in 0..3 {
            r.inventory.insert(
                (1, 1, night + chrono::Days::new(d)),
                NightCounts {
                    total: 5,
                    taken: 1,
                    sell_limit: None,
                    price_cents: Some(100),
                },
            );
        }
        r
    }

    #[test]
    fn equal_copies_have_no_divergent_rows() {
        let d = divergence(&rows(), &rows());
        assert_eq!(d.total(), 0);
        assert_eq!(d.compared, 5);
    }

    #[test]
    fn a_changed_a_missing_and_an_extra_row_are_each_counted() {
        let owner = rows();
        let mut copy = rows();
        let night = NaiveDate::from_ymd_opt(2030, 1, 1).unwrap();
        copy.inventory.get_mut(&(1, 1, night)).expect("row").taken = 2;
        copy.inventory.remove(&(1, 1, night + chrono::Days::new(1)));
        copy.inventory.insert(
            (1, 1, night + chrono::Days::new(9)),
            NightCounts {
                total: 1,
                taken: 0,
                sell_limit: None,
                price_cents: None,
            },
        );
        copy.hotels.get_mut(&1).expect("hotel").amenities.clear();
        copy.room_types.insert((1, 1), ("Double".into(), 3));
        let d = divergence(&owner, &copy);
        assert_eq!((d.inventory, d.hotels, d.room_types), (3, 1, 1));
        assert_eq!(d.total(), 5);
        assert_eq!(d.examples.len(), 5, "{:?}", d.examples);
    }

    #[test]
    fn a_calendar_answer_becomes_rows() {
        let v = serde_json::json!({
            "hotel_id": 1,
            "hotel": {"id": 1, "name": "A", "city": "Lisbon", "country": "PT", "stars": 3,
                      "latitude": 38.7, "longitude": -9.1, "amenities": ["wifi"]},
            "room_types": [{"room_type_id": 1, "name": "Double", "max_guests": 2, "nights": [
                {"night": "2030-01-01", "total": 5, "taken": 1, "sell_limit": null, "price_cents": 100, "free": 4},
                {"night": "2030-01-02", "total": 5, "taken": 1, "price_cents": 100, "free": 4},
                {"night": "2030-01-03", "total": 5, "taken": 1, "sell_limit": null, "price_cents": 100, "free": 4},
                {"night": "not a date", "total": 5, "taken": 1}
            ]}]
        });
        let text = v.to_string();
        let mut parsed = Rows::default();
        parse_calendar(&text, 1, true, &mut parsed);
        assert_eq!(parsed, rows());
        let mut later = Rows::default();
        parse_calendar(&text, 1, false, &mut later);
        assert!(later.hotels.is_empty() && later.room_types.is_empty());
        assert_eq!(later.inventory.len(), 3);
    }

    #[test]
    fn coordinates_are_parsed_exactly() {
        // Both 17-digit numbers land one ULP off without float_roundtrip,
        // which would count an exact copy as divergent.
        let body = r#"{"hotel":{"name":"A","city":"Lisbon","latitude":-9.139876543210987,"longitude":-0.24482051340406566,"amenities":[]},"room_types":[]}"#;
        let mut parsed = Rows::default();
        parse_calendar(body, 1, true, &mut parsed);
        let hotel = &parsed.hotels[&1];
        assert_eq!(hotel.latitude, Some(-9.139876543210987));
        assert_eq!(hotel.longitude, Some(-0.24482051340406566));
    }
}

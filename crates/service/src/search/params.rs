//! Search parameters: the raw query string into a checked `SearchRequest`.
//!
//! Parsed by hand from `form_urlencoded` pairs because `room` repeats (one
//! per room wanted) and because each rule must name the field it rejects.
//! Nothing here panics on any input.

use base64::Engine;
use chrono::NaiveDate;

use crate::index::Place;
use crate::lsn::Position;
pub use crate::model::Stay;

pub const MAX_ROOMS: usize = 8;
pub const MAX_GUESTS_PER_ROOM: i16 = 20;
pub const MAX_HOTEL_IDS: usize = 250;
pub const MAX_LIMIT: usize = 100;
pub const DEFAULT_LIMIT: usize = 20;

/// A rejected parameter: the field and what was wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {detail}")]
pub struct ParamError {
    pub field: &'static str,
    pub detail: String,
}

fn err(field: &'static str, detail: impl Into<String>) -> ParamError {
    ParamError {
        field,
        detail: detail.into(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sort {
    Price,
    Stars,
    Availability,
    Relevance,
}

impl Sort {
    fn parse(s: &str) -> Result<Sort, ParamError> {
        match s {
            "price" => Ok(Sort::Price),
            "stars" => Ok(Sort::Stars),
            "availability" => Ok(Sort::Availability),
            "relevance" => Ok(Sort::Relevance),
            _ => Err(err(
                "sort",
                "must be one of price, stars, availability, relevance",
            )),
        }
    }
}

/// The limits a stay is checked against.
#[derive(Debug, Clone, Copy)]
pub struct StayRules {
    /// The earliest date a stay may begin: today's date in UTC−12, the
    /// last time zone to leave a day (`http::guests::stay_rules`).
    pub today: NaiveDate,
    pub horizon_days: u32,
    pub max_stay_nights: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SearchRequest {
    pub place: Place,
    pub stay: Stay,
    /// Guests per room wanted.
    pub rooms: Vec<i16>,
    pub stars_min: Option<i16>,
    pub amenities: Vec<String>,
    pub max_price_cents: Option<i64>,
    pub sort: Sort,
    pub limit: usize,
    pub offset: usize,
    /// An LSN, bare or with its owner timeline (`crate::lsn::Position`).
    pub min_lsn: Option<Position>,
}

/// The parameters of `/v1/hotels/{id}/availability`.
#[derive(Debug, Clone, PartialEq)]
pub struct AvailabilityRequest {
    pub stay: Stay,
    pub rooms: Vec<i16>,
    pub min_lsn: Option<Position>,
}

/// Longest query string parsed at all, and the most `http.max_query_bytes`
/// may be. Over HTTP that setting refuses a longer one first (414
/// `/problems/query-too-long`), so a client meets one limit, the one the
/// operator set; this one guards callers that come without the router.
pub const MAX_QUERY_BYTES: usize = 65_536;

fn pairs(query: &str) -> Result<Vec<(String, String)>, ParamError> {
    if query.len() > MAX_QUERY_BYTES {
        return Err(err(
            "query",
            format!("the query string may be at most {MAX_QUERY_BYTES} bytes"),
        ));
    }
    Ok(form_urlencoded::parse(query.as_bytes())
        .into_owned()
        .collect())
}

fn single<'a>(
    pairs: &'a [(String, String)],
    field: &'static str,
) -> Result<Option<&'a str>, ParamError> {
    let mut found = pairs.iter().filter(|(k, _)| k == field);
    let first = found.next();
    if found.next().is_some() {
        return Err(err(field, "may be given only once"));
    }
    Ok(first.map(|(_, v)| v.as_str()))
}

fn date(pairs: &[(String, String)], field: &'static str) -> Result<NaiveDate, ParamError> {
    let v = single(pairs, field)?.ok_or_else(|| err(field, "is required (YYYY-MM-DD)"))?;
    NaiveDate::parse_from_str(v, "%Y-%m-%d")
        .map_err(|_| err(field, "must be a date like 2027-06-10"))
}

fn number<T: std::str::FromStr>(
    pairs: &[(String, String)],
    field: &'static str,
    what: &str,
) -> Result<Option<T>, ParamError> {
    single(pairs, field)?
        .map(|v| {
            v.trim()
                .parse::<T>()
                .map_err(|_| err(field, format!("must be {what}")))
        })
        .transpose()
}

fn stay(pairs: &[(String, String)], rules: StayRules) -> Result<Stay, ParamError> {
    let check_in = date(pairs, "check_in")?;
    let check_out = date(pairs, "check_out")?;
    if check_out <= check_in {
        return Err(err("check_out", "must be after check_in"));
    }
    if check_in < rules.today {
        return Err(err(
            "check_in",
            format!(
                "must not be in the past (the earliest date anywhere now is {}, UTC-12)",
                rules.today
            ),
        ));
    }
    let stay = Stay {
        check_in,
        check_out,
    };
    if stay.len() > i64::from(rules.max_stay_nights) {
        return Err(err(
            "check_out",
            format!("a stay may last at most {} nights", rules.max_stay_nights),
        ));
    }
    let horizon = rules.today + chrono::Days::new(u64::from(rules.horizon_days));
    if check_out > horizon {
        return Err(err(
            "check_out",
            format!(
                "must be at most {} days ahead ({horizon})",
                rules.horizon_days
            ),
        ));
    }
    Ok(stay)
}

fn rooms(pairs: &[(String, String)]) -> Result<Vec<i16>, ParamError> {
    let rooms: Vec<&str> = pairs
        .iter()
        .filter(|(k, _)| k == "room")
        .map(|(_, v)| v.as_str())
        .collect();
    if rooms.is_empty() {
        return Err(err(
            "room",
            "at least one room is required: room=<guests>, once per room",
        ));
    }
    if rooms.len() > MAX_ROOMS {
        return Err(err("room", format!("at most {MAX_ROOMS} rooms")));
    }
    rooms
        .iter()
        .map(|v| match v.trim().parse::<i16>() {
            Ok(g) if (1..=MAX_GUESTS_PER_ROOM).contains(&g) => Ok(g),
            _ => Err(err(
                "room",
                format!("each room is a number of guests from 1 to {MAX_GUESTS_PER_ROOM}"),
            )),
        })
        .collect()
}

fn min_lsn(pairs: &[(String, String)]) -> Result<Option<Position>, ParamError> {
    single(pairs, "min_lsn")?
        .map(|v| {
            v.parse::<Position>().map_err(|_| {
                err(
                    "min_lsn",
                    "must be an LSN like 0/16B3748, or an answer's position like 1/0/16B3748",
                )
            })
        })
        .transpose()
}

const KNOWN: &[&str] = &[
    "city",
    "q",
    "bbox",
    "hotel_ids",
    "check_in",
    "check_out",
    "room",
    "stars_min",
    "amenities",
    "max_price_cents",
    "sort",
    "limit",
    "cursor",
    "min_lsn",
];

pub fn parse_search(query: &str, rules: StayRules) -> Result<SearchRequest, ParamError> {
    let pairs = pairs(query)?;
    reject_unknown(&pairs, KNOWN)?;
    let place = place(&pairs)?;
    let stay = stay(&pairs, rules)?;
    let rooms = rooms(&pairs)?;
    let stars_min = stars_min(&pairs)?;
    let amenities = amenities(&pairs)?;
    let max_price_cents = max_price_cents(&pairs)?;
    let sort = sort(&pairs, &place)?;
    let limit = limit(&pairs)?;
    let min_lsn = min_lsn(&pairs)?;
    let mut request = SearchRequest {
        place,
        stay,
        rooms,
        stars_min,
        amenities,
        max_price_cents,
        sort,
        limit,
        offset: 0,
        min_lsn,
    };
    if let Some(cursor) = single(&pairs, "cursor")? {
        request.offset = Cursor::decode(cursor, &request)?;
    }
    Ok(request)
}

/// Refuses the first parameter not in `known`.
fn reject_unknown(pairs: &[(String, String)], known: &[&str]) -> Result<(), ParamError> {
    match pairs.iter().find(|(k, _)| !known.contains(&k.as_str())) {
        Some((k, _)) => Err(err(
            "query",
            format!(
                "unknown parameter {:?}",
                k.chars().take(40).collect::<String>()
            ),
        )),
        None => Ok(()),
    }
}

/// Where to look: exactly one of `city`, `q`, `bbox` or `hotel_ids`.
fn place(pairs: &[(String, String)]) -> Result<Place, ParamError> {
    let given = [city(pairs)?, text(pairs)?, bbox(pairs)?, hotel_ids(pairs)?];
    let mut places = given.into_iter().flatten();
    match (places.next(), places.next()) {
        (Some(place), None) => Ok(place),
        _ => Err(err(
            "city",
            "give exactly one of city, q, bbox or hotel_ids",
        )),
    }
}

fn city(pairs: &[(String, String)]) -> Result<Option<Place>, ParamError> {
    let Some(given) = single(pairs, "city")? else {
        return Ok(None);
    };
    let city = given.trim();
    if city.is_empty() || city.len() > 200 {
        return Err(err("city", "must be 1 to 200 characters"));
    }
    Ok(Some(Place::City(city.to_string())))
}

/// `q`: free text.
fn text(pairs: &[(String, String)]) -> Result<Option<Place>, ParamError> {
    let Some(q) = single(pairs, "q")? else {
        return Ok(None);
    };
    if q.trim().is_empty() || q.len() > 200 {
        return Err(err("q", "must be 1 to 200 characters"));
    }
    Ok(Some(Place::Text(q.to_string())))
}

fn bbox(pairs: &[(String, String)]) -> Result<Option<Place>, ParamError> {
    let Some(b) = single(pairs, "bbox")? else {
        return Ok(None);
    };
    let corners: Vec<f64> = b
        .split(',')
        .map(|x| x.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .map_err(|_| err("bbox", "must be min_lat,min_lon,max_lat,max_lon"))?;
    let [min_lat, min_lon, max_lat, max_lon] = corners[..] else {
        return Err(err("bbox", "must be min_lat,min_lon,max_lat,max_lon"));
    };
    let lat_ok = |x: f64| (-90.0..=90.0).contains(&x);
    let lon_ok = |x: f64| (-180.0..=180.0).contains(&x);
    if !(lat_ok(min_lat) && lat_ok(max_lat) && lon_ok(min_lon) && lon_ok(max_lon))
        || min_lat > max_lat
        || min_lon > max_lon
    {
        return Err(err(
            "bbox",
            "latitudes in -90..90, longitudes in -180..180, each min at most its max",
        ));
    }
    Ok(Some(Place::BBox {
        min_lat,
        min_lon,
        max_lat,
        max_lon,
    }))
}

fn hotel_ids(pairs: &[(String, String)]) -> Result<Option<Place>, ParamError> {
    let Some(list) = single(pairs, "hotel_ids")? else {
        return Ok(None);
    };
    let ids: Vec<i64> = list
        .split(',')
        .map(|x| x.trim().parse::<i64>())
        .collect::<Result<_, _>>()
        .map_err(|_| err("hotel_ids", "must be comma-separated integers"))?;
    if ids.is_empty() || ids.len() > MAX_HOTEL_IDS {
        return Err(err("hotel_ids", format!("1 to {MAX_HOTEL_IDS} ids")));
    }
    Ok(Some(Place::Ids(ids)))
}

fn stars_min(pairs: &[(String, String)]) -> Result<Option<i16>, ParamError> {
    let stars = number::<i16>(pairs, "stars_min", "a number of stars from 0 to 5")?;
    if stars.is_some_and(|s| !(0..=5).contains(&s)) {
        return Err(err("stars_min", "must be from 0 to 5"));
    }
    Ok(stars)
}

/// Comma-separated, lowercased; blanks dropped.
fn amenities(pairs: &[(String, String)]) -> Result<Vec<String>, ParamError> {
    let amenities: Vec<String> = single(pairs, "amenities")?
        .map(|a| {
            a.split(',')
                .map(|x| x.trim().to_lowercase())
                .filter(|x| !x.is_empty())
                .collect()
        })
        .unwrap_or_default();
    if amenities.len() > 20 {
        return Err(err("amenities", "at most 20"));
    }
    Ok(amenities)
}

fn max_price_cents(pairs: &[(String, String)]) -> Result<Option<i64>, ParamError> {
    let cents = number::<i64>(pairs, "max_price_cents", "a whole number of cents")?;
    if cents.is_some_and(|p| p <= 0) {
        return Err(err("max_price_cents", "must be above 0"));
    }
    Ok(cents)
}

/// The order asked for; by default relevance for free text, price otherwise.
fn sort(pairs: &[(String, String)], place: &Place) -> Result<Sort, ParamError> {
    let default_sort = if matches!(place, Place::Text(_)) {
        Sort::Relevance
    } else {
        Sort::Price
    };
    Ok(single(pairs, "sort")?
        .map(Sort::parse)
        .transpose()?
        .unwrap_or(default_sort))
}

fn limit(pairs: &[(String, String)]) -> Result<usize, ParamError> {
    let limit = number::<usize>(pairs, "limit", "a whole number")?.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(err("limit", format!("must be from 1 to {MAX_LIMIT}")));
    }
    Ok(limit)
}

pub fn parse_availability(
    query: &str,
    rules: StayRules,
) -> Result<AvailabilityRequest, ParamError> {
    let pairs = pairs(query)?;
    reject_unknown(&pairs, &["check_in", "check_out", "room", "min_lsn"])?;
    Ok(AvailabilityRequest {
        stay: stay(&pairs, rules)?,
        rooms: rooms(&pairs)?,
        min_lsn: min_lsn(&pairs)?,
    })
}

/// The parameters of `GET /v1/bypass`: one take the booking service is about to try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BypassRequest {
    pub hotel_id: i64,
    pub room_type_id: i64,
    pub stay: Stay,
    /// Units the take asks for (default 1).
    pub rooms: i32,
}

/// Most units one bypass question may name (a take of more is not a guest's).
pub const MAX_TAKE_ROOMS: i32 = 1000;

pub fn parse_bypass(query: &str, rules: StayRules) -> Result<BypassRequest, ParamError> {
    let pairs = pairs(query)?;
    const KNOWN_BYPASS: &[&str] = &["hotel_id", "room_type_id", "check_in", "check_out", "rooms"];
    reject_unknown(&pairs, KNOWN_BYPASS)?;
    let hotel_id = number::<i64>(&pairs, "hotel_id", "an integer")?
        .ok_or_else(|| err("hotel_id", "is required"))?;
    let room_type_id = number::<i64>(&pairs, "room_type_id", "an integer")?
        .ok_or_else(|| err("room_type_id", "is required"))?;
    let rooms = number::<i32>(&pairs, "rooms", "an integer")?.unwrap_or(1);
    if !(1..=MAX_TAKE_ROOMS).contains(&rooms) {
        return Err(err("rooms", format!("must be 1 to {MAX_TAKE_ROOMS}")));
    }
    Ok(BypassRequest {
        hotel_id,
        room_type_id,
        stay: stay(&pairs, rules)?,
        rooms,
    })
}

/// An opaque page token: the offset of the next page, bound to the question
/// it belongs to, so a cursor from one search cannot page another.
pub struct Cursor;

impl Cursor {
    /// A stable fingerprint of everything but the page (FNV-1a over a
    /// canonical rendering; stable across builds, unlike `DefaultHasher`).
    fn fingerprint(r: &SearchRequest) -> u64 {
        let canonical = format!(
            "{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{}",
            r.place, r.stay, r.rooms, r.stars_min, r.amenities, r.max_price_cents, r.sort, r.limit
        );
        canonical.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    pub fn encode(r: &SearchRequest, offset: usize) -> String {
        let raw = format!("v1.{offset}.{:016x}", Self::fingerprint(r));
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
    }

    fn decode(cursor: &str, r: &SearchRequest) -> Result<usize, ParamError> {
        let malformed = || err("cursor", "is not a cursor this search returned");
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(cursor.as_bytes())
            .map_err(|_| malformed())?;
        let raw = String::from_utf8(raw).map_err(|_| malformed())?;
        let mut parts = raw.split('.');
        let (Some("v1"), Some(offset), Some(fp), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(malformed());
        };
        let offset: usize = offset.parse().map_err(|_| malformed())?;
        if fp != format!("{:016x}", Self::fingerprint(r)) || offset > 1_000_000 {
            return Err(malformed());
        }
        Ok(offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rules() -> StayRules {
        StayRules {
            today: NaiveDate::from_ymd_opt(2030, 1, 1).unwrap(),
            horizon_days: 730,
            max_stay_nights: 30,
        }
    }

    const OK: &str = "city=Lisbon&check_in=2030-01-10&check_out=2030-01-13&room=2&room=1";

    #[test]
    fn parses_a_search() {
        let r = parse_search(OK, rules()).unwrap();
        assert_eq!(r.place, Place::City("Lisbon".into()));
        assert_eq!(r.rooms, vec![2, 1]);
        assert_eq!(r.stay.nights().count(), 3);
        assert_eq!(r.sort, Sort::Price);
        assert_eq!(r.limit, DEFAULT_LIMIT);
    }

    #[test]
    fn parses_a_bypass_question_and_names_bad_fields() {
        let q = "hotel_id=3&room_type_id=4&check_in=2030-01-10&check_out=2030-01-12";
        let r = parse_bypass(q, rules()).unwrap();
        assert_eq!((r.hotel_id, r.room_type_id, r.rooms), (3, 4, 1));
        assert_eq!(r.stay.len(), 2);
        assert_eq!(
            parse_bypass(&format!("{q}&rooms=3"), rules())
                .unwrap()
                .rooms,
            3
        );
        for (bad, field) in [
            (format!("{q}&rooms=0"), "rooms"),
            (format!("{q}&rooms=x"), "rooms"),
            (format!("{q}&city=x"), "query"),
            (q.replace("hotel_id=3&", ""), "hotel_id"),
            (
                q.replace("room_type_id=4", "room_type_id=a"),
                "room_type_id",
            ),
            (q.replace("2030-01-12", "2030-01-10"), "check_out"),
        ] {
            assert_eq!(
                parse_bypass(&bad, rules()).unwrap_err().field,
                field,
                "{bad}"
            );
        }
    }

    fn field_of(q: &str) -> &'static str {
        parse_search(q, rules()).unwrap_err().field
    }

    /// The longest list of ids a search takes, of the longest ids, is past
    /// 4 KiB: parsed whole, the router's `http.max_query_bytes` being the
    /// limit a client meets.
    #[test]
    fn the_most_ids_of_the_longest_ids_parse() {
        let ids: Vec<String> = (0..MAX_HOTEL_IDS)
            .map(|i| (i64::MAX - i as i64).to_string())
            .collect();
        let query = format!(
            "hotel_ids={}&check_in=2030-01-10&check_out=2030-01-13&room=2",
            ids.join(",")
        );
        assert!(query.len() > 4096, "{} bytes", query.len());
        let request = parse_search(&query, rules()).unwrap();
        assert!(matches!(request.place, Place::Ids(ref got) if got.len() == MAX_HOTEL_IDS));
    }

    #[test]
    fn each_rule_names_its_field() {
        let base = "city=Lisbon&room=2";
        assert_eq!(
            field_of(&format!("{base}&check_in=2030-01-10&check_out=2030-01-10")),
            "check_out"
        );
        assert_eq!(
            field_of(&format!("{base}&check_in=2029-12-31&check_out=2030-01-02")),
            "check_in"
        );
        assert_eq!(
            field_of(&format!("{base}&check_in=2030-01-10&check_out=2030-02-20")),
            "check_out"
        );
        assert_eq!(
            field_of(&format!("{base}&check_in=2031-12-30&check_out=2032-01-02")),
            "check_out"
        );
        assert_eq!(field_of(&format!("{OK}&sort=cheapest")), "sort");
        assert_eq!(field_of(&format!("{OK}&cursor=bm9wZQ")), "cursor");
        assert_eq!(
            field_of(&format!(
                "{OK}&room=1&room=1&room=1&room=1&room=1&room=1&room=1"
            )),
            "room"
        );
        assert_eq!(
            field_of("city=Lisbon&check_in=2030-01-10&check_out=2030-01-13"),
            "room"
        );
        assert_eq!(field_of(&format!("{OK}&limit=101")), "limit");
        assert_eq!(
            field_of("check_in=2030-01-10&check_out=2030-01-13&room=2"),
            "city"
        );
        assert_eq!(field_of(&format!("{OK}&q=beach")), "city");
        assert_eq!(field_of(&format!("{OK}&bogus=1")), "query");
        assert_eq!(
            field_of(&format!("{OK}&q={}", "a".repeat(MAX_QUERY_BYTES))),
            "query"
        );
        assert_eq!(
            field_of("bbox=1,2,3&check_in=2030-01-10&check_out=2030-01-13&room=2"),
            "bbox"
        );
    }

    #[test]
    fn cursors_round_trip_and_bind_to_their_search() {
        let r = parse_search(OK, rules()).unwrap();
        let c = Cursor::encode(&r, 40);
        let next = parse_search(&format!("{OK}&cursor={c}"), rules()).unwrap();
        assert_eq!(next.offset, 40);
        let other = format!("{}&cursor={c}", OK.replace("Lisbon", "Porto"));
        assert_eq!(parse_search(&other, rules()).unwrap_err().field, "cursor");
    }

    proptest! {
        #[test]
        fn never_panics(q in "[a-z_=&%0-9.,:/-]{0,120}") {
            let _ = parse_search(&q, rules());
            let _ = parse_availability(&q, rules());
        }

        #[test]
        fn never_panics_on_any_cursor(c in "\\PC{0,60}") {
            let q = format!("{OK}&cursor={}", form_urlencoded::byte_serialize(c.as_bytes()).collect::<String>());
            let _ = parse_search(&q, rules());
        }

        /// Any query string, raw or built from real parameter names with
        /// hostile values: no panic, and every refusal names a field the
        /// route knows (or `query` for the string as a whole).
        #[test]
        fn every_refusal_names_a_known_field(q in prop_oneof![any_text(), query_of_known_names()]) {
            if let Err(e) = parse_search(&q, rules()) {
                prop_assert!(KNOWN.contains(&e.field) || e.field == "query", "{:?}", e);
                prop_assert!(!e.detail.is_empty());
            }
            if let Err(e) = parse_availability(&q, rules()) {
                prop_assert!(AVAILABILITY.contains(&e.field) || e.field == "query", "{:?}", e);
            }
            if let Err(e) = parse_bypass(&q, rules()) {
                prop_assert!(BYPASS.contains(&e.field) || e.field == "query", "{:?}", e);
            }
        }

        /// A cursor is good for the search that returned it, at any offset
        /// it can carry, and for no other.
        #[test]
        fn a_cursor_pages_only_its_own_search(
            offset in 0usize..=1_000_000,
            (a, b) in (0usize..SEARCHES.len(), 0usize..SEARCHES.len()).prop_filter("two searches", |(a, b)| a != b),
        ) {
            let first = parse_search(SEARCHES[a], rules()).unwrap();
            let cursor = Cursor::encode(&first, offset);
            let same = parse_search(&format!("{}&cursor={cursor}", SEARCHES[a]), rules()).unwrap();
            prop_assert_eq!(same.offset, offset);
            let other = parse_search(&format!("{}&cursor={cursor}", SEARCHES[b]), rules());
            prop_assert_eq!(other.map_err(|e| e.field), Err("cursor"));
        }

        /// A cursor altered in one character is refused naming `cursor`, or
        /// still pages the same question (the offset is not secret: any page
        /// of a search may be asked for), never a panic.
        #[test]
        fn altered_cursors_are_refused_or_page_the_same_search(
            offset in 0usize..=1_000_000,
            at in any::<prop::sample::Index>(),
            c in "[A-Za-z0-9_-]",
        ) {
            let search = parse_search(OK, rules()).unwrap();
            let cursor = Cursor::encode(&search, offset);
            let i = at.index(cursor.len());
            let mut altered = cursor.clone();
            altered.replace_range(i..=i, &c);
            match parse_search(&format!("{OK}&cursor={altered}"), rules()) {
                Err(e) => prop_assert_eq!(e.field, "cursor"),
                Ok(r) => prop_assert!(r.offset <= 1_000_000),
            }
        }
    }

    const AVAILABILITY: &[&str] = &["check_in", "check_out", "room", "min_lsn"];
    const BYPASS: &[&str] = &["hotel_id", "room_type_id", "check_in", "check_out", "rooms"];

    /// Different questions: a cursor of one must not page another.
    const SEARCHES: &[&str] = &[
        OK,
        "city=Porto&check_in=2030-01-10&check_out=2030-01-13&room=2&room=1",
        "city=Lisbon&check_in=2030-01-10&check_out=2030-01-14&room=2&room=1",
        "city=Lisbon&check_in=2030-01-10&check_out=2030-01-13&room=2",
        "city=Lisbon&check_in=2030-01-10&check_out=2030-01-13&room=2&room=1&sort=stars",
        "city=Lisbon&check_in=2030-01-10&check_out=2030-01-13&room=2&room=1&limit=50",
        "hotel_ids=1,2,3&check_in=2030-01-10&check_out=2030-01-13&room=2&room=1",
        "q=beach&check_in=2030-01-10&check_out=2030-01-13&room=2&room=1",
    ];

    /// Any text at all, percent-encoded or not.
    fn any_text() -> impl Strategy<Value = String> {
        prop_oneof![
            "\\PC{0,200}",
            "[a-z_=&%0-9.,:/+ -]{0,200}",
            proptest::collection::vec(any::<u8>(), 0..200)
                .prop_map(|b| form_urlencoded::byte_serialize(&b).collect()),
        ]
    }

    /// Pairs whose names are real parameters (or near misses), with values
    /// at the edges: empty, huge numbers, negative, odd dates, unicode.
    fn query_of_known_names() -> impl Strategy<Value = String> {
        let names: Vec<&'static str> = KNOWN
            .iter()
            .chain(BYPASS)
            .copied()
            .chain(["", "room[]", "CITY"])
            .collect();
        let value = prop_oneof![
            Just(String::new()),
            "-?[0-9]{1,25}",
            "20[0-9]{2}-[0-9]{2}-[0-9]{2}",
            "[0-9A-F]{1,9}/[0-9A-F]{1,9}",
            "[-0-9.,]{0,40}",
            "[a-z,]{0,30}",
            "\\PC{0,20}",
        ];
        proptest::collection::vec((proptest::sample::select(names), value), 0..12).prop_map(
            |pairs| {
                form_urlencoded::Serializer::new(String::new())
                    .extend_pairs(pairs)
                    .finish()
            },
        )
    }
}

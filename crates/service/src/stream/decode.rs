//! Decode: pgoutput row events (text format, columns by name) into the read
//! model's `Change`s.
//!
//! Columns are looked up by name, so column order and columns we do not use
//! (an `ALTER TABLE ... ADD COLUMN` in the middle of the stream) do not
//! matter. With the default replica identity an update carries the old key
//! only when the key changed, and a delete carries only the key; both are
//! handled. A value that does not parse is a typed error naming the table and
//! column (never the value: row data stays out of logs).

use chrono::NaiveDate;
use pg_walstream::{ColumnValue, EventType, RowData};

use crate::metrics;
use crate::model::calendar::holds_night;
use crate::model::{CalendarKey, Change, Hotel, NightCounts, RoomType, Table, Unsent};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("{table}.{column} is missing from a row the stream sent")]
    MissingColumn {
        table: &'static str,
        column: &'static str,
    },
    #[error("{table}.{column} holds a value that is not a valid {expected}")]
    BadValue {
        table: &'static str,
        column: &'static str,
        expected: &'static str,
    },
    #[error("{table}.{column} is null, but the copy needs a value")]
    UnexpectedNull {
        table: &'static str,
        column: &'static str,
    },
}

/// Turns one row event into changes. Events for tables outside `schema` or
/// not ours yield nothing.
pub fn decode(schema: &str, event: &EventType) -> Result<Vec<Change>, DecodeError> {
    match event {
        EventType::Insert {
            schema: s,
            table,
            data,
            ..
        } if &**s == schema => match Table::from_name(table) {
            Some(t) => Ok(upsert(t, data)?.into_iter().collect()),
            None => Ok(vec![]),
        },
        EventType::Update {
            schema: s,
            table,
            old_data,
            new_data,
            ..
        } if &**s == schema => {
            let Some(t) = Table::from_name(table) else {
                return Ok(vec![]);
            };
            let new = upsert(t, new_data)?;
            let mut changes = Vec::with_capacity(2);
            if let Some(old) = old_data {
                // An old tuple arrives only when the key changed: the row
                // under the old key is gone.
                if let Some(old_key) = delete(t, old)?
                    && !new.as_ref().is_some_and(|n| same_key(&old_key, n))
                {
                    changes.push(old_key);
                }
            }
            changes.extend(new);
            Ok(changes)
        }
        EventType::Delete {
            schema: s,
            table,
            old_data,
            ..
        } if &**s == schema => match Table::from_name(table) {
            Some(t) => Ok(delete(t, old_data)?.into_iter().collect()),
            None => Ok(vec![]),
        },
        EventType::Truncate { tables, .. } => {
            let ours: Vec<Table> = tables
                .iter()
                .filter_map(|full| {
                    let (s, name) = full.split_once('.')?;
                    (s == schema).then(|| Table::from_name(name)).flatten()
                })
                .collect();
            Ok(if ours.is_empty() {
                vec![]
            } else {
                vec![Change::Truncate { tables: ours }]
            })
        }
        _ => Ok(vec![]),
    }
}

fn same_key(delete: &Change, upsert: &Change) -> bool {
    match (delete, upsert) {
        (Change::DeleteHotel { id }, Change::UpsertHotel { hotel, .. }) => *id == hotel.id,
        (Change::DeleteRoomType { hotel_id, id }, Change::UpsertRoomType { room_type, .. }) => {
            *hotel_id == room_type.hotel_id && *id == room_type.id
        }
        (
            Change::DeleteNight { key, night },
            Change::UpsertNight {
                key: k2, night: n2, ..
            },
        ) => key == k2 && night == n2,
        _ => false,
    }
}

/// A row's columns, read by name.
struct Row<'a> {
    table: &'static str,
    data: &'a RowData,
}

impl<'a> Row<'a> {
    /// `None` when the column was not sent (an unchanged TOAST value).
    fn text(&self, column: &'static str) -> Result<Option<Option<&'a str>>, DecodeError> {
        match self.data.get(column) {
            None => Ok(None),
            Some(ColumnValue::Null) => Ok(Some(None)),
            Some(v) => match v.as_str() {
                Some(s) => Ok(Some(Some(s))),
                None => Err(self.bad(column, "text value")),
            },
        }
    }

    fn required(&self, column: &'static str) -> Result<&'a str, DecodeError> {
        match self.text(column)? {
            None => Err(DecodeError::MissingColumn {
                table: self.table,
                column,
            }),
            Some(None) => Err(DecodeError::UnexpectedNull {
                table: self.table,
                column,
            }),
            Some(Some(s)) => Ok(s),
        }
    }

    fn nullable(&self, column: &'static str) -> Result<Option<&'a str>, DecodeError> {
        match self.text(column)? {
            None => Err(DecodeError::MissingColumn {
                table: self.table,
                column,
            }),
            Some(v) => Ok(v),
        }
    }

    fn parse<T: std::str::FromStr>(
        &self,
        column: &'static str,
        s: &str,
        expected: &'static str,
    ) -> Result<T, DecodeError> {
        s.parse().map_err(|_| self.bad(column, expected))
    }

    fn int8(&self, column: &'static str) -> Result<i64, DecodeError> {
        self.parse(column, self.required(column)?, "bigint")
    }

    fn int4(&self, column: &'static str) -> Result<i32, DecodeError> {
        self.parse(column, self.required(column)?, "integer")
    }

    fn int4_opt(&self, column: &'static str) -> Result<Option<i32>, DecodeError> {
        self.nullable(column)?
            .map(|s| self.parse(column, s, "integer"))
            .transpose()
    }

    fn int2_opt(&self, column: &'static str) -> Result<Option<i16>, DecodeError> {
        self.nullable(column)?
            .map(|s| self.parse(column, s, "smallint"))
            .transpose()
    }

    fn float8_opt(&self, column: &'static str) -> Result<Option<f64>, DecodeError> {
        self.nullable(column)?
            .map(|s| self.parse(column, s, "double precision"))
            .transpose()
    }

    /// The row's night, or `None` for a night the copy does not hold
    /// (`calendar::holds_night`), counted.
    fn night(&self) -> Result<Option<NaiveDate>, DecodeError> {
        let s = self.required("night")?;
        let held = match NaiveDate::parse_from_str(s, "%Y-%m-%d") {
            Ok(night) => Some(night).filter(|n| holds_night(*n)),
            // With DateStyle ISO (the replication session sets it) every
            // date outside years 1 to 9999 is written in one of these forms;
            // one within them outside `HELD_YEARS` parses and is filtered.
            Err(_) if is_unheld_date_text(s) => None,
            Err(_) => return Err(self.bad("night", "date")),
        };
        if held.is_none() {
            metrics::NIGHTS_NOT_HELD
                .with_label_values(&["stream"])
                .inc();
        }
        Ok(held)
    }

    fn bad(&self, column: &'static str, expected: &'static str) -> DecodeError {
        DecodeError::BadValue {
            table: self.table,
            column,
            expected,
        }
    }
}

/// The row as a change; `None` for a night the copy does not hold.
fn upsert(table: Table, data: &RowData) -> Result<Option<Change>, DecodeError> {
    let row = Row {
        table: table.name(),
        data,
    };
    Ok(Some(match table {
        Table::Hotels => {
            let name = row.text("name")?;
            let city = row.text("city")?;
            let country = row.text("country")?;
            let amenities = row.text("amenities")?;
            let unsent = Unsent {
                name: name.is_none(),
                city: city.is_none(),
                country: country.is_none(),
                amenities: amenities.is_none(),
            };
            let not_null = |v: Option<Option<&str>>, column| match v {
                Some(None) => Err(DecodeError::UnexpectedNull {
                    table: "hotels",
                    column,
                }),
                Some(Some(s)) => Ok(s.to_string()),
                None => Ok(String::new()),
            };
            let amenities = match amenities.flatten() {
                Some(s) => parse_text_array(s).ok_or_else(|| row.bad("amenities", "text[]"))?,
                None => Vec::new(),
            };
            Change::UpsertHotel {
                hotel: Box::new(Hotel {
                    id: row.int8("id")?,
                    name: not_null(name, "name")?,
                    city: not_null(city, "city")?,
                    country: country.flatten().map(str::to_string),
                    stars: row.int2_opt("stars")?,
                    latitude: row.float8_opt("latitude")?,
                    longitude: row.float8_opt("longitude")?,
                    amenities,
                }),
                unsent,
            }
        }
        Table::RoomTypes => {
            let name = row.text("name")?;
            Change::UpsertRoomType {
                room_type: Box::new(RoomType {
                    hotel_id: row.int8("hotel_id")?,
                    id: row.int8("id")?,
                    name: match name {
                        Some(Some(s)) => s.to_string(),
                        Some(None) => {
                            return Err(DecodeError::UnexpectedNull {
                                table: "room_types",
                                column: "name",
                            });
                        }
                        None => String::new(),
                    },
                    max_guests: row.parse("max_guests", row.required("max_guests")?, "smallint")?,
                }),
                name_unsent: name.is_none(),
            }
        }
        Table::Inventory => {
            let key = CalendarKey {
                hotel_id: row.int8("hotel_id")?,
                room_type_id: row.int8("room_type_id")?,
            };
            let Some(night) = row.night()? else {
                return Ok(None);
            };
            Change::UpsertNight {
                key,
                night,
                counts: NightCounts {
                    total: row.int4("total")?,
                    taken: row.int4("taken")?,
                    sell_limit: row.int4_opt("sell_limit")?,
                    price_cents: row.int4_opt("price_cents")?,
                },
            }
        }
    }))
}

/// The row's key as a delete; `None` for a night the copy does not hold
/// (it never held that row).
fn delete(table: Table, data: &RowData) -> Result<Option<Change>, DecodeError> {
    let row = Row {
        table: table.name(),
        data,
    };
    Ok(Some(match table {
        Table::Hotels => Change::DeleteHotel {
            id: row.int8("id")?,
        },
        Table::RoomTypes => Change::DeleteRoomType {
            hotel_id: row.int8("hotel_id")?,
            id: row.int8("id")?,
        },
        Table::Inventory => {
            let key = CalendarKey {
                hotel_id: row.int8("hotel_id")?,
                room_type_id: row.int8("room_type_id")?,
            };
            let Some(night) = row.night()? else {
                return Ok(None);
            };
            Change::DeleteNight { key, night }
        }
    }))
}

/// PostgreSQL's ISO text for a date outside years 1 to 9999: `infinity`,
/// `-infinity`, a year before 1 (`0044-03-15 BC`) or one of five digits or more.
fn is_unheld_date_text(s: &str) -> bool {
    if matches!(s, "infinity" | "-infinity") {
        return true;
    }
    let (ymd, bc) = match s.strip_suffix(" BC") {
        Some(ymd) => (ymd, true),
        None => (s, false),
    };
    let digits = |part: &str| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit());
    let mut parts = ymd.split('-');
    let (Some(year), Some(month), Some(day), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    digits(year)
        && digits(month)
        && digits(day)
        && year.len() >= 4
        && month.len() == 2
        && day.len() == 2
        && (bc || year.len() > 4)
}

/// Parses PostgreSQL's text form of a `text[]` (`{wifi,"sea view",NULL}`)
/// into its elements in storage order; NULL elements are dropped. `None`
/// when malformed.
///
/// Every legal value reads, since the snapshot's binary COPY reads it too
/// and a refusal here halted every copy of the owner on one legal row:
/// - An array whose lower bound is not 1 carries its bounds first
///   (`[0:1]={a,b}`): `UPDATE hotels SET amenities[0] = 'pool'` makes one.
/// - An array of more dimensions (`{{a,b},{c,d}}`) is flattened, as
///   PostgreSQL's `'a' = ANY(amenities)` and `unnest` read it: a guest's
///   amenity filter asks whether the hotel has it anywhere in the array.
pub fn parse_text_array(s: &str) -> Option<Vec<String>> {
    let elements = match s.strip_prefix('[') {
        // `[l:u]` once per dimension, then `=`; the bounds hold no `=`.
        Some(_) => {
            let (bounds, rest) = s.split_once('=')?;
            let inner = bounds.strip_prefix('[')?.strip_suffix(']')?;
            for bound in inner.split("][") {
                let (lower, upper) = bound.split_once(':')?;
                lower.parse::<i32>().ok()?;
                upper.parse::<i32>().ok()?;
            }
            rest
        }
        None => s,
    };
    let mut out = Vec::new();
    let mut chars = elements.chars().peekable();
    parse_array_level(&mut chars, &mut out, 1)?;
    match chars.next() {
        None => Some(out),
        Some(_) => None,
    }
}

/// PostgreSQL's own limit on an array's dimensions (`MAXDIM`); deeper
/// nesting is malformed, and bounds the recursion on any input.
const MAX_ARRAY_DIMENSIONS: usize = 6;

/// One `{...}` level: its elements, or its sub-arrays, appended to `out`.
fn parse_array_level(
    chars: &mut std::iter::Peekable<std::str::Chars<'_>>,
    out: &mut Vec<String>,
    depth: usize,
) -> Option<()> {
    if depth > MAX_ARRAY_DIMENSIONS || chars.next()? != '{' {
        return None;
    }
    if chars.peek() == Some(&'}') {
        chars.next();
        return Some(());
    }
    loop {
        match chars.peek()? {
            '{' => parse_array_level(chars, out, depth + 1)?,
            '"' => {
                chars.next();
                let mut item = String::new();
                loop {
                    match chars.next()? {
                        '\\' => item.push(chars.next()?),
                        '"' => break,
                        c => item.push(c),
                    }
                }
                out.push(item);
            }
            _ => {
                let mut item = String::new();
                while let Some(&c) = chars.peek() {
                    match c {
                        ',' | '}' => break,
                        '\\' => {
                            chars.next();
                            item.push(chars.next()?);
                        }
                        '{' | '"' => return None,
                        c => {
                            chars.next();
                            item.push(c);
                        }
                    }
                }
                push_unquoted(out, item)?;
            }
        }
        match chars.next()? {
            ',' => continue,
            '}' => return Some(()),
            _ => return None,
        }
    }
}

fn push_unquoted(out: &mut Vec<String>, item: String) -> Option<()> {
    let item = item.trim().to_string();
    if item.is_empty() {
        return None;
    }
    if !item.eq_ignore_ascii_case("null") {
        out.push(item);
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn row(pairs: &[(&str, Option<&str>)]) -> RowData {
        RowData::from_pairs(
            pairs
                .iter()
                .map(|(k, v)| (*k, v.map_or(ColumnValue::Null, ColumnValue::text)))
                .collect(),
        )
    }

    fn inventory_insert(data: RowData) -> EventType {
        EventType::Insert {
            schema: Arc::from("public"),
            table: Arc::from("inventory"),
            relation_oid: 1,
            data,
        }
    }

    #[test]
    fn inventory_columns_by_name_extra_columns_ignored() {
        let data = row(&[
            ("note", Some("added later")),
            ("taken", Some("3")),
            ("night", Some("2027-06-10")),
            ("room_type_id", Some("2")),
            ("hotel_id", Some("1")),
            ("total", Some("5")),
            ("sell_limit", None),
            ("price_cents", Some("12000")),
        ]);
        let changes = decode("public", &inventory_insert(data)).unwrap();
        assert_eq!(
            changes,
            vec![Change::UpsertNight {
                key: CalendarKey {
                    hotel_id: 1,
                    room_type_id: 2
                },
                night: NaiveDate::from_ymd_opt(2027, 6, 10).unwrap(),
                counts: NightCounts {
                    total: 5,
                    taken: 3,
                    sell_limit: None,
                    price_cents: Some(12000)
                },
            }]
        );
    }

    #[test]
    fn other_schema_and_tables_are_ignored() {
        let data = row(&[("id", Some("1"))]);
        let ev = EventType::Insert {
            schema: Arc::from("audit"),
            table: Arc::from("inventory"),
            relation_oid: 1,
            data: data.clone(),
        };
        assert!(decode("public", &ev).unwrap().is_empty());
        let ev = EventType::Insert {
            schema: Arc::from("public"),
            table: Arc::from("bookings"),
            relation_oid: 1,
            data,
        };
        assert!(decode("public", &ev).unwrap().is_empty());
    }

    #[test]
    fn key_change_deletes_the_old_key() {
        let new = row(&[
            ("hotel_id", Some("1")),
            ("room_type_id", Some("2")),
            ("night", Some("2027-06-11")),
            ("total", Some("5")),
            ("taken", Some("0")),
            ("sell_limit", None),
            ("price_cents", None),
        ]);
        let old = row(&[
            ("hotel_id", Some("1")),
            ("room_type_id", Some("2")),
            ("night", Some("2027-06-10")),
        ]);
        let ev = EventType::Update {
            schema: Arc::from("public"),
            table: Arc::from("inventory"),
            relation_oid: 1,
            old_data: Some(old),
            new_data: new,
            replica_identity: pg_walstream::ReplicaIdentity::Default,
            key_columns: vec![],
        };
        let changes = decode("public", &ev).unwrap();
        assert_eq!(changes.len(), 2);
        assert!(
            matches!(changes[0], Change::DeleteNight { night, .. } if night.to_string() == "2027-06-10")
        );
    }

    #[test]
    fn nights_outside_the_held_years_are_left_out_not_an_error() {
        let night_row = |night: &str| {
            row(&[
                ("hotel_id", Some("1")),
                ("room_type_id", Some("2")),
                ("night", Some(night)),
                ("total", Some("5")),
                ("taken", Some("0")),
                ("sell_limit", None),
                ("price_cents", None),
            ])
        };
        let key_row = |night: &str| {
            row(&[
                ("hotel_id", Some("1")),
                ("room_type_id", Some("2")),
                ("night", Some(night)),
            ])
        };
        let update = |old: &str, new: &str| EventType::Update {
            schema: Arc::from("public"),
            table: Arc::from("inventory"),
            relation_oid: 1,
            old_data: Some(key_row(old)),
            new_data: night_row(new),
            replica_identity: pg_walstream::ReplicaIdentity::Default,
            key_columns: vec![],
        };
        let not_held = [
            "infinity",
            "-infinity",
            "0044-03-15 BC",
            "0001-01-01 BC",
            "10000-01-01",
            "5874897-12-31",
        ];
        for night in not_held {
            assert_eq!(
                decode("public", &inventory_insert(night_row(night))),
                Ok(vec![])
            );
            let delete = EventType::Delete {
                schema: Arc::from("public"),
                table: Arc::from("inventory"),
                relation_oid: 1,
                old_data: key_row(night),
                replica_identity: pg_walstream::ReplicaIdentity::Default,
                key_columns: vec![],
            };
            assert_eq!(decode("public", &delete), Ok(vec![]));
            // Moved onto a held night: only its upsert; moved off one: only
            // the delete of the night it left.
            let onto = decode("public", &update(night, "2027-06-11")).unwrap();
            assert!(
                matches!(&onto[..], [Change::UpsertNight { night, .. }] if night.to_string() == "2027-06-11")
            );
            let off = decode("public", &update("2027-06-10", night)).unwrap();
            assert!(
                matches!(&off[..], [Change::DeleteNight { night, .. }] if night.to_string() == "2027-06-10")
            );
        }
        for not_held in ["0001-01-01", "1899-12-31", "2200-01-01", "9999-12-31"] {
            assert_eq!(
                decode("public", &inventory_insert(night_row(not_held))),
                Ok(vec![]),
                "{not_held}"
            );
        }
        for held in ["1900-01-01", "1969-12-31", "2199-12-31"] {
            let changes = decode("public", &inventory_insert(night_row(held))).unwrap();
            assert!(
                matches!(&changes[..], [Change::UpsertNight { night, .. }] if night.to_string() == held)
            );
        }
        // Not a date PostgreSQL writes: still an error.
        for bad in [
            "2027-13-01",
            "infinite",
            "12345",
            "2027-06-10 AD",
            "44-03-15 BC",
        ] {
            assert!(
                decode("public", &inventory_insert(night_row(bad))).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn bad_values_name_the_column_not_the_value() {
        let data = row(&[
            ("hotel_id", Some("1")),
            ("room_type_id", Some("2")),
            ("night", Some("not-a-date")),
            ("total", Some("5")),
            ("taken", Some("0")),
            ("sell_limit", None),
            ("price_cents", None),
        ]);
        let err = decode("public", &inventory_insert(data)).unwrap_err();
        assert_eq!(
            err,
            DecodeError::BadValue {
                table: "inventory",
                column: "night",
                expected: "date"
            }
        );
        assert!(!err.to_string().contains("not-a-date"));
        let missing = row(&[("hotel_id", Some("1"))]);
        assert!(matches!(
            decode("public", &inventory_insert(missing)),
            Err(DecodeError::MissingColumn { .. })
        ));
    }

    #[test]
    fn hotel_update_without_toasted_columns_marks_them_unsent() {
        let data = row(&[
            ("id", Some("7")),
            ("stars", Some("4")),
            ("latitude", None),
            ("longitude", None),
        ]);
        let ev = EventType::Update {
            schema: Arc::from("public"),
            table: Arc::from("hotels"),
            relation_oid: 1,
            old_data: None,
            new_data: data,
            replica_identity: pg_walstream::ReplicaIdentity::Default,
            key_columns: vec![],
        };
        let changes = decode("public", &ev).unwrap();
        let Change::UpsertHotel { hotel, unsent } = &changes[0] else {
            panic!("{changes:?}")
        };
        assert_eq!(hotel.stars, Some(4));
        assert!(unsent.name && unsent.city && unsent.country && unsent.amenities);
    }

    #[test]
    fn text_arrays() {
        assert_eq!(parse_text_array("{}"), Some(vec![]));
        assert_eq!(
            parse_text_array("{wifi,pool}"),
            Some(vec!["wifi".into(), "pool".into()])
        );
        assert_eq!(
            parse_text_array(r#"{"sea view","a \"b\"",NULL,x}"#),
            Some(vec!["sea view".into(), "a \"b\"".into(), "x".into()])
        );
        assert_eq!(
            parse_text_array("[0:1]={pool,wifi}"),
            Some(vec!["pool".into(), "wifi".into()])
        );
        assert_eq!(
            parse_text_array("[-3:-3]={\"sea view\"}"),
            Some(vec!["sea view".into()])
        );
        // More dimensions: flattened in storage order, as `unnest` reads them.
        let flat = |items: &[&str]| Some(items.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(parse_text_array("{{a}}"), flat(&["a"]));
        assert_eq!(
            parse_text_array(r#"{{wifi,NULL},{"sea view",pool}}"#),
            flat(&["wifi", "sea view", "pool"])
        );
        assert_eq!(
            parse_text_array("[0:1][1:2]={{a,b},{c,d}}"),
            flat(&["a", "b", "c", "d"])
        );
        assert_eq!(parse_text_array("{{{{{{a}}}}}}"), flat(&["a"]));
        for bad in [
            "",
            "{",
            "wifi",
            "{a,,b}",
            "{\"a}",
            "{a\"b}",
            "{a,{b}}x",
            "{a}}",
            "{{{{{{{a}}}}}}}",
            "[0:1]{a,b}",
            "[x:1]={a}",
            "[0:1]x[1:2]={{a,b}}",
        ] {
            assert_eq!(parse_text_array(bad), None, "{bad}");
        }
    }

    /// PostgreSQL's own quoting rule for array output, to round-trip against.
    fn pg_array_literal(items: &[String]) -> String {
        let quoted: Vec<String> = items
            .iter()
            .map(|s| {
                let needs = s.is_empty()
                    || s.eq_ignore_ascii_case("null")
                    || s.chars().any(|c| {
                        matches!(c, '{' | '}' | ',' | '"' | '\\' | ' ') || c.is_whitespace()
                    });
                if needs {
                    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
                } else {
                    s.clone()
                }
            })
            .collect();
        format!("{{{}}}", quoted.join(","))
    }

    proptest! {
        #[test]
        fn text_array_round_trips(items in proptest::collection::vec("\\PC{0,12}", 0..6)) {
            let lit = pg_array_literal(&items);
            prop_assert_eq!(parse_text_array(&lit), Some(items));
        }

        /// Two dimensions read as their rows one after the other.
        #[test]
        fn a_text_array_of_two_dimensions_reads_flattened(
            rows in proptest::collection::vec(proptest::collection::vec("\\PC{0,8}", 3), 1..4),
        ) {
            let lit = format!(
                "{{{}}}",
                rows.iter().map(|r| pg_array_literal(r)).collect::<Vec<_>>().join(",")
            );
            prop_assert_eq!(parse_text_array(&lit), Some(rows.concat()));
        }

        #[test]
        fn text_array_never_panics(s in "\\PC{0,40}") {
            let _ = parse_text_array(&s);
        }

        /// Any value in any one column of any table, as the wire may carry
        /// it (text, including invalid UTF-8; binary; NULL; not sent), never
        /// panics: it decodes, or it is a typed error naming that table and
        /// column and never quoting the value.
        #[test]
        fn any_value_in_any_column_decodes_or_names_its_column(
            (table, column) in proptest::sample::select(ALL_COLUMNS.to_vec()),
            value in wire_value(),
            op in 0..3u8,
        ) {
            let mut pairs: Vec<(&str, ColumnValue)> = valid_row(table)
                .iter()
                .filter(|(k, _)| *k != column)
                .map(|(k, v)| (*k, ColumnValue::text(v)))
                .collect();
            let shown = match &value {
                Some(v) => {
                    pairs.push((column, v.clone()));
                    v.as_str().map(str::to_string)
                }
                None => None,
            };
            let data = RowData::from_pairs(pairs);
            let (schema, name): (Arc<str>, Arc<str>) = (Arc::from("public"), Arc::from(table));
            let event = match op {
                0 => EventType::Insert { schema, table: name, relation_oid: 1, data },
                1 => EventType::Update {
                    schema,
                    table: name,
                    relation_oid: 1,
                    old_data: None,
                    new_data: data,
                    replica_identity: pg_walstream::ReplicaIdentity::Default,
                    key_columns: vec![],
                },
                _ => EventType::Delete {
                    schema,
                    table: name,
                    relation_oid: 1,
                    old_data: data,
                    replica_identity: pg_walstream::ReplicaIdentity::Default,
                    key_columns: vec![],
                },
            };
            if let Err(e) = decode("public", &event) {
                let (t, c) = match &e {
                    DecodeError::MissingColumn { table, column }
                    | DecodeError::BadValue { table, column, .. }
                    | DecodeError::UnexpectedNull { table, column } => (*table, *column),
                };
                prop_assert_eq!(t, table);
                prop_assert_eq!(c, column, "{}", e);
                // Messages hold no digits: a value with some would show.
                if let Some(v) = shown.filter(|v| v.len() >= 4 && v.chars().any(|c| c.is_ascii_digit())) {
                    let message = e.to_string();
                    prop_assert!(!message.contains(&v), "{} quotes the value", message);
                }
            }
        }
    }

    /// Every column the decoder reads, by table.
    const ALL_COLUMNS: [(&str, &str); 19] = [
        ("hotels", "id"),
        ("hotels", "name"),
        ("hotels", "city"),
        ("hotels", "country"),
        ("hotels", "stars"),
        ("hotels", "latitude"),
        ("hotels", "longitude"),
        ("hotels", "amenities"),
        ("room_types", "hotel_id"),
        ("room_types", "id"),
        ("room_types", "name"),
        ("room_types", "max_guests"),
        ("inventory", "hotel_id"),
        ("inventory", "room_type_id"),
        ("inventory", "night"),
        ("inventory", "total"),
        ("inventory", "taken"),
        ("inventory", "sell_limit"),
        ("inventory", "price_cents"),
    ];

    /// A row of `table` that decodes.
    fn valid_row(table: &str) -> Vec<(&'static str, &'static str)> {
        match table {
            "hotels" => vec![
                ("id", "1"),
                ("name", "Hotel"),
                ("city", "Lisbon"),
                ("country", "PT"),
                ("stars", "4"),
                ("latitude", "38.7"),
                ("longitude", "-9.1"),
                ("amenities", "{wifi}"),
            ],
            "room_types" => vec![
                ("hotel_id", "1"),
                ("id", "2"),
                ("name", "Double"),
                ("max_guests", "2"),
            ],
            _ => vec![
                ("hotel_id", "1"),
                ("room_type_id", "2"),
                ("night", "2030-01-01"),
                ("total", "5"),
                ("taken", "0"),
                ("sell_limit", "4"),
                ("price_cents", "10000"),
            ],
        }
    }

    /// `None`: the column was not sent (an unchanged TOAST value).
    fn wire_value() -> impl Strategy<Value = Option<ColumnValue>> {
        prop_oneof![
            "\\PC{0,24}".prop_map(|s| Some(ColumnValue::text(&s))),
            // Numbers and dates near the edges of their types.
            "-?[0-9]{1,40}(\\.[0-9]{0,4})?".prop_map(|s| Some(ColumnValue::text(&s))),
            "[0-9]{1,6}-[0-9]{1,3}-[0-9]{1,3}".prop_map(|s| Some(ColumnValue::text(&s))),
            proptest::collection::vec(any::<u8>(), 0..16)
                .prop_map(|b| Some(ColumnValue::text_bytes(bytes::Bytes::from(b)))),
            proptest::collection::vec(any::<u8>(), 0..16)
                .prop_map(|b| Some(ColumnValue::binary_bytes(bytes::Bytes::from(b)))),
            Just(Some(ColumnValue::Null)),
            Just(None),
        ]
    }
}

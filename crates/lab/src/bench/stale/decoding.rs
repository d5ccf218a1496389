//! The owner's commit log, as `test_decoding` writes it.
//!
//! A logical slot with the `test_decoding` plugin, read with
//! `pg_logical_slot_get_changes(..., 'include-xids', '1',
//! 'include-timestamp', '1')`, gives one row per line: `BEGIN <xid>`, one
//! line per changed row (`table public.inventory: UPDATE: hotel_id[bigint]:1
//! ...`), and `COMMIT <xid> (at <time>)`, whose `lsn` column is the end of
//! the commit record. Transactions come whole and in commit order. Only
//! `inventory` matters to the judge; every other table's lines are skipped.

use chrono::NaiveDate;
use vacancy_service::Lsn;

use super::judge::{Commit, NightKey, NightRow};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodingError {
    #[error("{what} at {lsn}: {line:?}")]
    Line {
        what: &'static str,
        lsn: Lsn,
        /// The line, cut to 200 characters.
        line: String,
    },
}

fn bad(what: &'static str, lsn: Lsn, line: &str) -> DecodingError {
    DecodingError::Line {
        what,
        lsn,
        line: line.chars().take(200).collect(),
    }
}

/// The commits of `lines` (`(lsn, data)` as the slot gave them) that
/// changed `inventory`, in order. Changes outside a transaction, a
/// transaction left open at the end, or an `inventory` line that cannot be
/// read are errors: a judge that guessed would judge wrong.
pub fn commits<'a>(
    lines: impl IntoIterator<Item = (Lsn, &'a str)>,
) -> Result<Vec<Commit>, DecodingError> {
    let mut out = Vec::new();
    let mut open: Option<Vec<(NightKey, Option<NightRow>)>> = None;
    for (lsn, line) in lines {
        if line.starts_with("BEGIN") {
            if open.is_some() {
                return Err(bad("BEGIN inside a transaction", lsn, line));
            }
            open = Some(Vec::new());
        } else if line.starts_with("COMMIT") {
            let changes = open
                .take()
                .ok_or_else(|| bad("COMMIT without BEGIN", lsn, line))?;
            if !changes.is_empty() {
                out.push(Commit {
                    end_lsn: lsn,
                    changes,
                });
            }
        } else if let Some(rest) = line.strip_prefix("table ") {
            let changes = open
                .as_mut()
                .ok_or_else(|| bad("a change outside a transaction", lsn, line))?;
            let (table, change) = rest
                .split_once(": ")
                .ok_or_else(|| bad("no table name", lsn, line))?;
            if table.rsplit('.').next() != Some("inventory") {
                continue;
            }
            changes.push(inventory_change(change).map_err(|what| bad(what, lsn, line))?);
        }
        // Anything else (a message, a future line kind) says nothing about
        // inventory.
    }
    if open.is_some() {
        return Err(bad("a transaction without COMMIT", Lsn::ZERO, "(end)"));
    }
    Ok(out)
}

/// One `inventory` change: `INSERT: cols`, `UPDATE: [old-key: cols
/// new-tuple:] cols` or `DELETE: cols`.
fn inventory_change(change: &str) -> Result<(NightKey, Option<NightRow>), &'static str> {
    let (kind, tuples) = change.split_once(": ").ok_or("no change kind")?;
    // With an old key, the row after the change is the new tuple.
    let row = match tuples.split_once("new-tuple: ") {
        Some((_, new)) => new,
        None => tuples,
    };
    let values = columns(row)?;
    let get = |name: &str| values.iter().find(|(n, _)| n == name).map(|(_, v)| v);
    let int = |name: &'static str| -> Result<Option<i64>, &'static str> {
        match get(name).ok_or(name)? {
            None => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|_| name),
        }
    };
    let required = |name: &'static str| int(name)?.ok_or(name);
    let small = |v: i64| i32::try_from(v).map_err(|_| "a count out of range");
    let night = match get("night").ok_or("night")? {
        Some(v) => NaiveDate::parse_from_str(v, "%Y-%m-%d").map_err(|_| "night")?,
        None => return Err("night"),
    };
    let key = NightKey {
        hotel_id: required("hotel_id")?,
        room_type_id: required("room_type_id")?,
        night,
    };
    match kind {
        "INSERT" | "UPDATE" => Ok((
            key,
            Some(NightRow {
                total: small(required("total")?)?,
                taken: small(required("taken")?)?,
                sell_limit: int("sell_limit")?.map(small).transpose()?,
            }),
        )),
        "DELETE" => Ok((key, None)),
        _ => Err("a change the judge cannot replay (TRUNCATE?)"),
    }
}

/// `name[type]:value` pairs; a value is `null`, a quoted string (`''` for
/// a quote) or a bare token.
fn columns(mut s: &str) -> Result<Vec<(String, Option<String>)>, &'static str> {
    let mut out = Vec::new();
    loop {
        s = s.trim_start();
        if s.is_empty() {
            return Ok(out);
        }
        let open = s.find('[').ok_or("a column without a type")?;
        let name = &s[..open];
        let close = s[open..].find("]:").ok_or("a column without a value")? + open;
        s = &s[close + 2..];
        if let Some(quoted) = s.strip_prefix('\'') {
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            let end = loop {
                match chars.next() {
                    Some((i, '\'')) => {
                        if quoted[i + 1..].starts_with('\'') {
                            value.push('\'');
                            chars.next();
                        } else {
                            break i + 1;
                        }
                    }
                    Some((_, c)) => value.push(c),
                    None => return Err("an unterminated quoted value"),
                }
            };
            out.push((name.to_string(), Some(value)));
            s = &quoted[end..];
        } else {
            let end = s.find(' ').unwrap_or(s.len());
            let token = &s[..end];
            out.push((
                name.to_string(),
                (token != "null").then(|| token.to_string()),
            ));
            s = &s[end..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UPDATE: &str = "table public.inventory: UPDATE: hotel_id[bigint]:3 room_type_id[bigint]:2 night[date]:'2030-06-10' total[integer]:5 taken[integer]:4 sell_limit[integer]:null price_cents[integer]:10000";

    #[test]
    fn commits_carry_their_inventory_rows_at_the_commit_end() {
        let lines = [
            (Lsn(1), "BEGIN 700"),
            (
                Lsn(2),
                "table public.bookings: INSERT: id[text]:'sim-1-0-1' note[text]:'it''s: new-tuple: x'",
            ),
            (Lsn(3), UPDATE),
            (Lsn(9), "COMMIT 700 (at 2030-06-01 10:00:00.123456+00)"),
            (Lsn(10), "BEGIN 701"),
            (Lsn(11), "table public.bookings: UPDATE: id[text]:'x'"),
            (Lsn(12), "COMMIT 701 (at 2030-06-01 10:00:00.2+00)"),
            (Lsn(13), "BEGIN 702"),
            (
                Lsn(14),
                "table public.inventory: DELETE: hotel_id[bigint]:3 room_type_id[bigint]:2 night[date]:'2030-06-11'",
            ),
            (
                Lsn(15),
                "table public.inventory: INSERT: hotel_id[bigint]:3 room_type_id[bigint]:2 night[date]:'2030-06-12' total[integer]:5 taken[integer]:0 sell_limit[integer]:3 price_cents[integer]:null",
            ),
            (Lsn(16), "COMMIT 702 (at 2030-06-01 10:00:00.3+00)"),
        ];
        let got = commits(lines).unwrap();
        let key = |d| NightKey {
            hotel_id: 3,
            room_type_id: 2,
            night: NaiveDate::from_ymd_opt(2030, 6, d).unwrap(),
        };
        assert_eq!(
            got,
            vec![
                Commit {
                    end_lsn: Lsn(9),
                    changes: vec![(
                        key(10),
                        Some(NightRow {
                            total: 5,
                            taken: 4,
                            sell_limit: None
                        })
                    )],
                },
                Commit {
                    end_lsn: Lsn(16),
                    changes: vec![
                        (key(11), None),
                        (
                            key(12),
                            Some(NightRow {
                                total: 5,
                                taken: 0,
                                sell_limit: Some(3)
                            })
                        )
                    ],
                },
            ],
            "the bookings-only commit is left out"
        );
    }

    #[test]
    fn an_update_with_its_old_key_reads_the_new_tuple() {
        let line = "table public.inventory: UPDATE: old-key: hotel_id[bigint]:3 room_type_id[bigint]:2 night[date]:'2030-06-10' new-tuple: hotel_id[bigint]:3 room_type_id[bigint]:2 night[date]:'2030-06-10' total[integer]:6 taken[integer]:1 sell_limit[integer]:null price_cents[integer]:1";
        let got = commits([(Lsn(1), "BEGIN 1"), (Lsn(2), line), (Lsn(3), "COMMIT 1")]).unwrap();
        assert_eq!(got[0].changes[0].1.map(|r| r.total), Some(6));
    }

    #[test]
    fn what_cannot_be_replayed_is_an_error() {
        let truncate = "table public.inventory: TRUNCATE: (no-flags)";
        assert!(
            commits([
                (Lsn(1), "BEGIN 1"),
                (Lsn(2), truncate),
                (Lsn(3), "COMMIT 1")
            ])
            .is_err()
        );
        assert!(
            commits([(Lsn(2), UPDATE)]).is_err(),
            "outside a transaction"
        );
        assert!(
            commits([(Lsn(1), "BEGIN 1"), (Lsn(2), UPDATE)]).is_err(),
            "never committed"
        );
        let cut = "table public.inventory: UPDATE: hotel_id[bigint]:3 night[date]:'2030-06-10";
        assert!(commits([(Lsn(1), "BEGIN 1"), (Lsn(2), cut), (Lsn(3), "COMMIT 1")]).is_err());
        let no_taken = "table public.inventory: UPDATE: hotel_id[bigint]:3 room_type_id[bigint]:2 night[date]:'2030-06-10' total[integer]:5";
        assert!(
            commits([
                (Lsn(1), "BEGIN 1"),
                (Lsn(2), no_taken),
                (Lsn(3), "COMMIT 1")
            ])
            .is_err()
        );
    }
}

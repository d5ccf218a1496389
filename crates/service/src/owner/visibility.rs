//! Owner reads that see every commit the copy has already applied.
//!
//! PostgreSQL commits in steps: the commit record is flushed to the WAL, the
//! commit log marks the transaction committed, and only then (after any wait
//! for a synchronous standby) do other sessions see it. The logical stream
//! reads the WAL, so the copy can apply a transaction that a read on the
//! owner, begun later, does not see yet: for a moment on a busy machine, for
//! a whole standby round trip when the owner runs synchronous replication.
//! A read that corrects the copy (the TTL re-read) or judges it (the
//! divergence audit) must not trust such a snapshot, or it would put an
//! older value over a newer one, or call a correct row wrong.
//!
//! Nothing on the owner tells such a transaction apart from an open one
//! (`pg_xact_status` says "in progress" for both, on purpose), but the copy
//! knows: it applied it, so it committed. So the read returns its own
//! snapshot ([`seeing`]), and the caller checks it against the xids the
//! stream applied (`model::AppliedXids`); [`read_seeing`] reads again until
//! no applied transaction is hidden from the snapshot.

use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row};

use crate::model::xids::{AppliedXids, XidMark, precedes};

/// How long to wait before asking again while a commit is still hidden.
const RETRY: Duration = Duration::from_millis(10);

#[derive(Debug, thiserror::Error)]
pub enum VisibilityError {
    #[error("owner query failed: {0}")]
    Query(#[from] tokio_postgres::Error),
    #[error("the owner returned an unreadable snapshot: {0:?}")]
    Snapshot(String),
}

/// An owner snapshot (`pg_current_snapshot()`): which transactions it
/// treats as still running. The stream names transactions by their 32-bit
/// xid, so a snapshot's 64-bit ones are compared by their low 32 bits with
/// wraparound, as PostgreSQL does; every xid that matters here is recent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    xmin: u32,
    xmax: u32,
    running: Vec<u32>,
}

impl Snapshot {
    /// From the text form `xmin:xmax:xip,xip,...`.
    pub fn parse(text: &str) -> Result<Snapshot, VisibilityError> {
        let bad = || VisibilityError::Snapshot(text.to_string());
        // Truncation to the low 32 bits is the point: see the type's doc.
        let xid = |s: &str| s.parse::<u64>().map(|x| x as u32).map_err(|_| bad());
        let mut parts = text.split(':');
        let (Some(xmin), Some(xmax), Some(xip), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let running = xip
            .split(',')
            .filter(|s| !s.is_empty())
            .map(xid)
            .collect::<Result<Vec<u32>, _>>()?;
        Ok(Snapshot {
            xmin: xid(xmin)?,
            xmax: xid(xmax)?,
            running,
        })
    }

    /// Whether a transaction that committed (the stream delivered it) is
    /// visible in this snapshot.
    pub fn sees(&self, xid: u32) -> bool {
        precedes(xid, self.xmin) || (precedes(xid, self.xmax) && !self.running.contains(&xid))
    }

    /// Whether a transaction the copy applied before `mark` is hidden here.
    fn hides_any(&self, xids: &AppliedXids, mark: XidMark) -> bool {
        xids.any_hidden(mark, self.xmin, |xid| !self.sees(xid))
    }
}

/// `read` (whose first column is a `bigint` never null) as one statement
/// that also returns the snapshot it read in, as text, in a last column.
/// There is always at least one row: when the read finds none, a single row
/// of nulls carries the snapshot.
pub fn seeing(read: &str) -> String {
    format!(
        "WITH snapshot AS MATERIALIZED (SELECT pg_current_snapshot()::text AS seen)
         SELECT r.*, snapshot.seen FROM snapshot LEFT JOIN LATERAL ({read}) r ON true"
    )
}

/// Runs `statement` (built by `seeing`) until its snapshot hides none of the
/// transactions the copy applied before `mark`, and returns the read's rows; `None` when `limit` passed first (a synchronous standby that does
/// not answer, say), and the caller tries another time. While a commit is
/// hidden only the snapshot is asked for, so waiting costs small queries.
pub async fn read_seeing(
    client: &Client,
    statement: &str,
    params: &[&(dyn ToSql + Sync)],
    (xids, mark): (&AppliedXids, XidMark),
    limit: Duration,
) -> Result<Option<Vec<Row>>, VisibilityError> {
    let started = Instant::now();
    loop {
        let now = client
            .query_one("SELECT pg_current_snapshot()::text", &[])
            .await?;
        if !Snapshot::parse(&now.try_get::<_, String>(0)?)?.hides_any(xids, mark) {
            let rows = client.query(statement, params).await?;
            let seen = match rows.first() {
                Some(row) => row.try_get::<_, String>(row.len() - 1)?,
                None => return Err(VisibilityError::Snapshot(String::new())),
            };
            if !Snapshot::parse(&seen)?.hides_any(xids, mark) {
                // The padding row of an empty read has a null first column.
                return Ok(Some(
                    rows.into_iter()
                        .filter(|r| r.try_get::<_, Option<i64>>(0).ok().flatten().is_some())
                        .collect(),
                ));
            }
        }
        if started.elapsed() + RETRY > limit {
            return Ok(None);
        }
        tokio::time::sleep(RETRY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pg_current_snapshot_text() {
        let s = Snapshot::parse("1108:1115:1108,1112").unwrap();
        assert_eq!(
            s,
            Snapshot {
                xmin: 1108,
                xmax: 1115,
                running: vec![1108, 1112]
            }
        );
        assert_eq!(Snapshot::parse("7:7:").unwrap().running, Vec::<u32>::new());
        // An epoch above zero: the low 32 bits are the stream's xid.
        let epoch = (3u64 << 32) + 42;
        let s = Snapshot::parse(&format!("{epoch}:{}:", epoch + 1)).unwrap();
        assert_eq!((s.xmin, s.xmax), (42, 43));
        for bad in ["", "1:2", "1:2:3:4", "a:2:", "1:2:x"] {
            assert!(Snapshot::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sees_what_finished_before_it_and_hides_the_rest() {
        let s = Snapshot::parse("100:110:100,105").unwrap();
        assert!(s.sees(99), "finished before xmin");
        assert!(s.sees(101) && s.sees(109), "finished, below xmax");
        assert!(!s.sees(100) && !s.sees(105), "still running");
        assert!(!s.sees(110) && !s.sees(200), "at or past xmax");
        // Committing but not yet visible, as under a synchronous standby's
        // wait: past xmax, with nothing running.
        let waiting = Snapshot::parse("1108:1108:").unwrap();
        assert!(!waiting.sees(1108));
        assert!(waiting.sees(1107));
    }

    #[test]
    fn xids_wrap_around() {
        assert!(precedes(u32::MAX - 1, 5));
        assert!(!precedes(5, u32::MAX - 1));
        let s = Snapshot::parse(&format!("{0}:10:{0}", u32::MAX - 2)).unwrap();
        assert!(s.sees(u32::MAX - 3));
        assert!(!s.sees(u32::MAX - 2));
        assert!(
            s.sees(3),
            "past the wrap, below xmax and not running: finished"
        );
        assert!(!s.sees(10));
    }
}

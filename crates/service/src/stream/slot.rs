//! Slot and publication: what must exist on the owner before a change can
//! reach us, and how the slot is doing.
//!
//! The publication is created when missing if the role may; otherwise the
//! error carries the exact SQL a DBA must run, since a replication role
//! usually lacks `CREATE` on the database. `REPLICA IDENTITY DEFAULT` (the
//! primary key) is enough for all three tables: deletes carry the key, and
//! updates carry the old key when it changes.

use tokio_postgres::Client;
use tokio_postgres::types::PgLsn;

use crate::lsn::Lsn;
use crate::model::Table;

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error(
        "publication {publication:?} is missing, lacks tables or leaves out operations, and this \
         role may not fix it; ask a DBA to run:\n  {sql}"
    )]
    PublicationNeedsDba { publication: String, sql: String },
    /// The publication leaves out rows or columns of a table the copy
    /// holds whole: a copy taken through it would differ from the owner
    /// forever, so none is taken.
    #[error(
        "publication {publication:?} publishes only part of {schema}.{table} ({what}): the copy          would miss what it leaves out; publish the whole table, for example:\n  \
         ALTER PUBLICATION {publication} SET TABLE {schema}.hotels, {schema}.room_types, {schema}.inventory;"
    )]
    PublicationFilters {
        publication: String,
        schema: String,
        table: String,
        what: &'static str,
    },
    /// A table's replica identity leaves out a column of its key: the old
    /// row of a DELETE arrives without it, and the stream could not tell
    /// which row went.
    #[error(
        "{schema}.{table}'s replica identity (an index on {columns}) leaves out its key ({key}): \
         a deleted row could not be told apart; ask a DBA to run:\n  \
         ALTER TABLE {schema}.{table} REPLICA IDENTITY DEFAULT;"
    )]
    ReplicaIdentity {
        schema: String,
        table: String,
        columns: String,
        key: String,
    },
    /// A slot of this name belongs to another database of the owner's
    /// cluster (slot names are the cluster's, not a database's): it is
    /// neither resumed nor replaced, and no checkpoint made on it is loaded.
    #[error(
        "slot {slot:?} belongs to database {database:?}, not to this one ({ours:?}): its changes are not this database's, and replacing it would break whoever follows it; give this node its own stream.slot"
    )]
    OtherDatabase {
        slot: String,
        database: String,
        ours: String,
    },
    #[error("owner query failed: {0}")]
    Query(#[from] tokio_postgres::Error),
}

/// The slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    pub active: bool,
    pub active_pid: Option<i32>,
    /// `reserved`, `extended`, `unreserved` or `lost` (invalidated by
    /// `max_slot_wal_keep_size`: its changes are gone).
    pub wal_status: Option<String>,
    pub confirmed_flush: Option<Lsn>,
    /// WAL the server keeps for this slot (current position − restart_lsn).
    pub retained_bytes: Option<i64>,
    /// WAL that can still be written before `max_slot_wal_keep_size` lets
    /// the server remove what this slot needs (`safe_wal_size`; none when
    /// that setting is unlimited).
    pub safe_wal_bytes: Option<i64>,
    /// The database the slot decodes (none for a physical slot), and the
    /// one this connection reached.
    pub database: Option<String>,
    pub current_database: String,
}

impl SlotInfo {
    /// `OtherDatabase` unless the slot decodes this connection's database.
    pub fn check_database(&self, slot: &str) -> Result<(), SlotError> {
        match &self.database {
            Some(database) if *database == self.current_database => Ok(()),
            other => Err(SlotError::OtherDatabase {
                slot: slot.to_string(),
                database: other
                    .clone()
                    .unwrap_or_else(|| "none (a physical slot)".into()),
                ours: self.current_database.clone(),
            }),
        }
    }

    pub fn is_lost(&self) -> bool {
        self.wal_status.as_deref() == Some("lost")
    }
}

fn publication_sql(publication: &str, schema: &str, missing: &[Table], exists: bool) -> String {
    let tables: Vec<String> = missing
        .iter()
        .map(|t| format!("{schema}.{}", t.name()))
        .collect();
    if exists {
        format!(
            "ALTER PUBLICATION {publication} ADD TABLE {};",
            tables.join(", ")
        )
    } else {
        format!(
            "CREATE PUBLICATION {publication} FOR TABLE {};",
            tables.join(", ")
        )
    }
}

/// The operations the stream must see: a publication created by hand
/// without `truncate` (or `delete`) never tells the copy of them.
const PUBLISH_ALL: &str = "insert, update, delete, truncate";

/// Makes sure `publication` publishes the three tables whole: every row,
/// every column and every operation, which it fixes where it can (a
/// missing table, a missing operation) and refuses where it should not
/// (a row filter or a column list, a DBA's choice).
pub async fn ensure_publication(
    client: &Client,
    publication: &str,
    schema: &str,
) -> Result<(), SlotError> {
    ensure_tables(client, publication, schema).await?;
    ensure_whole_tables(client, publication, schema).await?;
    ensure_operations(client, publication).await?;
    ensure_replica_identities(client, schema).await
}

/// The columns the stream needs in a deleted row's old values: each
/// table's key.
fn key_columns(table: Table) -> &'static [&'static str] {
    match table {
        Table::Hotels => &["id"],
        Table::RoomTypes => &["hotel_id", "id"],
        Table::Inventory => &["hotel_id", "room_type_id", "night"],
    }
}

/// Refuses a replica identity `USING INDEX` whose index leaves out a key
/// column (a surrogate key's index): the default (the primary key) and
/// `FULL` send the key of every deleted row. A table with no identity at
/// all makes the owner refuse its updates and deletes, which says so
/// there.
async fn ensure_replica_identities(client: &Client, schema: &str) -> Result<(), SlotError> {
    let rows = client
        .query(
            "SELECT c.relname::text,
                    coalesce((SELECT array_agg(a.attname::text ORDER BY a.attnum)
                              FROM pg_index i
                              JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
                              WHERE i.indrelid = c.oid AND i.indisreplident), '{}')
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relreplident = 'i'",
            &[&schema],
        )
        .await?;
    for row in rows {
        let name: String = row.get(0);
        let Some(table) = Table::from_name(&name) else {
            continue;
        };
        let columns: Vec<String> = row.get(1);
        let key = key_columns(table);
        if key.iter().all(|k| columns.iter().any(|c| c == k)) {
            continue;
        }
        return Err(SlotError::ReplicaIdentity {
            schema: schema.to_string(),
            table: name,
            columns: columns.join(", "),
            key: key.join(", "),
        });
    }
    Ok(())
}

/// Refuses a publication that filters rows of, or lists only some
/// columns of, one of the three tables (PostgreSQL 15's `WHERE` and column
/// lists): the snapshot copies every row, the stream would then miss the
/// changes of the rows left out.
async fn ensure_whole_tables(
    client: &Client,
    publication: &str,
    schema: &str,
) -> Result<(), SlotError> {
    let rows = client
        .query(
            "SELECT pt.tablename::text, pt.rowfilter IS NOT NULL,
                    cardinality(pt.attnames) < (
                      SELECT count(*) FROM pg_attribute a
                      WHERE a.attrelid = format('%I.%I', pt.schemaname, pt.tablename)::regclass
                        AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '')
             FROM pg_publication_tables pt
             WHERE pt.pubname = $1 AND pt.schemaname = $2",
            &[&publication, &schema],
        )
        .await?;
    for row in rows {
        let table: String = row.get(0);
        if Table::from_name(&table).is_none() {
            continue;
        }
        let what = if row.get::<_, bool>(1) {
            "a row filter"
        } else if row.get::<_, Option<bool>>(2) == Some(true) {
            "a column list"
        } else {
            continue;
        };
        return Err(SlotError::PublicationFilters {
            publication: publication.to_string(),
            schema: schema.to_string(),
            table,
            what,
        });
    }
    Ok(())
}

/// Makes the publication publish every operation, if it does not.
async fn ensure_operations(client: &Client, publication: &str) -> Result<(), SlotError> {
    let all = client
        .query_one(
            "SELECT pubinsert AND pubupdate AND pubdelete AND pubtruncate
             FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await?
        .get::<_, bool>(0);
    if all {
        return Ok(());
    }
    let sql = format!("ALTER PUBLICATION {publication} SET (publish = '{PUBLISH_ALL}');");
    run_fix(client, publication, sql).await
}

/// Makes sure `publication` lists the three tables.
async fn ensure_tables(client: &Client, publication: &str, schema: &str) -> Result<(), SlotError> {
    let exists = client
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await?
        .is_some();
    let listed: Vec<String> = client
        .query(
            "SELECT tablename::text FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2",
            &[&publication, &schema],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let missing: Vec<Table> = Table::ALL
        .into_iter()
        .filter(|t| !listed.iter().any(|l| l == t.name()))
        .collect();
    if exists && missing.is_empty() {
        return Ok(());
    }
    let sql = publication_sql(publication, schema, &missing, exists);
    run_fix(client, publication, sql).await
}

/// Runs `sql`, which fixes the publication, or says who may run it.
async fn run_fix(client: &Client, publication: &str, sql: String) -> Result<(), SlotError> {
    match client.batch_execute(&sql).await {
        Ok(()) => {
            tracing::info!(publication, sql = %sql, "publication fixed");
            Ok(())
        }
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => {
            Err(SlotError::PublicationNeedsDba {
                publication: publication.to_string(),
                sql,
            })
        }
        Err(e) => Err(e.into()),
    }
}

/// The slot's state, or `None` when it does not exist.
pub async fn slot_info(client: &Client, slot: &str) -> Result<Option<SlotInfo>, SlotError> {
    let row = client
        .query_opt(
            "SELECT active, active_pid, wal_status, confirmed_flush_lsn,
                    (pg_current_wal_lsn() - restart_lsn)::bigint, safe_wal_size,
                    database::text, current_database()::text
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let Some(row) = row else { return Ok(None) };
    Ok(Some(SlotInfo {
        active: row.get(0),
        active_pid: row.get(1),
        wal_status: row.get(2),
        confirmed_flush: row.get::<_, Option<PgLsn>>(3).map(Lsn::from),
        retained_bytes: row.get(4),
        safe_wal_bytes: row.get(5),
        database: row.get(6),
        current_database: row.get(7),
    }))
}

/// One walsender backend: its pid and start time, which together name it
/// even after the server gives the pid to another backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walsender {
    pub pid: i32,
    pub started: chrono::DateTime<chrono::Utc>,
}

/// The walsender holding `slot`, if one does (and this role may see it).
pub async fn walsender(client: &Client, slot: &str) -> Result<Option<Walsender>, SlotError> {
    let row = client
        .query_opt(
            "SELECT a.pid, a.backend_start FROM pg_replication_slots s
             JOIN pg_stat_activity a ON a.pid = s.active_pid
             WHERE s.slot_name = $1 AND a.backend_start IS NOT NULL",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| Walsender {
        pid: r.get(0),
        started: r.get(1),
    }))
}

/// How far `walsender` (the very backend: pid and start) has read the WAL
/// for its slot (`pg_stat_replication.sent_lsn`: a logical walsender moves
/// it past every record it decodes, sent or not); `None` when that backend
/// is gone.
pub async fn walsender_read_to(
    client: &Client,
    walsender: Walsender,
) -> Result<Option<Lsn>, SlotError> {
    let row = client
        .query_opt(
            "SELECT r.sent_lsn FROM pg_stat_replication r
             JOIN pg_stat_activity a ON a.pid = r.pid
             WHERE r.pid = $1 AND a.backend_start = $2 AND r.sent_lsn IS NOT NULL",
            &[&walsender.pid, &walsender.started],
        )
        .await?;
    Ok(row.map(|r| Lsn::from(r.get::<_, PgLsn>(0))))
}

/// Ends `walsender` if it is the very backend (pid and start) that still
/// holds `slot`; whether it was signalled. A backend that merely got its
/// pid later is never touched.
pub async fn end_walsender(
    client: &Client,
    slot: &str,
    walsender: Walsender,
) -> Result<bool, SlotError> {
    let row = client
        .query_opt(
            "SELECT pg_terminate_backend(a.pid) FROM pg_replication_slots s
             JOIN pg_stat_activity a ON a.pid = s.active_pid
             WHERE s.slot_name = $1 AND a.pid = $2 AND a.backend_start = $3",
            &[&slot, &walsender.pid, &walsender.started],
        )
        .await?;
    Ok(row.is_some_and(|r| r.get::<_, bool>(0)))
}

/// Drops the slot, first ending a walsender still attached to it (our own
/// dead session's, typically, which the server has not noticed yet).
/// The advisory lock a session holds over `slot` from before it looks at
/// the slot until it streams from it (`replicate::connect_and_start`). A
/// slot is not active between `CREATE_REPLICATION_SLOT` and
/// `START_REPLICATION` (PostgreSQL releases it at creation): while its
/// creator loads the snapshot, minutes on a large copy, only this lock says
/// someone is about to stream from it, so a standby projector does not
/// take it for free, drop it and make its own, which the first would then
/// start from past its consistent point, missing the commits between.
const SLOT_LOCK_SQL: &str =
    "SELECT pg_try_advisory_lock(hashtextextended('vacancy.slot:' || $1, 0))";
const SLOT_UNLOCK_SQL: &str =
    "SELECT pg_advisory_unlock(hashtextextended('vacancy.slot:' || $1, 0))";

/// Takes the slot's session lock on `client` if no other session holds it
/// (see `SLOT_LOCK_SQL`); held until `client` closes or `unlock_slot`.
pub async fn try_lock_slot(client: &Client, slot: &str) -> Result<bool, SlotError> {
    Ok(client.query_one(SLOT_LOCK_SQL, &[&slot]).await?.get(0))
}

/// Releases what `try_lock_slot` took on `client`.
pub async fn unlock_slot(client: &Client, slot: &str) -> Result<(), SlotError> {
    client.query_one(SLOT_UNLOCK_SQL, &[&slot]).await?;
    Ok(())
}

pub async fn drop_slot(client: &Client, slot: &str) -> Result<(), SlotError> {
    // A terminated walsender releases the slot asynchronously, and a client
    // may reconnect to it meanwhile: end whoever holds it on every attempt.
    let mut last = None;
    for _ in 0..50 {
        client
            .execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                 WHERE slot_name = $1 AND active_pid IS NOT NULL
                   AND database = current_database()",
                &[&slot],
            )
            .await?;
        match client
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                 WHERE slot_name = $1 AND database = current_database()",
                &[&slot],
            )
            .await
        {
            Ok(_) => return Ok(()),
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE) => {
                last = Some(e);
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(last.expect("loop ran").into())
}

/// A fingerprint of the published tables' columns: schema, table, column
/// number, name and type, in that order, hashed (SHA-256). A checkpoint's
/// rows were decoded under these columns; after an `ALTER TABLE` on a
/// published table they may no longer mean what they meant, so a
/// checkpoint made before is not loaded.
pub async fn columns_fingerprint(client: &Client, publication: &str) -> Result<Vec<u8>, SlotError> {
    use sha2::Digest;
    let rows = client
        .query(
            "SELECT pt.schemaname::text, pt.tablename::text, a.attnum::int4, a.attname::text,
                    format_type(a.atttypid, a.atttypmod)
             FROM pg_publication_tables pt
             JOIN pg_namespace n ON n.nspname = pt.schemaname
             JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename
             JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
             WHERE pt.pubname = $1
             ORDER BY 1, 2, 3",
            &[&publication],
        )
        .await?;
    let mut hash = sha2::Sha256::new();
    for row in &rows {
        let number: i32 = row.get(2);
        // Each field length-prefixed: a quoted name may hold any character,
        // so no separator could keep two column lists from hashing alike.
        for field in [
            row.get::<_, String>(0),
            row.get(1),
            number.to_string(),
            row.get(3),
            row.get(4),
        ] {
            hash.update((field.len() as u64).to_le_bytes());
            hash.update(field.as_bytes());
        }
    }
    Ok(hash.finalize().to_vec())
}

/// The oldest transactions open on the owner that hold an xid, as
/// `CREATE_REPLICATION_SLOT` waits for them: "pid 4711 (xid 829, open
/// 312 s, idle in transaction)", or a prepared one left behind, "prepared
/// 'gid' (xid 830, open 90000 s, prepared)"; at most `limit`, oldest first. What an
/// operator needs to find what holds a new slot back; never the query
/// text, which may carry guests' data.
pub async fn open_transactions(client: &Client, limit: i64) -> Result<Vec<String>, SlotError> {
    let rows = client
        .query(
            "SELECT what, xid, extract(epoch FROM now() - since)::float8, state FROM (
               SELECT format('pid %s', pid) AS what, backend_xid::text AS xid,
                      xact_start AS since, coalesce(state, '') AS state
               FROM pg_stat_activity
               WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
               UNION ALL
               SELECT format('prepared %L', gid), transaction::text, prepared, 'prepared'
               FROM pg_prepared_xacts
             ) t
             ORDER BY since NULLS LAST
             LIMIT $1",
            &[&limit],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| {
            let what: String = row.get(0);
            let xid: Option<String> = row.get(1);
            let open: Option<f64> = row.get(2);
            let state: String = row.get(3);
            format!(
                "{what} (xid {}, open {:.0} s, {state})",
                xid.as_deref().unwrap_or("?"),
                open.unwrap_or(0.0)
            )
        })
        .collect())
}

/// Cancels the walsender still creating `slot` (a creation this process
/// gave up on: the walsender waits on the owner's open transactions and
/// does not notice its client is gone), so the half-made slot goes with
/// its error instead of holding the name until those transactions end.
/// Only a slot of this database still being made (no `confirmed_flush_lsn`
/// until its start point is found): never another's walsender.
pub async fn cancel_creation(client: &Client, slot: &str) -> Result<(), SlotError> {
    client
        .execute(
            "SELECT pg_cancel_backend(active_pid) FROM pg_replication_slots
             WHERE slot_name = $1 AND active_pid IS NOT NULL
               AND database = current_database() AND confirmed_flush_lsn IS NULL",
            &[&slot],
        )
        .await?;
    Ok(())
}

/// The owner's current WAL insert position: once the copy has applied it,
/// every change committed before this call is in the copy.
pub async fn current_wal_lsn(client: &Client) -> Result<Lsn, SlotError> {
    let lsn: PgLsn = client
        .query_one("SELECT pg_current_wal_insert_lsn()", &[])
        .await?
        .get(0);
    Ok(lsn.into())
}

/// The owner's WAL positions: where it inserts, and what it has flushed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalPositions {
    pub inserted: Lsn,
    pub flushed: Lsn,
}

/// Reads both positions in one statement (so `flushed <= inserted`).
pub async fn wal_positions(client: &Client) -> Result<WalPositions, SlotError> {
    let row = client
        .query_one(
            "SELECT pg_current_wal_insert_lsn(), pg_current_wal_flush_lsn()",
            &[],
        )
        .await?;
    let inserted: PgLsn = row.get(0);
    let flushed: PgLsn = row.get(1);
    Ok(WalPositions {
        inserted: inserted.into(),
        flushed: flushed.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dba_sql_names_only_the_missing_tables() {
        assert_eq!(
            publication_sql("vacancy", "public", &Table::ALL, false),
            "CREATE PUBLICATION vacancy FOR TABLE public.hotels, public.room_types, public.inventory;"
        );
        assert_eq!(
            publication_sql("vacancy", "public", &[Table::Inventory], true),
            "ALTER PUBLICATION vacancy ADD TABLE public.inventory;"
        );
    }
}

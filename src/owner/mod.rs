//! The owner database: the booking site's PostgreSQL that decides every sale.
//!
//! `vacancy` only reads it (snapshot, stream, direct reads), but tests,
//! benchmarks and the demo need a real one to race against, so the owner's
//! schema, its operations (hold, confirm, release, sweep ...), a data
//! generator and a throwaway cluster live here too.

pub mod cluster;
pub mod ops;
pub mod seed;

use std::time::Duration;

/// The reference schema (`config/owner-schema.sql`), the contract other tools load through.
pub const SCHEMA_SQL: &str = include_str!("../../config/owner-schema.sql");

#[derive(Debug, thiserror::Error)]
pub enum OwnerError {
    #[error("cannot connect to the owner database: {0}")]
    Connect(#[source] tokio_postgres::Error),
    #[error("connecting to the owner database timed out after {0:?}")]
    ConnectTimeout(Duration),
    #[error("owner query failed: {0}")]
    Query(#[from] tokio_postgres::Error),
}

/// Opens an ordinary (non-replication) connection and drives it on the runtime.
pub async fn connect(url: &str, timeout: Duration) -> Result<tokio_postgres::Client, OwnerError> {
    let connecting = tokio_postgres::connect(url, tokio_postgres::NoTls);
    let (client, connection) = tokio::time::timeout(timeout, connecting)
        .await
        .map_err(|_| OwnerError::ConnectTimeout(timeout))?
        .map_err(OwnerError::Connect)?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "owner connection closed");
        }
    });
    Ok(client)
}

/// Loads the reference schema into the database (idempotent).
pub async fn apply_schema(client: &tokio_postgres::Client) -> Result<(), OwnerError> {
    client.batch_execute(SCHEMA_SQL).await?;
    Ok(())
}

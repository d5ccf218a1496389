//! The owner's reference schema (`config/owner-schema.sql`): the contract the
//! seed, the simulator and the tests load through. The service only reads
//! these tables, so the schema is the lab's.

use vacancy_service::OwnerError;

/// The reference schema, as a DBA would load it with `psql -f`.
pub const OWNER_SCHEMA_SQL: &str = include_str!("../../../config/owner-schema.sql");

/// Loads the reference schema into the database (idempotent).
pub async fn apply(client: &tokio_postgres::Client) -> Result<(), OwnerError> {
    client.batch_execute(OWNER_SCHEMA_SQL).await?;
    Ok(())
}

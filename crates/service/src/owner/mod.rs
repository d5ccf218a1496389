//! The owner database: the booking site's PostgreSQL that decides every sale.
//!
//! `vacancy` only reads it (snapshot, stream, direct reads). How to reach it
//! (URL, password, TLS) is decided in one place, `endpoint`, for every
//! connection. The owner's schema, its operations (hold, confirm, release,
//! sweep ...), the data generator and the throwaway cluster are the lab's
//! (`vacancy-lab`): the service never writes a booking.

pub mod endpoint;
pub mod identity;
mod settings;
pub mod visibility;

use std::time::Duration;

pub use endpoint::{Endpoint, EndpointError, SslMode};
pub use identity::OwnerIdentity;
pub use settings::{OwnerSettings, OwnerSettingsError};

use crate::metrics;
use crate::model::{CalendarKey, NightCounts};

#[derive(Debug, thiserror::Error)]
pub enum OwnerError {
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error("cannot connect to the owner database: {}", explain(.0))]
    Connect(#[source] tokio_postgres::Error),
    #[error("TLS with the owner database failed (sslmode={mode}): {source}")]
    Tls {
        mode: SslMode,
        #[source]
        source: rustls::Error,
    },
    #[error("connecting to the owner database timed out after {0:?}")]
    ConnectTimeout(Duration),
    #[error("owner query failed: {0}")]
    Query(#[from] tokio_postgres::Error),
    /// A multi-host `owner.url` sent this connection elsewhere than the
    /// replication stream (`identity`): it is dropped, never used.
    #[error(
        "the connection reached {found}, but the replication stream is on {expected}; refused (a multi-host owner.url must land every connection on the same primary)"
    )]
    OtherServer {
        expected: OwnerIdentity,
        found: OwnerIdentity,
    },
    #[error("checking which server a new connection reached timed out after {0:?}")]
    IdentityTimeout(Duration),
}

/// One inventory night as a direct read selects it: `hotel_id,
/// room_type_id, night, total, taken, sell_limit, price_cents`, in that
/// order. `Ok(None)` for a night the copy does not hold
/// (`calendar::holds_night`; `infinity`, which no `NaiveDate` takes, made
/// `Row::get` panic here). A column of another type than the copy reads
/// (an owner that altered `total` to `bigint`, say) is an error, as it is
/// for the snapshot and the stream, not a panic.
pub fn inventory_night(
    row: &tokio_postgres::Row,
) -> Result<Option<(CalendarKey, chrono::NaiveDate, NightCounts)>, tokio_postgres::Error> {
    let night = match row.try_get::<_, chrono::NaiveDate>(2) {
        Ok(night) => night,
        // A date column whose value no `NaiveDate` holds: +-infinity or
        // beyond chrono's years, none of which the copy holds.
        Err(_) if row.columns()[2].type_() == &tokio_postgres::types::Type::DATE => {
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    if !crate::model::calendar::holds_night(night) {
        return Ok(None);
    }
    Ok(Some((
        CalendarKey {
            hotel_id: row.try_get(0)?,
            room_type_id: row.try_get(1)?,
        },
        night,
        NightCounts {
            total: row.try_get(3)?,
            taken: row.try_get(4)?,
            sell_limit: row.try_get(5)?,
            price_cents: row.try_get(6)?,
        },
    )))
}

/// tokio-postgres shows "db error" or "invalid configuration" alone; an
/// operator needs the server's message ("password authentication failed",
/// "no pg_hba.conf entry ...") or the cause.
pub(crate) fn explain(error: &tokio_postgres::Error) -> String {
    if let Some(db) = error.as_db_error() {
        return format!("{}: {}", db.severity(), db.message());
    }
    match std::error::Error::source(error) {
        Some(cause) if !error.to_string().contains(&cause.to_string()) => {
            format!("{error}: {cause}")
        }
        _ => error.to_string(),
    }
}

/// Opens an ordinary connection to the owner the settings name, with their
/// password and TLS (`Endpoint`). Service code connects only through here.
/// Once a replication session has said which owner it is on
/// (`owner.pin`), a connection that reached another cluster or timeline
/// is refused (`identity`'s module doc says why).
pub async fn connect_configured(
    owner: &OwnerSettings,
    timeout: Duration,
) -> Result<tokio_postgres::Client, OwnerError> {
    let client = Endpoint::from_settings(owner)?.connect(timeout).await?;
    if let Some(expected) = owner.pin.current() {
        let found = tokio::time::timeout(timeout, identity::read(&client))
            .await
            .map_err(|_| OwnerError::IdentityTimeout(timeout))??;
        if found != expected {
            metrics::OWNER_CONNECTIONS_REFUSED.inc();
            return Err(OwnerError::OtherServer { expected, found });
        }
    }
    Ok(client)
}

/// Opens an ordinary connection to a URL alone (tools, tests): the URL's
/// `sslmode` and password, else `PGPASSWORD`.
pub async fn connect(url: &str, timeout: Duration) -> Result<tokio_postgres::Client, OwnerError> {
    Endpoint::from_url(url)?.connect(timeout).await
}

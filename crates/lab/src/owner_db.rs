//! The owner database a lab run works on: one given with `--owner-url`, or
//! else a throwaway cluster started here and removed when the run ends.

use vacancy_service::redacted_url;

use crate::cluster::{Cluster, ClusterError, ClusterOptions};

/// The owner under test. Keep it alive for the whole run: dropping it stops
/// and removes the embedded cluster.
#[derive(Debug)]
pub struct OwnerDb {
    pub url: String,
    /// Where the owner is, for a report's header (never with a password).
    pub description: String,
    cluster: Option<Cluster>,
}

impl OwnerDb {
    /// `given` when there is one, else a database named `database` in an
    /// embedded cluster started with `options`.
    pub async fn given_or_embedded(
        given: Option<&str>,
        options: ClusterOptions,
        database: &str,
    ) -> Result<OwnerDb, ClusterError> {
        if let Some(url) = given {
            return Ok(OwnerDb {
                url: url.to_string(),
                description: format!("given: {}", redacted_url(url)),
                cluster: None,
            });
        }
        let durability = if options.fsync { "on" } else { "off" };
        let cluster = start_embedded(options).await?;
        let url = cluster.create_database(database)?;
        Ok(OwnerDb {
            url,
            description: format!(
                "embedded throwaway cluster (fsync, synchronous_commit, full_page_writes {durability})"
            ),
            cluster: Some(cluster),
        })
    }

    /// Whether the owner goes away with this value (so nothing on it needs
    /// cleaning up by hand).
    pub fn is_embedded(&self) -> bool {
        self.cluster.is_some()
    }
}

/// Starts a throwaway cluster, saying so on stderr (a bench's stdout is its
/// report). initdb and pg_ctl block for seconds, so they run off the runtime.
pub async fn start_embedded(options: ClusterOptions) -> Result<Cluster, ClusterError> {
    eprintln!(
        "starting an embedded PostgreSQL from {} (fsync {})",
        options.bin_dir.display(),
        if options.fsync { "on" } else { "off" }
    );
    tokio::task::spawn_blocking(move || Cluster::start(options))
        .await
        .map_err(|joined| ClusterError::Io(std::io::Error::other(joined)))?
}

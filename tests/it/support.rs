//! A real owner for each test: a throwaway cluster with the reference schema loaded.

use std::time::Duration;

use tokio_postgres::Client;
use vacancy_lab::cluster::{Cluster, ClusterOptions};

pub const DB: &str = "owner";

/// A cluster with database `owner` holding the reference schema.
/// Dropping it stops the server and removes its files.
pub struct TestOwner {
    pub cluster: Cluster,
    pub url: String,
}

impl TestOwner {
    pub async fn start() -> TestOwner {
        Self::start_with(ClusterOptions::default()).await
    }

    pub async fn start_with(options: ClusterOptions) -> TestOwner {
        let cluster = tokio::task::spawn_blocking(move || Cluster::start(options))
            .await
            .expect("cluster start task")
            .unwrap_or_else(|e| panic!("cannot start the test PostgreSQL: {e}"));
        let url = cluster.create_database(DB).expect("create database");
        let client = vacancy_service::connect(&url, Duration::from_secs(10))
            .await
            .expect("connect to the test owner");
        vacancy_lab::schema::apply(&client)
            .await
            .expect("load config/owner-schema.sql");
        TestOwner { cluster, url }
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        vacancy_service::connect(&self.url, Duration::from_secs(10))
            .await
            .expect("connect to the test owner")
    }
}

/// Creates the role `vac` as README.md tells a DBA to: it may log in,
/// replicate and read the three tables, and no more (no superuser, no
/// CREATE on the database, owns no table, so it cannot create the
/// publication itself). Returns `owner_url` with `vac` as the user; the
/// password, when given, is not in it.
pub async fn least_privilege_role(
    client: &Client,
    owner_url: &str,
    password: Option<&str>,
) -> String {
    let password = password.map_or(String::new(), |p| {
        format!(" PASSWORD '{}'", p.replace('\'', "''"))
    });
    client
        .batch_execute(&format!(
            "CREATE ROLE vac LOGIN REPLICATION{password};
             GRANT SELECT ON hotels, room_types, inventory TO vac;"
        ))
        .await
        .expect("create the least-privilege role");
    owner_url.replacen("postgres@", "vac@", 1)
}

/// The publication a DBA creates for that role.
pub async fn create_publication(client: &Client) {
    client
        .batch_execute("CREATE PUBLICATION vacancy FOR TABLE hotels, room_types, inventory")
        .await
        .expect("create the publication as the superuser");
}

/// Polls `probe` until it yields `Some` or `timeout` passes (never a fixed sleep).
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        // A probe that hangs (a stream that never ends) is bounded too.
        let probed = tokio::time::timeout_at(deadline, probe())
            .await
            .unwrap_or_else(|_| {
                panic!("timed out after {timeout:?} waiting for {what} (a probe hung)")
            });
        if let Some(v) = probed {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Loads one hotel in `city` (id 1) with one double room type (id 1) and 9
/// units on each of the 10 nights from today: the smallest owner a test of
/// the HTTP surface needs.
pub async fn one_hotel(client: &Client, city: &str) {
    let today = chrono::Utc::now().date_naive();
    client
        .execute(
            "INSERT INTO hotels (id, name, city) VALUES (1, 'Hotel 1', $1)",
            &[&city],
        )
        .await
        .expect("load hotel");
    client
        .batch_execute(&format!(
            "INSERT INTO room_types VALUES (1, 1, 'Double', 2);
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               SELECT 1, 1, DATE '{today}' + n, 9, 10000 FROM generate_series(0, 9) n;"
        ))
        .await
        .expect("load room type and nights");
}

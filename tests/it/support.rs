//! A real owner for each test: a throwaway cluster with the reference schema loaded.

use std::time::Duration;

use vacancy::owner::cluster::{Cluster, ClusterOptions};

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
        let client = vacancy::owner::connect(&url, Duration::from_secs(10))
            .await
            .expect("connect to the test owner");
        vacancy::owner::apply_schema(&client)
            .await
            .expect("load config/owner-schema.sql");
        TestOwner { cluster, url }
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        vacancy::owner::connect(&self.url, Duration::from_secs(10))
            .await
            .expect("connect to the test owner")
    }
}

/// Polls `probe` until it yields `Some` or `timeout` passes (never a fixed sleep).
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

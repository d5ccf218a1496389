//! A throwaway `nats-server` with JetStream: the fleet's log in every test
//! and bench that runs more than one node.
//!
//! It exists for the same reason as [`crate::cluster`]: nothing between the
//! projector and a replica may be faked, so the fleet's tests publish to and
//! consume from a real server. It runs from Debian's `nats-server` package
//! (2.9), with its JetStream store in a temporary folder, on a free loopback
//! port, and is killed and removed when the value is dropped (also when a
//! test panics). `stop` and `start_again` keep the store, so a test can
//! take NATS away and bring the same streams back.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian's package installs the server.
pub const DEFAULT_NATS_SERVER: &str = "/usr/sbin/nats-server";

#[derive(Debug, thiserror::Error)]
pub enum NatsServerError {
    #[error(
        "nats-server not found at {0}: install it with `apt-get install -y nats-server` \
         (Debian), or point VACANCY_NATS_SERVER at the binary"
    )]
    NotInstalled(PathBuf),
    #[error("nats-server: {0}")]
    Io(#[from] std::io::Error),
    #[error("nats-server did not accept connections on port {port} within {waited:?}: {log}")]
    NotListening {
        port: u16,
        waited: Duration,
        log: String,
    },
}

/// A running (or stopped) `nats-server -js`.
#[derive(Debug)]
pub struct NatsServer {
    binary: PathBuf,
    store: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a server on a free port with JetStream on file storage, and
    /// waits (at most 10 s) until it accepts connections.
    pub fn start() -> Result<NatsServer, NatsServerError> {
        let binary = std::env::var_os("VACANCY_NATS_SERVER")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_NATS_SERVER));
        if !binary.is_file() {
            return Err(NatsServerError::NotInstalled(binary));
        }
        let store = tempfile::Builder::new().prefix("vacancy-nats-").tempdir()?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut server = NatsServer {
            binary,
            store,
            port,
            child: None,
        };
        server.start_again()?;
        Ok(server)
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory (kept across `stop`/`start_again`).
    pub fn store_dir(&self) -> &Path {
        self.store.path()
    }

    fn log_path(&self) -> PathBuf {
        self.store.path().join("nats-server.log")
    }

    /// The server's log so far (for a failing test's message).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Kills the server (SIGKILL): what a crash or a lost host looks like
    /// to its clients. The store stays.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and store.
    pub fn start_again(&mut self) -> Result<(), NatsServerError> {
        self.stop();
        let child = Command::new(&self.binary)
            .args(["-a", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .arg("-js")
            .arg("-sd")
            .arg(self.store.path())
            .arg("-l")
            .arg(self.log_path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.child = Some(child);
        let waited = Duration::from_secs(10);
        let deadline = Instant::now() + waited;
        while Instant::now() < deadline {
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(NatsServerError::NotListening {
            port: self.port,
            waited,
            log: self.log(),
        })
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

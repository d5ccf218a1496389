//! A throwaway PostgreSQL cluster: the embedded owner of `vacancy demo` and the
//! real database every integration test runs against.
//!
//! It exists because nothing in the read path may be faked: the projector must
//! read a real pgoutput stream from a real walsender. The cluster lives in a
//! temporary folder, listens on a free loopback port, runs with
//! `wal_level = logical`, and is stopped and removed when the value is dropped
//! (also when a test panics, since drop runs during unwinding).
//!
//! initdb refuses to run as root, so when this process is root the server runs
//! as an unprivileged user (`postgres` if it exists, else `nobody`), which owns
//! the folder.

use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Where Debian installs the PostgreSQL 15 server binaries.
pub const DEFAULT_BIN_DIR: &str = "/usr/lib/postgresql/15/bin";

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(
        "PostgreSQL server binaries not found: {0} has no `initdb`/`pg_ctl`. \
         Install them with `apt-get install -y postgresql-15` (Debian), \
         or point VACANCY_PG_BIN (or --pg-bin) at the folder that holds them"
    )]
    MissingBinaries(PathBuf),
    #[error("{command} failed: {detail}")]
    Command { command: String, detail: String },
    #[error("cluster i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("no unprivileged OS user to run PostgreSQL as (tried `postgres` and `nobody`)")]
    NoUser,
}

/// How the server is stopped, as `pg_ctl -m` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    Smart,
    Fast,
    Immediate,
}

impl StopMode {
    fn as_arg(self) -> &'static str {
        match self {
            StopMode::Smart => "smart",
            StopMode::Fast => "fast",
            StopMode::Immediate => "immediate",
        }
    }
}

/// Settings for a new cluster. The defaults suit tests: many connections
/// and slots, no fsync (a test cluster never outlives an OS crash).
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub bin_dir: PathBuf,
    pub max_connections: u32,
    /// Extra `postgresql.conf` lines, e.g. `max_slot_wal_keep_size = '64MB'`.
    pub extra_conf: Vec<String>,
    /// Keep data durable on disk (the demo and benchmarks want realistic commits).
    pub fsync: bool,
    /// Serve TLS with this certificate and key (`ssl = on`); `None`: no TLS.
    pub tls: Option<ServerTls>,
    /// `pg_hba.conf` lines in place of initdb's (trust for every local and
    /// host connection), e.g. to demand TLS or passwords.
    pub hba: Option<Vec<String>>,
}

/// A server certificate (PEM, chain first) and its private key (PEM).
#[derive(Clone)]
pub struct ServerTls {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert_pem", &self.cert_pem.len())
            .finish_non_exhaustive()
    }
}

impl Default for ClusterOptions {
    fn default() -> Self {
        let bin_dir = std::env::var_os("VACANCY_PG_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_BIN_DIR));
        ClusterOptions {
            bin_dir,
            max_connections: 600,
            extra_conf: Vec::new(),
            fsync: false,
            tls: None,
            hba: None,
        }
    }
}

/// A running throwaway cluster. Dropping it stops the server and removes its files.
#[derive(Debug)]
pub struct Cluster {
    bin_dir: PathBuf,
    // Kept for its Drop: removes the folder after the server stopped.
    root: tempfile::TempDir,
    data_dir: PathBuf,
    log_file: PathBuf,
    port: u16,
    run_as: Option<(u32, u32)>,
}

impl Cluster {
    /// Runs initdb in a fresh temporary folder and starts the server.
    pub fn start(options: ClusterOptions) -> Result<Cluster, ClusterError> {
        for binary in ["initdb", "pg_ctl", "postgres"] {
            if !options.bin_dir.join(binary).is_file() {
                return Err(ClusterError::MissingBinaries(options.bin_dir.clone()));
            }
        }
        let run_as = if running_as_root()? {
            Some(unprivileged_user()?)
        } else {
            None
        };
        let root = tempfile::Builder::new().prefix("vacancy-pg-").tempdir()?;
        let data_dir = root.path().join("data");
        let log_file = root.path().join("server.log");
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(root.path(), Some(uid), Some(gid))?;
        }

        let mut cluster = Cluster {
            bin_dir: options.bin_dir.clone(),
            root,
            data_dir,
            log_file,
            port: 0,
            run_as,
        };
        cluster.run(
            "initdb",
            &[
                "-D",
                path_str(&cluster.data_dir),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
        )?;
        let mut conf = fs::OpenOptions::new()
            .append(true)
            .open(cluster.data_dir.join("postgresql.conf"))?;
        let socket_dir = cluster.root.path().to_path_buf();
        writeln!(
            conf,
            "\n# vacancy test cluster\n\
             listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{}'\n\
             wal_level = logical\n\
             max_replication_slots = 64\n\
             max_wal_senders = 64\n\
             max_connections = {}\n\
             shared_buffers = '128MB'\n\
             fsync = {}\n\
             synchronous_commit = {}\n\
             full_page_writes = {}\n\
             wal_sender_timeout = '60s'\n\
             log_min_messages = warning\n\
             log_line_prefix = '%m [%p] %q%a '",
            socket_dir.display(),
            options.max_connections,
            on_off(options.fsync),
            on_off(options.fsync),
            on_off(options.fsync),
        )?;
        if let Some(tls) = &options.tls {
            // The server refuses a key others may read, and runs as run_as.
            cluster.write_private("server.crt", &tls.cert_pem)?;
            cluster.write_private("server.key", &tls.key_pem)?;
            writeln!(
                conf,
                "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'"
            )?;
        }
        for line in &options.extra_conf {
            writeln!(conf, "{line}")?;
        }
        drop(conf);
        if let Some(lines) = &options.hba {
            fs::write(
                cluster.data_dir.join("pg_hba.conf"),
                format!("{}\n", lines.join("\n")),
            )?;
        }
        cluster.start_server()?;
        Ok(cluster)
    }

    /// Starts the server on a free port. A port taken between the probe and the
    /// start is retried with another one.
    fn start_server(&mut self) -> Result<(), ClusterError> {
        let mut last = None;
        for _ in 0..5 {
            let port = if self.port == 0 {
                free_port()?
            } else {
                self.port
            };
            let port_opt = format!("-p {port}");
            match self.run(
                "pg_ctl",
                &[
                    "-D",
                    path_str(&self.data_dir),
                    "-l",
                    path_str(&self.log_file),
                    "-o",
                    &port_opt,
                    "-w",
                    "-t",
                    "60",
                    "start",
                ],
            ) {
                Ok(_) => {
                    self.port = port;
                    return Ok(());
                }
                Err(e) => {
                    // A restart keeps its port: clients reconnect to the same URL.
                    if self.port != 0 {
                        return Err(e);
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.expect("at least one attempt"))
    }

    /// The server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A connection URL for `database` as the superuser `postgres`.
    pub fn url(&self, database: &str) -> String {
        format!("postgresql://postgres@127.0.0.1:{}/{}", self.port, database)
    }

    /// A streaming standby of this cluster: a base backup (`pg_basebackup
    /// -R`) in a fresh folder, started on a free port, replaying this
    /// cluster's WAL. Name it in this cluster's `synchronous_standby_names`
    /// (or use `'*'`) to make every commit wait for it, as an owner with
    /// synchronous replication does. `extra_conf` are `postgresql.conf`
    /// lines for the standby (say `recovery_min_apply_delay`, to make a
    /// `remote_apply` commit wait longer). Dropping it stops and removes it.
    pub fn start_standby(&self, extra_conf: &[&str]) -> Result<Cluster, ClusterError> {
        let root = tempfile::Builder::new()
            .prefix("vacancy-pg-standby-")
            .tempdir()?;
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(root.path(), Some(uid), Some(gid))?;
        }
        let mut standby = Cluster {
            bin_dir: self.bin_dir.clone(),
            data_dir: root.path().join("data"),
            log_file: root.path().join("server.log"),
            root,
            port: 0,
            run_as: self.run_as,
        };
        standby.run(
            "pg_basebackup",
            &[
                "-D",
                path_str(&standby.data_dir),
                "-d",
                &format!(
                    "host=127.0.0.1 port={} user=postgres application_name=vacancy_standby",
                    self.port
                ),
                "-R",
                "--checkpoint=fast",
                "--no-sync",
            ],
        )?;
        // The copied settings point at this cluster's socket folder, which
        // goes away with it.
        let mut conf = fs::OpenOptions::new()
            .append(true)
            .open(standby.data_dir.join("postgresql.conf"))?;
        writeln!(
            conf,
            "\n# vacancy test standby\nunix_socket_directories = '{}'",
            standby.root.path().display()
        )?;
        for line in extra_conf {
            writeln!(conf, "{line}")?;
        }
        drop(conf);
        standby.start_server()?;
        Ok(standby)
    }

    /// Promotes this standby to a primary, as a failover does: `pg_ctl
    /// promote`, then waits (at most `timeout`) until the server says it is
    /// out of recovery. The new primary writes a new timeline; logical
    /// slots of the old primary are not on it (PostgreSQL 15).
    pub fn promote(&self, timeout: std::time::Duration) -> Result<(), ClusterError> {
        let deadline = std::time::Instant::now() + timeout;
        let secs = timeout.as_secs().max(1).to_string();
        self.run(
            "pg_ctl",
            &["-D", path_str(&self.data_dir), "-w", "-t", &secs, "promote"],
        )?;
        loop {
            let out = Command::new(self.bin_dir.join("psql"))
                .args(["-X", "-q", "-A", "-t", "-d", &self.url("postgres")])
                .arg("-c")
                .arg("SELECT pg_is_in_recovery()")
                .stdin(std::process::Stdio::null())
                .output()?;
            if out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "f" {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                return Err(ClusterError::Command {
                    command: "pg_ctl promote".to_string(),
                    detail: format!("still in recovery after {timeout:?}"),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// Creates a database (one per test keeps tests apart on a shared cluster).
    pub fn create_database(&self, name: &str) -> Result<String, ClusterError> {
        let psql = self.bin_dir.join("psql");
        let out = Command::new(psql)
            .args([
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                &self.url("postgres"),
            ])
            .arg("-c")
            .arg(format!("CREATE DATABASE \"{name}\""))
            .output()?;
        check("psql CREATE DATABASE", out)?;
        Ok(self.url(name))
    }

    /// Stops the server with `mode` and starts it again on the same port.
    pub fn restart(&mut self, mode: StopMode) -> Result<(), ClusterError> {
        self.stop(mode)?;
        self.start_server()
    }

    /// Stops the server; `start_again` brings it back on the same port.
    pub fn stop(&self, mode: StopMode) -> Result<(), ClusterError> {
        self.run(
            "pg_ctl",
            &[
                "-D",
                path_str(&self.data_dir),
                "-m",
                mode.as_arg(),
                "-w",
                "-t",
                "60",
                "stop",
            ],
        )
        .map(|_| ())
    }

    /// Starts a stopped server again on its old port.
    pub fn start_again(&mut self) -> Result<(), ClusterError> {
        self.start_server()
    }

    /// The data directory: a test copies it while the server is stopped
    /// and puts the copy back later, as an operator restoring a volume
    /// snapshot would.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The server log so far, for test failure messages.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log_file).unwrap_or_default()
    }

    /// The folder that holds the binaries, for tools like `psql` and `pgbench`.
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// Writes a file into the data folder readable by the server alone.
    fn write_private(&self, name: &str, contents: &str) -> Result<(), ClusterError> {
        use std::os::unix::fs::PermissionsExt;
        let path = self.data_dir.join(name);
        fs::write(&path, contents)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600))?;
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(&path, Some(uid), Some(gid))?;
        }
        Ok(())
    }

    fn run(&self, binary: &str, args: &[&str]) -> Result<Output, ClusterError> {
        let mut command = Command::new(self.bin_dir.join(binary));
        command.args(args).current_dir(self.root.path());
        // The server must not inherit the test's stdin/stdout, or `pg_ctl -w`
        // can hang waiting on a pipe the postmaster keeps open.
        command.stdin(std::process::Stdio::null());
        if let Some((uid, gid)) = self.run_as {
            command.uid(uid).gid(gid);
            command.env("HOME", self.root.path());
        }
        let out = command.output()?;
        check(binary, out)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.port != 0 {
            let _ = self.stop(StopMode::Immediate);
        }
    }
}

fn check(command: &str, out: Output) -> Result<Output, ClusterError> {
    if out.status.success() {
        Ok(out)
    } else {
        Err(ClusterError::Command {
            command: command.to_string(),
            detail: format!(
                "{}: {}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                String::from_utf8_lossy(&out.stdout).trim()
            ),
        })
    }
}

fn on_off(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap_or_default()
}

fn running_as_root() -> Result<bool, ClusterError> {
    Ok(fs::metadata("/proc/self")?.uid() == 0)
}

/// The uid and gid of `postgres`, else `nobody`, from /etc/passwd.
fn unprivileged_user() -> Result<(u32, u32), ClusterError> {
    let passwd = fs::read_to_string("/etc/passwd")?;
    for wanted in ["postgres", "nobody"] {
        for line in passwd.lines() {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() > 3
                && fields[0] == wanted
                && let (Ok(uid), Ok(gid)) = (fields[2].parse(), fields[3].parse())
            {
                return Ok((uid, gid));
            }
        }
    }
    Err(ClusterError::NoUser)
}

fn free_port() -> Result<u16, ClusterError> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_binaries_say_what_to_install() {
        let err = Cluster::start(ClusterOptions {
            bin_dir: PathBuf::from("/nonexistent/postgresql/bin"),
            ..ClusterOptions::default()
        })
        .unwrap_err();
        assert!(matches!(err, ClusterError::MissingBinaries(_)), "{err:?}");
        let message = err.to_string();
        assert!(
            message.contains("apt-get install -y postgresql-15"),
            "{message}"
        );
        assert!(message.contains("/nonexistent/postgresql/bin"), "{message}");
    }
}

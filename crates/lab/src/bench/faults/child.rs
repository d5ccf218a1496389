//! `vacancy serve` as a child process: a SIGKILL or SIGSTOP must hit a whole
//! process, as it would in production.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::process::{Child, Command};

use crate::bench::run_tool;
use crate::http_client::http;
use vacancy_service::Lsn;

use super::compare::get_json;
use super::{BOOKING_TOKEN, FaultBenchError, HTTP_TIMEOUT, POLL, PUBLICATION, SLOT};

/// `vacancy serve` as a child process, killed on drop so a failed run
/// leaves nothing behind.
pub struct Serve {
    child: Child,
    pub addr: SocketAddr,
    exe: PathBuf,
    url: String,
    dir: PathBuf,
    name: String,
    token_file: PathBuf,
    starts: u32,
    /// More `VACANCY_*` settings for every start (bench restart's checkpoints).
    env: Vec<(String, String)>,
}

impl Serve {
    /// Starts `exe serve` against `url` on a free loopback port, with the
    /// bench's slot, publication and booking token; logs go to
    /// `dir/<name>-<start>.log`.
    pub fn start(exe: &Path, url: &str, dir: &Path, name: &str) -> Result<Serve, FaultBenchError> {
        Self::start_with_env(exe, url, dir, name, Vec::new())
    }

    /// As `start`, with more settings in the environment of every start.
    pub fn start_with_env(
        exe: &Path,
        url: &str,
        dir: &Path,
        name: &str,
        env: Vec<(String, String)>,
    ) -> Result<Serve, FaultBenchError> {
        let token_file = dir.join("booking-tokens");
        std::fs::write(&token_file, format!("{BOOKING_TOKEN}\n"))?;
        // A free port: bind, read it, let go. The child binds it a moment
        // later, and again after a restart, so load loops keep one address.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let child = spawn(
            exe,
            url,
            addr,
            &dir.join(format!("{name}-1.log")),
            &token_file,
            &env,
        )?;
        Ok(Serve {
            child,
            addr,
            exe: exe.to_path_buf(),
            url: url.to_string(),
            dir: dir.to_path_buf(),
            name: name.to_string(),
            token_file,
            starts: 1,
            env,
        })
    }

    /// The log of the current start.
    /// Whether the process has exited (reaped, or a zombie not yet waited
    /// for); a stopped one (SIGSTOP) has not.
    fn exited(&self) -> bool {
        let Some(pid) = self.child.id() else {
            return true;
        };
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // The state follows the command name's closing parenthesis.
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
            Err(_) => true,
        }
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join(format!("{}-{}.log", self.name, self.starts))
    }

    /// The process id of the current start (`None` once it was reaped), for
    /// reading its `/proc/<pid>/status` (bench fleet's peak RSS).
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Waits, at most `limit`, for the process to exit; whether it did.
    pub async fn exited_within(&mut self, limit: Duration) -> bool {
        tokio::time::timeout(limit, self.child.wait()).await.is_ok()
    }

    /// SIGKILL: no shutdown hook runs, no last acknowledgement is sent.
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// Starts the process again on the same address.
    pub fn restart(&mut self) -> Result<(), FaultBenchError> {
        self.starts += 1;
        self.child = spawn(
            &self.exe,
            &self.url,
            self.addr,
            &self.log_path(),
            &self.token_file,
            &self.env,
        )?;
        Ok(())
    }

    /// Sends `SIGSTOP`, `SIGCONT` or another signal by name.
    pub async fn signal(&self, name: &str) -> Result<(), FaultBenchError> {
        let Some(pid) = self.child.id() else {
            return Ok(()); // already gone
        };
        let mut kill = Command::new("kill");
        kill.args(["-s", name, &pid.to_string()]);
        run_tool(kill, "kill").await?;
        Ok(())
    }

    /// SIGTERM, then SIGKILL if it has not exited within its grace.
    pub async fn stop(&mut self) {
        let _ = self.signal("CONT").await;
        let _ = self.signal("TERM").await;
        if tokio::time::timeout(Duration::from_secs(15), self.child.wait())
            .await
            .is_err()
        {
            self.kill().await;
        }
    }

    pub async fn status(&self) -> Option<Value> {
        get_json(self.addr, "/v1/status").await.ok()
    }

    /// Loaded, streaming, not resnapshotting, applied at or past `lsn`.
    pub async fn recovered_past(&self, lsn: Lsn) -> bool {
        let Some(s) = self.status().await else {
            return false;
        };
        let applied: Option<Lsn> = s["applied_lsn"].as_str().and_then(|t| t.parse().ok());
        s["snapshot"]["phase"] == "loaded"
            && s["connected"] == true
            && s["resnapshotting"] == false
            && applied.is_some_and(|a| a >= lsn)
    }

    /// Waits until the copy is loaded and has applied `target`.
    pub async fn caught_up(
        &self,
        target: Lsn,
        limit: Duration,
        what: &str,
    ) -> Result<(), FaultBenchError> {
        let started = Instant::now();
        loop {
            // A child that exited (a setting refused, a crash) will never
            // catch up: say so at once, with its log, instead of waiting out
            // `limit`.
            if self.exited() {
                return Err(FaultBenchError::ServerExited {
                    what: format!("{what} (copy applying {target})"),
                    log: self.log_path(),
                });
            }
            if let Some(s) = self.status().await {
                let applied: Option<Lsn> = s["applied_lsn"].as_str().and_then(|t| t.parse().ok());
                if s["snapshot"]["phase"] == "loaded" && applied.is_some_and(|a| a >= target) {
                    return Ok(());
                }
            }
            if started.elapsed() > limit {
                return Err(FaultBenchError::Timeout {
                    what: format!("{what} (copy applying {target})"),
                    limit,
                    detail: format!("; last status: {}", self.status_line().await),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The status fields that say why a copy is not caught up.
    pub(crate) async fn status_line(&self) -> String {
        match self.status().await {
            Some(s) => format!(
                "phase {}, connected {}, resnapshotting {}, applied {}, last error {}",
                s["snapshot"]["phase"],
                s["connected"],
                s["resnapshotting"],
                s["applied_lsn"],
                s["last_error"]
            ),
            None => {
                let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                format!(
                    "no answer; log ends: {}",
                    lines[lines.len().saturating_sub(3)..].join(" | ")
                )
            }
        }
    }

    /// What the child spilled (`/metrics`), and the files left in `spill_dir`.
    pub(super) async fn spilled(&self, spill_dir: &Path) -> super::Spilled {
        let scrape = match http(self.addr, "GET", "/metrics", None, None, HTTP_TIMEOUT).await {
            Ok(r) => String::from_utf8_lossy(&r.body).into_owned(),
            Err(_) => String::new(),
        };
        let counter =
            |name: &str| crate::bench::soak::gauge(&scrape, name, None).map_or(0, |v| v as u64);
        super::Spilled {
            transactions: counter("vacancy_held_spilled_transactions_total"),
            bytes: counter("vacancy_held_spilled_bytes_total"),
            files_left: std::fs::read_dir(spill_dir).map_or(0, |d| d.count()),
        }
    }

    /// `vacancy_resnapshots_total` by reason, from `/metrics`.
    pub(super) async fn snapshots_taken(&self) -> BTreeMap<String, u64> {
        let Ok(r) = http(self.addr, "GET", "/metrics", None, None, HTTP_TIMEOUT).await else {
            return BTreeMap::new();
        };
        parse_snapshots(&String::from_utf8_lossy(&r.body))
    }
}

fn parse_snapshots(metrics: &str) -> BTreeMap<String, u64> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("vacancy_resnapshots_total{reason=\""))
        .filter_map(|rest| {
            let (reason, value) = rest.split_once("\"}")?;
            let n = value.trim().parse::<f64>().ok()? as u64;
            (n > 0).then(|| (reason.to_string(), n))
        })
        .collect()
}

fn spawn(
    exe: &Path,
    url: &str,
    addr: SocketAddr,
    log: &Path,
    token_file: &Path,
    env: &[(String, String)],
) -> Result<Child, FaultBenchError> {
    let log = std::fs::File::create(log)?;
    let child = Command::new(exe)
        .arg("serve")
        .env("VACANCY_OWNER_URL", url)
        .env("VACANCY_LISTEN", addr.to_string())
        .env("VACANCY_STREAM__SLOT", SLOT)
        .env("VACANCY_STREAM__PUBLICATION", PUBLICATION)
        .env("VACANCY_STREAM__SLOT_WATCH_INTERVAL_MS", "1000")
        .env("VACANCY_STALE__BOOKING_TOKENS_FILE", token_file)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .kill_on_drop(true)
        .spawn()?;
    Ok(child)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_are_read_from_the_metrics_text() {
        let text = "# HELP x\nvacancy_resnapshots_total{reason=\"initial\"} 1\n\
                    vacancy_resnapshots_total{reason=\"slot_lost\"} 2\n\
                    vacancy_resnapshots_total{reason=\"requested\"} 0\n";
        let got = parse_snapshots(text);
        assert_eq!(got.len(), 2);
        assert_eq!(got["slot_lost"], 2);
    }
}

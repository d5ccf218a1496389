//! The load balancer in front of the replicas, and the load through it:
//! `vacancy bench fleet` measures searches/s of one and of two replicas
//! behind HAProxy, beside one replica asked directly, so the balancer's
//! own cost is seen.
//!
//! Both are the real programs a site runs: Debian's `haproxy` (round robin,
//! health-checking `/readyz`, keep-alive to the replicas) and `wrk` (keep-
//! alive clients, a Lua script choosing each search). Nothing here is a
//! stand-in: a balancer written for the bench would hide the cost the issue
//! asks to see.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::http_client::http;

/// Where Debian's package installs HAProxy.
const HAPROXY: &str = "/usr/sbin/haproxy";
/// How long HAProxy may take to listen and find a replica healthy.
const START_LIMIT: Duration = Duration::from_secs(15);
const POLL: Duration = Duration::from_millis(50);

#[derive(Debug, thiserror::Error)]
pub enum BalancerError {
    #[error("{0} not found: install it with `apt-get install -y haproxy wrk` (Debian)")]
    NotInstalled(String),
    #[error("haproxy: {0}")]
    Io(#[from] std::io::Error),
    #[error("haproxy did not pass a search to a ready replica within {0:?}")]
    NotServing(Duration),
    #[error("wrk: {0}")]
    Wrk(String),
}

/// A running `haproxy` in front of `backends`, killed on drop.
pub struct HaProxy {
    pub addr: SocketAddr,
    pub pid: u32,
    child: Child,
    _config: tempfile::NamedTempFile,
}

impl HaProxy {
    /// Starts HAProxy on a free loopback port, round robin over
    /// `backends`, each health-checked on `/readyz` every second; returns
    /// once it answers `/readyz` through a backend.
    ///
    /// One thread (`nbthread 1`): on two cores it shares the CPU with the
    /// replicas and the load generator, and a second thread would only
    /// contend with them.
    pub async fn start(backends: &[SocketAddr], dir: &Path) -> Result<HaProxy, BalancerError> {
        if !Path::new(HAPROXY).is_file() {
            return Err(BalancerError::NotInstalled(HAPROXY.to_string()));
        }
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut config = tempfile::Builder::new()
            .prefix("haproxy-")
            .suffix(".cfg")
            .tempfile_in(dir)?;
        std::io::Write::write_all(config.as_file_mut(), config_text(addr, backends).as_bytes())?;
        let log = std::fs::File::create(dir.join(format!("haproxy-{port}.log")))?;
        let child = Command::new(HAPROXY)
            .arg("-db") // foreground: the bench owns the process
            .arg("-f")
            .arg(config.path())
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()?;
        let pid = child.id();
        let proxy = HaProxy {
            addr,
            pid,
            child,
            _config: config,
        };
        let started = Instant::now();
        loop {
            if let Ok(r) = http(addr, "GET", "/readyz", None, None, POLL * 4).await
                && r.status == 200
            {
                return Ok(proxy);
            }
            if started.elapsed() > START_LIMIT {
                return Err(BalancerError::NotServing(START_LIMIT));
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

impl Drop for HaProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// HAProxy's configuration: HTTP mode, keep-alive on both sides, round
/// robin, `/readyz` as the health check (a replica that is not ready gets
/// no search, which is how a site runs it).
fn config_text(listen: SocketAddr, backends: &[SocketAddr]) -> String {
    let servers: String = backends
        .iter()
        .enumerate()
        .map(|(i, b)| format!("  server replica{} {b} check inter 1s\n", i + 1))
        .collect();
    format!(
        "global\n  nbthread 1\n  maxconn 4096\n\
         defaults\n  mode http\n  option http-keep-alive\n  timeout connect 1s\n  timeout client 10s\n  timeout server 10s\n\
         frontend search\n  bind {listen}\n  default_backend replicas\n\
         backend replicas\n  balance roundrobin\n  option httpchk GET /readyz\n  http-check expect status 200\n{servers}"
    )
}

/// What one `wrk` run reported.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WrkFigures {
    pub requests: u64,
    pub per_second: f64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// Answers that were not 2xx or 3xx, and socket errors.
    pub failed: u64,
}

/// Writes a wrk script that asks, at random, one of `paths`.
pub fn write_script(dir: &Path, paths: &[String]) -> Result<PathBuf, BalancerError> {
    let list: String = paths.iter().map(|p| format!("  \"{p}\",\n")).collect();
    let script = format!(
        "local paths = {{\n{list}}}\n\
         request = function()\n  return wrk.format(\"GET\", paths[math.random(#paths)])\nend\n"
    );
    let path = dir.join("searches.lua");
    std::fs::write(&path, script)?;
    Ok(path)
}

/// `wrk -t1 -c<connections> -d<seconds>s --latency -s <script>` against
/// `addr`; one thread, as the clients share two cores with the servers.
pub async fn run_wrk(
    addr: SocketAddr,
    script: &Path,
    connections: u32,
    seconds: u32,
) -> Result<WrkFigures, BalancerError> {
    let out = tokio::process::Command::new("wrk")
        .args(["-t1", &format!("-c{connections}"), &format!("-d{seconds}s")])
        .args(["--timeout", "5s", "--latency", "-s"])
        .arg(script)
        .arg(format!("http://{addr}"))
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => BalancerError::NotInstalled("wrk".into()),
            _ => BalancerError::Wrk(e.to_string()),
        })?;
    if !out.status.success() {
        return Err(BalancerError::Wrk(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(parse_wrk(&String::from_utf8_lossy(&out.stdout)))
}

/// Reads wrk's summary: the request count, the rate, the 50% and 99%
/// lines of `--latency`, non-2xx/3xx answers and socket errors.
fn parse_wrk(out: &str) -> WrkFigures {
    let mut figures = WrkFigures::default();
    for line in out.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["Requests/sec:", rate] => figures.per_second = rate.parse().unwrap_or(0.0),
            [count, "requests", "in", ..] => figures.requests = count.parse().unwrap_or(0),
            ["50%", latency] => figures.p50_ms = wrk_ms(latency),
            ["99%", latency] => figures.p99_ms = wrk_ms(latency),
            ["Non-2xx", "or", "3xx", "responses:", n] => {
                figures.failed += n.parse::<u64>().unwrap_or(0);
            }
            ["Socket", "errors:", rest @ ..] => {
                figures.failed += rest
                    .iter()
                    .filter_map(|w| w.trim_end_matches(',').parse::<u64>().ok())
                    .sum::<u64>();
            }
            _ => {}
        }
    }
    figures
}

/// wrk prints durations with their unit: `812.00us`, `2.31ms`, `1.02s`.
fn wrk_ms(text: &str) -> Option<f64> {
    let (number, scale) = if let Some(n) = text.strip_suffix("us") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1e3)
    } else {
        return None;
    };
    number.parse::<f64>().ok().map(|n| n * scale)
}

/// CPU seconds (user + system) a process has used so far.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = procfs::process::Process::new(i32::try_from(pid).ok()?)
        .ok()?
        .stat()
        .ok()?;
    Some((stat.utime + stat.stime) as f64 / procfs::ticks_per_second() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_summary_is_read() {
        let out = "Running 10s test @ http://127.0.0.1:1\n  1 threads and 16 connections\n\
            \x20 Thread Stats   Avg      Stdev     Max   +/- Stdev\n\
            \x20   Latency     4.01ms    1.20ms  30.00ms   80.00%\n\
            \x20 Latency Distribution\n     50%  812.00us\n     75%    3.90ms\n     90%    5.00ms\n     99%    1.20s\n\
            \x20 31000 requests in 10.00s, 900.00MB read\n\
            \x20 Socket errors: connect 0, read 2, write 0, timeout 3\n\
            \x20 Non-2xx or 3xx responses: 7\nRequests/sec:   3100.50\nTransfer/sec:     90.00MB\n";
        let figures = parse_wrk(out);
        assert_eq!(figures.requests, 31000);
        assert_eq!(figures.per_second, 3100.5);
        assert_eq!(figures.p50_ms, Some(0.812));
        assert_eq!(figures.p99_ms, Some(1200.0));
        assert_eq!(figures.failed, 12);
    }

    #[test]
    fn the_config_lists_every_backend_with_its_health_check() {
        let text = config_text(
            "127.0.0.1:9000".parse().unwrap(),
            &[
                "127.0.0.1:1".parse().unwrap(),
                "127.0.0.1:2".parse().unwrap(),
            ],
        );
        assert!(text.contains("bind 127.0.0.1:9000"), "{text}");
        assert!(text.contains("server replica1 127.0.0.1:1 check"), "{text}");
        assert!(text.contains("server replica2 127.0.0.1:2 check"), "{text}");
        assert!(text.contains("option httpchk GET /readyz"), "{text}");
    }
}

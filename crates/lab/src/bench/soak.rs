//! `vacancy bench soak`: hours of the demo's booking site against one
//! `vacancy serve`, to find what grows with uptime (issue 24, item 2).
//!
//! A leak shows only over time, and a process's resident set grows for
//! good reasons too: the bounded caches fill up to their bounds (attempt
//! ids live a day). So the server states each cache's entry size in the code
//! and exports entries and estimated bytes (`vacancy_cache_entries`,
//! `vacancy_cache_estimated_bytes`); what is left of the RSS after those,
//! the remainder, must not grow. The server runs as a child process, so its
//! RSS, descriptors and tasks are its own and not the load generator's.
//!
//! The load is the demo's booking site (`crate::demo::BookingSite`: both
//! crowds of guests, the sweeper, hoteliers, the front desk), plus a few
//! steady searchers whose latencies are the search p99 and who each send a
//! fresh `X-Forwarded-For`, so the per-client rate limit's buckets come and
//! go as a public site's do. Every sample (10 s) records RSS, descriptors,
//! alive tasks, each cache's entries and bytes, the lag's and the searches'
//! p99 over the interval. After the warm-up the samples are judged
//! (`judge`); at the end the copy is compared with the owner row for row.
//! The samples go to `soak.csv` and a plot to `soak.svg` in `--out-dir`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use plotters::prelude::*;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio_util::sync::CancellationToken;

use super::faults::{self, Serve};
use super::{BenchError, Owner, OwnerArgs, print_header};
use crate::demo::{self, BookingSite, DemoOptions};
use crate::http_client::{HttpClient, http};
use crate::measure::Latencies;
use vacancy_service::slot;

/// The bounded caches, by their `cache` label, in the CSV's and the plot's order.
pub const CACHES: [&str; 4] = [
    "attempt_ids",
    "rate_limit_buckets",
    "search_candidates",
    "owner_read",
];
const HTTP_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the lag is read from `/v1/status`: 40 reads per 10-second sample.
const LAG_POLL: Duration = Duration::from_millis(250);
/// Pause between two searches of one steady searcher.
const SEARCH_PAUSE: Duration = Duration::from_millis(50);
/// The copy's first load, and its catching up before the final comparison.
const LOAD_LIMIT: Duration = Duration::from_secs(30 * 60);
const CATCH_UP_LIMIT: Duration = Duration::from_secs(120);
const MIB: f64 = 1024.0 * 1024.0;

#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    #[command(flatten)]
    pub owner: OwnerArgs,
    /// Minutes of load, warm-up included.
    #[arg(long, default_value_t = 60)]
    pub minutes: u64,
    /// Seconds at the start that are sampled but not judged (the caches
    /// fill, the allocator finds its working set).
    #[arg(long, default_value_t = 300)]
    pub warmup_seconds: u64,
    /// Seconds between two samples.
    #[arg(long, default_value_t = 10)]
    pub sample_seconds: u64,
    /// The demo's simulated booking-service guests (two crowds).
    #[arg(long, default_value_t = 16)]
    pub guests: usize,
    /// Steady searchers beside the guests, each one search every 50 ms at most.
    #[arg(long, default_value_t = 4)]
    pub searchers: usize,
    /// How long a hold lasts before the sweeper returns it.
    #[arg(long, default_value_t = 15)]
    pub hold_secs: u64,
    /// checkpoint.interval_secs of the server (checkpoints are on, as in production).
    #[arg(long, default_value_t = 300)]
    pub checkpoint_interval_secs: u64,
    /// Where soak.csv, soak.svg and the server's log go.
    #[arg(long, default_value = "soak")]
    pub out_dir: PathBuf,
    /// Goal: the remainder's least-squares slope after the warm-up, MiB per 10 minutes.
    #[arg(long, default_value_t = 1.0)]
    pub max_remainder_mib_per_10min: f64,
    /// Goal instead of the slope: the remainder's growth over the judged
    /// span (the slope times the span), MiB. For short runs (CI), where a
    /// slope over a minute or two says little about ten.
    #[arg(long)]
    pub max_remainder_growth_mib: Option<f64>,
    /// Descriptors are flat when the last quarter's maximum is at most the
    /// first quarter's plus this.
    #[arg(long, default_value_t = 8)]
    pub fd_slack: u64,
    /// Tasks are flat when the last quarter's maximum is at most the first
    /// quarter's plus this.
    #[arg(long, default_value_t = 16)]
    pub task_slack: u64,
    /// Lag and search p99 are flat when the last quarter's is at most the
    /// first quarter's times this, or plus `--p99-floor-ms`, whichever is more.
    #[arg(long, default_value_t = 2.0)]
    pub p99_factor: f64,
    #[arg(long, default_value_t = 20.0)]
    pub p99_floor_ms: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum SoakError {
    #[error(
        "{0} sample(s) after the warm-up; the goals need at least 4 (a longer run or a shorter warm-up)"
    )]
    TooFewSamples(usize),
    #[error("cannot read the server's /proc entry: {0}")]
    Proc(std::io::Error),
    #[error("the server exited during the soak; see {0}")]
    ServerGone(PathBuf),
    #[error("cannot draw the plot: {0}")]
    Plot(String),
    #[error("goals missed: {0}")]
    GoalsMissed(String),
}

/// One sample: the server's figures at its time, and the interval's p99s.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    /// Seconds since the load began.
    pub seconds: f64,
    pub rss_bytes: u64,
    pub fds: u64,
    pub tasks: u64,
    /// Entries and estimated bytes per cache, in `CACHES` order.
    pub cache_entries: [u64; 4],
    pub cache_bytes: [u64; 4],
    pub lag_p99_ms: Option<f64>,
    pub search_p99_ms: Option<f64>,
    pub searches: u64,
    pub search_errors: u64,
    /// The lag reads of the interval, and those above 0 by `LagCause`.
    pub lag: LagCounts,
    /// The longest lag episode that began in the interval, seconds.
    pub lag_longest_episode_s: f64,
    /// Transactions of the interval whose commit reached the replication
    /// loop 1 s or more after its commit timestamp
    /// (`vacancy_stream_commit_to_receive_seconds`).
    pub commits_received_late: u64,
    /// Transactions of the interval applied 250 ms or more after the loop
    /// had their commit (`vacancy_stream_receive_to_apply_seconds`).
    pub commits_applied_late: u64,
    /// `vacancy_stream_loop_stalls_total` in the interval.
    pub loop_stalls: u64,
    /// The owner during the interval.
    pub owner: OwnerSample,
    /// This machine's 1-minute load average at the sample.
    pub load1: f64,
}

/// Lag reads by what the owner showed right after each one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LagCounts {
    pub reads: u64,
    pub above_zero: u64,
    pub unflushed: u64,
    pub not_sent: u64,
    pub in_flight: u64,
    /// Reads during which the owner ran a vacuum (`pg_stat_progress_vacuum`).
    pub vacuuming: u64,
}

impl LagCounts {
    fn add(&mut self, read: &LagRead) {
        self.reads += 1;
        if read.vacuum {
            self.vacuuming += 1;
        }
        if read.lag_ms <= 0.0 {
            return;
        }
        self.above_zero += 1;
        match read.cause {
            LagCause::Unflushed => self.unflushed += 1,
            LagCause::NotSent => self.not_sent += 1,
            LagCause::InFlight => self.in_flight += 1,
            LagCause::Zero | LagCause::Unknown => {}
        }
    }
}

/// The owner's own activity over a sample's interval (differences of its
/// cumulative statistics).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OwnerSample {
    /// Checkpoints begun (`pg_stat_bgwriter`, timed and requested).
    pub checkpoints: u64,
    /// Buffers those checkpoints wrote.
    pub checkpoint_buffers: u64,
    /// Autovacuums finished, over the owner database's tables.
    pub autovacuums: u64,
    /// WAL the owner inserted.
    pub wal_bytes: u64,
}

/// Why a lag read was above 0, told by the owner's positions read right
/// after it (`lag_load`): `applied` is the copy's, from the same read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LagCause {
    /// The read was 0.
    #[default]
    Zero,
    /// The owner had flushed nothing past what the copy applied, so no
    /// commit of ours was pending (a commit is visible once flushed): the
    /// lag counted WAL the owner had not flushed. The measure, not the copy.
    Unflushed,
    /// The owner had flushed past the copy but its walsender had sent
    /// nothing past it: the walsender was behind (a commit of ours, or WAL
    /// of others it must decode to tell).
    NotSent,
    /// The walsender had sent past what the copy applied: on the wire, in
    /// vacancy before apply, or WAL of others whose keepalive was not sent yet.
    InFlight,
    /// The owner could not be read.
    Unknown,
}

impl LagCause {
    /// The cause of a read above 0, from the copy's applied position and
    /// the owner's flush position and walsender's sent position read after it.
    pub fn of(applied: u64, flushed: Option<u64>, sent: Option<u64>) -> LagCause {
        match (flushed, sent) {
            (Some(f), _) if f <= applied => LagCause::Unflushed,
            (Some(_), Some(s)) if s <= applied => LagCause::NotSent,
            (Some(_), Some(_)) => LagCause::InFlight,
            _ => LagCause::Unknown,
        }
    }
}

/// One read of `/v1/status`'s lag, with the owner's state right after it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LagRead {
    /// Seconds since the load began.
    pub at: f64,
    pub lag_ms: f64,
    pub cause: LagCause,
    pub vacuum: bool,
}

/// A run of lag reads above 0.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Episode {
    /// Its first read, seconds since the load began.
    pub start: f64,
    /// From its first read to the first read of 0 after it (or its last
    /// read, at the end of the run).
    pub seconds: f64,
    pub max_ms: f64,
    pub counts: LagCounts,
}

/// The episodes of `reads` (in time order).
pub fn episodes(reads: &[LagRead]) -> Vec<Episode> {
    let mut out = Vec::new();
    let mut open: Option<Episode> = None;
    for read in reads {
        match (&mut open, read.lag_ms > 0.0) {
            (Some(e), true) => {
                e.seconds = read.at - e.start;
                e.max_ms = e.max_ms.max(read.lag_ms);
                e.counts.add(read);
            }
            (None, true) => {
                let mut counts = LagCounts::default();
                counts.add(read);
                open = Some(Episode {
                    start: read.at,
                    seconds: 0.0,
                    max_ms: read.lag_ms,
                    counts,
                });
            }
            (Some(e), false) => {
                e.seconds = read.at - e.start;
                out.extend(open.take());
            }
            (None, false) => {}
        }
    }
    out.extend(open);
    out
}

impl Sample {
    pub fn cache_total_bytes(&self) -> u64 {
        self.cache_bytes.iter().sum()
    }

    /// RSS less what the bounded caches hold (may go below 0 if an estimate is high).
    pub fn remainder_bytes(&self) -> i64 {
        self.rss_bytes as i64 - self.cache_total_bytes() as i64
    }
}

/// What the judged samples must show.
#[derive(Debug, Clone)]
pub struct Goals {
    pub max_remainder_mib_per_10min: f64,
    pub max_remainder_growth_mib: Option<f64>,
    pub fd_slack: u64,
    pub task_slack: u64,
    pub p99_factor: f64,
    pub p99_floor_ms: f64,
}

/// One goal's figure and whether it was met.
#[derive(Debug, Clone, PartialEq)]
pub struct GoalResult {
    pub goal: String,
    pub figure: String,
    pub met: bool,
}

/// The raw latencies behind the samples, for the quarters' p99.
#[derive(Debug, Default)]
pub struct Raw {
    /// Per sample, in the same order: the lag reads and the search latencies.
    pub lag_ms: Vec<Vec<f64>>,
    pub search_ms: Vec<Vec<f64>>,
    /// Per sample: the lag reads with their causes (empty when not known).
    pub lag_reads: Vec<Vec<LagRead>>,
}

/// Least-squares slope of `ys` over `xs` (per unit of x); `None` with fewer
/// than two distinct xs.
pub fn slope(xs: &[f64], ys: &[f64]) -> Option<f64> {
    let n = xs.len().min(ys.len());
    if n < 2 {
        return None;
    }
    let mean_x = xs[..n].iter().sum::<f64>() / n as f64;
    let mean_y = ys[..n].iter().sum::<f64>() / n as f64;
    let sxx: f64 = xs[..n].iter().map(|x| (x - mean_x).powi(2)).sum();
    if sxx == 0.0 {
        return None;
    }
    let sxy: f64 = xs[..n]
        .iter()
        .zip(&ys[..n])
        .map(|(x, y)| (x - mean_x) * (y - mean_y))
        .sum();
    Some(sxy / sxx)
}

/// Judges the samples at or after `warmup` seconds (`raw` holds their
/// latencies, index for index with `samples`).
pub fn judge(
    samples: &[Sample],
    raw: &Raw,
    warmup: f64,
    goals: &Goals,
) -> Result<Vec<GoalResult>, SoakError> {
    let first = samples
        .iter()
        .position(|s| s.seconds >= warmup)
        .unwrap_or(samples.len());
    let judged = &samples[first..];
    if judged.len() < 4 {
        return Err(SoakError::TooFewSamples(judged.len()));
    }
    let mut results = Vec::new();

    let xs: Vec<f64> = judged.iter().map(|s| s.seconds).collect();
    let ys: Vec<f64> = judged
        .iter()
        .map(|s| s.remainder_bytes() as f64 / MIB)
        .collect();
    let per_second = slope(&xs, &ys).unwrap_or(0.0);
    let per_10min = per_second * 600.0;
    let span = xs[xs.len() - 1] - xs[0];
    let growth = per_second * span;
    match goals.max_remainder_growth_mib {
        Some(limit) => results.push(GoalResult {
            goal: format!("remainder grows <= {limit} MiB over the judged {span:.0} s"),
            figure: format!(
                "{growth:+.2} MiB (least-squares slope {per_10min:+.2} MiB per 10 min)"
            ),
            met: growth <= limit,
        }),
        None => results.push(GoalResult {
            goal: format!(
                "remainder grows < {} MiB per 10 min",
                goals.max_remainder_mib_per_10min
            ),
            figure: format!(
                "{per_10min:+.3} MiB per 10 min (least squares over {span:.0} s; {growth:+.2} MiB in all)"
            ),
            met: per_10min < goals.max_remainder_mib_per_10min,
        }),
    }

    let quarter = judged.len().div_ceil(4);
    let (head, tail) = (&judged[..quarter], &judged[judged.len() - quarter..]);
    let flat = |name: &str, value: fn(&Sample) -> u64, slack: u64| {
        let before = head.iter().map(value).max().unwrap_or(0);
        let after = tail.iter().map(value).max().unwrap_or(0);
        GoalResult {
            goal: format!(
                "{name} flat: the last quarter's max <= the first quarter's max + {slack}"
            ),
            figure: format!(
                "first quarter max {before}, last quarter max {after} (all judged: {}..{})",
                judged.iter().map(value).min().unwrap_or(0),
                judged.iter().map(value).max().unwrap_or(0)
            ),
            met: after <= before + slack,
        }
    };
    results.push(flat("descriptors", |s| s.fds, goals.fd_slack));
    results.push(flat("tasks", |s| s.tasks, goals.task_slack));

    let tail_start = judged.len() - quarter;
    let pooled = |lists: &[Vec<f64>], range: std::ops::Range<usize>| {
        let values: Vec<f64> = lists
            .get(first + range.start..first + range.end)
            .unwrap_or_default()
            .iter()
            .flatten()
            .copied()
            .collect();
        Latencies::from_millis(values).percentile(0.99)
    };
    for (name, lists) in [("lag p99", &raw.lag_ms), ("search p99", &raw.search_ms)] {
        let before = pooled(lists, 0..quarter);
        let after = pooled(lists, tail_start..judged.len());
        let (figure, met) = match (before, after) {
            (Some(b), Some(a)) => {
                let bound = (b * goals.p99_factor).max(b + goals.p99_floor_ms);
                (
                    format!(
                        "first quarter {b:.1} ms, last quarter {a:.1} ms (bound {bound:.1} ms)"
                    ),
                    a <= bound,
                )
            }
            _ => ("no measurements in a quarter".to_string(), false),
        };
        // What the p99 alone cannot say: how much of each quarter the lag
        // was above 0 at all, and its longest stretch. Said, not judged.
        let figure = if name == "lag p99" {
            let first_q = lag_quarter(raw, first..first + quarter);
            let last_q = lag_quarter(raw, first + tail_start..first + judged.len());
            format!("{figure}; reads above 0: first quarter {first_q}, last quarter {last_q}")
        } else {
            figure
        };
        results.push(GoalResult {
            goal: format!(
                "{name} flat: the last quarter's <= max(first quarter's x {}, + {} ms)",
                goals.p99_factor, goals.p99_floor_ms
            ),
            figure,
            met,
        });
    }
    Ok(results)
}

/// A quarter's lag reads: the share above 0, and its longest episode when
/// the reads' times are known.
fn lag_quarter(raw: &Raw, range: std::ops::Range<usize>) -> String {
    let lists = raw.lag_ms.get(range.clone()).unwrap_or_default();
    let reads: usize = lists.iter().map(Vec::len).sum();
    let above: usize = lists.iter().flatten().filter(|v| **v > 0.0).count();
    let share = 100.0 * above as f64 / reads.max(1) as f64;
    let timed: Vec<LagRead> = raw
        .lag_reads
        .get(range)
        .unwrap_or_default()
        .iter()
        .flatten()
        .copied()
        .collect();
    match episodes(&timed)
        .iter()
        .max_by(|a, b| a.seconds.total_cmp(&b.seconds))
    {
        Some(e) => format!(
            "{share:.2}% (longest episode {:.1} s, up to {:.0} ms)",
            e.seconds, e.max_ms
        ),
        None => format!("{share:.2}%"),
    }
}

/// The samples as CSV, one row each, with a header.
pub fn csv(samples: &[Sample]) -> String {
    let mut out = String::from(
        "seconds,rss_bytes,remainder_bytes,cache_bytes,fds,tasks,lag_p99_ms,search_p99_ms,searches,search_errors",
    );
    for cache in CACHES {
        out.push_str(&format!(",{cache}_entries,{cache}_bytes"));
    }
    out.push_str(
        ",lag_reads,lag_reads_above_0,lag_reads_unflushed,lag_reads_not_sent,lag_reads_in_flight,lag_longest_episode_s,commits_received_late_1s,commits_applied_late_250ms,loop_stalls,owner_vacuuming_reads,owner_checkpoints,owner_checkpoint_buffers,owner_autovacuums,owner_wal_bytes,load1",
    );
    out.push('\n');
    let ms = |v: Option<f64>| v.map(|v| format!("{v:.3}")).unwrap_or_default();
    for s in samples {
        out.push_str(&format!(
            "{:.1},{},{},{},{},{},{},{},{},{}",
            s.seconds,
            s.rss_bytes,
            s.remainder_bytes(),
            s.cache_total_bytes(),
            s.fds,
            s.tasks,
            ms(s.lag_p99_ms),
            ms(s.search_p99_ms),
            s.searches,
            s.search_errors
        ));
        for i in 0..CACHES.len() {
            out.push_str(&format!(",{},{}", s.cache_entries[i], s.cache_bytes[i]));
        }
        let (l, o) = (&s.lag, &s.owner);
        out.push_str(&format!(
            ",{},{},{},{},{},{:.2},{},{},{},{},{},{},{},{},{:.2}",
            l.reads,
            l.above_zero,
            l.unflushed,
            l.not_sent,
            l.in_flight,
            s.lag_longest_episode_s,
            s.commits_received_late,
            s.commits_applied_late,
            s.loop_stalls,
            l.vacuuming,
            o.checkpoints,
            o.checkpoint_buffers,
            o.autovacuums,
            o.wal_bytes,
            s.load1
        ));
        out.push('\n');
    }
    out
}

/// One gauge from the Prometheus text, by name and (optionally) its
/// `cache` label; `None` when it is not there.
pub fn gauge(metrics: &str, name: &str, cache: Option<&str>) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let rest = match cache {
            Some(cache) => rest.strip_prefix(&format!("{{cache=\"{cache}\"}}"))?,
            None => rest,
        };
        let value = rest.strip_prefix(' ')?;
        value.trim().parse().ok()
    })
}

/// How many observations of histogram `name` exceeded `le` (its count
/// less its bucket `le`), from the Prometheus text; `None` when absent.
pub fn above_bucket(metrics: &str, name: &str, le: &str) -> Option<f64> {
    let count = gauge(metrics, &format!("{name}_count"), None)?;
    let bucket = metrics.lines().find_map(|line| {
        let rest = line.strip_prefix(&format!("{name}_bucket{{le=\"{le}\"}} "))?;
        rest.trim().parse::<f64>().ok()
    })?;
    Some(count - bucket)
}

pub async fn run(args: SoakArgs) -> Result<(), BenchError> {
    let owner = Owner::prepare(&args.owner).await?;
    let client = vacancy_service::connect(owner.url(), super::CONNECT_TIMEOUT).await?;
    // The guests' bookings and holds live in the reference schema's tables.
    crate::schema::apply(&client).await?;
    print_header("soak", &owner, &client).await?;
    let result = soak(&owner, &client, &args).await;
    // The child's slot and publication on an attached owner (an embedded one goes whole).
    let cleaned = async {
        slot::drop_slot(&client, faults::SLOT).await?;
        client
            .batch_execute(&format!(
                "DROP PUBLICATION IF EXISTS {}",
                faults::PUBLICATION
            ))
            .await?;
        Ok::<(), BenchError>(())
    }
    .await;
    result.and(cleaned)
}

async fn soak(
    owner: &Owner,
    client: &tokio_postgres::Client,
    args: &SoakArgs,
) -> Result<(), BenchError> {
    std::fs::create_dir_all(&args.out_dir)?;
    let exe = std::env::current_exe()?;
    // `checkpoint.dir` must be absolute (the service refuses a relative
    // one, which would move with its working directory); CI passes a
    // relative --out-dir.
    let checkpoints = std::path::absolute(args.out_dir.join("checkpoints"))?;
    std::fs::create_dir_all(&checkpoints)?;
    let env = vec![
        (
            "VACANCY_CHECKPOINT__DIR".to_string(),
            checkpoints.display().to_string(),
        ),
        (
            "VACANCY_CHECKPOINT__INTERVAL_SECS".to_string(),
            args.checkpoint_interval_secs.max(1).to_string(),
        ),
        // The per-client limit on, high enough never to refuse the load,
        // with the searchers' X-Forwarded-For trusted: its buckets fill and
        // idle out as a public site's do.
        (
            "VACANCY_HTTP__RATE_LIMIT_PER_SEC".to_string(),
            "200".to_string(),
        ),
        (
            "VACANCY_HTTP__RATE_LIMIT_BURST".to_string(),
            "400".to_string(),
        ),
        (
            "VACANCY_HTTP__TRUST_FORWARDED_FOR".to_string(),
            "true".to_string(),
        ),
    ];
    let mut serve = Serve::start_with_env(&exe, owner.url(), &args.out_dir, "serve", env)?;
    let result = soak_with(owner, client, args, &mut serve).await;
    serve.stop().await;
    result
}

async fn soak_with(
    owner: &Owner,
    client: &tokio_postgres::Client,
    args: &SoakArgs,
    serve: &mut Serve,
) -> Result<(), BenchError> {
    let pid = serve
        .pid()
        .ok_or_else(|| SoakError::ServerGone(serve.log_path()))?;
    let loaded_from = Instant::now();
    let target = slot::current_wal_lsn(client).await?;
    serve
        .caught_up(target, LOAD_LIMIT, "the first snapshot")
        .await?;
    eprintln!(
        "the copy is loaded in {:.1} s; {} minutes of load, {} s of warm-up",
        loaded_from.elapsed().as_secs_f64(),
        args.minutes,
        args.warmup_seconds
    );
    let load_start = load_average();

    let today = chrono::Utc::now().date_naive();
    let data = demo::dataset(client, today).await?;
    let site_options = DemoOptions {
        owner_url: None,
        pg_bin: None,
        listen: serve.addr.to_string(),
        hotels: 0,
        room_types: 0,
        nights: 0,
        guests: args.guests.max(1),
        hold_secs: args.hold_secs,
        duration: None,
        report_every: Duration::from_secs(args.sample_seconds),
    };
    let mut site = BookingSite::open(
        &site_options,
        &data,
        serve.addr,
        owner.url(),
        faults::BOOKING_TOKEN,
    );
    let cities: Vec<String> = client
        .query("SELECT DISTINCT city FROM hotels ORDER BY 1", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    // The owner's positions beside each lag read, on a connection of its own.
    let watcher = vacancy_service::connect(owner.url(), super::CONNECT_TIMEOUT).await?;
    let stop = CancellationToken::new();
    let began = Instant::now();
    let latencies = Arc::new(Mutex::new(Window::default()));
    let mut load = Vec::new();
    for i in 0..args.searchers {
        load.push(tokio::spawn(search_load(
            serve.addr,
            cities.clone(),
            (data.first_night, i64::from(data.nights)),
            i as u64 + 1,
            latencies.clone(),
            stop.clone(),
        )));
    }
    load.push(tokio::spawn(lag_load(
        serve.addr,
        watcher,
        began,
        latencies.clone(),
        stop.clone(),
    )));

    let sampled = sample_until(serve, pid, args, &latencies, client, began).await;
    stop.cancel();
    let guests = site.close().await;
    for task in load {
        // Each loop ends within one request's timeout of the cancel.
        let _ = tokio::time::timeout(HTTP_TIMEOUT * 2, task).await;
    }
    let load_end = load_average();
    let (mut samples, raw) = sampled?;
    let all_reads: Vec<LagRead> = raw.lag_reads.iter().flatten().copied().collect();
    let all_episodes = episodes(&all_reads);
    for e in &all_episodes {
        // The sample whose interval the episode began in.
        if let Some(s) = samples.iter_mut().find(|s| s.seconds >= e.start) {
            s.lag_longest_episode_s = s.lag_longest_episode_s.max(e.seconds);
        }
    }

    eprintln!("checking the copy against the owner, row for row");
    let target = slot::current_wal_lsn(client).await?;
    serve
        .caught_up(target, CATCH_UP_LIMIT, "the final comparison")
        .await?;
    let divergence = faults::measure_divergence(serve.addr, client).await?;

    std::fs::write(args.out_dir.join("soak.csv"), csv(&samples))?;
    plot(
        &args.out_dir.join("soak.svg"),
        &samples,
        args.warmup_seconds as f64,
    )?;

    let goals = Goals {
        max_remainder_mib_per_10min: args.max_remainder_mib_per_10min,
        max_remainder_growth_mib: args.max_remainder_growth_mib,
        fd_slack: args.fd_slack,
        task_slack: args.task_slack,
        p99_factor: args.p99_factor,
        p99_floor_ms: args.p99_floor_ms,
    };
    let mut results = judge(&samples, &raw, args.warmup_seconds as f64, &goals)?;
    results.push(GoalResult {
        goal: "the final row-for-row check finds 0 differing rows".to_string(),
        figure: format!(
            "{} of {} rows differ{}",
            divergence.total(),
            divergence.compared,
            if divergence.examples.is_empty() {
                String::new()
            } else {
                format!(" (e.g. {})", divergence.examples.join("; "))
            }
        ),
        met: divergence.total() == 0,
    });
    print_figures(&samples, args, &guests, &site, (&load_start, &load_end));
    println!();
    println!("| goal | figure | met |");
    println!("| --- | --- | --- |");
    for r in &results {
        println!(
            "| {} | {} | {} |",
            r.goal,
            r.figure,
            if r.met { "yes" } else { "**no**" }
        );
    }
    print_lag(&samples, &all_episodes, args.warmup_seconds as f64);
    println!();
    println!(
        "samples: {}, plot: {}",
        args.out_dir.join("soak.csv").display(),
        args.out_dir.join("soak.svg").display()
    );
    let missed: Vec<&str> = results
        .iter()
        .filter(|r| !r.met)
        .map(|r| r.goal.as_str())
        .collect();
    if missed.is_empty() {
        println!("verdict: every goal met");
        Ok(())
    } else {
        println!("verdict: {} goal(s) missed", missed.len());
        Err(SoakError::GoalsMissed(missed.join("; ")).into())
    }
}

/// The latencies measured since the last sample.
#[derive(Debug, Default)]
struct Window {
    lag_ms: Vec<f64>,
    lag_reads: Vec<LagRead>,
    search_ms: Vec<f64>,
    searches: u64,
    search_errors: u64,
}

/// Samples every `sample_seconds` until `minutes` have passed.
async fn sample_until(
    serve: &Serve,
    pid: u32,
    args: &SoakArgs,
    latencies: &Mutex<Window>,
    owner: &tokio_postgres::Client,
    started: Instant,
) -> Result<(Vec<Sample>, Raw), BenchError> {
    let end = started + Duration::from_secs(args.minutes.max(1) * 60);
    // Cumulative figures, for each interval's difference.
    let mut owner_before = owner_counters(owner).await;
    let mut stream_before = StreamCounters::default();
    let mut ticker = tokio::time::interval(Duration::from_secs(args.sample_seconds.max(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate: the interval before it is empty.
    ticker.tick().await;
    let mut samples = Vec::new();
    let mut raw = Raw::default();
    while Instant::now() < end {
        ticker.tick().await;
        let window = std::mem::take(&mut *latencies.lock().unwrap_or_else(|p| p.into_inner()));
        let metrics = match http(serve.addr, "GET", "/metrics", None, None, HTTP_TIMEOUT).await {
            Ok(r) => String::from_utf8_lossy(&r.body).into_owned(),
            Err(e) => {
                eprintln!("no /metrics this sample: {e}");
                String::new()
            }
        };
        let owner_now = owner_counters(owner).await;
        let owner_sample = match (owner_before, owner_now) {
            (Some(b), Some(n)) => OwnerSample {
                checkpoints: n.checkpoints.saturating_sub(b.checkpoints),
                checkpoint_buffers: n.checkpoint_buffers.saturating_sub(b.checkpoint_buffers),
                autovacuums: n.autovacuums.saturating_sub(b.autovacuums),
                wal_bytes: n.wal_bytes.saturating_sub(b.wal_bytes),
            },
            _ => OwnerSample::default(),
        };
        owner_before = owner_now.or(owner_before);
        let stream_now = StreamCounters::read(&metrics);
        let mut lag = LagCounts::default();
        for read in &window.lag_reads {
            lag.add(read);
        }
        let (rss_bytes, fds) = match process_figures(pid) {
            Ok(figures) => figures,
            Err(_) => return Err(SoakError::ServerGone(serve.log_path()).into()),
        };
        let mut sample = Sample {
            seconds: started.elapsed().as_secs_f64(),
            rss_bytes,
            fds,
            tasks: gauge(&metrics, "vacancy_runtime_alive_tasks", None).unwrap_or(0.0) as u64,
            lag_p99_ms: Latencies::from_millis(window.lag_ms.clone()).percentile(0.99),
            search_p99_ms: Latencies::from_millis(window.search_ms.clone()).percentile(0.99),
            searches: window.searches,
            search_errors: window.search_errors,
            lag,
            commits_received_late: stream_now
                .received_late
                .saturating_sub(stream_before.received_late),
            commits_applied_late: stream_now
                .applied_late
                .saturating_sub(stream_before.applied_late),
            loop_stalls: stream_now.stalls.saturating_sub(stream_before.stalls),
            owner: owner_sample,
            load1: load_average()
                .split_whitespace()
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0),
            ..Sample::default()
        };
        stream_before = stream_now;
        for (i, cache) in CACHES.iter().enumerate() {
            sample.cache_entries[i] =
                gauge(&metrics, "vacancy_cache_entries", Some(cache)).unwrap_or(0.0) as u64;
            sample.cache_bytes[i] =
                gauge(&metrics, "vacancy_cache_estimated_bytes", Some(cache)).unwrap_or(0.0) as u64;
        }
        eprintln!(
            "[{:>5.0}s] rss {:>7.1} MiB  remainder {:>7.1} MiB  caches {:>6.2} MiB  fds {:>3}  tasks {:>4}  lag p99 {:>6} ms  search p99 {:>6} ms  searches {:>5} (errors {})",
            sample.seconds,
            sample.rss_bytes as f64 / MIB,
            sample.remainder_bytes() as f64 / MIB,
            sample.cache_total_bytes() as f64 / MIB,
            sample.fds,
            sample.tasks,
            sample.lag_p99_ms.map_or("-".into(), |v| format!("{v:.1}")),
            sample
                .search_p99_ms
                .map_or("-".into(), |v| format!("{v:.1}")),
            sample.searches,
            sample.search_errors,
        );
        samples.push(sample);
        raw.lag_ms.push(window.lag_ms);
        raw.search_ms.push(window.search_ms);
        raw.lag_reads.push(window.lag_reads);
    }
    Ok((samples, raw))
}

/// The server's cumulative stream figures (`/metrics`).
#[derive(Debug, Clone, Copy, Default)]
struct StreamCounters {
    received_late: u64,
    applied_late: u64,
    stalls: u64,
}

impl StreamCounters {
    fn read(metrics: &str) -> StreamCounters {
        let count = |v: Option<f64>| v.map_or(0, |v| v.max(0.0) as u64);
        StreamCounters {
            received_late: count(above_bucket(
                metrics,
                "vacancy_stream_commit_to_receive_seconds",
                "1",
            )),
            applied_late: count(above_bucket(
                metrics,
                "vacancy_stream_receive_to_apply_seconds",
                "0.25",
            )),
            stalls: count(gauge(metrics, "vacancy_stream_loop_stalls_total", None)),
        }
    }
}

/// The owner's cumulative activity figures.
#[derive(Debug, Clone, Copy)]
struct OwnerCounters {
    checkpoints: u64,
    checkpoint_buffers: u64,
    autovacuums: u64,
    wal_bytes: u64,
}

/// Reads the owner's checkpoints, autovacuums and WAL position; `None`
/// when it does not answer in time (the sample then shows none).
async fn owner_counters(owner: &tokio_postgres::Client) -> Option<OwnerCounters> {
    let read = owner.query_one(
        "SELECT (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter),
                (SELECT buffers_checkpoint FROM pg_stat_bgwriter),
                (SELECT coalesce(sum(autovacuum_count), 0)::bigint FROM pg_stat_all_tables),
                (pg_current_wal_insert_lsn() - '0/0')::bigint",
        &[],
    );
    let row = tokio::time::timeout(HTTP_TIMEOUT, read).await.ok()?.ok()?;
    let value = |i: usize| {
        row.try_get::<_, i64>(i)
            .ok()
            .and_then(|v| u64::try_from(v).ok())
    };
    Some(OwnerCounters {
        checkpoints: value(0)?,
        checkpoint_buffers: value(1)?,
        autovacuums: value(2)?,
        wal_bytes: value(3)?,
    })
}

/// The owner's flushed WAL position, its walsender's sent position for the
/// soak's slot, and whether a vacuum runs; `None`s when it does not answer.
async fn owner_positions(owner: &tokio_postgres::Client) -> (Option<u64>, Option<u64>, bool) {
    let read = owner.query_one(
        "SELECT (pg_current_wal_flush_lsn() - '0/0')::bigint,
                (SELECT (r.sent_lsn - '0/0')::bigint
                   FROM pg_stat_replication r JOIN pg_replication_slots s ON s.active_pid = r.pid
                  WHERE s.slot_name = $1),
                EXISTS (SELECT 1 FROM pg_stat_progress_vacuum)",
        &[&faults::SLOT],
    );
    match tokio::time::timeout(HTTP_TIMEOUT, read).await {
        Ok(Ok(row)) => {
            let lsn = |i: usize| {
                row.try_get::<_, Option<i64>>(i)
                    .ok()
                    .flatten()
                    .and_then(|v| u64::try_from(v).ok())
            };
            (lsn(0), lsn(1), row.try_get(2).unwrap_or(false))
        }
        _ => (None, None, false),
    }
}

/// The server's resident bytes (`VmRSS`) and open descriptors.
fn process_figures(pid: u32) -> Result<(u64, u64), SoakError> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(SoakError::Proc)?;
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map_err(SoakError::Proc)?
        .count() as u64;
    Ok((rss_kib * 1024, fds))
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// One steady searcher: a city, a stay, a page of 10, from a fresh client
/// address each time (`X-Forwarded-For`), so rate-limit buckets come and go.
async fn search_load(
    addr: SocketAddr,
    cities: Vec<String>,
    (first_night, nights): (chrono::NaiveDate, i64),
    seed: u64,
    latencies: Arc<Mutex<Window>>,
    stop: CancellationToken,
) {
    let Ok(client) = HttpClient::new(addr, HTTP_TIMEOUT) else {
        latencies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .search_errors += 1;
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x534f_414b);
    while !stop.is_cancelled() && !cities.is_empty() {
        let city = &cities[rng.random_range(0..cities.len())];
        let stay: i64 = rng.random_range(1..=3);
        let start = rng.random_range(0..(nights - stay).max(1));
        let check_in = first_night + chrono::Days::new(start.unsigned_abs());
        let check_out = check_in + chrono::Days::new(stay.unsigned_abs());
        let city: String = form_urlencoded::byte_serialize(city.as_bytes()).collect();
        let path = format!(
            "/v1/search?city={city}&check_in={check_in}&check_out={check_out}&room=2&limit=10"
        );
        let forwarded = format!(
            "10.{}.{}.{}",
            rng.random::<u8>(),
            rng.random::<u8>(),
            rng.random::<u8>()
        );
        let sent = Instant::now();
        let answer = client
            .send(
                client
                    .request(reqwest::Method::GET, &path)
                    .header("x-forwarded-for", forwarded),
            )
            .await;
        let took = sent.elapsed().as_secs_f64() * 1e3;
        {
            let mut w = latencies.lock().unwrap_or_else(|p| p.into_inner());
            w.searches += 1;
            match answer {
                Ok(r) if r.status == 200 => w.search_ms.push(took),
                _ => w.search_errors += 1,
            }
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(SEARCH_PAUSE) => {}
        }
    }
}

/// Reads the copy's lag from `/v1/status` every `LAG_POLL`, and when it is
/// above 0, the owner's positions right after, to tell why (`LagCause`).
async fn lag_load(
    addr: SocketAddr,
    owner: tokio_postgres::Client,
    began: Instant,
    latencies: Arc<Mutex<Window>>,
    stop: CancellationToken,
) {
    let Ok(client) = HttpClient::new(addr, HTTP_TIMEOUT) else {
        return;
    };
    while !stop.is_cancelled() {
        if let Ok(r) = client.get("/v1/status").await {
            let status = r.json();
            if let Some(seconds) = status["lag_seconds"].as_f64() {
                let at = began.elapsed().as_secs_f64();
                let lag_ms = seconds * 1e3;
                let applied = status["applied_lsn"]
                    .as_str()
                    .and_then(|v| v.parse::<vacancy_service::Lsn>().ok());
                // Read every time, so the vacuum column covers quiet reads too.
                let (flushed, sent, vacuum) = owner_positions(&owner).await;
                let cause = match applied {
                    _ if lag_ms <= 0.0 => LagCause::Zero,
                    Some(applied) => LagCause::of(applied.0, flushed, sent),
                    None => LagCause::Unknown,
                };
                let mut w = latencies.lock().unwrap_or_else(|p| p.into_inner());
                w.lag_ms.push(lag_ms);
                w.lag_reads.push(LagRead {
                    at,
                    lag_ms,
                    cause,
                    vacuum,
                });
            }
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(LAG_POLL) => {}
        }
    }
}

fn print_figures(
    samples: &[Sample],
    args: &SoakArgs,
    guests: &crate::simulator::SimSummary,
    site: &BookingSite,
    (load_start, load_end): (&str, &str),
) {
    use std::sync::atomic::Ordering;
    let searches: u64 = samples.iter().map(|s| s.searches).sum();
    let errors: u64 = samples.iter().map(|s| s.search_errors).sum();
    let span = samples.last().map_or(0.0, |s| s.seconds);
    println!();
    println!(
        "load:     {} guests ({} searches, {} taken, {} conflicts, {} paid, {} released, {} swept), {} cancellations, {} capacity changes; {} steady searchers: {} searches ({:.1}/s), {} failed",
        args.guests,
        guests.searches,
        guests.taken,
        guests.conflicts,
        guests.paid,
        guests.released,
        guests.swept,
        site.counters.cancelled.load(Ordering::Relaxed),
        site.counters.capacity_changes.load(Ordering::Relaxed),
        args.searchers,
        searches,
        searches as f64 / span.max(1.0),
        errors
    );
    println!("load average (1, 5, 15 min): {load_start} at the start, {load_end} at the end");
    let at = |s: &Sample| {
        format!(
            "rss {:.1} MiB, remainder {:.1} MiB, caches {:.2} MiB ({}), fds {}, tasks {}",
            s.rss_bytes as f64 / MIB,
            s.remainder_bytes() as f64 / MIB,
            s.cache_total_bytes() as f64 / MIB,
            CACHES
                .iter()
                .zip(&s.cache_entries)
                .map(|(c, n)| format!("{c} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
            s.fds,
            s.tasks
        )
    };
    let warm = args.warmup_seconds as f64;
    if let Some(s) = samples.iter().find(|s| s.seconds >= warm) {
        println!("after the warm-up ({:.0} s): {}", s.seconds, at(s));
    }
    if let Some(s) = samples.last() {
        println!("at the end ({:.0} s):       {}", s.seconds, at(s));
    }
}

/// The lag beside the owner: per judged quarter the share of reads above
/// 0 by cause and the longest episode, then the longest episodes with what
/// the owner and this machine did in their samples.
fn print_lag(samples: &[Sample], episodes: &[Episode], warmup: f64) {
    let judged: Vec<&Sample> = samples.iter().filter(|s| s.seconds >= warmup).collect();
    if judged.is_empty() {
        return;
    }
    println!();
    println!(
        "lag reads above 0, by what the owner showed right after (unflushed: the owner had flushed nothing past the copy; not sent: its walsender had sent nothing past it; in flight: sent, not yet applied)"
    );
    println!(
        "| quarter | reads | above 0 | unflushed | not sent | in flight | longest episode | received >= 1 s late | applied >= 250 ms late | loop stalls | owner checkpoints | autovacuums | load1 max |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let quarter = judged.len().div_ceil(4);
    for (i, part) in judged.chunks(quarter).enumerate() {
        let mut c = LagCounts::default();
        for s in part {
            c.reads += s.lag.reads;
            c.above_zero += s.lag.above_zero;
            c.unflushed += s.lag.unflushed;
            c.not_sent += s.lag.not_sent;
            c.in_flight += s.lag.in_flight;
        }
        let sum = |f: fn(&Sample) -> u64| part.iter().map(|s| f(s)).sum::<u64>();
        println!(
            "| {} ({:.0}-{:.0} s) | {} | {:.2}% | {} | {} | {} | {:.1} s | {} | {} | {} | {} | {} | {:.1} |",
            i + 1,
            part[0].seconds,
            part[part.len() - 1].seconds,
            c.reads,
            100.0 * c.above_zero as f64 / c.reads.max(1) as f64,
            c.unflushed,
            c.not_sent,
            c.in_flight,
            part.iter()
                .map(|s| s.lag_longest_episode_s)
                .fold(0.0, f64::max),
            sum(|s| s.commits_received_late),
            sum(|s| s.commits_applied_late),
            sum(|s| s.loop_stalls),
            sum(|s| s.owner.checkpoints),
            sum(|s| s.owner.autovacuums),
            part.iter().map(|s| s.load1).fold(0.0, f64::max),
        );
    }
    let mut longest: Vec<&Episode> = episodes.iter().collect();
    longest.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    println!();
    println!(
        "the longest lag episodes (reads by cause: unflushed / not sent / in flight; the vacuum column counts reads during an owner vacuum)"
    );
    for e in longest.iter().take(10) {
        let sample = samples.iter().find(|s| s.seconds >= e.start);
        println!(
            "  at {:>6.1} s: {:>5.1} s, up to {:>6.0} ms, {} reads ({} / {} / {}), vacuum {}; its sample: {} received >= 1 s late, {} applied >= 250 ms late, {} owner checkpoints, load1 {:.1}",
            e.start,
            e.seconds,
            e.max_ms,
            e.counts.above_zero,
            e.counts.unflushed,
            e.counts.not_sent,
            e.counts.in_flight,
            e.counts.vacuuming,
            sample.map_or(0, |s| s.commits_received_late),
            sample.map_or(0, |s| s.commits_applied_late),
            sample.map_or(0, |s| s.owner.checkpoints),
            sample.map_or(0.0, |s| s.load1),
        );
    }
}

/// The samples over time, three panels: memory (RSS, remainder, caches),
/// descriptors and tasks, lag and search p99; the warm-up's end marked.
pub fn plot(path: &Path, samples: &[Sample], warmup: f64) -> Result<(), SoakError> {
    let err = |e: &dyn std::fmt::Display| SoakError::Plot(e.to_string());
    let root = SVGBackend::new(path, (960, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let panels = root.split_evenly((3, 1));
    let minutes: Vec<f64> = samples.iter().map(|s| s.seconds / 60.0).collect();
    let x_max = minutes.last().copied().unwrap_or(1.0).max(0.1);
    let series = |values: Vec<f64>| -> Vec<(f64, f64)> {
        minutes.iter().copied().zip(values).collect::<Vec<_>>()
    };
    type Line = (&'static str, RGBColor, Vec<(f64, f64)>);
    let mem: Vec<Line> = vec![
        (
            "RSS",
            BLUE,
            series(samples.iter().map(|s| s.rss_bytes as f64 / MIB).collect()),
        ),
        (
            "remainder (RSS - caches)",
            RED,
            series(
                samples
                    .iter()
                    .map(|s| s.remainder_bytes() as f64 / MIB)
                    .collect(),
            ),
        ),
        (
            "caches (entries x entry size)",
            GREEN,
            series(
                samples
                    .iter()
                    .map(|s| s.cache_total_bytes() as f64 / MIB)
                    .collect(),
            ),
        ),
    ];
    let counts: Vec<Line> = vec![
        (
            "open descriptors",
            BLUE,
            series(samples.iter().map(|s| s.fds as f64).collect()),
        ),
        (
            "tokio tasks alive",
            RED,
            series(samples.iter().map(|s| s.tasks as f64).collect()),
        ),
    ];
    let latency: Vec<Line> = vec![
        (
            "lag p99 per sample",
            BLUE,
            series(
                samples
                    .iter()
                    .map(|s| s.lag_p99_ms.unwrap_or(0.0))
                    .collect(),
            ),
        ),
        (
            "search p99 per sample",
            RED,
            series(
                samples
                    .iter()
                    .map(|s| s.search_p99_ms.unwrap_or(0.0))
                    .collect(),
            ),
        ),
    ];
    for (area, (title, unit, lines)) in panels.iter().zip([
        ("memory", "MiB", mem),
        ("descriptors and tasks", "count", counts),
        ("latency", "ms", latency),
    ]) {
        let y_max = lines
            .iter()
            .flat_map(|(_, _, points)| points.iter().map(|p| p.1))
            .fold(1.0_f64, f64::max)
            * 1.1;
        let y_min = lines
            .iter()
            .flat_map(|(_, _, points)| points.iter().map(|p| p.1))
            .fold(0.0_f64, f64::min);
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 18))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..x_max, y_min..y_max)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("minutes")
            .y_desc(unit)
            .light_line_style(WHITE)
            .draw()
            .map_err(|e| err(&e))?;
        for (name, color, points) in lines {
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
        let warm = warmup / 60.0;
        if warm > 0.0 && warm < x_max {
            chart
                .draw_series(LineSeries::new(
                    vec![(warm, y_min), (warm, y_max)],
                    BLACK.mix(0.4),
                ))
                .map_err(|e| err(&e))?
                .label("end of warm-up")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK.mix(0.4)));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn goals() -> Goals {
        Goals {
            max_remainder_mib_per_10min: 1.0,
            max_remainder_growth_mib: None,
            fd_slack: 2,
            task_slack: 4,
            p99_factor: 2.0,
            p99_floor_ms: 5.0,
        }
    }

    /// 60 samples 10 s apart whose remainder grows `mib_per_10min`, with
    /// 40 MiB in the caches that grow too (they must not count).
    fn run(mib_per_10min: f64) -> (Vec<Sample>, Raw) {
        let mut samples = Vec::new();
        let mut raw = Raw::default();
        for i in 0..60u64 {
            let seconds = i as f64 * 10.0;
            let remainder = 100.0 * MIB + mib_per_10min * MIB * seconds / 600.0;
            let cache = (i * 1_000_000) as f64;
            samples.push(Sample {
                seconds,
                rss_bytes: (remainder + cache) as u64,
                fds: 30 + i % 2,
                tasks: 50 + i % 3,
                cache_entries: [i * 1000, 0, 0, 0],
                cache_bytes: [cache as u64, 0, 0, 0],
                ..Sample::default()
            });
            raw.lag_ms.push(vec![1.0, 2.0]);
            raw.search_ms.push(vec![3.0, 4.0]);
        }
        (samples, raw)
    }

    fn met(results: &[GoalResult], prefix: &str) -> bool {
        results
            .iter()
            .find(|r| r.goal.starts_with(prefix))
            .map(|r| r.met)
            .expect("the goal is judged")
    }

    #[test]
    fn slope_is_least_squares() {
        let xs = [0.0, 1.0, 2.0, 3.0];
        assert_eq!(slope(&xs, &[1.0, 3.0, 5.0, 7.0]), Some(2.0));
        assert_eq!(slope(&xs, &[0.0, 1.0, 0.0, 1.0]), Some(0.2));
        assert_eq!(slope(&[1.0, 1.0], &[0.0, 5.0]), None);
    }

    #[test]
    fn a_growing_remainder_fails_and_growing_caches_do_not() {
        let (samples, raw) = run(0.5);
        let results = judge(&samples, &raw, 100.0, &goals()).expect("enough samples");
        assert!(met(&results, "remainder"), "{results:?}");
        assert!(results.iter().all(|r| r.met), "{results:?}");
        let (samples, raw) = run(1.5);
        let results = judge(&samples, &raw, 100.0, &goals()).expect("enough samples");
        assert!(!met(&results, "remainder"), "{results:?}");
    }

    #[test]
    fn the_total_growth_goal_replaces_the_slope() {
        let (samples, raw) = run(3.0);
        // 3 MiB per 10 min over the judged 490 s is 2.45 MiB.
        let mut g = goals();
        g.max_remainder_growth_mib = Some(2.5);
        assert!(met(&judge(&samples, &raw, 100.0, &g).unwrap(), "remainder"));
        g.max_remainder_growth_mib = Some(2.4);
        assert!(!met(
            &judge(&samples, &raw, 100.0, &g).unwrap(),
            "remainder"
        ));
    }

    #[test]
    fn descriptors_or_tasks_that_climb_fail() {
        let (mut samples, raw) = run(0.0);
        let n = samples.len();
        samples[n - 1].fds += 3;
        let results = judge(&samples, &raw, 100.0, &goals()).unwrap();
        assert!(!met(&results, "descriptors"));
        assert!(met(&results, "tasks"));
        samples[n - 1].fds -= 3;
        samples[n - 2].tasks += 10;
        let results = judge(&samples, &raw, 100.0, &goals()).unwrap();
        assert!(met(&results, "descriptors"));
        assert!(!met(&results, "tasks"));
    }

    #[test]
    fn warm_up_samples_are_not_judged() {
        let (mut samples, raw) = run(0.0);
        // A climb during the warm-up only.
        samples[0].fds = 500;
        samples[1].tasks = 900;
        samples[2].rss_bytes += 500 * MIB as u64;
        let results = judge(&samples, &raw, 100.0, &goals()).unwrap();
        assert!(results.iter().all(|r| r.met), "{results:?}");
    }

    #[test]
    fn a_slower_last_quarter_fails() {
        let (samples, mut raw) = run(0.0);
        let n = raw.search_ms.len();
        raw.search_ms[n - 1] = vec![40.0; 10];
        let results = judge(&samples, &raw, 100.0, &goals()).unwrap();
        assert!(!met(&results, "search p99"), "{results:?}");
        assert!(met(&results, "lag p99"));
        // Within the floor: 4 ms to 9 ms is within + 5 ms.
        raw.search_ms[n - 1] = vec![9.0; 10];
        let results = judge(&samples, &raw, 100.0, &goals()).unwrap();
        assert!(met(&results, "search p99"), "{results:?}");
    }

    #[test]
    fn too_few_samples_after_the_warm_up_is_an_error() {
        let (samples, raw) = run(0.0);
        assert!(matches!(
            judge(&samples, &raw, 570.0, &goals()),
            Err(SoakError::TooFewSamples(3))
        ));
    }

    #[test]
    fn gauges_are_read_by_name_and_cache() {
        let text = "# HELP vacancy_cache_entries x\n\
                    vacancy_cache_entries{cache=\"attempt_ids\"} 12\n\
                    vacancy_cache_entries{cache=\"owner_read\"} 3\n\
                    vacancy_cache_entries_other 9\n\
                    vacancy_runtime_alive_tasks 41\n";
        assert_eq!(
            gauge(text, "vacancy_cache_entries", Some("owner_read")),
            Some(3.0)
        );
        assert_eq!(
            gauge(text, "vacancy_cache_entries", Some("attempt_ids")),
            Some(12.0)
        );
        assert_eq!(gauge(text, "vacancy_runtime_alive_tasks", None), Some(41.0));
        assert_eq!(gauge(text, "vacancy_cache_entries", Some("nope")), None);
    }

    #[test]
    fn the_csv_has_one_row_per_sample_and_the_remainder() {
        let (samples, _) = run(0.0);
        let text = csv(&samples[..2]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("seconds,rss_bytes,remainder_bytes,cache_bytes,"));
        let second: Vec<&str> = lines[2].split(',').collect();
        assert_eq!(second.len(), lines[0].split(',').count());
        assert_eq!(
            second[2],
            (100 * 1024 * 1024).to_string(),
            "RSS less caches"
        );
    }

    fn read(at: f64, lag_ms: f64, cause: LagCause) -> LagRead {
        LagRead {
            at,
            lag_ms,
            cause,
            vacuum: false,
        }
    }

    #[test]
    fn a_lag_read_is_told_by_the_owner_positions_after_it() {
        // Flushed no further than applied: nothing committed was pending.
        assert_eq!(LagCause::of(100, Some(100), Some(100)), LagCause::Unflushed);
        assert_eq!(LagCause::of(100, Some(90), None), LagCause::Unflushed);
        assert_eq!(LagCause::of(100, Some(120), Some(100)), LagCause::NotSent);
        assert_eq!(LagCause::of(100, Some(120), Some(110)), LagCause::InFlight);
        assert_eq!(LagCause::of(100, Some(120), None), LagCause::Unknown);
        assert_eq!(LagCause::of(100, None, Some(110)), LagCause::Unknown);
    }

    #[test]
    fn an_episode_lasts_from_its_first_read_above_0_to_the_next_0() {
        let reads = [
            read(0.0, 0.0, LagCause::Zero),
            read(0.25, 300.0, LagCause::Unflushed),
            read(0.5, 550.0, LagCause::Unflushed),
            read(0.75, 20.0, LagCause::InFlight),
            read(1.0, 0.0, LagCause::Zero),
            read(1.25, 40.0, LagCause::NotSent),
        ];
        let found = episodes(&reads);
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0].start, 0.25);
        assert_eq!(found[0].seconds, 0.75);
        assert_eq!(found[0].max_ms, 550.0);
        assert_eq!(
            (
                found[0].counts.above_zero,
                found[0].counts.unflushed,
                found[0].counts.in_flight
            ),
            (3, 2, 1)
        );
        // Still open at the end of the run: its one read, no length.
        assert_eq!((found[1].start, found[1].seconds), (1.25, 0.0));
        assert_eq!(found[1].counts.not_sent, 1);
    }

    #[test]
    fn the_lag_goal_says_each_quarters_share_above_0_and_longest_episode() {
        let (samples, mut raw) = run(0.0);
        for (i, s) in samples.iter().enumerate() {
            let lag = if i == 55 { 900.0 } else { 0.0 };
            raw.lag_ms[i] = vec![0.0, lag];
            raw.lag_reads.push(vec![
                read(s.seconds, 0.0, LagCause::Zero),
                read(s.seconds + 5.0, lag, LagCause::Unflushed),
            ]);
        }
        let results = judge(&samples, &raw, 100.0, &goals()).unwrap();
        let lag = results
            .iter()
            .find(|r| r.goal.starts_with("lag p99"))
            .unwrap();
        // One read of 900 ms in the last quarter's 26 reads is its p99:
        // the goal is judged as before, and the figure says why.
        assert!(!lag.met, "{lag:?}");
        assert!(
            lag.figure.contains(
                "first quarter 0.00%, last quarter 3.85% (longest episode 5.0 s, up to 900 ms)"
            ),
            "{}",
            lag.figure
        );
    }

    #[test]
    fn histogram_counts_above_a_bucket() {
        let text = "x_bucket{le=\"0.25\"} 7\n\
                    x_bucket{le=\"1\"} 9\n\
                    x_bucket{le=\"+Inf\"} 10\n\
                    x_sum 3.5\n\
                    x_count 10\n";
        assert_eq!(above_bucket(text, "x", "1"), Some(1.0));
        assert_eq!(above_bucket(text, "x", "0.25"), Some(3.0));
        assert_eq!(above_bucket(text, "x", "2"), None);
        assert_eq!(above_bucket(text, "y", "1"), None);
    }

    #[test]
    fn the_plot_is_an_svg() {
        let (samples, _) = run(0.5);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("soak.svg");
        plot(&path, &samples, 100.0).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
        assert!(svg.contains("remainder"));
        assert!(svg.len() < 300_000, "{} bytes", svg.len());
    }
}

//! The `vacancy` command: parse the command line, load settings, start logging,
//! and hand over to the library. Nothing else lives here.

use anyhow::Context;
use clap::{Parser, Subcommand};

/// Search allocates a few short-lived buffers per answer on every worker
/// thread; mimalloc's thread-local free lists serve those without the
/// contention and size-class walks of the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "vacancy",
    version,
    about = "A read copy of a booking site's room inventory for guest search"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure speed and memory, each beside its baseline (see BENCHMARKS.md).
    Bench {
        #[command(subcommand)]
        which: vacancy_lab::bench::BenchCommand,
    },
    /// Run everything on one machine: an embedded PostgreSQL owner, a generated
    /// dataset, the projector and the API, and guests booking against the owner.
    Demo {
        /// Attach to an existing owner database instead of starting one.
        #[arg(long)]
        owner_url: Option<String>,
        /// Folder with the PostgreSQL server binaries (initdb, pg_ctl, postgres).
        #[arg(long, env = "VACANCY_PG_BIN")]
        pg_bin: Option<std::path::PathBuf>,
        #[arg(long, default_value = "127.0.0.1:8080", env = "VACANCY_LISTEN")]
        listen: String,
        #[arg(long, default_value_t = 1000)]
        hotels: u32,
        #[arg(long, default_value_t = 8)]
        room_types: u32,
        #[arg(long, default_value_t = 365)]
        nights: u32,
        /// Concurrent simulated booking-service guests (half race for a few
        /// hot hotels, half browse many).
        #[arg(long, default_value_t = 16)]
        guests: usize,
        /// How long a hold lasts before the sweeper returns it (short, so
        /// expiries show within a minute).
        #[arg(long, default_value_t = 15)]
        hold_secs: u64,
        /// Stop on its own after this long (e.g. 30s, 5m); default: until Ctrl-C.
        #[arg(long, value_parser = parse_duration)]
        duration: Option<std::time::Duration>,
        /// How often to print the figures line (e.g. 5s).
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        report_every: std::time::Duration,
    },
    /// Run the projector and the API against the owner database in the settings.
    Serve {
        /// A settings file layered over config/default.toml (then VACANCY_* env wins).
        #[arg(long)]
        config: Option<std::path::PathBuf>,
    },
    /// Load a deterministic generated dataset into an owner database (through COPY).
    Seed {
        /// The owner database to load into.
        #[arg(long, env = "VACANCY_OWNER_URL")]
        owner_url: String,
        #[arg(long, default_value_t = 1000)]
        hotels: u32,
        #[arg(long, default_value_t = 8)]
        room_types: u32,
        #[arg(long, default_value_t = 365)]
        nights: u32,
        /// First night (YYYY-MM-DD); default today.
        #[arg(long)]
        start: Option<chrono::NaiveDate>,
        /// Random seed: the same seed loads the same data.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Bench { which } => {
            vacancy_lab::bench::run(which)
                .await
                .context("bench failed")?;
        }
        Command::Demo {
            owner_url,
            pg_bin,
            listen,
            hotels,
            room_types,
            nights,
            guests,
            hold_secs,
            duration,
            report_every,
        } => {
            vacancy_service::init_logging(&vacancy_service::Settings::defaults().log);
            let stop = tokio_util::sync::CancellationToken::new();
            let on_signal = stop.clone();
            tokio::spawn(async move {
                wait_for_signal().await;
                on_signal.cancel();
            });
            let options = vacancy_lab::demo::DemoOptions {
                owner_url,
                pg_bin,
                listen,
                hotels,
                room_types,
                nights,
                guests,
                hold_secs,
                duration,
                report_every: report_every.max(std::time::Duration::from_secs(1)),
            };
            vacancy_lab::demo::run(options, stop)
                .await
                .context("demo failed")?;
        }
        Command::Serve { config } => {
            let settings = vacancy_service::Settings::load(config.as_deref())?;
            vacancy_service::init_logging(&settings.log);
            let grace = std::time::Duration::from_millis(settings.http.shutdown_grace_ms);
            let app = vacancy_service::App::bind_and_start(settings)
                .await
                .context("cannot start")?;
            let token = app.shutdown_token();
            tokio::spawn(async move {
                wait_for_signal().await;
                tracing::info!("shutting down");
                token.cancel();
            });
            app.stopped().await;
            let panicked = app.panicked();
            // Exit 0 only when requests drained and the stream sent its last
            // acknowledgement within the grace, and no task panicked (read
            // after the stop: a task may panic during it).
            let stopped = app.stop_within(grace).await;
            if let Some(task) = panicked.name() {
                anyhow::bail!("stopped: the {task} task panicked (the log above says where)");
            }
            stopped.context("shutdown")?;
            tracing::info!("stopped");
        }
        Command::Seed {
            owner_url,
            hotels,
            room_types,
            nights,
            start,
            seed,
        } => {
            let options = vacancy_lab::seed::SeedOptions {
                owner_url,
                hotels,
                room_types,
                nights,
                start: start.unwrap_or_else(|| chrono::Utc::now().date_naive()),
                seed,
                progress: true,
            };
            let report = vacancy_lab::seed::run(&options)
                .await
                .context("seed failed")?;
            println!(
                "seeded {} hotels, {} room types, {} inventory rows in {:.1}s; database size {} MiB",
                report.hotels,
                report.room_types,
                report.inventory_rows,
                report.elapsed.as_secs_f64(),
                report.database_bytes / (1024 * 1024)
            );
        }
    }
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C.
async fn wait_for_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// `30s`, `5m`, `1h` or plain seconds.
fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let (number, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, "s"), |i| s.split_at(i));
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 30s or 5m"))?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => return Err(format!("{s:?}: the unit must be s, m or h")),
    };
    Ok(std::time::Duration::from_secs(secs))
}

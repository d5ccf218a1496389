//! `vacancy demo`, the built binary, end to end: an embedded owner, the
//! seed, the copy, the simulated booking site, the figures, and the final
//! row-for-row check; on its own after `--duration`, and on Ctrl-C.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Longer than any healthy run (seed, snapshot, 30 s of guests, the check).
const RUN_LIMIT: Duration = Duration::from_secs(600);

fn demo(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_vacancy"))
        .arg("demo")
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start vacancy demo")
}

/// `key=value` pairs of the line that starts with `prefix`.
fn fields(lines: &[String], prefix: &str) -> HashMap<String, String> {
    let line = lines
        .iter()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line in:\n{}", lines.join("\n")));
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn number(f: &HashMap<String, String>, key: &str) -> f64 {
    f.get(key)
        .unwrap_or_else(|| panic!("no {key} in {f:?}"))
        .parse()
        .unwrap_or_else(|_| panic!("{key} is not a number in {f:?}"))
}

/// Reads stdout to the end (bounded), echoing it, and the exit status.
async fn finish(mut child: Child, mut on_line: impl FnMut(&str, &Child)) -> (bool, Vec<String>) {
    let stdout = child.stdout.take().expect("stdout");
    let mut reader = BufReader::new(stdout).lines();
    let mut lines = Vec::new();
    let run = async {
        while let Some(line) = reader.next_line().await.expect("read stdout") {
            println!("demo| {line}");
            on_line(&line, &child);
            lines.push(line);
        }
        child.wait().await.expect("wait for demo")
    };
    let status = tokio::time::timeout(RUN_LIMIT, run)
        .await
        .unwrap_or_else(|_| panic!("the demo did not finish within {RUN_LIMIT:?}"));
    (status.success(), lines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_books_for_30s_then_the_copy_equals_the_owner() {
    let child = demo(&[
        "--duration",
        "30s",
        "--hotels",
        "200",
        "--report-every",
        "5s",
    ]);
    let (ok, lines) = finish(child, |_, _| {}).await;
    assert!(ok, "the demo exits 0:\n{}", lines.join("\n"));
    assert!(
        lines.iter().any(|l| l.contains("http://127.0.0.1:")),
        "it says where to open the page"
    );
    let figures: Vec<&String> = lines.iter().filter(|l| l.contains("searches/s")).collect();
    assert!(figures.len() >= 3, "a figures line every 5 s: {figures:?}");
    for name in ["takes/s", "stale reads", "owner reads/s", "lag"] {
        assert!(figures[0].contains(name), "{name} in {}", figures[0]);
    }

    let summary = fields(&lines, "summary:");
    assert!(number(&summary, "searches") > 0.0, "{summary:?}");
    assert!(number(&summary, "taken") > 0.0, "{summary:?}");
    assert!(
        number(&summary, "conflicts") > 0.0,
        "guests raced: {summary:?}"
    );
    assert_eq!(
        number(&summary, "takes"),
        number(&summary, "taken") + number(&summary, "conflicts")
    );
    assert!(
        number(&summary, "reports_recorded") >= number(&summary, "takes"),
        "every take was reported with the demo's booking token: {summary:?}"
    );
    assert_eq!(number(&summary, "reports_failed"), 0.0, "{summary:?}");
    assert!(number(&summary, "paid") > 0.0, "{summary:?}");
    assert!(number(&summary, "capacity_changes") > 0.0, "{summary:?}");

    let verify = fields(&lines, "verify:");
    assert_eq!(
        number(&verify, "rows"),
        200.0 * 8.0 * 365.0,
        "every seeded row compared"
    );
    assert_eq!(
        number(&verify, "differing"),
        0.0,
        "the copy equals the owner"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_stops_cleanly_on_ctrl_c() {
    let child = demo(&["--hotels", "40", "--nights", "60", "--report-every", "1s"]);
    let mut interrupted = false;
    let (ok, lines) = finish(child, |line, child| {
        if !interrupted && line.contains("searches/s") {
            let pid = child.id().expect("running").to_string();
            // SIGINT, as Ctrl-C in a terminal sends.
            let sent = std::process::Command::new("kill")
                .args(["-INT", &pid])
                .status()
                .expect("run kill");
            assert!(sent.success());
            interrupted = true;
        }
    })
    .await;
    assert!(
        interrupted,
        "the demo printed figures:\n{}",
        lines.join("\n")
    );
    assert!(ok, "Ctrl-C exits 0:\n{}", lines.join("\n"));
    let verify = fields(&lines, "verify:");
    assert_eq!(number(&verify, "rows"), 40.0 * 8.0 * 60.0);
    assert_eq!(number(&verify, "differing"), 0.0);
}

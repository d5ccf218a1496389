//! What operators see is what the service exports.
//!
//! The dashboards (`dashboards/*.json`) and the Prometheus rules
//! (`dashboards/rules.yml`) are checked against a real `/metrics` scrape of
//! `vacancy` running against a real owner after every path was exercised:
//! every metric name in any expression must be exported (recording-rule names,
//! `level:metric:operations`, must be recorded in `rules.yml` instead), and
//! every label a selector matches on must exist on it. The scrape must pass
//! `promtool check metrics`. Without a server: every panel has a unit, a
//! description and the `datasource` variable; every alert has a firing and a
//! not-firing promtool unit test.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use vacancy_service::Settings;
use vacancy_service::slot;

use crate::api::get;
use crate::support::{TestOwner, wait_for};

fn dashboards_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("dashboards")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

// --- the dashboards -----------------------------------------------------------

/// Every `dashboards/*.json`, by file name.
fn dashboards() -> Vec<(String, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dashboards_dir())
        .expect("dashboards/")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 2,
        "expected the stale-reads and service-health dashboards in dashboards/"
    );
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            let v: Value = serde_json::from_str(&read(&p))
                .unwrap_or_else(|e| panic!("{name} is not JSON: {e}"));
            (name, v)
        })
        .collect()
}

/// Every panel, including those nested in (collapsed) rows.
fn panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for p in list.as_array().into_iter().flatten() {
            out.push(p);
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// Missing, not a string, or only spaces.
fn blank(v: &Value) -> bool {
    v.as_str().is_none_or(|s| s.trim().is_empty())
}

fn is_datasource_variable(ds: &Value) -> bool {
    let uid = ds
        .get("uid")
        .and_then(Value::as_str)
        .or_else(|| ds.as_str());
    matches!(uid, Some("${datasource}" | "$datasource"))
}

/// (where, expression) for every PromQL expression of a dashboard: panel
/// targets and query variables (`label_values(<selector>, <label>)` gives
/// the selector).
fn dashboard_exprs(file: &str, dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in panels(dashboard) {
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = t["expr"].as_str() {
                out.push((
                    format!(
                        "{file}: panel {:?} ({})",
                        p["title"].as_str().unwrap_or_default(),
                        t["refId"].as_str().unwrap_or_default()
                    ),
                    expr.to_string(),
                ));
            }
        }
    }
    for v in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if v["type"] != "query" {
            continue;
        }
        let query = v["query"]["query"]
            .as_str()
            .or_else(|| v["query"].as_str())
            .unwrap_or_default()
            .trim();
        let expr = match query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
        {
            Some(args) => match args.rsplit_once(',') {
                Some((selector, _label)) => selector.to_string(),
                None => continue, // label_values(label): no metric
            },
            None => query.to_string(),
        };
        out.push((
            format!(
                "{file}: variable {}",
                v["name"].as_str().unwrap_or_default()
            ),
            expr,
        ));
    }
    out
}

// --- the rules ----------------------------------------------------------------

#[derive(Default)]
struct Rules {
    records: BTreeSet<String>,
    alerts: Vec<String>,
    /// (where, expression)
    exprs: Vec<(String, String)>,
}

fn unquote(s: &str) -> String {
    let s = s.trim();
    for q in ['"', '\''] {
        if let Some(inner) = s.strip_prefix(q).and_then(|s| s.strip_suffix(q)) {
            return inner.to_string();
        }
    }
    s.to_string()
}

/// `rules.yml` by line scanning (no YAML parser among the dependencies):
/// `record:`, `alert:` and `expr:` values, plain or as `|`/`>` block scalars.
fn rules() -> Rules {
    let text = read(&dashboards_dir().join("rules.yml"));
    let lines: Vec<&str> = text.lines().collect();
    let mut rules = Rules::default();
    let mut current = String::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        i += 1;
        let indent = line.len() - line.trim_start().len();
        let t = line.trim_start();
        if t.starts_with('#') {
            continue;
        }
        let t = t.strip_prefix("- ").unwrap_or(t);
        if let Some(name) = t.strip_prefix("record:") {
            current = unquote(name);
            rules.records.insert(current.clone());
        } else if let Some(name) = t.strip_prefix("alert:") {
            current = unquote(name);
            rules.alerts.push(current.clone());
        } else if let Some(expr) = t.strip_prefix("expr:") {
            let expr = expr.trim();
            let expr = if expr.starts_with('|') || expr.starts_with('>') {
                let mut block = Vec::new();
                while i < lines.len() {
                    let l = lines[i];
                    let l_indent = l.len() - l.trim_start().len();
                    if !l.trim().is_empty() && l_indent <= indent {
                        break;
                    }
                    block.push(l.trim());
                    i += 1;
                }
                block.join("\n")
            } else {
                unquote(expr)
            };
            assert!(
                !expr.trim().is_empty(),
                "rules.yml: {current} has an empty expr"
            );
            rules
                .exprs
                .push((format!("rules.yml: {current}"), expr.trim().to_string()));
        }
    }
    rules
}

// --- PromQL, just enough to find the selectors ----------------------------------

#[derive(Debug, Clone, PartialEq)]
struct Matcher {
    label: String,
    op: String,
    value: String,
}

#[derive(Debug, Clone, PartialEq)]
struct Selector {
    name: String,
    matchers: Vec<Matcher>,
}

/// Words that are PromQL syntax rather than metric names.
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
];
/// Aggregation operators: `sum by (le) (...)` puts the grouping between the
/// operator and its parenthesis.
const AGGREGATIONS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];
/// Followed by a parenthesised list of label names, not an expression.
const GROUPING: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// The index just past the string literal starting at `i`.
fn skip_string(b: &[char], mut i: usize) -> usize {
    let quote = b[i];
    i += 1;
    while i < b.len() {
        match b[i] {
            '\\' if quote != '`' => i += 2,
            c if c == quote => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// The index just past the bracket that closes the one at `i`.
fn skip_group(b: &[char], mut i: usize) -> usize {
    let (open, close) = match b[i] {
        '(' => ('(', ')'),
        '[' => ('[', ']'),
        _ => ('{', '}'),
    };
    let mut depth = 0;
    while i < b.len() {
        match b[i] {
            '"' | '\'' | '`' => {
                i = skip_string(b, i);
                continue;
            }
            c if c == open => depth += 1,
            c if c == close => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    i
}

/// The label matchers of `{...}` starting at `i`, and the index past `}`.
fn label_matchers(b: &[char], mut i: usize) -> (Vec<Matcher>, usize) {
    let end = skip_group(b, i);
    let mut out = Vec::new();
    i += 1;
    while i < end - 1 {
        let c = b[i];
        if !is_ident_start(c) {
            i += 1;
            continue;
        }
        let start = i;
        while i < end && is_ident(b[i]) {
            i += 1;
        }
        let label: String = b[start..i].iter().collect();
        while i < end && b[i].is_whitespace() {
            i += 1;
        }
        let op_start = i;
        while i < end && matches!(b[i], '=' | '!' | '~') {
            i += 1;
        }
        let op: String = b[op_start..i].iter().collect();
        while i < end && b[i].is_whitespace() {
            i += 1;
        }
        let mut value = String::new();
        if i < end && matches!(b[i], '"' | '\'' | '`') {
            let stop = skip_string(b, i);
            value = b[i + 1..stop - 1].iter().collect();
            i = stop;
        }
        out.push(Matcher { label, op, value });
    }
    (out, end)
}

/// Every vector selector of a PromQL expression (Grafana's `$variables` and
/// `${variables}` outside label values are skipped).
fn selectors(expr: &str) -> Vec<Selector> {
    let b: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if matches!(c, '"' | '\'' | '`') {
            i = skip_string(&b, i);
        } else if c == '[' {
            i = skip_group(&b, i);
        } else if c == '{' {
            // `{__name__="..."}`: a selector without a leading name.
            let (matchers, end) = label_matchers(&b, i);
            if let Some(m) = matchers
                .iter()
                .find(|m| m.label == "__name__" && m.op == "=")
            {
                out.push(Selector {
                    name: m.value.clone(),
                    matchers: matchers.clone(),
                });
            }
            i = end;
        } else if c == '$' {
            i += 1;
            if i < b.len() && b[i] == '{' {
                i = skip_group(&b, i);
            } else {
                while i < b.len() && is_ident(b[i]) {
                    i += 1;
                }
            }
        } else if c.is_ascii_digit() || (c == '.' && b.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            // Numbers and durations: 0.99, 1e3, 5m, 0x1F.
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '.') {
                i += 1;
            }
        } else if is_ident_start(c) {
            let start = i;
            while i < b.len() && is_ident(b[i]) {
                i += 1;
            }
            let word: String = b[start..i].iter().collect();
            let mut j = i;
            while j < b.len() && b[j].is_whitespace() {
                j += 1;
            }
            if b.get(j) == Some(&'(') {
                if GROUPING.contains(&word.as_str()) {
                    i = skip_group(&b, j); // a list of labels
                }
                continue; // otherwise a function or aggregation: its arguments follow
            }
            if KEYWORDS.contains(&word.to_ascii_lowercase().as_str())
                || AGGREGATIONS.contains(&word.as_str())
            {
                continue;
            }
            let matchers = if b.get(j) == Some(&'{') {
                let (m, end) = label_matchers(&b, j);
                i = end;
                m
            } else {
                Vec::new()
            };
            out.push(Selector {
                name: word,
                matchers,
            });
        } else {
            i += 1;
        }
    }
    out
}

#[test]
fn observability_promql_selectors_are_found() {
    let got = selectors(
        r#"histogram_quantile(0.99, sum by (le, route) (rate(vacancy_x_bucket{job=~"$job", route!="/a{b}"}[$__rate_interval])))
           / on (job) group_left sum without (instance) (increase(vacancy_y_total[5m] offset 1h)) > bool 1e3
           or label_replace(vector(0.001), "dst", "$1", "src", "(.*)") and {__name__="vacancy_z"} unless vacancy:r:rate5m"#,
    );
    let names: Vec<&str> = got.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "vacancy_x_bucket",
            "vacancy_y_total",
            "vacancy_z",
            "vacancy:r:rate5m"
        ]
    );
    assert_eq!(
        got[0].matchers,
        [
            Matcher {
                label: "job".into(),
                op: "=~".into(),
                value: "$job".into()
            },
            Matcher {
                label: "route".into(),
                op: "!=".into(),
                value: "/a{b}".into()
            },
        ]
    );
}

// --- the scrape ---------------------------------------------------------------

/// Sample name → the label sets of its samples.
type Samples = BTreeMap<String, Vec<BTreeMap<String, String>>>;

fn parse_scrape(text: &str) -> Samples {
    let mut out = Samples::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let b: Vec<char> = line.chars().collect();
        let end = b
            .iter()
            .position(|&c| c == '{' || c == ' ')
            .unwrap_or(b.len());
        let name: String = b[..end].iter().collect();
        let mut labels = BTreeMap::new();
        if b.get(end) == Some(&'{') {
            let (matchers, _) = label_matchers(&b, end);
            for m in matchers {
                labels.insert(m.label, m.value);
            }
        }
        out.entry(name).or_default().push(labels);
    }
    out
}

/// Series Prometheus makes itself, not the service.
const PROMETHEUS_SERIES: &[&str] = &[
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
    "ALERTS",
    "ALERTS_FOR_STATE",
];
/// Target labels Prometheus adds to every scraped series.
const TARGET_LABELS: &[&str] = &["job", "instance"];

/// Every problem with the selectors of `exprs` against the scrape.
fn check_against_scrape(
    exprs: &[(String, String)],
    samples: &Samples,
    records: &BTreeSet<String>,
) -> Vec<String> {
    let mut problems = Vec::new();
    for (place, expr) in exprs {
        let found = selectors(expr);
        if found.is_empty() && !expr.contains("vector(") {
            problems.push(format!("{place}: no metric in {expr:?}"));
        }
        for s in found {
            if s.name.contains(':') {
                if !records.contains(&s.name) {
                    problems.push(format!(
                        "{place}: recording rule {} is not recorded in dashboards/rules.yml",
                        s.name
                    ));
                }
                continue;
            }
            if PROMETHEUS_SERIES.contains(&s.name.as_str()) {
                continue;
            }
            let Some(series) = samples.get(&s.name) else {
                let histogram = ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|x| samples.contains_key(&format!("{}{x}", s.name)));
                problems.push(if histogram {
                    format!(
                        "{place}: {} is a histogram; use {0}_bucket, _sum or _count",
                        s.name
                    )
                } else {
                    format!("{place}: metric {} is missing from /metrics", s.name)
                });
                continue;
            };
            for m in &s.matchers {
                if m.label == "__name__" || TARGET_LABELS.contains(&m.label.as_str()) {
                    continue;
                }
                if !series.iter().any(|l| l.contains_key(&m.label)) {
                    problems.push(format!(
                        "{place}: {} has no label {:?} in /metrics",
                        s.name, m.label
                    ));
                } else if m.op == "="
                    && !m.value.contains('$')
                    && !series.iter().any(|l| l.get(&m.label) == Some(&m.value))
                {
                    problems.push(format!(
                        "{place}: no series {}{{{}={:?}}} in /metrics",
                        s.name, m.label, m.value
                    ));
                }
            }
        }
    }
    problems.dedup();
    problems
}

fn promtool() -> Option<PathBuf> {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|d| d.join("promtool"))
        .chain([PathBuf::from("/usr/bin/promtool")])
        .find(|p| p.is_file())
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// `promtool check metrics` on the scrape (a lint of names, types and help).
fn promtool_check_metrics(scrape: &str) {
    use std::io::Write;
    let Some(promtool) = promtool() else {
        assert!(
            !in_ci(),
            "promtool is missing (Debian package prometheus; .ci/run installs it)"
        );
        eprintln!("note: promtool not found; skipping `promtool check metrics` (CI runs it)");
        return;
    };
    let mut child = std::process::Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run promtool");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(scrape.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

// --- without a server -------------------------------------------------------

#[test]
fn observability_dashboards_provision_from_files() {
    let mut problems = Vec::new();
    let mut uids = BTreeSet::new();
    for (file, d) in dashboards() {
        if d.get("__inputs").is_some() {
            problems.push(format!(
                "{file}: has __inputs (export for sharing externally is off)"
            ));
        }
        if blank(&d["uid"]) || !uids.insert(d["uid"].to_string()) {
            problems.push(format!("{file}: needs a unique uid"));
        }
        let vars = d["templating"]["list"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if !vars.iter().any(|v| {
            v["name"] == "datasource" && v["type"] == "datasource" && v["query"] == "prometheus"
        }) {
            problems.push(format!(
                "{file}: no `datasource` template variable of type datasource (prometheus)"
            ));
        }
        for v in vars.iter().filter(|v| v["type"] == "query") {
            if !is_datasource_variable(&v["datasource"]) {
                problems.push(format!(
                    "{file}: variable {} does not use ${{datasource}}",
                    v["name"]
                ));
            }
        }
        for p in panels(&d) {
            let title = format!("{:?}", p["title"].as_str().unwrap_or_default());
            if p["type"] == "row" {
                if p["targets"].as_array().is_some_and(|t| !t.is_empty()) {
                    problems.push(format!("{file}: row {title} has queries"));
                }
                continue;
            }
            if blank(&p["description"]) {
                problems.push(format!("{file}: panel {title} has no description"));
            }
            if blank(&p["fieldConfig"]["defaults"]["unit"]) {
                problems.push(format!(
                    "{file}: panel {title} has no unit (fieldConfig.defaults.unit)"
                ));
            }
            if !is_datasource_variable(&p["datasource"]) {
                problems.push(format!(
                    "{file}: panel {title} does not use the datasource variable"
                ));
            }
            let targets = p["targets"].as_array().cloned().unwrap_or_default();
            if targets.is_empty() {
                problems.push(format!("{file}: panel {title} has no query"));
            }
            for t in &targets {
                if t.get("datasource").is_some() && !is_datasource_variable(&t["datasource"]) {
                    problems.push(format!(
                        "{file}: panel {title} query {} does not use the datasource variable",
                        t["refId"]
                    ));
                }
                let expr = t["expr"].as_str().unwrap_or_default();
                if expr.trim().is_empty() {
                    problems.push(format!(
                        "{file}: panel {title} query {} has no expr",
                        t["refId"]
                    ));
                }
                // Every range in a dashboard follows the scrape interval.
                let mut rest = expr;
                while let Some(start) = rest.find('[') {
                    let tail = &rest[start..];
                    let end = tail.find(']').map_or(tail.len(), |e| e + 1);
                    if &tail[..end] != "[$__rate_interval]" {
                        problems.push(format!(
                            "{file}: panel {title} uses {} instead of [$__rate_interval]",
                            &tail[..end]
                        ));
                    }
                    rest = &tail[end..];
                }
            }
        }
    }
    let provisioning = dashboards_dir().join("grafana/provisioning");
    let providers = read(&provisioning.join("dashboards.yml"));
    if !providers.contains("type: file") {
        problems.push("grafana/provisioning/dashboards.yml: no file provider".into());
    }
    let sources = read(&provisioning.join("datasources.yml"));
    if !sources.contains("type: prometheus") {
        problems.push("grafana/provisioning/datasources.yml: no prometheus data source".into());
    }
    assert!(problems.is_empty(), "dashboards:\n{}", problems.join("\n"));
}

#[test]
fn observability_every_alert_has_a_firing_and_a_quiet_unit_test() {
    let rules = rules();
    assert!(!rules.alerts.is_empty(), "no alert in dashboards/rules.yml");
    let tests = read(&dashboards_dir().join("rules.test.yml"));
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    let mut firing = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = line.strip_prefix("alertname:") else {
            continue;
        };
        let next = lines[i + 1..]
            .iter()
            .find(|l| !l.is_empty() && !l.starts_with('#'))
            .copied()
            .unwrap_or_default();
        if next == "exp_alerts: []" {
            quiet.insert(unquote(name));
        } else if next == "exp_alerts:" {
            firing.insert(unquote(name));
        }
    }
    let mut problems = Vec::new();
    for alert in &rules.alerts {
        if !firing.contains(alert) {
            problems.push(format!("{alert}: no unit test where it fires"));
        }
        if !quiet.contains(alert) {
            problems.push(format!("{alert}: no unit test where it stays quiet"));
        }
    }
    for name in firing.union(&quiet) {
        if !rules.alerts.contains(name) {
            problems.push(format!(
                "rules.test.yml tests {name}, which rules.yml lacks"
            ));
        }
    }
    // The recording rules a rule uses are recorded.
    for (place, expr) in &rules.exprs {
        for s in selectors(expr) {
            if s.name.contains(':') && !rules.records.contains(&s.name) {
                problems.push(format!("{place}: {} is not recorded", s.name));
            }
        }
    }
    assert!(problems.is_empty(), "rules:\n{}", problems.join("\n"));
}

// --- against the running service ------------------------------------------

/// One request with a body, through the lab's HTTP client: status and body.
async fn send(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let r = vacancy_lab::http_client::request_once(
        addr,
        method,
        path,
        headers,
        Some(body.as_bytes()),
        Duration::from_secs(10),
    )
    .await
    .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    (r.status, r.text())
}

/// The value of an unlabelled sample in a scrape.
fn sample(scrape: &str, name: &str) -> Option<f64> {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

const BOOKING_TOKEN: &str = "observability-booking-token";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observability_every_metric_in_dashboards_and_rules_is_exported() {
    let owner = TestOwner::start().await;
    let client = owner.client().await;
    let today = chrono::Utc::now().date_naive();
    let day = |n: u64| today + chrono::Days::new(n);
    // Hotel 1 has few units (its search reads the owner); hotel 2 has many.
    client
        .batch_execute(&format!(
            "INSERT INTO hotels (id, name, city) VALUES (1, 'One', 'Lisbon'), (2, 'Two', 'Porto');
             INSERT INTO room_types VALUES (1, 1, 'Double', 2), (2, 1, 'Double', 2);
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               SELECT 1, 1, DATE '{today}' + n, 2, 10000 FROM generate_series(0, 9) n;
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               SELECT 2, 1, DATE '{today}' + n, 20, 8000 FROM generate_series(0, 9) n;"
        ))
        .await
        .unwrap();

    let mut settings = Settings::defaults();
    settings.owner.url = owner.url.clone();
    settings.stream.reconnect_min_ms = 50;
    settings.stream.reconnect_max_ms = 500;
    settings.stream.slot_watch_interval_ms = 200;
    settings.model.ttl_secs = 1; // so the TTL safety net re-reads during the test
    settings.search.min_lsn_wait_ms = 100;
    settings.search.fresh_reads = vacancy_service::FreshReads::Confirmed;
    settings.stale.booking_tokens = vec![BOOKING_TOKEN.to_string()];
    settings.stale.audit_interval_ms = 200; // so the divergence audit runs during the test
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = vacancy_service::start(settings, listener).expect("start vacancy");
    let addr = app.addr;
    wait_for("readyz to answer 200", Duration::from_secs(60), || async {
        (get(addr, "/readyz").await.0 == 200).then_some(())
    })
    .await;

    // Changes through the stream after the snapshot: every operation.
    client
        .batch_execute(&format!(
            "INSERT INTO hotels (id, name, city) VALUES (3, 'Three', 'Faro');
             INSERT INTO room_types VALUES (3, 1, 'Single', 1);
             INSERT INTO inventory (hotel_id, room_type_id, night, total, price_cents)
               VALUES (3, 1, DATE '{}', 1, 5000);
             UPDATE inventory SET taken = 1 WHERE hotel_id = 2 AND night = DATE '{}';
             DELETE FROM inventory WHERE hotel_id = 3;",
            day(1),
            day(2)
        ))
        .await
        .unwrap();
    let target = slot::current_wal_lsn(&client).await.unwrap();
    wait_for(
        "the copy and the index to catch up",
        Duration::from_secs(60),
        || async {
            (app.model.freshness.applied() >= target && app.hotel_index.synced_lsn() >= target)
                .then_some(())
        },
    )
    .await;

    // Every route, with good and bad requests.
    let stay = format!("check_in={}&check_out={}", day(1), day(3));
    for (path, code) in [
        ("/healthz".to_string(), 200),
        ("/readyz".to_string(), 200),
        ("/openapi.json".to_string(), 200),
        ("/v1/status".to_string(), 200),
        (
            format!("/v1/hotels/1/calendar?from={}&to={}", day(0), day(5)),
            200,
        ),
        ("/v1/hotels/1/calendar?from=tomorrow".to_string(), 400),
        (
            format!("/v1/hotels/99/calendar?from={}&to={}", day(0), day(5)),
            404,
        ),
        (
            // Past the owner's position: no write gave it.
            format!("/v1/search?city=porto&{stay}&room=2&min_lsn=FFFFFFFF/0"),
            400,
        ),
        ("/v1/search?city=porto&check_in=soon".to_string(), 400),
        (format!("/v1/hotels/2/availability?{stay}&room=2"), 200),
        (format!("/v1/hotels/2/availability?{stay}&room=0"), 400),
        (
            format!("/v1/bypass?hotel_id=1&room_type_id=1&{stay}&rooms=1"),
            200,
        ),
        (
            format!("/v1/bypass?hotel_id=2&room_type_id=1&{stay}&rooms=1"),
            200,
        ),
        ("/v1/bypass?hotel_id=x".to_string(), 400),
        ("/v1/stale-reads".to_string(), 200),
        ("/nowhere".to_string(), 404),
    ] {
        let (got, _, body) = get(addr, &path).await;
        assert_eq!(got, code, "{path}: {body}");
    }
    // Few units: the answer is confirmed against the owner's position.
    let (code, _, body) = get(addr, &format!("/v1/search?city=lisbon&{stay}&room=2")).await;
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["results"][0]["room_types"][0]["source"], "confirmed",
        "{body}"
    );
    assert!(v["confirmed_lsn"].is_string(), "{body}");
    // Many units: the copy's numbers, and a quote to report a take with.
    let (code, _, body) = get(addr, &format!("/v1/search?city=porto&{stay}&room=2")).await;
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let shown = &v["results"][0]["room_types"][0];
    assert_eq!(shown["source"], "copy", "{body}");
    let quote = shown["quote"]
        .as_str()
        .expect("a quote on a shown room type");

    // Take outcomes from the booking service: refused without its token,
    // recorded with it (a conflict after the copy showed the room free).
    let report = |attempt: &str, quote: Option<&str>, outcome: &str| {
        let mut r = serde_json::json!({
            "attempt_id": attempt,
            "hotel_id": 2,
            "room_type_id": 1,
            "check_in": day(1).to_string(),
            "check_out": day(3).to_string(),
            "rooms": 1,
            "outcome": outcome,
        });
        if let Some(q) = quote {
            r["quote"] = Value::from(q);
        }
        r.to_string()
    };
    let json = ("Content-Type", "application/json");
    let bearer = format!("Bearer {BOOKING_TOKEN}");
    let auth = ("Authorization", bearer.as_str());
    let (code, body) = send(
        addr,
        "POST",
        "/v1/take-outcomes",
        &[json],
        &report("observability-0", None, "taken"),
    )
    .await;
    assert_eq!(code, 401, "POST /v1/take-outcomes without a token: {body}");
    for (attempt, quote, outcome) in [
        ("observability-1", Some(quote), "conflict"),
        ("observability-2", Some(quote), "taken"),
        ("observability-3", None, "error"),
    ] {
        let (code, body) = send(
            addr,
            "POST",
            "/v1/take-outcomes",
            &[json, auth],
            &report(attempt, quote, outcome),
        )
        .await;
        assert_eq!(code, 200, "POST /v1/take-outcomes {attempt}: {body}");
    }
    let (code, body) = send(
        addr,
        "POST",
        "/v1/take-outcomes",
        &[json, auth],
        "{not json",
    )
    .await;
    assert_eq!(
        code, 400,
        "POST /v1/take-outcomes with a broken body: {body}"
    );

    let (_, _, scrape) = get(addr, "/metrics").await;
    assert!(
        scrape
            .lines()
            .any(|l| l == "vacancy_conflicts_after_shown_available_total{source=\"copy\"} 1"),
        "the conflict after the copy showed the room free is counted once"
    );

    // The TTL safety net re-reads calendars nobody confirmed within 1 s.
    wait_for("a TTL re-read", Duration::from_secs(30), || async {
        let (_, _, scrape) = get(addr, "/metrics").await;
        (sample(&scrape, "vacancy_ttl_rows_reread_total")? > 0.0).then_some(())
    })
    .await;
    // The divergence audit has compared rows.
    wait_for(
        "a divergence audit pass",
        Duration::from_secs(30),
        || async {
            let (_, _, scrape) = get(addr, "/metrics").await;
            (sample(&scrape, "vacancy_divergence_checked_total")? > 0.0).then_some(())
        },
    )
    .await;
    // The slot watch has reported.
    wait_for("the slot watch", Duration::from_secs(10), || async {
        let (_, _, scrape) = get(addr, "/metrics").await;
        (sample(&scrape, "vacancy_slot_active")? == 1.0).then_some(())
    })
    .await;

    let (code, _, scrape) = get(addr, "/metrics").await;
    assert_eq!(code, 200);
    let samples = parse_scrape(&scrape);
    let rules = rules();
    let mut exprs = rules.exprs.clone();
    for (file, d) in dashboards() {
        exprs.extend(dashboard_exprs(&file, &d));
    }
    assert!(
        exprs.len() > 40,
        "too few expressions found: {}",
        exprs.len()
    );
    let problems = check_against_scrape(&exprs, &samples, &rules.records);
    assert!(
        problems.is_empty(),
        "dashboards and rules use what /metrics does not export:\n{}",
        problems.join("\n")
    );
    promtool_check_metrics(&scrape);
    app.stop(Duration::from_secs(5)).await;
}

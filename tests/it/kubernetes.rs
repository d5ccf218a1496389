//! The Kubernetes deploy (`deploy/kubernetes`), checked without a cluster:
//! it renders with `kubectl kustomize`; every `VACANCY_*` variable it sets
//! loads through the service's own settings loader; every probe and scrape
//! path is a route of the real router (asked over HTTP); and the fleet has
//! its shape: no service links, scrape annotations, two projectors under a
//! disruption budget, an autoscaler on the replicas, secrets as files.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use vacancy_service::{App, FleetRole, Settings};

/// The workloads that run `vacancy`: their pod templates carry this label.
const VACANCY_LABEL: (&str, &str) = ("app.kubernetes.io/name", "vacancy");

/// The rendered documents, rendered once for every test here.
fn rendered() -> &'static [Value] {
    static DOCS: OnceLock<Vec<Value>> = OnceLock::new();
    DOCS.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes");
        let output = Command::new("kubectl")
            .arg("kustomize")
            .arg(&dir)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run kubectl ({e}): this test needs it to render deploy/kubernetes; \
                     .ci/run installs it (Debian: apt-get install kubernetes-client)"
                )
            });
        assert!(
            output.status.success(),
            "kubectl kustomize {} failed:\n{}",
            dir.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        let text = String::from_utf8(output.stdout).expect("kubectl prints UTF-8");
        let docs: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&text)
            .map(|doc| Value::deserialize(doc).expect("kubectl kustomize prints YAML"))
            .filter(|doc| !doc.is_null())
            .collect();
        assert!(!docs.is_empty(), "kubectl kustomize rendered nothing");
        docs
    })
}

fn kind(doc: &Value) -> &str {
    doc["kind"].as_str().unwrap_or_default()
}

fn name(doc: &Value) -> &str {
    doc["metadata"]["name"].as_str().unwrap_or_default()
}

fn of_kind<'a>(docs: &'a [Value], wanted: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    docs.iter().filter(move |doc| kind(doc) == wanted)
}

fn find<'a>(docs: &'a [Value], wanted: &str, wanted_name: &str) -> &'a Value {
    docs.iter()
        .find(|doc| kind(doc) == wanted && name(doc) == wanted_name)
        .unwrap_or_else(|| panic!("no {wanted} {wanted_name} in deploy/kubernetes"))
}

fn list(value: &Value) -> &[Value] {
    value.as_array().map(Vec::as_slice).unwrap_or_default()
}

/// Every workload that has a pod template, as (kind/name, the template).
fn pod_templates(docs: &[Value]) -> Vec<(String, &Value)> {
    docs.iter()
        .filter_map(|doc| {
            let template = match kind(doc) {
                "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
                    &doc["spec"]["template"]
                }
                "CronJob" => &doc["spec"]["jobTemplate"]["spec"]["template"],
                "Pod" => doc,
                _ => return None,
            };
            Some((format!("{}/{}", kind(doc), name(doc)), template))
        })
        .collect()
}

fn is_vacancy(template: &Value) -> bool {
    template["metadata"]["labels"][VACANCY_LABEL.0] == VACANCY_LABEL.1
}

/// Whether a `selector` (a Service's plain map, or `matchLabels`) selects
/// pods with these labels.
fn selects(selector: &Value, labels: &Value) -> bool {
    let wanted = selector.get("matchLabels").unwrap_or(selector);
    assert!(
        selector.get("matchExpressions").is_none(),
        "this test reads matchLabels only: {selector}"
    );
    let wanted = wanted.as_object().expect("a selector is a map of labels");
    !wanted.is_empty() && wanted.iter().all(|(k, v)| &labels[k] == v)
}

/// A container's environment as the kubelet would set it: `envFrom`
/// ConfigMaps (with their prefix), then `env`, which wins.
fn environment(docs: &[Value], workload: &str, container: &Value) -> BTreeMap<String, String> {
    let mut vars = BTreeMap::new();
    for source in list(&container["envFrom"]) {
        let Some(map) = source["configMapRef"]["name"].as_str() else {
            panic!("{workload}: this test resolves envFrom configMapRef only, not {source}");
        };
        let prefix = source["prefix"].as_str().unwrap_or_default();
        let data = find(docs, "ConfigMap", map)["data"]
            .as_object()
            .cloned()
            .unwrap_or_default();
        for (key, value) in data {
            let value = value
                .as_str()
                .expect("ConfigMap data are strings")
                .to_string();
            vars.insert(format!("{prefix}{key}"), value);
        }
    }
    for var in list(&container["env"]) {
        let key = var["name"].as_str().expect("env name").to_string();
        match var["value"].as_str() {
            Some(value) => {
                vars.insert(key, value.to_string());
            }
            None => assert!(
                !key.starts_with("VACANCY_"),
                "{workload}: {key} uses valueFrom, which this test cannot check; name a file instead"
            ),
        }
    }
    vars
}

/// Loads the container's `VACANCY_*` variables through the service's
/// settings loader; fails naming the workload and the refused setting.
fn settings_of(workload: &str, vars: &BTreeMap<String, String>) -> Settings {
    let vacancy = vars
        .iter()
        .filter(|(k, _)| k.to_ascii_uppercase().starts_with("VACANCY_"))
        .map(|(k, v)| (k.as_str(), v.as_str()));
    Settings::load_with_vars(None, vacancy).unwrap_or_else(|e| {
        panic!("{workload}: its VACANCY_* variables are not valid settings: {e}")
    })
}

/// The only container of a vacancy pod.
fn vacancy_container<'a>(workload: &str, template: &'a Value) -> &'a Value {
    let containers = list(&template["spec"]["containers"]);
    assert_eq!(containers.len(), 1, "{workload}: one container");
    &containers[0]
}

/// A port given by name or number, as a number.
fn port_number(container: &Value, port: &Value) -> u64 {
    if let Some(n) = port.as_u64() {
        return n;
    }
    let wanted = port.as_str().expect("a port is a number or a name");
    list(&container["ports"])
        .iter()
        .find(|p| p["name"] == wanted)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port named {wanted}"))
}

#[test]
fn every_vacancy_variable_is_a_real_setting() {
    let docs = rendered();
    let mut roles = Vec::new();
    for (workload, template) in pod_templates(docs) {
        for container in list(&template["spec"]["containers"]) {
            let vars = environment(docs, &workload, container);
            let has_settings = vars.keys().any(|k| k.starts_with("VACANCY_"));
            assert_eq!(
                has_settings,
                is_vacancy(template),
                "{workload}: VACANCY_* variables belong to, and only to, the pods labelled {VACANCY_LABEL:?}"
            );
            if !has_settings {
                continue;
            }
            let settings = settings_of(&workload, &vars);
            roles.push((workload.clone(), settings.fleet.role));
            let spec = &template["spec"];

            // Listening where the container port, the probes and the scrape
            // annotation point.
            let listen: std::net::SocketAddr = settings.http.listen.parse().expect("validated");
            assert!(
                listen.ip().is_unspecified(),
                "{workload}: http.listen {listen} must take connections from outside the pod"
            );
            let ports: Vec<u64> = list(&container["ports"])
                .iter()
                .filter_map(|p| p["containerPort"].as_u64())
                .collect();
            assert_eq!(
                ports,
                [u64::from(listen.port())],
                "{workload}: container port"
            );
            for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
                let get = &container[probe]["httpGet"];
                if !get.is_null() {
                    assert_eq!(
                        port_number(container, &get["port"]),
                        u64::from(listen.port()),
                        "{workload}: {probe} port"
                    );
                }
            }
            assert_eq!(
                template["metadata"]["annotations"]["prometheus.io/port"],
                listen.port().to_string(),
                "{workload}: prometheus.io/port"
            );

            // Time to stop as the process means to: the kubelet's grace
            // outlasts the process's own bound (final checkpoint included).
            let grace_secs = spec["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
            assert!(
                grace_secs * 1000 > settings.http.shutdown_grace_ms,
                "{workload}: terminationGracePeriodSeconds {grace_secs} must exceed http.shutdown_grace_ms {}",
                settings.http.shutdown_grace_ms
            );

            // Secrets only as files, each inside a mounted Secret and a key of it.
            assert!(
                settings.owner.password.is_empty()
                    && settings.stale.quote_key.is_empty()
                    && settings.stale.booking_tokens.is_empty()
                    && settings.admin.tokens.is_empty(),
                "{workload}: secrets are given as files (the _file settings), not as values"
            );
            let secret_files = [
                ("owner.password_file", &settings.owner.password_file),
                ("stale.quote_key_file", &settings.stale.quote_key_file),
                (
                    "stale.booking_tokens_file",
                    &settings.stale.booking_tokens_file,
                ),
                ("admin.tokens_file", &settings.admin.tokens_file),
            ];
            for (setting, path) in secret_files {
                if setting == "admin.tokens_file" && path.is_empty() {
                    continue;
                }
                assert!(!path.is_empty(), "{workload}: {setting} must be set");
                let secret =
                    mounted_secret(&workload, spec, container, path).unwrap_or_else(|| {
                        panic!("{workload}: {setting} = {path} is not inside a mounted Secret")
                    });
                let (secret_name, key) = secret;
                let object = find(docs, "Secret", &secret_name);
                assert!(
                    !object["stringData"][&key].is_null() || !object["data"][&key].is_null(),
                    "{workload}: {setting} = {path}: Secret {secret_name} has no key {key}"
                );
            }

            if settings.fleet.role == FleetRole::Projector {
                // Its own checkpoint directory: a volume of the pod's own
                // (emptyDir) or of its own claim (volumeClaimTemplates).
                let dir = settings
                    .checkpoint
                    .dir()
                    .expect("validated: a projector has checkpoint.dir");
                let (volume, _) = mount_of(container, &dir.to_string_lossy())
                    .unwrap_or_else(|| panic!("{workload}: checkpoint.dir is not on a volume"));
                let own = list(&spec["volumes"])
                    .iter()
                    .any(|v| v["name"] == volume.as_str() && v.get("emptyDir").is_some());
                let claimed =
                    list(&template_owner(docs, &workload)["spec"]["volumeClaimTemplates"])
                        .iter()
                        .any(|c| c["metadata"]["name"] == volume.as_str());
                assert!(
                    own || claimed,
                    "{workload}: checkpoint.dir must be on an emptyDir or a volumeClaimTemplate (one per pod), not on {volume}"
                );
            }
        }
    }
    roles.sort_by_key(|(workload, _)| workload.clone());
    assert_eq!(
        roles,
        [
            ("Deployment/vacancy-replica".to_string(), FleetRole::Replica),
            (
                "StatefulSet/vacancy-projector".to_string(),
                FleetRole::Projector
            ),
        ],
        "the fleet's workloads and their fleet.role"
    );

    // Why enableServiceLinks is off (checked in `the_fleet_has_its_shape`):
    // with it on, every Service named vacancy* would give each pod a
    // variable such as VACANCY_SERVICE_HOST, and the loader refuses those.
    for service in of_kind(docs, "Service") {
        let injected = format!(
            "{}_SERVICE_HOST",
            name(service).to_ascii_uppercase().replace('-', "_")
        );
        if injected.starts_with("VACANCY_") {
            let refused = Settings::load_with_vars(None, [(injected.as_str(), "10.0.0.1")]);
            assert!(
                refused.is_err(),
                "{injected} would load; then enableServiceLinks need not be false"
            );
        }
    }
}

/// The workload document whose pod template this is (for its claims).
fn template_owner<'a>(docs: &'a [Value], workload: &str) -> &'a Value {
    let (kind, wanted) = workload.split_once('/').expect("kind/name");
    find(docs, kind, wanted)
}

/// The volume mounted at or above `path` in `container`, and `path` below
/// that mount.
fn mount_of(container: &Value, path: &str) -> Option<(String, String)> {
    list(&container["volumeMounts"])
        .iter()
        .filter_map(|m| {
            let at = m["mountPath"].as_str()?.trim_end_matches('/');
            let rest = if path == at {
                ""
            } else {
                path.strip_prefix(at)?.strip_prefix('/')?
            };
            Some((at.len(), m["name"].as_str()?.to_string(), rest.to_string()))
        })
        .max_by_key(|(len, _, _)| *len)
        .map(|(_, volume, rest)| (volume, rest))
}

/// The Secret and its key that `path` reads, when `path` is inside a
/// read-only mount of a Secret volume.
fn mounted_secret(
    workload: &str,
    spec: &Value,
    container: &Value,
    path: &str,
) -> Option<(String, String)> {
    let (volume_name, file) = mount_of(container, path)?;
    let mount = list(&container["volumeMounts"])
        .iter()
        .find(|m| m["name"] == volume_name.as_str())?;
    let volume = list(&spec["volumes"])
        .iter()
        .find(|v| v["name"] == volume_name.as_str())?;
    let secret = volume["secret"]["secretName"].as_str()?;
    assert_eq!(
        mount["readOnly"], true,
        "{workload}: the Secret {secret} is mounted read-only"
    );
    let key = match volume["secret"]["items"].as_array() {
        Some(items) => items.iter().find(|item| item["path"] == file.as_str())?["key"]
            .as_str()?
            .to_string(),
        None => file,
    };
    Some((secret.to_string(), key))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_probe_and_scrape_path_is_a_route_of_the_router() {
    let docs = rendered();
    // (path, what it must answer on a process that is up and not ready).
    let mut paths: BTreeMap<String, &str> = BTreeMap::new();
    for (workload, template) in pod_templates(docs) {
        if !is_vacancy(template) {
            continue;
        }
        let container = vacancy_container(&workload, template);
        for (probe, role) in [
            ("livenessProbe", "liveness"),
            ("readinessProbe", "readiness"),
            ("startupProbe", "liveness"),
        ] {
            let probe = &container[probe];
            if probe.is_null() {
                continue;
            }
            let path = probe["httpGet"]["path"]
                .as_str()
                .unwrap_or_else(|| panic!("{workload}: probes are HTTP GETs: {probe}"));
            paths.insert(path.to_string(), role);
        }
        let scrape = template["metadata"]["annotations"]["prometheus.io/path"]
            .as_str()
            .unwrap_or_else(|| panic!("{workload}: prometheus.io/path"));
        paths.insert(scrape.to_string(), "metrics");
    }
    assert!(!paths.is_empty());

    // The real router, in a process that cannot reach its owner: alive,
    // never ready. Every role serves the same routes (`http::router`).
    let settings = Settings::load_with_vars(
        None,
        [
            (
                "VACANCY_OWNER_URL",
                "postgresql://postgres@127.0.0.1:1/postgres?sslmode=disable",
            ),
            ("VACANCY_LISTEN", "127.0.0.1:0"),
            ("VACANCY_STALE__AUDIT_INTERVAL_MS", "0"),
        ],
    )
    .expect("settings");
    let app = App::bind_and_start(settings).await.expect("start");
    for (path, role) in &paths {
        let answer = vacancy_lab::http_client::get(app.addr, path, Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        assert_ne!(answer.status, 404, "{path} is not a route of the router");
        match *role {
            "liveness" => assert_eq!(
                answer.status, 200,
                "{path}, a liveness probe, must answer 200 while the process is up but not ready"
            ),
            "readiness" => assert_eq!(
                answer.status, 503,
                "{path}, a readiness probe, must answer 503 while the copy is not loaded"
            ),
            _ => assert!(
                answer.status == 200 && answer.text().contains("vacancy_build_info"),
                "{path}, the scrape path, must answer the metrics: {}",
                answer.status
            ),
        }
    }
    app.stop(Duration::from_secs(5)).await;
}

#[test]
fn the_fleet_has_its_shape() {
    let docs = rendered();
    for (workload, template) in pod_templates(docs) {
        assert_eq!(
            template["spec"]["enableServiceLinks"], false,
            "{workload}: enableServiceLinks: false (else VACANCY_SERVICE_HOST-style variables reach the settings loader)"
        );
        if is_vacancy(template) {
            let annotations = &template["metadata"]["annotations"];
            assert_eq!(annotations["prometheus.io/scrape"], "true", "{workload}");
            assert!(
                annotations["prometheus.io/port"].is_string(),
                "{workload}: prometheus.io/port"
            );
            assert_eq!(annotations["prometheus.io/path"], "/metrics", "{workload}");
        }
    }

    // Two projectors (one slot: one holds it, one stands by), and a budget
    // that keeps one of them through a drain.
    let projector = find(docs, "StatefulSet", "vacancy-projector");
    assert_eq!(projector["spec"]["replicas"], 2, "two projectors");
    let projector_labels = &projector["spec"]["template"]["metadata"]["labels"];
    let budgets: Vec<&Value> = of_kind(docs, "PodDisruptionBudget")
        .filter(|pdb| selects(&pdb["spec"]["selector"], projector_labels))
        .collect();
    assert_eq!(
        budgets.len(),
        1,
        "one PodDisruptionBudget selects the projectors"
    );
    let budget = &budgets[0]["spec"];
    assert!(
        budget["minAvailable"] == 1 || budget["maxUnavailable"] == 1,
        "the projectors' budget keeps one: {budget}"
    );

    // The replicas: probes on /readyz and /healthz, a Service, an autoscaler.
    let replica = find(docs, "Deployment", "vacancy-replica");
    let template = &replica["spec"]["template"];
    let container = vacancy_container("Deployment/vacancy-replica", template);
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    let replica_labels = &template["metadata"]["labels"];
    assert!(
        of_kind(docs, "Service").any(|s| selects(&s["spec"]["selector"], replica_labels)),
        "a Service selects the replicas"
    );
    assert!(
        !of_kind(docs, "Service").any(|s| s["spec"]["clusterIP"] != "None"
            && selects(&s["spec"]["selector"], projector_labels)
            && selects(&s["spec"]["selector"], replica_labels)),
        "no Service sends guests to the projectors and the replicas alike"
    );
    let autoscalers: Vec<&Value> = of_kind(docs, "HorizontalPodAutoscaler")
        .filter(|hpa| {
            let target = &hpa["spec"]["scaleTargetRef"];
            target["kind"] == "Deployment" && target["name"] == "vacancy-replica"
        })
        .collect();
    assert_eq!(autoscalers.len(), 1, "one autoscaler targets the replicas");
    let hpa = autoscalers[0];
    assert_eq!(hpa["apiVersion"], "autoscaling/v2");
    assert!(
        list(&hpa["spec"]["metrics"])
            .iter()
            .any(|m| m["resource"]["name"] == "cpu"),
        "the autoscaler follows CPU"
    );
    assert!(
        container["resources"]["requests"]["cpu"].is_string(),
        "a CPU request, which the autoscaler's utilization is measured against"
    );
    assert!(
        replica["spec"].get("replicas").is_none(),
        "the autoscaler owns the replica count (an apply would reset it)"
    );

    // NATS: JetStream on file storage on its own claim.
    let nats = find(docs, "StatefulSet", "nats");
    let server = &list(&nats["spec"]["template"]["spec"]["containers"])[0];
    assert!(
        server["image"]
            .as_str()
            .is_some_and(|i| i.starts_with("nats:2.9")),
        "NATS server 2.9, as the fleet targets: {}",
        server["image"]
    );
    let args: Vec<&str> = list(&server["args"])
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(args.contains(&"-js"), "JetStream on: {args:?}");
    let store = args
        .iter()
        .position(|a| *a == "-sd")
        .map(|i| args[i + 1])
        .expect("-sd: JetStream's file store");
    let (volume, _) = mount_of(server, store).expect("the store is on a volume");
    assert!(
        list(&nats["spec"]["volumeClaimTemplates"])
            .iter()
            .any(|c| c["metadata"]["name"] == volume.as_str()),
        "the store is on the StatefulSet's claim"
    );
    let nats_labels = &nats["spec"]["template"]["metadata"]["labels"];
    let nats_services: Vec<&Value> = of_kind(docs, "Service")
        .filter(|s| selects(&s["spec"]["selector"], nats_labels))
        .collect();
    assert!(
        nats_services
            .iter()
            .any(|s| s["spec"]["clusterIP"] == "None")
            && nats_services
                .iter()
                .any(|s| s["spec"]["clusterIP"] != "None"),
        "NATS has a headless Service and a client Service"
    );
    assert!(
        nats_services
            .iter()
            .any(|s| s["metadata"]["name"] == nats["spec"]["serviceName"]),
        "the StatefulSet names its headless Service"
    );
}

//! The alerting rules (hooks/chart/probity/files/prometheus): promtool's own check and
//! unit tests, an alert without a test that fires and then resolves it, a metric an alert
//! reads that no Probity process exports, and a chart whose PrometheusRule says something
//! else than the files.
//!
//! Why the exported names come from running processes: a rule over a misspelt or removed
//! metric is valid PromQL that never fires, and promtool's tests, fed the same misspelt
//! series, would pass. So the names are read from a real `probity serve` (on etcd, with a
//! SIEM and a keyring, so its conditional families are there), a real `probity agent`
//! (its agent.prom) and the controller's metrics as its exporter renders them.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::cluster::{Pki, kube_bin, probity_bin, root};
use crate::services::{Proc, eventually, free_port, http};

/// The directory of the rules, their tests and the controller's rules.
fn rules_dir() -> PathBuf {
    root().join("hooks/chart/probity/files/prometheus")
}

const RULES: &str = "probity.rules.yml";
const CONTROLLER_RULES: &str = "probity-controller.rules.yml";
const TESTS: &str = "probity.rules.test.yml";

fn yaml(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap();
    serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The groups of a rules file.
fn groups(file: &str) -> Vec<Value> {
    yaml(&rules_dir().join(file))["groups"]
        .as_array()
        .unwrap_or_else(|| panic!("{file} has no groups"))
        .clone()
}

/// Every rule of both files.
fn rules() -> Vec<Value> {
    [RULES, CONTROLLER_RULES]
        .iter()
        .flat_map(|f| groups(f))
        .flat_map(|g| g["rules"].as_array().unwrap().clone())
        .collect()
}

/// `promtool ARGS` in the rules' directory; a clear failure when it is not installed.
fn promtool(args: &[&str]) -> Output {
    Command::new("promtool")
        .args(args)
        .current_dir(rules_dir())
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "promtool: {e}: install Debian's prometheus package (apt-get install prometheus; scripts/setup.sh does), which has /usr/bin/promtool"
            )
        })
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A Prometheus duration (`90s`, `20m`, `2h`, `1h30m`) in seconds.
fn seconds(duration: &str) -> u64 {
    let (mut total, mut number) = (0, String::new());
    for c in duration.chars() {
        if c.is_ascii_digit() {
            number.push(c);
            continue;
        }
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            _ => panic!("{duration:?}: unit {c:?}"),
        };
        total += number.parse::<u64>().unwrap() * unit;
        number.clear();
    }
    assert!(number.is_empty(), "{duration:?} ends without a unit");
    total
}

#[test]
fn every_alert_passes_promtool_and_has_a_test_that_fires_and_then_resolves_it() {
    let check = promtool(&["check", "rules", RULES, CONTROLLER_RULES]);
    assert!(
        check.status.success(),
        "promtool check rules:\n{}",
        text(&check)
    );
    let tested = promtool(&["test", "rules", TESTS]);
    assert!(
        tested.status.success(),
        "promtool test rules:\n{}",
        text(&tested)
    );
    assert!(text(&tested).contains("SUCCESS"), "{}", text(&tested));

    // What each rule owes the operator.
    let rules = rules();
    let mut alerts = BTreeSet::new();
    for rule in &rules {
        let name = rule["alert"]
            .as_str()
            .unwrap_or_else(|| panic!("not an alerting rule: {rule}"));
        assert!(alerts.insert(name.to_owned()), "{name} twice");
        let severity = rule["labels"]["severity"].as_str();
        assert!(
            matches!(severity, Some("warning" | "critical")),
            "{name}: severity {severity:?}"
        );
        for annotation in ["summary", "description"] {
            assert!(
                rule["annotations"][annotation].as_str().is_some(),
                "{name} has no {annotation}"
            );
        }
    }
    // The names are a contract (Alertmanager routes and silences match them): what an
    // operator must hear about, (a) to (g) of issue 35 and the earlier three.
    let expected = [
        "ProbityAgentSilent",
        "ProbityControllerBreakerTripped",
        "ProbityControllerNoLeader",
        "ProbityDecisionLogNearBudget",
        "ProbityDecisionsFailing",
        "ProbityKeyPastRotationAge",
        "ProbityPolicyReloadFailed",
        "ProbitySiemForwarderBehind",
        "ProbitySiemForwarderStalled",
        "ProbityStateDisconnected",
    ];
    assert_eq!(alerts.iter().collect::<Vec<_>>(), expected);

    // Each alert: in one test, a case where it fires (annotations included, so their
    // templates are tested too) and a later one where it has resolved.
    let tests = yaml(&rules_dir().join(TESTS));
    let files = tests["rule_files"].as_array().unwrap();
    for file in [RULES, CONTROLLER_RULES] {
        assert!(
            files.iter().any(|f| f == file),
            "{TESTS} does not load {file}"
        );
    }
    for alert in &alerts {
        let covered = tests["tests"].as_array().unwrap().iter().any(|test| {
            let cases: Vec<(u64, &Vec<Value>)> = test["alert_rule_test"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|case| case["alertname"] == alert.as_str())
                .map(|case| {
                    let expected = case["exp_alerts"].as_array().unwrap_or_else(|| {
                        panic!("{alert}: a case without exp_alerts (write [] for none)")
                    });
                    (seconds(case["eval_time"].as_str().unwrap()), expected)
                })
                .collect();
            cases.iter().any(|(fired_at, fired)| {
                let annotated = fired.iter().all(|a| {
                    a["exp_annotations"]["summary"].is_string()
                        && a["exp_annotations"]["description"].is_string()
                });
                !fired.is_empty()
                    && annotated
                    && cases
                        .iter()
                        .any(|(at, none)| at > fired_at && none.is_empty())
            })
        });
        assert!(
            covered,
            "{alert}: {TESTS} has no test where it fires (with its summary and description) and later resolves"
        );
    }
}

/// The metric names in `expr`, in order (Probity's own: every one begins with
/// `probity_`).
fn metric_names(expr: &str) -> impl Iterator<Item = &str> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|word| word.starts_with("probity_"))
}

/// The metric names `rate(` and `increase(` are applied to in `expr`.
fn counted(expr: &str) -> BTreeSet<String> {
    ["rate(", "increase("]
        .iter()
        .flat_map(|f| expr.match_indices(f).map(move |(i, _)| i + f.len()))
        .filter_map(|start| metric_names(expr.get(start..)?).next())
        .map(str::to_owned)
        .collect()
}

/// Family name -> type, from the `# TYPE` lines of an exposition, and a histogram's
/// `_bucket`, `_sum` and `_count` series as its own names.
fn families(exposition: &str, into: &mut BTreeMap<String, String>) {
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').unwrap();
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                into.insert(format!("{name}{suffix}"), "histogram series".into());
            }
        }
        into.insert(name.to_owned(), kind.to_owned());
    }
}

/// GET `path` on the Unix socket `socket`: the status and the whole response.
fn get_unix(socket: &Path, path: &str) -> Option<(u16, String)> {
    let mut s = UnixStream::connect(socket).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: probity\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    s.read_to_string(&mut response).ok()?;
    let status = response.split(' ').nth(1)?.parse().ok()?;
    Some((status, response))
}

/// Polls `scrape` until it has every name of `wanted`; its families (or a failure that
/// names the missing ones).
fn scrape_until(
    what: &str,
    wanted: &BTreeSet<String>,
    mut scrape: impl FnMut() -> Option<String>,
) -> BTreeMap<String, String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut found = BTreeMap::new();
        if let Some(text) = scrape() {
            families(&text, &mut found);
        }
        let missing: Vec<&String> = wanted.iter().filter(|n| !found.contains_key(*n)).collect();
        if missing.is_empty() {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "{what} does not export {missing:?}, which the alerts read; it exports {:?}",
            found.keys().collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `probity serve` on a Unix socket, with its shared state on a real etcd, a SIEM that
/// does not answer and the keyring: its /metrics families.
fn server_families(dir: &Path, wanted: &BTreeSet<String>) -> BTreeMap<String, String> {
    let (client, peer) = (free_port(), free_port());
    let (client_url, peer_url) = (
        format!("http://127.0.0.1:{client}"),
        format!("http://127.0.0.1:{peer}"),
    );
    let _etcd = Proc::spawn(
        "etcd",
        Command::new("etcd")
            .args(["--name", "alerts", "--data-dir"])
            .arg(dir.join("etcd"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("alerts={peer_url}")]),
        &dir.join("etcd.log"),
    );
    eventually("etcd /health", Duration::from_secs(60), || {
        http(client, "GET", "/health", "").filter(|(status, _)| *status == 200)
    });
    let state = dir.join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let socket = dir.join("probity.sock");
    let config = dir.join("probity-server.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nsocket = {socket:?}\n[integrity]\nstate_dir = {state:?}\n\
             [state]\nbackend = \"etcd\"\nendpoints = [{client_url:?}]\nnode = \"alerts-test\"\n\
             [siem]\naddress = \"127.0.0.1:{}\"\n",
            free_port()
        ),
    )
    .unwrap();
    let mut server = Proc::spawn(
        "probity serve",
        Command::new(probity_bin())
            .args(["serve", "--config"])
            .arg(&config),
        &dir.join("probity.log"),
    );
    eventually("probity /readyz", Duration::from_secs(60), || {
        server.assert_running();
        get_unix(&socket, "/readyz").filter(|(status, _)| *status == 200)
    });
    scrape_until("probity serve's /metrics", wanted, || {
        get_unix(&socket, "/metrics").map(|(_, text)| text)
    })
}

/// `probity agent` running cycles with a state directory and a SIEM that does not
/// answer, every source it would read off the host disabled or absent: its agent.prom.
fn agent_families(dir: &Path, wanted: &BTreeSet<String>) -> BTreeMap<String, String> {
    let (state, proc_root) = (dir.join("agent-state"), dir.join("proc"));
    std::fs::create_dir_all(proc_root.join("net")).unwrap();
    std::fs::write(proc_root.join("stat"), "cpu  1 1\ncpu0 1 1\n").unwrap();
    std::fs::create_dir_all(&state).unwrap();
    let missing = dir.join("absent");
    let config = dir.join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "[node]\nname = \"alerts-test\"\n[inventory]\nzone = \"z1\"\nrack = \"r1\"\n\
             [collect]\ninterval_seconds = 1\n[nvidia_smi]\nbinary = {missing:?}\n\
             [rapl]\nenabled = false\n[ipmi]\nenabled = false\n[proc]\nroot = {proc_root:?}\n\
             [firewall]\nnft = {missing:?}\nread_iptables = false\n[state]\ndir = {state:?}\n\
             [siem]\naddress = \"127.0.0.1:{}\"\n",
            free_port()
        ),
    )
    .unwrap();
    let mut agent = Proc::spawn(
        "probity agent",
        Command::new(probity_bin())
            .args(["agent", "--config"])
            .arg(&config),
        &dir.join("agent.log"),
    );
    scrape_until("probity agent's agent.prom", wanted, || {
        agent.assert_running();
        std::fs::read_to_string(state.join("agent.prom")).ok()
    })
}

#[test]
fn every_metric_an_alert_reads_is_one_a_running_probity_exports() {
    let rules = rules();
    let mut read: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut counters = BTreeSet::new();
    for rule in &rules {
        let (alert, expr) = (
            rule["alert"].as_str().unwrap(),
            rule["expr"].as_str().unwrap(),
        );
        let names: BTreeSet<&str> = metric_names(expr).collect();
        assert!(!names.is_empty(), "{alert} reads no Probity metric: {expr}");
        for name in names {
            read.entry(name.to_owned())
                .or_default()
                .push(alert.to_owned());
        }
        counters.extend(counted(expr));
    }
    let wanted = |prefix: &str| -> BTreeSet<String> {
        read.keys()
            .filter(|n| n.starts_with(prefix))
            .cloned()
            .collect()
    };
    let agent_wanted = wanted("probity_agent_");
    let controller_wanted = wanted("probity_controller_");
    let server_wanted: BTreeSet<String> = read
        .keys()
        .filter(|n| !agent_wanted.contains(*n) && !controller_wanted.contains(*n))
        .cloned()
        .collect();
    // Each part of Probity is asked for some of them: a rule group per part.
    for (part, names) in [
        ("server", &server_wanted),
        ("agent", &agent_wanted),
        ("controller", &controller_wanted),
    ] {
        assert!(!names.is_empty(), "no alert reads the {part}'s metrics");
    }

    let dir = tempfile::tempdir().unwrap();
    let mut exported = server_families(dir.path(), &server_wanted);
    exported.extend(agent_families(dir.path(), &agent_wanted));
    let controller = probity_kube::controller::metrics::Metrics::default().render();
    families(&controller, &mut exported);

    let unknown: Vec<String> = read
        .iter()
        .filter(|(name, _)| !exported.contains_key(*name))
        .map(|(name, alerts)| format!("{name} (read by {})", alerts.join(", ")))
        .collect();
    assert!(unknown.is_empty(), "not exported by Probity: {unknown:?}");
    // rate() and increase() of a gauge are quietly wrong.
    for name in &counters {
        assert_eq!(
            exported.get(name).map(String::as_str),
            Some("counter"),
            "{name} is rated or increased but is not a counter"
        );
    }
}

/// `helm template` of the chart with the values an install needs and `extra`, and
/// `--api-versions monitoring.coreos.com/v1` when `operator`: the PrometheusRules.
fn rendered_rules(pki: &Pki, operator: bool, extra: &[&str]) -> Vec<Value> {
    let mut helm = Command::new(kube_bin("helm"));
    helm.args(["template", "probity"])
        .arg(root().join("hooks/chart/probity"))
        .args(["--namespace", "probity-system"]);
    if operator {
        helm.args(["--api-versions", "monitoring.coreos.com/v1"]);
    }
    let ca_bundle = format!("webhook.caBundle={}", pki.ca_bundle_base64());
    let values = [
        "webhook.url=https://127.0.0.1:9",
        "etcd.endpoints[0]=https://etcd.example:2379",
        "etcd.clientSecret=probity-etcd-client",
        "trust.publicKey=04d6429c7bf1122d66fdf92a95b997c162d5261546b65e470f96ace3fb9d073b688e64db3b2e91d631f3069e0a010d380195f1dd449bdad248ed7bb04e9f448335",
        "sidecar.agent.inventory.gpu-a1.zone=zone-a",
        "sidecar.agent.inventory.gpu-a1.rack=r1",
        &ca_bundle,
    ];
    for value in values.iter().chain(extra) {
        helm.args(["--set", value]);
    }
    let out = helm.output().unwrap();
    assert!(out.status.success(), "helm template: {}", text(&out));
    probity_kube::parse_manifests(&String::from_utf8(out.stdout).unwrap())
        .unwrap()
        .into_iter()
        .filter(|m| m.kind() == "PrometheusRule")
        .map(|m| m.object)
        .collect()
}

#[test]
fn the_charts_prometheusrule_holds_the_groups_of_the_rules_files() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let server = groups(RULES);
    let controller = groups(CONTROLLER_RULES);

    let with_controller = rendered_rules(&pki, true, &[]);
    assert_eq!(with_controller.len(), 1);
    let rule = &with_controller[0];
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(rule["metadata"]["namespace"], "probity-system");
    let all: Vec<Value> = server.iter().chain(&controller).cloned().collect();
    let names = |groups: &Value| -> Vec<Value> {
        groups
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["name"].clone())
            .collect()
    };
    assert_eq!(
        names(&rule["spec"]["groups"]),
        names(&Value::Array(all.clone()))
    );
    assert_eq!(
        rule["spec"]["groups"],
        Value::Array(all),
        "the PrometheusRule's groups are not the files'"
    );
    // Read back as text, the annotations' templates are Prometheus's, untouched by Helm.
    let rendered = serde_json::to_string(&rule["spec"]).unwrap();
    assert!(rendered.contains("{{ $labels.instance }}"), "{rendered}");

    let without_controller = rendered_rules(&pki, true, &["controller.enabled=false"]);
    assert_eq!(
        without_controller[0]["spec"]["groups"],
        Value::Array(server),
        "with controller.enabled=false only probity.rules.yml's groups"
    );
    let labelled = rendered_rules(&pki, true, &["metrics.prometheusRule.labels.release=kps"]);
    assert_eq!(labelled[0]["metadata"]["labels"]["release"], "kps");

    // Without the operator's API, or switched off: none.
    assert!(rendered_rules(&pki, false, &[]).is_empty());
    assert!(rendered_rules(&pki, true, &["metrics.prometheusRule.enabled=false"]).is_empty());
}

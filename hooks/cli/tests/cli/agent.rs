//! `probity agent` and `probity baseline` end to end: one cycle printed as JSON, a
//! configuration error located, the status file, a graceful stop on SIGTERM, and the
//! baseline checked, refused and applied in a network namespace with a real sshd.

mod elevation;
mod netns;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{copy_policies, probity, root, text};

fn fixture(area: &str, name: &str) -> PathBuf {
    root().join("testdata/fixtures").join(area).join(name)
}

/// A node of fixtures: ipmitool and nft doubles, a proc root; its configuration.
struct Node {
    _dir: tempfile::TempDir,
    config: PathBuf,
}

impl Node {
    fn new(extra: &str) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        std::fs::create_dir_all(p.join("proc/net")).unwrap();
        std::fs::copy(
            fixture("sockets", "own-8gpu-node.tcp"),
            p.join("proc/net/tcp"),
        )
        .unwrap();
        std::fs::write(p.join("proc/stat"), "cpu  1 1\ncpu0 1 1\n").unwrap();
        let tool = |name: &str, file: PathBuf| {
            let path = p.join(name);
            std::fs::write(&path, format!("#!/bin/sh\nexec cat {}\n", file.display())).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            path
        };
        let ipmi = tool(
            "ipmitool",
            fixture("ipmi", "own-ipmitool-dcmi-power-reading-1.8.19-oneline.txt"),
        );
        let nft = tool("nft", fixture("firewall", "nft-j-netns.json"));
        let config = p.join("agent.toml");
        std::fs::write(
            &config,
            format!(
                "[node]\nname = \"cpu-01\"\n[inventory]\nzone = \"z1\"\nrack = \"r1\"\n[rapl]\nenabled = false\n[ipmi]\nbinary = \"{}\"\n[proc]\nroot = \"{}\"\n[firewall]\nnft = \"{}\"\nread_iptables = false\n{extra}",
                ipmi.display(),
                p.join("proc").display(),
                nft.display()
            ),
        )
        .unwrap();
        Node { _dir: dir, config }
    }

    fn config(&self) -> &str {
        self.config.to_str().unwrap()
    }
}

#[test]
fn agent_once_prints_one_cycle_as_json() {
    let node = Node::new("");
    let out = probity(&["agent", "--once", "--config", node.config()]);
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}{}", text(&out.stdout), text(&out.stderr)));
    let entity = &report["facts"]["entities"][0];
    assert_eq!(entity["uid"]["id"], "cpu-01");
    assert_eq!(entity["attrs"]["powerDrawW"], 2184);
    assert_eq!(entity["attrs"]["cpuCount"], 1);
    assert_eq!(report["decisions"][0]["action"], "comply");
    // The node's Zone is not loaded, so comply fails closed; the fixture's listeners
    // (etcd, dcgm-exporter, node-exporter) are beyond the global baseline.
    let active = report["active"].as_array().unwrap();
    assert!(!active.is_empty());
    assert!(
        active
            .iter()
            .any(|f| f["policy"] == "security.inbound-port-beyond-baseline"
                && f["subject"] == "tcp/9100"),
        "{active:?}"
    );
    assert_eq!(out.status.code(), Some(6), "findings are active");
}

#[test]
fn a_bad_agent_configuration_is_a_located_error() {
    let node = Node::new("[collect]\ninterval_seconds = 0\n");
    let out = probity(&["agent", "--once", "--config", node.config()]);
    assert_eq!(out.status.code(), Some(8));
    let err = text(&out.stderr);
    let line = std::fs::read_to_string(&node.config)
        .unwrap()
        .lines()
        .position(|l| l.starts_with("interval_seconds"))
        .unwrap()
        + 1;
    assert!(
        err.contains(&format!(
            "{}:{line}:20: collect.interval_seconds must be between 1 and",
            node.config()
        )),
        "{err}"
    );
    let out = probity(&["baseline", "render", "--config", "/nonexistent/agent.toml"]);
    assert_eq!(out.status.code(), Some(8));
    assert!(text(&out.stderr).contains("cannot read /nonexistent/agent.toml"));
}

#[test]
fn the_status_of_a_running_agent_and_its_graceful_stop() {
    let state = tempfile::tempdir().unwrap();
    let node = Node::new(&format!(
        "[collect]\ninterval_seconds = 1\nstale_after_seconds = 5\n[state]\ndir = \"{}\"\n",
        state.path().display()
    ));
    let mut child = Command::new(env!("CARGO_BIN_EXE_probity"))
        .args(["agent", "--config", node.config()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status_file = state.path().join("agent-status.json");
    let deadline = Instant::now() + Duration::from_secs(30);
    // Two cycles written: the loop runs on its interval.
    loop {
        if let Ok(bytes) = std::fs::read(&status_file)
            && let Ok(v) = serde_json::from_slice::<Value>(&bytes)
            && v["cycles"].as_u64() >= Some(2)
        {
            break;
        }
        assert!(Instant::now() < deadline, "no status with two cycles");
        assert!(child.try_wait().unwrap().is_none(), "the agent exited");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = probity(&["agent", "status", "--config", node.config()]);
    let shown = text(&out.stdout);
    assert!(shown.starts_with("node cpu-01: "), "{shown}");
    assert!(shown.contains("ipmi       ok"), "{shown}");
    assert_eq!(out.status.code(), Some(6), "findings are active");
    let out = probity(&[
        "agent",
        "status",
        "--state-dir",
        state.path().to_str().unwrap(),
        "--metrics",
    ]);
    let metrics = text(&out.stdout);
    assert!(
        metrics.contains("probity_agent_source_up{node=\"cpu-01\",source=\"ipmi\",state=\"ok\"} 1"),
        "{metrics}"
    );
    assert!(
        std::fs::read_to_string(state.path().join("agent.prom"))
            .unwrap()
            .contains("probity_agent_cycles_total")
    );

    let term = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "no stop after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(code.code(), Some(0), "{err}");
    assert!(err.contains("probity agent: stopped"), "{err}");
    assert!(err.contains("\"event\":\"finding\""), "{err}");
}

/// A policy directory with a role whose sshd runs on 2222 and another without it.
fn policies_with_roles() -> tempfile::TempDir {
    let dir = copy_policies();
    let toml = dir.path().join("probity.toml");
    let mut text = std::fs::read_to_string(&toml).unwrap();
    text.push_str("\n[roles.test-node]\ntcp = [2222, 9100]\n\n[roles.no-ssh]\ntcp = [22, 9100]\n");
    std::fs::write(&toml, text).unwrap();
    dir
}

fn baseline_config(dir: &Path, policies: &Path, mode: &str) -> PathBuf {
    let config = dir.join(format!("agent-{mode}.toml"));
    std::fs::write(
        &config,
        format!(
            "[node]\nname = \"ns-node\"\n[inventory]\nzone = \"z1\"\nrack = \"r1\"\nrole = \"test-node\"\n[firewall]\nmode = \"{mode}\"\n[engine]\npolicies = \"{}\"\n",
            policies.display()
        ),
    )
    .unwrap();
    config
}

#[test]
fn baseline_check_apply_in_a_network_namespace_keeps_sshd() {
    let policies = policies_with_roles();
    let dir = tempfile::tempdir().unwrap();
    let enforce = baseline_config(dir.path(), policies.path(), "enforce");
    let check_only = baseline_config(dir.path(), policies.path(), "check");
    let enforce = enforce.to_str().unwrap();
    let mut ns = netns::Netns::new();
    ns.sshd(2222);
    ns.listen(&[8080]);

    // No firewall in the namespace: 8080 is reachable beyond the baseline.
    let out = ns.probity(&["baseline", "check", "--config", enforce, "--json"]);
    assert_eq!(out.status.code(), Some(6), "{}", text(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["clean"], false);
    let covers_8080 = |f: &Value| {
        let ports = f["ports"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or(f["ports"].to_string());
        let (a, b) = ports.split_once('-').unwrap_or((&ports, &ports));
        let (a, b): (u16, u16) = (a.parse().unwrap(), b.parse().unwrap());
        f["protocol"] == "tcp" && (a..=b).contains(&8080)
    };
    assert!(
        report["excess"].as_array().unwrap().iter().any(covers_8080),
        "{}",
        report["excess"]
    );
    let table = ns.probity(&["baseline", "check", "--config", enforce]);
    assert!(
        text(&table.stdout).starts_with("role test-node: "),
        "{}",
        text(&table.stdout)
    );
    assert!(text(&table.stdout).contains("beyond"));

    // The script of the role.
    let out = ns.probity(&["baseline", "render", "--config", enforce]);
    let script = text(&out.stdout);
    assert!(script.contains("table inet probity"), "{script}");
    assert!(script.contains("tcp dport 2222 accept"), "{script}");

    // --enforce under mode = "check" is a dry run: nothing is loaded.
    let out = ns.probity(&[
        "baseline",
        "apply",
        "--config",
        check_only.to_str().unwrap(),
        "--enforce",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--enforce has no effect"));
    assert!(
        text(&out.stdout).contains("dry run: would apply"),
        "{}",
        text(&out.stdout)
    );
    assert!(!text(&ns.exec(&["/usr/sbin/nft", "list", "ruleset"])).contains("probity"));

    // A role without sshd's real port (2222, not 22) is refused, and nothing changes.
    let out = ns.probity(&[
        "baseline",
        "apply",
        "--config",
        enforce,
        "--role",
        "no-ssh",
        "--enforce",
    ]);
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("sshd port 2222"),
        "{}",
        text(&out.stderr)
    );
    assert!(ns.ssh_banner(std::net::IpAddr::V4(ns.ns_v4), 2222));

    // Enforced: applied, check is clean, sshd still answers over both families.
    let out = ns.probity(&[
        "baseline",
        "apply",
        "--config",
        enforce,
        "--enforce",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let applied: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(applied["report"]["outcome"], "applied");
    assert_eq!(applied["report"]["read_back_matches"], true);
    assert_eq!(applied["sshd"]["ports"], serde_json::json!([2222]));
    let out = ns.probity(&["baseline", "check", "--config", enforce, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    assert!(ns.ssh_banner(std::net::IpAddr::V4(ns.ns_v4), 2222));
    assert!(ns.ssh_banner(std::net::IpAddr::V6(ns.ns_v6), 2222));

    // Applying again changes nothing.
    let out = ns.probity(&[
        "baseline",
        "apply",
        "--config",
        enforce,
        "--enforce",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let again: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(again["report"]["outcome"], "unchanged");
}

/// The agent as systemd's `Type=notify` sees it: READY=1 once its configuration and
/// policies have loaded, RELOADING=1 then READY=1 around a SIGHUP reload of its policy
/// directory, STOPPING=1 at SIGTERM.
#[test]
fn the_agent_tells_systemd_it_is_ready_reloads_on_sighup_and_stops() {
    use crate::install::{NotifyListener, signal, wait_exit};
    let dir = tempfile::tempdir().unwrap();
    let policies = copy_policies();
    let node = Node::new(&format!(
        "[collect]\ninterval_seconds = 60\n[engine]\npolicies = \"{}\"\n",
        policies.path().display()
    ));
    let notify = NotifyListener::bind(&dir.path().join("notify"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_probity"))
        .args(["agent", "--config", node.config()])
        .env("NOTIFY_SOCKET", dir.path().join("notify"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let ready = notify.next("the agent's READY=1");
    assert!(
        ready.starts_with("READY=1\nSTATUS=node cpu-01, collecting\nMAINPID="),
        "{ready}"
    );
    signal(&child, "HUP");
    assert!(
        notify
            .next("RELOADING=1")
            .starts_with("RELOADING=1\nMONOTONIC_USEC=")
    );
    let reloaded = notify.next("READY=1 after the reload");
    assert!(
        reloaded.starts_with("READY=1\nSTATUS=policies reloaded\n"),
        "{reloaded}"
    );
    std::fs::write(policies.path().join("security/broken.cedar"), "forbid (").unwrap();
    signal(&child, "HUP");
    assert!(notify.next("RELOADING=1").starts_with("RELOADING=1\n"));
    let refused = notify.next("READY=1 after the refused reload");
    assert!(
        refused
            .starts_with("READY=1\nSTATUS=reload refused, the previous policies keep deciding: "),
        "{refused}"
    );
    assert!(refused.contains("broken.cedar"), "{refused}");
    signal(&child, "TERM");
    assert_eq!(notify.next("STOPPING=1"), "STOPPING=1");
    assert!(wait_exit(&mut child).success());
}

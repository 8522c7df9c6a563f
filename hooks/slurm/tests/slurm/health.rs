//! `probity slurm health` as Slurm's HealthCheckProgram: each node's agent runs one
//! compliance cycle on its own facts (an nvidia-smi stand-in printing a capture the
//! test rewrites), a `comply` finding drains the node with Probity's reason, and the
//! drain is resumed once the finding clears; an operator's drain is never touched.
//!
//! slurmd runs the program with only PWD and SLURMD_NODENAME in its environment, so the
//! program is a shell wrapper (written here) that sets SLURM_CONF, names every tool by
//! path and runs `probity slurm health` under `flock -n` (two runs on one node must not
//! open the agent's state store at once). The wrapper does nothing until the test arms
//! it: the harness waits for every node to be idle before it returns, and a drain
//! before then would be a failed start.
//!
//! HealthCheckInterval is 2, not 1: at 1, slurmctld starts a health check agent every
//! second and its pings never get their turn (both wait for the previous agent), so a
//! node resumed from inside the health check stays `IDLE+NOT_RESPONDING` for good, and
//! a node not responding is sent no further health check (measured, Slurm 22.05.8).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::slurm_cluster::{Slurm, SlurmOptions};

/// The longest any wait here may take.
const LIMIT: Duration = Duration::from_secs(30);

/// The policy a hot GPU trips (policies/thermal/thermal.cedar).
const OVER_TEMPERATURE: &str = "thermal.gpu-over-temperature";

/// The `probity` binary: `$PROBITY_BIN`, else the workspace's, beside the test's
/// `deps/` directory (the test command builds the workspace first).
fn probity_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("PROBITY_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("probity");
    assert!(
        path.exists(),
        "{} is missing: build it first (cargo build -p probity-cli)",
        path.display()
    );
    path
}

fn fixture(area: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/fixtures")
        .join(area)
        .join(name)
}

/// The directory holding `scontrol` (the wrapper has no PATH to find it).
fn slurm_bin() -> PathBuf {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .chain([PathBuf::from("/usr/bin")])
        .find(|dir| dir.join("scontrol").is_file())
        .expect("scontrol is not installed")
}

/// Writes `bytes` to `path` through a rename, so a reader sees the old file or the new.
fn write_atomic(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn executable(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// An 8-GPU H100 node's `nvidia-smi --query-gpu` (the repository's capture) on the
/// pinned driver, its hottest GPU at `hottest_c` (the H100 target is 70 C).
fn smi_capture(hottest_c: u32) -> String {
    let csv = std::fs::read_to_string(fixture("nvidia-smi", "own-8gpu-h100.query-gpu.csv"))
        .unwrap()
        .replace("570.133.20", "590.48.01");
    assert!(csv.contains(", 71, "), "the capture's hot GPU moved");
    csv.replace(", 71, ", &format!(", {hottest_c}, "))
}

const COOL_C: u32 = 61;
const HOT_C: u32 = 85;

/// The node's Zone and its Cluster: without them `comply` fails closed.
const ENTITIES: &str = r#"[
  {"uid": {"type": "Cluster", "id": "onprem"}, "attrs": {"gpusTotal": 24, "gpusAllocated": 0}, "parents": []},
  {"uid": {"type": "Zone", "id": "z1"}, "parents": [{"type": "Cluster", "id": "onprem"}],
   "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}}, "powerDrawW": 20000, "powerCeilingW": 100000}}
]
"#;

/// A Slurm cluster whose HealthCheckProgram runs `probity slurm health` with an agent
/// per node. Fields drop in order: the cluster (its daemons, and every health check
/// still running, which carries its SLURM_CONF) before the directory.
struct HealthCluster {
    slurm: Slurm,
    dir: PathBuf,
    _temp: tempfile::TempDir,
}

impl HealthCluster {
    /// Three nodes; node K's hottest GPU at `temps[K-1]` C. The health check runs every
    /// `interval` seconds once [`HealthCluster::arm`] is called.
    fn start(temps: [u32; 3], interval: u32) -> HealthCluster {
        let probity = probity_bin();
        let temp = tempfile::Builder::new()
            .prefix("probity-health-")
            .tempdir()
            .unwrap();
        let dir = temp.path().canonicalize().unwrap();
        let conf = dir.join("slurm.conf");

        // Tools every node shares: a BMC power reading, a firewall, a proc root with
        // no listener, and the Zone.
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        std::fs::create_dir_all(dir.join("proc/net")).unwrap();
        let cat = |name: &str, file: &Path| {
            let path = dir.join("bin").join(name);
            executable(
                &path,
                &format!("#!/bin/sh\nexec /bin/cat {}\n", file.display()),
            );
            path
        };
        let ipmitool = cat(
            "ipmitool",
            &fixture("ipmi", "own-ipmitool-dcmi-power-reading-1.8.19-oneline.txt"),
        );
        let nft = cat("nft", &fixture("firewall", "nft-j-netns.json"));
        std::fs::write(
            dir.join("proc/net/tcp"),
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n",
        )
        .unwrap();
        std::fs::write(dir.join("proc/stat"), "cpu  1 1\ncpu0 1 1\n").unwrap();
        std::fs::write(dir.join("entities.json"), ENTITIES).unwrap();

        for (k, celsius) in temps.into_iter().enumerate() {
            let node = format!("node{}", k + 1);
            let home = dir.join("nodes").join(&node);
            std::fs::create_dir_all(home.join("state")).unwrap();
            write_atomic(&home.join("smi.csv"), smi_capture(celsius).as_bytes());
            let smi = home.join("nvidia-smi");
            executable(
                &smi,
                &format!(
                    "#!/bin/sh\nexec /bin/cat {}\n",
                    home.join("smi.csv").display()
                ),
            );
            std::fs::write(
                dir.join(format!("agent-{node}.toml")),
                format!(
                    r#"[node]
name = "{node}"
[inventory]
zone = "z1"
rack = "r1"
gpu_node = true
cuda_image = "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04"
[nvidia_smi]
binary = "{smi}"
[rapl]
enabled = false
[ipmi]
binary = "{ipmitool}"
[proc]
root = "{proc}"
[firewall]
nft = "{nft}"
read_iptables = false
[engine]
entities = "{entities}"
[state]
dir = "{state}"
"#,
                    smi = smi.display(),
                    ipmitool = ipmitool.display(),
                    proc = dir.join("proc").display(),
                    nft = nft.display(),
                    entities = dir.join("entities.json").display(),
                    state = home.join("state").display(),
                ),
            )
            .unwrap();
        }

        // Each completed run appends its exit code to health-<node>.runs; a run that
        // finds the previous one still going is skipped (flock exits 75).
        let wrapper = dir.join("health-check.sh");
        let d = dir.display();
        executable(
            &wrapper,
            &format!(
                "#!/bin/sh\n\
                 [ -e {d}/health.on ] || exit 0\n\
                 export SLURM_CONF={conf}\n\
                 n=$SLURMD_NODENAME\n\
                 /usr/bin/flock -n -E 75 {d}/health-$n.lock \
                 {probity} slurm health --agent-config {d}/agent-$n.toml --slurm-bin {bin} \
                 2>>{d}/health-$n.err\n\
                 rc=$?\n\
                 [ $rc = 75 ] || echo $rc >>{d}/health-$n.runs\n\
                 exit $rc\n",
                conf = conf.display(),
                probity = probity.display(),
                bin = slurm_bin().display(),
            ),
        );

        let slurm = Slurm::start_in(
            &dir,
            SlurmOptions {
                health_check: Some((wrapper, interval)),
                ..Default::default()
            },
        );
        assert_eq!(slurm.conf, conf, "the harness moved slurm.conf");
        HealthCluster {
            slurm,
            dir,
            _temp: temp,
        }
    }

    /// From now on the health check runs `probity slurm health`.
    fn arm(&self) {
        std::fs::write(self.dir.join("health.on"), "").unwrap();
    }

    /// Node `node`'s hottest GPU is now at `celsius`.
    fn set_temperature(&self, node: &str, celsius: u32) {
        write_atomic(
            &self.dir.join("nodes").join(node).join("smi.csv"),
            smi_capture(celsius).as_bytes(),
        );
    }

    /// The exit codes of the health checks completed on `node`, oldest first.
    fn runs(&self, node: &str) -> Vec<String> {
        std::fs::read_to_string(self.dir.join(format!("health-{node}.runs")))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// What `probity slurm health` said on `node` (its standard error, every run).
    fn said(&self, node: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("health-{node}.err"))).unwrap_or_default()
    }

    /// What to show when a wait fails.
    fn diagnose(&self, node: &str) -> String {
        let said = self.said(node);
        let tail: Vec<&str> = said.lines().rev().take(20).collect();
        format!(
            "node {node}: {:?}\nruns: {:?}\nprobity slurm health said (last lines first):\n{}\nslurmd:\n{}\nslurmctld:\n{}",
            self.slurm.show_node(node),
            self.runs(node),
            tail.join("\n"),
            self.slurm.log_tail(&format!("slurmd-{node}.log"), 15),
            self.slurm.log_tail("slurmctld.log", 40),
        )
    }

    /// Polls until `f` holds for the node's `scontrol show node` fields.
    fn wait_node(
        &self,
        node: &str,
        what: &str,
        f: impl Fn(&std::collections::BTreeMap<String, String>) -> bool,
    ) -> std::collections::BTreeMap<String, String> {
        let deadline = Instant::now() + LIMIT;
        loop {
            if let Some(fields) = self.slurm.show_node(node).filter(|m| f(m)) {
                return fields;
            }
            if let Some(dead) = self.slurm.dead_daemon() {
                panic!("{dead} died while waiting for {node}: {what}");
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {node}: {what}\n{}",
                self.diagnose(node)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Polls until `node` has completed at least `n` health checks; their exit codes.
    fn wait_runs(&self, node: &str, n: usize) -> Vec<String> {
        let deadline = Instant::now() + LIMIT;
        loop {
            let runs = self.runs(node);
            if runs.len() >= n {
                return runs;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {n} health checks on {node}\n{}",
                self.diagnose(node)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Polls until the agent's state store of `node` holds `text` (an event kind): the
    /// store's file is read as bytes (the event log has no printing command, and the
    /// health check holds the store while it runs).
    fn wait_store_holds(&self, node: &str, text: &str) {
        let file = self.dir.join("nodes").join(node).join("state/state.redb");
        let deadline = Instant::now() + LIMIT;
        loop {
            let bytes = std::fs::read(&file).unwrap_or_default();
            if bytes.windows(text.len()).any(|w| w == text.as_bytes()) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} never held {text:?}\n{}",
                file.display(),
                self.diagnose(node)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn state(fields: &std::collections::BTreeMap<String, String>) -> &str {
    fields.get("State").map(String::as_str).unwrap_or("")
}

fn drained(fields: &std::collections::BTreeMap<String, String>) -> bool {
    state(fields)
        .split('+')
        .any(|flag| flag.starts_with("DRAIN"))
}

/// The node's Reason without Slurm's ` [user@time]` stamp; "" when it has none.
fn reason(fields: &std::collections::BTreeMap<String, String>) -> String {
    let text = fields.get("Reason").map(String::as_str).unwrap_or("");
    match text.rsplit_once(" [") {
        Some((reason, stamp)) if stamp.ends_with(']') => reason.to_owned(),
        _ => text.to_owned(),
    }
}

#[test]
fn health_findings_drain_the_node_and_resume_it_once_cleared() {
    let cluster = HealthCluster::start([COOL_C, HOT_C, COOL_C], 2);
    cluster.arm();

    let prefix = format!("Probity: {OVER_TEMPERATURE}");
    let fields = cluster.wait_node("node2", "drained for its hot GPU", |m| {
        drained(m) && reason(m).starts_with(&prefix)
    });
    assert_eq!(
        reason(&fields),
        format!("{prefix}: a GPU runs above its model's temperature target"),
        "{fields:?}"
    );

    // The cool nodes' checks run too, and find nothing: they stay up.
    for node in ["node1", "node3"] {
        let runs = cluster.wait_runs(node, 2);
        assert!(
            runs.iter().all(|rc| rc == "0"),
            "{node}: {runs:?}\n{}",
            cluster.diagnose(node)
        );
        let fields = cluster.slurm.show_node(node).unwrap();
        assert!(
            !drained(&fields) && reason(&fields).is_empty(),
            "{node}: {fields:?}"
        );
    }
    // node2's checks report the finding (exit 6) every time.
    let runs = cluster.wait_runs("node2", 2);
    assert!(
        runs.iter().all(|rc| rc == "6"),
        "{runs:?}\n{}",
        cluster.diagnose("node2")
    );
    cluster.wait_store_holds("node2", "slurm-node-drained");

    // The GPU cools: the next check clears the finding and resumes Probity's drain.
    cluster.set_temperature("node2", COOL_C);
    cluster.wait_node("node2", "resumed", |m| {
        state(m) == "IDLE" && reason(m).is_empty()
    });
    cluster.wait_store_holds("node2", "slurm-node-resumed");
    let said = cluster.said("node2");
    assert!(
        said.contains("probity slurm health: drained node2: Probity: thermal.gpu-over-temperature")
            && said.contains("probity slurm health: resumed node2 (was: Probity: thermal."),
        "{said}"
    );

    // Drained once: the checks between found Probity's own reason in place.
    assert_eq!(said.matches("drained node2:").count(), 1, "{said}");

    // It stays up: later checks find nothing.
    let before = cluster.runs("node2").len();
    let runs = cluster.wait_runs("node2", before + 2);
    assert!(runs[before..].iter().all(|rc| rc == "0"), "{runs:?}");
    let fields = cluster.slurm.show_node("node2").unwrap();
    assert!(!drained(&fields), "{fields:?}");
    for node in ["node1", "node3"] {
        let fields = cluster.slurm.show_node(node).unwrap();
        assert!(!drained(&fields), "{node}: {fields:?}");
    }
}

#[test]
fn an_operators_drain_is_never_resumed_by_the_health_check() {
    // node1 is fine and node3 runs hot, but the operator drained both first.
    let cluster = HealthCluster::start([COOL_C, HOT_C, HOT_C], 2);
    cluster.slurm.drain("node1", "disk replacement, ticket 42");
    cluster.slurm.drain("node3", "fan swap, ticket 43");
    cluster.arm();

    // The health check demonstrably runs: node2 (hot, not drained) is drained by it.
    cluster.wait_node("node2", "drained by Probity", |m| {
        drained(m) && reason(m).starts_with(&format!("Probity: {OVER_TEMPERATURE}"))
    });
    // Three completed checks on each operator-drained node: none touched its drain.
    let runs = cluster.wait_runs("node1", 3);
    assert!(
        runs.iter().all(|rc| rc == "0"),
        "node1 has no finding: {runs:?}\n{}",
        cluster.diagnose("node1")
    );
    let runs = cluster.wait_runs("node3", 3);
    assert!(
        runs.iter().all(|rc| rc == "6"),
        "node3's finding is reported: {runs:?}\n{}",
        cluster.diagnose("node3")
    );
    for (node, why) in [
        ("node1", "disk replacement, ticket 42"),
        ("node3", "fan swap, ticket 43"),
    ] {
        let fields = cluster.slurm.show_node(node).unwrap();
        assert!(drained(&fields), "{node}: {fields:?}");
        assert_eq!(reason(&fields), why, "{node}: {fields:?}");
    }
    let said = cluster.said("node3");
    assert!(
        said.contains("probity slurm health: node3 is drained by someone else; left as is"),
        "{said}"
    );
    assert!(
        !cluster.said("node1").contains("resumed"),
        "{}",
        cluster.said("node1")
    );
}

/// What the controller or the Prolog writes when the sidecar's blocklist holds a node:
/// `Probity: ...` too, but no finding of this node's agent. Pins a bug: the health
/// check resumed every `Probity: ` drain when its own agent had no finding, so it
/// undid the controller's drain for a block only the server knows, and the two took
/// turns.
#[test]
fn a_probity_drain_made_elsewhere_is_not_resumed_by_the_health_check() {
    let cluster = HealthCluster::start([COOL_C, COOL_C, COOL_C], 2);
    let why = "Probity: integrity.manifest-mismatch: node1 read a file that failed verification";
    cluster.slurm.drain("node1", why);
    cluster.arm();
    let runs = cluster.wait_runs("node1", 3);
    assert!(runs.iter().all(|rc| rc == "0"), "{runs:?}");
    let fields = cluster.slurm.show_node("node1").unwrap();
    assert!(
        drained(&fields) && reason(&fields) == why,
        "{fields:?}\n{}",
        cluster.said("node1")
    );
}

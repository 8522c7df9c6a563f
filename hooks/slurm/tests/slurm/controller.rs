//! The controller's Slurm side: blocks from anywhere drain, unblocks resume only
//! Probity's own drain, and the job that read bad data is requeued held.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::json;

use crate::harness::{Etcd, Sidecar, probity_bin, root};
use crate::slurm_cluster::{Proc, Slurm, SlurmOptions};
use crate::submit::{MAPPING, partitions};

/// Slurm, the sidecar, etcd and `probity slurm controller run` with a certificate the
/// api policies let record events.
struct Harness {
    dir: tempfile::TempDir,
    sidecar: Sidecar,
    slurm: Slurm,
    etcd: Etcd,
    controller: Option<Proc>,
}

impl Harness {
    /// With a breaker wide enough for the test's three nodes.
    fn start() -> Harness {
        Harness::start_with(&["--max-percent", "100"])
    }

    fn start_with(controller: &[&str]) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let sidecar = Sidecar::start(dir.path(), MAPPING);
        let slurm_dir = dir.path().join("slurm");
        std::fs::create_dir_all(&slurm_dir).unwrap();
        let slurm = Slurm::start_in(
            &slurm_dir,
            SlurmOptions {
                partitions: partitions(),
                ..SlurmOptions::default()
            },
        );
        let etcd = Etcd::start(dir.path());
        let mut h = Harness {
            dir,
            sidecar,
            slurm,
            etcd,
            controller: None,
        };
        h.start_controller(controller);
        h
    }

    fn start_controller(&mut self, extra: &[&str]) {
        self.controller = Some(self.spawn_controller("controller", extra));
    }

    /// A `probity slurm controller run` logging to `<name>.log`.
    fn spawn_controller(&self, name: &str, extra: &[&str]) -> Proc {
        let (crt, key) = self.sidecar.pki.issue(name, "probity-controller", &[]);
        Proc::spawn(
            "probity slurm controller",
            Command::new(probity_bin())
                .env("SLURM_CONF", &self.slurm.conf)
                .args(["slurm", "controller", "run", "--etcd", &self.etcd.endpoint])
                .args([
                    "--probity-url",
                    &format!("https://127.0.0.1:{}", self.sidecar.port),
                ])
                .arg("--probity-ca")
                .arg(self.sidecar.pki.ca_file())
                .arg("--probity-cert")
                .arg(crt)
                .arg("--probity-key")
                .arg(key)
                .args(["--slurm-bin", "/usr/bin", "--interval-ms", "200"])
                .args(extra),
            &self.dir.path().join(format!("{name}.log")),
        )
    }

    fn controller_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("controller.log")).unwrap_or_default()
    }

    fn wait_drained(&self, node: &str, what: &str) -> String {
        self.slurm
            .wait_node(node, what, Duration::from_secs(30), |n| {
                n.get("State").is_some_and(|s| s.contains("DRAIN"))
            });
        self.slurm.node_reason(node)
    }

    fn wait_resumed(&self, node: &str) {
        self.slurm
            .wait_node(node, "resumed", Duration::from_secs(30), |n| {
                n.get("State").is_some_and(|s| !s.contains("DRAIN"))
            });
    }
}

#[test]
fn a_block_drains_and_an_unblock_resumes_only_probitys_own_drain() {
    let mut h = Harness::start();
    h.sidecar.block("node1", "operator: bad DIMM");
    let reason = h.wait_drained("node1", "drained for the block");
    assert!(
        reason.starts_with("Probity: "),
        "{reason}\n{}",
        h.controller_log()
    );
    assert!(reason.contains("bad DIMM"), "{reason}");

    // An operator's drain stays as they wrote it, through a block and its release.
    h.slurm.drain("node2", "disk replacement, ticket 42");
    h.sidecar.block("node2", "operator: also bad");
    h.sidecar.unblock("node1");
    h.wait_resumed("node1");
    h.sidecar.unblock("node2");
    // node1's release came after node2's block: the controller has passed node2 since.
    let report = h.wait_report("node2", "release");
    let reason = h.slurm.node_reason("node2");
    assert!(
        reason.starts_with("disk replacement, ticket 42 ["),
        "{reason}: {report}"
    );
    assert!(h.slurm.node_state("node2").contains("DRAIN"));

    // Every action is in Probity's event log, recorded under the controller's name.
    h.controller = None;
    let events = h.sidecar.stop_and_read_events();
    let kinds: Vec<(String, String)> = events
        .iter()
        .filter(|(kind, ..)| kind.starts_with("controller-"))
        .map(|(kind, _, node, _)| (node.clone(), kind.clone()))
        .collect();
    for expected in [
        ("node1", "controller-block-done"),
        ("node1", "controller-release-done"),
        ("node2", "controller-block-unchanged"),
        ("node2", "controller-release-unchanged"),
    ] {
        assert!(
            kinds.contains(&(expected.0.to_owned(), expected.1.to_owned())),
            "{expected:?} in {kinds:?}"
        );
    }
}

impl Harness {
    /// Waits until the controller's state (`probity slurm controller status`) satisfies
    /// `f`; the state.
    fn wait_state(&self, f: impl Fn(&serde_json::Value) -> bool) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut last = String::new();
        while std::time::Instant::now() < deadline {
            let out = Command::new(probity_bin())
                .args([
                    "slurm",
                    "controller",
                    "status",
                    "--etcd",
                    &self.etcd.endpoint,
                ])
                .output()
                .unwrap();
            last = String::from_utf8_lossy(&out.stdout).into_owned();
            if serde_json::from_str::<serde_json::Value>(&last).is_ok_and(|s| f(&s)) {
                return last;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "the controller's state never got there:\n{last}\n{}",
            self.controller_log()
        );
    }

    /// Waits until the controller's report (in etcd, `probity slurm controller status`)
    /// holds an `action` record for `node`; the report.
    fn wait_report(&self, node: &str, action: &str) -> String {
        self.wait_state(|s| {
            s["report"]
                .as_array()
                .is_some_and(|r| r.iter().any(|r| r["node"] == node && r["action"] == action))
        })
    }
}

#[test]
fn the_circuit_breaker_holds_for_slurm_as_for_kubernetes() {
    // Default limits: at most 10% of a pool (at least one node) per window.
    let h = Harness::start_with(&[]);
    h.sidecar.block("node1", "operator: first");
    h.wait_drained("node1", "the first block");
    h.sidecar.block("node2", "operator: second");
    let report = h.wait_report("node2", "block");
    assert!(
        report.contains("circuit breaker (tripped at"),
        "the second node of partition train is refused: {report}"
    );
    assert!(!h.slurm.node_state("node2").contains("DRAIN"), "{report}");
    // An operator resets it; the block is then carried out.
    let out = Command::new(probity_bin())
        .args(["slurm", "controller", "reset", "--etcd", &h.etcd.endpoint])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("breaker: closed"));
    let reason = h.wait_drained("node2", "the second block, after the reset");
    assert!(reason.contains("operator: second"), "{reason}");
}

#[test]
fn a_dry_run_or_a_pause_drains_nothing_until_lifted() {
    let metrics = crate::slurm_cluster::free_port();
    let h = Harness::start_with(&[
        "--max-percent",
        "100",
        "--metrics-listen",
        &format!("127.0.0.1:{metrics}"),
    ]);
    let command = |args: &[&str]| {
        let out = Command::new(probity_bin())
            .args(["slurm", "controller"])
            .args(args)
            .args(["--etcd", &h.etcd.endpoint])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(command(&["dry-run", "on"]).contains("dry run: true"));
    h.sidecar.block("node1", "operator: dry");
    // The pass reports what it would do and does nothing.
    let report = h.wait_state(|s| {
        s["would"].as_array().is_some_and(|w| {
            w.iter()
                .any(|r| r["node"] == "node1" && r["action"] == "block")
        })
    });
    assert!(!h.slurm.node_state("node1").contains("DRAIN"), "{report}");
    // Paused, with the dry run lifted: still nothing.
    command(&["pause"]);
    command(&["dry-run", "off"]);
    h.wait_state(|s| s["paused"] == true && s["dryRun"] == false);
    // Three passes made since, each of which found the pause.
    let seen = passes(metrics);
    crate::slurm_cluster::eventually("three passes while paused", Duration::from_secs(30), || {
        (passes(metrics) >= seen + 3).then_some(())
    });
    assert!(!h.slurm.node_state("node1").contains("DRAIN"));
    // Resumed: the block is carried out.
    assert!(command(&["resume"]).contains("paused: false"));
    let reason = h.wait_drained("node1", "drained once resumed");
    assert!(reason.contains("operator: dry"), "{reason}");
}

#[test]
fn one_controller_acts_and_another_takes_over_when_it_dies() {
    let mut h = Harness::start_with(&[
        "--max-percent",
        "100",
        "--lease-seconds",
        "2",
        "--identity",
        "first",
    ]);
    h.sidecar.block("node1", "operator: first");
    h.wait_drained("node1", "drained by the first controller");
    let second = h.spawn_controller(
        "second",
        &[
            "--max-percent",
            "100",
            "--lease-seconds",
            "2",
            "--identity",
            "second",
        ],
    );
    let second_log =
        || std::fs::read_to_string(h.dir.path().join("second.log")).unwrap_or_default();
    // The second waits: it has tried the leader key and found it the first's.
    crate::slurm_cluster::eventually(
        "the second controller to find the key taken",
        Duration::from_secs(30),
        || second_log().contains("standing by").then_some(()),
    );
    assert!(
        !second_log().contains("holding the leader key"),
        "{}",
        second_log()
    );
    // The first dies without giving the key up (SIGKILL): once its lease lapses, the
    // second holds the key and carries out the next block.
    let first = h.controller.take().unwrap();
    Command::new("kill")
        .args(["-KILL", &first.child.id().to_string()])
        .status()
        .unwrap();
    drop(first);
    h.sidecar.block("node2", "operator: second");
    let reason = h.wait_drained("node2", "drained by the second controller");
    assert!(reason.contains("operator: second"), "{reason}");
    assert!(
        second_log().contains("holding the leader key: acting identity=\"second\""),
        "{}",
        second_log()
    );
    drop(second);
}

/// The controller's `probity_controller_passes_total`, from its metrics endpoint (0
/// while it does not answer yet).
fn passes(port: u16) -> u64 {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return 0;
    };
    let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text);
    text.lines()
        .find_map(|l| l.strip_prefix("probity_controller_passes_total "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// A checkpoint under the sidecar's data root with one byte flipped, beside its signed
/// manifest: its verified read fails.
fn tampered_checkpoint(data: &Path) -> PathBuf {
    let path = data.join("epoch-7.ckpt");
    let mut bytes = std::fs::read(root().join("testdata/integrity/object-7chunks.bin")).unwrap();
    bytes[100] ^= 0x01;
    std::fs::write(&path, bytes).unwrap();
    std::fs::copy(
        root().join("testdata/integrity/signed-manifest-v1.bin"),
        data.join("epoch-7.ckpt.manifest"),
    )
    .unwrap();
    path
}

#[test]
fn a_failed_verified_read_inside_a_job_requeues_it_held_and_drains_the_node() {
    let h = Harness::start();
    let checkpoint = tampered_checkpoint(&h.sidecar.data_dir);
    // The job reads through the sidecar, naming no reader: the sidecar finds the job
    // from the calling process (its slurmstepd ancestor).
    let script = format!(
        "#!/bin/sh\n{probity} verify {path} --id testdata/known-answer --node \"$SLURMD_NODENAME\" --sidecar {socket} > {dir}/read-$SLURM_JOB_ID.json 2>&1\nsleep 60\n",
        probity = probity_bin().display(),
        path = checkpoint.display(),
        socket = h.sidecar.socket.display(),
        dir = h.dir.path().display(),
    );
    let (code, out, err) = h.slurm.sbatch(&["-p", "train", "--parsable"], &script);
    assert_eq!(code, 0, "{out}{err}");
    let id: u32 = out.trim().split(';').next().unwrap().parse().unwrap();
    let read_file = h.dir.path().join(format!("read-{id}.json"));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let job = loop {
        let job = h.slurm.show_job(id).unwrap_or_default();
        if job.get("JobState").is_some_and(|s| s == "PENDING")
            && job.get("Restarts").is_some_and(|r| r == "1")
        {
            break job;
        }
        if std::time::Instant::now() > deadline {
            let blocked = h.sidecar.call("GET", "/v1/nodes/blocked", "").unwrap();
            panic!(
                "job {id} was not requeued: {job:?}\nread: {}\nblocked: {blocked:?}\ncontroller:\n{}",
                std::fs::read_to_string(&read_file).unwrap_or_default(),
                h.controller_log()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let node = "node1";
    let read = std::fs::read_to_string(&read_file).unwrap();
    assert!(read.contains("\"verified\": false"), "{read}");
    let blocked = h.sidecar.json("GET", "/v1/nodes/blocked", &json!({}));
    assert_eq!(
        blocked["nodes"][node]["reader"],
        json!({"namespace": "slurm", "name": format!("job-{id}")}),
        "the block names the job: {blocked}"
    );
    let reason = h.wait_drained(node, "drained for the failed read");
    assert!(
        reason.starts_with("Probity: integrity.unverified-read"),
        "{reason}\n{}",
        h.controller_log()
    );
    assert!(
        job.get("Reason").is_some_and(|r| r.contains("held")),
        "held, not started again elsewhere: {job:?}"
    );
}

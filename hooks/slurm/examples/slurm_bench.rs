//! What Probity costs Slurm, measured on a real cluster (Debian's Slurm 22.05):
//!
//! 1. **The Prolog.** Every job start runs the shipped Prolog's command, timed inside
//!    the wrapper (job start times have one-second resolution): `probity slurm prolog`
//!    (its process, the submission token from the job's comment, the sidecar's answer)
//!    against an empty Prolog (`/bin/true`) timed the same way in the same run, on the
//!    same job. Its own time (from its `--timing-log`, without process start) beside.
//! 2. **Submission.** `sbatch` with the shipped job_submit.lua against a job_submit.lua
//!    that admits at once, alternating job by job on the same cluster; and the
//!    `probity slurm submit` command alone.
//! 3. **Block to drain.** `probity slurm controller run` at its default interval
//!    (500 ms): a block through the API until `scontrol` shows the node drained, and
//!    the unblock until it is resumed, repeated.
//!
//! ```sh
//! cargo build --release -p probity-cli && cargo build --release -p probity-slurm --example slurm_bench
//! target/release/examples/slurm_bench 60 30            # JOBS BLOCKS [prolog|submission|block]...
//! ```

#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

#[path = "../../testsupport/slurm.rs"]
mod slurm_cluster;

#[path = "../tests/slurm/harness.rs"]
mod harness;
#[path = "../../testsupport/unix_http.rs"]
mod unix_http;

use std::process::Command;
use std::time::{Duration, Instant};

use harness::{Etcd, Sidecar, job_submit_lua, lua_env, probity_bin, script};
use slurm_cluster::{Partition, Proc, Slurm, SlurmOptions};

const MAPPING: &str = "namespace = \"partition\"\nclass = [\"comment:class\", \"qos\"]\n";

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn p90(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        f64::NAN
    } else {
        v[(v.len() * 9 / 10).min(v.len() - 1)]
    }
}

fn partitions() -> Vec<Partition> {
    vec![Partition::new("train", &["node1", "node2", "node3"], true)]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let jobs: usize = args.next().map_or(200, |a| a.parse().unwrap());
    let blocks: usize = args.next().map_or(30, |a| a.parse().unwrap());
    // Which parts (default all): prolog, submission, block.
    let only: Vec<String> = args.collect();
    let wants = |part: &str| only.is_empty() || only.iter().any(|o| o == part);
    println!("probity: {}", probity_bin().display());
    if wants("prolog") {
        prolog(jobs);
    }
    if wants("submission") {
        submission(jobs);
    }
    if wants("block") {
        block_to_drain(blocks);
    }
}

fn prolog(jobs: usize) {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = Sidecar::start(dir.path(), MAPPING);
    let slurm_dir = dir.path().join("slurm");
    std::fs::create_dir_all(&slurm_dir).unwrap();
    let times = dir.path().join("prolog-wall");
    let own = dir.path().join("prolog-own");
    // Both timed by the same clock in the same wrapper, on every job.
    let wrapper = script(
        &dir.path().join("prolog"),
        &format!(
            "export SLURM_CONF={conf}\n\
             t0=$(date +%s%N); /bin/true; t1=$(date +%s%N)\n\
             {probity} slurm prolog --socket {socket} --slurm-bin /usr/bin --timing-log {own}; rc=$?\n\
             t2=$(date +%s%N)\n\
             echo \"$((t1 - t0)) $((t2 - t1))\" >> {times}\nexit $rc",
            conf = slurm_dir.join("slurm.conf").display(),
            probity = probity_bin().display(),
            socket = sidecar.socket.display(),
            own = own.display(),
            times = times.display(),
        ),
    );
    let slurm = Slurm::start_in(
        &slurm_dir,
        SlurmOptions {
            partitions: partitions(),
            job_submit_lua: Some(job_submit_lua()),
            env: lua_env(&sidecar, 1500),
            prolog: Some(wrapper),
            ..SlurmOptions::default()
        },
    );
    // One job in flight per node (`sbatch --wait`): the Prolog's own cost, not a queue
    // of a hundred Prologs contending for two CPUs.
    std::thread::scope(|scope| {
        for _ in 0..3 {
            scope.spawn(|| {
                for _ in 0..jobs.div_ceil(3) {
                    let (code, out, err) =
                        slurm.sbatch_wrap(&["--wait", "--comment=class=training"], "true");
                    assert_eq!(code, 0, "{out}{err}");
                }
            });
        }
    });
    let text = std::fs::read_to_string(&times).unwrap();
    let (mut empty, mut probity) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let mut parts = line
            .split_whitespace()
            .map(|n| n.parse::<f64>().unwrap() / 1e6);
        empty.push(parts.next().unwrap());
        probity.push(parts.next().unwrap());
    }
    let own_text = std::fs::read_to_string(&own).unwrap();
    let field = |i: usize| -> Vec<f64> {
        own_text
            .lines()
            .filter_map(|l| l.split_whitespace().nth(i)?.parse::<f64>().ok())
            .map(|us| us / 1e3)
            .collect()
    };
    let mut verdicts = std::collections::BTreeMap::new();
    for line in own_text.lines() {
        *verdicts
            .entry(line.rsplit(' ').next().unwrap_or("").to_owned())
            .or_insert(0) += 1;
    }
    println!(
        "prolog: {} job starts ({verdicts:?}): probity slurm prolog median {:.2} ms (p90 {:.2}); its own time median {:.2} ms, of which finding the submission token {:.2} ms and the sidecar's answer {:.2} ms; empty prolog median {:.2} ms; ratio {:.1}x",
        probity.len(),
        median(probity.clone()),
        p90(probity.clone()),
        median(field(0)),
        median(field(1)),
        median(field(2)),
        median(empty.clone()),
        median(probity) / median(empty),
    );
    slurm.cancel_all(Duration::from_secs(60));
}

fn submission(jobs: usize) {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = Sidecar::start(dir.path(), MAPPING);
    let admit_at_once = "function slurm_job_submit(j, p, u) return slurm.SUCCESS end\n\
                         function slurm_job_modify(j, r, p, u) return slurm.SUCCESS end\n\
                         return slurm.SUCCESS\n";
    // Two clusters side by side, one with Probity's job_submit.lua and one with a
    // script that admits at once, submitted to in turn.
    let cluster = |name: &str, lua: String| {
        let slurm_dir = dir.path().join(name);
        std::fs::create_dir_all(&slurm_dir).unwrap();
        Slurm::start_in(
            &slurm_dir,
            SlurmOptions {
                partitions: partitions(),
                job_submit_lua: Some(lua),
                env: lua_env(&sidecar, 1500),
                ..SlurmOptions::default()
            },
        )
    };
    let probity = cluster("with", job_submit_lua());
    let plain = cluster("without", admit_at_once.to_owned());
    // Held jobs (never started), so the queue is the only thing that grows.
    let submit = |slurm: &Slurm| {
        let t = Instant::now();
        let (code, out, err) = slurm.sbatch_wrap(
            &["--hold", "--parsable", "--comment=class=training"],
            "true",
        );
        assert_eq!(code, 0, "{out}{err}");
        (t.elapsed().as_secs_f64() * 1e3, out.trim().to_owned())
    };
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..jobs {
        let (ms, id) = submit(&probity);
        with.push(ms);
        // Every job of the first cluster was judged: its token is in its admin comment.
        let job = probity.show_job(id.parse().unwrap()).unwrap();
        assert!(job["AdminComment"].starts_with("probity:"), "{job:?}");
        without.push(submit(&plain).0);
    }
    let mut alone = Vec::new();
    for _ in 0..jobs {
        let t = Instant::now();
        let out = Command::new(probity_bin())
            .args(["slurm", "submit", "--socket"])
            .arg(&sidecar.socket)
            .args(["partition=train", "comment=class=training", "min_cpus=1"])
            .output()
            .unwrap();
        alone.push(t.elapsed().as_secs_f64() * 1e3);
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("allow\t"));
    }
    println!(
        "submission: sbatch with Probity's job_submit.lua median {:.2} ms (p90 {:.2}), with one that admits at once {:.2} ms (p90 {:.2}): Probity adds {:.2} ms per job; `probity slurm submit` alone median {:.2} ms",
        median(with.clone()),
        p90(with.clone()),
        median(without.clone()),
        p90(without.clone()),
        median(with) - median(without),
        median(alone),
    );
    probity.cancel_all(Duration::from_secs(60));
    plain.cancel_all(Duration::from_secs(60));
}

fn block_to_drain(blocks: usize) {
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
    let (crt, key) = sidecar.pki.issue("controller", "probity-controller", &[]);
    let _controller = Proc::spawn(
        "probity slurm controller",
        Command::new(probity_bin())
            .env("SLURM_CONF", &slurm.conf)
            .args(["slurm", "controller", "run", "--etcd", &etcd.endpoint])
            .args([
                "--probity-url",
                &format!("https://127.0.0.1:{}", sidecar.port),
            ])
            .arg("--probity-ca")
            .arg(sidecar.pki.ca_file())
            .arg("--probity-cert")
            .arg(crt)
            .arg("--probity-key")
            .arg(key)
            .args([
                "--slurm-bin",
                "/usr/bin",
                "--max-nodes",
                "100000",
                "--max-percent",
                "100",
            ]),
        &dir.path().join("controller.log"),
    );
    let drained = |node: &str| {
        slurm
            .show_node(node)
            .and_then(|n| n.get("State").cloned())
            .is_some_and(|s| s.contains("DRAIN"))
    };
    let wait = |node: &str, want: bool| {
        let t = Instant::now();
        while drained(node) != want {
            assert!(t.elapsed() < Duration::from_secs(30), "{node} never {want}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let (mut drain, mut resume) = (Vec::new(), Vec::new());
    for i in 0..blocks {
        let node = ["node1", "node2", "node3"][i % 3];
        let t = Instant::now();
        sidecar.block(node, "bench: block to drain");
        wait(node, true);
        drain.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        sidecar.unblock(node);
        wait(node, false);
        resume.push(t.elapsed().as_secs_f64() * 1e3);
    }
    println!(
        "block to drain: {} blocks at the default 500 ms interval: median {:.0} ms, p90 {:.0} ms, max {:.0} ms; unblock to resume median {:.0} ms (three answers confirm an absence)",
        drain.len(),
        median(drain.clone()),
        p90(drain.clone()),
        drain.iter().cloned().fold(0.0, f64::max),
        median(resume),
    );
}

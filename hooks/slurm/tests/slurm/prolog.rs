//! Job start: the Prolog asks `schedule` for the job on its node. A node-level refusal
//! drains the node with Probity's reason and fails the Prolog, and Slurm requeues the
//! job onto another node; a job-level refusal requeues the job held and leaves the
//! node up.

use std::path::Path;
use std::time::Duration;

use crate::harness::{Sidecar, job_submit_lua, lua_env, prolog_wrapper};
use crate::slurm_cluster::{Slurm, SlurmOptions};
use crate::submit::{MAPPING, partitions};

/// A cluster whose jobs are admitted by job_submit.lua and started through the
/// shipped Prolog with the configuration it documents (`nohold_on_prolog_fail`).
fn cluster(dir: &Path, sidecar: &Sidecar) -> (Slurm, std::path::PathBuf) {
    let slurm_dir = dir.join("slurm");
    std::fs::create_dir_all(&slurm_dir).unwrap();
    let timing = dir.join("prolog-times");
    let prolog = prolog_wrapper(dir, sidecar, &slurm_dir.join("slurm.conf"), &timing);
    let slurm = Slurm::start_in(
        &slurm_dir,
        SlurmOptions {
            partitions: partitions(),
            job_submit_lua: Some(job_submit_lua()),
            env: lua_env(sidecar, 1500),
            prolog: Some(prolog),
            scheduler_parameters: Some("nohold_on_prolog_fail".into()),
            ..SlurmOptions::default()
        },
    );
    (slurm, timing)
}

#[test]
fn a_job_whose_node_is_blocked_is_requeued_elsewhere_and_the_node_drained() {
    let dir = tempfile::tempdir().unwrap();
    let mut sidecar = Sidecar::start(dir.path(), MAPPING);
    let (slurm, timing) = cluster(dir.path(), &sidecar);
    // Blocked in Probity, and no controller has drained it yet: only the Prolog stands
    // between the job and node1 (Slurm's first choice).
    sidecar.block("node1", "operator: bad DIMM");
    let id = slurm.submit(
        &["-p", "train", "-N", "1", "--comment=class=training"],
        "sleep 60",
    );
    let state = slurm.wait_node(
        "node1",
        "drained by the Prolog",
        Duration::from_secs(30),
        |n| n.get("State").is_some_and(|s| s.contains("DRAIN")),
    );
    let reason = slurm.node_reason("node1");
    assert!(
        reason.starts_with("Probity: security.blocked-node: "),
        "the operator sees which rule drained it: {reason:?} ({state:?})"
    );
    // Requeued without a hold, it runs on node2 once Slurm lets it start again.
    slurm.wait_job_state(id, &["RUNNING"], Duration::from_secs(60));
    let job = slurm.show_job(id).unwrap();
    assert_eq!(job["NodeList"], "node2", "{job:?}");
    assert_eq!(job["Restarts"], "1", "{job:?}");
    assert!(!slurm.node_state("node2").contains("DRAIN"));

    // The Prolog timed itself: one refusal on node1, one allow on node2. Slurm shows the
    // job running once it is allocated, which can be before node2's Prolog has
    // written its line (a flake seen in CI): wait for the line.
    let allowed = format!("{id} node2 allow");
    let times =
        crate::slurm_cluster::eventually("node2's Prolog line", Duration::from_secs(30), || {
            let times = std::fs::read_to_string(&timing).unwrap_or_default();
            times
                .lines()
                .any(|l| l.ends_with(&allowed))
                .then_some(times)
        });
    assert!(
        times
            .lines()
            .any(|l| l.ends_with(&format!("{id} node1 node"))),
        "{times}"
    );
    assert!(
        times
            .lines()
            .any(|l| l.ends_with(&format!("{id} node2 allow"))),
        "{times}"
    );
    slurm.cancel_all(Duration::from_secs(30));

    // The refusal is in Probity's event log, with the job, the node and the rule.
    let events = sidecar.stop_and_read_events();
    assert!(
        events.iter().any(
            |(kind, object, node, detail)| kind == "slurm-prolog-refused"
                && object == &format!("slurm-job/{id}")
                && node == "node1"
                && detail.contains("security.blocked-node")
        ),
        "{events:?}"
    );
}

#[test]
fn a_job_level_refusal_requeues_the_job_held_and_leaves_the_node_up() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = Sidecar::start(dir.path(), MAPPING);
    let (slurm, _) = cluster(dir.path(), &sidecar);
    // More GPU memory per GPU than any node's headroom: the node is fine, the job is not.
    let id = slurm.submit(
        &[
            "-p",
            "train",
            "--gres=gpu:1",
            "--comment=class=training,gpu_mem_mib=90000",
        ],
        "sleep 60",
    );
    slurm.wait_job_state(id, &["PENDING"], Duration::from_secs(30));
    let job = slurm.wait_job(id, "requeued held", Duration::from_secs(30), |j| {
        j.get("Reason")
            .is_some_and(|r| r.contains("held") || r.contains("Held"))
    });
    let admin = job.get("AdminComment").cloned().unwrap_or_default();
    assert!(
        admin.contains("Probity: placement.gpu-memory-headroom: "),
        "the job says why: {job:?}"
    );
    assert!(
        admin.starts_with("probity:"),
        "the token stays first: {admin}"
    );
    for node in ["node1", "node2", "node3"] {
        let state = slurm.node_state(node);
        assert!(!state.contains("DRAIN"), "{node}: {state}");
    }
    slurm.cancel_all(Duration::from_secs(30));
}

#[test]
fn a_job_probity_has_no_facts_for_is_refused_at_start_without_draining() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = Sidecar::start(dir.path(), MAPPING);
    let slurm_dir = dir.path().join("slurm");
    std::fs::create_dir_all(&slurm_dir).unwrap();
    let timing = dir.path().join("prolog-times");
    let prolog = prolog_wrapper(dir.path(), &sidecar, &slurm_dir.join("slurm.conf"), &timing);
    // No job_submit.lua: the job was never judged.
    let slurm = Slurm::start_in(
        &slurm_dir,
        SlurmOptions {
            partitions: partitions(),
            prolog: Some(prolog),
            scheduler_parameters: Some("nohold_on_prolog_fail".into()),
            ..SlurmOptions::default()
        },
    );
    let id = slurm.submit(&["-p", "train"], "sleep 60");
    let job = slurm.wait_job(id, "requeued held", Duration::from_secs(30), |j| {
        j.get("Reason")
            .is_some_and(|r| r.contains("held") || r.contains("Held"))
    });
    assert!(
        job.get("AdminComment").is_some_and(
            |c| c.contains("Probity: slurm.unknown-job: no facts are remembered for job")
        ),
        "{job:?}"
    );
    assert!(!slurm.node_state("node1").contains("DRAIN"));
    slurm.cancel_all(Duration::from_secs(30));
}

#[test]
fn every_task_of_a_job_array_starts_with_its_submissions_facts() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = Sidecar::start(dir.path(), MAPPING);
    let (slurm, timing) = cluster(dir.path(), &sidecar);
    // One submission, three job ids: each task's Prolog finds the facts judged once.
    let (code, out, err) = slurm.sbatch_wrap(
        &["-p", "train", "--array=0-2", "--comment=class=training"],
        "sleep 30",
    );
    assert_eq!(code, 0, "{out}{err}");
    crate::slurm_cluster::eventually("three array tasks allowed", Duration::from_secs(60), || {
        let times = std::fs::read_to_string(&timing).unwrap_or_default();
        (times.lines().filter(|l| l.ends_with(" allow")).count() >= 3).then_some(())
    });
    let times = std::fs::read_to_string(&timing).unwrap();
    assert!(
        !times
            .lines()
            .any(|l| l.ends_with(" job") || l.ends_with(" node")),
        "{times}"
    );
    slurm.cancel_all(Duration::from_secs(30));
}

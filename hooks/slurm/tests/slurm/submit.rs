//! Submission: job_submit.lua asks Probity through `probity slurm submit`, and a
//! refusal reaches `sbatch` as Probity's own message.

use std::time::Duration;

use crate::harness::{Sidecar, job_submit_lua, lua_env};
use crate::slurm_cluster::{Partition, Slurm, SlurmOptions};

/// node1 and node2 in `train` (the default) and `inference`, node3 in `rlhf`.
pub fn partitions() -> Vec<Partition> {
    vec![
        Partition::new("train", &["node1", "node2"], true),
        Partition::new("inference", &["node1", "node2"], false),
        Partition::new("rlhf", &["node3"], false),
    ]
}

/// How the tests' jobs read as workloads: the partition names the namespace, the
/// comment's `class=` the class, `gpu_mem_mib=` the GPU memory.
pub const MAPPING: &str = "namespace = \"partition\"\nclass = [\"comment:class\", \"qos\"]\n\
                           gpu_gres = \"gpu\"\ngpu_memory = \"comment:gpu_mem_mib\"\n";

fn cluster(dir: &std::path::Path, sidecar: &Sidecar, timeout_ms: u32) -> Slurm {
    std::fs::create_dir_all(dir).unwrap();
    Slurm::start_in(
        dir,
        SlurmOptions {
            partitions: partitions(),
            job_submit_lua: Some(job_submit_lua()),
            env: lua_env(sidecar, timeout_ms),
            ..SlurmOptions::default()
        },
    )
}

#[test]
fn a_job_is_admitted_or_refused_at_sbatch_with_probitys_message() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = Sidecar::start(dir.path(), MAPPING);
    let slurm = cluster(&dir.path().join("slurm"), &sidecar, 1500);

    // The inference partition keeps 8 CPUs per GPU: 1 GPU with 4 CPUs is refused, and
    // sbatch prints Probity's rule and message.
    let (code, _, err) = slurm.sbatch_wrap(
        &[
            "-p",
            "inference",
            "--gres=gpu:1",
            "-c",
            "4",
            "--comment=class=inference",
        ],
        "true",
    );
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("sbatch: error: Probity: placement.inference-gpu-cpu-ratio: "),
        "{err}"
    );

    // With 8 CPUs it is admitted, and its submission token is kept where only an
    // operator could have written it.
    let id = slurm.submit(
        &[
            "-p",
            "inference",
            "--gres=gpu:1",
            "-c",
            "8",
            "--comment=class=inference",
        ],
        "sleep 30",
    );
    let job = slurm.show_job(id).unwrap();
    let admin = job.get("AdminComment").cloned().unwrap_or_default();
    assert!(admin.starts_with("probity:"), "{job:?}");
    assert!(admin.len() > "probity:".len() + 16, "{admin}");
    // The same token ends the job's comment, where the Prolog's environment has it.
    assert_eq!(
        job["Comment"],
        format!("class=inference {admin}"),
        "{job:?}"
    );

    // A token the user wrote into their comment is dropped: only Probity's is kept.
    let id = slurm.submit(
        &[
            "-p",
            "train",
            "--comment=class=training probity:0123456789abcdef0123456789abcdef",
        ],
        "sleep 30",
    );
    let job = slurm.show_job(id).unwrap();
    let comment = &job["Comment"];
    assert!(
        !comment.contains("0123456789abcdef0123456789abcdef"),
        "{job:?}"
    );
    assert_eq!(comment.matches("probity:").count(), 1, "{job:?}");
    assert!(comment.ends_with(job["AdminComment"].as_str()), "{job:?}");

    // An unknown class is refused, naming it; the class may also come from the QOS
    // (not configured here: no class at all is refused too).
    let (code, _, err) = slurm.sbatch_wrap(&["-p", "train", "--comment=class=mystery"], "true");
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("Probity: placement.unknown-workload-class: workload class \"mystery\""),
        "{err}"
    );
    let (code, _, err) = slurm.sbatch_wrap(&["-p", "train"], "true");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("placement.unknown-workload-class"), "{err}");

    // RL-HF work only in its partition (or node set): refused in train, admitted in rlhf.
    let (code, _, err) = slurm.sbatch_wrap(&["-p", "train", "--comment=class=rlhf"], "true");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("Probity: placement.rlhf-partition: "), "{err}");
    let (code, out, err) = slurm.sbatch_wrap(&["-p", "rlhf", "--comment=class=rlhf"], "true");
    assert_eq!(code, 0, "{out}{err}");

    // A job without `-p` is judged in the default partition (train).
    let (code, out, err) = slurm.sbatch_wrap(&["--comment=class=training"], "true");
    assert_eq!(code, 0, "{out}{err}");

    // Training work with GPUs in train: admitted.
    let (code, out, err) = slurm.sbatch_wrap(
        &["-p", "train", "--gres=gpu:2", "--comment=class=training"],
        "true",
    );
    assert_eq!(code, 0, "{out}{err}");
    slurm.cancel_all(Duration::from_secs(30));
}

#[test]
fn a_warn_mode_policy_admits_the_job_and_tells_the_submitter() {
    let dir = tempfile::tempdir().unwrap();
    let mut sidecar = Sidecar::start(dir.path(), MAPPING);
    sidecar
        .restart_with_policy_lines("\n[modes]\n\"placement.inference-gpu-cpu-ratio\" = \"warn\"\n");
    let slurm = cluster(&dir.path().join("slurm"), &sidecar, 1500);
    let (code, out, err) = slurm.sbatch_wrap(
        &[
            "-p",
            "inference",
            "--gres=gpu:1",
            "-c",
            "4",
            "--comment=class=inference",
        ],
        "true",
    );
    assert_eq!(code, 0, "admitted: {out}{err}");
    assert!(
        err.contains("Probity: placement.inference-gpu-cpu-ratio: "),
        "the submitter sees the warning: {out}{err}"
    );
    slurm.cancel_all(Duration::from_secs(30));
}

#[test]
fn when_probity_cannot_answer_in_time_the_job_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut sidecar = Sidecar::start(dir.path(), MAPPING);
    let slurm = cluster(&dir.path().join("slurm"), &sidecar, 400);

    // No sidecar at all: refused at once, saying why.
    sidecar.stop();
    let (code, _, err) = slurm.sbatch_wrap(&["-p", "train", "--comment=class=training"], "true");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("Probity could not decide"), "{err}");
    assert!(err.contains("cannot connect"), "{err}");

    // A sidecar that accepts and never answers: refused at Probity's own deadline
    // (slurmctld runs job_submit.lua under its locks).
    let _ = std::fs::remove_file(&sidecar.socket);
    let _silent = std::os::unix::net::UnixListener::bind(&sidecar.socket).unwrap();
    let (code, _, err) = slurm.sbatch_wrap(&["-p", "train", "--comment=class=training"], "true");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no answer within 400ms"), "{err}");
}

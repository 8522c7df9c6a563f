//! Finding the Slurm job a local caller runs in, so that a reader inside a job may read
//! as that job (`{"namespace": <[slurm] reader_namespace>, "name": "job-<id>"}`) and no
//! other: a failed read's block names its reader, and the controller requeues the job it
//! names, so a process that could name any job could have another user's job stopped.
//!
//! Two ways, in order, each from facts the caller cannot forge:
//!
//! 1. **Its cgroup.** Slurm's cgroup plugins put every process of a job under a
//!    `job_<id>` cgroup: cgroup v1 `/slurm/uid_<uid>/job_<id>/step_<step>` (or
//!    `/slurm_<node>/...` with several slurmd per host), cgroup v2
//!    `/system.slice/slurmstepd.scope/job_<id>/step_<step>/user/task_<n>`. Only those
//!    paths count, from the root: a user can make cgroups named `job_<id>` under a
//!    subtree systemd delegates to them (`user@<uid>.service`), never under `/slurm` or
//!    `/system.slice`.
//! 2. **Its slurmstepd.** Without a job cgroup (proctrack/pgid or linuxproc), the
//!    caller's ancestors (`PPid` of `/proc/<pid>/status`, at most [`MAX_ANCESTORS`]
//!    steps) up to a process whose executable (`/proc/<pid>/exe`) is a file named
//!    `slurmstepd` (or Debian's `slurmstepd-wlm`), whose real uid is 0, and whose command line is the step's title,
//!    `slurmstepd: [<id>.<step>]`: the job id is `<id>`. A user's own binary named
//!    slurmstepd does not run as root.
//!
//! The parsing is pure and tested on real-looking texts; [`ProcessTable`] is the only
//! reader of `/proc`, each read bounded.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::PathBuf;

use crate::reader_claim::MAX_CGROUP_BYTES;

/// Most ancestors walked looking for a slurmstepd.
pub(crate) const MAX_ANCESTORS: usize = 64;

/// Largest `/proc/<pid>/status` or `cmdline` read (a real one is about 1.5 KiB; a
/// command line may be long, and only its beginning is read).
const MAX_PROC_BYTES: usize = 64 * 1024;

/// Why a local caller's claim to be a Slurm job is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlurmJobError {
    /// The peer's pid is not visible to the server (another pid namespace).
    #[error(
        "the calling process's pid is not visible to the server, so its Slurm job cannot be checked"
    )]
    NoPid,
    /// Its cgroup file could not be read.
    #[error("cannot read the cgroup of calling process {pid}: {problem}")]
    Unreadable {
        /// The peer's pid.
        pid: i32,
        /// Why.
        problem: String,
    },
    /// Its cgroup file names more than one job.
    #[error("the calling process's cgroup names several Slurm jobs ({found})")]
    Ambiguous {
        /// The jobs named.
        found: String,
    },
    /// The caller runs in no Slurm job.
    #[error(
        "reader.name: the calling process runs in no Slurm job, so it cannot read as job {claimed}"
    )]
    NoJob {
        /// The job it claimed.
        claimed: u64,
    },
    /// The caller runs in another job.
    #[error(
        "reader.name: the calling process runs in Slurm job {found}, not the claimed job {claimed}"
    )]
    OtherJob {
        /// The job it claimed.
        claimed: u64,
        /// The job it runs in.
        found: u64,
    },
}

/// The job ids in a cgroup file's Slurm job paths (see the module documentation).
pub(crate) fn jobs_in_cgroup(cgroup: &str) -> BTreeSet<u64> {
    let mut jobs = BTreeSet::new();
    for line in cgroup.lines() {
        // `hierarchy-id:controllers:path`; the path may itself hold `:`.
        let Some(path) = line.splitn(3, ':').nth(2) else {
            continue;
        };
        let segments: Vec<&str> = path.split('/').collect();
        let (Some(&""), Some(first), Some(second), Some(third)) = (
            segments.first(),
            segments.get(1),
            segments.get(2),
            segments.get(3),
        ) else {
            continue;
        };
        let v1 = (*first == "slurm" || first.starts_with("slurm_"))
            && second
                .strip_prefix("uid_")
                .is_some_and(|u| !u.is_empty() && u.bytes().all(|b| b.is_ascii_digit()));
        let v2 = *first == "system.slice"
            && (*second == "slurmstepd.scope" || second.ends_with("_slurmstepd.scope"));
        if (v1 || v2)
            && let Some(job) = third.strip_prefix("job_").and_then(job_id)
        {
            jobs.insert(job);
        }
    }
    jobs
}

/// `text` as a job id: 1 to 20 digits that fit a u64.
pub(crate) fn job_id(text: &str) -> Option<u64> {
    if text.is_empty() || text.len() > 20 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// The parent pid of a `/proc/<pid>/status` text.
pub(crate) fn parent_pid(status: &str) -> Option<i32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The real uid (the first of `Uid:`'s four) of a `/proc/<pid>/status` text.
pub(crate) fn real_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|u| u.parse().ok())
}

/// The job id of a slurmstepd's title, `slurmstepd: [<id>.<step>]`, from its
/// `/proc/<pid>/cmdline` (the title overwrites its arguments; NUL-separated).
pub(crate) fn step_job(cmdline: &[u8]) -> Option<u64> {
    let first = cmdline.split(|b| *b == 0).next()?;
    let rest = first.strip_prefix(b"slurmstepd: [")?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if rest.get(digits) != Some(&b'.') {
        return None;
    }
    job_id(std::str::from_utf8(rest.get(..digits)?).ok()?)
}

/// What [`find_job`] reads of a process; the host's `/proc` is [`HostProcesses`].
pub(crate) trait ProcessTable {
    /// `/proc/<pid>/cgroup`, at most [`MAX_CGROUP_BYTES`] and one more.
    fn cgroup(&self, pid: i32) -> std::io::Result<Vec<u8>>;
    /// `/proc/<pid>/status`.
    fn status(&self, pid: i32) -> std::io::Result<String>;
    /// Where `/proc/<pid>/exe` leads.
    fn exe(&self, pid: i32) -> std::io::Result<PathBuf>;
    /// `/proc/<pid>/cmdline`.
    fn cmdline(&self, pid: i32) -> std::io::Result<Vec<u8>>;
}

/// The host's `/proc`, each file read within its bound.
pub(crate) struct HostProcesses;

fn read_bounded(path: String, limit: usize) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    std::fs::File::open(path)?
        .take(limit as u64 + 1)
        .read_to_end(&mut out)?;
    Ok(out)
}

impl ProcessTable for HostProcesses {
    fn cgroup(&self, pid: i32) -> std::io::Result<Vec<u8>> {
        read_bounded(format!("/proc/{pid}/cgroup"), MAX_CGROUP_BYTES)
    }

    fn status(&self, pid: i32) -> std::io::Result<String> {
        let bytes = read_bounded(format!("/proc/{pid}/status"), MAX_PROC_BYTES)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn exe(&self, pid: i32) -> std::io::Result<PathBuf> {
        std::fs::read_link(format!("/proc/{pid}/exe"))
    }

    fn cmdline(&self, pid: i32) -> std::io::Result<Vec<u8>> {
        read_bounded(format!("/proc/{pid}/cmdline"), MAX_PROC_BYTES)
    }
}

/// The Slurm job process `pid` runs in, if any: by its cgroup, else by its slurmstepd
/// ancestor (see the module documentation).
pub(crate) fn find_job(procs: &impl ProcessTable, pid: i32) -> Result<Option<u64>, SlurmJobError> {
    if pid <= 0 {
        return Err(SlurmJobError::NoPid);
    }
    let cgroup = procs.cgroup(pid).map_err(|e| SlurmJobError::Unreadable {
        pid,
        problem: e.to_string(),
    })?;
    if cgroup.len() > MAX_CGROUP_BYTES {
        return Err(SlurmJobError::Unreadable {
            pid,
            problem: format!("its cgroup file is over {MAX_CGROUP_BYTES} bytes"),
        });
    }
    let jobs = jobs_in_cgroup(&String::from_utf8_lossy(&cgroup));
    match (jobs.len(), jobs.first()) {
        (1, Some(job)) => return Ok(Some(*job)),
        (0, _) => {}
        _ => {
            return Err(SlurmJobError::Ambiguous {
                found: jobs
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
    }
    Ok(stepd_ancestor(procs, pid))
}

/// Whether an executable's file name is slurmstepd's: `slurmstepd`, or a packaging's
/// variant of it (Debian installs `/usr/sbin/slurmstepd-wlm`, `slurmstepd` being an
/// alternatives link the kernel resolves).
fn is_stepd_binary(name: &std::ffi::OsStr) -> bool {
    name == "slurmstepd" || name == "slurmstepd-wlm"
}

/// The job of the first slurmstepd among `pid`'s ancestors. A process that exits
/// during the walk ends it: no job.
fn stepd_ancestor(procs: &impl ProcessTable, pid: i32) -> Option<u64> {
    let mut current = pid;
    for _ in 0..MAX_ANCESTORS {
        let parent = parent_pid(&procs.status(current).ok()?)?;
        if parent <= 1 {
            return None;
        }
        let is_stepd = procs
            .exe(parent)
            .ok()
            .is_some_and(|p| p.file_name().is_some_and(is_stepd_binary));
        if is_stepd {
            let status = procs.status(parent).ok()?;
            if real_uid(&status) == Some(0)
                && let Some(job) = procs.cmdline(parent).ok().as_deref().and_then(step_job)
            {
                return Some(job);
            }
        }
        current = parent;
    }
    None
}

/// Checks a claim to be job `claimed` against the job process `pid` runs in.
pub(crate) fn check_job_claim(
    procs: &impl ProcessTable,
    pid: i32,
    claimed: u64,
) -> Result<(), SlurmJobError> {
    match find_job(procs, pid)? {
        Some(found) if found == claimed => Ok(()),
        Some(found) => Err(SlurmJobError::OtherJob { claimed, found }),
        None => Err(SlurmJobError::NoJob { claimed }),
    }
}

/// The job id a Slurm reader's name (`job-<id>`) claims.
pub(crate) fn claimed_job(name: &str) -> Option<u64> {
    name.strip_prefix("job-").and_then(job_id)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use std::collections::BTreeMap;

    /// cgroup v1 (task/cgroup, proctrack/cgroup): the batch step of job 12 of uid 1000.
    const V1: &str = "12:pids:/slurm/uid_1000/job_12/step_batch\n\
11:memory:/slurm/uid_1000/job_12/step_batch/task_0\n\
4:devices:/slurm/uid_1000/job_12/step_batch\n\
3:cpuset:/slurm/uid_1000/job_12/step_batch\n\
1:name=systemd:/system.slice/slurmd.service\n";

    /// cgroup v2 (cgroup/v2 plugin): task 0 of step 0 of job 12.
    const V2: &str = "0::/system.slice/slurmstepd.scope/job_12/step_0/user/task_0\n";

    /// A slurmstepd's own v2 cgroup, outside any job.
    const STEPD_SYSTEM: &str = "0::/system.slice/slurmstepd.scope/system\n";

    /// A user's delegated subtree, with a cgroup named like a job.
    const FORGED: &str = "0::/user.slice/user-1000.slice/user@1000.service/job_99/app.scope\n";

    /// `/proc/<pid>/status` of a task (abridged, as the kernel writes it).
    const TASK_STATUS: &str = "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\nNgid:\t0\nPid:\t4242\nPPid:\t4200\nTracerPid:\t0\nUid:\t1000\t1000\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\nFDSize:\t64\n";

    #[test]
    fn slurm_job_cgroups_are_found_in_v1_and_v2_and_only_from_the_root() {
        assert_eq!(jobs_in_cgroup(V1).into_iter().collect::<Vec<_>>(), [12]);
        assert_eq!(jobs_in_cgroup(V2).into_iter().collect::<Vec<_>>(), [12]);
        assert_eq!(
            jobs_in_cgroup("5:memory:/slurm_node7/uid_0/job_3/step_extern\n")
                .into_iter()
                .collect::<Vec<_>>(),
            [3]
        );
        for text in [
            STEPD_SYSTEM,
            FORGED,
            "0::/user.slice/user-1000.slice/user@1000.service/slurmstepd.scope/job_99\n",
            "0::/kubepods/burstable/pod3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b/job_12\n",
            "0::/system.slice/slurmstepd.scope/job_\n",
            "0::/system.slice/slurmstepd.scope/job_12x/step_0\n",
            "0::/slurm/uid_x/job_12\n",
            "0::/slurm/job_12\n",
            "0::/system.slice/slurmstepd.scope/job_123456789012345678901\n",
            "no colons /system.slice/slurmstepd.scope/job_12",
            "",
        ] {
            assert!(jobs_in_cgroup(text).is_empty(), "{text}");
        }
        let two = format!("{V2}3:cpuset:/slurm/uid_0/job_13/step_0\n");
        assert_eq!(jobs_in_cgroup(&two).len(), 2);
    }

    #[test]
    fn status_gives_the_parent_and_the_real_uid() {
        assert_eq!(parent_pid(TASK_STATUS), Some(4200));
        assert_eq!(real_uid(TASK_STATUS), Some(1000));
        let root = "Name:\tslurmstepd\nPPid:\t1\nUid:\t0\t0\t0\t0\n";
        assert_eq!((parent_pid(root), real_uid(root)), (Some(1), Some(0)));
        // Effective root is not real root.
        assert_eq!(real_uid("Uid:\t1000\t0\t0\t0\n"), Some(1000));
        assert_eq!(parent_pid("Name:\tx\n"), None);
        assert_eq!(parent_pid("PPid:\tx\n"), None);
    }

    #[test]
    fn a_steps_title_gives_its_job() {
        assert_eq!(step_job(b"slurmstepd: [12.batch]\0\0\0\0\0\0"), Some(12));
        assert_eq!(step_job(b"slurmstepd: [12.0]"), Some(12));
        assert_eq!(step_job(b"slurmstepd: [7.extern]\0"), Some(7));
        for cmdline in [
            &b"slurmstepd: [12]"[..],
            b"slurmstepd: [.batch]",
            b"slurmstepd: [x.batch]",
            b"/usr/sbin/slurmstepd\0",
            b"slurmstepd:[12.batch]",
            b"python3\0slurmstepd: [12.batch]",
            b"",
        ] {
            assert_eq!(
                step_job(cmdline),
                None,
                "{}",
                String::from_utf8_lossy(cmdline)
            );
        }
    }

    /// A process table made of texts.
    #[derive(Default)]
    struct Fake {
        procs: BTreeMap<i32, (String, String, PathBuf, Vec<u8>)>,
    }

    impl Fake {
        fn with(
            mut self,
            pid: i32,
            ppid: i32,
            uid: u32,
            exe: &str,
            cmdline: &[u8],
            cgroup: &str,
        ) -> Self {
            let status =
                format!("Name:\tx\nPid:\t{pid}\nPPid:\t{ppid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n");
            self.procs
                .insert(pid, (cgroup.into(), status, exe.into(), cmdline.to_vec()));
            self
        }

        fn get(&self, pid: i32) -> std::io::Result<&(String, String, PathBuf, Vec<u8>)> {
            self.procs
                .get(&pid)
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
        }
    }

    impl ProcessTable for Fake {
        fn cgroup(&self, pid: i32) -> std::io::Result<Vec<u8>> {
            Ok(self.get(pid)?.0.clone().into_bytes())
        }
        fn status(&self, pid: i32) -> std::io::Result<String> {
            Ok(self.get(pid)?.1.clone())
        }
        fn exe(&self, pid: i32) -> std::io::Result<PathBuf> {
            Ok(self.get(pid)?.2.clone())
        }
        fn cmdline(&self, pid: i32) -> std::io::Result<Vec<u8>> {
            Ok(self.get(pid)?.3.clone())
        }
    }

    const HOST: &str = "0::/system.slice/slurmd.service\n";

    #[test]
    fn the_walk_finds_a_root_slurmstepd_ancestor_and_nothing_else() {
        // slurmd (100) -> slurmstepd [12.batch] (200, root) -> bash (300) -> python (400)
        let tree = Fake::default()
            .with(
                100,
                1,
                0,
                "/usr/sbin/slurmd",
                b"/usr/sbin/slurmd\0-D\0",
                HOST,
            )
            .with(
                200,
                100,
                0,
                "/usr/sbin/slurmstepd",
                b"slurmstepd: [12.batch]\0\0",
                HOST,
            )
            .with(
                300,
                200,
                1000,
                "/usr/bin/bash",
                b"/bin/bash\0job.sh\0",
                HOST,
            )
            .with(
                400,
                300,
                1000,
                "/usr/bin/python3",
                b"python3\0train.py\0",
                HOST,
            );
        assert_eq!(find_job(&tree, 400), Ok(Some(12)));
        assert_eq!(check_job_claim(&tree, 400, 12), Ok(()));
        // Debian's package installs it as slurmstepd-wlm (a bug pinned on real Slurm:
        // the walk named no job).
        let debian = Fake::default()
            .with(
                200,
                100,
                0,
                "/usr/sbin/slurmstepd-wlm",
                b"slurmstepd: [7.batch]\0",
                HOST,
            )
            .with(300, 200, 1000, "/usr/bin/bash", b"bash\0", HOST);
        assert_eq!(find_job(&debian, 300), Ok(Some(7)));
        assert_eq!(
            check_job_claim(&tree, 400, 13).unwrap_err().to_string(),
            "reader.name: the calling process runs in Slurm job 12, not the claimed job 13"
        );
        // The cgroup is asked first.
        let caged = Fake::default().with(400, 1, 1000, "/usr/bin/python3", b"python3\0", V2);
        assert_eq!(find_job(&caged, 400), Ok(Some(12)));
        // A user's own slurmstepd (not root) names nothing; nor does a root process
        // that is not slurmstepd but claims its title.
        let forged = Fake::default()
            .with(
                200,
                1,
                1000,
                "/home/u/slurmstepd",
                b"slurmstepd: [12.batch]\0",
                HOST,
            )
            .with(
                210,
                200,
                0,
                "/usr/bin/sudo",
                b"slurmstepd: [13.batch]\0",
                HOST,
            )
            .with(300, 210, 1000, "/usr/bin/python3", b"python3\0", FORGED);
        assert_eq!(find_job(&forged, 300), Ok(None));
        assert_eq!(
            check_job_claim(&forged, 300, 12).unwrap_err().to_string(),
            "reader.name: the calling process runs in no Slurm job, so it cannot read as job 12"
        );
        // A cycle (or a chain longer than the bound) ends the walk.
        let cycle = Fake::default()
            .with(10, 11, 1000, "/bin/a", b"a\0", HOST)
            .with(11, 10, 1000, "/bin/b", b"b\0", HOST);
        assert_eq!(find_job(&cycle, 10), Ok(None));
        // An ancestor that exited mid-walk ends it too.
        let orphan = Fake::default().with(10, 99, 1000, "/bin/a", b"a\0", HOST);
        assert_eq!(find_job(&orphan, 10), Ok(None));
        assert_eq!(find_job(&orphan, 0), Err(SlurmJobError::NoPid));
        assert!(matches!(
            find_job(&orphan, 11),
            Err(SlurmJobError::Unreadable { pid: 11, .. })
        ));
        let two = Fake::default().with(
            10,
            1,
            1000,
            "/bin/a",
            b"a\0",
            &format!("{V2}3:cpuset:/slurm/uid_0/job_13/step_0\n"),
        );
        assert_eq!(
            find_job(&two, 10),
            Err(SlurmJobError::Ambiguous {
                found: "12, 13".into()
            })
        );
    }

    #[test]
    fn reader_names_claim_a_job() {
        assert_eq!(claimed_job("job-12"), Some(12));
        assert_eq!(claimed_job("job-"), None);
        assert_eq!(claimed_job("job-12a"), None);
        assert_eq!(claimed_job("12"), None);
    }

    #[test]
    fn a_real_child_runs_in_its_parents_job_or_none() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let found = find_job(&HostProcesses, pid);
        child.kill().unwrap();
        child.wait().unwrap();
        // Outside Slurm (as the suite usually runs), no job; inside a job, the same
        // job as this test process.
        let own = find_job(&HostProcesses, i32::try_from(std::process::id()).unwrap());
        assert_eq!(found, own);
        assert!(own.is_ok());
    }
}

//! A real Slurm cluster inside a test's temporary directory: `munged`, `slurmctld -D`
//! and one `slurmd -D -N nodeK` per node (Debian's Slurm is built with
//! --enable-multiple-slurmd), all on loopback, each stopped by PID when the cluster drops.
//!
//! Why a file and not a crate: like `services.rs`, it is test code only, included by
//! test binaries through `#[path]`. It is self-contained but for `ports.rs` (its own
//! `Proc` and `eventually`, so it needs no other sibling module) and uses the standard
//! library and `tempfile` alone.
//!
//! Nothing outside the directory is read or written: munged gets its own key, socket,
//! pid and seed files; every Slurm path (state, spool, pid, log, gres device files,
//! `job_submit.lua`) is under it, and every client runs with `SLURM_CONF` pointing at
//! the cluster's `slurm.conf`, whose `AuthInfo=socket=` sends clients and daemons to the
//! cluster's munged (not /run/munge).
//!
//! What the scripts Slurm runs see (Slurm 22.05.8, measured):
//! - Prolog/Epilog: SLURM_JOB_ID, SLURMD_NODENAME, SLURM_JOB_PARTITION,
//!   SLURM_JOB_ACCOUNT, SLURM_JOB_COMMENT, SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES,
//!   SLURM_JOB_RESTART_COUNT, SLURM_CONF... but no PATH and not the daemons' environment.
//! - HealthCheckProgram: only PWD and SLURMD_NODENAME (no PATH, no SLURM_CONF): a
//!   script that runs `scontrol` must name it by path and set SLURM_CONF itself.
//! - job_submit.lua runs inside slurmctld, so `os.getenv` sees `SlurmOptions::env`.
//!   It is not given the job id (`job_desc.job_id` is nil); what it sets in
//!   `job_desc.admin_comment` the Prolog reads back with `scontrol show job $SLURM_JOB_ID`.
//!
//! How this Slurm behaves (measured here):
//! - Start to all nodes idle: about 0.3 s. slurmctld's scheduler first runs about 3 s
//!   after it starts, so the first job starts then; later ones start within about 1 s
//!   of sbatch (`batch_sched_delay=0` is always set; Slurm's default delays 3 s).
//! - A Prolog that exits non-zero drains its node with Reason "Prolog error" unless the
//!   node is already drained (a Prolog that runs `scontrol update ... state=drain
//!   reason=...` first keeps its own reason), and requeues the job held
//!   (`launch_failed_requeued_held`, Priority=0) or, with `nohold_on_prolog_fail`, not
//!   held; either way with EligibleTime 121 s later. `scontrol release` and
//!   `scontrol update jobid=N starttime=now` start it (elsewhere) within about 1 s.
//! - `scontrol update ... state=resume` shows `IDLE+NOT_RESPONDING` for up to about a
//!   second before `IDLE`.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A daemon in a process group of its own (so helpers it forks, like slurmctld's
/// slurmscriptd, go with it), stopped when dropped: SIGTERM to its PID, up to
/// `grace` to exit, then SIGKILL to its group; always reaped.
pub struct Proc {
    pub child: Child,
    pub name: String,
    pub log: PathBuf,
    pub grace: Duration,
}

impl Proc {
    /// Spawns `command` (in a new process group) with its output appended to `log`.
    pub fn spawn(name: &str, command: &mut Command, log: &Path) -> Proc {
        use std::os::unix::process::CommandExt;
        let file = || {
            std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(log)
                .unwrap()
        };
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::from(file()))
            .stderr(Stdio::from(file()))
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        Proc {
            child,
            name: name.to_owned(),
            log: log.to_owned(),
            grace: Duration::from_secs(10),
        }
    }

    /// Panics with its log when it has exited.
    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            panic!("{} exited with {status}:\n{text}", self.name);
        }
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let pid = self.child.id().to_string();
        if self.running() {
            signal("TERM", &pid);
            let deadline = Instant::now() + self.grace;
            while Instant::now() < deadline && self.running() {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // The group: whatever it forked and left behind.
        signal("KILL", &format!("-{pid}"));
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kill -SIG -- target` (a PID, or `-PGID`), quietly.
fn signal(sig: &str, target: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{sig}"), "--", target])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

#[path = "ports.rs"]
mod ports;
pub use ports::free_port;

/// Polls `f` every 50 ms until it gives a value; panics after `limit`.
pub fn eventually<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A Slurm partition.
#[derive(Clone, Debug)]
pub struct Partition {
    pub name: String,
    /// Node names, e.g. `["node1", "node2"]`.
    pub nodes: Vec<String>,
    pub default: bool,
}

impl Partition {
    pub fn new(name: &str, nodes: &[&str], default: bool) -> Partition {
        Partition {
            name: name.to_owned(),
            nodes: nodes.iter().map(|n| (*n).to_owned()).collect(),
            default,
        }
    }
}

/// How the cluster is configured. `Default`: nodes node1..node3 with 32 CPUs and 4 GPUs
/// each, partitions `train` (node1, node2; the default) and `inference` (node3), no
/// job_submit plugin, no prolog, epilog or health check, Slurm's SchedulerParameters.
#[derive(Clone, Debug)]
pub struct SlurmOptions {
    /// Nodes are named node1..nodeN.
    pub nodes: usize,
    /// CPUs each node declares (the host's own count does not matter:
    /// `SlurmdParameters=config_overrides`).
    pub cpus: u32,
    /// GPUs each node declares as GRES `gpu` (AutoDetect=off, stand-in device files).
    pub gpus: u32,
    /// MB of memory each node declares.
    pub memory_mb: u32,
    pub partitions: Vec<Partition>,
    /// The text of `job_submit.lua` (written beside slurm.conf); sets
    /// `JobSubmitPlugins=lua`.
    pub job_submit_lua: Option<String>,
    /// `Prolog=`: a path (absolute) to an executable.
    pub prolog: Option<PathBuf>,
    /// `PrologFlags=`, e.g. `Alloc`.
    pub prolog_flags: Option<String>,
    /// `Epilog=`.
    pub epilog: Option<PathBuf>,
    /// `HealthCheckProgram=` and `HealthCheckInterval=` (seconds).
    pub health_check: Option<(PathBuf, u32)>,
    /// More `SchedulerParameters=`, e.g. `nohold_on_prolog_fail`, after the harness's
    /// own `batch_sched_delay=0`.
    pub scheduler_parameters: Option<String>,
    /// `ReturnToService=`. 2 (the default here): a node that was DOWN for not
    /// responding comes back on registering; a DRAIN (Probity's, or "Prolog error")
    /// stays until resumed, whatever this is.
    pub return_to_service: u8,
    /// Environment for slurmctld and every slurmd (job_submit.lua sees slurmctld's;
    /// Prolog, Epilog and HealthCheckProgram do not see it).
    pub env: Vec<(String, String)>,
    /// More lines for slurm.conf, appended as they are.
    pub extra_conf: Vec<String>,
    /// `AuthInfo=cred_expire`: also how long a requeued job waits before it may start
    /// again (Slurm's default, 120 s, would make every requeue test wait two minutes).
    pub cred_expire: u32,
}

impl Default for SlurmOptions {
    fn default() -> SlurmOptions {
        SlurmOptions {
            nodes: 3,
            cpus: 32,
            gpus: 4,
            memory_mb: 64000,
            partitions: vec![
                Partition::new("train", &["node1", "node2"], true),
                Partition::new("inference", &["node3"], false),
            ],
            job_submit_lua: None,
            prolog: None,
            prolog_flags: None,
            epilog: None,
            health_check: None,
            scheduler_parameters: None,
            return_to_service: 2,
            env: Vec::new(),
            extra_conf: Vec::new(),
            cred_expire: 5,
        }
    }
}

/// One line of `squeue`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueuedJob {
    pub id: u32,
    pub name: String,
    /// PENDING, RUNNING, COMPLETING...
    pub state: String,
    /// The pending reason or the node list, as squeue's `%R` prints it.
    pub reason: String,
    pub partition: String,
}

/// A running cluster. Dropping it stops every slurmd and slurmctld (SIGTERM, then
/// SIGKILL to the process group), SIGKILLs every process left with this cluster's
/// SLURM_CONF in its environment (slurmstepd, job scripts and what they started,
/// prologs), then stops munged; the temporary directory goes last. Jobs are not
/// cancelled first (no Epilog runs); call `cancel_all` for that.
pub struct Slurm {
    /// Everything the cluster writes is under here.
    pub dir: PathBuf,
    pub conf: PathBuf,
    pub munge_socket: PathBuf,
    pub ctld_port: u16,
    pub nodes: Vec<String>,
    node_ports: Vec<u16>,
    slurmds: Vec<Option<Proc>>,
    slurmctld: Option<Proc>,
    munged: Option<Proc>,
    env: Vec<(String, String)>,
    // Declared last: dropped after the daemons above.
    _temp: Option<tempfile::TempDir>,
}

impl Slurm {
    /// Starts a cluster in a fresh temporary directory and waits until every node is idle.
    pub fn start(options: SlurmOptions) -> Slurm {
        let temp = tempfile::Builder::new()
            .prefix("probity-slurm-")
            .tempdir()
            .unwrap();
        let dir = temp.path().to_owned();
        let mut slurm = Slurm::start_in(&dir, options);
        slurm._temp = Some(temp);
        slurm
    }

    /// Starts a cluster whose files go under `dir` (which must exist and stays).
    pub fn start_in(dir: &Path, options: SlurmOptions) -> Slurm {
        let dir = dir.canonicalize().unwrap();
        let conf = dir.join("slurm.conf");
        let munge_socket = dir.join("munge/munge.socket");
        let nodes: Vec<String> = (1..=options.nodes).map(|k| format!("node{k}")).collect();
        let node_ports: Vec<u16> = nodes.iter().map(|_| free_port()).collect();
        let ctld_port = free_port();
        for sub in ["munge", "state", "log", "gpu"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        for node in &nodes {
            // slurmd makes its spool directory's socket there but not the directory.
            std::fs::create_dir_all(dir.join("spool").join(node)).unwrap();
        }

        let munged = start_munged(&dir, &munge_socket);

        write_gres(&dir, &nodes, options.gpus);
        std::fs::write(dir.join("plugstack.conf"), "").unwrap();
        if let Some(lua) = &options.job_submit_lua {
            std::fs::write(dir.join("job_submit.lua"), lua).unwrap();
        }
        std::fs::write(
            &conf,
            slurm_conf(
                &dir,
                &options,
                &nodes,
                &node_ports,
                ctld_port,
                &munge_socket,
            ),
        )
        .unwrap();

        let mut slurm = Slurm {
            dir: dir.clone(),
            conf,
            munge_socket,
            ctld_port,
            nodes,
            node_ports,
            slurmds: Vec::new(),
            slurmctld: None,
            munged: Some(munged),
            env: options.env.clone(),
            _temp: None,
        };
        slurm.start_slurmctld();
        for k in 0..slurm.nodes.len() {
            slurm.slurmds.push(None);
            slurm.start_slurmd(k);
        }
        slurm.wait_nodes_idle(Duration::from_secs(60));
        slurm
    }

    fn daemon(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf).current_dir(&self.dir);
        for (k, v) in &self.env {
            c.env(k, v);
        }
        c
    }

    fn start_slurmctld(&mut self) {
        let mut cmd = self.daemon("slurmctld");
        cmd.arg("-D").arg("-f").arg(&self.conf);
        let mut proc = Proc::spawn("slurmctld", &mut cmd, &self.dir.join("log/slurmctld.out"));
        let port = self.ctld_port;
        eventually("slurmctld to listen", Duration::from_secs(30), || {
            proc.assert_running();
            TcpStream::connect(("127.0.0.1", port)).ok().map(|_| ())
        });
        self.slurmctld = Some(proc);
    }

    /// Starts the slurmd of node `k` (0-based) again after `stop_slurmd`.
    pub fn start_slurmd(&mut self, k: usize) {
        let node = self.nodes[k].clone();
        let mut cmd = self.daemon("slurmd");
        cmd.arg("-D").arg("-N").arg(&node).arg("-f").arg(&self.conf);
        let mut proc = Proc::spawn(
            &format!("slurmd {node}"),
            &mut cmd,
            &self.dir.join(format!("log/slurmd-{node}.out")),
        );
        let port = self.node_ports[k];
        eventually(
            &format!("slurmd {node} to listen"),
            Duration::from_secs(30),
            || {
                proc.assert_running();
                TcpStream::connect(("127.0.0.1", port)).ok().map(|_| ())
            },
        );
        self.slurmds[k] = Some(proc);
    }

    /// Stops the slurmd of node `k` (0-based); its running jobs' steps stay.
    pub fn stop_slurmd(&mut self, k: usize) {
        self.slurmds[k] = None;
    }

    /// A client command (`sbatch`, `scontrol`...) for this cluster.
    pub fn client(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf)
            .current_dir(&self.dir)
            .stdin(Stdio::null());
        for var in [
            "SLURM_JOB_ID",
            "SLURM_JOBID",
            "SBATCH_PARTITION",
            "SLURM_PARTITION",
        ] {
            c.env_remove(var);
        }
        c
    }

    /// Runs a client: its exit code (-1 when killed by a signal), stdout and stderr.
    pub fn run(&self, program: &str, args: &[&str]) -> (i32, String, String) {
        let out = self.client(program).args(args).output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `sbatch args... script`: the script is written to a file in the directory first
    /// (give it a `#!/bin/sh` line). Job output goes to the directory unless `-o` is given.
    pub fn sbatch(&self, args: &[&str], script: &str) -> (i32, String, String) {
        let n = NEXT_SCRIPT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = self.dir.join(format!("script-{n}.sh"));
        std::fs::write(&path, script).unwrap();
        let path = path.to_str().unwrap().to_owned();
        let mut all: Vec<&str> = args.to_vec();
        all.push(&path);
        self.run("sbatch", &all)
    }

    /// `sbatch args... --wrap=command`.
    pub fn sbatch_wrap(&self, args: &[&str], command: &str) -> (i32, String, String) {
        let wrap = format!("--wrap={command}");
        let mut all: Vec<&str> = args.to_vec();
        all.push(&wrap);
        self.run("sbatch", &all)
    }

    /// Submits `--wrap=command` with `--parsable` and gives the job id; panics when
    /// sbatch refuses.
    pub fn submit(&self, args: &[&str], command: &str) -> u32 {
        let mut all = vec!["--parsable"];
        all.extend_from_slice(args);
        let (code, out, err) = self.sbatch_wrap(&all, command);
        assert_eq!(code, 0, "sbatch {args:?} failed: {out}{err}");
        out.trim()
            .split(';')
            .next()
            .unwrap()
            .parse()
            .unwrap_or_else(|_| panic!("sbatch printed {out:?}"))
    }

    /// `scontrol args...`.
    pub fn scontrol(&self, args: &[&str]) -> (i32, String, String) {
        self.run("scontrol", args)
    }

    /// `scontrol args...`, panicking unless it succeeds; its stdout.
    pub fn scontrol_ok(&self, args: &[&str]) -> String {
        let (code, out, err) = self.scontrol(args);
        assert_eq!(code, 0, "scontrol {args:?}: {out}{err}");
        out
    }

    /// `scontrol show node name` as key=value pairs (State, Reason, Gres...); `None`
    /// when scontrol fails.
    pub fn show_node(&self, name: &str) -> Option<BTreeMap<String, String>> {
        let (code, out, _) = self.scontrol(&["show", "node", name]);
        (code == 0).then(|| parse_show(&out))
    }

    /// `scontrol show job id` as key=value pairs (JobState, Reason, NodeList, Restarts,
    /// Priority, AdminComment...); `None` when the job is unknown (gone after MinJobAge).
    pub fn show_job(&self, id: u32) -> Option<BTreeMap<String, String>> {
        let (code, out, _) = self.scontrol(&["show", "job", &id.to_string()]);
        (code == 0).then(|| parse_show(&out))
    }

    /// The node's State (e.g. `IDLE`, `IDLE+DRAIN`, `ALLOCATED`).
    pub fn node_state(&self, name: &str) -> String {
        self.show_node(name)
            .and_then(|m| m.get("State").cloned())
            .unwrap_or_default()
    }

    /// The node's Reason as scontrol shows it, `text [user@time]`, or "" when it has none.
    pub fn node_reason(&self, name: &str) -> String {
        self.show_node(name)
            .and_then(|m| m.get("Reason").cloned())
            .unwrap_or_default()
    }

    /// The job's JobState (`PENDING`, `RUNNING`, `COMPLETED`...); "" when unknown.
    pub fn job_state(&self, id: u32) -> String {
        self.show_job(id)
            .and_then(|m| m.get("JobState").cloned())
            .unwrap_or_default()
    }

    /// Polls until the job's JobState is one of `states`; its fields then.
    pub fn wait_job_state(
        &self,
        id: u32,
        states: &[&str],
        limit: Duration,
    ) -> BTreeMap<String, String> {
        eventually(&format!("job {id} to be {states:?}"), limit, || {
            self.show_job(id)
                .filter(|m| states.contains(&m.get("JobState").map(String::as_str).unwrap_or("")))
        })
    }

    /// Polls until `f` holds for the job's fields; them then.
    pub fn wait_job(
        &self,
        id: u32,
        what: &str,
        limit: Duration,
        f: impl Fn(&BTreeMap<String, String>) -> bool,
    ) -> BTreeMap<String, String> {
        eventually(&format!("job {id}: {what}"), limit, || {
            self.show_job(id).filter(|m| f(m))
        })
    }

    /// Polls until `f` holds for the node's fields; them then.
    pub fn wait_node(
        &self,
        name: &str,
        what: &str,
        limit: Duration,
        f: impl Fn(&BTreeMap<String, String>) -> bool,
    ) -> BTreeMap<String, String> {
        eventually(&format!("node {name}: {what}"), limit, || {
            self.show_node(name).filter(|m| f(m))
        })
    }

    /// `squeue`: every job slurmctld still lists as pending or running.
    pub fn squeue(&self) -> Vec<QueuedJob> {
        let (code, out, err) = self.run("squeue", &["-h", "-o", "%i|%j|%T|%P|%R"]);
        assert_eq!(code, 0, "squeue: {err}");
        out.lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.splitn(5, '|').collect();
                Some(QueuedJob {
                    id: f.first()?.trim().parse().ok()?,
                    name: f.get(1)?.to_string(),
                    state: f.get(2)?.to_string(),
                    partition: f.get(3)?.to_string(),
                    reason: f.get(4)?.to_string(),
                })
            })
            .collect()
    }

    /// Every node's state, from `sinfo -N` (`idle`, `alloc`, `drain`, `down*`...).
    pub fn node_states(&self) -> BTreeMap<String, String> {
        let (_, out, _) = self.run("sinfo", &["-h", "-N", "-o", "%N %T"]);
        out.lines()
            .filter_map(|l| {
                let (n, s) = l.split_once(' ')?;
                Some((n.to_owned(), s.trim().to_owned()))
            })
            .collect()
    }

    /// Polls until every node is plainly idle (not drained, down or completing).
    pub fn wait_nodes_idle(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let states = self.node_states();
            if states.len() == self.nodes.len() && states.values().all(|s| s == "idle") {
                return;
            }
            if let Some(dead) = self.dead_daemon() {
                panic!(
                    "{dead} is not running:\n{}",
                    self.log_tail("slurmctld.log", 30)
                );
            }
            if Instant::now() >= deadline {
                panic!(
                    "nodes not idle after {limit:?}: {states:?}\n{}",
                    self.log_tail("slurmctld.log", 30)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The name of a daemon that has exited (slurmctld, a slurmd not stopped on
    /// purpose, munged), if any.
    pub fn dead_daemon(&self) -> Option<String> {
        let procs = self
            .slurmctld
            .iter()
            .chain(self.slurmds.iter().flatten())
            .chain(self.munged.iter());
        for p in procs {
            // Exited but not reaped yet (this handle reaps on drop): a zombie.
            let stat =
                std::fs::read_to_string(format!("/proc/{}/stat", p.child.id())).unwrap_or_default();
            let state = stat.rsplit_once(") ").map(|(_, r)| r.chars().next());
            if !matches!(state, Some(Some(s)) if s != 'Z' && s != 'X') {
                return Some(p.name.clone());
            }
        }
        None
    }

    /// `scontrol update nodename=name state=drain reason=reason`.
    pub fn drain(&self, name: &str, reason: &str) {
        self.scontrol_ok(&[
            "update",
            &format!("nodename={name}"),
            "state=drain",
            &format!("reason={reason}"),
        ]);
    }

    /// `scontrol update nodename=name state=resume`.
    pub fn resume(&self, name: &str) -> (i32, String, String) {
        self.scontrol(&["update", &format!("nodename={name}"), "state=resume"])
    }

    /// A log file under `log/` (`slurmctld.log`, `slurmd-node1.log`, `slurmctld.out`...).
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join("log").join(name)).unwrap_or_default()
    }

    /// The last `n` lines of a log under `log/`.
    pub fn log_tail(&self, name: &str, n: usize) -> String {
        let text = self.log(name);
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Cancels every job and waits (bounded) until squeue lists none.
    pub fn cancel_all(&self, limit: Duration) {
        let ids: Vec<String> = self.squeue().iter().map(|j| j.id.to_string()).collect();
        if ids.is_empty() {
            return;
        }
        let mut args = vec!["--full"];
        args.extend(ids.iter().map(String::as_str));
        let _ = self.run("scancel", &args);
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let (code, out, _) = self.run("squeue", &["-h", "-o", "%i"]);
            if code != 0 || out.trim().is_empty() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// PIDs of processes (other than this one) whose environment holds this cluster's
    /// SLURM_CONF: daemons, slurmstepd, job scripts, prologs.
    pub fn cluster_pids(&self) -> Vec<u32> {
        let needle = format!("SLURM_CONF={}", self.conf.display());
        let me = std::process::id();
        let mut pids = Vec::new();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return pids;
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if pid == me {
                continue;
            }
            let Ok(env) = std::fs::read(entry.path().join("environ")) else {
                continue;
            };
            if env.split(|b| *b == 0).any(|v| v == needle.as_bytes()) {
                pids.push(pid);
            }
        }
        pids
    }
}

static NEXT_SCRIPT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Drop for Slurm {
    fn drop(&mut self) {
        for d in &mut self.slurmds {
            if let Some(p) = d.as_mut() {
                p.grace = Duration::from_secs(5);
            }
        }
        self.slurmds.clear();
        self.slurmctld = None;
        // Job steps and scripts slurmd left behind (it does not stop them on exit).
        for _ in 0..3 {
            let pids = self.cluster_pids();
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                signal("KILL", &pid.to_string());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.munged = None;
    }
}

/// munged in the foreground with its own key (1 KiB of random bytes, mode 0400),
/// socket, pid, log and seed files under `dir/munge`.
fn start_munged(dir: &Path, socket: &Path) -> Proc {
    use std::os::unix::fs::PermissionsExt;
    let m = dir.join("munge");
    let key = m.join("munge.key");
    let mut bytes = vec![0u8; 1024];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut bytes)
        .unwrap();
    std::fs::write(&key, &bytes).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o400)).unwrap();
    let mut proc = Proc::spawn(
        "munged",
        Command::new("munged")
            .arg("--foreground")
            // As root, and with the socket in a directory munged does not own.
            .arg("--force")
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--key-file={}", key.display()))
            .arg(format!("--pid-file={}", m.join("munged.pid").display()))
            .arg(format!("--log-file={}", m.join("munged.log").display()))
            .arg(format!("--seed-file={}", m.join("munged.seed").display()))
            .arg("--num-threads=4"),
        &m.join("munged.out"),
    );
    eventually("munged to make its socket", Duration::from_secs(20), || {
        proc.assert_running();
        std::os::unix::net::UnixStream::connect(socket)
            .ok()
            .map(|_| ())
    });
    proc
}

/// gres.conf, and `gpus` stand-in device files per node under `dir/gpu`. Slurm wants
/// character devices: with regular files it allocates the GPUs but sets no
/// CUDA_VISIBLE_DEVICES / SLURM_JOB_GPUS (and logs "not a valid character or block
/// device"). So they are made with `mknod c 1 3` (what /dev/null is; nothing opens
/// them with task/none), falling back to regular files where mknod is not allowed.
fn write_gres(dir: &Path, nodes: &[String], gpus: u32) {
    let mut conf = String::from("AutoDetect=off\n");
    if gpus == 0 {
        std::fs::write(dir.join("gres.conf"), conf).unwrap();
        return;
    }
    for node in nodes {
        for g in 0..gpus {
            let path = dir.join("gpu").join(format!("{node}-gpu{g}"));
            let made = Command::new("mknod")
                .arg(&path)
                .args(["c", "1", "3"])
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if !made {
                std::fs::write(&path, "").unwrap();
            }
        }
        conf.push_str(&format!(
            "NodeName={node} Name=gpu File={}/{node}-gpu[0-{}]\n",
            dir.join("gpu").display(),
            gpus - 1
        ));
    }
    std::fs::write(dir.join("gres.conf"), conf).unwrap();
}

fn slurm_conf(
    dir: &Path,
    o: &SlurmOptions,
    nodes: &[String],
    node_ports: &[u16],
    ctld_port: u16,
    munge_socket: &Path,
) -> String {
    let d = dir.display();
    let mut c = format!(
        "ClusterName=probity\n\
         SlurmctldHost=localhost\n\
         SlurmctldPort={ctld_port}\n\
         SlurmdPort={slurmd_port}\n\
         SlurmUser=root\n\
         SlurmdUser=root\n\
         AuthType=auth/munge\n\
         AuthInfo=socket={sock},cred_expire={cred}\n\
         CredType=cred/munge\n\
         StateSaveLocation={d}/state\n\
         SlurmdSpoolDir={d}/spool/%n\n\
         SlurmctldPidFile={d}/slurmctld.pid\n\
         SlurmdPidFile={d}/slurmd-%n.pid\n\
         SlurmctldLogFile={d}/log/slurmctld.log\n\
         SlurmdLogFile={d}/log/slurmd-%n.log\n\
         SlurmctldDebug=info\n\
         SlurmdDebug=info\n\
         PlugStackConfig={d}/plugstack.conf\n\
         MailProg=/bin/true\n\
         SlurmdParameters=config_overrides\n\
         ProctrackType=proctrack/linuxproc\n\
         TaskPlugin=task/none\n\
         JobAcctGatherType=jobacct_gather/none\n\
         AccountingStorageType=accounting_storage/none\n\
         JobCompType=jobcomp/none\n\
         SwitchType=switch/none\n\
         MpiDefault=none\n\
         SelectType=select/cons_tres\n\
         SelectTypeParameters=CR_Core\n\
         GresTypes=gpu\n\
         JobRequeue=1\n\
         ReturnToService={rts}\n\
         SlurmctldTimeout=30\n\
         SlurmdTimeout=30\n\
         MessageTimeout=10\n\
         KillWait=2\n\
         MinJobAge=600\n\
         InactiveLimit=0\n\
         PrologEpilogTimeout=60\n",
        slurmd_port = node_ports.first().copied().unwrap_or(ctld_port + 1),
        sock = munge_socket.display(),
        rts = o.return_to_service,
        cred = o.cred_expire,
    );
    if o.job_submit_lua.is_some() {
        c.push_str("JobSubmitPlugins=lua\n");
    }
    if let Some(p) = &o.prolog {
        c.push_str(&format!("Prolog={}\n", p.display()));
    }
    if let Some(f) = &o.prolog_flags {
        c.push_str(&format!("PrologFlags={f}\n"));
    }
    if let Some(p) = &o.epilog {
        c.push_str(&format!("Epilog={}\n", p.display()));
    }
    if let Some((p, interval)) = &o.health_check {
        c.push_str(&format!(
            "HealthCheckProgram={}\nHealthCheckInterval={interval}\nHealthCheckNodeState=ANY\n",
            p.display()
        ));
    }
    // batch_sched_delay defaults to 3 s: every batch job would wait that long to start.
    let mut sched = String::from("batch_sched_delay=0");
    if let Some(s) = &o.scheduler_parameters {
        sched.push(',');
        sched.push_str(s);
    }
    c.push_str(&format!("SchedulerParameters={sched}\n"));
    for line in &o.extra_conf {
        c.push_str(line);
        c.push('\n');
    }
    let gres = if o.gpus > 0 {
        format!(" Gres=gpu:{}", o.gpus)
    } else {
        String::new()
    };
    for (node, port) in nodes.iter().zip(node_ports) {
        c.push_str(&format!(
            "NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} \
             CPUs={} RealMemory={}{gres} State=UNKNOWN\n",
            o.cpus, o.memory_mb
        ));
    }
    for p in &o.partitions {
        c.push_str(&format!(
            "PartitionName={} Nodes={} Default={} MaxTime=INFINITE State=UP\n",
            p.name,
            p.nodes.join(","),
            if p.default { "YES" } else { "NO" }
        ));
    }
    c
}

/// Fields whose values may hold spaces (and `=`) and, when they begin a line of
/// `scontrol show` output, run to its end: a node's `Reason=`, a job's `Comment=`.
/// (A job's `Reason=` shares its line with `JobState=` and `Dependency=`.)
const TO_END_OF_LINE: &[&str] = &["Reason", "Comment", "AdminComment", "OS", "Command"];

/// `scontrol show node|job` output (one or more records) as key=value pairs: later
/// records overwrite earlier ones. `Reason=Probity: p: msg [root@2026-...]` keeps its
/// spaces.
pub fn parse_show(text: &str) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    for line in text.lines() {
        let mut rest = line.trim();
        while !rest.is_empty() {
            let Some((key, after)) = rest.split_once('=') else {
                break;
            };
            let key = key.trim().to_owned();
            let first = rest.len() == line.trim().len();
            if first && TO_END_OF_LINE.contains(&key.as_str()) {
                map.insert(key, after.trim().to_owned());
                break;
            }
            // The value runs to the next ` Key=`.
            let mut end = after.len();
            let mut search = 0;
            while let Some(sp) = after[search..].find(' ') {
                let at = search + sp;
                let next = after[at + 1..].trim_start();
                let word = next.split(' ').next().unwrap_or("");
                if let Some((k, _)) = word.split_once('=')
                    && !k.is_empty()
                    && k.chars()
                        .all(|ch| ch.is_ascii_alphanumeric() || "_/:".contains(ch))
                {
                    end = at;
                    break;
                }
                search = at + 1;
            }
            map.insert(key, after[..end].trim().to_owned());
            rest = after[end..].trim_start();
        }
    }
    map
}

//! `probity slurm`: what Slurm's hooks run (job_submit.lua, the Prolog, the health
//! check) and the controller's Slurm side.
//!
//! `submit` and `prolog` ask the sidecar over its Unix socket and act on the answer;
//! `health` runs the node agent's compliance cycle once; `controller` mirrors the
//! blocklist onto Slurm's nodes. Each says what it did on standard error, and `submit`
//! prints one line for the Lua to read.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use probity_kube::controller::StateStore;
use probity_slurm::commands::{JobStop, SlurmCommands};
use probity_slurm::{
    SidecarClient, SlurmActuator, SlurmController, SlurmControllerOptions, reason,
};
use serde_json::{Map, Value, json};

use crate::controller::{BreakerArgs, ProbityArgs, default_identity, init_logging};
use crate::exit;

#[derive(Subcommand)]
pub enum SlurmCommand {
    /// Ask whether a job may be submitted (job_submit.lua runs it, without a shell):
    /// prints `allow<TAB><submission><TAB><warnings>` or `deny<TAB><message><TAB>` on
    /// one line.
    Submit(SubmitArgs),
    /// Decide a job's start on this node (the Prolog): a node-level refusal drains the
    /// node with Probity's reason and exits 1 (Slurm requeues the job elsewhere); a
    /// job-level refusal requeues the job held (or cancels it) and exits 0.
    Prolog(PrologArgs),
    /// Run the node agent's compliance cycle once (HealthCheckProgram): findings that
    /// refuse the node drain it; once they clear, Probity's own drain is resumed.
    Health(HealthArgs),
    /// The controller's Slurm side: drain blocked nodes, resume unblocked ones, requeue
    /// the jobs that read bad data (one active process per cluster, by an etcd lease).
    #[command(subcommand)]
    Controller(SlurmControllerCommand),
}

/// The sidecar's socket and how long to wait for it.
#[derive(Args)]
pub struct Sidecar {
    /// The sidecar's Unix socket.
    #[arg(long, default_value = "/run/probity/probity.sock")]
    socket: PathBuf,
    /// Milliseconds the whole request may take: past it, the answer is the one
    /// `--on-error` names.
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
}

impl Sidecar {
    fn client(&self) -> SidecarClient {
        SidecarClient::new(&self.socket, Duration::from_millis(self.timeout_ms.max(1)))
    }
}

#[derive(Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    sidecar: Sidecar,
    /// When Probity cannot answer in time: `refuse` (fail closed) or `allow`.
    #[arg(long, default_value = "refuse", value_parser = ["refuse", "allow"])]
    on_error: String,
    /// The job's fields, `name=value` each (one argv entry apiece: no quoting).
    #[arg(value_name = "FIELD=VALUE")]
    fields: Vec<String>,
}

#[derive(Args)]
pub struct PrologArgs {
    #[command(flatten)]
    sidecar: Sidecar,
    /// The job (default: SLURM_JOB_ID, which Slurm sets for the Prolog).
    #[arg(long, env = "SLURM_JOB_ID")]
    job: String,
    /// This node (default: SLURMD_NODENAME).
    #[arg(long, env = "SLURMD_NODENAME")]
    node: String,
    /// The job's comment (default: SLURM_JOB_COMMENT), where job_submit.lua appended
    /// the submission token; without one there, the token is read from the job's
    /// admin comment through scontrol.
    #[arg(long, env = "SLURM_JOB_COMMENT", default_value = "")]
    comment: String,
    /// What a job-level refusal does: `requeue-hold` or `cancel`.
    #[arg(long, default_value = "requeue-hold", value_parser = JobStop::parse)]
    job_refusal: JobStop,
    /// When Probity cannot answer: `drain` (fail closed: the node takes no job it cannot
    /// judge) or `allow`.
    #[arg(long, default_value = "drain", value_parser = ["drain", "allow"])]
    on_error: String,
    #[command(flatten)]
    slurm: SlurmBin,
    /// Append this run's own time to FILE, one line each (job start times have
    /// one-second resolution): total, the admin comment's read and the sidecar's
    /// answer in microseconds, then the job, the node and the verdict.
    #[arg(long)]
    timing_log: Option<PathBuf>,
}

#[derive(Args)]
pub struct SlurmBin {
    /// Where scontrol, squeue and scancel are (default: PATH).
    #[arg(long)]
    slurm_bin: Option<PathBuf>,
    /// Milliseconds one Slurm command may take.
    #[arg(long, default_value_t = 10_000)]
    slurm_timeout_ms: u64,
}

impl SlurmBin {
    fn commands(&self) -> SlurmCommands {
        SlurmCommands {
            bin_dir: self.slurm_bin.clone(),
            timeout: Duration::from_millis(self.slurm_timeout_ms.max(1)),
        }
    }
}

#[derive(Args)]
pub struct HealthArgs {
    /// The node agent's configuration (its node, collectors, policies, state).
    #[arg(long, default_value = "/etc/probity/agent.toml")]
    agent_config: PathBuf,
    /// The Slurm node (default: SLURMD_NODENAME, else the agent's node).
    #[arg(long, env = "SLURMD_NODENAME")]
    node: Option<String>,
    #[command(flatten)]
    slurm: SlurmBin,
}

#[derive(Subcommand)]
pub enum SlurmControllerCommand {
    /// Mirror Probity's blocklist onto Slurm's nodes.
    Run(Box<ControllerRunArgs>),
    /// Print the shared state: pause, dry run, breaker, report (JSON).
    Status(EtcdArgs),
    /// Stop acting until `resume`.
    Pause(EtcdArgs),
    /// Act again after `pause`.
    Resume(EtcdArgs),
    /// Reset a tripped circuit breaker, with a fresh window.
    Reset(EtcdArgs),
    /// Report what would be done, change nothing (`on`), or act again (`off`).
    DryRun {
        #[command(flatten)]
        etcd: EtcdArgs,
        /// `on` or `off`.
        #[arg(value_parser = ["on", "off"])]
        mode: String,
    },
}

/// The etcd the controller's lease and state live in.
#[derive(Args)]
pub struct EtcdArgs {
    /// An etcd endpoint (repeat), e.g. `http://127.0.0.1:2379`.
    #[arg(long = "etcd", required = true)]
    endpoints: Vec<String>,
    /// The key prefix (Probity's store's, so one etcd serves both).
    #[arg(long, default_value = "/probity/")]
    etcd_prefix: String,
    /// The CA bundle of etcd's server certificate (PEM): TLS when given.
    #[arg(long)]
    etcd_ca: Option<PathBuf>,
    /// A client certificate for etcd (PEM), with --etcd-key.
    #[arg(long, requires = "etcd_key")]
    etcd_cert: Option<PathBuf>,
    /// The client certificate's key.
    #[arg(long, requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
}

impl EtcdArgs {
    async fn connect(&self) -> Result<probity_etcd::EtcdClient> {
        let mut config = probity_etcd::EtcdConfig::new(self.endpoints.clone())
            .with_prefix(self.etcd_prefix.clone());
        if let Some(ca) = &self.etcd_ca {
            let mut tls = probity_etcd::TlsConfig::from_ca_file(ca)?;
            if let (Some(cert), Some(key)) = (&self.etcd_cert, &self.etcd_key) {
                tls = tls.with_client_identity_files(cert, key)?;
            }
            config = config.with_tls(tls);
        }
        probity_etcd::EtcdClient::connect(config)
            .await
            .context("cannot reach etcd")
    }
}

#[derive(Args)]
pub struct ControllerRunArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    #[command(flatten)]
    probity: ProbityArgs,
    #[command(flatten)]
    slurm: SlurmBin,
    /// This process's name in the leader key (default: host, pid and time).
    #[arg(long)]
    identity: Option<String>,
    /// Seconds leadership holds without renewal.
    #[arg(long, default_value_t = 15)]
    lease_seconds: u64,
    /// Milliseconds between reconcile passes.
    #[arg(long, default_value_t = 500)]
    interval_ms: u64,
    #[command(flatten)]
    breaker: BreakerArgs,
    /// What a job that read bad data gets: `requeue-hold` or `cancel`.
    #[arg(long, default_value = "requeue-hold", value_parser = JobStop::parse)]
    job_stop: JobStop,
    /// The reader namespace Slurm jobs are named in (the server's `[slurm] reader_namespace`).
    #[arg(long, default_value = probity_slurm::actuator::JOB_NAMESPACE)]
    job_namespace: String,
    /// Report what would be done, change nothing (whatever the shared state says).
    #[arg(long)]
    dry_run: bool,
    /// Serve /metrics and /healthz here (e.g. 127.0.0.1:9103).
    #[arg(long)]
    metrics_listen: Option<std::net::SocketAddr>,
    /// `text` or `json` log lines.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

pub fn slurm(command: SlurmCommand) -> Result<u8> {
    match command {
        SlurmCommand::Submit(args) => submit(&args),
        SlurmCommand::Prolog(args) => prolog(&args),
        SlurmCommand::Health(args) => health(&args),
        SlurmCommand::Controller(command) => controller(command),
    }
}

/// The string at `key` of a JSON object, if it is one.
fn str_at<'a>(value: &'a Value, key: &str) -> Option<&'a str> {
    value.get(key).and_then(Value::as_str)
}

/// One line for the Lua: no tab or newline inside a field.
fn lua_field(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

fn submit(args: &SubmitArgs) -> Result<u8> {
    let mut job = Map::new();
    for field in &args.fields {
        let Some((name, value)) = field.split_once('=') else {
            bail!("job field {field:?} is not name=value");
        };
        job.insert(name.to_owned(), Value::String(value.to_owned()));
    }
    let answer = args
        .sidecar
        .client()
        .post("/v1/slurm/submit", &json!({ "job": job }));
    let mut warnings = String::new();
    let (verdict, text) = match answer {
        Ok((200, body)) if body.get("allowed") == Some(&Value::Bool(true)) => {
            // What warn-mode policies found: shown to the submitter, as kubectl shows
            // an admission's warnings.
            warnings = body
                .get("warnings")
                .and_then(Value::as_array)
                .map(|w| {
                    w.iter()
                        .map(|n| {
                            format!(
                                "Probity: {}: {}",
                                str_at(n, "policy").unwrap_or(""),
                                str_at(n, "message").unwrap_or("")
                            )
                        })
                        .collect::<Vec<_>>()
                        .join(" | ")
                })
                .unwrap_or_default();
            (
                "allow",
                str_at(&body, "submission").unwrap_or("").to_owned(),
            )
        }
        Ok((200, body)) => (
            "deny",
            str_at(&body, "message")
                .unwrap_or("Probity: refused")
                .to_owned(),
        ),
        Ok((status, body)) => failed(
            &args.on_error,
            format!(
                "the sidecar refused the question ({status}): {}",
                str_at(&body, "error").unwrap_or("")
            ),
        ),
        Err(error) => failed(&args.on_error, probity_base::error::chain(&error)),
    };
    crate::out::line(format_args!(
        "{verdict}\t{}\t{}",
        lua_field(&text),
        lua_field(&warnings)
    ))?;
    Ok(if verdict == "allow" {
        exit::ALLOW
    } else {
        exit::DENY
    })
}

/// The answer when Probity could not decide: refused (fail closed) unless the operator
/// chose `allow`.
fn failed(on_error: &str, why: String) -> (&'static str, String) {
    eprintln!("probity slurm: {why}");
    if on_error == "allow" {
        ("allow", String::new())
    } else {
        (
            "deny",
            reason::one_line(&format!("Probity could not decide: {why}")),
        )
    }
}

fn prolog(args: &PrologArgs) -> Result<u8> {
    let started = Instant::now();
    let commands = args.slurm.commands();
    // The facts judged at submission are found by the token job_submit.lua appended
    // to the job's comment (in the Prolog's environment: no call to slurmctld at every
    // job start), else by the one it kept in the admin comment.
    let asked_slurm = Instant::now();
    let submission = match probity_slurm::commands::submission_in_comment(&args.comment) {
        Some(token) => Some(token),
        None => match commands.submission_of(&args.job) {
            Ok(token) => token,
            Err(e) => {
                eprintln!(
                    "probity slurm prolog: cannot read job {}'s admin comment: {}",
                    args.job,
                    probity_base::error::chain(&e)
                );
                None
            }
        },
    };
    let mut question = json!({ "job": args.job, "node": args.node });
    if let (Some(token), Some(fields)) = (&submission, question.as_object_mut()) {
        fields.insert("submission".into(), json!(token));
    }
    let slurm_time = asked_slurm.elapsed();
    let asked_sidecar = Instant::now();
    let answer = args.sidecar.client().post("/v1/slurm/prolog", &question);
    let sidecar_time = asked_sidecar.elapsed();
    let (verdict, message) = match answer {
        Ok((200, body)) => (
            str_at(&body, "verdict").unwrap_or("node").to_owned(),
            str_at(&body, "message").unwrap_or("").to_owned(),
        ),
        Ok((status, body)) => (
            "error".to_owned(),
            format!(
                "the sidecar refused the question ({status}): {}",
                str_at(&body, "error").unwrap_or("")
            ),
        ),
        Err(error) => ("error".to_owned(), probity_base::error::chain(&error)),
    };
    let (job, node) = (args.job.as_str(), args.node.as_str());
    let code = match verdict.as_str() {
        "allow" => exit::ALLOW,
        "job" => {
            // The node is fine: the job is put back (held) or cancelled, with
            // Probity's word on it, and the Prolog succeeds so the node stays up.
            // The token stays in the admin comment, ahead of Probity's word: a
            // released job's next start finds its facts again.
            let note = match &submission {
                Some(token) => format!(
                    "{}{token} {message}",
                    probity_slurm::commands::SUBMISSION_PREFIX
                ),
                None => message.clone(),
            };
            let _ = commands.annotate_job(job, &note);
            match commands.stop_job(job, args.job_refusal) {
                Ok(()) => eprintln!(
                    "probity slurm prolog: job {job} refused on {node} ({}): {message}",
                    args.job_refusal.as_str()
                ),
                Err(e) => eprintln!(
                    "probity slurm prolog: job {job} refused on {node}, but it could not be stopped: {}",
                    probity_base::error::chain(&e)
                ),
            }
            exit::ALLOW
        }
        "error" if args.on_error == "allow" => {
            eprintln!(
                "probity slurm prolog: {message}: job {job} allowed on {node} (--on-error allow)"
            );
            exit::ALLOW
        }
        other => {
            // The node refuses (or could not be judged): Slurm drains it itself when
            // the Prolog fails, with "Prolog error"; Probity's reason goes first so
            // the operator sees the rule.
            let text = if other == "error" {
                format!("Probity could not decide: {message}")
            } else {
                message.clone()
            };
            let why = reason::one_line(&text);
            if let Err(e) = commands.drain(node, &why) {
                eprintln!(
                    "probity slurm prolog: cannot drain {node}: {}",
                    probity_base::error::chain(&e)
                );
            }
            eprintln!("probity slurm prolog: node {node} refused for job {job}: {why}");
            exit::DENY
        }
    };
    if let Some(path) = &args.timing_log {
        use std::io::Write as _;
        let line = format!(
            "{} {} {} {job} {node} {verdict}\n",
            started.elapsed().as_micros(),
            slurm_time.as_micros(),
            sidecar_time.as_micros()
        );
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = written {
            eprintln!("probity slurm prolog: cannot write {}: {e}", path.display());
        }
    }
    Ok(code)
}

fn health(args: &HealthArgs) -> Result<u8> {
    let mut agent = crate::agent::start(&args.agent_config, false)?;
    let node = args
        .node
        .clone()
        .unwrap_or_else(|| agent.config().node.clone());
    let _ = agent.cycle();
    if let Err(e) = agent.write_status() {
        eprintln!("probity slurm health: cannot write the status file: {e}");
    }
    let block_kind = agent.engine().conventions().block_obligation().to_owned();
    // What refuses the node: its own compliance (the questions a Prolog's node-level
    // refusal comes from) and any finding that blocks it.
    let refusing = agent
        .findings()
        .find(|f| f.action == "comply" || f.obligations.iter().any(|o| o.kind == block_kind))
        .map(|f| reason::drain_reason(&f.policy, &f.message));
    let commands = args.slurm.commands();
    let current = commands.node(&node)?;
    let current_reason = current.reason.clone().unwrap_or_default();
    // The drains this check made (or took over), in the agent's state directory:
    // Probity's other parts (the controller, the Prolog) drain in the same words, and
    // a drain is resumed only by whoever made it.
    let mut owned = HealthDrains::load(agent.config().state_dir.as_deref());
    let ours = current.drained_by_probity() && owned.get(&node) == Some(current_reason.as_str());
    let code = match refusing {
        Some(why) => {
            if current.drained() && !current.drained_by_probity() {
                eprintln!(
                    "probity slurm health: {node} is drained by someone else; left as is ({why})"
                );
            } else if current.drained() && !ours && current_reason != why {
                eprintln!(
                    "probity slurm health: {node} is drained by Probity for another reason ({current_reason}); left as is ({why})"
                );
            } else {
                if !current.drained() || current_reason != why {
                    commands.drain(&node, &why)?;
                    agent_event(&agent, &node, "slurm-node-drained", &why);
                    eprintln!("probity slurm health: drained {node}: {why}");
                }
                // A Prolog's drain in the very words of this finding is taken over.
                owned.set(&node, Some(&why));
            }
            exit::VIOLATION
        }
        None => {
            let blocked = agent.engine().blocked_nodes().contains_key(&node);
            if ours && !blocked {
                commands.resume(&node)?;
                agent_event(
                    &agent,
                    &node,
                    "slurm-node-resumed",
                    &format!("was: {current_reason}"),
                );
                eprintln!("probity slurm health: resumed {node} (was: {current_reason})");
            } else if current.drained_by_probity() && !ours {
                eprintln!(
                    "probity slurm health: {node} stays drained: Probity's {current_reason:?} was not this check's"
                );
            }
            if !blocked {
                owned.set(&node, None);
            }
            exit::ALLOW
        }
    };
    owned.save();
    Ok(code)
}

/// The drain reasons the health check set, by node, kept in the agent's state
/// directory (without one nothing is remembered, and nothing is ever resumed).
struct HealthDrains {
    path: Option<PathBuf>,
    reasons: std::collections::BTreeMap<String, String>,
    changed: bool,
}

impl HealthDrains {
    const FILE: &'static str = "slurm-health-drains.json";

    fn load(state_dir: Option<&std::path::Path>) -> Self {
        let path = state_dir.map(|d| d.join(Self::FILE));
        let reasons = path
            .as_ref()
            .and_then(|p| match std::fs::read(p) {
                Ok(bytes) => serde_json::from_slice(&bytes)
                    .map_err(|e| eprintln!("probity slurm health: {} is unreadable ({e}): nothing is taken as this check's drain", p.display()))
                    .ok(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => {
                    eprintln!("probity slurm health: cannot read {}: {e}", p.display());
                    None
                }
            })
            .unwrap_or_default();
        Self {
            path,
            reasons,
            changed: false,
        }
    }

    fn get(&self, node: &str) -> Option<&str> {
        self.reasons.get(node).map(String::as_str)
    }

    fn set(&mut self, node: &str, reason: Option<&str>) {
        let before = self.reasons.get(node).cloned();
        match reason {
            Some(r) => {
                self.reasons.insert(node.to_owned(), r.to_owned());
            }
            None => {
                self.reasons.remove(node);
            }
        }
        self.changed |= before.as_deref() != reason;
    }

    /// Written through a rename: a crash leaves the old file or the new one.
    fn save(&self) {
        let (Some(path), true) = (&self.path, self.changed) else {
            return;
        };
        let tmp = path.with_extension("json.tmp");
        let written = serde_json::to_vec(&self.reasons)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            eprintln!("probity slurm health: cannot write {}: {e}", path.display());
        }
    }
}

/// Appends a Slurm action to the agent's event log (forwarded to the SIEM by the
/// running agent); a failure is said, not fatal.
fn agent_event(agent: &probity_agent::Agent, node: &str, kind: &str, detail: &str) {
    let Some(log) = agent.engine().log() else {
        return;
    };
    if let Err(e) = log.record_event(&format!("node/{node}"), Some(node), kind, detail) {
        eprintln!("probity slurm health: the event log refused {kind}: {e}");
    }
}

fn controller(command: SlurmControllerCommand) -> Result<u8> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let change = |etcd: EtcdArgs, f: Box<dyn Fn(&mut probity_kube::controller::ControlState) + Send>| async move {
            let control = probity_slurm::EtcdControl::new(etcd.connect().await?);
            let state = control.update(f).await?;
            crate::out::line(format_args!(
                "paused: {}, dry run: {}, breaker: {}",
                state.paused,
                state.dry_run,
                match &state.breaker.tripped {
                    Some(trip) => format!("tripped ({})", trip.reason),
                    None => "closed".into(),
                }
            ))?;
            Ok::<u8, anyhow::Error>(exit::ALLOW)
        };
        match command {
            SlurmControllerCommand::Run(args) => run_controller(*args).await,
            SlurmControllerCommand::Status(etcd) => {
                let control = probity_slurm::EtcdControl::new(etcd.connect().await?);
                let state = control.state().await?;
                crate::out::line(serde_json::to_string_pretty(&state)?)?;
                Ok(exit::ALLOW)
            }
            SlurmControllerCommand::Pause(etcd) => change(etcd, Box::new(|s| s.paused = true)).await,
            SlurmControllerCommand::Resume(etcd) => change(etcd, Box::new(|s| s.paused = false)).await,
            SlurmControllerCommand::Reset(etcd) => change(etcd, Box::new(|s| s.breaker.reset())).await,
            SlurmControllerCommand::DryRun { etcd, mode } => {
                let on = mode == "on";
                change(
                    etcd,
                    Box::new(move |s| {
                        s.dry_run = on;
                        if !on {
                            s.would.clear();
                        }
                    }),
                )
                .await
            }
        }
    })
}

async fn run_controller(args: ControllerRunArgs) -> Result<u8> {
    init_logging(&args.log_format);
    let probity = args.probity.api()?;
    let etcd = args.etcd.connect().await?;
    let actuator = SlurmActuator::new(args.slurm.commands(), &args.job_namespace, args.job_stop);
    let options = SlurmControllerOptions {
        identity: args.identity.clone().unwrap_or_else(default_identity),
        lease_ttl: Duration::from_secs(args.lease_seconds.max(1)),
        interval: Duration::from_millis(args.interval_ms.max(10)),
        limits: args.breaker.limits(),
        dry_run: args.dry_run,
        // Recording needs a certificate the api policies let record events.
        record_events: args.probity.probity_cert.is_some(),
        escalation: None,
    };
    let controller = SlurmController::new(etcd, probity, actuator, options);
    if let Some(addr) = args.metrics_listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr} for metrics"))?;
        tokio::spawn(probity_kube::controller::metrics::serve(
            listener,
            controller.metrics(),
        ));
    }
    controller.run(probity_server::shutdown_signal()).await;
    Ok(exit::ALLOW)
}

//! `probity`: serve, check, evaluate and test policies from the command line.
//!
//! Exit codes (also in README.md):
//! 0 allow / success, 1 deny, 2 usage error, 3 invalid policy set,
//! 4 failed policy tests, 5 integrity failure (verify), 6 violation (`baseline check`:
//! reachable beyond the baseline or missing from it; `agent --once`: a finding is active),
//! 7 refused (`baseline apply` would lock out SSH or the control plane),
//! 8 unreadable or malformed input,
//! 9 the server could not start or failed (bad server configuration, listener, TLS material).
//! A closed standard output (`probity audit | head -3`) ends any command quietly with 0.

/// Writes a line to standard error, ignoring a closed stream (never panics, unlike
/// `eprintln!`).
macro_rules! err_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod agent;
mod controller;
mod docs;
mod impact;
mod integrity;
mod keys;
mod slurm;

/// Standard output, where a closed pipe is an error (`println!` would panic) that
/// `main` turns into a quiet exit 0.
mod out {
    use std::io::Write as _;

    /// Writes `text` and a newline.
    pub fn line(text: impl std::fmt::Display) -> std::io::Result<()> {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{text}")?;
        stdout.flush()
    }

    /// Whether `e` is a write to a closed pipe.
    pub fn is_closed_pipe(e: &anyhow::Error) -> bool {
        e.chain().any(|cause| {
            cause
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
        })
    }
}

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use probity::{Engine, LoadError, Request};

mod exit {
    pub const ALLOW: u8 = 0;
    pub const DENY: u8 = 1;
    pub const INVALID_POLICIES: u8 = 3;
    pub const TESTS_FAILED: u8 = 4;
    pub const INTEGRITY_FAILURE: u8 = 5;
    pub const VIOLATION: u8 = 6;
    pub const REFUSED: u8 = 7;
    pub const BAD_INPUT: u8 = 8;
    pub const SERVE_FAILED: u8 = 9;
}

/// What `probity --version` says: the version, the commit it was built from, and what
/// is built in.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("PROBITY_GIT_COMMIT"),
    ")\nbuilt in: cedar policies, wasm plugins (wasmtime), PKCS#11 anchors, etcd state, ",
    "kubernetes (webhook, extender, controller), slurm (job_submit, prolog, health, ",
    "controller), mimalloc"
);

/// Largest entities file `probity eval` reads.
const MAX_ENTITIES_BYTES: u64 = 64 * 1024 * 1024;

#[derive(Parser)]
#[command(
    name = "probity",
    version = VERSION,
    about = "Policy, compliance and data-integrity engine for GPU clusters"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the sidecar API and the Kubernetes admission webhook (see
    /// hooks/server/probity-server.toml for every option and its default).
    Serve(ServeArgs),
    /// Run the node agent: collect this node's facts, decide comply, listen and elevate,
    /// carry out the obligations (see hooks/agent/probity-agent.toml).
    Agent(agent::AgentArgs),
    /// Print shell completions (bash, zsh or fish) for this command line.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Write man pages for this command line and each subcommand into DIR.
    Man {
        /// Where to write probity.1, probity-serve.1, ... (created if absent).
        dir: PathBuf,
    },
    /// Slurm's hooks (job_submit.lua, the Prolog, the health check) and the
    /// controller's Slurm side.
    Slurm {
        #[command(subcommand)]
        command: slurm::SlurmCommand,
    },
    /// Run the Kubernetes controller (blocked nodes tainted, released when unblocked),
    /// or pause, resume, reset or dry-run it.
    Controller {
        #[command(subcommand)]
        command: controller::ControllerCommand,
    },
    /// Check, render or apply the node role's firewall baseline.
    Baseline {
        #[command(subcommand)]
        command: agent::BaselineCommand,
    },
    /// Parse and validate a policy directory (policies, schema, thresholds).
    Check {
        /// The policy directory.
        #[arg(default_value = "policies")]
        dir: PathBuf,
        #[command(flatten)]
        files: SchemaConfig,
        /// Also verify DIR/policy.seal, as an engine in sealed mode does: signed by the
        /// --public-key, every file listed with its digest, no other policy file.
        #[arg(long, requires = "public_key")]
        sealed: bool,
        /// With --sealed: the file holding the pinned public key (the hex form of an
        /// uncompressed P-256 point, as STATE_DIR/trusted.pub).
        #[arg(long, requires = "sealed")]
        public_key: Option<PathBuf>,
    },
    /// Policy sets: seal one for engines in sealed mode.
    Policy {
        #[command(subcommand)]
        command: integrity::PolicyCommand,
    },
    /// Decide one request and print the decision as JSON.
    Eval {
        /// The request: a JSON file, or - for standard input.
        #[arg(long)]
        request: PathBuf,
        /// Cluster facts to load into the entity store first (Cedar entity JSON).
        #[arg(long)]
        entities: Option<PathBuf>,
        /// A state directory whose blocked nodes and keyring keys apply to the decision.
        #[arg(long, env = "PROBITY_STATE_DIR")]
        state_dir: Option<PathBuf>,
        /// Ask as an authorized reporter of the facts the engine owns (a decision's
        /// time, a read's verification, power readings, login times): without it, a
        /// request that carries them is denied, as it is over the API.
        #[arg(long)]
        as_reporter: bool,
        /// The engine's clock for this decision, in Unix seconds [default: now].
        #[arg(long)]
        now: Option<i64>,
        #[command(flatten)]
        policies: PolicyArgs,
    },
    /// Seal a file or block device: manifest, HSM signature, registry entry.
    Seal {
        /// The object to seal.
        file: PathBuf,
        /// Its object id.
        #[arg(long)]
        id: String,
        /// Its version [default: the registry's latest + 1].
        #[arg(long)]
        version: Option<u64>,
        /// Where to write the signed manifest [default: FILE.manifest].
        #[arg(long)]
        manifest: Option<PathBuf>,
        /// Chunk size in bytes.
        #[arg(long, default_value_t = probity::integrity::Manifest::DEFAULT_CHUNK_SIZE)]
        chunk_size: u32,
        #[command(flatten)]
        state: integrity::StateArgs,
        #[command(flatten)]
        anchor: integrity::AnchorArgs,
    },
    /// Verify a file against its signed manifest before it is read; with --node, decide
    /// the read through the policies and block the node on a mismatch (exit 5).
    Verify {
        /// The object to verify.
        file: PathBuf,
        /// The object id it must be.
        #[arg(long)]
        id: String,
        /// The signed manifest [default: FILE.manifest].
        #[arg(long)]
        manifest: Option<PathBuf>,
        /// The node that reads the object.
        #[arg(long)]
        node: Option<String>,
        /// The pod that reads it, NAMESPACE/NAME[/UID]: a block its failed read causes
        /// names it, so the cluster manager stops its workload first.
        #[arg(long, requires = "node", value_name = "NAMESPACE/NAME[/UID]", value_parser = parse_reader_pod)]
        reader_pod: Option<probity::ReaderPod>,
        /// The Slurm job that reads it (default: SLURM_JOB_ID, set inside a job): named
        /// as the reader `slurm/job-<ID>`, so a failed read requeues that job.
        #[arg(
            long,
            requires = "node",
            conflicts_with = "reader_pod",
            env = "SLURM_JOB_ID"
        )]
        slurm_job: Option<String>,
        /// Ask the sidecar at this Unix socket (`POST /v1/verify`) instead of verifying
        /// here: the sidecar reads the file under its data roots, decides and blocks,
        /// and checks a reader claim against the calling process (its pod, its Slurm
        /// job).
        #[arg(long, requires = "node", value_name = "SOCKET")]
        sidecar: Option<PathBuf>,
        /// The file holding the pinned public key: the hex form of an uncompressed
        /// P-256 point (SEC1), as `seal` writes it [default: STATE_DIR/trusted.pub]. It
        /// is refused if others can write it or it belongs to another user than this one
        /// or root.
        #[arg(long)]
        public_key: Option<PathBuf>,
        /// Cluster facts to load first (Cedar entity JSON).
        #[arg(long)]
        entities: Option<PathBuf>,
        #[command(flatten)]
        state: integrity::StateArgs,
        #[command(flatten)]
        hsm: integrity::HsmArgs,
        #[command(flatten)]
        policies: PolicyArgs,
    },
    /// List, block and unblock nodes in the state directory.
    Nodes {
        #[command(subcommand)]
        command: integrity::NodesCommand,
        #[command(flatten)]
        state: integrity::StateArgs,
    },
    /// What the warn and audit policies find in the facts now: every Node judged as its
    /// agent asks (comply), every Workload as admission does (admit), as the server's
    /// GET /v1/reports and the controller's PolicyReports have it. Exit 0 when nothing
    /// is found, 6 when something is.
    Report {
        /// Cedar entity JSON: the facts to judge.
        #[arg(long)]
        entities: Option<PathBuf>,
        /// A state directory whose blocklist and node facts are judged too.
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        policies: PolicyArgs,
    },
    /// Print the decision log of a state directory (denies and decisions with
    /// obligations), one JSON record per line, oldest first; or verify the audit
    /// trail's hash chain and checkpoints (`probity audit verify`).
    #[command(args_conflicts_with_subcommands = true)]
    Audit {
        #[command(subcommand)]
        command: Option<integrity::AuditCommand>,
        #[command(flatten)]
        list: integrity::AuditArgs,
        #[command(flatten)]
        state: integrity::StateArgs,
    },
    /// The keyring: create, list, rotate, rewrap and erase data keys.
    Keys {
        #[command(subcommand)]
        command: keys::KeysCommand,
    },
    /// Encrypt a file under a keyring key, after the policies allow it (a key past its
    /// maximum age is rotated first, as they ask). Exit 1 when refused.
    Encrypt {
        #[command(flatten)]
        crypt: keys::CryptArgs,
        #[command(flatten)]
        encrypt: keys::EncryptArgs,
        #[command(flatten)]
        keyring: keys::KeyringArgs,
    },
    /// Decrypt a file encrypted by `probity encrypt`; exit 5 when it does not
    /// authenticate or its key was erased (no plaintext of a failed segment is written).
    Decrypt {
        #[command(flatten)]
        crypt: keys::CryptArgs,
        #[command(flatten)]
        keyring: keys::KeyringArgs,
    },
    /// Run policy test cases (scenario files) and report each.
    Test {
        /// A scenario file or a directory of them.
        #[arg(default_value = "testdata/scenarios")]
        path: PathBuf,
        #[command(flatten)]
        policies: PolicyArgs,
    },
}

#[derive(Args)]
struct ServeArgs {
    /// Configuration file (TOML); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Policy directory, hot-reloaded on change [default: the embedded policies].
    #[arg(long)]
    policies: Option<PathBuf>,
    /// Cedar entity JSON to load into the store at start.
    #[arg(long)]
    entities: Option<PathBuf>,
    /// State directory: durable blocks, manifest registry, event log; enables /v1/verify.
    #[arg(long, env = "PROBITY_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Unix socket path [default: /run/probity/probity.sock].
    #[arg(long, conflicts_with = "no_socket")]
    socket: Option<PathBuf>,
    /// Listen on no Unix socket (only on --listen).
    #[arg(long)]
    no_socket: bool,
    /// TCP address to listen on, with TLS unless --insecure (e.g. 0.0.0.0:8443).
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// Plain HTTP on --listen; allowed only on loopback addresses.
    #[arg(long)]
    insecure: bool,
    /// PEM certificate chain for TLS.
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    /// PEM private key for TLS.
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// PEM CA bundle: require client certificates it signed (mTLS).
    #[arg(long)]
    client_ca: Option<PathBuf>,
    /// Log format: text or json.
    #[arg(long, value_parser = ["text", "json"])]
    log_format: Option<String>,
}

#[derive(Args, Default)]
struct SchemaConfig {
    /// Schema file [default: DIR/probity.cedarschema].
    #[arg(long)]
    schema: Option<PathBuf>,
    /// Thresholds file [default: DIR/probity.toml].
    #[arg(long)]
    config: Option<PathBuf>,
    /// Plugin manifest [default: DIR/plugins.toml when it exists; none otherwise].
    #[arg(long)]
    plugins: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct PolicyArgs {
    /// Policy directory [default: ./policies if it holds probity.cedarschema, else the
    /// embedded defaults].
    #[arg(long)]
    policies: Option<PathBuf>,
    #[command(flatten)]
    files: SchemaConfig,
}

/// A failure that has already been reported and maps to an exit code.
#[derive(Debug)]
struct Exit(u8);

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit {}", self.0)
    }
}
impl std::error::Error for Exit {}

/// mimalloc rather than glibc's malloc: the server allocates and frees a few dozen
/// small objects per request on two threads, where glibc's arenas cost measurably more
/// (BENCHMARKS.md, Server).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            if let Some(Exit(code)) = e.downcast_ref::<Exit>() {
                return ExitCode::from(*code);
            }
            // Whoever read our output stopped reading: that is their choice, not a failure.
            if out::is_closed_pipe(&e) {
                return ExitCode::from(exit::ALLOW);
            }
            err_line!("error: {e:#}");
            ExitCode::from(exit::BAD_INPUT)
        }
    }
}

fn run(cli: Cli) -> Result<u8> {
    match cli.command {
        Command::Serve(args) => serve(args),
        Command::Agent(args) => agent::agent(args),
        Command::Baseline { command } => agent::baseline(command),
        Command::Controller { command } => controller::controller(command),
        Command::Slurm { command } => slurm::slurm(command),
        Command::Completions { shell } => docs::completions(shell),
        Command::Man { dir } => docs::man_pages(&dir),
        Command::Check {
            dir,
            files,
            sealed: _,
            public_key,
        } => check(&dir, &files, public_key.as_deref()),
        Command::Policy { command } => integrity::policy(&command),
        Command::Eval {
            request,
            entities,
            state_dir,
            as_reporter,
            now,
            policies,
        } => eval(
            &request,
            entities.as_deref(),
            state_dir.as_deref(),
            EvalAs { as_reporter, now },
            &policies,
        ),
        Command::Test { path, policies } => test(&path, &policies),
        Command::Keys { command } => keys::keys(&command),
        Command::Encrypt {
            crypt,
            encrypt,
            keyring,
        } => keys::encrypt(&crypt, &encrypt, &keyring),
        Command::Decrypt { crypt, keyring } => keys::decrypt(&crypt, &keyring),
        Command::Seal {
            file,
            id,
            version,
            manifest,
            chunk_size,
            state,
            anchor,
        } => integrity::seal(
            &integrity::SealArgs {
                file: &file,
                id: &id,
                version,
                manifest: manifest.as_deref(),
                chunk_size,
            },
            &state,
            &anchor,
        ),
        Command::Verify {
            file,
            id,
            manifest,
            node,
            reader_pod,
            slurm_job,
            sidecar,
            public_key,
            entities,
            state,
            hsm,
            policies,
        } => {
            let reader_pod = match (reader_pod, slurm_job) {
                (Some(pod), _) => Some(pod),
                (None, Some(job)) => Some(slurm_reader(&job)?),
                (None, None) => None,
            };
            if let (Some(socket), Some(node)) = (&sidecar, &node) {
                return integrity::verify_through_sidecar(
                    socket,
                    &file,
                    &id,
                    manifest.as_deref(),
                    node,
                    reader_pod.as_ref(),
                );
            }
            integrity::verify(
                &integrity::VerifyArgs {
                    file: &file,
                    id: &id,
                    manifest: manifest.as_deref(),
                    node: node.as_deref(),
                    reader_pod: reader_pod.as_ref(),
                    public_key: public_key.as_deref(),
                    entities: entities.as_deref(),
                },
                &state,
                &hsm,
                &policies,
            )
        }
        Command::Nodes { command, state } => integrity::nodes(&command, &state),
        Command::Audit {
            command,
            list,
            state,
        } => integrity::audit(command.as_ref(), &list, &state),
        Command::Report {
            entities,
            state_dir,
            json,
            policies,
        } => report_store(entities.as_deref(), state_dir.as_deref(), json, &policies),
    }
}

/// A Slurm job as a reader: `slurm/job-<id>`, the id checked as untrusted input.
fn slurm_reader(job: &str) -> Result<probity::ReaderPod> {
    if !probity_slurm::commands::is_job_id(job) {
        bail!("--slurm-job (or SLURM_JOB_ID): {job:?} is not a Slurm job id (digits)");
    }
    probity::ReaderPod::new(
        probity_slurm::actuator::JOB_NAMESPACE,
        format!("job-{job}"),
        None,
    )
    .map_err(|e| anyhow::anyhow!("--slurm-job: {e}"))
}

/// `--reader-pod`'s value, checked as untrusted input (the error names the field).
fn parse_reader_pod(text: &str) -> std::result::Result<probity::ReaderPod, String> {
    probity::ReaderPod::parse(text).map_err(|e| e.to_string())
}

fn serve(args: ServeArgs) -> Result<u8> {
    use probity_server::{Config, LogFormat};
    let mut config = match &args.config {
        Some(path) => match Config::from_file(path) {
            Ok(c) => c,
            Err(e) => {
                err_line!("error: {e}");
                return Ok(exit::SERVE_FAILED);
            }
        },
        None => Config::default(),
    };
    let s = &mut config.server;
    if let Some(p) = args.socket {
        s.socket = p;
    }
    if args.no_socket {
        s.socket = PathBuf::new();
    }
    if args.listen.is_some() {
        s.listen = args.listen;
    }
    s.insecure |= args.insecure;
    s.tls_cert = args.tls_cert.or(s.tls_cert.take());
    s.tls_key = args.tls_key.or(s.tls_key.take());
    s.client_ca = args.client_ca.or(s.client_ca.take());
    if args.policies.is_some() {
        config.policies.dir = args.policies;
    }
    if args.entities.is_some() {
        config.policies.entities = args.entities;
    }
    if args.state_dir.is_some() {
        config.integrity.state_dir = args.state_dir;
    }
    match args.log_format.as_deref() {
        Some("json") => config.log.format = LogFormat::Json,
        Some(_) => config.log.format = LogFormat::Text,
        None => {}
    }
    probity_server::init_logging(&config.log);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    match runtime.block_on(probity_server::serve(config)) {
        Ok(()) => Ok(exit::ALLOW),
        Err(e) => {
            err_line!("error: {:#}", anyhow::Error::new(e));
            Ok(exit::SERVE_FAILED)
        }
    }
}

fn build(dir: &Path, files: &SchemaConfig) -> Result<Engine, LoadError> {
    build_with(dir, files, None, None)
}

fn build_with_clock(
    dir: &Path,
    files: &SchemaConfig,
    clock: Option<std::sync::Arc<dyn probity::Clock>>,
) -> Result<Engine, LoadError> {
    build_with(dir, files, clock, None)
}

fn build_with(
    dir: &Path,
    files: &SchemaConfig,
    clock: Option<std::sync::Arc<dyn probity::Clock>>,
    sealed: Option<probity::integrity::Verifier>,
) -> Result<Engine, LoadError> {
    let mut b = Engine::builder(dir);
    if let Some(verifier) = sealed {
        b = b.sealed(verifier);
    }
    if let Some(c) = clock {
        b = b.clock(c);
    }
    if let Some(s) = &files.schema {
        b = b.schema(s);
    }
    if let Some(c) = &files.config {
        b = b.config(c);
    }
    if let Some(p) = &files.plugins {
        b = b.plugins(p);
    }
    b.build()
}

pub(crate) fn report(e: LoadError) -> anyhow::Error {
    err_line!("{:?}", miette::Report::new(e));
    Exit(exit::INVALID_POLICIES).into()
}

pub(crate) fn load(args: &PolicyArgs) -> Result<Engine> {
    load_with_clock(args, None)
}

pub(crate) fn load_with_clock(
    args: &PolicyArgs,
    clock: Option<std::sync::Arc<dyn probity::Clock>>,
) -> Result<Engine> {
    let dir = args.policies.clone().or_else(|| {
        let local = PathBuf::from("policies");
        local.join("probity.cedarschema").is_file().then_some(local)
    });
    match dir {
        Some(dir) => {
            err_line!("probity: policies from {}", dir.display());
            build_with_clock(&dir, &args.files, clock).map_err(report)
        }
        None => {
            err_line!("probity: embedded default policies");
            let mut b = Engine::defaults();
            if let Some(c) = clock {
                b = b.clock(c);
            }
            b.build().map_err(report)
        }
    }
}

fn check(dir: &Path, files: &SchemaConfig, sealed: Option<&Path>) -> Result<u8> {
    let verifier = sealed.map(integrity::sealed_verifier).transpose()?;
    let engine = build_with(dir, files, None, verifier).map_err(report)?;
    let status = engine.status();
    if status.policies == 0 {
        err_line!(
            "error: no policies (*.cedar) under {}: the engine would deny every request",
            dir.display()
        );
        return Ok(exit::INVALID_POLICIES);
    }
    out::line(format_args!(
        "ok: {} policies in {} files, digest {}",
        status.policies,
        status.files.len(),
        status.digest
    ))?;
    if let Some(seal) = &status.seal {
        out::line(format_args!(
            "sealed: {} version {}, seal digest {}, signed by key {}",
            seal.name, seal.version, seal.digest, seal.key_id
        ))?;
    }
    // What does not plainly enforce is said, so that a rollout is never forgotten.
    for (policy, modes) in &status.modes {
        out::line(format_args!(
            "mode {policy}: {} ({})",
            modes.mode, modes.declared_in
        ))?;
        for scoped in &modes.scoped {
            out::line(format_args!("  {} where {}", scoped.mode, scoped.when))?;
        }
    }
    for p in &status.plugins {
        out::line(format_args!(
            "plugin {} {} for {} ({}, {} ms, {} MiB)",
            p.name,
            p.version,
            p.actions.join(", "),
            p.path,
            p.timeout_ms,
            p.memory_mib
        ))?;
        if !p.trapping_imports.is_empty() {
            out::line(format_args!(
                "  WASI imports linked as traps: {}",
                p.trapping_imports.join(", ")
            ))?;
        }
    }
    Ok(exit::ALLOW)
}

/// Reads a file (or standard input for `-`), refusing anything over `limit` bytes.
fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    if path == Path::new("-") {
        std::io::stdin()
            .take(limit + 1)
            .read_to_end(&mut buf)
            .context("cannot read standard input")?;
    } else {
        let len = std::fs::metadata(path)
            .with_context(|| format!("cannot read {}", path.display()))?
            .len();
        if len > limit {
            bail!(
                "{} is {len} bytes, over the limit of {limit}",
                path.display()
            );
        }
        std::fs::File::open(path)
            .and_then(|f| f.take(limit + 1).read_to_end(&mut buf))
            .with_context(|| format!("cannot read {}", path.display()))?;
    }
    if buf.len() as u64 > limit {
        bail!("{} is over the limit of {limit} bytes", path.display());
    }
    Ok(buf)
}

/// How `eval` asks: as a reporter or not, at which time.
struct EvalAs {
    as_reporter: bool,
    now: Option<i64>,
}

fn eval(
    request: &Path,
    entities: Option<&Path>,
    state_dir: Option<&Path>,
    asking: EvalAs,
    policies: &PolicyArgs,
) -> Result<u8> {
    let clock: Option<std::sync::Arc<dyn probity::Clock>> = asking.now.map(|t| {
        std::sync::Arc::new(probity::ManualClock::at(t)) as std::sync::Arc<dyn probity::Clock>
    });
    let engine = load_with_clock(policies, clock)?;
    if let Some(dir) = state_dir {
        // The store records at the asked time too (`--now`).
        let state = probity::state::StateStore::open_with_clock(dir, engine.clock().clone())
            .with_context(|| format!("cannot open the state directory {}", dir.display()))?;
        engine.attach_state(std::sync::Arc::new(state))?;
        // The keyring's keys, as their metadata stands: an encrypt decision judges them.
        probity::keys::publish_stored_keys(&engine)?;
    }
    if let Some(path) = entities {
        load_entities(&engine, path)?;
    }
    let bytes = read_limited(request, probity::Request::MAX_BYTES as u64)?;
    let mut request = Request::from_json_slice(&bytes)
        .with_context(|| format!("cannot read the request in {}", request.display()))?;
    if asking.as_reporter {
        request = request.as_fact_reporter();
    }
    let decision = engine.decide(&request);
    out::line(serde_json::to_string_pretty(&decision)?)?;
    Ok(if decision.is_allowed() {
        exit::ALLOW
    } else {
        exit::DENY
    })
}

/// `probity report`: the store's warn and audit findings (see `probity_server::reports`).
fn report_store(
    entities: Option<&Path>,
    state_dir: Option<&Path>,
    json: bool,
    policies: &PolicyArgs,
) -> Result<u8> {
    let engine = load(policies)?;
    if let Some(dir) = state_dir {
        let state = probity::state::StateStore::open(dir)
            .with_context(|| format!("cannot open the state directory {}", dir.display()))?;
        engine.attach_state(std::sync::Arc::new(state))?;
    }
    if let Some(path) = entities {
        load_entities(&engine, path)?;
    }
    let report = probity_server::reports::audit_store(&engine);
    let found = report.nodes.len() + report.workloads.values().map(Vec::len).sum::<usize>();
    if json {
        out::line(serde_json::to_string_pretty(&report)?)?;
    } else {
        out::line(format_args!(
            "judged {} entities: {found} warn/audit findings",
            report.judged
        ))?;
        let all = report.nodes.iter().map(|f| ("", f)).chain(
            report
                .workloads
                .iter()
                .flat_map(|(ns, list)| list.iter().map(move |f| (ns.as_str(), f))),
        );
        for (namespace, f) in all {
            let place = if namespace.is_empty() {
                f.subject.clone()
            } else {
                format!("{} in namespace {namespace}", f.subject)
            };
            out::line(format_args!(
                "{place}: {} ({}, {}): {}",
                f.policy,
                f.mode,
                format!("{:?}", f.severity).to_lowercase(),
                f.message
            ))?;
        }
    }
    Ok(if found == 0 {
        exit::ALLOW
    } else {
        exit::VIOLATION
    })
}

/// Loads a Cedar entity JSON file into the engine's store.
pub(crate) fn load_entities(engine: &Engine, path: &Path) -> Result<()> {
    let bytes = read_limited(path, MAX_ENTITIES_BYTES)?;
    let json: serde_json::Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    engine
        .upsert_entities(&json)
        .with_context(|| format!("cannot load entities from {}", path.display()))?;
    Ok(())
}

fn test(path: &Path, policies: &PolicyArgs) -> Result<u8> {
    let engine = load(policies)?;
    let files = probity::scenario::discover(path)
        .with_context(|| format!("cannot list scenarios under {}", path.display()))?;
    if files.is_empty() {
        bail!("no scenario files (*.json) under {}", path.display());
    }
    let (mut passed, mut failed) = (0usize, 0usize);
    for file in files {
        match probity::scenario::run_file(&engine, &file) {
            Ok(results) => {
                for r in results {
                    out::line(&r)?;
                    if r.passed() {
                        passed += 1;
                    } else {
                        failed += 1;
                    }
                }
            }
            Err(e) => {
                out::line(format_args!("FAILED  {}: {e:#}", file.display()))?;
                failed += 1;
            }
        }
    }
    out::line(format_args!("{passed} passed, {failed} failed"))?;
    Ok(if failed == 0 {
        exit::ALLOW
    } else {
        exit::TESTS_FAILED
    })
}

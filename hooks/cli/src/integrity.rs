//! `probity seal`, `probity verify`, `probity nodes`, `probity audit` and
//! `probity policy seal`: the integrity commands.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::builder::BoolishValueParser;
use clap::{Args, Subcommand};
use probity::integrity::{
    self, Anchor, HashOptions, Pin, Pkcs11Anchor, Pkcs11Config, RollbackMemory, SoftwareAnchor,
    Verifier, VerifyOptions,
};
use probity::policy_seal::{self, PolicySeal};
use probity::state::StateStore;

use crate::{PolicyArgs, exit, load, out};

/// Largest signed manifest read (a manifest of a 4 TiB object in 4 MiB chunks is ~32 MiB).
const MAX_MANIFEST_BYTES: u64 = 64 * 1024 * 1024;

/// Where the state lives and which anchor signs.
#[derive(Args)]
pub struct StateArgs {
    /// State directory: registry, blocklist, event log, software key, pinned public key.
    #[arg(long, env = "PROBITY_STATE_DIR", default_value = "/var/lib/probity")]
    pub(crate) state_dir: PathBuf,
}

/// Which HSM token, and how to log in to it.
#[derive(Args)]
pub struct HsmArgs {
    /// PKCS#11 module of the HSM, e.g. /usr/lib/softhsm/libsofthsm2.so.
    #[arg(long, env = "PROBITY_HSM_MODULE")]
    pub(crate) hsm_module: Option<PathBuf>,
    /// Label of the HSM token.
    #[arg(long, env = "PROBITY_HSM_TOKEN")]
    pub(crate) hsm_token: Option<String>,
    /// File holding the user PIN (first line), readable by its owner only. Else the PIN is
    /// read from PROBITY_HSM_PIN. The PIN is never taken from the command line.
    #[arg(long, env = "PROBITY_HSM_PIN_FILE")]
    pub(crate) hsm_pin_file: Option<PathBuf>,
    /// Use a PIN file that group or others can read, with a warning (refused otherwise).
    #[arg(long, env = "PROBITY_HSM_ALLOW_READABLE_PIN_FILE", value_parser = BoolishValueParser::new())]
    pub(crate) allow_readable_pin_file: bool,
}

/// Which anchor signs manifests. Without `--hsm-module`, the software anchor
/// (`STATE_DIR/anchor.key`, not an HSM).
#[derive(Args)]
pub struct AnchorArgs {
    #[command(flatten)]
    hsm: HsmArgs,
    /// Label of the signing key in the token (generated there if missing).
    #[arg(long, default_value = "probity-manifest-signing")]
    hsm_key: String,
    /// Sign with a token key the HSM does not protect (sensitive, not extractable,
    /// generated in the token): refused otherwise. Every output then says the signature
    /// is NOT HSM-protected ("hsm": false, "hsm_key_protected": false).
    #[arg(long, env = "PROBITY_HSM_ALLOW_UNPROTECTED_KEY", value_parser = BoolishValueParser::new())]
    allow_unprotected_hsm_key: bool,
}

/// `probity nodes ...`
#[derive(Subcommand)]
pub enum NodesCommand {
    /// List blocked nodes as JSON.
    List,
    /// Block a node: placement policies refuse it until it is unblocked.
    Block {
        /// Node id.
        node: String,
        /// Why (recorded with the block).
        #[arg(long)]
        reason: String,
    },
    /// Lift a block. This is the only way a block ends.
    Unblock {
        /// Node id.
        node: String,
    },
}

/// `probity policy ...`
#[derive(Subcommand)]
pub enum PolicyCommand {
    /// Seal a policy directory: write DIR/policy.seal, a signed list of every file of the
    /// set with its SHA-256, for engines in sealed mode (`probity check --sealed`).
    Seal {
        /// The policy directory.
        dir: PathBuf,
        /// The set's name (letters, digits, '.', '_', '-').
        #[arg(long)]
        name: String,
        /// Its version [default: the version of DIR/policy.seal + 1, or 1].
        #[arg(long)]
        version: Option<u64>,
        #[command(flatten)]
        state: StateArgs,
        #[command(flatten)]
        anchor: AnchorArgs,
    },
    /// Replay recorded decisions under the live set and a candidate set: every one whose
    /// answer would change (allow to deny and back, obligations or warn/audit findings
    /// gained or lost), grouped by policy, with examples. Exit 0 when nothing changes,
    /// 1 when something does.
    Impact(crate::impact::ImpactArgs),
}

fn open_state(args: &StateArgs) -> Result<Arc<StateStore>> {
    Ok(Arc::new(StateStore::open(&args.state_dir).with_context(
        || {
            format!(
                "cannot open the state directory {}",
                args.state_dir.display()
            )
        },
    )?))
}

/// Opens the state for sealing or verifying: a registry created by this open gets its
/// rollback memory back from the HSM token when one is configured, and says loudly
/// that rollback protection restarts from zero when none is.
fn open_registry(args: &StateArgs, hsm: &HsmArgs) -> Result<Arc<StateStore>> {
    let state = open_state(args)?;
    let config = if state.is_new() {
        hsm_config(hsm, "probity-manifest-signing", false)?
    } else {
        None
    };
    let memory =
        integrity::RollbackMemory::restore(state.as_ref(), state.is_new(), config.as_ref())
            .context("cannot restore the registry's rollback memory")?;
    match memory {
        RollbackMemory::Kept => {}
        RollbackMemory::Rebuilt { objects } => err_line!(
            "probity: new registry {}: rebuilt the highest sealed version of {objects} object(s) from the HSM token",
            state.path().display()
        ),
        RollbackMemory::RestartedFromZero => err_line!(
            "error: rollback protection restarts from zero: the registry {} is new and no HSM is configured to rebuild it from, so any signed version of any object will be accepted once",
            state.path().display()
        ),
    }
    Ok(state)
}

/// The PKCS#11 configuration, when `--hsm-module` is given.
fn hsm_config(
    args: &HsmArgs,
    key_label: &str,
    allow_unprotected_key: bool,
) -> Result<Option<Pkcs11Config>> {
    let Some(module) = &args.hsm_module else {
        return Ok(None);
    };
    let Some(token) = &args.hsm_token else {
        bail!("--hsm-module needs --hsm-token (or PROBITY_HSM_TOKEN)");
    };
    let pin = match &args.hsm_pin_file {
        Some(path) if args.allow_readable_pin_file => {
            let (pin, readable) = Pin::from_file_lenient(path)?;
            match readable {
                Some(probity_base::trust::TrustError::Readable {
                    path, mode, who, ..
                }) => err_line!(
                    "warning: PIN file {}: mode {mode:04o} lets {who} read it (chmod 600 it); used because of --allow-readable-pin-file",
                    path.display()
                ),
                Some(other) => err_line!("warning: {other}"),
                None => {}
            }
            pin
        }
        Some(path) => Pin::from_file(path)?,
        None => Pin::from_env("PROBITY_HSM_PIN")?,
    };
    let mut config = Pkcs11Config::new(module, token, key_label, pin);
    config.allow_unprotected_key = allow_unprotected_key;
    Ok(Some(config))
}

fn anchor(args: &AnchorArgs, state: &StateArgs) -> Result<Box<dyn Anchor>> {
    match hsm_config(&args.hsm, &args.hsm_key, args.allow_unprotected_hsm_key)? {
        Some(config) => Ok(Box::new(Pkcs11Anchor::open_or_generate(&config)?)),
        None => Ok(Box::new(SoftwareAnchor::load_or_generate(
            &state.state_dir.join("anchor.key"),
        )?)),
    }
}

fn trusted_key_path(state: &StateArgs) -> PathBuf {
    state.state_dir.join("trusted.pub")
}

/// Pins the signing key on first use (mode 0644 whatever the umask), so that `verify`
/// on this host needs no flag.
fn pin_on_first_use(state: &StateArgs, anchor: &dyn Anchor) -> Result<()> {
    let pinned = trusted_key_path(state);
    if !pinned.exists() {
        anchor
            .public_key()
            .pin(&pinned)
            .with_context(|| format!("cannot write {}", pinned.display()))?;
    }
    Ok(())
}

/// A progress bar on a terminal, nothing otherwise.
fn progress_bar(path: &Path) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let len = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    Some(bar)
}

fn manifest_path(file: &Path, manifest: Option<&Path>) -> PathBuf {
    manifest
        .map(Path::to_path_buf)
        .unwrap_or_else(|| integrity::Manifest::default_path(file))
}

/// What `probity seal` seals.
pub struct SealArgs<'a> {
    pub file: &'a Path,
    pub id: &'a str,
    pub version: Option<u64>,
    pub manifest: Option<&'a Path>,
    pub chunk_size: u32,
}

/// `probity seal FILE --id ID`
pub fn seal(args: &SealArgs<'_>, state_args: &StateArgs, anchor_args: &AnchorArgs) -> Result<u8> {
    let (file, id) = (args.file, args.id);
    if args.version == Some(u64::MAX) {
        bail!(
            "--version {}: the last version is refused, since nothing could be sealed after it",
            u64::MAX
        );
    }
    let state = open_registry(state_args, &anchor_args.hsm)?;
    let anchor = anchor(anchor_args, state_args)?;
    let description = anchor.describe();
    let version = match args.version {
        Some(v) => v,
        None => match integrity::SignedManifest::next_version(state.as_ref(), id)? {
            Some(v) => v,
            None => bail!(
                "{id:?} has reached the last version the registry can hold; seal it under a new id"
            ),
        },
    };
    let bar = progress_bar(file);
    let tick = |done: u64| {
        if let Some(b) = &bar {
            b.set_position(done);
        }
    };
    if let Some(b) = &bar {
        b.set_message(format!("sealing {id}"));
    }
    let options = HashOptions {
        chunk_size: args.chunk_size,
        progress: Some(&tick),
        ..HashOptions::default()
    };
    let signed = integrity::SignedManifest::seal(
        file,
        id,
        version,
        anchor.as_ref(),
        state.as_ref(),
        &options,
    )?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let out_path = manifest_path(file, args.manifest);
    std::fs::write(&out_path, signed.encode())
        .with_context(|| format!("cannot write the manifest {}", out_path.display()))?;
    pin_on_first_use(state_args, anchor.as_ref())?;
    let m = signed.manifest();
    out::line(serde_json::to_string_pretty(&serde_json::json!({
        "object_id": m.object_id(),
        "version": m.version(),
        "size": m.size(),
        "chunk_size": m.chunk_size(),
        "chunks": m.chunk_count(),
        "root": hex::encode(m.root()),
        "digest": hex::encode(signed.digest()),
        "manifest": out_path.display().to_string(),
        "anchor": description.summary,
        "hsm": description.is_hsm(),
        "hsm_key_protected": description.key_protected,
        "key_id": hex::encode(signed.key_id().0),
    }))?)?;
    if !description.is_hsm() {
        err_line!("warning: signed with the {}", description.summary);
    }
    Ok(exit::ALLOW)
}

/// What `probity verify` checks against.
pub struct VerifyArgs<'a> {
    pub file: &'a Path,
    pub id: &'a str,
    pub manifest: Option<&'a Path>,
    pub node: Option<&'a str>,
    pub reader_pod: Option<&'a probity::ReaderPod>,
    pub public_key: Option<&'a Path>,
    pub entities: Option<&'a Path>,
}

/// `probity verify FILE --id ID [--node N]`
pub fn verify(
    args: &VerifyArgs<'_>,
    state_args: &StateArgs,
    hsm: &HsmArgs,
    policies: &PolicyArgs,
) -> Result<u8> {
    let key_path = args
        .public_key
        .map(Path::to_path_buf)
        .unwrap_or_else(|| trusted_key_path(state_args));
    let verifier = Verifier::new(integrity::PublicKey::load_pinned(&key_path)?);
    let state = open_registry(state_args, hsm)?;
    let manifest_file = manifest_path(args.file, args.manifest);
    let bytes = crate::read_limited(&manifest_file, MAX_MANIFEST_BYTES)?;
    let bar = progress_bar(args.file);
    let tick = |done: u64| {
        if let Some(b) = &bar {
            b.set_position(done);
        }
    };
    if let Some(b) = &bar {
        b.set_message(format!("verifying {}", args.id));
    }
    let options = VerifyOptions {
        hash: HashOptions {
            progress: Some(&tick),
            ..HashOptions::default()
        },
        // The node is blocked through the policies below (decide_read), not behind their back.
        node: None,
        expected_object_id: Some(args.id),
    };
    // The environment failing is an error to report; the object failing is a verdict.
    let outcome = verifier
        .verify_encoded(args.file, &bytes, state.as_ref(), &options)
        .context("could not verify")?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let Some(node) = args.node else {
        return match outcome {
            Ok(report) => {
                out::line(
                    serde_json::json!({"verified": true, "object_id": report.object_id,
                        "version": report.version, "chunks": report.chunks,
                        "root": hex::encode(report.root)}),
                )?;
                Ok(exit::ALLOW)
            }
            Err(e) => {
                out::line(serde_json::json!({"verified": false, "failure": e.to_string()}))?;
                Ok(exit::INTEGRITY_FAILURE)
            }
        };
    };
    // As a node: the outcome goes through the policies, and their obligations are carried out.
    let engine = load(policies)?;
    engine.attach_state(state.clone())?;
    if let Some(path) = args.entities {
        crate::load_entities(&engine, path)?;
    }
    let verification = match &outcome {
        Ok(report) => Ok(report),
        Err(e) => Err(e as &dyn std::error::Error),
    };
    let decision = engine.decide_read_as(node, args.id, verification, args.reader_pod);
    out::line(serde_json::to_string_pretty(&decision)?)?;
    Ok(if decision.is_allowed() {
        exit::ALLOW
    } else {
        exit::INTEGRITY_FAILURE
    })
}

/// `probity verify FILE --id ID --node N --sidecar SOCKET`: the sidecar verifies and
/// decides (`POST /v1/verify`); its answer is printed, exit 5 on a failed read.
pub fn verify_through_sidecar(
    socket: &Path,
    file: &Path,
    id: &str,
    manifest: Option<&Path>,
    node: &str,
    reader: Option<&probity::ReaderPod>,
) -> Result<u8> {
    // The sidecar resolves the paths itself, from its own working directory.
    let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_owned());
    let mut body = serde_json::json!({"path": absolute(file), "id": id, "node": node});
    if let Some(fields) = body.as_object_mut() {
        if let Some(m) = manifest {
            fields.insert("manifest".into(), serde_json::json!(absolute(m)));
        }
        if let Some(r) = reader {
            fields.insert("reader".into(), serde_json::to_value(r)?);
        }
    }
    // Hashing a large object takes a while: the deadline is generous.
    let client = probity_slurm::SidecarClient::new(socket, std::time::Duration::from_secs(600));
    let (status, answer) = client.post("/v1/verify", &body)?;
    out::line(serde_json::to_string_pretty(&answer)?)?;
    if status != 200 {
        bail!(
            "the sidecar refused the verification ({status}): {}",
            answer.get("error").and_then(|e| e.as_str()).unwrap_or("")
        );
    }
    let allowed = answer
        .pointer("/decision/decision")
        .and_then(|d| d.as_str())
        == Some("allow");
    Ok(if allowed {
        exit::ALLOW
    } else {
        exit::INTEGRITY_FAILURE
    })
}

/// `probity nodes list|block|unblock`
pub fn nodes(command: &NodesCommand, state_args: &StateArgs) -> Result<u8> {
    let state = open_state(state_args)?;
    match command {
        NodesCommand::List => {}
        NodesCommand::Block { node, reason } => {
            use probity::Clock as _;
            // The operator's block, at the machine's time: no engine runs here.
            let now = u64::try_from(probity::SystemClock.now_unix()).unwrap_or(0);
            probity::state::SharedState::block_node(state.as_ref(), node, reason, now)?;
        }
        NodesCommand::Unblock { node } => {
            if !state.unblock_node(node)? {
                err_line!("{node} was not blocked");
            }
        }
    }
    let list: Vec<_> = state
        .blocked_nodes()?
        .into_iter()
        .map(|b| {
            let mut v = serde_json::json!({"node": b.node, "reason": b.record.reason, "since": b.record.since});
            if let (Some(o), false) = (v.as_object_mut(), b.record.history.is_empty()) {
                o.insert("history".into(), serde_json::json!(b.record.history));
            }
            // A failed read's block: which pod read, and what must stop.
            if let Some(o) = v.as_object_mut() {
                if let Some(reader) = &b.record.reader {
                    o.insert("reader".into(), serde_json::json!(reader));
                }
                if let Some(stop) = &b.record.stop {
                    o.insert("stop".into(), serde_json::json!(stop));
                }
                if let Some(effect) = &b.record.taint_effect {
                    o.insert("taintEffect".into(), serde_json::json!(effect));
                }
            }
            v
        })
        .collect();
    out::line(serde_json::to_string_pretty(&list)?)?;
    Ok(exit::ALLOW)
}

/// `probity audit ...`
#[derive(Subcommand)]
pub enum AuditCommand {
    /// Re-check the hash chain of the decision and event logs and every checkpoint, and
    /// name the first record that was edited, deleted, reordered or cut before the last
    /// checkpoint (exit 5). A cut after the last checkpoint cannot be seen here: the
    /// SIEM's forwarded copy is the witness of those records.
    Verify {
        /// The pinned public key (hex) checkpoints must be signed by. Without it,
        /// signatures are not checked, and the output says so.
        #[arg(long)]
        public_key: Option<PathBuf>,
        #[command(flatten)]
        state: StateArgs,
    },
    /// Checkpoint now every log with records not yet checkpointed, signed by the anchor
    /// (the HSM with --hsm-module, else the software anchor STATE_DIR/anchor.key, not an
    /// HSM). For a log about to go quiet, e.g. before a shutdown.
    Checkpoint {
        #[command(flatten)]
        anchor: AnchorArgs,
        #[command(flatten)]
        state: StateArgs,
    },
}

/// Which decisions `probity audit` prints.
#[derive(Args)]
pub struct AuditArgs {
    /// The first sequence number to print.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// The most records to print (with --follow: the most read per poll).
    #[arg(long, default_value_t = 1000)]
    limit: usize,
    /// Only records about this node: its principal or resource, or an obligation's
    /// target, is Node::"NODE".
    #[arg(long)]
    node: Option<String>,
    /// Only records a policy with this @id took part in (a reason, an obligation or an
    /// error).
    #[arg(long)]
    policy: Option<String>,
    /// Only allows (with obligations) or only denies.
    #[arg(long, value_enum)]
    decision: Option<DecisionFilter>,
    /// Keep printing records as they are recorded, until SIGINT or SIGTERM, or until the
    /// reader of the output pipe goes away. The state directory is opened for each poll
    /// only, so other processes can write it in between (not while a server holds it).
    #[arg(long)]
    follow: bool,
    /// How often --follow looks for new records, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..))]
    poll_ms: u64,
}

/// `--decision allow|deny`
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DecisionFilter {
    /// Allowed (recorded because they carry obligations).
    Allow,
    /// Denied.
    Deny,
}

/// Records read per page while filtering.
const AUDIT_PAGE: usize = 1000;

impl AuditArgs {
    fn matches(&self, r: &probity::state::DecisionRecord) -> bool {
        let d = &r.decision;
        let node = self.node.as_ref().is_none_or(|node| {
            let uid = format!(
                "Node::\"{}\"",
                node.replace('\\', "\\\\").replace('"', "\\\"")
            );
            r.principal == uid
                || r.resource == uid
                || d.obligations
                    .iter()
                    .any(|o| o.target.as_deref() == Some(uid.as_str()))
        });
        let policy = self.policy.as_ref().is_none_or(|p| {
            d.reasons.iter().any(|x| &x.policy == p)
                || d.obligations.iter().any(|x| &x.policy == p)
                || d.errors.iter().any(|x| x.policy.as_ref() == Some(p))
        });
        let effect = self.decision.is_none_or(|f| {
            d.decision
                == match f {
                    DecisionFilter::Allow => probity::Effect::Allow,
                    DecisionFilter::Deny => probity::Effect::Deny,
                }
        });
        node && policy && effect
    }

    /// Prints the matching records from `from`, at most `budget` of them and reading at
    /// most `read_limit`; the next sequence number to read and how many were printed.
    fn print_from(
        &self,
        state: &StateStore,
        mut from: u64,
        budget: usize,
        read_limit: usize,
    ) -> Result<(u64, usize)> {
        let (mut printed, mut read) = (0usize, 0usize);
        while printed < budget && read < read_limit {
            let page = state.decisions(from, AUDIT_PAGE.min(read_limit - read))?;
            let Some(last) = page.last().map(|r| r.seq) else {
                break;
            };
            read += page.len();
            for record in page.iter().filter(|r| self.matches(r)) {
                if printed == budget {
                    return Ok((record.seq, printed));
                }
                out::line(record.to_json())?;
                printed += 1;
            }
            from = last.saturating_add(1);
        }
        Ok((from, printed))
    }
}

/// `probity audit [verify|checkpoint]`: the decision log, one JSON record per line, or
/// the audit trail's verification.
pub fn audit(
    command: Option<&AuditCommand>,
    args: &AuditArgs,
    state_args: &StateArgs,
) -> Result<u8> {
    match command {
        Some(AuditCommand::Verify { public_key, state }) => {
            audit_verify(public_key.as_deref(), state)
        }
        Some(AuditCommand::Checkpoint { anchor: a, state }) => {
            let signer: Arc<dyn Anchor> = Arc::from(anchor(a, state)?);
            let store = open_state(state)?;
            store.set_checkpoint_policy(probity::audit::CheckpointPolicy {
                anchor: Some(signer.clone()),
                ..store.checkpoint_policy()
            });
            let made = store.checkpoint(true)?;
            if let Some(failure) = store.checkpoint_failure() {
                bail!("{failure}");
            }
            for cp in &made {
                out::line(cp.to_json())?;
            }
            let description = signer.describe();
            if !description.is_hsm() {
                err_line!("warning: signed with the {}", description.summary);
            }
            Ok(exit::ALLOW)
        }
        None if args.follow => audit_follow(args, state_args),
        None => {
            let state = open_state(state_args)?;
            args.print_from(&state, args.from, args.limit, usize::MAX)?;
            Ok(exit::ALLOW)
        }
    }
}

/// `probity audit --follow`: prints what is there, then polls for new records, with
/// the state opened only while reading, until SIGINT or SIGTERM.
fn audit_follow(args: &AuditArgs, state_args: &StateArgs) -> Result<u8> {
    use tokio::signal::unix::{SignalKind, signal};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime that waits for signals")?;
    runtime.block_on(async {
        let mut terminate = signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("cannot listen for SIGINT")?;
        let poll = std::time::Duration::from_millis(args.poll_ms);
        let stdout = watch_stdout();
        let mut next = args.from;
        let mut busy_reported = false;
        loop {
            // The first read must work; later, a state directory another process holds
            // for a moment is tried again at the next poll.
            match StateStore::open(&state_args.state_dir) {
                Ok(state) => {
                    busy_reported = false;
                    (next, _) = args.print_from(&state, next, usize::MAX, args.limit)?;
                }
                Err(e) if next > args.from || busy_reported => {
                    if !busy_reported {
                        err_line!(
                            "warning: cannot open the state directory {} (retrying): {e}",
                            state_args.state_dir.display()
                        );
                        busy_reported = true;
                    }
                }
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!(
                            "cannot open the state directory {}",
                            state_args.state_dir.display()
                        )
                    });
                }
            }
            tokio::select! {
                _ = terminate.recv() => return Ok(exit::ALLOW),
                _ = interrupt.recv() => return Ok(exit::ALLOW),
                () = reader_gone(stdout.as_ref()) => return Ok(exit::ALLOW),
                () = tokio::time::sleep(poll) => {}
            }
        }
    })
}

/// Standard output, watched for its reader going away while no record arrives (epoll
/// reports a pipe whose reader closed). `None` where it cannot be watched (a regular
/// file, /dev/null): a closed pipe is then seen at the next record written. The watch
/// leaves the descriptor blocking, as the writes to standard output expect.
fn watch_stdout() -> Option<tokio::net::unix::pipe::Sender> {
    use std::os::fd::AsFd as _;
    let fd = std::io::stdout().as_fd().try_clone_to_owned().ok()?;
    tokio::net::unix::pipe::Sender::from_owned_fd_unchecked(fd).ok()
}

/// Returns once the reader of standard output went away; never without a watch.
async fn reader_gone(stdout: Option<&tokio::net::unix::pipe::Sender>) {
    if let Some(pipe) = stdout {
        loop {
            match pipe.ready(tokio::io::Interest::WRITABLE).await {
                Ok(ready) if ready.is_write_closed() => return,
                // Writable, as an idle pipe is: forget it, wait for the next change.
                Ok(_) => {
                    let _ = pipe.try_io(|| Err::<(), _>(std::io::ErrorKind::WouldBlock.into()));
                }
                Err(_) => break,
            }
        }
    }
    std::future::pending::<()>().await;
}

/// `probity audit verify`: the report as JSON on standard output, what it cannot
/// vouch for as notes (also on standard error); exit 5 naming the first tampered
/// record.
fn audit_verify(public_key: Option<&Path>, state_args: &StateArgs) -> Result<u8> {
    use probity::audit::{self, AuditError};
    let key = public_key
        .map(integrity::PublicKey::load_pinned)
        .transpose()?;
    let state = open_state(state_args)?;
    let report = match audit::verify(&state, key.as_ref()) {
        Ok(report) => report,
        Err(AuditError::Read(e)) => return Err(e).context("cannot verify the audit trail"),
        Err(e) => {
            out::line(
                serde_json::json!({"verified": false, "failure": e.to_string(), "seq": e.seq()}),
            )?;
            err_line!("error: the audit trail was tampered with: {e}");
            return Ok(exit::INTEGRITY_FAILURE);
        }
    };
    let mut notes = Vec::new();
    if report.key_id.is_none() {
        notes.push("checkpoint signatures were not checked: no --public-key was given".to_owned());
    }
    for log in &report.logs {
        if log.unsigned_checkpoints > 0 {
            notes.push(format!(
                "{}: {} checkpoints are unsigned (no anchor signs them): they pin the chain, but anyone who can write the state file could forge them",
                log.log, log.unsigned_checkpoints
            ));
        }
        if log.unchained > 0 {
            notes.push(format!(
                "{}: {} records were written before the chain existed and cannot be verified",
                log.log, log.unchained
            ));
        }
        if log.unwitnessed > 0 {
            notes.push(format!(
                "{}: the last {} records come after the last checkpoint: a cut among them cannot be seen here; the SIEM's forwarded copy is their witness",
                log.log, log.unwitnessed
            ));
        }
    }
    for note in &notes {
        err_line!("note: {note}");
    }
    out::line(serde_json::to_string_pretty(
        &serde_json::json!({"verified": true, "report": report, "notes": notes}),
    )?)?;
    Ok(exit::ALLOW)
}

/// `probity policy ...`
pub fn policy(command: &PolicyCommand) -> Result<u8> {
    match command {
        PolicyCommand::Seal {
            dir,
            name,
            version,
            state,
            anchor,
        } => policy_seal(dir, name, *version, state, anchor),
        PolicyCommand::Impact(args) => crate::impact::impact(args),
    }
}

/// `probity policy seal DIR --name NAME [--version N]`
fn policy_seal(
    dir: &Path,
    name: &str,
    version: Option<u64>,
    state_args: &StateArgs,
    anchor_args: &AnchorArgs,
) -> Result<u8> {
    if version == Some(u64::MAX) {
        bail!(
            "--version {}: the last version is refused, since nothing could be sealed after it",
            u64::MAX
        );
    }
    // Only a set that loads is worth sealing.
    crate::build(dir, &crate::SchemaConfig::default()).map_err(crate::report)?;
    let seal_file = policy_seal::PolicySeal::path(dir);
    let version = match version {
        Some(v) => v,
        None if !seal_file.exists() => 1,
        None => {
            let bytes = std::fs::read(&seal_file)
                .with_context(|| format!("cannot read {}", seal_file.display()))?;
            let previous = PolicySeal::decode(&bytes).with_context(|| {
                format!(
                    "cannot read the version of {} to pick the next one: pass --version",
                    seal_file.display()
                )
            })?;
            match previous.version().checked_add(1).filter(|v| *v < u64::MAX) {
                Some(v) => v,
                None => bail!(
                    "{} holds the last version but one; nothing can be sealed after it",
                    seal_file.display()
                ),
            }
        }
    };
    probity_base::trust::create_private_dir(&state_args.state_dir).with_context(|| {
        format!(
            "cannot use the state directory {}",
            state_args.state_dir.display()
        )
    })?;
    let anchor = anchor(anchor_args, state_args)?;
    let description = anchor.describe();
    let seal = policy_seal::PolicySeal::seal_dir(dir, name, version, anchor.as_ref())?;
    pin_on_first_use(state_args, anchor.as_ref())?;
    out::line(serde_json::to_string_pretty(&serde_json::json!({
        "name": seal.name(),
        "version": seal.version(),
        "files": seal.files().iter().map(|f| f.path.as_str()).collect::<Vec<_>>(),
        "digest": hex::encode(seal.digest()),
        "seal": seal_file.display().to_string(),
        "anchor": description.summary,
        "hsm": description.is_hsm(),
        "hsm_key_protected": description.key_protected,
        "key_id": hex::encode(seal.key_id().0),
    }))?)?;
    if !description.is_hsm() {
        err_line!("warning: signed with the {}", description.summary);
    }
    Ok(exit::ALLOW)
}

/// The verifier of `probity check --sealed`.
pub fn sealed_verifier(public_key: &Path) -> Result<Verifier> {
    Ok(Verifier::new(integrity::PublicKey::load_pinned(
        public_key,
    )?))
}

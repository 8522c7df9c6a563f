//! `probity seal`, `probity verify` and `probity nodes`: the integrity commands.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use probity::integrity::{
    self, Anchor, HashOptions, Pin, Pkcs11Anchor, Pkcs11Config, PublicKey, SoftwareAnchor,
    Verifier, VerifyOptions, hex,
};
use probity::state::StateStore;

use crate::{PolicyArgs, exit, load};

/// Largest signed manifest read (a manifest of a 4 TiB object in 4 MiB chunks is ~32 MiB).
const MAX_MANIFEST_BYTES: u64 = 64 * 1024 * 1024;

/// Where the state lives and which anchor signs.
#[derive(Args)]
pub struct StateArgs {
    /// State directory: registry, blocklist, event log, software key, pinned public key.
    #[arg(long, env = "PROBITY_STATE_DIR", default_value = "/var/lib/probity")]
    state_dir: PathBuf,
}

/// Which anchor signs manifests. Without `--hsm-module`, the software anchor
/// (`STATE_DIR/anchor.key`, not an HSM).
#[derive(Args)]
pub struct AnchorArgs {
    /// PKCS#11 module of the HSM, e.g. /usr/lib/softhsm/libsofthsm2.so.
    #[arg(long, env = "PROBITY_HSM_MODULE")]
    hsm_module: Option<PathBuf>,
    /// Label of the HSM token.
    #[arg(long, env = "PROBITY_HSM_TOKEN")]
    hsm_token: Option<String>,
    /// Label of the signing key in the token (generated there if missing).
    #[arg(long, default_value = "probity-manifest-signing")]
    hsm_key: String,
    /// File holding the user PIN (first line). Else the PIN is read from PROBITY_HSM_PIN.
    /// The PIN is never taken from the command line.
    #[arg(long, env = "PROBITY_HSM_PIN_FILE")]
    hsm_pin_file: Option<PathBuf>,
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

fn anchor(args: &AnchorArgs, state: &StateArgs) -> Result<Box<dyn Anchor>> {
    match &args.hsm_module {
        Some(module) => {
            let Some(token) = &args.hsm_token else {
                bail!("--hsm-module needs --hsm-token (or PROBITY_HSM_TOKEN)");
            };
            let pin = match &args.hsm_pin_file {
                Some(path) => Pin::from_file(path)?,
                None => Pin::from_env("PROBITY_HSM_PIN")?,
            };
            let config = Pkcs11Config {
                module: module.clone(),
                token_label: token.clone(),
                key_label: args.hsm_key.clone(),
                pin,
            };
            Ok(Box::new(Pkcs11Anchor::open_or_generate(&config)?))
        }
        None => Ok(Box::new(SoftwareAnchor::load_or_generate(
            &state.state_dir.join("anchor.key"),
        )?)),
    }
}

fn trusted_key_path(state: &StateArgs) -> PathBuf {
    state.state_dir.join("trusted.pub")
}

fn read_public_key(path: &Path) -> Result<PublicKey> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the public key {}", path.display()))?;
    PublicKey::from_hex(&text)
        .with_context(|| format!("{} is not a hex-encoded SEC1 public key", path.display()))
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
        .unwrap_or_else(|| integrity::default_manifest_path(file))
}

/// `probity seal FILE --id ID`
pub fn seal(
    file: &Path,
    id: &str,
    version: Option<u64>,
    manifest: Option<&Path>,
    chunk_size: u32,
    state_args: &StateArgs,
    anchor_args: &AnchorArgs,
) -> Result<u8> {
    let state = open_state(state_args)?;
    let anchor = anchor(anchor_args, state_args)?;
    let description = anchor.describe();
    let version = match version {
        Some(v) => v,
        None => state.registry_entry(id)?.map_or(1, |e| e.version + 1),
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
        chunk_size,
        progress: Some(&tick),
        ..HashOptions::default()
    };
    let signed = integrity::seal(file, id, version, anchor.as_ref(), state.as_ref(), &options)?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let out = manifest_path(file, manifest);
    std::fs::write(&out, signed.encode())
        .with_context(|| format!("cannot write the manifest {}", out.display()))?;
    // Pin the signing key on first use, so that `verify` on this host needs no flag.
    let pinned = trusted_key_path(state_args);
    if !pinned.exists() {
        std::fs::write(&pinned, anchor.public_key().to_hex())
            .with_context(|| format!("cannot write {}", pinned.display()))?;
    }
    let m = signed.manifest();
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "object_id": m.object_id(),
            "version": m.version(),
            "size": m.size(),
            "chunk_size": m.chunk_size(),
            "chunks": m.chunk_count(),
            "root": hex(m.root()),
            "digest": hex(signed.digest()),
            "manifest": out.display().to_string(),
            "anchor": description.summary,
            "hsm": description.is_hsm(),
            "key_id": hex(&signed.key_id().0),
        }))?
    );
    if !description.is_hsm() {
        eprintln!("warning: signed with the {}", description.summary);
    }
    Ok(exit::ALLOW)
}

/// What `probity verify` checks against.
pub struct VerifyArgs<'a> {
    pub file: &'a Path,
    pub id: &'a str,
    pub manifest: Option<&'a Path>,
    pub node: Option<&'a str>,
    pub public_key: Option<&'a Path>,
    pub entities: Option<&'a Path>,
}

/// `probity verify FILE --id ID [--node N]`
pub fn verify(args: &VerifyArgs<'_>, state_args: &StateArgs, policies: &PolicyArgs) -> Result<u8> {
    let state = open_state(state_args)?;
    let key_path = args
        .public_key
        .map(Path::to_path_buf)
        .unwrap_or_else(|| trusted_key_path(state_args));
    let verifier = Verifier::new(read_public_key(&key_path)?);
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
    let outcome = integrity::verify_encoded(args.file, &bytes, &verifier, state.as_ref(), &options)
        .context("could not verify")?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let Some(node) = args.node else {
        return match outcome {
            Ok(report) => {
                println!(
                    "{}",
                    serde_json::json!({"verified": true, "object_id": report.object_id,
                        "version": report.version, "chunks": report.chunks,
                        "root": hex(&report.root)})
                );
                Ok(exit::ALLOW)
            }
            Err(e) => {
                println!(
                    "{}",
                    serde_json::json!({"verified": false, "failure": e.to_string()})
                );
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
    let decision = engine.decide_read(node, args.id, verification);
    println!("{}", serde_json::to_string_pretty(&decision)?);
    Ok(if decision.is_allowed() {
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
        NodesCommand::Block { node, reason } => state.block_node(node, reason)?,
        NodesCommand::Unblock { node } => {
            if !state.unblock_node(node)? {
                eprintln!("{node} was not blocked");
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
            v
        })
        .collect();
    println!("{}", serde_json::to_string_pretty(&list)?);
    Ok(exit::ALLOW)
}

/// `probity audit`: the decision log, one JSON record per line.
pub fn audit(from: u64, limit: usize, state_args: &StateArgs) -> Result<u8> {
    let state = open_state(state_args)?;
    for record in state.decisions(from, limit)? {
        println!("{}", record.to_json());
    }
    Ok(exit::ALLOW)
}

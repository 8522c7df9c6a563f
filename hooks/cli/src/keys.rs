//! `probity keys ...`, `probity encrypt` and `probity decrypt`: the keyring from the
//! command line.
//!
//! Key metadata lives in the state directory (through the engine's state backend), the
//! KEKs in the HSM (`--hsm-module`) or, without one, in `STATE_DIR/kek` (a software KEK,
//! "not an HSM", said on every run). Encrypting asks the policies first, on the
//! keyring's own metadata, and carries out a `rotate_key` obligation (see
//! `probity::keys::PolicyKeys::authorize_encrypt`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use probity::keys::{
    self, DecryptOptions, EncryptOptions, KekProvider, KeyId, KeyScope, Keyring, KeyringOptions,
    Pin, SoftwareKek, StateKeyStore,
};
use probity::{Engine, EntityUid};

use crate::integrity::{HsmArgs, StateArgs};
use crate::{PolicyArgs, exit, out};

/// Where the keyring lives and who acts.
#[derive(Args)]
pub struct KeyringArgs {
    #[command(flatten)]
    state: StateArgs,
    #[command(flatten)]
    hsm: HsmArgs,
    /// Who acts, as recorded with every key version and event [default: $SUDO_USER,
    /// else $USER, else uid:N].
    #[arg(long)]
    actor: Option<String>,
    /// The engine's clock, in Unix seconds [default: now]: key ages and the policies'
    /// rotation rule are judged at this time.
    #[arg(long)]
    now: Option<i64>,
    #[command(flatten)]
    policies: PolicyArgs,
}

/// `probity keys ...`
#[derive(Subcommand)]
pub enum KeysCommand {
    /// Create a data key: for a dataset, or (with --subject) for an erasable data
    /// subject, wrapped under a KEK of the subject's own.
    Create {
        #[command(flatten)]
        ring: KeyringArgs,
        /// Key id, e.g. dataset/imagenet.
        key: String,
        /// The data subject whose data the key encrypts.
        #[arg(long)]
        subject: Option<String>,
    },
    /// One JSON line per key: id, primary version, its age and state.
    List {
        #[command(flatten)]
        ring: KeyringArgs,
    },
    /// The whole keyring as JSON: where the KEKs live, every key and version.
    Status {
        #[command(flatten)]
        ring: KeyringArgs,
        /// Only this key.
        key: Option<String>,
    },
    /// Rotate a key (a new primary version; older ones keep decrypting), or with
    /// --due every key whose encrypt decision asks for a rotation.
    Rotate {
        #[command(flatten)]
        ring: KeyringArgs,
        /// The key.
        #[arg(required_unless_present = "due", conflicts_with = "due")]
        key: Option<String>,
        /// Rotate what the policies ask to rotate.
        #[arg(long)]
        due: bool,
        /// With --due: who asks the encrypt decisions [default: Node::"<hostname>"].
        #[arg(long)]
        principal: Option<String>,
    },
    /// Re-encrypt encrypted objects' data-key headers to their key's primary version, in
    /// place (no plaintext is written anywhere).
    Rewrap {
        #[command(flatten)]
        ring: KeyringArgs,
        /// The encrypted files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Their object ids, in the same order [default: each file's name].
        #[arg(long = "object-id")]
        object_ids: Vec<String>,
    },
    /// Erase a data subject: destroy the subject's KEK in the HSM and the wrapped data
    /// keys, so every copy of its data anywhere becomes undecryptable. Irreversible.
    Erase {
        #[command(flatten)]
        ring: KeyringArgs,
        /// The data subject.
        subject: String,
        /// Objects encrypted under the subject's keys, recorded with the erasure.
        #[arg(long = "object")]
        objects: Vec<String>,
        /// Confirms the erasure (it cannot be undone).
        #[arg(long)]
        yes: bool,
    },
}

impl KeysCommand {
    fn ring(&self) -> &KeyringArgs {
        match self {
            Self::Create { ring, .. }
            | Self::List { ring }
            | Self::Status { ring, .. }
            | Self::Rotate { ring, .. }
            | Self::Rewrap { ring, .. }
            | Self::Erase { ring, .. } => ring,
        }
    }
}

/// `probity encrypt` and `probity decrypt` arguments.
#[derive(Args)]
pub struct CryptArgs {
    /// The input file.
    input: PathBuf,
    /// The output file (created; never the input).
    #[arg(long, short)]
    output: PathBuf,
    /// The object id bound into every segment [default: the input's file name for
    /// encrypt, the output's for decrypt].
    #[arg(long)]
    object_id: Option<String>,
}

/// `probity encrypt` arguments beyond [`CryptArgs`].
#[derive(Args)]
pub struct EncryptArgs {
    /// The key to encrypt under.
    #[arg(long)]
    key: String,
    /// Who asks [default: Node::"<hostname>"], as `Type::"id"`.
    #[arg(long)]
    principal: Option<String>,
    /// Plaintext bytes per segment.
    #[arg(long)]
    segment_size: Option<u32>,
}

/// An engine with the state directory attached and a keyring on it.
struct Opened {
    engine: Engine,
    keyring: Keyring,
    actor: String,
}

fn open(args: &KeyringArgs) -> Result<Opened> {
    let clock: Option<Arc<dyn probity::Clock>> = args
        .now
        .map(|t| Arc::new(probity::ManualClock::at(t)) as Arc<dyn probity::Clock>);
    let engine = crate::load_with_clock(&args.policies, clock)?;
    let dir = &args.state.state_dir;
    let state = Arc::new(
        probity::state::StateStore::open(dir)
            .with_context(|| format!("cannot open the state directory {}", dir.display()))?,
    );
    engine.attach_state(state.clone())?;
    let kek: Arc<dyn KekProvider> = match &args.hsm.hsm_module {
        Some(module) => {
            let Some(token) = &args.hsm.hsm_token else {
                bail!("--hsm-module needs --hsm-token (or PROBITY_HSM_TOKEN)");
            };
            let pin = read_pin(&args.hsm)?;
            Arc::new(keys::open_hsm_kek(module, token, &pin)?)
        }
        None => {
            let software = SoftwareKek::open(&dir.join("kek"))?;
            err_line!("probity: {}", keys::SOFTWARE_KEK_NOTICE);
            Arc::new(software)
        }
    };
    let keyring = Keyring::new(
        Arc::new(StateKeyStore::new(state)),
        kek,
        engine.clock().clone(),
        KeyringOptions::default(),
    );
    keys::PolicyKeys::new(&engine, &keyring).publish()?;
    Ok(Opened {
        engine,
        keyring,
        actor: actor(args.actor.as_deref()),
    })
}

/// The PIN, from a file only its owner can read, or from PROBITY_HSM_PIN.
fn read_pin(hsm: &HsmArgs) -> Result<Pin> {
    match &hsm.hsm_pin_file {
        Some(path) => {
            use probity_base::trust::{Material, TrustError, check_file_lenient};
            match check_file_lenient(path, Material::Secret) {
                Ok((_, None)) => {}
                Ok((_, Some(TrustError::Readable { mode, who, .. })))
                    if hsm.allow_readable_pin_file =>
                {
                    err_line!(
                        "warning: PIN file {}: mode {mode:04o} lets {who} read it (chmod 600 it); used because of --allow-readable-pin-file",
                        path.display()
                    );
                }
                Ok((_, Some(problem))) => return Err(problem.into()),
                Err(e) => return Err(e.into()),
            }
            Ok(Pin::from_file(path)?)
        }
        None => Ok(Pin::from_env("PROBITY_HSM_PIN")?),
    }
}

fn actor(given: Option<&str>) -> String {
    if let Some(a) = given {
        return a.to_owned();
    }
    ["SUDO_USER", "USER"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| format!("uid:{}", rustix_uid()))
}

fn rustix_uid() -> u32 {
    // /proc/self/status says "Uid:\t<real>\t<effective>..."; no libc call needed.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|u| u.parse().ok())
        })
        .unwrap_or(u32::MAX)
}

/// `Node::"<hostname>"`, or the principal given.
fn principal(given: Option<&str>) -> Result<EntityUid> {
    match given {
        Some(p) => p.parse().map_err(|_| {
            anyhow::anyhow!("--principal {p:?} is not an entity uid like User::\"alice\"")
        }),
        None => {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .context("cannot read this machine's host name (give --principal)")?;
            Ok(EntityUid::new("Node", host.trim())?)
        }
    }
}

fn key_id(text: &str) -> Result<KeyId> {
    Ok(KeyId::new(text)?)
}

fn json_line(value: &impl serde::Serialize) -> Result<()> {
    out::line(serde_json::to_string(value)?)?;
    Ok(())
}

pub fn keys(command: &KeysCommand) -> Result<u8> {
    let o = open(command.ring())?;
    match command {
        KeysCommand::Create { key, subject, .. } => {
            let scope = match subject {
                Some(s) => KeyScope::Subject(s.clone()),
                None => KeyScope::Dataset,
            };
            let id = key_id(key)?;
            let status = o.keyring.create(&id, scope, &o.actor)?;
            keys::PolicyKeys::new(&o.engine, &o.keyring).record_event(
                &id,
                "key-created",
                &format!("version 1 by {}", o.actor),
            );
            keys::PolicyKeys::new(&o.engine, &o.keyring).publish()?;
            json_line(&status)?;
        }
        KeysCommand::List { .. } => {
            let status = o.keyring.status()?;
            for k in &status.keys {
                json_line(&serde_json::json!({
                    "key": k.id.as_str(),
                    "scope": k.scope,
                    "primary": k.primary,
                    "age_days": k.age(status.now).as_secs() / 86_400,
                    "state": if k.erased.is_some() { "erased".to_owned() } else { k.primary_state.to_string() },
                    "versions": k.versions.len(),
                }))?;
            }
        }
        KeysCommand::Status { key, .. } => match key {
            Some(k) => json_line(&o.keyring.key_status(&key_id(k)?)?)?,
            None => out::line(serde_json::to_string_pretty(&o.keyring.status()?)?)?,
        },
        KeysCommand::Rotate {
            key,
            due,
            principal: who,
            ..
        } => {
            if *due {
                let asker = principal(who.as_deref())?;
                let rotations =
                    keys::PolicyKeys::new(&o.engine, &o.keyring).rotate_due(&asker, &o.actor)?;
                for r in &rotations {
                    json_line(r)?;
                }
                err_line!("probity: {} key(s) rotated", rotations.len());
            } else if let Some(k) = key {
                let id = key_id(k)?;
                let r = o.keyring.rotate(&id, &o.actor)?;
                keys::PolicyKeys::new(&o.engine, &o.keyring).record_event(
                    &id,
                    "key-rotated",
                    &format!("version {} -> {} by {}", r.previous, r.primary, o.actor),
                );
                keys::PolicyKeys::new(&o.engine, &o.keyring).publish()?;
                json_line(&r)?;
            }
        }
        KeysCommand::Rewrap {
            files, object_ids, ..
        } => {
            if !object_ids.is_empty() && object_ids.len() != files.len() {
                bail!(
                    "{} --object-id for {} files: give one per file, in order, or none",
                    object_ids.len(),
                    files.len()
                );
            }
            for (i, file) in files.iter().enumerate() {
                let id = match object_ids.get(i) {
                    Some(id) => id.clone(),
                    None => file_name(file)?,
                };
                let report = keys::rewrap_file(&o.keyring, &id, file)
                    .with_context(|| format!("cannot rewrap {}", file.display()))?;
                json_line(&report)?;
            }
        }
        KeysCommand::Erase {
            subject,
            objects,
            yes,
            ..
        } => {
            if !yes {
                bail!(
                    "erasing {subject:?} destroys its KEK and cannot be undone: add --yes to confirm"
                );
            }
            let erasure = o.keyring.erase(subject, &o.actor, objects.clone())?;
            keys::PolicyKeys::new(&o.engine, &o.keyring).record_erasure(&erasure);
            keys::PolicyKeys::new(&o.engine, &o.keyring).publish()?;
            json_line(&erasure)?;
        }
    }
    Ok(exit::ALLOW)
}

fn file_name(path: &Path) -> Result<String> {
    path.file_name()
        .and_then(|n| n.to_str())
        .map(str::to_owned)
        .with_context(|| {
            format!(
                "{} has no file name to use as object id (give --object-id)",
                path.display()
            )
        })
}

fn refuse_same_file(input: &Path, output: &Path) -> Result<()> {
    if let (Ok(a), Ok(b)) = (std::fs::canonicalize(input), std::fs::canonicalize(output))
        && a == b
    {
        bail!("refusing to write {} over its own input", output.display());
    }
    Ok(())
}

pub fn encrypt(crypt: &CryptArgs, enc: &EncryptArgs, args: &KeyringArgs) -> Result<u8> {
    refuse_same_file(&crypt.input, &crypt.output)?;
    let o = open(args)?;
    let key = key_id(&enc.key)?;
    let asker = principal(enc.principal.as_deref())?;
    let grant =
        keys::PolicyKeys::new(&o.engine, &o.keyring).authorize_encrypt(&asker, &key, &o.actor)?;
    if let (Some(refused), Some(r)) = (&grant.refused, &grant.rotation) {
        let why = refused
            .reasons
            .first()
            .map_or("(no reason)", |r| r.policy.as_str());
        err_line!(
            "probity: key {} was refused by {why}; rotated to version {} (was {}) as the policy asks",
            key.as_str(),
            r.primary,
            r.previous
        );
    }
    if !grant.decision.is_allowed() {
        out::line(serde_json::to_string_pretty(&grant.decision)?)?;
        return Ok(exit::DENY);
    }
    let object_id = match &crypt.object_id {
        Some(id) => id.clone(),
        None => file_name(&crypt.input)?,
    };
    let mut options = EncryptOptions::default();
    if let Some(size) = enc.segment_size {
        options.segment_size = size;
    }
    let report = keys::encrypt_file(
        &o.keyring,
        &key,
        &object_id,
        &crypt.input,
        &crypt.output,
        &options,
    )
    .with_context(|| format!("cannot encrypt {}", crypt.input.display()))?;
    json_line(&serde_json::json!({
        "encrypted": report,
        "output": crypt.output.display().to_string(),
        "rotated": grant.rotation,
    }))?;
    Ok(exit::ALLOW)
}

pub fn decrypt(crypt: &CryptArgs, args: &KeyringArgs) -> Result<u8> {
    refuse_same_file(&crypt.input, &crypt.output)?;
    let o = open(args)?;
    let object_id = match &crypt.object_id {
        Some(id) => id.clone(),
        None => file_name(&crypt.output)?,
    };
    match keys::decrypt_file(
        &o.keyring,
        &object_id,
        &crypt.input,
        &crypt.output,
        &DecryptOptions::default(),
    ) {
        Ok(report) => {
            json_line(&serde_json::json!({
                "decrypted": report,
                "output": crypt.output.display().to_string(),
            }))?;
            Ok(exit::ALLOW)
        }
        Err(e) => {
            err_line!(
                "error: cannot decrypt {}: {:#}",
                crypt.input.display(),
                anyhow::Error::new(e)
            );
            Ok(exit::INTEGRITY_FAILURE)
        }
    }
}

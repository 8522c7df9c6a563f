//! What an engine handle does, in safe Rust: open, decide, entities, status, verify.
//!
//! Why this module exists: the entry points in `lib.rs` only convert pointers; the
//! behaviour they promise (which status for which outcome, what the JSON holds) lives
//! here, where it reads like the rest of Probity.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use engine::integrity::{
    self, IntegrityError, PublicKey, Verifier, VerifyFailure, VerifyOptions, VerifyReport,
};
use engine::state::{AttachedState, StateStore};
use engine::{DecideOptions, Decision, Engine, ReloadWatcher, Request};
use serde_json::{Value, json};

use crate::error::{Failure, chain};
use crate::handles::{Kind, Table};
use crate::json::{self, JsonError};
use crate::{
    PROBITY_DECIDE_DRY_RUN, PROBITY_DECIDE_FACT_REPORTER, PROBITY_OPEN_WATCH, ProbityStatus,
};

/// Largest signed manifest read (a 4 TiB object in 4 MiB chunks has one of ~32 MiB).
pub(crate) const MAX_MANIFEST_BYTES: u64 = 64 * 1024 * 1024;
/// Largest public key file read.
const MAX_KEY_BYTES: u64 = 4096;
/// Largest entity document upserted in one call.
pub(crate) const MAX_ENTITIES_BYTES: usize = 256 * 1024 * 1024;

/// The live engines.
pub(crate) static ENGINES: Table<EngineEntry> = Table::new(Kind::Engine);

/// An open engine. Fields drop in order: the watcher (which holds an engine clone)
/// stops before the engine goes.
pub(crate) struct EngineEntry {
    _watcher: Option<ReloadWatcher>,
    pub engine: Engine,
    state_dir: Option<PathBuf>,
}

/// Opens an engine on `policy_dir` (or the embedded defaults), with a state store under
/// `state_dir` when given.
pub(crate) fn open(
    policy_dir: Option<&str>,
    state_dir: Option<&str>,
    flags: u32,
) -> Result<EngineEntry, Failure> {
    check_flags(flags, PROBITY_OPEN_WATCH, "probity_engine_open")?;
    let built = match policy_dir {
        Some(dir) => Engine::builder(dir).build(),
        None => Engine::from_embedded_defaults(),
    };
    let engine = built.map_err(|e| load_failure(&e))?;
    if let Some(dir) = state_dir {
        let store =
            StateStore::open_with_clock(Path::new(dir), engine.clock().clone()).map_err(|e| {
                Failure::new(
                    ProbityStatus::State,
                    format!("cannot open the state directory {dir}: {}", chain(&e)),
                )
            })?;
        engine
            .attach_state(Arc::new(store))
            .map_err(|e| Failure::chain(ProbityStatus::State, &e))?;
    }
    let watcher = if flags & PROBITY_OPEN_WATCH != 0 {
        if policy_dir.is_none() {
            return Err(Failure::invalid(
                "PROBITY_OPEN_WATCH needs a policy directory: the embedded defaults never change",
            ));
        }
        Some(
            engine
                .watch()
                .map_err(|e| Failure::chain(ProbityStatus::Io, &e))?,
        )
    } else {
        None
    };
    Ok(EngineEntry {
        _watcher: watcher,
        engine,
        state_dir: state_dir.map(PathBuf::from),
    })
}

fn check_flags(flags: u32, known: u32, call: &str) -> Result<(), Failure> {
    if flags & !known != 0 {
        return Err(Failure::invalid(format!(
            "{call}: unknown flags {:#x}",
            flags & !known
        )));
    }
    Ok(())
}

fn utf8(bytes: &[u8], what: &str) -> Result<(), Failure> {
    std::str::from_utf8(bytes).map(|_| ()).map_err(|e| {
        Failure::new(
            ProbityStatus::NotUtf8,
            format!("{what} is not UTF-8 (at byte {})", e.valid_up_to()),
        )
    })
}

fn from_json_error(e: JsonError) -> Failure {
    match e {
        JsonError::NotUtf8 { .. } => Failure::new(ProbityStatus::NotUtf8, e.to_string()),
        JsonError::Invalid(m) => Failure::invalid(m),
    }
}

fn to_json(value: &impl serde::Serialize) -> Result<Vec<u8>, Failure> {
    serde_json::to_vec(value).map_err(|e| {
        Failure::new(
            ProbityStatus::Internal,
            format!("cannot serialize the answer: {e}"),
        )
    })
}

/// Decides one request (JSON in, decision JSON out).
pub(crate) fn decide(entry: &EngineEntry, request: &[u8], flags: u32) -> Result<Vec<u8>, Failure> {
    check_flags(
        flags,
        PROBITY_DECIDE_FACT_REPORTER | PROBITY_DECIDE_DRY_RUN,
        "probity_decide",
    )?;
    utf8(request, "the request")?;
    let request = Request::from_json_slice(request)
        .map_err(|e| Failure::chain(ProbityStatus::InvalidArgument, &e))?;
    let decision = decide_one(&entry.engine, request, flags);
    to_json(&decision)
}

fn decide_one(engine: &Engine, request: Request, flags: u32) -> Decision {
    let request = if flags & PROBITY_DECIDE_FACT_REPORTER != 0 {
        request.as_fact_reporter()
    } else {
        request
    };
    if flags & PROBITY_DECIDE_DRY_RUN != 0 {
        engine
            .decide_with(
                std::slice::from_ref(&request),
                DecideOptions::new().dry_run(),
            )
            .settle()
            .pop()
            .unwrap_or_else(|| Decision::error("no decision"))
    } else {
        engine.decide(&request)
    }
}

/// Decides a batch against one policy set and store: `{"decisions": [..]}`.
pub(crate) fn decide_batch(
    entry: &EngineEntry,
    batch: &[u8],
    flags: u32,
) -> Result<Vec<u8>, Failure> {
    check_flags(
        flags,
        PROBITY_DECIDE_FACT_REPORTER | PROBITY_DECIDE_DRY_RUN,
        "probity_decide_batch",
    )?;
    let requests = json::batch(batch).map_err(from_json_error)?;
    let requests: Vec<Request> = if flags & PROBITY_DECIDE_FACT_REPORTER != 0 {
        requests
            .into_iter()
            .map(Request::as_fact_reporter)
            .collect()
    } else {
        requests
    };
    let options = if flags & PROBITY_DECIDE_DRY_RUN != 0 {
        DecideOptions::new().dry_run()
    } else {
        DecideOptions::new()
    };
    let decisions = entry.engine.decide_with(&requests, options).settle();
    to_json(&json!({ "decisions": decisions }))
}

/// Adds or replaces entities (a Cedar entity JSON array); returns how many.
pub(crate) fn upsert(entry: &EngineEntry, entities: &[u8]) -> Result<usize, Failure> {
    if entities.len() > MAX_ENTITIES_BYTES {
        return Err(Failure::invalid(format!(
            "entities: {} bytes, over the limit of {MAX_ENTITIES_BYTES}",
            entities.len()
        )));
    }
    utf8(entities, "the entities")?;
    entry
        .engine
        .upsert_entities_from_reader(entities)
        .map_err(|e| {
            let status = match e {
                engine::EntityError::State(_) | engine::EntityError::DecisionLog(_) => {
                    ProbityStatus::State
                }
                _ => ProbityStatus::InvalidArgument,
            };
            Failure::chain(status, &e)
        })
}

/// Removes entities by uid (unknown uids are ignored).
pub(crate) fn remove(entry: &EngineEntry, uids: &[u8]) -> Result<(), Failure> {
    let uids = json::uids(uids).map_err(from_json_error)?;
    entry
        .engine
        .remove_entities(&uids)
        .map_err(|e| Failure::chain(ProbityStatus::InvalidArgument, &e))
}

/// The live policy set's status, as the server's `/v1/policy/status`.
pub(crate) fn status(entry: &EngineEntry) -> Result<Vec<u8>, Failure> {
    to_json(&entry.engine.status())
}

/// Reloads the policy directory; on error the previous set keeps serving.
pub(crate) fn reload(entry: &EngineEntry) -> Result<(), Failure> {
    if entry.engine.policy_dir().is_none() {
        return Err(Failure::invalid(
            "the engine runs on the embedded defaults: there is nothing to reload",
        ));
    }
    entry.engine.reload().map_err(|e| load_failure(&e))
}

/// A policy set that did not load: the error's chain, then each located problem
/// (file:line:column) on a line of its own.
fn load_failure(e: &engine::LoadError) -> Failure {
    let mut message = chain(e);
    for problem in e.problems() {
        message.push('\n');
        message.push_str(&problem.to_string());
    }
    Failure::new(ProbityStatus::PolicyInvalid, message)
}

/// The attached state store: verification keeps its registry (accepted versions, so
/// rollbacks are refused) and its event log there.
pub(crate) fn registry(entry: &EngineEntry) -> Result<AttachedState, Failure> {
    entry.engine.attached().ok_or_else(|| {
        Failure::invalid(
            "verification needs a state directory (its registry refuses rollbacks): open the engine with one",
        )
    })
}

/// The pinned public key: `path`, else `STATE_DIR/trusted.pub` (where `probity seal`
/// pins it). Refused when group or others may write it.
pub(crate) fn verifier(entry: &EngineEntry, path: Option<&str>) -> Result<Verifier, Failure> {
    let path = match (path, &entry.state_dir) {
        (Some(p), _) => PathBuf::from(p),
        (None, Some(dir)) => dir.join("trusted.pub"),
        (None, None) => {
            return Err(Failure::invalid(
                "no public key given, and no state directory holding trusted.pub",
            ));
        }
    };
    let file = std::fs::File::open(&path).map_err(|e| {
        Failure::new(
            ProbityStatus::Io,
            format!("cannot read the public key {}: {e}", path.display()),
        )
    })?;
    let mode = {
        use std::os::unix::fs::PermissionsExt;
        file.metadata()
            .map_err(|e| {
                Failure::new(
                    ProbityStatus::Io,
                    format!("cannot read the public key {}: {e}", path.display()),
                )
            })?
            .permissions()
            .mode()
    };
    // The same judgement as every other trust file's (write access beyond the owner).
    if let Some(who) = probity_base::trust::granted_to_others(mode, 0o2) {
        return Err(Failure::invalid(format!(
            "the public key {} is writable by {who} (mode {:04o}): refusing it as a pinned key",
            path.display(),
            mode & 0o7777
        )));
    }
    let text = read_limited(file, &path, MAX_KEY_BYTES, "public key")?;
    let text = String::from_utf8(text).map_err(|_| {
        Failure::new(
            ProbityStatus::NotUtf8,
            format!("the public key {} is not UTF-8", path.display()),
        )
    })?;
    let key = PublicKey::from_hex(&text).map_err(|e| {
        Failure::invalid(format!(
            "{} is not a hex-encoded SEC1 public key: {}",
            path.display(),
            chain(&e)
        ))
    })?;
    Ok(Verifier::new(key))
}

/// The signed manifest's bytes: `path`, else `OBJECT.manifest`.
pub(crate) fn manifest_bytes(object: &str, path: Option<&str>) -> Result<Vec<u8>, Failure> {
    let path = match path {
        Some(p) => PathBuf::from(p),
        None => integrity::Manifest::default_path(Path::new(object)),
    };
    let file = std::fs::File::open(&path).map_err(|e| {
        Failure::new(
            ProbityStatus::Io,
            format!("cannot read the manifest {}: {e}", path.display()),
        )
    })?;
    read_limited(file, &path, MAX_MANIFEST_BYTES, "manifest")
}

fn read_limited(
    file: std::fs::File,
    path: &Path,
    limit: u64,
    what: &str,
) -> Result<Vec<u8>, Failure> {
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes).map_err(|e| {
        Failure::new(
            ProbityStatus::Io,
            format!("cannot read the {what} {}: {e}", path.display()),
        )
    })?;
    if bytes.len() as u64 > limit {
        return Err(Failure::invalid(format!(
            "the {what} {} is over {limit} bytes",
            path.display()
        )));
    }
    Ok(bytes)
}

/// What `probity_verify` answers: its status, the JSON report, and the message for
/// `probity_last_error` when the status is not OK.
pub(crate) struct Verified {
    pub status: ProbityStatus,
    pub report: Vec<u8>,
    pub message: Option<String>,
}

/// The arguments of `probity_verify`.
pub(crate) struct VerifyArgs<'a> {
    pub path: &'a str,
    pub manifest: Option<&'a str>,
    pub object_id: &'a str,
    pub public_key: Option<&'a str>,
    pub node: Option<&'a str>,
    /// The pod that reads, if the caller named it.
    pub reader: Option<&'a engine::ReaderPod>,
}

/// The reader pod the C arguments name: none when all are NULL; namespace and name
/// together, checked as Kubernetes names (an error naming the field otherwise).
pub(crate) fn reader_pod(
    namespace: Option<&str>,
    name: Option<&str>,
    uid: Option<&str>,
) -> Result<Option<engine::ReaderPod>, Failure> {
    let invalid = |message: String| Failure::new(ProbityStatus::InvalidArgument, message);
    match (namespace, name) {
        (None, None) if uid.is_none() => Ok(None),
        (Some(namespace), Some(name)) => {
            engine::ReaderPod::new(namespace, name, uid.map(str::to_owned))
                .map(Some)
                .map_err(|e| invalid(e.to_string()))
        }
        _ => Err(invalid(
            "reader_namespace and reader_name name the reading pod together: give both or neither (and reader_uid only with them)".into(),
        )),
    }
}

/// Verifies a whole object; with a node, decides the read through the policies (a
/// failure denies it and blocks the node, durably).
pub(crate) fn verify(entry: &EngineEntry, args: &VerifyArgs<'_>) -> Result<Verified, Failure> {
    let store = registry(entry)?;
    let verifier = verifier(entry, args.public_key)?;
    let manifest = manifest_bytes(args.path, args.manifest)?;
    let path = Path::new(args.path);
    let file = integrity::HashedObject::open(path).map_err(|e| {
        Failure::new(
            ProbityStatus::Io,
            format!("cannot open {}: {e}", path.display()),
        )
    })?;
    let options = VerifyOptions {
        // The node is blocked through the policies below (decide_read), not behind their back.
        node: None,
        expected_object_id: Some(args.object_id),
        ..VerifyOptions::default()
    };
    // The environment failing is an error; the object failing is a verdict.
    let outcome = verifier
        .verify_encoded_file(file, path, &manifest, &store, &options)
        .map_err(|e| Failure::chain(environment_status(&e), &e))?;
    let decision = args.node.map(|node| {
        let verification = match &outcome {
            Ok(report) => Ok(report),
            Err(e) => Err(e as &dyn std::error::Error),
        };
        entry
            .engine
            .decide_read_as(node, args.object_id, verification, args.reader)
    });
    let mut report = match &outcome {
        Ok(r) => report_json(r),
        Err(e) => json!({
            "verified": false,
            "object_id": args.object_id,
            "failure": chain(e),
            "failure_kind": failure_kind(e),
        }),
    };
    if let (Some(d), Some(o)) = (&decision, report.as_object_mut()) {
        o.insert(
            "decision".into(),
            serde_json::to_value(d).unwrap_or(Value::Null),
        );
    }
    let (status, message) = match (&outcome, &decision) {
        (Err(e), _) => (ProbityStatus::IntegrityFailure, Some(chain(e))),
        (Ok(_), Some(d)) if !d.is_allowed() => (ProbityStatus::Denied, Some(denial(d))),
        (Ok(_), _) => (ProbityStatus::Ok, None),
    };
    Ok(Verified {
        status,
        report: to_json(&report)?,
        message,
    })
}

/// The status of an environment failure (the check could not run).
pub(crate) fn environment_status(e: &IntegrityError) -> ProbityStatus {
    match e {
        IntegrityError::State { .. } => ProbityStatus::State,
        _ => ProbityStatus::Io,
    }
}

fn failure_kind(e: &VerifyFailure) -> &'static str {
    match e {
        VerifyFailure::Manifest(_) => "manifest-invalid",
        VerifyFailure::Object(e) => e.kind(),
    }
}

pub(crate) fn report_json(r: &VerifyReport) -> Value {
    json!({
        "verified": true,
        "object_id": r.object_id,
        "version": r.version,
        "size": r.size,
        "chunks": r.chunks,
        "root": hex::encode(r.root),
        "digest": hex::encode(r.digest),
        "key_id": hex::encode(r.key_id.0),
        "newly_accepted": r.newly_accepted,
    })
}

/// A deny's reasons as one line.
pub(crate) fn denial(d: &Decision) -> String {
    let reasons: Vec<String> = d
        .reasons
        .iter()
        .map(|r| format!("{}: {}", r.policy, r.message))
        .chain(d.errors.iter().map(|e| e.message.clone()))
        .collect();
    format!("the read was denied: {}", reasons.join("; "))
}

//! The JSON API under `/v1`: decide, batch decide, entities, node blocks, policy status.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::Extensions;
use probity::state::DecisionRecord;
use probity::{Decision, EntityUid, Request};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::AppState;
use crate::caller::{Caller, forbidden_message};
use crate::error::ApiError;

/// Batches at least this large are decided on the blocking pool, off the async threads.
const BLOCKING_BATCH: usize = 32;

/// Most requests in one batch.
pub(crate) const MAX_BATCH: usize = 10_000;

/// Reads a JSON body, mapping a too-large body to 413 and bad JSON to a located 400.
pub(crate) fn json_body(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
    what: &str,
) -> Result<Value, ApiError> {
    let bytes = body.map_err(|r| body_error(state, &r))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::BadRequest(format!(
            "{what} is not valid JSON at line {}, column {}",
            e.line(),
            e.column()
        ))
    })
}

pub(crate) fn body_error(state: &AppState, r: &BytesRejection) -> ApiError {
    if r.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::TooLarge {
            limit: state.config().server.max_body_bytes,
        }
    } else {
        ApiError::BadRequest("cannot read the request body".into())
    }
}

pub(crate) fn caller(ext: &Extensions) -> Caller {
    ext.get::<Caller>()
        .cloned()
        .unwrap_or_else(Caller::anonymous)
}

/// Asks the policies whether the caller may `operation` on `api`. A refusal is a deny,
/// recorded (with a state store) before it is answered, off the async worker.
pub(crate) async fn authorize(
    state: &AppState,
    caller: &Caller,
    api: &str,
    operation: &str,
    node: Option<&str>,
) -> Result<(), ApiError> {
    let request = caller
        .manage_request(api, operation, node)
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    // An allow that carries no obligation is never recorded, so it may come from the
    // decision cache, which reuses an answer only while the facts it read are unchanged
    // (node agents' updates and reports repeat the same question thousands of times a
    // second). A deny, or an allow with obligations, is decided again below and
    // recorded as every decision is.
    let start = std::time::Instant::now();
    let cached = if state.engine().runs_plugins(&request) {
        Vec::new() // plugins run on the blocking pool, below
    } else {
        state.engine().decide_each(
            &request,
            std::slice::from_ref(request.resource()),
            Some(state.authorization_cache()),
        )
    };
    if let Some(decision) = cached.first()
        && decision.is_allowed()
        && decision.obligations.is_empty()
    {
        state.metrics().record_decision(decision, start.elapsed());
        return Ok(());
    }
    let decision = state.decide_async(caller, request).await?;
    if decision.is_allowed() {
        Ok(())
    } else {
        tracing::warn!(caller = %caller.0, operation, node, "API call forbidden");
        Err(ApiError::Forbidden(forbidden_message(
            caller, operation, &decision,
        )))
    }
}

/// Marks `request` as reported by an authorized source when it carries facts the
/// engine owns and the api policies let this caller `report` on `Api::"facts"`;
/// otherwise leaves it as it is, and the engine's deny names the fact.
async fn with_reporter(state: &AppState, caller: &Caller, request: Request) -> Request {
    if !state.engine().needs_reporter(&request) {
        return request;
    }
    match authorize(state, caller, "facts", "report", None).await {
        Ok(()) => request.as_fact_reporter(),
        Err(_) => request,
    }
}

pub(crate) async fn decide(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Decision>, ApiError> {
    let bytes = body.map_err(|r| body_error(&state, &r))?;
    let request = state
        .parsed_requests()
        .parse(&bytes)
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let caller = caller(&ext);
    let request = with_reporter(&state, &caller, request).await;
    Ok(Json(state.decide_async(&caller, request).await?))
}

pub(crate) async fn decide_batch(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let value = json_body(&state, body, "batch")?;
    let shape = || {
        ApiError::BadRequest("batch: expected {\"requests\": [...]} or an array of requests".into())
    };
    let items = match value {
        Value::Array(a) => a,
        Value::Object(mut o) => match o.remove("requests") {
            Some(Value::Array(a)) => a,
            _ => return Err(shape()),
        },
        _ => return Err(shape()),
    };
    if items.len() > MAX_BATCH {
        return Err(ApiError::BadRequest(format!(
            "batch: {} requests, over the limit of {MAX_BATCH}",
            items.len()
        )));
    }
    let requests = items
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            Request::from_json_owned(v)
                .map_err(|e| ApiError::BadRequest(format!("requests[{i}]: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // The caller is authorized to report at most once per batch.
    let caller = caller(&ext);
    let requests: Vec<Request> = requests
        .into_iter()
        .map(|r| r.on_behalf_of(caller.0.as_str()))
        .collect();
    let requests = if requests.iter().any(|r| state.engine().needs_reporter(r)) {
        let reporter = authorize(&state, &caller, "facts", "report", None)
            .await
            .is_ok();
        requests
            .into_iter()
            .map(|r| if reporter { r.as_fact_reporter() } else { r })
            .collect()
    } else {
        requests
    };
    // Large batches, and any batch whose denies must be recorded before the answer,
    // are decided on the blocking pool.
    let plugins = requests.iter().any(|r| state.engine().runs_plugins(r));
    let decisions =
        if requests.len() >= BLOCKING_BATCH || state.engine().state().is_some() || plugins {
            let s = state.clone();
            let c = caller.clone();
            tokio::task::spawn_blocking(move || s.decide_batch(&c, &requests))
                .await
                .map_err(|e| {
                    tracing::error!(error = %e, "batch decision task failed");
                    ApiError::Internal
                })??
        } else {
            state.decide_batch(&caller, &requests)?
        };
    Ok(Json(json!({ "decisions": decisions })))
}

pub(crate) async fn upsert_entities(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let caller = caller(&ext);
    authorize(&state, &caller, "entities", "upsert", None).await?;
    let value = json_body(&state, body, "entities")?;
    let n = state
        .engine()
        .upsert_entities(&value)
        .map_err(|e| ApiError::Unprocessable(e.to_string()))?;
    tracing::info!(caller = %caller.0, count = n, "entities upserted");
    Ok(Json(json!({ "upserted": n })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveBody {
    uids: Vec<Value>,
}

pub(crate) async fn remove_entities(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let caller = caller(&ext);
    authorize(&state, &caller, "entities", "remove", None).await?;
    let value = json_body(&state, body, "uids")?;
    let list = match value {
        Value::Array(a) => a,
        other => {
            serde_json::from_value::<RemoveBody>(other)
                .map_err(|e| {
                    ApiError::BadRequest(format!(
                        "expected {{\"uids\": [\"Type::\\\"id\\\"\", ...]}}: {e}"
                    ))
                })?
                .uids
        }
    };
    let uids = list
        .iter()
        .enumerate()
        .map(|(i, v)| {
            parse_uid(v).ok_or_else(|| {
                ApiError::BadRequest(format!(
                    "uids[{i}]: expected \"Type::\\\"id\\\"\" or {{\"type\": .., \"id\": ..}}"
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    state
        .engine()
        .remove_entities(&uids)
        .map_err(|e| ApiError::Unprocessable(e.to_string()))?;
    tracing::info!(caller = %caller.0, count = uids.len(), "entities removed");
    Ok(Json(json!({ "removed": uids.len() })))
}

fn parse_uid(v: &Value) -> Option<EntityUid> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Object(o) => match (o.get("type"), o.get("id")) {
            (Some(Value::String(t)), Some(Value::String(id))) => EntityUid::new(t, id).ok(),
            _ => None,
        },
        _ => None,
    }
}

pub(crate) async fn entity(
    State(state): State<AppState>,
    Path((type_name, id)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let uid = EntityUid::new(&type_name, &id)
        .map_err(|_| ApiError::BadRequest(format!("{type_name:?} is not an entity type")))?;
    state
        .engine()
        .entity(&uid)
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no entity {uid}")))
}

/// `GET /v1/entities/{type}`: every stored entity of a type, sorted by uid (the
/// controller reads the nodes' zones this way, in one request).
pub(crate) async fn entities_of_type(
    State(state): State<AppState>,
    Path(type_name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    EntityUid::new(&type_name, "-")
        .map_err(|_| ApiError::BadRequest(format!("{type_name:?} is not an entity type")))?;
    Ok(Json(
        json!({ "entities": state.engine().entities_json(Some(&type_name)) }),
    ))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct BlockBody {
    #[serde(default)]
    reason: Option<String>,
}

pub(crate) async fn block_node(
    State(state): State<AppState>,
    ext: Extensions,
    Path(node): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let caller = caller(&ext);
    authorize(&state, &caller, "nodes", "block", Some(&node)).await?;
    let bytes = body.map_err(|r| body_error(&state, &r))?;
    let parsed: BlockBody = if bytes.iter().all(u8::is_ascii_whitespace) {
        BlockBody::default()
    } else {
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::BadRequest(format!("expected {{\"reason\": \"...\"}}: {e}")))?
    };
    let reason = parsed
        .reason
        .unwrap_or_else(|| format!("blocked through the API by {}", caller.0));
    let engine = state.engine().clone();
    let (n, r) = (node.clone(), reason.clone());
    // A shared store answers over the network and waits for this process's watch.
    tokio::task::spawn_blocking(move || engine.block_node(&n, &r))
        .await
        .map_err(|_| ApiError::Internal)?
        .map_err(state_change_error)?;
    tracing::warn!(caller = %caller.0, node = %node, reason = %reason, "node blocked");
    Ok(Json(
        json!({ "node": node, "blocked": true, "reason": reason }),
    ))
}

pub(crate) async fn unblock_node(
    State(state): State<AppState>,
    ext: Extensions,
    Path(node): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let caller = caller(&ext);
    authorize(&state, &caller, "nodes", "unblock", Some(&node)).await?;
    let engine = state.engine().clone();
    let n = node.clone();
    tokio::task::spawn_blocking(move || engine.unblock_node(&n))
        .await
        .map_err(|_| ApiError::Internal)?
        .map_err(state_change_error)?;
    tracing::warn!(caller = %caller.0, node = %node, "node unblocked");
    Ok(Json(json!({ "node": node, "blocked": false })))
}

/// A refused block or unblock: the state store failing is 503 (try again), a bad node
/// name 400.
fn state_change_error(e: probity::EntityError) -> ApiError {
    match e {
        probity::EntityError::State(inner) => {
            // The caller acts on the cause (which endpoint, whether it may have applied).
            let mut text = inner.to_string();
            let mut cause = std::error::Error::source(&inner);
            while let Some(c) = cause {
                text.push_str(": ");
                text.push_str(&c.to_string());
                cause = c.source();
            }
            ApiError::Unavailable(text)
        }
        other => ApiError::BadRequest(other.to_string()),
    }
}

pub(crate) async fn blocked_nodes(State(state): State<AppState>) -> Json<Value> {
    // Blocks in force here that have not reached the shared store yet.
    let unshared: Vec<String> = state
        .engine()
        .state()
        .map(|s| s.unshared_blocks().into_iter().map(|b| b.node).collect())
        .unwrap_or_default();
    let nodes = state.engine().blocked_nodes();
    // Read after the blocklist, so a record this answer holds and its node's unblock
    // (already in the store, not yet in memory) show up together: the record is stale.
    let engine = state.engine().clone();
    let tombstones = tokio::task::spawn_blocking(move || engine.block_tombstones()).await;
    let mut answer = serde_json::Map::new();
    answer.insert("nodes".into(), json!(nodes));
    answer.insert("unshared".into(), json!(unshared));
    match tombstones {
        Ok(Ok(tombstones)) => {
            answer.insert("tombstones".into(), json!(tombstones));
        }
        // Without them a caller cannot tell a stale record from a live one: it says so,
        // and a cluster manager acts on nothing new until they read again.
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "reading the blocklist's tombstones failed");
            answer.insert(
                "tombstonesError".into(),
                json!(probity_base::error::chain(&e)),
            );
        }
        Err(_) => {
            answer.insert(
                "tombstonesError".into(),
                json!("the tombstone read did not finish"),
            );
        }
    }
    Json(Value::Object(answer))
}

/// `GET /v1/cluster/digests`: the policy digest every process reported serving, newest
/// first, with the processes whose digest differs from the newest one (a rollout they
/// have not taken, or a rejected reload) listed as lagging.
pub(crate) async fn cluster_digests(
    State(state): State<AppState>,
) -> Result<Json<Value>, ApiError> {
    let Some(store) = state.engine().state().cloned() else {
        return Err(ApiError::Unavailable(
            "no state store: digests are reported to [integrity] state_dir or [state] etcd".into(),
        ));
    };
    let mut served = tokio::task::spawn_blocking(move || store.served_digests())
        .await
        .map_err(|_| ApiError::Internal)?
        .map_err(|e| {
            tracing::warn!(error = %e, "reading the served digests failed");
            ApiError::Unavailable(format!("cannot read the served digests: {e}"))
        })?;
    served.sort_by(|a, b| b.at.cmp(&a.at).then_with(|| a.process.cmp(&b.process)));
    let newest = served.first().map(|d| d.digest.clone());
    let lagging: Vec<&str> = served
        .iter()
        .filter(|d| Some(&d.digest) != newest.as_ref())
        .map(|d| d.process.as_str())
        .collect();
    Ok(Json(json!({
        "process": state.config().state.process_name(),
        "digest": state.engine().status().digest,
        "newest": newest,
        "processes": served,
        "lagging": lagging,
    })))
}

/// Most decision records one `GET /v1/decisions` returns.
const MAX_DECISION_RECORDS: usize = 1000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DecisionsQuery {
    #[serde(default)]
    from: u64,
    limit: Option<usize>,
}

/// The decision log, oldest first: `?from=<seq>&limit=<n>` (at most 1000, default
/// 100). For callers the API policies let read it (admins, auditors).
pub(crate) async fn decisions(
    State(state): State<AppState>,
    ext: Extensions,
    query: Result<Query<DecisionsQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let caller = caller(&ext);
    authorize(&state, &caller, "decisions", "read", None).await?;
    let Some(store) = state.engine().log().cloned() else {
        return Err(ApiError::Unavailable(
            "no state directory is configured, so no decision is recorded".into(),
        ));
    };
    let limit = query.limit.unwrap_or(100).min(MAX_DECISION_RECORDS);
    let from = query.from;
    let records = tokio::task::spawn_blocking(move || store.decisions(from, limit))
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "decision log read task failed");
            ApiError::Internal
        })?
        .map_err(|e| {
            tracing::error!(error = %e, "reading the decision log failed");
            ApiError::Internal
        })?;
    let next = records.last().map_or(from, |r| r.seq + 1);
    let records: Vec<Value> = records.iter().map(DecisionRecord::to_json).collect();
    Ok(Json(json!({ "records": records, "next": next })))
}

pub(crate) async fn policy_status(State(state): State<AppState>) -> Json<probity::PolicyStatus> {
    Json(state.engine().status())
}

/// `GET /v1/policy/shadow`: the shadow set's counts and latest disagreements.
pub(crate) async fn policy_shadow(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    match state.shadow() {
        None => Err(ApiError::NotFound(
            "no shadow set is configured ([policies] shadow)".into(),
        )),
        Some(Err(why)) => Err(ApiError::Unavailable(why.to_owned())),
        Some(Ok(shadow)) => Ok(Json(shadow.report())),
    }
}

/// `GET /v1/reports`: the store judged now (see [`crate::reports`]), off the async
/// workers.
pub(crate) async fn reports(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let report = tokio::task::spawn_blocking(move || crate::reports::audit_store(state.engine()))
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "the report task failed");
            ApiError::Internal
        })?;
    Ok(Json(serde_json::to_value(report).unwrap_or_default()))
}

/// Largest signed manifest `/v1/verify` reads.
const MAX_MANIFEST_BYTES: u64 = 64 * 1024 * 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct VerifyBody {
    /// The file (or block device) on this node.
    path: std::path::PathBuf,
    /// The object id it must be.
    id: String,
    /// The node that is about to read it.
    node: String,
    /// The signed manifest; default `PATH.manifest`.
    #[serde(default)]
    manifest: Option<std::path::PathBuf>,
    /// The pod that reads, `{namespace, name, uid?}`: a block its failed read causes
    /// names it, so the cluster manager stops its workload first.
    #[serde(default)]
    reader: Option<probity::ReaderPod>,
}

/// `POST /v1/verify`: verifies `path` against its signed manifest before `node` reads it,
/// then decides the read through the policies; a failure denies it and blocks the node.
///
/// The object and its manifest are read only under the configured data roots, only if
/// they are regular files (or block devices), through a walk that follows no symlink
/// placed after the check; anything else is "not permitted", the same answer for every
/// reason. The reading runs on the server's I/O threads, a few jobs per caller.
pub(crate) async fn verify(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let caller = caller(&ext);
    let value = json_body(&state, body, "verify request")?;
    let mut body: VerifyBody = serde_json::from_value(value).map_err(|e| {
        ApiError::BadRequest(format!(
            "expected {{\"path\": .., \"id\": .., \"node\": .., \"manifest\"?: .., \"reader\"?: {{\"namespace\", \"name\", \"uid\"?}}}}: {e}"
        ))
    })?;
    let slurm_namespace = state.config().slurm.reader_namespace.as_str();
    if let Some(reader) = &body.reader {
        reader
            .validate()
            .map_err(|e| ApiError::BadRequest(e.to_string()))?;
        if reader.namespace == slurm_namespace {
            slurm_reader_job(reader)?;
        }
    }
    authorize(&state, &caller, "verify", "verify", Some(&body.node)).await?;
    if let Some(peer) = ext.get::<crate::PeerProcess>() {
        match &mut body.reader {
            Some(reader) if reader.namespace == slurm_namespace => {
                check_local_job(reader, *peer)?;
            }
            Some(reader) => check_local_reader(reader, *peer)?,
            None => body.reader = local_job_reader(slurm_namespace, *peer),
        }
    }
    let engine = state.engine().clone();
    let Some(store) = engine.attached() else {
        return Err(ApiError::Unavailable(
            "verification needs a state directory ([integrity] state_dir)".into(),
        ));
    };
    let roots = state.config().integrity.data_roots.clone();
    if roots.is_empty() {
        return Err(ApiError::Unavailable(
            "verification reads only under data roots, and none are configured ([integrity] data_roots)".into(),
        ));
    }
    let key_path = state
        .config()
        .integrity
        .pinned_key_path()
        .ok_or_else(|| ApiError::Unavailable("no pinned public key configured".into()))?;
    let checker = state.clone();
    let outcome = state
        .io()
        .run(&caller.0, move || {
            verify_blocking(&checker, &engine, &store, &key_path, &roots, &body)
        })
        .await
        .map_err(|busy| match busy {
            crate::limits::Busy::Caller => ApiError::TooManyRequests(format!(
                "{} already has its verifications in flight",
                caller.0
            )),
            crate::limits::Busy::Queue => {
                ApiError::TooManyRequests("too many verifications are waiting".into())
            }
            crate::limits::Busy::Stopped => ApiError::Internal,
        })??;
    Ok(Json(outcome))
}

/// A local caller (on the Unix socket) may name only the pod it runs in: the pod uid
/// in its cgroup must be the claimed one, and becomes the claim's uid when it gave
/// none. A caller over TCP has no cgroup here; its certificate is what is trusted.
fn check_local_reader(
    reader: &mut probity::ReaderPod,
    peer: crate::PeerProcess,
) -> Result<(), ApiError> {
    let refused = |e: crate::ReaderClaimError| {
        ApiError::Forbidden(format!("reader {}/{}: {e}", reader.namespace, reader.name))
    };
    let cgroup = crate::reader_claim::read_cgroup(peer.pid).map_err(refused)?;
    let uid = crate::reader_claim::check_claim(
        &cgroup,
        &format!("{}/{}", reader.namespace, reader.name),
        reader.uid.as_deref(),
    )
    .map_err(refused)?;
    reader.uid = Some(uid);
    Ok(())
}

/// The job a Slurm reader (`{"namespace": <[slurm] reader_namespace>, "name":
/// "job-<id>"}`) claims; a name of another form, or a uid, is a 400.
fn slurm_reader_job(reader: &probity::ReaderPod) -> Result<u64, ApiError> {
    if reader.uid.is_some() {
        return Err(ApiError::BadRequest(format!(
            "reader.uid: a Slurm job reader ({}/{}) has no uid",
            reader.namespace, reader.name
        )));
    }
    crate::slurm_job::claimed_job(&reader.name).ok_or_else(|| {
        ApiError::BadRequest(format!(
            "reader.name: {:?} is not job-<id>, which names a Slurm job in namespace {}",
            reader.name, reader.namespace
        ))
    })
}

/// A local caller naming a Slurm job must run in it (see [`crate::slurm_job`]).
fn check_local_job(reader: &probity::ReaderPod, peer: crate::PeerProcess) -> Result<(), ApiError> {
    let claimed = slurm_reader_job(reader)?;
    crate::slurm_job::check_job_claim(&crate::slurm_job::HostProcesses, peer.pid, claimed).map_err(
        |e| ApiError::Forbidden(format!("reader {}/{}: {e}", reader.namespace, reader.name)),
    )
}

/// A local caller that names no reader reads as the Slurm job it runs in, if any, so
/// that a block its failed read causes names the job (which the controller requeues).
/// Nothing found, or nothing readable: no reader, as before.
fn local_job_reader(namespace: &str, peer: crate::PeerProcess) -> Option<probity::ReaderPod> {
    let job = crate::slurm_job::find_job(&crate::slurm_job::HostProcesses, peer.pid)
        .inspect_err(|e| tracing::debug!(error = %e, pid = peer.pid, "no Slurm job found for a local reader"))
        .ok()??;
    probity::ReaderPod::new(namespace, format!("job-{job}"), None)
        .inspect_err(|e| tracing::warn!(error = %e, "a Slurm job cannot be named as a reader"))
        .ok()
}

/// Opens `path` if it lies under one of `roots` and is a regular file or block device:
/// canonicalized, then opened from the root down one component at a time without
/// following symlinks, so a link swapped in after the check cannot lead outside. Every
/// refusal is the same [`ApiError::NotPermitted`].
pub(crate) fn open_confined(
    roots: &[std::path::PathBuf],
    path: &std::path::Path,
) -> Result<(std::fs::File, std::path::PathBuf), ApiError> {
    use rustix::fs::{Mode, OFlags};
    let canonical = std::fs::canonicalize(path).map_err(|_| ApiError::NotPermitted)?;
    let (root, rest) = roots
        .iter()
        .filter_map(|r| std::fs::canonicalize(r).ok())
        .find_map(|r| {
            let rest = canonical.strip_prefix(&r).ok()?.to_owned();
            Some((r, rest))
        })
        .ok_or(ApiError::NotPermitted)?;
    let parts: Vec<&std::ffi::OsStr> = rest.iter().collect();
    let Some((last, dirs)) = parts.split_last() else {
        return Err(ApiError::NotPermitted);
    };
    let walk = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut dir =
        rustix::fs::open(&root, walk, Mode::empty()).map_err(|_| ApiError::NotPermitted)?;
    for part in dirs {
        dir = rustix::fs::openat(&dir, *part, walk, Mode::empty())
            .map_err(|_| ApiError::NotPermitted)?;
    }
    let fd = rustix::fs::openat(
        &dir,
        *last,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|_| ApiError::NotPermitted)?;
    let file = std::fs::File::from(fd);
    use std::os::unix::fs::FileTypeExt;
    let kind = file
        .metadata()
        .map_err(|_| ApiError::NotPermitted)?
        .file_type();
    if !(kind.is_file() || kind.is_block_device()) {
        return Err(ApiError::NotPermitted);
    }
    Ok((file, canonical))
}

fn verify_blocking(
    state: &AppState,
    engine: &probity::Engine,
    store: &probity::state::AttachedState,
    key_path: &std::path::Path,
    roots: &[std::path::PathBuf],
    body: &VerifyBody,
) -> Result<Value, ApiError> {
    use probity::integrity::{self, Verifier, VerifyOptions};
    use std::io::Read;
    // The caller's paths first: what it may not read is refused before anything else.
    let manifest_path = body
        .manifest
        .clone()
        .unwrap_or_else(|| integrity::Manifest::default_path(&body.path));
    let (object, object_path) = open_confined(roots, &body.path)?;
    let (manifest_file, _) = open_confined(roots, &manifest_path)?;
    // Judged on every read, as the CLI and sealed mode judge it: a key others may
    // write proves nothing, and a server trusting it would pass forged data.
    let key = state.pinned_key(key_path)?;
    let verifier = Verifier::new(key);
    let mut manifest = Vec::new();
    manifest_file
        .take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut manifest)
        .map_err(|_| ApiError::NotPermitted)?;
    if manifest.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(ApiError::Unprocessable(format!(
            "the manifest is over {MAX_MANIFEST_BYTES} bytes"
        )));
    }
    let options = VerifyOptions {
        expected_object_id: Some(&body.id),
        ..VerifyOptions::default()
    };
    // The environment failing gives no verdict on the node; the object failing does.
    let outcome = verifier
        .verify_encoded_file(object, &object_path, &manifest, store, &options)
        .map_err(|e| ApiError::Unprocessable(format!("could not verify: {e}")))?;
    let verification = match &outcome {
        Ok(report) => Ok(report),
        Err(e) => Err(e as &dyn std::error::Error),
    };
    let decision = engine.decide_read_as(&body.node, &body.id, verification, body.reader.as_ref());
    Ok(json!({
        "verified": outcome.is_ok(),
        "failure": outcome.as_ref().err().map(|e| e.to_string()),
        "decision": decision,
    }))
}

/// Most events one `POST /v1/events` appends.
const MAX_EVENTS: usize = 256;
/// Longest text of an event's field.
const MAX_EVENT_FIELD: usize = 4096;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsBody {
    events: Vec<EventBody>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventBody {
    object: String,
    #[serde(default)]
    node: Option<String>,
    kind: String,
    detail: String,
}

/// `POST /v1/events`: appends what another component did (the controller's taints,
/// releases and evictions) to the event log, so it is chained, checkpointed and
/// forwarded to the SIEM with Probity's own events.
pub(crate) async fn record_events(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let caller = caller(&ext);
    authorize(&state, &caller, "events", "record", None).await?;
    let bytes = body.map_err(|r| body_error(&state, &r))?;
    let parsed: EventsBody = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::BadRequest(format!(
            "expected {{\"events\": [{{\"object\", \"node\", \"kind\", \"detail\"}}]}}: {e}"
        ))
    })?;
    if parsed.events.len() > MAX_EVENTS {
        return Err(ApiError::BadRequest(format!(
            "events: {} events, over the limit of {MAX_EVENTS}",
            parsed.events.len()
        )));
    }
    for (i, event) in parsed.events.iter().enumerate() {
        let fields = [
            ("object", Some(event.object.as_str())),
            ("node", event.node.as_deref()),
            ("kind", Some(event.kind.as_str())),
            ("detail", Some(event.detail.as_str())),
        ];
        for (name, value) in fields {
            if value.is_some_and(|v| v.len() > MAX_EVENT_FIELD) {
                return Err(ApiError::BadRequest(format!(
                    "events[{i}].{name}: over {MAX_EVENT_FIELD} bytes"
                )));
            }
        }
        if event.kind.is_empty() || event.object.is_empty() {
            return Err(ApiError::BadRequest(format!(
                "events[{i}]: object and kind must not be empty"
            )));
        }
    }
    let Some(log) = state.engine().log().cloned() else {
        return Err(ApiError::Unavailable(
            "no state store: events are kept in [integrity] state_dir".into(),
        ));
    };
    let recorder = caller.0.to_string();
    let appended = tokio::task::spawn_blocking(move || {
        let mut first = None;
        for event in &parsed.events {
            let detail = format!("{} (recorded by {recorder})", event.detail);
            let seq =
                log.record_event(&event.object, event.node.as_deref(), &event.kind, &detail)?;
            first.get_or_insert(seq);
        }
        Ok::<_, probity::state::StateError>((first, parsed.events.len()))
    })
    .await
    .map_err(|_| ApiError::Internal)?
    .map_err(|e| {
        tracing::warn!(error = %e, "recording events failed");
        ApiError::Unavailable(format!("cannot record the events: {e}"))
    })?;
    Ok(Json(json!({ "recorded": appended.1, "first": appended.0 })))
}

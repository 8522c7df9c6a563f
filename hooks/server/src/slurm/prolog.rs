//! `POST /v1/slurm/prolog`: a job judged on the node where it starts.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::Extensions;
use probity::state::{AdmittedFacts, AdmittedLimits};
use probity::{DecideOptions, Decision, EntityUid, Request};
use serde::Deserialize;
use serde_json::{Value, json};

use super::submit::is_token;
use super::{JOB, Refusal, SUBMISSION, refusals, workload_entity};
use crate::AppState;
use crate::api::{caller, json_body};
use crate::caller::Caller;
use crate::config::UnknownJobs;
use crate::error::ApiError;

/// The event appended when the Prolog refuses a job.
pub(crate) const REFUSED_EVENT: &str = "slurm-prolog-refused";

/// Longest node name taken (a DNS name).
const MAX_NODE_BYTES: usize = 253;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PrologBody {
    /// The job id, digits.
    job: String,
    /// The node it starts on.
    node: String,
    /// The token its submission answered, when the job carries it.
    #[serde(default)]
    submission: Option<String>,
}

/// Who is at fault when the Prolog refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The node: Slurm drains it and requeues the job.
    Node,
    /// The job: Slurm requeues it held.
    Job,
}

impl Fault {
    fn verdict(self) -> &'static str {
        match self {
            Fault::Node => "node",
            Fault::Job => "job",
        }
    }

    fn consequence(self) -> &'static str {
        match self {
            Fault::Node => "node drained and job requeued",
            Fault::Job => "job requeued held",
        }
    }
}

/// `POST /v1/slurm/prolog`: `{"job", "node", "submission"?}` answered with
/// `{"verdict": "allow"}` or `{"verdict": "node" | "job", "policy", "message"}`.
///
/// Asked like `/v1/decide` (the Prolog runs as root on the node; no `manage`
/// authorization). A refusal forgets nothing: the job may start elsewhere later.
pub(crate) async fn prolog(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let caller = caller(&ext);
    let value = json_body(&state, body, "slurm prolog request")?;
    let body: PrologBody = serde_json::from_value(value).map_err(|e| {
        ApiError::BadRequest(format!(
            "expected {{\"job\": \"<job id>\", \"node\": \"<node>\", \"submission\"?: \"<token>\"}}: {e}"
        ))
    })?;
    if body.job.is_empty() || body.job.len() > 20 || !body.job.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ApiError::BadRequest(format!(
            "job: {:?} is not a Slurm job id (digits)",
            body.job.chars().take(32).collect::<String>()
        )));
    }
    if body.node.is_empty()
        || body.node.len() > MAX_NODE_BYTES
        || !body
            .node
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(ApiError::BadRequest(format!(
            "node: {:?} is not a node name (letters, digits, '-', '_', '.'; at most {MAX_NODE_BYTES} bytes)",
            body.node.chars().take(64).collect::<String>()
        )));
    }
    if let Some(token) = body.submission.as_deref()
        && !is_token(token)
    {
        return Err(ApiError::BadRequest(
            "submission: not a token answered by POST /v1/slurm/submit (32 lower-case hex digits)"
                .into(),
        ));
    }
    let s = state.clone();
    tokio::task::spawn_blocking(move || judge(&s, &caller, &body))
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "slurm prolog task failed");
            ApiError::Internal
        })?
        .map(Json)
}

fn judge(state: &AppState, caller: &Caller, body: &PrologBody) -> Result<Value, ApiError> {
    let job = body.job.as_str();
    let node = body.node.as_str();
    let Some(attrs) = facts(state, job, body.submission.as_deref())? else {
        return match state.config().slurm.unknown_job {
            UnknownJobs::Allow => Ok(json!({"verdict": "allow"})),
            UnknownJobs::Refuse => {
                let refusal = Refusal::new(
                    "slurm.unknown-job",
                    format!(
                        "no facts are remembered for job {job} (submitted before Probity answered, or over remember_seconds ago)"
                    ),
                );
                Ok(refuse(state, job, node, Fault::Job, &refusal))
            }
        };
    };
    let engine = state.engine();
    let node_type = engine.blocklist_type().unwrap_or_else(|| "Node".to_owned());
    let node_uid = EntityUid::new(&node_type, node)
        .map_err(|e| ApiError::BadRequest(format!("node {node:?}: {e}")))?;
    let workload = workload_entity(&format!("{JOB}/{job}"), &attrs);
    let request = workload
        .request(
            engine.conventions().schedule_action(),
            Some(node_uid.clone()),
        )
        .map_err(ApiError::BadRequest)?
        .on_behalf_of(caller.0.as_str());
    let scheduled = state.decide(caller, &request)?;
    if scheduled.is_allowed() {
        return Ok(json!({"verdict": "allow"}));
    }
    let (fault, refusal) = at_fault(state, node, &node_uid, &scheduled);
    Ok(refuse(state, job, node, fault, &refusal))
}

/// The job's facts: its submission's (copied under its id the first time), else those
/// under its id. `None` when neither holds any (or without a state backend).
///
/// The token is kept, not moved: every task of a job array, each with its own id,
/// carries the same submission, and a requeued job starts again with it. The token is
/// asked first when there is one: a job id Slurm has wrapped around to may still hold
/// another job's facts.
fn facts(state: &AppState, job: &str, token: Option<&str>) -> Result<Option<Value>, ApiError> {
    let Some(store) = state.engine().state() else {
        return Ok(None);
    };
    let cfg = state.config();
    let seconds = cfg.slurm.remember_seconds;
    let unavailable = |what: &str, e: probity::state::StateError| {
        let why = crate::server::error_chain(&e);
        tracing::warn!(error = %why, job, "{what}");
        ApiError::Unavailable(format!("{what} ({why}); retry later"))
    };
    let under_id = |store: &dyn probity::state::SharedState| {
        store
            .admitted(JOB, job, seconds)
            .map_err(|e| unavailable("cannot read the job's facts", e))
    };
    if let Some(token) = token {
        let submitted = store
            .admitted(SUBMISSION, token, seconds)
            .map_err(|e| unavailable("cannot read the job's submitted facts", e))?;
        if let Some(f) = submitted {
            // Written once per job id: a restart of the same job reads it back alike.
            if under_id(store.as_ref())?.is_none_or(|known| known.attrs != f.attrs) {
                let started = AdmittedFacts {
                    namespace: JOB.to_owned(),
                    name: job.to_owned(),
                    uid: job.to_owned(),
                    attrs: f.attrs.clone(),
                    admitted_at_ms: state.engine().clock().now_unix_ms(),
                };
                let limits = AdmittedLimits {
                    max: cfg.admission.admitted_facts_max,
                    seconds,
                };
                store
                    .remember_admitted(&started, &limits)
                    .map_err(|e| unavailable("cannot remember the job's facts under its id", e))?;
            }
            return Ok(Some(f.attrs));
        }
    }
    Ok(under_id(store.as_ref())?.map(|f| f.attrs))
}

/// Whether the node or the job is at fault for a refused `schedule`, and the reason
/// that says so: the node when it is blocked, when Probity holds no facts about it, or
/// when its own `comply` is refused; the job otherwise.
fn at_fault(
    state: &AppState,
    node: &str,
    node_uid: &EntityUid,
    scheduled: &Decision,
) -> (Fault, Refusal) {
    let engine = state.engine();
    if let Some(block) = engine.blocked_nodes().get(node) {
        let policy = engine
            .conventions()
            .block_policy()
            .unwrap_or("security.blocked-node")
            .to_owned();
        let message = scheduled
            .reasons
            .iter()
            .find(|r| r.policy == policy)
            .map_or_else(|| "the node is blocked".to_owned(), |r| r.message.clone());
        return (
            Fault::Node,
            Refusal::new(policy, format!("{message} (blocked: {})", block.reason)),
        );
    }
    if !engine.contains_entity(node_uid) || engine.known_only_from_cluster(node_uid) {
        return (
            Fault::Node,
            Refusal::new(
                "slurm.unknown-node",
                format!(
                    "Probity holds no facts about node {node} (its agent has not reported it), so no job may start there"
                ),
            ),
        );
    }
    // The node's own compliance, asked as its agent asks it. Not recorded: the agent
    // records its node's findings; this only tells the node's fault from the job's.
    let comply = EntityUid::action("comply")
        .map(|action| Request::new(node_uid.clone(), action, node_uid.clone()));
    if let Ok(request) = comply {
        let d = engine
            .decide_with(
                std::slice::from_ref(&request),
                DecideOptions::new().dry_run(),
            )
            .settle()
            .pop()
            .unwrap_or_else(|| Decision::error("no decision"));
        if let Some(first) = refusals(&d).into_iter().next() {
            return (Fault::Node, first);
        }
    }
    let first = refusals(scheduled)
        .into_iter()
        .next()
        .unwrap_or_else(|| Refusal::new("probity.no-permit", "no policy permits it"));
    (Fault::Job, first)
}

/// The refusal as answered, after appending it to the event log.
fn refuse(state: &AppState, job: &str, node: &str, fault: Fault, refusal: &Refusal) -> Value {
    let message = refusal.line();
    let object = format!("{JOB}/{job}");
    let detail = format!(
        "verdict {} by {}: {message}; {}",
        fault.verdict(),
        refusal.policy,
        fault.consequence()
    );
    tracing::info!(job, node, verdict = fault.verdict(), %message, "slurm prolog refused");
    match state.engine().log() {
        Some(log) => {
            if let Err(e) = log.record_event(&object, Some(node), REFUSED_EVENT, &detail) {
                tracing::warn!(error = %crate::server::error_chain(&e), job, "cannot record the prolog's refusal");
            }
        }
        None => tracing::debug!(job, "no event log: the prolog's refusal is not recorded"),
    }
    json!({"verdict": fault.verdict(), "policy": refusal.policy, "message": message})
}

//! `POST /v1/slurm/submit`: a job description judged as admission judges a pod.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::Extensions;
use probity::EntityUid;
use serde_json::{Value, json};

use super::job::{JobDescription, JobWorkload};
use super::{Refusal, SUBMISSION, refusals, workload_entity};
use crate::AppState;
use crate::api::{caller, json_body};
use crate::caller::Caller;
use crate::config::SlurmNamespace;
use crate::error::ApiError;

/// Bytes of a submission token (written as twice as many hex digits).
const TOKEN_BYTES: usize = 16;

/// `POST /v1/slurm/submit`: `{"job": {"<field>": "<string>", ..}}` answered with
/// `{"allowed", "submission", "message"?, "reasons", "warnings", "workload"}`.
///
/// Asked like `/v1/decide` (a question; no `manage` authorization): `job_submit` runs
/// as slurmctld's user. Each of the job's namespaces (a job may be submitted to several
/// partitions) is asked `admit`, recorded as admission's decisions are; an admitted
/// job's facts are remembered under a fresh token for its Prolog.
pub(crate) async fn submit(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let caller = caller(&ext);
    let value = json_body(&state, body, "slurm submit request")?;
    let job = JobDescription::from_body(&value).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let cfg = &state.config().slurm;
    let namespaces = job.namespaces(cfg);
    let bad = |e: super::job::JobError| ApiError::BadRequest(e.to_string());
    if namespaces.is_empty() {
        // Read anyway, so a malformed job is a 400 whatever else is wrong with it.
        let workload = job.workload(cfg, "").map_err(bad)?;
        let field = match cfg.namespace {
            SlurmNamespace::Partition => "partition",
            SlurmNamespace::Account => "account",
        };
        let refusal = Refusal::new(
            "slurm.no-namespace",
            format!(
                "the job names no {field}, which is its namespace here ([slurm] namespace), so its policies cannot be chosen; name one (--{field})"
            ),
        );
        return Ok(Json(answer(
            Some(&refusal),
            std::slice::from_ref(&refusal),
            &[],
            None,
            &workload,
        )));
    }
    let workloads = namespaces
        .iter()
        .map(|ns| job.workload(cfg, ns))
        .collect::<Result<Vec<_>, _>>()
        .map_err(bad)?;
    // Decisions that deny wait for their records, and remembering writes the state
    // backend (possibly etcd): off the async workers.
    let s = state.clone();
    tokio::task::spawn_blocking(move || admit_job(&s, &caller, &workloads))
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "slurm submit task failed");
            ApiError::Internal
        })?
        .map(Json)
}

fn admit_job(
    state: &AppState,
    caller: &Caller,
    workloads: &[JobWorkload],
) -> Result<Value, ApiError> {
    let token = new_token()?;
    let id = format!("{SUBMISSION}/{token}");
    let mut reasons = Vec::new();
    let mut warnings = Vec::new();
    for w in workloads {
        let workload = workload_entity(&id, &w.attrs);
        let namespace = EntityUid::new("Namespace", &w.namespace)
            .map_err(|e| ApiError::BadRequest(format!("job namespace {:?}: {e}", w.namespace)))?;
        let request = workload
            .request("admit", Some(namespace))
            .map_err(ApiError::BadRequest)?
            .on_behalf_of(caller.0.as_str());
        let d = state.decide(caller, &request)?;
        warnings.extend(
            d.warnings
                .iter()
                .map(|n| Refusal::new(&n.policy, &n.message)),
        );
        reasons.extend(refusals(&d));
    }
    let Some(first) = workloads.first() else {
        return Err(ApiError::Internal);
    };
    if let Some(refusal) = reasons.first() {
        tracing::info!(
            message = %refusal.line(),
            "slurm job refused at submission"
        );
        return Ok(answer(Some(refusal), &reasons, &warnings, None, first));
    }
    let submission = remember(state, &token, first, &mut warnings)?;
    Ok(answer(
        None,
        &reasons,
        &warnings,
        submission.as_deref(),
        first,
    ))
}

/// Remembers an admitted job's facts under its token; without a state backend nothing
/// is kept (and a warning says what the Prolog will then do).
fn remember(
    state: &AppState,
    token: &str,
    w: &JobWorkload,
    warnings: &mut Vec<Refusal>,
) -> Result<Option<String>, ApiError> {
    let cfg = state.config();
    let Some(store) = state.engine().state() else {
        warnings.push(Refusal::new(
            "slurm.facts-not-remembered",
            format!(
                "this server has no state backend ([integrity] state_dir), so the job's facts are not kept for its Prolog, which will treat it as unknown ([slurm] unknown_job = \"{}\")",
                match cfg.slurm.unknown_job {
                    crate::config::UnknownJobs::Refuse => "refuse",
                    crate::config::UnknownJobs::Allow => "allow",
                }
            ),
        ));
        return Ok(None);
    };
    let facts = probity::state::AdmittedFacts {
        namespace: SUBMISSION.to_owned(),
        name: token.to_owned(),
        uid: token.to_owned(),
        attrs: w.attrs.clone(),
        admitted_at_ms: state.engine().clock().now_unix_ms(),
    };
    let limits = probity::state::AdmittedLimits {
        max: cfg.admission.admitted_facts_max,
        seconds: cfg.slurm.remember_seconds,
    };
    // An admitted job whose facts were lost would be refused where it starts: the
    // submission fails instead, where Slurm can say so at once.
    store.remember_admitted(&facts, &limits).map_err(|e| {
        let why = crate::server::error_chain(&e);
        tracing::warn!(error = %why, "cannot remember a slurm job's facts");
        ApiError::Unavailable(format!(
            "the job's facts could not be remembered for its Prolog ({why}); retry later"
        ))
    })?;
    Ok(Some(token.to_owned()))
}

fn answer(
    first: Option<&Refusal>,
    reasons: &[Refusal],
    warnings: &[Refusal],
    submission: Option<&str>,
    workload: &JobWorkload,
) -> Value {
    let mut out = json!({
        "allowed": first.is_none(),
        "submission": submission,
        "reasons": reasons.iter().map(Refusal::json).collect::<Vec<_>>(),
        "warnings": warnings.iter().map(Refusal::json).collect::<Vec<_>>(),
        "workload": workload.attrs,
    });
    if let (Some(r), Some(obj)) = (first, out.as_object_mut()) {
        obj.insert("message".into(), Value::String(r.line()));
    }
    out
}

/// A fresh random token: 32 lower-case hex digits.
fn new_token() -> Result<String, ApiError> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; TOKEN_BYTES];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| {
            tracing::error!("the system's random source failed");
            ApiError::Internal
        })?;
    Ok(hex::encode(bytes))
}

/// Whether `text` is a token [`new_token`] could have made.
pub(super) fn is_token(text: &str) -> bool {
    text.len() == TOKEN_BYTES * 2 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

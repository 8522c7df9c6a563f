//! `/v1/actions/migrate`: the agents' requests that the controller move work out of a
//! zone ([`ActionRequest`]), as shared state holds them. The controller reads the live
//! ones here (never from a decision log); a node that reaches Probity only through the
//! API reports here instead, and the server decides for it.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::Extensions;
use probity::state::{ActionRequest, MIGRATE};
use probity::{EntityUid, Request};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::AppState;
use crate::api::{authorize, body_error, caller};
use crate::error::ApiError;

/// The TTL of a reported request when the reporter names none: as long as an agent's
/// facts stay fresh by default.
const DEFAULT_TTL_SECONDS: u64 = 60;
/// The longest TTL a reporter may give: a request must lapse soon after its reporter.
const MAX_TTL_SECONDS: u64 = 600;

fn unavailable(e: impl std::fmt::Display) -> ApiError {
    tracing::warn!(error = %e, "action requests could not be read or written");
    ApiError::Unavailable(format!("cannot reach the action requests: {e}"))
}

fn now(state: &AppState) -> u64 {
    u64::try_from(state.engine().clock().now_unix()).unwrap_or(0)
}

/// `GET /v1/actions/migrate`: the live `migrate` requests, by zone then node
/// (`{"requests": [..]}`). Open to read, as the blocklist is.
pub(crate) async fn migrate_requests(
    State(state): State<AppState>,
) -> Result<Json<Value>, ApiError> {
    let Some(store) = state.engine().state().cloned() else {
        return Ok(Json(json!({ "requests": [] })));
    };
    let all = tokio::task::spawn_blocking(move || store.action_requests())
        .await
        .map_err(|_| ApiError::Internal)?
        .map_err(unavailable)?;
    let now = now(&state);
    let mut live: Vec<ActionRequest> = all
        .into_iter()
        .filter(|r| r.kind == MIGRATE && r.is_live(now))
        .collect();
    live.sort_by(|a, b| (&a.target, &a.node, &a.policy).cmp(&(&b.target, &b.node, &b.policy)));
    Ok(Json(json!({ "requests": live })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReportBody {
    node: String,
    #[serde(default)]
    ttl_seconds: Option<u64>,
}

/// `POST /v1/actions/migrate` `{"node", "ttl_seconds"?}`: a reporter (authorized:
/// `manage` on `Api::"actions"`, operation `report`, for its node) says its node's facts
/// are current; the server decides `comply` for the node from the facts it holds and
/// publishes a request for each `migrate` obligation, withdrawing the node's requests
/// the decision no longer carries. The reporter reports again within the TTL or the
/// requests lapse.
pub(crate) async fn report_migrate(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let caller = caller(&ext);
    let bytes = body.map_err(|r| body_error(&state, &r))?;
    let parsed: ReportBody = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::BadRequest(format!("expected {{\"node\", \"ttl_seconds\"?}}: {e}"))
    })?;
    let ttl = parsed.ttl_seconds.unwrap_or(DEFAULT_TTL_SECONDS);
    if ttl == 0 || ttl > MAX_TTL_SECONDS {
        return Err(ApiError::BadRequest(format!(
            "ttl_seconds: {ttl} is not within 1..={MAX_TTL_SECONDS}"
        )));
    }
    authorize(&state, &caller, "actions", "report", Some(&parsed.node)).await?;
    let Some(store) = state.engine().state().cloned() else {
        return Err(ApiError::Unavailable(
            "no state store: action requests are kept in [integrity] state_dir or [state] etcd"
                .into(),
        ));
    };
    let bad = |e: probity::RequestError| ApiError::BadRequest(format!("node: {e}"));
    let node_uid = EntityUid::new("Node", &parsed.node).map_err(bad)?;
    let comply = EntityUid::action("comply").map_err(bad)?;
    let decision = state
        .decide_async(&caller, Request::new(node_uid.clone(), comply, node_uid))
        .await?;
    let at = now(&state);
    let wanted: Vec<ActionRequest> = decision
        .obligations
        .iter()
        .filter_map(|o| {
            let reason = decision
                .reasons
                .iter()
                .find(|r| r.policy == o.policy)
                .map_or_else(|| o.policy.clone(), |r| r.message.clone());
            ActionRequest::of_obligation(o, &parsed.node, &reason, at, ttl)
        })
        // A warn or audit policy's `migrate`: asked as a dry run, so the controller
        // reports what it would move and moves nothing.
        .chain(
            decision
                .warnings
                .iter()
                .chain(&decision.audit)
                .flat_map(|n| {
                    n.obligations.iter().filter_map(|o| {
                        let mut r =
                            ActionRequest::of_obligation(o, &parsed.node, &n.message, at, ttl)?;
                        r.dry_run = true;
                        Some(r)
                    })
                }),
        )
        .collect();
    let node = parsed.node.clone();
    let (published, withdrawn) = tokio::task::spawn_blocking(move || {
        let mut withdrawn = Vec::new();
        for old in store.action_requests()? {
            let key = old.key();
            if old.kind == MIGRATE && old.node == node && !wanted.iter().any(|w| w.key() == key) {
                store.withdraw_action(&key)?;
                withdrawn.push(key);
            }
        }
        let mut published = Vec::new();
        for request in &wanted {
            store.publish_action(request)?;
            published.push(request.clone());
        }
        Ok::<_, probity::state::StateError>((published, withdrawn))
    })
    .await
    .map_err(|_| ApiError::Internal)?
    .map_err(unavailable)?;
    tracing::info!(caller = %caller.0, node = %parsed.node, published = published.len(), withdrawn = withdrawn.len(), "migrate requests reported");
    Ok(Json(json!({
        "node": parsed.node,
        "published": published,
        "withdrawn": withdrawn,
    })))
}

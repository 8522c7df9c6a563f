//! `PUT /v1/facts/cluster`: the controller's view of the Kubernetes Nodes, as the
//! attributes the schema marks `@owned("cluster")` (README, "Where each fact comes
//! from"), sent as a full replace ([`probity::Engine::replace_cluster_facts`]).
//!
//! Why the checks here: what the controller sends comes from Node labels, which anyone
//! who may label a node writes. The engine checks each value against the schema's
//! type; this module first bounds what a schema type cannot: how many entities, how
//! long an id or a string is and which characters it has (those of a Kubernetes name
//! or label value), and numbers that are negative or past any real count. Every
//! refusal names the entity and the field.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::Extensions;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::AppState;
use crate::api::{authorize, body_error, caller};
use crate::error::ApiError;

/// Largest body of `PUT /v1/facts/cluster`: the limit's number of entities at about 300
/// bytes each, past the server's general body bound.
pub(crate) const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// Most entities one replace carries (a cluster's nodes).
pub(crate) const MAX_CLUSTER_ENTITIES: usize = 20_000;
/// Longest id or string value: a Kubernetes name (DNS subdomain) is at most 253.
pub(crate) const MAX_CLUSTER_TEXT: usize = 253;
/// Largest number the cluster may give: every one is a count (GPUs, millicores).
pub(crate) const MAX_CLUSTER_NUMBER: i64 = 1 << 40;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterBody {
    entities: Vec<Value>,
}

/// `PUT /v1/facts/cluster` (authorized: `manage` on `Api::"cluster"`, operation
/// `replace`).
pub(crate) async fn replace(
    State(state): State<AppState>,
    ext: Extensions,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let caller = caller(&ext);
    authorize(&state, &caller, "cluster", "replace", None).await?;
    let bytes = body.map_err(|r| body_error(&state, &r))?;
    let parsed: ClusterBody = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::BadRequest(format!(
            "expected {{\"entities\": [{{\"uid\", \"attrs\"}}, ...]}}: {e}"
        ))
    })?;
    check_entities(&parsed.entities).map_err(ApiError::Unprocessable)?;
    let engine = state.engine().clone();
    let entities = Value::Array(parsed.entities);
    let n = tokio::task::spawn_blocking(move || {
        let n = engine
            .replace_cluster_facts(&entities)
            .map_err(|e| ApiError::Unprocessable(e.to_string()))?;
        // In force here; then shared, so every replica following the store (the
        // controller reaches only one) holds the same set.
        if let Some(shared) = engine.state().filter(|s| s.is_shared())
            && let Err(e) = shared.publish_cluster_facts(entities.as_array().map_or(&[], Vec::as_slice))
        {
            tracing::warn!(error = %e, "the cluster's facts could not be shared");
            return Err(ApiError::Unavailable(format!(
                "the cluster's facts are in force in this server but could not be shared with the others: {}",
                probity_base::error::chain(&e)
            )));
        }
        Ok(n)
    })
    .await
    .map_err(|_| ApiError::Internal)??;
    tracing::info!(caller = %caller.0, count = n, "cluster facts replaced");
    Ok(Json(json!({ "replaced": n })))
}

/// The bounds a schema type cannot state; the error names the entity and the field.
pub(crate) fn check_entities(entities: &[Value]) -> Result<(), String> {
    if entities.len() > MAX_CLUSTER_ENTITIES {
        return Err(format!(
            "entities: {} entities, over the limit of {MAX_CLUSTER_ENTITIES}",
            entities.len()
        ));
    }
    for (i, entity) in entities.iter().enumerate() {
        let id = entity
            .pointer("/uid/id")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("entities[{i}]: no uid {{\"type\", \"id\"}}"))?;
        let name = || format!("entities[{i}] ({id:?})");
        if let Err(why) = check_text(id) {
            return Err(format!("{}: uid.id: {why}", name()));
        }
        let attrs = entity.get("attrs").and_then(Value::as_object);
        for (attr, value) in attrs.into_iter().flatten() {
            check_value(value).map_err(|why| format!("{}: attrs.{attr}: {why}", name()))?;
        }
    }
    Ok(())
}

fn check_value(value: &Value) -> Result<(), String> {
    match value {
        Value::String(s) => check_text(s),
        Value::Number(n) => match n.as_i64() {
            Some(v) if v < 0 => Err(format!(
                "{v} is negative (the cluster's numbers are counts)"
            )),
            Some(v) if v > MAX_CLUSTER_NUMBER => {
                Err(format!("{v} is over the limit of {MAX_CLUSTER_NUMBER}"))
            }
            Some(_) => Ok(()),
            None => Err(format!("{n} is not a whole number")),
        },
        Value::Bool(_) => Ok(()),
        // An entity reference: its id is label text too.
        Value::Object(o) => match o.get("__entity").and_then(|e| e.get("id")) {
            Some(Value::String(id)) if o.len() == 1 => check_text(id),
            _ => Err("expected a string, a number, a boolean or an entity reference".into()),
        },
        Value::Array(_) | Value::Null => {
            Err("expected a string, a number, a boolean or an entity reference".into())
        }
    }
}

/// A Kubernetes name or label value: 1 to 253 characters of letters, digits, `-`, `_`
/// and `.`.
fn check_text(text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err("empty".into());
    }
    if text.len() > MAX_CLUSTER_TEXT {
        return Err(format!(
            "{} bytes, over the limit of {MAX_CLUSTER_TEXT}",
            text.len()
        ));
    }
    if let Some(bad) = text
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!(
            "{bad:?} is not allowed (letters, digits, '-', '_', '.')"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn node(attrs: Value) -> Value {
        json!({"uid": {"type": "Node", "id": "gpu-1"}, "attrs": attrs})
    }

    #[test]
    fn a_negative_or_huge_count_is_refused_naming_the_node_and_field() {
        let err = check_entities(&[node(json!({"gpusAllocatable": -1}))]).unwrap_err();
        assert_eq!(
            err,
            "entities[0] (\"gpu-1\"): attrs.gpusAllocatable: -1 is negative (the cluster's numbers are counts)"
        );
        let err = check_entities(&[node(json!({"gpusAllocatable": 1u64 << 50}))]).unwrap_err();
        assert!(
            err.contains("attrs.gpusAllocatable: 1125899906842624 is over the limit"),
            "{err}"
        );
        let err = check_entities(&[node(json!({"gpusAllocatable": 1.5}))]).unwrap_err();
        assert!(err.contains("1.5 is not a whole number"), "{err}");
    }

    #[test]
    fn label_text_with_other_characters_or_too_long_is_refused() {
        let err = check_entities(&[node(json!({"gpuProduct": "A100; rm -rf"}))]).unwrap_err();
        assert!(
            err.contains("attrs.gpuProduct: ';' is not allowed"),
            "{err}"
        );
        let long = "a".repeat(254);
        let err = check_entities(&[node(
            json!({"zone": {"__entity": {"type": "Zone", "id": long}}}),
        )])
        .unwrap_err();
        assert!(err.contains("attrs.zone: 254 bytes"), "{err}");
        let err = check_entities(&[json!({"uid": {"type": "Node", "id": "a b"}, "attrs": {}})])
            .unwrap_err();
        assert!(err.contains("uid.id: ' ' is not allowed"), "{err}");
        check_entities(&[node(json!({
            "zone": {"__entity": {"type": "Zone", "id": "eu-west-1a"}},
            "gpuProduct": "NVIDIA-H100-80GB-HBM3", "gpuNode": true, "gpusAllocatable": 8,
        }))])
        .unwrap();
    }

    #[test]
    fn too_many_entities_are_refused() {
        let many = vec![node(json!({})); MAX_CLUSTER_ENTITIES + 1];
        let err = check_entities(&many).unwrap_err();
        assert!(err.contains("over the limit of 20000"), "{err}");
    }
}

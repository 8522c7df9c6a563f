//! The mutating patch: placement constraints merged into the pod's required node affinity.

use serde_json::{Value, json};

use super::workload::Workload;
use crate::AppState;

/// The JSONPatch that adds Probity's placement constraints (from the policies'
/// `schedule` decisions, see [`crate::placement`]) to the pod spec at `base`.
pub(super) fn placement_patch(
    state: &AppState,
    spec: &Value,
    base: &str,
    workload: &Workload,
) -> Result<(Vec<Value>, Vec<String>), String> {
    let (exprs, warnings) = crate::placement::affinity_expressions(state, workload)?;
    if exprs.is_empty() {
        return Ok((Vec::new(), warnings));
    }
    let existing = spec.get("affinity").filter(|a| a.is_object());
    let mut affinity = existing.cloned().unwrap_or_else(|| json!({}));
    let merged = merge_required(affinity.get("nodeAffinity"), &exprs);
    if let Some(obj) = affinity.as_object_mut() {
        obj.insert("nodeAffinity".into(), merged);
    }
    let op = if existing.is_some() { "replace" } else { "add" };
    Ok((
        vec![json!({"op": op, "path": format!("{base}/affinity"), "value": affinity})],
        warnings,
    ))
}

/// Node affinity whose required terms all also carry `exprs` (terms are ORed, the
/// expressions within one are ANDed, so each term needs them).
fn merge_required(node_affinity: Option<&Value>, exprs: &[Value]) -> Value {
    let mut na = node_affinity
        .filter(|v| v.is_object())
        .cloned()
        .unwrap_or_else(|| json!({}));
    let terms: Vec<Value> = na
        .pointer("/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms")
        .and_then(Value::as_array)
        .filter(|t| !t.is_empty())
        .cloned()
        .unwrap_or_else(|| vec![json!({})]);
    let terms: Vec<Value> = terms
        .into_iter()
        .map(|mut t| {
            let mut list = t
                .get("matchExpressions")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            list.extend(exprs.iter().cloned());
            if let Some(o) = t.as_object_mut() {
                o.insert("matchExpressions".into(), Value::Array(list));
            }
            t
        })
        .collect();
    if let Some(o) = na.as_object_mut() {
        o.insert(
            "requiredDuringSchedulingIgnoredDuringExecution".into(),
            json!({"nodeSelectorTerms": terms}),
        );
    }
    na
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn existing_terms_each_get_the_expressions() {
        let na = json!({"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}
        ]}, "preferredDuringSchedulingIgnoredDuringExecution": []});
        let e = json!({"key": "k", "operator": "NotIn", "values": ["x"]});
        let merged = merge_required(Some(&na), std::slice::from_ref(&e));
        let terms = merged
            .pointer("/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms")
            .unwrap();
        assert_eq!(terms[0]["matchExpressions"].as_array().unwrap().len(), 2);
        assert_eq!(terms[1]["matchExpressions"], json!([e]));
        assert!(
            merged
                .get("preferredDuringSchedulingIgnoredDuringExecution")
                .is_some()
        );
    }
}

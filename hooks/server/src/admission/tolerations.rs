//! A pod's tolerations as the `Workload.tolerations` attribute: one record per
//! toleration in the shape the schema documents, so that a Cedar policy can ask with
//! `containsAny` whether the pod tolerates a taint (Cedar has no per-element test and
//! no string concatenation). Which taint matters, and what tolerating it allows, is the
//! policies' business (`security.blocked-node`); this module only translates, keeping
//! Kubernetes' matching exact:
//!
//! - the key, or `"*"` for an empty key (operator `Exists` with no key tolerates every
//!   taint);
//! - the value for operator `Equal` (or none, which means `Equal`), or `"*"` for
//!   `Exists` (any value);
//! - the effect, or `"*"` when empty (every effect).
//!
//! Label keys and values cannot hold `*`, so the wildcard never stands for a real key
//! or value. `tolerationSeconds` is left out: it bounds how long a pod stays on a
//! `NoExecute` node, not whether it may be placed there. A toleration Kubernetes'
//! own validation would refuse is refused here too, naming it: the pod spec is
//! untrusted input.

use std::collections::BTreeSet;

use serde_json::{Value, json};

/// Most tolerations one pod may carry here: a node agent's DaemonSet has a handful;
/// far more is a mistake or an attack on the decision's size.
pub(super) const MAX_TOLERATIONS: usize = 128;
/// A label key: an optional DNS subdomain prefix (253) and `/`, then a name (63).
const MAX_KEY_LEN: usize = 253 + 1 + 63;
/// A label value.
const MAX_VALUE_LEN: usize = 63;
/// What stands for "any" in a record.
const ANY: &str = "*";

/// Why a pod's tolerations could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(super) enum TolerationError {
    /// `tolerations` is not a list.
    #[error("tolerations is not a list")]
    NotAList,
    /// More tolerations than [`MAX_TOLERATIONS`].
    #[error("tolerations holds {count} entries, more than the {MAX_TOLERATIONS} Probity reads")]
    TooMany {
        /// How many the pod has.
        count: usize,
    },
    /// One toleration is malformed.
    #[error("tolerations[{index}]: {problem}")]
    Invalid {
        /// Its position in the list.
        index: usize,
        /// What is wrong with it.
        problem: String,
    },
}

/// The records of `spec.tolerations` (absent or null: none), each distinct, in a
/// stable order (so that pods of one shape share a content id).
pub(super) fn tolerations(spec: &Value) -> Result<Vec<Value>, TolerationError> {
    let list = match spec.get("tolerations") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(TolerationError::NotAList),
    };
    if list.len() > MAX_TOLERATIONS {
        return Err(TolerationError::TooMany { count: list.len() });
    }
    let mut records = BTreeSet::new();
    for (index, t) in list.iter().enumerate() {
        let record =
            toleration(t).map_err(|problem| TolerationError::Invalid { index, problem })?;
        records.insert(record);
    }
    Ok(records
        .into_iter()
        .map(|(key, value, effect)| json!({"key": key, "value": value, "effect": effect}))
        .collect())
}

/// One toleration as (key, value, effect), wildcards in place.
fn toleration(t: &Value) -> Result<(String, String, String), String> {
    if !t.is_object() {
        return Err("not an object".into());
    }
    let field = |name: &str| -> Result<&str, String> {
        match t.get(name) {
            None | Some(Value::Null) => Ok(""),
            Some(Value::String(s)) => Ok(s.as_str()),
            Some(other) => Err(format!("{name} is {other}, not a string")),
        }
    };
    let key = field("key")?;
    let operator = field("operator")?;
    let value = field("value")?;
    let effect = field("effect")?;
    if key.len() > MAX_KEY_LEN || !key.chars().all(is_key_char) {
        return Err(format!("key {:?} is not a label key", shown(key)));
    }
    let exists = match operator {
        "Exists" => true,
        "" | "Equal" => false,
        other => {
            return Err(format!(
                "operator {:?} is not Exists or Equal",
                shown(other)
            ));
        }
    };
    if key.is_empty() && !exists {
        return Err("an empty key needs operator Exists".into());
    }
    let value = if exists {
        if !value.is_empty() {
            return Err(format!(
                "operator Exists takes no value, found {:?}",
                shown(value)
            ));
        }
        ANY.to_owned()
    } else {
        if value.len() > MAX_VALUE_LEN || !value.chars().all(is_value_char) {
            return Err(format!("value {:?} is not a label value", shown(value)));
        }
        value.to_owned()
    };
    let effect = match effect {
        "" => ANY,
        "NoSchedule" | "PreferNoSchedule" | "NoExecute" => effect,
        other => {
            return Err(format!(
                "effect {:?} is not NoSchedule, PreferNoSchedule or NoExecute",
                shown(other)
            ));
        }
    };
    let key = if key.is_empty() { ANY } else { key };
    Ok((key.to_owned(), value, effect.to_owned()))
}

/// At most the first 80 characters of untrusted text, for a message.
fn shown(s: &str) -> String {
    const SHOWN: usize = 80;
    match s.char_indices().nth(SHOWN) {
        Some((end, _)) => format!("{}...", s.get(..end).unwrap_or_default()),
        None => s.to_owned(),
    }
}

fn is_key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/')
}

fn is_value_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(spec: Value) -> Vec<(String, String, String)> {
        tolerations(&spec)
            .unwrap()
            .iter()
            .map(|r| {
                let s = |f: &str| r[f].as_str().unwrap().to_owned();
                (s("key"), s("value"), s("effect"))
            })
            .collect()
    }

    fn r(k: &str, v: &str, e: &str) -> (String, String, String) {
        (k.into(), v.into(), e.into())
    }

    #[test]
    fn tolerations_translate_with_kubernetes_wildcards() {
        let got = records(json!({"tolerations": [
            {"operator": "Exists"},
            {"key": "probity.io/blocked", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "probity.io/blocked", "operator": "Equal", "value": "", "effect": "NoExecute",
             "tolerationSeconds": 30},
            {"key": "dedicated", "value": "gpu"},
            {"operator": "Exists", "effect": "NoExecute"},
            {"key": "dedicated", "value": "gpu"},
        ]}));
        assert_eq!(
            got,
            vec![
                r("*", "*", "*"),
                r("*", "*", "NoExecute"),
                r("dedicated", "gpu", "*"),
                r("probity.io/blocked", "", "NoExecute"),
                r("probity.io/blocked", "*", "NoSchedule"),
            ]
        );
    }

    #[test]
    fn no_tolerations_is_an_empty_set() {
        assert!(records(json!({})).is_empty());
        assert!(records(json!({"tolerations": null})).is_empty());
        assert!(records(json!({"tolerations": []})).is_empty());
    }

    #[test]
    fn malformed_tolerations_are_refused_naming_which() {
        let err = |t: Value| {
            tolerations(&json!({"tolerations": t}))
                .unwrap_err()
                .to_string()
        };
        assert_eq!(err(json!("all")), "tolerations is not a list");
        assert_eq!(
            err(json!([{"operator": "Exists"}, {"key": "a", "operator": "Sometimes"}])),
            "tolerations[1]: operator \"Sometimes\" is not Exists or Equal"
        );
        assert_eq!(
            err(json!([{"value": "x"}])),
            "tolerations[0]: an empty key needs operator Exists"
        );
        assert_eq!(
            err(json!([{"key": "a", "operator": "Exists", "value": "x"}])),
            "tolerations[0]: operator Exists takes no value, found \"x\""
        );
        // A wildcard or a separator smuggled into a key or value.
        assert_eq!(
            err(json!([{"key": "*", "operator": "Exists"}])),
            "tolerations[0]: key \"*\" is not a label key"
        );
        assert_eq!(
            err(json!([{"key": "a", "value": "*"}])),
            "tolerations[0]: value \"*\" is not a label value"
        );
        assert_eq!(
            err(json!([{"key": "a", "effect": "NoWay"}])),
            "tolerations[0]: effect \"NoWay\" is not NoSchedule, PreferNoSchedule or NoExecute"
        );
        assert_eq!(
            err(json!([{"key": 7}])),
            "tolerations[0]: key is 7, not a string"
        );
        assert_eq!(err(json!([[]])), "tolerations[0]: not an object");
        // Untrusted text is cut short in the message.
        assert_eq!(
            err(json!([{"key": "k".repeat(100_000) + "!"}])),
            format!(
                "tolerations[0]: key {:?} is not a label key",
                "k".repeat(80) + "..."
            )
        );
        assert_eq!(
            err(json!([{"key": "a", "value": "v".repeat(64)}])),
            format!(
                "tolerations[0]: value {:?} is not a label value",
                "v".repeat(64)
            )
        );
        let many: Vec<Value> = (0..=MAX_TOLERATIONS)
            .map(|i| json!({"key": format!("k{i}"), "operator": "Exists"}))
            .collect();
        assert_eq!(
            err(Value::Array(many)),
            "tolerations holds 129 entries, more than the 128 Probity reads"
        );
    }
}

//! The JSON a caller sends besides single requests: batches and lists of entity uids.
//!
//! Why this module exists: these are parsers of bytes from another program, with size
//! limits and errors that say where. They depend only on the engine crate, so the fuzz
//! targets (`fuzz/fuzz_targets/`) compile this file as it is.

use engine::{EntityUid, Request};
use serde_json::Value;

/// Most requests in one batch (as the server's `/v1/decide/batch`).
pub(crate) const MAX_BATCH: usize = 10_000;
/// Largest batch, in bytes.
pub(crate) const MAX_BATCH_BYTES: usize = 64 * 1024 * 1024;
/// Largest list of uids to remove, in bytes.
pub(crate) const MAX_UIDS_BYTES: usize = 64 * 1024 * 1024;

/// Why a batch or uid list was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum JsonError {
    /// The input is not UTF-8.
    NotUtf8 {
        /// Byte offset of the first invalid byte.
        offset: usize,
    },
    /// Anything else, with where.
    Invalid(String),
}

impl std::fmt::Display for JsonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JsonError::NotUtf8 { offset } => write!(f, "not UTF-8 (at byte {offset})"),
            JsonError::Invalid(m) => f.write_str(m),
        }
    }
}

fn parse(bytes: &[u8], what: &str, limit: usize) -> Result<Value, JsonError> {
    if bytes.len() > limit {
        return Err(JsonError::Invalid(format!(
            "{what}: {} bytes, over the limit of {limit}",
            bytes.len()
        )));
    }
    std::str::from_utf8(bytes).map_err(|e| JsonError::NotUtf8 {
        offset: e.valid_up_to(),
    })?;
    serde_json::from_slice(bytes).map_err(|e| {
        JsonError::Invalid(format!(
            "{what} is not valid JSON at line {}, column {}: {e}",
            e.line(),
            e.column()
        ))
    })
}

/// A batch: `{"requests": [..]}` or a bare array of requests.
pub fn batch(bytes: &[u8]) -> Result<Vec<Request>, JsonError> {
    let value = parse(bytes, "batch", MAX_BATCH_BYTES)?;
    let shape = || {
        JsonError::Invalid("batch: expected {\"requests\": [...]} or an array of requests".into())
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
        return Err(JsonError::Invalid(format!(
            "batch: {} requests, over the limit of {MAX_BATCH}",
            items.len()
        )));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            Request::from_json_owned(v)
                .map_err(|e| JsonError::Invalid(format!("requests[{i}]: {}", chain(&e))))
        })
        .collect()
}

/// Uids to remove: an array of `"Type::\"id\""` strings or `{"type": .., "id": ..}`
/// objects (optionally under `__entity`).
pub fn uids(bytes: &[u8]) -> Result<Vec<EntityUid>, JsonError> {
    let value = parse(bytes, "uids", MAX_UIDS_BYTES)?;
    let Value::Array(items) = value else {
        return Err(JsonError::Invalid(
            "uids: expected an array of \"Type::\\\"id\\\"\" strings or {\"type\", \"id\"} objects"
                .into(),
        ));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            uid(v).ok_or_else(|| {
                JsonError::Invalid(format!("uids[{i}]: not an entity uid: {}", short(v)))
            })
        })
        .collect()
}

fn uid(v: &Value) -> Option<EntityUid> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Object(o) => {
            let o = match o.get("__entity") {
                Some(Value::Object(inner)) => inner,
                _ => o,
            };
            match (o.get("type"), o.get("id")) {
                (Some(Value::String(t)), Some(Value::String(id))) => EntityUid::new(t, id).ok(),
                _ => None,
            }
        }
        _ => None,
    }
}

fn short(v: &Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", text.get(..i).unwrap_or_default()),
        None => text,
    }
}

fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let next = cause.to_string();
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str =
        r#"{"principal": "Workload::\"w\"", "action": "schedule", "resource": "Node::\"n\""}"#;

    #[test]
    fn a_batch_is_an_array_or_an_object_of_requests() {
        assert_eq!(
            batch(format!("[{ONE}, {ONE}]").as_bytes()).unwrap().len(),
            2
        );
        assert_eq!(
            batch(format!(r#"{{"requests": [{ONE}]}}"#).as_bytes())
                .unwrap()
                .len(),
            1
        );
        assert!(batch(b"[]").unwrap().is_empty());
    }

    #[test]
    fn a_bad_batch_names_where() {
        let e = batch(format!("[{ONE}, {{\"principal\": 3}}]").as_bytes()).unwrap_err();
        assert!(e.to_string().starts_with("requests[1]: "), "{e}");
        let e = batch(b"[\n {").unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
        assert_eq!(
            batch(b"[\"\xff\"]").unwrap_err(),
            JsonError::NotUtf8 { offset: 2 }
        );
        assert!(
            batch(b"{\"requests\": 1}")
                .unwrap_err()
                .to_string()
                .contains("expected")
        );
        let many = format!("[{}]", vec![ONE; MAX_BATCH + 1].join(","));
        assert!(
            batch(many.as_bytes())
                .unwrap_err()
                .to_string()
                .contains("over the limit")
        );
    }

    #[test]
    fn uids_come_as_strings_or_objects() {
        let list = uids(br#"["Node::\"a\"", {"type": "Node", "id": "b"}, {"__entity": {"type": "Zone", "id": "z"}}]"#).unwrap();
        let shown: Vec<String> = list.iter().map(ToString::to_string).collect();
        assert_eq!(shown, [r#"Node::"a""#, r#"Node::"b""#, r#"Zone::"z""#]);
        let e = uids(br#"["Node::\"a\"", 7]"#).unwrap_err();
        assert_eq!(e.to_string(), "uids[1]: not an entity uid: 7");
        assert!(uids(b"{}").is_err());
    }

    /// Mutated inputs: no panic, and either a value or an error that says something.
    #[test]
    fn mutated_batches_and_uid_lists_never_panic() {
        let seeds: [&[u8]; 3] = [
            br#"{"requests": [{"principal": "Workload::\"w\"", "action": "schedule", "resource": "Node::\"n\"", "context": {"a": [1, 2.5, null]}}]}"#,
            br#"["Node::\"a\"", {"type": "Node", "id": "b"}, {"__entity": {"type": "Zone", "id": "z"}}]"#,
            br#"[{"principal": {"type": "Node", "id": "x"}, "action": "read", "resource": "Checkpoint::\"c\"", "entities": []}]"#,
        ];
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..3000 {
            let seed = seeds[round % seeds.len()];
            let mut input = seed.to_vec();
            match next() % 4 {
                0 => input.truncate((next() as usize) % (seed.len() + 1)),
                1 => {
                    for _ in 0..1 + next() % 4 {
                        let i = (next() as usize) % input.len();
                        input[i] ^= 1 << (next() % 8);
                    }
                }
                2 => {
                    let i = (next() as usize) % input.len();
                    let j = i + (next() as usize) % (input.len() - i);
                    let dup = input[i..j].to_vec();
                    input.splice(j..j, dup);
                }
                _ => {
                    let i = (next() as usize) % input.len();
                    input.insert(i, (next() % 256) as u8);
                }
            }
            for result in [batch(&input).map(|_| ()), uids(&input).map(|_| ())] {
                if let Err(e) = result {
                    assert!(!e.to_string().is_empty());
                }
            }
        }
    }
}

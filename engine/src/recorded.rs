//! What a decision record keeps of its request beyond principal, action and resource
//! (`RecordedRequest`): the context and request entities as sent, secret-named values
//! redacted, bounded in size; built on the path of every recorded decision, so without
//! writing the JSON out or allocating per attribute.

use serde_json::Value;

use crate::request::Request;
use crate::state::RecordedRequest;

/// What a record keeps of `r` beyond principal, action and resource.
pub(crate) fn recorded_request(r: &Request) -> RecordedRequest {
    let mut out = RecordedRequest {
        context: r.context.as_deref().cloned(),
        entities: r.entities.to_vec(),
        reporter: r.reporter,
        redacted: Vec::new(),
        omitted: None,
    };
    if let Some(c) = out.context.as_mut() {
        for (k, v) in c.iter_mut() {
            let mut at = vec!["context".to_owned(), k.clone()];
            redact(v, &mut at, secret_name(k), &mut out.redacted);
        }
    }
    for (i, e) in out.entities.iter_mut().enumerate() {
        if let Some(attrs) = e.get_mut("attrs").and_then(Value::as_object_mut) {
            for (k, v) in attrs.iter_mut() {
                let mut at = vec![format!("entities[{i}]"), "attrs".to_owned(), k.clone()];
                redact(v, &mut at, secret_name(k), &mut out.redacted);
            }
        }
    }
    out.redacted.sort();
    let size = out
        .context
        .iter()
        .flat_map(|c| c.iter())
        .map(|(k, v)| k.len() + json_size(v, 0))
        .chain(out.entities.iter().map(|e| json_size(e, 0)))
        .fold(0usize, usize::saturating_add);
    if size > RecordedRequest::MAX_BYTES {
        out.context = None;
        out.entities = Vec::new();
        out.redacted = Vec::new();
        out.omitted = Some(format!(
            "context and entities of {size} bytes, over the {} a record keeps",
            RecordedRequest::MAX_BYTES
        ));
    }
    out
}

/// About how many bytes `v` takes as JSON, counted without writing it (on the hot
/// path of every recorded decision): strings and keys exactly, with their quotes and
/// separators, escapes not counted; numbers at most 24.
fn json_size(v: &Value, depth: usize) -> usize {
    if depth > 64 {
        return 0;
    }
    match v {
        Value::Null | Value::Bool(_) => 5,
        Value::Number(_) => 24,
        Value::String(s) => s.len() + 2,
        Value::Array(a) => a
            .iter()
            .map(|x| json_size(x, depth + 1) + 1)
            .fold(2, usize::saturating_add),
        Value::Object(o) => o
            .iter()
            .map(|(k, x)| k.len() + 4 + json_size(x, depth + 1))
            .fold(2, usize::saturating_add),
    }
}

/// Whether an attribute's name says its value is a secret (`apiToken`, `client_secret`,
/// `Password`): its letters and digits, lowercased, hold one of the words. Looked at
/// in a buffer on the stack: this runs for every attribute of every recorded request.
fn secret_name(name: &str) -> bool {
    const SECRET: [&[u8]; 7] = [
        b"password",
        b"passwd",
        b"secret",
        b"token",
        b"credential",
        b"privatekey",
        b"apikey",
    ];
    let mut folded = [0u8; 64];
    let mut len = 0;
    for b in name.bytes().filter(u8::is_ascii_alphanumeric) {
        let Some(slot) = folded.get_mut(len) else {
            break;
        };
        *slot = b.to_ascii_lowercase();
        len += 1;
    }
    let folded = folded.get(..len).unwrap_or_default();
    SECRET
        .iter()
        .any(|word| folded.windows(word.len()).any(|w| w == *word))
}

/// Replaces the value at the path `at` names (and, in records and sets, what
/// secret-named keys hold) with `"<redacted>"`, listing each path replaced. The path is
/// written out only for a value replaced: most requests hold none.
fn redact(v: &mut Value, at: &mut Vec<String>, secret: bool, out: &mut Vec<String>) {
    if secret {
        *v = Value::String("<redacted>".into());
        out.push(at.join("."));
        return;
    }
    if at.len() > 16 {
        return;
    }
    match v {
        Value::Object(o) => {
            for (k, x) in o.iter_mut() {
                at.push(k.clone());
                redact(x, at, secret_name(k), out);
                at.pop();
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter_mut().enumerate() {
                let Some(before) = at.last().map(String::len) else {
                    continue;
                };
                if let Some(last) = at.last_mut() {
                    last.push_str(&format!("[{i}]"));
                }
                redact(x, at, false, out);
                if let Some(last) = at.last_mut() {
                    last.truncate(before);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_request_keeps_its_facts_redacts_secrets_and_is_bounded() {
        let r = Request::from_json_value(&serde_json::json!({
            "principal": "User::\"a\"", "action": "elevate", "resource": "Node::\"n\"",
            "context": {"port": 22, "session": {"apiToken": "t0k", "user": "a"}, "Password": "p"},
            "entities": [{"uid": {"type": "User", "id": "b"}, "parents": [],
                          "attrs": {"client_secret": "s", "name": "b"}}]
        }))
        .unwrap();
        let kept = recorded_request(&r);
        let context = kept.context.as_ref().unwrap();
        assert_eq!(context["port"], 22);
        assert_eq!(context["session"]["user"], "a");
        assert_eq!(context["session"]["apiToken"], "<redacted>");
        assert_eq!(context["Password"], "<redacted>");
        assert_eq!(kept.entities[0]["attrs"]["client_secret"], "<redacted>");
        assert_eq!(kept.entities[0]["attrs"]["name"], "b");
        assert_eq!(
            kept.redacted,
            [
                "context.Password",
                "context.session.apiToken",
                "entities[0].attrs.client_secret"
            ]
        );
        assert!(kept.replayable());

        let big = "x".repeat(RecordedRequest::MAX_BYTES);
        let r = Request::from_json_value(&serde_json::json!({
            "principal": "User::\"a\"", "action": "elevate", "resource": "Node::\"n\"",
            "context": {"note": big}
        }))
        .unwrap();
        let kept = recorded_request(&r);
        assert!(!kept.replayable());
        assert!(kept.context.is_none());
        assert!(
            kept.omitted
                .as_deref()
                .unwrap()
                .contains("over the 65536 a record keeps")
        );
    }
}

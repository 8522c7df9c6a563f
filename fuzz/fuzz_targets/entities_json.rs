//! Any bytes a writer sends as an entity update (`POST /v1/entities`, a line of
//! `POST /v1/entities/stream`, a node agent's published facts) are upserted into the
//! engine on the default policies without a panic, all or nothing: a refused update
//! leaves the store as it was, and the store still decides afterwards.
#![no_main]
use std::sync::OnceLock;

static ENGINE: OnceLock<probity::Engine> = OnceLock::new();

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let engine = ENGINE.get_or_init(|| {
        probity::Engine::from_embedded_defaults().unwrap_or_else(|e| panic!("{e}"))
    });
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let before = engine.entity_count();
    match engine.upsert_entities(&json) {
        Ok(_) => {}
        Err(_) => assert_eq!(engine.entity_count(), before, "a refused update changed the store"),
    }
    if let Some(items) = json.as_array() {
        for item in items {
            if let Some(uid) = item.get("uid")
                && let (Some(t), Some(id)) = (
                    uid.get("type").and_then(|v| v.as_str()),
                    uid.get("id").and_then(|v| v.as_str()),
                )
                && let Ok(uid) = probity::EntityUid::new(t, id)
            {
                let _ = engine.entity(&uid);
            }
        }
    }
    let request = probity::Request::from_json_slice(
        br#"{"principal": "Workload::\"w\"", "action": "schedule", "resource": "Node::\"n\""}"#,
    );
    if let Ok(request) = request {
        let _ = engine.decide(&request);
    }
});

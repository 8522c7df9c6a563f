//! Verify before read, end to end: seal under a SoftHSM2 key, corrupt one byte, verify
//! as a node; the read is denied with block_node, the node is blocked durably, and the
//! placement policy then refuses to schedule onto it.

use std::sync::Arc;

use probity::integrity::Anchor;
use probity::integrity::{
    self, HashOptions, Pkcs11Anchor, SoftwareAnchor, Verifier, VerifyOptions,
};
use probity::state::StateStore;
use probity::{Effect, Engine, Request};
use serde_json::json;

use crate::integrity::with_softhsm;

fn schedule_onto(node: &str) -> Request {
    Request::from_json_value(
        &json!({"principal": "Workload::\"train-1\"", "action": "schedule",
        "resource": {"type": "Node", "id": node}}),
    )
    .unwrap()
}

fn corrupt_read_blocks_the_node(anchor: &dyn Anchor, dir: &std::path::Path) {
    let path = dir.join("epoch-7.ckpt");
    let data: Vec<u8> = (0..3 * 4096 + 17).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(&path, &data).unwrap();
    let options = HashOptions {
        chunk_size: 4096,
        ..HashOptions::default()
    };
    let state = Arc::new(StateStore::open(&dir.join("state")).unwrap());
    let signed =
        integrity::SignedManifest::seal(&path, "llm/epoch-7", 7, anchor, state.as_ref(), &options)
            .unwrap();
    let verifier = Verifier::new(anchor.public_key().clone());

    let engine = Engine::from_embedded_defaults().unwrap();
    engine.attach_state(state.clone()).unwrap();
    engine.upsert_entities(&crate::cluster()).unwrap();
    let verify = |node| {
        let opts = VerifyOptions {
            node: Some(node),
            expected_object_id: Some("llm/epoch-7"),
            ..VerifyOptions::default()
        };
        verifier.verify_object(&path, &signed, state.as_ref(), &opts)
    };

    // Intact: the read is allowed and nothing is blocked.
    let report = verify("gpu-h1").unwrap();
    let d = engine.decide_read("gpu-h1", "llm/epoch-7", Ok(&report));
    assert_eq!(d.decision, Effect::Allow, "{d:?}");
    assert!(engine.blocked_nodes().is_empty());

    // One flipped byte in chunk 2.
    let mut bad = data.clone();
    bad[2 * 4096 + 5] ^= 0x40;
    std::fs::write(&path, &bad).unwrap();
    let err = verify("gpu-a1").unwrap_err();
    assert!(err.to_string().contains("chunk 2"), "{err}");
    assert!(engine.decide(&schedule_onto("gpu-a1")).is_allowed());
    let d = engine.decide_read("gpu-a1", "llm/epoch-7", Err(&err));
    assert_eq!(d.decision, Effect::Deny);
    assert_eq!(
        d.reason_ids().collect::<Vec<_>>(),
        ["integrity.unverified-read"]
    );
    assert_eq!(d.obligations[0].kind, "block_node");
    assert_eq!(d.obligations[0].target.as_deref(), Some("Node::\"gpu-a1\""));
    assert!(d.errors.is_empty(), "{:?}", d.errors);

    // The placement policy now refuses the node; other nodes still take work.
    let s = engine.decide(&schedule_onto("gpu-a1"));
    assert_eq!(
        s.reason_ids().collect::<Vec<_>>(),
        ["security.blocked-node"]
    );
    assert!(engine.decide(&schedule_onto("gpu-spike")).is_allowed());

    // Durable: the block and the denied read are in the state store, and a new engine on
    // the same state refuses the node too.
    let blocked = state.blocked("gpu-a1").unwrap().unwrap();
    assert!(
        blocked.record.reason.contains("integrity.unverified-read"),
        "{}",
        blocked.record.reason
    );
    let events = state.events(0).unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.kind == "read-denied" && e.node.as_deref() == Some("gpu-a1"))
    );
    drop(engine);
    let restarted = Engine::from_embedded_defaults().unwrap();
    restarted.attach_state(state.clone()).unwrap();
    restarted.upsert_entities(&crate::cluster()).unwrap();
    assert!(!restarted.decide(&schedule_onto("gpu-a1")).is_allowed());
    // A blocked node may not read even a verified checkpoint.
    std::fs::write(&path, &data).unwrap();
    let report = verify("gpu-a1").unwrap();
    let d = restarted.decide_read("gpu-a1", "llm/epoch-7", Ok(&report));
    assert_eq!(
        d.reason_ids().collect::<Vec<_>>(),
        ["security.blocked-node"]
    );

    // Unblocking is explicit.
    restarted.unblock_node("gpu-a1").unwrap();
    assert!(state.blocked("gpu-a1").unwrap().is_none());
    assert!(restarted.decide(&schedule_onto("gpu-a1")).is_allowed());
}

#[test]
fn corrupt_checkpoint_read_blocks_the_node_softhsm() {
    with_softhsm(
        "read_guard::corrupt_checkpoint_read_blocks_the_node_softhsm",
        |hsm, dir| {
            let anchor = Pkcs11Anchor::open_or_generate(&hsm.config("probity-read-guard")).unwrap();
            corrupt_read_blocks_the_node(&anchor, dir);
        },
    );
}

#[test]
fn corrupt_checkpoint_read_blocks_the_node_software_anchor() {
    let tmp = tempfile::tempdir().unwrap();
    let anchor = SoftwareAnchor::load_or_generate(&tmp.path().join("anchor.key")).unwrap();
    corrupt_read_blocks_the_node(&anchor, tmp.path());
}

#[test]
fn attaching_a_second_state_store_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = Engine::from_embedded_defaults().unwrap();
    engine
        .attach_state(Arc::new(StateStore::open(&tmp.path().join("a")).unwrap()))
        .unwrap();
    assert!(
        engine
            .attach_state(Arc::new(StateStore::open(&tmp.path().join("b")).unwrap()))
            .is_err()
    );
}

#[test]
fn a_guarded_reader_that_meets_a_flipped_byte_blocks_the_node_through_the_policies() {
    use std::io::Read;

    let tmp = tempfile::tempdir().unwrap();
    let anchor = SoftwareAnchor::load_or_generate(&tmp.path().join("anchor.key")).unwrap();
    let path = tmp.path().join("epoch-8.ckpt");
    let data: Vec<u8> = (0..3 * 4096 + 17).map(|i| (i * 37 % 251) as u8).collect();
    std::fs::write(&path, &data).unwrap();
    let options = HashOptions {
        chunk_size: 4096,
        ..HashOptions::default()
    };
    let state = Arc::new(StateStore::open(&tmp.path().join("state")).unwrap());
    let signed =
        integrity::SignedManifest::seal(&path, "llm/epoch-8", 1, &anchor, state.as_ref(), &options)
            .unwrap();
    let verifier = Verifier::new(anchor.public_key().clone());
    let engine = Engine::from_embedded_defaults().unwrap();
    engine.attach_state(state.clone()).unwrap();
    engine.upsert_entities(&crate::cluster()).unwrap();

    // gpu-a1 reads the file through a guarded reader.
    let guarded = || {
        let file = std::fs::File::open(&path).unwrap();
        let reader =
            integrity::VerifiedReader::new(file, &signed, &verifier, state.as_ref()).unwrap();
        engine.guard_reader(reader, "gpu-a1")
    };

    // Intact: the whole object reads, and nothing is blocked or recorded.
    let mut out = Vec::new();
    guarded().read_to_end(&mut out).unwrap();
    assert_eq!(out, data);
    assert!(engine.blocked_nodes().is_empty());

    // One flipped byte in chunk 1: the read fails there, and the failure becomes the
    // policies' deny, whose block_node blocks the reading node.
    let mut bad = data.clone();
    bad[4096 + 9] ^= 0x01;
    std::fs::write(&path, &bad).unwrap();
    let err = guarded().read_to_end(&mut Vec::new()).unwrap_err();
    assert!(err.to_string().contains("chunk 1"), "{err}");
    let blocked = engine.blocked_nodes();
    assert!(
        blocked["gpu-a1"]
            .reason
            .contains("integrity.unverified-read"),
        "{blocked:?}"
    );
    assert!(state.blocked("gpu-a1").unwrap().is_some());
    assert_eq!(
        engine
            .decide(&schedule_onto("gpu-a1"))
            .reason_ids()
            .collect::<Vec<_>>(),
        ["security.blocked-node"]
    );
    // The denied read is in the decision log with its obligation.
    let records = state.decisions(0, 10).unwrap();
    assert_eq!(records[0].action, "Action::\"read\"");
    assert_eq!(records[0].resource, "Checkpoint::\"llm/epoch-8\"");
    assert_eq!(records[0].decision.obligations[0].kind, "block_node");
}

/// The issue: a block from a failed read must say which pod read the bad data and what
/// the cluster manager stops, so that the reading workload's pods are stopped first.
#[test]
fn a_guarded_read_by_a_named_pod_records_the_reader_and_the_stop_scope() {
    use std::io::Read;

    let tmp = tempfile::tempdir().unwrap();
    let anchor = SoftwareAnchor::load_or_generate(&tmp.path().join("anchor.key")).unwrap();
    let path = tmp.path().join("epoch-9.ckpt");
    let data: Vec<u8> = (0..2 * 4096 + 3).map(|i| (i * 41 % 251) as u8).collect();
    std::fs::write(&path, &data).unwrap();
    let options = HashOptions {
        chunk_size: 4096,
        ..HashOptions::default()
    };
    let state = Arc::new(StateStore::open(&tmp.path().join("state")).unwrap());
    let signed =
        integrity::SignedManifest::seal(&path, "llm/epoch-9", 1, &anchor, state.as_ref(), &options)
            .unwrap();
    let verifier = Verifier::new(anchor.public_key().clone());
    let engine = Engine::from_embedded_defaults().unwrap();
    engine.attach_state(state.clone()).unwrap();
    engine.upsert_entities(&crate::cluster()).unwrap();
    let pod = probity::ReaderPod::new(
        "train",
        "llm-0",
        Some("3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b".into()),
    )
    .unwrap();
    let mut bad = data.clone();
    bad[9] ^= 0x01;
    std::fs::write(&path, &bad).unwrap();
    let read = |pod: Option<probity::ReaderPod>| {
        let file = std::fs::File::open(&path).unwrap();
        let reader =
            integrity::VerifiedReader::new(file, &signed, &verifier, state.as_ref()).unwrap();
        engine
            .guard_reader_as(reader, "gpu-a1", pod)
            .read_to_end(&mut Vec::new())
    };
    assert!(read(Some(pod.clone())).is_err());
    let record = state.blocked("gpu-a1").unwrap().unwrap().record;
    assert_eq!(record.reader.as_ref(), Some(&pod));
    assert_eq!(record.stop.as_deref(), Some("reader"));
    assert_eq!(record.taint_effect, None);
    assert_eq!(engine.blocked_nodes()["gpu-a1"], record);

    // A second failed read by another pod keeps the first block's reader and scope,
    // and its history notes the second reader.
    let other = probity::ReaderPod::new("train", "llm-1", None).unwrap();
    assert!(read(Some(other.clone())).is_err());
    let again = state.blocked("gpu-a1").unwrap().unwrap().record;
    assert_eq!(again.reader.as_ref(), Some(&pod));
    assert_eq!(again.stop.as_deref(), Some("reader"));
    assert_eq!(
        again.history.last().and_then(|e| e.reader.as_ref()),
        Some(&other)
    );
}

#[test]
fn a_read_without_a_named_pod_records_no_reader_or_stop() {
    let engine = Engine::from_embedded_defaults().unwrap();
    engine.upsert_entities(&crate::cluster()).unwrap();
    let err = std::io::Error::other("chunk 0: hash mismatch");
    let d = engine.decide_read("gpu-a1", "llm/epoch-9", Err(&err));
    assert_eq!(d.decision, Effect::Deny);
    assert_eq!(d.obligations[0].parameters["stop"], "reader");
    let record = &engine.blocked_nodes()["gpu-a1"];
    assert_eq!(
        (record.reader.as_ref(), record.stop.as_deref()),
        (None, None)
    );
    // With a pod, the schema's `readerPod` context fact is filled and validates.
    let pod = probity::ReaderPod::new("train", "llm-0", None).unwrap();
    let d = engine.decide_read_as("gpu-h1", "llm/epoch-9", Err(&err), Some(&pod));
    assert!(d.errors.is_empty(), "{:?}", d.errors);
    assert_eq!(engine.blocked_nodes()["gpu-h1"].reader.as_ref(), Some(&pod));
    // A malformed pod (built around the checks) is left out with an error naming the
    // field; the node is blocked all the same.
    let bad = probity::ReaderPod {
        namespace: "Train".into(),
        name: "x".into(),
        uid: None,
    };
    let d = engine.decide_read_as("gpu-spike", "llm/epoch-9", Err(&err), Some(&bad));
    assert!(!d.is_allowed());
    assert!(
        d.errors[0]
            .message
            .starts_with("the reader pod is left out: reader.namespace: "),
        "{:?}",
        d.errors
    );
    assert_eq!(engine.blocked_nodes()["gpu-spike"].reader, None);
}

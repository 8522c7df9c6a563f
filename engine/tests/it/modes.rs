//! Policy modes: `warn` and `audit` forbids change no decision and carry out nothing,
//! but are told and recorded; required policies always enforce; a lowered mode is
//! recorded.

use std::path::Path;
use std::sync::Arc;

use probity::state::StateStore;
use probity::{Effect, Engine, Mode, ReloadOutcome};

use crate::decision_log::schedule;
use crate::policy_copy;

/// Appends `text` to the copy's probity.toml.
fn append_config(dir: &Path, text: &str) {
    let path = dir.join("probity.toml");
    let mut config = std::fs::read_to_string(&path).unwrap();
    config.push_str(text);
    std::fs::write(&path, config).unwrap();
}

fn engine_at(dir: &Path) -> Engine {
    let engine = Engine::builder(dir).build().unwrap();
    crate::load_cluster(&engine);
    engine
}

fn load_error(dir: &Path) -> String {
    match Engine::builder(dir).build() {
        Ok(_) => panic!("the set loaded"),
        Err(e) => e.detail(),
    }
}

#[test]
fn an_audit_forbid_allows_and_keeps_what_it_would_have_done_apart() {
    let dir = policy_copy();
    let enforcing = engine_at(dir.path());
    let denied = enforcing.decide(&schedule("train-1", "gpu-drift"));
    assert_eq!(denied.decision, Effect::Deny);
    assert_eq!(denied.obligations.len(), 1, "{denied:?}");

    append_config(
        dir.path(),
        "\n[modes]\n\"placement.driver-drift\" = \"audit\"\n",
    );
    let auditing = engine_at(dir.path());
    let d = auditing.decide(&schedule("train-1", "gpu-drift"));
    assert_eq!(d.decision, Effect::Allow, "{d:?}");
    assert!(
        d.obligations.is_empty(),
        "an audit policy's obligation is never carried out: {d:?}"
    );
    assert!(d.warnings.is_empty());
    assert_eq!(d.audit.len(), 1, "{d:?}");
    let notice = &d.audit[0];
    assert_eq!(notice.policy, "placement.driver-drift");
    assert_eq!(
        notice.message,
        "the GPU node does not run the pinned driver and CUDA image"
    );
    assert_eq!(notice.obligations.len(), 1);
    assert_eq!(notice.obligations[0].kind, "alert");
    assert_eq!(
        notice.obligations[0].target.as_deref(),
        Some(r#"Node::"gpu-drift""#)
    );
    // The same request on a node that does not drift has nothing to say.
    let clean = auditing.decide(&schedule("train-1", "gpu-a1"));
    assert!(clean.is_allowed() && clean.audit.is_empty() && clean.warnings.is_empty());
    // An enforcing forbid still denies, and the audit one is still told beside it.
    auditing.block_node("gpu-drift", "test").unwrap();
    let both = auditing.decide(&schedule("train-1", "gpu-drift"));
    assert_eq!(both.decision, Effect::Deny);
    assert_eq!(
        both.reason_ids().collect::<Vec<_>>(),
        ["security.blocked-node"]
    );
    assert_eq!(both.audit.len(), 1);
    // The wire form names the lists; an all-enforcing decision has neither.
    let wire = serde_json::to_value(&d).unwrap();
    assert_eq!(wire["audit"][0]["policy"], "placement.driver-drift");
    assert!(
        serde_json::to_value(&denied)
            .unwrap()
            .get("audit")
            .is_none()
    );
}

#[test]
fn a_warn_mode_declared_on_the_policy_is_told_as_a_warning() {
    let dir = policy_copy();
    let path = dir.path().join("placement/scheduling.cedar");
    let text = std::fs::read_to_string(&path).unwrap().replace(
        "@id(\"placement.driver-drift\")",
        "@id(\"placement.driver-drift\")\n@mode(\"warn\")",
    );
    std::fs::write(&path, text).unwrap();
    let engine = engine_at(dir.path());
    let d = engine.decide(&schedule("train-1", "gpu-drift"));
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(
        d.warnings
            .iter()
            .map(|n| n.policy.as_str())
            .collect::<Vec<_>>(),
        ["placement.driver-drift"]
    );
    let modes = engine.policy_modes();
    let drift = &modes["placement.driver-drift"];
    assert_eq!(drift.mode, Mode::Warn);
    assert!(
        drift.declared_in.ends_with("placement/scheduling.cedar"),
        "{}",
        drift.declared_in
    );
    assert_eq!(modes["security.blocked-node"].mode, Mode::Enforce);
    // probity.toml overrides the policy's own @mode.
    append_config(
        dir.path(),
        "\n[modes]\n\"placement.driver-drift\" = \"enforce\"\n",
    );
    let engine = engine_at(dir.path());
    assert!(
        !engine
            .decide(&schedule("train-1", "gpu-drift"))
            .is_allowed()
    );
}

#[test]
fn required_policies_and_permits_cannot_be_downgraded() {
    let dir = policy_copy();
    append_config(
        dir.path(),
        "\n[modes]\n\"security.blocked-node\" = \"audit\"\n",
    );
    let e = load_error(dir.path());
    assert!(
        e.contains("modes.security.blocked-node: security.blocked-node is required (@required, or the schema's @block_policy): it always enforces"),
        "{e}"
    );
    assert!(e.contains("probity.toml:"), "located: {e}");

    let dir = policy_copy();
    let path = dir.path().join("security/blocklist.cedar");
    let text = std::fs::read_to_string(&path).unwrap().replace(
        "@id(\"security.blocked-node\")",
        "@id(\"security.blocked-node\")\n@mode(\"warn\")",
    );
    std::fs::write(&path, text).unwrap();
    let e = load_error(dir.path());
    assert!(
        e.contains("@mode(\"warn\"): security.blocked-node is required"),
        "{e}"
    );

    let dir = policy_copy();
    append_config(dir.path(), "\n[modes]\n\"placement.schedule\" = \"warn\"\n");
    let e = load_error(dir.path());
    assert!(e.contains("placement.schedule is a permit"), "{e}");

    let dir = policy_copy();
    append_config(
        dir.path(),
        "\n[modes]\n\"placement.no-such-rule\" = \"warn\"\n",
    );
    let e = load_error(dir.path());
    assert!(
        e.contains("modes.placement.no-such-rule: the set has no policy with this @id"),
        "{e}"
    );

    let dir = policy_copy();
    append_config(
        dir.path(),
        "\n[[mode_scope]]\npolicy = \"security.blocked-node\"\nmode = \"enforce\"\nwhen = \"true\"\n",
    );
    let e = load_error(dir.path());
    assert!(
        e.contains("it enforces everywhere, so it takes no scope"),
        "{e}"
    );
}

#[test]
fn a_scoped_mode_applies_where_its_condition_holds_and_nowhere_else() {
    let dir = policy_copy();
    append_config(
        dir.path(),
        concat!(
            "\n[modes]\n\"placement.driver-drift\" = \"audit\"\n",
            "\n[[mode_scope]]\npolicy = \"placement.driver-drift\"\nmode = \"enforce\"\n",
            "when = 'resource.zone == Zone::\"zone-a\"'\n",
        ),
    );
    let engine = engine_at(dir.path());
    // A second drifted node, in another zone.
    let mut hot = crate::cluster()
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["uid"]["id"] == "gpu-drift")
        .unwrap()
        .clone();
    hot["uid"]["id"] = "gpu-drift-hot".into();
    hot["attrs"]["zone"]["__entity"]["id"] = "zone-hot".into();
    hot["parents"] = serde_json::json!([{"type": "Zone", "id": "zone-hot"}]);
    engine.upsert_entities(&serde_json::json!([hot])).unwrap();
    // gpu-drift is in zone-a: enforced there.
    let d = engine.decide(&schedule("train-1", "gpu-drift"));
    assert_eq!(d.decision, Effect::Deny, "{d:?}");
    assert_eq!(
        d.reason_ids().collect::<Vec<_>>(),
        ["placement.driver-drift"]
    );
    assert!(d.audit.is_empty());
    // Elsewhere: audited.
    let d = engine.decide(&schedule("train-1", "gpu-drift-hot"));
    assert!(
        d.audit.iter().any(|n| n.policy == "placement.driver-drift"),
        "{d:?}"
    );
    assert!(
        !d.reason_ids().any(|r| r == "placement.driver-drift"),
        "{d:?}"
    );
    let modes = engine.policy_modes();
    let drift = &modes["placement.driver-drift"];
    assert_eq!(drift.mode, Mode::Audit);
    assert_eq!(drift.scoped.len(), 1);
    assert_eq!(drift.scoped[0].mode, Mode::Enforce);
    // Counted once, however many parts a scope makes of it.
    assert_eq!(
        engine.status().policies,
        Engine::builder(crate::root().join("policies"))
            .build()
            .unwrap()
            .status()
            .policies
    );
}

#[test]
fn a_scope_that_is_not_a_valid_condition_is_refused_where_it_is_written() {
    let dir = policy_copy();
    append_config(
        dir.path(),
        "\n[[mode_scope]]\npolicy = \"placement.driver-drift\"\nmode = \"audit\"\nwhen = 'principal.nope == 1'\n",
    );
    let e = load_error(dir.path());
    assert!(e.contains("mode_scope[0].when:"), "{e}");
    assert!(e.contains("nope"), "names the attribute: {e}");

    // The condition must hold for every action the policy applies to: driver-drift
    // also judges `comply`, whose principal is a Node.
    let dir = policy_copy();
    append_config(
        dir.path(),
        "\n[[mode_scope]]\npolicy = \"placement.driver-drift\"\nmode = \"audit\"\nwhen = 'principal.namespace == Namespace::\"x\"'\n",
    );
    let e = load_error(dir.path());
    assert!(
        e.contains("attribute `namespace` on entity type `Node` not found"),
        "{e}"
    );

    let dir = policy_copy();
    append_config(
        dir.path(),
        "\n[[mode_scope]]\npolicy = \"placement.driver-drift\"\nmode = \"audit\"\nwhen = 'true }; permit (principal, action, resource) when { true'\n",
    );
    let e = load_error(dir.path());
    assert!(e.contains("mode_scope[0].when:"), "{e}");
}

#[test]
fn a_lowered_mode_is_recorded_with_the_file_and_its_owner_and_a_raised_one_is_not() {
    let dir = policy_copy();
    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(StateStore::open(&tmp.path().join("state")).unwrap());
    let engine = engine_at(dir.path());
    engine.attach_state(store.clone()).unwrap();
    let events = engine.reload_events();

    append_config(
        dir.path(),
        "\n[modes]\n\"placement.driver-drift\" = \"audit\"\n",
    );
    engine.reload().unwrap();
    let event = events.recv().unwrap();
    assert_eq!(event.outcome, ReloadOutcome::Loaded);
    assert_eq!(event.lowered.len(), 1, "{:?}", event.lowered);
    let change = &event.lowered[0];
    assert_eq!(change.policy, "placement.driver-drift");
    assert_eq!((change.from, change.to), (Mode::Enforce, Mode::Audit));
    assert!(change.declared_in.ends_with("/probity.toml"), "{change:?}");
    assert!(
        change
            .owner
            .as_deref()
            .is_some_and(|o| o.starts_with("uid:")),
        "{change:?}"
    );
    let recorded: Vec<_> = store
        .events(0)
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "policy-mode-lowered")
        .collect();
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0].object_id, "placement.driver-drift");
    assert!(
        recorded[0]
            .detail
            .starts_with("placement.driver-drift lowered from enforce to audit by /"),
        "{}",
        recorded[0].detail
    );
    assert!(
        recorded[0]
            .detail
            .ends_with("trigger: a reload asked by the host")
    );

    // Raising it back is not a downgrade: nothing more is recorded.
    let path = dir.path().join("probity.toml");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("= \"audit\"", "= \"enforce\"");
    std::fs::write(&path, text).unwrap();
    engine.reload().unwrap();
    let event = events.recv().unwrap();
    assert_eq!(event.outcome, ReloadOutcome::Loaded);
    assert!(event.lowered.is_empty());
    let count = store
        .events(0)
        .unwrap()
        .iter()
        .filter(|e| e.kind == "policy-mode-lowered")
        .count();
    assert_eq!(count, 1);
}

#[test]
fn an_audit_finding_is_recorded_in_the_decision_log_though_it_allows() {
    let dir = policy_copy();
    append_config(
        dir.path(),
        "\n[modes]\n\"placement.driver-drift\" = \"audit\"\n",
    );
    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(StateStore::open(&tmp.path().join("state")).unwrap());
    let engine = engine_at(dir.path());
    engine.attach_state(store.clone()).unwrap();
    assert!(engine.decide(&schedule("train-1", "gpu-a1")).is_allowed());
    assert!(store.decisions(0, 10).unwrap().is_empty());
    let d = engine.decide(&schedule("train-1", "gpu-drift"));
    assert!(d.is_allowed());
    let records = store.decisions(0, 10).unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].decision, d);
}

#[test]
fn scenarios_expect_warnings_and_audit_findings_by_policy() {
    let dir = policy_copy();
    append_config(
        dir.path(),
        "\n[modes]\n\"placement.driver-drift\" = \"audit\"\n\"thermal.zone-power-ceiling\" = \"warn\"\n",
    );
    let engine = Engine::builder(dir.path()).build().unwrap();
    let scenario = dir.path().join("modes.json");
    let write = |audit: &str| {
        std::fs::write(
            &scenario,
            serde_json::json!({
                "entities": crate::root().join("testdata/entities/cluster.json"),
                "cases": [
                    {"name": "drift is audited",
                     "request": {"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-drift\""},
                     "expect": {"decision": "allow", "audit": [audit], "warnings": [], "obligations": []}},
                    {"name": "a hot zone warns",
                     "request": {"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-hot1\""},
                     "expect": {"decision": "allow", "warnings": ["thermal.zone-power-ceiling"], "audit": []}}
                ]
            })
            .to_string(),
        )
        .unwrap();
    };
    write("placement.driver-drift");
    let results = probity::scenario::run_file(&engine, &scenario).unwrap();
    assert!(results.iter().all(|r| r.passed()), "{results:?}");
    write("placement.other");
    let results = probity::scenario::run_file(&engine, &scenario).unwrap();
    let failure = results[0].failure.as_deref().unwrap();
    assert!(
        failure.contains(r#"audit {"placement.driver-drift"}, expected {"placement.other"}"#),
        "{failure}"
    );
    assert!(results[1].passed());
}

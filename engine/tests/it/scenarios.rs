//! Every scenario under testdata/scenarios passes, and every default rule has both
//! an allow and a deny case.

use std::collections::BTreeMap;

use probity::{Effect, Engine, scenario};

use crate::root;

#[test]
fn every_scenario_passes_on_the_policy_directory_and_the_embedded_defaults() {
    let dir_engine = Engine::builder(root().join("policies")).build().unwrap();
    let embedded = Engine::from_embedded_defaults().unwrap();
    assert_eq!(dir_engine.status().digest.len(), 64);
    let files = scenario::discover(&root().join("testdata/scenarios")).unwrap();
    assert!(
        files.len() >= 15,
        "found only {} scenario files",
        files.len()
    );
    for engine in [&dir_engine, &embedded] {
        let mut failures = Vec::new();
        let mut count = 0;
        for file in &files {
            for result in scenario::run_file(engine, file).unwrap() {
                count += 1;
                if !result.passed() {
                    failures.push(result.to_string());
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        assert!(count >= 30);
    }
}

#[test]
fn every_default_rule_has_an_allow_and_a_deny_case() {
    let engine = Engine::from_embedded_defaults().unwrap();
    let mut seen: BTreeMap<String, (bool, bool)> = BTreeMap::new();
    for file in scenario::discover(&root().join("testdata/scenarios")).unwrap() {
        for r in scenario::run_file(&engine, &file).unwrap() {
            let Some(policy) = r.policy.clone() else {
                continue;
            };
            let entry = seen.entry(policy).or_default();
            match r.expected {
                Effect::Allow => entry.0 = true,
                Effect::Deny => entry.1 = true,
            }
        }
    }
    // Every forbid is a rule; so is a permit that carries an obligation.
    let rules: Vec<String> = engine
        .policy_ids()
        .into_iter()
        .filter(|(id, forbid)| *forbid || id == "placement.burst-to-cloud")
        .map(|(id, _)| id)
        .collect();
    assert!(rules.len() >= 14);
    for rule in rules {
        assert_eq!(
            seen.get(&rule),
            Some(&(true, true)),
            "rule {rule} needs a scenario file with an allow and a deny case"
        );
    }
}

#[test]
fn a_failing_expectation_is_reported_with_what_differed() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("wrong.json");
    std::fs::write(
        &file,
        r#"{"cases": [{"name": "wrong", "request": {"principal": "Node::\"n\"", "action": "listen",
            "resource": "Node::\"n\"", "context": {"port": 22, "protocol": "tcp"}},
            "expect": {"decision": "deny", "obligations": [{"kind": "alert"}]}}]}"#,
    )
    .unwrap();
    let engine = Engine::from_embedded_defaults().unwrap();
    let results = scenario::run_file(&engine, &file).unwrap();
    let why = results[0].failure.as_deref().unwrap();
    assert!(why.contains("expected deny, got allow"), "{why}");
    assert!(why.contains("obligations []"), "{why}");
}

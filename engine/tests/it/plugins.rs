//! WebAssembly plugins: the examples vote with Cedar, hostile plugins become denies
//! naming the plugin and the cause, broken plugins reject a reload whole, and a
//! looping plugin does not hold up other decisions.
//!
//! These tests need the components built by `scripts/build-plugins.sh`; they fail
//! (never skip) when the files are missing.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use probity::{DecideOptions, Decision, Effect, Engine, Request};
use serde_json::json;

use crate::{policy_copy, root};

/// The built component `name`, or a failure that says how to build it.
pub fn plugin_wasm(name: &str) -> PathBuf {
    let path = root().join("target/plugins").join(format!("{name}.wasm"));
    assert!(
        path.is_file(),
        "{} is missing: run scripts/build-plugins.sh before cargo test",
        path.display()
    );
    path
}

/// A manifest binding one plugin to `action`, with the given extra lines.
fn manifest(dir: &Path, name: &str, action: &str, extra: &str) -> PathBuf {
    let path = dir.join("plugins.toml");
    let text = format!(
        "[[plugin]]\nname = \"{name}\"\npath = {:?}\nactions = [\"{action}\"]\n{extra}\n",
        plugin_wasm(name).display().to_string()
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn engine_with(name: &str, action: &str, extra: &str) -> (tempfile::TempDir, Engine) {
    let tmp = tempfile::tempdir().unwrap();
    let m = manifest(tmp.path(), name, action, extra);
    let engine = Engine::builder(root().join("policies"))
        .plugins(m)
        .build()
        .unwrap();
    crate::load_cluster(&engine);
    (tmp, engine)
}

fn examples() -> Engine {
    plugin_wasm("power-spike");
    plugin_wasm("thermal-headroom");
    let engine = Engine::builder(root().join("policies"))
        .plugins(root().join("testdata/plugins/manifests/examples.toml"))
        .build()
        .unwrap();
    crate::load_cluster(&engine);
    engine
}

/// A compliance check with power readings, as the node agent (a fact reporter) asks it.
fn comply(node: &str, readings: serde_json::Value) -> Request {
    Request::from_json_value(
        &json!({"principal": format!("Node::\"{node}\""), "action": "comply",
        "resource": format!("Node::\"{node}\""), "context": {"powerReadingsW": readings}}),
    )
    .unwrap()
    .as_fact_reporter()
}

fn listen(port: i64) -> Request {
    Request::from_json_value(&json!({"principal": "Node::\"gpu-a1\"", "action": "listen",
        "resource": "Node::\"gpu-a1\"", "context": {"port": port, "protocol": "tcp"}}))
    .unwrap()
}

/// The one plugin failure of a decision: its error message.
fn failure(d: &Decision, plugin: &str) -> String {
    assert_eq!(d.decision, Effect::Deny, "{d:?}");
    let id = format!("plugin:{plugin}");
    assert!(d.reason_ids().any(|r| r == id), "no reason {id}: {d:?}");
    let e = d
        .errors
        .iter()
        .find(|e| e.policy.as_deref() == Some(id.as_str()))
        .unwrap_or_else(|| panic!("no error from {id}: {d:?}"));
    assert!(
        e.message.starts_with(&format!("plugin {plugin}: ")),
        "{}",
        e.message
    );
    e.message.clone()
}

#[test]
fn example_plugins_vote_with_cedar_and_deny_wins() {
    let engine = examples();
    let steady = engine.decide(&comply("gpu-a1", json!([2900, 3000, 3050])));
    assert!(steady.is_allowed(), "{steady:?}");
    assert_eq!(steady.reason_ids().collect::<Vec<_>>(), ["thermal.comply"]);

    let spike = engine.decide(&comply("gpu-a1", json!([3000, 3000, 3100, 4200])));
    assert!(!spike.is_allowed());
    // Cedar's permit does not explain a deny: only the plugin's reason remains.
    assert_eq!(
        spike.reason_ids().collect::<Vec<_>>(),
        ["plugin:power-spike/spike"]
    );
    assert_eq!(spike.obligations[0].kind, "alert");
    assert_eq!(spike.obligations[0].policy, "plugin:power-spike/spike");
    assert_eq!(spike.obligations[0].parameters["reading_w"], "4200");
    assert!(spike.errors.is_empty());

    // Only plugins bound to the action run: listen has none.
    assert!(!engine.decide(&listen(8080)).is_allowed());
    assert!(engine.decide(&listen(22)).is_allowed());

    let status = engine.status();
    let names: Vec<_> = status.plugins.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["power-spike", "thermal-headroom"]);
    assert_eq!(status.plugins[0].actions, ["comply"]);
    assert_eq!(status.plugins[0].sha256.len(), 64);
}

#[test]
fn thermal_headroom_migrates_to_a_zone_found_in_the_store() {
    let engine = examples();
    let r = Request::from_json_value(&json!({"principal": "Workload::\"train-1\"",
        "action": "schedule", "resource": "Node::\"gpu-hot1\""}))
    .unwrap();
    let d = engine.decide(&r);
    assert!(
        d.reason_ids()
            .any(|r| r == "plugin:thermal-headroom/zone-ceiling"),
        "{d:?}"
    );
    let plugin_migrate = d
        .obligations
        .iter()
        .find(|o| o.policy.starts_with("plugin:"))
        .unwrap();
    assert_eq!(plugin_migrate.kind, "migrate");
    assert_eq!(plugin_migrate.target.as_deref(), Some(r#"Zone::"zone-a""#));
    assert_eq!(
        plugin_migrate.parameters["from_zone"],
        r#"Zone::"zone-hot""#
    );
}

#[test]
fn a_looping_plugin_is_a_timeout_deny() {
    let (_tmp, engine) = engine_with("looping", "comply", "timeout_ms = 20");
    let d = engine.decide(&comply("gpu-a1", json!([1])));
    assert_eq!(
        failure(&d, "looping"),
        "plugin looping: timeout after 20 ms"
    );
    // The engine keeps answering, and the next call gets a fresh sandbox.
    assert!(engine.decide(&listen(22)).is_allowed());
    let again = engine.decide(&comply("gpu-a1", json!([1])));
    assert_eq!(
        failure(&again, "looping"),
        "plugin looping: timeout after 20 ms"
    );
}

/// A caller's deadline bounds the plugins of its decision: a plugin whose manifest
/// allows it 3 s gets what is left before the deadline, and none once it has passed.
#[test]
fn a_deadline_cuts_a_looping_plugin_short_and_skips_one_past_it() {
    let (_tmp, engine) = engine_with("looping", "comply", "timeout_ms = 3000");
    let asked = [comply("gpu-a1", json!([1]))];
    let by = std::time::Instant::now() + std::time::Duration::from_millis(50);
    let d = engine
        .decide_with(&asked, DecideOptions::new().dry_run().deadline(by))
        .settle();
    let message = failure(&d[0], "looping");
    let given: u64 = message
        .strip_prefix("plugin looping: timeout after ")
        .and_then(|rest| rest.strip_suffix(" ms"))
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("not a timeout: {message}"));
    assert!(given <= 50, "{message}");
    assert_eq!(d[0].decision, Effect::Deny);

    let past = std::time::Instant::now();
    let d = engine
        .decide_with(&asked, DecideOptions::new().dry_run().deadline(past))
        .settle();
    assert_eq!(
        failure(&d[0], "looping"),
        "plugin looping: not called: the caller's deadline passed"
    );
    assert_eq!(d[0].decision, Effect::Deny);
}

#[test]
fn a_memory_bomb_hits_the_memory_limit() {
    // A generous deadline, so that on a loaded machine (a debug build of the host grows
    // memory slowly) only the memory limit can stop the bomb.
    let (_tmp, engine) = engine_with(
        "memory-bomb",
        "comply",
        "memory_mib = 16\ntimeout_ms = 5000",
    );
    let d = engine.decide(&comply("gpu-a1", json!([1])));
    assert_eq!(
        failure(&d, "memory-bomb"),
        "plugin memory-bomb: memory limit of 16 MiB exceeded"
    );
}

#[test]
fn a_trapping_plugin_is_a_trap_deny() {
    let (_tmp, engine) = engine_with("trap", "comply", "");
    let d = engine.decide(&comply("gpu-a1", json!([1])));
    let m = failure(&d, "trap");
    assert!(m.starts_with("plugin trap: trap: "), "{m}");
    assert!(m.contains("unreachable"), "{m}");
}

#[test]
fn a_malformed_verdict_is_invalid_output_even_when_it_allows() {
    let (_tmp, engine) = engine_with("malformed", "comply", "");
    let d = engine.decide(&comply("gpu-a1", json!([1])));
    let m = failure(&d, "malformed");
    assert!(
        m.starts_with("plugin malformed: invalid output: reason id"),
        "{m}"
    );
    assert!(d.obligations.is_empty(), "{d:?}");
}

#[test]
fn an_unknown_import_is_a_link_error_that_rejects_the_set_located_in_the_manifest() {
    let tmp = tempfile::tempdir().unwrap();
    let m = manifest(tmp.path(), "missing-import", "comply", "");
    let err = Engine::builder(root().join("policies"))
        .plugins(&m)
        .build()
        .err()
        .unwrap();
    let detail = err.detail();
    assert!(detail.contains("plugins.toml:3:"), "{detail}");
    assert!(
        detail.contains("plugin missing-import: link error"),
        "{detail}"
    );
    assert!(detail.contains("probity:evil/net"), "{detail}");
}

#[test]
fn a_file_that_is_not_wasm_or_is_missing_is_a_load_error() {
    let tmp = tempfile::tempdir().unwrap();
    let m = manifest(tmp.path(), "not-wasm", "comply", "");
    let err = Engine::builder(root().join("policies")).plugins(&m).build();
    let detail = err.err().unwrap().detail();
    assert!(
        detail.contains("plugin not-wasm: load error: not a WebAssembly component"),
        "{detail}"
    );

    std::fs::write(&m, "[[plugin]]\nname = \"gone\"\npath = \"gone.wasm\"\n").unwrap();
    let detail = Engine::builder(root().join("policies"))
        .plugins(&m)
        .build()
        .err()
        .unwrap()
        .detail();
    assert!(
        detail.contains("plugin gone: load error: cannot read"),
        "{detail}"
    );
    assert!(detail.contains("gone.wasm"), "{detail}");
}

#[test]
fn a_manifest_naming_an_action_the_schema_lacks_is_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let m = manifest(tmp.path(), "power-spike", "teleport", "");
    let detail = Engine::builder(root().join("policies"))
        .plugins(&m)
        .build()
        .err()
        .unwrap()
        .detail();
    assert!(
        detail.contains("\"teleport\" is not an action of the schema"),
        "{detail}"
    );
}

#[test]
fn a_looping_plugin_on_one_action_does_not_hold_up_other_actions() {
    let (_tmp, engine) = engine_with("looping", "comply", "timeout_ms = 3000");
    let started = Arc::new(AtomicBool::new(false));
    let finished = Arc::new(AtomicBool::new(false));
    let looping = {
        let (engine, started, finished) = (engine.clone(), started.clone(), finished.clone());
        std::thread::spawn(move || {
            started.store(true, Ordering::SeqCst);
            let d = engine.decide(&comply("gpu-a1", json!([1])));
            finished.store(true, Ordering::SeqCst);
            d
        })
    };
    while !started.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    // Many decisions on other actions complete while the looping call is still running.
    for i in 0..200 {
        assert!(engine.decide(&listen(22)).is_allowed(), "decision {i}");
        assert!(!engine.decide(&listen(8080)).is_allowed(), "decision {i}");
    }
    assert!(
        !finished.load(Ordering::SeqCst),
        "the looping call ended before the other decisions did"
    );
    let d = looping.join().unwrap();
    assert_eq!(
        failure(&d, "looping"),
        "plugin looping: timeout after 3000 ms"
    );
}

#[test]
fn a_broken_plugin_rejects_the_reload_and_the_previous_set_keeps_serving() {
    let dir = policy_copy();
    std::fs::create_dir_all(dir.path().join("plugins")).unwrap();
    let wasm = dir.path().join("plugins/spike.wasm");
    std::fs::copy(plugin_wasm("power-spike"), &wasm).unwrap();
    let m = dir.path().join("plugins.toml");
    std::fs::write(
        &m,
        "[[plugin]]\nname = \"power-spike\"\npath = \"plugins/spike.wasm\"\n",
    )
    .unwrap();
    let engine = Engine::builder(dir.path()).build().unwrap();
    crate::load_cluster(&engine);
    let spike = || comply("gpu-a1", json!([3000, 3000, 3100, 4200]));
    assert!(!engine.decide(&spike()).is_allowed());
    let digest = engine.status().digest;

    // Reloading unchanged files changes nothing.
    engine.reload().unwrap();
    assert_eq!(engine.status().digest, digest);

    std::fs::copy(plugin_wasm("not-wasm"), &wasm).unwrap();
    let err = engine.reload().unwrap_err();
    assert!(
        err.detail().contains("plugin power-spike: load error"),
        "{}",
        err.detail()
    );
    assert_eq!(engine.status().digest, digest);
    let d = engine.decide(&spike());
    assert_eq!(
        d.reason_ids().collect::<Vec<_>>(),
        ["plugin:power-spike/spike"]
    );
}

#[test]
fn replacing_a_component_under_the_policy_directory_hot_reloads_it() {
    let dir = policy_copy();
    std::fs::create_dir_all(dir.path().join("plugins")).unwrap();
    let wasm = dir.path().join("plugins/p.wasm");
    std::fs::copy(plugin_wasm("power-spike"), &wasm).unwrap();
    std::fs::write(
        dir.path().join("plugins.toml"),
        "[[plugin]]\nname = \"p\"\npath = \"plugins/p.wasm\"\nactions = [\"comply\"]\n",
    )
    .unwrap();
    let engine = Engine::builder(dir.path()).build().unwrap();
    crate::load_cluster(&engine);
    let _watcher = engine.watch().unwrap();
    let before = engine.status().plugins[0].sha256.clone();

    // The trap plugin replaces power-spike in place (written beside, then renamed).
    let tmp = dir.path().join("plugins/.p.wasm.tmp");
    std::fs::copy(plugin_wasm("trap"), &tmp).unwrap();
    std::fs::rename(&tmp, &wasm).unwrap();
    crate::reload::wait_for("the new component", || {
        engine.status().plugins[0].sha256 != before
    });
    let d = engine.decide(&comply("gpu-a1", json!([1])));
    assert!(failure(&d, "p").contains("trap"));
}

#[test]
fn every_plugin_scenario_passes_with_the_example_manifest() {
    let engine = examples();
    let files = probity::scenario::discover(&root().join("testdata/scenarios-plugins")).unwrap();
    assert!(files.len() >= 2);
    let mut failures = Vec::new();
    let mut count = 0;
    for file in &files {
        for result in probity::scenario::run_file(&engine, file).unwrap() {
            count += 1;
            if !result.passed() {
                failures.push(result.to_string());
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(count >= 8);
}

#[test]
fn plugins_see_entity_updates_at_once() {
    let engine = examples();
    let r = Request::from_json_value(&json!({"principal": "Workload::\"train-1\"",
        "action": "schedule", "resource": "Node::\"gpu-hot1\""}))
    .unwrap();
    let target = |d: &Decision| {
        d.obligations
            .iter()
            .find(|o| o.policy.starts_with("plugin:"))
            .and_then(|o| o.target.clone())
    };
    assert_eq!(
        target(&engine.decide(&r)).as_deref(),
        Some(r#"Zone::"zone-a""#)
    );
    // A new, empty zone appears: the next decision migrates there.
    engine
        .upsert_entities(
            &json!([{"uid": {"type": "Zone", "id": "zone-new"}, "parents": [],
            "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}},
                      "powerDrawW": 0, "powerCeilingW": 40000}}]),
        )
        .unwrap();
    assert_eq!(
        target(&engine.decide(&r)).as_deref(),
        Some(r#"Zone::"zone-new""#)
    );
}

#[test]
fn environment_files_clock_and_stdout_are_out_of_reach() {
    for (reach, interface) in [
        ("env", "wasi:cli/environment"),
        ("file", "wasi:filesystem/"),
        ("clock", "wasi:clocks/wall-clock"),
        ("print", "wasi:cli/stdout"),
    ] {
        let (_tmp, engine) = engine_with(
            "sneaky",
            "comply",
            &format!("[plugin.settings]\nreach = \"{reach}\""),
        );
        let d = engine.decide(&comply("gpu-a1", json!([1])));
        let m = failure(&d, "sneaky");
        assert!(
            m.starts_with("plugin sneaky: trap: the plugin called "),
            "{reach}: {m}"
        );
        assert!(m.contains(interface), "{reach}: {m}");
        assert!(m.contains("which Probity does not provide"), "{reach}: {m}");
    }
}

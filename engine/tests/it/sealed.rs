//! Sealed policy mode: a set loads only if its `policy.seal` verifies under the pinned
//! key, covers every file with its digest, and is not older than what was loaded (or
//! what the state store remembers). Unsealed engines ignore the seal.

use std::path::Path;
use std::sync::Arc;

use probity::integrity::{Anchor as _, SoftwareAnchor, Verifier};
use probity::policy_seal::{self, PolicySeal};
use probity::state::{StateError, StateStore};
use probity::{Engine, EntityError, LoadError, ReloadOutcome, Request};

use crate::{load_cluster, policy_copy, write_atomic};

fn anchor(dir: &Path, name: &str) -> SoftwareAnchor {
    SoftwareAnchor::generate(&dir.join(name)).unwrap()
}

fn verifier(anchor: &SoftwareAnchor) -> Verifier {
    Verifier::new(anchor.public_key().clone())
}

fn schedule_on(node: &str) -> Request {
    Request::from_json_value(&serde_json::json!({
        "principal": "Workload::\"train-1\"", "action": "schedule",
        "resource": format!("Node::\"{node}\"")}))
    .unwrap()
}

fn sealed_error(e: &LoadError) -> String {
    assert!(
        matches!(e, LoadError::Sealed { .. }),
        "not a seal refusal: {e:?}"
    );
    e.detail()
}

#[test]
fn a_sealed_set_loads_and_an_unsealed_engine_ignores_the_seal() {
    let dir = policy_copy();
    let keys = tempfile::tempdir().unwrap();
    let a = anchor(keys.path(), "k");
    let seal = policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 1, &a).unwrap();
    let listed: Vec<&str> = seal.files().iter().map(|f| f.path.as_str()).collect();
    assert!(listed.contains(&"probity.cedarschema"), "{listed:?}");
    assert!(listed.contains(&"probity.toml"), "{listed:?}");
    assert!(listed.contains(&"security/blocklist.cedar"), "{listed:?}");
    assert!(!listed.contains(&"policy.seal"));

    let engine = Engine::builder(dir.path())
        .sealed(verifier(&a))
        .build()
        .unwrap();
    let status = engine.status();
    let info = status.seal.unwrap();
    assert_eq!((info.name.as_str(), info.version), ("prod", 1));
    assert_eq!(info.key_id, hex::encode(a.public_key().key_id().0));

    // Unsealed mode keeps working as before, seal or no seal.
    let plain = Engine::builder(dir.path()).build().unwrap();
    assert_eq!(plain.status().digest, engine.status().digest);
    assert!(plain.status().seal.is_none());
    std::fs::write(dir.path().join("security/extra.cedar"), "").unwrap();
    assert!(Engine::builder(dir.path()).build().is_ok());
}

#[test]
fn bug_a_file_changed_after_sealing_is_refused_and_the_previous_set_keeps_serving() {
    let dir = policy_copy();
    let keys = tempfile::tempdir().unwrap();
    let a = anchor(keys.path(), "k");
    policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 1, &a).unwrap();
    let engine = Engine::builder(dir.path())
        .sealed(verifier(&a))
        .build()
        .unwrap();
    load_cluster(&engine);
    let events = engine.reload_events();
    let digest = engine.status().digest;

    // The blocklist forbid removed in place: still a valid set, but not the sealed one.
    write_atomic(
        &dir.path().join("security/blocklist.cedar"),
        "// nothing here\n",
    );
    let e = engine.reload().unwrap_err();
    let detail = sealed_error(&e);
    assert!(
        detail.contains("security/blocklist.cedar was changed after sealing"),
        "{detail}"
    );
    // Located in the seal, on the file's line.
    let problem = &e.problems()[0];
    assert!(problem.file.ends_with("policy.seal"), "{problem}");
    assert!(problem.line > 3, "{problem}");
    assert_eq!(engine.status().digest, digest);
    let d = engine.decide(&schedule_on("gpu-blocked"));
    assert!(!d.is_allowed());
    assert_eq!(d.reasons[0].policy, "security.blocked-node");
    let event = events.try_recv().unwrap();
    assert_eq!(event.outcome, ReloadOutcome::Rejected);
    assert_eq!(event.digest_before, digest);
    assert_eq!(event.digest_after, digest);
    assert!(event.error.is_some());

    // A fresh engine refuses it too.
    let e = Engine::builder(dir.path())
        .sealed(verifier(&a))
        .build()
        .err()
        .unwrap();
    assert!(sealed_error(&e).contains("changed after sealing"));
}

#[test]
fn an_added_or_a_missing_policy_file_is_refused() {
    let dir = policy_copy();
    let keys = tempfile::tempdir().unwrap();
    let a = anchor(keys.path(), "k");
    policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 1, &a).unwrap();
    let sealed = || Engine::builder(dir.path()).sealed(verifier(&a)).build();

    let extra = dir.path().join("placement/allow-all.cedar");
    std::fs::write(
        &extra,
        "@id(\"x.allow\") permit (principal, action, resource);\n",
    )
    .unwrap();
    let detail = sealed_error(&sealed().err().unwrap());
    assert!(
        detail.contains("placement/allow-all.cedar is part of the policy set but not sealed"),
        "{detail}"
    );
    std::fs::remove_file(&extra).unwrap();
    assert!(sealed().is_ok());

    // A plugin manifest counts as a policy file.
    std::fs::write(dir.path().join("plugins.toml"), "").unwrap();
    let detail = sealed_error(&sealed().err().unwrap());
    assert!(
        detail.contains("plugins.toml is part of the policy set"),
        "{detail}"
    );
    std::fs::remove_file(dir.path().join("plugins.toml")).unwrap();

    std::fs::remove_file(dir.path().join("thermal/thermal.cedar")).unwrap();
    let detail = sealed_error(&sealed().err().unwrap());
    assert!(
        detail.contains("thermal/thermal.cedar is sealed but missing"),
        "{detail}"
    );
}

#[test]
fn a_seal_made_with_another_key_or_altered_is_refused() {
    let dir = policy_copy();
    let keys = tempfile::tempdir().unwrap();
    let pinned = anchor(keys.path(), "pinned");
    let other = anchor(keys.path(), "other");
    policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 1, &other).unwrap();
    let e = Engine::builder(dir.path())
        .sealed(verifier(&pinned))
        .build()
        .err()
        .unwrap();
    let detail = sealed_error(&e);
    assert!(
        detail.contains(&format!(
            "signed by key {}, not the pinned key {}",
            other.public_key().key_id(),
            pinned.public_key().key_id()
        )),
        "{detail}"
    );

    // Signed by the pinned key, then edited (a version bump by hand).
    policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 1, &pinned).unwrap();
    let path = dir.path().join("policy.seal");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("version 1\n", "version 9\n")).unwrap();
    let e = Engine::builder(dir.path())
        .sealed(verifier(&pinned))
        .build()
        .err()
        .unwrap();
    assert!(sealed_error(&e).contains("the seal was altered"), "{e:?}");

    // A seal that does not parse is located by line.
    std::fs::write(&path, text.replace("version 1\n", "version 01\n")).unwrap();
    let e = Engine::builder(dir.path())
        .sealed(verifier(&pinned))
        .build()
        .err()
        .unwrap();
    assert_eq!(e.problems()[0].line, 3, "{}", e.detail());

    // No seal at all.
    std::fs::remove_file(&path).unwrap();
    let e = Engine::builder(dir.path())
        .sealed(verifier(&pinned))
        .build()
        .err()
        .unwrap();
    assert!(
        sealed_error(&e).contains("sealed mode: cannot read"),
        "{e:?}"
    );
}

/// The replay the issue describes: an old signed set goes back into the directory. A
/// live engine refuses it; so does a restarted one whose state store remembers the
/// newer version. (The old set lacked `security.blocked-node`; such a set no
/// longer loads at all, see `reload::bug_a_set_without_the_block_rule_was_accepted`,
/// so the old set here differs by a rule of its own.)
#[test]
fn bug_an_older_signed_set_cannot_be_replayed_even_across_restarts() {
    let dir = policy_copy();
    let keys = tempfile::tempdir().unwrap();
    let state_dir = tempfile::tempdir().unwrap();
    let a = anchor(keys.path(), "k");
    let blocklist = dir.path().join("security/blocklist.cedar");
    let forbid = std::fs::read_to_string(&blocklist).unwrap();

    // Version 1: an extra permit that version 2 withdrew. Keep its files to replay them.
    let old_text = format!(
        "{forbid}\n@id(\"old.permit-all-listens\")\npermit (principal, action == Action::\"listen\", resource);\n"
    );
    std::fs::write(&blocklist, &old_text).unwrap();
    policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 1, &a).unwrap();
    let old_seal = std::fs::read(dir.path().join("policy.seal")).unwrap();
    // Version 2: with it.
    std::fs::write(&blocklist, &forbid).unwrap();
    policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 2, &a).unwrap();
    let new_seal = std::fs::read(dir.path().join("policy.seal")).unwrap();

    let engine = Engine::builder(dir.path())
        .sealed(verifier(&a))
        .build()
        .unwrap();
    let state = Arc::new(StateStore::open(state_dir.path()).unwrap());
    engine.attach_state(state.clone()).unwrap();
    load_cluster(&engine);
    assert_eq!(
        state
            .registry_entry("policy-set:prod")
            .unwrap()
            .unwrap()
            .version,
        2
    );

    // The replay, file by file as an attacker would: the old seal, then the old file.
    std::fs::write(dir.path().join("policy.seal"), &old_seal).unwrap();
    std::fs::write(&blocklist, &old_text).unwrap();
    let e = engine.reload().unwrap_err();
    assert!(
        sealed_error(&e).contains("version 1 is older than the live version 2"),
        "{}",
        e.detail()
    );
    assert!(!engine.decide(&schedule_on("gpu-blocked")).is_allowed());
    drop(engine);

    // A restart on the replayed directory: the set verifies on its own, but the state
    // store remembers version 2, so the engine refuses to take the store.
    let restarted = Engine::builder(dir.path())
        .sealed(verifier(&a))
        .build()
        .unwrap();
    let e = restarted.attach_state(state.clone()).unwrap_err();
    assert!(
        matches!(
            &e,
            EntityError::State(StateError::Rollback {
                offered: 1,
                accepted: 2,
                ..
            })
        ),
        "{e:?}"
    );
    drop(restarted);

    // With the store attached from the start, a reload to the replay is refused by the
    // store's memory too.
    std::fs::write(dir.path().join("policy.seal"), &new_seal).unwrap();
    std::fs::write(&blocklist, &forbid).unwrap();
    let engine = Engine::builder(dir.path())
        .sealed(verifier(&a))
        .build()
        .unwrap();
    engine.attach_state(state.clone()).unwrap();
    // Same version, other contents: refused as well.
    std::fs::write(&blocklist, format!("// v2 again\n{forbid}")).unwrap();
    policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 2, &a).unwrap();
    let e = engine.reload().unwrap_err();
    assert!(
        sealed_error(&e).contains("version 2 is live with other contents"),
        "{}",
        e.detail()
    );
    // A newer version goes live and is remembered.
    policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 3, &a).unwrap();
    engine.reload().unwrap();
    assert_eq!(engine.status().seal.unwrap().version, 3);
    assert_eq!(
        state
            .registry_entry("policy-set:prod")
            .unwrap()
            .unwrap()
            .version,
        3
    );
}

#[test]
fn a_pinned_name_refuses_another_set_signed_with_the_same_key() {
    let dir = policy_copy();
    let keys = tempfile::tempdir().unwrap();
    let a = anchor(keys.path(), "k");
    policy_seal::PolicySeal::seal_dir(dir.path(), "staging", 9, &a).unwrap();
    let e = Engine::builder(dir.path())
        .sealed(verifier(&a))
        .sealed_name("prod")
        .build()
        .err()
        .unwrap();
    assert!(
        sealed_error(&e).contains("loads only the set named \"prod\""),
        "{}",
        e.detail()
    );
    // And a reload never switches names.
    policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 1, &a).unwrap();
    let engine = Engine::builder(dir.path())
        .sealed(verifier(&a))
        .build()
        .unwrap();
    policy_seal::PolicySeal::seal_dir(dir.path(), "staging", 10, &a).unwrap();
    let e = engine.reload().unwrap_err();
    assert!(
        sealed_error(&e).contains("the live set is \"prod\""),
        "{}",
        e.detail()
    );
}

#[test]
fn sealed_mode_needs_a_policy_directory_and_files_under_it() {
    let keys = tempfile::tempdir().unwrap();
    let a = anchor(keys.path(), "k");
    let e = Engine::defaults()
        .sealed(verifier(&a))
        .build()
        .err()
        .unwrap();
    assert!(sealed_error(&e).contains("needs a policy directory"));

    // A schema outside the directory cannot be sealed.
    let dir = policy_copy();
    let outside = tempfile::tempdir().unwrap();
    std::fs::rename(
        dir.path().join("probity.cedarschema"),
        outside.path().join("probity.cedarschema"),
    )
    .unwrap();
    assert!(policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 1, &a).is_err());
}

#[test]
fn plugins_and_their_components_are_sealed() {
    let dir = policy_copy();
    let keys = tempfile::tempdir().unwrap();
    let a = anchor(keys.path(), "k");
    std::fs::create_dir(dir.path().join("plugins")).unwrap();
    let component = dir.path().join("plugins/power-spike.wasm");
    std::fs::copy(crate::plugins::plugin_wasm("power-spike"), &component).unwrap();
    std::fs::write(
        dir.path().join("plugins.toml"),
        "[[plugin]]\nname = \"power-spike\"\npath = \"plugins/power-spike.wasm\"\nactions = [\"comply\"]\n",
    )
    .unwrap();
    let seal = policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 1, &a).unwrap();
    assert!(
        seal.files()
            .iter()
            .any(|f| f.path == "plugins/power-spike.wasm")
    );
    let engine = Engine::builder(dir.path())
        .sealed(verifier(&a))
        .build()
        .unwrap();
    assert_eq!(engine.status().plugins.len(), 1);

    // Another component under the same name.
    std::fs::copy(crate::plugins::plugin_wasm("thermal-headroom"), &component).unwrap();
    let e = engine.reload().unwrap_err();
    assert!(
        sealed_error(&e).contains("plugins/power-spike.wasm was changed after sealing"),
        "{}",
        e.detail()
    );
}

#[test]
fn the_seal_file_round_trips_through_its_public_decoder() {
    let dir = policy_copy();
    let keys = tempfile::tempdir().unwrap();
    let a = anchor(keys.path(), "k");
    let seal = policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 4, &a).unwrap();
    let bytes = std::fs::read(dir.path().join("policy.seal")).unwrap();
    let back = PolicySeal::decode(&bytes).unwrap();
    assert_eq!(back, seal);
    assert_eq!(back.encode().as_bytes(), bytes.as_slice());
    back.check_signature(&verifier(&a)).unwrap();
    assert_eq!(back.registry_id(), "policy-set:prod");
    // The last version is refused: nothing could follow it.
    assert!(matches!(
        policy_seal::PolicySeal::seal_dir(dir.path(), "prod", u64::MAX, &a),
        Err(policy_seal::SealError::LastVersion { .. })
    ));
}

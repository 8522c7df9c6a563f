//! The engine's integration tests: one binary, a module per area.

// A panic in a test is a failed test, which is what we want.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod architecture;
mod audit;
mod cache;
pub mod decision_log;
mod disk_full;
mod engine;
mod facts;
mod fanout;
mod integrity;
mod modes;
mod plugins;
mod read_guard;
pub mod reload;
#[path = "../../../hooks/testsupport/rng.rs"]
mod rng;
mod scenarios;
mod sealed;
mod trust;

use std::path::{Path, PathBuf};

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A copy of the default policy directory in a temporary directory.
pub fn policy_copy() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&root().join("policies"), tmp.path());
    tmp
}

/// Copies the directory tree `from` into `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Loads the shared cluster fixture into `engine`, with `gpu-blocked` blocked as its
/// name says (the blocklist, not the entity JSON, says which nodes are blocked).
pub fn load_cluster(engine: &probity::Engine) {
    engine.upsert_entities(&cluster()).unwrap();
    engine
        .block_node(
            "gpu-blocked",
            "fixture: blocked since the cluster was set up",
        )
        .unwrap();
}

/// The keyring's keys of the fixture (testdata/entities/keys.json), published as the
/// keyring publishes them: `Key` is `@owned("keyring")`.
pub fn load_keys(engine: &probity::Engine) {
    let text = std::fs::read_to_string(root().join("testdata/entities/keys.json")).unwrap();
    let keys: serde_json::Value = serde_json::from_str(&text).unwrap();
    engine
        .replace_owned_entities(probity::EntityOwner::Keyring, &keys)
        .unwrap();
}

/// The cluster's entity of id `id`.
pub fn stored(id: &str) -> serde_json::Value {
    cluster()
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["uid"]["id"] == id)
        .cloned()
        .unwrap()
}

/// The cluster's nodes.
pub fn cluster_nodes() -> Vec<serde_json::Value> {
    cluster()
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["uid"]["type"] == "Node")
        .cloned()
        .collect()
}

/// The shared cluster fixture.
pub fn cluster() -> serde_json::Value {
    let text = std::fs::read_to_string(root().join("testdata/entities/cluster.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Writes `text` to `path` atomically (temp file in the same directory, then rename),
/// as editors and ConfigMap updates do.
pub fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_file_name(format!(
        ".{}.tmp",
        path.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

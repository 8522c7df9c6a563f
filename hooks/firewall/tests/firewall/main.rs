//! The integration tests of probity-firewall: the fixtures, randomized malformed input,
//! and real rulesets in network namespaces checked against real connections.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod fixtures;
mod live;
mod mutate;
mod netns;

use std::path::PathBuf;

/// testdata/fixtures/firewall of the repository.
pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/firewall")
}

/// The bytes of a fixture.
pub fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(fixture_dir().join(name)).unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

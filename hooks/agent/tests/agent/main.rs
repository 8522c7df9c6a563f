//! The integration tests of probity-agent: the cycle on a fake node with real tool
//! doubles, a powercap tree, a proc root, a DCGM exporter and Alertmanager on loopback;
//! elevations from a real audit log; and the parsers under randomized input.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod cycle;
mod elevation;
mod mutation;
mod once;
#[path = "../../../testsupport/services.rs"]
mod services;
mod support;

//! The integration tests of probity-siem: real rsyslog and Alertmanager on loopback,
//! started and stopped by the tests.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod alerts;
mod format;
mod resilience;
mod rsyslog;
mod support;

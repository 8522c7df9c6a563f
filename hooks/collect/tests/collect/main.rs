//! The integration tests of probity-collect: real captures and our own fixtures from
//! testdata/fixtures, real commands, a loopback HTTP server, a temporary powercap tree, and
//! this machine's own /proc/net.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod auditd;
mod common;
mod dcgm;
mod ipmi;
mod mutation;
mod nvidia_smi;
#[path = "../../../testsupport/ports.rs"]
mod ports;
mod rapl;
mod sockets;
mod source;

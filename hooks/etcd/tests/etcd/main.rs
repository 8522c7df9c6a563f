//! Integration tests against a real etcd 3.4 (`/usr/bin/etcd`, Debian's etcd-server),
//! started and stopped by PID by the harness.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod harness;

mod backend;
mod cas;
mod cluster;
mod kv;
mod lease;
mod outage;
mod processes;
mod tls;
mod watch;

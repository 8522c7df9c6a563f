//! Probity against real Slurm (Debian's slurmctld, slurmd and munge), each test with
//! a cluster of its own in its temp directory, started and stopped by PID: jobs refused
//! at `sbatch` with Probity's message, a blocked node drained and its job requeued
//! elsewhere, an operator's drain never resumed, a failed verified read inside a job
//! requeuing it held, health findings draining and resuming.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

#[path = "../../../testsupport/slurm.rs"]
mod slurm_cluster;

mod harness;

mod controller;
mod health;
mod prolog;
mod submit;
#[path = "../../../testsupport/unix_http.rs"]
mod unix_http;

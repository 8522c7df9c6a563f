//! Probity in Slurm: the levers Slurm gives, pulled by Probity's decisions.
//!
//! - at submission, `job_submit.lua` runs `probity slurm submit` (no shell), which asks
//!   the sidecar (`POST /v1/slurm/submit`) and prints the answer the Lua reads;
//! - at job start, the Prolog runs `probity slurm prolog`: a node-level refusal drains
//!   the node with Probity's reason and fails the Prolog (Slurm requeues the job
//!   elsewhere), a job-level refusal requeues the job held (or cancels it) and leaves
//!   the node alone;
//! - `HealthCheckProgram` runs `probity slurm health`: the agent's compliance cycle,
//!   once; blocking findings drain, and a node is resumed only from Probity's own drain;
//! - `probity slurm controller run` mirrors the blocklist onto Slurm's nodes: the
//!   controller's [`Actuator`](probity_kube::controller::Actuator) implemented for Slurm.
//!
//! Code map:
//! - [`nodes`] — `scontrol show node` read into [`nodes::SlurmNode`];
//! - [`reason`] — the drain reason (`Probity: <policy>: <message>`) and its prefix;
//! - [`commands`] — `scontrol`, `squeue`, `scancel`, without a shell, under a deadline;
//! - [`client`] — the sidecar's Unix socket, standard library only;
//! - [`actuator`] — [`actuator::SlurmActuator`]: drain, resume, requeue-hold, cancel;
//! - [`controller`] — the blocklist mirrored, one active process by an etcd lease.
//!
//! Invariant (NHC's rule): Probity never resumes a node whose drain reason it did not
//! write, and never rewrites another's reason.

pub mod actuator;
pub mod client;
pub mod commands;
pub mod controller;
pub mod nodes;
pub mod reason;

pub use actuator::SlurmActuator;
pub use client::SidecarClient;
pub use commands::{JobStop, SlurmCommands};
pub use controller::{EtcdControl, SlurmController, SlurmControllerOptions};

/// What went wrong talking to Slurm or to the sidecar.
#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    /// A Slurm command failed or did not answer in time.
    #[error("{command}: {problem}")]
    Command {
        /// The command line.
        command: String,
        /// What happened.
        problem: String,
    },
    /// A Slurm command's output was not understood.
    #[error("{0}")]
    Output(String),
    /// The sidecar could not be asked.
    #[error("the sidecar at {socket}: {problem}")]
    Sidecar {
        /// Its socket.
        socket: String,
        /// What happened.
        problem: String,
    },
}

use std::sync::Arc;
use std::time::Duration;

use probity::{Clock, SystemClock};

#[cfg(doc)]
use super::EtcdState;
use super::{BackendError, DEFAULT_OUTBOX_RETRY, DEFAULT_PROCESS_TTL, DEFAULT_READ_YOUR_WRITES};
use crate::ResyncOptions;

/// What a process follows in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// A node's sidecar: the blocklist, the manifest registry and its own node's facts.
    Sidecar {
        /// The node it serves.
        node: String,
    },
    /// An admission webhook or scheduler extender replica: the blocklist and every
    /// node's facts.
    Webhook,
}

/// How an [`EtcdState`] behaves. Build with [`EtcdStateOptions::new`] and the `with_*`
/// methods; every setting not given keeps the default named in its doc.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EtcdStateOptions {
    /// What the process follows. No default.
    pub role: Role,
    /// The name this process reports its served digest under (`digests/<process>`): its
    /// host (pod) name and role, e.g. `probity-webhook-7d9f-x2/webhook`. No default.
    pub process: String,
    /// See [`DEFAULT_READ_YOUR_WRITES`].
    pub read_your_writes: Duration,
    /// When a disconnected watch reads everything again instead of resuming.
    pub resync: ResyncOptions,
    /// See [`DEFAULT_PROCESS_TTL`].
    pub process_ttl: Duration,
    /// See [`DEFAULT_OUTBOX_RETRY`].
    pub outbox_retry: Duration,
    /// The clock the local logs stamp their records with: the engine's, so that a
    /// decision's record carries the time the engine decided at. Default: the system
    /// clock.
    pub clock: Arc<dyn Clock>,
}

impl EtcdStateOptions {
    /// Options for `role`, reporting as `process`, everything else at its default.
    pub fn new(role: Role, process: impl Into<String>) -> Self {
        Self {
            role,
            process: process.into(),
            read_your_writes: DEFAULT_READ_YOUR_WRITES,
            resync: ResyncOptions::default(),
            process_ttl: DEFAULT_PROCESS_TTL,
            outbox_retry: DEFAULT_OUTBOX_RETRY,
            clock: Arc::new(SystemClock),
        }
    }

    /// Sets the clock of the local logs (pass the engine's).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Sets the read-your-writes bound.
    pub fn with_read_your_writes(mut self, bound: Duration) -> Self {
        self.read_your_writes = bound;
        self
    }

    /// Sets the watches' resync options.
    pub fn with_resync(mut self, resync: ResyncOptions) -> Self {
        self.resync = resync;
        self
    }

    /// Sets the TTL of the process lease.
    pub fn with_process_ttl(mut self, ttl: Duration) -> Self {
        self.process_ttl = ttl;
        self
    }

    /// Sets the outbox retry pause.
    pub fn with_outbox_retry(mut self, pause: Duration) -> Self {
        self.outbox_retry = pause;
        self
    }

    pub(super) fn validate(&self) -> Result<(), BackendError> {
        let bad = |field, problem: &str| BackendError::Options {
            field,
            problem: problem.to_owned(),
        };
        let name_ok = |s: &str| !s.is_empty() && s.len() <= 253 && !s.contains(['/', '\0']);
        if let Role::Sidecar { node } = &self.role
            && !name_ok(node)
        {
            return Err(bad(
                "node",
                "a sidecar needs its node's name (1-253 bytes, no '/')",
            ));
        }
        if !name_ok(&self.process) {
            return Err(bad("process", "must be 1-253 bytes without '/'"));
        }
        for (field, d) in [
            ("read_your_writes", self.read_your_writes),
            ("process_ttl", self.process_ttl),
            ("outbox_retry", self.outbox_retry),
        ] {
            if d.is_zero() {
                return Err(bad(field, "must be more than zero"));
            }
        }
        Ok(())
    }
}

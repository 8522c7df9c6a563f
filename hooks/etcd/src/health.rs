//! Is this process still hearing from etcd, and since when not?
//!
//! Why this module exists: a Probity server answers from a snapshot that watches keep current.
//! When etcd goes quiet the snapshot does not fail, it ages; readiness must say by how much
//! ("serving from state 12 s old") rather than pretend. Every response from etcd (a reply, a
//! watch event, a watch progress notification, a lease renewal) marks the client as heard
//! from; a round in which no endpoint answered marks it disconnected.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Shared by a client and everything made from it.
#[derive(Debug)]
pub(crate) struct HealthState {
    epoch: Instant,
    connected: AtomicBool,
    /// Nanoseconds after `epoch` of the last response; 0 = never.
    last_heard: AtomicU64,
    revision: AtomicI64,
    last_error: Mutex<Option<String>>,
}

impl HealthState {
    pub(crate) fn new() -> Self {
        Self {
            epoch: Instant::now(),
            connected: AtomicBool::new(false),
            last_heard: AtomicU64::new(0),
            revision: AtomicI64::new(0),
            last_error: Mutex::new(None),
        }
    }

    /// etcd answered, at `revision` when the answer had a header.
    pub(crate) fn heard(&self, revision: Option<i64>) {
        let nanos = u64::try_from(self.epoch.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1);
        self.last_heard.fetch_max(nanos, Ordering::Relaxed);
        if let Some(rev) = revision {
            self.revision.fetch_max(rev, Ordering::Relaxed);
        }
        if !self.connected.swap(true, Ordering::Relaxed) {
            tracing::info!("etcd reachable again");
        }
    }

    /// No endpoint answered; `error` says why.
    pub(crate) fn failed(&self, error: String) {
        if self.connected.swap(false, Ordering::Relaxed) {
            tracing::warn!(%error, "etcd unreachable");
        }
        if let Ok(mut last) = self.last_error.lock() {
            *last = Some(error);
        }
    }

    pub(crate) fn report(&self) -> Health {
        let nanos = self.last_heard.load(Ordering::Relaxed);
        let since_last_heard = (nanos != 0).then(|| {
            self.epoch
                .elapsed()
                .saturating_sub(Duration::from_nanos(nanos))
        });
        Health {
            connected: self.connected.load(Ordering::Relaxed),
            since_last_heard,
            revision: self.revision.load(Ordering::Relaxed),
            last_error: self.last_error.lock().ok().and_then(|e| e.clone()),
        }
    }
}

/// A client's view of its link to etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// Whether the last exchange with etcd succeeded.
    pub connected: bool,
    /// Time since etcd last answered anything; `None` if it never has.
    pub since_last_heard: Option<Duration>,
    /// Highest revision seen in any response (0 before the first).
    pub revision: i64,
    /// The last failure, flattened, if any (kept after recovery, for diagnosis).
    pub last_error: Option<String>,
}

impl Health {
    /// Whether the state this client serves may be trusted as at most `max_age` old.
    pub fn is_fresh(&self, max_age: Duration) -> bool {
        self.connected && self.since_last_heard.is_some_and(|age| age <= max_age)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_client_has_never_heard_and_is_not_fresh() {
        let h = HealthState::new();
        let r = h.report();
        assert!(!r.connected);
        assert_eq!(r.since_last_heard, None);
        assert!(!r.is_fresh(Duration::from_secs(3600)));
        h.heard(Some(7));
        h.heard(Some(5));
        let r = h.report();
        assert!(r.connected);
        assert_eq!(r.revision, 7);
        assert!(r.is_fresh(Duration::from_secs(3600)));
        h.failed("down".into());
        let r = h.report();
        assert!(!r.connected);
        assert_eq!(r.last_error.as_deref(), Some("down"));
        assert!(r.since_last_heard.is_some());
    }
}

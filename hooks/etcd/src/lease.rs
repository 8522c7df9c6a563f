//! Leases: facts that vanish with the agent that published them.
//!
//! Why this module exists: a node agent publishes its node's facts under a lease and keeps the
//! lease alive while it runs. If the agent dies, or loses etcd for longer than the lease's
//! TTL, etcd deletes the facts itself and every watcher sees them go: a dead agent's facts
//! expire instead of lingering as if fresh.
//!
//! [`KeepAlive`] renews a lease from a background task, at a third of its TTL, moving to
//! another endpoint when one fails. It stops when dropped (the lease then expires after its
//! TTL, or at once with [`EtcdClient::revoke_lease`]). Once etcd says the lease is gone the
//! task reports [`LeaseState::expired`] and stops: the owner must grant a new lease and
//! publish again.

use std::fmt;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::client::{EtcdClient, Retry};
use crate::error::{AttemptError, EtcdError, Operation};

/// Shortest renewal interval.
const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(100);

/// An etcd lease id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub i64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// A granted lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Its id.
    pub id: LeaseId,
    /// The TTL etcd granted (etcd may raise a short TTL to its minimum, 1.5 election
    /// timeouts).
    pub ttl: Duration,
}

/// What a [`KeepAlive`] knows about its lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseState {
    /// Successful renewals so far.
    pub renewals: u64,
    /// When the last renewal was acknowledged.
    pub last_renewed: Option<Instant>,
    /// The TTL etcd restarted at the last renewal.
    pub ttl: Duration,
    /// etcd said the lease no longer exists: its keys are gone. Final.
    pub expired: bool,
    /// The last renewal failure, if the last attempt failed.
    pub last_error: Option<String>,
}

/// Renews a lease in the background until dropped.
#[derive(Debug)]
pub struct KeepAlive {
    lease: Lease,
    state: watch::Receiver<LeaseState>,
    task: tokio::task::JoinHandle<()>,
}

impl KeepAlive {
    /// The lease kept alive.
    pub fn lease(&self) -> Lease {
        self.lease
    }

    /// The latest state.
    pub fn state(&self) -> LeaseState {
        self.state.borrow().clone()
    }

    /// Waits until etcd reports the lease gone.
    pub async fn expired(&mut self) {
        // An Err means the task ended, which it does only after reporting expiry (or when
        // this handle is dropped, which cannot be while borrowed).
        let _ = self.state.wait_for(|s| s.expired).await;
    }

    /// Waits until the state satisfies `f` (renewal count, error...).
    pub async fn wait_for(&mut self, f: impl FnMut(&LeaseState) -> bool) -> LeaseState {
        let reached = self.state.wait_for(f).await.map(|s| s.clone()).ok();
        reached.unwrap_or_else(|| self.state.borrow().clone())
    }

    /// Stops renewing (as dropping does).
    pub fn stop(self) {}
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl EtcdClient {
    /// Grants a lease of `ttl` (rounded up to whole seconds, at least one).
    pub async fn grant_lease(&self, ttl: Duration) -> Result<Lease, EtcdError> {
        let seconds = i64::try_from(ttl.as_secs())
            .unwrap_or(i64::MAX)
            .saturating_add(i64::from(ttl.subsec_nanos() > 0))
            .max(1);
        let resp = self
            .run(
                Operation::LeaseGrant,
                "",
                Retry::Always,
                |mut c| async move { c.lease_grant(seconds, None).await },
            )
            .await?;
        Ok(Lease {
            id: LeaseId(resp.id()),
            ttl: Duration::from_secs(u64::try_from(resp.ttl()).unwrap_or(0)),
        })
    }

    /// Revokes `lease`, deleting its keys at once. `false` if it did not exist (any more).
    pub async fn revoke_lease(&self, lease: LeaseId) -> Result<bool, EtcdError> {
        let result = self
            .run(
                Operation::LeaseRevoke,
                "",
                Retry::Always,
                |mut c| async move { c.lease_revoke(lease.0).await },
            )
            .await;
        match result {
            Ok(_) => Ok(true),
            Err(EtcdError::Request { source, .. }) if is_lease_not_found(&source) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The time `lease` has left, `None` if it does not exist (any more).
    pub async fn lease_time_to_live(&self, lease: LeaseId) -> Result<Option<Duration>, EtcdError> {
        let resp = self
            .run(
                Operation::LeaseTimeToLive,
                "",
                Retry::Always,
                |mut c| async move { c.lease_time_to_live(lease.0, None).await },
            )
            .await?;
        // etcd answers -1 for a lease it does not know.
        Ok(u64::try_from(resp.ttl()).ok().map(Duration::from_secs))
    }

    /// Starts renewing `lease` in the background; see the module docs.
    pub fn keep_alive(&self, lease: Lease) -> KeepAlive {
        let (tx, rx) = watch::channel(LeaseState {
            renewals: 0,
            last_renewed: None,
            ttl: lease.ttl,
            expired: false,
            last_error: None,
        });
        let client = self.clone();
        let task = tokio::spawn(async move { renew_loop(client, lease, tx).await });
        KeepAlive {
            lease,
            state: rx,
            task,
        }
    }
}

fn is_lease_not_found(e: &AttemptError) -> bool {
    e.to_string().contains("lease not found")
}

async fn renew_loop(client: EtcdClient, lease: Lease, state: watch::Sender<LeaseState>) {
    let inner = &*client.inner;
    let interval = (lease.ttl / 3).max(MIN_RENEW_INTERVAL);
    let timeout = inner
        .config
        .request_timeout
        .min(interval.max(MIN_RENEW_INTERVAL));
    let count = inner.members.len();
    let mut backoff = MIN_RENEW_INTERVAL;
    let fail = |error: String| {
        state.send_modify(|s| s.last_error = Some(error));
    };
    let renewed = |ttl: i64| {
        inner.health.heard(None);
        state.send_modify(|s| {
            s.renewals = s.renewals.saturating_add(1);
            s.last_renewed = Some(Instant::now());
            s.ttl = Duration::from_secs(u64::try_from(ttl).unwrap_or(0));
            s.last_error = None;
        });
    };
    let expire = || state.send_modify(|s| s.expired = true);
    loop {
        let index = inner.current.load(Ordering::Relaxed) % count.max(1);
        let Some(member) = inner.members.get(index) else {
            return;
        };
        let mut lease_client = member.client.lease_client();
        match tokio::time::timeout(timeout, lease_client.keep_alive(lease.id.0)).await {
            Ok(Ok((mut keeper, mut stream))) => {
                // Opening the stream renewed the lease once.
                renewed(lease.ttl.as_secs().try_into().unwrap_or(i64::MAX));
                backoff = MIN_RENEW_INTERVAL;
                loop {
                    tokio::time::sleep(interval).await;
                    if let Err(e) = keeper.keep_alive().await {
                        fail(format!(
                            "{}: {}",
                            member.url,
                            crate::client::describe_error(&e)
                        ));
                        break;
                    }
                    match tokio::time::timeout(timeout, stream.message()).await {
                        Ok(Ok(Some(resp))) if resp.ttl() <= 0 => {
                            expire();
                            return;
                        }
                        Ok(Ok(Some(resp))) => renewed(resp.ttl()),
                        Ok(Ok(None)) => {
                            fail(format!("{}: keep-alive stream closed", member.url));
                            break;
                        }
                        Ok(Err(e)) => {
                            fail(format!(
                                "{}: {}",
                                member.url,
                                crate::client::describe_error(&e)
                            ));
                            break;
                        }
                        Err(_) => {
                            fail(format!(
                                "{}: no keep-alive answer within {timeout:?}",
                                member.url
                            ));
                            break;
                        }
                    }
                }
            }
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(m))) if m.contains("not found") => {
                expire();
                return;
            }
            Ok(Err(e)) => fail(format!(
                "{}: {}",
                member.url,
                crate::client::describe_error(&e)
            )),
            Err(_) => fail(format!(
                "{}: no keep-alive answer within {timeout:?}",
                member.url
            )),
        }
        inner
            .current
            .store((index + 1) % count.max(1), Ordering::Relaxed);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(interval);
    }
}

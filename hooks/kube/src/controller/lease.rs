//! One active replica: a `coordination.k8s.io/v1` Lease.
//!
//! Expiry is judged on this process's own monotonic clock (how long the holder's record
//! has gone unchanged), never by comparing another replica's `renewTime` with ours, so
//! skewed clocks cannot make two leaders. Every write carries the `resourceVersion` it
//! read, so of two replicas racing for an expired lease one wins.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};

use super::ControllerError;

/// A replica's hold on the Lease.
pub struct LeaseLock {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
    observed: Mutex<Observed>,
}

#[derive(Default)]
struct Observed {
    /// The lease record's resourceVersion when last read, and when it was first seen.
    record: Option<(String, Instant)>,
    /// When this replica last renewed (it leads until `renewed + duration`).
    renewed: Option<Instant>,
}

impl LeaseLock {
    /// A lock on Lease `name` in `api`'s namespace, held as `identity` for `duration`.
    pub fn new(api: Api<Lease>, name: &str, identity: &str, duration: Duration) -> Self {
        Self {
            api,
            name: name.to_owned(),
            identity: identity.to_owned(),
            duration,
            observed: Mutex::new(Observed::default()),
        }
    }

    /// The identity it holds the lease as.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Whether this replica leads now: it renewed within the lease's duration, less a
    /// margin for the time a write takes to be seen.
    pub fn leads(&self) -> bool {
        let observed = self.observed.lock().unwrap_or_else(|p| p.into_inner());
        observed
            .renewed
            .is_some_and(|at| at.elapsed() < self.duration.mul_f32(0.8))
    }

    /// Whether a renewal is due (a third of the duration since the last one).
    pub fn renewal_due(&self) -> bool {
        let observed = self.observed.lock().unwrap_or_else(|p| p.into_inner());
        observed
            .renewed
            .is_none_or(|at| at.elapsed() >= self.duration / 3)
    }

    /// Takes or renews the lease if it may; answers whether this replica leads.
    pub async fn try_hold(&self) -> Result<bool, ControllerError> {
        // Leadership counts from before the read: a slow answer shortens it, never
        // stretches it past what a waiting replica allows.
        let asked = Instant::now();
        let now = MicroTime(jiff::Timestamp::now());
        let seconds = i32::try_from(self.duration.as_secs().max(1)).unwrap_or(i32::MAX);
        let current = self
            .api
            .get_opt(&self.name)
            .await
            .map_err(|e| ControllerError::kube(format!("reading lease {}", self.name), e))?;
        let Some(mut lease) = current else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(seconds),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return self
                .settle(self.api.create(&PostParams::default(), &lease).await, asked)
                .await;
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let version = lease.metadata.resource_version.clone().unwrap_or_default();
        if holder != self.identity && !holder.is_empty() {
            let expired = {
                let mut observed = self.observed.lock().unwrap_or_else(|p| p.into_inner());
                observed.renewed = None;
                match &observed.record {
                    Some((seen, since)) if *seen == version => {
                        let held_for = spec
                            .lease_duration_seconds
                            .and_then(|s| u64::try_from(s).ok())
                            .map_or(self.duration, Duration::from_secs);
                        since.elapsed() > held_for
                    }
                    _ => {
                        observed.record = Some((version, Instant::now()));
                        false
                    }
                }
            };
            if !expired {
                return Ok(false);
            }
        }
        if holder != self.identity {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
            spec.holder_identity = Some(self.identity.clone());
        }
        spec.renew_time = Some(now);
        spec.lease_duration_seconds = Some(seconds);
        let written = self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await;
        self.settle(written, asked).await
    }

    async fn settle(
        &self,
        written: Result<Lease, kube::Error>,
        asked: Instant,
    ) -> Result<bool, ControllerError> {
        let mut observed = self.observed.lock().unwrap_or_else(|p| p.into_inner());
        match written {
            Ok(lease) => {
                let version = lease.metadata.resource_version.unwrap_or_default();
                observed.record = Some((version, Instant::now()));
                observed.renewed = Some(asked);
                Ok(true)
            }
            // Another replica wrote first: it leads.
            Err(kube::Error::Api(status)) if status.code == 409 => {
                observed.renewed = None;
                Ok(false)
            }
            Err(e) => Err(ControllerError::kube(
                format!("writing lease {}", self.name),
                e,
            )),
        }
    }

    /// Gives the lease up (on shutdown), so another replica takes over at once.
    pub async fn release(&self) {
        if !self.leads() {
            return;
        }
        if let Ok(Some(mut lease)) = self.api.get_opt(&self.name).await
            && let Some(spec) = lease.spec.as_mut()
            && spec.holder_identity.as_deref() == Some(self.identity.as_str())
        {
            spec.holder_identity = None;
            let _ = self
                .api
                .replace(&self.name, &PostParams::default(), &lease)
                .await;
        }
        let mut observed = self.observed.lock().unwrap_or_else(|p| p.into_inner());
        observed.renewed = None;
    }
}

//! `migrate`: work moved out of a zone at its ceiling, a bounded number of pods per
//! window, while the zone's agents ask for it.
//!
//! A node agent whose policy raises a `migrate` obligation on its zone publishes a
//! request to Probity's shared state; it lapses with the agent and is withdrawn when
//! the finding clears. Each pass reads the live requests (`GET /v1/actions/migrate`)
//! and, per zone asked, evicts at most `pods_per_window` pods per `window_seconds`
//! (the policy's `@param_`s, else the controller's flags) from the nodes labelled with
//! that zone: never a DaemonSet's pod, a mirror pod or one already terminating; first
//! the pods whose `order_annotation` (default `probity.io/migrate-priority`) holds the
//! highest integer, ties and pods without it by namespace and name. The order is the
//! policy's to name; the controller only sorts by it.
//!
//! Safety: the window's count is written to the shared state before the first eviction
//! (a failover keeps the bound), and what did not evict is given back after; an
//! eviction a disruption budget refuses is retried with back-off and reported, never
//! turned into a delete; a dry run asks the apiserver with `dryRun=All` and counts
//! nothing; nothing more leaves a zone whose requests are gone, and its window is kept
//! until it closes (a request that lapses and returns does not reset the bound); a
//! paused controller does nothing here.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use probity_base::error::chain as error_chain;
use serde::{Deserialize, Serialize};

use super::plan::{self, ActionRecord};
use super::source::ProbityApi;
use super::{Actuator, Controller, ControllerError, Outcome, PodRef, StateStore, unix_now};

/// The annotation that orders a zone's pods when the policy names none.
pub const DEFAULT_ORDER_ANNOTATION: &str = "probity.io/migrate-priority";

/// The bound and window when a policy gives none (`--migrate-per-window`,
/// `--migrate-window-seconds`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrateLimits {
    /// Pods evicted from a zone per window, at most.
    pub per_window: u32,
    /// The window.
    pub window: Duration,
}

impl Default for MigrateLimits {
    fn default() -> Self {
        Self {
            per_window: 2,
            window: Duration::from_secs(300),
        }
    }
}

/// A zone's window, in the shared state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrateWindow {
    /// When the window opened, in Unix seconds.
    pub start: u64,
    /// Evictions counted in it (reserved before acting, given back when they failed).
    pub evicted: u32,
    /// Its length in seconds, as asked when it opened.
    #[serde(default)]
    pub seconds: u64,
}

impl MigrateWindow {
    /// Whether it still bounds evictions at `now`.
    pub fn is_open(&self, now: u64) -> bool {
        now < self.start.saturating_add(self.seconds)
    }
}

/// A live `migrate` request as Probity's API lists it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct MigrateRequest {
    /// The zone.
    pub target: String,
    /// The policy that asked.
    pub policy: String,
    /// Its message.
    #[serde(default)]
    pub reason: String,
    /// The node whose agent asked.
    pub node: String,
    /// The policy's parameters.
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// From a policy in warn or audit mode: report what would be moved, move nothing.
    #[serde(default, rename = "dryRun")]
    pub dry_run: bool,
}

/// What a zone is asked, all its requests together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZoneAsk {
    /// Pods per window: the smallest any request asks.
    pub per_window: u32,
    /// The window in seconds: the longest any request asks.
    pub window_seconds: u64,
    /// The annotation that orders pods (the first request's, by policy and node).
    pub order_annotation: String,
    /// Why: the requests' policies and nodes.
    pub reason: String,
    /// Every request is a dry run (from warn or audit policies): evictions go with
    /// `dryRun=All` and count against no window. One enforcing request makes it real.
    pub dry_run: bool,
}

/// The zones asked, from the live requests; a parameter a policy gives but that does
/// not parse falls back to `limits`, and the strictest of several requests wins.
pub fn zone_asks(requests: &[MigrateRequest], limits: &MigrateLimits) -> BTreeMap<String, ZoneAsk> {
    let mut sorted: Vec<&MigrateRequest> = requests.iter().collect();
    sorted.sort_by(|a, b| (&a.target, &a.policy, &a.node).cmp(&(&b.target, &b.policy, &b.node)));
    let mut asks: BTreeMap<String, ZoneAsk> = BTreeMap::new();
    for r in sorted {
        let per_window = r
            .parameters
            .get("pods_per_window")
            .and_then(|v| v.parse().ok())
            .unwrap_or(limits.per_window);
        let window_seconds = r
            .parameters
            .get("window_seconds")
            .and_then(|v| v.parse().ok())
            .filter(|&s| s > 0)
            .unwrap_or(limits.window.as_secs().max(1));
        let order = r
            .parameters
            .get("order_annotation")
            .cloned()
            .unwrap_or_else(|| DEFAULT_ORDER_ANNOTATION.to_owned());
        let why = format!("{} (node {})", r.policy, r.node);
        asks.entry(r.target.clone())
            .and_modify(|a| {
                a.per_window = a.per_window.min(per_window);
                a.window_seconds = a.window_seconds.max(window_seconds);
                a.reason = format!("{}, {why}", a.reason);
                a.dry_run = a.dry_run && r.dry_run;
            })
            .or_insert(ZoneAsk {
                per_window,
                window_seconds,
                order_annotation: order,
                reason: why,
                dry_run: r.dry_run,
            });
    }
    asks
}

/// The zone's window at `now` (a new one once the last has run its length) and how
/// many evictions it still allows.
pub fn window_at(
    previous: Option<&MigrateWindow>,
    ask: &ZoneAsk,
    now: u64,
) -> (MigrateWindow, u32) {
    let window = match previous {
        Some(w) if w.is_open(now) => w.clone(),
        _ => MigrateWindow {
            start: now,
            evicted: 0,
            seconds: ask.window_seconds,
        },
    };
    let left = ask.per_window.saturating_sub(window.evicted);
    (window, left)
}

/// Forgets the windows of zones no longer asked once they close. Nothing leaves a zone
/// no longer asked; its window is kept while open, so a request that lapses and comes
/// back within it does not reset the bound.
pub fn forget_closed(
    windows: &mut BTreeMap<String, MigrateWindow>,
    asks: &BTreeMap<String, ZoneAsk>,
    now: u64,
) {
    windows.retain(|zone, w| asks.contains_key(zone) || w.is_open(now));
}

/// A pod that may be moved, with its place in the policy's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The pod.
    pub pod: PodRef,
    /// Its node.
    pub node: String,
    /// The order annotation's value as an integer (absent or not an integer: last).
    pub priority: Option<i64>,
}

/// Sorts candidates in the policy's order: highest priority first, pods without one
/// last, ties by namespace and name.
pub fn order(candidates: &mut [Candidate]) {
    candidates.sort_by(|a, b| {
        b.priority
            .cmp(&a.priority)
            .then_with(|| a.pod.namespace.cmp(&b.pod.namespace))
            .then_with(|| a.pod.name.cmp(&b.pod.name))
    });
}

/// A pod's candidate, unless a drain would leave it (a DaemonSet's, a mirror pod, one
/// terminating).
pub(super) fn candidate(pod: Pod, node: &str, order_annotation: &str) -> Option<Candidate> {
    let meta = &pod.metadata;
    let daemon = meta
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "DaemonSet");
    let annotations = meta.annotations.as_ref();
    let mirror = annotations.is_some_and(|a| a.contains_key("kubernetes.io/config.mirror"));
    if daemon || mirror || meta.deletion_timestamp.is_some() {
        return None;
    }
    let priority = annotations
        .and_then(|a| a.get(order_annotation))
        .and_then(|v| v.trim().parse().ok());
    Some(Candidate {
        pod: PodRef {
            namespace: pod.metadata.namespace?,
            name: pod.metadata.name?,
            uid: pod.metadata.uid,
            node: Some(node.to_owned()),
        },
        node: node.to_owned(),
        priority,
    })
}

impl ProbityApi {
    /// The live `migrate` requests (`GET /v1/actions/migrate`).
    pub async fn migrate_requests(&self) -> Result<Vec<MigrateRequest>, ControllerError> {
        #[derive(Deserialize)]
        struct Answer {
            requests: Vec<MigrateRequest>,
        }
        const PATH: &str = "/v1/actions/migrate";
        let body = self.get(PATH).await?;
        let answer: Answer =
            serde_json::from_slice(&body).map_err(|e| ControllerError::Probity {
                what: format!("GET {PATH}"),
                reason: format!("the answer is not a list of requests: {e}"),
            })?;
        Ok(answer.requests)
    }
}

impl Controller {
    /// Carries out the live `migrate` requests (module docs); after the pass, under the
    /// modes it read.
    pub(super) async fn migrate(&self, dry_run: bool) -> Result<(), ControllerError> {
        let requests = self.probity.migrate_requests().await?;
        let asks = zone_asks(&requests, &self.options.migrate);
        let read = self.shared.load().await?;
        if read.state.paused {
            return Ok(());
        }
        let now = unix_now();
        let mut state = read.state.clone();
        forget_closed(&mut state.migrations, &asks, now);
        let mut plans: Vec<(String, ZoneAsk, Vec<Candidate>)> = Vec::new();
        for (zone, ask) in &asks {
            let (mut window, left) = window_at(state.migrations.get(zone), ask, now);
            let chosen = if left == 0 {
                Vec::new()
            } else {
                let mut candidates = self.zone_pods(zone, &ask.order_annotation).await?;
                // Pods whose eviction a budget refused wait for their back-off.
                candidates.retain(|c| {
                    let key = format!("{}/{}", c.pod.namespace, c.pod.name);
                    state.stopping.get(&key).is_none_or(|b| b.next <= now)
                });
                order(&mut candidates);
                candidates.truncate(usize::try_from(left).unwrap_or(usize::MAX));
                candidates
            };
            if !(dry_run || ask.dry_run) {
                window.evicted = window
                    .evicted
                    .saturating_add(u32::try_from(chosen.len()).unwrap_or(u32::MAX));
            }
            state.migrations.insert(zone.clone(), window);
            if !chosen.is_empty() {
                plans.push((zone.clone(), ask.clone(), chosen));
            }
        }
        // The counts are reserved before anything is evicted.
        if state != read.state && !self.shared.store(&read, &state).await? {
            return Ok(());
        }
        if plans.is_empty() {
            return Ok(());
        }
        let mut records = Vec::new();
        let mut refunds: BTreeMap<String, u32> = BTreeMap::new();
        let mut backoffs = BTreeMap::new();
        let mut cleared = Vec::new();
        for (zone, ask, chosen) in &plans {
            // This zone's evictions are dry runs when the controller's mode says so, or
            // when only warn or audit policies ask.
            let dry_run = dry_run || ask.dry_run;
            for c in chosen {
                if !self.lease.leads() {
                    *refunds.entry(zone.clone()).or_default() += 1;
                    continue;
                }
                let key = format!("{}/{}", c.pod.namespace, c.pod.name);
                let reason = format!("Probity moves work out of zone {zone}: {}", ask.reason);
                let note = |outcome: &str, detail: String| ActionRecord {
                    at: now,
                    node: c.node.clone(),
                    action: "migrate".into(),
                    outcome: if dry_run {
                        "would".into()
                    } else {
                        outcome.into()
                    },
                    detail,
                };
                let (record, evicted) = match self.actuator.stop_pod(&c.pod, &reason, dry_run).await
                {
                    Ok(Outcome::Done) => {
                        cleared.push(key.clone());
                        (
                            note("done", format!("{key} evicted from zone {zone}")),
                            true,
                        )
                    }
                    Ok(outcome) => (
                        note(outcome.as_str(), format!("{key}: gone before its eviction")),
                        false,
                    ),
                    Err(ControllerError::Disrupted { message, .. }) => {
                        let backoff = plan::Backoff::refused(state.stopping.get(&key), now);
                        let record = note(
                            "disrupted",
                            format!(
                                "{key}: eviction refused ({message}); retried at {}",
                                backoff.next
                            ),
                        );
                        if !dry_run {
                            backoffs.insert(key.clone(), backoff);
                        }
                        (record, false)
                    }
                    Err(error) => {
                        self.metrics.error();
                        (note("failed", error_chain(&error)), false)
                    }
                };
                if !evicted && !dry_run {
                    *refunds.entry(zone.clone()).or_default() += 1;
                }
                tracing::info!(
                    zone,
                    node = record.node,
                    outcome = record.outcome,
                    detail = record.detail,
                    "migrate"
                );
                self.metrics.action(&record.action, &record.outcome);
                records.push(record);
            }
        }
        let known = |r: &ActionRecord| {
            read.state.report.iter().any(|k| {
                k.node == r.node
                    && k.action == r.action
                    && k.outcome == r.outcome
                    && k.detail == r.detail
            })
        };
        // A dry run's record says "would".
        let dry = |r: &ActionRecord| r.outcome == "would";
        if records.iter().all(|r| dry(r) && known(r)) {
            return Ok(());
        }
        let done: Vec<ActionRecord> = records.iter().filter(|r| !dry(r)).cloned().collect();
        let unlogged = if self.options.record_events && !done.is_empty() {
            let (sent, error) = self.probity.record_events(&done).await;
            if let Some(error) = error {
                self.metrics.error();
                tracing::warn!(error = %error_chain(&error), "migrations could not be appended to Probity's event log: kept for the next pass");
            }
            done.iter().skip(sent).cloned().collect()
        } else {
            Vec::new()
        };
        self.shared
            .update(|s| {
                for (zone, refund) in &refunds {
                    if let Some(w) = s.migrations.get_mut(zone) {
                        w.evicted = w.evicted.saturating_sub(*refund);
                    }
                }
                for key in &cleared {
                    s.stopping.remove(key);
                }
                s.stopping
                    .extend(backoffs.iter().map(|(k, b)| (k.clone(), b.clone())));
                // A dry run says what it would do once, not on every pass.
                let fresh: Vec<ActionRecord> = records
                    .iter()
                    .filter(|r| {
                        !dry(r)
                            || !s.report.iter().any(|k| {
                                k.node == r.node
                                    && k.action == r.action
                                    && k.outcome == r.outcome
                                    && k.detail == r.detail
                            })
                    })
                    .cloned()
                    .collect();
                s.record(fresh);
                s.unlogged.extend(unlogged.iter().cloned());
            })
            .await?;
        Ok(())
    }

    /// The pods that may be moved out of `zone`: on the nodes labelled with it.
    async fn zone_pods(
        &self,
        zone: &str,
        order_annotation: &str,
    ) -> Result<Vec<Candidate>, ControllerError> {
        let label = &self.options.zone_label;
        let nodes: Vec<String> = self
            .nodes
            .state()
            .iter()
            .filter(|n| {
                n.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(label))
                    .is_some_and(|z| z == zone)
            })
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        self.actuator.movable_work(&nodes, order_annotation).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(zone: &str, node: &str, params: &[(&str, &str)]) -> MigrateRequest {
        MigrateRequest {
            target: zone.into(),
            policy: "thermal.zone-power-ceiling".into(),
            reason: String::new(),
            node: node.into(),
            parameters: params
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            dry_run: false,
        }
    }

    #[test]
    fn a_zone_asked_only_by_dry_runs_is_a_dry_run_and_one_enforcing_ask_makes_it_real() {
        let limits = MigrateLimits::default();
        let mut dry = request("z1", "n1", &[]);
        dry.dry_run = true;
        assert!(zone_asks(std::slice::from_ref(&dry), &limits)["z1"].dry_run);
        let real = request("z1", "n2", &[]);
        assert!(!zone_asks(&[dry, real], &limits)["z1"].dry_run);
    }

    fn pod(name: &str, priority: Option<i64>) -> Candidate {
        Candidate {
            pod: PodRef {
                namespace: "training".into(),
                name: name.into(),
                uid: None,
                node: Some("gpu-1".into()),
            },
            node: "gpu-1".into(),
            priority,
        }
    }

    #[test]
    fn the_policys_parameters_set_the_bound_and_the_strictest_request_wins() {
        let limits = MigrateLimits::default();
        let asks = zone_asks(
            &[
                request(
                    "z1",
                    "gpu-1",
                    &[("pods_per_window", "3"), ("window_seconds", "60")],
                ),
                request(
                    "z1",
                    "gpu-2",
                    &[("pods_per_window", "1"), ("window_seconds", "30")],
                ),
                request("z2", "gpu-9", &[("pods_per_window", "many")]),
            ],
            &limits,
        );
        assert_eq!((asks["z1"].per_window, asks["z1"].window_seconds), (1, 60));
        assert_eq!(asks["z1"].order_annotation, DEFAULT_ORDER_ANNOTATION);
        // A parameter that does not parse falls back to the controller's flags.
        assert_eq!((asks["z2"].per_window, asks["z2"].window_seconds), (2, 300));
    }

    #[test]
    fn a_window_allows_its_bound_and_a_new_window_starts_after_its_length() {
        let ask = zone_asks(&[request("z1", "gpu-1", &[])], &MigrateLimits::default())
            .remove("z1")
            .unwrap();
        let (w, left) = window_at(None, &ask, 1_000);
        assert_eq!((w.start, left), (1_000, 2));
        let used = MigrateWindow {
            start: 1_000,
            evicted: 2,
            seconds: 300,
        };
        assert_eq!(window_at(Some(&used), &ask, 1_299).1, 0);
        let (w, left) = window_at(Some(&used), &ask, 1_300);
        assert_eq!((w.start, w.evicted, left), (1_300, 0, 2));
    }

    #[test]
    fn a_request_that_lapses_and_returns_within_the_window_does_not_reset_its_bound() {
        let limits = MigrateLimits::default();
        let asked = zone_asks(&[request("z1", "gpu-1", &[])], &limits);
        let mut windows = BTreeMap::from([(
            "z1".to_owned(),
            MigrateWindow {
                start: 1_000,
                evicted: 2,
                seconds: 300,
            },
        )]);
        forget_closed(&mut windows, &BTreeMap::new(), 1_100);
        assert_eq!(window_at(windows.get("z1"), &asked["z1"], 1_101).1, 0);
        forget_closed(&mut windows, &BTreeMap::new(), 1_300);
        assert!(windows.is_empty());
    }

    #[test]
    fn pods_go_in_the_annotations_order_highest_first_ties_and_unannotated_by_name() {
        let mut pods = vec![
            pod("c", None),
            pod("b", Some(5)),
            pod("a", None),
            pod("z", Some(10)),
            pod("a5", Some(5)),
        ];
        order(&mut pods);
        let names: Vec<&str> = pods.iter().map(|c| c.pod.name.as_str()).collect();
        assert_eq!(names, ["z", "a5", "b", "a", "c"]);
    }

    #[test]
    fn a_daemonsets_mirror_or_terminating_pod_is_never_a_candidate() {
        let make = |extra: serde_json::Value| -> Pod {
            let mut pod = serde_json::json!({"metadata": {"name": "p", "namespace": "n",
                "annotations": {DEFAULT_ORDER_ANNOTATION: "7"}}});
            if let (Some(meta), Some(extra)) = (pod["metadata"].as_object_mut(), extra.as_object())
            {
                meta.extend(extra.clone());
            }
            serde_json::from_value(pod).unwrap()
        };
        let plain = candidate(
            make(serde_json::json!({})),
            "gpu-1",
            DEFAULT_ORDER_ANNOTATION,
        );
        assert_eq!(plain.unwrap().priority, Some(7));
        let daemon = serde_json::json!({"ownerReferences": [{"apiVersion": "apps/v1",
            "kind": "DaemonSet", "name": "d", "uid": "u"}]});
        let mirror = serde_json::json!({"annotations": {"kubernetes.io/config.mirror": "x"}});
        let going = serde_json::json!({"deletionTimestamp": "2026-01-01T00:00:00Z"});
        for extra in [daemon, mirror, going] {
            assert!(
                candidate(make(extra.clone()), "gpu-1", DEFAULT_ORDER_ANNOTATION).is_none(),
                "{extra}"
            );
        }
    }
}

//! One reconcile pass, decided without I/O: what Probity's blocklist asks, what the
//! nodes carry, and what the breaker, the pause and the tombstones allow.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::breaker::{BreakerLimits, BreakerState, Pool, Trip};

/// Most action records the report keeps (oldest dropped first).
pub const MAX_REPORT: usize = 200;

/// A block as Probity's blocklist holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockMark {
    /// What blocked the node first (a policy id, an operator's note).
    pub reason: String,
    /// When it was first blocked, in Unix seconds: the block record's revision.
    pub since: u64,
    /// The pod that read the data that failed verification, when the block came from
    /// such a read and the reader named itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reader: Option<ReaderPod>,
    /// What the block's policy says to stop: `reader` (the reading pod) or `node`
    /// (the reading pod first, then every pod on the node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<String>,
    /// The taint effect the block's policy opted into (`NoExecute`), else the settings'.
    #[serde(
        default,
        rename = "taintEffect",
        skip_serializing_if = "Option::is_none"
    )]
    pub taint_effect: Option<String>,
}

/// A pod as a reader names itself in a verified read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReaderPod {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its uid, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

impl BlockMark {
    /// A block with no reader, no stop and the settings' taint.
    pub fn new(reason: impl Into<String>, since: u64) -> Self {
        Self {
            reason: reason.into(),
            since,
            reader: None,
            stop: None,
            taint_effect: None,
        }
    }
}

/// What the controller finds on a node it set itself (its annotation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppliedMark {
    /// The block record acted on.
    #[serde(flatten)]
    pub block: BlockMark,
    /// Whether Probity added the taint (false: it was there already, and stays on release).
    #[serde(rename = "taintAdded")]
    pub taint_added: bool,
    /// The taint's effect as set (a policy may have opted into `NoExecute`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<String>,
}

/// A node as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// The Node's name.
    pub name: String,
    /// What Probity set on it, as its shared state records (never read from the node:
    /// a node may edit its own annotations).
    pub applied: Option<AppliedMark>,
    /// Whether it carries a taint with Probity's key now.
    pub has_taint: bool,
    /// The pools the node belongs to.
    pub pools: Vec<Pool>,
}

/// One step of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Taint the node and mark it.
    Block {
        /// The node.
        node: String,
        /// The record acted on.
        block: BlockMark,
        /// What the node carries once done (also in the shared state).
        mark: AppliedMark,
    },
    /// The node is blocked already: its mark names a newer record, or its taint went
    /// missing (removed by hand), and is set again.
    Refresh {
        /// The node.
        node: String,
        /// The record acted on.
        block: BlockMark,
        /// What the node carries once done (also in the shared state).
        mark: AppliedMark,
    },
    /// Remove what Probity set.
    Release {
        /// The node.
        node: String,
        /// What Probity had set.
        applied: AppliedMark,
    },
    /// A block the breaker refused.
    Refused {
        /// The node.
        node: String,
        /// Why.
        trip: Trip,
    },
    /// A block record not newer than the node's last release: not acted on.
    Stale {
        /// The node.
        node: String,
        /// The record.
        block: BlockMark,
        /// The revision of the block last released.
        released: u64,
    },
    /// Stop the node's work as the block record says (once it is tainted).
    StopWork {
        /// The node.
        node: String,
        /// The record whose stop it carries out.
        block: BlockMark,
    },
}

impl Step {
    /// The node it is about.
    pub fn node(&self) -> &str {
        match self {
            Step::Block { node, .. }
            | Step::Refresh { node, .. }
            | Step::Release { node, .. }
            | Step::Refused { node, .. }
            | Step::Stale { node, .. }
            | Step::StopWork { node, .. } => node,
        }
    }

    /// The action's name in reports and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Step::Block { .. } | Step::Refused { .. } | Step::Stale { .. } => "block",
            Step::Refresh { .. } => "refresh",
            Step::Release { .. } => "release",
            Step::StopWork { .. } => "stop",
        }
    }
}

/// One action, as the report keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionRecord {
    /// When, in Unix seconds.
    pub at: u64,
    /// The node.
    pub node: String,
    /// `block`, `refresh` or `release`.
    pub action: String,
    /// `done`, `unchanged`, `failed`, `refused` (the breaker), `stale`, or `would` (dry run).
    pub outcome: String,
    /// The block's reason, the breaker's, or the error.
    pub detail: String,
}

/// The controller's state in the cluster's shared state (a ConfigMap): the pause, the
/// dry run, the breaker, the tombstones and the report. Every replica reads it afresh
/// on each pass, so a failover or an operator's command takes effect at the next one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlState {
    /// Acts on nothing while set.
    #[serde(default)]
    pub paused: bool,
    /// Records what it would do, changes nothing.
    #[serde(default, rename = "dryRun")]
    pub dry_run: bool,
    /// The circuit breaker.
    #[serde(default)]
    pub breaker: BreakerState,
    /// Per node, the revision (`since`) of the last block released: a record not newer
    /// is stale (a lagging replica, a replayed event) and never acted on.
    #[serde(default)]
    pub tombstones: BTreeMap<String, u64>,
    /// The last actions taken, refused or failed, oldest first.
    #[serde(default)]
    pub report: Vec<ActionRecord>,
    /// Per node, what Probity set on it (the taint, whether it added it, the record): the
    /// only source of what a release may remove.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub applied: BTreeMap<String, AppliedMark>,
    /// Per node, the revision (`since`) of the block whose work was stopped: a block's
    /// work is stopped once.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub stopped: BTreeMap<String, u64>,
    /// Evictions refused for now (a disruption budget), by `namespace/name`: retried
    /// with back-off, and deleted only past the operator's escalation timeout.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub stopping: BTreeMap<String, Backoff>,
    /// Actions not yet appended to Probity's event log (it was unreachable), oldest
    /// first; sent again with the next pass's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unlogged: Vec<ActionRecord>,
    /// In a dry run: what the last pass would have done.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub would: Vec<ActionRecord>,
    /// Per zone asked to `migrate`, the window and its evictions (see `migrate.rs`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub migrations: BTreeMap<String, super::migrate::MigrateWindow>,
}

/// An eviction being retried.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backoff {
    /// The first attempt, in Unix seconds.
    pub first: u64,
    /// Attempts so far.
    pub attempts: u32,
    /// No attempt before this, in Unix seconds.
    pub next: u64,
}

impl Backoff {
    /// After one more refused attempt at `now`: the wait doubles, up to a minute.
    pub fn refused(previous: Option<&Backoff>, now: u64) -> Backoff {
        let attempts = previous.map_or(0, |b| b.attempts).saturating_add(1);
        Backoff {
            first: previous.map_or(now, |b| b.first),
            attempts,
            next: now + (1u64 << attempts.min(6)).min(60),
        }
    }
}

impl ControlState {
    /// Appends records to the report, keeping the newest [`MAX_REPORT`].
    pub fn record(&mut self, records: impl IntoIterator<Item = ActionRecord>) {
        self.report.extend(records);
        let excess = self.report.len().saturating_sub(MAX_REPORT);
        self.report.drain(..excess);
    }
}

/// Plans one pass: the steps, with the breaker's admissions and the tombstones of the
/// releases already written into `state` (which is written back before anything acts,
/// so a crash after acting never forgets what the breaker counted). A paused controller
/// plans nothing. Blocks of nodes the cluster does not have are left alone.
pub fn plan(
    blocks: &BTreeMap<String, BlockMark>,
    nodes: &[NodeView],
    state: &mut ControlState,
    limits: &BreakerLimits,
    settings_effect: &str,
    now: u64,
) -> Vec<Step> {
    if state.paused {
        return Vec::new();
    }
    let mut pool_sizes: BTreeMap<Pool, usize> = BTreeMap::new();
    for node in nodes {
        for pool in &node.pools {
            *pool_sizes.entry(pool.clone()).or_default() += 1;
        }
    }
    let mut steps = Vec::new();
    for node in nodes {
        let wanted = blocks.get(&node.name);
        match (wanted, &node.applied) {
            (Some(block), applied) => {
                if let Some(&released) = state.tombstones.get(&node.name)
                    && block.since <= released
                {
                    steps.push(Step::Stale {
                        node: node.name.clone(),
                        block: block.clone(),
                        released,
                    });
                    continue;
                }
                let effect = block
                    .taint_effect
                    .clone()
                    .unwrap_or_else(|| settings_effect.to_owned());
                let tainted = match applied {
                    Some(applied) if applied.block == *block && node.has_taint => true,
                    Some(applied) => {
                        // Whether Probity added the taint stays as first decided while the
                        // taint is there; a taint gone missing is Probity's to add again.
                        let mark = AppliedMark {
                            block: block.clone(),
                            taint_added: applied.taint_added || !node.has_taint,
                            effect: Some(effect),
                        };
                        state.applied.insert(node.name.clone(), mark.clone());
                        steps.push(Step::Refresh {
                            node: node.name.clone(),
                            block: block.clone(),
                            mark,
                        });
                        true
                    }
                    None => {
                        match state
                            .breaker
                            .admit(limits, &node.name, &node.pools, &pool_sizes, now)
                        {
                            Ok(()) => {
                                // A taint found already there is someone else's: it stays
                                // on release.
                                let mark = AppliedMark {
                                    block: block.clone(),
                                    taint_added: !node.has_taint,
                                    effect: Some(effect),
                                };
                                state.applied.insert(node.name.clone(), mark.clone());
                                steps.push(Step::Block {
                                    node: node.name.clone(),
                                    block: block.clone(),
                                    mark,
                                });
                                true
                            }
                            Err(trip) => {
                                steps.push(Step::Refused {
                                    node: node.name.clone(),
                                    trip,
                                });
                                false
                            }
                        }
                    }
                };
                // A node's work is stopped only on a node the breaker let be blocked,
                // and once per block record.
                if tainted
                    && block.stop.is_some()
                    && state.stopped.get(&node.name) != Some(&block.since)
                {
                    steps.push(Step::StopWork {
                        node: node.name.clone(),
                        block: block.clone(),
                    });
                }
            }
            (None, Some(applied)) => {
                let released = state.tombstones.entry(node.name.clone()).or_default();
                *released = (*released).max(applied.block.since);
                steps.push(Step::Release {
                    node: node.name.clone(),
                    applied: applied.clone(),
                });
            }
            (None, None) => {}
        }
    }
    // Tombstones of nodes the cluster no longer has are forgotten with them, and
    // stops of blocks no longer in force.
    state
        .tombstones
        .retain(|name, _| nodes.iter().any(|n| &n.name == name));
    state.stopped.retain(|name, _| blocks.contains_key(name));
    state
        .applied
        .retain(|name, _| nodes.iter().any(|n| &n.name == name));
    // An eviction retried for a day (reported at every attempt) is given up, so the
    // shared state stays bounded.
    state
        .stopping
        .retain(|_, b| now.saturating_sub(b.first) < 86_400);
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, applied: Option<(&str, u64)>) -> NodeView {
        NodeView {
            name: name.into(),
            has_taint: applied.is_some(),
            applied: applied.map(|(reason, since)| AppliedMark {
                block: mark(reason, since),
                taint_added: true,
                effect: None,
            }),
            pools: vec![("zone".into(), "a".into())],
        }
    }

    fn mark(reason: &str, since: u64) -> BlockMark {
        BlockMark::new(reason, since)
    }

    fn limits() -> BreakerLimits {
        BreakerLimits {
            max_nodes: 2,
            max_percent: 100,
            window_secs: 600,
        }
    }

    #[test]
    fn blocks_what_is_blocked_releases_what_is_not_and_leaves_the_rest() {
        let blocks = BTreeMap::from([("n1".into(), mark("r", 10)), ("n2".into(), mark("r", 11))]);
        let nodes = [
            node("n1", None),
            node("n2", Some(("r", 11))),
            node("n3", Some(("r", 5))),
            node("n4", None),
        ];
        let mut state = ControlState::default();
        let steps = plan(&blocks, &nodes, &mut state, &limits(), "NoSchedule", 100);
        assert_eq!(
            steps,
            vec![
                Step::Block {
                    node: "n1".into(),
                    block: mark("r", 10),
                    mark: AppliedMark {
                        block: mark("r", 10),
                        taint_added: true,
                        effect: Some("NoSchedule".into()),
                    },
                },
                Step::Release {
                    node: "n3".into(),
                    applied: AppliedMark {
                        block: mark("r", 5),
                        taint_added: true,
                        effect: None,
                    }
                },
            ]
        );
        assert_eq!(state.tombstones.get("n3"), Some(&5));
        assert_eq!(state.breaker.admitted.len(), 1);
        // The mark is in the shared state before anything acts.
        assert_eq!(state.applied.get("n1").map(|m| m.taint_added), Some(true));
    }

    #[test]
    fn a_taint_removed_by_hand_is_set_again_and_a_taint_found_is_not_probitys() {
        let blocks = BTreeMap::from([("n1".into(), mark("r", 10))]);
        let mut gone = node("n1", Some(("r", 10)));
        gone.has_taint = false;
        let mut state = ControlState::default();
        let steps = plan(&blocks, &[gone], &mut state, &limits(), "NoSchedule", 100);
        assert!(matches!(&steps[..], [Step::Refresh { mark, .. }] if mark.taint_added));
        // An operator's taint with Probity's key, there before the block: not Probity's.
        let mut found = node("n1", None);
        found.has_taint = true;
        let mut state = ControlState::default();
        let steps = plan(&blocks, &[found], &mut state, &limits(), "NoSchedule", 100);
        assert!(matches!(&steps[..], [Step::Block { mark, .. }] if !mark.taint_added));
    }

    #[test]
    fn a_block_not_newer_than_the_last_release_is_stale() {
        let mut state = ControlState::default();
        state.tombstones.insert("n1".into(), 10);
        let blocks = BTreeMap::from([("n1".into(), mark("r", 10))]);
        let steps = plan(
            &blocks,
            &[node("n1", None)],
            &mut state,
            &limits(),
            "NoSchedule",
            100,
        );
        assert!(matches!(&steps[..], [Step::Stale { released: 10, .. }]));
        // A block made after the release is acted on.
        let blocks = BTreeMap::from([("n1".into(), mark("r", 11))]);
        let steps = plan(
            &blocks,
            &[node("n1", None)],
            &mut state,
            &limits(),
            "NoSchedule",
            100,
        );
        assert!(matches!(&steps[..], [Step::Block { .. }]));
    }

    #[test]
    fn the_breaker_refuses_past_its_limit() {
        let blocks: BTreeMap<String, BlockMark> =
            (1..=4).map(|i| (format!("n{i}"), mark("r", 10))).collect();
        let nodes: Vec<NodeView> = (1..=4).map(|i| node(&format!("n{i}"), None)).collect();
        let mut state = ControlState::default();
        let steps = plan(&blocks, &nodes, &mut state, &limits(), "NoSchedule", 100);
        let kinds: Vec<bool> = steps
            .iter()
            .map(|s| matches!(s, Step::Block { .. }))
            .collect();
        assert_eq!(kinds, [true, true, false, false]);
        assert!(state.breaker.tripped.is_some());
    }

    #[test]
    fn a_blocks_work_is_stopped_once_and_only_on_a_node_the_breaker_admitted() {
        let stopping = |since| BlockMark {
            stop: Some("reader".into()),
            ..mark("read failed", since)
        };
        let blocks = BTreeMap::from([("n1".into(), stopping(10)), ("n2".into(), stopping(10))]);
        let nodes = [node("n1", None), node("n2", None)];
        let limits = BreakerLimits {
            max_nodes: 1,
            ..limits()
        };
        let mut state = ControlState::default();
        let steps = plan(&blocks, &nodes, &mut state, &limits, "NoSchedule", 100);
        let kinds: Vec<&str> = steps.iter().map(|s| s.kind()).collect();
        assert_eq!(kinds, ["block", "stop", "block"]);
        assert!(matches!(&steps[2], Step::Refused { .. }));
        // Once stopped, the same record is not stopped again; a newer one is.
        state.stopped.insert("n1".into(), 10);
        let applied = |since| NodeView {
            applied: Some(AppliedMark {
                block: stopping(since),
                taint_added: true,
                effect: None,
            }),
            has_taint: true,
            ..node("n1", None)
        };
        let only_n1 = BTreeMap::from([("n1".into(), stopping(10))]);
        let mut fresh = ControlState {
            stopped: state.stopped.clone(),
            ..ControlState::default()
        };
        assert!(
            plan(
                &only_n1,
                &[applied(10)],
                &mut fresh,
                &limits,
                "NoSchedule",
                100
            )
            .is_empty()
        );
        let newer = BTreeMap::from([("n1".into(), stopping(20))]);
        let kinds: Vec<&'static str> = plan(
            &newer,
            &[applied(10)],
            &mut fresh,
            &limits,
            "NoSchedule",
            100,
        )
        .iter()
        .map(|s| s.kind())
        .collect();
        assert_eq!(kinds, ["refresh", "stop"]);
    }

    #[test]
    fn a_refused_eviction_waits_longer_each_time_up_to_a_minute() {
        let first = Backoff::refused(None, 100);
        assert_eq!((first.first, first.attempts, first.next), (100, 1, 102));
        let mut b = first;
        for _ in 0..10 {
            b = Backoff::refused(Some(&b), 200);
        }
        assert_eq!((b.first, b.attempts, b.next), (100, 11, 260));
    }

    #[test]
    fn paused_plans_nothing() {
        let blocks = BTreeMap::from([("n1".into(), mark("r", 10))]);
        let mut state = ControlState {
            paused: true,
            ..ControlState::default()
        };
        assert!(
            plan(
                &blocks,
                &[node("n1", None)],
                &mut state,
                &limits(),
                "NoSchedule",
                1
            )
            .is_empty()
        );
    }

    #[test]
    fn the_report_keeps_the_newest_records() {
        let mut state = ControlState::default();
        state.record((0..MAX_REPORT as u64 + 5).map(|at| ActionRecord {
            at,
            node: "n".into(),
            action: "block".into(),
            outcome: "done".into(),
            detail: String::new(),
        }));
        assert_eq!(state.report.len(), MAX_REPORT);
        assert_eq!(state.report.first().map(|r| r.at), Some(5));
    }
}

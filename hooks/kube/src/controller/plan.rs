//! One reconcile pass, decided without I/O: what Probity's blocklist asks, what the
//! nodes carry, and what the breaker, the pause and the tombstones allow.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::breaker::{BreakerLimits, BreakerState, Pool, Trip};

/// A block record's `stop` that drains the node (every pod a drain stops).
pub const STOP_NODE: &str = "node";

/// Most action records the report keeps (oldest dropped first).
pub const MAX_REPORT: usize = 200;

/// A block as Probity's blocklist holds it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BlockMark {
    /// What blocked the node first (a policy id, an operator's note).
    pub reason: String,
    /// When it was first blocked, in Unix seconds.
    pub since: u64,
    /// The block's number in Probity's state store, monotonic across its blocks and
    /// unblocks (etcd's create revision, or the local store's counter); absent from a
    /// Probity without a store, whose blocks are numbered by their time
    /// ([`BlockMark::number`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
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
    /// The later blocks of the node while it stayed blocked, as Probity's answer gives
    /// them: read for the pods that read bad data since (each is stopped like the
    /// first reader), never written to the shared state or the node's annotation (32
    /// entries a node would not fit a ConfigMap at scale), and not part of what makes
    /// two marks the same block.
    #[serde(default, skip_serializing)]
    pub history: Vec<LaterBlock>,
}

impl PartialEq for BlockMark {
    /// The same block, as set on a node: every field but the later blocks' history.
    fn eq(&self, other: &Self) -> bool {
        self.reason == other.reason
            && self.since == other.since
            && self.revision == other.revision
            && self.reader == other.reader
            && self.stop == other.stop
            && self.taint_effect == other.taint_effect
    }
}

impl Eq for BlockMark {}

/// A later block of a blocked node, as far as the controller reads it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct LaterBlock {
    /// The pod that read bad data this time, if it named itself.
    #[serde(default)]
    pub reader: Option<ReaderPod>,
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

impl ReaderPod {
    /// `namespace/name`: how the stopped readers are kept.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
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
            revision: None,
            history: Vec::new(),
        }
    }

    /// The pods that read bad data on the node, the first block's reader first, then
    /// the later blocks' in order.
    pub fn readers(&self) -> impl Iterator<Item = &ReaderPod> {
        self.reader
            .iter()
            .chain(self.history.iter().filter_map(|h| h.reader.as_ref()))
    }

    /// Whether `other` is this same block: the same store number when both have one;
    /// else (a block in force before its store numbered it, a record from before
    /// numbers) the same first reason and time. Store numbers and times are never
    /// compared with each other.
    pub fn same_block(&self, other: &BlockMark) -> bool {
        match (self.revision, other.revision) {
            (Some(a), Some(b)) => a == b,
            _ => self.reason == other.reason && self.since == other.since,
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
    /// The taint's key as set (the settings may name another later).
    #[serde(default, rename = "taintKey", skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

impl AppliedMark {
    /// The taint this mark set, `(key, effect)`; a mark from before they were
    /// recorded set the settings'.
    pub fn taint(&self, settings: &TaintSpec) -> (String, String) {
        (
            self.key.clone().unwrap_or_else(|| settings.key.clone()),
            self.effect
                .clone()
                .unwrap_or_else(|| settings.effect.clone()),
        )
    }
}

/// The taint Probity's settings name for a blocked node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaintSpec {
    /// Its key.
    pub key: String,
    /// Its effect, unless a block record opts into another.
    pub effect: String,
}

/// A node as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// The Node's name.
    pub name: String,
    /// What Probity set on it, as its shared state records (never read from the node:
    /// a node may edit its own annotations).
    pub applied: Option<AppliedMark>,
    /// The taints it carries now, `(key, effect)`.
    pub taints: Vec<(String, String)>,
    /// The pools the node belongs to.
    pub pools: Vec<Pool>,
}

impl NodeView {
    /// Whether it carries `taint` now.
    pub fn carries(&self, taint: &(String, String)) -> bool {
        self.taints.contains(taint)
    }
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
        /// The mark whose taint this one replaces (the settings' or the record's taint
        /// changed, and Probity had added the old one): removed in the same change.
        replaces: Option<Box<AppliedMark>>,
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
    /// Per node, the time (`since`) of the last block released that no store numbered:
    /// such a record not newer is stale (a lagging replica, a replayed event) and is not
    /// acted on unless Probity keeps answering it (clocks disagree).
    #[serde(default)]
    pub tombstones: BTreeMap<String, u64>,
    /// Per node, the store number ([`BlockMark::revision`]) of the last numbered block
    /// released: a numbered record not above it is a replay (a restored backup, a
    /// lagging answer) and is never acted on. Kept apart from `tombstones` (times):
    /// the two kinds of number are never compared.
    #[serde(default, rename = "releasedRevisions")]
    pub released_revisions: BTreeMap<String, u64>,
    /// The last actions taken, refused or failed, oldest first.
    #[serde(default)]
    pub report: Vec<ActionRecord>,
    /// Per node, what Probity set on it (the taint, whether it added it, the record): the
    /// only source of what a release may remove.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub applied: BTreeMap<String, AppliedMark>,
    /// Per node, the block whose work was stopped, and the readers stopped: a block's
    /// work is stopped once, and a later reader of bad data on the node too.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub stopped: BTreeMap<String, StoppedBlock>,
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

impl ControlState {
    /// The readers of `block` already stopped on `node`, once its stop was carried out;
    /// `None` while it was not.
    pub fn readers_stopped(&self, node: &str, block: &BlockMark) -> Option<BTreeSet<String>> {
        match self.stopped.get(node)? {
            // Written before readers were kept: the first reader was stopped.
            StoppedBlock::Number(n) => (*n == block.since || Some(*n) == block.revision)
                .then(|| block.reader.iter().map(ReaderPod::key).collect()),
            StoppedBlock::Block {
                reason,
                since,
                revision,
                readers,
            } => {
                let stopped = BlockMark {
                    revision: *revision,
                    ..BlockMark::new(reason.clone(), *since)
                };
                stopped.same_block(block).then(|| readers.clone())
            }
        }
    }

    /// Whether `block` is one the node's last release already lifted: numbered no
    /// higher than the last numbered block released, or (unnumbered) made no later than
    /// the last unnumbered one. The number it is judged against.
    pub fn released(&self, node: &str, block: &BlockMark) -> Option<u64> {
        match block.revision {
            Some(revision) => self
                .released_revisions
                .get(node)
                .copied()
                .filter(|&released| revision <= released),
            None => self
                .tombstones
                .get(node)
                .copied()
                .filter(|&released| block.since <= released),
        }
    }
}

/// A block whose work was stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StoppedBlock {
    /// As a state written before the readers were kept says it: the block's number.
    Number(u64),
    /// The block (as [`BlockMark::same_block`] tells it) and its readers stopped
    /// (`namespace/name`).
    Block {
        /// Its first reason.
        reason: String,
        /// Its first time.
        since: u64,
        /// Its store number, when it had one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        revision: Option<u64>,
        /// The readers stopped, `namespace/name` (at most the record's 33).
        #[serde(default)]
        readers: BTreeSet<String>,
    },
}

impl StoppedBlock {
    /// `block`, its work stopped, with `readers`.
    pub fn of(block: &BlockMark, readers: BTreeSet<String>) -> Self {
        StoppedBlock::Block {
            reason: block.reason.clone(),
            since: block.since,
            revision: block.revision,
            readers,
        }
    }
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

/// Drops from `blocks` each record Probity's store has lifted since: its revision is
/// not above its node's unblock tombstone from the same answer (Probity's memory lags
/// its store). The nodes dropped.
pub fn drop_lifted(
    blocks: &mut BTreeMap<String, BlockMark>,
    tombstones: &BTreeMap<String, u64>,
) -> Vec<String> {
    let mut dropped = Vec::new();
    blocks.retain(|node, block| {
        let lifted = matches!(
            (block.revision, tombstones.get(node)),
            (Some(revision), Some(&unblocked)) if revision <= unblocked
        );
        if lifted {
            dropped.push(node.clone());
        }
        !lifted
    });
    dropped
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
    settings: &TaintSpec,
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
                if let Some(released) = state.released(&node.name, block) {
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
                    .unwrap_or_else(|| settings.effect.clone());
                let wanted = (settings.key.clone(), effect);
                let carries = node.carries(&wanted);
                let mut drain_refused = false;
                let tainted = match applied {
                    Some(applied)
                        if applied.block == *block
                            && carries
                            && applied.taint(settings) == wanted =>
                    {
                        true
                    }
                    Some(applied) => {
                        // The taint the settings or the record name changed: Probity's
                        // old one goes in the same change, someone else's stays.
                        let (old_key, old_effect) = applied.taint(settings);
                        let moved = (old_key.as_str(), old_effect.as_str())
                            != (wanted.0.as_str(), wanted.1.as_str());
                        let replaces = (moved && applied.taint_added).then(|| {
                            Box::new(AppliedMark {
                                key: Some(old_key),
                                effect: Some(old_effect),
                                ..applied.clone()
                            })
                        });
                        // Whether Probity added the taint stays as first decided while the
                        // taint is there; a taint gone missing is Probity's to add again.
                        let taint_added = if moved {
                            !carries
                        } else {
                            applied.taint_added || !carries
                        };
                        // A newer record that asks for a drain is a new disruption: the
                        // breaker counts it as it counts a new block.
                        if block.stop.as_deref() == Some(STOP_NODE)
                            && !applied.block.same_block(block)
                            && let Err(trip) = state.breaker.admit(
                                limits,
                                &node.name,
                                &node.pools,
                                &pool_sizes,
                                now,
                            )
                        {
                            steps.push(Step::Refused {
                                node: node.name.clone(),
                                trip,
                            });
                            drain_refused = true;
                        }
                        let mark = AppliedMark {
                            block: block.clone(),
                            taint_added,
                            effect: Some(wanted.1.clone()),
                            key: Some(wanted.0.clone()),
                        };
                        state.applied.insert(node.name.clone(), mark.clone());
                        steps.push(Step::Refresh {
                            node: node.name.clone(),
                            block: block.clone(),
                            mark,
                            replaces,
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
                                    taint_added: !carries,
                                    effect: Some(wanted.1.clone()),
                                    key: Some(wanted.0.clone()),
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
                // A node's work is stopped only on a node the breaker let be blocked (and
                // drained), and once per block record.
                let readers_stopped = state.readers_stopped(&node.name, block);
                if tainted
                    && !drain_refused
                    && block.stop.is_some()
                    && readers_stopped
                        .is_none_or(|done| block.readers().any(|r| !done.contains(&r.key())))
                {
                    steps.push(Step::StopWork {
                        node: node.name.clone(),
                        block: block.clone(),
                    });
                }
            }
            (None, Some(applied)) => {
                let (released, number) = match applied.block.revision {
                    Some(revision) => (&mut state.released_revisions, revision),
                    None => (&mut state.tombstones, applied.block.since),
                };
                let released = released.entry(node.name.clone()).or_default();
                *released = (*released).max(number);
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
    state
        .released_revisions
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
            taints: applied.iter().map(|_| taint()).collect(),
            applied: applied.map(|(reason, since)| AppliedMark {
                block: mark(reason, since),
                taint_added: true,
                effect: None,
                key: None,
            }),
            pools: vec![("zone".into(), "a".into())],
        }
    }

    fn taint() -> (String, String) {
        ("probity.io/blocked".into(), "NoSchedule".into())
    }

    fn settings() -> TaintSpec {
        TaintSpec {
            key: "probity.io/blocked".into(),
            effect: "NoSchedule".into(),
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
        let steps = plan(&blocks, &nodes, &mut state, &limits(), &settings(), 100);
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
                        key: Some("probity.io/blocked".into()),
                    },
                },
                Step::Release {
                    node: "n3".into(),
                    applied: AppliedMark {
                        block: mark("r", 5),
                        taint_added: true,
                        effect: None,
                        key: None,
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
        gone.taints.clear();
        let mut state = ControlState::default();
        let steps = plan(&blocks, &[gone], &mut state, &limits(), &settings(), 100);
        assert!(matches!(&steps[..], [Step::Refresh { mark, .. }] if mark.taint_added));
        // An operator's taint with Probity's key, there before the block: not Probity's.
        let mut found = node("n1", None);
        found.taints = vec![taint()];
        let mut state = ControlState::default();
        let steps = plan(&blocks, &[found], &mut state, &limits(), &settings(), 100);
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
            &settings(),
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
            &settings(),
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
        let steps = plan(&blocks, &nodes, &mut state, &limits(), &settings(), 100);
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
        let steps = plan(&blocks, &nodes, &mut state, &limits, &settings(), 100);
        let kinds: Vec<&str> = steps.iter().map(|s| s.kind()).collect();
        assert_eq!(kinds, ["block", "stop", "block"]);
        assert!(matches!(&steps[2], Step::Refused { .. }));
        // Once stopped, the same record is not stopped again; a newer one is.
        // (As a state written before the readers were kept says it.)
        state.stopped.insert("n1".into(), StoppedBlock::Number(10));
        let applied = |since| NodeView {
            applied: Some(AppliedMark {
                block: stopping(since),
                taint_added: true,
                effect: None,
                key: None,
            }),
            taints: vec![taint()],
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
                &settings(),
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
            &settings(),
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
                &settings(),
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

    #[test]
    fn a_record_probitys_store_has_lifted_since_is_dropped_and_a_newer_one_kept() {
        let numbered = |revision| BlockMark {
            revision: Some(revision),
            ..mark("blocked", 1_700_000_000)
        };
        let mut blocks = BTreeMap::from([
            ("lifted".to_owned(), numbered(7)),
            ("at-tombstone".to_owned(), numbered(9)),
            ("reblocked".to_owned(), numbered(12)),
            ("never-unblocked".to_owned(), numbered(3)),
            // No store numbered it: a tombstone cannot judge it.
            ("unnumbered".to_owned(), mark("blocked", 5)),
        ]);
        let tombstones = BTreeMap::from([
            ("lifted".to_owned(), 8),
            ("at-tombstone".to_owned(), 9),
            ("reblocked".to_owned(), 11),
            ("unnumbered".to_owned(), 10),
        ]);
        let dropped = drop_lifted(&mut blocks, &tombstones);
        assert_eq!(dropped, ["at-tombstone", "lifted"]);
        assert_eq!(
            blocks.keys().map(String::as_str).collect::<Vec<_>>(),
            ["never-unblocked", "reblocked", "unnumbered"]
        );
    }

    #[test]
    fn a_block_is_ordered_by_its_store_revision_not_its_time() {
        let mut state = ControlState::default();
        // Released: the block numbered 40 (made at a later second than the next one).
        state.released_revisions.insert("n1".into(), 40);
        let nodes = [node("n1", None)];
        let newer = BlockMark {
            revision: Some(41),
            ..mark("re-blocked", 100)
        };
        let steps = plan(
            &BTreeMap::from([("n1".to_owned(), newer)]),
            &nodes,
            &mut state,
            &limits(),
            &settings(),
            1_000,
        );
        assert!(
            matches!(steps.as_slice(), [Step::Block { .. }]),
            "{steps:?}"
        );
        let replayed = BlockMark {
            revision: Some(40),
            ..mark("old", 2_000_000_000)
        };
        let mut state = ControlState::default();
        state.released_revisions.insert("n1".into(), 40);
        let steps = plan(
            &BTreeMap::from([("n1".to_owned(), replayed.clone())]),
            &nodes,
            &mut state,
            &limits(),
            &settings(),
            1_000,
        );
        assert!(
            matches!(steps.as_slice(), [Step::Stale { released: 40, .. }]),
            "{steps:?}"
        );
        // A time tombstone (a release of a block no store numbered, or one written before
        // numbers: a Unix time, far above any store number) never judges a numbered block.
        let mut state = ControlState::default();
        state.tombstones.insert("n1".into(), 1_700_000_000);
        let steps = plan(
            &BTreeMap::from([("n1".to_owned(), replayed)]),
            &nodes,
            &mut state,
            &limits(),
            &settings(),
            1_000,
        );
        assert!(
            matches!(steps.as_slice(), [Step::Block { .. }]),
            "{steps:?}"
        );
    }

    #[test]
    fn a_changed_taint_setting_moves_probitys_taint_and_leaves_someone_elses() {
        let blocks = BTreeMap::from([("n1".into(), mark("r", 10))]);
        // Blocked under the default settings, which the mark records.
        let node = |name: &str, applied: Option<(&str, u64)>| {
            let mut view = node(name, applied);
            if let Some(applied) = view.applied.as_mut() {
                (applied.key, applied.effect) = (Some(taint().0), Some(taint().1));
            }
            view
        };
        let moved = TaintSpec {
            key: "example.com/quarantine".into(),
            effect: "NoSchedule".into(),
        };
        // Probity added the old taint: the refresh names it, to go in the same change.
        let mut state = ControlState::default();
        let steps = plan(
            &blocks,
            &[node("n1", Some(("r", 10)))],
            &mut state,
            &limits(),
            &moved,
            100,
        );
        let [Step::Refresh { mark, replaces, .. }] = &steps[..] else {
            panic!("{steps:?}");
        };
        assert_eq!(
            mark.taint(&moved),
            (moved.key.clone(), moved.effect.clone())
        );
        assert!(mark.taint_added);
        assert_eq!(
            replaces.as_ref().map(|r| r.taint(&moved)),
            Some(taint()),
            "{steps:?}"
        );
        // The node already carries the new taint and the mark names it: nothing to do.
        let mut done = node("n1", None);
        done.applied = Some(mark.clone());
        done.taints = vec![(moved.key.clone(), moved.effect.clone())];
        assert!(plan(&blocks, &[done], &mut state, &limits(), &moved, 100).is_empty());

        // An operator's taint with the old key, there before the block: it stays.
        let mut theirs = node("n1", Some(("r", 10)));
        if let Some(applied) = theirs.applied.as_mut() {
            applied.taint_added = false;
        }
        let mut state = ControlState::default();
        let steps = plan(&blocks, &[theirs], &mut state, &limits(), &moved, 100);
        assert!(
            matches!(&steps[..], [Step::Refresh { replaces: None, mark, .. }] if mark.taint_added),
            "{steps:?}"
        );

        // Only the effect changed (NoSchedule to NoExecute in the settings).
        let harder = TaintSpec {
            effect: "NoExecute".into(),
            ..settings()
        };
        let mut state = ControlState::default();
        let steps = plan(
            &blocks,
            &[node("n1", Some(("r", 10)))],
            &mut state,
            &limits(),
            &harder,
            100,
        );
        assert!(
            matches!(&steps[..], [Step::Refresh { replaces: Some(old), mark, .. }]
                if old.effect.as_deref() == Some("NoSchedule")
                    && mark.effect.as_deref() == Some("NoExecute")),
            "{steps:?}"
        );
    }

    #[test]
    fn a_newer_record_asking_for_a_drain_passes_the_breaker_first() {
        let drain = |since| BlockMark {
            stop: Some(STOP_NODE.into()),
            ..mark("read failed", since)
        };
        let blocks = BTreeMap::from([("n1".into(), drain(20))]);
        let blocked = node("n1", Some(("r", 10)));
        // The breaker tripped (by other blocks): the taint is refreshed, no drain.
        let mut state = ControlState::default();
        state.breaker.tripped = Some(Trip {
            at: 1,
            reason: "too many".into(),
            node: "n9".into(),
        });
        let steps = plan(
            &blocks,
            std::slice::from_ref(&blocked),
            &mut state,
            &limits(),
            &settings(),
            100,
        );
        let kinds: Vec<&str> = steps.iter().map(Step::kind).collect();
        assert_eq!(kinds, ["block", "refresh"], "{steps:?}");
        assert!(matches!(&steps[0], Step::Refused { .. }));
        // With room, the drain is admitted and counted.
        let mut state = ControlState::default();
        let steps = plan(&blocks, &[blocked], &mut state, &limits(), &settings(), 100);
        let kinds: Vec<&str> = steps.iter().map(Step::kind).collect();
        assert_eq!(kinds, ["refresh", "stop"], "{steps:?}");
        assert_eq!(state.breaker.admitted.len(), 1);
    }

    #[test]
    fn the_reader_of_a_later_failed_read_on_a_blocked_node_is_stopped_too() {
        let reader = |name: &str| ReaderPod {
            namespace: "train".into(),
            name: name.into(),
            uid: None,
        };
        let first = BlockMark {
            stop: Some("reader".into()),
            reader: Some(reader("llm-0")),
            revision: Some(5),
            ..mark("read failed", 10)
        };
        let applied = NodeView {
            applied: Some(AppliedMark {
                block: first.clone(),
                taint_added: true,
                effect: None,
                key: None,
            }),
            taints: vec![taint()],
            ..node("n1", None)
        };
        let mut state = ControlState::default();
        state.stopped.insert(
            "n1".into(),
            StoppedBlock::of(&first, BTreeSet::from(["train/llm-0".to_owned()])),
        );
        let blocks = BTreeMap::from([("n1".into(), first.clone())]);
        assert!(
            plan(
                &blocks,
                std::slice::from_ref(&applied),
                &mut state,
                &limits(),
                &settings(),
                100
            )
            .is_empty()
        );
        // Blocked again by another pod's failed read: the same block (no refresh of the
        // node), whose new reader is stopped.
        let again = BlockMark {
            history: vec![LaterBlock {
                reader: Some(reader("llm-1")),
            }],
            ..first
        };
        assert_eq!(again, *applied.applied.as_ref().map(|a| &a.block).unwrap());
        let blocks = BTreeMap::from([("n1".into(), again.clone())]);
        let steps = plan(
            &blocks,
            std::slice::from_ref(&applied),
            &mut state,
            &limits(),
            &settings(),
            100,
        );
        assert!(matches!(&steps[..], [Step::StopWork { .. }]), "{steps:?}");
        assert_eq!(
            again.readers().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            ["llm-0", "llm-1"]
        );
        state.stopped.insert(
            "n1".into(),
            StoppedBlock::of(&again, again.readers().map(ReaderPod::key).collect()),
        );
        assert!(
            plan(
                &blocks,
                std::slice::from_ref(&applied),
                &mut state,
                &limits(),
                &settings(),
                100
            )
            .is_empty()
        );
        // The history's oldest entry dropped (the record keeps 32) or a merge sorting a
        // lagging replica's read in before a stopped one: the readers are told apart by
        // name, not by their place, so only the one not stopped yet is stopped.
        let reordered = BlockMark {
            history: vec![
                LaterBlock {
                    reader: Some(reader("llm-2")),
                },
                LaterBlock {
                    reader: Some(reader("llm-1")),
                },
            ],
            ..again.clone()
        };
        let blocks = BTreeMap::from([("n1".into(), reordered)]);
        let steps = plan(&blocks, &[applied], &mut state, &limits(), &settings(), 100);
        assert!(matches!(&steps[..], [Step::StopWork { .. }]), "{steps:?}");
        // Neither the history nor the count reaches the node's annotation.
        let text = serde_json::to_string(&again).unwrap();
        assert!(
            !text.contains("llm-1") && !text.contains("history"),
            "{text}"
        );
    }

    #[test]
    fn a_block_numbered_by_its_store_after_it_was_acted_on_is_the_same_block() {
        // In force here before its store numbered it (a block that must not wait for
        // etcd), tainted and drained; then the watch delivers it, numbered.
        let unnumbered = BlockMark {
            stop: Some(STOP_NODE.into()),
            ..mark("read failed", 10)
        };
        let numbered = BlockMark {
            revision: Some(77),
            ..unnumbered.clone()
        };
        assert!(unnumbered.same_block(&numbered) && numbered.same_block(&unnumbered));
        let applied = NodeView {
            applied: Some(AppliedMark {
                block: unnumbered.clone(),
                taint_added: true,
                effect: None,
                key: None,
            }),
            taints: vec![taint()],
            ..node("n1", None)
        };
        let mut state = ControlState::default();
        state
            .stopped
            .insert("n1".into(), StoppedBlock::of(&unnumbered, BTreeSet::new()));
        // The breaker is full: a new block or a new drain would be refused.
        state.breaker.tripped = Some(Trip {
            at: 1,
            reason: "full".into(),
            node: "n9".into(),
        });
        let blocks = BTreeMap::from([("n1".into(), numbered)]);
        let steps = plan(&blocks, &[applied], &mut state, &limits(), &settings(), 100);
        // The mark learns the number; nothing is admitted, refused or drained again.
        assert!(
            matches!(&steps[..], [Step::Refresh { mark, replaces: None, .. }] if mark.block.revision == Some(77)),
            "{steps:?}"
        );
    }
}

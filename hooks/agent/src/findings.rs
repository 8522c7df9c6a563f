//! Findings: what a deny says is wrong, kept while it holds, and its clearing.
//!
//! Why this module exists: the agent asks the same questions every cycle, and a node that
//! runs a GPU too hot gets the same deny every 15 seconds. An operator wants one alert
//! that stays active while the condition holds and resolves when it clears, and one
//! record of when it started and ended with the facts that caused it. A finding is one
//! reason of a deny (its policy) for one subject (the node, a port range, an
//! elevation); [`Findings::reconcile`] compares a cycle's findings with the active ones
//! and says which were raised, which changed (a new message: the alert is updated, not
//! raised again) and which cleared.
//!
//! The active findings outlive the process through [`saved`]: with a state directory they
//! are saved after every cycle and taken up by the next agent, so a one-shot run
//! (`probity agent --once`, `probity slurm health`) reconciles against the last run's
//! findings exactly as the running agent does against its last cycle's.

use std::collections::BTreeMap;

use probity::{Decision, Obligation, Severity};
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub mod saved;

/// The policy id a deny without any reason is filed under (an invalid request, an
/// evaluation error outside every policy): it is still a finding.
pub const DECISION_ERROR: &str = "decision-error";

/// Which questions a finding comes from: telemetry findings clear when a cycle no longer
/// shows them; elevation findings are events and expire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// `comply` and `listen`.
    Telemetry,
    /// `elevate`.
    Elevation,
}

/// One reason of a deny, for one subject.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    /// `action|subject|policy`: what identifies it across cycles.
    pub key: String,
    /// Where it comes from.
    pub scope: Scope,
    /// `comply`, `listen` or `elevate`.
    pub action: String,
    /// The node, `tcp/8080`, or `User::"alice" at <event>`.
    pub subject: String,
    /// The policy's id.
    pub policy: String,
    /// Its severity.
    pub severity: Severity,
    /// Its message, rendered.
    pub message: String,
    /// The obligations the policy imposed.
    pub obligations: Vec<Obligation>,
    /// Errors met while deciding.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
    /// When it was first seen, in Unix seconds.
    pub since: u64,
    /// The facts that caused it.
    pub facts: Value,
}

/// What identifies a finding across cycles: `action|subject|policy`.
pub fn key_of(action: &str, subject: &str, policy: &str) -> String {
    format!("{action}|{subject}|{policy}")
}

/// The findings of one decision: one per reason of a deny; nothing for an allow.
pub fn findings_of(
    scope: Scope,
    action: &str,
    subject: &str,
    decision: &Decision,
    facts: &Value,
    now: u64,
) -> Vec<Finding> {
    if decision.is_allowed() {
        return Vec::new();
    }
    let errors: Vec<String> = decision
        .errors
        .iter()
        .map(|e| match &e.policy {
            Some(p) => format!("{p}: {}", e.message),
            None => e.message.clone(),
        })
        .collect();
    let make = |policy: &str, severity: Severity, message: String| Finding {
        key: key_of(action, subject, policy),
        scope,
        action: action.to_owned(),
        subject: subject.to_owned(),
        policy: policy.to_owned(),
        severity,
        message,
        obligations: decision
            .obligations
            .iter()
            .filter(|o| o.policy == policy)
            .cloned()
            .collect(),
        errors: errors.clone(),
        since: now,
        facts: facts.clone(),
    };
    if decision.reasons.is_empty() {
        return vec![make(
            DECISION_ERROR,
            Severity::High,
            format!("the {action} decision failed: {}", errors.join("; ")),
        )];
    }
    decision
        .reasons
        .iter()
        .map(|r| make(&r.policy, r.severity, r.message.clone()))
        .collect()
}

/// What a reconciliation found.
#[derive(Debug, Default)]
pub struct Change {
    /// New findings.
    pub raised: Vec<Finding>,
    /// Active findings whose message, severity or obligations changed: the version
    /// active before, and the new one.
    pub updated: Vec<(Finding, Finding)>,
    /// Findings that no longer hold (as they were when last active).
    pub cleared: Vec<Finding>,
}

/// The active findings.
#[derive(Debug, Default)]
pub struct Findings {
    active: BTreeMap<String, Finding>,
}

impl Findings {
    /// No finding active.
    pub fn new() -> Self {
        Self::default()
    }

    /// These findings active, as a previous agent left them (see [`saved`]): each
    /// keeps its first time, and the next reconciliation treats them as its own.
    pub fn restore(active: impl IntoIterator<Item = Finding>) -> Self {
        Self {
            active: active.into_iter().map(|f| (f.key.clone(), f)).collect(),
        }
    }

    /// Takes a cycle's findings of `scope`: those not active yet are raised, those
    /// active keep their first time (and are updated when their message changed), and
    /// active ones of the scope that the cycle no longer shows are cleared.
    pub fn reconcile(&mut self, scope: Scope, current: Vec<Finding>) -> Change {
        let mut change = Change::default();
        let mut seen: BTreeMap<String, Finding> = BTreeMap::new();
        for f in current {
            // Two reasons of one decision never share a policy; keep the first anyway.
            seen.entry(f.key.clone()).or_insert(f);
        }
        let gone: Vec<String> = self
            .active
            .iter()
            .filter(|(k, f)| f.scope == scope && !seen.contains_key(*k))
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            if let Some(f) = self.active.remove(&k) {
                change.cleared.push(f);
            }
        }
        for (k, mut f) in seen {
            match self.active.get_mut(&k) {
                Some(active) => {
                    f.since = active.since;
                    let changed = active.message != f.message
                        || active.obligations != f.obligations
                        || active.severity != f.severity;
                    let before = std::mem::replace(active, f);
                    if changed {
                        change.updated.push((before, active.clone()));
                    }
                }
                None => {
                    self.active.insert(k, f.clone());
                    change.raised.push(f);
                }
            }
        }
        change
    }

    /// Raises one finding (an event: an elevation), unless it is active already.
    pub fn raise(&mut self, f: Finding) -> Option<Finding> {
        if self.active.contains_key(&f.key) {
            return None;
        }
        self.active.insert(f.key.clone(), f.clone());
        Some(f)
    }

    /// Clears the findings of `scope` first seen at or before `before` (Unix seconds).
    pub fn expire(&mut self, scope: Scope, before: u64) -> Vec<Finding> {
        let keys: Vec<String> = self
            .active
            .iter()
            .filter(|(_, f)| f.scope == scope && f.since <= before)
            .map(|(k, _)| k.clone())
            .collect();
        keys.into_iter()
            .filter_map(|k| self.active.remove(&k))
            .collect()
    }

    /// The active findings, by key.
    pub fn active(&self) -> impl Iterator<Item = &Finding> {
        self.active.values()
    }

    /// How many are active.
    pub fn len(&self) -> usize {
        self.active.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.active.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use probity::{Effect, Reason};
    use serde_json::json;

    fn deny(policies: &[(&str, &str)]) -> Decision {
        Decision {
            decision: Effect::Deny,
            reasons: policies
                .iter()
                .map(|(p, m)| Reason {
                    policy: (*p).into(),
                    message: (*m).into(),
                    severity: Severity::High,
                })
                .collect(),
            obligations: policies
                .iter()
                .map(|(p, _)| Obligation {
                    kind: "alert".into(),
                    target: Some("Node::\"n\"".into()),
                    parameters: BTreeMap::new(),
                    policy: (*p).into(),
                })
                .collect(),
            errors: vec![],
            score: 0,
            warnings: Vec::new(),
            audit: Vec::new(),
            unrecorded: false,
        }
    }

    fn cycle(book: &mut Findings, d: &Decision, now: u64) -> Change {
        let f = findings_of(
            Scope::Telemetry,
            "comply",
            "Node::\"n\"",
            d,
            &json!({}),
            now,
        );
        book.reconcile(Scope::Telemetry, f)
    }

    #[test]
    fn a_finding_is_raised_once_kept_while_it_holds_and_cleared_when_it_goes() {
        let mut book = Findings::new();
        let c = cycle(&mut book, &deny(&[("a", "m1"), ("b", "x")]), 10);
        assert_eq!(c.raised.len(), 2);
        assert!(
            c.raised[0]
                .obligations
                .iter()
                .all(|o| o.policy == c.raised[0].policy)
        );
        let c = cycle(&mut book, &deny(&[("a", "m1"), ("b", "x")]), 20);
        assert!(c.raised.is_empty() && c.updated.is_empty() && c.cleared.is_empty());
        let c = cycle(&mut book, &deny(&[("a", "m2")]), 30);
        assert_eq!(c.updated.len(), 1);
        assert_eq!(c.updated[0].1.since, 10, "keeps its first time");
        assert_eq!(c.updated[0].0.message, "m1");
        assert_eq!(c.cleared.len(), 1);
        assert_eq!(c.cleared[0].policy, "b");
        let allow = Decision {
            decision: Effect::Allow,
            ..deny(&[])
        };
        let c = cycle(&mut book, &allow, 40);
        assert_eq!(c.cleared.len(), 1);
        assert!(book.is_empty());
    }

    #[test]
    fn restored_findings_reconcile_as_if_they_had_never_left() {
        let mut book = Findings::new();
        cycle(&mut book, &deny(&[("a", "m1"), ("b", "x")]), 10);
        let mut book = Findings::restore(book.active().cloned().collect::<Vec<_>>());
        let c = cycle(&mut book, &deny(&[("a", "m1"), ("b", "x")]), 20);
        assert!(c.raised.is_empty() && c.updated.is_empty() && c.cleared.is_empty());
        assert!(book.active().all(|f| f.since == 10));
        let mut book = Findings::restore(book.active().cloned().collect::<Vec<_>>());
        let c = cycle(&mut book, &deny(&[("a", "m2")]), 30);
        assert_eq!(c.updated.len(), 1);
        assert_eq!(c.cleared.len(), 1);
        assert_eq!(c.cleared[0].policy, "b");
    }

    #[test]
    fn a_deny_without_a_reason_is_a_finding_too() {
        let d = Decision::error("invalid context");
        let f = findings_of(Scope::Telemetry, "listen", "tcp/1", &d, &json!({}), 1);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].policy, DECISION_ERROR);
        assert!(f[0].message.contains("invalid context"));
    }

    #[test]
    fn elevation_findings_expire_and_telemetry_ones_do_not() {
        let mut book = Findings::new();
        let mut f = findings_of(
            Scope::Elevation,
            "elevate",
            "User::\"a\" at 1.000:1",
            &deny(&[("e", "m")]),
            &json!({}),
            100,
        );
        assert!(book.raise(f.remove(0)).is_some());
        cycle(&mut book, &deny(&[("t", "m")]), 100);
        assert_eq!(book.len(), 2);
        // A telemetry cycle does not clear an elevation.
        cycle(&mut book, &deny(&[("t", "m")]), 200);
        assert_eq!(book.len(), 2);
        let gone = book.expire(Scope::Elevation, 150);
        assert_eq!(gone.len(), 1);
        assert_eq!(book.len(), 1);
    }
}

use serde_json::{Value, json};

use super::Agent;
use super::reports::{EventRecord, ObligationReport};
use crate::alerts::alert_spec;
use crate::findings::Finding;

/// Events kept in memory (the last ones), for `--once` and when no state store is
/// attached.
const EVENTS_KEPT: usize = 256;

impl Agent {
    /// Carries out a raised finding's obligations; what was done, per obligation.
    pub(super) fn carry_out(&mut self, f: &Finding, out: &mut Vec<ObligationReport>) -> Vec<Value> {
        let mut done = Vec::new();
        // The kinds that alert and block are the schema's to name, not the agent's.
        let conventions = self.engine.conventions();
        for o in &f.obligations {
            let outcome = match o.kind.as_str() {
                kind if conventions.is_alert(kind) => {
                    if self.alerts.is_empty() {
                        "no alert sink configured: recorded only".to_owned()
                    } else {
                        let failed = self.alerts.fire(&alert_spec(&self.config.node, f, o));
                        if failed.is_empty() {
                            "alerted".to_owned()
                        } else {
                            self.obligation_failures += 1;
                            format!("alert not taken: {}", failed.join("; "))
                        }
                    }
                }
                kind if kind == conventions.block_obligation() => {
                    match o.target.as_deref().and_then(node_of_target) {
                        Some(node) => match self.engine.block_node(&node, &f.policy) {
                            Ok(()) => format!("blocked node {node}"),
                            Err(e) => {
                                self.obligation_failures += 1;
                                format!("block of {node} failed: {e}")
                            }
                        },
                        None => {
                            self.obligation_failures += 1;
                            format!("{kind} target {:?} is not a node", o.target)
                        }
                    }
                }
                kind if kind == probity::state::MIGRATE => {
                    let at = crate::sources::unix(self.engine.clock().now());
                    self.publish_action(f, o, at)
                }
                other => format!("{other}: not carried out by the node agent"),
            };
            done.push(json!({"kind": o.kind, "target": o.target, "outcome": outcome}));
            out.push(ObligationReport {
                finding: f.key.clone(),
                kind: o.kind.clone(),
                target: o.target.clone(),
                outcome,
            });
        }
        done
    }

    /// Resolves a cleared finding's alerts.
    pub(super) fn resolve(&mut self, f: &Finding, out: &mut Vec<ObligationReport>) -> Vec<Value> {
        let mut done = Vec::new();
        let conventions = self.engine.conventions();
        for o in f
            .obligations
            .iter()
            .filter(|o| conventions.is_alert(&o.kind))
        {
            if self.alerts.is_empty() {
                continue;
            }
            let failed = self.alerts.resolve(&alert_spec(&self.config.node, f, o));
            let outcome = if failed.is_empty() {
                "resolved".to_owned()
            } else {
                self.obligation_failures += 1;
                format!("resolve not taken: {}", failed.join("; "))
            };
            done.push(json!({"kind": o.kind, "target": o.target, "outcome": outcome}));
            out.push(ObligationReport {
                finding: f.key.clone(),
                kind: o.kind.clone(),
                target: o.target.clone(),
                outcome,
            });
        }
        done
    }

    /// Posts again the alerts of a finding this process did not raise (taken up from the
    /// state directory, still holding): the same alert, refreshed (same labels, same
    /// `since`), which this process's alerter keeps alive from now on. Without it the
    /// alert would lapse at the `endsAt` of the last process's post while the finding
    /// holds.
    pub(super) fn refresh_alerts(&mut self, f: &Finding, out: &mut Vec<ObligationReport>) {
        if self.alerts.is_empty() {
            return;
        }
        let conventions = self.engine.conventions();
        for o in f
            .obligations
            .iter()
            .filter(|o| conventions.is_alert(&o.kind))
        {
            let failed = self.alerts.fire(&alert_spec(&self.config.node, f, o));
            let outcome = if failed.is_empty() {
                "alert refreshed".to_owned()
            } else {
                self.obligation_failures += 1;
                format!("alert refresh not taken: {}", failed.join("; "))
            };
            out.push(ObligationReport {
                finding: f.key.clone(),
                kind: o.kind.clone(),
                target: o.target.clone(),
                outcome,
            });
        }
    }

    /// Updates the alerts of a finding whose message or severity changed: an alert whose
    /// labels changed (a new severity) is resolved and raised under its new labels.
    pub(super) fn update_alerts(
        &mut self,
        before: &Finding,
        after: &Finding,
        out: &mut Vec<ObligationReport>,
    ) {
        if self.alerts.is_empty() {
            return;
        }
        let conventions = self.engine.conventions();
        for o in before
            .obligations
            .iter()
            .filter(|o| conventions.is_alert(&o.kind))
        {
            let old = alert_spec(&self.config.node, before, o);
            let still = after.obligations.iter().any(|n| {
                conventions.is_alert(&n.kind)
                    && alert_spec(&self.config.node, after, n).label_set() == old.label_set()
            });
            if !still {
                let _ = self.alerts.resolve(&old);
            }
        }
        for o in after
            .obligations
            .iter()
            .filter(|o| conventions.is_alert(&o.kind))
        {
            let failed = self.alerts.fire(&alert_spec(&self.config.node, after, o));
            let outcome = if failed.is_empty() {
                "alert updated".to_owned()
            } else {
                self.obligation_failures += 1;
                format!("alert update not taken: {}", failed.join("; "))
            };
            out.push(ObligationReport {
                finding: after.key.clone(),
                kind: o.kind.clone(),
                target: o.target.clone(),
                outcome,
            });
        }
    }

    /// Records a finding or its clearing with its facts and what was done.
    pub(super) fn record(
        &mut self,
        kind: &str,
        f: &Finding,
        at: u64,
        done: Vec<Value>,
    ) -> Option<EventRecord> {
        let mut detail = serde_json::to_value(f).unwrap_or_default();
        if let Some(o) = detail.as_object_mut() {
            o.insert("carried_out".into(), Value::Array(done));
            o.insert("node".into(), json!(self.config.node));
            if kind == "finding-cleared" {
                o.insert("cleared_at".into(), json!(at));
            }
        }
        let mut seq = None;
        if let Some(log) = self.engine.log() {
            match log.record_event(&f.key, Some(&self.config.node), kind, &detail.to_string()) {
                Ok(s) => seq = Some(s),
                Err(e) => {
                    self.event_failures += 1;
                    if let Some(o) = detail.as_object_mut() {
                        o.insert("record_error".into(), json!(e.to_string()));
                    }
                }
            }
        }
        let event = EventRecord {
            seq,
            kind: kind.to_owned(),
            key: f.key.clone(),
            at,
            detail,
        };
        if self.events.len() == EVENTS_KEPT {
            self.events.pop_front();
        }
        self.events.push_back(event.clone());
        Some(event)
    }
}

/// The node id of an obligation target `Node::"id"`.
pub fn node_of_target(target: &str) -> Option<String> {
    let id = target.strip_prefix("Node::\"")?.strip_suffix('"')?;
    let unescaped = id.replace("\\\"", "\"").replace("\\\\", "\\");
    crate::config::valid_id(&unescaped).then_some(unescaped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_target_names_a_node_or_nothing() {
        assert_eq!(node_of_target("Node::\"gpu-1\"").as_deref(), Some("gpu-1"));
        assert_eq!(node_of_target("Zone::\"z\""), None);
        assert_eq!(node_of_target("Node::\"bad id\""), None);
    }
}

//! The obligations a node agent cannot carry out itself but asks of the cluster manager
//! (`migrate`: move work out of a zone), published to shared state as
//! [`ActionRequest`]s for the controller, which reads them through Probity's API.
//!
//! A request is published when its finding is raised, published again every cycle the
//! finding stays active (its TTL is the facts' staleness bound, so it lapses with an
//! agent that stops), and withdrawn when the finding clears.

use probity::state::{ActionRequest, MIGRATE, split_target};
use serde_json::{Value, json};

use super::Agent;
use super::reports::ObligationReport;
use crate::findings::Finding;
use probity::Obligation;

impl Agent {
    /// The request for a `migrate` obligation of `f` (`None`: another kind, or a target
    /// that is no entity, or whose id is not one the agent accepts).
    fn action_request(&self, f: &Finding, o: &Obligation, at: u64) -> Option<ActionRequest> {
        let ttl = self.config.collect.stale_after.as_secs().max(1);
        ActionRequest::of_obligation(o, &self.config.node, &f.message, at, ttl)
            .filter(|r| crate::config::valid_id(&r.target))
    }

    /// Publishes the request of a raised `migrate` obligation; the outcome to report.
    pub(super) fn publish_action(&mut self, f: &Finding, o: &Obligation, at: u64) -> String {
        let Some(request) = self.action_request(f, o, at) else {
            self.obligation_failures += 1;
            return format!("{} target {:?} is not an entity", o.kind, o.target);
        };
        let Some(state) = self.engine.state().cloned() else {
            self.obligation_failures += 1;
            return format!(
                "{}: no shared state attached, so the controller cannot be asked",
                o.kind
            );
        };
        match state.publish_action(&request) {
            Ok(()) => format!(
                "asked the controller to {} out of {} {}",
                o.kind, request.target_type, request.target
            ),
            Err(e) => {
                self.obligation_failures += 1;
                format!("{} request not published: {e}", o.kind)
            }
        }
    }

    /// Publishes again the requests of the findings still active (not `raised` this
    /// cycle: those were just published), so they outlive their TTL only while the
    /// agent runs and the finding holds.
    pub(super) fn refresh_actions(&mut self, raised: &[Finding], at: u64) {
        let Some(state) = self.engine.state().cloned() else {
            return;
        };
        let this = &*self;
        let requests: Vec<ActionRequest> = this
            .findings
            .active()
            .filter(|f| !raised.iter().any(|r| r.key == f.key))
            .flat_map(|f| {
                f.obligations
                    .iter()
                    .filter_map(move |o| this.action_request(f, o, at))
            })
            .collect();
        for request in requests {
            // A failure is counted; the request lapses with its TTL unless a later
            // cycle publishes it.
            if state.publish_action(&request).is_err() {
                self.obligation_failures += 1;
            }
        }
    }

    /// Withdraws the requests of a cleared finding; what was done, per obligation.
    pub(super) fn withdraw_actions(
        &mut self,
        f: &Finding,
        out: &mut Vec<ObligationReport>,
    ) -> Vec<Value> {
        let mut done = Vec::new();
        let Some(state) = self.engine.state().cloned() else {
            return done;
        };
        for o in f.obligations.iter().filter(|o| o.kind == MIGRATE) {
            let Some((_, target)) = o.target.as_deref().and_then(split_target) else {
                continue;
            };
            let key = ActionRequest::key_of(&o.kind, &self.config.node, &f.policy, &target);
            let outcome = match state.withdraw_action(&key) {
                Ok(()) => "withdrawn".to_owned(),
                Err(e) => {
                    // It still lapses with its TTL.
                    self.obligation_failures += 1;
                    format!("withdrawal failed (the request lapses with its TTL): {e}")
                }
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

    /// Publishes, as dry runs, the `migrate` requests of the warn and audit policies
    /// that fired in `decisions` (the controller reports what it would move and moves
    /// nothing), again each cycle they fire; withdraws those that no longer do.
    pub(super) fn publish_dry_runs(&mut self, decisions: &[&probity::Decision], at: u64) {
        let Some(state) = self.engine.state().cloned() else {
            return;
        };
        let ttl = self.config.collect.stale_after.as_secs().max(1);
        let mut wanted = std::collections::BTreeSet::new();
        for d in decisions {
            for n in d.warnings.iter().chain(&d.audit) {
                for o in &n.obligations {
                    let Some(mut request) =
                        ActionRequest::of_obligation(o, &self.config.node, &n.message, at, ttl)
                            .filter(|r| crate::config::valid_id(&r.target))
                    else {
                        continue;
                    };
                    request.dry_run = true;
                    wanted.insert(request.key());
                    if state.publish_action(&request).is_err() {
                        self.obligation_failures += 1;
                    }
                }
            }
        }
        for key in self.dry_run_actions.difference(&wanted) {
            // A failure lapses with the TTL.
            if state.withdraw_action(key).is_err() {
                self.obligation_failures += 1;
            }
        }
        self.dry_run_actions = wanted;
    }
}

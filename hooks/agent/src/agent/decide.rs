use probity::{DecideOptions, Decision, EntityUid, Request};
use serde_json::{Map, Value, json};

use super::Agent;
use super::collect::Readings;
use super::reports::{DecisionReport, EventRecord, ObligationReport};
use crate::findings::{Finding, Scope, findings_of};
use crate::listen::ListenSubject;

/// What the findings step of a cycle did.
pub(super) struct Reconciled {
    pub(super) reports: Vec<DecisionReport>,
    pub(super) change: crate::findings::Change,
    pub(super) expired: Vec<Finding>,
    pub(super) obligations: Vec<ObligationReport>,
    pub(super) events: Vec<EventRecord>,
}

impl Agent {
    /// Step 3 of a cycle: `comply` for the node and `listen` for each subject, in one
    /// batch; what each question was about, and its decision.
    pub(super) fn decide(
        &self,
        node_entity: &Value,
        readings: &Readings,
        subjects: &[ListenSubject],
    ) -> (Vec<(String, String, Value)>, Vec<Decision>) {
        let Readings {
            unreadable,
            gpus,
            power,
            ..
        } = readings;
        let mut asked: Vec<(String, String, Value)> = Vec::new();
        let mut requests = Vec::new();
        if let (Some(node), Ok(comply), Ok(listen_action)) = (
            self.node_uid(),
            EntityUid::action("comply"),
            EntityUid::action("listen"),
        ) {
            let mut ctx = Map::new();
            if !power.readings_w.is_empty() {
                ctx.insert("powerReadingsW".into(), json!(power.readings_w));
            }
            requests.push(
                Request::new(node.clone(), comply, node.clone())
                    .with_context(ctx)
                    .as_fact_reporter(),
            );
            asked.push((
                "comply".into(),
                node.to_string(),
                json!({
                    "node": node_entity,
                    "unreadable": unreadable,
                    "power": power,
                    "gpus": gpus,
                }),
            ));
            for s in subjects {
                let mut ctx = Map::new();
                ctx.insert("port".into(), json!(s.port));
                ctx.insert("protocol".into(), json!(s.protocol));
                requests.push(
                    Request::new(node.clone(), listen_action.clone(), node.clone())
                        .with_context(ctx),
                );
                asked.push((
                    "listen".into(),
                    s.key(),
                    serde_json::to_value(s).unwrap_or_default(),
                ));
            }
        }
        let decisions = self
            .engine
            .decide_with(&requests, DecideOptions::new())
            .settle();
        (asked, decisions)
    }

    /// Step 4 of a cycle: the decisions' findings reconciled with the active ones; a
    /// raised finding's obligations carried out and recorded, an updated one's alerts
    /// updated, a cleared or expired one's resolved and recorded, and the alerts of the
    /// findings taken up from the last process refreshed.
    pub(super) fn reconcile(
        &mut self,
        asked: Vec<(String, String, Value)>,
        decisions: Vec<Decision>,
        at: u64,
    ) -> Reconciled {
        let mut current = Vec::new();
        let mut reports = Vec::new();
        for ((action, subject, facts), decision) in asked.into_iter().zip(decisions) {
            current.extend(findings_of(
                Scope::Telemetry,
                &action,
                &subject,
                &decision,
                &facts,
                at,
            ));
            reports.push(DecisionReport {
                action,
                subject,
                decision,
            });
        }
        let change = self.findings.reconcile(Scope::Telemetry, current);
        let mut obligations = Vec::new();
        let mut events = Vec::new();
        for f in &change.raised {
            let done = self.carry_out(f, &mut obligations);
            events.extend(self.record("finding", f, at, done));
        }
        for (before, after) in &change.updated {
            self.update_alerts(before, after, &mut obligations);
        }
        self.refresh_actions(&change.raised, at);
        let decided: Vec<&Decision> = reports.iter().map(|r| &r.decision).collect();
        self.publish_dry_runs(&decided, at);
        for f in &change.cleared {
            let mut done = self.resolve(f, &mut obligations);
            done.extend(self.withdraw_actions(f, &mut obligations));
            events.extend(self.record("finding-cleared", f, at, done));
        }
        let hold = self.config.alerts.elevation_hold.as_secs();
        let expired = self
            .findings
            .expire(Scope::Elevation, at.saturating_sub(hold));
        for f in &expired {
            let mut done = self.resolve(f, &mut obligations);
            done.extend(self.withdraw_actions(f, &mut obligations));
            events.extend(self.record("finding-cleared", f, at, done));
        }
        // Findings taken up from the last process that still hold and were not updated
        // (an update posts its alerts): their alerts are refreshed, once; from now on
        // this process's alerter keeps them alive.
        let inherited = std::mem::take(&mut self.inherited);
        let refresh: Vec<Finding> = self
            .findings
            .active()
            .filter(|f| inherited.contains(&f.key))
            .filter(|f| !change.updated.iter().any(|(_, u)| u.key == f.key))
            .cloned()
            .collect();
        for f in &refresh {
            self.refresh_alerts(f, &mut obligations);
        }
        Reconciled {
            reports,
            change,
            expired,
            obligations,
            events,
        }
    }
}

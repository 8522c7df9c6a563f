use std::sync::Arc;

use probity::{DecideOptions, EntityUid, Request};
use serde_json::{Map, json};

use super::Agent;
use super::reports::{AuditReport, DecisionReport};
use crate::elevation::elevation_facts;
use crate::findings::{Scope, findings_of};
use crate::sources::{Outcome, unix};

impl Agent {
    /// Reads what is new in the audit log and decides each successful elevation.
    pub fn poll_audit(&mut self) -> AuditReport {
        let mut report = AuditReport::default();
        let clock = Arc::clone(self.engine.clock());
        let now = clock.now();
        let at = unix(now);
        let Some(reader) = self.audit.as_mut() else {
            return report;
        };
        let poll = reader.poll(&*clock);
        match &reader.status().last {
            Outcome::Ok { .. } => self.audit_state.record_ok((), now),
            Outcome::Unavailable { reason, .. } => {
                self.audit_state.record_unavailable(reason.clone(), now);
            }
            Outcome::Error { error, .. } => self.audit_state.record_failure(error.clone(), now),
            Outcome::Never | Outcome::Disabled => {}
        }
        report.failed_elevations = poll.failed;
        report.line_errors = poll.line_errors;
        let (Some(node), Ok(elevate)) = (self.node_uid(), EntityUid::action("elevate")) else {
            return report;
        };
        let mut requests = Vec::new();
        let mut asked = Vec::new();
        for e in &poll.elevations {
            let user = match EntityUid::new("User", &e.user) {
                Ok(u) => u,
                Err(err) => {
                    report
                        .errors
                        .push(format!("elevation {} by {:?}: {err}", e.event, e.user));
                    continue;
                }
            };
            let ctx = e.context();
            let mut c = Map::new();
            c.insert("now".into(), json!(ctx.now));
            if let Some(login) = ctx.last_remote_login_at {
                c.insert("lastRemoteLoginAt".into(), json!(login));
            }
            asked.push((format!("{user} at {}", e.event), elevation_facts(e)));
            requests.push(
                Request::new(user, elevate.clone(), node.clone())
                    .with_context(c)
                    .as_fact_reporter(),
            );
        }
        let decisions = self
            .engine
            .decide_with(&requests, DecideOptions::new())
            .settle();
        for ((subject, facts), decision) in asked.into_iter().zip(decisions) {
            for f in findings_of(Scope::Elevation, "elevate", &subject, &decision, &facts, at) {
                if let Some(f) = self.findings.raise(f) {
                    let done = self.carry_out(&f, &mut report.obligations);
                    report.events.extend(self.record("finding", &f, at, done));
                    report.raised.push(f);
                }
            }
            report.decisions.push(DecisionReport {
                action: "elevate".into(),
                subject,
                decision,
            });
        }
        if !report.raised.is_empty() {
            report.errors.extend(self.save_findings(at));
        }
        report
    }
}

//! Elevations from a real audit log capture: sudo and su by `alice` one second after her
//! ssh login. Unauthorized, each is a denied `elevate` with an alert; authorized, nothing.

use std::time::Duration;

use crate::support::{FakeNode, HttpStub, NODE, agent, engine, eventually, fixture_path};

const LOG: &str = "debian12-auditd3.0.9-sshd-sudo-su-enriched.log";

fn audit_config(
    node: &FakeNode,
    webhook: &HttpStub,
    log: &std::path::Path,
) -> probity_agent::Config {
    node.config(
        &format!("webhook_url = \"{}/hook\"", webhook.url),
        &format!(
            "[audit]\nenabled = true\npath = \"{}\"\nstart = \"beginning\"\n",
            log.display()
        ),
    )
}

#[test]
fn an_unauthorized_elevation_after_a_remote_login_is_denied_and_alerted() {
    let node = FakeNode::new();
    let webhook = HttpStub::start(Vec::new());
    let state = tempfile::tempdir().unwrap();
    let log = node.path("audit.log");
    std::fs::copy(fixture_path("auditd", LOG), &log).unwrap();
    let mut config = audit_config(&node, &webhook, &log);
    config.state_dir = Some(state.path().to_owned());
    let (engine, _clock) = engine(Some(state.path()), false);
    let mut agent = agent(config, engine.clone());
    let report = agent.poll_audit();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    // Two sudos and the su they ran succeeded; the failed sudo elevated nothing.
    assert_eq!(report.decisions.len(), 3, "{:?}", report.decisions);
    assert_eq!(report.failed_elevations, 1);
    for d in &report.decisions {
        assert_eq!(d.action, "elevate");
        assert!(
            d.subject.starts_with("User::\"alice\" at 1796075"),
            "{}",
            d.subject
        );
        assert!(!d.decision.is_allowed());
        assert_eq!(
            d.decision.reasons[0].policy,
            "security.elevation-after-remote-login"
        );
    }
    assert_eq!(report.raised.len(), 3);
    let f = &report.raised[0];
    assert_eq!(f.facts["user"], "alice");
    assert_eq!(f.facts["lastRemoteLoginAt"], 1796075113);
    assert_eq!(f.facts["now"], 1796075114);
    assert_eq!(f.facts["command"], "ls <redacted> <redacted>");
    let posted = eventually(
        "three alerts at the webhook",
        Duration::from_secs(20),
        || {
            let p = webhook.posted();
            (p.len() >= 3).then_some(p)
        },
    );
    for a in &posted[..3] {
        assert_eq!(
            a["labels"]["alertname"],
            "security.elevation-after-remote-login"
        );
        assert_eq!(a["labels"]["node"], "User::\"alice\"");
        assert_eq!(a["labels"]["probity_node"], NODE);
        assert_eq!(a["labels"]["severity"], "critical");
    }
    let events = engine.log().unwrap().events(0).unwrap();
    assert_eq!(events.iter().filter(|e| e.kind == "finding").count(), 3);
    // The decision log has the denies too (the engine records them).
    let decisions = engine.log().unwrap().decisions(0, 100).unwrap();
    assert!(
        decisions
            .iter()
            .filter(|d| d.action == "Action::\"elevate\"")
            .count()
            >= 3
    );

    // The position is saved: a restarted agent reads nothing twice.
    drop(agent);
    let mut config = audit_config(&node, &webhook, &log);
    config.state_dir = Some(state.path().to_owned());
    let (engine2, _) = crate::support::engine(None, false);
    let mut again = crate::support::agent(config, engine2);
    assert!(again.poll_audit().decisions.is_empty());
}

#[test]
fn an_authorized_user_elevates_with_no_finding_and_no_alert() {
    let node = FakeNode::new();
    let webhook = HttpStub::start(Vec::new());
    let log = node.path("audit.log");
    std::fs::copy(fixture_path("auditd", LOG), &log).unwrap();
    let config = audit_config(&node, &webhook, &log);
    let (engine, _clock) = engine(None, true);
    let mut agent = agent(config, engine);
    let report = agent.poll_audit();
    assert_eq!(report.decisions.len(), 3);
    assert!(report.decisions.iter().all(|d| d.decision.is_allowed()));
    assert!(report.raised.is_empty());
    assert_eq!(agent.findings().count(), 0);
    // The cycle's own findings alert after any elevation alert would have (one queue,
    // in order): once they are at the webhook, an elevation alert would be too.
    let r = agent.cycle();
    assert!(!r.raised.is_empty());
    let posted = eventually("the cycle's alerts", Duration::from_secs(20), || {
        let p = webhook.posted();
        (!p.is_empty()).then_some(p)
    });
    assert!(
        !posted.iter().any(|a| a["labels"]["action"] == "elevate"),
        "{posted:?}"
    );
}

#[test]
fn a_missing_audit_log_makes_auditd_unreadable() {
    let node = FakeNode::new();
    let webhook = HttpStub::start(Vec::new());
    let config = audit_config(&node, &webhook, &node.path("no-such-audit.log"));
    let (engine, _clock) = engine(None, false);
    let mut agent = agent(config, engine);
    agent.poll_audit();
    let r = agent.cycle();
    assert!(
        r.facts.unreadable["auditd"].contains("does not exist"),
        "{:?}",
        r.facts.unreadable
    );
}

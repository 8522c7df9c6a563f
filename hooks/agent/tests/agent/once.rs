//! One-shot runs (`probity agent --once`, `probity slurm health`): each is a new agent on
//! the same state directory, and together they behave as one running agent. A finding
//! that still holds is not raised again (no second event, no new alert, its `since`
//! kept; its alert refreshed so it does not lapse), and one that clears is recorded as
//! cleared and its alert resolved.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use probity_agent::findings::saved::FINDINGS_FILE;
use probity_agent::{Config, CycleReport};
use serde_json::Value;

use crate::support::{
    ActiveNames, Alertmanager, FakeNode, HttpStub, NODE, T0, agent, engine, eventually, fixture,
};

/// One process: a new engine on `state` at `T0 + offset`, a new agent, one cycle; the
/// report and the state store's events (kind and object) after it.
fn one_shot(config: &Config, state: &Path, offset: i64) -> (CycleReport, Vec<(String, String)>) {
    let (engine, clock) = engine(Some(state), false);
    clock.advance(offset);
    let mut agent = agent(config.clone(), engine.clone());
    let report = agent.cycle();
    // Dropping the agent stops its alerters once they posted what was queued.
    drop(agent);
    let events = engine
        .log()
        .unwrap()
        .events(0)
        .unwrap()
        .into_iter()
        .map(|e| (e.kind, e.object_id))
        .collect();
    (report, events)
}

fn keys(list: &[probity_agent::Finding]) -> BTreeSet<String> {
    list.iter().map(|f| f.key.clone()).collect()
}

fn count(events: &[(String, String)], kind: &str) -> usize {
    events.iter().filter(|(k, _)| k == kind).count()
}

const HOT: &str = "comply|Node::\"gpu-node-07\"|thermal.gpu-over-temperature";

/// The webhook posts of the alert named `name`.
fn posts_of(webhook: &HttpStub, name: &str) -> Vec<Value> {
    webhook
        .posted()
        .into_iter()
        .filter(|p| p["labels"]["alertname"] == name)
        .collect()
}

#[test]
fn one_shot_runs_raise_a_finding_once_and_clear_it_when_it_goes() {
    let node = FakeNode::new();
    let am_dir = tempfile::tempdir().unwrap();
    let mut am = Alertmanager::start(am_dir.path());
    let webhook = HttpStub::start(Vec::new());
    let state = tempfile::tempdir().unwrap();
    let mut config = node.config(
        &format!(
            "alertmanager_url = \"{}\"\nwebhook_url = \"{}/hook\"",
            am.url, webhook.url
        ),
        "",
    );
    config.state_dir = Some(state.path().to_owned());

    // The fixture's node runs GPU 5 at 71 C and an unpinned driver.
    let (first, events) = one_shot(&config, state.path(), 0);
    assert!(first.errors.is_empty(), "{:?}", first.errors);
    let raised = keys(&first.raised);
    assert!(raised.contains(HOT), "{raised:?}");
    assert_eq!(count(&events, "finding"), raised.len());
    assert!(
        first.obligations.iter().all(|o| o.outcome == "alerted"),
        "{:?}",
        first.obligations
    );
    let saved = state.path().join(FINDINGS_FILE);
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&saved).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    let hot_alert = eventually("the heat alert", Duration::from_secs(20), || {
        am.alerts()
            .into_iter()
            .find(|a| a["labels"]["alertname"] == "thermal.gpu-over-temperature")
    });
    let first_posts = posts_of(&webhook, "thermal.gpu-over-temperature");
    assert_eq!(first_posts.len(), 1);

    // Five minutes later, a new process, the same heat: nothing is raised or recorded;
    // the alert is the same one, refreshed.
    let (second, events) = one_shot(&config, state.path(), 300);
    assert!(second.errors.is_empty(), "{:?}", second.errors);
    assert!(second.raised.is_empty(), "{:?}", second.raised);
    assert!(second.cleared.is_empty(), "{:?}", second.cleared);
    assert!(second.events.is_empty(), "{:?}", second.events);
    assert_eq!(keys(&second.active), raised);
    let hot = second.active.iter().find(|f| f.key == HOT).unwrap();
    assert_eq!(hot.since, u64::try_from(T0).unwrap(), "its first time kept");
    assert_eq!(count(&events, "finding"), raised.len(), "no second event");
    assert!(
        second
            .obligations
            .iter()
            .all(|o| o.outcome == "alert refreshed"),
        "{:?}",
        second.obligations
    );
    let posts = posts_of(&webhook, "thermal.gpu-over-temperature");
    assert_eq!(posts.len(), 2, "one refresh");
    assert_eq!(posts[1]["status"], "firing");
    assert_eq!(posts[1]["labels"], first_posts[0]["labels"]);
    assert_eq!(
        posts[1]["annotations"]["since"],
        first_posts[0]["annotations"]["since"]
    );
    // Alertmanager holds one alert, which started when the first run raised it.
    let held: Vec<Value> = am
        .alerts()
        .into_iter()
        .filter(|a| a["labels"]["alertname"] == "thermal.gpu-over-temperature")
        .collect();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0]["startsAt"], hot_alert["startsAt"]);
    assert_eq!(held[0]["status"]["state"], "active");

    // The GPUs cool and the driver is pinned: the next process clears what the first
    // raised, records it, and resolves its alerts.
    let csv = String::from_utf8(fixture("nvidia-smi", "own-8gpu-h100.query-gpu.csv"))
        .unwrap()
        .replace("570.133.20", "590.48.01")
        .replace(", 71, ", ", 61, ");
    node.write("data/smi.csv", csv.as_bytes());
    node.dcgm.set_body(
        String::from_utf8(fixture("dcgm", "own-8gpu-mig-mixed-labels.prom"))
            .unwrap()
            .replace("} 71\n", "} 61\n")
            .into_bytes(),
    );
    let (third, events) = one_shot(&config, state.path(), 600);
    assert!(third.errors.is_empty(), "{:?}", third.errors);
    assert!(third.raised.is_empty(), "{:?}", third.raised);
    assert!(keys(&third.cleared).contains(HOT), "{:?}", third.cleared);
    let hot = third.cleared.iter().find(|f| f.key == HOT).unwrap();
    assert_eq!(hot.since, u64::try_from(T0).unwrap());
    let cleared: Vec<&(String, String)> = events
        .iter()
        .filter(|(k, _)| k == "finding-cleared")
        .collect();
    assert_eq!(cleared.len(), third.cleared.len());
    assert!(cleared.iter().any(|(_, key)| key == HOT), "{cleared:?}");
    assert!(
        third
            .obligations
            .iter()
            .any(|o| o.finding == HOT && o.outcome == "resolved"),
        "{:?}",
        third.obligations
    );
    let posts = posts_of(&webhook, "thermal.gpu-over-temperature");
    assert_eq!(posts.len(), 3);
    assert_eq!(posts[2]["status"], "resolved");
    eventually("the heat alert resolved", Duration::from_secs(20), || {
        (!am.active_names()
            .contains(&"thermal.gpu-over-temperature".to_owned()))
        .then_some(())
    });

    // And a fourth process finds nothing more to do about it.
    let (fourth, events) = one_shot(&config, state.path(), 900);
    assert!(!keys(&fourth.raised).contains(HOT));
    assert!(fourth.cleared.is_empty(), "{:?}", fourth.cleared);
    assert_eq!(count(&events, "finding-cleared"), cleared.len());
}

#[test]
fn a_findings_file_that_cannot_be_used_is_said_and_the_cycle_goes_on() {
    let node = FakeNode::new();
    let state = tempfile::tempdir().unwrap();
    let mut config = node.config("", "");
    config.state_dir = Some(state.path().to_owned());
    let saved = state.path().join(FINDINGS_FILE);

    let (first, _) = one_shot(&config, state.path(), 0);
    let good = std::fs::read_to_string(&saved).unwrap();
    let other = good.replace(&format!("\"node\":\"{NODE}\""), "\"node\":\"gpu-node-08\"");
    assert_ne!(good, other);
    for (bytes, said) in [
        ("{\"version\":1,\n\"findings\": [{]}", ":2:"),
        (
            other.as_str(),
            "the findings of node \"gpu-node-08\", not of this node",
        ),
    ] {
        std::fs::write(&saved, bytes).unwrap();
        let (r, _) = one_shot(&config, state.path(), 60);
        assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
        let e = &r.errors[0];
        assert!(
            e.starts_with("the saved findings were not taken up")
                && e.contains(&saved.display().to_string())
                && e.contains(said),
            "{e}"
        );
        // The cycle went on, from no active finding: the heat is raised again.
        assert_eq!(keys(&r.raised), keys(&first.raised));
        // And the file is whole again: the next process raises nothing.
        let (next, _) = one_shot(&config, state.path(), 120);
        assert!(next.errors.is_empty(), "{:?}", next.errors);
        assert!(next.raised.is_empty(), "{:?}", next.raised);
    }
}

//! Hot reload: a good change goes live, a broken one is rejected whole while the
//! previous set serves, and decisions in flight never fail or see a mixed set.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use probity::{Effect, Engine, Request};
use serde_json::json;

use crate::{policy_copy, write_atomic};

/// Polls `cond` every 10 ms for at most 20 s (a bound, not a timing assertion).
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn listen(port: i64) -> Request {
    Request::from_json_value(&json!({"principal": "Node::\"n\"", "action": "listen",
        "resource": "Node::\"n\"", "context": {"port": port, "protocol": "tcp"}}))
    .unwrap()
}

#[test]
fn good_change_goes_live_and_broken_change_keeps_the_previous_set() {
    let dir = policy_copy();
    let engine = Engine::builder(dir.path()).build().unwrap();
    let _watcher = engine.watch().unwrap();
    assert!(!engine.decide(&listen(9100)).is_allowed());

    // A threshold change in the configuration file goes live.
    let config = dir.path().join("probity.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    write_atomic(
        &config,
        &text.replace("[22, 2379, 2380]", "[22, 2379, 2380, 9100]"),
    );
    wait_for("the new port baseline", || {
        engine.decide(&listen(9100)).is_allowed()
    });
    let good_digest = engine.status().digest;

    // A broken policy file is rejected; the previous set keeps serving.
    let broken = dir.path().join("security/network.cedar");
    write_atomic(
        &broken,
        "permit (principal, action, resource) when { context.port > };\n",
    );
    wait_for("the reload error", || engine.last_error().is_some());
    let status = engine.status();
    assert_eq!(status.digest, good_digest);
    let error = status.last_error.unwrap();
    assert!(error.contains("security/network.cedar:1:"), "{error}");
    assert!(engine.decide(&listen(9100)).is_allowed());
    assert!(!engine.decide(&listen(8080)).is_allowed());

    // Restoring the file clears the error.
    let original =
        std::fs::read_to_string(crate::root().join("policies/security/network.cedar")).unwrap();
    write_atomic(&broken, &original);
    wait_for("the error to clear", || engine.last_error().is_none());
    assert!(engine.status().reload_errors >= 1);
}

/// Two policies in one file whose messages carry the generation: a decision that saw
/// a mixed set would report two different generations.
fn generation(g: u64) -> String {
    format!(
        "@id(\"gen.a\") @message(\"gen {g}\")\npermit (principal, action == Action::\"listen\", resource);\n\
         @id(\"gen.b\") @message(\"gen {g}\")\npermit (principal, action == Action::\"listen\", resource)\n\
         when {{ Settings::\"active\".inboundPortBaseline.contains(context.port) }};\n"
    )
}

fn install_generation_dir(dir: &Path) {
    for sub in ["security", "placement", "thermal", "integrity"] {
        std::fs::remove_dir_all(dir.join(sub)).unwrap();
    }
    std::fs::write(dir.join("gen.cedar"), generation(0)).unwrap();
}

#[test]
fn decisions_under_reload_never_fail_nor_see_a_mixed_set() {
    let dir = policy_copy();
    install_generation_dir(dir.path());
    let engine = Engine::builder(dir.path()).build().unwrap();
    let _watcher = engine
        .watch_with_debounce(Duration::from_millis(5))
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let engine = engine.clone();
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let request = listen(22);
                let mut count = 0u64;
                let deadline = Instant::now() + Duration::from_secs(60);
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    let d = engine.decide(&request);
                    assert_eq!(d.decision, Effect::Allow, "{d:?}");
                    assert!(d.errors.is_empty(), "{d:?}");
                    assert_eq!(d.reasons.len(), 2, "{d:?}");
                    assert_eq!(
                        d.reasons[0].message, d.reasons[1].message,
                        "mixed set: {d:?}"
                    );
                    count += 1;
                }
                count
            })
        })
        .collect();
    let file = dir.path().join("gen.cedar");
    let mut last_good = 0;
    // Each write waits for the reload it causes, so good and broken sets alternate
    // however long a compile takes on this machine.
    let attempts = || {
        let s = engine.status();
        s.reloads + s.reload_errors
    };
    for g in 1..=20u64 {
        let before = attempts();
        if g % 2 == 0 {
            write_atomic(
                &file,
                "@id(\"gen.a\") permit (principal, action, resource) when { ;\n",
            );
        } else {
            write_atomic(&file, &generation(g));
            last_good = g;
        }
        wait_for("the reload of that write", || attempts() > before);
    }
    write_atomic(&file, &generation(1000));
    wait_for("the final generation", || {
        engine.decide(&listen(22)).reasons[0].message == "gen 1000"
    });
    stop.store(true, Ordering::Relaxed);
    let decided: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
    let status = engine.status();
    assert!(decided > 100, "only {decided} decisions");
    assert!(status.reloads >= 2, "{status:?}");
    assert!(status.reload_errors >= 1, "{status:?}");
    assert!(last_good > 0);
    assert!(status.last_error.is_none());
}

#[test]
fn watching_embedded_defaults_is_an_error() {
    let engine = Engine::from_embedded_defaults().unwrap();
    assert!(engine.watch().is_err());
}

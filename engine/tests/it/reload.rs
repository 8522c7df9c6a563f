//! Hot reload: a good change goes live, a broken one is rejected whole while the
//! previous set serves, and decisions in flight never fail or see a mixed set.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use probity::{Effect, Engine, ReloadOutcome, Request, Settle, Sleeper};
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
    for sub in ["placement", "thermal", "integrity"] {
        std::fs::remove_dir_all(dir.join(sub)).unwrap();
    }
    // The block rule stays: the schema's @block_policy requires it.
    for f in std::fs::read_dir(dir.join("security")).unwrap() {
        let f = f.unwrap().path();
        if !f.ends_with("blocklist.cedar") {
            std::fs::remove_file(f).unwrap();
        }
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

// ------------------------------------------------------------ settling and events

/// A write scheduled on a [`Script`].
type Action = Box<dyn FnOnce() + Send>;

/// A sleeper that moves a virtual clock and, as it passes their times, runs the writes
/// scheduled on it: time passes only when the watcher waits, and a test says exactly
/// what lands when.
#[derive(Default)]
struct Script {
    now_ms: Mutex<u64>,
    due: Mutex<Vec<(u64, Action)>>,
    /// What each sleep saw of the live set: whether `security.blocked-node` was in it.
    blocklist_live: Mutex<Vec<bool>>,
    engine: Mutex<Option<Engine>>,
}

impl Script {
    fn at(&self, ms: u64, action: impl FnOnce() + Send + 'static) {
        self.due.lock().unwrap().push((ms, Box::new(action)));
    }
}

impl Sleeper for Script {
    fn sleep(&self, d: Duration) {
        if let Some(engine) = self.engine.lock().unwrap().as_ref() {
            self.blocklist_live
                .lock()
                .unwrap()
                .push(has_blocklist(engine));
        }
        let now = {
            let mut now = self.now_ms.lock().unwrap();
            *now += u64::try_from(d.as_millis()).unwrap();
            *now
        };
        let mut due = self.due.lock().unwrap();
        due.sort_by_key(|(t, _)| *t);
        while due.first().is_some_and(|(t, _)| *t <= now) {
            let (_, action) = due.remove(0);
            action();
        }
    }
}

fn has_blocklist(engine: &Engine) -> bool {
    engine
        .policy_ids()
        .iter()
        .any(|(id, _)| id == "security.blocked-node")
}

fn schedule_blocked() -> Request {
    Request::from_json_value(&json!({"principal": "Workload::\"train-1\"",
        "action": "schedule", "resource": "Node::\"gpu-blocked\""}))
    .unwrap()
}

/// The blocklist file rewritten in place in two halves: its first half (the comment
/// header) is a valid file with no policy in it, so a set read between the halves is
/// valid and lacks `security.blocked-node`.
struct Halves {
    path: std::path::PathBuf,
    first: String,
    whole: String,
}

fn halves(dir: &Path) -> Halves {
    let path = dir.join("security/blocklist.cedar");
    let original = std::fs::read_to_string(&path).unwrap();
    // The new version differs from the old (so that it loads) by a comment line.
    let whole = format!("// reviewed\n{original}");
    let cut = whole.find("@id").unwrap();
    Halves {
        path,
        first: whole[..cut].to_owned(),
        whole,
    }
}

/// An in-place write: truncate, then write (what `>` and `cp` over a file do).
fn write_in_place(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

fn settle_with(script: &Arc<Script>) -> Settle {
    Settle::new(Duration::from_millis(50)).with_sleeper(Arc::clone(script) as Arc<dyn Sleeper>)
}

/// Issue: an in-place write whose first half was a valid set was loaded after the
/// debounce, and the blocked node was allowed for a while. The first half is written,
/// the watcher starts settling, and the second half lands 30 ms (less than the 50 ms
/// debounce) into the round: the first half never goes live.
#[test]
fn bug_a_file_written_in_two_halves_with_a_short_pause_never_loads_its_first_half() {
    let dir = policy_copy();
    let engine = Engine::builder(dir.path()).build().unwrap();
    crate::load_cluster(&engine);
    let events = engine.reload_events();
    let h = halves(dir.path());
    let script = Arc::new(Script::default());
    *script.engine.lock().unwrap() = Some(engine.clone());
    write_in_place(&h.path, &h.first);
    let (path, whole) = (h.path.clone(), h.whole.clone());
    script.at(30, move || write_in_place(&path, &whole));

    engine.reload_when_settled(&settle_with(&script)).unwrap();

    let event = events.try_recv().unwrap();
    assert_eq!(event.outcome, ReloadOutcome::Loaded);
    assert_eq!(event.rounds, 2, "the first round saw the file change");
    assert!(events.try_recv().is_err(), "one reload only");
    assert!(
        script
            .blocklist_live
            .lock()
            .unwrap()
            .iter()
            .all(|live| *live)
    );
    assert!(has_blocklist(&engine));
    let d = engine.decide(&schedule_blocked());
    assert_eq!(d.reasons[0].policy, "security.blocked-node");
}

/// A pause longer than the debounce: the old watcher (reload once no event came for
/// the debounce) loaded the first half. Now the watcher starts settling when the
/// debounce has passed (50 ms after the first half), the second half lands at 80 ms,
/// inside the settling round: the set loads only once it is whole and stable.
#[test]
fn a_pause_longer_than_the_debounce_loads_only_once_the_file_is_stable() {
    let dir = policy_copy();
    let engine = Engine::builder(dir.path()).build().unwrap();
    crate::load_cluster(&engine);
    let events = engine.reload_events();
    let h = halves(dir.path());
    let script = Arc::new(Script::default());
    *script.engine.lock().unwrap() = Some(engine.clone());
    write_in_place(&h.path, &h.first);
    // Virtual time 0 is the end of the 50 ms quiet period after the first half.
    let (path, whole) = (h.path.clone(), h.whole.clone());
    script.at(80 - 50, move || write_in_place(&path, &whole));

    engine.reload_when_settled(&settle_with(&script)).unwrap();

    let event = events.try_recv().unwrap();
    assert_eq!(event.outcome, ReloadOutcome::Loaded);
    assert_eq!(event.rounds, 2);
    assert!(
        script
            .blocklist_live
            .lock()
            .unwrap()
            .iter()
            .all(|live| *live)
    );
    assert!(!engine.decide(&schedule_blocked()).is_allowed());
}

/// A writer that pauses longer than a whole settling round (see the `watch` module
/// docs): the first half is stable for a round. Sealed mode refuses it (the first half
/// does not match the seal); unsealed, the first half lacks the schema's
/// `@block_policy` and is refused too. (A first half that kept the block rule would go
/// live unsealed: deploy by rename, or seal.)
#[test]
fn a_pause_longer_than_a_settling_round_never_drops_the_block_rule_sealed_or_not() {
    for sealed in [false, true] {
        let dir = policy_copy();
        let keys = tempfile::tempdir().unwrap();
        let anchor = probity::integrity::SoftwareAnchor::generate(&keys.path().join("k")).unwrap();
        let h = halves(dir.path());
        let mut builder = Engine::builder(dir.path());
        if sealed {
            // The operator seals the new version, deploys the seal, then writes the
            // policy file in place, slowly.
            std::fs::write(&h.path, &h.whole).unwrap();
            probity::policy_seal::PolicySeal::seal_dir(dir.path(), "prod", 1, &anchor).unwrap();
            builder = builder.sealed(probity::integrity::Verifier::new(
                probity::integrity::Anchor::public_key(&anchor).clone(),
            ));
        }
        let engine = builder.build().unwrap();
        crate::load_cluster(&engine);
        let events = engine.reload_events();
        let script = Arc::new(Script::default());
        write_in_place(&h.path, &h.first);
        engine
            .reload_when_settled(&settle_with(&script))
            .unwrap_or_default();
        let first = events.try_recv().unwrap();
        assert_eq!(first.rounds, 1);
        if sealed {
            assert_eq!(first.outcome, ReloadOutcome::Rejected);
            assert!(has_blocklist(&engine));
            assert!(!engine.decide(&schedule_blocked()).is_allowed());
        } else {
            // Once the limitation (the blocked node allowed until the rest landed); now
            // the schema's @block_policy refuses a set without the block rule.
            assert_eq!(first.outcome, ReloadOutcome::Rejected);
            assert!(has_blocklist(&engine));
            assert!(!engine.decide(&schedule_blocked()).is_allowed());
        }
        write_in_place(&h.path, &h.whole);
        engine.reload_when_settled(&settle_with(&script)).unwrap();
        assert!(has_blocklist(&engine));
        assert!(!engine.decide(&schedule_blocked()).is_allowed());
    }
}

/// Sizes and times can miss a change (a same-size rewrite within one tick of a coarse
/// clock, simulated here by putting the time back): the bytes read before compiling
/// are read again after the round, and a difference starts the round over.
#[test]
fn a_same_size_rewrite_with_the_same_time_is_caught_by_the_digest() {
    let dir = policy_copy();
    let engine = Engine::builder(dir.path()).build().unwrap();
    let events = engine.reload_events();
    let config = dir.path().join("probity.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("[22, 2379, 2380]"));
    write_in_place(
        &config,
        &text.replace("[22, 2379, 2380]", "[22, 2379, 2381]"),
    );
    let script = Arc::new(Script::default());
    let (path, next) = (
        config.clone(),
        text.replace("[22, 2379, 2380]", "[22, 2379, 2382]"),
    );
    script.at(10, move || {
        let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
        write_in_place(&path, &next);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(modified)
            .unwrap();
    });
    engine.reload_when_settled(&settle_with(&script)).unwrap();
    let event = events.try_recv().unwrap();
    assert_eq!(event.rounds, 2, "the digest saw the rewrite");
    assert!(engine.decide(&listen(2382)).is_allowed());
    assert!(!engine.decide(&listen(2381)).is_allowed());
}

#[test]
fn files_that_never_settle_are_a_rejected_reload_and_the_previous_set_serves() {
    let dir = policy_copy();
    let engine = Engine::builder(dir.path()).build().unwrap();
    let events = engine.reload_events();
    let digest = engine.status().digest;
    let path = dir.path().join("security/network.cedar");
    let original = std::fs::read_to_string(&path).unwrap();
    let script = Arc::new(Script::default());
    for i in 1..=3u64 {
        let (path, text) = (
            path.clone(),
            format!("// {}\n{original}", "x".repeat(i as usize)),
        );
        script.at(i * 50, move || write_in_place(&path, &text));
    }
    let settle = settle_with(&script).with_max_rounds(3);
    let e = engine.reload_when_settled(&settle).unwrap_err();
    assert!(
        matches!(*e, probity::LoadError::Unsettled { rounds: 3, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("network.cedar"), "{e}");
    assert_eq!(engine.status().digest, digest);
    assert!(engine.status().last_error.is_some());
    let event = events.try_recv().unwrap();
    assert_eq!(event.outcome, ReloadOutcome::Rejected);
    assert_eq!(event.rounds, 3);
}

#[test]
fn every_reload_and_every_rejected_reload_is_reported_to_subscribers() {
    let dir = policy_copy();
    let engine = Engine::builder(dir.path()).build().unwrap();
    let events = engine.reload_events();
    let dropped = engine.reload_events();
    drop(dropped);
    let first = engine.status().digest;

    engine.reload().unwrap();
    let e = events.try_recv().unwrap();
    assert_eq!(e.outcome, ReloadOutcome::Unchanged);
    assert_eq!(
        (e.digest_before.as_str(), e.digest_after.as_str()),
        (first.as_str(), first.as_str())
    );
    assert_eq!(e.rounds, 1);
    assert!(e.error.is_none());

    let config = dir.path().join("probity.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    write_atomic(
        &config,
        &text.replace("[22, 2379, 2380]", "[22, 2379, 2380, 9100]"),
    );
    engine.reload().unwrap();
    let e = events.try_recv().unwrap();
    assert_eq!(e.outcome, ReloadOutcome::Loaded);
    assert_eq!(e.digest_before, first);
    assert_ne!(e.digest_after, first);
    let second = e.digest_after.clone();

    write_atomic(
        &dir.path().join("security/network.cedar"),
        "permit (principal, action, resource) when { };\n",
    );
    engine.reload().unwrap_err();
    let e = events.try_recv().unwrap();
    assert_eq!(e.outcome, ReloadOutcome::Rejected);
    assert_eq!(
        (e.digest_before.as_str(), e.digest_after.as_str()),
        (second.as_str(), second.as_str())
    );
    let error = e.error.unwrap();
    assert!(
        error.detail().contains("security/network.cedar:1:"),
        "{}",
        error.detail()
    );
    assert!(e.seq > 2);
    assert!(events.try_recv().is_err());
}

/// The watcher, end to end, reports what it did.
#[test]
fn the_watcher_reports_its_reloads() {
    let dir = policy_copy();
    let engine = Engine::builder(dir.path()).build().unwrap();
    let events = engine.reload_events();
    let _watcher = engine.watch().unwrap();
    let config = dir.path().join("probity.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    write_atomic(
        &config,
        &text.replace("[22, 2379, 2380]", "[22, 2379, 2380, 9100]"),
    );
    let event = events.recv_timeout(Duration::from_secs(20)).unwrap();
    assert_eq!(event.outcome, ReloadOutcome::Loaded);
    assert!(engine.decide(&listen(9100)).is_allowed());
}

/// Issue 28, item 7: `--policies` naming a symlink that a deploy repointed atomically
/// (`ln -s new tmp && mv -T tmp link`) kept serving the old set: no reload, no error,
/// the same digest; edits under the new target were ignored too.
#[test]
fn bug_a_swapped_symlink_to_the_policy_directory_was_never_noticed() {
    let tmp = tempfile::tempdir().unwrap();
    let (v1, v2) = (tmp.path().join("v1"), tmp.path().join("v2"));
    crate::copy_dir(&crate::root().join("policies"), &v1);
    crate::copy_dir(&crate::root().join("policies"), &v2);
    let config = |dir: &Path| dir.join("probity.toml");
    let text = std::fs::read_to_string(config(&v2)).unwrap();
    std::fs::write(
        config(&v2),
        text.replace("[22, 2379, 2380]", "[22, 2379, 2380, 9100]"),
    )
    .unwrap();
    let link = tmp.path().join("policies");
    std::os::unix::fs::symlink(&v1, &link).unwrap();
    let engine = Engine::builder(&link).build().unwrap();
    let _watcher = engine
        .watch_with_debounce(Duration::from_millis(50))
        .unwrap();
    assert!(!engine.decide(&listen(9100)).is_allowed());
    let before = engine.status().digest;

    // The deploy: a new link beside the old one, renamed over it.
    let next = tmp.path().join("policies.tmp");
    std::os::unix::fs::symlink(&v2, &next).unwrap();
    std::fs::rename(&next, &link).unwrap();
    wait_for("the swapped-in set", || {
        engine.decide(&listen(9100)).is_allowed()
    });
    assert_ne!(engine.status().digest, before);

    // An edit under the new target is followed as well.
    let text = std::fs::read_to_string(config(&v2)).unwrap();
    crate::write_atomic(
        &config(&v2),
        &text.replace("[22, 2379, 2380, 9100]", "[22, 2379, 2380, 9100, 9200]"),
    );
    wait_for("the edit under the new target", || {
        engine.decide(&listen(9200)).is_allowed()
    });
    // And the old target is no longer what serves.
    let text = std::fs::read_to_string(config(&v1)).unwrap();
    crate::write_atomic(&config(&v1), &text.replace("[22, 2379, 2380]", "[22]"));
    // A reload reads through the link: the new target, unchanged.
    engine.reload().unwrap();
    assert!(engine.decide(&listen(9200)).is_allowed());
}

/// Issue 28, item 8 (acceptance): a file written in two writes one second apart,
/// without closing between them, is never live half-written. The old watcher loaded
/// the first half (the blocklist file's header, a valid set without
/// `security.blocked-node`) once it had been quiet for a settling round.
#[test]
fn bug_a_file_written_in_two_writes_a_second_apart_was_live_half_written() {
    use std::io::Write as _;
    let dir = policy_copy();
    let engine = Engine::builder(dir.path()).build().unwrap();
    crate::load_cluster(&engine);
    let events = engine.reload_events();
    let _watcher = engine.watch().unwrap();
    let h = halves(dir.path());

    let watching = Arc::new(AtomicBool::new(true));
    let lost = Arc::new(AtomicBool::new(false));
    let observer = {
        let (engine, watching, lost) = (engine.clone(), watching.clone(), lost.clone());
        std::thread::spawn(move || {
            while watching.load(Ordering::Relaxed) {
                if !has_blocklist(&engine) {
                    lost.store(true, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let mut file = std::fs::File::create(&h.path).unwrap();
    file.write_all(h.first.as_bytes()).unwrap();
    file.flush().unwrap();
    std::thread::sleep(Duration::from_secs(1));
    file.write_all(&h.whole.as_bytes()[h.first.len()..])
        .unwrap();
    drop(file);
    wait_for("the whole file to load", || {
        events
            .try_recv()
            .is_ok_and(|e| e.outcome == ReloadOutcome::Loaded)
    });
    watching.store(false, Ordering::Relaxed);
    observer.join().unwrap();
    assert!(
        !lost.load(Ordering::Relaxed),
        "security.blocked-node was not live for a while"
    );
    assert_eq!(
        engine.decide(&schedule_blocked()).reasons[0].policy,
        "security.blocked-node"
    );
}

/// A writer that never closes: the burst is refused after the bounded wait, the
/// previous set keeps serving, and the close loads the file.
#[test]
fn a_file_a_writer_keeps_open_is_refused_after_the_wait_then_loaded_on_close() {
    use std::io::Write as _;
    let dir = policy_copy();
    let engine = Engine::builder(dir.path()).build().unwrap();
    crate::load_cluster(&engine);
    let events = engine.reload_events();
    let _watcher = engine
        .watch_settled(
            Settle::new(Duration::from_millis(50)).with_open_wait(Duration::from_millis(400)),
        )
        .unwrap();
    let h = halves(dir.path());
    let mut file = std::fs::File::create(&h.path).unwrap();
    file.write_all(h.first.as_bytes()).unwrap();
    let mut refused = None;
    wait_for("the refusal", || {
        if let Ok(e) = events.try_recv() {
            assert_ne!(
                e.outcome,
                ReloadOutcome::Loaded,
                "a half-written file loaded"
            );
            if e.outcome == ReloadOutcome::Rejected {
                refused = e.error;
            }
        }
        refused.is_some()
    });
    let message = refused.unwrap().to_string();
    assert!(
        message.contains("security/blocklist.cedar is still open for writing after"),
        "{message}"
    );
    assert!(has_blocklist(&engine));
    file.write_all(&h.whole.as_bytes()[h.first.len()..])
        .unwrap();
    drop(file);
    wait_for("the whole file to load", || {
        events
            .try_recv()
            .is_ok_and(|e| e.outcome == ReloadOutcome::Loaded)
    });
    assert!(has_blocklist(&engine));
}

/// Issue 28, item 8: a set without the blocklist's rule loaded (a half-written file, a
/// careless edit). The schema names the rule (`@block_policy`): a set without it never
/// loads, at start or by a reload, and the message names it.
#[test]
fn bug_a_set_without_the_block_rule_was_accepted() {
    let dir = policy_copy();
    let engine = Engine::builder(dir.path()).build().unwrap();
    crate::load_cluster(&engine);
    let digest = engine.status().digest;
    let h = halves(dir.path());
    write_atomic(&h.path, &h.first);
    let e = engine.reload().unwrap_err().detail();
    assert!(
        e.contains("the block policy \"security.blocked-node\" (@block_policy) is not in the set"),
        "{e}"
    );
    assert!(
        e.contains("probity.cedarschema"),
        "located in the schema: {e}"
    );
    assert_eq!(engine.status().digest, digest);
    assert!(!engine.decide(&schedule_blocked()).is_allowed());

    // A permit under its id is refused too.
    write_atomic(
        &h.path,
        "@id(\"security.blocked-node\")\npermit (principal, action, resource);\n",
    );
    let e = engine.reload().unwrap_err().detail();
    assert!(e.contains("is a permit, not a forbid"), "{e}");

    // And a fresh start on such a directory fails with the same message.
    write_atomic(&h.path, &h.first);
    let e = Engine::builder(dir.path())
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("policy set rejected"), "{e}");
}

/// `@required` extends the protection to an operator's own rules: a reload that drops
/// one is refused, naming it; removing the annotation first lets it go.
#[test]
fn a_reload_that_drops_a_required_policy_is_refused_until_the_annotation_goes() {
    let dir = policy_copy();
    let file = dir.path().join("security/site.cedar");
    let policy = |required: &str| {
        format!(
            "{required}@id(\"site.no-port-23\")\n@severity(\"high\")\n@message(\"telnet is not allowed\")\nforbid (principal, action == Action::\"listen\", resource)\nwhen {{ context.port == 23 }};\n"
        )
    };
    std::fs::write(&file, policy("@required\n")).unwrap();
    let engine = Engine::builder(dir.path()).build().unwrap();
    assert!(!engine.decide(&listen(23)).is_allowed());

    std::fs::remove_file(&file).unwrap();
    let e = engine.reload().unwrap_err().to_string();
    assert!(
        e.contains("the new set drops required policies (site.no-port-23)"),
        "{e}"
    );
    assert!(!engine.decide(&listen(23)).is_allowed());

    // Without the annotation first, then without the policy.
    std::fs::write(&file, policy("")).unwrap();
    engine.reload().unwrap();
    std::fs::remove_file(&file).unwrap();
    engine.reload().unwrap();
    assert!(
        !engine
            .policy_ids()
            .iter()
            .any(|(id, _)| id == "site.no-port-23")
    );
}

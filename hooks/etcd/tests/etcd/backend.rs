//! The engine on etcd ([`EtcdState`]): engines in this process, each with a client, a
//! runtime and a state directory of its own (as separate processes have), sharing one
//! etcd. A block written in one reaches the other in etcd's order; seals race safely;
//! members, the whole of etcd, or one process's link can go away; facts expire with
//! their publisher.

use std::sync::Arc;
use std::time::{Duration, Instant};

use probity::state::{NodeFacts, SharedState, StateError};
use probity::{Engine, Request};
use probity_etcd::{EtcdConfig, EtcdState, EtcdStateOptions, ResyncOptions, Role};
use rustix::process::Signal;
use serde_json::{Value, json};

use crate::harness::{Etcd, POLL, Proxy};

const WAIT: Duration = Duration::from_secs(30);

/// A runtime for the harness's async helpers; the engines are synchronous.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Polls `f` every [`POLL`] until it returns `Some`, or panics with `what` after `deadline`.
pub fn wait_for<T>(deadline: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + deadline;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "not within {deadline:?}: {what}");
        std::thread::sleep(POLL);
    }
}

/// An engine on the embedded policies following etcd as `role`.
pub struct Peer {
    pub engine: Engine,
    pub state: Arc<EtcdState>,
    _dir: tempfile::TempDir,
}

impl Peer {
    pub fn new(config: EtcdConfig, role: Role, process: &str) -> Self {
        Self::with_options(config, EtcdStateOptions::new(role, process))
    }

    pub fn with_options(config: EtcdConfig, options: EtcdStateOptions) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(EtcdState::open(config, dir.path(), options).unwrap());
        let engine = Engine::from_embedded_defaults().unwrap();
        engine.attach_state(state.attached()).unwrap();
        Self {
            engine,
            state,
            _dir: dir,
        }
    }

    pub fn blocked(&self) -> Vec<String> {
        self.engine.blocked_nodes().into_keys().collect()
    }
}

/// The blocklist as etcd holds it.
fn etcd_blocklist(rt: &tokio::runtime::Runtime, etcd: &Etcd) -> Vec<String> {
    rt.block_on(async {
        let client = etcd.client("/probity/").await;
        client
            .list("blocklist/")
            .await
            .unwrap()
            .entries
            .into_iter()
            .map(|e| e.key.trim_start_matches("blocklist/").to_owned())
            .collect()
    })
}

fn sidecar(node: &str) -> Role {
    Role::Sidecar {
        node: node.to_owned(),
    }
}

/// The bug: a block through a replica whose watch had not yet delivered another
/// replica's block of the same node was a plain put of a record computed from its own
/// view, so it replaced the first block's reason, reader and stop (the pod that read bad
/// data was then never stopped). Now it is merged into etcd's record.
#[test]
fn bug_a_block_from_a_lagging_replica_overwrote_the_first_blocks_reader_and_stop() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let a = Peer::new(etcd.config(), Role::Webhook, "webhook:a");
    let b = Peer::new(etcd.config(), Role::Webhook, "webhook:b");
    let reader = probity::ReaderPod::new("train", "llm-0", None).unwrap();
    let first = probity::BlockRecord::new("integrity.unverified-read", 10).with_stop(
        Some(reader.clone()),
        Some("reader".into()),
        None,
    );
    a.state.put_block_at("gpu-1", &first).unwrap();
    // b writes from a view that has not seen it: a fresh record of its own.
    b.state
        .put_block_at("gpu-1", &probity::BlockRecord::new("operator", 12))
        .unwrap();
    let stored = b
        .state
        .blocked_nodes()
        .unwrap()
        .into_iter()
        .find(|n| n.node == "gpu-1")
        .unwrap()
        .record;
    assert_eq!(stored.reason, "integrity.unverified-read");
    assert_eq!(stored.reader, Some(reader));
    assert_eq!(stored.stop.as_deref(), Some("reader"));
    assert_eq!(
        stored
            .history
            .iter()
            .map(|e| e.reason.as_str())
            .collect::<Vec<_>>(),
        ["operator"]
    );
}

/// The controller reaches one server replica; the cluster's facts it sends there are
/// shared through etcd, so every replica knows the node, and a node the next set leaves
/// out is forgotten by every replica.
#[test]
fn the_cluster_facts_one_replica_took_are_known_to_every_replica() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let a = Peer::new(etcd.config(), Role::Webhook, "webhook:a");
    let b = Peer::new(etcd.config(), Role::Webhook, "webhook:b");
    let node = |id: &str| {
        json!({"uid": {"type": "Node", "id": id}, "attrs": {
            "zone": {"__entity": {"type": "Zone", "id": "zone-a"}},
            "gpuNode": true, "gpusAllocatable": 8}})
    };
    let zone_of = |p: &Peer, id: &str| {
        p.engine
            .entities_json(Some("Node"))
            .into_iter()
            .find(|e| e["uid"]["id"] == id)
            .map(|e| e["attrs"]["zone"]["__entity"]["id"].clone())
    };
    let set = vec![node("gpu-new-1"), node("gpu-new-2")];
    a.engine
        .replace_cluster_facts(&Value::Array(set.clone()))
        .unwrap();
    a.state.publish_cluster_facts(&set).unwrap();
    wait_for(WAIT, "b knows both nodes from the cluster", || {
        (zone_of(&b, "gpu-new-1") == Some(json!("zone-a"))
            && zone_of(&b, "gpu-new-2") == Some(json!("zone-a")))
        .then_some(())
    });
    // A replica started later reads the set whole.
    let c = Peer::new(etcd.config(), Role::Webhook, "webhook:c");
    wait_for(WAIT, "c reads the set when it starts", || {
        (zone_of(&c, "gpu-new-2") == Some(json!("zone-a"))).then_some(())
    });
    // The next set, through b, leaves gpu-new-2 out (its Node was deleted).
    let set = vec![node("gpu-new-1")];
    b.engine
        .replace_cluster_facts(&Value::Array(set.clone()))
        .unwrap();
    b.state.publish_cluster_facts(&set).unwrap();
    wait_for(WAIT, "a and c forget gpu-new-2", || {
        (zone_of(&a, "gpu-new-2").is_none()
            && zone_of(&c, "gpu-new-2").is_none()
            && zone_of(&c, "gpu-new-1").is_some())
        .then_some(())
    });
    // A record someone wrote under another node's key is left out, not applied.
    rt.block_on(async {
        let client = etcd.client("/probity/").await;
        client
            .put("cluster/gpu-forged", node("gpu-new-1").to_string())
            .await
            .unwrap();
    });
    let d = Peer::new(etcd.config(), Role::Webhook, "webhook:d");
    wait_for(WAIT, "d reads the set", || zone_of(&d, "gpu-new-1"));
    assert!(zone_of(&d, "gpu-forged").is_none());
}

/// The bug: an agent's facts that contradict the cluster's (its inventory names another
/// zone than the Node's label) were refused, and the facts before them stayed in force:
/// the node was judged on old telemetry for as long as its agent kept publishing. Now
/// the node counts as stale (`unreadable`) until its facts agree.
#[test]
fn bug_an_agents_facts_refused_for_contradicting_the_cluster_left_the_old_ones_in_force() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let webhook = Peer::new(etcd.config(), Role::Webhook, "webhook:a");
    let agent = Peer::new(etcd.config(), sidecar("gpu-7"), "sidecar:gpu-7");
    let unreadable = |p: &Peer| {
        p.engine
            .entities_json(Some("Node"))
            .into_iter()
            .find(|e| e["uid"]["id"] == "gpu-7")
            .map(|e| e["attrs"].get("unreadable").cloned())
    };
    agent.state.publish_facts(&facts("gpu-7", 60)).unwrap();
    wait_for(WAIT, "the webhook holds gpu-7's facts", || {
        unreadable(&webhook).filter(Option::is_none)
    });
    // The Node's label moves it to zone-b; the agent's inventory still says zone-a.
    let cluster = json!([{"uid": {"type": "Node", "id": "gpu-7"}, "attrs": {
        "zone": {"__entity": {"type": "Zone", "id": "zone-b"}}}}]);
    webhook.engine.replace_cluster_facts(&cluster).unwrap();
    let mut hotter = facts("gpu-7", 60);
    hotter.entities[0]["attrs"]["hottestGpuTempC"] = json!(91);
    agent.state.publish_facts(&hotter).unwrap();
    wait_for(WAIT, "gpu-7 counts as stale", || {
        unreadable(&webhook)
            .flatten()
            .filter(|u| *u == json!(["agent"]))
    });
}

#[test]
fn blocks_carry_etcds_create_revision_and_an_unblock_leaves_a_higher_tombstone() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let a = Peer::new(etcd.config(), Role::Webhook, "webhook:a");
    let b = Peer::new(etcd.config(), Role::Webhook, "webhook:b");
    let revision = |p: &Peer, node: &str| p.engine.blocked_nodes()[node].revision.unwrap();

    a.engine.block_node("gpu-1", "first").unwrap();
    let first = revision(&a, "gpu-1");
    wait_for(WAIT, "b sees a's block", || {
        b.engine.blocked_nodes().contains_key("gpu-1").then_some(())
    });
    // Blocked again: the same key, the same block number, in every process.
    b.engine.block_node("gpu-1", "again").unwrap();
    assert_eq!(revision(&b, "gpu-1"), first);
    wait_for(WAIT, "a sees the history", || {
        (a.engine.blocked_nodes()["gpu-1"].history.len() == 1).then_some(())
    });
    assert_eq!(revision(&a, "gpu-1"), first);
    assert!(a.engine.block_tombstones().unwrap().is_empty());

    b.engine.unblock_node("gpu-1").unwrap();
    let tombstones = a.engine.block_tombstones().unwrap();
    let unblocked = tombstones["gpu-1"];
    assert!(unblocked > first, "{unblocked} > {first}");
    // Unblocking a node not blocked leaves no tombstone.
    b.engine.unblock_node("gpu-2").unwrap();
    assert_eq!(b.engine.block_tombstones().unwrap(), tombstones);

    a.engine.block_node("gpu-1", "re-blocked").unwrap();
    let again = revision(&a, "gpu-1");
    assert!(again > unblocked, "{again} > {unblocked}");
    // The tombstone went with the new block: one per node unblocked and not since.
    assert!(a.engine.block_tombstones().unwrap().is_empty());
    wait_for(WAIT, "b sees the new block", || {
        (b.engine
            .blocked_nodes()
            .get("gpu-1")
            .and_then(|r| r.revision)
            == Some(again))
        .then_some(())
    });
}

#[test]
fn blocks_from_two_engines_reach_both_in_etcds_order_and_each_reads_its_own_writes() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let a = Peer::new(etcd.config(), sidecar("gpu-a"), "sidecar:gpu-a");
    let b = Peer::new(etcd.config(), Role::Webhook, "webhook:b");

    // Read-your-writes: the block is in force here when the call returns, no polling.
    a.engine.block_node("gpu-7", "checkpoint tampered").unwrap();
    assert_eq!(a.blocked(), ["gpu-7"]);
    wait_for(WAIT, "b sees a's block", || {
        (b.blocked() == ["gpu-7"]).then_some(())
    });
    assert_eq!(
        b.engine.blocked_nodes()["gpu-7"].reason,
        "checkpoint tampered"
    );
    // A block by b of a node a blocked joins its history, in both.
    b.engine.block_node("gpu-7", "operator").unwrap();
    assert_eq!(b.engine.blocked_nodes()["gpu-7"].history.len(), 1);
    wait_for(WAIT, "a sees the history", || {
        (a.engine.blocked_nodes()["gpu-7"].history.len() == 1).then_some(())
    });
    b.engine.unblock_node("gpu-7").unwrap();
    assert!(b.blocked().is_empty());

    // Both write at once, the same nodes: every process ends with etcd's list.
    std::thread::scope(|s| {
        for (peer, offset) in [(&a, 0), (&b, 1)] {
            s.spawn(move || {
                for i in 0..60 {
                    let node = format!("n{:02}", (i + offset) % 40);
                    if (i + offset) % 3 == 0 {
                        peer.engine.unblock_node(&node).unwrap();
                    } else {
                        peer.engine.block_node(&node, "race").unwrap();
                    }
                }
            });
        }
    });
    let want = etcd_blocklist(&rt, &etcd);
    assert!(!want.is_empty());
    for peer in [&a, &b] {
        wait_for(WAIT, "each engine converges on etcd's blocklist", || {
            (peer.blocked() == want).then_some(())
        });
    }

    // A block is a deny for every action on the node, here and there.
    let request = Request::from_json_slice(
        br#"{"principal": "Node::\"n01\"", "action": "listen", "resource": "Node::\"n01\"",
             "context": {"port": 22, "protocol": "tcp"}}"#,
    )
    .unwrap();
    let blocked = want.iter().any(|n| n == "n01");
    for peer in [&a, &b] {
        let d = peer.engine.decide(&request);
        if blocked {
            assert!(!d.is_allowed(), "{d:?}");
        }
    }
}

#[test]
fn a_block_that_cannot_reach_etcd_is_an_error_and_changes_nothing() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let target = format!("127.0.0.1:{}", etcd.members[0].client_port)
        .parse()
        .unwrap();
    let proxy = rt.block_on(Proxy::start(target));
    let mut config = etcd.config().with_retry_budget(Duration::from_millis(800));
    config.endpoints = vec![proxy.url()];
    let peer = Peer::new(config, sidecar("gpu-a"), "sidecar:gpu-a");
    proxy.cut();
    let err = peer.engine.block_node("gpu-9", "operator").unwrap_err();
    assert!(
        matches!(
            &err,
            probity::EntityError::State(StateError::Shared { operation, .. })
                if *operation == "blocking a node"
        ),
        "{err:?}"
    );
    assert!(peer.blocked().is_empty(), "never a silent local-only block");
    assert!(peer.engine.unblock_node("gpu-9").is_err());
}

/// A verification failure while etcd is unreachable: the reading node is blocked here at
/// once, flagged as not yet shared, kept through whatever the watch applies meanwhile,
/// and written to etcd as soon as it answers again.
#[test]
fn a_failed_verification_blocks_at_once_while_etcd_is_cut_off_and_lands_later() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let target = format!("127.0.0.1:{}", etcd.members[0].client_port)
        .parse()
        .unwrap();
    let proxy = rt.block_on(Proxy::start(target));
    let mut config = etcd.config().with_retry_budget(Duration::from_millis(800));
    config.endpoints = vec![proxy.url()];
    let options = EtcdStateOptions::new(sidecar("gpu-r"), "sidecar:gpu-r")
        .with_outbox_retry(Duration::from_millis(100));
    let reader = Peer::with_options(config, options);
    let other = Peer::new(etcd.config(), Role::Webhook, "webhook:o");
    other.engine.block_node("gpu-old", "earlier").unwrap();
    wait_for(WAIT, "the reader follows", || {
        (reader.blocked() == ["gpu-old"]).then_some(())
    });

    proxy.cut();
    let failure = std::io::Error::other("chunk 3 of models/llama does not match its manifest");
    let started = Instant::now();
    let decision = reader
        .engine
        .decide_read("gpu-r", "models/llama", Err(&failure));
    assert!(!decision.is_allowed());
    assert!(decision.errors.is_empty(), "{:?}", decision.errors);
    // In force at once, well before any etcd timeout could have passed.
    assert!(started.elapsed() < Duration::from_millis(800));
    assert_eq!(reader.blocked(), ["gpu-old", "gpu-r"]);
    let unshared: Vec<String> = reader
        .state
        .unshared_blocks()
        .into_iter()
        .map(|b| b.node)
        .collect();
    assert_eq!(unshared, ["gpu-r"]);
    assert_eq!(reader.state.shared_health().unwrap().unshared_blocks, 1);
    // Meanwhile etcd moves on without it; the reader keeps its block.
    other.engine.unblock_node("gpu-old").unwrap();

    proxy.restore();
    wait_for(WAIT, "the queued block reaches etcd", || {
        (etcd_blocklist(&rt, &etcd) == ["gpu-r"]).then_some(())
    });
    wait_for(WAIT, "every engine has etcd's list", || {
        (reader.blocked() == ["gpu-r"] && other.blocked() == ["gpu-r"]).then_some(())
    });
    wait_for(WAIT, "nothing is left unshared", || {
        reader.state.unshared_blocks().is_empty().then_some(())
    });
    assert!(
        other.engine.blocked_nodes()["gpu-r"]
            .reason
            .contains("chunk 3 of models/llama"),
        "{:?}",
        other.engine.blocked_nodes()
    );
}

/// The outbox is durable: a process that dies with a block not yet in etcd sends it when
/// it starts again.
#[test]
fn a_queued_block_survives_a_restart_of_the_process() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let dir = tempfile::tempdir().unwrap();
    let options = || {
        EtcdStateOptions::new(sidecar("gpu-q"), "sidecar:gpu-q")
            .with_outbox_retry(Duration::from_millis(100))
    };
    // Nothing listens here: the block can only be queued.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let mut unreachable = etcd.config().with_retry_budget(Duration::from_millis(300));
    unreachable.endpoints = vec![dead_url];
    {
        let state = EtcdState::open(unreachable, dir.path(), options()).unwrap();
        // A failed read's block: its reader, stop scope and taint effect travel through
        // the queue on disk and etcd unchanged.
        let reader = probity::ReaderPod::new(
            "train",
            "llm-0",
            Some("3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b".into()),
        )
        .unwrap();
        let record = probity::BlockRecord::new("failed verification", 5).with_stop(
            Some(reader),
            Some("node".into()),
            Some("NoExecute".into()),
        );
        state.queue_block("gpu-q", &record).unwrap();
        assert_eq!(state.unshared_blocks().len(), 1);
    }
    let state = Arc::new(EtcdState::open(etcd.config(), dir.path(), options()).unwrap());
    let engine = Engine::from_embedded_defaults().unwrap();
    engine.attach_state(state.attached()).unwrap();
    assert!(
        engine.blocked_nodes().contains_key("gpu-q"),
        "in force at start"
    );
    wait_for(WAIT, "the queued block reaches etcd", || {
        (etcd_blocklist(&rt, &etcd) == ["gpu-q"]).then_some(())
    });
    wait_for(WAIT, "and leaves the queue", || {
        state.unshared_blocks().is_empty().then_some(())
    });
    let stored = probity::state::SharedState::blocked_nodes(state.as_ref()).unwrap();
    let record = &stored.iter().find(|b| b.node == "gpu-q").unwrap().record;
    assert_eq!(
        record.reader.as_ref().map(|r| r.name.as_str()),
        Some("llm-0")
    );
    assert_eq!(
        (record.stop.as_deref(), record.taint_effect.as_deref()),
        (Some("node"), Some("NoExecute"))
    );
    assert_eq!(engine.blocked_nodes()["gpu-q"], *record);
}

/// Many rounds of two processes sealing one object id at once with different manifests:
/// exactly one wins each contested version, and the version stored never goes down.
#[test]
fn concurrent_seals_of_one_object_have_one_winner_each_and_never_go_down() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let sealers: Vec<EtcdState> = dirs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            EtcdState::open(
                etcd.config(),
                d.path(),
                EtcdStateOptions::new(Role::Webhook, format!("sealer:{i}")),
            )
            .unwrap()
        })
        .collect();
    let rounds = 150_u64;
    let barrier = std::sync::Barrier::new(2);
    let outcomes: Vec<Vec<Result<(), String>>> = std::thread::scope(|s| {
        let handles: Vec<_> = sealers
            .iter()
            .enumerate()
            .map(|(i, sealer)| {
                let barrier = &barrier;
                s.spawn(move || {
                    let mut out = Vec::new();
                    for round in 1..=rounds {
                        barrier.wait();
                        // Each offers this round's version with its own digest; now and
                        // then one also offers the version before (a rollback).
                        let rollback = round % 10 == 0 && i == 1;
                        // The rollback's digest is its own: offering the very version
                        // and digest already accepted is an idempotent success.
                        let digest = if rollback {
                            [9; 32]
                        } else {
                            [u8::try_from(i).unwrap() + 1; 32]
                        };
                        let version = if rollback { round - 1 } else { round };
                        let result = sealer.accept("models/llama", version, &digest, b"signed");
                        out.push(result.map_err(|e| match e {
                            StateError::Rollback { .. } => "rollback".to_owned(),
                            StateError::DigestConflict { .. } => "conflict".to_owned(),
                            other => format!("{other:?}"),
                        }));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut last = 0;
    for (round, (x, y)) in outcomes[0].iter().zip(&outcomes[1]).enumerate() {
        let wins = [x, y].iter().filter(|r| r.is_ok()).count();
        assert_eq!(wins, 1, "round {}: {x:?} / {y:?}", round + 1);
        for r in [x, y] {
            if let Err(e) = r {
                assert!(
                    e == "rollback" || e == "conflict",
                    "round {}: {e}",
                    round + 1
                );
            }
        }
        let stored = sealers[0].registry_entry("models/llama").unwrap().unwrap();
        assert!(
            stored.version >= last,
            "went down from {last} to {}",
            stored.version
        );
        last = stored.version;
    }
    assert_eq!(last, rounds);
    // A rollback is refused by both, from either side.
    assert!(matches!(
        sealers[1].accept("models/llama", 3, &[9; 32], b"old"),
        Err(StateError::Rollback {
            offered: 3,
            accepted,
            ..
        }) if accepted == rounds
    ));
}

/// The Node entity gpu-a1 as its agent would publish it.
fn node_entities(node: &str) -> Value {
    json!([{
        "uid": {"type": "Node", "id": node},
        "attrs": {
            "zone": {"__entity": {"type": "Zone", "id": "zone-a"}},
            "rack": "r1", "driverVersion": "590.48.01",
            "cudaImage": "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
            "gpuNode": true, "gpuCount": 8, "cpuCount": 64, "gpuMemoryMiB": 81920,
            "hottestGpuTempC": 58, "powerDrawW": 3000, "powerWindowMeanW": 2900,
            "gpuModel": {"__entity": {"type": "GpuModel", "id": "A100"}},
            // The blocklist owns this: a claim is dropped, not applied.
            "blocked": false
        },
        "parents": [{"type": "Zone", "id": "zone-a"}]
    }])
}

fn cluster_entities() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/entities/cluster.json"
    );
    let all: Vec<Value> = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    Value::Array(
        all.into_iter()
            .filter(|e| e["uid"]["type"] != "Node")
            .collect(),
    )
}

fn comply(node: &str) -> Request {
    Request::from_json_slice(
        format!(
            r#"{{"principal": "Node::\"{node}\"", "action": "comply", "resource": "Node::\"{node}\""}}"#
        )
        .as_bytes(),
    )
    .unwrap()
}

fn facts(node: &str, ttl_seconds: u64) -> NodeFacts {
    NodeFacts {
        node: node.to_owned(),
        entities: node_entities(node),
        collected_at: 1,
        ttl_seconds,
    }
}

/// Facts under a lease: a webhook replica judges a node on them while its agent
/// publishes; when the agent stops publishing, or dies, the facts expire and the node's
/// telemetry counts as stale (a deny with an alert), until it publishes again.
#[test]
fn facts_expire_with_their_publisher_and_the_node_becomes_stale_in_decisions() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let webhook = Peer::new(etcd.config(), Role::Webhook, "webhook:w");
    webhook.engine.upsert_entities(&cluster_entities()).unwrap();
    let sidecar_b = Peer::new(etcd.config(), sidecar("gpu-b1"), "sidecar:gpu-b1");
    sidecar_b
        .engine
        .upsert_entities(&cluster_entities())
        .unwrap();
    let agent_dir = tempfile::tempdir().unwrap();
    let agent = EtcdState::open(
        etcd.config(),
        agent_dir.path(),
        EtcdStateOptions::new(sidecar("gpu-a1"), "agent:gpu-a1"),
    )
    .unwrap();

    agent.publish_facts(&facts("gpu-a1", 2)).unwrap();
    let allowed = wait_for(WAIT, "the webhook judges gpu-a1 on its facts", || {
        let d = webhook.engine.decide(&comply("gpu-a1"));
        d.is_allowed().then_some(d)
    });
    assert!(
        allowed.reasons.iter().any(|r| r.policy == "thermal.comply"),
        "judged on its telemetry: {allowed:?}"
    );
    // A sidecar follows its own node's facts only.
    assert!(
        sidecar_b
            .engine
            .entity(&probity::EntityUid::new("Node", "gpu-a1").unwrap())
            .is_none()
    );
    assert_eq!(agent.node_facts().unwrap().len(), 1);

    // Publishing every half TTL keeps them alive well past it.
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        agent.publish_facts(&facts("gpu-a1", 2)).unwrap();
        assert!(webhook.engine.decide(&comply("gpu-a1")).is_allowed());
        std::thread::sleep(Duration::from_millis(500));
    }

    // The agent stops publishing (it hangs): after a TTL the facts go.
    let stale = wait_for(WAIT, "the silent agent's facts expire", || {
        let d = webhook.engine.decide(&comply("gpu-a1"));
        (!d.is_allowed()).then_some(d)
    });
    assert_eq!(
        stale.reasons[0].policy, "thermal.telemetry-unreadable",
        "{stale:?}"
    );
    assert!(stale.reasons[0].message.contains("agent"), "{stale:?}");
    assert_eq!(stale.obligations[0].kind, "alert");
    assert!(agent.node_facts().unwrap().is_empty());

    // Fresh facts judge it again; then the agent dies: its lease expires.
    agent.publish_facts(&facts("gpu-a1", 2)).unwrap();
    wait_for(WAIT, "fresh facts judge the node again", || {
        webhook
            .engine
            .decide(&comply("gpu-a1"))
            .is_allowed()
            .then_some(())
    });
    drop(agent);
    let gone = wait_for(WAIT, "the dead agent's facts expire", || {
        let d = webhook.engine.decide(&comply("gpu-a1"));
        (!d.is_allowed()).then_some(d)
    });
    assert_eq!(gone.reasons[0].policy, "thermal.telemetry-unreadable");
}

/// The sidecar's own facts reach it, and go when they expire.
#[test]
fn a_sidecar_follows_its_own_nodes_facts() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let peer = Peer::new(etcd.config(), sidecar("gpu-a1"), "sidecar:gpu-a1");
    peer.engine.upsert_entities(&cluster_entities()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let agent = EtcdState::open(
        etcd.config(),
        dir.path(),
        EtcdStateOptions::new(sidecar("gpu-a1"), "agent:gpu-a1"),
    )
    .unwrap();
    // Another node whose name starts with this one's: not followed.
    agent.publish_facts(&facts("gpu-a10", 30)).unwrap();
    agent.publish_facts(&facts("gpu-a1", 2)).unwrap();
    wait_for(WAIT, "the sidecar has its node's facts", || {
        peer.engine
            .decide(&comply("gpu-a1"))
            .is_allowed()
            .then_some(())
    });
    assert!(
        peer.engine
            .entity(&probity::EntityUid::new("Node", "gpu-a10").unwrap())
            .is_none()
    );
    drop(agent);
    wait_for(WAIT, "and sees them expire", || {
        (!peer.engine.decide(&comply("gpu-a1")).is_allowed()).then_some(())
    });
}

/// A process cut off while others write and etcd compacts the history its watch would
/// resume from: it reads everything again, and its blocklist equals etcd's.
#[test]
fn a_watch_behind_a_compaction_recovers_by_a_full_read() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let target = format!("127.0.0.1:{}", etcd.members[0].client_port)
        .parse()
        .unwrap();
    let proxy = rt.block_on(Proxy::start(target));
    let mut config = etcd.config();
    config.endpoints = vec![proxy.url()];
    let follower = Peer::new(config, Role::Webhook, "webhook:f");
    let writer = Peer::new(etcd.config(), Role::Webhook, "webhook:w");
    for i in 0..20 {
        writer
            .engine
            .block_node(&format!("n{i:02}"), "before")
            .unwrap();
    }
    wait_for(WAIT, "the follower has the first 20", || {
        (follower.blocked().len() == 20).then_some(())
    });

    proxy.cut();
    for i in 0..20 {
        if i % 2 == 0 {
            writer.engine.unblock_node(&format!("n{i:02}")).unwrap();
        }
    }
    for i in 20..50 {
        writer
            .engine
            .block_node(&format!("n{i:02}"), "while cut off")
            .unwrap();
    }
    rt.block_on(async {
        let client = etcd.client("/probity/").await;
        let (_, revision) = client.get("blocklist/").await.unwrap();
        client.compact(revision).await.unwrap();
    });
    proxy.restore();

    let want = etcd_blocklist(&rt, &etcd);
    assert_eq!(want.len(), 40);
    wait_for(WAIT, "the follower converges on etcd's blocklist", || {
        (follower.blocked() == want).then_some(())
    });
    assert!(follower.state.shared_health().unwrap().resyncs >= 1);
}

/// etcd stopped for a while: the state ages visibly and decisions keep serving from it;
/// restarted, everything catches up, and blocks written elsewhere while this process
/// was cut off arrive.
#[test]
fn etcd_down_then_back_state_ages_decisions_serve_and_no_block_is_lost() {
    let rt = runtime();
    let mut etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let config = etcd.config().with_retry_budget(Duration::from_millis(800));
    let peer = Peer::new(config, Role::Webhook, "webhook:p");
    peer.engine
        .block_node("gpu-down", "before the outage")
        .unwrap();
    let listen = Request::from_json_slice(
        br#"{"principal": "Node::\"gpu-down\"", "action": "listen", "resource": "Node::\"gpu-down\"",
             "context": {"port": 22, "protocol": "tcp"}}"#,
    )
    .unwrap();
    assert!(!peer.engine.decide(&listen).is_allowed());
    wait_for(WAIT, "fresh", || {
        let h = peer.state.shared_health().unwrap();
        (h.connected && h.since_last_heard? < Duration::from_secs(2)).then_some(())
    });

    etcd.stop(0, Signal::TERM);
    let health = wait_for(WAIT, "the state is seen to age", || {
        let h = peer.state.shared_health().unwrap();
        (!h.connected && h.since_last_heard? > Duration::from_secs(3)).then_some(h)
    });
    assert!(health.last_error.is_some());
    // Decisions still serve from the last state heard.
    assert!(!peer.engine.decide(&listen).is_allowed());
    assert!(peer.engine.block_node("gpu-x", "during").is_err());

    etcd.start(0);
    rt.block_on(etcd.wait_healthy(None));
    wait_for(WAIT, "fresh again", || {
        let h = peer.state.shared_health().unwrap();
        (h.connected && h.since_last_heard? < Duration::from_secs(2)).then_some(())
    });
    let other = Peer::new(etcd.config(), Role::Webhook, "webhook:o");
    other.engine.block_node("gpu-after", "after").unwrap();
    wait_for(WAIT, "blocks written elsewhere arrive", || {
        (peer.blocked() == ["gpu-after", "gpu-down"]).then_some(())
    });
}

/// Three members: a dead follower costs nothing; a dead leader costs writes until the
/// election, never the decisions served or a block.
#[test]
fn three_members_lose_a_follower_quietly_and_the_leader_only_for_an_election() {
    let rt = runtime();
    let mut etcd = Etcd::cluster();
    let leader = rt.block_on(etcd.wait_healthy(None));
    let follower = (leader + 1) % 3;
    let writer = Peer::new(etcd.config(), Role::Webhook, "webhook:w");
    let reader = Peer::new(etcd.config(), sidecar("gpu-z"), "sidecar:gpu-z");
    writer.engine.block_node("n-before", "before").unwrap();

    etcd.stop(follower, Signal::KILL);
    for i in 0..10 {
        writer
            .engine
            .block_node(&format!("n-f{i}"), "follower down")
            .unwrap();
    }
    wait_for(WAIT, "the reader follows through a dead follower", || {
        (reader.blocked().len() == 11).then_some(())
    });

    // The follower back, the leader killed: two of three elect a new leader.
    etcd.start(follower);
    rt.block_on(etcd.wait_healthy(None));
    let leader = rt.block_on(etcd.wait_healthy(None));
    etcd.stop(leader, Signal::KILL);
    let listen = Request::from_json_slice(
        br#"{"principal": "Node::\"n-before\"", "action": "listen", "resource": "Node::\"n-before\"",
             "context": {"port": 22, "protocol": "tcp"}}"#,
    )
    .unwrap();
    // Decisions serve throughout, from the state last heard.
    assert!(!reader.engine.decide(&listen).is_allowed());
    assert_eq!(reader.blocked().len(), 11);
    let mut refused = 0;
    wait_for(WAIT, "writes resume after the election", || {
        let written = writer.engine.block_node("n-after", "after the election");
        refused += usize::from(written.is_err());
        written.ok()
    });
    wait_for(WAIT, "and reach the reader", || {
        reader
            .blocked()
            .contains(&"n-after".to_owned())
            .then_some(())
    });
    assert!(!reader.engine.decide(&listen).is_allowed());
    eprintln!("writes refused during the election: {refused}");
}

/// A resync after a long disconnection (past `resync_after_disconnect`) reads the
/// blocklist whole, and the engine takes it whole.
#[test]
fn a_long_disconnection_ends_in_a_full_read() {
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let target = format!("127.0.0.1:{}", etcd.members[0].client_port)
        .parse()
        .unwrap();
    let proxy = rt.block_on(Proxy::start(target));
    let mut config = etcd.config();
    config.endpoints = vec![proxy.url()];
    let options = EtcdStateOptions::new(Role::Webhook, "webhook:l").with_resync(
        ResyncOptions::default().with_resync_after_disconnect(Duration::from_millis(500)),
    );
    let follower = Peer::with_options(config, options);
    let writer = Peer::new(etcd.config(), Role::Webhook, "webhook:w");
    writer.engine.block_node("a", "x").unwrap();
    wait_for(WAIT, "followed", || {
        (follower.blocked() == ["a"]).then_some(())
    });
    proxy.cut();
    writer.engine.unblock_node("a").unwrap();
    writer.engine.block_node("b", "y").unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    proxy.restore();
    wait_for(WAIT, "the follower has etcd's list", || {
        (follower.blocked() == ["b"]).then_some(())
    });
    assert!(follower.state.shared_health().unwrap().resyncs >= 1);
}

#[test]
fn served_digests_and_key_metadata_live_in_etcd() {
    use probity::state::ServedDigest;
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let a = EtcdState::open(
        etcd.config(),
        dirs[0].path(),
        EtcdStateOptions::new(Role::Webhook, "webhook:a").with_process_ttl(Duration::from_secs(2)),
    )
    .unwrap();
    let b = EtcdState::open(
        etcd.config(),
        dirs[1].path(),
        EtcdStateOptions::new(Role::Webhook, "webhook:b"),
    )
    .unwrap();
    for (s, digest) in [(&a, "d1"), (&b, "d2"), (&a, "d3")] {
        s.report_digest(&ServedDigest {
            process: s.options().process.clone(),
            digest: digest.into(),
            at: 1,
        })
        .unwrap();
    }
    let mut served: Vec<(String, String)> = b
        .served_digests()
        .unwrap()
        .into_iter()
        .map(|d| (d.process, d.digest))
        .collect();
    served.sort();
    assert_eq!(
        served,
        [
            ("webhook:a".to_owned(), "d3".to_owned()),
            ("webhook:b".to_owned(), "d2".to_owned())
        ]
    );
    // A process that is gone drops out after its lease's TTL.
    drop(a);
    wait_for(WAIT, "the gone process drops out", || {
        (b.served_digests().unwrap().len() == 1).then_some(())
    });

    // Key metadata: compare-and-swap on the record's revision.
    assert_eq!(b.key_record("k").unwrap(), None);
    let r1 = b.put_key_record("k", b"one", None).unwrap();
    assert!(matches!(
        b.put_key_record("k", b"again", None),
        Err(StateError::Conflict { expected: None, found: Some(f), .. }) if f == r1
    ));
    let r2 = b.put_key_record("k", b"two", Some(r1)).unwrap();
    assert!(b.put_key_record("k", b"stale", Some(r1)).is_err());
    assert_eq!(b.key_record("k").unwrap(), Some((b"two".to_vec(), r2)));
    assert_eq!(b.key_ids().unwrap(), ["k"]);
    assert!(b.delete_key_record("k", r1).is_err());
    b.delete_key_record("k", r2).unwrap();
    assert_eq!(b.key_record("k").unwrap(), None);

    // The decision and event logs stay in the local store.
    assert_eq!(
        b.local().record_event("o", None, "rollback", "d").unwrap(),
        0
    );
    assert_eq!(b.local().events(0).unwrap().len(), 1);
    assert!(b.describe().contains("logs: redb"), "{}", b.describe());
}

#[test]
fn a_quiet_log_on_etcd_is_checkpointed_by_time() {
    use probity::audit::{CheckpointPolicy, Log};
    let etcd = Etcd::single();
    runtime().block_on(etcd.wait_healthy(None));
    let dir = tempfile::tempdir().unwrap();
    let state = Arc::new(
        EtcdState::open(
            etcd.config(),
            dir.path(),
            EtcdStateOptions::new(Role::Webhook, "webhook:quiet"),
        )
        .unwrap(),
    );
    // Far more records than one deny before a checkpoint by count: only time makes it.
    state.local().set_checkpoint_policy(CheckpointPolicy {
        every_records: 1_000_000,
        every: Duration::from_millis(300),
        anchor: None,
    });
    let engine = Engine::from_embedded_defaults().unwrap();
    engine.attach_state(state.attached()).unwrap();
    let deny = engine.decide(&comply("gpu-quiet"));
    assert!(!deny.is_allowed(), "{deny:?}");
    assert_eq!(state.local().decisions(0, 10).unwrap().len(), 1);
    let checkpoint = wait_for(WAIT, "a checkpoint of the quiet decision log", || {
        state.local().checkpoints(Log::Decisions).unwrap().pop()
    });
    assert_eq!(checkpoint.seq, 0, "{checkpoint:?}");
}

/// The local logs of an etcd backend read the time from the clock it is given (the
/// engine's), not the system's: an event recorded at a fixed time carries that time.
#[test]
fn the_local_logs_of_an_etcd_backend_stamp_records_with_the_given_clock() {
    let etcd = Etcd::single();
    runtime().block_on(etcd.wait_healthy(None));
    let dir = tempfile::tempdir().unwrap();
    // 2026-01-01T00:00:00Z, far from the system clock of any run.
    let clock = Arc::new(probity::ManualClock::at(1_767_225_600));
    let state = EtcdState::open(
        etcd.config(),
        dir.path(),
        EtcdStateOptions::new(Role::Webhook, "webhook:clocked").with_clock(clock.clone()),
    )
    .unwrap();
    clock.advance(60);
    state
        .local()
        .record_event("models/llama", Some("gpu-1"), "chunk-mismatch", "chunk 3")
        .unwrap();
    let events = state.local().events(0).unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].time_unix, 1_767_225_660);
}

/// Issue 28, item 3: an admitted pod's facts, remembered by one webhook replica, are
/// read by another (the apiserver calls either for the binding), forgotten by either,
/// and live under a lease of the configured time.
#[test]
fn admitted_facts_remembered_by_one_replica_are_read_and_forgotten_by_another() {
    use probity::state::{AdmittedFacts, AdmittedLimits};
    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let a = Peer::new(etcd.config(), Role::Webhook, "webhook:a");
    let b = Peer::new(etcd.config(), Role::Webhook, "webhook:b");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let facts = AdmittedFacts {
        namespace: "training".into(),
        name: "rl-0".into(),
        uid: "pod-uid-1".into(),
        attrs: json!({"class": "rlhf", "gpus": 1}),
        admitted_at_ms: now,
    };
    let limits = AdmittedLimits {
        max: 100,
        seconds: 2,
    };
    a.state.remember_admitted(&facts, &limits).unwrap();
    assert_eq!(
        b.state.admitted("training", "rl-0", 60).unwrap(),
        Some(facts.clone())
    );
    b.state.forget_admitted("training", "rl-0").unwrap();
    assert_eq!(a.state.admitted("training", "rl-0", 60).unwrap(), None);

    // The lease (2 s plus a quarter, rounded up to whole seconds) removes what no
    // binding came for.
    a.state.remember_admitted(&facts, &limits).unwrap();
    wait_for(WAIT, "the lease to remove the entry", || {
        // A long max age: only the lease can make it vanish.
        b.state
            .admitted("training", "rl-0", 3600)
            .unwrap()
            .is_none()
            .then_some(())
    });
}

/// A `migrate` request lives under its agent's facts lease: a reader sees it while the
/// agent lives and no longer once the agent is gone, so a dead agent never keeps work
/// moving; a process that published no facts for the node cannot ask for it.
#[test]
fn an_action_request_goes_with_its_agents_facts_lease() {
    use probity::state::ActionRequest;

    let rt = runtime();
    let etcd = Etcd::single();
    rt.block_on(etcd.wait_healthy(None));
    let reader_dir = tempfile::tempdir().unwrap();
    let reader = EtcdState::open(
        etcd.config(),
        reader_dir.path(),
        EtcdStateOptions::new(Role::Webhook, "webhook:w"),
    )
    .unwrap();
    let agent_dir = tempfile::tempdir().unwrap();
    let agent = EtcdState::open(
        etcd.config(),
        agent_dir.path(),
        EtcdStateOptions::new(sidecar("gpu-a1"), "agent:gpu-a1"),
    )
    .unwrap();
    let request = ActionRequest {
        kind: "migrate".into(),
        target: "zone-a".into(),
        target_type: "Zone".into(),
        policy: "thermal.zone-power-ceiling".into(),
        reason: "at its ceiling".into(),
        node: "gpu-a1".into(),
        at: 1,
        ttl_seconds: 2,
        parameters: std::collections::BTreeMap::new(),
        dry_run: false,
    };
    let refused = agent.publish_action(&request).unwrap_err();
    assert!(
        format!("{refused:?}").contains("published no facts from this process"),
        "{refused:?}"
    );

    agent.publish_facts(&facts("gpu-a1", 2)).unwrap();
    agent.publish_action(&request).unwrap();
    assert_eq!(
        reader.action_requests().unwrap(),
        std::slice::from_ref(&request)
    );
    agent.withdraw_action(&request.key()).unwrap();
    assert!(reader.action_requests().unwrap().is_empty());

    agent.publish_action(&request).unwrap();
    assert_eq!(reader.action_requests().unwrap().len(), 1);
    drop(agent);
    wait_for(WAIT, "the dead agent's request expires", || {
        reader.action_requests().unwrap().is_empty().then_some(())
    });
}

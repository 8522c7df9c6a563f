//! `probity controller` against the real control plane: blocks in Probity become taints,
//! unblocks remove only what Probity set, and nothing acts at scale by mistake (the
//! breaker, the pause, the dry run, one active replica, no duplicate after a restart).

use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::api::events::v1::Event as EventV1;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchParams};
use serde_json::{Value, json};

use crate::cluster::{
    ControlPlane, Probity, copy_dir, probity_bin, root, start_controller, watch_until,
};
use crate::install::{Installed, gpu_pod, test_nodes};
use crate::services::{Proc, free_port};

const NAMESPACE: &str = "probity-system";
const TAINT: &str = "probity.io/blocked";
const WAIT: Duration = Duration::from_secs(60);

struct Harness {
    plane: ControlPlane,
    probity: Probity,
    _dir: tempfile::TempDir,
}

impl Harness {
    async fn start(nodes: &[&str]) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let plane = ControlPlane::start(dir.path()).await;
        plane.namespace(NAMESPACE).await;
        for node in nodes {
            plane
                .add_node(node, "zone-a", 8, "NVIDIA-A100-SXM4-80GB")
                .await;
        }
        let probity = Probity::start_on(
            &plane,
            &root().join("testdata/entities/cluster.json"),
            free_port(),
        )
        .await;
        Harness {
            plane,
            probity,
            _dir: dir,
        }
    }

    fn controller(&self, identity: &str, extra: &[&str]) -> Proc {
        start_controller(&self.plane, &self.probity, identity, extra)
    }

    /// `probity controller <args>` to completion; its standard output.
    fn command(&self, args: &[&str]) -> String {
        let out = Command::new(probity_bin())
            .arg("controller")
            .args(args)
            .arg("--kubeconfig")
            .arg(&self.plane.kubeconfig)
            .args(["--namespace", NAMESPACE])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "probity controller {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    async fn block(&self, node: &str, reason: &str) {
        let (status, body) = self
            .probity
            .call(
                "POST",
                &format!("/v1/nodes/{node}/block"),
                &json!({ "reason": reason }),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }

    async fn unblock(&self, node: &str) {
        let (status, body) = self
            .probity
            .call("POST", &format!("/v1/nodes/{node}/unblock"), &json!({}))
            .await;
        assert_eq!(status, 200, "{body}");
    }

    fn nodes(&self) -> Api<Node> {
        Api::all(self.plane.client())
    }

    /// Waits until node `name` satisfies `ready`; the node.
    async fn node_until(&self, name: &str, what: &str, ready: impl Fn(&Node) -> bool) -> Node {
        watch_until(
            &self.nodes(),
            &WatchParams::default().fields(&format!("metadata.name={name}")),
            &format!("node {name}: {what}"),
            WAIT,
            |n: &Node| ready(n).then(|| n.clone()),
        )
        .await
    }

    /// Waits until the controller's shared state satisfies `ready`; the state. A test
    /// that times out here prints the state as it was.
    async fn state_until(&self, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
        struct ShowState(std::path::PathBuf);
        impl Drop for ShowState {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    let out = Command::new(crate::cluster::kube_bin("kubectl"))
                        .arg("--kubeconfig")
                        .arg(&self.0)
                        .args([
                            "-n",
                            NAMESPACE,
                            "get",
                            "configmap",
                            "probity-controller-state",
                        ])
                        .args(["-o", "jsonpath={.data.state}"])
                        .output();
                    if let Ok(out) = out {
                        eprintln!("controller state: {}", String::from_utf8_lossy(&out.stdout));
                    }
                }
            }
        }
        let _show = ShowState(self.plane.kubeconfig.clone());
        let maps: Api<ConfigMap> = Api::namespaced(self.plane.client(), NAMESPACE);
        watch_until(
            &maps,
            &WatchParams::default().fields("metadata.name=probity-controller-state"),
            what,
            WAIT,
            |m: &ConfigMap| {
                let text = m.data.as_ref()?.get("state")?;
                let state: Value = serde_json::from_str(text).ok()?;
                ready(&state).then_some(state)
            },
        )
        .await
    }

    /// The controller's Events about node `name`: (reason, reporting instance).
    async fn events(&self, name: &str) -> Vec<(String, String)> {
        let events: Api<EventV1> = Api::all(self.plane.client());
        let list = events.list(&ListParams::default()).await.unwrap();
        list.items
            .into_iter()
            .filter(|e| e.reporting_controller.as_deref() == Some("probity-controller"))
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .map(|e| {
                (
                    e.reason.unwrap_or_default(),
                    e.reporting_instance.unwrap_or_default(),
                )
            })
            .collect()
    }

    async fn lease_holder(&self) -> Option<String> {
        let leases: Api<Lease> = Api::namespaced(self.plane.client(), NAMESPACE);
        leases
            .get_opt("probity-controller")
            .await
            .unwrap()
            .and_then(|l| l.spec?.holder_identity)
    }
}

fn has_taint(node: &Node, key: &str) -> bool {
    taints(node).iter().any(|(k, _)| k == key)
}

fn taints(node: &Node) -> Vec<(String, String)> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|t| {
            t.iter()
                .map(|t| (t.key.clone(), t.effect.clone()))
                .collect()
        })
        .unwrap_or_default()
}

fn annotation(node: &Node) -> Option<Value> {
    let text = node
        .metadata
        .annotations
        .as_ref()?
        .get("probity.io/block")?;
    serde_json::from_str(text).ok()
}

fn outcomes(state: &Value, outcome: &str) -> Vec<String> {
    state["report"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter(|r| r["outcome"] == outcome)
                .filter_map(|r| r["node"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_taints_the_node_and_an_unblock_removes_only_what_probity_set() {
    let h = Harness::start(&["gpu-1", "gpu-2", "gpu-3"]).await;
    // Someone else's taint and cordon on gpu-1; an operator's own probity.io/blocked
    // taint already on gpu-3.
    h.nodes()
        .patch(
            "gpu-1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": true, "taints": [
                {"key": "example.com/maintenance", "effect": "NoSchedule"}]}})),
        )
        .await
        .unwrap();
    h.nodes()
        .patch(
            "gpu-3",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": [{"key": TAINT, "effect": "NoSchedule"}]}})),
        )
        .await
        .unwrap();
    let _controller = h.controller("c1", &[]);

    h.block("gpu-1", "bad checkpoint read").await;
    h.block("gpu-3", "operator").await;
    let node = h
        .node_until("gpu-1", "Probity's taint", |n| has_taint(n, TAINT))
        .await;
    let mark = annotation(&node).unwrap();
    assert_eq!(mark["reason"], "bad checkpoint read");
    assert_eq!(mark["taintAdded"], true);
    assert!(
        has_taint(&node, "example.com/maintenance"),
        "{:?}",
        taints(&node)
    );
    assert_eq!(node.spec.as_ref().unwrap().unschedulable, Some(true));
    let gpu3 = h
        .node_until("gpu-3", "Probity's annotation", |n| annotation(n).is_some())
        .await;
    assert_eq!(annotation(&gpu3).unwrap()["taintAdded"], false);
    assert_eq!(taints(&gpu3), [(TAINT.to_owned(), "NoSchedule".to_owned())]);
    assert!(
        h.events("gpu-1")
            .await
            .iter()
            .any(|(reason, _)| reason == "ProbityBlocked")
    );

    h.unblock("gpu-1").await;
    h.unblock("gpu-3").await;
    let node = h
        .node_until("gpu-1", "Probity's taint gone", |n| !has_taint(n, TAINT))
        .await;
    assert!(annotation(&node).is_none());
    assert_eq!(
        taints(&node),
        [(
            "example.com/maintenance".to_owned(),
            "NoSchedule".to_owned()
        )]
    );
    assert_eq!(node.spec.as_ref().unwrap().unschedulable, Some(true));
    // The taint Probity found on gpu-3 is the operator's: it stays.
    let gpu3 = h
        .node_until("gpu-3", "Probity's annotation gone", |n| {
            annotation(n).is_none()
        })
        .await;
    assert_eq!(taints(&gpu3), [(TAINT.to_owned(), "NoSchedule".to_owned())]);
    assert!(taints(&h.nodes().get("gpu-2").await.unwrap()).is_empty());
    let state = h
        .state_until("both releases reported", |s| {
            outcomes(s, "done").iter().filter(|n| *n == "gpu-1").count() == 2
        })
        .await;
    assert!(outcomes(&state, "done").contains(&"gpu-3".to_owned()));
    assert!(state["unlogged"].is_null(), "{state}");

    // Every action is in Probity's own event log (chained, and forwarded to a SIEM from
    // there), recorded under the controller's certificate.
    let mut h = h;
    h.probity.stop();
    let store = probity::state::StateStore::open(&h.probity.state_dir).unwrap();
    let events = probity::state::LocalLog::events(&store, 0).unwrap();
    let kinds: Vec<(String, String)> = events
        .iter()
        .filter(|e| e.kind.starts_with("controller-"))
        .map(|e| (e.node.clone().unwrap_or_default(), e.kind.clone()))
        .collect();
    for expected in [
        ("gpu-1", "controller-block-done"),
        ("gpu-3", "controller-block-done"),
        ("gpu-1", "controller-release-done"),
        ("gpu-3", "controller-release-done"),
    ] {
        assert!(
            kinds.contains(&(expected.0.to_owned(), expected.1.to_owned())),
            "{expected:?} in {kinds:?}"
        );
    }
    assert!(
        events
            .iter()
            .filter(|e| e.kind.starts_with("controller-"))
            .all(|e| e.detail.ends_with("(recorded by cn:probity-controller)")),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_trips_at_its_threshold_and_reports_the_rest_until_reset() {
    let names = ["gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6"];
    let h = Harness::start(&names).await;
    let _controller = h.controller("c1", &["--max-nodes", "2", "--max-percent", "100"]);
    for node in &names[..5] {
        h.block(node, "mass failure").await;
    }
    let state = h
        .state_until("two blocks done, three refused", |s| {
            outcomes(s, "done").len() == 2 && outcomes(s, "refused").len() == 3
        })
        .await;
    assert!(
        state["breaker"]["tripped"]["reason"]
            .as_str()
            .unwrap()
            .contains("limit 2")
    );
    let tainted: Vec<String> = h
        .nodes()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .filter(|n| has_taint(n, TAINT))
        .filter_map(|n| n.metadata.name.clone())
        .collect();
    assert_eq!(tainted, outcomes(&state, "done"));
    let status: Value = serde_json::from_str(&h.command(&["status"])).unwrap();
    assert!(status["breaker"]["tripped"].is_object(), "{status}");

    // Releases are never held back by a tripped breaker.
    h.unblock(&tainted[0]).await;
    h.node_until(&tainted[0], "released while tripped", |n| {
        !has_taint(n, TAINT)
    })
    .await;

    // A reset opens a fresh window: two more, then it trips again.
    let out = h.command(&["reset"]);
    assert!(out.contains("breaker: closed"), "{out}");
    let state = h
        .state_until("two more blocks after the reset", |s| {
            outcomes(s, "done").len() == 5 && s["breaker"]["tripped"].is_object()
        })
        .await;
    let blocked_now = h
        .nodes()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .filter(|n| has_taint(n, TAINT))
        .count();
    assert_eq!(blocked_now, 3, "{state}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_lease_holder_acts_and_another_replica_takes_over_when_it_dies() {
    let h = Harness::start(&["gpu-1", "gpu-2"]).await;
    let mut first = h.controller("first", &[]);
    h.block("gpu-1", "first block").await;
    h.node_until("gpu-1", "tainted by the first replica", |n| {
        has_taint(n, TAINT)
    })
    .await;
    assert_eq!(h.lease_holder().await.as_deref(), Some("first"));
    let _second = h.controller("second", &[]);
    // The second replica waits: the lease stays with the first while it renews.
    first.assert_running();
    assert_eq!(h.lease_holder().await.as_deref(), Some("first"));

    drop(first); // SIGKILL: no lease release, the second waits out the lease.
    h.block("gpu-2", "second block").await;
    h.node_until("gpu-2", "tainted by the second replica", |n| {
        has_taint(n, TAINT)
    })
    .await;
    assert_eq!(h.lease_holder().await.as_deref(), Some("second"));
    let gpu1 = h.events("gpu-1").await;
    assert_eq!(
        gpu1,
        [("ProbityBlocked".to_owned(), "first".to_owned())],
        "one action on gpu-1, by the leader"
    );
    let gpu2 = h.events("gpu-2").await;
    assert_eq!(gpu2, [("ProbityBlocked".to_owned(), "second".to_owned())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_reports_what_it_would_do_and_changes_nothing() {
    let h = Harness::start(&["gpu-1", "gpu-2", "gpu-3"]).await;
    let out = h.command(&["dry-run", "on"]);
    assert!(out.contains("dry run: true"), "{out}");
    let _controller = h.controller("c1", &["--max-nodes", "1", "--max-percent", "100"]);
    h.block("gpu-1", "dry").await;
    h.block("gpu-2", "dry").await;
    let state = h
        .state_until("the would-be actions", |s| {
            s["would"].as_array().is_some_and(|w| w.len() == 2)
        })
        .await;
    let would: Vec<(String, String)> = state["would"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["node"].as_str().unwrap().to_owned(),
                w["detail"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(would[0].0, "gpu-1");
    assert!(would[0].1.starts_with("dry"), "{would:?}");
    // The breaker's limit is in the report, and nothing was counted against it.
    assert!(would[1].1.contains("circuit breaker"), "{would:?}");
    assert!(state["breaker"]["tripped"].is_null(), "{state}");
    for node in ["gpu-1", "gpu-2"] {
        let node = h.nodes().get(node).await.unwrap();
        assert!(taints(&node).is_empty());
        assert!(annotation(&node).is_none());
    }
    assert!(h.events("gpu-1").await.is_empty());

    // Off: the same plan is carried out.
    h.command(&["dry-run", "off"]);
    h.node_until("gpu-1", "tainted once the dry run is off", |n| {
        has_taint(n, TAINT)
    })
    .await;
    h.state_until("gpu-2 refused by the breaker", |s| {
        outcomes(s, "refused") == ["gpu-2"]
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_controller_acts_once_and_catches_up_with_what_changed_while_down() {
    let h = Harness::start(&["gpu-1", "gpu-2"]).await;
    let controller = h.controller("c1", &[]);
    h.block("gpu-1", "before the restart").await;
    h.node_until("gpu-1", "tainted", |n| has_taint(n, TAINT))
        .await;
    // Stopped once the block is reported (a crash between the taint and the report
    // loses the report line and the Event, never the taint).
    h.state_until("gpu-1's block reported", |s| {
        outcomes(s, "done") == ["gpu-1"]
    })
    .await;
    drop(controller);

    // While it is down: gpu-1 unblocked, gpu-2 blocked.
    h.unblock("gpu-1").await;
    h.block("gpu-2", "while down").await;
    let _controller = h.controller("c2", &[]);
    h.node_until("gpu-1", "released after the restart", |n| {
        !has_taint(n, TAINT)
    })
    .await;
    h.node_until("gpu-2", "tainted after the restart", |n| {
        has_taint(n, TAINT)
    })
    .await;
    let state = h
        .state_until("gpu-1's release reported", |s| {
            s["releasedRevisions"]["gpu-1"].is_u64()
        })
        .await;
    // One block of gpu-1 (before), one release (after); never a second block.
    let mut gpu1: Vec<String> = h.events("gpu-1").await.into_iter().map(|e| e.0).collect();
    gpu1.sort();
    assert_eq!(gpu1, ["ProbityBlocked", "ProbityReleased"], "{state}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_controller_acts_on_nothing_until_resumed() {
    let h = Harness::start(&["gpu-1"]).await;
    let metrics_port = free_port();
    let _controller = h.controller(
        "c1",
        &["--metrics-listen", &format!("127.0.0.1:{metrics_port}")],
    );
    let out = h.command(&["pause"]);
    assert!(out.contains("paused: true"), "{out}");
    h.block("gpu-1", "while paused").await;
    // Passes go on while paused (the metrics count them): wait for several after the
    // block, then nothing may have changed.
    five_more_passes(metrics_port, "five passes while paused").await;
    assert!(taints(&h.nodes().get("gpu-1").await.unwrap()).is_empty());
    let text = metrics_text(metrics_port).await;
    assert!(text.contains("probity_controller_paused 1"), "{text}");

    // Someone else's label on the state ConfigMap survives the controller's writes.
    let maps: Api<ConfigMap> = Api::namespaced(h.plane.client(), NAMESPACE);
    maps.patch(
        "probity-controller-state",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"team": "ops"}}})),
    )
    .await
    .unwrap();
    h.command(&["resume"]);
    h.node_until("gpu-1", "tainted once resumed", |n| has_taint(n, TAINT))
        .await;
    let state = h
        .state_until("the block reported", |s| outcomes(s, "done") == ["gpu-1"])
        .await;
    let map = maps.get("probity-controller-state").await.unwrap();
    assert_eq!(
        map.metadata.labels.unwrap().get("team").map(String::as_str),
        Some("ops"),
        "{state}"
    );
}

/// Stale-event replay: Probity restarted from a backup of its store taken while a node
/// was blocked serves that block again after its unblock. Its store number is not above
/// the release the controller recorded, so it is reported stale and never acted on,
/// however often it is answered; a block made after it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_replayed_from_a_restored_backup_of_probitys_store_is_never_acted_on() {
    let mut h = Harness::start(&["gpu-1"]).await;
    let metrics_port = free_port();
    let _controller = h.controller(
        "c1",
        &["--metrics-listen", &format!("127.0.0.1:{metrics_port}")],
    );
    h.block("gpu-1", "before the backup").await;
    h.node_until("gpu-1", "tainted", |n| has_taint(n, TAINT))
        .await;
    let backup = h.probity.state_dir.with_extension("backup");
    h.probity.stop();
    copy_dir(&h.probity.state_dir, &backup);
    h.probity.restart().await;
    h.unblock("gpu-1").await;
    h.node_until("gpu-1", "released", |n| !has_taint(n, TAINT))
        .await;
    let state = h
        .state_until("the release's tombstone", |s| {
            s["releasedRevisions"]["gpu-1"].is_u64()
        })
        .await;
    let released = state["releasedRevisions"]["gpu-1"].as_u64().unwrap();

    // Restored: Probity holds the block again, under its old number.
    h.probity.stop();
    std::fs::remove_dir_all(&h.probity.state_dir).unwrap();
    copy_dir(&backup, &h.probity.state_dir);
    h.probity.restart().await;
    let (_, blocked) = h.probity.call("GET", "/v1/nodes/blocked", &json!({})).await;
    assert_eq!(
        blocked["nodes"]["gpu-1"]["revision"].as_u64(),
        Some(released),
        "{blocked}"
    );
    h.state_until("the replay reported stale", |s| {
        outcomes(s, "stale") == ["gpu-1"]
    })
    .await;
    five_more_passes(metrics_port, "five passes answered the replay").await;
    let node = h.nodes().get("gpu-1").await.unwrap();
    assert!(taints(&node).is_empty(), "{:?}", taints(&node));

    // Unblocked and blocked again in the restored store: numbered after the replay,
    // so acted on.
    h.unblock("gpu-1").await;
    h.block("gpu-1", "after the restore").await;
    let node = h
        .node_until("gpu-1", "tainted by the new block", |n| has_taint(n, TAINT))
        .await;
    assert_eq!(
        annotation(&node).unwrap()["reason"],
        "after the restore",
        "{node:?}"
    );
}

/// The settings name another taint key while nodes are blocked: Probity's old taint
/// moves to the new key in one change, an operator's taint with the old key stays, and
/// a release removes exactly what Probity set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_block_taint_setting_moves_probitys_taint_and_leaves_an_operators() {
    const MOVED: &str = "example.com/quarantine";
    let mut h = Harness::start(&["gpu-1", "gpu-2"]).await;
    // An operator's taint with Probity's key, on gpu-2 before any block.
    h.nodes()
        .patch(
            "gpu-2",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": [{"key": TAINT, "effect": "NoSchedule"}]}})),
        )
        .await
        .unwrap();
    let _controller = h.controller("c1", &[]);
    h.block("gpu-1", "before the change").await;
    h.block("gpu-2", "before the change").await;
    h.node_until("gpu-1", "tainted", |n| has_taint(n, TAINT))
        .await;
    h.node_until("gpu-2", "marked", |n| annotation(n).is_some())
        .await;

    let policies = h.probity.state_dir.with_extension("policies");
    copy_dir(&root().join("policies"), &policies);
    let settings = policies.join("probity.toml");
    let text = std::fs::read_to_string(&settings).unwrap();
    let changed = text.replace(
        "block_taint_key = \"probity.io/blocked\"",
        &format!("block_taint_key = \"{MOVED}\""),
    );
    assert_ne!(changed, text, "probity.toml names the taint key");
    std::fs::write(&settings, changed).unwrap();
    h.probity.stop();
    h.probity.policies = policies;
    h.probity.restart().await;

    h.node_until("gpu-1", "Probity's taint moved", |n| {
        has_taint(n, MOVED) && !has_taint(n, TAINT)
    })
    .await;
    let gpu2 = h
        .node_until("gpu-2", "the new taint added", |n| has_taint(n, MOVED))
        .await;
    assert!(has_taint(&gpu2, TAINT), "{:?}", taints(&gpu2));

    h.unblock("gpu-1").await;
    h.unblock("gpu-2").await;
    h.node_until("gpu-1", "released", |n| taints(n).is_empty())
        .await;
    let gpu2 = h
        .node_until("gpu-2", "released", |n| !has_taint(n, MOVED))
        .await;
    assert_eq!(
        taints(&gpu2),
        [(TAINT.to_owned(), "NoSchedule".to_owned())],
        "{gpu2:?}"
    );
}

/// A drain (`@param_stop("node")`) a disruption budget holds up, and the controller
/// restarted in the middle of it: the new one finishes it, every pod of the node is
/// evicted exactly once (the reader too, though it is asked for by name), none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_restarted_mid_drain_evicts_each_pod_once_and_loses_none() {
    let mut h = Harness::start(&["gpu-1"]).await;
    // The read-failure policy, opted into draining the node.
    let policies = h.probity.state_dir.with_extension("policies");
    copy_dir(&root().join("policies"), &policies);
    let rule = policies.join("integrity/checkpoints.cedar");
    let text = std::fs::read_to_string(&rule).unwrap();
    let drains = text.replace("@param_stop(\"reader\")", "@param_stop(\"node\")");
    assert_ne!(drains, text, "the policy names its stop");
    std::fs::write(&rule, drains).unwrap();
    h.probity.stop();
    h.probity.policies = policies;
    h.probity.restart().await;

    h.plane.namespace("training").await;
    let reader = bound_pod(
        &h,
        "training",
        "trainer-0",
        "gpu-1",
        json!({"app": "trainer"}),
        true,
    )
    .await;
    bound_pod(
        &h,
        "training",
        "worker-1",
        "gpu-1",
        json!({"app": "worker"}),
        true,
    )
    .await;
    for name in ["guarded-0", "guarded-1"] {
        bound_pod(
            &h,
            "training",
            name,
            "gpu-1",
            json!({"app": "guarded"}),
            true,
        )
        .await;
    }
    let budgets = guard_budget(&h).await;

    let first = h.controller("c1", &[]);
    let (status, body) = h
        .probity
        .call(
            "POST",
            "/v1/verify",
            &json!({"path": tampered_checkpoint(&h), "id": "testdata/known-answer",
                    "node": "gpu-1",
                    "reader": {"namespace": "training", "name": "trainer-0", "uid": reader}}),
        )
        .await;
    assert_eq!((status, &body["verified"]), (200, &json!(false)), "{body}");
    // Mid-drain: the reader and the free pod evicted, the budget's pods refused and
    // retried more than once (each retry also passes by the reader again).
    h.state_until("the drain held up by the budget", |s| {
        s["stopping"]["training/guarded-0"]["attempts"].as_u64() >= Some(2)
            && s["stopping"]["training/guarded-1"]["attempts"].as_u64() >= Some(2)
    })
    .await;
    drop(first);

    budgets
        .delete("guarded", &DeleteParams::default())
        .await
        .unwrap();
    let _second = h.controller("c2", &[]);
    let state = h
        .state_until("the drain finished", |s| s["stopped"]["gpu-1"].is_object())
        .await;
    let evictions = |pod: &str| {
        state["report"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["detail"] == format!("training/{pod} evicted"))
            .count()
    };
    assert_eq!(
        ["trainer-0", "worker-1", "guarded-0", "guarded-1"].map(evictions),
        [1, 1, 1, 1],
        "{state}"
    );
    let pods: Api<Pod> = Api::namespaced(h.plane.client(), "training");
    for name in ["trainer-0", "worker-1", "guarded-0", "guarded-1"] {
        assert!(terminating(&pods.get(name).await.unwrap()), "{name}");
    }
}

async fn metrics_text(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut tcp) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    let _ = tcp
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await;
    let mut out = String::new();
    let _ = tcp.read_to_string(&mut out).await;
    out
}

/// Waits until the controller serving metrics on `port` has made five more passes.
async fn five_more_passes(port: u16, what: &str) {
    let passes = |text: &str| -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix("probity_controller_passes_total "))
            .and_then(|v| v.trim().parse().ok())
    };
    let count = || async {
        crate::cluster::poll_ready("the controller's metrics", WAIT, || async {
            passes(&metrics_text(port).await)
        })
        .await
    };
    let start = count().await;
    crate::cluster::poll_ready(what, WAIT, || async {
        (count().await >= start + 5).then_some(())
    })
    .await;
}

/// A blocked node runs what tolerates Probity's taint (its own agents) and nothing else:
/// the taint, the webhook's binding check and the extender agree, through the pods'
/// tolerations as a fact of the default block policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemonset_tolerating_probitys_taint_runs_on_a_blocked_node_and_one_that_does_not_is_kept_off()
 {
    let cluster = Installed::start().await;
    let _controller = start_controller(&cluster.plane, &cluster.probity, "c1", &[]);
    let nodes: Api<Node> = Api::all(cluster.plane.client());
    watch_until(
        &nodes,
        &WatchParams::default().fields("metadata.name=gpu-blocked"),
        "gpu-blocked tainted",
        WAIT,
        |n: &Node| has_taint(n, TAINT).then_some(()),
    )
    .await;
    let daemonsets: Api<DaemonSet> = Api::namespaced(cluster.plane.client(), "training");
    for (name, tolerations) in [
        ("node-agent", json!([{"key": TAINT, "operator": "Exists"}])),
        ("plain-agent", json!([])),
    ] {
        let ds: DaemonSet = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {
                        "tolerations": tolerations,
                        "containers": [{"name": "agent", "image": "agent:1",
                            "resources": {"requests": {"cpu": "100m"}}}]
                    }
                }
            }
        }))
        .unwrap();
        daemonsets
            .create(&PostParams::default(), &ds)
            .await
            .unwrap();
    }
    // The tolerating agent's pod for gpu-blocked is made and bound there: the binding
    // passed Probity's webhook.
    let pods = cluster.pods("training");
    let bound = watch_until(
        &pods,
        &WatchParams::default().labels("app=node-agent"),
        "node-agent's pod bound to gpu-blocked",
        WAIT,
        |p: &Pod| (p.spec.as_ref()?.node_name.as_deref() == Some("gpu-blocked")).then(|| p.clone()),
    )
    .await;
    assert!(bound.metadata.name.unwrap().starts_with("node-agent-"));
    // The other agent runs on every node but the blocked one: the DaemonSet controller
    // reads the taint and makes no pod for it.
    let node_count = test_nodes().len();
    let targets = watch_until(
        &daemonsets,
        &WatchParams::default().fields("metadata.name=plain-agent"),
        "plain-agent's desired pods counted",
        WAIT,
        |d: &DaemonSet| {
            let status = d.status.as_ref()?;
            (status.desired_number_scheduled > 0 && status.observed_generation.is_some())
                .then_some(status.desired_number_scheduled)
        },
    )
    .await;
    assert_eq!(targets as usize, node_count - 1);
    let plain = pods
        .list(&ListParams::default().labels("app=plain-agent"))
        .await
        .unwrap();
    for pod in &plain.items {
        let spec = serde_json::to_value(&pod.spec).unwrap();
        assert_ne!(spec["nodeName"], "gpu-blocked");
        // The DaemonSet controller names its node in matchFields; Probity's mutating
        // webhook adds its own terms beside it.
        let terms = &spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"];
        for term in terms.as_array().unwrap() {
            for field in term["matchFields"].as_array().into_iter().flatten() {
                assert!(
                    !field["values"]
                        .as_array()
                        .unwrap()
                        .contains(&json!("gpu-blocked")),
                    "{spec}"
                );
            }
        }
    }
}

/// The mutating webhook's affinity names `topology.probity.io/zone`: the controller keeps
/// it equal to each node's zone in Probity's store, so GPU pods bind on nodes that
/// registered without it (or with a wrong one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_without_probitys_zone_label_get_it_from_the_store_and_gpu_pods_bind() {
    let cluster = Installed::start().await;
    let nodes: Api<Node> = Api::all(cluster.plane.client());
    let zone_label =
        |value: Value| json!({"metadata": {"labels": {"topology.probity.io/zone": value}}});
    for node in ["gpu-a1", "gpu-spike"] {
        nodes
            .patch(
                node,
                &PatchParams::default(),
                &Patch::Merge(zone_label(Value::Null)),
            )
            .await
            .unwrap();
    }
    nodes
        .patch(
            "gpu-h1",
            &PatchParams::default(),
            &Patch::Merge(zone_label(json!("zone-wrong"))),
        )
        .await
        .unwrap();
    // Without the label no node matches the affinity: the pod waits.
    cluster
        .create_pod("training", &gpu_pod("train-before", "training", 8, "16"))
        .await
        .unwrap();
    cluster
        .failed_scheduling(
            "training",
            "train-before",
            "didn't match Pod's node affinity",
        )
        .await;

    let _controller = start_controller(&cluster.plane, &cluster.probity, "c1", &[]);
    for (node, zone) in [
        ("gpu-a1", "zone-a"),
        ("gpu-spike", "zone-a"),
        ("gpu-h1", "zone-rlhf"),
    ] {
        watch_until(
            &nodes,
            &WatchParams::default().fields(&format!("metadata.name={node}")),
            &format!("{node} labelled {zone}"),
            WAIT,
            |n: &Node| {
                (n.metadata
                    .labels
                    .as_ref()?
                    .get("topology.probity.io/zone")?
                    == zone)
                    .then_some(())
            },
        )
        .await;
    }
    let node = cluster.bound("training", "train-before").await;
    assert!(["gpu-a1", "gpu-spike"].contains(&node.as_str()), "{node}");
    // Only that label: the node's other labels are as they were.
    let a1 = nodes.get("gpu-a1").await.unwrap();
    let labels = a1.metadata.labels.unwrap();
    assert_eq!(labels["topology.kubernetes.io/zone"], "zone-a");
    assert_eq!(labels["kubernetes.io/hostname"], "gpu-a1");
}

/// A pod bound to `node` in `namespace` (no kubelet: it stays as created), made Running
/// and Ready when `ready`, so a disruption budget counts it. Its uid.
async fn bound_pod(
    h: &Harness,
    namespace: &str,
    name: &str,
    node: &str,
    labels: Value,
    ready: bool,
) -> String {
    let pods: Api<Pod> = Api::namespaced(h.plane.client(), namespace);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "trainer:1"}]}
    }))
    .unwrap();
    let created = pods.create(&PostParams::default(), &pod).await.unwrap();
    if ready {
        let status = json!({"status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True"}]}});
        pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
    }
    created.metadata.uid.unwrap()
}

/// A checkpoint under Probity's data root with one byte flipped, beside its signed
/// manifest: the verified read of it fails.
fn tampered_checkpoint(h: &Harness) -> std::path::PathBuf {
    let path = h.probity.data_dir.join("epoch-7.ckpt");
    let mut data = std::fs::read(root().join("testdata/integrity/object-7chunks.bin")).unwrap();
    data[100] ^= 0x01;
    std::fs::write(&path, data).unwrap();
    std::fs::copy(
        root().join("testdata/integrity/signed-manifest-v1.bin"),
        h.probity.data_dir.join("epoch-7.ckpt.manifest"),
    )
    .unwrap();
    path
}

/// The reading pod reads the tampered checkpoint through Probity's API, naming itself.
async fn failed_read(h: &Harness, node: &str, namespace: &str, pod: &str, uid: &str) {
    let path = tampered_checkpoint(h);
    let (status, body) = h
        .probity
        .call(
            "POST",
            "/v1/verify",
            &json!({"path": path, "id": "testdata/known-answer", "node": node,
                    "reader": {"namespace": namespace, "name": pod, "uid": uid}}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["verified"], false, "{body}");
    let (_, blocked) = h.probity.call("GET", "/v1/nodes/blocked", &json!({})).await;
    assert_eq!(blocked["nodes"][node]["reader"]["name"], pod, "{blocked}");
    assert_eq!(blocked["nodes"][node]["stop"], "reader", "{blocked}");
}

/// A PodDisruptionBudget over the two ready `app=guarded` pods in `training` that
/// allows no disruption, once the disruption controller counts both healthy.
async fn guard_budget(h: &Harness) -> Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> {
    let budgets: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        Api::namespaced(h.plane.client(), "training");
    budgets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "guarded"},
                "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "guarded"}}}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    watch_until(
        &budgets,
        &WatchParams::default().fields("metadata.name=guarded"),
        "the budget counting both pods healthy",
        WAIT,
        |b: &k8s_openapi::api::policy::v1::PodDisruptionBudget| {
            let status = b.status.as_ref()?;
            (status.current_healthy == Some(2) && status.disruptions_allowed == Some(0))
                .then_some(())
        },
    )
    .await;
    budgets
}

fn terminating(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_verified_read_taints_the_node_and_evicts_only_the_reading_pod() {
    let h = Harness::start(&["gpu-1", "gpu-2"]).await;
    h.plane.namespace("training").await;
    let uid = bound_pod(
        &h,
        "training",
        "trainer-0",
        "gpu-1",
        json!({"app": "trainer"}),
        false,
    )
    .await;
    bound_pod(
        &h,
        "training",
        "bystander",
        "gpu-1",
        json!({"app": "other"}),
        false,
    )
    .await;
    let _controller = h.controller("c1", &[]);
    failed_read(&h, "gpu-1", "training", "trainer-0", &uid).await;

    let node = h
        .node_until("gpu-1", "tainted after the failed read", |n| {
            has_taint(n, TAINT)
        })
        .await;
    assert_eq!(annotation(&node).unwrap()["reader"]["name"], "trainer-0");
    let pods: Api<Pod> = Api::namespaced(h.plane.client(), "training");
    // Evicted (no kubelet finishes it: the eviction is accepted and the pod terminating).
    watch_until(
        &pods,
        &WatchParams::default().fields("metadata.name=trainer-0"),
        "trainer-0 evicted",
        WAIT,
        |p: &Pod| terminating(p).then_some(()),
    )
    .await;
    let state = h
        .state_until("the stop reported", |s| s["stopped"]["gpu-1"].is_object())
        .await;
    let stop = state["report"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["action"] == "stop")
        .unwrap();
    assert_eq!(stop["outcome"], "done", "{state}");
    assert_eq!(stop["detail"], "training/trainer-0 evicted", "{state}");
    // Whoever looks at the pod sees why it went.
    crate::cluster::poll_ready("the Event on trainer-0", WAIT, || async {
        h.events("trainer-0")
            .await
            .iter()
            .any(|(reason, _)| reason == "ProbityEvicted")
            .then_some(())
    })
    .await;
    // The policy says `reader`: the other pod on the node keeps running.
    assert!(!terminating(&pods.get("bystander").await.unwrap()));

    // A reader's name is its claim: a failed read on gpu-2 naming a pod that runs on
    // gpu-1 taints gpu-2 and stops nothing.
    let bystander = pods.get("bystander").await.unwrap().metadata.uid.unwrap();
    failed_read(&h, "gpu-2", "training", "bystander", &bystander).await;
    let state = h
        .state_until("gpu-2's stop reported", |s| {
            s["stopped"]["gpu-2"].is_object()
        })
        .await;
    assert!(
        state["report"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["node"] == "gpu-2"
                && r["outcome"] == "not-there"
                && r["detail"]
                    .as_str()
                    .unwrap()
                    .starts_with("training/bystander not on this node")),
        "{state}"
    );
    assert!(!terminating(&pods.get("bystander").await.unwrap()));

    // Another pod on the blocked gpu-1 reads bad data: the same block (its history
    // names the new reader), and that reader is stopped too; the first is not asked
    // again, and the bystander still runs.
    let second = bound_pod(
        &h,
        "training",
        "trainer-1",
        "gpu-1",
        json!({"app": "trainer"}),
        false,
    )
    .await;
    let (status, body) = h
        .probity
        .call(
            "POST",
            "/v1/verify",
            &json!({"path": tampered_checkpoint(&h), "id": "testdata/known-answer",
                    "node": "gpu-1",
                    "reader": {"namespace": "training", "name": "trainer-1", "uid": second}}),
        )
        .await;
    assert_eq!((status, &body["verified"]), (200, &json!(false)), "{body}");
    watch_until(
        &pods,
        &WatchParams::default().fields("metadata.name=trainer-1"),
        "trainer-1 evicted",
        WAIT,
        |p: &Pod| terminating(p).then_some(()),
    )
    .await;
    let state = h
        .state_until("both readers counted", |s| {
            s["stopped"]["gpu-1"]["readers"] == json!(["training/trainer-0", "training/trainer-1"])
        })
        .await;
    let evictions = |pod: &str| {
        state["report"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["detail"] == format!("training/{pod} evicted"))
            .count()
    };
    assert_eq!(
        (evictions("trainer-0"), evictions("trainer-1")),
        (1, 1),
        "{state}"
    );
    assert!(!terminating(&pods.get("bystander").await.unwrap()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_a_disruption_budget_forbids_is_retried_and_reported_and_deleted_only_by_escalation()
 {
    let h = Harness::start(&["gpu-1"]).await;
    h.plane.namespace("training").await;
    let uid = bound_pod(
        &h,
        "training",
        "guarded-0",
        "gpu-1",
        json!({"app": "guarded"}),
        true,
    )
    .await;
    bound_pod(
        &h,
        "training",
        "guarded-1",
        "gpu-1",
        json!({"app": "guarded"}),
        true,
    )
    .await;
    guard_budget(&h).await;
    let controller = h.controller("c1", &[]);
    failed_read(&h, "gpu-1", "training", "guarded-0", &uid).await;
    // Refused, retried with back-off, reported each time, never deleted.
    let state = h
        .state_until("two refused evictions", |s| {
            s["report"]
                .as_array()
                .is_some_and(|r| r.iter().filter(|r| r["outcome"] == "disrupted").count() >= 2)
        })
        .await;
    assert!(state["stopping"]["training/guarded-0"]["attempts"].as_u64() >= Some(2));
    assert!(state["stopped"]["gpu-1"].is_null(), "{state}");
    let pods: Api<Pod> = Api::namespaced(h.plane.client(), "training");
    assert!(!terminating(&pods.get("guarded-0").await.unwrap()));

    // The operator's escalation: past its timeout the pod is deleted, and said so.
    drop(controller);
    let _controller = h.controller("c2", &["--evict-escalate-after-seconds", "1"]);
    let state = h
        .state_until("the escalation", |s| s["stopped"]["gpu-1"].is_object())
        .await;
    assert!(
        state["report"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["outcome"] == "escalated"
                && r["detail"]
                    .as_str()
                    .unwrap()
                    .starts_with("training/guarded-0 deleted")),
        "{state}"
    );
    let guarded = pods.get_opt("guarded-0").await.unwrap();
    assert!(guarded.as_ref().is_none_or(terminating));
    assert!(!terminating(&pods.get("guarded-1").await.unwrap()));
}

/// A pod in `training` on `node` whose `probity.io/migrate-priority` is `priority`
/// (none: no annotation).
async fn ranked_pod(h: &Harness, name: &str, node: &str, priority: Option<&str>) {
    let pods: Api<Pod> = Api::namespaced(h.plane.client(), "training");
    let annotations = priority.map_or(json!({}), |p| json!({"probity.io/migrate-priority": p}));
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "trainer:1"}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
}

/// Moves the start of `zone`'s migrate window in the controller's state back past its
/// length, as time passing would (the ConfigMap is written at the version read).
async fn close_window(h: &Harness, zone: &str) {
    let maps: Api<ConfigMap> = Api::namespaced(h.plane.client(), NAMESPACE);
    for _ in 0..20 {
        let mut map = maps.get("probity-controller-state").await.unwrap();
        let data = map.data.as_mut().unwrap();
        let mut state: Value = serde_json::from_str(&data["state"]).unwrap();
        state["migrations"][zone]["start"] = json!(1);
        data.insert("state".into(), state.to_string());
        map.metadata.managed_fields = None;
        match maps
            .replace("probity-controller-state", &PostParams::default(), &map)
            .await
        {
            Ok(_) => return,
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(e) => panic!("closing the window: {e}"),
        }
    }
    panic!("the controller's state changed under every attempt to close the window");
}

/// gpu-hot1's reporter (the stand-in for its agent, whose GPU telemetry cannot run
/// here) reports its node; Probity decides from its facts. The answer.
async fn report_gpu_hot1(h: &Harness) -> Value {
    let (status, body) = h
        .probity
        .call("POST", "/v1/actions/migrate", &json!({"node": "gpu-hot1"}))
        .await;
    assert_eq!(status, 200, "{body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zone_at_its_ceiling_loses_pods_up_to_the_windows_bound_in_the_policys_order_until_it_cools()
 {
    let h = Harness::start(&[]).await;
    for (node, zone) in [
        ("gpu-hot1", "zone-hot"),
        ("gpu-hot2", "zone-hot"),
        ("gpu-1", "zone-a"),
    ] {
        h.plane
            .add_node(node, zone, 8, "NVIDIA-A100-SXM4-80GB")
            .await;
    }
    h.plane.namespace("training").await;
    ranked_pod(&h, "low", "gpu-hot1", Some("1")).await;
    ranked_pod(&h, "high", "gpu-hot2", Some("10")).await;
    ranked_pod(&h, "mid", "gpu-hot1", Some("5")).await;
    ranked_pod(&h, "unranked", "gpu-hot2", None).await;
    ranked_pod(&h, "elsewhere", "gpu-1", Some("100")).await;
    let metrics_port = free_port();
    let _controller = h.controller(
        "c1",
        &["--metrics-listen", &format!("127.0.0.1:{metrics_port}")],
    );

    // zone-hot draws 38.5 of its 40 kW (testdata/entities/cluster.json): at its ceiling.
    let body = report_gpu_hot1(&h).await;
    assert_eq!(body["published"][0]["target"], "zone-hot", "{body}");
    assert_eq!(
        body["published"][0]["parameters"]["pods_per_window"], "2",
        "{body}"
    );

    // The policy's bound (2 per window), highest priority first, from every node of
    // the zone; accepted evictions leave the pods terminating (no kubelet finishes them).
    let pods: Api<Pod> = Api::namespaced(h.plane.client(), "training");
    for name in ["high", "mid"] {
        watch_until(
            &pods,
            &WatchParams::default().fields(&format!("metadata.name={name}")),
            &format!("{name} evicted"),
            WAIT,
            |p: &Pod| terminating(p).then_some(()),
        )
        .await;
    }
    let state = h
        .state_until("the window's two evictions reported", |s| {
            s["migrations"]["zone-hot"]["evicted"] == 2
                && s["report"]
                    .as_array()
                    .is_some_and(|r| r.iter().filter(|r| r["action"] == "migrate").count() == 2)
        })
        .await;
    let done: Vec<(&str, &str)> = state["report"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["action"] == "migrate")
        .map(|r| {
            (
                r["outcome"].as_str().unwrap(),
                r["detail"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        done,
        [
            ("done", "training/high evicted from zone zone-hot"),
            ("done", "training/mid evicted from zone zone-hot")
        ],
        "{state}"
    );

    // The bound holds: passes go on, and nothing else leaves within the window.
    five_more_passes(metrics_port, "five more passes").await;
    for name in ["low", "unranked", "elsewhere"] {
        assert!(!terminating(&pods.get(name).await.unwrap()), "{name}");
    }
    let text = metrics_text(metrics_port).await;
    assert!(
        text.contains("probity_controller_actions_total{kind=\"migrate\",outcome=\"done\"} 2"),
        "{text}"
    );

    // The zone cools: the next report withdraws the request and the controller forgets
    // the zone.
    let (_, mut zone) = h
        .probity
        .call("GET", "/v1/entities/Zone/zone-hot", &json!({}))
        .await;
    zone["attrs"]["powerDrawW"] = json!(10_000);
    let (status, body) = h.probity.call("POST", "/v1/entities", &json!([zone])).await;
    assert_eq!(status, 200, "{body}");
    let body = report_gpu_hot1(&h).await;
    assert_eq!(
        body["withdrawn"],
        json!(["migrate/gpu-hot1/thermal.zone-power-ceiling/zone-hot"]),
        "{body}"
    );
    let (_, live) = h
        .probity
        .call("GET", "/v1/actions/migrate", &json!({}))
        .await;
    assert_eq!(live["requests"], json!([]), "{live}");
    // Time passes (the window closes, as after its 300 s): with no request, nothing
    // more leaves the zone, and the closed window is forgotten.
    close_window(&h, "zone-hot").await;
    h.state_until("zone-hot forgotten", |s| {
        s["migrations"]["zone-hot"].is_null()
    })
    .await;
    five_more_passes(metrics_port, "five more passes after the window").await;
    for name in ["low", "unranked", "elsewhere"] {
        assert!(!terminating(&pods.get(name).await.unwrap()), "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_a_budget_refuses_is_backed_off_and_reported_never_deleted_and_a_dry_run_moves_nothing()
 {
    let h = Harness::start(&[]).await;
    h.plane
        .add_node("gpu-hot1", "zone-hot", 8, "NVIDIA-A100-SXM4-80GB")
        .await;
    h.plane.namespace("training").await;
    let pods: Api<Pod> = Api::namespaced(h.plane.client(), "training");
    for (name, priority) in [("guarded-0", "10"), ("guarded-1", "5")] {
        bound_pod(
            &h,
            "training",
            name,
            "gpu-hot1",
            json!({"app": "guarded"}),
            true,
        )
        .await;
        pods.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "probity.io/migrate-priority": priority}}})),
        )
        .await
        .unwrap();
    }
    ranked_pod(&h, "free", "gpu-hot1", Some("1")).await;
    guard_budget(&h).await;
    h.command(&["dry-run", "on"]);
    let _controller = h.controller("c1", &[]);
    report_gpu_hot1(&h).await;

    // A dry run asks the apiserver (dryRun=All), reports once, and counts nothing.
    let state = h
        .state_until("the dry run's migrations reported", |s| {
            s["report"].as_array().is_some_and(|r| {
                r.iter()
                    .filter(|r| r["action"] == "migrate" && r["outcome"] == "would")
                    .count()
                    == 2
            })
        })
        .await;
    assert_eq!(state["migrations"]["zone-hot"]["evicted"], 0, "{state}");
    for name in ["guarded-0", "guarded-1", "free"] {
        assert!(!terminating(&pods.get(name).await.unwrap()), "{name}");
    }

    // For real: the guarded pods come first, their budget refuses, they are backed off
    // and reported (and given back to the window), and the next in order goes.
    h.command(&["dry-run", "off"]);
    watch_until(
        &pods,
        &WatchParams::default().fields("metadata.name=free"),
        "free evicted",
        WAIT,
        |p: &Pod| terminating(p).then_some(()),
    )
    .await;
    let state = h
        .state_until("the refusals and the eviction reported", |s| {
            s["stopping"]["training/guarded-0"]["attempts"].as_u64() >= Some(1)
                && s["migrations"]["zone-hot"]["evicted"] == 1
        })
        .await;
    let refused: Vec<&str> = state["report"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["action"] == "migrate" && r["outcome"] == "disrupted")
        .filter_map(|r| r["detail"].as_str())
        .collect();
    assert!(
        refused
            .iter()
            .any(|d| d.starts_with("training/guarded-0: eviction refused")),
        "{state}"
    );
    for name in ["guarded-0", "guarded-1"] {
        assert!(!terminating(&pods.get(name).await.unwrap()), "{name}");
    }
}

/// Issue 31 item 6: nodes nobody seeded, created with GPU feature discovery's labels
/// and the device plugin's capacity, become known to Probity through the controller
/// (the cluster's facts); the extender then says such a node has no telemetry yet, and
/// a Node deleted from Kubernetes loses its facts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_nobody_seeded_are_known_from_their_labels_and_a_deleted_one_is_forgotten() {
    let h = Harness::start(&[]).await;
    for name in ["gpu-new-1", "gpu-new-2"] {
        crate::cluster::add_node_with(
            &h.plane.client(),
            name,
            "zone-b",
            4,
            "NVIDIA-H100-80GB-HBM3",
        )
        .await;
    }
    let (status, _) = h
        .probity
        .call("GET", "/v1/entities/Node/gpu-new-1", &Value::Null)
        .await;
    assert_eq!(status, 404, "not seeded");
    let _controller = h.controller("c1", &[]);
    // The store has no event to watch over the API: it is polled.
    let node = |name: &'static str| {
        let probity = &h.probity;
        move || async move {
            let (status, body) = probity
                .call("GET", &format!("/v1/entities/Node/{name}"), &Value::Null)
                .await;
            (status == 200).then_some(body)
        }
    };
    let known =
        crate::cluster::poll_ready("gpu-new-1's cluster facts", WAIT, node("gpu-new-1")).await;
    let attrs = &known["attrs"];
    assert_eq!(attrs["zone"]["__entity"]["id"], "zone-b", "{known}");
    assert_eq!(attrs["gpuNode"], true, "{known}");
    assert_eq!(attrs["gpusAllocatable"], 4, "{known}");
    assert_eq!(attrs["cpuAllocatableMillis"], 64_000, "{known}");
    assert_eq!(attrs["gpuProduct"], "NVIDIA-H100-80GB-HBM3", "{known}");
    assert!(attrs.get("hottestGpuTempC").is_none(), "{known}");
    crate::cluster::poll_ready("gpu-new-2's cluster facts", WAIT, node("gpu-new-2")).await;

    // The extender knows the node: it has no telemetry yet (not "holds no facts").
    let args = json!({"Pod": gpu_pod("p", "training", 1, "8"), "Nodes": null,
                      "NodeNames": ["gpu-new-1"]});
    let (status, out) = h.probity.call("POST", "/v1/scheduler/filter", &args).await;
    assert_eq!(status, 200, "{out}");
    let why = out["FailedNodes"]["gpu-new-1"].as_str().unwrap_or_default();
    assert!(why.contains("no telemetry of node gpu-new-1 yet"), "{out}");

    // A deleted Node loses its facts; the other keeps them.
    h.nodes()
        .delete("gpu-new-2", &Default::default())
        .await
        .unwrap();
    crate::cluster::poll_ready("gpu-new-2's facts gone", WAIT, || async {
        let (status, _) = h
            .probity
            .call("GET", "/v1/entities/Node/gpu-new-2", &Value::Null)
            .await;
        (status == 404).then_some(())
    })
    .await;
    let (status, _) = h
        .probity
        .call("GET", "/v1/entities/Node/gpu-new-1", &Value::Null)
        .await;
    assert_eq!(status, 200);
}

/// Probity's report of `kind` in `namespace` (cluster-wide for `None`), once `ready`
/// holds for its results; polled, bounded by [`WAIT`].
async fn report_until(
    plane: &ControlPlane,
    kind: &str,
    namespace: Option<&str>,
    what: &str,
    ready: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    use kube::api::{ApiResource, DynamicObject};
    use kube::core::GroupVersionKind;
    let resource =
        ApiResource::from_gvk(&GroupVersionKind::gvk("wgpolicyk8s.io", "v1alpha2", kind));
    let api: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(plane.client(), ns, &resource),
        None => Api::all_with(plane.client(), &resource),
    };
    let started = std::time::Instant::now();
    let mut last = Vec::new();
    while started.elapsed() < WAIT {
        if let Ok(Some(report)) = api.get_opt("probity").await {
            last = report.data["results"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if ready(&last) {
                return last;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("{what}: the report never got there; last results: {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_reports_appear_for_what_warn_and_audit_rules_find_and_clear_when_they_enforce() {
    let mut cluster = Installed::start().await;
    let modes = cluster
        .probity
        .restart_with_modes(
            "\"placement.driver-drift\" = \"audit\"\n\"placement.inference-gpu-cpu-ratio\" = \"warn\"\n",
        )
        .await;
    let _controller = start_controller(
        &cluster.plane,
        &cluster.probity,
        "reporter",
        &["--report-interval-seconds", "1"],
    );

    // The drifted nodes, cluster-wide, as what the audit rule would refuse.
    let nodes = report_until(
        &cluster.plane,
        "ClusterPolicyReport",
        None,
        "the nodes' report",
        |r| r.len() == 2,
    )
    .await;
    let mut named: Vec<&str> = nodes
        .iter()
        .map(|r| r["resources"][0]["name"].as_str().unwrap())
        .collect();
    named.sort_unstable();
    assert_eq!(named, ["gpu-drift", "gpu-oldimage"]);
    assert!(nodes.iter().all(|r| r["policy"] == "placement.driver-drift"
        && r["result"] == "fail"
        && r["properties"]["mode"] == "audit"));
    // The greedy inference workload, in its namespace, as a warning.
    let workloads = report_until(
        &cluster.plane,
        "PolicyReport",
        Some("inference"),
        "the inference report",
        |r| !r.is_empty(),
    )
    .await;
    assert_eq!(workloads[0]["policy"], "placement.inference-gpu-cpu-ratio");
    assert_eq!(workloads[0]["result"], "warn");

    // Both rules enforcing again: the reports clear (emptied, not deleted).
    modes.restore();
    report_until(
        &cluster.plane,
        "ClusterPolicyReport",
        None,
        "the nodes' report cleared",
        <[Value]>::is_empty,
    )
    .await;
    report_until(
        &cluster.plane,
        "PolicyReport",
        Some("inference"),
        "the inference report cleared",
        <[Value]>::is_empty,
    )
    .await;
}

/// The same hot zone under the ceiling rule in audit mode: the request is a dry run,
/// the controller reports which pods it would move (evictions with `dryRun=All`, which
/// the apiserver judges without acting) and moves none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zone_at_an_audit_rules_ceiling_is_reported_with_dry_run_evictions_and_keeps_its_pods() {
    let mut h = Harness::start(&[]).await;
    let _modes = h
        .probity
        .restart_with_modes("\"thermal.zone-power-ceiling\" = \"audit\"\n")
        .await;
    h.plane
        .add_node("gpu-hot1", "zone-hot", 8, "NVIDIA-A100-SXM4-80GB")
        .await;
    h.plane.namespace("training").await;
    ranked_pod(&h, "high", "gpu-hot1", Some("10")).await;
    ranked_pod(&h, "mid", "gpu-hot1", Some("5")).await;
    let metrics_port = free_port();
    let _controller = h.controller(
        "c1",
        &["--metrics-listen", &format!("127.0.0.1:{metrics_port}")],
    );
    let body = report_gpu_hot1(&h).await;
    assert_eq!(body["published"][0]["target"], "zone-hot", "{body}");
    assert_eq!(body["published"][0]["dryRun"], true, "{body}");

    let state = h
        .state_until("the dry-run evictions reported", |s| {
            s["report"].as_array().is_some_and(|r| {
                r.iter()
                    .filter(|r| r["action"] == "migrate" && r["outcome"] == "would")
                    .count()
                    == 2
            })
        })
        .await;
    // Nothing counted against the window, nothing moved, however many passes.
    assert_eq!(state["migrations"]["zone-hot"]["evicted"], 0, "{state}");
    five_more_passes(metrics_port, "five more passes").await;
    let pods: Api<Pod> = Api::namespaced(h.plane.client(), "training");
    for name in ["high", "mid"] {
        assert!(!terminating(&pods.get(name).await.unwrap()), "{name}");
    }
    let text = metrics_text(metrics_port).await;
    assert!(
        !text.contains("probity_controller_actions_total{kind=\"migrate\",outcome=\"done\"}"),
        "{text}"
    );
}

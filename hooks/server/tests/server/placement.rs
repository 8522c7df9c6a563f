//! Placement from decisions: the scheduler extender, the mutating webhook's affinity,
//! bindings, and thresholds that change with no Rust change.

use std::path::Path;

use axum::http::{Method, StatusCode};
use probity_server::Config;
use serde_json::{Value, json};

use crate::{call, call_raw, root, state};

fn gpu_pod(name: &str, class: &str, gpus: u32) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "training", "labels": {"probity.io/class": class}},
        "spec": {"containers": [{"name": "c", "image": "trainer:1",
            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string(), "cpu": "8"}}}]}
    })
}

/// ExtenderArgs as the scheduler's Go encoder writes it with `nodeCacheCapable`.
fn args(pod: Value, names: &[&str]) -> Value {
    json!({"Pod": pod, "Nodes": null, "NodeNames": names})
}

async fn filter(s: &probity_server::AppState, body: &Value) -> (StatusCode, Value) {
    call(s, Method::POST, "/v1/scheduler/filter", Some(body), None).await
}

fn names(v: &Value) -> Vec<&str> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect()
}

#[tokio::test]
async fn the_extender_filters_a_blocked_node_and_a_hot_zone_with_their_reasons() {
    let s = state();
    let sent = ["gpu-a1", "gpu-blocked", "gpu-hot1", "gpu-h1", "gpu-spike"];
    let (status, out) = filter(&s, &args(gpu_pod("t", "batch", 1), &sent)).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["Error"], "");
    assert_eq!(out["Nodes"], Value::Null);
    assert_eq!(names(&out["NodeNames"]), ["gpu-a1", "gpu-spike"]);
    let failed = out["FailedNodes"].as_object().unwrap();
    assert_eq!(failed.len(), 3, "{out}");
    assert!(
        failed["gpu-blocked"].as_str().unwrap().contains("blocked"),
        "{out}"
    );
    assert!(
        failed["gpu-hot1"]
            .as_str()
            .unwrap()
            .contains("thermal.zone-power-ceiling"),
        "{out}"
    );
    assert!(
        failed["gpu-h1"].as_str().unwrap().contains("dedicated"),
        "{out}"
    );
    // Every name returned was sent.
    for n in names(&out["NodeNames"]) {
        assert!(sent.contains(&n));
    }
}

#[tokio::test]
async fn the_same_filter_asked_again_is_answered_from_the_decision_cache_and_counted() {
    let s = state();
    let sent = ["gpu-a1", "gpu-blocked", "gpu-hot1", "gpu-h1", "gpu-spike"];
    let body = args(gpu_pod("t", "batch", 1), &sent);
    let (_, first) = filter(&s, &body).await;
    let (_, again) = filter(&s, &body).await;
    assert_eq!(first, again);
    let (_, metrics) = call(&s, Method::GET, "/metrics", None, None).await;
    let text = metrics.as_str().unwrap();
    // The five nodes are decided once, then reused.
    assert!(
        text.contains("probity_decision_cache_misses_total 5\n"),
        "{text}"
    );
    assert!(
        text.contains("probity_decision_cache_hits_total 5\n"),
        "{text}"
    );
}

#[tokio::test]
async fn the_extender_reads_the_upstream_encoding_and_answers_in_kind() {
    let s = state();
    // The upstream compatibility string, with our node names in its NodeList.
    let text = std::fs::read_to_string(
        root().join("testdata/fixtures/k8s-scheduler-extender/upstream-compat-ExtenderArgs.json"),
    )
    .unwrap();
    let mut upstream: Value = serde_json::from_str(&text).unwrap();
    // As sent: both Nodes and NodeNames; NodeNames wins, and "node1" is unknown.
    let (status, out) = filter(&s, &upstream).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["NodeNames"], json!([]));
    assert!(
        out["FailedNodes"]["node1"]
            .as_str()
            .unwrap()
            .contains("holds no facts about node node1"),
        "{out}"
    );
    // Without NodeNames the full NodeList is filtered and sent back as objects.
    upstream["NodeNames"] = Value::Null;
    let item = upstream["Nodes"]["items"][0].clone();
    let mut a1 = item.clone();
    a1["metadata"]["name"] = json!("gpu-a1");
    let mut blocked = item;
    blocked["metadata"]["name"] = json!("gpu-blocked");
    upstream["Nodes"]["items"] = json!([a1.clone(), blocked]);
    upstream["Pod"] = gpu_pod("t", "batch", 1);
    let (status, out) = filter(&s, &upstream).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["NodeNames"], Value::Null);
    assert_eq!(out["Nodes"]["items"], json!([a1]));
    assert!(out["FailedNodes"].get("gpu-blocked").is_some());
    // Lower-case field names are read too.
    let lower = json!({"pod": gpu_pod("t", "batch", 1), "nodenames": ["gpu-a1"]});
    let (_, out) = filter(&s, &lower).await;
    assert_eq!(out["NodeNames"], json!(["gpu-a1"]));
}

#[tokio::test]
async fn unknown_nodes_are_filtered_with_a_reason_unless_configured_to_pass() {
    let (_, out) = filter(&state(), &args(gpu_pod("t", "batch", 1), &["new-node"])).await;
    assert_eq!(out["NodeNames"], json!([]));
    assert!(
        out["FailedNodes"]["new-node"]
            .as_str()
            .unwrap()
            .contains("scheduler.unknown_nodes"),
        "{out}"
    );
    let config = Config::from_toml("[scheduler]\nunknown_nodes = \"allow\"\n").unwrap();
    let s = crate::state_with(config);
    let (_, out) = filter(
        &s,
        &args(gpu_pod("t", "batch", 1), &["new-node", "gpu-blocked"]),
    )
    .await;
    // A blocked node stays filtered even then.
    assert_eq!(out["NodeNames"], json!(["new-node"]));
}

#[tokio::test]
async fn bad_extender_args_get_a_clear_error_never_an_empty_allow() {
    let s = state();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"{not json".to_vec(), "ExtenderArgs"),
        (b"[]".to_vec(), "JSON object"),
        (
            serde_json::to_vec(&json!({"Pod": gpu_pod("t", "batch", 1), "NodeNames": []}))
                .unwrap(),
            "names no nodes",
        ),
        (
            serde_json::to_vec(&json!({"Pod": gpu_pod("t", "batch", 1), "Nodes": null, "NodeNames": null})).unwrap(),
            "names no nodes",
        ),
        (
            serde_json::to_vec(&json!({"NodeNames": ["gpu-a1"]})).unwrap(),
            "no Pod",
        ),
        (
            serde_json::to_vec(&json!({"Pod": {"metadata": {}}, "NodeNames": ["gpu-a1"]}))
                .unwrap(),
            "no spec",
        ),
        (
            serde_json::to_vec(&json!({"Pod": gpu_pod("t", "batch", 1), "NodeNames": ["gpu-a1", 7]}))
                .unwrap(),
            "NodeNames[1]",
        ),
        (
            serde_json::to_vec(&json!({"Pod": {"spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "lots"}}}]}}, "NodeNames": ["gpu-a1"]}))
                .unwrap(),
            "nvidia.com/gpu",
        ),
    ];
    for (body, expected) in cases {
        for route in ["/v1/scheduler/filter", "/v1/scheduler/prioritize"] {
            let (status, out) = call_raw(&s, Method::POST, route, body.clone(), None).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{route}: {out}");
            let error = out["Error"].as_str().unwrap_or_default();
            assert!(
                error.contains(expected),
                "{route}: {error:?} lacks {expected:?}"
            );
            assert!(out.get("NodeNames").is_none_or(Value::is_null), "{out}");
        }
    }
}

#[tokio::test]
async fn prioritize_ranks_by_the_scores_of_permit_policies() {
    let s = state();
    // gpu-cool runs 15 C under its model's target: the headroom permit scores it.
    let mut cool = crate::cluster()
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["uid"]["id"] == "gpu-a1")
        .unwrap()
        .clone();
    cool["uid"]["id"] = json!("gpu-cool");
    cool["attrs"]["hottestGpuTempC"] = json!(50);
    s.engine().upsert_entities(&json!([cool])).unwrap();
    let body = args(
        gpu_pod("t", "batch", 1),
        &["gpu-cool", "gpu-a1", "gpu-blocked"],
    );
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/scheduler/prioritize",
        Some(&body),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(
        out,
        json!([
            {"Host": "gpu-cool", "Score": 5},
            {"Host": "gpu-a1", "Score": 0},
            {"Host": "gpu-blocked", "Score": 0}
        ])
    );
    // RL-HF work in its own zone: the own-zone permit scores it.
    let body = args(gpu_pod("rl", "rlhf", 1), &["gpu-h1"]);
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/scheduler/prioritize",
        Some(&body),
        None,
    )
    .await;
    assert!(out[0]["Score"].as_i64().unwrap() >= 3, "{out}");
}

#[tokio::test]
async fn a_binding_to_a_blocked_node_is_denied_and_to_a_good_node_allowed() {
    let s = state();
    let binding = |node: &str| {
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "b-1", "kind": {"group": "", "version": "v1", "kind": "Binding"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "binding", "namespace": "training", "operation": "CREATE",
            "object": {"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": "t", "namespace": "training"},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}}})
    };
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/admission/validate",
        Some(&binding("gpu-blocked")),
        None,
    )
    .await;
    assert_eq!(out["response"]["allowed"], false, "{out}");
    assert!(
        out["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("gpu-blocked")
    );
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/admission/validate",
        Some(&binding("gpu-a1")),
        None,
    )
    .await;
    assert_eq!(out["response"]["allowed"], true, "{out}");
    assert!(
        out["response"]["warnings"][0]
            .as_str()
            .unwrap()
            .contains("node-level rules")
    );
    let mut no_target = binding("x");
    no_target["request"]["object"]["target"] = Value::Null;
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/admission/validate",
        Some(&no_target),
        None,
    )
    .await;
    assert_eq!(
        out["response"]["status"]["message"],
        "Binding has no target.name"
    );
}

pub(crate) fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn insert_after(file: &Path, line: &str, text: &str) {
    let old = std::fs::read_to_string(file).unwrap();
    let at = old.find(line).unwrap() + line.len();
    std::fs::write(file, format!("{}\n{text}{}", &old[..at], &old[at..])).unwrap();
}

/// The default policies plus the threshold overlay (README there): a new setting, a
/// new zone fact and a new rule, with no Rust change.
fn policies_with_new_threshold(dir: &Path) {
    copy_dir(&root().join("policies"), dir);
    let overlay = root().join("testdata/threshold-overlay");
    let read = |f: &str| std::fs::read_to_string(overlay.join(f)).unwrap();
    let schema = dir.join("probity.cedarschema");
    insert_after(
        &schema,
        "entity Settings = {",
        &read("settings.cedarschema"),
    );
    insert_after(
        &schema,
        "entity Zone in [Cluster] = {",
        &read("zone.cedarschema"),
    );
    insert_after(
        &dir.join("probity.toml"),
        "[placement]",
        &read("probity.toml"),
    );
    std::fs::write(
        dir.join("placement/zone-max-gpus.cedar"),
        read("zone-max-gpus.cedar"),
    )
    .unwrap();
}

fn mutate_review(pod: Value) -> Value {
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "m-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "namespace": "training", "operation": "CREATE", "object": pod}})
}

fn affinity_of(out: &Value) -> Value {
    use base64::Engine as _;
    let Some(patch) = out["response"]["patch"].as_str() else {
        return Value::Null;
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(patch)
        .unwrap();
    let patch: Value = serde_json::from_slice(&bytes).unwrap();
    patch[0]["value"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"][0]["matchExpressions"]
        .clone()
}

#[tokio::test]
async fn a_new_threshold_needs_no_rust_and_the_webhook_and_extender_follow_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("policies");
    policies_with_new_threshold(&dir);
    let engine = probity::Engine::builder(&dir).build().unwrap();
    engine.upsert_entities(&crate::cluster()).unwrap();
    let s = probity_server::AppState::new(engine, Config::default());
    // The setting is read from the TOML through the schema.
    let settings = s.engine().entities_json(Some("Settings"));
    assert_eq!(settings[0]["attrs"]["zoneMaxGpus"], 64);
    // zone-a's jobs hold 60 GPUs: a 4-GPU job fits, an 8-GPU job does not.
    let mut zone_a = crate::cluster()
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["uid"]["id"] == "zone-a")
        .unwrap()
        .clone();
    zone_a["attrs"]["gpusAllocated"] = json!(60);
    s.engine().upsert_entities(&json!([zone_a])).unwrap();
    let (_, out) = filter(&s, &args(gpu_pod("small", "batch", 4), &["gpu-a1"])).await;
    assert_eq!(out["NodeNames"], json!(["gpu-a1"]), "{out}");
    let (_, out) = filter(&s, &args(gpu_pod("big", "batch", 8), &["gpu-a1"])).await;
    assert_eq!(out["NodeNames"], json!([]), "{out}");
    assert!(
        out["FailedNodes"]["gpu-a1"]
            .as_str()
            .unwrap()
            .contains("placement.zone-max-gpus"),
        "{out}"
    );
    // The mutating webhook keeps the big job out of zone-a, where the small one may go.
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/admission/mutate",
        Some(&mutate_review(gpu_pod("small", "batch", 4))),
        None,
    )
    .await;
    let small = affinity_of(&out);
    assert!(small.to_string().contains("zone-a"), "{out}");
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/admission/mutate",
        Some(&mutate_review(gpu_pod("big", "batch", 8))),
        None,
    )
    .await;
    let big = affinity_of(&out);
    assert!(!big.to_string().contains("\"zone-a\""), "{big}");
    // And the validating webhook denies the big job bound to gpu-a1.
    let mut bound = gpu_pod("big", "batch", 8);
    bound["spec"]["nodeName"] = json!("gpu-a1");
    let mut review = mutate_review(bound);
    review["request"]["uid"] = json!("v-1");
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/admission/validate",
        Some(&review),
        None,
    )
    .await;
    assert_eq!(out["response"]["allowed"], false, "{out}");
    assert!(
        out["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("placement.zone-max-gpus")
    );
}

#[tokio::test]
async fn a_threshold_edited_in_a_live_policy_directory_changes_the_patch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("policies");
    copy_dir(&root().join("policies"), &dir);
    let engine = probity::Engine::builder(&dir).build().unwrap();
    engine.upsert_entities(&crate::cluster()).unwrap();
    let s = probity_server::AppState::new(engine, Config::default());
    let review = mutate_review(gpu_pod("t", "batch", 1));
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/admission/mutate",
        Some(&review),
        None,
    )
    .await;
    let before = affinity_of(&out);
    // zone-hot draws 96% of its ceiling: closed at the default 95%.
    assert!(
        before.to_string().contains(r#""In","values":["zone-a"]"#),
        "{before}"
    );
    assert!(before.to_string().contains("gpu-drift"), "{before}");

    // Raise the ceiling in probity.toml: zone-hot opens.
    let toml = dir.join("probity.toml");
    let text = std::fs::read_to_string(&toml).unwrap();
    std::fs::write(
        &toml,
        text.replace("zone_power_ceiling_pct = 95", "zone_power_ceiling_pct = 99"),
    )
    .unwrap();
    s.engine().reload().unwrap();
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/admission/mutate",
        Some(&review),
        None,
    )
    .await;
    let raised = affinity_of(&out);
    assert!(
        raised
            .to_string()
            .contains(r#""In","values":["zone-a","zone-hot"]"#),
        "{raised}"
    );

    // Drop the driver-drift rule from its .cedar file: gpu-drift is no longer kept out.
    let scheduling = dir.join("placement/scheduling.cedar");
    let text = std::fs::read_to_string(&scheduling).unwrap();
    let start = text.find("@id(\"placement.driver-drift\")").unwrap();
    let end = start + text[start..].find("};").unwrap() + 2;
    std::fs::write(&scheduling, format!("{}{}", &text[..start], &text[end..])).unwrap();
    s.engine().reload().unwrap();
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/admission/mutate",
        Some(&review),
        None,
    )
    .await;
    let edited = affinity_of(&out);
    assert!(!edited.to_string().contains("gpu-drift"), "{edited}");
}

#[tokio::test]
async fn the_same_pod_again_after_a_node_heats_up_gets_a_patch_that_keeps_it_off_that_node() {
    let s = state();
    let review = mutate_review(gpu_pod("t", "batch", 1));
    let mutate = |s: probity_server::AppState| {
        let review = review.clone();
        async move {
            let (_, out) = call(
                &s,
                Method::POST,
                "/v1/admission/mutate",
                Some(&review),
                None,
            )
            .await;
            affinity_of(&out).to_string()
        }
    };
    let before = mutate(s.clone()).await;
    // Asked again with nothing changed: the same patch (from the memo).
    assert_eq!(mutate(s.clone()).await, before);
    assert!(!before.contains("gpu-a1"), "{before}");
    // gpu-a1 heats up: the very next review names it.
    let mut hot = crate::cluster()
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["uid"]["id"] == "gpu-a1")
        .unwrap()
        .clone();
    hot["attrs"]["hottestGpuTempC"] = json!(95);
    s.engine().upsert_entities(&json!([hot])).unwrap();
    let after = mutate(s.clone()).await;
    assert!(after.contains("gpu-a1"), "{after}");
    assert_ne!(after, before);
}

#[tokio::test]
async fn with_no_node_stored_a_new_block_still_reaches_the_next_patch() {
    // Before agents report, the store holds no node: the affinity is the blocklist's.
    let engine = probity::Engine::from_embedded_defaults().unwrap();
    let s = probity_server::AppState::new(engine, Config::default());
    let review = mutate_review(gpu_pod("t", "batch", 1));
    let patch = |s: probity_server::AppState| {
        let review = review.clone();
        async move {
            let (_, out) = call(
                &s,
                Method::POST,
                "/v1/admission/mutate",
                Some(&review),
                None,
            )
            .await;
            affinity_of(&out).to_string()
        }
    };
    s.engine().block_node("n1", "test").unwrap();
    let first = patch(s.clone()).await;
    assert!(first.contains("n1") && !first.contains("n2"), "{first}");
    s.engine().block_node("n2", "test").unwrap();
    let second = patch(s.clone()).await;
    assert!(second.contains("n1") && second.contains("n2"), "{second}");
}

/// Issue 28 item 6: one 1 MB ExtenderArgs of 200,000 names cost about 64 MB, and 32 at
/// once 2.1 GB. A request may name at most `[scheduler] max_nodes` nodes and carry at
/// most `[scheduler] max_body_bytes`; past either it is a 413 saying which bound.
#[tokio::test]
async fn bug_one_extender_request_could_cost_64_times_its_size() {
    let mut config = Config::default();
    config.scheduler.max_nodes = 100;
    config.scheduler.max_body_bytes = 64 * 1024;
    let s = crate::state_with(config);
    let many: Vec<String> = (0..101).map(|i| format!("n{i}")).collect();
    let refs: Vec<&str> = many.iter().map(String::as_str).collect();
    for route in ["/v1/scheduler/filter", "/v1/scheduler/prioritize"] {
        let (status, out) = call(
            &s,
            Method::POST,
            route,
            Some(&args(gpu_pod("p", "batch", 1), &refs)),
            None,
        )
        .await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{route}: {out}");
        assert!(
            out["Error"].as_str().unwrap().contains("max_nodes"),
            "{out}"
        );
    }
    // Within the bound it is judged as before.
    let (status, out) = filter(&s, &args(gpu_pod("p", "batch", 1), &refs[..100])).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    // The extender's own body bound, under the server's 1 MiB.
    let long: Vec<String> = (0..100)
        .map(|i| format!("{i}-{}", "x".repeat(1000)))
        .collect();
    let refs: Vec<&str> = long.iter().map(String::as_str).collect();
    let (status, out) = filter(&s, &args(gpu_pod("p", "batch", 1), &refs)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{out}");
    assert!(
        out["Error"].as_str().unwrap().contains("max_body_bytes"),
        "{out}"
    );
}

/// The default policies with the schedule action renamed `place` and the nodes grouped
/// by a `row` attribute of their own, both declared as the schema's conventions; the
/// test cluster's nodes each get the row `row-of-<zone>`.
fn renamed_placement_state(dir: &Path) -> probity_server::AppState {
    copy_dir(&root().join("policies"), dir);
    let rename = |file: &Path| {
        let text = std::fs::read_to_string(file).unwrap();
        std::fs::write(
            file,
            text.replace("Action::\"schedule\"", "Action::\"place\""),
        )
        .unwrap();
    };
    rename(&dir.join("placement/scheduling.cedar"));
    rename(&dir.join("thermal/thermal.cedar"));
    // Its exemption for pods tolerating the block taint names the action too.
    rename(&dir.join("security/blocklist.cedar"));
    let schema = dir.join("probity.cedarschema");
    let text = std::fs::read_to_string(&schema).unwrap();
    let edited = text
        .replace("action schedule appliesTo", "action place appliesTo")
        .replace(
            "@schedule_action(\"schedule\")",
            "@schedule_action(\"place\")",
        )
        .replace("@placement_group(\"zone\")", "@placement_group(\"row\")")
        .replace(
            "  zone: Zone,\n  rack: String,",
            "  zone: Zone,\n  row?: Zone,\n  rack: String,",
        );
    assert_eq!(
        edited.matches("place").count(),
        text.matches("place").count() + 2
    );
    assert!(edited.contains("row?: Zone"));
    std::fs::write(&schema, edited).unwrap();
    let engine = probity::Engine::builder(dir).build().unwrap();
    let mut cluster = crate::cluster();
    for e in cluster.as_array_mut().unwrap() {
        if e["uid"]["type"] == "Node" {
            let row = format!(
                "row-of-{}",
                e["attrs"]["zone"]["__entity"]["id"].as_str().unwrap()
            );
            e["attrs"]["row"] = json!({"__entity": {"type": "Zone", "id": row}});
        }
    }
    engine.upsert_entities(&cluster).unwrap();
    engine
        .block_node(
            "gpu-blocked",
            "fixture: blocked since the cluster was set up",
        )
        .unwrap();
    probity_server::AppState::new(engine, Config::default())
}

/// The extender, admission and the webhook ask the schema's schedule action (an action
/// of another name would be refused by Cedar, every node with it), and the webhook
/// groups nodes by the schema's placement group.
#[tokio::test]
async fn the_schedule_action_and_the_placement_group_are_the_schemas() {
    let tmp = tempfile::tempdir().unwrap();
    let s = renamed_placement_state(&tmp.path().join("policies"));
    assert_eq!(s.engine().conventions().schedule_action(), "place");
    let sent = ["gpu-a1", "gpu-blocked", "gpu-hot1", "gpu-h1", "gpu-spike"];
    let (status, out) = filter(&s, &args(gpu_pod("t", "batch", 1), &sent)).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(names(&out["NodeNames"]), ["gpu-a1", "gpu-spike"], "{out}");
    assert!(
        out["FailedNodes"]["gpu-hot1"]
            .as_str()
            .unwrap()
            .contains("thermal.zone-power-ceiling"),
        "{out}"
    );
    // The webhook's affinity names rows, not zones.
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/admission/mutate",
        Some(&mutate_review(gpu_pod("t", "batch", 1))),
        None,
    )
    .await;
    let affinity = affinity_of(&out).to_string();
    assert!(
        affinity.contains(r#""In","values":["row-of-zone-a"]"#),
        "{affinity}"
    );
    // Admission of a pod bound to a node decides `place` too.
    let mut bound = gpu_pod("t", "batch", 1);
    bound["spec"]["nodeName"] = json!("gpu-hot1");
    let mut review = mutate_review(bound);
    review["request"]["uid"] = json!("v-1");
    let (_, out) = call(
        &s,
        Method::POST,
        "/v1/admission/validate",
        Some(&review),
        None,
    )
    .await;
    assert_eq!(out["response"]["allowed"], false, "{out}");
    let message = out["response"]["status"]["message"].as_str().unwrap();
    assert!(message.contains("thermal.zone-power-ceiling"), "{message}");
    assert!(!message.contains("evaluation error"), "{message}");
}

/// Issue 31 item 6: the controller sends the cluster's view of its Nodes; the store then
/// knows a node no one seeded, the extender says it has no telemetry yet (not that it
/// holds no facts), an agent's write keeps the cluster's attributes and may not
/// contradict them, and a node left out of the next replace loses them.
#[tokio::test]
async fn cluster_facts_make_a_node_known_and_the_extender_says_it_has_no_telemetry_yet() {
    let mut config = Config::default();
    config.auth.groups.insert(
        "cluster-reporters".into(),
        vec!["cn:probity-controller".into()],
    );
    let s = crate::state_with(config);
    let facts = json!({"entities": [{
        "uid": {"type": "Node", "id": "gpu-new"},
        "attrs": {"zone": {"__entity": {"type": "Zone", "id": "zone-a"}}, "gpuNode": true,
                  "gpusAllocatable": 8, "gpuProduct": "NVIDIA-H100-80GB-HBM3"},
    }]});
    // Only the controller's group (or an admin) may replace them.
    let (status, _) = call(&s, Method::PUT, "/v1/facts/cluster", Some(&facts), None).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, out) = call(
        &s,
        Method::PUT,
        "/v1/facts/cluster",
        Some(&facts),
        Some("cn:probity-controller"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["replaced"], 1);
    let (status, node) = call(&s, Method::GET, "/v1/entities/Node/gpu-new", None, None).await;
    assert_eq!(status, StatusCode::OK, "{node}");
    assert_eq!(node["attrs"]["gpusAllocatable"], 8);

    let (status, out) = filter(&s, &args(gpu_pod("t", "batch", 1), &["gpu-new"])).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let why = out["FailedNodes"]["gpu-new"].as_str().unwrap();
    assert!(why.contains("no telemetry of node gpu-new yet"), "{out}");

    // An agent's write that contradicts the cluster's zone is refused, naming it.
    let mut agent = json!([{
        "uid": {"type": "Node", "id": "gpu-new"},
        "attrs": {"zone": {"__entity": {"type": "Zone", "id": "zone-b"}}, "rack": "r1"},
        "parents": [],
    }]);
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/entities",
        Some(&agent),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{out}");
    assert!(
        out["error"]
            .as_str()
            .unwrap()
            .contains("attrs.zone: owned by the cluster"),
        "{out}"
    );
    // Leaving the zone out keeps the cluster's.
    agent[0]["attrs"].as_object_mut().unwrap().remove("zone");
    let (status, out) = call(
        &s,
        Method::POST,
        "/v1/entities",
        Some(&agent),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let (_, node) = call(&s, Method::GET, "/v1/entities/Node/gpu-new", None, None).await;
    assert_eq!(node["attrs"]["zone"]["__entity"]["id"], "zone-a", "{node}");
    assert_eq!(node["attrs"]["rack"], "r1", "{node}");

    // Label text a schema type would take is still bounded, naming node and field.
    let bad = json!({"entities": [{
        "uid": {"type": "Node", "id": "gpu-new"},
        "attrs": {"gpusAllocatable": -2},
    }]});
    let (status, out) = call(
        &s,
        Method::PUT,
        "/v1/facts/cluster",
        Some(&bad),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{out}");
    assert!(
        out["error"]
            .as_str()
            .unwrap()
            .contains("entities[0] (\"gpu-new\"): attrs.gpusAllocatable: -2 is negative"),
        "{out}"
    );
    let wrong_type = json!({"entities": [{
        "uid": {"type": "Node", "id": "gpu-new"},
        "attrs": {"gpusAllocatable": "eight"},
    }]});
    let (status, out) = call(
        &s,
        Method::PUT,
        "/v1/facts/cluster",
        Some(&wrong_type),
        Some("uid:0"),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{out}");
    assert!(out["error"].as_str().unwrap().contains("gpu-new"), "{out}");
    assert!(
        out["error"].as_str().unwrap().contains("gpusAllocatable"),
        "{out}"
    );

    // A replace without the node drops the cluster's attributes, the agent's stay.
    let (status, _) = call(
        &s,
        Method::PUT,
        "/v1/facts/cluster",
        Some(&json!({"entities": []})),
        Some("cn:probity-controller"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (_, node) = call(&s, Method::GET, "/v1/entities/Node/gpu-new", None, None).await;
    assert!(node["attrs"].get("zone").is_none(), "{node}");
    assert!(node["attrs"].get("gpusAllocatable").is_none(), "{node}");
    assert_eq!(node["attrs"]["rack"], "r1", "{node}");
}

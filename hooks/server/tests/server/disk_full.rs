//! A full disk under the state directory (issue 28, item 2): no deny is answered
//! without its record, the failure is a 503 (and an admission deny with code 503) the
//! caller can tell from a policy's deny, readiness and the metrics say so, and the
//! server recovers by itself when space returns.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use probity::state::StateStore;
use serde_json::json;

use crate::{call, metric};

#[path = "../../../testsupport/small_disk.rs"]
mod small_disk;

fn deny_request() -> serde_json::Value {
    json!({"principal": "Workload::\"train-1\"", "action": "schedule",
           "resource": "Node::\"gpu-blocked\""})
}

#[tokio::test]
async fn a_full_disk_answers_503_not_an_unrecorded_deny_and_the_server_recovers_when_space_returns()
{
    let disk = small_disk::SmallDisk::mount(8);
    let store = Arc::new(StateStore::open(&disk.path().join("state")).unwrap());
    let engine = crate::engine();
    engine.attach_state(store.clone()).unwrap();
    let s = probity_server::AppState::new(engine, probity_server::Config::default());
    let (status, _) = call(&s, Method::GET, "/readyz", None, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(metric(&s, "probity_state_store_failing").await, 0.0);

    disk.fill();
    // Denies until one cannot be recorded; every 200 deny before it must be recorded.
    let mut answered = 0usize;
    let mut refused = None;
    for _ in 0..20_000 {
        let (status, out) = call(&s, Method::POST, "/v1/decide", Some(&deny_request()), None).await;
        if status == StatusCode::SERVICE_UNAVAILABLE {
            refused = Some(out);
            break;
        }
        assert_eq!(status, StatusCode::OK, "{out}");
        assert_eq!(out["decision"], "deny");
        answered += 1;
    }
    let refused = refused.expect("a full disk must make a record fail");
    let message = refused["error"].as_str().unwrap();
    assert!(
        message.starts_with("the decision could not be recorded: ")
            && message.contains("No space left on device"),
        "{refused}"
    );
    assert_eq!(refused["code"], 503);

    // Readiness says why; the metrics show it.
    let (status, ready) = call(&s, Method::GET, "/readyz", None, None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{ready}");
    assert_eq!(ready["status"], "not ready");
    assert!(
        ready["reasons"][0]
            .as_str()
            .unwrap()
            .starts_with("the state store cannot write"),
        "{ready}"
    );
    assert_eq!(metric(&s, "probity_state_store_failing").await, 1.0);
    assert!(metric(&s, "probity_decisions_unrecorded_total").await >= 1.0);
    assert!(metric(&s, "probity_state_store_failures_total").await >= 1.0);

    // A batch is refused as a whole (one commit holds its records).
    let batch = json!({"requests": [deny_request()]});
    let (status, out) = call(&s, Method::POST, "/v1/decide/batch", Some(&batch), None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{out}");
    // Admission: a refusal with code 503, not a policy's 403.
    let mut pod = crate::admission::gpu_pod("on-blocked", 1, "4");
    pod["spec"]["nodeName"] = json!("gpu-blocked");
    let response =
        crate::admission::validate(&s, &crate::admission::review("Pod", "ml-train", pod)).await;
    assert_eq!(response["allowed"], false, "{response}");
    assert_eq!(response["status"]["code"], 503, "{response}");
    assert_eq!(response["status"]["reason"], "ServiceUnavailable");

    disk.free();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, _) = call(&s, Method::GET, "/readyz", None, None).await;
        if status == StatusCode::OK {
            break;
        }
        assert!(Instant::now() < deadline, "readiness never came back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(metric(&s, "probity_state_store_failing").await, 0.0);
    assert_eq!(
        metric(&s, "probity_state_store_recoveries_total").await,
        1.0
    );
    let (status, out) = call(&s, Method::POST, "/v1/decide", Some(&deny_request()), None).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["decision"], "deny");

    // Every deny answered 200 is in the log, and nothing else.
    let records = store.decisions(0, 100_000).unwrap();
    assert_eq!(records.len(), answered + 1);
}

//! probity-server's integration tests: every route in process through `oneshot`,
//! AdmissionReviews from real captures, end to end over a Unix socket and over TLS on
//! loopback (mTLS accepted and refused), a bounded load test across policy reloads, and
//! a lint of the Kubernetes manifests.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod actions;
mod admission;
mod api;
mod cache;
mod deploy;
mod disk_full;
mod keys;
mod modes;
mod net;
mod placement;
#[path = "../../../testsupport/rng.rs"]
mod rng;
mod routes;
mod slurm;
mod stream;
#[path = "../../../testsupport/tls_client.rs"]
mod tls_client;
mod tolerations;

use std::path::{Path, PathBuf};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use probity::Engine;
use probity_server::{AppState, Caller, Config, app};
use serde_json::Value;
use tower::ServiceExt;

pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The cluster facts shared by the scenarios.
pub(crate) fn cluster() -> Value {
    serde_json::from_slice(&std::fs::read(root().join("testdata/entities/cluster.json")).unwrap())
        .unwrap()
}

/// An engine on the embedded defaults with the test cluster loaded, and its
/// `gpu-blocked` node blocked (the blocklist, not the entity JSON, says so).
pub(crate) fn engine() -> Engine {
    let engine = Engine::from_embedded_defaults().unwrap();
    engine.upsert_entities(&cluster()).unwrap();
    engine
        .block_node(
            "gpu-blocked",
            "fixture: blocked since the cluster was set up",
        )
        .unwrap();
    engine
}

pub(crate) fn state_with(config: Config) -> AppState {
    AppState::new(engine(), config)
}

pub(crate) fn state() -> AppState {
    state_with(Config::default())
}

/// Sends one request through the router in process, as `caller` if given.
pub(crate) async fn call(
    state: &AppState,
    method: Method,
    uri: &str,
    body: Option<&Value>,
    caller: Option<&str>,
) -> (StatusCode, Value) {
    let bytes = body
        .map(|b| serde_json::to_vec(b).unwrap())
        .unwrap_or_default();
    call_raw(state, method, uri, bytes, caller).await
}

/// The value of metric `name` in the server's `/metrics`.
pub(crate) async fn metric(s: &AppState, name: &str) -> f64 {
    let (_, text) = call_raw(s, Method::GET, "/metrics", Vec::new(), None).await;
    let text = text.as_str().unwrap().to_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in the metrics"))
        .parse()
        .unwrap()
}

pub(crate) async fn call_raw(
    state: &AppState,
    method: Method,
    uri: &str,
    body: Vec<u8>,
    caller: Option<&str>,
) -> (StatusCode, Value) {
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    if let Some(c) = caller {
        req.extensions_mut().insert(Caller(c.to_owned()));
    }
    let response = app(state.clone()).oneshot(req).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let value = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    (status, value)
}

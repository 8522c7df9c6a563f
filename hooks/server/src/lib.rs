//! `probity serve`: the node sidecar's API and the Kubernetes admission webhook.
//!
//! The server is thin: [`app`] builds the axum [`Router`] over an [`AppState`] (an
//! [`Engine`] plus configuration and metrics); [`Server`] binds the configured listeners
//! (a Unix socket, and/or TCP with rustls TLS and optional client certificates), serves
//! until a shutdown signal and drains in-flight requests. Everything the engine decides
//! comes from the `probity` library; this crate only speaks HTTP, JSON and Kubernetes.
//!
//! Routes:
//!
//! | route | what |
//! | --- | --- |
//! | `POST /v1/decide` | one request, answered with a decision |
//! | `POST /v1/decide/batch` | `{"requests": [..]}`, answered with `{"decisions": [..]}` |
//! | `POST /v1/entities` | upsert Cedar entity JSON (authorized: `manage` on `Api::"entities"`) |
//! | `DELETE /v1/entities` | remove `{"uids": [..]}` (authorized likewise) |
//! | `GET /v1/entities/{type}/{id}` | one entity |
//! | `POST /v1/nodes/{id}/block`, `.../unblock` | block or unblock a node (authorized: `manage` on `Api::"nodes"`) |
//! | `GET /v1/nodes/blocked` | blocked nodes and why |
//! | `GET /v1/policy/status` | digest, files, reloads, last reload error |
//! | `POST /v1/verify` | verify a file before a node reads it; a failure blocks the node (authorized: `manage` on `Api::"verify"`) |
//! | `POST /v1/admission/validate`, `/v1/admission/mutate` | AdmissionReview v1 |
//! | `GET /healthz`, `/readyz`, `/metrics` | liveness, readiness, Prometheus |
//!
//! Running it: `cargo run -p probity-cli -- serve` serves the embedded default policies
//! on `/run/probity/probity.sock` (mode 0660; the directory is created), where root is an
//! administrator; `probity serve --listen 127.0.0.1:8181 --insecure` adds plain HTTP on
//! loopback (refused on any other address); `--listen 0.0.0.0:8443 --tls-cert C --tls-key K
//! [--client-ca CA]` serves TLS (mTLS). `--policies DIR` hot-reloads a policy directory;
//! `--config FILE` reads every option (see `probity-server.toml`).
//!
//! ```sh
//! curl --unix-socket /run/probity/probity.sock http://probity/v1/decide \
//!   -d '{"principal": "Workload::\"w\"", "action": "admit", "resource": "Namespace::\"default\""}'
//! ```
//!
//! Who may change state is itself policy: the server asks the engine
//! `ApiCaller::"<identity>"` / `Action::"manage"` / `Api::"entities"` or `Api::"nodes"`,
//! with the caller's groups (from the configuration) as request-scoped parents. A policy
//! directory without the `api/` policies therefore permits no state change.
//!
//! ```
//! use probity_server::{AppState, Config, app};
//! use tower::ServiceExt;
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let engine = probity::Engine::from_embedded_defaults().unwrap();
//! let router = app(AppState::new(engine, Config::default()));
//! let response = router
//!     .oneshot(axum::http::Request::get("/healthz").body(axum::body::Body::empty()).unwrap())
//!     .await
//!     .unwrap();
//! assert_eq!(response.status(), 200);
//! # });
//! ```

mod admission;
mod api;
mod caller;
mod config;
mod error;
mod metrics;
mod server;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request as HttpRequest, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use probity::{Decision, Engine, Request};

pub use caller::{Caller, certificate_common_name};
pub use config::{
    AdmissionConfig, AuthConfig, Config, ConfigError, DEFAULT_SOCKET, IntegrityConfig, LogConfig,
    LogFormat, PolicyConfig, ServerConfig, UnknownKinds, UnknownNodes,
};
pub use error::{ApiError, ServeError};
pub use server::{Server, init_logging, serve, shutdown_signal};

/// What every handler shares: the engine, the configuration, metrics and readiness.
/// Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    engine: Engine,
    config: Config,
    metrics: metrics::Metrics,
    ready: AtomicBool,
}

impl AppState {
    /// State over a loaded engine; ready at once, since the engine holds a valid set.
    /// The configuration's API callers, groups and endpoint families are registered in
    /// the engine as the facts it owns ([`AuthConfig::api_entities`]); a policy set
    /// whose schema has no such types permits no state change, and says so in the log.
    pub fn new(engine: Engine, config: Config) -> Self {
        if let Err(e) =
            engine.replace_owned_entities(probity::EntityOwner::Api, &config.auth.api_entities())
        {
            tracing::warn!(error = %e, "the API callers could not be registered; no state change will be permitted");
        }
        Self {
            inner: Arc::new(Inner {
                engine,
                config,
                metrics: metrics::Metrics::default(),
                ready: AtomicBool::new(true),
            }),
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Whether `/readyz` reports ready.
    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::Relaxed)
    }

    /// Sets readiness: the server clears it when it starts shutting down.
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::Relaxed);
    }

    pub(crate) fn metrics(&self) -> &metrics::Metrics {
        &self.inner.metrics
    }

    /// Decides and times the decision into the metrics. Waits for the decision's
    /// record in place: for callers already off the async workers (admission reviews
    /// with a state store run on the blocking pool).
    pub(crate) fn decide(&self, request: &Request) -> Decision {
        let start = Instant::now();
        let d = self.engine().decide(request);
        self.metrics().record_decision(&d, start.elapsed());
        d
    }

    /// Decides, and if the decision must be recorded first (a deny or obligations,
    /// with a state store attached), waits for the commit on the blocking pool rather
    /// than on the async worker.
    pub(crate) async fn decide_async(&self, request: Request) -> Decision {
        let start = Instant::now();
        let settled = self.engine().decide_deferred(&request);
        let decisions = if settled.is_pending() {
            tokio::task::spawn_blocking(move || settled.settle())
                .await
                .unwrap_or_default()
        } else {
            settled.settle()
        };
        let decision = decisions
            .into_iter()
            .next()
            .unwrap_or_else(|| Decision::error("the decision record could not be awaited"));
        self.metrics().record_decision(&decision, start.elapsed());
        decision
    }

    pub(crate) fn decide_batch(&self, requests: &[Request]) -> Vec<Decision> {
        let start = Instant::now();
        let decisions = self.engine().decide_batch(requests);
        let per = start.elapsed() / u32::try_from(requests.len().max(1)).unwrap_or(u32::MAX);
        for d in &decisions {
            self.metrics().record_decision(d, per);
        }
        decisions
    }
}

/// The router: every route, with the body limit, concurrency bound, and timeout and
/// metrics as layers.
pub fn app(state: AppState) -> Router {
    let server = &state.config().server;
    let limit = server.max_body_bytes;
    let concurrency = server.max_concurrency;
    Router::new()
        .route("/v1/decide", post(api::decide))
        .route("/v1/decide/batch", post(api::decide_batch))
        .route(
            "/v1/entities",
            post(api::upsert_entities).delete(api::remove_entities),
        )
        .route("/v1/entities/{type}/{id}", get(api::entity))
        .route("/v1/nodes/blocked", get(api::blocked_nodes))
        .route("/v1/nodes/{id}/block", post(api::block_node))
        .route("/v1/nodes/{id}/unblock", post(api::unblock_node))
        .route("/v1/policy/status", get(api::policy_status))
        .route("/v1/decisions", get(api::decisions))
        .route("/v1/verify", post(api::verify))
        .route("/v1/admission/validate", post(admission::validate))
        .route("/v1/admission/mutate", post(admission::mutate))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Innermost first: a request waiting for a concurrency slot is inside its timeout.
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(concurrency))
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::NotFound("no such route".into())
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// Times the request out and records it in the metrics: one middleware rather than
/// two, since each layer costs a boxed future per request on the hottest route.
async fn observe(State(state): State<AppState>, req: HttpRequest, next: Next) -> Response {
    let start = Instant::now();
    let route = req.extensions().get::<MatchedPath>().cloned();
    let route = route.as_ref().map_or("unmatched", MatchedPath::as_str);
    let response =
        match tokio::time::timeout(state.config().server.request_timeout(), next.run(req)).await {
            Ok(r) => r,
            Err(_) => ApiError::Timeout.into_response(),
        };
    let took = start.elapsed();
    let status = response.status().as_u16();
    state.metrics().record_response(route, status, took);
    tracing::trace!(route, status, micros = took.as_micros() as u64, "request");
    response
}

async fn healthz() -> impl IntoResponse {
    axum::Json(serde_json::json!({"status": "ok"}))
}

async fn readyz(State(state): State<AppState>) -> Response {
    if state.is_ready() {
        let s = state.engine().status();
        axum::Json(
            serde_json::json!({"status": "ready", "digest": s.digest, "policies": s.policies}),
        )
        .into_response()
    } else {
        ApiError::Unavailable("not ready".into()).into_response()
    }
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    let text = state
        .metrics()
        .render(&state.engine().status(), state.is_ready());
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

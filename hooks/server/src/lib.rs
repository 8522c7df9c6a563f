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
//! | `POST /v1/entities/stream` | NDJSON of upserts on one long-lived request, applied in groups and acknowledged as they go (authorized likewise) |
//! | `DELETE /v1/entities` | remove `{"uids": [..]}` (authorized likewise) |
//! | `GET /v1/entities/{type}/{id}` | one entity |
//! | `GET /v1/entities/{type}` | every entity of a type, sorted by id (`{"entities": [..]}`) |
//! | `POST /v1/nodes/{id}/block`, `POST /v1/nodes/{id}/unblock` | block or unblock a node (authorized: `manage` on `Api::"nodes"`) |
//! | `GET /v1/nodes/blocked` | blocked nodes and why |
//! | `GET /v1/actions/migrate`, `POST /v1/actions/migrate` | the live `migrate` requests (for the controller); `{"node"}`: a reporter's node decided and its requests published or withdrawn (authorized: `manage` on `Api::"actions"`, operation `report`) |
//! | `PUT /v1/facts/cluster` | replace the facts the cluster owns (`{"entities": [..]}`: each Node's `@owned("cluster")` attributes, from its Kubernetes Node) (authorized: `manage` on `Api::"cluster"`, operation `replace`; the controller) |
//! | `POST /v1/events` | append `{"events": [{"object", "node", "kind", "detail"}]}` to the event log (authorized: `manage` on `Api::"events"`, operation `record`; the controller's actions) |
//! | `GET /v1/policy/status` | digest, files, reloads, last reload error, the policies not plainly enforcing (`modes`) |
//! | `GET /v1/reports` | what the `warn` and `audit` policies find in the store now: each Node judged as its agent asks (`comply`), each stored Workload as admission does (`admit`), nodes and workloads by namespace |
//! | `GET /v1/policy/shadow` | the shadow set (`[policies] shadow`): decisions agreed, disagreed and dropped, by policy, the latest disagreements |
//! | `GET /v1/cluster/digests` | the policy digest every process serves (from the state store), and which lag |
//! | `POST /v1/verify` | verify a file before a node reads it; a failure blocks the node (authorized: `manage` on `Api::"verify"`) |
//! | `GET /v1/decisions?from=&limit=` | the decision log, oldest first (authorized: `read` on `Api::"decisions"`) |
//! | `GET /v1/keys` | every key's metadata (never key material) and where the KEKs live |
//! | `POST /v1/keys/rotate`, `POST /v1/keys/erase` | `{"key"}`: a new primary version; `{"subject", "objects"}`: crypto-shredding |
//! | `POST /v1/encrypt`, `POST /v1/decrypt` | `{"key", "object_id", "plaintext"}` / `{"object_id", "ciphertext"}`, base64, after the policies allow it |
//! | `POST /v1/admission/validate`, `POST /v1/admission/mutate` | AdmissionReview v1 (Pods, pod templates, `pods/binding`) |
//! | `POST /v1/scheduler/filter`, `POST /v1/scheduler/prioritize` | kube-scheduler extender: ExtenderArgs in, ExtenderFilterResult / HostPriorityList out |
//! | `POST /v1/slurm/submit` | `{"job": {..}}` from `job_submit`: the job judged as a `Workload` (`admit`), answered `{"allowed", "submission", "message"?, "reasons", "warnings", "workload"}` |
//! | `POST /v1/slurm/prolog` | `{"job", "node", "submission"?}` from the Prolog: the job's `schedule` onto its node, answered `{"verdict": "allow"}` or `{"verdict": "node" \| "job", "policy", "message"}` |
//! | `GET /healthz`, `GET /readyz`, `GET /metrics` | liveness, readiness, Prometheus |
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

mod actions;
mod admission;
pub mod alerts;
mod api;
mod caller;
mod cluster_facts;
mod config;
mod error;
pub mod forward;
#[doc(hidden)]
pub mod fuzzing;
mod keys;
mod limits;
mod metrics;
mod placement;
mod reader_claim;
pub mod reports;
mod server;
mod shadow;
mod slurm;
mod slurm_job;
mod stream;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request as HttpRequest, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use probity::{DecideOptions, Decision, Engine, Request};

/// Bytes the authorization cache keeps: a question is one caller, one operation and at
/// most one node, so a few thousand answers (under a KiB each) cover every agent of a
/// large cluster.
const AUTHORIZATION_CACHE_BYTES: usize = 4 << 20;

pub use caller::{Caller, IdentityError, certificate_common_name, certificate_identity};
pub use config::{
    AdmissionConfig, AuthConfig, ClientAuth, Config, ConfigError, DEFAULT_SOCKET,
    DecisionLogConfig, IntegrityConfig, JobSource, KeysConfig, LimitsConfig, LogConfig, LogFormat,
    NODE_NAME_ENV, PolicyConfig, ServerConfig, SiemConfig, SiemTransport, SlurmConfig,
    SlurmNamespace, StateBackendKind, StateConfig, StateRole, UnknownJobs, UnknownKinds,
    UnknownNodes,
};
pub use error::{ApiError, ServeError};
pub use reader_claim::{PeerProcess, ReaderClaimError};
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
    budget: limits::RecordBudget,
    io: limits::IoPool,
    /// The decision log's usage as retention last measured it.
    log_usage: std::sync::Mutex<Option<probity::state::LogUsage>>,
    /// The listeners' connection counts, once serving.
    connections: std::sync::OnceLock<Arc<limits::Connections>>,
    /// The `manage` authorizations' answers, reused the same way as the engine's
    /// decisions ([`probity::Engine::decision_cache`]). Apart from the engine's, so that
    /// callers' questions (which a caller chooses, and may flood) never push out the
    /// answers that let every caller in.
    authorizations: probity::DecisionCache,
    /// `/v1/decide`'s bodies already parsed: the same bytes (a Deployment's replicas,
    /// node agents' periodic questions) are read once.
    parsed_requests: probity::ParsedRequests,
    /// The mutating webhook's last node affinity, with the decisions it came from.
    affinity: std::sync::Mutex<Option<placement::AffinityMemo>>,
    /// Open fact streams, in all and per caller (`[server] max_fact_streams` and
    /// `max_fact_streams_per_caller`).
    fact_streams: Arc<limits::Connections>,
    /// The keyring, once opened on the state backend.
    keys: std::sync::OnceLock<keys::KeyService>,
    /// The local store that holds the decision and event logs (redb, or the etcd
    /// backend's local store), for the SIEM forwarders.
    local_logs: std::sync::OnceLock<Arc<probity::state::StateStore>>,
    /// `[policies] shadow`: the candidate set decided beside the live one, or why it
    /// could not be loaded.
    shadow: Option<Result<shadow::Shadow, String>>,
    /// The SIEM forwarders, while serving with `[siem]`.
    forwarders: std::sync::Mutex<Option<forward::Forwarders>>,
    /// The alert sinks fed from the decision log, while serving with `[alerts]`.
    alerts: std::sync::Mutex<Option<alerts::DecisionAlerts>>,
    /// The state store's health as last observed ([`AppState::storage_health`]), so
    /// that a change is logged once.
    storage: std::sync::Mutex<probity::state::StorageHealth>,
    /// Whether the pinned public key that `/v1/verify` reads was trusted when last read
    /// (`Err`: why not); `None` until verification is configured and the key read.
    verify_key: std::sync::Mutex<Option<Result<(), String>>>,
    /// Places for large scheduler extender requests (`[scheduler] max_large_requests`).
    large_scheduler_requests: Arc<limits::Connections>,
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
        let l = &config.limits;
        let budget = limits::RecordBudget::new(l.recorded_per_second, l.recorded_burst);
        let io =
            limits::IoPool::start(l.io_threads, l.io_queue, l.io_per_caller).unwrap_or_else(|e| {
                // Without threads every verification is refused (Busy::Stopped), and
                // nothing else depends on them.
                tracing::error!(error = %e, "cannot start the I/O threads; /v1/verify will refuse");
                limits::IoPool::start(0, 0, 0).unwrap_or_else(|_| std::process::abort())
            });
        let fact_streams = limits::Connections::new(
            config.server.max_fact_streams,
            config.server.max_fact_streams_per_caller,
        );
        engine
            .decision_cache()
            .set_budget(config.limits.decision_cache_bytes);
        let shadow = config.policies.shadow.as_ref().map(|dir| {
            shadow::Shadow::start(&engine, dir, config.policies.shadow_sample_every)
                .inspect_err(|e| tracing::error!(error = %e, "the shadow set is not decided"))
        });
        let parsed_requests = probity::ParsedRequests::new(
            config.limits.parsed_request_bytes,
            probity::ParsedRequests::DEFAULT_MAX_BODY_BYTES,
        );
        let large = config.scheduler.max_large_requests;
        let large_scheduler_requests = limits::Connections::new(large, large);
        Self {
            inner: Arc::new(Inner {
                large_scheduler_requests,
                engine,
                config,
                metrics: metrics::Metrics::default(),
                ready: AtomicBool::new(true),
                budget,
                io,
                log_usage: std::sync::Mutex::new(None),
                connections: std::sync::OnceLock::new(),
                authorizations: probity::DecisionCache::with_budget(AUTHORIZATION_CACHE_BYTES),
                parsed_requests,
                affinity: std::sync::Mutex::new(None),
                fact_streams,
                keys: std::sync::OnceLock::new(),
                local_logs: std::sync::OnceLock::new(),
                shadow,
                forwarders: std::sync::Mutex::new(None),
                alerts: std::sync::Mutex::new(None),
                storage: std::sync::Mutex::new(probity::state::StorageHealth::default()),
                verify_key: std::sync::Mutex::new(None),
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

    /// Whether the state store writes, asking it (which, while it fails, tries to
    /// recover: a reopen, a probe write); `None` without a state store. Logs a change:
    /// at error level when it starts failing, at info when it recovers. May write to
    /// disk: call it off the async workers.
    pub fn storage_health(&self) -> Option<probity::state::StorageHealth> {
        let health = self.engine().log()?.storage_health();
        let mut last = self
            .inner
            .storage
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match (&last.failure, &health.failure) {
            (None, Some(f)) => tracing::error!(
                path = %f.path.display(),
                operation = f.operation,
                error = %f.detail,
                "the state store cannot write: denies and obligations are answered 503 until it recovers"
            ),
            (Some(_), None) => tracing::info!("the state store writes again"),
            _ => {}
        }
        *last = health.clone();
        Some(health)
    }

    /// The pinned public key at `path`, judged as the CLI and sealed mode judge it
    /// (owner, mode, and every directory on its path: see `probity_base::trust`): a key
    /// others may write is refused with 503, and readiness says why. Logs a change of
    /// verdict.
    pub(crate) fn pinned_key(
        &self,
        path: &std::path::Path,
    ) -> Result<probity::integrity::PublicKey, ApiError> {
        let loaded = probity::integrity::PublicKey::load_pinned(path).map_err(|e| {
            format!(
                "the pinned public key is not trusted: {}",
                server::error_chain(&e)
            )
        });
        let verdict = loaded.as_ref().map(|_| ()).map_err(Clone::clone);
        let mut last = self
            .inner
            .verify_key
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.as_ref() != Some(&verdict) {
            match &verdict {
                Err(why) => {
                    tracing::error!(error = %why, "POST /v1/verify is refused until the key is fixed")
                }
                Ok(()) => tracing::info!(key = %path.display(), "the pinned public key is trusted"),
            }
        }
        *last = Some(verdict);
        loaded.map_err(|why| ApiError::Unavailable(format!("{why}; verification is refused")))
    }

    /// Judges the pinned key now, when `/v1/verify` is configured (data roots and a
    /// key path): at start and on each readiness check. `None`: not configured.
    pub fn check_verify_key(&self) -> Option<Result<(), String>> {
        let integrity = &self.config().integrity;
        if integrity.data_roots.is_empty() {
            return None;
        }
        let path = integrity.pinned_key_path()?;
        Some(
            self.pinned_key(&path)
                .map(|_| ())
                .map_err(|e| e.to_string()),
        )
    }

    /// The state store's health as last observed, without asking it.
    fn last_storage_health(&self) -> probity::state::StorageHealth {
        self.inner
            .storage
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Sets readiness: the server clears it when it starts shutting down.
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::Relaxed);
    }

    pub(crate) fn metrics(&self) -> &metrics::Metrics {
        &self.inner.metrics
    }

    pub(crate) fn keys(&self) -> Option<&keys::KeyService> {
        self.inner.keys.get()
    }

    /// Opens the keyring on the engine's state backend (`[keys]`); without a state
    /// backend there is none and the key endpoints answer 503. Call once, before
    /// serving.
    pub fn open_keyring(&self) -> Result<bool, String> {
        match keys::open(self.engine(), self.config())? {
            Some(service) => {
                let _ = self.inner.keys.set(service);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    pub(crate) fn decision_cache(&self) -> &probity::DecisionCache {
        self.inner.engine.decision_cache()
    }

    pub(crate) fn authorization_cache(&self) -> &probity::DecisionCache {
        &self.inner.authorizations
    }

    pub(crate) fn parsed_requests(&self) -> &probity::ParsedRequests {
        &self.inner.parsed_requests
    }

    pub(crate) fn affinity_memo(&self) -> &std::sync::Mutex<Option<placement::AffinityMemo>> {
        &self.inner.affinity
    }

    pub(crate) fn fact_streams(&self) -> &Arc<limits::Connections> {
        &self.inner.fact_streams
    }

    pub(crate) fn large_scheduler_requests(&self) -> &Arc<limits::Connections> {
        &self.inner.large_scheduler_requests
    }

    pub(crate) fn io(&self) -> &limits::IoPool {
        &self.inner.io
    }

    pub(crate) fn set_connections(&self, c: Arc<limits::Connections>) {
        let _ = self.inner.connections.set(c);
    }

    /// Names the local store that holds the decision and event logs (what the SIEM
    /// forwarders read). Call once, before serving.
    pub fn set_local_logs(&self, store: Arc<probity::state::StateStore>) {
        let _ = self.inner.local_logs.set(store);
    }

    pub(crate) fn local_logs(&self) -> Option<&Arc<probity::state::StateStore>> {
        self.inner.local_logs.get()
    }

    pub(crate) fn set_forwarders(
        &self,
        f: Option<forward::Forwarders>,
    ) -> Option<forward::Forwarders> {
        std::mem::replace(
            &mut *self
                .inner
                .forwarders
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            f,
        )
    }

    pub(crate) fn set_alerts(
        &self,
        a: Option<alerts::DecisionAlerts>,
    ) -> Option<alerts::DecisionAlerts> {
        std::mem::replace(
            &mut *self
                .inner
                .alerts
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            a,
        )
    }

    /// The alert follower's counters and each sink's (`None` without `[alerts]`).
    pub fn alert_stats(
        &self,
    ) -> Option<(
        alerts::FollowerStats,
        Vec<(&'static str, probity_siem::AlerterStats)>,
    )> {
        self.inner
            .alerts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(alerts::DecisionAlerts::stats)
    }

    /// Each SIEM forwarder's counters (none without `[siem]`).
    pub fn siem_stats(&self) -> Vec<(forward::Log, probity_siem::ForwarderStats)> {
        self.inner
            .forwarders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(forward::Forwarders::stats)
            .unwrap_or_default()
    }

    /// The first decision-log sequence number the SIEM has not received (retention
    /// keeps it and what follows); `None` without `[siem]`.
    pub(crate) fn siem_keep_from(&self) -> Option<u64> {
        self.inner
            .forwarders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .and_then(forward::Forwarders::decisions_undelivered)
    }

    pub(crate) fn set_log_usage(&self, usage: probity::state::LogUsage) {
        *self
            .inner
            .log_usage
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(usage);
    }

    pub(crate) fn log_usage(&self) -> Option<probity::state::LogUsage> {
        *self
            .inner
            .log_usage
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the decision log holds at least `warn_pct` of its byte budget.
    pub(crate) fn log_near_budget(&self) -> bool {
        let c = &self.config().decision_log;
        self.log_usage().is_some_and(|u| {
            u.bytes.saturating_mul(100) >= c.max_bytes.saturating_mul(u64::from(c.warn_pct))
        })
    }

    /// Readiness warnings about the SIEM forwarders: one per log that is behind.
    fn siem_warnings(&self, out: &mut Vec<String>) {
        for (log, s) in self.siem_stats() {
            if s.behind {
                out.push(format!(
                    "the SIEM forwarder of the {} log is behind: {} records not confirmed{}",
                    log.as_str(),
                    s.backlog,
                    s.last_error
                        .map(|e| format!(" (last error: {e})"))
                        .unwrap_or_default()
                ));
            }
        }
    }

    /// How current the shared state is, when the state store is shared (etcd).
    pub(crate) fn shared_health(&self) -> Option<probity::state::SharedHealth> {
        self.engine().state().and_then(|s| s.shared_health())
    }

    /// Readiness warnings about the shared state: unreachable, or older than
    /// `[state] stale_after_ms`. Decisions keep serving from the last state heard.
    fn state_warnings(&self, health: &probity::state::SharedHealth, out: &mut Vec<String>) {
        let limit = self.config().state.stale_after();
        let age = health.since_last_heard.map_or_else(
            || "never heard from".to_owned(),
            |d| format!("last heard from {:.1} s ago", d.as_secs_f64()),
        );
        if !health.connected || health.since_last_heard.is_none_or(|d| d > limit) {
            out.push(format!(
                "shared state ({}) is unreachable or stale ({age}): decisions serve from the last state heard{}",
                health.backend,
                health
                    .last_error
                    .as_ref()
                    .map(|e| format!("; last error: {e}"))
                    .unwrap_or_default()
            ));
        }
        if health.unshared_blocks > 0 {
            out.push(format!(
                "{} block(s) in force here have not reached the shared state yet; retrying",
                health.unshared_blocks
            ));
        }
    }

    fn too_many(caller: &Caller) -> ApiError {
        ApiError::TooManyRequests(format!(
            "{} is over its budget of recorded decisions; retry later",
            caller.0
        ))
    }

    /// A decision that needed a record the log could not write becomes a 503: the
    /// caller must not take it for a policy's deny (nor act on its obligations).
    fn recorded(d: Decision) -> Result<Decision, ApiError> {
        if d.unrecorded {
            let why = d
                .errors
                .last()
                .map_or("the decision could not be recorded", |e| e.message.as_str());
            return Err(ApiError::Unavailable(format!("{why}; retry later")));
        }
        Ok(d)
    }

    /// Decides `requests` within `caller`'s budget of recorded decisions, without
    /// waiting for their records. Plugins get no longer than the request timeout: once
    /// the caller has been answered that it timed out, their work stops too.
    fn decide_within(&self, caller: &Caller, requests: &[Request]) -> probity::Settled {
        let budget = &self.inner.budget;
        let mut admit = |n: usize| budget.admit_n(&caller.0, n);
        let deadline = Instant::now() + self.config().server.request_timeout();
        self.engine().decide_with(
            requests,
            DecideOptions::new().within(&mut admit).deadline(deadline),
        )
    }

    /// Decides and times the decision into the metrics, within `caller`'s budget of
    /// recorded decisions. Waits for the decision's record in place: for callers
    /// already off the async workers (admission reviews with a state store run on the
    /// blocking pool).
    pub(crate) fn decide(&self, caller: &Caller, request: &Request) -> Result<Decision, ApiError> {
        let start = Instant::now();
        let settled = self.decide_within(caller, std::slice::from_ref(request));
        if settled.is_over_budget() {
            return Err(Self::too_many(caller));
        }
        let d = settled
            .settle()
            .pop()
            .unwrap_or_else(|| Decision::error("no decision"));
        self.metrics().record_decision(&d, start.elapsed());
        self.offer_shadow(request, &d);
        Self::recorded(d)
    }

    /// Decides within `caller`'s budget of recorded decisions. A decision that runs
    /// plugins (deadlines up to seconds) is made on the blocking pool; one that must be
    /// recorded first (a deny or obligations, with a state store attached) awaits its
    /// commit without holding a worker or a thread.
    pub(crate) async fn decide_async(
        &self,
        caller: &Caller,
        request: Request,
    ) -> Result<Decision, ApiError> {
        let start = Instant::now();
        let request = request.on_behalf_of(caller.0.as_str());
        let sample = self.shadow_sample(&request);
        let decision = if self.engine().runs_plugins(&request) {
            let s = self.clone();
            let c = caller.clone();
            tokio::task::spawn_blocking(move || {
                let settled = s.decide_within(&c, std::slice::from_ref(&request));
                (!settled.is_over_budget()).then(|| settled.settle())
            })
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "decision task failed");
                ApiError::Internal
            })?
            .ok_or_else(|| Self::too_many(caller))?
        } else {
            let settled = self.decide_within(caller, std::slice::from_ref(&request));
            if settled.is_over_budget() {
                return Err(Self::too_many(caller));
            }
            // The commit is awaited here, on the async workers: no thread is parked per
            // recorded decision. Only records still waiting for room in the log's full
            // queue need a blocking wait (backpressure), on the blocking pool.
            match settled.awaitable() {
                Ok(awaiting) => awaiting.await,
                Err(settled) => tokio::task::spawn_blocking(move || settled.settle())
                    .await
                    .unwrap_or_default(),
            }
        };
        let decision = decision
            .into_iter()
            .next()
            .unwrap_or_else(|| Decision::error("the decision record could not be awaited"));
        self.metrics().record_decision(&decision, start.elapsed());
        if let (Some(request), Some(Ok(shadow))) = (sample, &self.inner.shadow) {
            shadow.submit(request, decision.clone());
        }
        Self::recorded(decision)
    }

    pub(crate) fn decide_batch(
        &self,
        caller: &Caller,
        requests: &[Request],
    ) -> Result<Vec<Decision>, ApiError> {
        let start = Instant::now();
        let settled = self.decide_within(caller, requests);
        if settled.is_over_budget() {
            return Err(Self::too_many(caller));
        }
        let decisions = settled.settle();
        let per = start.elapsed() / u32::try_from(requests.len().max(1)).unwrap_or(u32::MAX);
        for (r, d) in requests.iter().zip(&decisions) {
            self.metrics().record_decision(d, per);
            self.offer_shadow(r, d);
        }
        // One commit holds a batch's records: none was written.
        if let Some(d) = decisions.iter().find(|d| d.unrecorded) {
            return Self::recorded(d.clone()).map(|_| Vec::new());
        }
        Ok(decisions)
    }
}

/// Every (method, path) [`app`] serves, in its order: what the route tables of README.md
/// and of this module's documentation are checked against, and what the server's route
/// test checks against [`app`] itself (tests/server/routes.rs).
pub const ROUTES: &[(&str, &str)] = &[
    ("POST", "/v1/decide"),
    ("POST", "/v1/decide/batch"),
    ("POST", "/v1/entities"),
    ("DELETE", "/v1/entities"),
    ("POST", "/v1/entities/stream"),
    ("GET", "/v1/entities/{type}/{id}"),
    ("GET", "/v1/entities/{type}"),
    ("GET", "/v1/nodes/blocked"),
    ("GET", "/v1/actions/migrate"),
    ("POST", "/v1/actions/migrate"),
    ("POST", "/v1/nodes/{id}/block"),
    ("POST", "/v1/nodes/{id}/unblock"),
    ("GET", "/v1/policy/status"),
    ("GET", "/v1/policy/shadow"),
    ("GET", "/v1/reports"),
    ("GET", "/v1/cluster/digests"),
    ("GET", "/v1/decisions"),
    ("POST", "/v1/events"),
    ("PUT", "/v1/facts/cluster"),
    ("POST", "/v1/verify"),
    ("GET", "/v1/keys"),
    ("POST", "/v1/keys/rotate"),
    ("POST", "/v1/keys/erase"),
    ("POST", "/v1/encrypt"),
    ("POST", "/v1/decrypt"),
    ("POST", "/v1/admission/validate"),
    ("POST", "/v1/admission/mutate"),
    ("POST", "/v1/scheduler/filter"),
    ("POST", "/v1/scheduler/prioritize"),
    ("POST", "/v1/slurm/submit"),
    ("POST", "/v1/slurm/prolog"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
];

/// The router: every route, with the body limit, concurrency bound, and timeout and
/// metrics as layers.
pub fn app(state: AppState) -> Router {
    let server = &state.config().server;
    let limit = server.max_body_bytes;
    let concurrency = server.max_concurrency;
    let extender_limit = state.config().scheduler.max_body_bytes;
    Router::new()
        .route("/v1/decide", post(api::decide))
        .route("/v1/decide/batch", post(api::decide_batch))
        .route(
            "/v1/entities",
            post(api::upsert_entities).delete(api::remove_entities),
        )
        .route("/v1/entities/stream", post(stream::upsert_stream))
        .route("/v1/entities/{type}/{id}", get(api::entity))
        .route("/v1/entities/{type}", get(api::entities_of_type))
        .route("/v1/nodes/blocked", get(api::blocked_nodes))
        .route(
            "/v1/actions/migrate",
            get(actions::migrate_requests).post(actions::report_migrate),
        )
        .route("/v1/nodes/{id}/block", post(api::block_node))
        .route("/v1/nodes/{id}/unblock", post(api::unblock_node))
        .route("/v1/policy/status", get(api::policy_status))
        .route("/v1/policy/shadow", get(api::policy_shadow))
        .route("/v1/reports", get(api::reports))
        .route("/v1/cluster/digests", get(api::cluster_digests))
        .route("/v1/decisions", get(api::decisions))
        .route("/v1/events", post(api::record_events))
        // Every Node of a large cluster in one request: a bound of its own.
        .route(
            "/v1/facts/cluster",
            put(cluster_facts::replace).layer(DefaultBodyLimit::max(cluster_facts::MAX_BODY_BYTES)),
        )
        .route("/v1/verify", post(api::verify))
        .route("/v1/keys", get(keys::status))
        .route("/v1/keys/rotate", post(keys::rotate))
        .route("/v1/keys/erase", post(keys::erase))
        .route("/v1/encrypt", post(keys::encrypt))
        .route("/v1/decrypt", post(keys::decrypt))
        .route("/v1/admission/validate", post(admission::validate))
        .route("/v1/admission/mutate", post(admission::mutate))
        // The extender's own body bound ([scheduler] max_body_bytes) replaces the server's.
        .route(
            "/v1/scheduler/filter",
            post(placement::filter).layer(DefaultBodyLimit::max(extender_limit)),
        )
        .route(
            "/v1/scheduler/prioritize",
            post(placement::prioritize).layer(DefaultBodyLimit::max(extender_limit)),
        )
        .route("/v1/slurm/submit", post(slurm::submit))
        .route("/v1/slurm/prolog", post(slurm::prolog))
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
    // Asking the store may write a probe: off the async workers.
    let s = state.clone();
    let (storage, verify_key) =
        tokio::task::spawn_blocking(move || (s.storage_health(), s.check_verify_key()))
            .await
            .unwrap_or_default();
    if let Some(f) = storage.as_ref().and_then(|h| h.failure.as_ref()) {
        // Not ready: denies and obligations would be answered 503 here, so traffic is
        // better sent to a replica whose store writes.
        let body = serde_json::json!({
            "status": "not ready",
            "code": 503,
            "reasons": [format!(
                "the state store cannot write ({} at {}: {}); it retries every {:?}",
                f.operation,
                f.path.display(),
                f.detail,
                probity::state::StateStore::RECOVERY_INTERVAL
            )],
            "state_store": {"failing_since_unix_ms": f.since_unix_ms},
        });
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    }
    if state.is_ready() {
        let s = state.engine().status();
        let mut warnings = Vec::new();
        if state.log_near_budget() {
            warnings.push(
                "the decision log is near its byte budget ([decision_log] max_bytes): retention is pruning"
                    .to_owned(),
            );
        }
        state.siem_warnings(&mut warnings);
        // Verification refused, everything else served: degraded, not unready.
        let degraded = matches!(verify_key, Some(Err(_)));
        if let Some(Err(why)) = verify_key {
            warnings.push(format!("{why}: POST /v1/verify answers 503"));
        }
        let shared = state.shared_health();
        if let Some(h) = &shared {
            state.state_warnings(h, &mut warnings);
        }
        let status = if degraded { "degraded" } else { "ready" };
        let mut body = serde_json::json!({"status": status, "digest": s.digest,
            "policies": s.policies, "warnings": warnings});
        if let (Some(h), Some(obj)) = (shared, body.as_object_mut()) {
            obj.insert(
                "state".into(),
                serde_json::json!({
                    "backend": h.backend,
                    "connected": h.connected,
                    "since_last_heard_seconds": h.since_last_heard.map(|d| d.as_secs_f64()),
                    "applied_revision": h.applied_revision,
                    "resyncs": h.resyncs,
                    "unshared_blocks": h.unshared_blocks,
                    "last_error": h.last_error,
                }),
            );
        }
        axum::Json(body).into_response()
    } else {
        ApiError::Unavailable("not ready".into()).into_response()
    }
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    let mut text = metrics::exposition(&state);
    if state.keys().is_some() {
        // The key ages read the state backend, which may be etcd over the network.
        let s = state.clone();
        if let Ok(keys_text) = tokio::task::spawn_blocking(move || {
            let mut t = String::new();
            if let Some(k) = s.keys() {
                keys::render_metrics(k, s.engine(), &mut t);
            }
            t
        })
        .await
        {
            text.push_str(&keys_text);
        }
    }
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

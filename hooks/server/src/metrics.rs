//! Prometheus metrics: a few counters and fixed-bucket latency histograms kept in atomics,
//! so recording never blocks deciding, and the whole `/metrics` text ([`exposition`]):
//! these counters, then what the server's state reports (limits, caches, SIEM forwarders,
//! alert sinks). `AppState` holds the state; the text is written here, through the one
//! Prometheus writer ([`probity_base::prometheus`]). The keyring's gauges are written by
//! `keys::render_metrics`, off the async threads.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError, RwLock};
use std::time::Duration;

use probity::{Decision, Effect, PolicyStatus};
use probity_base::prometheus::{Kind, Writer};

use crate::AppState;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
    5.0,
];

#[derive(Default)]
struct RouteStats {
    latency: Histogram,
    /// Responses by status class: 1xx..5xx.
    classes: [AtomicU64; 5],
}

#[derive(Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| secs <= *b)
            && let Some(b) = self.buckets.get(i)
        {
            b.fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }
}

/// The server's counters and histograms.
#[derive(Default)]
pub(crate) struct Metrics {
    allow: AtomicU64,
    deny: AtomicU64,
    /// Decisions that needed a record the log could not write (answered 503).
    unrecorded: AtomicU64,
    /// policy -> decisions it determined, [allow, deny]. Read-locked on the hot path.
    by_policy: RwLock<HashMap<String, [AtomicU64; 2]>>,
    /// policy -> times it fired without enforcing, [warn, audit].
    findings: RwLock<HashMap<String, [AtomicU64; 2]>>,
    /// (endpoint, allowed) -> admission reviews answered.
    reviews: Mutex<BTreeMap<(&'static str, bool), u64>>,
    /// route -> request latency and responses by status class.
    routes: RwLock<HashMap<String, RouteStats>>,
    decide_latency: Histogram,
}

/// Adds one to `policy`'s counter `index` in `map`, read-locked unless the policy is new.
fn count(map: &RwLock<HashMap<String, [AtomicU64; 2]>>, policy: &str, index: usize) {
    let read = map.read().unwrap_or_else(PoisonError::into_inner);
    if let Some(counts) = read.get(policy) {
        if let Some(c) = counts.get(index) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        return;
    }
    drop(read);
    let mut write = map.write().unwrap_or_else(PoisonError::into_inner);
    if let Some(c) = write.entry(policy.to_owned()).or_default().get(index) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Metrics {
    pub fn record_decision(&self, d: &Decision, took: Duration) {
        let index = match d.decision {
            Effect::Allow => {
                self.allow.fetch_add(1, Ordering::Relaxed);
                0
            }
            Effect::Deny => {
                self.deny.fetch_add(1, Ordering::Relaxed);
                1
            }
        };
        self.decide_latency.observe(took);
        if d.unrecorded {
            self.unrecorded.fetch_add(1, Ordering::Relaxed);
        }
        for r in &d.reasons {
            count(&self.by_policy, &r.policy, index);
        }
        for n in &d.warnings {
            count(&self.findings, &n.policy, 0);
        }
        for n in &d.audit {
            count(&self.findings, &n.policy, 1);
        }
    }

    pub fn record_review(&self, endpoint: &'static str, allowed: bool) {
        *lock(&self.reviews).entry((endpoint, allowed)).or_default() += 1;
    }

    pub fn record_response(&self, route: &str, status: u16, took: Duration) {
        let class = usize::from(status / 100).saturating_sub(1).min(4);
        let note = |r: &RouteStats| {
            r.latency.observe(took);
            if let Some(c) = r.classes.get(class) {
                c.fetch_add(1, Ordering::Relaxed);
            }
        };
        let read = self.routes.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = read.get(route) {
            note(r);
        } else {
            drop(read);
            let mut write = self.routes.write().unwrap_or_else(PoisonError::into_inner);
            note(write.entry(route.to_owned()).or_default());
        }
    }

    /// The text exposition of these counters and histograms.
    pub fn render(&self, status: &PolicyStatus, ready: bool) -> String {
        let mut out = String::with_capacity(4096);
        let mut w = Writer::new(&mut out);
        w.family(
            "probity_decisions_total",
            Kind::Counter,
            "Decisions made, by outcome.",
        );
        for (outcome, n) in [
            ("allow", self.allow.load(Ordering::Relaxed)),
            ("deny", self.deny.load(Ordering::Relaxed)),
        ] {
            w.sample("probity_decisions_total", &[("outcome", outcome)], n);
        }
        w.single(
            "probity_decisions_unrecorded_total",
            Kind::Counter,
            "Decisions that needed a record the decision log could not write, answered as a failure (503).",
            self.unrecorded.load(Ordering::Relaxed),
        );
        w.family(
            "probity_decision_reasons_total",
            Kind::Counter,
            "Decisions by the policy that determined them.",
        );
        let by_policy: BTreeMap<String, [u64; 2]> = self
            .by_policy
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(p, [a, d])| {
                (
                    p.clone(),
                    [a.load(Ordering::Relaxed), d.load(Ordering::Relaxed)],
                )
            })
            .collect();
        for (policy, counts) in &by_policy {
            for (outcome, n) in ["allow", "deny"].iter().zip(counts) {
                if *n > 0 {
                    w.sample(
                        "probity_decision_reasons_total",
                        &[("outcome", outcome), ("policy", policy)],
                        n,
                    );
                }
            }
        }
        w.family(
            "probity_policy_findings_total",
            Kind::Counter,
            "Times a policy in warn or audit mode fired (what it would have refused), by mode and policy.",
        );
        let findings: BTreeMap<String, [u64; 2]> = self
            .findings
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(p, [w, a])| {
                (
                    p.clone(),
                    [w.load(Ordering::Relaxed), a.load(Ordering::Relaxed)],
                )
            })
            .collect();
        for (policy, counts) in &findings {
            for (mode, n) in ["warn", "audit"].iter().zip(counts) {
                if *n > 0 {
                    w.sample(
                        "probity_policy_findings_total",
                        &[("mode", mode), ("policy", policy)],
                        n,
                    );
                }
            }
        }
        w.family(
            "probity_policy_mode",
            Kind::Gauge,
            "1 for each policy not plainly enforcing, labelled with its mode where no scope applies (a scoped policy also has scoped=\"true\").",
        );
        for (policy, modes) in &status.modes {
            let scoped = if modes.scoped.is_empty() {
                "false"
            } else {
                "true"
            };
            w.sample(
                "probity_policy_mode",
                &[
                    ("mode", modes.mode.as_str()),
                    ("policy", policy),
                    ("scoped", scoped),
                ],
                1,
            );
        }
        w.family(
            "probity_admission_reviews_total",
            Kind::Counter,
            "AdmissionReviews answered.",
        );
        for ((endpoint, allowed), n) in lock(&self.reviews).iter() {
            let allowed = if *allowed { "true" } else { "false" };
            w.sample(
                "probity_admission_reviews_total",
                &[("endpoint", endpoint), ("allowed", allowed)],
                n,
            );
        }
        w.family(
            "probity_http_responses_total",
            Kind::Counter,
            "HTTP responses, by route and status.",
        );
        let routes = self.routes.read().unwrap_or_else(PoisonError::into_inner);
        let mut sorted: Vec<(&String, &RouteStats)> = routes.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        for (route, stats) in &sorted {
            for (i, c) in stats.classes.iter().enumerate() {
                let n = c.load(Ordering::Relaxed);
                if n > 0 {
                    let status = format!("{}xx", i + 1);
                    w.sample(
                        "probity_http_responses_total",
                        &[("route", route), ("status", &status)],
                        n,
                    );
                }
            }
        }
        w.family(
            "probity_decision_duration_seconds",
            Kind::Histogram,
            "Time to decide one request in the engine.",
        );
        write_histogram(
            &mut w,
            "probity_decision_duration_seconds",
            &[],
            &self.decide_latency,
        );
        w.family(
            "probity_http_request_duration_seconds",
            Kind::Histogram,
            "HTTP request latency, by route.",
        );
        for (route, stats) in &sorted {
            write_histogram(
                &mut w,
                "probity_http_request_duration_seconds",
                &[("route", route)],
                &stats.latency,
            );
        }
        drop(routes);
        let gauges: [(&str, Kind, &str, u64); 6] = [
            (
                "probity_policy_reloads_total",
                Kind::Counter,
                "Successful policy reloads.",
                status.reloads,
            ),
            (
                "probity_policy_reload_errors_total",
                Kind::Counter,
                "Rejected policy reloads.",
                status.reload_errors,
            ),
            (
                "probity_policy_last_reload_failed",
                Kind::Gauge,
                "1 while the last reload was rejected.",
                u64::from(status.last_error.is_some()),
            ),
            (
                "probity_policy_loaded_timestamp_seconds",
                Kind::Gauge,
                "When the live policy set was loaded.",
                status.loaded_at,
            ),
            (
                "probity_policies",
                Kind::Gauge,
                "Policies in the live set.",
                status.policies as u64,
            ),
            (
                "probity_entities",
                Kind::Gauge,
                "Entities in the store.",
                status.entities as u64,
            ),
        ];
        for (name, kind, help, v) in gauges {
            w.single(name, kind, help, v);
        }
        w.single(
            "probity_ready",
            Kind::Gauge,
            "1 when the server takes traffic.",
            u8::from(ready),
        );
        out
    }
}

fn write_histogram(w: &mut Writer<'_>, name: &str, labels: &[(&str, &str)], h: &Histogram) {
    let mut cumulative = 0;
    let buckets = BUCKETS.iter().zip(&h.buckets).map(|(bound, b)| {
        cumulative += b.load(Ordering::Relaxed);
        (*bound, cumulative)
    });
    let buckets: Vec<(f64, u64)> = buckets.collect();
    let count = h.count.load(Ordering::Relaxed);
    let sum = h.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
    w.histogram(name, labels, buckets, sum, count);
}

/// The `/metrics` text but the keyring's: the server's counters, then what its state
/// reports.
pub(crate) fn exposition(state: &AppState) -> String {
    let mut text = state
        .metrics()
        .render(&state.engine().status(), state.is_ready());
    let mut w = Writer::new(&mut text);
    limits(state, &mut w);
    if let Some(Ok(shadow)) = state.shadow() {
        let (agreed, disagreed, dropped) = shadow.totals();
        w.family(
            "probity_shadow_decisions_total",
            Kind::Counter,
            "Sampled decisions decided again under the shadow set, by outcome (dropped: the shadow queue was full).",
        );
        for (outcome, n) in [
            ("agreed", agreed),
            ("disagreed", disagreed),
            ("dropped", dropped),
        ] {
            w.sample("probity_shadow_decisions_total", &[("outcome", outcome)], n);
        }
    }
    decision_caches(state, &mut w);
    siem(state, &mut w);
    alerts(state, &mut w);
    text
}

/// The limits' gauges and counters, and the health of the state store and shared state.
fn limits(state: &AppState, w: &mut Writer<'_>) {
    let inner = &state.inner;
    w.single(
        "probity_recorded_budget_refused_total",
        Kind::Counter,
        "Requests answered 429 for want of a caller's budget of recorded decisions.",
        inner.budget.refused(),
    );
    let verify_key = inner
        .verify_key
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    if let Some(verdict) = verify_key {
        w.single(
            "probity_verify_key_trusted",
            Kind::Gauge,
            "1 while the pinned public key POST /v1/verify reads passes the trust checks (owner, mode, path); 0: verification is refused.",
            u8::from(verdict.is_ok()),
        );
    }
    if state.engine().state().is_some() {
        let h = state.last_storage_health();
        w.single(
            "probity_state_store_failing",
            Kind::Gauge,
            "1 while the state store cannot write (a full disk, say): denies and obligations are answered 503.",
            u8::from(h.failure.is_some()),
        );
        w.single(
            "probity_state_store_failures_total",
            Kind::Counter,
            "State store operations that failed with an I/O error.",
            h.failures_total,
        );
        w.single(
            "probity_state_store_recoveries_total",
            Kind::Counter,
            "Times the state store went from failing back to writing.",
            h.recoveries_total,
        );
    }
    w.single(
        "probity_io_jobs_in_flight",
        Kind::Gauge,
        "Verification jobs on the I/O threads.",
        inner.io.in_flight(),
    );
    let (open, refused) = inner.fact_streams.counts();
    w.single(
        "probity_fact_streams_open",
        Kind::Gauge,
        "Fact streams (POST /v1/entities/stream) open.",
        open,
    );
    w.single(
        "probity_fact_streams_refused_total",
        Kind::Counter,
        "Fact streams refused over the limits, in all or per caller.",
        refused,
    );
    if let Some(c) = inner.connections.get() {
        let (open, refused) = c.counts();
        w.single(
            "probity_connections_open",
            Kind::Gauge,
            "Connections open.",
            open,
        );
        w.single(
            "probity_connections_refused_total",
            Kind::Counter,
            "Connections refused over the limits.",
            refused,
        );
    }
    if let Some(h) = state.shared_health() {
        w.single(
            "probity_state_connected",
            Kind::Gauge,
            "1 while every watch of the shared state (etcd) is connected.",
            u8::from(h.connected),
        );
        w.single(
            "probity_state_since_last_heard_seconds",
            Kind::Gauge,
            "Age of the shared state decisions serve from: time since its stalest watch last heard from etcd.",
            // Never heard: as stale as can be said (Prometheus spells it +Inf).
            h.since_last_heard
                .map_or_else(|| "+Inf".to_owned(), |d| d.as_secs_f64().to_string()),
        );
        w.single(
            "probity_state_applied_revision",
            Kind::Gauge,
            "The etcd revision of the blocklist this process has applied.",
            h.applied_revision,
        );
        w.single(
            "probity_state_resyncs_total",
            Kind::Counter,
            "Full reads of the shared state after compactions or long disconnections.",
            h.resyncs,
        );
        w.single(
            "probity_state_unshared_blocks",
            Kind::Gauge,
            "Blocks in force here that have not reached etcd yet.",
            h.unshared_blocks,
        );
    }
    if let Some(u) = state.log_usage() {
        let c = &state.config().decision_log;
        w.single(
            "probity_decision_log_bytes",
            Kind::Gauge,
            "Bytes the decision log holds.",
            u.bytes,
        );
        w.single(
            "probity_decision_log_budget_bytes",
            Kind::Gauge,
            "The decision log's byte budget.",
            c.max_bytes,
        );
        w.single(
            "probity_decision_log_records",
            Kind::Gauge,
            "Records the decision log holds.",
            u.records,
        );
        w.single(
            "probity_decision_log_near_budget",
            Kind::Gauge,
            "1 when the log holds warn_pct of its budget.",
            u8::from(state.log_near_budget()),
        );
    }
}

/// The decision caches' counters: many placement misses while nothing changes mean the
/// scheduler's questions are not being reused.
fn decision_caches(state: &AppState, w: &mut Writer<'_>) {
    let cache = state.decision_cache().stats();
    w.single(
        "probity_decision_cache_hits_total",
        Kind::Counter,
        "Decisions reused from the decision cache (single decides, batches, admission, the extender).",
        cache.hits,
    );
    w.single(
        "probity_decision_cache_misses_total",
        Kind::Counter,
        "Cacheable decisions made afresh (not cached, or a fact they read changed).",
        cache.misses,
    );
    w.single(
        "probity_decision_cache_evictions_total",
        Kind::Counter,
        "Decisions let go to keep the decision cache within its byte budget.",
        cache.evictions,
    );
    w.single(
        "probity_decision_cache_entries",
        Kind::Gauge,
        "Decisions the decision cache holds.",
        cache.entries as u64,
    );
    w.single(
        "probity_decision_cache_bytes",
        Kind::Gauge,
        "Bytes the decision cache holds (its estimate of each entry's size).",
        cache.bytes as u64,
    );
    w.single(
        "probity_decision_cache_budget_bytes",
        Kind::Gauge,
        "The decision cache's byte budget ([limits] decision_cache_bytes).",
        cache.budget as u64,
    );
    let auth = state.authorization_cache();
    w.single(
        "probity_authorization_cache_hits_total",
        Kind::Counter,
        "API authorizations answered from their cache.",
        auth.hits(),
    );
    w.single(
        "probity_authorization_cache_misses_total",
        Kind::Counter,
        "API authorizations decided afresh (a deny is then decided again and recorded).",
        auth.misses(),
    );
    let parsed = state.parsed_requests().stats();
    w.single(
        "probity_parsed_requests_hits_total",
        Kind::Counter,
        "/v1/decide bodies answered from the memo of parsed bodies (the same bytes seen before).",
        parsed.hits,
    );
    w.single(
        "probity_parsed_requests_misses_total",
        Kind::Counter,
        "/v1/decide bodies parsed (new, too large to keep, or not valid).",
        parsed.misses,
    );
    w.single(
        "probity_parsed_requests_evictions_total",
        Kind::Counter,
        "Parsed bodies let go to keep the memo within its byte budget.",
        parsed.evictions,
    );
    w.single(
        "probity_parsed_requests_bytes",
        Kind::Gauge,
        "Bytes the memo of parsed bodies is counted at.",
        parsed.bytes,
    );
}

/// The SIEM forwarders' counters (none without `[siem]`).
fn siem(state: &AppState, w: &mut Writer<'_>) {
    let stats = state.siem_stats();
    if stats.is_empty() {
        return;
    }
    w.family(
        "probity_siem_forwarded_total",
        Kind::Counter,
        "Audit records the SIEM confirmed received since start, per log.",
    );
    for (log, s) in &stats {
        w.sample(
            "probity_siem_forwarded_total",
            &[("log", log.as_str())],
            s.forwarded,
        );
    }
    w.family(
        "probity_siem_backlog",
        Kind::Gauge,
        "Audit records not yet confirmed received by the SIEM, per log.",
    );
    for (log, s) in &stats {
        w.sample("probity_siem_backlog", &[("log", log.as_str())], s.backlog);
    }
    w.family(
        "probity_siem_connected",
        Kind::Gauge,
        "1 while the forwarder holds a connection to the SIEM, per log.",
    );
    for (log, s) in &stats {
        w.sample(
            "probity_siem_connected",
            &[("log", log.as_str())],
            u8::from(s.connected),
        );
    }
}

/// The alert follower's and sinks' counters (none without `[alerts]`).
fn alerts(state: &AppState, w: &mut Writer<'_>) {
    let Some((follower, sinks)) = state.alert_stats() else {
        return;
    };
    w.single(
        "probity_alerts_fired_total",
        Kind::Counter,
        "Alerts fired from alert obligations of recorded decisions.",
        follower.fired,
    );
    w.single(
        "probity_alerts_resolved_total",
        Kind::Counter,
        "Decision alerts resolved after their hold.",
        follower.resolved,
    );
    w.single(
        "probity_alerts_dropped_total",
        Kind::Counter,
        "Alerts an alert sink's full queue refused.",
        follower.dropped,
    );
    for (name, help, value) in [
        (
            "probity_alerts_posted_total",
            "Alert posts that succeeded, per sink.",
            (|s: &probity_siem::AlerterStats| s.posted) as fn(&probity_siem::AlerterStats) -> u64,
        ),
        (
            "probity_alerts_failed_posts_total",
            "Alert posts that failed (retried), per sink.",
            |s| s.failed_posts,
        ),
    ] {
        w.family(name, Kind::Counter, help);
        for (sink, s) in &sinks {
            w.sample(name, &[("sink", sink)], value(s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_text_is_valid_exposition_with_escaped_labels() {
        let engine = probity::Engine::defaults().build().unwrap();
        let state = AppState::new(engine, crate::config::Config::default());
        let m = state.metrics();
        m.record_review("validate", true);
        m.record_review("mutate", false);
        m.record_response("/v1/decide", 200, Duration::from_micros(70));
        m.record_response("/odd\"route\\\n", 503, Duration::from_millis(2));
        let text = exposition(&state);
        probity_base::prometheus::check(&text).unwrap();
        for line in [
            "probity_admission_reviews_total{endpoint=\"validate\",allowed=\"true\"} 1\n",
            "probity_http_responses_total{route=\"/odd\\\"route\\\\\\n\",status=\"5xx\"} 1\n",
            "probity_http_request_duration_seconds_bucket{route=\"/v1/decide\",le=\"0.0001\"} 1\n",
            "probity_decision_duration_seconds_bucket{le=\"+Inf\"} 0\n",
            "probity_decision_duration_seconds_sum{} 0\n",
            "# HELP probity_ready 1 when the server takes traffic.\n# TYPE probity_ready gauge\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from\n{text}");
        }
    }
}

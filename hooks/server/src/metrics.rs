//! Prometheus metrics in the text exposition format, hand-written: a few counters and
//! fixed-bucket latency histograms kept in atomics, so recording never blocks deciding.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError, RwLock};
use std::time::Duration;

use probity::{Decision, Effect, PolicyStatus};

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
    /// (endpoint, allowed) -> admission reviews answered.
    reviews: Mutex<BTreeMap<(&'static str, bool), u64>>,
    /// route -> request latency and responses by status class.
    routes: RwLock<HashMap<String, RouteStats>>,
    decide_latency: Histogram,
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
            let read = self
                .by_policy
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some(counts) = read.get(&r.policy) {
                if let Some(c) = counts.get(index) {
                    c.fetch_add(1, Ordering::Relaxed);
                }
            } else {
                drop(read);
                let mut write = self
                    .by_policy
                    .write()
                    .unwrap_or_else(PoisonError::into_inner);
                if let Some(c) = write.entry(r.policy.clone()).or_default().get(index) {
                    c.fetch_add(1, Ordering::Relaxed);
                }
            }
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

    /// The text exposition.
    pub fn render(&self, status: &PolicyStatus, ready: bool) -> String {
        let mut out = String::with_capacity(4096);
        let _ = writeln!(
            out,
            "# HELP probity_decisions_total Decisions made, by outcome.\n# TYPE probity_decisions_total counter"
        );
        for (outcome, n) in [
            ("allow", self.allow.load(Ordering::Relaxed)),
            ("deny", self.deny.load(Ordering::Relaxed)),
        ] {
            let _ = writeln!(out, "probity_decisions_total{{outcome=\"{outcome}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP probity_decisions_unrecorded_total Decisions that needed a record the decision log could not write, answered as a failure (503).\n# TYPE probity_decisions_unrecorded_total counter\nprobity_decisions_unrecorded_total {}",
            self.unrecorded.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP probity_decision_reasons_total Decisions by the policy that determined them.\n# TYPE probity_decision_reasons_total counter"
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
                    let _ = writeln!(
                        out,
                        "probity_decision_reasons_total{{outcome=\"{outcome}\",policy=\"{}\"}} {n}",
                        escape(policy)
                    );
                }
            }
        }
        let _ = writeln!(
            out,
            "# HELP probity_admission_reviews_total AdmissionReviews answered.\n# TYPE probity_admission_reviews_total counter"
        );
        for ((endpoint, allowed), n) in lock(&self.reviews).iter() {
            let _ = writeln!(
                out,
                "probity_admission_reviews_total{{endpoint=\"{endpoint}\",allowed=\"{allowed}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP probity_http_responses_total HTTP responses, by route and status.\n# TYPE probity_http_responses_total counter"
        );
        let routes = self.routes.read().unwrap_or_else(PoisonError::into_inner);
        let mut sorted: Vec<(&String, &RouteStats)> = routes.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        for (route, stats) in &sorted {
            for (i, c) in stats.classes.iter().enumerate() {
                let n = c.load(Ordering::Relaxed);
                if n > 0 {
                    let _ = writeln!(
                        out,
                        "probity_http_responses_total{{route=\"{}\",status=\"{}xx\"}} {n}",
                        escape(route),
                        i + 1
                    );
                }
            }
        }
        let _ = writeln!(
            out,
            "# HELP probity_decision_duration_seconds Time to decide one request in the engine.\n# TYPE probity_decision_duration_seconds histogram"
        );
        write_histogram(
            &mut out,
            "probity_decision_duration_seconds",
            "",
            &self.decide_latency,
        );
        let _ = writeln!(
            out,
            "# HELP probity_http_request_duration_seconds HTTP request latency, by route.\n# TYPE probity_http_request_duration_seconds histogram"
        );
        for (route, stats) in &sorted {
            let label = format!("route=\"{}\",", escape(route));
            write_histogram(
                &mut out,
                "probity_http_request_duration_seconds",
                &label,
                &stats.latency,
            );
        }
        drop(routes);
        let gauges: [(&str, &str, &str, u64); 6] = [
            (
                "probity_policy_reloads_total",
                "counter",
                "Successful policy reloads.",
                status.reloads,
            ),
            (
                "probity_policy_reload_errors_total",
                "counter",
                "Rejected policy reloads.",
                status.reload_errors,
            ),
            (
                "probity_policy_last_reload_failed",
                "gauge",
                "1 while the last reload was rejected.",
                u64::from(status.last_error.is_some()),
            ),
            (
                "probity_policy_loaded_timestamp_seconds",
                "gauge",
                "When the live policy set was loaded.",
                status.loaded_at,
            ),
            (
                "probity_policies",
                "gauge",
                "Policies in the live set.",
                status.policies as u64,
            ),
            (
                "probity_entities",
                "gauge",
                "Entities in the store.",
                status.entities as u64,
            ),
        ];
        for (name, kind, help, v) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP probity_ready 1 when the server takes traffic.\n# TYPE probity_ready gauge\nprobity_ready {}",
            u8::from(ready)
        );
        out
    }
}

fn write_histogram(out: &mut String, name: &str, labels: &str, h: &Histogram) {
    let mut cumulative = 0;
    for (bound, b) in BUCKETS.iter().zip(&h.buckets) {
        cumulative += b.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{bound}\"}} {cumulative}");
    }
    let count = h.count.load(Ordering::Relaxed);
    let _ = writeln!(out, "{name}_bucket{{{labels}le=\"+Inf\"}} {count}");
    let sum = h.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
    let trimmed = labels.trim_end_matches(',');
    let _ = writeln!(out, "{name}_sum{{{trimmed}}} {sum}");
    let _ = writeln!(out, "{name}_count{{{trimmed}}} {count}");
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

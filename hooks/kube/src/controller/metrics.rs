//! The controller's metrics, and the small HTTP endpoint that serves them.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Response, StatusCode};
use hyper_util::rt::TokioIo;
use probity_base::prometheus::{Kind, Writer};

/// Upper bounds of the block-to-taint lag histogram, in seconds.
const LAG_BUCKETS: [f64; 10] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];

/// What the controller counts.
#[derive(Default)]
pub struct Metrics {
    leader: AtomicBool,
    tripped: AtomicBool,
    paused: AtomicBool,
    dry_run: AtomicBool,
    passes: AtomicU64,
    errors: AtomicU64,
    actions: Mutex<BTreeMap<(String, String), u64>>,
    lag: Mutex<([u64; LAG_BUCKETS.len()], f64, u64)>,
}

impl Metrics {
    /// Whether this process holds the lease.
    pub fn set_leader(&self, leads: bool) {
        self.leader.store(leads, Ordering::Relaxed);
    }

    /// Whether it held the lease at the last pass.
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::Relaxed)
    }

    /// The modes the last pass found.
    pub fn set_modes(&self, tripped: bool, paused: bool, dry_run: bool) {
        self.tripped.store(tripped, Ordering::Relaxed);
        self.paused.store(paused, Ordering::Relaxed);
        self.dry_run.store(dry_run, Ordering::Relaxed);
    }

    /// One pass made.
    pub fn pass(&self) {
        self.passes.fetch_add(1, Ordering::Relaxed);
    }

    /// One failure (a pass, an action, a write).
    pub fn error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// One action with its outcome.
    pub fn action(&self, kind: &str, outcome: &str) {
        let mut actions = self.actions.lock().unwrap_or_else(|p| p.into_inner());
        *actions
            .entry((kind.to_owned(), outcome.to_owned()))
            .or_default() += 1;
    }

    /// A block acted on `seconds` after Probity recorded it.
    pub fn lag(&self, seconds: f64) {
        let mut lag = self.lag.lock().unwrap_or_else(|p| p.into_inner());
        for (bucket, bound) in lag.0.iter_mut().zip(LAG_BUCKETS) {
            if seconds <= bound {
                *bucket += 1;
            }
        }
        lag.1 += seconds;
        lag.2 += 1;
    }

    /// The Prometheus text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut w = Writer::new(&mut out);
        let flag = |b: &AtomicBool| u8::from(b.load(Ordering::Relaxed));
        w.single(
            "probity_controller_leader",
            Kind::Gauge,
            "1 while this replica holds the lease and acts",
            flag(&self.leader),
        );
        w.single(
            "probity_controller_breaker_tripped",
            Kind::Gauge,
            "1 while the circuit breaker is tripped (reset with probity controller reset)",
            flag(&self.tripped),
        );
        w.single(
            "probity_controller_paused",
            Kind::Gauge,
            "1 while the controller is paused",
            flag(&self.paused),
        );
        w.single(
            "probity_controller_dry_run",
            Kind::Gauge,
            "1 while the controller only reports what it would do",
            flag(&self.dry_run),
        );
        w.single(
            "probity_controller_passes_total",
            Kind::Counter,
            "reconcile passes made as the leader",
            self.passes.load(Ordering::Relaxed),
        );
        w.single(
            "probity_controller_errors_total",
            Kind::Counter,
            "passes or actions that failed (Probity, the apiserver or the shared state unreachable)",
            self.errors.load(Ordering::Relaxed),
        );
        w.family(
            "probity_controller_actions_total",
            Kind::Counter,
            "actions by kind (block, refresh, release, stop, label, migrate) and outcome",
        );
        let actions = self.actions.lock().unwrap_or_else(|p| p.into_inner());
        for ((kind, outcome), count) in actions.iter() {
            w.sample(
                "probity_controller_actions_total",
                &[("kind", kind), ("outcome", outcome)],
                count,
            );
        }
        drop(actions);
        w.family(
            "probity_controller_block_lag_seconds",
            Kind::Histogram,
            "from Probity's block record to the node's taint (whole seconds in the record)",
        );
        let lag = self.lag.lock().unwrap_or_else(|p| p.into_inner());
        w.histogram(
            "probity_controller_block_lag_seconds",
            &[],
            LAG_BUCKETS.iter().copied().zip(lag.0.iter().copied()),
            lag.1,
            lag.2,
        );
        drop(lag);
        out
    }
}

/// Serves `GET /metrics` (and `/healthz`) on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, metrics: std::sync::Arc<Metrics>) {
    loop {
        let Ok((stream, _peer)): Result<(tokio::net::TcpStream, SocketAddr), _> =
            listener.accept().await
        else {
            // Out of descriptors, most likely: wait rather than spin.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                let metrics = metrics.clone();
                async move {
                    let (status, body) = match request.uri().path() {
                        "/metrics" => (StatusCode::OK, metrics.render()),
                        "/healthz" => (StatusCode::OK, "ok\n".to_owned()),
                        _ => (StatusCode::NOT_FOUND, "not found\n".to_owned()),
                    };
                    let mut response = Response::new(Full::new(Bytes::from(body)));
                    *response.status_mut() = status;
                    Ok::<_, Infallible>(response)
                }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_text_is_valid_exposition() {
        let metrics = Metrics::default();
        metrics.set_leader(true);
        metrics.action("block", "done");
        metrics.action("release", "failed");
        metrics.lag(0.3);
        let text = metrics.render();
        probity_base::prometheus::check(&text).unwrap();
        assert!(text.contains("probity_controller_leader 1"), "{text}");
        assert!(
            text.contains("probity_controller_actions_total{kind=\"block\",outcome=\"done\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("probity_controller_block_lag_seconds_bucket{le=\"0.5\"} 1"),
            "{text}"
        );
    }
}

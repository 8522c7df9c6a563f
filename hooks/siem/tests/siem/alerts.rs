//! Alerts to a real Alertmanager, to a fake one that fails, and to a webhook.

use std::net::TcpListener;
use std::process::Command;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use probity_siem::{
    Alert, AlertError, AlertSink, AlertSpec, Alerter, AlerterConfig, AlertmanagerSink, Backoff,
    HttpSettings, Severity, SinkError, WebhookSink,
};
use serde_json::Value;

use crate::support::{Proc, eventually, fixtures, free_port, read_http_request, wait_listening};

fn fast() -> AlerterConfig {
    AlerterConfig {
        refresh_interval: Duration::from_millis(300),
        expiry: Duration::from_secs(2),
        backoff: Backoff {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(200),
        },
        ..AlerterConfig::default()
    }
}

fn spec() -> AlertSpec {
    let mut s = AlertSpec::new(
        "thermal.gpu-over-target",
        Some("gpu-node-1".into()),
        Severity::High,
        "GPU 3 on gpu-node-1 at 71 C, above the 65 C target",
    );
    s.labels.insert("gpu".into(), "3".into());
    s
}

fn http() -> HttpSettings {
    HttpSettings {
        timeout: Duration::from_secs(2),
        ca_file: None,
    }
}

/// prometheus-alertmanager on loopback, clustering off, state in `dir`.
struct Alertmanager {
    proc: Proc,
    log: std::path::PathBuf,
    url: String,
}

impl Alertmanager {
    fn start(dir: &std::path::Path) -> Alertmanager {
        let port = free_port();
        let config = dir.join("alertmanager.yml");
        std::fs::write(
            &config,
            "route:\n  receiver: none\nreceivers:\n  - name: none\n",
        )
        .unwrap();
        let storage = dir.join("alertmanager-data");
        std::fs::create_dir_all(&storage).unwrap();
        let log = dir.join("alertmanager.log");
        let mut proc = Proc::spawn(
            "prometheus-alertmanager",
            Command::new("prometheus-alertmanager")
                .arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.path={}", storage.display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--cluster.listen-address=")
                .stdout(std::fs::File::create(&log).unwrap())
                .stderr(std::fs::OpenOptions::new().append(true).open(&log).unwrap()),
        );
        wait_listening(port, &mut proc, &log);
        let url = format!("http://127.0.0.1:{port}");
        eventually("alertmanager to be ready", Duration::from_secs(20), || {
            proc.assert_running(&log);
            let r = ureq::get(&format!("{url}/-/ready")).call().ok()?;
            (r.status() == 200).then_some(())
        });
        Alertmanager { proc, log, url }
    }

    /// GET /api/v2/alerts.
    fn alerts(&mut self) -> Vec<Value> {
        self.proc.assert_running(&self.log);
        let body = ureq::get(&format!("{}/api/v2/alerts", self.url))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap();
        serde_json::from_str::<Vec<Value>>(&body).unwrap()
    }
}

#[test]
fn alertmanager_shows_a_fired_alert_keeps_it_past_its_expiry_and_forgets_it_once_resolved() {
    let dir = tempfile::tempdir().unwrap();
    let mut am = Alertmanager::start(dir.path());
    let sink = AlertmanagerSink::new(&am.url, &http()).unwrap();
    let alerter = Alerter::start(fast(), Box::new(sink)).unwrap();
    alerter.fire(spec()).unwrap();

    let shown = eventually(
        "the alert in GET /api/v2/alerts",
        Duration::from_secs(20),
        || {
            let a = am.alerts();
            (a.len() == 1).then(|| a[0].clone())
        },
    );
    let labels = &shown["labels"];
    assert_eq!(labels["alertname"], "thermal.gpu-over-target");
    assert_eq!(labels["node"], "gpu-node-1");
    assert_eq!(labels["severity"], "high");
    assert_eq!(labels["gpu"], "3");
    assert_eq!(
        shown["annotations"]["message"],
        "GPU 3 on gpu-node-1 at 71 C, above the 65 C target"
    );
    assert_eq!(shown["status"]["state"], "active");
    let first_end = shown["endsAt"].as_str().unwrap().to_owned();

    // Refreshed past its 2 s expiry: still active, with a later end.
    let posted = alerter.stats().posted;
    eventually(
        "refreshes beyond the expiry",
        Duration::from_secs(30),
        || (alerter.stats().posted >= posted + 8).then_some(()),
    );
    let a = am.alerts();
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(a[0]["status"]["state"], "active");
    assert!(a[0]["endsAt"].as_str().unwrap() > first_end.as_str());

    alerter.resolve(spec()).unwrap();
    eventually(
        "the alert to leave GET /api/v2/alerts",
        Duration::from_secs(20),
        || am.alerts().is_empty().then_some(()),
    );
    let stats = eventually("the resolve to be counted", Duration::from_secs(10), || {
        let s = alerter.stats();
        (s.resolved == 1 && s.active == 0).then_some(s)
    });
    assert_eq!(
        (stats.failed_posts, stats.rejected, stats.dropped_when_full),
        (0, 0, 0)
    );
}

/// An HTTP server on loopback that answers each request with the next of `replies`
/// (the last one repeats) and records what it was sent.
/// A request: its head and its body.
type Request = (String, Vec<u8>);

struct FakeHttp {
    port: u16,
    requests: Arc<Mutex<Vec<Request>>>,
}

impl FakeHttp {
    fn start(port: u16, replies: Vec<Vec<u8>>) -> FakeHttp {
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&requests);
        // The thread ends with the test process.
        std::thread::spawn(move || {
            let mut n = 0usize;
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                // Keep-alive: several requests per connection.
                while let Some(req) = read_http_request(&mut conn) {
                    seen.lock().unwrap().push(req);
                    let reply = &replies[n.min(replies.len() - 1)];
                    n += 1;
                    use std::io::Write;
                    if conn.write_all(reply).is_err() {
                        break;
                    }
                }
            }
        });
        FakeHttp { port, requests }
    }

    fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(fixtures().join("alertmanager").join(name)).unwrap()
}

const ERROR_500: &[u8] =
    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\nContent-Length: 21\r\n\r\ninternal server error";

#[test]
fn a_500_is_retried_with_backoff_until_the_alert_arrives_and_each_failure_is_counted() {
    let port = free_port();
    let fake = FakeHttp::start(
        port,
        vec![
            ERROR_500.to_vec(),
            ERROR_500.to_vec(),
            fixture("post-alerts-response.http"),
        ],
    );
    let sink = AlertmanagerSink::new(&format!("http://127.0.0.1:{}", fake.port), &http()).unwrap();
    let alerter = Alerter::start(fast(), Box::new(sink)).unwrap();
    alerter.fire(spec()).unwrap();
    let stats = eventually("a successful post", Duration::from_secs(20), || {
        let s = alerter.stats();
        (s.posted >= 1).then_some(s)
    });
    assert_eq!(stats.failed_posts, 2);
    let reqs = fake.requests();
    assert!(
        reqs[0].0.starts_with("POST /api/v2/alerts HTTP/1.1"),
        "{}",
        reqs[0].0
    );
    // Three identical attempts of the same alert.
    let bodies: Vec<Value> = reqs
        .iter()
        .take(3)
        .map(|(_, b)| serde_json::from_slice(b).unwrap())
        .collect();
    for b in &bodies {
        assert_eq!(b[0]["labels"], bodies[0][0]["labels"]);
        assert_eq!(b[0]["labels"]["alertname"], "thermal.gpu-over-target");
        assert_eq!(b[0]["startsAt"], bodies[0][0]["startsAt"]);
        assert!(b[0]["endsAt"].as_str().unwrap() > b[0]["startsAt"].as_str().unwrap());
    }
}

#[test]
fn a_422_is_a_rejection_counted_with_alertmanagers_message_and_not_retried() {
    let port = free_port();
    let _fake = FakeHttp::start(port, vec![fixture("post-alerts-invalid-response.http")]);
    let sink = AlertmanagerSink::new(&format!("http://127.0.0.1:{port}"), &http()).unwrap();
    let alerter = Alerter::start(fast(), Box::new(sink)).unwrap();
    alerter.fire(spec()).unwrap();
    let stats = eventually("the rejection", Duration::from_secs(20), || {
        let s = alerter.stats();
        (s.rejected == 1 && s.active == 0).then_some(s)
    });
    assert_eq!((stats.posted, stats.failed_posts), (0, 0));
    assert_eq!(
        stats.last_error.unwrap(),
        format!(
            "http://127.0.0.1:{port}/api/v2/alerts rejected the alert with 422: 0.labels in body is required"
        )
    );
}

#[test]
fn an_unreachable_alertmanager_is_retried_and_the_alert_waits_for_it() {
    let port = free_port();
    let sink = AlertmanagerSink::new(&format!("http://127.0.0.1:{port}"), &http()).unwrap();
    let alerter = Alerter::start(fast(), Box::new(sink)).unwrap();
    alerter.fire(spec()).unwrap();
    let stats = eventually("failed posts", Duration::from_secs(20), || {
        let s = alerter.stats();
        (s.failed_posts >= 3).then_some(s)
    });
    assert_eq!((stats.posted, stats.active), (0, 1));
    let error = stats.last_error.unwrap();
    assert!(
        error.starts_with(&format!(
            "cannot reach http://127.0.0.1:{port}/api/v2/alerts: "
        )),
        "{error}"
    );
    let fake = FakeHttp::start(port, vec![fixture("post-alerts-response.http")]);
    eventually("the alert to arrive", Duration::from_secs(20), || {
        (alerter.stats().posted >= 1).then_some(())
    });
    let body: Value = serde_json::from_slice(&fake.requests()[0].1).unwrap();
    assert_eq!(body[0]["labels"]["node"], "gpu-node-1");
    assert_eq!(alerter.stats().last_error, None);
}

/// A sink that reports each call and waits for a go-ahead.
struct Gate {
    entered: Mutex<Sender<()>>,
    go: Mutex<Receiver<()>>,
}

impl AlertSink for Gate {
    fn post(&self, _: &Alert) -> Result<(), SinkError> {
        // Once the test has let go (dropped its ends), calls pass straight through.
        let _ = self.entered.lock().unwrap().send(());
        let _ = self.go.lock().unwrap().recv();
        Ok(())
    }
}

#[test]
fn a_full_queue_refuses_new_alerts_without_blocking_and_counts_them() {
    let (entered_tx, entered) = channel();
    let (go, go_rx) = channel();
    let sink = Gate {
        entered: Mutex::new(entered_tx),
        go: Mutex::new(go_rx),
    };
    let cfg = AlerterConfig {
        queue_capacity: 2,
        ..fast()
    };
    let alerter = Alerter::start(cfg, Box::new(sink)).unwrap();
    alerter.fire(spec()).unwrap();
    // The thread is now inside the sink: the queue takes two, then refuses.
    entered.recv().unwrap();
    let mut refused = 0;
    for i in 0..10 {
        let mut s = spec();
        s.labels.insert("gpu".into(), i.to_string());
        match alerter.fire(s) {
            Ok(()) => {}
            Err(AlertError::Full {
                alertname,
                capacity,
            }) => {
                assert_eq!(
                    (alertname.as_str(), capacity),
                    ("thermal.gpu-over-target", 2)
                );
                refused += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(refused, 8);
    assert_eq!(alerter.stats().dropped_when_full, 8);
    // Let everything through: the three accepted alerts are posted.
    for _ in 0..3 {
        go.send(()).unwrap();
    }
    eventually("three posts", Duration::from_secs(10), || {
        (alerter.stats().posted >= 3).then_some(())
    });
    drop(go);
    drop(alerter);
}

#[test]
fn the_webhook_gets_the_alert_firing_then_resolved() {
    let port = free_port();
    let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n".to_vec();
    let fake = FakeHttp::start(port, vec![ok]);
    let sink = WebhookSink::new(&format!("http://127.0.0.1:{port}/hook"), &http()).unwrap();
    let alerter = Alerter::start(fast(), Box::new(sink)).unwrap();
    alerter.fire(spec()).unwrap();
    eventually("the firing post", Duration::from_secs(10), || {
        (alerter.stats().posted >= 1).then_some(())
    });
    alerter.resolve(spec()).unwrap();
    eventually("the resolve", Duration::from_secs(10), || {
        (alerter.stats().resolved == 1).then_some(())
    });
    let reqs = fake.requests();
    let first: Value = serde_json::from_slice(&reqs[0].1).unwrap();
    let last: Value = serde_json::from_slice(&reqs.last().unwrap().1).unwrap();
    assert!(reqs[0].0.starts_with("POST /hook HTTP/1.1"));
    assert_eq!(first["status"], "firing");
    assert_eq!(first["labels"]["alertname"], "thermal.gpu-over-target");
    assert_eq!(last["status"], "resolved");
    assert_eq!(last["labels"], first["labels"]);
    assert_eq!(
        last["annotations"]["message"],
        first["annotations"]["message"]
    );
}

#[test]
fn our_alert_json_has_the_fields_of_the_captured_post() {
    let captured: Value = serde_json::from_slice(&fixture("post-alerts-request.json")).unwrap();
    let ours = serde_json::to_value(Alert {
        labels: Default::default(),
        annotations: Default::default(),
        starts_at: "2026-11-30T21:47:13.385181Z".into(),
        ends_at: "2026-11-30T21:52:13.385181Z".into(),
        generator_url: Some("http://127.0.0.1:8080/policies/gpu-power-cap".into()),
    })
    .unwrap();
    for key in captured[0].as_object().unwrap().keys() {
        assert!(ours.get(key).is_some(), "{key} missing from {ours}");
    }
    // And what Alertmanager sends back parses as JSON with the labels we use.
    let get = fixture("get-alerts-response.http");
    let body = &get[get.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4..];
    let shown: Vec<Value> = serde_json::from_slice(body).unwrap();
    assert_eq!(shown[0]["labels"]["node"], "gpu-node-1");
}

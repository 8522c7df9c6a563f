//! A small HTTP/1.1 keep-alive load generator for `probity serve` (and, for comparison,
//! any JSON-over-HTTP decision server such as cedar-agent).
//!
//! Closed loop (each connection sends its next request when the last one is answered) or
//! fixed rate (requests scheduled at `--rate` per second in total, spread evenly over
//! the connections). At a fixed rate every request is timed from its scheduled time, so
//! neither a stalled server nor a late client hides queueing. The pacer is a timerfd per
//! connection with microsecond resolution: tokio's own timer has 1 ms ticks, which at
//! 10k/s would release each millisecond's requests in one burst and measure the burst.
//! Always bounded: it stops at `--requests` or `--duration`, whichever comes first.
//!
//! ```text
//! cargo run --release -p probity-server --example loadgen -- \
//!     --tcp 127.0.0.1:8181 --path /v1/decide --body request.json \
//!     --connections 4 --rate 10000 --duration 10 --requests 200000
//! ```
//!
//! Options: `--tcp ADDR` or `--unix PATH`; `--tls-ca PEM` (TLS to `localhost`);
//! `--path`, `--body FILE` or `--bodies FILE` (one JSON body per line, taken in turn),
//! `--get` (GETs without a body, for `/healthz`),
//! `--connections N` (default 1), `--rate R` (default 0:
//! closed loop), `--requests N` (default 100000), `--duration SECS` (default 10),
//! `--warmup N` requests per connection not counted (default 100),
//! `--expect TEXT` (a response must contain it), `--threads N` (client threads, default 1).
//!
//! `--stream`: each connection opens one request (`POST /v1/entities/stream`) and sends
//! the bodies as its NDJSON lines, at the rate; a line is timed from its scheduled time
//! to the acknowledgement that covers it (`{"through": N}`), and a refused line or a
//! stream the server ended counts as an error. Warm-up lines are acknowledged before
//! the clock starts. `--tick MS` (with `--stream` and `--rate`): each writer wakes every
//! MS milliseconds and sends the lines due by then in one write, as a relay that
//! forwards its agents' reports would; each line is still timed from its own scheduled
//! time, so the wait for the tick counts in its latency.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;
type StreamSender = hyper::client::conn::http1::SendRequest<Lines>;

/// A request body fed from a channel: one stream's NDJSON lines.
struct Lines(tokio::sync::mpsc::Receiver<Bytes>);

impl hyper::body::Body for Lines {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|b| b.map(|b| Ok(hyper::body::Frame::data(b))))
    }
}

#[derive(Clone)]
struct Opts {
    tcp: Option<String>,
    unix: Option<PathBuf>,
    tls_ca: Option<PathBuf>,
    path: String,
    body: Bytes,
    /// With `--bodies`: the requests' bodies, taken in turn.
    bodies: Arc<Vec<Bytes>>,
    /// `--get`: GET requests without a body (`/healthz`), instead of POSTs.
    get: bool,
    connections: usize,
    rate: f64,
    requests: u64,
    duration: Duration,
    warmup: usize,
    expect: Option<String>,
    threads: usize,
    stream: bool,
    /// With `--stream`: send the lines due every this often, in one write.
    tick: Option<Duration>,
}

fn opts() -> Opts {
    let mut o = Opts {
        tcp: None,
        unix: None,
        tls_ca: None,
        path: "/v1/decide".into(),
        body: Bytes::new(),
        bodies: Arc::new(Vec::new()),
        get: false,
        connections: 1,
        rate: 0.0,
        requests: 100_000,
        duration: Duration::from_secs(10),
        warmup: 100,
        expect: None,
        threads: 1,
        stream: false,
        tick: None,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        if args[i] == "--get" {
            o.get = true;
            i += 1;
            continue;
        }
        if args[i] == "--stream" {
            o.stream = true;
            i += 1;
            continue;
        }
        let v = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--tcp" => o.tcp = Some(v),
            "--unix" => o.unix = Some(v.into()),
            "--tls-ca" => o.tls_ca = Some(v.into()),
            "--path" => o.path = v,
            "--body" => o.body = Bytes::from(std::fs::read(&v).expect("--body file")),
            "--bodies" => {
                let text = std::fs::read_to_string(&v).expect("--bodies file");
                let lines = text.lines().filter(|l| !l.trim().is_empty());
                o.bodies = Arc::new(lines.map(|l| Bytes::from(l.to_owned())).collect());
            }
            "--connections" => o.connections = v.parse().expect("--connections"),
            "--rate" => o.rate = v.parse().expect("--rate"),
            "--requests" => o.requests = v.parse().expect("--requests"),
            "--duration" => o.duration = Duration::from_secs_f64(v.parse().expect("--duration")),
            "--warmup" => o.warmup = v.parse().expect("--warmup"),
            "--tick" => {
                let ms: f64 = v.parse().expect("--tick");
                o.tick = (ms > 0.0).then(|| Duration::from_secs_f64(ms / 1000.0));
            }
            "--expect" => o.expect = Some(v),
            "--threads" => o.threads = v.parse().expect("--threads"),
            other => panic!("unknown option {other}; see the example's doc comment"),
        }
        i += 2;
    }
    assert!(
        o.tcp.is_some() != o.unix.is_some(),
        "give one of --tcp or --unix"
    );
    assert!(
        o.tick.is_none() || (o.stream && o.rate > 0.0),
        "--tick paces --stream writers at a --rate"
    );
    o
}

async fn connect<B>(o: &Opts) -> hyper::client::conn::http1::SendRequest<B>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    async fn handshake<I, B>(io: I) -> hyper::client::conn::http1::SendRequest<B>
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let (s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .unwrap();
        tokio::spawn(conn);
        s
    }
    if let Some(p) = &o.unix {
        return handshake(tokio::net::UnixStream::connect(p).await.unwrap()).await;
    }
    let tcp = tokio::net::TcpStream::connect(o.tcp.as_deref().unwrap())
        .await
        .unwrap();
    tcp.set_nodelay(true).unwrap();
    match &o.tls_ca {
        None => handshake(tcp).await,
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca).unwrap() {
                roots.add(c.unwrap()).unwrap();
            }
            let config = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
            let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
                .connect(ServerName::try_from("localhost").unwrap(), tcp)
                .await
                .unwrap();
            handshake(tls).await
        }
    }
}

/// Sends one request (the `seq`th, which picks its body from `--bodies`); true if it
/// succeeded as expected.
async fn one(s: &mut Sender, o: &Opts, seq: u64) -> bool {
    let body = match o.bodies.len() {
        0 => o.body.clone(),
        n => o.bodies[(seq % n as u64) as usize].clone(),
    };
    let req = if o.get {
        hyper::Request::get(o.path.as_str())
            .header("host", "localhost")
            .body(Full::new(Bytes::new()))
            .unwrap()
    } else {
        hyper::Request::post(o.path.as_str())
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(Full::new(body))
            .unwrap()
    };
    if s.ready().await.is_err() {
        return false;
    }
    let Ok(resp) = s.send_request(req).await else {
        return false;
    };
    let ok = resp.status().is_success();
    let Ok(body) = resp.into_body().collect().await else {
        return false;
    };
    ok && o.expect.as_ref().is_none_or(|e| {
        let b = body.to_bytes();
        std::str::from_utf8(&b).is_ok_and(|t| t.contains(e.as_str()))
    })
}

/// Sleeps until an instant with microsecond resolution: a one-shot timerfd, awaited
/// through tokio's reactor.
struct Pacer {
    fd: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
}

impl Pacer {
    fn new() -> Self {
        use rustix::time::{TimerfdClockId, TimerfdFlags, timerfd_create};
        let fd = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )
        .expect("timerfd_create");
        // `AsyncFd::new` is deprecated for wrapping a descriptor the wrapper may not own;
        // this one is an `OwnedFd` created just above and owned by the wrapper alone,
        // and the replacement (`register`) is `unsafe`, which this crate forbids.
        #[allow(deprecated)]
        let fd = tokio::io::unix::AsyncFd::new(fd).expect("timerfd in the reactor");
        Self { fd }
    }

    async fn sleep_until(&self, at: Instant) {
        use rustix::time::{Itimerspec, TimerfdTimerFlags, Timespec, timerfd_settime};
        let Some(wait) = at
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
        else {
            return;
        };
        let spec = Itimerspec {
            it_interval: Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: Timespec {
                tv_sec: wait.as_secs() as i64,
                tv_nsec: i64::from(wait.subsec_nanos()),
            },
        };
        timerfd_settime(&self.fd, TimerfdTimerFlags::empty(), &spec).expect("timerfd_settime");
        loop {
            let mut guard = self.fd.readable().await.expect("timerfd readable");
            let mut expirations = [0u8; 8];
            match guard.try_io(|fd| Ok(rustix::io::read(fd.get_ref(), &mut expirations)?)) {
                Ok(Ok(_)) => return,
                Ok(Err(e)) => panic!("timerfd read: {e}"),
                Err(_would_block) => continue,
            }
        }
    }
}

fn main() {
    let o = opts();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(o.threads)
        .enable_all()
        .build()
        .unwrap();
    if o.stream {
        rt.block_on(run_stream(o));
    } else {
        rt.block_on(run(o));
    }
}

async fn run(o: Opts) {
    let errors = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    // Warm up and connect first, so the measurement sees steady state.
    let mut senders = Vec::new();
    let mut warmed = 0u64;
    for _ in 0..o.connections {
        let mut s: Sender = connect(&o).await;
        for _ in 0..o.warmup {
            one(&mut s, &o, warmed).await;
            warmed += 1;
        }
        senders.push(s);
    }
    let start = Instant::now();
    let deadline = start + o.duration;
    let per_conn_interval =
        (o.rate > 0.0).then(|| Duration::from_secs_f64(o.connections as f64 / o.rate));
    let mut tasks = tokio::task::JoinSet::new();
    for (i, mut s) in senders.into_iter().enumerate() {
        let o = o.clone();
        let errors = Arc::clone(&errors);
        let sent = Arc::clone(&sent);
        tasks.spawn(async move {
            let mut lat = Vec::with_capacity(1 << 16);
            let offset = per_conn_interval.map(|iv| iv.mul_f64(i as f64 / o.connections as f64));
            let pacer = per_conn_interval.map(|_| Pacer::new());
            let mut n: u32 = 0;
            loop {
                let now = Instant::now();
                let seq = sent.fetch_add(1, Ordering::Relaxed);
                if now >= deadline || seq >= o.requests {
                    break;
                }
                let t0 = match (per_conn_interval, offset) {
                    (Some(iv), Some(off)) => {
                        let at = start + off + iv * n;
                        n += 1;
                        pacer.as_ref().expect("pacer").sleep_until(at).await;
                        at
                    }
                    _ => now,
                };
                if !one(&mut s, &o, warmed + seq).await {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
                lat.push(t0.elapsed().as_micros() as u32);
            }
            lat
        });
    }
    let mut lat: Vec<u32> = Vec::new();
    while let Some(r) = tasks.join_next().await {
        lat.extend(r.unwrap());
    }
    report(
        lat,
        errors.load(Ordering::Relaxed),
        start.elapsed().as_secs_f64(),
    );
}

/// Prints the one line every mode ends with.
fn report(mut lat: Vec<u32>, errors: u64, elapsed: f64) {
    lat.sort_unstable();
    let pct = |p: f64| -> f64 {
        if lat.is_empty() {
            return 0.0;
        }
        let i = ((lat.len() as f64 * p).ceil() as usize).clamp(1, lat.len()) - 1;
        f64::from(lat[i]) / 1000.0
    };
    println!(
        "requests={} errors={} seconds={:.2} throughput={:.0}/s p50={:.3}ms p90={:.3}ms p99={:.3}ms p99.9={:.3}ms max={:.3}ms",
        lat.len(),
        errors,
        elapsed,
        lat.len() as f64 / elapsed,
        pct(0.50),
        pct(0.90),
        pct(0.99),
        pct(0.999),
        pct(1.0)
    );
}

/// One open stream: the sender of its lines, its acknowledgements, and how many lines
/// it has sent.
struct Stream {
    lines: tokio::sync::mpsc::Sender<Bytes>,
    acks: hyper::body::Incoming,
    buf: Vec<u8>,
    sent: u64,
    through: u64,
}

impl Stream {
    async fn open(o: &Opts) -> Self {
        let mut s: StreamSender = connect(o).await;
        let (lines, rx) = tokio::sync::mpsc::channel(1024);
        let req = hyper::Request::post(o.path.as_str())
            .header("host", "localhost")
            .header("content-type", "application/x-ndjson")
            .body(Lines(rx))
            .unwrap();
        s.ready().await.unwrap();
        let response = tokio::spawn(s.send_request(req));
        // The response head comes once the server has the request: send a first line
        // so that it does not wait for one.
        let first = line_of(o, 0);
        lines.send(first).await.unwrap();
        let response = response.await.unwrap().unwrap();
        assert!(
            response.status().is_success(),
            "the stream was refused: {}",
            response.status()
        );
        Self {
            lines,
            acks: response.into_body(),
            buf: Vec::new(),
            sent: 1,
            through: 0,
        }
    }

    async fn send(&mut self, o: &Opts, seq: u64) {
        self.lines.send(line_of(o, seq)).await.unwrap();
        self.sent += 1;
    }

    /// The next acknowledgement line, or None when the response has ended.
    async fn ack(&mut self) -> Option<serde_json::Value> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Some(serde_json::from_slice(&line).expect("an NDJSON acknowledgement"));
            }
            let frame = self.acks.frame().await?.ok()?;
            if let Ok(data) = frame.into_data() {
                self.buf.extend_from_slice(&data);
            }
        }
    }
}

/// The `seq`th body as an NDJSON line.
fn line_of(o: &Opts, seq: u64) -> Bytes {
    let body = match o.bodies.len() {
        0 => &o.body,
        n => &o.bodies[(seq % n as u64) as usize],
    };
    let mut line = Vec::with_capacity(body.len() + 1);
    line.extend_from_slice(body);
    line.push(b'\n');
    Bytes::from(line)
}

async fn run_stream(o: Opts) {
    let errors = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let mut streams = Vec::new();
    let mut warmed = 0u64;
    for _ in 0..o.connections {
        let mut s = Stream::open(&o).await;
        warmed += 1;
        for _ in 1..o.warmup.max(1) {
            s.send(&o, warmed).await;
            warmed += 1;
        }
        while s.through < s.sent {
            let ack = s.ack().await.expect("the warm-up was acknowledged");
            if let Some(n) = ack.get("through").and_then(serde_json::Value::as_u64) {
                s.through = n;
            } else {
                panic!("warm-up line refused: {ack}");
            }
        }
        streams.push(s);
    }
    let start = Instant::now();
    let deadline = start + o.duration;
    let interval = (o.rate > 0.0).then(|| Duration::from_secs_f64(o.connections as f64 / o.rate));
    let mut tasks = tokio::task::JoinSet::new();
    for (i, mut s) in streams.into_iter().enumerate() {
        let o = o.clone();
        let errors = Arc::clone(&errors);
        let sent = Arc::clone(&sent);
        tasks.spawn(async move {
            let mut lat = Vec::with_capacity(1 << 16);
            // Lines sent and not yet acknowledged: (line number, scheduled time).
            let mut waiting: std::collections::VecDeque<(u64, Instant)> = Default::default();
            let offset = interval.map(|iv| iv.mul_f64(i as f64 / o.connections as f64));
            let pacer = Pacer::new();
            let mut n: u32 = 0;
            let mut sending = true;
            let schedule = |n: u32| match (interval, offset) {
                (Some(iv), Some(off)) => start + off + iv * n,
                _ => Instant::now(),
            };
            loop {
                let next = schedule(n);
                // With --tick, the first of this writer's ticks at or after the next
                // line's time (the writers' ticks are spread like their lines).
                let wake = match (o.tick, interval) {
                    (Some(tick), Some(_)) => {
                        let first = start + tick.mul_f64(i as f64 / o.connections as f64);
                        let ticks = next.saturating_duration_since(first).as_secs_f64()
                            / tick.as_secs_f64();
                        first + tick.mul_f64(ticks.ceil())
                    }
                    _ => next,
                };
                tokio::select! {
                    _ = pacer.sleep_until(wake), if sending && waiting.len() < 1000 => {
                        // The lines due by now (one without --tick), in one write.
                        let now = Instant::now();
                        let mut batch = Vec::new();
                        loop {
                            let at = schedule(n);
                            if !batch.is_empty() && (o.tick.is_none() || at > now || waiting.len() >= 1000) {
                                break;
                            }
                            let seq = sent.fetch_add(1, Ordering::Relaxed);
                            if now >= deadline || seq >= o.requests {
                                sending = false;
                                break;
                            }
                            n += 1;
                            batch.extend_from_slice(&line_of(&o, warmed + seq));
                            s.sent += 1;
                            waiting.push_back((s.sent, at));
                        }
                        if !batch.is_empty() {
                            s.lines.send(Bytes::from(batch)).await.unwrap();
                        }
                        if !sending {
                            drop(std::mem::replace(&mut s.lines, tokio::sync::mpsc::channel(1).0));
                        }
                    }
                    ack = s.ack() => {
                        let Some(ack) = ack else { break };
                        if let Some(through) = ack.get("through").and_then(serde_json::Value::as_u64) {
                            while waiting.front().is_some_and(|w| w.0 <= through) {
                                let (_, at) = waiting.pop_front().unwrap();
                                lat.push(at.elapsed().as_micros() as u32);
                            }
                        } else if ack.get("line").is_some() {
                            errors.fetch_add(1, Ordering::Relaxed);
                        } else if ack.get("done").is_some() {
                            if ack["done"] != true {
                                errors.fetch_add(1, Ordering::Relaxed);
                                eprintln!("the server ended a stream: {ack}");
                            }
                            break;
                        }
                    }
                }
            }
            errors.fetch_add(waiting.len() as u64, Ordering::Relaxed);
            lat
        });
    }
    let mut lat: Vec<u32> = Vec::new();
    while let Some(r) = tasks.join_next().await {
        lat.extend(r.unwrap());
    }
    report(
        lat,
        errors.load(Ordering::Relaxed),
        start.elapsed().as_secs_f64(),
    );
}

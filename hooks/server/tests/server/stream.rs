//! `POST /v1/entities/stream`: lines applied in groups and acknowledged while the body is
//! still open, refused lines named and skipped, and every way the server ends a stream
//! (a line too long, idleness, the stream limit, a withdrawn permission, shutdown).

use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Bytes, Frame};
use hyper_util::rt::TokioIo;
use probity_server::{AppState, Caller, Config, Server, app};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tower::ServiceExt;

use crate::{call, root, state, state_with};

/// A request body fed line by line from the test.
struct Lines(mpsc::Receiver<Bytes>);

impl hyper::body::Body for Lines {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

/// Reads the response's NDJSON one line at a time.
struct Acks<B> {
    body: B,
    buf: Vec<u8>,
}

impl<B> Acks<B>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    async fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Some(serde_json::from_slice(&line).unwrap());
            }
            let frame = tokio::time::timeout(Duration::from_secs(10), self.body.frame())
                .await
                .expect("an acknowledgement within 10 s")?
                .unwrap();
            if let Ok(data) = frame.into_data() {
                self.buf.extend_from_slice(&data);
            }
        }
    }

    async fn rest(mut self) -> Vec<Value> {
        let mut out = Vec::new();
        while let Some(v) = self.next().await {
            out.push(v);
        }
        out
    }
}

fn zone(id: &str) -> Value {
    json!([{"uid": {"type": "Zone", "id": id}, "parents": [],
            "attrs": {"cluster": {"__entity": {"type": "Cluster", "id": "onprem"}},
                      "powerDrawW": 1, "powerCeilingW": 100}}])
}

fn line(v: &Value) -> Bytes {
    let mut b = serde_json::to_vec(v).unwrap();
    b.push(b'\n');
    Bytes::from(b)
}

/// Opens a stream in process as `caller`: the sender of its body, and its status and
/// acknowledgements.
async fn open(
    s: &AppState,
    caller: &str,
) -> (mpsc::Sender<Bytes>, StatusCode, Acks<axum::body::Body>) {
    let (tx, rx) = mpsc::channel(16);
    let mut req = Request::builder()
        .method(Method::POST)
        .uri("/v1/entities/stream")
        .header("content-type", "application/x-ndjson")
        .body(Body::new(Lines(rx)))
        .unwrap();
    req.extensions_mut().insert(Caller(caller.to_owned()));
    let response = app(s.clone()).oneshot(req).await.unwrap();
    let status = response.status();
    (
        tx,
        status,
        Acks {
            body: response.into_body(),
            buf: Vec::new(),
        },
    )
}

async fn stored(s: &AppState, zone: &str) -> bool {
    let (status, _) = call(
        s,
        Method::GET,
        &format!("/v1/entities/Zone/{zone}"),
        None,
        None,
    )
    .await;
    status == StatusCode::OK
}

#[tokio::test]
async fn each_line_is_acknowledged_while_the_stream_is_open_and_refused_lines_are_named() {
    let s = state();
    let (tx, status, mut acks) = open(&s, "uid:0").await;
    assert_eq!(status, StatusCode::OK);
    // Full duplex: line 1 is applied and acknowledged before line 2 is sent.
    tx.send(line(&zone("stream-1"))).await.unwrap();
    assert_eq!(
        acks.next().await.unwrap(),
        json!({"through": 1, "upserted": 1})
    );
    assert!(stored(&s, "stream-1").await);
    // Then a burst, in one frame: a line that is not JSON, one that is not an array, an
    // entity that does not fit the schema, a blank keep-alive, and a good one.
    let bad_entity = json!([{"uid": {"type": "Zone", "id": "stream-4"},
                             "attrs": {"powerDrawW": "lots"}, "parents": []}]);
    let mut burst = b"[{\"uid\": \n{\"uid\": 1}\n".to_vec();
    burst.extend_from_slice(&line(&bad_entity));
    burst.extend_from_slice(b"   \n");
    burst.extend_from_slice(&line(&zone("stream-6")));
    tx.send(Bytes::from(burst)).await.unwrap();
    drop(tx);
    let rest = acks.rest().await;
    let refusals: Vec<&Value> = rest.iter().filter(|v| v.get("line").is_some()).collect();
    assert_eq!(refusals.len(), 3, "{rest:?}");
    assert_eq!(refusals[0]["line"], 2);
    assert!(
        refusals[0]["error"]
            .as_str()
            .unwrap()
            .starts_with("not valid JSON at column"),
        "{rest:?}"
    );
    assert_eq!(
        refusals[1],
        &json!({"line": 3, "error": "expected an array of entities, found an object"})
    );
    assert_eq!(refusals[2]["line"], 4);
    assert!(
        refusals[2]["error"]
            .as_str()
            .unwrap()
            .starts_with("entities[0] (Zone::\"stream-4\"): "),
        "{rest:?}"
    );
    assert_eq!(
        rest.last().unwrap(),
        &json!({"done": true, "lines": 6, "upserted": 2, "refused": 3})
    );
    assert!(stored(&s, "stream-6").await);
    assert!(!stored(&s, "stream-4").await);
}

#[tokio::test]
async fn lines_that_arrive_together_are_acknowledged_together_in_bounded_groups() {
    let s = state();
    let (tx, _, acks) = open(&s, "uid:0").await;
    let mut burst = Vec::new();
    for i in 0..300 {
        burst.extend_from_slice(&line(&zone(&format!("group-{i}"))));
    }
    // The last line has no newline: the end of the body finishes it.
    burst.extend_from_slice(&line(&zone("group-300"))[..]);
    burst.pop();
    tx.send(Bytes::from(burst)).await.unwrap();
    drop(tx);
    // 301 lines in one frame: a group of 256 (the most), then the 44 other whole lines;
    // the last one waits for the end of the body, which finishes it. Acknowledgements
    // are sent at most every 10 ms, so the groups' may share one.
    let rest = acks.rest().await;
    let (last, throughs) = rest.split_last().unwrap();
    assert_eq!(
        last,
        &json!({"done": true, "lines": 301, "upserted": 301, "refused": 0})
    );
    assert_eq!(
        throughs.last().unwrap(),
        &json!({"through": 301, "upserted": 301})
    );
    for t in throughs {
        assert!(
            [256, 300, 301].contains(&t["through"].as_u64().unwrap()),
            "a group's bound was not kept: {rest:?}"
        );
    }
    assert!(stored(&s, "group-0").await);
    assert!(stored(&s, "group-300").await);
}

#[tokio::test]
async fn a_body_that_breaks_off_ends_the_stream_after_the_lines_it_brought() {
    let s = state();
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    let mut req = Request::builder()
        .method(Method::POST)
        .uri("/v1/entities/stream")
        .body(Body::new(Failing(rx)))
        .unwrap();
    req.extensions_mut().insert(Caller("uid:0".to_owned()));
    let response = app(s.clone()).oneshot(req).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut acks = Acks {
        body: response.into_body(),
        buf: Vec::new(),
    };
    tx.send(Ok(line(&zone("before-break")))).await.unwrap();
    assert_eq!(
        acks.next().await.unwrap(),
        json!({"through": 1, "upserted": 1})
    );
    // Half a line, then the connection breaks: the half is not applied.
    tx.send(Ok(Bytes::from_static(
        b"[{\"uid\": {\"type\": \"Zone\", \"id\": \"half\"}",
    )))
    .await
    .unwrap();
    tx.send(Err(std::io::Error::other("connection reset")))
        .await
        .unwrap();
    assert_eq!(
        acks.rest().await,
        vec![
            json!({"done": false, "lines": 1, "upserted": 1, "refused": 0,
                    "error": "the request body could not be read"})
        ]
    );
    assert!(stored(&s, "before-break").await);
    assert!(!stored(&s, "half").await);
}

/// A request body that can fail, as a broken connection does.
struct Failing(mpsc::Receiver<Result<Bytes, std::io::Error>>);

impl hyper::body::Body for Failing {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| b.map(Frame::data)))
    }
}

#[tokio::test]
async fn a_caller_who_may_not_upsert_is_refused_before_the_stream_opens() {
    let s = state();
    let (_tx, status, acks) = open(&s, "uid:1000").await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let body = acks.body.collect().await.unwrap().to_bytes();
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["code"], 403);
}

#[tokio::test]
async fn a_line_over_the_body_limit_ends_the_stream_after_the_lines_before_it() {
    let mut config = Config::default();
    config.server.max_body_bytes = 400;
    let s = state_with(config);
    let (tx, _, acks) = open(&s, "uid:0").await;
    let mut burst = line(&zone("before-long")).to_vec();
    burst.extend_from_slice(format!("[\"{}\"]\n", "x".repeat(500)).as_bytes());
    burst.extend_from_slice(&line(&zone("after-long")));
    tx.send(Bytes::from(burst)).await.unwrap();
    let rest = acks.rest().await;
    assert_eq!(
        rest,
        vec![
            json!({"through": 1, "upserted": 1}),
            json!({"done": false, "lines": 1, "upserted": 1, "refused": 0,
                   "error": "line 2: over the limit of 400 bytes ([server] max_body_bytes)"}),
        ]
    );
    assert!(stored(&s, "before-long").await);
    assert!(!stored(&s, "after-long").await);
}

#[tokio::test]
async fn an_unfinished_line_that_outgrows_the_limit_ends_the_stream() {
    let mut config = Config::default();
    config.server.max_body_bytes = 400;
    let s = state_with(config);
    let (tx, _, acks) = open(&s, "uid:0").await;
    // No newline ever comes: the server does not buffer it without bound, whether it
    // comes in small frames or in one.
    for _ in 0..5 {
        if tx.send(Bytes::from(vec![b' '; 100])).await.is_err() {
            break;
        }
    }
    let rest = acks.rest().await;
    assert_eq!(
        rest.last().unwrap()["error"],
        "line 1: over the limit of 400 bytes ([server] max_body_bytes)"
    );
    let (tx, _, acks) = open(&s, "uid:0").await;
    tx.send(line(&zone("short"))).await.unwrap();
    tx.send(Bytes::from(vec![b' '; 100_000])).await.unwrap();
    let rest = acks.rest().await;
    assert_eq!(
        rest.last().unwrap()["error"],
        "line 2: over the limit of 400 bytes ([server] max_body_bytes)"
    );
}

#[tokio::test]
async fn an_idle_stream_is_ended_and_a_second_one_over_the_limit_is_refused() {
    let mut config = Config::default();
    config.server.fact_stream_idle_ms = 300;
    config.server.max_fact_streams = 1;
    let s = state_with(config);
    let (tx, status, acks) = open(&s, "uid:0").await;
    assert_eq!(status, StatusCode::OK);
    let (_tx2, status2, second) = open(&s, "uid:0").await;
    assert_eq!(status2, StatusCode::TOO_MANY_REQUESTS);
    let body = second.body.collect().await.unwrap().to_bytes();
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap()["error"],
        "1 fact streams are open, the limit ([server] max_fact_streams)"
    );
    // The first sends nothing: it is ended, and its permit is given back.
    let rest = acks.rest().await;
    assert_eq!(
        rest,
        vec![
            json!({"done": false, "lines": 0, "upserted": 0, "refused": 0,
                    "error": "no byte for 300 ms ([server] fact_stream_idle_ms)"})
        ]
    );
    drop(tx);
    let mut reopened = None;
    for _ in 0..50 {
        let (tx3, status3, acks3) = open(&s, "uid:0").await;
        if status3 == StatusCode::OK {
            reopened = Some((tx3, acks3));
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (tx3, mut acks3) = reopened.expect("the permit came back");
    tx3.send(line(&zone("reopened"))).await.unwrap();
    assert_eq!(
        acks3.next().await.unwrap(),
        json!({"through": 1, "upserted": 1})
    );
}

#[tokio::test]
async fn one_caller_cannot_take_every_stream_and_another_still_opens_one() {
    let mut config = Config::default();
    config.server.max_fact_streams = 4;
    config.server.max_fact_streams_per_caller = 2;
    config
        .auth
        .groups
        .insert("entity-writers".into(), vec!["cn:relay".into()]);
    let s = state_with(config);
    let (_a1, first, _) = open(&s, "uid:0").await;
    let (_a2, second, _) = open(&s, "uid:0").await;
    assert_eq!((first, second), (StatusCode::OK, StatusCode::OK));
    let (_a3, third, refused) = open(&s, "uid:0").await;
    assert_eq!(third, StatusCode::TOO_MANY_REQUESTS);
    let body = refused.body.collect().await.unwrap().to_bytes();
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap()["error"],
        "uid:0 has 2 fact streams open, the limit for one caller \
         ([server] max_fact_streams_per_caller)"
    );
    // Another writer is not held back by the first one's streams, and writes.
    let (tx, status, mut acks) = open(&s, "cn:relay").await;
    assert_eq!(status, StatusCode::OK);
    tx.send(line(&zone("beside-a-greedy-writer")))
        .await
        .unwrap();
    assert_eq!(
        acks.next().await.unwrap(),
        json!({"through": 1, "upserted": 1})
    );
    assert!(stored(&s, "beside-a-greedy-writer").await);
    let (_, metrics) = call(&s, Method::GET, "/metrics", None, None).await;
    let metrics = metrics.as_str().unwrap();
    assert!(
        metrics.contains("probity_fact_streams_open 3\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("probity_fact_streams_refused_total 1\n"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_stream_whose_permission_is_withdrawn_ends_at_its_next_group() {
    let mut config = Config::default();
    config
        .auth
        .groups
        .insert("entity-writers".into(), vec!["cn:relay".into()]);
    let s = state_with(config);
    let (tx, status, mut acks) = open(&s, "cn:relay").await;
    assert_eq!(status, StatusCode::OK);
    tx.send(line(&zone("while-allowed"))).await.unwrap();
    assert_eq!(
        acks.next().await.unwrap(),
        json!({"through": 1, "upserted": 1})
    );
    // The relay's membership is withdrawn: the engine's API entities change.
    s.engine()
        .replace_owned_entities(
            probity::EntityOwner::Api,
            &Config::default().auth.api_entities(),
        )
        .unwrap();
    tx.send(line(&zone("after-withdrawal"))).await.unwrap();
    let rest = acks.rest().await;
    assert_eq!(
        rest,
        vec![
            json!({"done": false, "lines": 1, "upserted": 1, "refused": 0,
                    "error": "the caller may no longer upsert entities"})
        ]
    );
    assert!(!stored(&s, "after-withdrawal").await);
}

#[tokio::test]
async fn over_a_unix_socket_acks_stream_back_and_shutdown_ends_an_open_stream() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("probity.sock");
    let mut config = Config::default();
    config.server.socket = path.clone();
    config.policies.entities = Some(root().join("testdata/entities/cluster.json"));
    let uid = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(tmp.path()).unwrap().uid()
    };
    config
        .auth
        .groups
        .insert("admins".into(), vec![format!("uid:{uid}")]);
    let server = Server::bind(config).await.unwrap();
    let state = server.state();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        server
            .run(async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    let io = tokio::net::UnixStream::connect(&path).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .unwrap();
    tokio::spawn(conn);
    let (tx, rx) = mpsc::channel(16);
    let req = Request::builder()
        .method(Method::POST)
        .uri("/v1/entities/stream")
        .header("host", "localhost")
        .body(Lines(rx))
        .unwrap();
    sender.ready().await.unwrap();
    let pending = tokio::spawn(sender.send_request(req));
    tx.send(line(&zone("socket-1"))).await.unwrap();
    let response = pending.await.unwrap().unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut acks = Acks {
        body: response.into_body(),
        buf: Vec::new(),
    };
    assert_eq!(
        acks.next().await.unwrap(),
        json!({"through": 1, "upserted": 1})
    );
    for j in 2..=3u64 {
        tx.send(line(&zone(&format!("socket-{j}")))).await.unwrap();
        assert_eq!(
            acks.next().await.unwrap(),
            json!({"through": j, "upserted": j})
        );
    }
    // Shutdown while the stream is open: it is ended, not waited for.
    stop.send(()).unwrap();
    assert_eq!(
        acks.next().await.unwrap(),
        json!({"done": false, "lines": 3, "upserted": 3, "refused": 0,
               "error": "the server is shutting down"})
    );
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the server stopped without waiting out its grace period")
        .unwrap();
    let uid = probity::EntityUid::new("Zone", "socket-3").unwrap();
    assert!(state.engine().entity(&uid).is_some());
    drop(tx);
}

#[tokio::test]
async fn a_client_that_reads_no_acknowledgement_loses_its_stream_and_its_permit() {
    let mut config = Config::default();
    config.server.fact_stream_idle_ms = 300;
    config.server.max_fact_streams = 1;
    let s = state_with(config);
    let (tx, status, _unread) = open(&s, "uid:0").await;
    assert_eq!(status, StatusCode::OK);
    // One line at a time, more than 10 ms apart, so that most get an acknowledgement of
    // their own: more than the server queues for an unread client. Bounded in time, not
    // in lines, so a slow machine that merges acknowledgements only takes longer.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut stopped = false;
    let mut i = 0;
    while std::time::Instant::now() < deadline {
        let sending = tx.send(line(&zone(&format!("unread-{i}"))));
        if !matches!(
            tokio::time::timeout(Duration::from_secs(2), sending).await,
            Ok(Ok(()))
        ) {
            stopped = true; // the server stopped reading, or dropped the body
            break;
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(12)).await;
    }
    assert!(
        stopped,
        "the server kept reading for a client that reads nothing"
    );
    // Its permit is back: a new stream opens.
    let mut opened = false;
    for _ in 0..100 {
        let (_tx2, status2, _acks2) = open(&s, "uid:0").await;
        if status2 == StatusCode::OK {
            opened = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(opened, "the unread stream kept its permit");
}

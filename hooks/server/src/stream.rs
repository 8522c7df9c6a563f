//! `POST /v1/entities/stream`: a long-lived stream of fact updates on one request.
//!
//! A writer that pushes facts at a steady rate (a relay for many node agents, a
//! collector) pays for an HTTP request, its routing and its authorization once, not per
//! update. The request body is NDJSON: each line is what `POST /v1/entities` takes (an
//! array of Cedar entity JSON), applied all or nothing. The lines that have arrived
//! when the server reads are applied together, in one snapshot change (a group commit),
//! so a writer the server falls behind costs less per line, not more.
//!
//! The response, streamed while the body is still being read, is NDJSON too:
//! * `{"line": N, "error": "..."}`: line N (1-based) was refused and nothing of it applied;
//!   the stream goes on.
//! * `{"through": N, "upserted": U}`: every line up to N has been handled (applied, or
//!   refused above), and U entities have been upserted since the stream began.
//! * last, `{"done": true, "lines": N, "upserted": U, "refused": R}` when the body ended,
//!   or `{"done": false, "error": "...", ...}` when the server ended the stream: a line
//!   over `max_body_bytes`, no byte for `fact_stream_idle_ms` (or no acknowledgement
//!   read for as long), the caller's permission withdrawn, the body unreadable, or
//!   shutdown. Lines after the last `through` were
//!   not applied.
//!
//! The caller is authorized (`manage` on `Api::"entities"`, as for `POST /v1/entities`)
//! before the stream starts and again before each group, so a policy change that
//! withdraws the permission ends the stream at its next group. At most
//! `max_fact_streams` streams are open at once; one more is refused with 429.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{Extensions, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use crate::AppState;
use crate::api::{authorize, caller};
use crate::caller::Caller;
use crate::error::ApiError;

/// Most lines applied in one group: a writer far ahead is taken in bounded steps, so
/// acknowledgements keep coming and one group's retry (line by line, when a line is
/// refused) stays short.
const MAX_GROUP_LINES: usize = 256;

/// Acknowledgement lines waiting for the client to read them; when full, the server
/// stops reading the body (the writer is slowed by TCP, nothing is dropped).
const ACK_QUEUE: usize = 64;

/// Groups of at most this many lines are applied on the async worker that read them.
const INLINE_LINES: usize = 32;

/// How often an idle stream checks for shutdown.
const IDLE_TICK: Duration = Duration::from_millis(250);

/// Opens a stream of fact updates (see the module's documentation).
pub(crate) async fn upsert_stream(
    State(state): State<AppState>,
    ext: Extensions,
    body: Body,
) -> Result<Response, ApiError> {
    let caller = caller(&ext);
    authorize(&state, &caller, "entities", "upsert", None).await?;
    let permit = state.fact_streams().try_acquire_owned().map_err(|_| {
        ApiError::TooManyRequests(format!(
            "{} fact streams are open, the limit ([server] max_fact_streams)",
            state.config().server.max_fact_streams
        ))
    })?;
    let (acks, rx) = mpsc::channel(ACK_QUEUE);
    tokio::spawn(run(state, caller, body, acks, permit));
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::new(Acks(rx)),
    )
        .into_response())
}

/// The response body: acknowledgement lines as the stream's task sends them.
struct Acks(mpsc::Receiver<Bytes>);

impl hyper::body::Body for Acks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|line| line.map(|b| Ok(hyper::body::Frame::data(b))))
    }
}

/// What a stream has done so far.
#[derive(Default)]
struct Tally {
    /// Complete lines read (handled or about to be).
    lines: u64,
    upserted: u64,
    refused: u64,
}

impl Tally {
    fn end(&self, error: Option<&str>) -> Value {
        let mut v = json!({
            "done": error.is_none(),
            "lines": self.lines,
            "upserted": self.upserted,
            "refused": self.refused,
        });
        if let (Some(e), Some(map)) = (error, v.as_object_mut()) {
            map.insert("error".into(), Value::String(e.to_owned()));
        }
        v
    }
}

/// Reads the body, applies each group of lines and acknowledges it, until the body
/// ends or the stream must stop. Returns when the client has gone (its acknowledgements
/// cannot be sent) or the stream has ended.
async fn run(
    state: AppState,
    caller: Caller,
    mut body: Body,
    acks: mpsc::Sender<Bytes>,
    _permit: OwnedSemaphorePermit,
) {
    let max_line = state.config().server.max_body_bytes;
    let idle = Duration::from_millis(state.config().server.fact_stream_idle_ms);
    let mut tally = Tally::default();
    let mut pending: Vec<u8> = Vec::new();
    let mut last_byte = Instant::now();
    let outcome: Result<(), String> = 'stream: loop {
        if !state.is_ready() {
            break Err("the server is shutting down".into());
        }
        // Wait for bytes (checking for shutdown and idleness meanwhile), then take
        // whatever else has already arrived, so a writer ahead of the server is applied
        // in one group.
        let mut ended = false;
        match tokio::time::timeout(IDLE_TICK, body.frame()).await {
            Err(_) => {
                if last_byte.elapsed() >= idle {
                    break Err(format!(
                        "no byte for {} ms ([server] fact_stream_idle_ms)",
                        idle.as_millis()
                    ));
                }
                continue;
            }
            Ok(None) => ended = true,
            Ok(Some(Err(_))) => break Err("the request body could not be read".into()),
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    pending.extend_from_slice(&data);
                }
                last_byte = Instant::now();
            }
        }
        while !ended && complete_lines(&pending) < MAX_GROUP_LINES {
            // Only frames already here: a pending poll is dropped, which loses nothing.
            match futures_now(body.frame()) {
                Some(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        pending.extend_from_slice(&data);
                    }
                }
                Some(Some(Err(_))) => {
                    break 'stream Err("the request body could not be read".into());
                }
                Some(None) => ended = true,
                None => break,
            }
        }
        // Whole lines are applied in groups of at most MAX_GROUP_LINES; an unfinished
        // line waits for the rest of its bytes (or, at the end, is the last line).
        loop {
            let (lines, consumed) = split_lines(&pending, MAX_GROUP_LINES, ended);
            if let Some(first_long) = lines.iter().position(|l| l.len() > max_line) {
                // Handle the lines before it, then stop: the stream cannot resynchronize.
                let before = lines.get(..first_long).unwrap_or_default();
                if let Err(e) = apply_group(&state, &caller, before, &mut tally, &acks).await {
                    break 'stream Err(e);
                }
                break 'stream Err(format!(
                    "line {}: over the limit of {max_line} bytes ([server] max_body_bytes)",
                    tally.lines + 1
                ));
            }
            if lines.is_empty() {
                break;
            }
            let result = apply_group(&state, &caller, &lines, &mut tally, &acks).await;
            pending.drain(..consumed);
            if let Err(e) = result {
                break 'stream Err(e);
            }
        }
        if pending.len() > max_line {
            break Err(format!(
                "line {}: over the limit of {max_line} bytes ([server] max_body_bytes)",
                tally.lines + 1
            ));
        }
        if ended {
            break Ok(());
        }
    };
    let last = match &outcome {
        Ok(()) => tally.end(None),
        Err(e) => {
            tracing::warn!(caller = %caller.0, lines = tally.lines, error = %e, "fact stream ended");
            tally.end(Some(e))
        }
    };
    let _ = tokio::time::timeout(idle, acks.send(ndjson(&last))).await;
    tracing::info!(
        caller = %caller.0,
        lines = tally.lines,
        upserted = tally.upserted,
        refused = tally.refused,
        "fact stream closed"
    );
}

/// Polls a future once: its output if it is ready now.
fn futures_now<F: std::future::Future>(f: F) -> Option<F::Output> {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(out) => Some(out),
        std::task::Poll::Pending => None,
    }
}

/// How many complete lines `bytes` holds.
fn complete_lines(bytes: &[u8]) -> usize {
    bytes.iter().filter(|&&b| b == b'\n').count()
}

/// Up to `max` lines of `bytes` (without their newline), and how many bytes they span.
/// At the end of the body the unfinished rest is a line too.
fn split_lines(bytes: &[u8], max: usize, at_end: bool) -> (Vec<&[u8]>, usize) {
    let mut lines = Vec::new();
    let mut start = 0;
    while lines.len() < max {
        let rest = bytes.get(start..).unwrap_or_default();
        match rest.iter().position(|&b| b == b'\n') {
            Some(i) => {
                lines.push(rest.get(..i).unwrap_or_default());
                start += i + 1;
            }
            None => {
                if at_end && !rest.is_empty() {
                    lines.push(rest);
                    start = bytes.len();
                }
                break;
            }
        }
    }
    (lines, start)
}

/// Applies one group of lines: all in one upsert when every line is valid, else line by
/// line so that a refused line holds back no other. Sends the refusals and then the
/// group's `through`. An error ends the stream (the client has gone, or may no longer
/// write).
async fn apply_group(
    state: &AppState,
    caller: &Caller,
    lines: &[&[u8]],
    tally: &mut Tally,
    acks: &mpsc::Sender<Bytes>,
) -> Result<(), String> {
    let patience = Duration::from_millis(state.config().server.fact_stream_idle_ms);
    if lines.is_empty() {
        return Ok(());
    }
    if authorize(state, caller, "entities", "upsert", None)
        .await
        .is_err()
    {
        return Err("the caller may no longer upsert entities".into());
    }
    let first = tally.lines + 1;
    tally.lines += lines.len() as u64;
    let mut refusals: Vec<(u64, String)> = Vec::new();
    // Each valid line's entities, and where they sit in the group's one upsert.
    let mut all: Vec<Value> = Vec::new();
    let mut spans: Vec<(u64, std::ops::Range<usize>)> = Vec::new();
    for (n, line) in (first..).zip(lines) {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue; // a blank line (a keep-alive) upserts nothing
        }
        match serde_json::from_slice::<Value>(line) {
            Ok(Value::Array(items)) => {
                let at = all.len();
                all.extend(items);
                spans.push((n, at..all.len()));
            }
            Ok(other) => refusals.push((
                n,
                format!("expected an array of entities, found {}", json_kind(&other)),
            )),
            Err(e) => refusals.push((n, format!("not valid JSON at column {}", e.column()))),
        }
    }
    let engine = state.engine().clone();
    let group = Value::Array(all);
    // A short group is applied here; a long one (a writer far ahead) off the async
    // workers, as large batches of decisions are.
    let (applied, refused) = if lines.len() <= INLINE_LINES {
        upsert_lines(&engine, &group, &spans)
    } else {
        tokio::task::spawn_blocking(move || upsert_lines(&engine, &group, &spans))
            .await
            .map_err(|_| "the upsert task failed".to_owned())?
    };
    refusals.extend(refused);
    tally.upserted += applied as u64;
    tally.refused += refusals.len() as u64;
    refusals.sort_by_key(|r| r.0);
    for (line, error) in refusals {
        send(acks, &json!({"line": line, "error": error}), patience).await?;
    }
    send(
        acks,
        &json!({"through": tally.lines, "upserted": tally.upserted}),
        patience,
    )
    .await
}

/// Upserts the group in one write, or, if the engine refuses it, each line alone;
/// returns how many entities were upserted and each refused line with its reason.
fn upsert_lines(
    engine: &probity::Engine,
    group: &Value,
    spans: &[(u64, std::ops::Range<usize>)],
) -> (usize, Vec<(u64, String)>) {
    let mut refusals = Vec::new();
    let Value::Array(all) = group else {
        return (0, refusals);
    };
    if all.is_empty() {
        return (0, refusals);
    }
    if let Ok(n) = engine.upsert_entities(group) {
        return (n, refusals);
    }
    let mut applied = 0;
    for (line, range) in spans {
        let items = Value::Array(all.get(range.clone()).unwrap_or_default().to_vec());
        match engine.upsert_entities(&items) {
            Ok(n) => applied += n,
            Err(e) => refusals.push((*line, e.to_string())),
        }
    }
    (applied, refusals)
}

/// Sends one acknowledgement. A client that leaves `patience` of them unread (the queue
/// full for that long) is gone as far as the stream is concerned: it would otherwise
/// hold its permit, and the writes it stopped reading about, forever.
async fn send(acks: &mpsc::Sender<Bytes>, v: &Value, patience: Duration) -> Result<(), String> {
    match tokio::time::timeout(patience, acks.send(ndjson(v))).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err("the client went away".to_owned()),
        Err(_) => Err(format!(
            "the client read no acknowledgement for {} ms ([server] fact_stream_idle_ms)",
            patience.as_millis()
        )),
    }
}

fn ndjson(v: &Value) -> Bytes {
    let mut out = serde_json::to_vec(v).unwrap_or_default();
    out.push(b'\n');
    Bytes::from(out)
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The open streams' permits.
pub(crate) fn streams(limit: usize) -> Arc<tokio::sync::Semaphore> {
    Arc::new(tokio::sync::Semaphore::new(limit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_split_at_newlines_and_the_unfinished_rest_waits() {
        let (lines, used) = split_lines(b"[1]\n[2]\n[3", 10, false);
        assert_eq!(lines, vec![&b"[1]"[..], &b"[2]"[..]]);
        assert_eq!(used, 8);
        let (lines, used) = split_lines(b"[1]\n[2]\n[3", 10, true);
        assert_eq!(lines, vec![&b"[1]"[..], &b"[2]"[..], &b"[3"[..]]);
        assert_eq!(used, 10);
    }

    #[test]
    fn a_group_takes_at_most_its_bound_of_lines() {
        let (lines, used) = split_lines(b"a\nb\nc\n", 2, true);
        assert_eq!(lines, vec![&b"a"[..], &b"b"[..]]);
        assert_eq!(used, 4);
    }
}

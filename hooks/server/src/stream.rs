//! `POST /v1/entities/stream`: a long-lived stream of fact updates on one request.
//!
//! A writer that pushes facts at a steady rate (a relay for many node agents, a
//! collector) pays for an HTTP request, its routing and its response once, not per
//! update. The request body is NDJSON: each line is what `POST /v1/entities` takes (an
//! array of Cedar entity JSON), applied all or nothing. The lines that arrive within
//! 5 ms of a group's first bytes (at most 256 of them and `max_body_bytes` in all) are
//! applied together, in one snapshot change (a group commit): a busy writer costs a
//! read, a wake-up and a commit per group, not per line. A group whose first read
//! already brought several lines is applied at once: its writer batches them itself. A group is judged as one
//! update: the store after the whole group must be valid, as with one
//! `POST /v1/entities` of all its entities; if it is not, its lines are applied one by
//! one and only the refused ones are left out.
//!
//! The response, streamed while the body is still being read, is NDJSON too:
//! * `{"line": N, "error": "..."}`: line N (1-based) was refused and nothing of it applied;
//!   the stream goes on.
//! * `{"through": N, "upserted": U}`: every line up to N has been handled (applied,
//!   refused above, or blank), and the applied lines held U entities in all. Sent at
//!   most every 10 ms (the lines handled meanwhile share one), and at once after a
//!   refusal.
//! * last, `{"done": true, "lines": N, "upserted": U, "refused": R}` when the body ended,
//!   or `{"done": false, "error": "...", ...}` when the server ended the stream: a line
//!   over `max_body_bytes`, no byte for `fact_stream_idle_ms` (or no acknowledgement
//!   read for as long), the caller's permission withdrawn, the body unreadable, or
//!   shutdown. `lines` counts the lines handled. A line after the last acknowledged
//!   `through` may or may not have been applied (the acknowledgement may be what was
//!   lost): a writer resends its current facts for those entities, not older ones.
//!
//! The caller is authorized (`manage` on `Api::"entities"`, as for `POST /v1/entities`)
//! before the stream starts and again before each group, so a policy change that
//! withdraws the permission ends the stream at its next group. At most
//! `max_fact_streams` streams are open at once (over all callers), and at most
//! `max_fact_streams_per_caller` of one caller; one more is refused with 429.

use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{Extensions, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::AppState;
use crate::api::{authorize, caller};
use crate::caller::Caller;
use crate::error::ApiError;
use crate::limits::{ConnectionPermit, OverLimit};

/// Most lines applied in one group (a group also holds at most `max_body_bytes` of lines,
/// or one line): a writer far ahead is taken in bounded steps, so acknowledgements keep
/// coming and one group's retry (line by line, when a line is refused) stays short.
const MAX_GROUP_LINES: usize = 256;

/// Acknowledgement lines waiting for the client to read them; when full, the server
/// stops reading the body (the writer is slowed by TCP, nothing is dropped).
const ACK_QUEUE: usize = 64;

/// Groups of at most this many bytes are parsed and applied on the async worker that
/// read them; larger ones on the blocking pool.
const INLINE_BYTES: usize = 64 * 1024;

/// How often an idle stream checks for shutdown.
const IDLE_TICK: Duration = Duration::from_millis(250);

/// How long a group stays open after its first bytes: the lines a writer sends
/// meanwhile join it, and are parsed and applied with it. Reading, waking for and
/// applying each line as it comes costs more than the line's own work (and the body
/// hands over one chunk at a time, so only waiting gathers more); a fact waits about
/// this much beyond the server's own work.
const LINGER: Duration = Duration::from_millis(5);

/// Most often a stream's `through` is sent: the lines applied meanwhile share one. Each
/// acknowledgement is a write that wakes the client, which costs both sides more than
/// applying a line; a refusal is sent at once, and the `through` after it.
const ACK_EVERY: Duration = Duration::from_millis(10);

/// Opens a stream of fact updates (see the module's documentation).
pub(crate) async fn upsert_stream(
    State(state): State<AppState>,
    ext: Extensions,
    body: Body,
) -> Result<Response, ApiError> {
    let caller = caller(&ext);
    authorize(&state, &caller, "entities", "upsert", None).await?;
    let server = &state.config().server;
    let permit = state
        .fact_streams()
        .admit(&caller.0)
        .map_err(|over| match over {
            OverLimit::All => ApiError::TooManyRequests(format!(
                "{} fact streams are open, the limit ([server] max_fact_streams)",
                server.max_fact_streams
            )),
            OverLimit::PerKey => ApiError::TooManyRequests(format!(
                "{} has {} fact streams open, the limit for one caller \
                 ([server] max_fact_streams_per_caller)",
                caller.0, server.max_fact_streams_per_caller
            )),
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
    /// Lines handled: applied, refused, or blank.
    lines: u64,
    /// Entities in the applied lines.
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

/// The bytes read and not yet applied, with the count of newlines among them (kept as
/// bytes arrive, so a long line is not rescanned per frame).
#[derive(Default)]
struct Pending {
    bytes: Vec<u8>,
    newlines: usize,
}

impl Pending {
    fn push(&mut self, data: &[u8]) {
        self.newlines += data.iter().filter(|&&b| b == b'\n').count();
        self.bytes.extend_from_slice(data);
    }

    /// Takes the next group: up to [`MAX_GROUP_LINES`] whole lines and, past the first,
    /// no more than `max_bytes` in all; at the end of the body, the unfinished rest is a
    /// line too. Empty when no whole line is here.
    fn take_group(&mut self, max_bytes: usize, at_end: bool) -> Vec<u8> {
        let mut end = 0;
        let mut lines = 0;
        while lines < MAX_GROUP_LINES {
            let rest = self.bytes.get(end..).unwrap_or_default();
            let next = match rest.iter().position(|&b| b == b'\n') {
                Some(i) => end + i + 1,
                None if at_end && !rest.is_empty() => self.bytes.len(),
                None => break,
            };
            if lines > 0 && next > max_bytes {
                break;
            }
            end = next;
            lines += 1;
        }
        let group: Vec<u8> = self.bytes.drain(..end).collect();
        self.newlines -= group.iter().filter(|&&b| b == b'\n').count();
        group
    }

    /// The length of the first line, if it is longer than `max` (whole or not).
    fn first_line_over(&self, max: usize) -> bool {
        match self.bytes.iter().position(|&b| b == b'\n') {
            Some(i) => i > max,
            None => self.bytes.len() > max,
        }
    }
}

/// Reads the body, applies each group of lines and acknowledges it, until the body
/// ends or the stream must stop.
async fn run(
    state: AppState,
    caller: Caller,
    mut body: Body,
    acks: mpsc::Sender<Bytes>,
    _permit: ConnectionPermit,
) {
    let max_line = state.config().server.max_body_bytes;
    let idle = Duration::from_millis(state.config().server.fact_stream_idle_ms);
    let mut tally = Tally::default();
    let mut pending = Pending::default();
    let mut last_byte = Instant::now();
    // When the last `through` went out, and whether lines were handled since.
    let mut acked_at: Option<Instant> = None;
    let mut owed = false;
    let patience = idle;
    let over = |tally: &Tally| {
        format!(
            "line {}: over the limit of {max_line} bytes ([server] max_body_bytes)",
            tally.lines + 1
        )
    };
    let outcome: Result<(), String> = 'stream: loop {
        if !state.is_ready() {
            break Err("the server is shutting down".into());
        }
        // Wait for bytes (checking for shutdown and idleness meanwhile), then take what
        // else comes within LINGER, so that a writer's lines are applied in groups.
        let mut ended = false;
        let wait = match (owed, acked_at) {
            (true, Some(at)) => ACK_EVERY.saturating_sub(at.elapsed()),
            (true, None) => Duration::ZERO,
            (false, _) => IDLE_TICK,
        };
        match tokio::time::timeout(wait, body.frame()).await {
            Err(_) => {
                if owed {
                    if let Err(e) = send(&state, &acks, &through(&tally), patience).await {
                        break Err(e);
                    }
                    owed = false;
                    acked_at = Some(Instant::now());
                    continue;
                }
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
                    pending.push(&data);
                }
            }
        }
        // The group stays open for LINGER, or until it is full (in lines or bytes). A
        // frame that brought several lines comes from a writer that batches them itself
        // (a relay on a tick): its group closes at once, without a wake-up for the timer.
        let batched = pending.newlines > 1;
        let closes = tokio::time::Instant::now() + LINGER;
        while !ended
            && !batched
            && pending.newlines < MAX_GROUP_LINES
            && pending.bytes.len() <= max_line
        {
            match tokio::time::timeout_at(closes, body.frame()).await {
                Err(_) => break,
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        pending.push(&data);
                    }
                }
                Ok(Some(Err(_))) => {
                    break 'stream Err("the request body could not be read".into());
                }
                Ok(None) => ended = true,
            }
        }
        loop {
            if pending.first_line_over(max_line) {
                break 'stream Err(over(&tally));
            }
            let group = pending.take_group(max_line, ended);
            if group.is_empty() {
                break;
            }
            let handled = tally.lines;
            let result = apply_group(&state, &caller, group, &mut tally, &acks).await;
            // Lines applied before a failed send are still owed their `through`.
            owed = owed || tally.lines > handled;
            let refused = match result {
                Ok(refused) => refused,
                Err(e) => break 'stream Err(e),
            };
            if refused {
                // A refusal was just sent: its `through` follows it at once.
                if let Err(e) = send(&state, &acks, &through(&tally), patience).await {
                    break 'stream Err(e);
                }
                owed = false;
                acked_at = Some(Instant::now());
            }
        }
        if owed && acked_at.is_none_or(|at| at.elapsed() >= ACK_EVERY) {
            if let Err(e) = send(&state, &acks, &through(&tally), patience).await {
                break Err(e);
            }
            owed = false;
            acked_at = Some(Instant::now());
        }
        // The client's silence is what idleness measures, not the server's work.
        last_byte = Instant::now();
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
    // A client that is not reading is waited for at most IDLE_TICK more.
    let flush = async {
        if owed {
            acks.send(ndjson(&through(&tally))).await?;
        }
        acks.send(ndjson(&last)).await
    };
    let _ = tokio::time::timeout(IDLE_TICK, flush).await;
    tracing::info!(
        caller = %caller.0,
        lines = tally.lines,
        upserted = tally.upserted,
        refused = tally.refused,
        "fact stream closed"
    );
}

/// What applying a group did.
#[derive(Default)]
struct GroupOutcome {
    lines: u64,
    upserted: u64,
    refusals: Vec<(u64, String)>,
}

/// `{"through": N, "upserted": U}`.
fn through(tally: &Tally) -> Value {
    json!({"through": tally.lines, "upserted": tally.upserted})
}

/// Applies one group of lines (see [`apply_lines`]) and sends its refusals; returns
/// whether there were any (the caller then sends the `through` at once). An error ends
/// the stream: the client has gone or stopped reading, the caller may no longer write,
/// or the server is shutting down.
async fn apply_group(
    state: &AppState,
    caller: &Caller,
    group: Vec<u8>,
    tally: &mut Tally,
    acks: &mpsc::Sender<Bytes>,
) -> Result<bool, String> {
    match authorize(state, caller, "entities", "upsert", None).await {
        Ok(()) => {}
        Err(ApiError::Forbidden(_)) => {
            return Err("the caller may no longer upsert entities".into());
        }
        Err(e) => return Err(format!("the caller could not be authorized: {e}")),
    }
    let engine = state.engine().clone();
    let first = tally.lines + 1;
    let outcome = if group.len() <= INLINE_BYTES {
        apply_lines(&engine, &group, first)
    } else {
        tokio::task::spawn_blocking(move || apply_lines(&engine, &group, first))
            .await
            .map_err(|_| "the upsert task failed".to_owned())?
    };
    // Counted once applied, so the last message never claims more than was handled.
    tally.lines += outcome.lines;
    tally.upserted += outcome.upserted;
    tally.refused += outcome.refusals.len() as u64;
    let patience = Duration::from_millis(state.config().server.fact_stream_idle_ms);
    let refused = !outcome.refusals.is_empty();
    for (line, error) in outcome.refusals {
        send(
            state,
            acks,
            &json!({"line": line, "error": error}),
            patience,
        )
        .await?;
    }
    Ok(refused)
}

/// Parses the group's lines (numbered from `first`) and upserts them: all in one write
/// when every line is valid (the store after the whole group is what is checked), else
/// line by line, so that a refused line holds back no other.
fn apply_lines(engine: &probity::Engine, group: &[u8], first: u64) -> GroupOutcome {
    let mut outcome = GroupOutcome::default();
    let text = group.strip_suffix(b"\n").unwrap_or(group);
    // Each valid line's entities, and where they sit in the group's one upsert.
    let mut all: Vec<Value> = Vec::new();
    let mut spans: Vec<(u64, std::ops::Range<usize>)> = Vec::new();
    for (n, line) in (first..).zip(text.split(|&b| b == b'\n')) {
        outcome.lines += 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue; // a blank line (a keep-alive) upserts nothing
        }
        match serde_json::from_slice::<Value>(line) {
            Ok(Value::Array(items)) => {
                let at = all.len();
                all.extend(items);
                spans.push((n, at..all.len()));
            }
            Ok(other) => outcome.refusals.push((
                n,
                format!("expected an array of entities, found {}", json_kind(&other)),
            )),
            Err(e) => outcome
                .refusals
                .push((n, format!("not valid JSON at column {}", e.column()))),
        }
    }
    if all.is_empty() {
        return outcome;
    }
    let group = Value::Array(all);
    if engine.upsert_entities(&group).is_ok() {
        outcome.upserted = spans.iter().map(|(_, r)| r.len() as u64).sum();
        return outcome;
    }
    let Value::Array(all) = group else {
        return outcome;
    };
    for (line, range) in spans {
        let items = Value::Array(all.get(range.clone()).unwrap_or_default().to_vec());
        match engine.upsert_entities(&items) {
            Ok(_) => outcome.upserted += range.len() as u64,
            Err(e) => outcome.refusals.push((line, e.to_string())),
        }
    }
    outcome.refusals.sort_by_key(|r| r.0);
    outcome
}

/// Sends one acknowledgement. A client that leaves the queue full for `patience` is
/// gone as far as the stream is concerned: it would otherwise hold its permit, and the
/// writes it stopped reading about, without end. Shutdown does not wait for it.
async fn send(
    state: &AppState,
    acks: &mpsc::Sender<Bytes>,
    v: &Value,
    patience: Duration,
) -> Result<(), String> {
    let since = Instant::now();
    loop {
        match tokio::time::timeout(IDLE_TICK, acks.reserve()).await {
            Ok(Ok(slot)) => {
                slot.send(ndjson(v));
                return Ok(());
            }
            Ok(Err(_)) => return Err("the client went away".to_owned()),
            Err(_) if !state.is_ready() => return Err("the server is shutting down".into()),
            Err(_) if since.elapsed() >= patience => {
                return Err(format!(
                    "the client read no acknowledgement for {} ms ([server] fact_stream_idle_ms)",
                    patience.as_millis()
                ));
            }
            Err(_) => {}
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(bytes: &[u8]) -> Pending {
        let mut p = Pending::default();
        p.push(bytes);
        p
    }

    #[test]
    fn whole_lines_are_taken_and_the_unfinished_rest_waits_for_the_end() {
        let mut p = pending(b"[1]\n[2]\n[3");
        assert_eq!(p.take_group(100, false), b"[1]\n[2]\n");
        assert_eq!(p.newlines, 0);
        assert!(p.take_group(100, false).is_empty());
        assert_eq!(p.take_group(100, true), b"[3");
        assert!(p.bytes.is_empty());
    }

    #[test]
    fn a_group_is_bounded_in_lines_and_in_bytes_but_takes_at_least_one_line() {
        let many = "a\n".repeat(MAX_GROUP_LINES + 3);
        let mut p = pending(many.as_bytes());
        assert_eq!(p.take_group(usize::MAX, false).len(), 2 * MAX_GROUP_LINES);
        assert_eq!(p.newlines, 3);
        let mut p = pending(b"aaaa\nbbbb\ncc\n");
        assert_eq!(p.take_group(6, false), b"aaaa\n");
        assert_eq!(p.take_group(3, false), b"bbbb\n");
        assert_eq!(p.take_group(3, false), b"cc\n");
    }

    #[test]
    fn a_first_line_over_the_limit_is_seen_whole_or_unfinished() {
        assert!(pending(b"aaaaa\nb\n").first_line_over(4));
        assert!(pending(b"aaaaa").first_line_over(4));
        assert!(!pending(b"aaaa\nbbbbbbbbb").first_line_over(4));
    }
}

//! [`ParsedRequests`]: a bounded memo of request bodies already parsed, for a server
//! that hears the same bytes again and again (the replicas of one Deployment, node
//! agents' periodic `comply`, every rank of a job).
//!
//! Correct by construction: a body's request depends on its bytes alone, and a hit is
//! confirmed by comparing the whole body, so the memo never answers for other bytes.
//! What it hands out is a clone sharing the context, the entities and the decision
//! cache's fingerprint (made once per remembered body, not per repeat).

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::{Fingerprints, Request};
use crate::error::RequestError;
use crate::hashing::KeyedHash;

/// Shards of the memo, each behind its own lock.
const SHARDS: usize = 8;

/// Slots of the doorkeeper: a body is remembered only when seen a second time while
/// its slot still holds it, so bodies that never repeat push nothing out.
const DOORKEEPER_SLOTS: usize = 4096;

/// What one remembered body costs beyond its bytes, its parsed tree and its
/// fingerprints: the map's entry, the request's uids and `Arc`s.
const ENTRY_OVERHEAD: usize = 256;

/// What the allocator adds to each allocation of a parsed tree, as counted.
const ALLOCATION_OVERHEAD: usize = 16;

/// The count is doubled: the sidecar's resident memory grew by about 1.9 times what
/// the memo counted (16 MB at the median of five samples, 11.8–17.1, for 8.37 MB;
/// `scripts/bench-decisions.sh soak` with and without it): the allocator's pages and
/// the parts not walked (uids, `Arc`s).
const CALIBRATION: usize = 2;

/// Counters of a [`ParsedRequests`], for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ParsedRequestsStats {
    /// Bodies answered from the memo.
    pub hits: u64,
    /// Bodies parsed (not in the memo, too large for it, or not valid).
    pub misses: u64,
    /// Bodies let go to make room.
    pub evictions: u64,
    /// Bodies remembered now.
    pub entries: u64,
    /// Bytes the remembered bodies are counted at.
    pub bytes: u64,
}

#[derive(Default)]
struct Shard {
    entries: HashMap<u64, Remembered, crate::hashing::FastHash>,
    bytes: usize,
}

struct Remembered {
    body: Box<[u8]>,
    request: Request,
    /// What it is counted at against the budget ([`cost`]).
    cost: usize,
}

/// The least a body of `body` bytes can be counted at: its bytes, its two
/// fingerprints (each about the body's size: the request written out again) and the
/// entry; [`cost`] adds the parsed tree.
fn least_cost(body: usize) -> usize {
    body.saturating_mul(3)
        .saturating_add(ENTRY_OVERHEAD)
        .saturating_mul(CALIBRATION)
}

/// What remembering `request`, parsed from `body` bytes, holds: [`least_cost`] and the
/// heap of its context and entities as parsed, times [`CALIBRATION`]. A tree can be
/// tens of times its text: `[0,0,...]` is 2 bytes of text and a 72-byte value per
/// element.
fn cost(body: usize, request: &Request) -> usize {
    let context = request.context.as_deref().map_or(0, |c| object_bytes(c, 0));
    let entities = array_bytes(&request.entities, 0);
    least_cost(body).saturating_add(context.saturating_add(entities).saturating_mul(CALIBRATION))
}

/// The heap a parsed value's children hold (the value itself is counted by whoever
/// holds it). Past the parser's own depth bound nothing is left to count.
fn value_bytes(v: &serde_json::Value, depth: usize) -> usize {
    use serde_json::Value;
    if depth > 256 {
        return 0;
    }
    match v {
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
        Value::String(s) => s.capacity().saturating_add(ALLOCATION_OVERHEAD),
        Value::Array(a) => array_bytes(a, depth + 1),
        Value::Object(o) => object_bytes(o, depth + 1),
    }
}

fn array_bytes(a: &[serde_json::Value], depth: usize) -> usize {
    a.iter()
        .map(|x| value_bytes(x, depth).saturating_add(size_of::<serde_json::Value>()))
        .fold(ALLOCATION_OVERHEAD, usize::saturating_add)
}

fn object_bytes(o: &serde_json::Map<String, serde_json::Value>, depth: usize) -> usize {
    // Each entry: its key, its value, the map's hash and index slot.
    let entry = size_of::<String>() + size_of::<serde_json::Value>() + 16;
    o.iter()
        .map(|(k, x)| {
            value_bytes(x, depth)
                .saturating_add(k.capacity())
                .saturating_add(ALLOCATION_OVERHEAD)
                .saturating_add(entry)
        })
        .fold(2 * ALLOCATION_OVERHEAD, usize::saturating_add)
}

/// A bounded memo of parsed request bodies: [`ParsedRequests::parse`] answers as
/// [`Request::from_json_slice`] does, from memory for a body it has seen twice.
/// Unlike it, `parse` reads a body of any size: the caller bounds what it reads (the
/// server's `max_body_bytes`).
///
/// Bounded in bytes (a body counted at twice its bytes, its parsed tree, its
/// fingerprints and 256 bytes: about what it holds) and in the size of a body it
/// keeps; a body that does not parse is never kept.
///
/// ```
/// use probity::ParsedRequests;
///
/// let memo = ParsedRequests::default();
/// let body = br#"{"principal": "Workload::\"w\"", "action": "schedule", "resource": "Node::\"n\""}"#;
/// for _ in 0..3 {
///     let request = memo.parse(body)?;
///     assert_eq!(request.resource().to_string(), r#"Node::"n""#);
/// }
/// // The first sight parses; the second parses and keeps; the third is remembered.
/// assert_eq!(memo.stats().hits, 1);
/// assert!(memo.parse(b"{").is_err());
/// # Ok::<(), probity::RequestError>(())
/// ```
pub struct ParsedRequests {
    shards: [Mutex<Shard>; SHARDS],
    doorkeeper: Box<[AtomicU64]>,
    hasher: KeyedHash,
    budget: usize,
    max_body: usize,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

impl Default for ParsedRequests {
    /// [`ParsedRequests::DEFAULT_BUDGET_BYTES`], bodies of up to
    /// [`ParsedRequests::DEFAULT_MAX_BODY_BYTES`].
    fn default() -> Self {
        Self::new(Self::DEFAULT_BUDGET_BYTES, Self::DEFAULT_MAX_BODY_BYTES)
    }
}

impl std::fmt::Debug for ParsedRequests {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParsedRequests")
            .field("budget", &self.budget)
            .field("max_body", &self.max_body)
            .field("stats", &self.stats())
            .finish()
    }
}

impl ParsedRequests {
    /// The default budget: 8 MiB.
    pub const DEFAULT_BUDGET_BYTES: usize = 8 << 20;

    /// The largest body kept by default: 8 KiB (admission's and agents' questions are
    /// well under it).
    pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 10;

    /// A memo counting at most `budget` bytes, keeping bodies of at most `max_body`
    /// bytes. A budget of 0 keeps nothing: every body is parsed.
    pub fn new(budget: usize, max_body: usize) -> Self {
        Self {
            shards: std::array::from_fn(|_| Mutex::new(Shard::default())),
            doorkeeper: (0..DOORKEEPER_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            hasher: KeyedHash::default(),
            budget,
            max_body,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// The request in `bytes`, as [`Request::from_json_slice`] reads it (the same
    /// errors, and no size bound), from memory if the same bytes were parsed before
    /// and kept.
    pub fn parse(&self, bytes: &[u8]) -> Result<Request, RequestError> {
        let shard_budget = self.budget / SHARDS;
        if bytes.len() > self.max_body || least_cost(bytes.len()) > shard_budget {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return Request::from_json_any_size(bytes);
        }
        let hash = self.hasher.hash_one(bytes);
        let Some(shard) = self.shards.get((hash as usize) % SHARDS) else {
            return Request::from_json_any_size(bytes);
        };
        {
            let shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(known) = shard.entries.get(&hash)
                && *known.body == *bytes
            {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(known.request.clone());
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let request = Request::from_json_any_size(bytes)?;
        if !self.seen_before(hash) {
            return Ok(request);
        }
        let needed = cost(bytes.len(), &request);
        if needed > shard_budget {
            return Ok(request);
        }
        let mut request = request;
        request.fingerprints = Some(Arc::new(Fingerprints::default()));
        let remembered = Remembered {
            body: bytes.into(),
            request: request.clone(),
            cost: needed,
        };
        // Let go of outside the lock: a tree can be large to free.
        let mut gone = Vec::new();
        {
            let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            // The same body, kept meanwhile by another thread, is replaced first, so
            // that it does not push others out.
            if let Some(same) = shard.entries.remove(&hash) {
                shard.bytes = shard.bytes.saturating_sub(same.cost);
                gone.push(same);
            }
            // Room is made by letting go of whichever bodies the map yields first:
            // the memo only saves parsing, so which ones go matters little, and a
            // flood of distinct bodies cannot grow it.
            while shard.bytes + needed > shard_budget {
                let Some(&victim) = shard.entries.keys().next() else {
                    break;
                };
                if let Some(evicted) = shard.entries.remove(&victim) {
                    shard.bytes = shard.bytes.saturating_sub(evicted.cost);
                    self.evictions.fetch_add(1, Ordering::Relaxed);
                    gone.push(evicted);
                }
            }
            shard.entries.insert(hash, remembered);
            shard.bytes += needed;
        }
        drop(gone);
        Ok(request)
    }

    /// Whether a body hashed to `hash` was seen recently (as far as a direct-mapped
    /// table tells); remembers it if not.
    fn seen_before(&self, hash: u64) -> bool {
        self.doorkeeper
            .get((hash as usize) % DOORKEEPER_SLOTS)
            .is_some_and(|slot| slot.swap(hash, Ordering::Relaxed) == hash)
    }

    /// The memo's counters now.
    pub fn stats(&self) -> ParsedRequestsStats {
        let (mut entries, mut bytes) = (0u64, 0u64);
        for shard in &self.shards {
            let shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            entries += shard.entries.len() as u64;
            bytes += shard.bytes as u64;
        }
        ParsedRequestsStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            entries,
            bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(id: usize) -> Vec<u8> {
        format!(
            r#"{{"principal":"Workload::\"w{id}\"","action":"schedule","resource":"Node::\"gpu-1\"","context":{{"gpus":{id}}},"entities":[{{"uid":{{"type":"Workload","id":"w{id}"}},"attrs":{{}},"parents":[]}}]}}"#
        )
        .into_bytes()
    }

    /// `b` parsed three times through `memo`; its counters after.
    fn asked_thrice(memo: &ParsedRequests, b: &[u8]) -> ParsedRequestsStats {
        for _ in 0..3 {
            memo.parse(b).unwrap();
        }
        memo.stats()
    }

    #[test]
    fn a_body_seen_twice_is_answered_from_memory_the_same_as_parsed() {
        let memo = ParsedRequests::default();
        let b = body(7);
        let parsed = Request::from_json_slice(&b).unwrap();
        for _ in 0..3 {
            let r = memo.parse(&b).unwrap();
            assert_eq!(r.principal(), parsed.principal());
            assert_eq!(r.action(), parsed.action());
            assert_eq!(r.resource(), parsed.resource());
            assert_eq!(r.context(), parsed.context());
            assert_eq!(r.entities(), parsed.entities());
            assert!(!r.is_fact_reporter());
        }
        let stats = memo.stats();
        // First sight parses (the doorkeeper), second parses and keeps, third hits.
        assert_eq!((stats.hits, stats.misses, stats.entries), (1, 2, 1));
    }

    #[test]
    fn a_body_that_does_not_parse_is_never_kept_and_gives_the_parsers_error() {
        let memo = ParsedRequests::default();
        let bad = br#"{"principal":"Workload::\"w\"","action":"schedule"}"#;
        for _ in 0..3 {
            let memo_err = memo.parse(bad).unwrap_err().to_string();
            let parse_err = Request::from_json_slice(bad).unwrap_err().to_string();
            assert_eq!(memo_err, parse_err);
        }
        assert_eq!(memo.stats().entries, 0);
        assert_eq!(memo.stats().hits, 0);
    }

    #[test]
    fn bodies_that_differ_in_one_byte_get_their_own_requests() {
        let memo = ParsedRequests::default();
        let (a, b) = (body(1), body(2));
        for _ in 0..3 {
            assert_eq!(
                memo.parse(&a).unwrap().context(),
                Some(&serde_json::json!({"gpus": 1}).as_object().unwrap().clone())
            );
            assert_eq!(
                memo.parse(&b).unwrap().context(),
                Some(&serde_json::json!({"gpus": 2}).as_object().unwrap().clone())
            );
        }
    }

    #[test]
    fn a_flood_of_distinct_bodies_stays_within_the_budget() {
        let budget = 64 << 10;
        let memo = ParsedRequests::new(budget, 1024);
        for id in 0..5_000 {
            let b = body(id);
            memo.parse(&b).unwrap();
            memo.parse(&b).unwrap();
        }
        let stats = memo.stats();
        assert!(stats.bytes as usize <= budget, "{stats:?}");
        assert!(stats.evictions > 0, "{stats:?}");
        assert!(stats.entries > 0, "{stats:?}");
    }

    /// Review: `[0,0,...]` is 2 bytes of text per element and a whole value once
    /// parsed; a memo that counted bodies by their text held ten times its budget.
    #[test]
    fn a_body_is_counted_at_its_parsed_tree_not_its_text() {
        let zeros = vec!["0"; 3_000].join(",");
        let b = format!(
            r#"{{"principal":"Workload::\"w\"","action":"schedule","resource":"Node::\"n\"","entities":[{zeros}]}}"#
        )
        .into_bytes();
        let memo = ParsedRequests::new(8 << 20, 8 << 10);
        memo.parse(&b).unwrap();
        memo.parse(&b).unwrap();
        let stats = memo.stats();
        assert_eq!(stats.entries, 1);
        let tree = 3_000 * size_of::<serde_json::Value>();
        assert!(
            stats.bytes as usize > tree + b.len(),
            "{stats:?}, tree {tree}"
        );
        // With a budget the tree does not fit in, it is not kept at all.
        let small = asked_thrice(&ParsedRequests::new(8 * (tree / 2), 8 << 10), &b);
        assert_eq!((small.entries, small.bytes), (0, 0));
    }

    #[test]
    fn a_body_over_the_size_bound_is_parsed_every_time() {
        let b = body(3);
        assert!(b.len() > 64);
        let stats = asked_thrice(&ParsedRequests::new(1 << 20, 64), &b);
        assert_eq!((stats.entries, stats.misses), (0, 3));
    }

    #[test]
    fn a_zero_budget_keeps_nothing() {
        let stats = asked_thrice(&ParsedRequests::new(0, 1 << 20), &body(4));
        assert_eq!(stats.entries, 0);
    }
}

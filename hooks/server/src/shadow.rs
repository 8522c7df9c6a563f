//! `[policies] shadow`: a candidate set decided beside the live one. One decision in
//! `shadow_sample_every` is handed, with the live answer, to a thread of its own
//! through a bounded queue (full: dropped and counted, never waited for), which decides
//! it under the shadow set and counts agreements and disagreements, keeping the latest
//! disagreements for `GET /v1/policy/shadow`. The thread takes at most a quarter of a
//! core ([`REST_FACTOR`]). The answer the caller gets is the live set's, always.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};

use probity::{Decision, Engine, Request, ShadowSet};

use crate::AppState;
use serde_json::{Value, json};

/// Decisions waiting for the shadow thread at most.
const QUEUE: usize = 1024;
/// Disagreements kept for the API.
const RECENT: usize = 100;

/// The shadow set, its queue and its counts.
pub(crate) struct Shadow {
    set: Arc<ShadowSet>,
    every: u64,
    seen: AtomicU64,
    queue: SyncSender<(Request, Decision)>,
    counts: Arc<Counts>,
}

#[derive(Default)]
struct Counts {
    agreed: AtomicU64,
    disagreed: AtomicU64,
    dropped: AtomicU64,
    /// policy -> disagreements it took part in (on either side).
    by_policy: Mutex<BTreeMap<String, u64>>,
    recent: Mutex<VecDeque<Value>>,
}

impl Shadow {
    /// Loads `dir` as the shadow of `engine`'s set and starts its thread.
    pub fn start(engine: &Engine, dir: &std::path::Path, every: u32) -> Result<Self, String> {
        let set = Arc::new(
            engine
                .load_shadow(dir)
                .map_err(|e| format!("shadow set {}: {}", dir.display(), e.detail()))?,
        );
        let (queue, inbox) = sync_channel(QUEUE);
        let counts = Arc::new(Counts::default());
        let (e, s, c) = (engine.clone(), Arc::clone(&set), Arc::clone(&counts));
        std::thread::Builder::new()
            .name("probity-shadow".into())
            .spawn(move || run(&e, &s, &c, &inbox))
            .map_err(|e| format!("cannot start the shadow thread: {e}"))?;
        Ok(Self {
            set,
            every: u64::from(every.max(1)),
            seen: AtomicU64::new(0),
            queue,
            counts,
        })
    }

    /// Whether the next decision is a sample (every `every`-th is).
    pub fn wants(&self) -> bool {
        (self.seen.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(self.every)
    }

    /// Queues a sampled request with its live answer, never waiting.
    pub fn submit(&self, request: Request, decision: Decision) {
        match self.queue.try_send((request, decision)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counts.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The counts: (agreed, disagreed, dropped).
    pub fn totals(&self) -> (u64, u64, u64) {
        let c = &self.counts;
        (
            c.agreed.load(Ordering::Relaxed),
            c.disagreed.load(Ordering::Relaxed),
            c.dropped.load(Ordering::Relaxed),
        )
    }

    /// What `GET /v1/policy/shadow` answers.
    pub fn report(&self) -> Value {
        let (agreed, disagreed, dropped) = self.totals();
        let by_policy = self
            .counts
            .by_policy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let recent: Vec<Value> = self
            .counts
            .recent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect();
        json!({
            "dir": self.set.dir(),
            "digest": self.set.digest(),
            "sample_every": self.every,
            "agreed": agreed,
            "disagreed": disagreed,
            "dropped": dropped,
            "by_policy": by_policy,
            "recent": recent,
        })
    }
}

/// The most of one core the shadow thread takes: after each decision it rests
/// `REST_FACTOR` times as long as the decision took. On a busy machine the hot path's
/// threads would otherwise share their cores with it; what it cannot keep up with
/// fills the queue and is dropped (counted).
const REST_FACTOR: u32 = 3;

fn run(engine: &Engine, set: &ShadowSet, counts: &Counts, inbox: &Receiver<(Request, Decision)>) {
    // Ends when the server's state, and with it the sender, is dropped.
    for (request, live) in inbox {
        let started = std::time::Instant::now();
        let shadow = engine.decide_shadow(set, &request);
        std::thread::sleep(started.elapsed() * REST_FACTOR);
        if same(&live, &shadow) {
            counts.agreed.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        counts.disagreed.fetch_add(1, Ordering::Relaxed);
        {
            let mut by_policy = counts
                .by_policy
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let mut policies: Vec<&str> = live.reason_ids().chain(shadow.reason_ids()).collect();
            policies.sort_unstable();
            policies.dedup();
            for p in policies {
                *by_policy.entry(p.to_owned()).or_default() += 1;
            }
        }
        let mut recent = counts.recent.lock().unwrap_or_else(PoisonError::into_inner);
        if recent.len() == RECENT {
            recent.pop_front();
        }
        recent.push_back(json!({
            "request": {
                "principal": request.principal().to_string(),
                "action": request.action().to_string(),
                "resource": request.resource().to_string(),
            },
            "live": live,
            "shadow": shadow,
        }));
    }
}

/// Whether two answers agree: the same outcome and the same obligations.
fn same(a: &Decision, b: &Decision) -> bool {
    let key = |d: &Decision| {
        let mut o: Vec<(String, String, Option<String>)> = d
            .obligations
            .iter()
            .map(|o| (o.policy.clone(), o.kind.clone(), o.target.clone()))
            .collect();
        o.sort();
        o
    };
    a.decision == b.decision && key(a) == key(b)
}

impl AppState {
    /// Hands a decided request to the shadow set, when one is configured and this
    /// decision is its sample (never waits).
    pub(crate) fn offer_shadow(&self, request: &Request, decision: &Decision) {
        if let Some(Ok(shadow)) = &self.inner.shadow
            && shadow.wants()
        {
            shadow.submit(request.clone(), decision.clone());
        }
    }

    /// A copy of `request` when the shadow set wants this decision as its sample.
    pub(crate) fn shadow_sample(&self, request: &Request) -> Option<Request> {
        match &self.inner.shadow {
            Some(Ok(shadow)) if shadow.wants() => Some(request.clone()),
            _ => None,
        }
    }

    /// The shadow set, or why it is not decided; `None` when none is configured.
    pub(crate) fn shadow(&self) -> Option<Result<&Shadow, &str>> {
        self.inner
            .shadow
            .as_ref()
            .map(|s| s.as_ref().map_err(String::as_str))
    }
}

//! What keeps one caller from exhausting what every caller shares.
//!
//! * **Recorded decisions** cost a durable write and disk: each caller identity has a
//!   token bucket of them; a caller over it is answered 429, never a deny that goes
//!   unrecorded ([`RecordBudget`]).
//! * **Blocking I/O for callers** (reading objects and manifests to verify them) runs
//!   on a pool of its own, with a bounded queue and a per-caller bound on jobs in
//!   flight, so it can never take the threads that settle decision records or the
//!   async workers ([`IoPool`]). A job whose caller gave up (its request timed out)
//!   releases the caller's slot at once and is skipped if it has not started.
//! * **Connections**: a bound on all of them and one per caller identity (or peer
//!   address), so a slowloris holding connections open cannot starve others
//!   ([`Connections`]). Fact streams are bounded the same way, in all and per caller.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

/// Most distinct callers whose buckets or counts are remembered; past this, idle ones
/// are forgotten first, then new callers share one bucket.
const MAX_TRACKED: usize = 100_000;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// A token bucket of recorded decisions per caller identity.
pub(crate) struct RecordBudget {
    per_second: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
    refused: AtomicU64,
}

impl RecordBudget {
    /// `per_second` recorded decisions per caller, up to `burst` at once; 0 turns the
    /// budget off.
    pub fn new(per_second: u32, burst: u32) -> Self {
        Self {
            per_second: f64::from(per_second),
            burst: f64::from(burst.max(1)),
            buckets: Mutex::new(HashMap::new()),
            refused: AtomicU64::new(0),
        }
    }

    /// Takes `n` tokens for `caller` at once; false (and none taken) when it has fewer.
    pub fn admit_n(&self, caller: &str, n: usize) -> bool {
        let n = n as f64;
        if self.per_second <= 0.0 {
            return true;
        }
        let now = Instant::now();
        let mut buckets = lock(&self.buckets);
        if buckets.len() >= MAX_TRACKED && !buckets.contains_key(caller) {
            // Forget callers whose buckets are full again (idle ones).
            let (rate, burst) = (self.per_second, self.burst);
            buckets.retain(|_, b| b.tokens + now.duration_since(b.at).as_secs_f64() * rate < burst);
        }
        let key = if buckets.len() >= MAX_TRACKED && !buckets.contains_key(caller) {
            "(too many callers)"
        } else {
            caller
        };
        let bucket = buckets.entry(key.to_owned()).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        let refill = now.duration_since(bucket.at).as_secs_f64() * self.per_second;
        bucket.tokens = (bucket.tokens + refill).min(self.burst);
        bucket.at = now;
        if bucket.tokens >= n {
            bucket.tokens -= n;
            true
        } else {
            self.refused.fetch_add(1, Ordering::Relaxed);
            false
        }
    }

    /// Decisions refused for want of budget since start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// Why a job was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Busy {
    /// The caller already has its share of jobs in flight.
    Caller,
    /// The pool's queue is full.
    Queue,
    /// The pool's threads are gone.
    Stopped,
}

type Job = Box<dyn FnOnce() + Send>;

/// Threads for callers' blocking I/O, apart from everything else.
pub(crate) struct IoPool {
    jobs: SyncSender<(Arc<AtomicBool>, Job)>,
    in_flight: Arc<Mutex<HashMap<String, usize>>>,
    per_caller: usize,
}

/// A caller's claim on one of its slots; dropping it frees the slot (when the job
/// finished, or when the caller gave up waiting, whichever comes first) and, if the
/// job has not started yet, cancels it.
struct Slot {
    caller: String,
    in_flight: Arc<Mutex<HashMap<String, usize>>>,
    released: AtomicBool,
}

impl Slot {
    fn release(&self) {
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut map = lock(&self.in_flight);
        if let Some(n) = map.get_mut(&self.caller) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.caller);
            }
        }
    }
}

impl IoPool {
    /// `threads` workers (at least 1), `queue` jobs waiting at most, `per_caller` jobs
    /// in flight per caller at most.
    pub fn start(threads: usize, queue: usize, per_caller: usize) -> std::io::Result<Self> {
        let (jobs, inbox) = sync_channel::<(Arc<AtomicBool>, Job)>(queue.max(1));
        let inbox = Arc::new(Mutex::new(inbox));
        for i in 0..threads.max(1) {
            let inbox = Arc::clone(&inbox);
            std::thread::Builder::new()
                .name(format!("probity-io-{i}"))
                .spawn(move || {
                    loop {
                        let next = lock(&inbox).recv();
                        let Ok((cancelled, job)) = next else { return };
                        if !cancelled.load(Ordering::Acquire) {
                            job();
                        }
                    }
                })?;
        }
        Ok(Self {
            jobs,
            in_flight: Arc::new(Mutex::new(HashMap::new())),
            per_caller: per_caller.max(1),
        })
    }

    /// Runs `f` on the pool for `caller` and waits for it without blocking the async
    /// worker. Refused at once when the caller has too many jobs in flight or the queue
    /// is full. If the waiting future is dropped (a timeout), the caller's slot is freed
    /// and the job is skipped if it has not started.
    pub async fn run<T: Send + 'static>(
        &self,
        caller: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Busy> {
        {
            let mut map = lock(&self.in_flight);
            let n = map.entry(caller.to_owned()).or_insert(0);
            if *n >= self.per_caller {
                return Err(Busy::Caller);
            }
            *n += 1;
        }
        let slot = Arc::new(Slot {
            caller: caller.to_owned(),
            in_flight: Arc::clone(&self.in_flight),
            released: AtomicBool::new(false),
        });
        let cancelled = Arc::new(AtomicBool::new(false));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job_slot = Arc::clone(&slot);
        let job: Job = Box::new(move || {
            let out = f();
            job_slot.release();
            let _ = tx.send(out);
        });
        match self.jobs.try_send((Arc::clone(&cancelled), job)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                slot.release();
                return Err(Busy::Queue);
            }
            Err(TrySendError::Disconnected(_)) => {
                slot.release();
                return Err(Busy::Stopped);
            }
        }
        // Dropped with the future on a timeout: the slot goes back to the caller and a
        // job still queued is skipped.
        struct OnDrop(Arc<Slot>, Arc<AtomicBool>);
        impl Drop for OnDrop {
            fn drop(&mut self) {
                self.1.store(true, Ordering::Release);
                self.0.release();
            }
        }
        let _guard = OnDrop(slot, cancelled);
        rx.await.map_err(|_| Busy::Stopped)
    }

    /// Jobs in flight per caller, summed.
    pub fn in_flight(&self) -> usize {
        lock(&self.in_flight).values().sum()
    }
}

/// Which bound [`Connections::admit`] refused over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OverLimit {
    /// As many are open as may be in all.
    All,
    /// As many are open for this key (caller identity or peer address) as one key may hold.
    PerKey,
}

/// Open connections (or fact streams): all of them, and per caller identity or peer
/// address.
pub(crate) struct Connections {
    max: usize,
    per_caller: usize,
    open: Mutex<(usize, HashMap<String, usize>)>,
    refused: AtomicU64,
}

/// A held connection; dropping it frees its place.
pub(crate) struct ConnectionPermit {
    key: String,
    owner: Arc<Connections>,
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        let mut open = lock(&self.owner.open);
        open.0 = open.0.saturating_sub(1);
        if let Some(n) = open.1.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.1.remove(&self.key);
            }
        }
    }
}

impl Connections {
    pub fn new(max: usize, per_caller: usize) -> Arc<Self> {
        Arc::new(Self {
            max: max.max(1),
            per_caller: per_caller.max(1),
            open: Mutex::new((0, HashMap::new())),
            refused: AtomicU64::new(0),
        })
    }

    /// A place for one more connection of `key`, or the bound it is over.
    pub fn admit(self: &Arc<Self>, key: &str) -> Result<ConnectionPermit, OverLimit> {
        let mut open = lock(&self.open);
        let mine = open.1.get(key).copied().unwrap_or(0);
        let over = if open.0 >= self.max {
            Some(OverLimit::All)
        } else if mine >= self.per_caller {
            Some(OverLimit::PerKey)
        } else {
            None
        };
        if let Some(over) = over {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(over);
        }
        open.0 += 1;
        *open.1.entry(key.to_owned()).or_insert(0) += 1;
        Ok(ConnectionPermit {
            key: key.to_owned(),
            owner: Arc::clone(self),
        })
    }

    /// Connections open now, and refused since start.
    pub fn counts(&self) -> (usize, u64) {
        (lock(&self.open).0, self.refused.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_caller_over_its_budget_is_refused_and_others_are_not() {
        let b = RecordBudget::new(1, 3);
        assert!((0..3).all(|_| b.admit_n("flood", 1)));
        assert!(!b.admit_n("flood", 1));
        assert!(b.admit_n("quiet", 1));
        assert_eq!(b.refused(), 1);
        assert!(RecordBudget::new(0, 0).admit_n("anyone", 1));
    }

    #[test]
    fn connections_are_bounded_in_all_and_per_caller() {
        let c = Connections::new(3, 2);
        let a1 = c.admit("a").unwrap();
        let _a2 = c.admit("a").unwrap();
        assert_eq!(c.admit("a").err(), Some(OverLimit::PerKey));
        let _b = c.admit("b").unwrap();
        assert_eq!(c.admit("c").err(), Some(OverLimit::All));
        drop(a1);
        assert!(c.admit("c").is_ok());
        assert_eq!(c.counts().1, 2);
    }

    #[tokio::test]
    async fn a_caller_cannot_take_more_than_its_share_of_io_threads_and_a_timeout_frees_its_slot() {
        let pool = IoPool::start(2, 8, 1).unwrap();
        let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
        let hold_rx = Arc::new(Mutex::new(hold_rx));
        let held = Arc::clone(&hold_rx);
        let slow = pool.run("attacker", move || {
            let _ = lock(&held).recv_timeout(Duration::from_secs(10));
        });
        // The first job holds the attacker's one slot...
        let timed_out = tokio::time::timeout(Duration::from_millis(100), slow).await;
        assert!(timed_out.is_err());
        // ...which its timeout gave back, so it may try again, while others are served.
        assert_eq!(pool.run("client", || 7).await, Ok(7));
        let again = pool.run("attacker", || 1);
        let again = tokio::time::timeout(Duration::from_millis(100), again).await;
        assert!(again.is_err() || again == Ok(Ok(1)));
        hold_tx.send(()).unwrap();
        assert_eq!(pool.run("client", || 8).await, Ok(8));
    }

    #[tokio::test]
    async fn a_second_job_of_a_busy_caller_is_refused_at_once() {
        let pool = Arc::new(IoPool::start(1, 8, 1).unwrap());
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let p = Arc::clone(&pool);
        let first = tokio::spawn(async move { p.run("a", move || rx.recv().ok()).await });
        // Until the first job holds the caller's one slot.
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.in_flight() == 0 {
            assert!(Instant::now() < deadline, "the first job never started");
            tokio::task::yield_now().await;
        }
        assert_eq!(pool.run("a", || ()).await, Err(Busy::Caller));
        tx.send(()).unwrap();
        assert_eq!(first.await.unwrap(), Ok(Some(())));
    }
}

//! The decision log: every decision that denies or carries obligations is recorded in
//! the state store before it is acknowledged (DESIGN.md: "no acknowledged record is
//! lost").
//!
//! One writer thread owns the appends and commits them in groups: records that
//! arrive while a commit is under way go into the next transaction together, so a
//! burst of denies shares one durable commit instead of paying one each. A caller
//! submits its records and waits for the commit that holds them; only then does it
//! answer. The queue is bounded, so under a flood submitters wait (backpressure)
//! rather than records being dropped.
//!
//! A waiter is a thread ([`Settled::settle`]) or a task ([`Settled::awaitable`]): an
//! async server awaits the commit on its own workers instead of parking a thread per
//! decision, which cost two OS context switches per recorded decision.
//!
//! Invariants: a record is acknowledged only after the transaction holding it
//! committed durably; a failed commit fails every waiter of that group, and
//! [`Settled`] turns that into a deny (fail closed); a job the writer never answers
//! (it stopped) fails its waiter rather than leaving it waiting.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{
    Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError, sync_channel,
};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::decision::{Decision, DecisionError, Effect};
use crate::recorded::recorded_request;
use crate::request::Request;
use crate::state::{DecisionRecord, LocalLog, RECOVERY_INTERVAL};

/// Submissions waiting for the writer; beyond this, submitters block.
const QUEUE: usize = 1024;
/// Most records in one commit.
const MAX_GROUP: usize = 4096;

type Outcome = Result<u64, String>;

struct Job {
    records: Vec<DecisionRecord>,
    done: Completer,
}

/// Where the writer leaves one job's outcome, for a thread that waits or a task that
/// awaits it.
#[derive(Default)]
struct Completion {
    slot: Mutex<Slot>,
    ready: Condvar,
}

#[derive(Default)]
struct Slot {
    outcome: Option<Outcome>,
    waker: Option<Waker>,
}

impl Completion {
    fn complete(&self, outcome: Outcome) {
        let waker = {
            let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
            slot.outcome.get_or_insert(outcome);
            slot.waker.take()
        };
        self.ready.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Blocks until the outcome is there.
    fn wait(&self) -> Outcome {
        let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(outcome) = slot.outcome.take() {
                return outcome;
            }
            slot = self
                .ready
                .wait(slot)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The outcome if it is there; else `cx`'s waker is woken when it is.
    fn poll(&self, cx: &Context<'_>) -> Poll<Outcome> {
        let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        match slot.outcome.take() {
            Some(outcome) => Poll::Ready(outcome),
            None => {
                match &mut slot.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    other => *other = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }
}

/// The writer's side of a [`Completion`]: answered once; dropped unanswered (the
/// writer stopped with the job queued), it fails the waiter.
struct Completer(Option<Arc<Completion>>);

impl Completer {
    fn new() -> (Self, Arc<Completion>) {
        let completion = Arc::new(Completion::default());
        (Self(Some(Arc::clone(&completion))), completion)
    }

    fn complete(mut self, outcome: Outcome) {
        if let Some(c) = self.0.take() {
            c.complete(outcome);
        }
    }
}

impl Drop for Completer {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.complete(Err("the decision log stopped".to_owned()));
        }
    }
}

/// The writer thread's mailbox. Dropping it lets the writer commit what is queued,
/// then joins it, so the store is released when the engine is.
pub(crate) struct DecisionLog {
    jobs: Option<SyncSender<Job>>,
    writer: Option<JoinHandle<()>>,
}

impl DecisionLog {
    /// Starts the writer thread for `store`.
    pub fn start(store: Arc<dyn LocalLog>) -> std::io::Result<Self> {
        let (jobs, inbox) = sync_channel::<Job>(QUEUE);
        let writer = std::thread::Builder::new()
            .name("probity-decision-log".into())
            .spawn(move || write_loop(store.as_ref(), &inbox))?;
        Ok(Self {
            jobs: Some(jobs),
            writer: Some(writer),
        })
    }

    /// Submits records without blocking; the returned handle waits for their commit.
    /// When the queue is full the job travels with the handle and is sent by
    /// [`Pending::wait`], so a caller on an async thread never blocks here.
    fn submit(&self, records: Vec<DecisionRecord>) -> Pending {
        let (done, completion) = Completer::new();
        let job = Job { records, done };
        let Some(jobs) = self.jobs.as_ref() else {
            return Pending::stopped();
        };
        match jobs.try_send(job) {
            Ok(()) => Pending {
                completion: Some(completion),
                unsent: None,
            },
            Err(TrySendError::Full(job)) => Pending {
                completion: Some(completion),
                unsent: Some((jobs.clone(), job)),
            },
            // The writer is gone (it stops only when the log is dropped, so this is a
            // thread that died): nothing can be recorded.
            Err(TrySendError::Disconnected(_)) => Pending::stopped(),
        }
    }
}

impl Drop for DecisionLog {
    fn drop(&mut self) {
        // Closing the mailbox ends the writer's loop once the queue is drained.
        self.jobs.take();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

/// Shortest wait between time-based checkpoint checks.
const MIN_TICK: Duration = Duration::from_millis(100);

fn write_loop(store: &dyn LocalLog, inbox: &Receiver<Job>) {
    // Appends make the checkpoints due by count; a quiet log is checkpointed by time
    // here, between commits (the chain is hashed in the commit, in `record_decisions`).
    let checkpoint_tick = store.checkpoint_interval().map(|t| t.max(MIN_TICK));
    // After a failed commit the store is asked for its health on a tick of its own,
    // which recovers it (a reopen, a probe write) once the disk takes writes again,
    // whether or not records arrive meanwhile.
    let mut failing = false;
    loop {
        let tick = if failing {
            Some(checkpoint_tick.map_or(RECOVERY_INTERVAL, |t| t.min(RECOVERY_INTERVAL)))
        } else {
            checkpoint_tick
        };
        let first = match tick {
            None => match inbox.recv() {
                Ok(job) => job,
                Err(_) => return,
            },
            Some(tick) => match inbox.recv_timeout(tick) {
                Ok(job) => job,
                Err(RecvTimeoutError::Timeout) => {
                    if failing {
                        failing = store.storage_health().failure.is_some();
                    }
                    if !failing {
                        // A failure here is retried at the next tick or append, and
                        // the records it concerns are already durable.
                        let _ = store.checkpoint_due();
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return,
            },
        };
        let mut group = vec![first];
        let mut count = group.iter().map(|j| j.records.len()).sum::<usize>();
        while count < MAX_GROUP {
            match inbox.try_recv() {
                Ok(job) => {
                    count += job.records.len();
                    group.push(job);
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        let sizes: Vec<u64> = group
            .iter()
            .map(|j| u64::try_from(j.records.len()).unwrap_or(u64::MAX))
            .collect();
        let mut records: Vec<DecisionRecord> = group
            .iter_mut()
            .flat_map(|j| std::mem::take(&mut j.records))
            .collect();
        let result = store.record_decisions(&mut records).map_err(|e| {
            crate::diagnostic::join_chain(e.to_string(), std::error::Error::source(&e))
        });
        failing = result.is_err();
        // Each job learns the sequence number of its first record.
        let mut next = result.as_ref().ok().copied();
        for (job, size) in group.into_iter().zip(sizes) {
            let outcome = match (&result, next) {
                (Ok(_), Some(seq)) => Ok(seq),
                (Err(e), _) => Err(e.clone()),
                (Ok(_), None) => Err("sequence numbers ran out".to_owned()),
            };
            next = next.and_then(|n| n.checked_add(size));
            // A waiter that gave up is no loss: its records are committed.
            job.done.complete(outcome);
        }
    }
}

/// Records submitted (or, with the queue full, ready to be), not yet known durable.
struct Pending {
    completion: Option<Arc<Completion>>,
    unsent: Option<(SyncSender<Job>, Job)>,
}

impl Pending {
    fn stopped() -> Self {
        Self {
            completion: None,
            unsent: None,
        }
    }

    fn wait(self) -> Outcome {
        if let Some((jobs, job)) = self.unsent
            && jobs.send(job).is_err()
        {
            // The job came back and is dropped here, answering its completion with
            // the same error.
            return Err("the decision log stopped".to_owned());
        }
        match self.completion {
            Some(c) => c.wait(),
            None => Err("the decision log is not running".to_owned()),
        }
    }
}

/// Decisions whose records may still be on their way to disk. [`Settled::settle`]
/// waits for the commit; a decision must not be acknowledged before.
#[must_use = "a decision is acknowledged only once settled"]
pub struct Settled {
    decisions: Vec<Decision>,
    pending: Option<Pending>,
    over_budget: bool,
}

/// Why decisions refused by a caller's budget were not given.
const OVER_BUDGET: &str = "over the caller's budget of recorded decisions";

impl Settled {
    /// Nothing to record.
    pub(crate) fn done(decisions: Vec<Decision>) -> Self {
        Self {
            decisions,
            pending: None,
            over_budget: false,
        }
    }

    /// Refused by the caller's budget: nothing was recorded, and settling gives no
    /// decision that needed a record.
    pub(crate) fn over_budget(decisions: Vec<Decision>) -> Self {
        Self {
            decisions: finish(decisions, Err(OVER_BUDGET.to_owned())),
            pending: None,
            over_budget: true,
        }
    }

    /// True if the budget of [`crate::DecideOptions::within`] refused these
    /// decisions: none was recorded, and each that needed a record settles as a
    /// deny saying so. A server answers "too many requests".
    pub fn is_over_budget(&self) -> bool {
        self.over_budget
    }

    /// True if a commit must be waited for (worth moving off an async thread).
    pub fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Waits for the records' commit and returns the decisions. If they could not be
    /// recorded, each decision that needed a record becomes a deny with an error
    /// saying why (an allow's obligations are dropped, a deny's kept): a decision that
    /// cannot be recorded is not given (fail closed).
    pub fn settle(self) -> Vec<Decision> {
        let Some(pending) = self.pending else {
            return self.decisions;
        };
        finish(self.decisions, pending.wait())
    }

    /// [`Settled::settle`] for async callers: a future that resolves when the records
    /// are committed, holding no thread meanwhile. `Err` gives the `Settled` back when
    /// its records are still waiting for room in the log's full queue: only a
    /// blocking [`Settled::settle`] can hand them over (backpressure).
    pub fn awaitable(self) -> Result<impl Future<Output = Vec<Decision>> + Send, Settled> {
        match self.pending {
            None => Ok(Awaiting {
                decisions: Some(self.decisions),
                completion: None,
            }),
            Some(Pending {
                completion: Some(completion),
                unsent: None,
            }) => Ok(Awaiting {
                decisions: Some(self.decisions),
                completion: Some(completion),
            }),
            Some(Pending {
                completion: None,
                unsent: None,
            }) => Ok(Awaiting {
                decisions: Some(finish(
                    self.decisions,
                    Err("the decision log is not running".to_owned()),
                )),
                completion: None,
            }),
            pending @ Some(Pending {
                unsent: Some(_), ..
            }) => Err(Settled {
                decisions: self.decisions,
                pending,
                over_budget: self.over_budget,
            }),
        }
    }
}

/// Decisions whose records' commit is awaited ([`Settled::awaitable`]); resolves to
/// what [`Settled::settle`] returns.
#[must_use = "a decision is acknowledged only once settled"]
pub struct Awaiting {
    decisions: Option<Vec<Decision>>,
    completion: Option<Arc<Completion>>,
}

impl Future for Awaiting {
    type Output = Vec<Decision>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Vec<Decision>> {
        let this = self.get_mut();
        let outcome = match &this.completion {
            None => None,
            Some(c) => match c.poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(outcome) => Some(outcome),
            },
        };
        let decisions = this.decisions.take().unwrap_or_default();
        Poll::Ready(match outcome {
            None => decisions,
            Some(outcome) => finish(decisions, outcome),
        })
    }
}

/// The decisions as the commit's `outcome` leaves them (see [`Settled::settle`]).
fn finish(decisions: Vec<Decision>, outcome: Outcome) -> Vec<Decision> {
    match outcome {
        Ok(_) => decisions,
        Err(why) => decisions
            .into_iter()
            .map(|mut d| {
                if needs_record(&d) {
                    // An allow's obligations (an alert, a burst) belonged to the
                    // allow; a deny's (a block) are how it fails closed, and stay.
                    if d.decision == Effect::Allow {
                        d.obligations.clear();
                    }
                    d.decision = Effect::Deny;
                    d.score = 0;
                    d.unrecorded = true;
                    d.errors.push(DecisionError {
                        policy: None,
                        message: format!("the decision could not be recorded: {why}"),
                    });
                }
                d
            })
            .collect(),
    }
}

/// Whether DESIGN's rule asks for a record: a deny, or any obligation. Such a decision
/// fails closed when its record cannot be written.
pub(crate) fn needs_record(d: &Decision) -> bool {
    d.decision == Effect::Deny || !d.obligations.is_empty()
}

/// Whether the log keeps `d`: what [`needs_record`] asks, and an allow on which a
/// `warn` or `audit` policy fired (what reports and `policy impact` read). Only the
/// former fails closed: a policy that does not enforce never turns an allow into a deny,
/// not even on a full disk.
pub(crate) fn keeps_record(d: &Decision) -> bool {
    needs_record(d) || !d.warnings.is_empty() || !d.audit.is_empty()
}

/// What the log keeps beyond what it must: one allow in `every` that it would not
/// otherwise keep, as a sample, so that a replay (`probity policy impact`) sees allows
/// a candidate set might refuse; and whether records keep their requests.
#[derive(Debug)]
pub(crate) struct RecordOptions {
    every: AtomicU32,
    seen: AtomicU64,
    keep_requests: AtomicBool,
}

impl Default for RecordOptions {
    fn default() -> Self {
        Self {
            every: AtomicU32::new(0),
            seen: AtomicU64::new(0),
            keep_requests: AtomicBool::new(true),
        }
    }
}

impl RecordOptions {
    /// Keeps one allow in `every` from now on (0: none).
    pub fn sample_allows(&self, every: u32) {
        self.every.store(every, Ordering::Relaxed);
    }

    /// Whether records keep their requests from now on.
    pub fn keep_requests(&self, keep: bool) {
        self.keep_requests.store(keep, Ordering::Relaxed);
    }

    /// Whether this allow is the sample: the `every`-th, then every `every` after it.
    fn take(&self) -> bool {
        let every = self.every.load(Ordering::Relaxed);
        every != 0
            && (self.seen.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(u64::from(every))
    }
}

/// Submits the records `decisions` need (if any) to `log`.
pub(crate) fn submit(
    log: Option<&DecisionLog>,
    options: &RecordOptions,
    policy_digest: &str,
    time_unix_ms: u64,
    asked: &[Request],
    decisions: Vec<Decision>,
) -> Settled {
    let Some(log) = log else {
        return Settled::done(decisions);
    };
    let records: Vec<DecisionRecord> = asked
        .iter()
        .zip(&decisions)
        .filter_map(|(r, d)| {
            let sampled = if keeps_record(d) {
                false
            } else if d.is_allowed() && options.take() {
                true
            } else {
                return None;
            };
            Some(DecisionRecord {
                seq: 0,
                time_unix_ms,
                principal: r.principal.to_string(),
                action: r.action.to_string(),
                resource: r.resource.to_string(),
                policy_digest: policy_digest.to_owned(),
                decision: d.clone(),
                caller: r.caller.as_deref().map(str::to_owned),
                request: options
                    .keep_requests
                    .load(Ordering::Relaxed)
                    .then(|| recorded_request(r)),
                sampled,
            })
        })
        .collect();
    if records.is_empty() {
        return Settled::done(decisions);
    }
    Settled {
        decisions,
        pending: Some(log.submit(records)),
        over_budget: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_held_back_by_a_full_queue_is_sent_by_the_waiter() {
        let (jobs, inbox) = sync_channel::<Job>(1);
        let (done, completion) = Completer::new();
        let pending = Pending {
            completion: Some(completion),
            unsent: Some((
                jobs,
                Job {
                    records: Vec::new(),
                    done,
                },
            )),
        };
        let writer = std::thread::spawn(move || {
            let job = inbox.recv().unwrap();
            job.done.complete(Ok(7));
        });
        assert_eq!(pending.wait(), Ok(7));
        writer.join().unwrap();
    }

    #[test]
    fn a_decision_that_cannot_be_recorded_becomes_a_deny_saying_why() {
        let allow_with_alert = Decision {
            decision: Effect::Allow,
            reasons: Vec::new(),
            obligations: vec![crate::decision::Obligation {
                kind: "alert".into(),
                target: None,
                parameters: Default::default(),
                policy: "p".into(),
            }],
            errors: Vec::new(),
            score: 3,
            warnings: Vec::new(),
            audit: Vec::new(),
            unrecorded: false,
        };
        let plain_allow = Decision {
            obligations: Vec::new(),
            ..allow_with_alert.clone()
        };
        let settled = Settled {
            decisions: vec![allow_with_alert, plain_allow.clone()],
            pending: Some(Pending::stopped()),
            over_budget: false,
        };
        assert!(settled.is_pending());
        let out = settled.settle();
        assert_eq!(out[0].decision, Effect::Deny);
        assert_eq!(out[0].score, 0);
        assert!(
            out[0].unrecorded,
            "the caller must tell it from a policy's deny"
        );
        assert_eq!(
            out[0].errors[0].message,
            "the decision could not be recorded: the decision log is not running"
        );
        // The allow's obligations went with the allow.
        assert!(out[0].obligations.is_empty());
        // A decision that needed no record is left as it was.
        assert_eq!(out[1], plain_allow);
        assert!(!out[1].unrecorded);
    }

    /// A minimal executor: polls `fut` on this thread, parking until it is woken.
    fn block_on<F: Future>(fut: F) -> (F::Output, usize) {
        struct Unpark(std::thread::Thread, std::sync::atomic::AtomicUsize);
        impl std::task::Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                self.0.unpark();
            }
        }
        let unpark = Arc::new(Unpark(
            std::thread::current(),
            std::sync::atomic::AtomicUsize::new(0),
        ));
        let waker = Waker::from(Arc::clone(&unpark));
        let mut cx = Context::from_waker(&waker);
        let mut fut = std::pin::pin!(fut);
        loop {
            if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
                return (out, unpark.1.load(std::sync::atomic::Ordering::SeqCst));
            }
            std::thread::park_timeout(Duration::from_secs(5));
        }
    }

    fn deny() -> Decision {
        Decision {
            decision: Effect::Deny,
            reasons: Vec::new(),
            obligations: Vec::new(),
            errors: Vec::new(),
            score: 0,
            warnings: Vec::new(),
            audit: Vec::new(),
            unrecorded: false,
        }
    }

    #[test]
    fn an_awaited_decision_resolves_when_its_commit_lands_and_is_woken_for_it() {
        let (done, completion) = Completer::new();
        let settled = Settled {
            decisions: vec![deny()],
            pending: Some(Pending {
                completion: Some(completion),
                unsent: None,
            }),
            over_budget: false,
        };
        let Ok(awaiting) = settled.awaitable() else {
            panic!("a queued job can be awaited");
        };
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            done.complete(Ok(3));
        });
        let (out, wakes) = block_on(awaiting);
        writer.join().unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].decision, Effect::Deny);
        assert!(out[0].errors.is_empty(), "{:?}", out[0].errors);
        assert!(wakes >= 1, "the commit must wake the task");
    }

    #[test]
    fn a_job_the_writer_drops_unanswered_fails_its_waiter_instead_of_hanging() {
        // A thread that waits.
        let (done, completion) = Completer::new();
        drop(done);
        assert_eq!(
            Pending {
                completion: Some(completion),
                unsent: None
            }
            .wait(),
            Err("the decision log stopped".to_owned())
        );
        // A task that awaits: the deny says why it could not be recorded.
        let (done, completion) = Completer::new();
        let settled = Settled {
            decisions: vec![deny()],
            pending: Some(Pending {
                completion: Some(completion),
                unsent: None,
            }),
            over_budget: false,
        };
        let Ok(awaiting) = settled.awaitable() else {
            panic!("a queued job can be awaited");
        };
        std::thread::spawn(move || drop(done)).join().unwrap();
        let (out, _) = block_on(awaiting);
        assert_eq!(out[0].decision, Effect::Deny);
        assert!(
            out[0].errors[0]
                .message
                .contains("could not be recorded: the decision log stopped"),
            "{:?}",
            out[0].errors
        );
    }

    #[test]
    fn records_still_waiting_for_room_in_the_queue_are_handed_back_for_a_blocking_wait() {
        let (jobs, inbox) = sync_channel::<Job>(1);
        let (done, completion) = Completer::new();
        let settled = Settled {
            decisions: vec![deny()],
            pending: Some(Pending {
                completion: Some(completion),
                unsent: Some((
                    jobs,
                    Job {
                        records: Vec::new(),
                        done,
                    },
                )),
            }),
            over_budget: false,
        };
        let Err(settled) = settled.awaitable() else {
            panic!("an unsent job needs a blocking wait");
        };
        let writer = std::thread::spawn(move || {
            let job = inbox.recv().unwrap();
            job.done.complete(Ok(0));
        });
        let out = settled.settle();
        writer.join().unwrap();
        assert!(out[0].errors.is_empty());
    }
}

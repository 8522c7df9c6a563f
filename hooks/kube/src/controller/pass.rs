//! The bookkeeping of a pass every cluster manager's controller shares: the refusals
//! reported once, each action's record, the records appended to Probity's event log,
//! and what acting leaves in the shared state.

use std::collections::BTreeMap;

use probity_base::error::chain as error_chain;

use super::metrics::Metrics;
use super::plan::{self, ActionRecord, AppliedMark, Backoff, ControlState, Step, StoppedBlock};
use super::shared::StateStore;
use super::{ControllerError, Outcome, ProbityApi, describe, record};

/// The breaker's refusals and the stale records of a plan that the report does not
/// hold yet (each is reported once, not on every pass), logged and counted; added to
/// `state`'s report. Logs the breaker tripping in this pass (`reset` names the
/// operator's command that closes it).
pub fn note_refusals(
    steps: &[Step],
    state: &mut ControlState,
    was_tripped: bool,
    now: u64,
    metrics: &Metrics,
    reset: &str,
) -> Vec<ActionRecord> {
    let notes: Vec<ActionRecord> = steps
        .iter()
        .filter_map(|step| {
            let outcome = match step {
                Step::Refused { .. } => "refused",
                Step::Stale { .. } => "stale",
                _ => return None,
            };
            let note = record(step, now, outcome, describe(step));
            let known = state.report.iter().any(|r| {
                r.node == note.node && r.outcome == note.outcome && r.detail == note.detail
            });
            (!known).then_some(note)
        })
        .collect();
    for note in &notes {
        tracing::warn!(
            node = note.node,
            outcome = note.outcome,
            detail = note.detail,
            "block not acted on"
        );
        metrics.action(&note.action, &note.outcome);
    }
    state.record(notes.iter().cloned());
    if let (false, Some(trip)) = (was_tripped, &state.breaker.tripped) {
        tracing::error!(
            node = trip.node,
            reason = trip.reason,
            "circuit breaker tripped: no new block is acted on until `{reset}`"
        );
    }
    notes
}

/// The record of one step carried out (or failed), logged and counted; `Ok` when it
/// succeeded.
pub fn acted(
    step: &Step,
    now: u64,
    result: Result<Outcome, ControllerError>,
    metrics: &Metrics,
) -> Result<ActionRecord, ActionRecord> {
    let note = match result {
        Ok(outcome) => {
            if let (Step::Block { block, .. }, Outcome::Done) = (step, outcome) {
                metrics.lag(now.saturating_sub(block.since) as f64);
            }
            tracing::info!(
                node = step.node(),
                action = step.kind(),
                outcome = outcome.as_str(),
                "acted"
            );
            Ok(record(step, now, outcome.as_str(), describe(step)))
        }
        Err(error) => {
            metrics.error();
            let error = error_chain(&error);
            tracing::warn!(node = step.node(), action = step.kind(), %error, "action failed");
            Err(record(step, now, "failed", error))
        }
    };
    let (Ok(r) | Err(r)) = &note;
    metrics.action(&r.action, &r.outcome);
    note
}

/// Appends the records left from earlier passes and this pass's to Probity's event
/// log (so they are chained, checkpointed and forwarded to the SIEM); what could not
/// be appended, kept for the next pass (bounded: the oldest go first).
pub async fn log_actions(
    probity: &ProbityApi,
    metrics: &Metrics,
    earlier: &[ActionRecord],
    this_pass: &[&[ActionRecord]],
) -> Vec<ActionRecord> {
    let pending: Vec<ActionRecord> = earlier
        .iter()
        .chain(this_pass.iter().flat_map(|records| records.iter()))
        .cloned()
        .collect();
    let (sent, error) = probity.record_events(&pending).await;
    let mut rest: Vec<ActionRecord> = pending.into_iter().skip(sent).collect();
    if let Some(error) = error {
        metrics.error();
        tracing::warn!(error = %error_chain(&error), kept = rest.len(), "actions could not be appended to Probity's event log: kept for the next pass");
    }
    let excess = rest.len().saturating_sub(plan::MAX_REPORT * 5);
    rest.drain(..excess);
    rest
}

/// What acting on a plan leaves in the shared state.
#[derive(Debug, Default)]
pub struct Acted {
    /// Nodes released: what Probity had set there is no longer its own.
    pub released: Vec<String>,
    /// The records of what was done.
    pub done: Vec<ActionRecord>,
    /// Blocks whose stop was carried out, by node.
    pub stopped: Vec<(String, StoppedBlock)>,
    /// Marks whose change failed: the old one stays what Probity set.
    pub unmoved: Vec<(String, AppliedMark)>,
    /// Stops refused for now, with their back-off.
    pub stopping: BTreeMap<String, Backoff>,
    /// Records not yet in Probity's event log.
    pub unlogged: Vec<ActionRecord>,
}

impl Acted {
    /// Whether anything changed against the state read before acting.
    pub fn changed(&self, before: &ControlState, read: &ControlState) -> bool {
        !self.done.is_empty() || self.stopping != before.stopping || self.unlogged != read.unlogged
    }

    /// Ends a pass. With `log`, what was done (after `notes`, and what earlier passes
    /// could not append) goes to Probity's event log, and what fails to stays for the
    /// next pass; then, if anything changed against `read` (the state the pass read)
    /// and `before` (the state it planned from), `store` takes it.
    pub async fn finish<S: StateStore>(
        mut self,
        store: &S,
        log: Option<(&ProbityApi, &Metrics)>,
        notes: &[ActionRecord],
        before: &ControlState,
        read: &ControlState,
    ) -> Result<(), ControllerError> {
        if let Some((probity, metrics)) = log {
            self.unlogged =
                log_actions(probity, metrics, &read.unlogged, &[notes, &self.done]).await;
        }
        if self.changed(before, read) {
            store.update(|s| self.apply(s)).await?;
        }
        Ok(())
    }

    /// Writes it into `s` (the shared state as read again).
    pub fn apply(&self, s: &mut ControlState) {
        for node in &self.released {
            s.applied.remove(node);
        }
        s.record(self.done.clone());
        for (node, block) in &self.stopped {
            s.stopped.insert(node.clone(), block.clone());
        }
        for (node, old) in &self.unmoved {
            s.applied.insert(node.clone(), old.clone());
        }
        s.stopping = self.stopping.clone();
        s.unlogged = self.unlogged.clone();
    }
}

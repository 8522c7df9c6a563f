//! Stopping a blocked node's work: the reading pod of a failed read, or what a drain
//! stops, by eviction, with back-off and the operator's escalation.

use probity_base::error::chain as error_chain;

use std::time::Duration;

use super::plan::{self, BlockMark, ControlState};
use super::{ActionRecord, Actuator, ControllerError, Outcome, PodRef};

/// Stops the work the block record names, through whichever cluster manager `actuator`
/// drives: its reader's work, then (`stop = "node"`) everything a drain stops; once
/// that was done, the readers of later failed reads on the node. A stop refused for now
/// ([`ControllerError::Disrupted`]) is retried with back-off (in `state.stopping`) and
/// turned into a delete only past the operator's `escalation` timeout. Answers whether
/// every piece of work is stopped, and the records.
pub async fn stop_work<A: Actuator<Error = ControllerError>>(
    actuator: &A,
    node: &str,
    block: &BlockMark,
    state: &mut ControlState,
    now: u64,
    dry_run: bool,
    escalation: Option<Duration>,
) -> (bool, Vec<ActionRecord>) {
    let note = |outcome: &str, detail: String| ActionRecord {
        at: now,
        node: node.to_owned(),
        action: "stop".into(),
        outcome: if dry_run {
            "would".into()
        } else {
            outcome.into()
        },
        detail,
    };
    // A block whose stop was carried out already: only the readers of its later
    // failed reads are left (the drain, if any, was done).
    let earlier = state.readers_stopped(node, block);
    let mut pods: Vec<PodRef> = block
        .readers()
        .filter(|r| earlier.as_ref().is_none_or(|done| !done.contains(&r.key())))
        .map(|r| PodRef {
            namespace: r.namespace.clone(),
            name: r.name.clone(),
            uid: r.uid.clone(),
            node: Some(node.to_owned()),
        })
        .collect();
    match block.stop.as_deref() {
        Some("reader") => {}
        Some("node") if earlier.is_some() => {}
        Some("node") => match actuator.node_pods(node).await {
            Ok(on_node) => {
                for pod in on_node {
                    if !pods
                        .iter()
                        .any(|p| p.namespace == pod.namespace && p.name == pod.name)
                    {
                        pods.push(pod);
                    }
                }
            }
            Err(error) => return (false, vec![note("failed", error_chain(&error))]),
        },
        other => {
            // A stop this controller does not know is reported once and not acted on:
            // guessing would be acting by mistake.
            let detail = format!("unknown stop {other:?} in the block record: nothing stopped");
            return (true, vec![note("failed", detail)]);
        }
    }
    let reason = format!("Probity blocked node {node}: {}", block.reason);
    let mut complete = true;
    let mut records = Vec::new();
    for pod in &pods {
        let key = format!("{}/{}", pod.namespace, pod.name);
        if !dry_run && state.stopping.get(&key).is_some_and(|b| b.next > now) {
            complete = false;
            continue;
        }
        match actuator.stop_pod(pod, &reason, dry_run).await {
            Ok(outcome) => {
                state.stopping.remove(&key);
                let what = match outcome {
                    Outcome::Done => actuator.stopped_word(),
                    Outcome::Unchanged => "already gone",
                    Outcome::NotThere => "not on this node: not stopped",
                    // Reported when it was evicted; a drain's retries pass it by.
                    Outcome::Stopping => continue,
                };
                records.push(note(outcome.as_str(), format!("{key} {what}")));
            }
            Err(ControllerError::Disrupted { message, .. }) => {
                let backoff = plan::Backoff::refused(state.stopping.get(&key), now);
                let escalate = escalation
                    .is_some_and(|limit| now.saturating_sub(backoff.first) >= limit.as_secs());
                if escalate && !dry_run {
                    state.stopping.remove(&key);
                    let record = match actuator.delete_pod(pod, &reason).await {
                        Ok(_) => note(
                            "escalated",
                            format!("{key} deleted: evictions refused since {}", backoff.first),
                        ),
                        Err(error) => {
                            complete = false;
                            note("failed", error_chain(&error))
                        }
                    };
                    records.push(record);
                } else {
                    complete = false;
                    records.push(note(
                        "disrupted",
                        format!(
                            "{key}: eviction refused ({message}); retried at {}",
                            backoff.next
                        ),
                    ));
                    state.stopping.insert(key, backoff);
                }
            }
            Err(error) => {
                complete = false;
                records.push(note("failed", error_chain(&error)));
            }
        }
    }
    for record in &records {
        tracing::info!(
            node,
            action = "stop",
            outcome = record.outcome,
            detail = record.detail,
            "stop"
        );
    }
    (complete, records)
}

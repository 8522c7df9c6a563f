//! Verify before read, with consequences: a verification outcome becomes a `read`
//! decision through the policies, and the decision's obligations are carried out.
//! The action, the reader's and the object's types and the block obligation are the
//! schema's conventions (`crate::conventions`), `read`, `Node`, `Checkpoint` and
//! `block_node` in the default schema.
//!
//! This is where an integrity failure turns into a blocked node: the policy
//! `integrity.unverified-read` denies the read and carries `block_node` for the reader;
//! [`Engine::decide_read`] blocks it (durably, with a state store attached), so the
//! placement policies then refuse to schedule onto it, and records the event.

use serde_json::{Map, Value};

use crate::block::{ReaderPod, STOP_NODE, STOP_READER, TAINT_EFFECTS};
use crate::conventions::{FAILURE_ATTR, READER_POD_ATTR, VERIFIED_ATTR};
use crate::decision::{Decision, DecisionError, Obligation};
use crate::engine::{BlockCause, Engine};
use crate::integrity::{VerifiedReader, VerifyReport};
use crate::request::{EntityUid, Request};

impl Engine {
    /// Decides whether `node` may read checkpoint `checkpoint` given the outcome of its
    /// verification, then carries out the decision's `block_node` obligations and records
    /// a denied read in the attached state store's event log.
    ///
    /// Fails closed: if the request cannot be built or an obligation cannot be carried
    /// out, the decision is a deny that says so.
    pub fn decide_read(
        &self,
        node: &str,
        checkpoint: &str,
        verification: Result<&VerifyReport, &dyn std::error::Error>,
    ) -> Decision {
        self.decide_read_as(node, checkpoint, verification, None)
    }

    /// [`Engine::decide_read`] for a read by a named pod: a block it causes records the
    /// pod, and what the block obligation's `@param_stop` says must stop (`reader` when
    /// it says nothing), so that the cluster manager stops the reading workload first.
    /// The pod is also the `readerPod` context fact when the schema declares it. The
    /// caller checks the claim (the server against a local peer's cgroup); the pod's
    /// syntax is checked here, and a bad one is left out (the block still happens) with
    /// an error in the decision that names the field.
    pub fn decide_read_as(
        &self,
        node: &str,
        checkpoint: &str,
        verification: Result<&VerifyReport, &dyn std::error::Error>,
        reader: Option<&ReaderPod>,
    ) -> Decision {
        // A malformed pod is left out, not allowed to spare the node its block.
        let bad_reader = reader.and_then(|r| r.validate().err());
        let reader = reader.filter(|_| bad_reader.is_none());
        let conventions = self.conventions();
        let Some(read) = conventions.verified_read() else {
            return Decision::error(
                "the schema declares no verified-read action (@verified_read), so no read can be allowed",
            );
        };
        let mut context = Map::new();
        context.insert(VERIFIED_ATTR.into(), Value::Bool(verification.is_ok()));
        if let Err(e) = verification {
            context.insert(FAILURE_ATTR.into(), Value::String(e.to_string()));
        }
        if let (Some(pod), true) = (reader, read.reader_pod) {
            let mut fact = Map::new();
            fact.insert("namespace".into(), Value::String(pod.namespace.clone()));
            fact.insert("name".into(), Value::String(pod.name.clone()));
            if let Some(uid) = &pod.uid {
                fact.insert("uid".into(), Value::String(uid.clone()));
            }
            context.insert(READER_POD_ATTR.into(), Value::Object(fact));
        }
        let request = match (
            EntityUid::new(&read.reader, node),
            EntityUid::action(&read.action),
            EntityUid::new(&read.object, checkpoint),
        ) {
            // The verification is the engine's own: it reports the `verified` fact.
            (Ok(p), Ok(a), Ok(r)) => Request::new(p, a, r)
                .with_context(context)
                .as_fact_reporter(),
            _ => {
                return Decision::error(format!(
                    "cannot build a {} request for {} {node:?}",
                    read.action, read.reader
                ));
            }
        };
        let mut decision = self.decide(&request);
        if let Some(e) = bad_reader {
            decision.errors.push(DecisionError {
                policy: None,
                message: format!("the reader pod is left out: {e}"),
            });
        }
        let reason = decision
            .reasons
            .first()
            .map(|r| r.policy.clone())
            .unwrap_or_else(|| "integrity".into());
        for obligation in &decision.obligations {
            if obligation.kind != conventions.block_obligation() {
                continue;
            }
            let Some(target) = obligation.target.as_deref() else {
                continue;
            };
            let Ok(uid) = target.parse::<EntityUid>() else {
                continue;
            };
            // The blocklist blocks entities of its own type only.
            if self.blocklist_type().as_deref() != Some(uid.type_name().as_str()) {
                decision.errors.push(DecisionError {
                    policy: Some(obligation.policy.clone()),
                    message: format!(
                        "{} names {target}, which is not of the blocklist's type",
                        obligation.kind
                    ),
                });
                continue;
            }
            let detail = match verification {
                Err(e) => format!("{reason}: {e}"),
                Ok(_) => reason.clone(),
            };
            let (stop, taint_effect) = match stop_of(obligation, reader.is_some()) {
                Ok(scope) => scope,
                Err(message) => {
                    // Still blocked: the node read bad data whatever the policy's typo.
                    decision.errors.push(DecisionError {
                        policy: Some(obligation.policy.clone()),
                        message,
                    });
                    (reader.map(|_| STOP_READER.to_owned()), None)
                }
            };
            let cause = BlockCause {
                reason: detail,
                reader: reader.cloned(),
                stop,
                taint_effect,
            };
            if let Err(e) = self.block_node_now_for(uid.id(), cause) {
                decision.errors.push(DecisionError {
                    policy: Some(obligation.policy.clone()),
                    message: format!("could not block {target}: {e}"),
                });
            }
        }
        if let (false, Some(state)) = (decision.is_allowed(), self.log()) {
            let detail = decision
                .reasons
                .iter()
                .map(|r| format!("{}: {}", r.policy, r.message))
                .collect::<Vec<_>>()
                .join("; ");
            if let Err(e) = state.record_event(checkpoint, Some(node), "read-denied", &detail) {
                decision.errors.push(DecisionError {
                    policy: None,
                    message: format!("could not record the denied read: {e}"),
                });
            }
        }
        decision
    }

    /// Puts a [`VerifiedReader`] under the policies: the first integrity failure it
    /// meets while `node` reads becomes [`Engine::decide_read`]'s deny, with its
    /// obligations carried out (the node blocked) and the event and decision recorded,
    /// exactly as a failed whole-object verification. Replaces any earlier
    /// [`VerifiedReader::on_failure`] hook.
    pub fn guard_reader<R: std::io::Read + std::io::Seek>(
        &self,
        reader: VerifiedReader<R>,
        node: &str,
    ) -> VerifiedReader<R> {
        self.guard_reader_as(reader, node, None)
    }

    /// [`Engine::guard_reader`] for a read by a named pod ([`Engine::decide_read_as`]).
    pub fn guard_reader_as<R: std::io::Read + std::io::Seek>(
        &self,
        reader: VerifiedReader<R>,
        node: &str,
        pod: Option<ReaderPod>,
    ) -> VerifiedReader<R> {
        let engine = self.clone();
        let node = node.to_owned();
        let checkpoint = reader.manifest().object_id().to_owned();
        reader.on_failure(move |err| {
            // The decision's consequences are what matter here; the reader returns the
            // integrity error to its caller either way.
            let _ = engine.decide_read_as(&node, &checkpoint, Err(err), pod.as_ref());
        })
    }
}

/// What a block obligation says must stop (`@param_stop`: `node`, or `reader`, the
/// default, which applies only when the reader named its pod) and with which taint effect (`@param_taint_effect`, none: the
/// settings' default). The bundle refuses other literal values at load time; a value
/// built from a placeholder is checked here.
fn stop_of(
    obligation: &Obligation,
    reader_known: bool,
) -> Result<(Option<String>, Option<String>), String> {
    let stop = match obligation.parameters.get("stop").map(String::as_str) {
        // With no pod named, "stop the reader" has nothing to stop beyond the block.
        None | Some(STOP_READER) => reader_known.then(|| STOP_READER.to_owned()),
        Some(STOP_NODE) => Some(STOP_NODE.to_owned()),
        Some(other) => {
            return Err(format!(
                "{}'s stop {other:?} is not {STOP_READER:?} or {STOP_NODE:?}",
                obligation.kind
            ));
        }
    };
    let taint_effect = match obligation.parameters.get("taint_effect") {
        None => None,
        Some(e) if TAINT_EFFECTS.contains(&e.as_str()) => Some(e.clone()),
        Some(other) => {
            return Err(format!(
                "{}'s taint_effect {other:?} is not one of {}",
                obligation.kind,
                TAINT_EFFECTS.join(", ")
            ));
        }
    };
    Ok((stop, taint_effect))
}

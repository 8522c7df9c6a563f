//! Placement: a pod's `schedule` decided for each candidate node, for the scheduler
//! extender (`filter`, `prioritize`) and for the mutating webhook's node affinity.
//! The action asked and the node attribute that groups nodes (into zones) are the
//! schema's (`@schedule_action`, `@placement_group`: [`probity::Conventions`]).
//!
//! Nothing here knows a rule. Which node may take a pod, and how much a node is
//! preferred, are the policies' answers ([`probity::Engine::decide_each`], with the
//! scores of `@score` permit policies); this module only turns them into the shapes
//! Kubernetes reads. Decisions are reused while the facts they read stay the same
//! ([`probity::DecisionCache`]), so a filter over a thousand nodes after one node's facts
//! changed decides that one node again.

use std::collections::{BTreeMap, BTreeSet};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use probity::{Decision, EntityUid, Request};
use serde_json::{Map, Value, json};

use crate::AppState;
use crate::admission::{Workload, pod_workload};
use crate::config::UnknownSchedulerNodes;

/// Largest score the scheduler takes from an extender (`MaxExtenderPriority`).
pub(crate) const MAX_EXTENDER_PRIORITY: i64 = 10;

/// What one node's `schedule` came to.
pub(crate) enum Verdict {
    /// The policies permit it, with the permits' summed score.
    Allowed { score: i64 },
    /// Refused, with why (the reasons of the policies, or why it was not decided).
    Refused(String),
}

/// Decides `schedule` of `workload` onto each of `nodes` (names of `Node` entities):
/// a name the store holds no facts about, and that the blocklist does not name, is
/// refused as unknown unless `unknown` says to let it through.
pub(crate) fn judge_nodes(
    state: &AppState,
    workload: &Workload,
    nodes: &[&str],
    unknown: UnknownSchedulerNodes,
) -> Result<Vec<Verdict>, String> {
    let engine = state.engine();
    let node_type = engine.blocklist_type().unwrap_or_else(|| "Node".to_owned());
    let blocked = engine.blocked_nodes();
    let mut verdicts: Vec<Option<Verdict>> = Vec::with_capacity(nodes.len());
    let mut to_decide = Vec::new();
    let mut positions = Vec::new();
    for (i, name) in nodes.iter().enumerate() {
        let uid = EntityUid::new(&node_type, name)
            .map_err(|e| format!("node name {name:?} is not a valid {node_type} id: {e}"))?;
        let absent = !engine.contains_entity(&uid);
        // A node known only from the cluster (the controller's facts, no agent's yet)
        // is as unknown to the placement rules as an absent one, and says so.
        if (absent || engine.known_only_from_cluster(&uid)) && !blocked.contains_key(*name) {
            verdicts.push(Some(match unknown {
                UnknownSchedulerNodes::Filter if absent => Verdict::Refused(format!(
                    "probity holds no facts about node {name} (scheduler.unknown_nodes = \"filter\"; seed its facts or wait for its agent)"
                )),
                UnknownSchedulerNodes::Filter => Verdict::Refused(format!(
                    "probity has no telemetry of node {name} yet: it knows the node only from the cluster (scheduler.unknown_nodes = \"filter\"; wait for its agent)"
                )),
                UnknownSchedulerNodes::Allow => Verdict::Allowed { score: 0 },
            }));
            continue;
        }
        verdicts.push(None);
        to_decide.push(uid);
        positions.push(i);
    }
    let request = workload.request(engine.conventions().schedule_action(), None)?;
    let decisions = engine.decide_each(&request, &to_decide, Some(state.decision_cache()));
    for (i, d) in positions.into_iter().zip(decisions) {
        if let Some(slot) = verdicts.get_mut(i) {
            *slot = Some(verdict(&d));
        }
    }
    Ok(verdicts
        .into_iter()
        .map(|v| v.unwrap_or_else(|| Verdict::Refused("not decided".into())))
        .collect())
}

fn verdict(d: &Decision) -> Verdict {
    if d.is_allowed() {
        return Verdict::Allowed { score: d.score };
    }
    Verdict::Refused(why_denied(d))
}

/// Why `d` denies, in one line for a caller: its reasons with their policies, then
/// its evaluation errors, or that no policy permits it.
pub(crate) fn why_denied(d: &Decision) -> String {
    let mut why: Vec<String> = d
        .reasons
        .iter()
        .map(|r| format!("{} ({})", r.message, r.policy))
        .collect();
    why.extend(
        d.errors
            .iter()
            .map(|e| format!("evaluation error: {}", e.message)),
    );
    if why.is_empty() {
        why.push("no policy permits it".into());
    }
    why.join("; ")
}

/// The node affinity expressions that keep `workload` where the policies let it go:
/// zones none of whose nodes may take it are left out (`zone In` the others), and the
/// refused nodes of the remaining zones are named (`hostname NotIn`), as are blocked
/// nodes the store does not hold. Warnings say when no node may take it.
pub(crate) fn affinity_expressions(
    state: &AppState,
    workload: &Workload,
) -> Result<(Vec<Value>, Vec<String>), String> {
    let cfg = &state.config().admission;
    let engine = state.engine();
    let node_type = engine.blocklist_type().unwrap_or_else(|| "Node".to_owned());
    let conventions = engine.conventions();
    let nodes = engine.entities_by_reference(&node_type, conventions.placement_group());
    let request = workload.request(conventions.schedule_action(), None)?;
    let decisions = engine.decide_each(&request, &nodes.uids, Some(state.decision_cache()));
    let blocked: BTreeSet<String> = engine.blocked_nodes().into_keys().collect();
    // The same nodes, the very same decisions (shared with the decision cache, so
    // compared by address) and the same blocklist give the same affinity: the usual
    // case between two changes of the store, when a deployment's pods arrive one after
    // another.
    let memo = state.affinity_memo();
    if let Some(known) = memo
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_ref()
        .filter(|m| m.is_for(&nodes, &decisions, &blocked))
    {
        return Ok(known.affinity.clone());
    }
    let affinity = affinity_from(cfg, &nodes, &decisions, &blocked);
    *memo
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(AffinityMemo {
        nodes,
        decisions,
        blocked,
        affinity: affinity.clone(),
    });
    Ok(affinity)
}

/// The mutating webhook's last answer and what it came from.
pub(crate) struct AffinityMemo {
    nodes: std::sync::Arc<probity::EntitiesByReference>,
    decisions: Vec<std::sync::Arc<probity::Decision>>,
    blocked: BTreeSet<String>,
    affinity: (Vec<Value>, Vec<String>),
}

impl AffinityMemo {
    fn is_for(
        &self,
        nodes: &std::sync::Arc<probity::EntitiesByReference>,
        decisions: &[std::sync::Arc<probity::Decision>],
        blocked: &BTreeSet<String>,
    ) -> bool {
        self.blocked == *blocked
            && std::sync::Arc::ptr_eq(&self.nodes, nodes)
            && self.decisions.len() == decisions.len()
            && self
                .decisions
                .iter()
                .zip(decisions)
                .all(|(a, b)| std::sync::Arc::ptr_eq(a, b))
    }
}

fn affinity_from(
    cfg: &crate::config::AdmissionConfig,
    nodes: &probity::EntitiesByReference,
    decisions: &[std::sync::Arc<probity::Decision>],
    blocked: &BTreeSet<String>,
) -> (Vec<Value>, Vec<String>) {
    // zone -> (allowed nodes, refused nodes); nodes without a zone under "".
    let mut zones: BTreeMap<&str, (usize, Vec<&str>)> = BTreeMap::new();
    let mut allowed_total = 0;
    for ((uid, zone), d) in nodes.uids.iter().zip(&nodes.targets).zip(decisions) {
        let entry = zones
            .entry(zone.as_deref().unwrap_or_default())
            .or_default();
        if d.is_allowed() {
            entry.0 += 1;
            allowed_total += 1;
        } else {
            entry.1.push(uid.id());
        }
    }
    let mut warnings = Vec::new();
    let mut exprs = Vec::new();
    let mut refused_nodes: BTreeSet<String> = blocked
        .iter()
        .filter(|n| !nodes.contains_id(n))
        .cloned()
        .collect();
    if nodes.uids.is_empty() {
        if refused_nodes.is_empty() {
            return (exprs, warnings);
        }
    } else if allowed_total == 0 {
        warnings.push(format!(
            "probity: none of the {} nodes Probity knows may take this pod; it is not constrained here, and the validating webhook and the scheduler extender refuse each node",
            nodes.uids.len()
        ));
        return (exprs, warnings);
    }
    let closed: Vec<&&str> = zones
        .iter()
        .filter(|(z, (allowed, _))| !z.is_empty() && *allowed == 0)
        .map(|(z, _)| z)
        .collect();
    if !closed.is_empty() {
        let open: Vec<&&str> = zones
            .iter()
            .filter(|(z, (allowed, _))| !z.is_empty() && *allowed > 0)
            .map(|(z, _)| z)
            .collect();
        exprs.push(json!({"key": cfg.zone_label, "operator": "In", "values": open}));
    }
    for (zone, (allowed, refused)) in &zones {
        if zone.is_empty() || *allowed > 0 {
            refused_nodes.extend(refused.iter().map(|n| (*n).to_owned()));
        }
    }
    if !refused_nodes.is_empty() {
        exprs.insert(
            0,
            json!({"key": cfg.hostname_label, "operator": "NotIn", "values": refused_nodes}),
        );
    }
    (exprs, warnings)
}

/// The scheduler's question, read: the pod and the node names it sent.
struct ExtenderArgs {
    pod: Value,
    names: Vec<String>,
    /// The full NodeList, when the scheduler sent objects rather than names.
    node_objects: Option<Vec<Value>>,
}

/// ExtenderArgs on the wire, as Go's encoder writes it (`Pod`, `Nodes`, `NodeNames`) or
/// in lower case. Names are borrowed from the body, so a long list costs a slice per
/// name rather than a JSON tree.
#[derive(serde::Deserialize)]
struct WireArgs<'a> {
    #[serde(rename = "Pod", alias = "pod", default)]
    pod: Option<Value>,
    #[serde(
        rename = "NodeNames",
        alias = "nodenames",
        alias = "nodeNames",
        default,
        borrow
    )]
    node_names: Option<NodeNames<'a>>,
    #[serde(rename = "Nodes", alias = "nodes", default)]
    nodes: Option<WireNodeList>,
}

/// One node name, borrowed from the body unless it holds an escape.
#[derive(serde::Deserialize)]
struct WireName<'a>(#[serde(borrow)] std::borrow::Cow<'a, str>);

/// `NodeNames`, read element by element so that a bad one is named by its index, and
/// kept only up to the cap of [`NAMES_KEPT`]: past it the rest are counted, not kept, so
/// a refused list costs no more than an accepted one.
struct NodeNames<'a> {
    kept: Vec<std::borrow::Cow<'a, str>>,
    total: usize,
}

thread_local! {
    /// Most names [`NodeNames`] keeps while this thread reads one ExtenderArgs (serde's
    /// derive passes no state down, and the read is synchronous on one thread).
    static NAMES_KEPT: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for NodeNames<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Names<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Names<'a> {
            type Value = NodeNames<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of node names")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let cap = NAMES_KEPT.with(std::cell::Cell::get);
                let mut kept = Vec::new();
                let mut total = 0usize;
                loop {
                    let next = if total < cap {
                        seq.next_element::<WireName<'a>>()
                            .map(|n| n.map(|n| kept.push(n.0)))
                    } else {
                        seq.next_element::<serde::de::IgnoredAny>()
                            .map(|n| n.map(drop))
                    };
                    match next {
                        Ok(Some(())) => total += 1,
                        Ok(None) => return Ok(NodeNames { kept, total }),
                        Err(_) => {
                            return Err(serde::de::Error::custom(format!(
                                "ExtenderArgs NodeNames[{total}] is not a node name"
                            )));
                        }
                    }
                }
            }
        }
        d.deserialize_seq(Names(std::marker::PhantomData))
    }
}

#[derive(serde::Deserialize)]
struct WireNodeList {
    items: Option<Vec<Value>>,
}

/// Why an ExtenderArgs is refused, and with which status.
fn too_many(names: usize, max: usize) -> (StatusCode, String) {
    (
        StatusCode::PAYLOAD_TOO_LARGE,
        format!(
            "ExtenderArgs names {names} nodes; at most {max} are judged at once ([scheduler] max_nodes)"
        ),
    )
}

/// Reads ExtenderArgs, refusing more than `max_nodes` names.
fn extender_args(body: &[u8], max_nodes: usize) -> Result<ExtenderArgs, (StatusCode, String)> {
    let bad = |m: String| (StatusCode::BAD_REQUEST, m);
    // A list would pass for a struct's fields in order; ExtenderArgs is an object.
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some_and(|b| *b != b'{')
        && serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok()
    {
        return Err(bad("ExtenderArgs must be a JSON object".into()));
    }
    NAMES_KEPT.with(|c| c.set(max_nodes.saturating_add(1)));
    let read = serde_json::from_slice::<WireArgs<'_>>(body);
    NAMES_KEPT.with(|c| c.set(usize::MAX));
    let wire = read.map_err(|e| {
        bad(if e.is_syntax() || e.is_eof() {
            format!(
                "ExtenderArgs is not valid JSON at line {}, column {}",
                e.line(),
                e.column()
            )
        } else {
            format!("ExtenderArgs: {e}")
        })
    })?;
    let pod = wire
        .pod
        .ok_or_else(|| bad("ExtenderArgs has no Pod".into()))?;
    if !pod.is_object() {
        return Err(bad("ExtenderArgs Pod is not an object".into()));
    }
    if let Some(NodeNames { kept: list, total }) = wire.node_names.filter(|l| l.total > 0) {
        if total > max_nodes {
            return Err(too_many(total, max_nodes));
        }
        let names = list
            .into_iter()
            .enumerate()
            .map(|(i, n)| {
                if n.is_empty() {
                    Err(bad(format!(
                        "ExtenderArgs NodeNames[{i}] is not a node name"
                    )))
                } else {
                    Ok(n.into_owned())
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        return Ok(ExtenderArgs {
            pod,
            names,
            node_objects: None,
        });
    }
    if let Some(nodes) = wire.nodes {
        let items = nodes
            .items
            .ok_or_else(|| bad("ExtenderArgs Nodes has no items list".into()))?;
        if items.len() > max_nodes {
            return Err(too_many(items.len(), max_nodes));
        }
        let names = items
            .iter()
            .enumerate()
            .map(|(i, n)| {
                n.pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .ok_or_else(|| {
                        bad(format!(
                            "ExtenderArgs Nodes.items[{i}] has no metadata.name"
                        ))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if !names.is_empty() {
            return Ok(ExtenderArgs {
                pod,
                names,
                node_objects: Some(items),
            });
        }
    }
    Err(bad(
        "ExtenderArgs names no nodes (NodeNames and Nodes are both empty or absent)".into(),
    ))
}

/// Reads the body and judges every node it names. A large request (over
/// `[scheduler] large_request_nodes` names) holds one of `max_large_requests` places
/// while it is judged; without one it is a 503, which the scheduler retries.
fn judge(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<(ExtenderArgs, Vec<Verdict>), (StatusCode, String)> {
    let limits = &state.config().scheduler;
    let bytes = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "ExtenderArgs is over {} bytes ([scheduler] max_body_bytes)",
                    limits.max_body_bytes
                ),
            )
        } else {
            (
                StatusCode::BAD_REQUEST,
                "cannot read the request body".to_owned(),
            )
        }
    })?;
    let args = extender_args(&bytes, limits.max_nodes.max(1))?;
    drop(bytes);
    let _place = if args.names.len() > limits.large_request_nodes {
        Some(state.large_scheduler_requests().admit("scheduler").map_err(|_| {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "{} large requests are being judged already ([scheduler] max_large_requests); retry",
                    limits.max_large_requests
                ),
            )
        })?)
    } else {
        None
    };
    let workload = pod_workload(state, &args.pod).map_err(|e| (StatusCode::BAD_REQUEST, e))?;
    let names: Vec<&str> = args.names.iter().map(String::as_str).collect();
    let verdicts = judge_nodes(
        state,
        &workload,
        &names,
        state.config().scheduler.unknown_nodes,
    )
    .map_err(|e| (StatusCode::BAD_REQUEST, e))?;
    Ok((args, verdicts))
}

/// `POST /v1/scheduler/filter`: ExtenderArgs in, ExtenderFilterResult out. Only names
/// the scheduler sent come back; each refused node is in `FailedNodes` with the
/// policies' reasons. Nothing is recorded: the binding is decided on its own.
pub(crate) async fn filter(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    tokio::task::spawn_blocking(move || filter_blocking(&state, body))
        .await
        .unwrap_or_else(|e| filter_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()))
}

/// The filter's work, on a blocking thread (or a fuzz target).
pub(crate) fn filter_blocking(state: &AppState, body: Result<Bytes, BytesRejection>) -> Response {
    let (args, verdicts) = match judge(state, body) {
        Ok(j) => j,
        Err((status, e)) => return filter_error(status, &e),
    };
    let mut failed = Map::new();
    let mut passed = Vec::new();
    for (i, (name, v)) in args.names.iter().zip(&verdicts).enumerate() {
        match v {
            Verdict::Allowed { .. } => passed.push(i),
            Verdict::Refused(why) => {
                failed.insert(name.clone(), Value::String(why.clone()));
            }
        }
    }
    state
        .metrics()
        .record_review("scheduler-filter", !passed.is_empty());
    let (nodes, names) = match &args.node_objects {
        Some(objects) => {
            let items: Vec<Value> = passed
                .iter()
                .filter_map(|i| objects.get(*i).cloned())
                .collect();
            (json!({"metadata": {}, "items": items}), Value::Null)
        }
        None => {
            let names: Vec<&String> = passed.iter().filter_map(|i| args.names.get(*i)).collect();
            (Value::Null, json!(names))
        }
    };
    Json(json!({
        "Nodes": nodes,
        "NodeNames": names,
        "FailedNodes": failed,
        "FailedAndUnresolvableNodes": {},
        "Error": "",
    }))
    .into_response()
}

fn filter_error(status: StatusCode, message: &str) -> Response {
    (
        status,
        Json(json!({
            "Nodes": null,
            "NodeNames": null,
            "FailedNodes": {},
            "FailedAndUnresolvableNodes": {},
            "Error": format!("probity: {message}"),
        })),
    )
        .into_response()
}

/// `POST /v1/scheduler/prioritize`: ExtenderArgs in, HostPriorityList out: each sent
/// node with the score its permits give (0 to 10; a refused node scores 0).
pub(crate) async fn prioritize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    tokio::task::spawn_blocking(move || prioritize_blocking(&state, body))
        .await
        .unwrap_or_else(|e| {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({"Error": format!("probity: {e}")})),
            )
                .into_response()
        })
}

/// The prioritize's work, on a blocking thread (or a fuzz target).
pub(crate) fn prioritize_blocking(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (args, verdicts) = match judge(state, body) {
        Ok(j) => j,
        Err((status, e)) => {
            return (status, Json(json!({"Error": format!("probity: {e}")}))).into_response();
        }
    };
    let list: Vec<Value> = args
        .names
        .iter()
        .zip(&verdicts)
        .map(|(name, v)| {
            let score = match v {
                Verdict::Allowed { score } => (*score).clamp(0, MAX_EXTENDER_PRIORITY),
                Verdict::Refused(_) => 0,
            };
            json!({"Host": name, "Score": score})
        })
        .collect();
    Json(Value::Array(list)).into_response()
}

/// A request of `workload` for `action` on `resource` (a placeholder node when
/// `None`: [`probity::Engine::decide_each`] puts each node in its place).
impl Workload {
    pub(crate) fn request(
        &self,
        action: &str,
        resource: Option<EntityUid>,
    ) -> Result<Request, String> {
        let principal = EntityUid::new("Workload", &self.id).map_err(|e| e.to_string())?;
        let resource = match resource {
            Some(r) => r,
            None => EntityUid::new("Node", "placeholder").map_err(|e| e.to_string())?,
        };
        Ok(Request::new(
            principal,
            EntityUid::action(action).map_err(|e| e.to_string())?,
            resource,
        )
        .with_entities(vec![self.entity.clone()]))
    }
}

//! What the `warn` and `audit` policies find in the store as it is now, not only in
//! what was asked: every Node judged as its agent asks (`comply`), every stored Workload
//! as admission asks (`admit` into its namespace), all as dry runs. `GET /v1/reports`
//! answers it, `probity report` prints it, and the controller turns it into
//! PolicyReport objects (per namespace for workloads, cluster-wide for nodes).

use std::collections::BTreeMap;

use probity::{DecideOptions, Engine, EntityUid, Mode, Notice, Request};
use serde::Serialize;
use serde_json::Value;

/// One finding: a `warn` or `audit` policy that fires on an entity now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// The entity judged, `Type::"id"`.
    pub subject: String,
    /// The entity's id.
    pub name: String,
    /// The policy's `@id`.
    pub policy: String,
    /// `warn` or `audit`.
    pub mode: Mode,
    /// The policy's message, filled.
    pub message: String,
    /// The policy's severity.
    pub severity: probity::Severity,
    /// Set when the policy could not be evaluated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The store's findings.
#[derive(Debug, Default, Serialize)]
pub struct StoreReport {
    /// The digest of the policy set that judged.
    pub policy_digest: String,
    /// Entities judged.
    pub judged: usize,
    /// Findings on nodes.
    pub nodes: Vec<Finding>,
    /// Findings on workloads, by namespace.
    pub workloads: BTreeMap<String, Vec<Finding>>,
}

/// Judges every Node and stored Workload of `engine`'s store (see the module docs).
pub fn audit_store(engine: &Engine) -> StoreReport {
    let mut asked: Vec<(Request, String, Option<String>)> = Vec::new();
    let comply = EntityUid::action("comply");
    let admit = EntityUid::action("admit");
    if let Ok(comply) = &comply {
        for id in ids(&engine.entities_json(Some("Node"))) {
            if let Ok(node) = EntityUid::new("Node", &id.0) {
                asked.push((Request::new(node.clone(), comply.clone(), node), id.0, None));
            }
        }
    }
    if let Ok(admit) = &admit {
        for (id, namespace) in ids(&engine.entities_json(Some("Workload"))) {
            let Some(namespace) = namespace else { continue };
            if let (Ok(w), Ok(ns)) = (
                EntityUid::new("Workload", &id),
                EntityUid::new("Namespace", &namespace),
            ) {
                asked.push((Request::new(w, admit.clone(), ns), id, Some(namespace)));
            }
        }
    }
    let requests: Vec<Request> = asked.iter().map(|(r, _, _)| r.clone()).collect();
    let decisions = engine
        .decide_with(&requests, DecideOptions::new().dry_run())
        .settle();
    let mut report = StoreReport {
        policy_digest: engine.status().digest,
        judged: requests.len(),
        ..StoreReport::default()
    };
    for ((request, name, namespace), decision) in asked.iter().zip(&decisions) {
        let subject = request.principal().to_string();
        let found = |n: &Notice, mode: Mode| Finding {
            subject: subject.clone(),
            name: name.clone(),
            policy: n.policy.clone(),
            mode,
            message: n.message.clone(),
            severity: n.severity,
            error: n.error.clone(),
        };
        let findings = decision
            .warnings
            .iter()
            .map(|n| found(n, Mode::Warn))
            .chain(decision.audit.iter().map(|n| found(n, Mode::Audit)));
        match namespace {
            None => report.nodes.extend(findings),
            Some(ns) => {
                let list: Vec<Finding> = findings.collect();
                if !list.is_empty() {
                    report.workloads.entry(ns.clone()).or_default().extend(list);
                }
            }
        }
    }
    report
}

/// The ids of entity JSON items, with each one's `namespace` attribute's id if it has
/// one.
fn ids(entities: &[Value]) -> Vec<(String, Option<String>)> {
    entities
        .iter()
        .filter_map(|e| {
            let id = e.pointer("/uid/id")?.as_str()?.to_owned();
            let ns = e
                .pointer("/attrs/namespace/__entity/id")
                .and_then(Value::as_str)
                .map(str::to_owned);
            Some((id, ns))
        })
        .collect()
}

//! PolicyReports (`wgpolicyk8s.io/v1alpha2`, the CRDs in the chart) of what Probity's
//! `warn` and `audit` policies find in its store now (`GET /v1/reports`): one
//! `ClusterPolicyReport` for the nodes, one `PolicyReport` per namespace for the
//! workloads, written by server-side apply every `report_interval`. A namespace whose
//! findings cleared keeps its report, emptied: the controller deletes nothing.

use std::collections::BTreeSet;
use std::time::Instant;

use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};

use super::{Controller, ControllerError};

/// The reports' name: the cluster-wide one and each namespace's.
pub const REPORT_NAME: &str = "probity";
/// The label that marks the reports the controller owns.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "probity");
/// The field manager of its applies.
const FIELD_MANAGER: &str = "probity-controller";

fn resource(kind: &str) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("wgpolicyk8s.io", "v1alpha2", kind))
}

/// A report's body: its results and their summary.
pub fn report_body(kind: &str, namespace: Option<&str>, findings: &[Value]) -> Value {
    let (mut warn, mut fail, mut error) = (0u64, 0u64, 0u64);
    let results: Vec<Value> = findings
        .iter()
        .map(|f| {
            let mode = f["mode"].as_str().unwrap_or("audit");
            let result = if f.get("error").is_some_and(|e| !e.is_null()) {
                error += 1;
                "error"
            } else if mode == "warn" {
                warn += 1;
                "warn"
            } else {
                fail += 1;
                "fail"
            };
            let mut r = json!({
                "policy": f["policy"],
                "result": result,
                "severity": f["severity"],
                "message": f["message"],
                "source": "probity",
                "scored": false,
                "properties": {"mode": mode, "subject": f["subject"]},
            });
            if namespace.is_none()
                && let (Some(name), Some(o)) =
                    (f.get("name").and_then(Value::as_str), r.as_object_mut())
            {
                o.insert(
                    "resources".into(),
                    json!([{"apiVersion": "v1", "kind": "Node", "name": name}]),
                );
            }
            r
        })
        .collect();
    let mut metadata = json!({"name": REPORT_NAME, "labels": {MANAGED_BY.0: MANAGED_BY.1}});
    if let (Some(ns), Some(o)) = (namespace, metadata.as_object_mut()) {
        o.insert("namespace".into(), json!(ns));
    }
    json!({
        "apiVersion": "wgpolicyk8s.io/v1alpha2",
        "kind": kind,
        "metadata": metadata,
        "summary": {"pass": 0, "fail": fail, "warn": warn, "error": error, "skip": 0},
        "results": results,
    })
}

impl Controller {
    /// Writes the reports when `report_interval` has passed since the last.
    pub(super) async fn sync_reports(&self) -> Result<(), ControllerError> {
        let Some(interval) = self.options.report_interval else {
            return Ok(());
        };
        {
            let at = self
                .reported_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if at.is_some_and(|t| t.elapsed() < interval) {
                return Ok(());
            }
        }
        let body = self.probity.get("/v1/reports").await?;
        let report: Value =
            serde_json::from_slice(&body).map_err(|e| ControllerError::Probity {
                what: "GET /v1/reports".into(),
                reason: format!("not a report: {e}"),
            })?;
        let apply = PatchParams::apply(FIELD_MANAGER).force();
        let nodes: Vec<Value> = report
            .get("nodes")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let cluster: Api<DynamicObject> =
            Api::all_with(self.client.clone(), &resource("ClusterPolicyReport"));
        cluster
            .patch(
                REPORT_NAME,
                &apply,
                &Patch::Apply(report_body("ClusterPolicyReport", None, &nodes)),
            )
            .await
            .map_err(|e| ControllerError::kube("apply the ClusterPolicyReport", e))?;
        let namespaced = resource("PolicyReport");
        let mut written: BTreeSet<String> = BTreeSet::new();
        if let Some(by_namespace) = report.get("workloads").and_then(Value::as_object) {
            for (ns, findings) in by_namespace {
                let findings = findings.as_array().cloned().unwrap_or_default();
                self.apply_policy_report(&namespaced, ns, &findings, &apply)
                    .await?;
                written.insert(ns.clone());
            }
        }
        // The namespaces whose findings cleared: their reports emptied.
        let all: Api<DynamicObject> = Api::all_with(self.client.clone(), &namespaced);
        let ours = all
            .list(&ListParams::default().labels(&format!("{}={}", MANAGED_BY.0, MANAGED_BY.1)))
            .await
            .map_err(|e| ControllerError::kube("list Probity's PolicyReports", e))?;
        for old in ours.items {
            let Some(ns) = old.metadata.namespace.clone() else {
                continue;
            };
            let empty = old
                .data
                .get("results")
                .and_then(Value::as_array)
                .is_none_or(Vec::is_empty);
            if !written.contains(&ns) && !empty {
                self.apply_policy_report(&namespaced, &ns, &[], &apply)
                    .await?;
            }
        }
        *self
            .reported_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
        Ok(())
    }

    async fn apply_policy_report(
        &self,
        resource: &ApiResource,
        namespace: &str,
        findings: &[Value],
        apply: &PatchParams,
    ) -> Result<(), ControllerError> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), namespace, resource);
        api.patch(
            REPORT_NAME,
            apply,
            &Patch::Apply(report_body("PolicyReport", Some(namespace), findings)),
        )
        .await
        .map_err(|e| ControllerError::kube(format!("apply the PolicyReport in {namespace}"), e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn findings_become_results_with_their_summary() {
        let findings = vec![
            json!({"subject": "Node::\"n1\"", "name": "n1", "policy": "p.a", "mode": "audit",
                   "message": "m", "severity": "high"}),
            json!({"subject": "Node::\"n2\"", "name": "n2", "policy": "p.b", "mode": "warn",
                   "message": "w", "severity": "low"}),
        ];
        let body = report_body("ClusterPolicyReport", None, &findings);
        assert_eq!(body["summary"]["fail"], 1);
        assert_eq!(body["summary"]["warn"], 1);
        assert_eq!(body["results"][0]["result"], "fail");
        assert_eq!(body["results"][0]["resources"][0]["name"], "n1");
        assert_eq!(body["results"][1]["properties"]["mode"], "warn");
        let body = report_body("PolicyReport", Some("inference"), &[]);
        assert_eq!(body["metadata"]["namespace"], "inference");
        assert_eq!(body["results"], json!([]));
    }
}

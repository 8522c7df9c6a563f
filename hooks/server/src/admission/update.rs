//! An UPDATE, judged only for what it introduces over its old object.

use serde_json::{Map, Value};

use super::Answer;
use super::validation::validate_workload;
use super::workload::{Workload, WorkloadId, workload};
use crate::AppState;
use crate::caller::Caller;

/// An UPDATE refuses only what it introduces. `Some(allow)` when it introduces
/// nothing to judge: the object is being deleted (`deletionTimestamp`: finalizers
/// must be removable whatever the node's state), or its judged facts (the workload the
/// policies read, and a template's node) read as the old object's did (a
/// metadata-only update, a finalizer, a status or replica change); or when every
/// refusal of the new object already applied to the old one (then the refusals are
/// warnings). `None`: judge the object as a CREATE.
pub(super) fn judge_update(
    state: &AppState,
    uid: &str,
    request: &Map<String, Value>,
    object: &Value,
    spec_path: &str,
    meta_path: &str,
    new: &Workload,
) -> Option<Answer> {
    if object
        .pointer("/metadata/deletionTimestamp")
        .is_some_and(|t| !t.is_null())
    {
        let mut a = Answer::allow(uid);
        a.warnings
            .push("probity: the object is being deleted; its update is not judged".into());
        return Some(a);
    }
    let old_object = request.get("oldObject").filter(|o| o.is_object())?;
    let old_spec = old_object.pointer(spec_path).filter(|s| s.is_object())?;
    let mut old = workload(
        state,
        request,
        old_object,
        old_spec,
        meta_path,
        WorkloadId::Review,
    )
    .ok()?;
    if new.node_name.is_none() {
        old.node_name = None;
    }
    if old.entity == new.entity && old.node_name == new.node_name {
        return Some(Answer::allow(uid));
    }
    // Both judged without a trace (dry runs): only a refusal that stands is recorded,
    // by the caller's full judgement.
    let caller = Caller::anonymous();
    let now = validate_workload(state, &caller, uid, new, true, true);
    if now.allowed || now.denials.is_empty() {
        return None;
    }
    let before = validate_workload(state, &caller, uid, &old, true, true);
    if now.denials.iter().all(|d| before.denials.contains(d)) {
        let mut a = Answer::allow(uid);
        a.warnings = now.warnings;
        a.audit_annotations = now.audit_annotations;
        a.warnings.extend(now.denials.iter().map(|d| {
            format!("probity: already refused before this update, not introduced by it: {d}")
        }));
        return Some(a);
    }
    None
}

//! Entry points for the fuzz targets in `hooks/server/fuzz`: untrusted bytes through
//! exactly the code the routes run (the AdmissionReview handlers, the scheduler
//! extender's filter and prioritize), on one server state over the embedded default
//! policies with no state store, so nothing is written. Not part of the API.

use std::sync::OnceLock;

use axum::body::Bytes;
use axum::response::Response;

use crate::admission::{self, Mode};
use crate::{AppState, Caller, Config};

fn state() -> &'static AppState {
    static STATE: OnceLock<AppState> = OnceLock::new();
    STATE.get_or_init(|| {
        // The embedded defaults always load; a fuzz run without them is meaningless.
        #[allow(clippy::expect_used)]
        let engine = probity::Engine::from_embedded_defaults().expect("the embedded defaults load");
        AppState::new(engine, Config::default())
    })
}

fn answer_is_json(response: Response) {
    let status = response.status();
    assert!(
        !status.is_server_error() || status.as_u16() == 503,
        "an AdmissionReview or ExtenderArgs body is never an internal error: {status}"
    );
}

/// `body` as an AdmissionReview to `POST /v1/admission/validate`.
pub fn admission_validate(body: &[u8]) {
    answer_is_json(admission::review(
        state(),
        &Caller::anonymous(),
        Ok(Bytes::copy_from_slice(body)),
        Mode::Validate,
    ));
}

/// `body` as an AdmissionReview to `POST /v1/admission/mutate`.
pub fn admission_mutate(body: &[u8]) {
    answer_is_json(admission::review(
        state(),
        &Caller::anonymous(),
        Ok(Bytes::copy_from_slice(body)),
        Mode::Mutate,
    ));
}

/// `object` (any bytes) as the object of a `pods/binding` CREATE review, sent to the
/// validating webhook: the binding backstop's own parsing.
pub fn admission_binding(object: &[u8]) {
    let mut body = Vec::with_capacity(object.len() + 400);
    body.extend_from_slice(
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","kind":{"group":"","version":"v1","kind":"Binding"},"resource":{"group":"","version":"v1","resource":"pods"},"subResource":"binding","namespace":"ml-train","name":"p","operation":"CREATE","userInfo":{"username":"system:kube-scheduler"},"object":"#,
    );
    body.extend_from_slice(object);
    body.extend_from_slice(b"}}");
    admission_validate(&body);
}

/// `body` as ExtenderArgs to `POST /v1/scheduler/filter`.
pub fn extender_filter(body: &[u8]) {
    answer_is_json(crate::placement::filter_blocking(
        state(),
        Ok(Bytes::copy_from_slice(body)),
    ));
}

/// `body` as ExtenderArgs to `POST /v1/scheduler/prioritize`.
pub fn extender_prioritize(body: &[u8]) {
    answer_is_json(crate::placement::prioritize_blocking(
        state(),
        Ok(Bytes::copy_from_slice(body)),
    ));
}

/// `body` as a `POST /v1/slurm/submit` body, read as the route reads it into the
/// workloads of each of its namespaces (nothing is decided): an error, never a panic.
pub fn slurm_job(body: &[u8]) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return;
    };
    let Ok(job) = crate::slurm::job::JobDescription::from_body(&value) else {
        return;
    };
    let cfg = &state().config().slurm;
    let _ = job.workload(cfg, "");
    for namespace in job.namespaces(cfg) {
        let _ = job.workload(cfg, &namespace);
    }
}

/// Any bytes as the texts the Slurm parsers read: a TRES list, a constraint, a
/// comment, and a process's cgroup, status and command line.
pub fn slurm_texts(data: &[u8]) {
    use crate::slurm::job::{comment_value, gres_count, required_features};
    use crate::slurm_job::{jobs_in_cgroup, parent_pid, real_uid, step_job};
    let text = String::from_utf8_lossy(data);
    let _ = gres_count(&text, "gpu", false);
    let _ = gres_count(&text, "gpu", true);
    let _ = required_features(&text);
    let _ = comment_value(&text, "class");
    let _ = jobs_in_cgroup(&text);
    let _ = (parent_pid(&text), real_uid(&text), step_job(data));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzz entry points run over the real captures without a panic (the fuzz
    /// targets seed from them).
    #[test]
    fn the_fuzz_entry_points_take_the_captures_and_cut_inputs() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata");
        let mut seen = 0;
        for entry in walk(&dir) {
            let bytes = std::fs::read(&entry).unwrap_or_default();
            for cut in [bytes.len(), bytes.len() / 2, 1] {
                let b = bytes.get(..cut).unwrap_or_default();
                admission_validate(b);
                admission_mutate(b);
                admission_binding(b);
                extender_filter(b);
                extender_prioritize(b);
                slurm_job(b);
                slurm_texts(b);
            }
            seen += 1;
        }
        assert!(seen > 0);
    }

    fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else if p.extension().is_some_and(|x| x == "json")
                && (p.to_string_lossy().contains("admission")
                    || p.to_string_lossy().contains("extender"))
            {
                out.push(p);
            }
        }
        out
    }
}

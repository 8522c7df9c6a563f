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

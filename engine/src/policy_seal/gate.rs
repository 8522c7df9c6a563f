//! Checking a policy set against its seal when it loads, and against the registry's version.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::diagnostic::SourceDiagnostic;
use crate::error::LoadError;
use crate::integrity::{Hash, SignatureProblem, hex};

use super::*;

/// Collects located problems in `policy.seal`.
pub(super) struct Problems {
    pub(super) file: String,
    pub(super) text: Arc<str>,
    pub(super) found: Vec<SourceDiagnostic>,
}

impl Problems {
    pub(super) fn at(&mut self, span: (usize, usize), message: String) {
        self.found.push(SourceDiagnostic::new(
            &self.file, &self.text, span.0, span.1, message,
        ));
    }
}

pub(super) fn seal_error(path: &Path, found: Vec<SourceDiagnostic>) -> LoadError {
    LoadError::Sealed {
        seal: path.to_owned(),
        problems: found,
    }
}

/// Reads and verifies `dir/policy.seal` against `sources` (the hashes of the texts about
/// to be compiled) and `components` (the hashes of the plugin components their manifest
/// names), against the live seal (`live`) and the versions `registry` remembers:
/// signature, file list and digests, name, version. Every problem found is reported,
/// located in the seal.
pub(crate) fn check(
    sealing: &Sealing,
    dir: &Path,
    sources: &[(PathBuf, Hash)],
    components: &[(PathBuf, Hash)],
    live: Option<&LoadedSeal>,
    registry: Option<&dyn crate::state::SharedState>,
) -> Result<Checked, LoadError> {
    let path = PolicySeal::path(dir);
    let file = path.display().to_string();
    let empty: Arc<str> = Arc::from("");
    let bytes = match crate::source::read_limited_bytes(&path, MAX_SEAL_BYTES as u64) {
        Ok(b) => b,
        Err(e) => {
            let message = format!(
                "sealed mode: {}",
                crate::diagnostic::join_chain(e.to_string(), std::error::Error::source(&e))
            );
            return Err(seal_error(
                &path,
                vec![SourceDiagnostic::new(&file, &empty, 0, 0, message)],
            ));
        }
    };
    let text: Arc<str> = Arc::from(String::from_utf8_lossy(&bytes).into_owned());
    let mut problems = Problems {
        file,
        text: Arc::clone(&text),
        found: Vec::new(),
    };
    let seal = match PolicySeal::decode(&bytes) {
        Ok(s) => s,
        Err(e) => {
            let len = text.get(e.offset..).and_then(|r| r.find('\n')).unwrap_or(0);
            problems.at((e.offset, len), e.to_string());
            return Err(seal_error(&path, problems.found));
        }
    };
    let spans = seal.spans();
    match seal.check_signature(&sealing.verifier) {
        Ok(()) => {}
        Err(SignatureProblem::WrongKey { expected, found }) => {
            problems.at(
                spans.signed_by,
                format!("signed by key {found}, not the pinned key {expected}"),
            );
            return Err(seal_error(&path, problems.found));
        }
        Err(SignatureProblem::Invalid) => {
            problems.at(
                spans.signature,
                "the signature does not verify under the pinned key: the seal was altered".into(),
            );
            return Err(seal_error(&path, problems.found));
        }
    }
    // The signature holds: everything below is what the signer said.
    if let Some(pinned) = &sealing.name
        && pinned != &seal.name
    {
        problems.at(
            spans.name,
            format!("this engine loads only the set named {pinned:?}"),
        );
    }
    let mut actual: Vec<(String, Hash)> = Vec::with_capacity(sources.len() + components.len());
    for (p, hash) in sources.iter().chain(components) {
        match relative_name(dir, p) {
            Some(rel) => actual.push((rel, *hash)),
            None => problems.at(
                (0, 0),
                format!(
                    "{} is outside the policy directory: a sealed set keeps every file under it",
                    p.display()
                ),
            ),
        }
    }
    actual.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    for (i, sealed) in seal.files.iter().enumerate() {
        let span = spans.files.get(i).copied().unwrap_or((0, 0));
        match actual.iter().find(|(rel, _)| rel == &sealed.path) {
            None => problems.at(span, format!("{} is sealed but missing", sealed.path)),
            Some((_, hash)) if hash != &sealed.sha256 => problems.at(
                span,
                format!(
                    "{} was changed after sealing: its SHA-256 is {}, the seal says {}",
                    sealed.path,
                    hex(hash),
                    hex(&sealed.sha256)
                ),
            ),
            Some(_) => {}
        }
    }
    for (rel, _) in &actual {
        if !seal.files.iter().any(|f| &f.path == rel) {
            problems.at(
                (0, 0),
                format!("{rel} is part of the policy set but not sealed: remove it or seal the set again"),
            );
        }
    }
    let digest = seal.digest();
    if let Some(live) = live
        && let Some((on_name, message)) = compare(&seal, &digest, &live.seal, &live.digest)
    {
        problems.at(if on_name { spans.name } else { spans.version }, message);
    }
    if let Some(registry) = registry
        && let Err(e) = registry.check_version(&seal.registry_id(), seal.version, &digest)
    {
        problems.at(spans.version, registry_problem(&e));
    }
    if !problems.found.is_empty() {
        return Err(seal_error(&path, problems.found));
    }
    Ok(Checked {
        seal: Arc::new(LoadedSeal {
            info: seal.info(),
            seal,
            encoded: bytes,
            digest,
        }),
        components: components.to_vec(),
    })
}

/// Why `new` may not replace `live`, if it may not: whether the problem is the name
/// (else the version), and the message.
pub(super) fn compare(
    new: &PolicySeal,
    new_digest: &Hash,
    live: &PolicySeal,
    live_digest: &Hash,
) -> Option<(bool, String)> {
    if live.name != new.name {
        Some((
            true,
            format!(
                "the live set is {:?}; a set of another name is not loaded by a reload",
                live.name
            ),
        ))
    } else if new.version < live.version {
        Some((
            false,
            format!(
                "version {} is older than the live version {}: refusing the rollback",
                new.version, live.version
            ),
        ))
    } else if new.version == live.version && new_digest != live_digest {
        Some((
            false,
            format!(
                "version {} is live with other contents: seal the change as a new version",
                new.version
            ),
        ))
    } else {
        None
    }
}

/// Why the checked seal `new` may not replace the live one, if it may not.
pub(crate) fn compare_live(new: &LoadedSeal, live: &LoadedSeal) -> Option<String> {
    compare(&new.seal, &new.digest, &live.seal, &live.digest).map(|(_, m)| m)
}

/// A registry refusal of a seal's version, as a message about that version.
pub(crate) fn registry_problem(e: &crate::state::StateError) -> String {
    use crate::state::StateError;
    match e {
        StateError::Rollback {
            offered, accepted, ..
        } => format!(
            "version {offered} is older than version {accepted}, which the state store remembers: refusing the rollback"
        ),
        StateError::DigestConflict { version, .. } => format!(
            "the state store remembers other contents for version {version}: seal the change as a new version"
        ),
        other => format!(
            "cannot check the version against the state store: {}",
            crate::diagnostic::join_chain(other.to_string(), std::error::Error::source(other))
        ),
    }
}

/// Locates a problem found after the check (a component that changed while it was
/// compiled, a registry refusal at commit) in the seal.
pub(crate) fn late_problem(dir: &Path, seal: &LoadedSeal, message: String) -> LoadError {
    let path = PolicySeal::path(dir);
    let text: Arc<str> = Arc::from(String::from_utf8_lossy(&seal.encoded).into_owned());
    let span = seal.seal.spans().version;
    seal_error(
        &path,
        vec![SourceDiagnostic::new(
            &path.display().to_string(),
            &text,
            span.0,
            span.1,
            message,
        )],
    )
}

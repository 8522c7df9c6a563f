//! The active findings, saved in the state directory from one process to the next.
//!
//! Why this module exists: a finding is raised once, kept while it holds and cleared
//! when it goes, and the running agent knows which are active because it remembers its
//! last cycle. A one-shot run (`probity agent --once`, or `probity slurm health` from
//! Slurm's HealthCheckProgram) is a new process every time: on its own it would raise
//! every active finding again each run (another event, `since` reset, the alert fired
//! anew) and never record one as cleared. So, with a state directory, the agent saves
//! its active findings after each cycle (and after an audit read that raised one), and
//! an agent built on that directory starts from them.
//!
//! The file is [`FINDINGS_FILE`] in the state directory, mode 0600 (a finding carries
//! the facts that caused it), one JSON object:
//!
//! ```json
//! {"version": 1, "node": "gpu-001", "saved_at": 1800000000, "findings": [ ... ]}
//! ```
//!
//! where each finding is a [`Finding`] as serialized in the cycle report.
//!
//! Invariants:
//! * it is written to a temporary file, synced, and renamed over the old one: a reader
//!   sees the old findings or the new, never a part;
//! * it is never read, nor written, past [`MAX_FINDINGS_BYTES`];
//! * a file that cannot be used (unreadable, corrupt, of another format version or
//!   another node) is never fatal: the agent starts with no active finding and says
//!   why, and its next save replaces the file.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use probity_collect::source::FileError;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::{Finding, key_of};

/// The file in the state directory.
pub const FINDINGS_FILE: &str = "agent-findings.json";
/// Largest file read or written.
pub const MAX_FINDINGS_BYTES: usize = 16 * 1024 * 1024;
/// The format this agent reads and writes.
pub const FORMAT_VERSION: u32 = 1;

/// Saved findings that could not be used, or saved.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SavedError {
    /// Unreadable: permissions, not a regular file, over the limit.
    #[error("cannot read the saved findings")]
    Read(#[source] FileError),
    /// Not the saved findings' JSON.
    #[error("{path}:{line}:{column}: not the agent's saved findings")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Line.
        line: usize,
        /// Column.
        column: usize,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// Another format version.
    #[error("{path}: format version {version}, this agent reads version {FORMAT_VERSION}")]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        version: u32,
    },
    /// Saved by the agent of another node (a state directory copied, or the node
    /// renamed): none of them is this node's.
    #[error("{path}: the findings of node {node:?}, not of this node")]
    OtherNode {
        /// The file.
        path: PathBuf,
        /// The node it names.
        node: String,
    },
    /// A finding whose key is not its action, subject and policy, or a key twice.
    #[error("{path}: finding {key:?} {what}")]
    Inconsistent {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What is wrong with it.
        what: &'static str,
    },
    /// More findings than the file may hold.
    #[error("{path}: {len} bytes, more than the limit of {limit}")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// What it would have been.
        len: usize,
        /// [`MAX_FINDINGS_BYTES`].
        limit: usize,
    },
    /// The file could not be written.
    #[error("cannot write {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The file as written.
#[derive(Serialize)]
struct SavedOut<'a> {
    version: u32,
    node: &'a str,
    saved_at: u64,
    findings: Vec<&'a Finding>,
}

/// What is read first: whose file, in which format.
#[derive(Deserialize)]
struct Header {
    version: u32,
    node: String,
}

/// The file as read.
#[derive(Deserialize)]
struct SavedIn {
    findings: Vec<Finding>,
}

fn parse_error(path: &Path, source: serde_json::Error) -> SavedError {
    SavedError::Parse {
        path: path.to_owned(),
        line: source.line(),
        column: source.column(),
        source,
    }
}

/// Parses a saved file's bytes for `node`.
pub fn parse(path: &Path, bytes: &[u8], node: &str) -> Result<Vec<Finding>, SavedError> {
    if bytes.len() > MAX_FINDINGS_BYTES {
        return Err(SavedError::TooLarge {
            path: path.to_owned(),
            len: bytes.len(),
            limit: MAX_FINDINGS_BYTES,
        });
    }
    let header: Header = serde_json::from_slice(bytes).map_err(|e| parse_error(path, e))?;
    if header.version != FORMAT_VERSION {
        return Err(SavedError::Version {
            path: path.to_owned(),
            version: header.version,
        });
    }
    if header.node != node {
        return Err(SavedError::OtherNode {
            path: path.to_owned(),
            node: header.node,
        });
    }
    let saved: SavedIn = serde_json::from_slice(bytes).map_err(|e| parse_error(path, e))?;
    let mut keys = std::collections::BTreeSet::new();
    for f in &saved.findings {
        let what = if f.key != key_of(&f.action, &f.subject, &f.policy) {
            "is not keyed by its action, subject and policy"
        } else if !keys.insert(f.key.as_str()) {
            "is there twice"
        } else {
            continue;
        };
        return Err(SavedError::Inconsistent {
            path: path.to_owned(),
            key: f.key.clone(),
            what,
        });
    }
    Ok(saved.findings)
}

/// The findings saved in `state_dir` for `node`; `None` when nothing was saved.
pub fn load(state_dir: &Path, node: &str) -> Result<Option<Vec<Finding>>, SavedError> {
    let path = state_dir.join(FINDINGS_FILE);
    let bytes = match probity_collect::source::read_regular_file(&path, MAX_FINDINGS_BYTES) {
        Ok(b) => b,
        Err(FileError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(SavedError::Read(e)),
    };
    parse(&path, &bytes, node).map(Some)
}

/// Saves `findings` as `node`'s active findings at `at` (Unix seconds), replacing what
/// `state_dir` held.
pub fn save<'a>(
    state_dir: &Path,
    node: &str,
    at: u64,
    findings: impl IntoIterator<Item = &'a Finding>,
) -> Result<(), SavedError> {
    let path = state_dir.join(FINDINGS_FILE);
    let out = SavedOut {
        version: FORMAT_VERSION,
        node,
        saved_at: at,
        findings: findings.into_iter().collect(),
    };
    let bytes = serde_json::to_vec(&out).map_err(|e| SavedError::Write {
        path: path.clone(),
        source: std::io::Error::other(e),
    })?;
    if bytes.len() > MAX_FINDINGS_BYTES {
        return Err(SavedError::TooLarge {
            path,
            len: bytes.len(),
            limit: MAX_FINDINGS_BYTES,
        });
    }
    write_private(&path, &bytes).map_err(|source| SavedError::Write { path, source })
}

/// Writes `bytes` to `path`, mode 0600, through a temporary file of this process that
/// is synced and renamed over `path`.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    // Left over by a crash of a process that had this id: created afresh with its mode.
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::findings::Scope;
    use probity::{Obligation, Severity};
    use serde_json::json;
    use std::collections::BTreeMap;
    use std::os::unix::fs::PermissionsExt;

    fn finding(policy: &str, since: u64) -> Finding {
        Finding {
            key: key_of("comply", "Node::\"n\"", policy),
            scope: Scope::Telemetry,
            action: "comply".into(),
            subject: "Node::\"n\"".into(),
            policy: policy.into(),
            severity: Severity::High,
            message: "too hot".into(),
            obligations: vec![Obligation {
                kind: "alert".into(),
                target: Some("Node::\"n\"".into()),
                parameters: BTreeMap::new(),
                policy: policy.into(),
            }],
            errors: Vec::new(),
            since,
            facts: json!({"node": {"attrs": {"hottestGpuTempC": 71}}}),
        }
    }

    #[test]
    fn saved_findings_load_as_they_were_in_a_private_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut elevation = finding("e", 5);
        elevation.scope = Scope::Elevation;
        elevation.errors = vec!["e: an error".into()];
        let saved = [finding("a", 10), elevation];
        save(dir.path(), "n", 20, &saved).unwrap();
        let back = load(dir.path(), "n").unwrap().unwrap();
        assert_eq!(back, saved);
        let mode = std::fs::metadata(dir.path().join(FINDINGS_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, [FINDINGS_FILE], "no temporary file left");
        // Saving none replaces them.
        save(dir.path(), "n", 30, &[]).unwrap();
        assert_eq!(load(dir.path(), "n").unwrap(), Some(Vec::new()));
    }

    #[test]
    fn nothing_saved_is_none() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load(dir.path(), "n").unwrap().is_none());
    }

    #[test]
    fn a_corrupt_file_is_located() {
        let p = Path::new("/s/agent-findings.json");
        let e = parse(
            p,
            b"{\"version\": 1,\n \"node\": \"n\", \"findings\": [{]}",
            "n",
        )
        .unwrap_err();
        assert!(matches!(e, SavedError::Parse { line: 2, .. }), "{e:?}");
        assert!(
            e.to_string().starts_with("/s/agent-findings.json:2:"),
            "{e}"
        );
        let e = parse(p, b"{\"version\": 1, \"node\": \"n\"}", "n").unwrap_err();
        assert!(
            e.to_string().contains("not the agent's saved findings"),
            "{e}"
        );
    }

    #[test]
    fn another_nodes_or_another_versions_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), "other", 1, &[finding("a", 1)]).unwrap();
        let e = load(dir.path(), "n").unwrap_err();
        assert!(matches!(&e, SavedError::OtherNode { node, .. } if node == "other"));
        let p = Path::new("f");
        let e = parse(p, br#"{"version": 2, "node": "n", "findings": []}"#, "n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "f: format version 2, this agent reads version 1"
        );
    }

    #[test]
    fn a_finding_filed_under_another_key_or_twice_is_refused() {
        let mut wrong = finding("a", 1);
        wrong.key = "comply|Node::\"n\"|b".into();
        for findings in [vec![wrong], vec![finding("a", 1), finding("a", 2)]] {
            let bytes = serde_json::to_vec(
                &json!({"version": 1, "node": "n", "saved_at": 1, "findings": findings}),
            )
            .unwrap();
            let e = parse(Path::new("f"), &bytes, "n").unwrap_err();
            assert!(matches!(e, SavedError::Inconsistent { .. }), "{e:?}");
        }
    }

    #[test]
    fn a_file_over_the_limit_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let big = vec![b' '; MAX_FINDINGS_BYTES + 1];
        std::fs::write(dir.path().join(FINDINGS_FILE), big).unwrap();
        let e = load(dir.path(), "n").unwrap_err();
        assert!(
            matches!(e, SavedError::Read(FileError::TooLarge { .. })),
            "{e:?}"
        );
    }
}

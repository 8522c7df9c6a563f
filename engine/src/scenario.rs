//! Policy test cases as data, run by `probity test` and by the test suite.
//!
//! A scenario file is JSON:
//!
//! ```json
//! {
//!   "policy": "security.blocked-node",
//!   "entities": "../entities/cluster.json",
//!   "cases": [
//!     { "name": "healthy node",
//!       "request": {"principal": "Workload::\"train\"", "action": "schedule", "resource": "Node::\"gpu-001\""},
//!       "expect": {"decision": "allow"} },
//!     { "name": "blocked node",
//!       "entities": [ ...entities that replace or add to the file's... ],
//!       "request": { ... },
//!       "expect": {"decision": "deny", "reasons": ["security.blocked-node"],
//!                  "obligations": [{"kind": "alert", "target": "Node::\"gpu-001\""}]} }
//!   ]
//! }
//! ```
//!
//! `entities` is an array of Cedar entities, or a path (relative to the scenario file)
//! to a JSON file holding one, or an array of such paths; a case's entities replace the file's with the same uid
//! and add to them. They are the case's *stored* facts: each case runs in a world of
//! its own (the engine's store and blocklist are neither read nor changed), where
//! `blocked` (file or case) lists the blocked nodes and `now` (file or case, Unix
//! seconds) is the engine's clock. A case's request is asked as an authorized fact
//! reporter unless the case says `"reporter": false` (to test what an ordinary caller
//! may not claim). `reasons` and `obligations`, when given, must match exactly (as
//! sets; an obligation's `parameters`, when given, must be exactly its `@param_*`s);
//! `errors` (default `false`) says whether evaluation errors are expected; `score`
//! (optional) is the decision's expected score; `warnings` and `audit` (optional) are
//! the ids of the `warn` and `audit` policies expected to fire, exactly.
//! `policy` names the rule the file covers.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::decision::{Decision, Effect};
use crate::engine::Engine;
use crate::request::Request;

/// Largest scenario or entities file read.
const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    #[serde(default)]
    policy: Option<String>,
    #[serde(default)]
    entities: Option<Value>,
    #[serde(default)]
    blocked: Vec<String>,
    #[serde(default)]
    now: Option<i64>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    #[serde(default)]
    entities: Vec<Value>,
    #[serde(default)]
    blocked: Option<Vec<String>>,
    #[serde(default)]
    now: Option<i64>,
    #[serde(default = "yes")]
    reporter: bool,
    request: Value,
    expect: Expect,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Expect {
    decision: Effect,
    #[serde(default)]
    reasons: Option<BTreeSet<String>>,
    #[serde(default)]
    obligations: Option<Vec<ExpectedObligation>>,
    #[serde(default)]
    errors: bool,
    /// The decision's score (the `@score`s of the permits that allowed it).
    #[serde(default)]
    score: Option<i64>,
    /// The `warn` policies that fired, exactly (as a set).
    #[serde(default)]
    warnings: Option<BTreeSet<String>>,
    /// The `audit` policies that fired, exactly (as a set).
    #[serde(default)]
    audit: Option<BTreeSet<String>>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ExpectedObligation {
    kind: String,
    #[serde(default)]
    target: Option<String>,
    /// When given, the obligation's parameters must be exactly these.
    #[serde(default)]
    parameters: Option<std::collections::BTreeMap<String, String>>,
}

/// The outcome of one case.
#[derive(Debug, Clone)]
pub struct CaseResult {
    /// The scenario file.
    pub file: PathBuf,
    /// The rule the file covers, if it names one.
    pub policy: Option<String>,
    /// The case's name.
    pub name: String,
    /// The decision the case expected.
    pub expected: Effect,
    /// `None` if the case passed, else what differed.
    pub failure: Option<String>,
}

impl CaseResult {
    /// True if the decision matched the expectation.
    pub fn passed(&self) -> bool {
        self.failure.is_none()
    }
}

impl fmt::Display for CaseResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.failure {
            None => write!(f, "ok      {} :: {}", self.file.display(), self.name),
            Some(why) => write!(f, "FAILED  {} :: {}: {why}", self.file.display(), self.name),
        }
    }
}

/// Why a scenario file could not be run at all.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("cannot read {}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a scenario.
    #[error("{}:{line}:{column}: not a valid scenario file", path.display())]
    Parse {
        /// The path.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The file is too big.
    #[error("{} is over {MAX_FILE_BYTES} bytes", path.display())]
    TooLarge {
        /// The path.
        path: PathBuf,
    },
    /// `entities` is neither an array nor a path to one.
    #[error("{}: entities must be an array of entities, a path to a file holding one, or an array of such paths", path.display())]
    Entities {
        /// The path.
        path: PathBuf,
    },
}

/// All `*.json` scenario files under `path` (or `path` itself if it is a file), sorted.
pub fn discover(path: &Path) -> Result<Vec<PathBuf>, ScenarioError> {
    let mut out = Vec::new();
    if path.is_file() {
        out.push(path.to_path_buf());
    } else {
        walk(path, &mut out)?;
    }
    out.sort();
    Ok(out)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), ScenarioError> {
    let io = |source| ScenarioError::Io {
        path: dir.to_path_buf(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.is_dir() {
            walk(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "json") {
            out.push(path);
        }
    }
    Ok(())
}

fn read_json(path: &Path) -> Result<Value, ScenarioError> {
    let io = |source| ScenarioError::Io {
        path: path.to_path_buf(),
        source,
    };
    if std::fs::metadata(path).map_err(io)?.len() > MAX_FILE_BYTES {
        return Err(ScenarioError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    let bytes = std::fs::read(path).map_err(io)?;
    serde_json::from_slice(&bytes).map_err(|source| ScenarioError::Parse {
        path: path.to_path_buf(),
        line: source.line(),
        column: source.column(),
        source,
    })
}

/// Runs every case of one scenario file against `engine`. The file's and the case's
/// entities are request-scoped: the engine's store is neither read for them nor changed.
pub fn run_file(engine: &Engine, path: &Path) -> Result<Vec<CaseResult>, ScenarioError> {
    let value = read_json(path)?;
    let file: ScenarioFile =
        serde_json::from_value(value).map_err(|source| ScenarioError::Parse {
            path: path.to_path_buf(),
            line: source.line(),
            column: source.column(),
            source,
        })?;
    let entities_file = |rel: &str| -> Result<Vec<Value>, ScenarioError> {
        let target = path.parent().unwrap_or(Path::new(".")).join(rel);
        match read_json(&target)? {
            Value::Array(a) => Ok(a),
            _ => Err(ScenarioError::Entities {
                path: path.to_path_buf(),
            }),
        }
    };
    let shared = match &file.entities {
        None => Vec::new(),
        // A list of paths: the files' entities, in order.
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => {
            let mut all = Vec::new();
            for rel in a.iter().filter_map(Value::as_str) {
                all.extend(entities_file(rel)?);
            }
            all
        }
        Some(Value::Array(a)) => a.clone(),
        Some(Value::String(rel)) => entities_file(rel)?,
        Some(_) => {
            return Err(ScenarioError::Entities {
                path: path.to_path_buf(),
            });
        }
    };
    Ok(file
        .cases
        .iter()
        .map(|case| CaseResult {
            file: path.to_path_buf(),
            policy: file.policy.clone(),
            name: case.name.clone(),
            expected: case.expect.decision,
            failure: run_case(engine, &file, &shared, case).err(),
        })
        .collect())
}

fn run_case(
    engine: &Engine,
    file: &ScenarioFile,
    shared: &[Value],
    case: &Case,
) -> Result<(), String> {
    let mut request =
        Request::from_json_value(&case.request).map_err(|e| format!("bad request: {e}"))?;
    if case.reporter {
        request = request.as_fact_reporter();
    }
    let key = |e: &Value| {
        let u = e.get("uid")?;
        let u = u.get("__entity").unwrap_or(u);
        Some((
            u.get("type")?.as_str()?.to_owned(),
            u.get("id")?.as_str()?.to_owned(),
        ))
    };
    let mut entities = shared.to_vec();
    for e in &case.entities {
        let k = key(e);
        match entities.iter().position(|x| k.is_some() && key(x) == k) {
            Some(i) => {
                if let Some(slot) = entities.get_mut(i) {
                    *slot = e.clone();
                }
            }
            None => entities.push(e.clone()),
        }
    }
    let blocked = case.blocked.as_ref().unwrap_or(&file.blocked);
    let decision = engine
        .decide_in_world(&request, &entities, blocked, case.now.or(file.now))
        .map_err(|e| format!("the case's entities were refused: {e}"))?;
    check(&decision, &case.expect)
}

fn check(d: &Decision, expect: &Expect) -> Result<(), String> {
    let mut problems = Vec::new();
    if d.decision != expect.decision {
        problems.push(format!("expected {}, got {}", expect.decision, d.decision));
    }
    if let Some(want) = expect.score
        && d.score != want
    {
        problems.push(format!("score {}, expected {want}", d.score));
    }
    if let Some(want) = &expect.reasons {
        let got: BTreeSet<String> = d.reason_ids().map(str::to_owned).collect();
        if &got != want {
            problems.push(format!("reasons {got:?}, expected {want:?}"));
        }
    }
    for (name, want, got) in [
        ("warnings", &expect.warnings, &d.warnings),
        ("audit", &expect.audit, &d.audit),
    ] {
        if let Some(want) = want {
            let got: BTreeSet<String> = got.iter().map(|n| n.policy.clone()).collect();
            if &got != want {
                problems.push(format!("{name} {got:?}, expected {want:?}"));
            }
        }
    }
    if let Some(want) = &expect.obligations {
        // An expected obligation without a target matches that kind at any target.
        let mut unmatched: Vec<&crate::decision::Obligation> = d.obligations.iter().collect();
        let mut missing = Vec::new();
        for w in want {
            let hit = unmatched.iter().position(|o| {
                o.kind == w.kind
                    && (w.target.is_none() || o.target == w.target)
                    && w.parameters.as_ref().is_none_or(|p| *p == o.parameters)
            });
            match hit {
                Some(i) => {
                    unmatched.remove(i);
                }
                None => missing.push(w),
            }
        }
        if !missing.is_empty() || !unmatched.is_empty() {
            let got: Vec<_> = d
                .obligations
                .iter()
                .map(|o| format!("{}({})", o.kind, o.target.as_deref().unwrap_or("-")))
                .collect();
            problems.push(format!(
                "obligations [{}], expected {want:?}",
                got.join(", ")
            ));
        }
    }
    if !d.errors.is_empty() && !expect.errors {
        let msgs: Vec<_> = d.errors.iter().map(|e| e.message.as_str()).collect();
        problems.push(format!("unexpected errors: {}", msgs.join("; ")));
    }
    if d.errors.is_empty() && expect.errors {
        problems.push("expected evaluation errors, got none".into());
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

//! Error types, one enum per area. Messages say what and where; a cause is
//! reached through `source()`, never repeated in the message.

use std::path::PathBuf;

use miette::Diagnostic;

use crate::diagnostic::SourceDiagnostic;

/// Why a policy set (policies, schema, configuration) could not be loaded.
#[derive(Debug, thiserror::Error, Diagnostic)]
pub enum LoadError {
    /// A file or directory could not be read.
    #[error("cannot read {}", path.display())]
    Io {
        /// The path that failed.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A source file is larger than the engine accepts.
    #[error("{} is {size} bytes, over the limit of {limit}", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// A source file is not UTF-8.
    #[error("{} is not UTF-8 (invalid byte at offset {offset})", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Offset of the first invalid byte.
        offset: usize,
    },
    /// The sources were read but are wrong: parse errors, schema violations,
    /// missing annotations. Every problem found is listed with its location.
    #[error("{}", summary(.problems))]
    Invalid {
        /// Each problem, located.
        #[related]
        problems: Vec<SourceDiagnostic>,
    },
    /// Sealed mode: the set does not match its seal (a file changed, added or missing),
    /// or the seal is not trusted (another key, altered, an older version). Every
    /// problem found is listed, located in `policy.seal`.
    #[error("policy set refused by its seal {}: {}", seal.display(), count(.problems))]
    Sealed {
        /// The seal file.
        seal: PathBuf,
        /// Each problem, located.
        #[related]
        problems: Vec<SourceDiagnostic>,
    },
    /// The files kept changing while the watcher waited for them to settle; the set
    /// was not read. The next change tries again.
    #[error(
        "the policy files kept changing for {rounds} rounds of {debounce_ms} ms ({} last); the previous set keeps serving",
        path.display()
    )]
    Unsettled {
        /// Rounds waited.
        rounds: u32,
        /// Length of a round, in milliseconds.
        debounce_ms: u64,
        /// A file seen changing in the last round.
        path: PathBuf,
    },
    /// The new set lacks a policy the live set marks `@required` (or the schema's
    /// `@block_policy`), or has it as a permit where it was a forbid: the live set
    /// keeps serving. Remove `@required` in one reload, then the policy in the next.
    #[error(
        "the new set drops required policies ({}): the previous set keeps serving; remove a policy's @required in one reload before removing the policy",
        ids.join(", ")
    )]
    RequiredDropped {
        /// The ids of the policies dropped.
        ids: Vec<String>,
    },
    /// A writer kept a policy file open (written, not closed) for longer than the
    /// watcher waits ([`crate::Settle::with_open_wait`]): it may be half-written, so the set
    /// was not read. Its close tries again.
    #[error(
        "{} is still open for writing after {waited_ms} ms; the set was not read and the previous set keeps serving",
        path.display()
    )]
    StillOpen {
        /// The file a writer has open.
        path: PathBuf,
        /// How long the watcher waited for it, in milliseconds.
        waited_ms: u64,
    },
}

fn summary(problems: &[SourceDiagnostic]) -> String {
    format!("policy set rejected: {}", count(problems))
}

fn count(problems: &[SourceDiagnostic]) -> String {
    match problems.len() {
        1 => "1 problem".to_owned(),
        n => format!("{n} problems"),
    }
}

impl LoadError {
    /// The error and every located problem, one per line: what status endpoints and logs show.
    pub fn detail(&self) -> String {
        let mut out = self.to_string();
        for p in self.problems() {
            out.push('\n');
            out.push_str(&p.to_string());
        }
        out
    }

    /// Every located problem, for callers that render them one by one.
    pub fn problems(&self) -> &[SourceDiagnostic] {
        match self {
            LoadError::Invalid { problems } | LoadError::Sealed { problems, .. } => problems,
            _ => &[],
        }
    }
}

/// Why a request could not be read.
#[derive(Debug, thiserror::Error, Diagnostic)]
pub enum RequestError {
    /// The request is larger than the engine accepts.
    #[error("request is {size} bytes, over the limit of {limit}")]
    TooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The bytes are not JSON.
    #[error("request is not valid JSON at line {line}, column {column}")]
    Json {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// The JSON is not an object of the expected shape.
    #[error("request {field}: expected {expected}, found {found}")]
    Shape {
        /// Which field (or `body`).
        field: &'static str,
        /// What was expected.
        expected: &'static str,
        /// What was found.
        found: String,
    },
    /// An entity reference is not `Type::"id"` nor `{"type": .., "id": ..}`.
    #[error("request {field}: {value} is not an entity reference (Type::\"id\")")]
    EntityUid {
        /// Which field.
        field: &'static str,
        /// The offending text.
        value: String,
    },
}

/// Why an entity update was refused. The store is unchanged when this is returned.
#[derive(Debug, thiserror::Error, Diagnostic)]
pub enum EntityError {
    /// The entities do not parse, or do not fit the schema.
    #[error("entities rejected: {detail}")]
    Invalid {
        /// What is wrong, naming the entity and attribute (the parser's whole chain).
        detail: String,
    },
    /// The entities are not a JSON array of entity objects.
    #[error("entities: expected a JSON array of entities, found {found}")]
    Shape {
        /// What was found.
        found: String,
    },
    /// The durable state store refused the change (a block or unblock); nothing changed.
    #[error("cannot record the change in the state store")]
    State(#[source] crate::state::StateError),
    /// A state store is already attached to this engine.
    #[error("a state store is already attached to this engine")]
    StateAlreadyAttached,
    /// The decision log's writer thread could not start.
    #[error("cannot start the decision log")]
    DecisionLog(#[source] std::io::Error),
    /// The update touches an entity that only the engine supplies (from probity.toml,
    /// or from the server's caller configuration).
    #[error(
        "{uid} is supplied by the engine ({owner}) and cannot be changed through the entity store"
    )]
    Reserved {
        /// The entity.
        uid: String,
        /// Who supplies it: `config` or `api`.
        owner: &'static str,
    },
    /// One entity of the update is malformed or does not fit the schema.
    #[error("entities[{index}]{}: {problem}", uid.as_ref().map(|u| format!(" ({u})")).unwrap_or_default())]
    Rejected {
        /// Its position in the update.
        index: usize,
        /// Its uid, when it has a readable one.
        uid: Option<String>,
        /// What is wrong, and where in the entity (`attrs.zone: ...`).
        problem: String,
    },
    /// The entities are not valid JSON.
    #[error("entities are not valid JSON at line {line}, column {column}: {detail}")]
    Json {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The parser's message.
        detail: String,
    },
    /// The update would make an entity its own ancestor.
    #[error("{uid}: its parents would make it its own ancestor")]
    Cycle {
        /// The entity.
        uid: String,
    },
    /// A node id that is not a node name.
    #[error(
        "{id:?} is not a node name (1-253 letters, digits, '-', '.' or '_', not starting or ending with '-' or '.')"
    )]
    NodeId {
        /// The id, truncated.
        id: String,
    },
    /// The policy set changed while the update was prepared (internal: retried).
    #[error("the policy set was reloaded while the update was prepared")]
    SchemaChanged,
}

/// Why the policy watcher could not start.
#[derive(Debug, thiserror::Error, Diagnostic)]
pub enum WatchError {
    /// The engine was built from embedded defaults: there is nothing on disk to watch.
    #[error("the engine runs on embedded defaults; there are no files to watch")]
    NothingToWatch,
    /// The file watcher failed.
    #[error("cannot watch {}", path.display())]
    Notify {
        /// The path.
        path: PathBuf,
        /// notify's error.
        #[source]
        source: notify::Error,
    },
}

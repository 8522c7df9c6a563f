//! A blocked node's record: why, since when, which pod read the bad data, what the
//! cluster manager must stop, and its later blocks.

/// Most earlier blocks a block record remembers.
const MAX_BLOCK_HISTORY: usize = 32;

/// What a block from a failed read stops: the reading workload's pods, or every pod on
/// the node (the policy's `@param_stop`).
pub const STOP_READER: &str = "reader";
/// See [`STOP_READER`].
pub const STOP_NODE: &str = "node";
/// The taint effects a policy's `@param_taint_effect` may ask for.
pub const TAINT_EFFECTS: [&str; 2] = ["NoSchedule", "NoExecute"];

/// Why a node is blocked, and since when.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BlockRecord {
    /// What blocked it first (a policy id, an operator's note).
    pub reason: String,
    /// When it was first blocked, in Unix seconds.
    pub since: u64,
    /// Later blocks of the node while it stayed blocked, oldest first (at most 32).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<BlockEvent>,
    /// The pod whose read of bad data caused the first block, when its reader named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reader: Option<ReaderPod>,
    /// What the cluster manager must stop: [`STOP_READER`] (the reading workload's
    /// pods) or [`STOP_NODE`] (every pod on the node). Absent: nothing beyond the block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<String>,
    /// The taint effect the policy asked for (`NoSchedule` or `NoExecute`); absent, the
    /// settings' default. `NoExecute` here says the policy opted in to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taint_effect: Option<String>,
    /// The store's number for this block, monotonic across the store's blocks and
    /// unblocks (etcd: its key's create revision; the local store: its own counter), so
    /// a record can be told apart from a replay of one the node's last unblock
    /// ([`crate::state::SharedState::block_tombstones`]) already lifted. Absent where no
    /// store numbered it (an engine without a state store, a block not yet shared).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
}

/// A block of an already blocked node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockEvent {
    /// Why.
    pub reason: String,
    /// When, in Unix seconds.
    pub at: u64,
    /// The pod that read bad data this time, if it named itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reader: Option<ReaderPod>,
}

/// The Kubernetes pod that read the data, as the reader named it (checked where it can
/// be: against a local caller's cgroup).
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ReaderPod {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The pod's uid, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// Why a [`ReaderPod`] is not a valid pod reference: the field and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reader.{field}: {problem}")]
pub struct ReaderPodError {
    /// `namespace`, `name` or `uid`.
    pub field: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

impl ReaderPod {
    /// A pod reference, checked: the namespace a DNS label (at most 63 bytes), the name
    /// a DNS subdomain (at most 253), the uid a UUID. Untrusted input is refused here,
    /// naming the field, before it reaches a record.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        uid: Option<String>,
    ) -> Result<Self, ReaderPodError> {
        let pod = Self {
            namespace: namespace.into(),
            name: name.into(),
            uid,
        };
        pod.validate()?;
        Ok(pod)
    }

    /// Reads `NAMESPACE/NAME[/UID]` (the CLI's form), checked as [`ReaderPod::new`].
    pub fn parse(text: &str) -> Result<Self, ReaderPodError> {
        let mut parts = text.splitn(3, '/');
        let (Some(namespace), Some(name)) = (parts.next(), parts.next()) else {
            return Err(ReaderPodError {
                field: "name",
                problem: format!("{:?} is not NAMESPACE/NAME[/UID]", shorten(text)),
            });
        };
        Self::new(namespace, name, parts.next().map(str::to_owned))
    }

    /// Checks the syntax of every field (see [`ReaderPod::new`]).
    pub fn validate(&self) -> Result<(), ReaderPodError> {
        check_dns(&self.namespace, 63, false).map_err(|problem| ReaderPodError {
            field: "namespace",
            problem,
        })?;
        check_dns(&self.name, 253, true).map_err(|problem| ReaderPodError {
            field: "name",
            problem,
        })?;
        if let Some(uid) = &self.uid
            && !is_uuid(uid)
        {
            return Err(ReaderPodError {
                field: "uid",
                problem: format!(
                    "{:?} is not a pod uid (a UUID, 36 characters)",
                    shorten(uid)
                ),
            });
        }
        Ok(())
    }
}

impl std::fmt::Display for ReaderPod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)?;
        if let Some(uid) = &self.uid {
            write!(f, " (uid {uid})")?;
        }
        Ok(())
    }
}

/// A DNS label (`dots == false`) or subdomain: lower case alphanumerics and `-` (and
/// `.` between labels), starting and ending alphanumeric, 1 to `max` bytes.
fn check_dns(text: &str, max: usize, dots: bool) -> Result<(), String> {
    if text.is_empty() {
        return Err("must not be empty".into());
    }
    if text.len() > max {
        return Err(format!("{} bytes, more than {max}", text.len()));
    }
    let label_ok = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    };
    let ok = if dots {
        text.split('.').all(label_ok)
    } else {
        label_ok(text)
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{:?} is not a {} (lower case letters, digits{}, `-` inside)",
            shorten(text),
            if dots { "DNS subdomain" } else { "DNS label" },
            if dots { ", `.` between labels" } else { "" },
        ))
    }
}

/// At most 80 characters of untrusted text, for a message.
fn shorten(text: &str) -> String {
    match text.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", text.get(..i).unwrap_or(text)),
        None => text.to_owned(),
    }
}

/// 8-4-4-4-12 hex digits, as Kubernetes writes pod uids.
fn is_uuid(text: &str) -> bool {
    let groups: Vec<&str> = text.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl BlockRecord {
    /// A new block.
    pub fn new(reason: impl Into<String>, since: u64) -> Self {
        Self {
            reason: reason.into(),
            since,
            history: Vec::new(),
            reader: None,
            stop: None,
            taint_effect: None,
            revision: None,
        }
    }

    /// This record with the reading pod, the stop scope and the taint effect of the
    /// block that made it.
    pub fn with_stop(
        mut self,
        reader: Option<ReaderPod>,
        stop: Option<String>,
        taint_effect: Option<String>,
    ) -> Self {
        self.reader = reader;
        self.stop = stop;
        self.taint_effect = taint_effect;
        self
    }

    /// This record after another block: the first reason, time, reader and stop scope
    /// stay, the new one joins the history.
    pub fn blocked_again(self, reason: impl Into<String>, at: u64) -> Self {
        self.blocked_again_by(reason, at, None)
    }

    /// [`BlockRecord::blocked_again`], noting the pod that read bad data this time.
    pub fn blocked_again_by(
        mut self,
        reason: impl Into<String>,
        at: u64,
        reader: Option<ReaderPod>,
    ) -> Self {
        if self.history.len() >= MAX_BLOCK_HISTORY {
            self.history.remove(0);
        }
        self.history.push(BlockEvent {
            reason: reason.into(),
            at,
            reader,
        });
        self
    }
}

impl BlockRecord {
    /// This record, written from one process's view, merged into `stored`, the record
    /// the store holds now (another process may have written it meanwhile): the stored
    /// first block (reason, time, reader, stop, taint effect, revision) stays; this
    /// record's first block, if it is another, and each of its later blocks the stored
    /// one lacks join the history, in time order (at most 32, oldest dropped). So two
    /// processes blocking one node at once lose neither block, nor the reader whose pod
    /// must be stopped.
    pub fn merged_into(self, stored: BlockRecord) -> BlockRecord {
        let mut out = stored;
        let mut offered = Vec::with_capacity(self.history.len() + 1);
        if (&self.reason, self.since, &self.reader) != (&out.reason, out.since, &out.reader) {
            offered.push(BlockEvent {
                reason: self.reason,
                at: self.since,
                reader: self.reader,
            });
        }
        offered.extend(self.history);
        for event in offered {
            if !out.history.contains(&event) {
                out.history.push(event);
            }
        }
        out.history.sort_by_key(|e| e.at);
        let excess = out.history.len().saturating_sub(MAX_BLOCK_HISTORY);
        out.history.drain(..excess);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_written_from_a_lagging_view_joins_the_stored_record_and_loses_nothing() {
        let reader = |name: &str| ReaderPod::new("train", name, None).unwrap();
        // What the store holds: the first block, by a reader whose pod must be stopped.
        let stored = BlockRecord::new("integrity.unverified-read", 10).with_stop(
            Some(reader("llm-0")),
            Some(STOP_READER.into()),
            None,
        );
        // Another process, not having seen it, blocked the node for its own reason.
        let theirs = BlockRecord::new("operator", 12);
        let merged = theirs.merged_into(stored.clone());
        assert_eq!(merged.reason, "integrity.unverified-read");
        assert_eq!(merged.reader, Some(reader("llm-0")));
        assert_eq!(merged.stop.as_deref(), Some(STOP_READER));
        assert_eq!(merged.history.len(), 1);
        assert_eq!(
            (merged.history[0].reason.as_str(), merged.history[0].at),
            ("operator", 12)
        );
        // A process that had seen it adds only its new block; merging twice is merging once.
        let seen = stored
            .clone()
            .blocked_again_by("again", 15, Some(reader("llm-1")));
        let merged = seen.clone().merged_into(merged);
        assert_eq!(
            merged.history.iter().map(|e| e.at).collect::<Vec<_>>(),
            [12, 15]
        );
        assert_eq!(seen.merged_into(merged.clone()), merged);
        // Bounded like any record.
        let mut many = stored.clone();
        for at in 0..40 {
            many = many.blocked_again(format!("b{at}"), 100 + at);
        }
        let merged = many.merged_into(stored.blocked_again("x", 11));
        assert_eq!(merged.history.len(), MAX_BLOCK_HISTORY);
        assert_eq!(merged.history.last().map(|e| e.at), Some(139));
    }

    const UID: &str = "3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b";

    #[test]
    fn old_block_records_without_reader_fields_still_read() {
        let old = br#"{"reason":"integrity.unverified-read: chunk 3","since":1700000000,"history":[{"reason":"again","at":1700000100}]}"#;
        let record: BlockRecord = serde_json::from_slice(old).unwrap();
        assert_eq!(record.reader, None);
        assert_eq!(record.stop, None);
        assert_eq!(record.taint_effect, None);
        assert_eq!(record.history[0].reader, None);
        // Written back, it is the same bytes: nothing new appears for an old record.
        assert_eq!(serde_json::to_vec(&record).unwrap(), old.to_vec());
    }

    #[test]
    fn block_record_fields_are_camel_case_and_survive_a_second_block() {
        let pod = ReaderPod::new("train", "job-0", Some(UID.into())).unwrap();
        let record = BlockRecord::new("integrity.unverified-read", 5).with_stop(
            Some(pod.clone()),
            Some(STOP_READER.into()),
            Some("NoExecute".into()),
        );
        let json = serde_json::to_value(&record).unwrap();
        assert_eq!(json["taintEffect"], "NoExecute");
        assert_eq!(json["stop"], "reader");
        assert_eq!(json["reader"]["uid"], UID);
        let other = ReaderPod::new("train", "job-1", None).unwrap();
        let again = record.blocked_again_by("again", 9, Some(other.clone()));
        assert_eq!(again.reader, Some(pod));
        assert_eq!(again.stop.as_deref(), Some("reader"));
        assert_eq!(again.history[0].reader, Some(other));
        let back: BlockRecord =
            serde_json::from_value(serde_json::to_value(&again).unwrap()).unwrap();
        assert_eq!(back, again);
    }

    #[test]
    fn reader_pods_are_checked_naming_the_field() {
        assert!(ReaderPod::parse("train/job-0").is_ok());
        assert_eq!(
            ReaderPod::parse(&format!("train/job-0/{UID}"))
                .unwrap()
                .uid
                .as_deref(),
            Some(UID)
        );
        let cases = [
            ("Train/job", "namespace"),
            ("train", "name"),
            ("/job", "namespace"),
            ("train/", "name"),
            ("train/job_0", "name"),
            ("train/job/not-a-uid", "uid"),
            (&format!("train/job/{UID}/x"), "uid"),
            (&format!("{}/job", "a".repeat(64)), "namespace"),
            (&format!("train/{}", "a".repeat(254)), "name"),
            ("train/job\n", "name"),
        ];
        for (text, field) in cases {
            let err = ReaderPod::parse(text).unwrap_err();
            assert_eq!(err.field, field, "{text:?}: {err}");
            assert!(
                err.to_string().starts_with(&format!("reader.{field}: ")),
                "{err}"
            );
        }
    }
}

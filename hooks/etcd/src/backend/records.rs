//! How the engine's state is written in etcd, and read back: one JSON record per key.
//!
//! Why this module exists: every value read from etcd is untrusted bytes (anything with
//! etcd credentials may write under the prefix), so each record has one decoder with a
//! size limit and an error that says where the record is wrong; nothing here panics on
//! any byte string. The layout, relative to the configured prefix:
//!
//! | key | value |
//! | --- | --- |
//! | `blocklist/<node>` | the engine's `BlockRecord` (reason, since, history; for a failed read, reader, stop, taintEffect) |
//! | `tombstones/<node>` | the node's name; its mod revision is the revision of the node's last unblock, written in the delete's transaction |
//! | `cluster/<entity id>` | one entity's cluster-owned facts, Cedar entity JSON (`{"uid": {"type", "id"}, "attrs"}`), as the controller sent them to any server |
//! | `registry/<object id>` | `{"version", "digest" (hex), "signed_manifest" (base64, absent when too large)}` |
//! | `keys/<key id>` | the key metadata record's bytes, as the keyring wrote them |
//! | `facts/<node>` | `NodeFacts`, under the publishing agent's lease |
//! | `digests/<process>` | `ServedDigest`, under the serving process's lease |
//! | `actions/<kind>/<node>/<policy>/<target>` | `ActionRequest` (a `migrate`), under the publishing agent's facts lease |

use base64::Engine as _;
use probity::BlockRecord;
use probity::state::{NodeFacts, RegistryEntry, ServedDigest};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Key prefix of the blocklist.
pub const BLOCKLIST: &str = "blocklist/";
/// Key prefix of unblock tombstones: `tombstones/<node>`'s mod revision is the
/// revision at which the node's block was last deleted.
pub const TOMBSTONES: &str = "tombstones/";
/// Key prefix of the cluster's facts (`cluster/<entity id>`).
pub const CLUSTER: &str = "cluster/";
/// Key prefix of the manifest registry.
pub const REGISTRY: &str = "registry/";
/// Key prefix of key metadata.
pub const KEYS: &str = "keys/";
/// Key prefix of node facts.
pub const FACTS: &str = "facts/";
/// Key prefix of admitted objects' facts (`admitted/<namespace>/<name>`), each under a
/// lease that ends them after the configured time.
pub const ADMITTED: &str = "admitted/";
/// Key prefix of served policy digests.
pub const DIGESTS: &str = "digests/";
/// Key prefix of action requests (`actions/<kind>/<node>/<policy>/<target>`), each
/// under its agent's facts lease.
pub const ACTIONS: &str = "actions/";

/// Largest record decoded, in bytes (etcd refuses requests over 1.5 MiB by default).
pub const MAX_RECORD_LEN: usize = 2 * 1024 * 1024;

/// Largest signed manifest kept inline in its registry record, in bytes: its base64 form
/// (4/3 larger) must fit etcd's request limit with room to spare. A larger manifest is
/// left out of the record: the registry's guarantees (versions only go up, one digest per
/// version) need only the version and the digest, and the manifest travels with the
/// object it describes.
pub const MAX_INLINE_MANIFEST: usize = 768 * 1024;

/// Why a record read from etcd is not what its key says it holds.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Longer than [`MAX_RECORD_LEN`].
    #[error("{len} bytes, more than the {limit} allowed")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// Not JSON of the expected shape.
    #[error("not a valid record at line {line}, column {column}")]
    Json {
        /// Line, from 1.
        line: usize,
        /// Column, from 1.
        column: usize,
        /// What the parser found.
        #[source]
        source: serde_json::Error,
    },
    /// A field holds a value it may not.
    #[error("field {field}: {problem}")]
    Field {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
}

fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, RecordError> {
    if bytes.len() > MAX_RECORD_LEN {
        return Err(RecordError::TooLarge {
            len: bytes.len(),
            limit: MAX_RECORD_LEN,
        });
    }
    serde_json::from_slice(bytes).map_err(|source| RecordError::Json {
        line: source.line(),
        column: source.column(),
        source,
    })
}

/// Reads a block record.
pub fn decode_block(bytes: &[u8]) -> Result<BlockRecord, RecordError> {
    parse(bytes)
}

/// Reads a node's facts published at `facts/<node>`: the record must name that node and
/// hold a JSON array of entities.
pub fn decode_facts(node: &str, bytes: &[u8]) -> Result<NodeFacts, RecordError> {
    let facts: NodeFacts = parse(bytes)?;
    if facts.node != node {
        return Err(RecordError::Field {
            field: "node",
            problem: format!("{:?} is published under the key of {node:?}", facts.node),
        });
    }
    if !facts.entities.is_array() {
        return Err(RecordError::Field {
            field: "entities",
            problem: "not a JSON array of entities".into(),
        });
    }
    Ok(facts)
}

/// Reads one entity's cluster facts, published under `cluster/<id>`: a Cedar entity
/// JSON object whose `uid.id` is that id (what it says is the engine's to judge when it
/// applies the set).
pub fn decode_cluster_entity(id: &str, bytes: &[u8]) -> Result<serde_json::Value, RecordError> {
    let entity: serde_json::Value = parse(bytes)?;
    let named = entity
        .pointer("/uid/id")
        .and_then(serde_json::Value::as_str);
    if named != Some(id) {
        return Err(RecordError::Field {
            field: "uid.id",
            problem: format!("{named:?} is published under the key of {id:?}"),
        });
    }
    Ok(entity)
}

/// Reads a served digest.
pub fn decode_digest(bytes: &[u8]) -> Result<ServedDigest, RecordError> {
    parse(bytes)
}

/// A registry record as stored: `version` and `digest` are what probity-etcd's versioned
/// compare-and-swap reads ([`crate::VersionHead`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryRecord {
    /// The accepted version.
    pub version: u64,
    /// The manifest digest, 64 lowercase hex digits.
    pub digest: String,
    /// The signed manifest, base64; absent when over [`MAX_INLINE_MANIFEST`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed_manifest: Option<String>,
}

impl RegistryRecord {
    /// The record of an accepted version.
    pub fn new(version: u64, digest: &[u8; 32], signed_manifest: &[u8]) -> Self {
        Self {
            version,
            digest: hex::encode(digest),
            signed_manifest: (signed_manifest.len() <= MAX_INLINE_MANIFEST)
                .then(|| base64::engine::general_purpose::STANDARD.encode(signed_manifest)),
        }
    }

    /// The digest as bytes.
    pub fn digest_bytes(&self) -> Result<[u8; 32], RecordError> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(&self.digest, &mut out).map_err(|e| RecordError::Field {
            field: "digest",
            problem: format!("not 64 hex digits: {e}"),
        })?;
        Ok(out)
    }
}

/// Reads a registry record into the engine's entry (an empty `signed_manifest` when the
/// record left it out).
pub fn decode_registry(bytes: &[u8]) -> Result<RegistryEntry, RecordError> {
    let record: RegistryRecord = parse(bytes)?;
    let digest = record.digest_bytes()?;
    let signed_manifest = match &record.signed_manifest {
        None => Vec::new(),
        Some(b64) => base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| RecordError::Field {
                field: "signed_manifest",
                problem: format!("not base64: {e}"),
            })?,
    };
    Ok(RegistryEntry {
        version: record.version,
        digest,
        signed_manifest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_records_round_trip_and_leave_out_large_manifests() {
        let small = RegistryRecord::new(7, &[0xab; 32], b"manifest");
        let bytes = serde_json::to_vec(&small).unwrap();
        let entry = decode_registry(&bytes).unwrap();
        assert_eq!(
            (
                entry.version,
                entry.digest,
                entry.signed_manifest.as_slice()
            ),
            (7, [0xab; 32], &b"manifest"[..])
        );
        let head = crate::VersionHead::parse(&bytes).unwrap();
        assert_eq!(head.version, 7);
        assert_eq!(head.digest.as_deref(), Some("ab".repeat(32).as_str()));
        let large = RegistryRecord::new(1, &[1; 32], &vec![0; MAX_INLINE_MANIFEST + 1]);
        assert!(large.signed_manifest.is_none());
        let entry = decode_registry(&serde_json::to_vec(&large).unwrap()).unwrap();
        assert!(entry.signed_manifest.is_empty());
    }

    /// The issue: block records gained the reader, stop and taint effect; records
    /// written before them still read, and the new fields round-trip.
    #[test]
    fn old_block_records_still_read_and_new_fields_round_trip() {
        let old = decode_block(br#"{"reason":"integrity.unverified-read: chunk 2","since":1700000000,"history":[{"reason":"again","at":1700000100}]}"#).unwrap();
        assert_eq!((old.reader, old.stop, old.taint_effect), (None, None, None));
        assert_eq!(old.history[0].reader, None);
        let pod = probity::ReaderPod::new(
            "train",
            "llm-0",
            Some("3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b".into()),
        )
        .unwrap();
        let new = BlockRecord::new("integrity.unverified-read", 5)
            .with_stop(Some(pod), Some("node".into()), Some("NoExecute".into()))
            .blocked_again_by("again", 6, None);
        let bytes = serde_json::to_vec(&new).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.contains(r#""taintEffect":"NoExecute""#), "{text}");
        assert_eq!(decode_block(&bytes).unwrap(), new);
    }

    #[test]
    fn record_errors_say_where_and_what() {
        let err = decode_registry(b"{\"version\": 1,\n \"digest\": \"zz\"}").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("field digest: not 64 hex digits"),
            "{err}"
        );
        let err = decode_block(b"{\n  \"reason\": 5}").unwrap_err();
        assert!(matches!(err, RecordError::Json { line: 2, .. }), "{err:?}");
        let facts = br#"{"node":"n2","entities":[],"collected_at":1,"ttl_seconds":5}"#;
        let err = decode_facts("n1", facts).unwrap_err();
        assert_eq!(
            err.to_string(),
            "field node: \"n2\" is published under the key of \"n1\""
        );
        let not_array = br#"{"node":"n1","entities":{},"collected_at":1,"ttl_seconds":5}"#;
        assert!(decode_facts("n1", not_array).is_err());
        assert!(decode_facts("n2", facts).is_ok());
        assert!(matches!(
            decode_digest(&vec![b' '; MAX_RECORD_LEN + 1]),
            Err(RecordError::TooLarge { .. })
        ));
    }

    /// Mutated records from a fixed-seed generator: never a panic, always a value or a
    /// located error.
    #[test]
    fn decoders_survive_mutated_records() {
        let seeds: [&[u8]; 4] = [
            br#"{"reason":"checkpoint tampered","since":1700000000,"history":[{"reason":"again","at":1700000100}]}"#,
            br#"{"version":12,"digest":"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08","signed_manifest":"UFJCVA=="}"#,
            br#"{"node":"gpu-001","entities":[{"uid":{"type":"Node","id":"gpu-001"},"attrs":{},"parents":[]}],"collected_at":5,"ttl_seconds":30}"#,
            br#"{"process":"webhook-0","digest":"abc","at":17}"#,
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut decoded = 0;
        for i in 0..4000_u64 {
            let mut record = seeds[(i % 4) as usize].to_vec();
            for _ in 0..=(next() % 3) {
                match next() % 4 {
                    0 => record.truncate((next() as usize) % (record.len() + 1)),
                    1 => {
                        if !record.is_empty() {
                            let at = (next() as usize) % record.len();
                            record[at] ^= 1 << (next() % 8);
                        }
                    }
                    2 => {
                        let copy = record.clone();
                        record.extend_from_slice(&copy);
                    }
                    _ => {
                        let at = (next() as usize) % (record.len() + 1);
                        record.insert(at, (next() & 0xff) as u8);
                    }
                }
            }
            let results = [
                decode_block(&record).map(|_| ()),
                decode_registry(&record).map(|_| ()),
                decode_facts("gpu-001", &record).map(|_| ()),
                decode_digest(&record).map(|_| ()),
            ];
            for r in results {
                match r {
                    Ok(()) => decoded += 1,
                    Err(RecordError::Json { line, column, .. }) => {
                        let lines = record.split(|b| *b == b'\n').count();
                        assert!(line >= 1 && line <= lines.max(1), "{record:?}");
                        let _ = column;
                    }
                    Err(RecordError::Field { .. }) => {}
                    Err(RecordError::TooLarge { .. }) => panic!("seeds are small"),
                }
            }
        }
        assert!(decoded > 0, "some mutations keep a record valid");
    }
}

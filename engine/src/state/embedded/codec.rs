//! The byte layouts of registry entries, blocks and events in the embedded store.

use crate::block::BlockRecord;

use super::*;

pub(in crate::state) fn check_against(
    object_id: &str,
    version: u64,
    digest: &[u8; 32],
    entry: &RegistryEntry,
) -> Result<(), StateError> {
    if version < entry.version {
        return Err(StateError::Rollback {
            object_id: object_id.to_owned(),
            offered: version,
            accepted: entry.version,
        });
    }
    if version == entry.version && digest != &entry.digest {
        return Err(StateError::DigestConflict {
            object_id: object_id.to_owned(),
            version,
        });
    }
    Ok(())
}

/// The sequence number after `last` (0 for an empty log), with room for `count` more:
/// a log whose numbers would overflow is reported as corrupt rather than wrap.
pub(super) fn next_seq(last: Option<u64>, count: usize) -> Result<u64, redb::Error> {
    let first = match last {
        None => 0,
        Some(last) => last.checked_add(1).ok_or_else(exhausted)?,
    };
    first
        .checked_add(count as u64)
        .ok_or_else(exhausted)
        .map(|_| first)
}

pub(super) fn exhausted() -> redb::Error {
    redb::Error::Corrupted("a log's sequence numbers are exhausted".into())
}

pub(super) fn encode_entry(version: u64, digest: &[u8; 32], signed: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(40 + signed.len());
    v.extend_from_slice(&version.to_be_bytes());
    v.extend_from_slice(digest);
    v.extend_from_slice(signed);
    v
}

pub(super) fn decode_entry(raw: &[u8]) -> Option<RegistryEntry> {
    let version = u64::from_be_bytes(raw.get(..8)?.try_into().ok()?);
    let digest: [u8; 32] = raw.get(8..40)?.try_into().ok()?;
    Some(RegistryEntry {
        version,
        digest,
        signed_manifest: raw.get(40..)?.to_vec(),
    })
}

pub(super) fn decode_block(node: &str, raw: &[u8]) -> Option<BlockedNode> {
    let record = if raw.first() == Some(&b'{') {
        serde_json::from_slice(raw).ok()?
    } else {
        // Stores written before block histories: 8 bytes of time, then the reason.
        let since = u64::from_be_bytes(raw.get(..8)?.try_into().ok()?);
        BlockRecord::new(String::from_utf8(raw.get(8..)?.to_vec()).ok()?, since)
    };
    Some(BlockedNode {
        node: node.to_owned(),
        record,
    })
}

pub(super) fn push_str(v: &mut Vec<u8>, s: &str) {
    v.extend_from_slice(&(s.len() as u32).to_be_bytes());
    v.extend_from_slice(s.as_bytes());
}

pub(crate) fn encode_event(
    time: u64,
    object_id: &str,
    node: Option<&str>,
    kind: &str,
    detail: &str,
) -> Vec<u8> {
    let mut v = time.to_be_bytes().to_vec();
    push_str(&mut v, object_id);
    match node {
        Some(n) => {
            v.push(1);
            push_str(&mut v, n);
        }
        None => v.push(0),
    }
    push_str(&mut v, kind);
    push_str(&mut v, detail);
    v
}

pub(crate) fn decode_event(seq: u64, raw: &[u8]) -> Option<Event> {
    fn string(raw: &[u8], pos: &mut usize) -> Option<String> {
        let len = u32::from_be_bytes(raw.get(*pos..*pos + 4)?.try_into().ok()?) as usize;
        let start = *pos + 4;
        let s = String::from_utf8(raw.get(start..start.checked_add(len)?)?.to_vec()).ok()?;
        *pos = start + len;
        Some(s)
    }
    let time_unix = u64::from_be_bytes(raw.get(..8)?.try_into().ok()?);
    let mut pos = 8;
    let object_id = string(raw, &mut pos)?;
    let has_node = *raw.get(pos)?;
    pos += 1;
    let node = if has_node == 1 {
        Some(string(raw, &mut pos)?)
    } else {
        None
    };
    let kind = string(raw, &mut pos)?;
    let detail = string(raw, &mut pos)?;
    Some(Event {
        seq,
        time_unix,
        object_id,
        node,
        kind,
        detail,
    })
}

pub(super) fn split_revision(raw: &[u8]) -> Option<(u64, &[u8])> {
    let rev = u64::from_be_bytes(raw.get(..8)?.try_into().ok()?);
    Some((rev, raw.get(8..)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The issue: block records gained the reader, stop and taint effect; a store
    /// written before them (JSON without them, or the older binary layout) still reads.
    #[test]
    fn block_records_from_before_the_reader_fields_still_decode() {
        let json = br#"{"reason":"integrity.unverified-read: chunk 2","since":1700000000}"#;
        let b = decode_block("gpu-a1", json).unwrap();
        assert_eq!(
            b.record,
            BlockRecord::new("integrity.unverified-read: chunk 2", 1700000000)
        );
        let mut binary = 1700000000u64.to_be_bytes().to_vec();
        binary.extend_from_slice(b"operator");
        let b = decode_block("gpu-a1", &binary).unwrap();
        assert_eq!((b.record.reader, b.record.stop), (None, None));
        let pod = crate::block::ReaderPod::new("train", "llm-0", None).unwrap();
        let new = BlockRecord::new("r", 1).with_stop(Some(pod), Some("reader".into()), None);
        let bytes = serde_json::to_vec(&new).unwrap();
        assert_eq!(decode_block("gpu-a1", &bytes).unwrap().record, new);
    }
}

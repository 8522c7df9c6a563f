//! The encrypted-object header: its fields, its canonical encoding and a parser of untrusted
//! bytes (see the layout in [`crate::stream`]).

use thiserror::Error;

use crate::meta::{KeyId, MAX_KEY_ID_LEN, check_id};

/// The first four bytes of every encrypted object.
pub const MAGIC: [u8; 4] = *b"PRBE";
/// The format version this crate writes and reads.
pub const FORMAT_VERSION: u16 = 1;
/// Smallest segment size accepted, in plaintext bytes.
pub const MIN_SEGMENT_SIZE: u32 = 16;
/// Largest segment size accepted, in plaintext bytes (16 MiB): bounds the memory a reader or
/// a worker thread needs whatever the header says.
pub const MAX_SEGMENT_SIZE: u32 = 16 * 1024 * 1024;
/// Longest object id, in bytes.
pub const MAX_OBJECT_ID_LEN: usize = 1024;
/// Length of the nonce prefix (and of each segment's object tag).
pub const NONCE_PREFIX_LEN: usize = 8;
/// Length of the wrap nonce.
pub const WRAP_NONCE_LEN: usize = 12;
/// Length of the wrapped per-object key: 32 bytes of key and a 16-byte GCM tag.
pub const WRAPPED_DEK_LEN: usize = 48;
/// Length of a GCM tag.
pub const TAG_LEN: usize = 16;
/// Bytes a segment adds to its plaintext: the 8-byte object tag and the 16-byte GCM tag.
pub const SEGMENT_OVERHEAD: usize = NONCE_PREFIX_LEN + TAG_LEN;
/// Header bytes besides the two ids: fixed fields, the two id lengths, the wrap nonce and
/// the wrapped key.
pub const HEADER_FIXED_LEN: usize = 40 + WRAP_NONCE_LEN + WRAPPED_DEK_LEN;
/// Longest possible header.
pub const MAX_HEADER_LEN: usize = HEADER_FIXED_LEN + MAX_KEY_ID_LEN + MAX_OBJECT_ID_LEN;
/// Most segments an object may have (the segment index is 32 bits in the nonce).
pub const MAX_SEGMENTS: u64 = 1 << 32;

/// The header of an encrypted object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub(crate) segment_size: u32,
    pub(crate) plaintext_len: u64,
    pub(crate) nonce_prefix: [u8; NONCE_PREFIX_LEN],
    pub(crate) sealed_version: u32,
    pub(crate) wrap_version: u32,
    pub(crate) key_id: KeyId,
    pub(crate) object_id: String,
    pub(crate) wrap_nonce: [u8; WRAP_NONCE_LEN],
    pub(crate) wrapped_dek: [u8; WRAPPED_DEK_LEN],
}

/// Why header bytes are not a valid header. Each names the field and its byte offset.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum HeaderError {
    /// The bytes end before the header does.
    #[error(
        "encrypted-object header is truncated: {field} at byte offset {offset} needs {needed} bytes, {available} available"
    )]
    Truncated {
        /// The field that does not fit.
        field: &'static str,
        /// Its offset.
        offset: usize,
        /// Bytes it needs.
        needed: usize,
        /// Bytes left.
        available: usize,
    },
    /// A field holds a value the format does not allow.
    #[error("encrypted-object header: {field} at byte offset {offset} is invalid: {problem}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Its offset.
        offset: usize,
        /// What is wrong.
        problem: String,
    },
}

impl HeaderError {
    /// The byte offset of the offending field.
    pub fn offset(&self) -> usize {
        match self {
            Self::Truncated { offset, .. } | Self::Invalid { offset, .. } => *offset,
        }
    }
}

/// A cursor over untrusted bytes that reports the field and offset of every failure.
struct Fields<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Fields<'a> {
    fn take(&mut self, field: &'static str, n: usize) -> Result<&'a [u8], HeaderError> {
        let end = self.at.checked_add(n);
        match end.and_then(|end| self.bytes.get(self.at..end)) {
            Some(s) => {
                self.at += n;
                Ok(s)
            }
            None => Err(HeaderError::Truncated {
                field,
                offset: self.at,
                needed: n,
                available: self.bytes.len().saturating_sub(self.at),
            }),
        }
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], HeaderError> {
        let s = self.take(field, N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, HeaderError> {
        Ok(u16::from_be_bytes(self.array(field)?))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, HeaderError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, HeaderError> {
        Ok(u64::from_be_bytes(self.array(field)?))
    }
}

fn invalid(field: &'static str, offset: usize, problem: impl Into<String>) -> HeaderError {
    HeaderError::Invalid {
        field,
        offset,
        problem: problem.into(),
    }
}

/// Number of segments of an object of `plaintext_len` bytes: at least one (an empty object
/// is one empty final segment).
pub(crate) fn segment_count(plaintext_len: u64, segment_size: u32) -> u64 {
    plaintext_len
        .div_ceil(u64::from(segment_size.max(1)))
        .max(1)
}

/// Checks a segment size against the format's bounds.
pub(crate) fn check_segment_size(segment_size: u32) -> Result<(), String> {
    if !(MIN_SEGMENT_SIZE..=MAX_SEGMENT_SIZE).contains(&segment_size) {
        return Err(format!(
            "segment size {segment_size} is outside {MIN_SEGMENT_SIZE}..={MAX_SEGMENT_SIZE}"
        ));
    }
    Ok(())
}

impl Header {
    /// Parses a header from the start of `bytes` (which may continue with segments), and
    /// returns it with its length. Never panics; reads at most [`MAX_HEADER_LEN`] bytes.
    pub fn parse(bytes: &[u8]) -> Result<(Self, usize), HeaderError> {
        let mut f = Fields { bytes, at: 0 };
        let magic: [u8; 4] = f.array("magic")?;
        if magic != MAGIC {
            return Err(invalid(
                "magic",
                0,
                format!("found {magic:02x?}, expected \"PRBE\": not a Probity encrypted object"),
            ));
        }
        let format = f.u16("format version")?;
        if format != FORMAT_VERSION {
            return Err(invalid(
                "format version",
                4,
                format!("version {format} is not supported (this build reads {FORMAT_VERSION})"),
            ));
        }
        let header_len = usize::from(f.u16("header length")?);
        if !(HEADER_FIXED_LEN + 2..=MAX_HEADER_LEN).contains(&header_len) {
            return Err(invalid(
                "header length",
                6,
                format!(
                    "{header_len} is outside {}..={MAX_HEADER_LEN}",
                    HEADER_FIXED_LEN + 2
                ),
            ));
        }
        let segment_size = f.u32("segment size")?;
        check_segment_size(segment_size).map_err(|p| invalid("segment size", 8, p))?;
        let plaintext_len = f.u64("plaintext length")?;
        if segment_count(plaintext_len, segment_size) > MAX_SEGMENTS {
            return Err(invalid(
                "plaintext length",
                12,
                format!(
                    "{plaintext_len} bytes need more than 2^32 segments of {segment_size} bytes"
                ),
            ));
        }
        let nonce_prefix = f.array("nonce prefix")?;
        let sealed_version = f.u32("sealed key version")?;
        let wrap_version = f.u32("wrap key version")?;
        for (field, offset, v) in [
            ("sealed key version", 28, sealed_version),
            ("wrap key version", 32, wrap_version),
        ] {
            if v == 0 {
                return Err(invalid(field, offset, "key versions start at 1"));
            }
        }
        let key_len_at = f.at;
        let key_len = usize::from(f.u16("key id length")?);
        if key_len == 0 || key_len > MAX_KEY_ID_LEN {
            return Err(invalid(
                "key id length",
                key_len_at,
                format!("{key_len} is outside 1..={MAX_KEY_ID_LEN}"),
            ));
        }
        let key_at = f.at;
        let key_bytes = f.take("key id", key_len)?;
        let key_id = std::str::from_utf8(key_bytes)
            .map_err(|e| invalid("key id", key_at, format!("not UTF-8: {e}")))
            .and_then(|s| KeyId::new(s).map_err(|e| invalid("key id", key_at, e.reason)))?;
        let object_len_at = f.at;
        let object_len = usize::from(f.u16("object id length")?);
        if object_len == 0 || object_len > MAX_OBJECT_ID_LEN {
            return Err(invalid(
                "object id length",
                object_len_at,
                format!("{object_len} is outside 1..={MAX_OBJECT_ID_LEN}"),
            ));
        }
        let object_at = f.at;
        let object_bytes = f.take("object id", object_len)?;
        let object_id = std::str::from_utf8(object_bytes)
            .map_err(|e| invalid("object id", object_at, format!("not UTF-8: {e}")))?
            .to_owned();
        check_id("object id", &object_id, MAX_OBJECT_ID_LEN)
            .map_err(|e| invalid("object id", object_at, e.reason))?;
        let expected_len = HEADER_FIXED_LEN + key_len + object_len;
        if header_len != expected_len {
            return Err(invalid(
                "header length",
                6,
                format!("says {header_len}, but its fields take {expected_len}"),
            ));
        }
        let wrap_nonce = f.array("wrap nonce")?;
        let wrapped_dek = f.array("wrapped object key")?;
        Ok((
            Self {
                segment_size,
                plaintext_len,
                nonce_prefix,
                sealed_version,
                wrap_version,
                key_id,
                object_id,
                wrap_nonce,
                wrapped_dek,
            },
            header_len,
        ))
    }

    /// The canonical encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.authenticated_prefix();
        out.extend_from_slice(&self.wrapped_dek);
        out
    }

    /// The header bytes that the wrapped key's GCM tag authenticates: everything before
    /// the wrapped key.
    pub(crate) fn authenticated_prefix(&self) -> Vec<u8> {
        let len = self.len();
        let mut out = Vec::with_capacity(len);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_be_bytes());
        out.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_be_bytes());
        out.extend_from_slice(&self.segment_size.to_be_bytes());
        out.extend_from_slice(&self.plaintext_len.to_be_bytes());
        out.extend_from_slice(&self.nonce_prefix);
        out.extend_from_slice(&self.sealed_version.to_be_bytes());
        out.extend_from_slice(&self.wrap_version.to_be_bytes());
        push_id(&mut out, self.key_id.as_str());
        push_id(&mut out, &self.object_id);
        out.extend_from_slice(&self.wrap_nonce);
        out
    }

    /// The encoded length.
    pub fn len(&self) -> usize {
        HEADER_FIXED_LEN + self.key_id.as_str().len() + self.object_id.len()
    }

    /// Always false: a header is never empty (here for clippy's `len_without_is_empty`).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The keyring key.
    pub fn key_id(&self) -> &KeyId {
        &self.key_id
    }

    /// The object id.
    pub fn object_id(&self) -> &str {
        &self.object_id
    }

    /// The key version the object was sealed under (bound into every segment; never changes).
    pub fn sealed_version(&self) -> u32 {
        self.sealed_version
    }

    /// The key version whose data key wraps the object key (changes on rewrap).
    pub fn wrap_version(&self) -> u32 {
        self.wrap_version
    }

    /// Plaintext bytes per segment.
    pub fn segment_size(&self) -> u32 {
        self.segment_size
    }

    /// The plaintext length.
    pub fn plaintext_len(&self) -> u64 {
        self.plaintext_len
    }

    /// The number of segments.
    pub fn segment_count(&self) -> u64 {
        segment_count(self.plaintext_len, self.segment_size)
    }

    /// The ciphertext length the header implies (header and every segment).
    pub fn ciphertext_len(&self) -> u64 {
        let n = self.segment_count();
        self.len() as u64 + self.plaintext_len + n * SEGMENT_OVERHEAD as u64
    }
}

fn push_id(out: &mut Vec<u8>, id: &str) {
    out.extend_from_slice(&u16::try_from(id.len()).unwrap_or(u16::MAX).to_be_bytes());
    out.extend_from_slice(id.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Header {
        Header {
            segment_size: 64,
            plaintext_len: 130,
            nonce_prefix: [1; 8],
            sealed_version: 2,
            wrap_version: 3,
            key_id: KeyId::new("dataset/x").unwrap(),
            object_id: "obj/1".into(),
            wrap_nonce: [2; 12],
            wrapped_dek: [3; 48],
        }
    }

    #[test]
    fn round_trips_and_locates_errors() {
        let h = sample();
        let bytes = h.encode();
        assert_eq!(bytes.len(), h.len());
        assert_eq!(bytes.len(), 100 + 9 + 5);
        let mut with_tail = bytes.clone();
        with_tail.extend_from_slice(b"segments...");
        assert_eq!(Header::parse(&with_tail).unwrap(), (h.clone(), bytes.len()));
        assert_eq!(h.segment_count(), 3);
        assert_eq!(h.ciphertext_len(), bytes.len() as u64 + 130 + 3 * 24);

        let err = Header::parse(&bytes[..40]).unwrap_err();
        assert!(
            matches!(
                err,
                HeaderError::Truncated {
                    field: "key id",
                    offset: 38,
                    ..
                }
            ),
            "{err}"
        );
        let mut zero_seg = bytes.clone();
        zero_seg[8..12].copy_from_slice(&0u32.to_be_bytes());
        let err = Header::parse(&zero_seg).unwrap_err();
        assert_eq!(err.offset(), 8);
        assert!(err.to_string().contains("segment size 0"), "{err}");
        let mut bad_len = bytes.clone();
        bad_len[7] ^= 1;
        assert!(
            Header::parse(&bad_len)
                .unwrap_err()
                .to_string()
                .contains("header length")
        );
    }

    #[test]
    fn empty_object_has_one_segment() {
        assert_eq!(segment_count(0, 64), 1);
        assert_eq!(segment_count(64, 64), 1);
        assert_eq!(segment_count(65, 64), 2);
    }
}

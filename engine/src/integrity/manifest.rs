//! The manifest: what an object must hash to, chunk by chunk, in a canonical encoding.
//!
//! # Construction
//!
//! The object is cut into fixed chunks of `chunk_size` bytes (the last chunk may be shorter).
//! An object of `size` bytes has `ceil(size / chunk_size)` chunks; a 0-byte object has none.
//!
//! * **Leaf** `L[i]` = `SHA-256(chunk[i])`: the plain SHA-256 of the chunk bytes, so the leaf of a
//!   one-chunk object equals `sha256sum` of the file.
//! * **Tree** (RFC 6962, section 2.1, with the leaf hashes as the tree's inputs):
//!   * leaf node `N(i)` = `SHA-256(0x00 || L[i])`
//!   * interior node = `SHA-256(0x01 || left || right)`
//!   * for `n > 1` inputs, the left subtree holds the largest power of two `k < n` inputs and the
//!     right subtree the remaining `n - k`. Equivalently, built level by level: nodes are paired
//!     left to right and an odd last node is **promoted unchanged** to the next level (never
//!     duplicated, so two different leaf lists never share a root).
//!   * the **empty object** (no chunks) has root `SHA-256("")`, as RFC 6962 defines `MTH({})`.
//!
//! # Canonical encoding (format version 1, all integers big-endian)
//!
//! | field         | bytes | rule                                                        |
//! |---------------|-------|-------------------------------------------------------------|
//! | magic         | 4     | `PRBM`                                                      |
//! | format        | 2     | `1`                                                         |
//! | algorithm     | 1     | `1` = SHA-256 leaves, RFC 6962 tree                          |
//! | id length     | 2     | 1 ..= [`MAX_OBJECT_ID_LEN`]                                  |
//! | object id     | n     | UTF-8, no control characters                                |
//! | version       | 8     | any `u64`                                                   |
//! | size          | 8     | object size in bytes                                        |
//! | chunk size    | 4     | [`MIN_CHUNK_SIZE`] ..= [`MAX_CHUNK_SIZE`]                    |
//! | root          | 32    | must equal the root computed from the leaves                |
//! | leaf count    | 8     | must equal `ceil(size / chunk size)`                        |
//! | leaves        | 32 × count | nothing may follow                                     |
//!
//! The decoder is strict: any deviation is a [`ManifestError`], never a panic, and it never
//! allocates more than the input's length. The manifest digest is `SHA-256` of this encoding.

use sha2::{Digest as _, Sha256};
use thiserror::Error;

/// A SHA-256 value (leaf, node, root or manifest digest).
pub type Hash = [u8; 32];

/// Magic bytes opening an encoded manifest.
pub const MANIFEST_MAGIC: [u8; 4] = *b"PRBM";
/// The only manifest format version this build reads and writes.
pub const MANIFEST_FORMAT: u16 = 1;
/// Default chunk size: 4 MiB.
pub(crate) const DEFAULT_CHUNK_SIZE: u32 = 4 * 1024 * 1024;
/// Smallest chunk size accepted: 1 KiB.
pub const MIN_CHUNK_SIZE: u32 = 1024;
/// Largest chunk size accepted: 1 GiB.
pub const MAX_CHUNK_SIZE: u32 = 1024 * 1024 * 1024;
/// Longest object id accepted, in bytes.
pub const MAX_OBJECT_ID_LEN: usize = 1024;

/// The hash construction of a manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// SHA-256 of each chunk as leaves, RFC 6962 Merkle tree (see the module docs).
    Sha256Rfc6962,
}

impl Algorithm {
    fn code(self) -> u8 {
        match self {
            Self::Sha256Rfc6962 => 1,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Self::Sha256Rfc6962),
            _ => None,
        }
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Sha256Rfc6962 => f.write_str("sha256-rfc6962"),
        }
    }
}

/// Why a manifest could not be built or decoded.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ManifestError {
    /// The input ended inside a field.
    #[error("manifest ends at byte {offset} inside the {field} field ({needed} more bytes needed)")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Byte offset where the field starts.
        offset: usize,
        /// Bytes missing.
        needed: usize,
    },
    /// The magic bytes are wrong: this is not a manifest.
    #[error("not a probity manifest: bad magic bytes at offset 0")]
    BadMagic,
    /// The format version is not one this build reads.
    #[error("unsupported manifest format version {0} (this build reads version 1)")]
    UnsupportedFormat(u16),
    /// The algorithm code is unknown.
    #[error("unknown manifest algorithm code {0} at byte 6")]
    UnknownAlgorithm(u8),
    /// The object id is empty, too long, not UTF-8 or holds control characters.
    #[error("invalid object id: {reason}")]
    InvalidObjectId {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The chunk size is out of range.
    #[error("chunk size {0} is outside {MIN_CHUNK_SIZE}..={MAX_CHUNK_SIZE} bytes")]
    InvalidChunkSize(u64),
    /// The leaf count does not match the size and chunk size.
    #[error(
        "manifest lists {found} leaves but an object of {size} bytes in chunks of {chunk_size} has {expected}"
    )]
    LeafCountMismatch {
        /// Leaves listed.
        found: u64,
        /// Leaves implied by size and chunk size.
        expected: u64,
        /// Object size.
        size: u64,
        /// Chunk size.
        chunk_size: u32,
    },
    /// The bytes after the leaf count are not exactly `32 × count` long.
    #[error("manifest leaf section at byte {offset} is {found} bytes long, expected {expected}")]
    LeafSectionLength {
        /// Offset of the leaf section.
        offset: usize,
        /// Bytes present.
        found: usize,
        /// Bytes required.
        expected: u64,
    },
    /// The stored root does not match the root computed from the leaves.
    #[error("manifest root does not match its leaves")]
    RootMismatch,
}

/// A manifest: object identity and version, and the hashes its bytes must produce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    object_id: String,
    version: u64,
    size: u64,
    chunk_size: u32,
    algorithm: Algorithm,
    root: Hash,
    leaves: Vec<Hash>,
}

impl Manifest {
    /// The chunk size sealing uses unless told otherwise (4 MiB).
    pub const DEFAULT_CHUNK_SIZE: u32 = DEFAULT_CHUNK_SIZE;

    /// Builds a manifest from chunk leaves, computing the root.
    ///
    /// Fails if the id is invalid, the chunk size out of range or the leaf count does not match
    /// `ceil(size / chunk_size)`.
    pub fn new(
        object_id: &str,
        version: u64,
        size: u64,
        chunk_size: u32,
        leaves: Vec<Hash>,
    ) -> Result<Self, ManifestError> {
        check_object_id(object_id.as_bytes())?;
        check_chunk_size(chunk_size)?;
        let expected = Manifest::chunks_for(size, chunk_size);
        let found = leaves.len() as u64;
        if found != expected {
            return Err(ManifestError::LeafCountMismatch {
                found,
                expected,
                size,
                chunk_size,
            });
        }
        Ok(Self {
            object_id: object_id.to_owned(),
            version,
            size,
            chunk_size,
            algorithm: Algorithm::Sha256Rfc6962,
            root: merkle_root(&leaves),
            leaves,
        })
    }

    /// The object id.
    pub fn object_id(&self) -> &str {
        &self.object_id
    }
    /// The object version.
    pub fn version(&self) -> u64 {
        self.version
    }
    /// The object size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
    /// The chunk size in bytes.
    pub fn chunk_size(&self) -> u32 {
        self.chunk_size
    }
    /// The hash construction.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }
    /// The Merkle root.
    pub fn root(&self) -> &Hash {
        &self.root
    }
    /// The chunk leaves (SHA-256 of each chunk), in order.
    pub fn leaves(&self) -> &[Hash] {
        &self.leaves
    }
    /// The number of chunks.
    pub fn chunk_count(&self) -> u64 {
        self.leaves.len() as u64
    }
    /// Byte offset where chunk `index` starts.
    pub fn chunk_offset(&self, index: u64) -> u64 {
        index.saturating_mul(u64::from(self.chunk_size))
    }
    /// Length in bytes of chunk `index` (0 past the end).
    pub fn chunk_len(&self, index: u64) -> u64 {
        let start = self.chunk_offset(index);
        self.size
            .saturating_sub(start)
            .min(u64::from(self.chunk_size))
    }

    /// The canonical encoding (see the module docs).
    pub fn encode(&self) -> Vec<u8> {
        let id = self.object_id.as_bytes();
        let mut out = Vec::with_capacity(69 + id.len() + 32 * self.leaves.len());
        out.extend_from_slice(&MANIFEST_MAGIC);
        out.extend_from_slice(&MANIFEST_FORMAT.to_be_bytes());
        out.push(self.algorithm.code());
        // The id length was checked at construction (<= MAX_OBJECT_ID_LEN < u16::MAX).
        out.extend_from_slice(&u16::try_from(id.len()).unwrap_or(u16::MAX).to_be_bytes());
        out.extend_from_slice(id);
        out.extend_from_slice(&self.version.to_be_bytes());
        out.extend_from_slice(&self.size.to_be_bytes());
        out.extend_from_slice(&self.chunk_size.to_be_bytes());
        out.extend_from_slice(&self.root);
        out.extend_from_slice(&(self.leaves.len() as u64).to_be_bytes());
        for leaf in &self.leaves {
            out.extend_from_slice(leaf);
        }
        out
    }

    /// The manifest digest: SHA-256 of [`Manifest::encode`].
    pub fn digest(&self) -> Hash {
        sha256(&self.encode())
    }

    /// Decodes a canonical encoding strictly: wrong magic, format, algorithm, id, chunk size,
    /// leaf count, leaf section length, root, or trailing bytes are all errors.
    pub fn decode(bytes: &[u8]) -> Result<Self, ManifestError> {
        let mut r = Cursor { bytes, pos: 0 };
        if r.take("magic", 4)? != MANIFEST_MAGIC {
            return Err(ManifestError::BadMagic);
        }
        let format = r.u16("format version")?;
        if format != MANIFEST_FORMAT {
            return Err(ManifestError::UnsupportedFormat(format));
        }
        let code = r.u8("algorithm")?;
        let algorithm = Algorithm::from_code(code).ok_or(ManifestError::UnknownAlgorithm(code))?;
        let id_len = usize::from(r.u16("object id length")?);
        if id_len > MAX_OBJECT_ID_LEN {
            return Err(ManifestError::InvalidObjectId {
                reason: "longer than 1024 bytes",
            });
        }
        let id = r.take("object id", id_len)?;
        let object_id = check_object_id(id)?.to_owned();
        let version = r.u64("version")?;
        let size = r.u64("size")?;
        let chunk_size = r.u32("chunk size")?;
        check_chunk_size(chunk_size)?;
        let root: Hash = r.array("root")?;
        let count = r.u64("leaf count")?;
        let expected = Manifest::chunks_for(size, chunk_size);
        if count != expected {
            return Err(ManifestError::LeafCountMismatch {
                found: count,
                expected,
                size,
                chunk_size,
            });
        }
        let rest = r.rest();
        let expected_len = count.checked_mul(32);
        if expected_len != Some(rest.len() as u64) {
            return Err(ManifestError::LeafSectionLength {
                offset: r.pos,
                found: rest.len(),
                expected: expected_len.unwrap_or(u64::MAX),
            });
        }
        let leaves: Vec<Hash> = rest
            .chunks_exact(32)
            .map(|c| {
                let mut h = [0u8; 32];
                h.copy_from_slice(c);
                h
            })
            .collect();
        if merkle_root(&leaves) != root {
            return Err(ManifestError::RootMismatch);
        }
        Ok(Self {
            object_id,
            version,
            size,
            chunk_size,
            algorithm,
            root,
            leaves,
        })
    }
}

impl Manifest {
    /// Number of chunks of an object of `size` bytes: `ceil(size / chunk_size)`.
    pub fn chunks_for(size: u64, chunk_size: u32) -> u64 {
        let cs = u64::from(chunk_size.max(1));
        size.div_ceil(cs)
    }
}

/// SHA-256 of `data`.
pub fn sha256(data: &[u8]) -> Hash {
    Sha256::digest(data).into()
}

/// The RFC 6962 Merkle root over chunk leaves (see the module docs for the exact construction).
pub fn merkle_root(leaves: &[Hash]) -> Hash {
    if leaves.is_empty() {
        return sha256(&[]);
    }
    let mut level: Vec<Hash> = leaves
        .iter()
        .map(|leaf| {
            let mut h = Sha256::new();
            h.update([0x00]);
            h.update(leaf);
            h.finalize().into()
        })
        .collect();
    while level.len() > 1 {
        level = level
            .chunks(2)
            .map(|pair| match pair {
                [left, right] => {
                    let mut h = Sha256::new();
                    h.update([0x01]);
                    h.update(left);
                    h.update(right);
                    h.finalize().into()
                }
                // An odd last node is promoted unchanged.
                [single] => *single,
                _ => [0u8; 32],
            })
            .collect();
    }
    level.first().copied().unwrap_or_default()
}

pub(crate) fn check_object_id(id: &[u8]) -> Result<&str, ManifestError> {
    if id.is_empty() {
        return Err(ManifestError::InvalidObjectId { reason: "empty" });
    }
    if id.len() > MAX_OBJECT_ID_LEN {
        return Err(ManifestError::InvalidObjectId {
            reason: "longer than 1024 bytes",
        });
    }
    let s = std::str::from_utf8(id).map_err(|_| ManifestError::InvalidObjectId {
        reason: "not UTF-8",
    })?;
    if s.chars().any(char::is_control) {
        return Err(ManifestError::InvalidObjectId {
            reason: "contains control characters",
        });
    }
    Ok(s)
}

pub(crate) fn check_chunk_size(chunk_size: u32) -> Result<(), ManifestError> {
    if (MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&chunk_size) {
        Ok(())
    } else {
        Err(ManifestError::InvalidChunkSize(u64::from(chunk_size)))
    }
}

/// A bounds-checked big-endian reader over a byte slice.
pub(crate) struct Cursor<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn take(
        &mut self,
        field: &'static str,
        n: usize,
    ) -> Result<&'a [u8], ManifestError> {
        let end = self.pos.checked_add(n);
        match end.and_then(|end| self.bytes.get(self.pos..end)) {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(ManifestError::Truncated {
                field,
                offset: self.pos,
                needed: n.saturating_sub(self.bytes.len().saturating_sub(self.pos)),
            }),
        }
    }
    pub(crate) fn array<const N: usize>(
        &mut self,
        field: &'static str,
    ) -> Result<[u8; N], ManifestError> {
        let s = self.take(field, N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8, ManifestError> {
        Ok(u8::from_be_bytes(self.array(field)?))
    }
    pub(crate) fn u16(&mut self, field: &'static str) -> Result<u16, ManifestError> {
        Ok(u16::from_be_bytes(self.array(field)?))
    }
    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32, ManifestError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }
    pub(crate) fn u64(&mut self, field: &'static str) -> Result<u64, ManifestError> {
        Ok(u64::from_be_bytes(self.array(field)?))
    }
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        let rest = self.bytes.get(self.pos..).unwrap_or_default();
        self.pos = self.bytes.len();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(l: &Hash, r: &Hash) -> Hash {
        let mut v = vec![1u8];
        v.extend_from_slice(l);
        v.extend_from_slice(r);
        sha256(&v)
    }
    fn leaf(l: &Hash) -> Hash {
        let mut v = vec![0u8];
        v.extend_from_slice(l);
        sha256(&v)
    }

    #[test]
    fn empty_root_is_sha256_of_nothing() {
        assert_eq!(merkle_root(&[]), sha256(b""));
    }

    #[test]
    fn three_leaves_follow_rfc6962_split() {
        let l: Vec<Hash> = (0u8..3).map(|i| sha256(&[i])).collect();
        let expected = node(&node(&leaf(&l[0]), &leaf(&l[1])), &leaf(&l[2]));
        assert_eq!(merkle_root(&l), expected);
        // Five leaves: k = 4 on the left, 1 on the right.
        let l: Vec<Hash> = (0u8..5).map(|i| sha256(&[i])).collect();
        let left = node(
            &node(&leaf(&l[0]), &leaf(&l[1])),
            &node(&leaf(&l[2]), &leaf(&l[3])),
        );
        assert_eq!(merkle_root(&l), node(&left, &leaf(&l[4])));
    }

    #[test]
    fn duplicate_last_leaf_changes_root() {
        let l: Vec<Hash> = (0u8..3).map(|i| sha256(&[i])).collect();
        let mut dup = l.clone();
        dup.push(l[2]);
        assert_ne!(merkle_root(&l), merkle_root(&dup));
    }

    #[test]
    fn roundtrip_and_strictness() {
        let leaves: Vec<Hash> = (0u8..3).map(|i| sha256(&[i])).collect();
        let m = Manifest::new("model/llama", 7, 2 * 1024 + 5, 1024, leaves).unwrap();
        let enc = m.encode();
        assert_eq!(Manifest::decode(&enc).unwrap(), m);
        let mut trailing = enc.clone();
        trailing.push(0);
        assert!(matches!(
            Manifest::decode(&trailing),
            Err(ManifestError::LeafSectionLength { .. })
        ));
        for n in 0..enc.len() {
            assert!(Manifest::decode(&enc[..n]).is_err(), "prefix {n} accepted");
        }
        for bit in 0..enc.len() * 8 {
            let mut e = enc.clone();
            e[bit / 8] ^= 1 << (bit % 8);
            // Either rejected, or (a flip in version) a different manifest.
            if let Ok(d) = Manifest::decode(&e) {
                assert_ne!(d, m);
            }
        }
    }

    #[test]
    fn rejects_bad_fields() {
        assert!(Manifest::new("", 1, 0, 1024, vec![]).is_err());
        assert!(Manifest::new("a\nb", 1, 0, 1024, vec![]).is_err());
        assert!(Manifest::new(&"x".repeat(1025), 1, 0, 1024, vec![]).is_err());
        assert!(Manifest::new("a", 1, 0, 512, vec![]).is_err());
        assert!(Manifest::new("a", 1, 1, 1024, vec![]).is_err());
        let m = Manifest::new("a", 1, 0, 1024, vec![]).unwrap();
        assert_eq!(m.root(), &sha256(b""));
        assert_eq!(Manifest::decode(&m.encode()).unwrap(), m);
    }

    #[test]
    fn huge_leaf_count_does_not_allocate() {
        let m = Manifest::new("a", 1, 0, 1024, vec![]).unwrap();
        let mut enc = m.encode();
        // Claim size u64::MAX: leaf count must then be huge, and the section absent.
        let size_at = 4 + 2 + 1 + 2 + 1 + 8;
        enc[size_at..size_at + 8].copy_from_slice(&u64::MAX.to_be_bytes());
        let count_at = enc.len() - 8;
        enc[count_at..].copy_from_slice(&Manifest::chunks_for(u64::MAX, 1024).to_be_bytes());
        assert!(matches!(
            Manifest::decode(&enc),
            Err(ManifestError::LeafSectionLength { .. })
        ));
    }
}

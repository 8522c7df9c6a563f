//! Envelope encryption of objects of any size: segmented, streaming AES-256-GCM under a
//! per-object key wrapped by a keyring data key.
//!
//! Why this module exists: a single GCM message must stay under 64 GiB, a model checkpoint or
//! a dataset shard may not, and a reader that wants bytes 3 GiB into a file must not decrypt
//! the 3 GiB before them. Cutting the object into fixed-size segments, each its own GCM
//! message bound to its position, gives streaming, random access and parallelism, while the
//! binding (object id, index, last flag, key version) keeps truncation, extension, reordering
//! and splicing detectable. Wrapping a per-object key (envelope encryption) makes rotation
//! cheap: [`rewrap_file`] rewrites a header, never the data.
//!
//! Entry points: [`encrypt_file`] and [`decrypt_file`] (parallel, positioned I/O, memory
//! bounded by threads × segment size, output written atomically), [`encrypt_stream`] (any
//! `Read` into a `Write + Seek`), [`DecryptingReader`] (`Read + Seek`, decrypts only the
//! segments a read touches), [`rewrap_file`], and [`Header::parse`] to inspect an object.
//!
#![doc = include_str!("../FORMAT.md")]

use std::io;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;

use aes_gcm::aead::array::Array;
use aes_gcm::aead::inout::InOutBuf;
use aes_gcm::aead::{Nonce, Tag};
use aes_gcm::{AeadInOut as _, Aes256Gcm, KeyInit as _};
use thiserror::Error;
use zeroize::Zeroize as _;

use crate::keyring::{KeyError, KeySource};
use crate::meta::{InvalidId, KeyId, check_id};
use crate::secret::{DataKey, RandomError, RandomSource, SystemRandom};

mod buffer;
mod file;
mod header;
mod reader;
mod writer;

pub use buffer::{decrypt_buffer, encrypt_buffer};
pub use file::{
    DecryptReport, EncryptReport, RewrapReport, decrypt_file, encrypt_file, rewrap_file,
};
pub use header::{
    FORMAT_VERSION, HEADER_FIXED_LEN, Header, HeaderError, MAGIC, MAX_HEADER_LEN,
    MAX_OBJECT_ID_LEN, MAX_SEGMENT_SIZE, MAX_SEGMENTS, MIN_SEGMENT_SIZE, NONCE_PREFIX_LEN,
    SEGMENT_OVERHEAD, TAG_LEN, WRAP_NONCE_LEN, WRAPPED_DEK_LEN,
};
pub use reader::DecryptingReader;
pub use writer::{encrypt_stream, encrypt_to_vec};

use header::segment_count;

/// Default plaintext bytes per segment: 256 KiB. Chosen from `examples/stream_bench.rs`
/// on this 2-core machine (L2: 512 KiB per core): with 64 KiB to 1 MiB segments the
/// memory-to-memory paths cost the same CPU per byte as raw `aes-gcm` (0.97x to 1.03x),
/// while 4 MiB segments fall to 0.79x because a segment no longer stays in L2 between GCM's
/// counter-mode and GHASH passes. 256 KiB sits in the middle of the flat region, keeps the
/// per-segment overhead (24 bytes) under 0.01%, makes random reads decrypt at most 256 KiB
/// to return one byte, and bounds memory at 256 KiB per thread.
pub const DEFAULT_SEGMENT_SIZE: u32 = 256 * 1024;

/// How far from a failing segment's index [`DecryptingReader`] and [`decrypt_file`] look for
/// the segment it really is, to report a reordering (each try costs one GHASH pass).
const REORDER_SEARCH: u64 = 256;

/// How to encrypt.
#[derive(Clone)]
pub struct EncryptOptions {
    /// Plaintext bytes per segment. Default: [`DEFAULT_SEGMENT_SIZE`].
    pub segment_size: u32,
    /// Worker threads for [`encrypt_file`]. Default: `available_parallelism()` (1 if unknown).
    pub threads: NonZeroUsize,
    /// Where the object key, nonce prefix and wrap nonce come from (drawn in that order).
    /// Default: the operating system's generator. Inject fixed bytes only in known-answer
    /// tests: reusing them across objects would reuse nonces.
    pub random: Arc<dyn RandomSource>,
}

impl std::fmt::Debug for EncryptOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncryptOptions")
            .field("segment_size", &self.segment_size)
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl Default for EncryptOptions {
    fn default() -> Self {
        Self {
            segment_size: DEFAULT_SEGMENT_SIZE,
            threads: default_threads(),
            random: Arc::new(SystemRandom::new()),
        }
    }
}

fn default_threads() -> NonZeroUsize {
    std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN)
}

/// How to decrypt a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecryptOptions {
    /// Worker threads for [`decrypt_file`]. Default: `available_parallelism()`.
    pub threads: NonZeroUsize,
}

impl Default for DecryptOptions {
    fn default() -> Self {
        Self {
            threads: default_threads(),
        }
    }
}

/// Why an object could not be encrypted, decrypted or rewrapped. Every tampering case has
/// its own variant, naming the segment and its byte offset in the encrypted object.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StreamError {
    /// The header does not parse.
    #[error(transparent)]
    Header(#[from] HeaderError),
    /// The keyring refused or failed (erased, destroyed, below the minimum version...).
    #[error(transparent)]
    Key(#[from] KeyError),
    /// An id was refused.
    #[error(transparent)]
    InvalidId(#[from] InvalidId),
    /// Reading or writing failed.
    #[error("cannot {what}")]
    Io {
        /// What was being done, with the path.
        what: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The header is a valid header of another object.
    #[error("encrypted object header is for object {found:?}, expected {expected:?}")]
    ObjectMismatch {
        /// The object the caller asked for.
        expected: String,
        /// The object the header names.
        found: String,
    },
    /// The header does not authenticate under the key version it names.
    #[error(
        "header of object {object:?} (key \"{key}\" version {version}) failed authentication: header altered or its wrapped key damaged"
    )]
    HeaderTampered {
        /// The object id the header claims.
        object: String,
        /// The key.
        key: KeyId,
        /// The version it names.
        version: u32,
    },
    /// The header's wrap version was changed: the key unwraps under another version.
    #[error(
        "header of object {object:?} names key \"{key}\" version {claimed}, but its key was wrapped under version {actual}: key version substituted"
    )]
    KeyVersionSubstituted {
        /// The object.
        object: String,
        /// The key.
        key: KeyId,
        /// The version the header names.
        claimed: u32,
        /// The version that unwraps it.
        actual: u32,
    },
    /// The object ends at a segment boundary before its last segment.
    #[error(
        "object {object:?} is truncated: {actual_len} bytes, its header says {expected_len}; segment {segment} at byte offset {offset} is missing"
    )]
    Truncated {
        /// The object.
        object: String,
        /// The first missing segment.
        segment: u64,
        /// Where it should start.
        offset: u64,
        /// The length the header implies.
        expected_len: u64,
        /// The length found.
        actual_len: u64,
    },
    /// The object ends inside a segment.
    #[error(
        "object {object:?} ends mid-segment: segment {segment} at byte offset {offset} has {have} of its {need} bytes"
    )]
    PartialSegment {
        /// The object.
        object: String,
        /// The incomplete segment.
        segment: u64,
        /// Its offset.
        offset: u64,
        /// Bytes present.
        have: u64,
        /// Bytes it should have.
        need: u64,
    },
    /// Bytes follow the last segment.
    #[error(
        "object {object:?} is extended: {extra} unexpected bytes after its last segment, from byte offset {offset}"
    )]
    Extended {
        /// The object.
        object: String,
        /// Where the extra bytes start.
        offset: u64,
        /// How many.
        extra: u64,
    },
    /// A segment's object tag is not this object's: it belongs to another object.
    #[error(
        "object {object:?}: segment {segment} at byte offset {offset} belongs to another object (its object tag differs)"
    )]
    ForeignSegment {
        /// The object.
        object: String,
        /// The segment.
        segment: u64,
        /// Its offset.
        offset: u64,
    },
    /// A segment authenticates as another segment of the same object.
    #[error(
        "object {object:?}: segment {segment} at byte offset {offset} holds segment {found}: segments reordered"
    )]
    SegmentReordered {
        /// The object.
        object: String,
        /// The position.
        segment: u64,
        /// Its offset.
        offset: u64,
        /// The segment found there.
        found: u64,
    },
    /// A segment failed authentication.
    #[error(
        "object {object:?}: segment {segment} at byte offset {offset} failed authentication: ciphertext or tag altered"
    )]
    SegmentTampered {
        /// The object.
        object: String,
        /// The segment.
        segment: u64,
        /// Its offset.
        offset: u64,
    },
    /// A reader refuses every read after a failure.
    #[error(
        "object {object:?}: reads refused after the failure at segment {segment} (byte offset {offset})"
    )]
    Poisoned {
        /// The object.
        object: String,
        /// The segment that failed.
        segment: u64,
        /// Its offset.
        offset: u64,
    },
    /// The output path is the input file.
    #[error("refusing to write {output} over its input {input}")]
    SameFile {
        /// The input.
        input: PathBuf,
        /// The output.
        output: PathBuf,
    },
    /// The segment size is out of bounds.
    #[error("segment size {segment_size} is invalid: {problem}")]
    InvalidSegmentSize {
        /// The size asked for.
        segment_size: u32,
        /// Why.
        problem: String,
    },
    /// The object needs more than 2^32 segments at this segment size.
    #[error("{len} bytes need more than 2^32 segments of {segment_size} bytes")]
    TooLarge {
        /// Plaintext length.
        len: u64,
        /// Segment size.
        segment_size: u32,
    },
    /// The input changed length while it was being encrypted.
    #[error("{path} changed while being encrypted: it was {expected} bytes, now {actual}")]
    InputChanged {
        /// The input.
        path: PathBuf,
        /// Its length at the start.
        expected: u64,
        /// Its length later.
        actual: u64,
    },
    /// The random generator failed.
    #[error(transparent)]
    Random(#[from] RandomError),
}

impl StreamError {
    /// A short machine-readable kind, for logs and audit records (e.g. `segment-tampered`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Header(_) => "header-invalid",
            Self::Key(_) => "key-unavailable",
            Self::InvalidId(_) => "invalid-id",
            Self::Io { .. } => "io-error",
            Self::ObjectMismatch { .. } => "object-mismatch",
            Self::HeaderTampered { .. } => "header-tampered",
            Self::KeyVersionSubstituted { .. } => "key-version-substituted",
            Self::Truncated { .. } => "truncated",
            Self::PartialSegment { .. } => "partial-segment",
            Self::Extended { .. } => "extended",
            Self::ForeignSegment { .. } => "foreign-segment",
            Self::SegmentReordered { .. } => "segment-reordered",
            Self::SegmentTampered { .. } => "segment-tampered",
            Self::Poisoned { .. } => "poisoned",
            Self::SameFile { .. } => "same-file",
            Self::InvalidSegmentSize { .. } => "invalid-segment-size",
            Self::TooLarge { .. } => "too-large",
            Self::InputChanged { .. } => "input-changed",
            Self::Random(_) => "random-failure",
        }
    }

    /// Whether the encrypted bytes were altered (as opposed to a key refusal or an
    /// environment failure).
    pub fn is_tampering(&self) -> bool {
        matches!(
            self,
            Self::Header(_)
                | Self::ObjectMismatch { .. }
                | Self::HeaderTampered { .. }
                | Self::KeyVersionSubstituted { .. }
                | Self::Truncated { .. }
                | Self::PartialSegment { .. }
                | Self::Extended { .. }
                | Self::ForeignSegment { .. }
                | Self::SegmentReordered { .. }
                | Self::SegmentTampered { .. }
        )
    }

    /// The stream error inside an I/O error returned by [`DecryptingReader`], if any.
    pub fn from_io(e: &io::Error) -> Option<&StreamError> {
        e.get_ref().and_then(|inner| inner.downcast_ref())
    }

    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(io::Error) -> Self {
        let what = what.into();
        move |source| Self::Io { what, source }
    }
}

fn cipher(key: &DataKey) -> Aes256Gcm {
    Aes256Gcm::new(&Array::from(*key.expose()))
}

/// Wraps the object key under `data_key` into `header` (whose other fields are final).
pub(crate) fn wrap_object_key(
    header: &mut Header,
    data_key: &DataKey,
    object_key: &DataKey,
) -> Result<(), StreamError> {
    let aad = header.authenticated_prefix();
    let mut sealed = [0u8; WRAPPED_DEK_LEN];
    let (body, tag_out) = sealed
        .split_last_chunk_mut::<TAG_LEN>()
        .ok_or_else(|| internal("wrapped key layout"))?;
    body.copy_from_slice(object_key.expose());
    let tag = cipher(data_key)
        .encrypt_inout_detached(
            &Nonce::<Aes256Gcm>::from(header.wrap_nonce),
            &aad,
            body.into(),
        )
        .map_err(|_| internal("AES-GCM refused to wrap the object key"))?;
    tag_out.copy_from_slice(&tag);
    header.wrapped_dek = sealed;
    sealed.zeroize();
    Ok(())
}

/// Unwraps the object key of `header` under `data_key`; `None` if it does not authenticate.
fn unwrap_object_key(header: &Header, data_key: &DataKey) -> Option<DataKey> {
    let aad = header.authenticated_prefix();
    let (body, tag) = header.wrapped_dek.split_last_chunk::<TAG_LEN>()?;
    let mut key = [0u8; 32];
    key.copy_from_slice(body);
    let ok = cipher(data_key)
        .decrypt_inout_detached(
            &Nonce::<Aes256Gcm>::from(header.wrap_nonce),
            &aad,
            key.as_mut_slice().into(),
            &Tag::<Aes256Gcm>::from(*tag),
        )
        .is_ok();
    let out = ok.then(|| DataKey::from_bytes(key));
    key.zeroize();
    out
}

/// An internal invariant failed; reported as an I/O error rather than a panic.
fn internal(what: &str) -> StreamError {
    StreamError::Io {
        what: format!("complete an internal step ({what})"),
        source: io::Error::other("internal error"),
    }
}

/// Where each segment of an object lies, in the plaintext and in the encrypted object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) header_len: u64,
    pub(crate) segment_size: u32,
    pub(crate) plaintext_len: u64,
    pub(crate) segments: u64,
}

impl Layout {
    pub(crate) fn of(header: &Header) -> Self {
        Self {
            header_len: header.len() as u64,
            segment_size: header.segment_size,
            plaintext_len: header.plaintext_len,
            segments: header.segment_count(),
        }
    }

    fn stride(&self) -> u64 {
        u64::from(self.segment_size) + SEGMENT_OVERHEAD as u64
    }

    /// Plaintext bytes in segment `i`.
    pub(crate) fn plain_len(&self, i: u64) -> usize {
        let start = i.saturating_mul(u64::from(self.segment_size));
        let n = self
            .plaintext_len
            .saturating_sub(start)
            .min(u64::from(self.segment_size));
        usize::try_from(n).unwrap_or(0)
    }

    /// Where segment `i` starts in the plaintext.
    pub(crate) fn plain_offset(&self, i: u64) -> u64 {
        i.saturating_mul(u64::from(self.segment_size))
    }

    /// Where segment `i` starts in the encrypted object.
    pub(crate) fn cipher_offset(&self, i: u64) -> u64 {
        self.header_len
            .saturating_add(i.saturating_mul(self.stride()))
    }

    /// Encrypted bytes of segment `i`.
    pub(crate) fn cipher_len(&self, i: u64) -> usize {
        self.plain_len(i) + SEGMENT_OVERHEAD
    }

    pub(crate) fn is_last(&self, i: u64) -> bool {
        i + 1 == self.segments
    }

    /// The encrypted object's length.
    pub(crate) fn total_len(&self) -> u64 {
        self.header_len + self.plaintext_len + self.segments * SEGMENT_OVERHEAD as u64
    }

    /// Checks the encrypted object's actual length against the header's.
    pub(crate) fn check_len(&self, object: &str, actual: u64) -> Result<(), StreamError> {
        let expected = self.total_len();
        if actual > expected {
            return Err(StreamError::Extended {
                object: object.to_owned(),
                offset: expected,
                extra: actual - expected,
            });
        }
        if actual < expected {
            let into = actual.saturating_sub(self.header_len);
            let segment = (into / self.stride()).min(self.segments - 1);
            let offset = self.cipher_offset(segment);
            if actual == offset {
                return Err(StreamError::Truncated {
                    object: object.to_owned(),
                    segment,
                    offset,
                    expected_len: expected,
                    actual_len: actual,
                });
            }
            return Err(StreamError::PartialSegment {
                object: object.to_owned(),
                segment,
                offset,
                have: actual.saturating_sub(offset),
                need: self.cipher_len(segment) as u64,
            });
        }
        Ok(())
    }
}

/// The per-object cipher: seals and opens segments of one object.
pub(crate) struct ObjectCipher {
    aead: Aes256Gcm,
    prefix: [u8; NONCE_PREFIX_LEN],
    /// `u16(o) || object id || u32(sealed version)`: the start of every segment's AAD.
    aad_prefix: Vec<u8>,
    pub(crate) layout: Layout,
    pub(crate) object: String,
}

impl ObjectCipher {
    pub(crate) fn new(header: &Header, object_key: &DataKey) -> Self {
        let mut aad_prefix = Vec::with_capacity(header.object_id.len() + 6);
        aad_prefix.extend_from_slice(
            &u16::try_from(header.object_id.len())
                .unwrap_or(u16::MAX)
                .to_be_bytes(),
        );
        aad_prefix.extend_from_slice(header.object_id.as_bytes());
        aad_prefix.extend_from_slice(&header.sealed_version.to_be_bytes());
        Self {
            aead: cipher(object_key),
            prefix: header.nonce_prefix,
            aad_prefix,
            layout: Layout::of(header),
            object: header.object_id.clone(),
        }
    }

    fn nonce(&self, i: u64) -> Nonce<Aes256Gcm> {
        let mut n = [0u8; 12];
        let (p, idx) = n.split_at_mut(NONCE_PREFIX_LEN);
        p.copy_from_slice(&self.prefix);
        idx.copy_from_slice(&u32::try_from(i).unwrap_or(u32::MAX).to_be_bytes());
        Nonce::<Aes256Gcm>::from(n)
    }

    fn aad(&self, i: u64, last: bool, out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(&self.aad_prefix);
        out.extend_from_slice(&u32::try_from(i).unwrap_or(u32::MAX).to_be_bytes());
        out.push(u8::from(last));
    }

    /// Seals segment `i` in place: `segment` is the object tag slot (8 bytes), the plaintext,
    /// and the GCM tag slot (16 bytes).
    pub(crate) fn seal(
        &self,
        i: u64,
        segment: &mut [u8],
        aad: &mut Vec<u8>,
    ) -> Result<(), StreamError> {
        self.seal_as(i, self.layout.is_last(i), segment, aad)
    }

    /// Seals segment `i` in place, flagged last or not (for streams of unknown length).
    pub(crate) fn seal_as(
        &self,
        i: u64,
        last: bool,
        segment: &mut [u8],
        aad: &mut Vec<u8>,
    ) -> Result<(), StreamError> {
        if i >= MAX_SEGMENTS {
            return Err(StreamError::TooLarge {
                len: i.saturating_mul(u64::from(self.layout.segment_size)),
                segment_size: self.layout.segment_size,
            });
        }
        let (tag8, rest) = segment
            .split_first_chunk_mut::<NONCE_PREFIX_LEN>()
            .ok_or_else(|| internal("segment layout"))?;
        let (body, tag_out) = rest
            .split_last_chunk_mut::<TAG_LEN>()
            .ok_or_else(|| internal("segment layout"))?;
        *tag8 = self.prefix;
        *tag_out = self.seal_inout_as(i, last, body.into(), aad)?;
        Ok(())
    }

    /// Encrypts one segment's bytes from `inout`'s input to its output; returns the tag.
    fn seal_inout(
        &self,
        i: u64,
        inout: InOutBuf<'_, '_, u8>,
        aad: &mut Vec<u8>,
    ) -> Result<[u8; TAG_LEN], StreamError> {
        self.seal_inout_as(i, self.layout.is_last(i), inout, aad)
    }

    fn seal_inout_as(
        &self,
        i: u64,
        last: bool,
        inout: InOutBuf<'_, '_, u8>,
        aad: &mut Vec<u8>,
    ) -> Result<[u8; TAG_LEN], StreamError> {
        self.aad(i, last, aad);
        let tag = self
            .aead
            .encrypt_inout_detached(&self.nonce(i), aad, inout)
            .map_err(|_| internal("AES-GCM refused a segment"))?;
        Ok(tag.into())
    }

    /// Checks segment `i`'s tag and, only if it verifies, decrypts `inout`'s input to its
    /// output.
    fn open_inout(
        &self,
        i: u64,
        inout: InOutBuf<'_, '_, u8>,
        tag: &[u8; TAG_LEN],
        aad: &mut Vec<u8>,
    ) -> bool {
        self.aad(i, self.layout.is_last(i), aad);
        self.aead
            .decrypt_inout_detached(&self.nonce(i), aad, inout, &Tag::<Aes256Gcm>::from(*tag))
            .is_ok()
    }

    fn try_open(&self, i: u64, body: &mut [u8], tag: &[u8; TAG_LEN], aad: &mut Vec<u8>) -> bool {
        self.open_inout(i, body.into(), tag, aad)
    }

    /// Opens segment `i` in place (the whole encrypted segment); on success the plaintext is
    /// `segment[8 .. len-16]`. On failure the buffer holds no plaintext and the error says
    /// what the segment is: another object's, another position's, or altered.
    pub(crate) fn open(
        &self,
        i: u64,
        segment: &mut [u8],
        aad: &mut Vec<u8>,
    ) -> Result<(), StreamError> {
        let (tag8, rest) = segment
            .split_first_chunk_mut::<NONCE_PREFIX_LEN>()
            .ok_or_else(|| internal("segment layout"))?;
        let (body, tag) = rest
            .split_last_chunk_mut::<TAG_LEN>()
            .ok_or_else(|| internal("segment layout"))?;
        self.open_parts(i, tag8, body, tag, aad)
    }

    /// [`Self::open`] over a segment read in three parts (object tag, ciphertext, GCM tag),
    /// so a reader can decrypt straight into its caller's buffer.
    pub(crate) fn open_parts(
        &self,
        i: u64,
        object_tag: &[u8; NONCE_PREFIX_LEN],
        body: &mut [u8],
        tag: &[u8; TAG_LEN],
        aad: &mut Vec<u8>,
    ) -> Result<(), StreamError> {
        let offset = self.layout.cipher_offset(i);
        if *object_tag != self.prefix {
            return Err(StreamError::ForeignSegment {
                object: self.object.clone(),
                segment: i,
                offset,
            });
        }
        if self.try_open(i, body, tag, aad) {
            return Ok(());
        }
        // Rare path: find out whether this is another segment of the same object. GCM checks
        // the tag before decrypting, so each try costs a GHASH pass; a match decrypts in
        // place, and that plaintext is wiped, never released.
        let lo = i.saturating_sub(REORDER_SEARCH);
        let hi = i.saturating_add(REORDER_SEARCH).min(self.layout.segments);
        for j in lo..hi {
            if j != i && self.layout.plain_len(j) == body.len() && self.try_open(j, body, tag, aad)
            {
                body.zeroize();
                return Err(StreamError::SegmentReordered {
                    object: self.object.clone(),
                    segment: i,
                    offset,
                    found: j,
                });
            }
        }
        Err(StreamError::SegmentTampered {
            object: self.object.clone(),
            segment: i,
            offset,
        })
    }
}

/// Authenticates `header` with the keyring and checks it is `expected_object`'s; returns the
/// object's cipher.
pub(crate) fn open_header(
    keys: &dyn KeySource,
    header: &Header,
    expected_object: &str,
) -> Result<ObjectCipher, StreamError> {
    let object_key = unwrap_header(keys, header)?;
    if header.object_id != expected_object {
        return Err(StreamError::ObjectMismatch {
            expected: expected_object.to_owned(),
            found: header.object_id.clone(),
        });
    }
    Ok(ObjectCipher::new(header, &object_key))
}

/// The object key of `header`, unwrapped under the data key of the version it names;
/// diagnoses a substituted version.
pub(crate) fn unwrap_header(keys: &dyn KeySource, header: &Header) -> Result<DataKey, StreamError> {
    let data_key = keys.decryption_key(&header.key_id, header.wrap_version)?;
    if let Some(k) = unwrap_object_key(header, &data_key) {
        return Ok(k);
    }
    // Rare path: was the version field changed? Try the other versions that may decrypt.
    for v in keys
        .decryptable_versions(&header.key_id)
        .unwrap_or_default()
    {
        if v == header.wrap_version {
            continue;
        }
        let Ok(other) = keys.decryption_key(&header.key_id, v) else {
            continue;
        };
        let mut as_wrapped = header.clone();
        as_wrapped.wrap_version = v;
        if unwrap_object_key(&as_wrapped, &other).is_some() {
            return Err(StreamError::KeyVersionSubstituted {
                object: header.object_id.clone(),
                key: header.key_id.clone(),
                claimed: header.wrap_version,
                actual: v,
            });
        }
    }
    Err(StreamError::HeaderTampered {
        object: header.object_id.clone(),
        key: header.key_id.clone(),
        version: header.wrap_version,
    })
}

/// An object being encrypted: its secrets are drawn, its length not yet known.
pub(crate) struct Draft {
    pub(crate) header: Header,
    object_key: DataKey,
    data_key: Arc<DataKey>,
}

impl Draft {
    /// Draws a fresh object key, nonce prefix and wrap nonce (in that order) for object
    /// `object_id` under `key`'s primary version.
    pub(crate) fn new(
        keys: &dyn KeySource,
        key: &KeyId,
        object_id: &str,
        options: &EncryptOptions,
    ) -> Result<Self, StreamError> {
        check_id("object id", object_id, MAX_OBJECT_ID_LEN)?;
        header::check_segment_size(options.segment_size).map_err(|problem| {
            StreamError::InvalidSegmentSize {
                segment_size: options.segment_size,
                problem,
            }
        })?;
        let (version, data_key) = keys.encryption_key(key)?;
        let object_key = DataKey::generate(options.random.as_ref())?;
        let mut nonce_prefix = [0u8; NONCE_PREFIX_LEN];
        options.random.fill(&mut nonce_prefix)?;
        let mut wrap_nonce = [0u8; WRAP_NONCE_LEN];
        options.random.fill(&mut wrap_nonce)?;
        let header = Header {
            segment_size: options.segment_size,
            plaintext_len: 0,
            nonce_prefix,
            sealed_version: version,
            wrap_version: version,
            key_id: key.clone(),
            object_id: object_id.to_owned(),
            wrap_nonce,
            wrapped_dek: [0; WRAPPED_DEK_LEN],
        };
        Ok(Self {
            header,
            object_key,
            data_key,
        })
    }

    /// The segment cipher, for sealing before the length is known (with
    /// [`ObjectCipher::seal_as`]).
    pub(crate) fn cipher(&self) -> ObjectCipher {
        ObjectCipher::new(&self.header, &self.object_key)
    }

    /// Fixes the plaintext length and wraps the object key: the final header, and the
    /// segment cipher for an object of that length.
    pub(crate) fn finish(
        mut self,
        plaintext_len: u64,
    ) -> Result<(Header, ObjectCipher), StreamError> {
        if segment_count(plaintext_len, self.header.segment_size) > MAX_SEGMENTS {
            return Err(StreamError::TooLarge {
                len: plaintext_len,
                segment_size: self.header.segment_size,
            });
        }
        self.header.plaintext_len = plaintext_len;
        wrap_object_key(&mut self.header, &self.data_key, &self.object_key)?;
        let cipher = ObjectCipher::new(&self.header, &self.object_key);
        Ok((self.header, cipher))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_names_truncation_partial_segments_and_extension() {
        let l = Layout {
            header_len: 100,
            segment_size: 16,
            plaintext_len: 40,
            segments: 3,
        };
        assert_eq!(l.total_len(), 100 + 40 + 72);
        assert_eq!((l.plain_len(0), l.plain_len(2)), (16, 8));
        assert_eq!(l.cipher_offset(2), 100 + 80);
        l.check_len("o", 212).unwrap();
        assert!(matches!(
            l.check_len("o", 180),
            Err(StreamError::Truncated {
                segment: 2,
                offset: 180,
                ..
            })
        ));
        assert!(matches!(
            l.check_len("o", 100),
            Err(StreamError::Truncated {
                segment: 0,
                offset: 100,
                ..
            })
        ));
        assert!(matches!(
            l.check_len("o", 150),
            Err(StreamError::PartialSegment {
                segment: 1,
                offset: 140,
                have: 10,
                need: 40,
                ..
            })
        ));
        assert!(matches!(
            l.check_len("o", 50),
            Err(StreamError::PartialSegment {
                segment: 0,
                offset: 100,
                ..
            })
        ));
        assert!(matches!(
            l.check_len("o", 213),
            Err(StreamError::Extended {
                offset: 212,
                extra: 1,
                ..
            })
        ));
    }
}

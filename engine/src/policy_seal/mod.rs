//! Sealed policy sets: `policy.seal`, a signed list of every file a policy set is built
//! from, so that an engine in sealed mode ([`crate::EngineBuilder::sealed`]) loads only a
//! set an operator signed, whole, and never an older one.
//!
//! Why this module exists: hot reload follows the files. Whoever can write the policy
//! directory (or a half-finished write, or a ConfigMap rolled back by hand) decides what
//! the engine enforces; the quiescence heuristic of the watcher narrows the window of a
//! half-written file but cannot close it. A seal closes it: the set loads only if
//!
//! * `policy.seal` verifies against the pinned key (the same anchors as checkpoints: an
//!   HSM over PKCS#11 or the software anchor, checked with [`Verifier`]);
//! * every file the engine reads (schema, `probity.toml`, every `.cedar`, `plugins.toml`
//!   and every component it names) is listed with the SHA-256 of the bytes the engine
//!   compiled, and no other policy file is present;
//! * its version is not lower than the live set's, nor than the version remembered in
//!   the attached state store (so an old signed set cannot be replayed even across a
//!   restart); the same version must have the same contents.
//!
//! Anything else is a rejected reload, located in `policy.seal`, and the previous set
//! keeps serving.
//!
//! # Encoding (format 1)
//!
//! UTF-8 text, lines ended by `\n` (no `\r`, no control characters, no trailing spaces),
//! exactly:
//!
//! ```text
//! probity-policy-seal 1
//! name <name>
//! version <decimal u64, no sign, no leading zero>
//! file <sha256, 64 lowercase hex> <path relative to the policy directory>
//! ...                                   (one or more, sorted by path bytes, unique)
//! signed-by <key id, 64 lowercase hex: SHA-256 of the signer's public point>
//! signature <128 lowercase hex: ECDSA P-256 r || s>
//! ```
//!
//! * `name`: 1 to 128 ASCII letters, digits, `.`, `_` or `-`.
//! * `path`: `/`-separated, relative, no empty, `.` or `..` component, at most 4096
//!   bytes. Every file lies under the policy directory.
//! * The **seal digest** is SHA-256 of the bytes from the start of the file through the
//!   newline of the last `file` line; the signature is the anchor's signature over that
//!   digest (the scheme of [`crate::integrity`]: ECDSA P-256 over SHA-256 of the digest).
//!   The header line separates it from manifest digests, which hash binary encodings
//!   starting `PRBM`.
//!
//! Every field has one spelling, so the encoding is canonical: a file decodes only if
//! re-encoding it gives back the same bytes. Decoding takes untrusted bytes: at most
//! `MAX_SEAL_BYTES` (1 MiB), never panics, and an error names the line and what is wrong.
//!
//! The seal's version is remembered in the state store's manifest registry under the
//! object id `policy-set:<name>`, and (with an HSM) on the token as a `CKO_DATA` object of
//! that id, so it survives the loss of the state directory like a checkpoint's.

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;

use crate::error::LoadError;
use crate::integrity::{Anchor, AnchorError, Hash, KeyId, Signature, Verifier, sha256};
use crate::source::Origin;

mod format;
mod gate;

use format::*;
pub(crate) use gate::{check, compare_live, late_problem, registry_problem};
#[cfg(test)]
mod tests;

/// File name of the seal in the policy directory.
pub(crate) const SEAL_FILE: &str = "policy.seal";
/// First line of a seal, format 1.
pub(crate) const SEAL_HEADER: &str = "probity-policy-seal 1";
/// Largest seal read.
pub(crate) const MAX_SEAL_BYTES: usize = 1024 * 1024;
/// Most files one seal lists.
pub(crate) const MAX_SEALED_FILES: usize = 10_000;
/// Longest seal name.
pub(crate) const MAX_SEAL_NAME_LEN: usize = 128;
/// Longest path in a seal, in bytes.
pub(crate) const MAX_SEALED_PATH_LEN: usize = 4096;
/// Prefix of the registry object id under which a sealed set's version is remembered.
pub(crate) const REGISTRY_PREFIX: &str = "policy-set:";

/// One file of a sealed set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedFile {
    /// Its path relative to the policy directory, `/`-separated.
    pub path: String,
    /// SHA-256 of its bytes.
    pub sha256: Hash,
}

/// A decoded (not yet trusted) or freshly signed `policy.seal`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySeal {
    name: String,
    version: u64,
    files: Vec<SealedFile>,
    key_id: KeyId,
    signature: Signature,
}

/// Where a seal failed to decode: the line (1-based; 0 for the whole file), its byte
/// offset, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{SEAL_FILE} line {line}: {problem}")]
pub struct SealParseError {
    /// 1-based line; 0 when the problem is the whole file.
    pub line: usize,
    /// Byte offset of the line.
    pub offset: usize,
    /// What is wrong.
    pub problem: SealProblem,
}

/// What is wrong with a seal's bytes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SealProblem {
    /// Over `MAX_SEAL_BYTES` (1 MiB).
    #[error("the seal is {size} bytes, over the limit of {MAX_SEAL_BYTES}")]
    TooLarge {
        /// Its size.
        size: usize,
    },
    /// Not UTF-8.
    #[error("invalid UTF-8 at byte {offset}")]
    NotUtf8 {
        /// Offset of the first invalid byte.
        offset: usize,
    },
    /// A control character (including `\r` and tab) or trailing space.
    #[error("control character or trailing space at byte {offset}")]
    BadCharacter {
        /// Offset of the character.
        offset: usize,
    },
    /// The file does not end with a newline.
    #[error("the last line has no newline")]
    NoFinalNewline,
    /// The first line is not `SEAL_HEADER`.
    #[error("expected `{SEAL_HEADER}`")]
    Header,
    /// A line other than the expected one.
    #[error("expected a `{expected}` line")]
    Expected {
        /// The line's keyword.
        expected: &'static str,
    },
    /// The name is empty, too long, or has characters other than letters, digits, `.`,
    /// `_`, `-`.
    #[error("the name must be 1 to {MAX_SEAL_NAME_LEN} ASCII letters, digits, '.', '_' or '-'")]
    Name,
    /// The version is not a canonical decimal `u64`.
    #[error(
        "the version must be a decimal number without sign or leading zero, at most {}",
        u64::MAX
    )]
    Version,
    /// A hex field of the wrong length or case.
    #[error("{field} must be {digits} lowercase hex digits")]
    Hex {
        /// Which field.
        field: &'static str,
        /// How many digits.
        digits: usize,
    },
    /// A path that is not relative, normal and `/`-separated.
    #[error("path {path:?}: {reason}")]
    Path {
        /// The path, as written.
        path: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// Paths out of order or repeated.
    #[error("path {path:?} is out of order or repeated (paths are sorted by bytes, once each)")]
    Order {
        /// The path.
        path: String,
    },
    /// No `file` line.
    #[error("the seal lists no file")]
    NoFiles,
    /// More than `MAX_SEALED_FILES` (10,000) files.
    #[error("the seal lists more than {MAX_SEALED_FILES} files")]
    TooManyFiles,
    /// Lines after the signature.
    #[error("nothing may follow the signature line")]
    Trailing,
}

/// Why a policy directory could not be sealed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SealError {
    /// The set's files could not be listed or read.
    #[error("cannot read the policy set to seal it")]
    Files(#[source] LoadError),
    /// A file of the set lies outside the policy directory.
    #[error(
        "{} is outside the policy directory {}: a sealed set keeps every file under it",
        path.display(),
        dir.display()
    )]
    Outside {
        /// The file.
        path: PathBuf,
        /// The policy directory.
        dir: PathBuf,
    },
    /// A name, version or path that the encoding refuses.
    #[error("cannot seal")]
    Invalid(#[source] SealProblem),
    /// The last version a `u64` holds: no later version could follow it.
    #[error(
        "refusing version {version}: it is the last version, after which the set could never be sealed again"
    )]
    LastVersion {
        /// The version offered.
        version: u64,
    },
    /// The anchor failed to sign or to store the digest on the token.
    #[error("the anchor failed to seal version {version} of {name:?}")]
    Anchor {
        /// Set name.
        name: String,
        /// Version.
        version: u64,
        /// Why.
        #[source]
        source: AnchorError,
    },
    /// `policy.seal` could not be written.
    #[error("cannot write {}", path.display())]
    Write {
        /// The seal file.
        path: PathBuf,
        /// Why.
        #[source]
        source: crate::trust::TrustError,
    },
}

/// The seal of the live set, for status endpoints and `probity check`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SealInfo {
    /// The set's name.
    pub name: String,
    /// Its version.
    pub version: u64,
    /// The seal digest, hex.
    pub digest: String,
    /// The key that signed it, hex.
    pub key_id: String,
}

impl PolicySeal {
    /// The seal path of a policy directory.
    pub fn path(dir: &Path) -> PathBuf {
        dir.join(SEAL_FILE)
    }
}

/// The path of `file` relative to `dir`, `/`-separated, if it lies under `dir` (judged
/// lexically: `.` components dropped, `..` popping a component).
pub(crate) fn relative_name(dir: &Path, file: &Path) -> Option<String> {
    let rest = file.strip_prefix(dir).ok()?;
    let mut parts: Vec<String> = Vec::new();
    for c in rest.components() {
        match c {
            Component::Normal(s) => parts.push(s.to_str()?.to_owned()),
            Component::CurDir => {}
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    if parts.is_empty() {
        None
    } else {
        Some(parts.join("/"))
    }
}

impl PolicySeal {
    /// Seals the policy set in `dir` (default layout: `probity.cedarschema`,
    /// `probity.toml`, the `.cedar` files, `plugins.toml` if present and its components) as
    /// version `version` of `name`: hashes every file, signs the seal with `anchor`, keeps
    /// its digest on the token when the anchor is an HSM (object id `policy-set:<name>`),
    /// and writes `dir/policy.seal` atomically (mode 0644). Validating the set is the
    /// caller's business (`probity policy seal` builds an engine on it first).
    pub fn seal_dir(
        dir: &Path,
        name: &str,
        version: u64,
        anchor: &dyn Anchor,
    ) -> Result<PolicySeal, SealError> {
        if version == u64::MAX {
            return Err(SealError::LastVersion { version });
        }
        check_name(name).map_err(SealError::Invalid)?;
        let origin = Origin::default_dir(dir);
        let paths = crate::bundle::set_files(&origin).map_err(SealError::Files)?;
        let mut files = Vec::with_capacity(paths.len());
        for path in paths {
            let Some(rel) = relative_name(dir, &path) else {
                return Err(SealError::Outside {
                    path,
                    dir: dir.to_owned(),
                });
            };
            let bytes = crate::bundle::read_set_file(&path).map_err(SealError::Files)?;
            files.push(SealedFile {
                path: rel,
                sha256: sha256(&bytes),
            });
        }
        let seal = PolicySeal::sign(name, version, files, anchor)?;
        anchor
            .store_digest(&seal.registry_id(), version, &seal.digest())
            .map_err(|source| SealError::Anchor {
                name: name.to_owned(),
                version,
                source,
            })?;
        let path = PolicySeal::path(dir);
        crate::trust::write_file_atomic(
            &path,
            seal.encode().as_bytes(),
            crate::trust::PUBLIC_FILE_MODE,
        )
        .map_err(|source| SealError::Write { path, source })?;
        Ok(seal)
    }
}

/// How an engine in sealed mode judges a set.
#[derive(Debug, Clone)]
pub(crate) struct Sealing {
    pub verifier: Verifier,
    /// The name every seal must carry, when pinned.
    pub name: Option<String>,
}

/// A seal that verified, with the bytes to remember it by.
#[derive(Debug, Clone)]
pub(crate) struct LoadedSeal {
    pub seal: PolicySeal,
    pub info: SealInfo,
    pub encoded: Vec<u8>,
    pub digest: Hash,
}

/// A verified seal and the component hashes it was checked against.
pub(crate) struct Checked {
    pub seal: Arc<LoadedSeal>,
    /// Component path -> SHA-256, as read before compiling, for the check after.
    pub components: Vec<(PathBuf, Hash)>,
}

//! Data integrity: seal an object (file or block device) into a signed manifest, and verify it
//! before use, whole or chunk by chunk.
//!
//! Why this module exists: a GPU node must never load model weights or datasets that differ,
//! by one bit, from what an operator sealed. Sealing hashes the object into a
//! [`Manifest`] (chunk leaves and an RFC 6962 Merkle root), has an [`Anchor`] sign its digest
//! (an HSM over PKCS#11, or a software key that is clearly not an HSM), and records the version
//! in the [`crate::state::StateStore`] registry. Verifying checks the signature against a pinned key
//! ([`Verifier`], no HSM round trip), refuses rollbacks, then re-hashes in parallel
//! ([`Verifier::verify_object`]) or chunk by chunk as bytes are read ([`VerifiedReader`]).
//!
//! Code map:
//! * `manifest` — the manifest, its Merkle construction and canonical encoding;
//! * `hash` — parallel positioned-read hashing with bounded memory;
//! * `anchor` — the [`Anchor`] trait, keys, signatures and the [`Verifier`];
//! * `software`, `pkcs11` — the two anchors;
//! * `signed` — the signed manifest file;
//! * `reader` — the [`VerifiedReader`].
//!
//! ```no_run
//! use probity::integrity::{self, HashOptions, SoftwareAnchor, Anchor, Verifier, VerifyOptions};
//! use probity::state::StateStore;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = StateStore::open("/var/lib/probity".as_ref())?;
//! let anchor = SoftwareAnchor::load_or_generate("/var/lib/probity/anchor.key".as_ref())?;
//! let signed = integrity::SignedManifest::seal(
//!     "/models/llama.safetensors".as_ref(), "models/llama", 1, &anchor, &store,
//!     &HashOptions::default(),
//! )?;
//! std::fs::write("/models/llama.manifest", signed.encode())?;
//!
//! let verifier = Verifier::new(anchor.public_key().clone());
//! let report = verifier.verify_object(
//!     "/models/llama.safetensors".as_ref(), &signed, &store,
//!     &VerifyOptions::default(),
//! )?;
//! println!("{} v{} verified", report.object_id, report.version);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::state::{RegistryEntry, StateError};

mod anchor;
mod hash;
mod manifest;
pub(crate) mod pkcs11;
mod reader;
mod signed;
mod software;

pub(crate) use anchor::SIGNATURE_LEN;
pub(crate) use anchor::hex;
pub use anchor::{
    Anchor, AnchorDescription, AnchorError, AnchorKind, KeyId, PublicKey, Signature, Verifier,
};
pub use hash::{HashError, HashOptions, HashedObject};
pub(crate) use manifest::sha256;
pub use manifest::{Algorithm, Hash, Manifest, ManifestError};
pub(crate) use pkcs11::TokenDigest;
pub(crate) use pkcs11::token_digests;
pub use pkcs11::{Pin, Pkcs11Anchor, Pkcs11Config};
pub use reader::VerifiedReader;
#[cfg(feature = "fuzzing")]
pub use signed::fuzzing;
pub use signed::{SignatureProblem, SignedManifest, SignedManifestError};
pub use software::SoftwareAnchor;

/// Why sealing or verification failed. Each tamper case has its own variant.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum IntegrityError {
    /// The object could not be read.
    #[error(transparent)]
    Hash(#[from] HashError),
    /// The manifest could not be built.
    #[error("cannot build a manifest for {object_id:?}")]
    Manifest {
        /// Object id.
        object_id: String,
        /// Why.
        #[source]
        source: ManifestError,
    },
    /// The anchor failed to sign or store the digest.
    #[error("anchor failed for {object_id:?} version {version}")]
    Anchor {
        /// Object id.
        object_id: String,
        /// Version.
        version: u64,
        /// Why.
        #[source]
        source: AnchorError,
    },
    /// The state store failed.
    #[error("state store failed for {object_id:?}")]
    State {
        /// Object id.
        object_id: String,
        /// Why.
        #[source]
        source: StateError,
    },
    /// The manifest is signed by a key other than the pinned one.
    #[error(
        "manifest of {object_id:?} version {version} is signed by key {found}, not the pinned key {expected}"
    )]
    WrongKey {
        /// Object id.
        object_id: String,
        /// Version.
        version: u64,
        /// Pinned key id.
        expected: KeyId,
        /// Key id in the signed manifest.
        found: KeyId,
    },
    /// The signature does not match the manifest: the manifest (or signature) was edited.
    #[error(
        "signature of the manifest of {object_id:?} version {version} does not verify: manifest or signature altered"
    )]
    BadSignature {
        /// Object id.
        object_id: String,
        /// Version.
        version: u64,
    },
    /// A version older than the accepted one.
    #[error(
        "refusing rollback of {object_id:?} to version {offered}: version {accepted} was already accepted"
    )]
    Rollback {
        /// Object id.
        object_id: String,
        /// Version offered.
        offered: u64,
        /// Version accepted.
        accepted: u64,
    },
    /// The accepted version, but with a different manifest.
    #[error(
        "manifest of {object_id:?} version {version} differs from the one accepted for that version"
    )]
    VersionConflict {
        /// Object id.
        object_id: String,
        /// Version.
        version: u64,
    },
    /// The object is shorter than the manifest says.
    #[error(
        "{path} is truncated: {actual} bytes, manifest says {expected}; chunk {index} at byte offset {offset} is short"
    )]
    Truncated {
        /// Object path.
        path: PathBuf,
        /// Size in the manifest.
        expected: u64,
        /// Size found.
        actual: u64,
        /// First chunk affected.
        index: u64,
        /// Byte offset where data ends.
        offset: u64,
    },
    /// The object is longer than the manifest says.
    #[error(
        "{path} is extended: {actual} bytes, manifest says {expected}; unexpected data from byte offset {offset}"
    )]
    Extended {
        /// Object path.
        path: PathBuf,
        /// Size in the manifest.
        expected: u64,
        /// Size found.
        actual: u64,
        /// Byte offset where extra data starts.
        offset: u64,
    },
    /// A chunk's bytes differ from the signed leaf.
    #[error("{path}: chunk {index} at byte offset {offset} does not match the signed manifest")]
    ChunkMismatch {
        /// Object path.
        path: PathBuf,
        /// Chunk index.
        index: u64,
        /// Byte offset of the chunk.
        offset: u64,
    },
    /// A chunk holds the signed content of another chunk: chunks were reordered.
    #[error(
        "{path}: chunk {index} at byte offset {offset} holds the content of chunk {found_chunk}: chunks reordered"
    )]
    ChunkReordered {
        /// Object path.
        path: PathBuf,
        /// Chunk index.
        index: u64,
        /// Byte offset of the chunk.
        offset: u64,
        /// The chunk whose signed content was found there.
        found_chunk: u64,
    },
    /// The manifest is for another object than the one expected.
    #[error("manifest is for object {found:?}, expected {expected:?}")]
    ObjectMismatch {
        /// The object id expected.
        expected: String,
        /// The object id in the manifest.
        found: String,
    },
    /// The version is the last one a `u64` holds: sealing it would leave the object no
    /// later version, so it is refused.
    #[error(
        "refusing to seal {object_id:?} as version {version}: it is the last version, after which the object could never be sealed again"
    )]
    LastVersion {
        /// Object id.
        object_id: String,
        /// The version offered (`u64::MAX`).
        version: u64,
    },
    /// The HSM token's digests could not be read to rebuild a new registry.
    #[error("cannot read the sealed versions kept on the HSM token to rebuild the new registry")]
    TokenDigests {
        /// Why.
        #[source]
        source: AnchorError,
    },
    /// A verified reader refuses every read after a failure.
    #[error(
        "{path}: reads refused after integrity failure at chunk {index} (byte offset {offset})"
    )]
    Poisoned {
        /// Object path.
        path: PathBuf,
        /// The chunk that failed.
        index: u64,
        /// Its byte offset.
        offset: u64,
    },
}

impl IntegrityError {
    /// A short machine-readable kind, as recorded in the event log (e.g. `chunk-mismatch`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Hash(_) => "read-error",
            Self::Manifest { .. } => "manifest-invalid",
            Self::Anchor { .. } => "anchor-error",
            Self::State { .. } => "state-error",
            Self::WrongKey { .. } => "wrong-key",
            Self::BadSignature { .. } => "bad-signature",
            Self::Rollback { .. } => "rollback",
            Self::VersionConflict { .. } => "version-conflict",
            Self::Truncated { .. } => "truncated",
            Self::Extended { .. } => "extended",
            Self::ChunkMismatch { .. } => "chunk-mismatch",
            Self::ChunkReordered { .. } => "chunk-reordered",
            Self::ObjectMismatch { .. } => "object-mismatch",
            Self::Poisoned { .. } => "poisoned",
            Self::LastVersion { .. } => "last-version",
            Self::TokenDigests { .. } => "token-error",
        }
    }

    /// Whether the object's bytes differ from the signed manifest (as opposed to a problem
    /// with the manifest, its signature, its version, or the environment).
    pub fn is_content_mismatch(&self) -> bool {
        matches!(
            self,
            Self::Truncated { .. }
                | Self::Extended { .. }
                | Self::ChunkMismatch { .. }
                | Self::ChunkReordered { .. }
        )
    }

    /// Whether the environment failed (reading the file, the anchor, the state store)
    /// rather than the object: no verdict on the object or its reader follows from it.
    pub fn is_environment(&self) -> bool {
        matches!(
            self,
            Self::Hash(_) | Self::Anchor { .. } | Self::State { .. } | Self::TokenDigests { .. }
        )
    }

    fn from_state(object_id: &str, e: StateError) -> Self {
        match e {
            StateError::Rollback {
                object_id,
                offered,
                accepted,
            } => Self::Rollback {
                object_id,
                offered,
                accepted,
            },
            StateError::DigestConflict { object_id, version } => {
                Self::VersionConflict { object_id, version }
            }
            source => Self::State {
                object_id: object_id.to_owned(),
                source,
            },
        }
    }
}

/// Checks a signed manifest's signature and its version against the registry (no hashing).
pub(crate) fn check_manifest(
    signed: &SignedManifest,
    verifier: &Verifier,
    registry: &dyn Registry,
) -> Result<(), IntegrityError> {
    let m = signed.manifest();
    match signed.check_signature(verifier) {
        Ok(()) => {}
        Err(SignatureProblem::WrongKey { expected, found }) => {
            return Err(IntegrityError::WrongKey {
                object_id: m.object_id().to_owned(),
                version: m.version(),
                expected,
                found,
            });
        }
        Err(SignatureProblem::Invalid) => {
            return Err(IntegrityError::BadSignature {
                object_id: m.object_id().to_owned(),
                version: m.version(),
            });
        }
    }
    registry
        .check_version(m.object_id(), m.version(), signed.digest())
        .map_err(|e| IntegrityError::from_state(m.object_id(), e))
}

impl SignedManifest {
    /// Seals the object at `path` as `object_id` version `version`: hashes it in parallel, signs
    /// the manifest digest with `anchor`, stores the digest in the anchor (a `CKO_DATA` object on
    /// an HSM), and records the version in the registry. Refuses a version lower than the one
    /// already accepted, before hashing.
    pub fn seal(
        path: &Path,
        object_id: &str,
        version: u64,
        anchor: &dyn Anchor,
        registry: &dyn Registry,
        options: &HashOptions<'_>,
    ) -> Result<SignedManifest, IntegrityError> {
        let state_err = |e| IntegrityError::from_state(object_id, e);
        let invalid = |source| IntegrityError::Manifest {
            object_id: object_id.to_owned(),
            source,
        };
        manifest::check_object_id(object_id.as_bytes()).map_err(invalid)?;
        manifest::check_chunk_size(options.chunk_size).map_err(invalid)?;
        if version == u64::MAX {
            return Err(IntegrityError::LastVersion {
                object_id: object_id.to_owned(),
                version,
            });
        }
        if let Some(entry) = registry.registry_entry(object_id).map_err(state_err)?
            && version < entry.version
        {
            return Err(IntegrityError::Rollback {
                object_id: object_id.to_owned(),
                offered: version,
                accepted: entry.version,
            });
        }
        let hashed = HashedObject::hash_file(path, options)?;
        let manifest = Manifest::new(
            object_id,
            version,
            hashed.size,
            options.chunk_size,
            hashed.leaves,
        )
        .map_err(|source| IntegrityError::Manifest {
            object_id: object_id.to_owned(),
            source,
        })?;
        let digest = manifest.digest();
        let anchor_err = |source| IntegrityError::Anchor {
            object_id: object_id.to_owned(),
            version,
            source,
        };
        let signature = anchor.sign(&digest).map_err(anchor_err)?;
        registry
            .check_version(object_id, version, &digest)
            .map_err(state_err)?;
        anchor
            .store_digest(object_id, version, &digest)
            .map_err(anchor_err)?;
        let signed = SignedManifest::new(manifest, signature, anchor.public_key().key_id());
        registry
            .accept(object_id, version, &digest, &signed.encode())
            .map_err(state_err)?;
        Ok(signed)
    }
}

/// Why an object failed verification against an encoded signed manifest: the manifest
/// itself does not decode, or the object (or its signature, version...) does not match.
#[derive(Debug, Error)]
pub enum VerifyFailure {
    /// The signed manifest bytes are malformed.
    #[error(transparent)]
    Manifest(#[from] SignedManifestError),
    /// The object did not verify against the manifest.
    #[error(transparent)]
    Object(IntegrityError),
}

impl Verifier {
    /// Verifies the object at `path` against `signed`: the signature under the pinned key, the
    /// version against the registry (refusing rollbacks), then the size and every chunk, hashed in
    /// parallel. On success the version is recorded as accepted. Every failure is appended to the
    /// registry's event log before returning; a content mismatch also blocks `options.node`.
    pub fn verify_object(
        &self,
        path: &Path,
        signed: &SignedManifest,
        registry: &dyn Registry,
        options: &VerifyOptions<'_>,
    ) -> Result<VerifyReport, IntegrityError> {
        self.verify_recorded(path, None, signed, registry, options)
    }

    /// Verifies the object at `path` against `manifest`, the bytes of a signed manifest file,
    /// as [`Verifier::verify_object`] does. The outer `Err` means the check could not run (the
    /// environment failed: [`IntegrityError::is_environment`]); the inner one that the object
    /// failed verification, which is a verdict on it: a malformed manifest counts as a failure,
    /// so verification fails closed.
    pub fn verify_encoded(
        &self,
        path: &Path,
        manifest: &[u8],
        registry: &dyn Registry,
        options: &VerifyOptions<'_>,
    ) -> Result<Result<VerifyReport, VerifyFailure>, IntegrityError> {
        let signed = match SignedManifest::decode(manifest) {
            Ok(signed) => signed,
            Err(e) => return Ok(Err(VerifyFailure::Manifest(e))),
        };
        verdict(self.verify_recorded(path, None, &signed, registry, options))
    }

    /// [`Verifier::verify_encoded`] on an object the caller has already opened (and judged:
    /// the server opens only regular files under its data roots), so that nothing can be
    /// swapped in between the check and the read. `path` names it in errors.
    pub fn verify_encoded_file(
        &self,
        file: std::fs::File,
        path: &Path,
        manifest: &[u8],
        registry: &dyn Registry,
        options: &VerifyOptions<'_>,
    ) -> Result<Result<VerifyReport, VerifyFailure>, IntegrityError> {
        let signed = match SignedManifest::decode(manifest) {
            Ok(signed) => signed,
            Err(e) => return Ok(Err(VerifyFailure::Manifest(e))),
        };
        let opened = hash::sized(file, path)?;
        verdict(self.verify_recorded(path, Some(opened), &signed, registry, options))
    }

    /// Verifies, recording a failure in the registry's event log (best effort: the
    /// verification error is what the caller must see).
    fn verify_recorded(
        &self,
        path: &Path,
        opened: Option<(std::fs::File, u64)>,
        signed: &SignedManifest,
        registry: &dyn Registry,
        options: &VerifyOptions<'_>,
    ) -> Result<VerifyReport, IntegrityError> {
        let result = verify_inner(path, opened, signed, self, registry, options);
        if let Err(err) = &result {
            let _ = record_failure(registry, signed.manifest().object_id(), options.node, err);
        }
        result
    }
}

/// A verification's result as a verdict on the object (inner) or a failure of the
/// environment to check it (outer).
fn verdict(
    result: Result<VerifyReport, IntegrityError>,
) -> Result<Result<VerifyReport, VerifyFailure>, IntegrityError> {
    match result {
        Ok(report) => Ok(Ok(report)),
        Err(e) if e.is_environment() => Err(e),
        Err(e) => Ok(Err(VerifyFailure::Object(e))),
    }
}

impl SignedManifest {
    /// The version after the registry's latest for `object_id` (1 if none was accepted), as
    /// `probity seal` picks by default; `None` when the latest is the last version a `u64`
    /// holds.
    pub fn next_version(
        registry: &dyn Registry,
        object_id: &str,
    ) -> Result<Option<u64>, IntegrityError> {
        let entry = registry
            .registry_entry(object_id)
            .map_err(|e| IntegrityError::from_state(object_id, e))?;
        Ok(match entry {
            None => Some(1),
            Some(e) => e.version.checked_add(1).filter(|v| *v < u64::MAX),
        })
    }
}

impl PublicKey {
    /// Reads the pinned public key at `path` (the hex form of an uncompressed P-256 point,
    /// as [`PublicKey::pin`] writes it), refusing a file that group or others may write, that
    /// another user than this one or root owns, or that sits in a directory others could
    /// change (symlinks are followed and the final target judged: see `probity_base::trust`).
    /// Every verifier of this host should get its key here.
    pub fn load_pinned(path: &Path) -> Result<PublicKey, AnchorError> {
        let target = crate::trust::check_file(path, crate::trust::Material::Public).map_err(
            |e| match e {
                crate::trust::TrustError::Io { source, .. } => AnchorError::PinnedKeyFile {
                    path: path.to_owned(),
                    source,
                },
                other => other.into(),
            },
        )?;
        let meta = std::fs::metadata(&target).map_err(|source| AnchorError::PinnedKeyFile {
            path: path.to_owned(),
            source,
        })?;
        // 130 hex digits and a newline; anything much larger is not a key.
        if meta.len() > 4096 {
            return Err(AnchorError::PinnedKeyInvalid {
                path: path.to_owned(),
            });
        }
        let text =
            std::fs::read_to_string(&target).map_err(|source| AnchorError::PinnedKeyFile {
                path: path.to_owned(),
                source,
            })?;
        PublicKey::from_hex(&text).map_err(|_| AnchorError::PinnedKeyInvalid {
            path: path.to_owned(),
        })
    }
}

impl PublicKey {
    /// Writes this key to `path` as [`PublicKey::load_pinned`] reads it, atomically and
    /// with mode 0644 whatever the umask.
    pub fn pin(&self, path: &Path) -> Result<(), AnchorError> {
        let mut text = self.to_hex();
        text.push('\n');
        crate::trust::write_file_atomic(path, text.as_bytes(), crate::trust::PUBLIC_FILE_MODE)?;
        Ok(())
    }
}

/// Where a registry's rollback memory came from when it was opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RollbackMemory {
    /// The registry existed already: it remembers what it accepted.
    Kept,
    /// The registry was new and was rebuilt from the HSM token's digests: the highest
    /// version of each of `objects` object ids.
    Rebuilt {
        /// Object ids restored.
        objects: usize,
    },
    /// The registry was new and no HSM was configured to rebuild it from: **rollback
    /// protection restarts from zero**, so any validly signed version of any object will
    /// be accepted once. Say so loudly (the CLI prints an error line; a server should log
    /// it at error level and expose it).
    RestartedFromZero,
}

impl RollbackMemory {
    /// Whether rollback protection restarted from zero (see
    /// [`RollbackMemory::RestartedFromZero`]).
    pub fn restarted_from_zero(&self) -> bool {
        matches!(self, RollbackMemory::RestartedFromZero)
    }
}

impl RollbackMemory {
    /// Restores a registry's rollback memory after it was lost. Call it right after opening
    /// the registry and before accepting anything, with `is_new` saying whether the open
    /// created it ([`crate::state::StateStore::is_new`]):
    ///
    /// * an existing registry is left alone ([`RollbackMemory::Kept`]);
    /// * a new one, with an HSM configured (`hsm`), gets the highest version of each object
    ///   id the token keeps as a `CKO_DATA` object, with its digest, so an older version is
    ///   refused as before ([`RollbackMemory::Rebuilt`]);
    /// * a new one without an HSM cannot be rebuilt: [`RollbackMemory::RestartedFromZero`].
    pub fn restore(
        registry: &dyn Registry,
        is_new: bool,
        hsm: Option<&Pkcs11Config>,
    ) -> Result<RollbackMemory, IntegrityError> {
        if !is_new {
            return Ok(RollbackMemory::Kept);
        }
        let Some(config) = hsm else {
            return Ok(RollbackMemory::RestartedFromZero);
        };
        let digests =
            token_digests(config).map_err(|source| IntegrityError::TokenDigests { source })?;
        rebuild_registry(registry, &digests).map(|objects| RollbackMemory::Rebuilt { objects })
    }
}

/// Accepts, for each object id in `digests`, its highest version with its digest (no
/// signed manifest is kept for them: the token holds only digests). Returns the number of
/// object ids. A registry that already holds a higher version keeps it.
pub(crate) fn rebuild_registry(
    registry: &dyn Registry,
    digests: &[TokenDigest],
) -> Result<usize, IntegrityError> {
    let mut highest: std::collections::BTreeMap<&str, &TokenDigest> =
        std::collections::BTreeMap::new();
    for d in digests {
        let slot = highest.entry(d.object_id.as_str()).or_insert(d);
        if d.version > slot.version {
            *slot = d;
        }
    }
    for d in highest.values() {
        match registry.accept(&d.object_id, d.version, &d.digest, &[]) {
            Ok(()) | Err(StateError::Rollback { .. }) => {}
            Err(e) => return Err(IntegrityError::from_state(&d.object_id, e)),
        }
    }
    Ok(highest.len())
}

impl Manifest {
    /// Where a signed manifest lives by convention: beside the object, as `OBJECT.manifest`.
    pub fn default_path(object: &Path) -> PathBuf {
        let mut name = object.as_os_str().to_owned();
        name.push(".manifest");
        PathBuf::from(name)
    }
}

/// How to verify an object.
#[derive(Debug, Clone, Copy, Default)]
pub struct VerifyOptions<'a> {
    /// Threads and progress hook (the chunk size always comes from the manifest).
    /// Default: [`HashOptions::default`].
    pub hash: HashOptions<'a>,
    /// The node doing the verification. When set, a content mismatch blocks this node in the
    /// state store directly, without the policies and without telling any engine: a
    /// store-level path for programs that run no engine. With an engine, leave it unset
    /// and pass the outcome to [`crate::Engine::decide_read`], as the CLI and the
    /// server do. Default: none.
    pub node: Option<&'a str>,
    /// The object id the caller expects. When set, a validly signed manifest of another
    /// object is refused ([`IntegrityError::ObjectMismatch`]): set it whenever the caller
    /// knows what the file should be, to stop manifest substitution. Default: none.
    pub expected_object_id: Option<&'a str>,
}

/// What a successful verification established.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// Object id.
    pub object_id: String,
    /// Version.
    pub version: u64,
    /// Size in bytes.
    pub size: u64,
    /// Number of chunks checked.
    pub chunks: u64,
    /// Merkle root.
    pub root: Hash,
    /// Manifest digest.
    pub digest: Hash,
    /// Key that signed it.
    pub key_id: KeyId,
    /// Whether this verification raised the registry's accepted version.
    pub newly_accepted: bool,
}

/// What sealing and verifying need of the state, and nothing more: the registry of
/// accepted versions, the event log a failure is recorded in, and (for
/// [`VerifyOptions::node`], programs that run no engine) the blocklist. A
/// [`crate::state::StateStore`] is one; so is an engine's
/// [`crate::state::AttachedState`] (registry and blocks shared, events local).
pub trait Registry {
    /// The registry entry of `object_id`, if any version was accepted.
    fn registry_entry(&self, object_id: &str) -> Result<Option<RegistryEntry>, StateError>;
    /// Records `version` as accepted for `object_id`, refusing a rollback or another
    /// digest for the accepted version.
    fn accept(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
        signed_manifest: &[u8],
    ) -> Result<(), StateError>;
    /// Checks, without changing anything, that `version` with `digest` may be accepted
    /// (the shared state's own check: etcd answers it from its watched registry).
    fn check_version(
        &self,
        object_id: &str,
        version: u64,
        digest: &[u8; 32],
    ) -> Result<(), StateError>;
    /// Appends an event to this machine's event log; its sequence number.
    fn record_event(
        &self,
        object_id: &str,
        node: Option<&str>,
        kind: &str,
        detail: &str,
    ) -> Result<u64, StateError>;
    /// Blocks `node` at `now` (Unix seconds).
    fn block_node(&self, node: &str, reason: &str, now: u64) -> Result<(), StateError>;
}

/// Records an integrity failure: appends it to the event log (durably) and, when `node` is
/// given and the object's bytes differ from the manifest, blocks that node. This is what
/// [`Verifier::verify_object`] does on failure. It blocks without consulting the policies: for
/// a reader under the policies use [`crate::Engine::guard_reader`], and for a whole
/// object [`crate::Engine::decide_read`] (the CLI and the server do the latter).
pub(crate) fn record_failure(
    registry: &dyn Registry,
    object_id: &str,
    node: Option<&str>,
    err: &IntegrityError,
) -> Result<(), StateError> {
    let detail = err.to_string();
    registry.record_event(object_id, node, err.kind(), &detail)?;
    if let Some(node) = node
        && err.is_content_mismatch()
    {
        // Programs that run no engine have no clock of their own to ask.
        let now =
            u64::try_from(crate::clock::Clock::now_unix(&crate::clock::SystemClock)).unwrap_or(0);
        registry.block_node(node, &detail, now)?;
    }
    Ok(())
}

fn verify_inner(
    path: &Path,
    opened: Option<(std::fs::File, u64)>,
    signed: &SignedManifest,
    verifier: &Verifier,
    registry: &dyn Registry,
    options: &VerifyOptions<'_>,
) -> Result<VerifyReport, IntegrityError> {
    let m = signed.manifest();
    if let Some(expected) = options.expected_object_id
        && expected != m.object_id()
    {
        return Err(IntegrityError::ObjectMismatch {
            expected: expected.to_owned(),
            found: m.object_id().to_owned(),
        });
    }
    check_manifest(signed, verifier, registry)?;
    let (file, actual) = match opened {
        Some(o) => o,
        None => hash::open_sized(path)?,
    };
    compare_size(path, m, actual)?;
    let hash_options = HashOptions {
        chunk_size: m.chunk_size(),
        ..options.hash
    };
    let leaves = hash::hash_chunks(&file, path, actual, &hash_options)?;
    if let Some(err) = first_mismatch(path, m, &leaves) {
        return Err(err);
    }
    let before = registry
        .registry_entry(m.object_id())
        .map_err(|e| IntegrityError::from_state(m.object_id(), e))?;
    registry
        .accept(
            m.object_id(),
            m.version(),
            signed.digest(),
            &signed.encode(),
        )
        .map_err(|e| IntegrityError::from_state(m.object_id(), e))?;
    Ok(VerifyReport {
        object_id: m.object_id().to_owned(),
        version: m.version(),
        size: m.size(),
        chunks: m.chunk_count(),
        root: *m.root(),
        digest: *signed.digest(),
        key_id: signed.key_id(),
        newly_accepted: before.is_none_or(|e| e.version < m.version()),
    })
}

pub(crate) fn compare_size(path: &Path, m: &Manifest, actual: u64) -> Result<(), IntegrityError> {
    let expected = m.size();
    if actual < expected {
        let cs = u64::from(m.chunk_size());
        return Err(IntegrityError::Truncated {
            path: path.to_owned(),
            expected,
            actual,
            index: actual / cs,
            offset: actual,
        });
    }
    if actual > expected {
        return Err(IntegrityError::Extended {
            path: path.to_owned(),
            expected,
            actual,
            offset: expected,
        });
    }
    Ok(())
}

/// The first chunk whose hash differs from the signed leaf, as an error.
fn first_mismatch(path: &Path, m: &Manifest, leaves: &[Hash]) -> Option<IntegrityError> {
    let (index, found) = m
        .leaves()
        .iter()
        .zip(leaves)
        .enumerate()
        .find(|(_, (signed, found))| signed != found)
        .map(|(i, (_, found))| (i as u64, found))?;
    let by_leaf: HashMap<&Hash, u64> = m
        .leaves()
        .iter()
        .enumerate()
        .map(|(i, h)| (h, i as u64))
        .collect();
    Some(mismatch_error(path, m, index, found, &by_leaf))
}

pub(crate) fn mismatch_error(
    path: &Path,
    m: &Manifest,
    index: u64,
    found: &Hash,
    by_leaf: &HashMap<&Hash, u64>,
) -> IntegrityError {
    let offset = m.chunk_offset(index);
    match by_leaf.get(found) {
        Some(&other) if other != index => IntegrityError::ChunkReordered {
            path: path.to_owned(),
            index,
            offset,
            found_chunk: other,
        },
        _ => IntegrityError::ChunkMismatch {
            path: path.to_owned(),
            index,
            offset,
        },
    }
}

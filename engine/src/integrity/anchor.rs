//! Anchors sign manifest digests; verifiers check them against a pinned public key.
//!
//! # Signature scheme
//!
//! ECDSA P-256 with SHA-256 over the **message = the 32-byte manifest digest**: the signer
//! computes `SHA-256(message)` and signs that prehash (raw `CKM_ECDSA` in an HSM, since
//! SoftHSM2 has no `CKM_ECDSA_SHA256`); the signature is the fixed-length `r || s` (64 bytes);
//! nodes verify with ring's `ECDSA_P256_SHA256_FIXED` over the message, with no HSM round trip.

use std::path::PathBuf;

use ring::signature::{ECDSA_P256_SHA256_FIXED, UnparsedPublicKey};
use thiserror::Error;

use super::manifest::{Hash, sha256};

/// Length of an uncompressed P-256 public point (`0x04 || X || Y`).
pub const PUBLIC_KEY_LEN: usize = 65;
/// Length of a fixed `r || s` P-256 signature.
pub const SIGNATURE_LEN: usize = 64;

/// An ECDSA P-256 public key, as an uncompressed SEC1 point.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PublicKey([u8; PUBLIC_KEY_LEN]);

impl PublicKey {
    /// Parses an uncompressed SEC1 point (65 bytes starting with `0x04`).
    pub fn from_sec1(bytes: &[u8]) -> Result<Self, AnchorError> {
        let point: [u8; PUBLIC_KEY_LEN] = bytes
            .try_into()
            .map_err(|_| AnchorError::InvalidPublicKey { len: bytes.len() })?;
        if point.first() != Some(&0x04) {
            return Err(AnchorError::InvalidPublicKey { len: bytes.len() });
        }
        Ok(Self(point))
    }
    /// Parses the hex form of an uncompressed SEC1 point (130 hex digits, surrounding
    /// whitespace ignored), as pinned in configuration files.
    pub fn from_hex(text: &str) -> Result<Self, AnchorError> {
        let text = text.trim();
        let invalid = AnchorError::InvalidPublicKey {
            len: text.len() / 2,
        };
        if text.len() != 2 * PUBLIC_KEY_LEN || !text.is_ascii() {
            return Err(invalid);
        }
        let mut bytes = [0u8; PUBLIC_KEY_LEN];
        hex::decode_to_slice(text, &mut bytes).map_err(|_| invalid)?;
        Self::from_sec1(&bytes)
    }
    /// The hex form of the uncompressed point (see [`PublicKey::from_hex`]).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
    /// The uncompressed SEC1 point.
    pub fn as_sec1(&self) -> &[u8; PUBLIC_KEY_LEN] {
        &self.0
    }
    /// The key id: SHA-256 of the uncompressed point.
    pub fn key_id(&self) -> KeyId {
        KeyId(sha256(&self.0))
    }
}

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PublicKey({})", self.key_id())
    }
}

/// The SHA-256 of a public key, naming it in signed manifests.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId(pub Hash);

impl std::fmt::Display for KeyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl std::fmt::Debug for KeyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyId({self})")
    }
}

/// A fixed-length `r || s` ECDSA P-256 signature.
#[derive(Clone, PartialEq, Eq)]
pub struct Signature(pub [u8; SIGNATURE_LEN]);

impl std::fmt::Debug for Signature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Signature({})", hex(&self.0))
    }
}

/// What kind of anchor signs: only an HSM keeps the key out of reach of the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnchorKind {
    /// A PKCS#11 token (HSM); the key never leaves it.
    Hsm,
    /// A key file on the host (not an HSM).
    Software,
}

/// A human description of an anchor, for every output about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnchorDescription {
    /// HSM or software.
    pub kind: AnchorKind,
    /// One line naming the anchor, e.g. `software anchor (not an HSM): key /etc/probity/key`.
    pub summary: String,
    /// The key id of its public key.
    pub key_id: KeyId,
    /// Whether the HSM protects the key (sensitive, not extractable, generated in the
    /// token or never extractable). False for the software anchor, and for a token key
    /// used despite failing the check ([`crate::integrity::Pkcs11Config::allow_unprotected_key`]).
    pub key_protected: bool,
}

impl AnchorDescription {
    /// Whether signatures are HSM-protected: the key lives in an HSM that protects it.
    /// A token key that failed the protection check does not count.
    pub fn is_hsm(&self) -> bool {
        self.kind == AnchorKind::Hsm && self.key_protected
    }
}

impl std::fmt::Display for AnchorDescription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (key id {})", self.summary, self.key_id)
    }
}

/// A signer of manifest digests (like a rustls crypto provider: pick one, plug it in).
pub trait Anchor: Send + Sync {
    /// Signs a manifest digest (see the module docs for the exact scheme).
    fn sign(&self, digest: &Hash) -> Result<Signature, AnchorError>;
    /// The public key that verifies this anchor's signatures.
    fn public_key(&self) -> &PublicKey;
    /// Also stores the digest in the anchor, for sites that require the hash to live in the
    /// HSM. Default: does nothing.
    fn store_digest(
        &self,
        object_id: &str,
        version: u64,
        digest: &Hash,
    ) -> Result<(), AnchorError> {
        let _ = (object_id, version, digest);
        Ok(())
    }
    /// Describes the anchor, saying whether it is an HSM.
    fn describe(&self) -> AnchorDescription;
}

/// Checks anchor signatures against a pinned public key; needs no HSM session.
#[derive(Debug, Clone)]
pub struct Verifier {
    key: PublicKey,
}

impl Verifier {
    /// A verifier pinned to `key`.
    pub fn new(key: PublicKey) -> Self {
        Self { key }
    }
    /// The pinned key.
    pub fn public_key(&self) -> &PublicKey {
        &self.key
    }
    /// The pinned key's id.
    pub fn key_id(&self) -> KeyId {
        self.key.key_id()
    }
    /// Whether `signature` is the pinned key's signature over `digest`.
    pub fn verify(&self, digest: &Hash, signature: &Signature) -> bool {
        UnparsedPublicKey::new(&ECDSA_P256_SHA256_FIXED, self.key.as_sec1())
            .verify(digest, &signature.0)
            .is_ok()
    }
}

/// Why an anchor could not be opened or could not sign.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum AnchorError {
    /// The PKCS#11 module could not be loaded.
    #[error("cannot load or initialize PKCS#11 module {module}")]
    ModuleLoad {
        /// Module path.
        module: PathBuf,
        /// Loader error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No slot holds a token with this label.
    #[error("no token labelled {label:?} in PKCS#11 module {module}")]
    TokenNotFound {
        /// Token label.
        label: String,
        /// Module path.
        module: PathBuf,
    },
    /// The token rejected the user PIN.
    #[error("wrong user PIN for token {token:?}")]
    WrongPin {
        /// Token label.
        token: String,
    },
    /// The token's user PIN is locked after too many failures.
    #[error("user PIN of token {token:?} is locked")]
    PinLocked {
        /// Token label.
        token: String,
    },
    /// The PIN environment variable is unset or empty.
    #[error("PIN environment variable {var} is unset or empty")]
    PinEnvMissing {
        /// Variable name.
        var: String,
    },
    /// The PIN file could not be read, or its first line is empty.
    #[error("cannot read a PIN from file {path}")]
    PinFile {
        /// File path.
        path: PathBuf,
        /// I/O error.
        #[source]
        source: std::io::Error,
    },
    /// No signing key with this label on the token.
    #[error("no private key labelled {key:?} on token {token:?}")]
    KeyNotFound {
        /// Key label.
        key: String,
        /// Token label.
        token: String,
    },
    /// A key with this label already exists (refusing to create a second one).
    #[error("a key labelled {key:?} already exists on token {token:?}")]
    KeyExists {
        /// Key label.
        key: String,
        /// Token label.
        token: String,
    },
    /// The token holds a different digest for this object version.
    #[error("token {token:?} already holds a different digest for {label:?}")]
    DigestConflict {
        /// Token label.
        token: String,
        /// Data object label (`<object id>@<version>`).
        label: String,
    },
    /// A PKCS#11 call failed.
    #[error("PKCS#11 {operation} failed on token {token:?}")]
    Pkcs11 {
        /// What was being done.
        operation: &'static str,
        /// Token label.
        token: String,
        /// Module error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The signature produced does not verify under the anchor's own public key.
    #[error("anchor {anchor} produced a signature its public key does not verify")]
    SelfCheck {
        /// Anchor summary.
        anchor: String,
    },
    /// The public key is not an uncompressed P-256 point.
    #[error("public key is not an uncompressed P-256 point ({len} bytes)")]
    InvalidPublicKey {
        /// Length found.
        len: usize,
    },
    /// The software key file could not be read or written.
    #[error("software anchor (not an HSM): cannot access key file {path}")]
    KeyFile {
        /// File path.
        path: PathBuf,
        /// I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The software key file is readable or writable by group or others.
    #[error("software anchor (not an HSM): key file {path} has mode {mode:o}; it must be 0600")]
    KeyFilePermissions {
        /// File path.
        path: PathBuf,
        /// The permission bits found.
        mode: u32,
    },
    /// The software key file does not hold a P-256 PKCS#8 key.
    #[error("software anchor (not an HSM): key file {path} is not an ECDSA P-256 PKCS#8 key")]
    KeyFileInvalid {
        /// File path.
        path: PathBuf,
    },
    /// The software signer failed (random source or key).
    #[error("software anchor (not an HSM): signing failed")]
    SoftwareSign,
    /// A key file, PIN file or pinned public key that others could change (or read, for
    /// a secret) is not trusted.
    #[error(transparent)]
    Untrusted(#[from] crate::trust::TrustError),
    /// The token's key is not protected by the HSM: it could have been, or could be,
    /// copied out of the token.
    #[error(
        "key {key:?} on token {token:?} is not HSM-protected: {attribute} is {}, it must be {}",
        shown(*found),
        required(attribute)
    )]
    UnprotectedKey {
        /// Key label.
        key: String,
        /// Token label.
        token: String,
        /// The PKCS#11 attribute that failed, e.g. `CKA_EXTRACTABLE`.
        attribute: &'static str,
        /// What the token says (`None`: it does not say).
        found: Option<bool>,
    },
    /// The pinned public key file could not be read.
    #[error("cannot read the pinned public key {}", path.display())]
    PinnedKeyFile {
        /// File path.
        path: PathBuf,
        /// I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The pinned public key file does not hold a public key.
    #[error(
        "pinned public key {} is not the hex form of an uncompressed P-256 point (130 hex digits)",
        path.display()
    )]
    PinnedKeyInvalid {
        /// File path.
        path: PathBuf,
    },
}

fn shown(value: Option<bool>) -> &'static str {
    match value {
        Some(true) => "true",
        Some(false) => "false",
        None => "unavailable",
    }
}

/// What a protection attribute must be (see `pkcs11::check_protection`).
fn required(attribute: &str) -> &'static str {
    match attribute {
        "CKA_EXTRACTABLE" => "false",
        "CKA_ALWAYS_SENSITIVE" | "CKA_NEVER_EXTRACTABLE" => {
            "true (the key was not generated in the token: CKA_LOCAL is not true)"
        }
        _ => "true",
    }
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    hex::encode(bytes)
}

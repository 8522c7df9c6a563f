//! Key-encryption keys (KEKs): the keys that wrap data keys, behind a small pluggable trait.
//!
//! Why this module exists: data keys are stored only wrapped, and where the wrapping key lives
//! decides how much an attacker who reads the host gets. A [`KekProvider`] hides that choice
//! (like a rustls crypto provider): [`Pkcs11Kek`] keeps each KEK inside an HSM as a
//! non-extractable AES-256 key and wraps with `CKM_AES_KEY_WRAP_PAD`; [`SoftwareKek`] keeps
//! each KEK in a 0600 file and wraps with the same algorithm (RFC 5649) in process, and says
//! "software KEK: not an HSM" wherever it is described.
//!
//! KEKs are named by label. A dataset's keys share the keyring's dataset KEK; each erasable
//! data subject gets a KEK of its own ([`subject_kek_label`]), so destroying that one KEK
//! makes every wrapped copy of the subject's data keys useless, wherever the copies went.

use std::path::PathBuf;

use sha2::{Digest as _, Sha256};
use thiserror::Error;

use crate::secret::{DataKey, PinError, RandomError};

mod pkcs11;
mod software;

pub use pkcs11::Pkcs11Kek;
pub use software::{SOFTWARE_KEK_NOTICE, SoftwareKek};

/// Longest KEK label accepted (PKCS#11 labels are commonly limited to a few dozen bytes by
/// tools; 128 leaves room for prefixes).
pub const MAX_KEK_LABEL_LEN: usize = 128;

/// The KEK label for data subject `subject`: `probity-subject-` and 32 hex digits of
/// SHA-256 over a domain tag and the subject id. Hashing keeps the subject's identity (often
/// personal data) out of the HSM's object list and keeps labels short and printable.
pub fn subject_kek_label(subject: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"probity-keys subject KEK\0");
    h.update(subject.as_bytes());
    let digest = h.finalize();
    let half = digest.get(..16).unwrap_or_default();
    format!("probity-subject-{}", hex::encode(half))
}

/// Checks a KEK label: 1 to [`MAX_KEK_LABEL_LEN`] bytes of `A-Z a-z 0-9 . _ -`, not starting
/// with a dot (the software provider uses labels as file names).
pub fn check_kek_label(label: &str) -> Result<(), KekError> {
    let bad = |reason: &'static str| {
        Err(KekError::InvalidLabel {
            label: label.to_owned(),
            reason,
        })
    };
    if label.is_empty() {
        return bad("it is empty");
    }
    if label.len() > MAX_KEK_LABEL_LEN {
        return bad("it is longer than 128 bytes");
    }
    if label.starts_with('.') {
        return bad("it starts with a dot");
    }
    if !label
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return bad("only A-Z a-z 0-9 . _ - are allowed");
    }
    Ok(())
}

/// Where a KEK lives: only an HSM keeps it out of reach of the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KekKind {
    /// A PKCS#11 token (HSM); the KEK never leaves it.
    Hsm,
    /// A key file on the host: not an HSM.
    Software,
}

/// A one-line description of a KEK provider, for every output about it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KekDescription {
    /// HSM or software.
    pub kind: KekKind,
    /// E.g. `PKCS#11 token "probity" (SoftHSM)` or
    /// `software KEK: not an HSM (directory /var/lib/probity/kek)`.
    pub summary: String,
}

impl KekDescription {
    /// Whether KEKs live in an HSM.
    pub fn is_hsm(&self) -> bool {
        self.kind == KekKind::Hsm
    }
}

impl std::fmt::Display for KekDescription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.summary)
    }
}

/// Whether [`KekProvider::ensure_kek`] found the KEK or made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KekOutcome {
    /// A KEK with this label already existed and passed the provider's checks.
    Existing,
    /// The KEK was generated now.
    Created,
}

/// A holder of key-encryption keys. Implementations must be safe to share between threads.
pub trait KekProvider: Send + Sync {
    /// Describes the provider, saying whether it is an HSM.
    fn describe(&self) -> KekDescription;

    /// Generates a new KEK labelled `label`; fails with [`KekError::KekExists`] if one exists.
    fn generate_kek(&self, label: &str) -> Result<(), KekError>;

    /// Finds the KEK labelled `label` (checking it as the provider requires) or generates it.
    fn ensure_kek(&self, label: &str) -> Result<KekOutcome, KekError>;

    /// Whether a KEK labelled `label` exists (without checking its attributes).
    fn kek_exists(&self, label: &str) -> Result<bool, KekError>;

    /// Wraps `key` under the KEK labelled `label` (AES key wrap with padding, RFC 5649).
    fn wrap(&self, label: &str, key: &DataKey) -> Result<Vec<u8>, KekError>;

    /// Unwraps `wrapped` under the KEK labelled `label`.
    fn unwrap(&self, label: &str, wrapped: &[u8]) -> Result<DataKey, KekError>;

    /// Destroys the KEK labelled `label`: afterwards nothing wrapped under it can be unwrapped
    /// through this provider.
    fn destroy_kek(&self, label: &str) -> Result<(), KekError>;
}

/// Why a KEK operation failed. Messages name the token or file and the label.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum KekError {
    /// The PIN could not be obtained.
    #[error(transparent)]
    Pin(#[from] PinError),
    /// An empty PIN was given.
    #[error("token {token:?}: the user PIN is missing (empty)")]
    PinMissing {
        /// Token label.
        token: String,
    },
    /// The token refused the PIN.
    #[error("token {token:?} refused the user PIN")]
    WrongPin {
        /// Token label.
        token: String,
    },
    /// Too many wrong PINs.
    #[error("token {token:?}: the user PIN is locked")]
    PinLocked {
        /// Token label.
        token: String,
    },
    /// No slot holds a token with this label.
    #[error("no token labelled {token:?} in the PKCS#11 module {module}")]
    TokenNotFound {
        /// Token label.
        token: String,
        /// The module's description.
        module: String,
    },
    /// No KEK has this label.
    #[error("no KEK labelled {label:?} in {provider}")]
    KekNotFound {
        /// KEK label.
        label: String,
        /// The provider's summary.
        provider: String,
    },
    /// A KEK with this label exists already.
    #[error("a KEK labelled {label:?} already exists in {provider}")]
    KekExists {
        /// KEK label.
        label: String,
        /// The provider's summary.
        provider: String,
    },
    /// Several secret keys carry this label: which one is the KEK is ambiguous.
    #[error("{count} secret keys are labelled {label:?} on token {token:?}; refusing to guess")]
    KekAmbiguous {
        /// KEK label.
        label: String,
        /// Token label.
        token: String,
        /// How many.
        count: usize,
    },
    /// A KEK on the token fails an attribute check (it could leave the token, or was imported).
    #[error("KEK {label:?} on token {token:?} refused: {attribute} is {found}, {required}")]
    KekAttribute {
        /// KEK label.
        label: String,
        /// Token label.
        token: String,
        /// The attribute, e.g. `CKA_EXTRACTABLE`.
        attribute: &'static str,
        /// Its value, or `absent`.
        found: String,
        /// What is required.
        required: &'static str,
    },
    /// The wrapped key did not unwrap: the KEK is not the one it was wrapped under, or the
    /// wrapped bytes were altered.
    #[error(
        "wrapped key ({len} bytes) does not unwrap under KEK {label:?} in {provider}: wrong KEK or altered bytes"
    )]
    UnwrapRejected {
        /// KEK label.
        label: String,
        /// The provider's summary.
        provider: String,
        /// Length of the wrapped bytes.
        len: usize,
    },
    /// The label is not acceptable.
    #[error("KEK label {label:?} is invalid: {reason}")]
    InvalidLabel {
        /// The label.
        label: String,
        /// Why.
        reason: &'static str,
    },
    /// A PKCS#11 call failed.
    #[error("PKCS#11 {operation} failed on token {token:?}")]
    Pkcs11 {
        /// What was being done.
        operation: &'static str,
        /// Token label.
        token: String,
        /// The module's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A software KEK file or its directory could not be read or written.
    #[error("cannot {operation} {path} [software KEK: not an HSM]")]
    KeyFile {
        /// What was being done.
        operation: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A software KEK file or directory has permissions that let others read or change it.
    #[error(
        "{path} has mode {mode:04o}; refusing it while group or others have {access} access [software KEK: not an HSM]"
    )]
    KeyFilePermissions {
        /// The file or directory.
        path: PathBuf,
        /// Its mode bits.
        mode: u32,
        /// `read or write`, or `write` for the directory.
        access: &'static str,
    },
    /// A software KEK file or directory is owned by another user.
    #[error(
        "{path} is owned by uid {owner}, not by this process's uid {euid} [software KEK: not an HSM]"
    )]
    KeyFileOwner {
        /// The file or directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// This process's effective uid.
        euid: u32,
    },
    /// A software KEK file is not a regular file of exactly 32 bytes.
    #[error("{path} is not a KEK file: {reason} [software KEK: not an HSM]")]
    KeyFileInvalid {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The random generator failed.
    #[error(transparent)]
    Random(#[from] RandomError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subject_labels_are_stable_short_and_valid() {
        let a = subject_kek_label("alice@example.org");
        assert_eq!(a.len(), "probity-subject-".len() + 32);
        assert_eq!(a, subject_kek_label("alice@example.org"));
        assert_ne!(a, subject_kek_label("bob@example.org"));
        assert!(!a.contains("alice"));
        check_kek_label(&a).unwrap();
    }

    #[test]
    fn labels_are_checked() {
        for bad in ["", ".hidden", "a/b", "a b", &"x".repeat(129)] {
            assert!(
                matches!(check_kek_label(bad), Err(KekError::InvalidLabel { .. })),
                "{bad:?}"
            );
        }
        check_kek_label("probity-kek_1.v2").unwrap();
    }
}

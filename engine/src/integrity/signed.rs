//! The signed manifest file: a manifest, the anchor's signature over its digest, and the id of
//! the signing key.
//!
//! # Encoding (format version 1, big-endian)
//!
//! | field               | bytes | rule                                              |
//! |---------------------|-------|---------------------------------------------------|
//! | magic               | 4     | `PRBS`                                            |
//! | format              | 2     | `1`                                               |
//! | signature algorithm | 1     | `1` = ECDSA P-256, SHA-256, fixed `r‖s`           |
//! | key id              | 32    | SHA-256 of the signer's uncompressed public point |
//! | signature length    | 2     | `64`                                              |
//! | signature           | 64    |                                                   |
//! | manifest length     | 8     | must equal the number of bytes that follow        |
//! | manifest            | n     | the canonical manifest encoding                   |
//!
//! Decoding is strict (trailing bytes, wrong lengths, unknown codes are errors) and never
//! panics. Decoding does **not** check the signature: [`crate::integrity::verify_object`] and
//! [`crate::integrity::VerifiedReader`] do, against a pinned key.

use thiserror::Error;

use super::anchor::{KeyId, SIGNATURE_LEN, Signature, Verifier};
use super::manifest::{Cursor, Hash, Manifest, ManifestError, sha256};

/// Magic bytes opening a signed manifest.
pub const SIGNED_MAGIC: [u8; 4] = *b"PRBS";
/// The only signed manifest format version this build reads and writes.
pub const SIGNED_FORMAT: u16 = 1;
const ALG_ECDSA_P256_SHA256: u8 = 1;

/// Why a signed manifest could not be decoded.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SignedManifestError {
    /// The input ended inside a field.
    #[error("signed manifest ends at byte {offset} inside the {field} field")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Byte offset where the field starts.
        offset: usize,
    },
    /// Not a signed manifest.
    #[error("not a probity signed manifest: bad magic bytes at offset 0")]
    BadMagic,
    /// Unknown format version.
    #[error("unsupported signed manifest format version {0} (this build reads version 1)")]
    UnsupportedFormat(u16),
    /// Unknown signature algorithm.
    #[error("unknown signature algorithm code {0} at byte 6")]
    UnknownSignatureAlgorithm(u8),
    /// The signature length is not 64.
    #[error("signature length {0} at byte 39 is not 64")]
    SignatureLength(u16),
    /// The manifest length does not match the bytes that follow.
    #[error("manifest length field says {declared} bytes but {present} follow at byte {offset}")]
    ManifestLength {
        /// Declared length.
        declared: u64,
        /// Bytes present.
        present: usize,
        /// Offset of the manifest.
        offset: usize,
    },
    /// The embedded manifest is invalid.
    #[error("embedded manifest at byte {offset} is invalid")]
    Manifest {
        /// Offset of the manifest.
        offset: usize,
        /// What is wrong with it.
        #[source]
        source: ManifestError,
    },
}

fn envelope(e: ManifestError) -> SignedManifestError {
    match e {
        ManifestError::Truncated { field, offset, .. } => {
            SignedManifestError::Truncated { field, offset }
        }
        other => SignedManifestError::Manifest {
            offset: 0,
            source: other,
        },
    }
}

/// A manifest with its anchor signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedManifest {
    manifest: Manifest,
    encoded: Vec<u8>,
    digest: Hash,
    signature: Signature,
    key_id: KeyId,
}

impl SignedManifest {
    /// Wraps a manifest with a signature made by the key `key_id`.
    pub fn new(manifest: Manifest, signature: Signature, key_id: KeyId) -> Self {
        let encoded = manifest.encode();
        let digest = sha256(&encoded);
        Self {
            manifest,
            encoded,
            digest,
            signature,
            key_id,
        }
    }
    /// The manifest (not yet trusted unless [`SignedManifest::check_signature`] succeeded).
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    /// The manifest digest: SHA-256 of its canonical encoding.
    pub fn digest(&self) -> &Hash {
        &self.digest
    }
    /// The signature over the digest.
    pub fn signature(&self) -> &Signature {
        &self.signature
    }
    /// The id of the key that signed.
    pub fn key_id(&self) -> KeyId {
        self.key_id
    }

    /// Checks the signature against the verifier's pinned key.
    pub fn check_signature(&self, verifier: &Verifier) -> Result<(), SignatureProblem> {
        if self.key_id != verifier.key_id() {
            return Err(SignatureProblem::WrongKey {
                expected: verifier.key_id(),
                found: self.key_id,
            });
        }
        if verifier.verify(&self.digest, &self.signature) {
            Ok(())
        } else {
            Err(SignatureProblem::Invalid)
        }
    }

    /// The file encoding (see the module docs).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(113 + self.encoded.len());
        out.extend_from_slice(&SIGNED_MAGIC);
        out.extend_from_slice(&SIGNED_FORMAT.to_be_bytes());
        out.push(ALG_ECDSA_P256_SHA256);
        out.extend_from_slice(&self.key_id.0);
        out.extend_from_slice(&(SIGNATURE_LEN as u16).to_be_bytes());
        out.extend_from_slice(&self.signature.0);
        out.extend_from_slice(&(self.encoded.len() as u64).to_be_bytes());
        out.extend_from_slice(&self.encoded);
        out
    }

    /// Decodes the file encoding strictly.
    pub fn decode(bytes: &[u8]) -> Result<Self, SignedManifestError> {
        let mut r = Cursor { bytes, pos: 0 };
        if r.take("magic", 4).map_err(envelope)? != SIGNED_MAGIC {
            return Err(SignedManifestError::BadMagic);
        }
        let format = r.u16("format version").map_err(envelope)?;
        if format != SIGNED_FORMAT {
            return Err(SignedManifestError::UnsupportedFormat(format));
        }
        let alg = r.u8("signature algorithm").map_err(envelope)?;
        if alg != ALG_ECDSA_P256_SHA256 {
            return Err(SignedManifestError::UnknownSignatureAlgorithm(alg));
        }
        let key_id = KeyId(r.array("key id").map_err(envelope)?);
        let sig_len = r.u16("signature length").map_err(envelope)?;
        if usize::from(sig_len) != SIGNATURE_LEN {
            return Err(SignedManifestError::SignatureLength(sig_len));
        }
        let signature = Signature(r.array("signature").map_err(envelope)?);
        let declared = r.u64("manifest length").map_err(envelope)?;
        let offset = r.pos;
        let rest = r.rest();
        if declared != rest.len() as u64 {
            return Err(SignedManifestError::ManifestLength {
                declared,
                present: rest.len(),
                offset,
            });
        }
        let manifest = Manifest::decode(rest)
            .map_err(|source| SignedManifestError::Manifest { offset, source })?;
        Ok(Self {
            manifest,
            encoded: rest.to_vec(),
            digest: sha256(rest),
            signature,
            key_id,
        })
    }
}

/// Why a signature check failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum SignatureProblem {
    /// Signed by a key other than the pinned one.
    #[error("manifest is signed by key {found}, not the pinned key {expected}")]
    WrongKey {
        /// The pinned key id.
        expected: KeyId,
        /// The key id in the signed manifest.
        found: KeyId,
    },
    /// The signature does not verify: the manifest or signature was altered.
    #[error("signature does not match the manifest (manifest or signature altered)")]
    Invalid,
}

/// For the fuzz target `checkpoint_manifest`: any bytes as a `.manifest` file.
#[cfg(feature = "fuzzing")]
pub mod fuzzing {
    use super::SignedManifest;

    /// Decodes `data` strictly; what decodes re-encodes to bytes that decode to the same
    /// manifest digest, key and signature.
    pub fn signed_manifest(data: &[u8]) {
        if let Ok(m) = SignedManifest::decode(data) {
            let encoded = m.encode();
            assert_eq!(encoded, data, "a decoded manifest re-encodes to its input");
            let again = SignedManifest::decode(&encoded);
            assert!(again.is_ok(), "a re-encoded manifest does not decode");
            if let Ok(again) = again {
                assert_eq!(again.digest(), m.digest());
                assert_eq!(again.key_id(), m.key_id());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::integrity::anchor::Anchor as _;
    use crate::integrity::software::SoftwareAnchor;

    #[test]
    fn roundtrip_truncations_and_flips_never_panic() {
        let dir = tempfile::tempdir().unwrap();
        let anchor = SoftwareAnchor::generate(&dir.path().join("k")).unwrap();
        let leaves = vec![sha256(b"a"), sha256(b"b")];
        let m = Manifest::new("obj", 3, 1500, 1024, leaves).unwrap();
        let sig = anchor.sign(&m.digest()).unwrap();
        let s = SignedManifest::new(m, sig, anchor.public_key().key_id());
        let enc = s.encode();
        let back = SignedManifest::decode(&enc).unwrap();
        assert_eq!(back, s);
        let verifier = Verifier::new(anchor.public_key().clone());
        back.check_signature(&verifier).unwrap();
        for n in 0..enc.len() {
            assert!(SignedManifest::decode(&enc[..n]).is_err());
        }
        let mut longer = enc.clone();
        longer.push(1);
        assert!(SignedManifest::decode(&longer).is_err());
        for bit in 0..enc.len() * 8 {
            let mut e = enc.clone();
            e[bit / 8] ^= 1 << (bit % 8);
            if let Ok(d) = SignedManifest::decode(&e) {
                assert!(d.check_signature(&verifier).is_err(), "bit {bit} accepted");
            }
        }
    }
}

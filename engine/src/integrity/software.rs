//! The software anchor: an ECDSA P-256 key in a local file. **Not an HSM**: anyone who can read
//! the file can sign. It exists as the embedded default for a first run; every description of
//! it says "software anchor (not an HSM)".

use std::io::Write as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use ring::rand::SystemRandom;
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair as _};

use super::anchor::{
    Anchor, AnchorDescription, AnchorError, AnchorKind, PublicKey, SIGNATURE_LEN, Signature,
};
use super::manifest::Hash;

/// An anchor whose key is a PKCS#8 file with mode 0600 (not an HSM).
pub struct SoftwareAnchor {
    path: PathBuf,
    key: EcdsaKeyPair,
    public: PublicKey,
    rng: SystemRandom,
}

impl std::fmt::Debug for SoftwareAnchor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftwareAnchor")
            .field("kind", &"software anchor (not an HSM)")
            .field("path", &self.path)
            .field("public", &self.public)
            .finish_non_exhaustive()
    }
}

impl SoftwareAnchor {
    /// Generates a new key and writes it to `path`, created with mode 0600. Fails if the file
    /// exists.
    pub fn generate(path: &Path) -> Result<Self, AnchorError> {
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng)
            .map_err(|_| AnchorError::SoftwareSign)?;
        let key_err = |source| AnchorError::KeyFile {
            path: path.to_owned(),
            source,
        };
        let mut file = crate::trust::create_private_file(path)?;
        file.write_all(pkcs8.as_ref()).map_err(key_err)?;
        file.sync_all().map_err(key_err)?;
        Self::from_pkcs8(path, pkcs8.as_ref(), rng)
    }

    /// Loads the key at `path`, refusing a file with any group or other permission bit,
    /// owned by another user than this one or root, or in a directory others could
    /// change (see `probity_base::trust`).
    pub fn load(path: &Path) -> Result<Self, AnchorError> {
        let key_err = |source| AnchorError::KeyFile {
            path: path.to_owned(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(key_err)?;
        let mode = meta.mode() & 0o777;
        if crate::trust::granted_to_others(mode, 0o7).is_some() {
            return Err(AnchorError::KeyFilePermissions {
                path: path.to_owned(),
                mode,
            });
        }
        crate::trust::check_file(path, crate::trust::Material::Secret)?;
        let bytes = std::fs::read(path).map_err(key_err)?;
        Self::from_pkcs8(path, &bytes, SystemRandom::new())
    }

    /// Loads the key at `path`, or generates it there if the file does not exist.
    pub fn load_or_generate(path: &Path) -> Result<Self, AnchorError> {
        if path.exists() {
            Self::load(path)
        } else {
            Self::generate(path)
        }
    }

    /// The key file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn from_pkcs8(path: &Path, pkcs8: &[u8], rng: SystemRandom) -> Result<Self, AnchorError> {
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8, &rng).map_err(
            |_| AnchorError::KeyFileInvalid {
                path: path.to_owned(),
            },
        )?;
        let public = PublicKey::from_sec1(key.public_key().as_ref())?;
        Ok(Self {
            path: path.to_owned(),
            key,
            public,
            rng,
        })
    }
}

impl Anchor for SoftwareAnchor {
    fn sign(&self, digest: &Hash) -> Result<Signature, AnchorError> {
        let sig = self
            .key
            .sign(&self.rng, digest)
            .map_err(|_| AnchorError::SoftwareSign)?;
        let fixed: [u8; SIGNATURE_LEN] = sig
            .as_ref()
            .try_into()
            .map_err(|_| AnchorError::SoftwareSign)?;
        Ok(Signature(fixed))
    }

    fn public_key(&self) -> &PublicKey {
        &self.public
    }

    fn describe(&self) -> AnchorDescription {
        AnchorDescription {
            kind: AnchorKind::Software,
            summary: format!(
                "software anchor (not an HSM): key file {}",
                self.path.display()
            ),
            key_id: self.public.key_id(),
            key_protected: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::integrity::anchor::Verifier;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn generate_sign_verify_and_permissions() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("anchor.key");
        let a = SoftwareAnchor::generate(&path).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert!(!a.describe().is_hsm());
        assert!(
            a.describe()
                .to_string()
                .contains("software anchor (not an HSM)")
        );
        let digest = [7u8; 32];
        let sig = a.sign(&digest).unwrap();
        let v = Verifier::new(a.public_key().clone());
        assert!(v.verify(&digest, &sig));
        assert!(!v.verify(&[8u8; 32], &sig));

        let b = SoftwareAnchor::load(&path).unwrap();
        assert_eq!(b.public_key(), a.public_key());
        assert!(SoftwareAnchor::generate(&path).is_err());

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(matches!(
            SoftwareAnchor::load(&path),
            Err(AnchorError::KeyFilePermissions { mode: 0o640, .. })
        ));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&path, b"garbage").unwrap();
        assert!(matches!(
            SoftwareAnchor::load(&path),
            Err(AnchorError::KeyFileInvalid { .. })
        ));
    }
}

//! The software KEK provider: each KEK is 32 random bytes in a file of its own. **Not an
//! HSM**: anyone who can read the file can unwrap every data key wrapped under it. It exists
//! as the embedded default for a first run and for machines without a token; every
//! description of it says "software KEK: not an HSM".
//!
//! * Files live in one directory (created 0700), one per label: `LABEL.kek`, created 0600
//!   whatever the umask (the mode is set explicitly after creation).
//! * A file (or the directory) that another user owns, a file that group or others can read
//!   or write, a directory that group or others can write, a symbolic link, or a file that is
//!   not exactly 32 bytes is refused, naming the path and what is wrong.
//! * Wrapping is AES key wrap with padding (RFC 5649, the `aes-kw` crate), the same algorithm
//!   as the PKCS#11 provider's `CKM_AES_KEY_WRAP_PAD`.
//! * Destroying a KEK overwrites the file with zeros, syncs it, unlinks it and syncs the
//!   directory. That is the best a file can do: it cannot reach backups, snapshots, or blocks
//!   the file system or the SSD kept elsewhere (see the crate README).
//! * KEK bytes are read from the file for each operation and zeroized after it, so a
//!   destroyed KEK is gone from this process at once (the keyring caches unwrapped *data*
//!   keys, not KEKs).

use std::fs::{self, File, OpenOptions};
use std::io::{Read as _, Write as _};
use std::os::unix::fs::{
    DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt,
};
use std::path::{Path, PathBuf};

use aes_kw::{KeyInit as _, KwpAes256};
use probity_base::trust;
use zeroize::Zeroizing;

use super::{KekDescription, KekError, KekKind, KekOutcome, KekProvider, check_kek_label};
use crate::secret::{DATA_KEY_LEN, DataKey, RandomSource, SystemRandom};

/// The words that label every description and output of a software KEK.
pub const SOFTWARE_KEK_NOTICE: &str = "software KEK: not an HSM";

/// Length of a data key wrapped with RFC 5649 (32 bytes of key plus the 8-byte integrity
/// block).
const WRAPPED_LEN: usize = DATA_KEY_LEN + 8;

/// KEKs in files of a local directory (not an HSM).
pub struct SoftwareKek {
    dir: PathBuf,
    random: SystemRandom,
}

impl std::fmt::Debug for SoftwareKek {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftwareKek")
            .field("kind", &SOFTWARE_KEK_NOTICE)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn file_err(operation: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> KekError {
    let path = path.to_owned();
    move |source| KekError::KeyFile {
        operation,
        path,
        source,
    }
}

fn kwp(kek: &[u8; DATA_KEY_LEN]) -> KwpAes256 {
    KwpAes256::new(&(*kek).into())
}

/// Refuses a file or directory that another user owns (root too: stricter than the engine's
/// trust material, judged by the same [`trust::foreign_owner`]).
fn check_owner(path: &Path, meta: &fs::Metadata) -> Result<(), KekError> {
    if let Some((owner, euid)) = trust::foreign_owner(meta, false) {
        return Err(KekError::KeyFileOwner {
            path: path.to_owned(),
            owner,
            euid,
        });
    }
    Ok(())
}

impl SoftwareKek {
    /// Opens (creating it 0700 if missing) the KEK directory `dir`, refusing one that another
    /// user owns or that group or others can write.
    pub fn open(dir: &Path) -> Result<Self, KekError> {
        if !dir.exists() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(file_err("create the KEK directory", dir))?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
                .map_err(file_err("set the mode of", dir))?;
        }
        let meta = fs::symlink_metadata(dir).map_err(file_err("inspect", dir))?;
        if !meta.is_dir() {
            return Err(KekError::KeyFileInvalid {
                path: dir.to_owned(),
                reason: "the KEK directory is not a directory (or is a symbolic link)".into(),
            });
        }
        check_owner(dir, &meta)?;
        let mode = meta.mode() & 0o7777;
        if trust::granted_to_others(mode, 0o2).is_some() {
            return Err(KekError::KeyFilePermissions {
                path: dir.to_owned(),
                mode,
                access: "write",
            });
        }
        Ok(Self {
            dir: dir.to_owned(),
            random: SystemRandom::new(),
        })
    }

    /// The KEK directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file that holds the KEK labelled `label`.
    pub fn kek_path(&self, label: &str) -> Result<PathBuf, KekError> {
        check_kek_label(label)?;
        Ok(self.dir.join(format!("{label}.kek")))
    }

    fn not_found(&self, label: &str) -> KekError {
        KekError::KekNotFound {
            label: label.to_owned(),
            provider: self.describe().summary,
        }
    }

    /// Reads and checks the KEK file for `label`.
    fn read_kek(&self, label: &str) -> Result<Zeroizing<[u8; DATA_KEY_LEN]>, KekError> {
        let path = self.kek_path(label)?;
        let link = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(self.not_found(label));
            }
            Err(e) => return Err(file_err("inspect", &path)(e)),
        };
        if link.file_type().is_symlink() {
            return Err(KekError::KeyFileInvalid {
                path,
                reason: "it is a symbolic link".into(),
            });
        }
        let mut file = File::open(&path).map_err(file_err("open", &path))?;
        // Check the file we opened, not the path (it could have been swapped in between).
        let meta = file.metadata().map_err(file_err("inspect", &path))?;
        if !meta.is_file() {
            return Err(KekError::KeyFileInvalid {
                path,
                reason: "it is not a regular file".into(),
            });
        }
        check_owner(&path, &meta)?;
        let mode = meta.mode() & 0o7777;
        if trust::granted_to_others(mode, 0o7).is_some() {
            return Err(KekError::KeyFilePermissions {
                path,
                mode,
                access: "read or write",
            });
        }
        if meta.len() != DATA_KEY_LEN as u64 {
            return Err(KekError::KeyFileInvalid {
                path,
                reason: format!("it is {} bytes long, a KEK is 32", meta.len()),
            });
        }
        let mut kek = Zeroizing::new([0u8; DATA_KEY_LEN]);
        file.read_exact(kek.as_mut_slice())
            .map_err(file_err("read", &path))?;
        Ok(kek)
    }

    fn sync_dir(&self) -> Result<(), KekError> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(file_err("sync the KEK directory", &self.dir))
    }
}

impl KekProvider for SoftwareKek {
    fn describe(&self) -> KekDescription {
        KekDescription {
            kind: KekKind::Software,
            summary: format!("{SOFTWARE_KEK_NOTICE} (directory {})", self.dir.display()),
        }
    }

    fn generate_kek(&self, label: &str) -> Result<(), KekError> {
        let path = self.kek_path(label)?;
        let mut kek = Zeroizing::new([0u8; DATA_KEY_LEN]);
        self.random.fill(kek.as_mut_slice())?;
        let mut file = match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(KekError::KekExists {
                    label: label.to_owned(),
                    provider: self.describe().summary,
                });
            }
            Err(e) => return Err(file_err("create", &path)(e)),
        };
        // The umask may have cleared bits of 0600; set the mode itself.
        file.set_permissions(fs::Permissions::from_mode(0o600))
            .map_err(file_err("set the mode of", &path))?;
        file.write_all(kek.as_slice())
            .and_then(|()| file.sync_all())
            .map_err(file_err("write", &path))?;
        self.sync_dir()
    }

    fn ensure_kek(&self, label: &str) -> Result<KekOutcome, KekError> {
        match self.read_kek(label) {
            Ok(_) => Ok(KekOutcome::Existing),
            Err(KekError::KekNotFound { .. }) => {
                self.generate_kek(label)?;
                Ok(KekOutcome::Created)
            }
            Err(e) => Err(e),
        }
    }

    fn kek_exists(&self, label: &str) -> Result<bool, KekError> {
        let path = self.kek_path(label)?;
        match fs::symlink_metadata(&path) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(file_err("inspect", &path)(e)),
        }
    }

    fn wrap(&self, label: &str, key: &DataKey) -> Result<Vec<u8>, KekError> {
        let kek = self.read_kek(label)?;
        let kw = kwp(&kek);
        let mut out = vec![0u8; WRAPPED_LEN];
        let len = kw
            .wrap_key(key.expose(), &mut out)
            .map(<[u8]>::len)
            .map_err(|_| KekError::KeyFileInvalid {
                path: self.kek_path(label).unwrap_or_default(),
                reason: "AES key wrap refused the key length".into(),
            })?;
        out.truncate(len);
        Ok(out)
    }

    fn unwrap(&self, label: &str, wrapped: &[u8]) -> Result<DataKey, KekError> {
        let kek = self.read_kek(label)?;
        let kw = kwp(&kek);
        let rejected = || KekError::UnwrapRejected {
            label: label.to_owned(),
            provider: self.describe().summary,
            len: wrapped.len(),
        };
        if wrapped.len() != WRAPPED_LEN {
            return Err(rejected());
        }
        let mut out = Zeroizing::new([0u8; WRAPPED_LEN]);
        let key = kw
            .unwrap_key(wrapped, out.as_mut_slice())
            .map_err(|_| rejected())?;
        DataKey::from_slice(key).ok_or_else(rejected)
    }

    fn destroy_kek(&self, label: &str) -> Result<(), KekError> {
        let path = self.kek_path(label)?;
        // Checks ownership and type before touching the file.
        match self.read_kek(label) {
            Ok(_) | Err(KekError::KeyFilePermissions { .. } | KekError::KeyFileInvalid { .. }) => {}
            Err(e) => return Err(e),
        }
        if let Ok(mut file) = OpenOptions::new().write(true).open(&path) {
            let zeros = [0u8; DATA_KEY_LEN];
            file.write_all(&zeros)
                .and_then(|()| file.sync_all())
                .map_err(file_err("overwrite", &path))?;
        }
        fs::remove_file(&path).map_err(file_err("delete", &path))?;
        self.sync_dir()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_with_rfc5649_and_checks_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let kek = SoftwareKek::open(&dir.path().join("kek")).unwrap();
        assert!(kek.describe().summary.starts_with(SOFTWARE_KEK_NOTICE));
        assert!(format!("{kek:?}").contains(SOFTWARE_KEK_NOTICE));
        assert!(!kek.describe().is_hsm());
        assert_eq!(kek.ensure_kek("k1").unwrap(), KekOutcome::Created);
        assert_eq!(kek.ensure_kek("k1").unwrap(), KekOutcome::Existing);
        let path = kek.kek_path("k1").unwrap();
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        let data = DataKey::from_bytes([9; 32]);
        let wrapped = kek.wrap("k1", &data).unwrap();
        assert_eq!(wrapped.len(), 40);
        assert_eq!(kek.unwrap("k1", &wrapped).unwrap().expose(), &[9; 32]);
        let mut bad = wrapped.clone();
        bad[3] ^= 1;
        assert!(matches!(
            kek.unwrap("k1", &bad),
            Err(KekError::UnwrapRejected { .. })
        ));
        kek.destroy_kek("k1").unwrap();
        assert!(!path.exists());
        assert!(matches!(
            kek.unwrap("k1", &wrapped),
            Err(KekError::KekNotFound { .. })
        ));
    }
}

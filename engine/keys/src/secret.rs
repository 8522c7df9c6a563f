//! Secret material held in memory: data keys, token PINs, and the randomness that makes keys.
//!
//! Why this module exists: every secret that passes through this crate lives in one of these
//! types, so the rules are enforced in one place: a secret is never printed (redacted `Debug`,
//! no `Display`), never cloned implicitly, sits behind one heap allocation so moves do not
//! leave copies, and is zeroized when dropped.

use std::path::{Path, PathBuf};

use zeroize::Zeroize;

/// Length of a data key (AES-256) in bytes.
pub const DATA_KEY_LEN: usize = 32;

/// An AES-256 key in memory: a keyring data key or a per-object data encryption key.
///
/// Zeroized on drop; `Debug` shows nothing of it; share it with `Arc`, not by copying.
pub struct DataKey(Box<[u8; DATA_KEY_LEN]>);

impl DataKey {
    /// Takes ownership of `bytes` (the caller's copy should be zeroized by the caller).
    pub fn from_bytes(bytes: [u8; DATA_KEY_LEN]) -> Self {
        let mut boxed = Box::new([0u8; DATA_KEY_LEN]);
        boxed.copy_from_slice(&bytes);
        Self(boxed)
    }

    /// Copies a key from a slice, which must be exactly [`DATA_KEY_LEN`] bytes long.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != DATA_KEY_LEN {
            return None;
        }
        let mut boxed = Box::new([0u8; DATA_KEY_LEN]);
        boxed.copy_from_slice(bytes);
        Some(Self(boxed))
    }

    /// A fresh random key from `random`.
    pub fn generate(random: &dyn RandomSource) -> Result<Self, RandomError> {
        let mut boxed = Box::new([0u8; DATA_KEY_LEN]);
        random.fill(boxed.as_mut_slice())?;
        Ok(Self(boxed))
    }

    /// The key bytes, for handing to a cipher.
    pub fn expose(&self) -> &[u8; DATA_KEY_LEN] {
        &self.0
    }
}

impl Drop for DataKey {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

impl std::fmt::Debug for DataKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DataKey(<redacted>)")
    }
}

/// A token user PIN. Its `Debug` output is redacted, it has no `Display`, and it is zeroized
/// on drop.
pub struct Pin(String);

impl Pin {
    /// Reads the PIN from environment variable `var`.
    pub fn from_env(var: &str) -> Result<Self, PinError> {
        match std::env::var(var) {
            Ok(v) if !v.is_empty() => Ok(Self(v)),
            _ => Err(PinError::EnvMissing {
                var: var.to_owned(),
            }),
        }
    }

    /// Reads the PIN from the first line of the file at `path` (line ending removed).
    pub fn from_file(path: &Path) -> Result<Self, PinError> {
        let mut text = std::fs::read_to_string(path).map_err(|source| PinError::File {
            path: path.to_owned(),
            source,
        })?;
        let line = text.lines().next().unwrap_or_default().to_owned();
        text.zeroize();
        if line.is_empty() {
            return Err(PinError::FileEmpty {
                path: path.to_owned(),
            });
        }
        Ok(Self(line))
    }

    /// Wraps a PIN obtained some other way (a prompt, a secret store). Never pass a PIN on a
    /// command line: it shows in the process list. An empty PIN is refused when used.
    pub fn new(pin: String) -> Self {
        Self(pin)
    }

    /// Whether the PIN is empty (a missing PIN).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The PIN as a PKCS#11 login takes it (the keyring's KEK provider and the engine's
    /// integrity anchor both log in with it).
    pub fn auth_pin(&self) -> cryptoki::types::AuthPin {
        cryptoki::types::AuthPin::from(self.expose().to_owned())
    }

    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

impl std::fmt::Debug for Pin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pin(<redacted>)")
    }
}

/// Why a PIN could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PinError {
    /// The environment variable is unset or empty.
    #[error("token PIN missing: environment variable {var} is unset or empty")]
    EnvMissing {
        /// The variable.
        var: String,
    },
    /// The PIN file could not be read.
    #[error("cannot read the token PIN file {path}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The PIN file's first line is empty.
    #[error("token PIN missing: the first line of {path} is empty")]
    FileEmpty {
        /// The file.
        path: PathBuf,
    },
}

/// Where keys, nonce prefixes and wrap nonces come from. The default, [`SystemRandom`], is
/// the operating system's generator; known-answer tests inject fixed bytes.
pub trait RandomSource: Send + Sync {
    /// Fills `dest` with random bytes.
    fn fill(&self, dest: &mut [u8]) -> Result<(), RandomError>;
}

/// The operating system's random generator (through `ring`).
#[derive(Debug)]
pub struct SystemRandom(ring::rand::SystemRandom);

impl Default for SystemRandom {
    fn default() -> Self {
        Self::new()
    }
}

impl SystemRandom {
    /// The system generator.
    pub fn new() -> Self {
        Self(ring::rand::SystemRandom::new())
    }
}

impl RandomSource for SystemRandom {
    fn fill(&self, dest: &mut [u8]) -> Result<(), RandomError> {
        ring::rand::SecureRandom::fill(&self.0, dest).map_err(|_| RandomError)
    }
}

/// The random generator failed.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the random number generator failed")]
pub struct RandomError;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let key = DataKey::from_bytes([0x41; 32]);
        assert_eq!(format!("{key:?}"), "DataKey(<redacted>)");
        let pin = Pin::new("123456".into());
        assert_eq!(format!("{pin:?}"), "Pin(<redacted>)");
        assert!(DataKey::from_slice(&[1; 31]).is_none());
        assert_eq!(DataKey::from_slice(&[7; 32]).unwrap().expose(), &[7; 32]);
    }

    #[test]
    fn pin_file_first_line_empty_file_and_unset_variable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pin");
        std::fs::write(&path, "1234\r\nignored\n").unwrap();
        assert_eq!(Pin::from_file(&path).unwrap().expose(), "1234");
        std::fs::write(&path, "\n").unwrap();
        assert!(matches!(
            Pin::from_file(&path),
            Err(PinError::FileEmpty { .. })
        ));
        assert!(matches!(
            Pin::from_env("PROBITY_KEYS_TEST_UNSET_PIN"),
            Err(PinError::EnvMissing { .. })
        ));
    }

    #[test]
    fn system_random_fills() {
        let mut a = [0u8; 32];
        let mut b = [0u8; 32];
        SystemRandom::new().fill(&mut a).unwrap();
        SystemRandom::new().fill(&mut b).unwrap();
        assert_ne!(a, b);
    }
}

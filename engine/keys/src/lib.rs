//! Probity's keyring and encryption at rest.
//!
//! Why this crate exists: datasets and checkpoints on a GPU cluster's dedicated servers must
//! be encrypted at rest under keys an operator can rotate, and a data subject's data must be
//! erasable everywhere at once, backups included, by destroying one key. This crate is that
//! machinery, without the engine: the engine (`probity::keys`) supplies the state backend
//! ([`KeyMetaStore`]), the clock ([`Clock`]), the policies that decide when to rotate, the
//! audit log that records [`ErasureRecord`]s, and the CLI.
//!
//! The layers, from the HSM up:
//! * [`kek`]: key-encryption keys behind [`KekProvider`]: [`Pkcs11Kek`] (an HSM over
//!   PKCS#11; SoftHSM2 in tests) and [`SoftwareKek`] (a 0600 file: "software KEK: not an
//!   HSM"). Per-subject KEKs make erasure a single `C_DestroyObject`.
//! * [`Keyring`]: data keys (AES-256) per dataset or data subject, with versions, a primary,
//!   a minimum decryption version, rotation, retirement, erasure with a tombstone, and a
//!   bounded cache of unwrapped keys (one unwrap per key version).
//! * [`stream`]: the encrypted object format (see `FORMAT.md`): segmented AES-256-GCM under
//!   a per-object key wrapped by a keyring data key; parallel file encryption and
//!   decryption, a random-access [`DecryptingReader`], and [`rewrap_file`].
//!
//! ```
//! use std::sync::Arc;
//! use probity_keys::{
//!     KeyId, KeyScope, Keyring, KeyringOptions, MemoryMetaStore, SoftwareKek, SystemClock,
//!     stream::{self, DecryptingReader, EncryptOptions},
//! };
//! use std::io::Read as _;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! let kek = SoftwareKek::open(&dir.path().join("kek"))?; // not an HSM: use Pkcs11Kek there
//! let keyring = Keyring::new(
//!     Arc::new(MemoryMetaStore::new()), Arc::new(kek), Arc::new(SystemClock),
//!     KeyringOptions::default(),
//! );
//! let key = KeyId::new("dataset/imagenet")?;
//! keyring.create(&key, KeyScope::Dataset, "ops@example.org")?;
//!
//! let sealed = stream::encrypt_to_vec(
//!     &keyring, &key, "shards/0001", b"hello", &EncryptOptions::default(),
//! )?;
//! let mut reader = DecryptingReader::open(&keyring, "shards/0001", std::io::Cursor::new(sealed))?;
//! let mut plain = Vec::new();
//! reader.read_to_end(&mut plain)?;
//! assert_eq!(plain, b"hello");
//! # Ok(()) }
//! ```

mod cache;
pub mod kek;
mod keyring;
mod meta;
mod secret;
pub mod stream;
mod time;

pub use cache::CacheStats;
pub use kek::{
    KekDescription, KekError, KekKind, KekOutcome, KekProvider, Pkcs11Kek, SOFTWARE_KEK_NOTICE,
    SoftwareKek, subject_kek_label,
};
pub use keyring::{
    DEFAULT_CACHE_CAPACITY, DEFAULT_DATASET_KEK_LABEL, ErasedKey, ErasureRecord, KeyError,
    KeySource, KeyStatus, Keyring, KeyringOptions, KeyringStatus, Rotation, VersionStatus,
};
pub use meta::{
    InvalidId, KeyId, KeyMetaStore, KeyRecord, KeyScope, MAX_KEY_ID_LEN, MAX_SUBJECT_LEN,
    MemoryMetaStore, MetaStoreError, Tombstone, VersionRecord, VersionState, Versioned,
};
pub use secret::{DATA_KEY_LEN, DataKey, Pin, PinError, RandomError, RandomSource, SystemRandom};
pub use stream::{
    DecryptOptions, DecryptingReader, EncryptOptions, Header, StreamError, decrypt_file,
    encrypt_file, rewrap_file,
};
pub use time::{Clock, ManualClock, SystemClock, Timestamp};

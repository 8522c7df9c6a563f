//! Trust material on disk: the files Probity believes without checking them against
//! anything else (a pinned public key, the manifest registry, a PIN file, the software
//! anchor's key) and the directory that holds them.
//!
//! The check lives in `probity-base` so that the keyring's software KEK judges its files
//! by the same rules; see [`probity_base::trust`] for what is refused and why.

pub use probity_base::trust::*;

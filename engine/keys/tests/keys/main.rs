//! Integration tests of `probity-keys` through its public API: known-answer vectors from an
//! independent implementation, the keyring's lifecycle, the encrypted object format's tamper
//! cases, software KEK files, SoftHSM2 end to end, and randomized robustness.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    reason = "test helpers as well as tests: a panic is a failed test, as clippy.toml allows in #[test]s"
)]

mod common;
mod kat;
mod keyring;
mod robustness;
mod softhsm;
mod software;
mod stream;

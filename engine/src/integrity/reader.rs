//! A reader that hands out no byte of a chunk before that chunk matched its signed leaf.
//!
//! It keeps one verified chunk in memory. Random access verifies only the chunks it touches.
//! After the first integrity failure every later read fails too ("poisoned"); seeking still
//! works but reading does not. Integrity failures surface as `io::Error`s of kind
//! `InvalidData` whose inner error is an [`IntegrityError`] (get it back with
//! [`VerifiedReader::failure`] or `io::Error::get_ref` + `downcast_ref`).

use std::collections::HashMap;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::PathBuf;

use sha2::{Digest as _, Sha256};

use super::anchor::Verifier;
use super::manifest::{Hash, Manifest};
use super::signed::SignedManifest;
use super::{IntegrityError, check_manifest, compare_size, mismatch_error};
use crate::state::StateStore;

/// A `Read + Seek` over an object that verifies each chunk against the signed manifest before
/// returning any of its bytes.
#[derive(Debug)]
pub struct VerifiedReader<R> {
    inner: R,
    manifest: Manifest,
    name: PathBuf,
    pos: u64,
    inner_pos: Option<u64>,
    buf: Vec<u8>,
    loaded: Option<u64>,
    failure: Option<(u64, u64, String)>,
}

impl<R: Read + Seek> VerifiedReader<R> {
    /// Wraps `inner` after checking the manifest's signature with `verifier`, its version
    /// against `registry` (refusing rollbacks), and the object's size (seeking to its end).
    /// Does not hash anything yet.
    pub fn new(
        mut inner: R,
        signed: &SignedManifest,
        verifier: &Verifier,
        registry: &StateStore,
    ) -> Result<Self, IntegrityError> {
        check_manifest(signed, verifier, registry)?;
        let manifest = signed.manifest().clone();
        let name = PathBuf::from(manifest.object_id());
        let actual = inner.seek(SeekFrom::End(0)).map_err(|source| {
            IntegrityError::Hash(super::HashError::Open {
                path: name.clone(),
                source,
            })
        })?;
        compare_size(&name, &manifest, actual)?;
        Ok(Self {
            inner,
            manifest,
            name,
            pos: 0,
            inner_pos: Some(actual),
            buf: Vec::new(),
            loaded: None,
            failure: None,
        })
    }

    /// Names the object in errors by `path` instead of its object id.
    pub fn with_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.name = path.into();
        self
    }

    /// The signed manifest's content (already verified).
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The first integrity failure, if the reader is poisoned: `(chunk index, byte offset,
    /// message)`.
    pub fn failure(&self) -> Option<(u64, u64, &str)> {
        self.failure.as_ref().map(|(i, o, m)| (*i, *o, m.as_str()))
    }

    /// Returns the wrapped reader.
    pub fn into_inner(self) -> R {
        self.inner
    }

    fn poison(&mut self, err: IntegrityError, index: u64) -> io::Error {
        let offset = self.manifest.chunk_offset(index);
        self.failure = Some((index, offset, err.to_string()));
        self.loaded = None;
        io::Error::new(io::ErrorKind::InvalidData, err)
    }

    fn load(&mut self, index: u64) -> io::Result<()> {
        let offset = self.manifest.chunk_offset(index);
        let len = usize::try_from(self.manifest.chunk_len(index))
            .map_err(|_| io::Error::other("chunk larger than memory"))?;
        self.loaded = None;
        if self.inner_pos != Some(offset) {
            self.inner_pos = None;
            self.inner.seek(SeekFrom::Start(offset))?;
        }
        self.buf.resize(len, 0);
        let read = self.inner.read_exact(&mut self.buf);
        match read {
            Ok(()) => self.inner_pos = Some(offset + len as u64),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                self.inner_pos = None;
                let actual = self.inner.seek(SeekFrom::End(0)).unwrap_or(offset);
                let err = IntegrityError::Truncated {
                    path: self.name.clone(),
                    expected: self.manifest.size(),
                    actual,
                    index,
                    offset: actual.max(offset),
                };
                return Err(self.poison(err, index));
            }
            Err(e) => {
                self.inner_pos = None;
                return Err(e);
            }
        }
        let found: Hash = Sha256::digest(&self.buf).into();
        let signed = usize::try_from(index)
            .ok()
            .and_then(|i| self.manifest.leaves().get(i));
        if signed != Some(&found) {
            let by_leaf: HashMap<&Hash, u64> = self
                .manifest
                .leaves()
                .iter()
                .enumerate()
                .map(|(i, h)| (h, i as u64))
                .collect();
            let err = mismatch_error(&self.name, &self.manifest, index, &found, &by_leaf);
            return Err(self.poison(err, index));
        }
        self.loaded = Some(index);
        Ok(())
    }
}

impl<R: Read + Seek> Read for VerifiedReader<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if let Some((index, offset, _)) = &self.failure {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                IntegrityError::Poisoned {
                    path: self.name.clone(),
                    index: *index,
                    offset: *offset,
                },
            ));
        }
        if out.is_empty() || self.pos >= self.manifest.size() {
            return Ok(0);
        }
        let cs = u64::from(self.manifest.chunk_size());
        let index = self.pos / cs;
        if self.loaded != Some(index) {
            self.load(index)?;
        }
        let within = usize::try_from(self.pos - index * cs)
            .map_err(|_| io::Error::other("chunk offset larger than memory"))?;
        let available = self.buf.get(within..).unwrap_or_default();
        let n = available.len().min(out.len());
        if let (Some(dst), Some(src)) = (out.get_mut(..n), available.get(..n)) {
            dst.copy_from_slice(src);
        }
        self.pos += n as u64;
        Ok(n)
    }
}

impl<R: Read + Seek> Seek for VerifiedReader<R> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let (base, delta) = match to {
            SeekFrom::Start(p) => {
                self.pos = p;
                return Ok(p);
            }
            SeekFrom::Current(d) => (self.pos, d),
            SeekFrom::End(d) => (self.manifest.size(), d),
        };
        match base.checked_add_signed(delta) {
            Some(p) => {
                self.pos = p;
                Ok(p)
            }
            None => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "seek to a negative or overflowing position",
            )),
        }
    }
}

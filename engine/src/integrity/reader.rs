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

use super::Registry;
use super::anchor::Verifier;
use super::manifest::{Hash, Manifest};
use super::signed::SignedManifest;
use super::{IntegrityError, check_manifest, compare_size, mismatch_error};

/// A hook called once with the first integrity failure of a [`VerifiedReader`].
type FailureHook = Box<dyn FnMut(&IntegrityError) + Send>;

/// A `Read + Seek` over an object that verifies each chunk against the signed manifest before
/// returning any of its bytes.
pub struct VerifiedReader<R> {
    inner: R,
    manifest: Manifest,
    name: PathBuf,
    pos: u64,
    inner_pos: Option<u64>,
    buf: Vec<u8>,
    loaded: Option<u64>,
    failure: Option<(u64, u64, String)>,
    on_failure: Option<FailureHook>,
}

impl<R> std::fmt::Debug for VerifiedReader<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifiedReader")
            .field("object_id", &self.manifest.object_id())
            .field("version", &self.manifest.version())
            .field("name", &self.name)
            .field("pos", &self.pos)
            .field("loaded", &self.loaded)
            .field("failure", &self.failure)
            .finish_non_exhaustive()
    }
}

impl<R: Read + Seek> VerifiedReader<R> {
    /// Wraps `inner` after checking the manifest's signature with `verifier`, its version
    /// against `registry` (refusing rollbacks), and the object's size (seeking to its end).
    /// Does not hash anything yet.
    pub fn new(
        mut inner: R,
        signed: &SignedManifest,
        verifier: &Verifier,
        registry: &dyn Registry,
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
            on_failure: None,
        })
    }

    /// Names the object in errors by `path` instead of its object id.
    pub fn with_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.name = path.into();
        self
    }

    /// Calls `hook` with the first integrity failure (not with plain I/O errors).
    /// [`crate::Engine::guard_reader`] installs one that puts the failure through the
    /// policies (a `read` decision that blocks the node).
    pub fn on_failure(mut self, hook: impl FnMut(&IntegrityError) + Send + 'static) -> Self {
        self.on_failure = Some(Box::new(hook));
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
        if let Some(hook) = self.on_failure.as_mut() {
            hook(&err);
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::integrity::anchor::Anchor as _;
    use crate::integrity::manifest::sha256;
    use crate::integrity::software::SoftwareAnchor;
    use crate::state::StateStore;
    use std::io::Cursor;
    use std::sync::{Arc, Mutex};

    fn setup(data: &[u8]) -> (SignedManifest, Verifier, StateStore, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let anchor = SoftwareAnchor::generate(&dir.path().join("k")).unwrap();
        let leaves = data.chunks(1024).map(sha256).collect();
        let m = Manifest::new("r", 1, data.len() as u64, 1024, leaves).unwrap();
        let sig = anchor.sign(&m.digest()).unwrap();
        let signed = SignedManifest::new(m, sig, anchor.public_key().key_id());
        let store = StateStore::open(&dir.path().join("s")).unwrap();
        (
            signed,
            Verifier::new(anchor.public_key().clone()),
            store,
            dir,
        )
    }

    #[test]
    fn odd_reads_and_seeks_return_the_exact_bytes() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 253) as u8).collect();
        let (signed, verifier, store, _dir) = setup(&data);
        let mut r =
            VerifiedReader::new(Cursor::new(data.clone()), &signed, &verifier, &store).unwrap();
        let mut out = Vec::new();
        let mut buf = [0u8; 333];
        loop {
            let n = r.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        assert_eq!(out, data);
        assert_eq!(r.seek(SeekFrom::Current(-10)).unwrap(), 4990);
        assert!(r.seek(SeekFrom::Current(-5000)).is_err());
        assert_eq!(r.seek(SeekFrom::End(100)).unwrap(), 5100);
        assert_eq!(r.read(&mut buf).unwrap(), 0);
        r.seek(SeekFrom::Start(1023)).unwrap();
        let mut two = [0u8; 2];
        r.read_exact(&mut two).unwrap();
        assert_eq!(two, [data[1023], data[1024]]);
    }

    #[test]
    fn failure_hook_runs_once_and_reads_stay_refused() {
        let data = vec![7u8; 3000];
        let (signed, verifier, store, _dir) = setup(&data);
        let mut bad = data.clone();
        bad[2500] = 8;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&seen);
        let mut r = VerifiedReader::new(Cursor::new(bad), &signed, &verifier, &store)
            .unwrap()
            .with_path("/data/r.bin")
            .on_failure(move |e| sink.lock().unwrap().push(e.kind()));
        r.seek(SeekFrom::Start(2048)).unwrap();
        let e = r.read(&mut [0u8; 4]).unwrap_err();
        assert!(e.to_string().contains("/data/r.bin"));
        assert!(e.to_string().contains("chunk 2"));
        r.seek(SeekFrom::Start(0)).unwrap();
        assert!(r.read(&mut [0u8; 4]).is_err());
        assert_eq!(*seen.lock().unwrap(), vec!["chunk-mismatch"]);
    }
}

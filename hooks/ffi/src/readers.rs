//! The verified reader behind a handle: no byte of a chunk reaches the caller before the
//! chunk matched its signed leaf, and, for a reader opened as a node, a failure goes
//! through the policies like `Engine::guard_reader` (a `read` deny, the node blocked).
//!
//! Why this module exists: this is what closes the gap between "verify the file" and
//! "read the file" for programs in other languages. A reader is used by one call at a
//! time: its state sits behind a mutex, so two threads sharing a handle take turns
//! rather than race (open one reader per thread to read in parallel).

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use engine::integrity::{self, IntegrityError, SignedManifest, VerifiedReader, VerifyReport};

use crate::ProbityStatus;
use crate::engines::{self, EngineEntry};
use crate::error::{Failure, chain};
use crate::handles::{Kind, Table};

/// The live readers.
pub(crate) static READERS: Table<ReaderEntry> = Table::new(Kind::Reader);

/// An open verified reader.
pub(crate) struct ReaderEntry {
    reader: Mutex<VerifiedReader<File>>,
}

/// The arguments of `probity_reader_open`.
pub(crate) struct OpenArgs<'a> {
    pub path: &'a str,
    pub manifest: Option<&'a str>,
    pub public_key: Option<&'a str>,
    pub object_id: &'a str,
    pub node: Option<&'a str>,
    /// The pod that reads, if the caller named it.
    pub reader: Option<engine::ReaderPod>,
}

/// Opens a verified reader: the manifest's signature, its object id, its version (no
/// rollback) and the object's size are checked now; each chunk when it is first read.
///
/// With a node, a manifest or size failure at open is decided as a read through the
/// policies (and blocks the node), and so is the first chunk that fails later; and the
/// read itself is decided at open, so a node the policies deny (a blocked node) gets no
/// reader at all.
pub(crate) fn open(entry: &EngineEntry, args: &OpenArgs<'_>) -> Result<ReaderEntry, Failure> {
    let store = engines::registry(entry)?;
    let verifier = engines::verifier(entry, args.public_key)?;
    let manifest = engines::manifest_bytes(args.path, args.manifest)?;
    let path = Path::new(args.path);
    let file = integrity::HashedObject::open(path).map_err(|e| {
        Failure::new(
            ProbityStatus::Io,
            format!("cannot open {}: {e}", path.display()),
        )
    })?;
    // A failure of the object or its manifest is a verdict: with a node, it goes through
    // the policies before the caller hears of it.
    let refuse = |e: &dyn std::error::Error| {
        if let Some(node) = args.node {
            let _ = entry
                .engine
                .decide_read_as(node, args.object_id, Err(e), args.reader.as_ref());
        }
        Failure::new(ProbityStatus::IntegrityFailure, chain(e))
    };
    let signed = SignedManifest::decode(&manifest).map_err(|e| refuse(&e))?;
    if signed.manifest().object_id() != args.object_id {
        let e = IntegrityError::ObjectMismatch {
            expected: args.object_id.to_owned(),
            found: signed.manifest().object_id().to_owned(),
        };
        return Err(refuse(&e));
    }
    let reader = match VerifiedReader::new(file, &signed, &verifier, &store) {
        Ok(r) => r.with_path(path),
        Err(e) if e.is_environment() => {
            return Err(Failure::chain(engines::environment_status(&e), &e));
        }
        Err(e) => return Err(refuse(&e)),
    };
    let reader = match args.node {
        None => reader,
        Some(node) => {
            let m = signed.manifest();
            // Every byte will be checked before it is handed out: the read is verified
            // in the sense the policies mean, and a chunk that fails turns it into a deny.
            let report = VerifyReport {
                object_id: m.object_id().to_owned(),
                version: m.version(),
                size: m.size(),
                chunks: m.chunk_count(),
                root: *m.root(),
                digest: *signed.digest(),
                key_id: signed.key_id(),
                newly_accepted: false,
            };
            let decision = entry.engine.decide_read_as(
                node,
                args.object_id,
                Ok(&report),
                args.reader.as_ref(),
            );
            if !decision.is_allowed() {
                return Err(Failure::new(
                    ProbityStatus::Denied,
                    engines::denial(&decision),
                ));
            }
            entry
                .engine
                .guard_reader_as(reader, node, args.reader.clone())
        }
    };
    Ok(ReaderEntry {
        reader: Mutex::new(reader),
    })
}

impl ReaderEntry {
    fn lock(&self) -> std::sync::MutexGuard<'_, VerifiedReader<File>> {
        // A panic while reading was caught at the boundary; the reader's own state
        // (position, loaded chunk, failure) is updated only after each step succeeds.
        self.reader.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reads from the current position until `buf` is full or the object ends. On a
    /// failure, returns how many verified bytes it placed in `buf` first.
    pub fn read(&self, buf: &mut [u8]) -> Result<usize, (usize, Failure)> {
        fill(&mut self.lock(), buf)
    }

    /// Reads at `offset` without moving the position.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize, (usize, Failure)> {
        let mut r = self.lock();
        let pos = r.stream_position().map_err(|e| (0, io_failure(&e)))?;
        r.seek(SeekFrom::Start(offset))
            .map_err(|e| (0, io_failure(&e)))?;
        let result = fill(&mut r, buf);
        // Seeking a verified reader only sets its position: it cannot fail here.
        let _ = r.seek(SeekFrom::Start(pos));
        result
    }

    /// Moves the position (`whence` 0: from the start, 1: from here, 2: from the end).
    pub fn seek(&self, offset: i64, whence: i32) -> Result<u64, Failure> {
        let to = match whence {
            0 => SeekFrom::Start(u64::try_from(offset).map_err(|_| {
                Failure::invalid(format!("seek to a negative offset {offset} from the start"))
            })?),
            1 => SeekFrom::Current(offset),
            2 => SeekFrom::End(offset),
            other => {
                return Err(Failure::invalid(format!(
                    "whence must be PROBITY_SEEK_SET, _CUR or _END, not {other}"
                )));
            }
        };
        self.lock().seek(to).map_err(|e| io_failure(&e))
    }

    /// The object's size, from its verified manifest.
    pub fn size(&self) -> u64 {
        self.lock().manifest().size()
    }
}

fn fill(r: &mut VerifiedReader<File>, buf: &mut [u8]) -> Result<usize, (usize, Failure)> {
    let mut filled = 0;
    while let Some(rest) = buf.get_mut(filled..).filter(|rest| !rest.is_empty()) {
        match r.read(rest) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err((filled, io_failure(&e))),
        }
    }
    Ok(filled)
}

/// An I/O error from a verified reader: an integrity failure inside is
/// [`ProbityStatus::IntegrityFailure`], anything else [`ProbityStatus::Io`].
fn io_failure(e: &io::Error) -> Failure {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<IntegrityError>())
    {
        Some(integrity) => Failure::chain(ProbityStatus::IntegrityFailure, integrity),
        None if e.kind() == io::ErrorKind::InvalidInput => Failure::invalid(e.to_string()),
        None => Failure::new(ProbityStatus::Io, e.to_string()),
    }
}

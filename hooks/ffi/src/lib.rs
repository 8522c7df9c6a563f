//! libprobity: the Probity engine as a C library, for C, Go, Python and any language with
//! a C FFI. The header is `include/probity.h` (generated from this file by cbindgen).
//!
//! Why this crate exists: a program that links the engine can verify every chunk of a
//! checkpoint as it reads it, in-process, instead of asking a sidecar to verify a file and
//! then reading it (a gap between check and use). Rust programs link the `probity` crate;
//! everything else links this.
//!
//! Conventions of the ABI (`PROBITY_ABI_VERSION` 1):
//!
//! * Every call returns a `probity_status`; `PROBITY_STATUS_OK` is 0. On any other
//!   status, `probity_last_error()` gives the message (per thread).
//! * Handles (`probity_engine`, `probity_reader`) are ids checked against a table, not
//!   pointers: zero, a closed handle, a double close, or a handle of the other kind is
//!   refused with `PROBITY_STATUS_STALE_HANDLE`.
//! * Strings in are NUL-terminated UTF-8 (else `PROBITY_STATUS_NOT_UTF8`); JSON in is a
//!   pointer and a length. Buffers out are set to NULL/0 first, then to memory the
//!   caller frees with `probity_free` (always safe to call on what came back, even NULL).
//! * No panic crosses the boundary: it becomes `PROBITY_STATUS_INTERNAL`.
//! * Thread safety: an engine handle may be used from any number of threads at once. A
//!   reader handle may be used from any thread; calls on one reader are serialized by a
//!   mutex inside it (open one reader per thread to read in parallel).
#![allow(
    unsafe_code,
    reason = "the C boundary: raw pointers and lengths from the caller become slices, \
              strings and out parameters in `boundary` and in the entry points below, \
              each `unsafe` block with its SAFETY argument; nothing else is unsafe"
)]

mod boundary;
mod buffers;
mod engines;
mod error;
mod handles;
mod json;
mod readers;

use std::ffi::c_char;

use boundary::{Out, OutBuffer, bytes, bytes_mut, optional_str, strings};
use engines::ENGINES;
use error::{Failure, entry};
use readers::READERS;

/// The version of this ABI. It changes when a function's signature or meaning changes;
/// compare it with `probity_abi_version()` at run time.
pub const PROBITY_ABI_VERSION: u32 = 1;

/// `probity_engine_open` flag: reload the policy directory when its files change.
pub const PROBITY_OPEN_WATCH: u32 = 1;

/// `probity_decide` flag: the caller reports facts the engine owns (a decision's
/// `verified`, power readings, remote logins: the schema's `@owned` attributes and
/// actions). Without it, a request carrying such a fact is a deny that names it. A
/// linking program sets it only for requests whose facts it measured itself.
pub const PROBITY_DECIDE_FACT_REPORTER: u32 = 1;

/// `probity_decide` flag: a dry run, recorded nowhere (for what-if tools).
pub const PROBITY_DECIDE_DRY_RUN: u32 = 2;

/// `probity_reader_seek` whence: from the start.
pub const PROBITY_SEEK_SET: i32 = 0;
/// `probity_reader_seek` whence: from the current position.
pub const PROBITY_SEEK_CUR: i32 = 1;
/// `probity_reader_seek` whence: from the end.
pub const PROBITY_SEEK_END: i32 = 2;

/// What a call did. 0 is success; every other value leaves a message in
/// `probity_last_error()`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbityStatus {
    /// Success.
    Ok = 0,
    /// An argument is malformed: JSON that does not parse or fit, unknown flags, a bad
    /// entity, a missing state directory for verification, an unsafe key file.
    InvalidArgument = 1,
    /// A string or JSON argument is not UTF-8.
    NotUtf8 = 2,
    /// A required pointer is NULL.
    NullPointer = 3,
    /// The handle is zero, closed, of the other kind, or never existed; or the pointer
    /// given to `probity_free` is not a live buffer from this library.
    StaleHandle = 4,
    /// The object, its manifest, its signature or its version did not verify, or a chunk
    /// failed while reading (and every later read of that reader fails too).
    IntegrityFailure = 5,
    /// The policies denied the read (for example, the node is blocked).
    Denied = 6,
    /// A file could not be opened or read.
    Io = 7,
    /// The policy set is invalid (at open or reload); the message has file:line:column.
    PolicyInvalid = 8,
    /// The state store failed (cannot open, locked by another process, write failed).
    State = 9,
    /// An internal error, including a caught panic: please report it.
    Internal = 10,
}

/// A handle to an engine: an id, not a pointer. Zero is never a valid handle.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbityEngine {
    /// The id.
    pub id: u64,
}

/// A handle to a verified reader: an id, not a pointer. Zero is never a valid handle.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbityReader {
    /// The id.
    pub id: u64,
}

/// The library's version (`"0.1.0"`), a static string: never free it. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn probity_version() -> *const c_char {
    static VERSION: &std::ffi::CStr = match std::ffi::CStr::from_bytes_with_nul(
        concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes(),
    ) {
        Ok(v) => v,
        Err(_) => c"unknown",
    };
    VERSION.as_ptr()
}

/// The ABI version of the loaded library (`PROBITY_ABI_VERSION` when it was built).
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn probity_abi_version() -> u32 {
    PROBITY_ABI_VERSION
}

/// The message of the last call on this thread that did not return OK ("" if none). The
/// pointer is valid until the next failing call on this thread; never free it.
#[unsafe(no_mangle)]
pub extern "C" fn probity_last_error() -> *const c_char {
    error::last_error()
}

/// Frees a buffer this library returned. NULL is a no-op. A pointer that is not a live
/// buffer from this library (already freed, or foreign) is refused with
/// `PROBITY_STATUS_STALE_HANDLE` and left alone. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn probity_free(buffer: *mut u8) -> ProbityStatus {
    entry(|| buffers::release(buffer))
}

/// Opens an engine.
///
/// `policy_dir`: a policy directory (schema, `probity.toml`, policies, optional
/// `plugins.toml`), or NULL for the default policies compiled into the library.
/// `state_dir`: NULL, or a state directory (created if missing) to attach: the
/// blocklist is durable there, denies and decisions with obligations are recorded
/// there before they are answered, and verification keeps its registry there (needed
/// by `probity_verify` and `probity_reader_open`). A state directory is locked by the
/// process that opens it. `flags`: 0 or `PROBITY_OPEN_WATCH`. On success `*engine_out`
/// is the handle; close it with `probity_engine_close`.
///
/// # Safety
///
/// The strings are NULL or NUL-terminated; `engine_out` points to writable memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_engine_open(
    policy_dir: *const c_char,
    state_dir: *const c_char,
    flags: u32,
    engine_out: *mut ProbityEngine,
) -> ProbityStatus {
    entry(|| {
        // SAFETY: the caller gives a writable out parameter (documented above).
        let mut out = unsafe { Out::new(engine_out, ProbityEngine { id: 0 }, "engine_out") }?;
        // SAFETY: the caller gives NULL or a NUL-terminated string.
        let policy_dir = unsafe { optional_str(policy_dir, "policy_dir") }?;
        // SAFETY: as above.
        let state_dir = unsafe { optional_str(state_dir, "state_dir") }?;
        let opened = engines::open(policy_dir, state_dir, flags)?;
        out.set(ProbityEngine {
            id: ENGINES.insert(opened)?,
        });
        Ok(())
    })
}

/// Closes an engine handle; the handle (and every copy of it) is stale afterwards. Calls
/// in flight on other threads finish first; readers opened from it keep the engine
/// alive until they are closed. Closing twice is `PROBITY_STATUS_STALE_HANDLE`.
#[unsafe(no_mangle)]
pub extern "C" fn probity_engine_close(engine: ProbityEngine) -> ProbityStatus {
    entry(|| ENGINES.remove(engine.id).map(drop))
}

/// The live policy set's status as JSON: `{"digest", "files", "policies", "loaded_at",
/// "reloads", "reload_errors", "last_error", "entities", "plugins"}`. Free `*json_out`
/// with `probity_free`. Thread-safe.
///
/// # Safety
///
/// `json_out` and `json_len_out` point to writable memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_engine_status(
    engine: ProbityEngine,
    json_out: *mut *mut u8,
    json_len_out: *mut usize,
) -> ProbityStatus {
    entry(|| {
        // SAFETY: the caller gives writable out parameters.
        let mut out = unsafe { OutBuffer::new(json_out, json_len_out, "json_out") }?;
        let e = ENGINES.get(engine.id)?;
        out.put(engines::status(&e)?);
        Ok(())
    })
}

/// Reloads the policy directory now. If the new set is invalid it is rejected whole
/// (`PROBITY_STATUS_POLICY_INVALID`, with file:line:column) and the previous set keeps
/// serving. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn probity_engine_reload(engine: ProbityEngine) -> ProbityStatus {
    entry(|| engines::reload(&*ENGINES.get(engine.id)?))
}

/// Decides one request: `request` is JSON (`{"principal", "action", "resource",
/// "context"?, "entities"?}`, at most 1 MiB), `*decision_out` the decision as JSON
/// (`{"decision": "allow"|"deny", "reasons", "obligations", "errors"}`), to be freed with
/// `probity_free`. A deny is not an error: the status is OK and the JSON says deny.
/// `flags`: 0, `PROBITY_DECIDE_FACT_REPORTER`, `PROBITY_DECIDE_DRY_RUN`. With a state
/// directory, a deny or a decision with obligations is recorded before this returns.
/// The caller carries out the obligations. Thread-safe.
///
/// # Safety
///
/// `request` points to `request_len` readable bytes; `decision_out` and
/// `decision_len_out` point to writable memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_decide(
    engine: ProbityEngine,
    request: *const u8,
    request_len: usize,
    flags: u32,
    decision_out: *mut *mut u8,
    decision_len_out: *mut usize,
) -> ProbityStatus {
    entry(|| {
        // SAFETY: the caller gives writable out parameters.
        let mut out = unsafe { OutBuffer::new(decision_out, decision_len_out, "decision_out") }?;
        // SAFETY: the caller gives `request_len` readable bytes.
        let request = unsafe { bytes(request, request_len, "request") }?;
        let e = ENGINES.get(engine.id)?;
        out.put(engines::decide(&e, request, flags)?);
        Ok(())
    })
}

/// Decides many requests against one policy set and store: `batch` is
/// `{"requests": [..]}` or an array of requests (at most 10,000), `*decisions_out` is
/// `{"decisions": [..]}` in the same order. One malformed request refuses the whole
/// batch, naming its index. Flags as `probity_decide`. Thread-safe.
///
/// # Safety
///
/// As `probity_decide`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_decide_batch(
    engine: ProbityEngine,
    batch: *const u8,
    batch_len: usize,
    flags: u32,
    decisions_out: *mut *mut u8,
    decisions_len_out: *mut usize,
) -> ProbityStatus {
    entry(|| {
        // SAFETY: the caller gives writable out parameters.
        let mut out = unsafe { OutBuffer::new(decisions_out, decisions_len_out, "decisions_out") }?;
        // SAFETY: the caller gives `batch_len` readable bytes.
        let batch = unsafe { bytes(batch, batch_len, "batch") }?;
        let e = ENGINES.get(engine.id)?;
        out.put(engines::decide_batch(&e, batch, flags)?);
        Ok(())
    })
}

/// Adds or replaces entities: `entities` is a Cedar entity JSON array
/// (`[{"uid": {"type", "id"}, "attrs", "parents"}]`), validated against the schema, all
/// or nothing. Entities the engine owns (settings, the blocklist's attribute) are
/// refused. `count_out` may be NULL; else it receives how many were upserted.
/// Thread-safe.
///
/// # Safety
///
/// `entities` points to `entities_len` readable bytes; `count_out` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_upsert_entities(
    engine: ProbityEngine,
    entities: *const u8,
    entities_len: usize,
    count_out: *mut usize,
) -> ProbityStatus {
    entry(|| {
        let mut count = if count_out.is_null() {
            None
        } else {
            // SAFETY: non-null, and the caller gives writable memory.
            Some(unsafe { Out::new(count_out, 0, "count_out") }?)
        };
        // SAFETY: the caller gives `entities_len` readable bytes.
        let entities = unsafe { bytes(entities, entities_len, "entities") }?;
        let e = ENGINES.get(engine.id)?;
        let n = engines::upsert(&e, entities)?;
        if let Some(c) = count.as_mut() {
            c.set(n);
        }
        Ok(())
    })
}

/// Removes entities: `uids` is a JSON array of `"Type::\"id\""` strings or
/// `{"type", "id"}` objects. Unknown uids are ignored. Thread-safe.
///
/// # Safety
///
/// `uids` points to `uids_len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_remove_entities(
    engine: ProbityEngine,
    uids: *const u8,
    uids_len: usize,
) -> ProbityStatus {
    entry(|| {
        // SAFETY: the caller gives `uids_len` readable bytes.
        let uids = unsafe { bytes(uids, uids_len, "uids") }?;
        engines::remove(&*ENGINES.get(engine.id)?, uids)
    })
}

/// Verifies a whole object against its signed manifest before it is read: the signature
/// under the pinned key, the object id, the version (no rollback), the size and every
/// chunk (hashed in parallel). Needs an engine opened with a state directory.
///
/// `path`: the object. `manifest_path`: NULL for `PATH.manifest`. `object_id`: what the
/// object must be (a validly signed manifest of another object is refused).
/// `public_key_path`: NULL for `STATE_DIR/trusted.pub` (hex SEC1, as `probity seal`
/// pins it; refused if group or others can write it). `node`: NULL, or the node about
/// to read: then the outcome is decided as a `read` through the policies, and a failure
/// denies it and blocks the node (durably), as `probity verify --node` does.
///
/// `*report_out` is JSON: `{"verified": true, "object_id", "version", "size", "chunks",
/// "root", "digest", "key_id", "newly_accepted"}` or `{"verified": false, "object_id",
/// "failure", "failure_kind"}`, plus `"decision"` with a node. Returns OK,
/// `PROBITY_STATUS_INTEGRITY_FAILURE` (the object failed: the report says how), or
/// `PROBITY_STATUS_DENIED` (it verified but the policies deny the read, e.g. the node is
/// blocked); with each of these the report is set. Other statuses (the file cannot be
/// opened: IO) leave it NULL. Thread-safe.
///
/// # Safety
///
/// The strings are NULL (where allowed) or NUL-terminated; `report_out` and
/// `report_len_out` point to writable memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_verify(
    engine: ProbityEngine,
    path: *const c_char,
    manifest_path: *const c_char,
    object_id: *const c_char,
    public_key_path: *const c_char,
    node: *const c_char,
    report_out: *mut *mut u8,
    report_len_out: *mut usize,
) -> ProbityStatus {
    // SAFETY: the caller's guarantees are passed on; the reader pod's pointers are NULL.
    unsafe {
        probity_verify_as(
            engine,
            path,
            manifest_path,
            object_id,
            public_key_path,
            node,
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            report_out,
            report_len_out,
        )
    }
}

/// `probity_verify` for a read by a named Kubernetes pod: `reader_namespace` and
/// `reader_name` (both, or both NULL) and `reader_uid` (NULL when unknown) name the pod
/// that reads. With `node`, a block the read causes records that pod and what the
/// policy says must stop (its workload, or the whole node), so the cluster manager
/// stops the reading workload first. A malformed pod (not Kubernetes name syntax, a uid
/// that is not a UUID, a namespace without a name) is `PROBITY_STATUS_INVALID_ARGUMENT`
/// naming the field. The library cannot check the claim: the caller is the reader.
///
/// # Safety
///
/// As `probity_verify`; the reader strings are NULL or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_verify_as(
    engine: ProbityEngine,
    path: *const c_char,
    manifest_path: *const c_char,
    object_id: *const c_char,
    public_key_path: *const c_char,
    node: *const c_char,
    reader_namespace: *const c_char,
    reader_name: *const c_char,
    reader_uid: *const c_char,
    report_out: *mut *mut u8,
    report_len_out: *mut usize,
) -> ProbityStatus {
    entry(|| {
        // SAFETY: the caller gives writable out parameters.
        let mut out = unsafe { OutBuffer::new(report_out, report_len_out, "report_out") }?;
        // SAFETY: the caller gives NUL-terminated strings (NULL where allowed), valid for
        // the call; `strings` reads no further than each NUL.
        let [
            path,
            manifest,
            object_id,
            public_key,
            node,
            namespace,
            name,
            uid,
        ] = unsafe {
            strings([
                (path, "path", true),
                (manifest_path, "manifest_path", false),
                (object_id, "object_id", true),
                (public_key_path, "public_key_path", false),
                (node, "node", false),
                (reader_namespace, "reader_namespace", false),
                (reader_name, "reader_name", false),
                (reader_uid, "reader_uid", false),
            ])
        }?;
        let reader = engines::reader_pod(namespace, name, uid)?;
        let args = engines::VerifyArgs {
            path: path.unwrap_or_default(),
            manifest,
            object_id: object_id.unwrap_or_default(),
            public_key,
            node,
            reader: reader.as_ref(),
        };
        let verified = engines::verify(&*ENGINES.get(engine.id)?, &args)?;
        out.put(verified.report);
        match verified.message {
            None => Ok(()),
            Some(message) => Err(Failure::new(verified.status, message)),
        }
    })
}

/// Opens a verified reader over `path`: the manifest's signature, object id, version and
/// the object's size are checked now, each chunk before any byte of it is returned.
/// Arguments as `probity_verify`. With `node`, the read is decided through the
/// policies now (a node they deny, such as a blocked one, gets
/// `PROBITY_STATUS_DENIED` and no reader), and a failure now or in any later read goes
/// through them too: the read is denied and the node blocked, as Rust's
/// `Engine::guard_reader`. Close the reader with `probity_reader_close`. Thread-safe.
///
/// # Safety
///
/// As `probity_verify`; `reader_out` points to writable memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_reader_open(
    engine: ProbityEngine,
    path: *const c_char,
    manifest_path: *const c_char,
    public_key_path: *const c_char,
    object_id: *const c_char,
    node: *const c_char,
    reader_out: *mut ProbityReader,
) -> ProbityStatus {
    // SAFETY: the caller's guarantees are passed on; the reader pod's pointers are NULL.
    unsafe {
        probity_reader_open_as(
            engine,
            path,
            manifest_path,
            public_key_path,
            object_id,
            node,
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            reader_out,
        )
    }
}

/// `probity_reader_open` for a read by a named Kubernetes pod (the reader arguments as
/// `probity_verify_as`): a failure at open or in any later read records that pod in
/// the node's block.
///
/// # Safety
///
/// As `probity_reader_open`; the reader strings are NULL or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_reader_open_as(
    engine: ProbityEngine,
    path: *const c_char,
    manifest_path: *const c_char,
    public_key_path: *const c_char,
    object_id: *const c_char,
    node: *const c_char,
    reader_namespace: *const c_char,
    reader_name: *const c_char,
    reader_uid: *const c_char,
    reader_out: *mut ProbityReader,
) -> ProbityStatus {
    entry(|| {
        // SAFETY: the caller gives a writable out parameter.
        let mut out = unsafe { Out::new(reader_out, ProbityReader { id: 0 }, "reader_out") }?;
        // SAFETY: the caller gives NUL-terminated strings (NULL where allowed), valid for
        // the call; `strings` reads no further than each NUL.
        let [
            path,
            manifest,
            public_key,
            object_id,
            node,
            namespace,
            name,
            uid,
        ] = unsafe {
            strings([
                (path, "path", true),
                (manifest_path, "manifest_path", false),
                (public_key_path, "public_key_path", false),
                (object_id, "object_id", true),
                (node, "node", false),
                (reader_namespace, "reader_namespace", false),
                (reader_name, "reader_name", false),
                (reader_uid, "reader_uid", false),
            ])
        }?;
        let reader = engines::reader_pod(namespace, name, uid)?;
        let args = readers::OpenArgs {
            path: path.unwrap_or_default(),
            manifest,
            public_key,
            object_id: object_id.unwrap_or_default(),
            node,
            reader,
        };
        let opened = readers::open(&*ENGINES.get(engine.id)?, &args)?;
        out.set(ProbityReader {
            id: READERS.insert(opened)?,
        });
        Ok(())
    })
}

/// Reads up to `len` bytes at the reader's position into `buf`, filling it unless the
/// object ends; `*n_out` is the count (0 at the end). Returns
/// `PROBITY_STATUS_INTEGRITY_FAILURE` instead of any byte of a chunk that does not
/// match its signed leaf; `*n_out` then counts the verified bytes placed in `buf`
/// before that chunk. After a failure every read of this reader fails. Calls on one
/// reader are serialized.
///
/// # Safety
///
/// `buf` points to `len` writable bytes (or `len` is 0); `n_out` points to writable
/// memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_reader_read(
    reader: ProbityReader,
    buf: *mut u8,
    len: usize,
    n_out: *mut usize,
) -> ProbityStatus {
    entry(|| {
        // SAFETY: the caller gives a writable out parameter.
        let mut n = unsafe { Out::new(n_out, 0, "n_out") }?;
        // SAFETY: the caller gives `len` writable bytes; they are only written.
        let buf = unsafe { bytes_mut(buf, len, "buf") }?;
        let r = READERS.get(reader.id)?;
        let (count, result) = match r.read(buf) {
            Ok(count) => (count, Ok(())),
            Err((count, failure)) => (count, Err(failure)),
        };
        n.set(count);
        result
    })
}

/// As `probity_reader_read`, at `offset`, without moving the reader's position (random
/// access: only the chunks touched are verified).
///
/// # Safety
///
/// As `probity_reader_read`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_reader_read_at(
    reader: ProbityReader,
    offset: u64,
    buf: *mut u8,
    len: usize,
    n_out: *mut usize,
) -> ProbityStatus {
    entry(|| {
        // SAFETY: the caller gives a writable out parameter.
        let mut n = unsafe { Out::new(n_out, 0, "n_out") }?;
        // SAFETY: the caller gives `len` writable bytes; they are only written.
        let buf = unsafe { bytes_mut(buf, len, "buf") }?;
        let r = READERS.get(reader.id)?;
        let (count, result) = match r.read_at(offset, buf) {
            Ok(count) => (count, Ok(())),
            Err((count, failure)) => (count, Err(failure)),
        };
        n.set(count);
        result
    })
}

/// Moves the reader's position: `whence` is `PROBITY_SEEK_SET`, `_CUR` or `_END`.
/// `position_out` may be NULL; else it receives the new position (so `offset` 0 with
/// `PROBITY_SEEK_CUR` tells the position). Seeking past the end is allowed (reads there
/// return 0 bytes); before the start is `PROBITY_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
///
/// `position_out` is NULL or points to writable memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_reader_seek(
    reader: ProbityReader,
    offset: i64,
    whence: i32,
    position_out: *mut u64,
) -> ProbityStatus {
    entry(|| {
        let mut position = if position_out.is_null() {
            None
        } else {
            // SAFETY: non-null, and the caller gives writable memory.
            Some(unsafe { Out::new(position_out, 0, "position_out") }?)
        };
        let p = READERS.get(reader.id)?.seek(offset, whence)?;
        if let Some(out) = position.as_mut() {
            out.set(p);
        }
        Ok(())
    })
}

/// The object's size in bytes, from its verified manifest.
///
/// # Safety
///
/// `size_out` points to writable memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn probity_reader_size(
    reader: ProbityReader,
    size_out: *mut u64,
) -> ProbityStatus {
    entry(|| {
        // SAFETY: the caller gives a writable out parameter.
        let mut out = unsafe { Out::new(size_out, 0, "size_out") }?;
        out.set(READERS.get(reader.id)?.size());
        Ok(())
    })
}

/// Closes a reader; the handle is stale afterwards (closing twice is
/// `PROBITY_STATUS_STALE_HANDLE`).
#[unsafe(no_mangle)]
pub extern "C" fn probity_reader_close(reader: ProbityReader) -> ProbityStatus {
    entry(|| READERS.remove(reader.id).map(drop))
}

#[cfg(test)]
mod tests;

"""Probity for Python: the engine in-process through libprobity (ctypes, standard library only).

    import probity

    with probity.Engine(state_dir="/var/lib/probity") as engine:
        decision = engine.decide({"principal": 'Workload::"train-1"',
                                  "action": "schedule", "resource": 'Node::"gpu-a1"'})
        with engine.open_reader("/data/epoch-7.ckpt", object_id="llm/epoch-7",
                                node="gpu-a1") as f:
            state = torch.load(f)          # every chunk verified before a byte of it is read

The library is found at $PROBITY_LIB, else by the system's search (libprobity.so on the
library path). An Engine may be shared by threads; a VerifiedReader serializes the calls
made on it (open one per thread to read in parallel).
"""

import ctypes
import ctypes.util
import io
import json
import os
import threading

__all__ = [
    "ABI_VERSION",
    "Engine",
    "VerifiedReader",
    "ProbityError",
    "InvalidArgument",
    "NotUtf8",
    "NullPointer",
    "StaleHandle",
    "IntegrityFailure",
    "Denied",
    "IoFailure",
    "PolicyInvalid",
    "StateFailure",
    "InternalError",
    "version",
]

#: The ABI this module speaks (probity.h's PROBITY_ABI_VERSION).
ABI_VERSION = 1

_OPEN_WATCH = 1
_DECIDE_FACT_REPORTER = 1
_DECIDE_DRY_RUN = 2


class ProbityError(Exception):
    """A call into libprobity failed: ``status`` is the probity_status, ``message`` what went wrong."""

    status = None

    def __init__(self, message, report=None):
        super().__init__(message)
        self.message = message
        #: For verification failures and denied reads: the JSON report, as a dict.
        self.report = report


class InvalidArgument(ProbityError):
    status = 1


class NotUtf8(ProbityError):
    status = 2


class NullPointer(ProbityError):
    status = 3


class StaleHandle(ProbityError):
    status = 4


class IntegrityFailure(ProbityError):
    """The object, its manifest, signature or version did not verify, or a chunk failed mid-read."""

    status = 5


class Denied(ProbityError):
    """The policies denied the read (for example, the node is blocked)."""

    status = 6


class IoFailure(ProbityError, OSError):
    status = 7


class PolicyInvalid(ProbityError):
    status = 8


class StateFailure(ProbityError):
    status = 9


class InternalError(ProbityError):
    status = 10


_ERRORS = {
    cls.status: cls
    for cls in (
        InvalidArgument,
        NotUtf8,
        NullPointer,
        StaleHandle,
        IntegrityFailure,
        Denied,
        IoFailure,
        PolicyInvalid,
        StateFailure,
        InternalError,
    )
}


class _Handle(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64)]


_lib = None
_lib_lock = threading.Lock()


def _load():
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = os.environ.get("PROBITY_LIB") or ctypes.util.find_library("probity") or "libprobity.so"
        lib = ctypes.CDLL(path)
        status = ctypes.c_int
        u8p = ctypes.POINTER(ctypes.c_uint8)
        out_buf = [ctypes.POINTER(u8p), ctypes.POINTER(ctypes.c_size_t)]
        cstr = ctypes.c_char_p
        signatures = {
            "probity_version": (cstr, []),
            "probity_abi_version": (ctypes.c_uint32, []),
            "probity_last_error": (cstr, []),
            "probity_free": (status, [u8p]),
            "probity_engine_open": (status, [cstr, cstr, ctypes.c_uint32, ctypes.POINTER(_Handle)]),
            "probity_engine_close": (status, [_Handle]),
            "probity_engine_status": (status, [_Handle] + out_buf),
            "probity_engine_reload": (status, [_Handle]),
            "probity_decide": (status, [_Handle, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32] + out_buf),
            "probity_decide_batch": (status, [_Handle, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32] + out_buf),
            "probity_upsert_entities": (status, [_Handle, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
            "probity_remove_entities": (status, [_Handle, ctypes.c_char_p, ctypes.c_size_t]),
            "probity_verify": (status, [_Handle, cstr, cstr, cstr, cstr, cstr] + out_buf),
            "probity_reader_open": (status, [_Handle, cstr, cstr, cstr, cstr, cstr, ctypes.POINTER(_Handle)]),
            "probity_verify_as": (status, [_Handle, cstr, cstr, cstr, cstr, cstr, cstr, cstr, cstr] + out_buf),
            "probity_reader_open_as": (
                status,
                [_Handle, cstr, cstr, cstr, cstr, cstr, cstr, cstr, cstr, ctypes.POINTER(_Handle)],
            ),
            "probity_reader_read": (status, [_Handle, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
            "probity_reader_read_at": (
                status,
                [_Handle, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
            ),
            "probity_reader_seek": (status, [_Handle, ctypes.c_int64, ctypes.c_int32, ctypes.POINTER(ctypes.c_uint64)]),
            "probity_reader_size": (status, [_Handle, ctypes.POINTER(ctypes.c_uint64)]),
            "probity_reader_close": (status, [_Handle]),
        }
        for name, (restype, argtypes) in signatures.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        if lib.probity_abi_version() != ABI_VERSION:
            raise ImportError(
                f"{path} speaks ABI {lib.probity_abi_version()}, this module ABI {ABI_VERSION}"
            )
        _lib = lib
        return lib


def version():
    """The loaded library's version."""
    return _load().probity_version().decode()


def _error(lib, status, report=None):
    # Read on the thread that failed: the message is thread-local in the library, and
    # ctypes calls stay on the calling thread.
    message = (lib.probity_last_error() or b"").decode("utf-8", "replace")
    return _ERRORS.get(status, ProbityError)(message, report)


def _call(lib, fn, *args):
    status = fn(*args)
    if status != 0:
        raise _error(lib, status)


def _str(value, what):
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError(f"{what} must be a str, bytes or path, not {type(value).__name__}")


def _json_bytes(value):
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    return json.dumps(value).encode("utf-8")


class _Buffer:
    """An out buffer: filled by the call, parsed, then freed by the library."""

    def __init__(self, lib):
        self.lib = lib
        self.ptr = ctypes.POINTER(ctypes.c_uint8)()
        self.len = ctypes.c_size_t(0)

    def args(self):
        return ctypes.byref(self.ptr), ctypes.byref(self.len)

    def take(self):
        if not self.ptr:
            return None
        try:
            return json.loads(ctypes.string_at(self.ptr, self.len.value))
        finally:
            self.lib.probity_free(self.ptr)
            self.ptr = ctypes.POINTER(ctypes.c_uint8)()


class Engine:
    """A Probity engine in this process. Use it as a context manager, or call close().

    policy_dir: a policy directory, or None for the default policies built into the library.
    state_dir: None, or a state directory: blocks are durable there, denies are recorded
        there, and verification keeps its registry there (needed by verify and open_reader).
    watch: reload the policy directory when its files change.
    """

    def __init__(self, policy_dir=None, state_dir=None, *, watch=False):
        self._lib = _load()
        self._handle = _Handle(0)
        _call(
            self._lib,
            self._lib.probity_engine_open,
            _str(policy_dir, "policy_dir"),
            _str(state_dir, "state_dir"),
            _OPEN_WATCH if watch else 0,
            ctypes.byref(self._handle),
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        """Closes the engine (readers opened from it keep working until closed). Idempotent."""
        if self._handle.id:
            handle, self._handle = self._handle, _Handle(0)
            _call(self._lib, self._lib.probity_engine_close, handle)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _json_call(self, fn, payload, flags):
        out = _Buffer(self._lib)
        status = fn(self._handle, payload, len(payload), flags, *out.args())
        value = out.take()
        if status != 0:
            raise _error(self._lib, status)
        return value

    def decide(self, request, *, fact_reporter=False, dry_run=False):
        """Decides one request (a dict, or JSON text/bytes); returns the decision as a dict.

        fact_reporter: this program measured the facts the engine owns that the request
            carries (``context.verified``, power readings...); without it they are refused.
        dry_run: record nothing.
        """
        flags = (_DECIDE_FACT_REPORTER if fact_reporter else 0) | (_DECIDE_DRY_RUN if dry_run else 0)
        return self._json_call(self._lib.probity_decide, _json_bytes(request), flags)

    def decide_batch(self, requests, *, fact_reporter=False, dry_run=False):
        """Decides a list of requests against one policy set; returns the list of decisions."""
        flags = (_DECIDE_FACT_REPORTER if fact_reporter else 0) | (_DECIDE_DRY_RUN if dry_run else 0)
        payload = _json_bytes({"requests": requests} if isinstance(requests, list) else requests)
        return self._json_call(self._lib.probity_decide_batch, payload, flags)["decisions"]

    def upsert_entities(self, entities):
        """Adds or replaces entities (a Cedar entity JSON array); returns how many."""
        payload = _json_bytes(entities)
        count = ctypes.c_size_t(0)
        _call(self._lib, self._lib.probity_upsert_entities, self._handle, payload, len(payload), ctypes.byref(count))
        return count.value

    def remove_entities(self, uids):
        """Removes entities by uid (``'Node::"gpu-a1"'`` or ``{"type", "id"}``)."""
        payload = _json_bytes(uids)
        _call(self._lib, self._lib.probity_remove_entities, self._handle, payload, len(payload))

    def status(self):
        """The live policy set's status (digest, files, reloads, last error, entities...)."""
        out = _Buffer(self._lib)
        status = self._lib.probity_engine_status(self._handle, *out.args())
        value = out.take()
        if status != 0:
            raise _error(self._lib, status)
        return value

    def reload(self):
        """Reloads the policy directory; a bad set raises PolicyInvalid and the old one keeps serving."""
        _call(self._lib, self._lib.probity_engine_reload, self._handle)

    def verify(self, path, object_id, *, manifest=None, public_key=None, node=None, reader=None):
        """Verifies a whole object against its signed manifest; returns the report (a dict).

        Raises IntegrityFailure (the object failed; with a node, the node is blocked) or
        Denied (it verified, but the policies deny the node's read), each with ``.report``.
        ``reader``: the Kubernetes pod that reads, ``{"namespace", "name", "uid"?}``; a
        block the read causes records it (a malformed one raises InvalidArgument).
        """
        out = _Buffer(self._lib)
        status = self._lib.probity_verify_as(
            self._handle,
            _str(path, "path"),
            _str(manifest, "manifest"),
            _str(object_id, "object_id"),
            _str(public_key, "public_key"),
            _str(node, "node"),
            *_reader_args(reader),
            *out.args(),
        )
        report = out.take()
        if status != 0:
            raise _error(self._lib, status, report)
        return report

    def open_reader(self, path, object_id, *, manifest=None, public_key=None, node=None, reader=None):
        """A file-like VerifiedReader over ``path``: see VerifiedReader."""
        return VerifiedReader(
            self, path, object_id, manifest=manifest, public_key=public_key, node=node, reader=reader
        )


def _reader_args(reader):
    """The three C strings of a reader pod ``{"namespace", "name", "uid"?}`` (or None)."""
    if reader is None:
        return (None, None, None)
    return (
        _str(reader.get("namespace"), "reader.namespace"),
        _str(reader.get("name"), "reader.name"),
        _str(reader.get("uid"), "reader.uid"),
    )


class VerifiedReader(io.RawIOBase):
    """A read-only binary file whose every byte was checked against the signed manifest.

    read, readinto, seek and tell work as on an open file (``io.BufferedReader(reader)``
    adds buffering, ``torch.load(reader)`` reads from it). A chunk that does not match its
    signed leaf raises IntegrityFailure instead of returning any byte of it, and every later
    read raises too; opened with ``node``, the failure goes through the policies (the read
    is denied and the node blocked), and a node they already deny gets Denied at open.
    """

    def __init__(self, engine, path, object_id, *, manifest=None, public_key=None, node=None, reader=None):
        super().__init__()
        self._lib = engine._lib
        self._handle = _Handle(0)
        self.name = os.fspath(path)
        self.object_id = object_id
        _call(
            self._lib,
            self._lib.probity_reader_open_as,
            engine._handle,
            _str(path, "path"),
            _str(manifest, "manifest"),
            _str(public_key, "public_key"),
            _str(object_id, "object_id"),
            _str(node, "node"),
            *_reader_args(reader),
            ctypes.byref(self._handle),
        )
        size = ctypes.c_uint64(0)
        _call(self._lib, self._lib.probity_reader_size, self._handle, ctypes.byref(size))
        #: The object's size in bytes, from its verified manifest.
        self.size = size.value

    def readable(self):
        return True

    def seekable(self):
        return True

    def readinto(self, buffer):
        self._check_open()
        with memoryview(buffer) as raw, raw.cast("B") as view:
            if len(view) == 0:
                return 0
            target = (ctypes.c_char * len(view)).from_buffer(view)
            n = ctypes.c_size_t(0)
            status = self._lib.probity_reader_read(self._handle, target, len(view), ctypes.byref(n))
            # Release the export before the caller resizes its buffer (RawIOBase.read does).
            del target
        if status != 0:
            raise _error(self._lib, status)
        return n.value

    def read_at(self, offset, size):
        """Reads up to ``size`` bytes at ``offset`` without moving the position."""
        self._check_open()
        buf = bytearray(size)
        if size == 0:
            return b""
        target = (ctypes.c_char * size).from_buffer(buf)
        n = ctypes.c_size_t(0)
        status = self._lib.probity_reader_read_at(self._handle, offset, target, size, ctypes.byref(n))
        del target
        if status != 0:
            raise _error(self._lib, status)
        return bytes(buf[: n.value])

    def seek(self, offset, whence=io.SEEK_SET):
        self._check_open()
        position = ctypes.c_uint64(0)
        _call(self._lib, self._lib.probity_reader_seek, self._handle, offset, whence, ctypes.byref(position))
        return position.value

    def tell(self):
        return self.seek(0, io.SEEK_CUR)

    def _check_open(self):
        if self.closed:
            raise ValueError("I/O operation on a closed VerifiedReader")

    def close(self):
        if not self.closed and self._handle.id:
            handle, self._handle = self._handle, _Handle(0)
            _call(self._lib, self._lib.probity_reader_close, handle)
        super().close()

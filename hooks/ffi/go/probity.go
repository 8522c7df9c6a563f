// Package probity links the Probity engine (libprobity, through cgo) into a Go program:
// decisions with their reasons and obligations, entity updates, and verify-on-every-read
// through a Reader that checks each chunk of a sealed object before returning any byte of it.
//
// Build with pkg-config finding probity.pc (for a build tree:
// PKG_CONFIG_PATH=<target>/debug). An Engine may be used by many goroutines at once; a
// Reader serializes the calls made on it (open one per goroutine to read in parallel).
package probity

/*
#cgo pkg-config: probity
#include <stdlib.h>
#include "probity.h"
*/
import "C"

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"runtime"
	"strings"
	"unsafe"
)

// ABIVersion is the ABI this package speaks (probity.h's PROBITY_ABI_VERSION).
const ABIVersion = 1

// Status is a probity_status.
type Status int

// The statuses a call can return.
const (
	StatusOK               Status = C.PROBITY_STATUS_OK
	StatusInvalidArgument  Status = C.PROBITY_STATUS_INVALID_ARGUMENT
	StatusNotUTF8          Status = C.PROBITY_STATUS_NOT_UTF8
	StatusNullPointer      Status = C.PROBITY_STATUS_NULL_POINTER
	StatusStaleHandle      Status = C.PROBITY_STATUS_STALE_HANDLE
	StatusIntegrityFailure Status = C.PROBITY_STATUS_INTEGRITY_FAILURE
	StatusDenied           Status = C.PROBITY_STATUS_DENIED
	StatusIO               Status = C.PROBITY_STATUS_IO
	StatusPolicyInvalid    Status = C.PROBITY_STATUS_POLICY_INVALID
	StatusState            Status = C.PROBITY_STATUS_STATE
	StatusInternal         Status = C.PROBITY_STATUS_INTERNAL
)

// Error is a failed call: its status, the library's message, and for verification
// failures and denied reads the JSON report.
type Error struct {
	Status  Status
	Message string
	Report  json.RawMessage
}

func (e *Error) Error() string { return fmt.Sprintf("probity: %s", e.Message) }

// Is matches an *Error of the same status, so errors.Is(err, probity.ErrIntegrityFailure) works.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Message == "" && t.Status == e.Status
}

// Sentinels for errors.Is.
var (
	ErrInvalidArgument  = &Error{Status: StatusInvalidArgument}
	ErrNotUTF8          = &Error{Status: StatusNotUTF8}
	ErrStaleHandle      = &Error{Status: StatusStaleHandle}
	ErrIntegrityFailure = &Error{Status: StatusIntegrityFailure}
	ErrDenied           = &Error{Status: StatusDenied}
	ErrIO               = &Error{Status: StatusIO}
	ErrPolicyInvalid    = &Error{Status: StatusPolicyInvalid}
	ErrState            = &Error{Status: StatusState}
	ErrInternal         = &Error{Status: StatusInternal}
)

// call runs f on one OS thread and reads the thread-local message there if it failed.
func call(f func() C.probity_status) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	status := f()
	if status == C.PROBITY_STATUS_OK {
		return nil
	}
	return &Error{Status: Status(status), Message: C.GoString(C.probity_last_error())}
}

// cString is a C copy of s (free it), or nil for "" when optional.
func cString(s, what string, optional bool) (*C.char, error) {
	if s == "" && optional {
		return nil, nil
	}
	if strings.IndexByte(s, 0) >= 0 {
		return nil, &Error{Status: StatusInvalidArgument, Message: what + " contains a NUL byte"}
	}
	return C.CString(s), nil
}

func freeAll(ps ...*C.char) {
	for _, p := range ps {
		if p != nil {
			C.free(unsafe.Pointer(p))
		}
	}
}

// take copies a returned buffer into Go memory and frees it.
func take(out *C.uint8_t, n C.size_t) []byte {
	if out == nil {
		return nil
	}
	defer C.probity_free(out)
	return C.GoBytes(unsafe.Pointer(out), C.int(n))
}

func bytesPtr(b []byte) *C.uint8_t {
	if len(b) == 0 {
		return nil
	}
	return (*C.uint8_t)(unsafe.Pointer(&b[0]))
}

// Version is the loaded library's version.
func Version() string { return C.GoString(C.probity_version()) }

// Options say what an Engine opens.
type Options struct {
	// PolicyDir is a policy directory; "" for the default policies built into the library.
	PolicyDir string
	// StateDir is a state directory (blocks durable, denies recorded, the verification
	// registry); "" for none. Verify and OpenReader need one.
	StateDir string
	// Watch reloads the policy directory when its files change.
	Watch bool
}

// Engine is a Probity engine in this process. Close it when done.
type Engine struct {
	h C.probity_engine
}

// Open opens an engine.
func Open(o Options) (*Engine, error) {
	if C.probity_abi_version() != ABIVersion {
		return nil, fmt.Errorf("probity: the library speaks ABI %d, this package ABI %d", C.probity_abi_version(), ABIVersion)
	}
	dir, err := cString(o.PolicyDir, "the policy directory", true)
	if err != nil {
		return nil, err
	}
	state, err := cString(o.StateDir, "the state directory", true)
	if err != nil {
		freeAll(dir)
		return nil, err
	}
	defer freeAll(dir, state)
	var flags C.uint32_t
	if o.Watch {
		flags |= C.PROBITY_OPEN_WATCH
	}
	e := &Engine{}
	if err := call(func() C.probity_status { return C.probity_engine_open(dir, state, flags, &e.h) }); err != nil {
		return nil, err
	}
	return e, nil
}

// Close closes the engine; readers opened from it keep working until closed.
func (e *Engine) Close() error {
	return call(func() C.probity_status { return C.probity_engine_close(e.h) })
}

// Reason is why a decision came out as it did.
type Reason struct {
	Policy   string `json:"policy"`
	Message  string `json:"message"`
	Severity string `json:"severity"`
}

// Obligation is something the caller must carry out.
type Obligation struct {
	Kind       string            `json:"kind"`
	Target     string            `json:"target,omitempty"`
	Parameters map[string]string `json:"parameters,omitempty"`
	Policy     string            `json:"policy"`
}

// DecisionError is a problem met while deciding.
type DecisionError struct {
	Policy  string `json:"policy,omitempty"`
	Message string `json:"message"`
}

// Decision is the engine's answer.
type Decision struct {
	Decision    string          `json:"decision"`
	Reasons     []Reason        `json:"reasons"`
	Obligations []Obligation    `json:"obligations"`
	Errors      []DecisionError `json:"errors"`
}

// Allowed says whether the decision allows.
func (d *Decision) Allowed() bool { return d.Decision == "allow" }

// DecideOption changes how a request is decided.
type DecideOption uint32

const (
	// FactReporter: this program measured the facts the engine owns that the request
	// carries (context.verified, power readings...); without it they are refused.
	FactReporter DecideOption = C.PROBITY_DECIDE_FACT_REPORTER
	// DryRun: record nothing.
	DryRun DecideOption = C.PROBITY_DECIDE_DRY_RUN
)

func flagsOf(opts []DecideOption) C.uint32_t {
	var f C.uint32_t
	for _, o := range opts {
		f |= C.uint32_t(o)
	}
	return f
}

// DecideJSON decides one request (JSON) and returns the decision's JSON.
func (e *Engine) DecideJSON(request []byte, opts ...DecideOption) ([]byte, error) {
	var out *C.uint8_t
	var n C.size_t
	err := call(func() C.probity_status {
		return C.probity_decide(e.h, bytesPtr(request), C.size_t(len(request)), flagsOf(opts), &out, &n)
	})
	runtime.KeepAlive(request)
	body := take(out, n)
	return body, err
}

// Decide decides one request (JSON: principal, action, resource, context, entities).
func (e *Engine) Decide(request []byte, opts ...DecideOption) (*Decision, error) {
	body, err := e.DecideJSON(request, opts...)
	if err != nil {
		return nil, err
	}
	var d Decision
	if err := json.Unmarshal(body, &d); err != nil {
		return nil, err
	}
	return &d, nil
}

// DecideBatch decides requests (a JSON array, or {"requests": [...]}) against one policy set.
func (e *Engine) DecideBatch(batch []byte, opts ...DecideOption) ([]Decision, error) {
	var out *C.uint8_t
	var n C.size_t
	err := call(func() C.probity_status {
		return C.probity_decide_batch(e.h, bytesPtr(batch), C.size_t(len(batch)), flagsOf(opts), &out, &n)
	})
	runtime.KeepAlive(batch)
	body := take(out, n)
	if err != nil {
		return nil, err
	}
	var answer struct {
		Decisions []Decision `json:"decisions"`
	}
	if err := json.Unmarshal(body, &answer); err != nil {
		return nil, err
	}
	return answer.Decisions, nil
}

// UpsertEntities adds or replaces entities (a Cedar entity JSON array); returns how many.
func (e *Engine) UpsertEntities(entities []byte) (int, error) {
	var count C.size_t
	err := call(func() C.probity_status {
		return C.probity_upsert_entities(e.h, bytesPtr(entities), C.size_t(len(entities)), &count)
	})
	runtime.KeepAlive(entities)
	return int(count), err
}

// RemoveEntities removes entities by uid (a JSON array of "Type::\"id\"" strings or
// {"type", "id"} objects).
func (e *Engine) RemoveEntities(uids []byte) error {
	err := call(func() C.probity_status {
		return C.probity_remove_entities(e.h, bytesPtr(uids), C.size_t(len(uids)))
	})
	runtime.KeepAlive(uids)
	return err
}

// Status is the live policy set's status as JSON.
func (e *Engine) Status() ([]byte, error) {
	var out *C.uint8_t
	var n C.size_t
	err := call(func() C.probity_status { return C.probity_engine_status(e.h, &out, &n) })
	return take(out, n), err
}

// Reload reloads the policy directory; a bad set is an ErrPolicyInvalid and the old one keeps serving.
func (e *Engine) Reload() error {
	return call(func() C.probity_status { return C.probity_engine_reload(e.h) })
}

// Object names a sealed object to verify or read.
type Object struct {
	// Path of the object.
	Path string
	// ID is the object id it must be.
	ID string
	// Manifest is the signed manifest; "" for Path + ".manifest".
	Manifest string
	// PublicKey is the pinned public key file; "" for STATE_DIR/trusted.pub.
	PublicKey string
	// Node is the node that reads it; "" for none. With a node, a failure is decided as
	// a read through the policies: it is denied and the node blocked.
	Node string
	// Reader is the Kubernetes pod that reads it; nil for none. A block the read causes
	// records it, so the cluster manager stops its workload first.
	Reader *Pod
}

// Pod names a Kubernetes pod: a malformed one is an ErrInvalidArgument naming the field.
type Pod struct {
	Namespace string
	Name      string
	// UID is the pod's uid; "" when unknown.
	UID string
}

// readerStrings are the reader's namespace, name and uid as C strings (nil for none).
func (o Object) readerStrings() (namespace, name, uid *C.char, err error) {
	if o.Reader == nil {
		return
	}
	if namespace, err = cString(o.Reader.Namespace, "the reader's namespace", false); err != nil {
		return
	}
	if name, err = cString(o.Reader.Name, "the reader's name", false); err != nil {
		freeAll(namespace)
		return
	}
	if uid, err = cString(o.Reader.UID, "the reader's uid", true); err != nil {
		freeAll(namespace, name)
	}
	return
}

func (o Object) cStrings() (path, manifest, id, key, node *C.char, err error) {
	if path, err = cString(o.Path, "the path", false); err != nil {
		return
	}
	if manifest, err = cString(o.Manifest, "the manifest", true); err != nil {
		freeAll(path)
		return
	}
	if id, err = cString(o.ID, "the object id", false); err != nil {
		freeAll(path, manifest)
		return
	}
	if key, err = cString(o.PublicKey, "the public key", true); err != nil {
		freeAll(path, manifest, id)
		return
	}
	if node, err = cString(o.Node, "the node", true); err != nil {
		freeAll(path, manifest, id, key)
	}
	return
}

// Verify verifies a whole object against its signed manifest and returns the JSON report.
// A failure is an ErrIntegrityFailure, a denied read an ErrDenied; both carry the report.
func (e *Engine) Verify(o Object) ([]byte, error) {
	path, manifest, id, key, node, err := o.cStrings()
	if err != nil {
		return nil, err
	}
	defer freeAll(path, manifest, id, key, node)
	namespace, name, uid, err := o.readerStrings()
	if err != nil {
		return nil, err
	}
	defer freeAll(namespace, name, uid)
	var out *C.uint8_t
	var n C.size_t
	err = call(func() C.probity_status {
		return C.probity_verify_as(e.h, path, manifest, id, key, node, namespace, name, uid, &out, &n)
	})
	report := take(out, n)
	var perr *Error
	if errors.As(err, &perr) {
		perr.Report = report
	}
	return report, err
}

// Reader reads a sealed object and checks each chunk before returning any byte of it. It
// implements io.Reader, io.ReaderAt, io.Seeker and io.Closer.
type Reader struct {
	h    C.probity_reader
	size int64
}

// OpenReader opens a verified Reader. With o.Node, a node the policies deny (a blocked
// one) gets ErrDenied, and a chunk failing later denies the read and blocks the node.
func (e *Engine) OpenReader(o Object) (*Reader, error) {
	path, manifest, id, key, node, err := o.cStrings()
	if err != nil {
		return nil, err
	}
	defer freeAll(path, manifest, id, key, node)
	namespace, name, uid, err := o.readerStrings()
	if err != nil {
		return nil, err
	}
	defer freeAll(namespace, name, uid)
	r := &Reader{}
	if err := call(func() C.probity_status {
		return C.probity_reader_open_as(e.h, path, manifest, key, id, node, namespace, name, uid, &r.h)
	}); err != nil {
		return nil, err
	}
	var size C.uint64_t
	if err := call(func() C.probity_status { return C.probity_reader_size(r.h, &size) }); err != nil {
		r.Close()
		return nil, err
	}
	r.size = int64(size)
	return r, nil
}

// Size is the object's size, from its verified manifest.
func (r *Reader) Size() int64 { return r.size }

// Read reads verified bytes; at the end it returns 0, io.EOF. A chunk that does not match
// its signed leaf is an ErrIntegrityFailure (n counts the verified bytes before it).
func (r *Reader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	var n C.size_t
	err := call(func() C.probity_status {
		return C.probity_reader_read(r.h, bytesPtr(p), C.size_t(len(p)), &n)
	})
	runtime.KeepAlive(p)
	if err == nil && n == 0 {
		return 0, io.EOF
	}
	return int(n), err
}

// ReadAt reads at off without moving the position (random access: only the chunks it
// touches are verified).
func (r *Reader) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, &Error{Status: StatusInvalidArgument, Message: "negative offset"}
	}
	if len(p) == 0 {
		return 0, nil
	}
	var n C.size_t
	err := call(func() C.probity_status {
		return C.probity_reader_read_at(r.h, C.uint64_t(off), bytesPtr(p), C.size_t(len(p)), &n)
	})
	runtime.KeepAlive(p)
	if err == nil && int(n) < len(p) {
		err = io.EOF
	}
	return int(n), err
}

// Seek moves the position (io.SeekStart, io.SeekCurrent, io.SeekEnd).
func (r *Reader) Seek(offset int64, whence int) (int64, error) {
	var pos C.uint64_t
	err := call(func() C.probity_status {
		return C.probity_reader_seek(r.h, C.int64_t(offset), C.int32_t(whence), &pos)
	})
	return int64(pos), err
}

// Close closes the reader.
func (r *Reader) Close() error {
	return call(func() C.probity_status { return C.probity_reader_close(r.h) })
}

package probity

// Run by the Rust suite (tests/ffi/go.rs), which seals the fixtures and sets
// PROBITY_TEST_FIXTURES and PKG_CONFIG_PATH. By hand:
//
//	cargo build -p probity-ffi
//	cargo run -p probity-ffi --example make_fixtures -- /tmp/probity-fixtures
//	cd hooks/ffi/go && PKG_CONFIG_PATH=$PWD/../../../target/debug \
//	    PROBITY_TEST_FIXTURES=/tmp/probity-fixtures GOFLAGS=-mod=mod go test ./...

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

const (
	objectID = "llm/epoch-7"
	chunk    = 64 * 1024
	size     = 4*chunk + 1000
	allow    = `{"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""}`
	hot      = `{"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-hot1\""}`
)

// fixtures copies the sealed fixtures into a directory of the test's own (the state
// directory records blocks).
func fixtures(t *testing.T) string {
	t.Helper()
	src := os.Getenv("PROBITY_TEST_FIXTURES")
	if src == "" {
		t.Fatal("PROBITY_TEST_FIXTURES is not set: run through `cargo test -p probity-ffi`")
	}
	dst := filepath.Join(t.TempDir(), "fixtures")
	err := filepath.Walk(src, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		target := filepath.Join(dst, rel)
		if info.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(target, b, info.Mode().Perm())
	})
	if err != nil {
		t.Fatal(err)
	}
	return dst
}

func openEngine(t *testing.T, dir string) *Engine {
	t.Helper()
	e, err := Open(Options{StateDir: filepath.Join(dir, "state")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	cluster, err := os.ReadFile(filepath.Join(dir, "cluster.json"))
	if err != nil {
		t.Fatal(err)
	}
	if n, err := e.UpsertEntities(cluster); err != nil || n < 10 {
		t.Fatalf("upsert: %d, %v", n, err)
	}
	return e
}

func TestDecideAllowsAndDeniesWithObligations(t *testing.T) {
	e := openEngine(t, fixtures(t))
	d, err := e.Decide([]byte(allow))
	if err != nil || !d.Allowed() {
		t.Fatalf("allow: %+v, %v", d, err)
	}
	d, err = e.Decide([]byte(hot))
	if err != nil || d.Allowed() {
		t.Fatalf("deny: %+v, %v", d, err)
	}
	if len(d.Reasons) != 1 || d.Reasons[0].Policy != "thermal.zone-power-ceiling" {
		t.Fatalf("reasons: %+v", d.Reasons)
	}
	if len(d.Obligations) != 1 || d.Obligations[0].Kind != "migrate" || d.Obligations[0].Target != `Zone::"zone-hot"` {
		t.Fatalf("obligations: %+v", d.Obligations)
	}
	batch, err := e.DecideBatch([]byte("[" + allow + "," + hot + "]"))
	if err != nil || len(batch) != 2 || !batch[0].Allowed() || batch[1].Allowed() {
		t.Fatalf("batch: %+v, %v", batch, err)
	}
	status, err := e.Status()
	if err != nil || !bytes.Contains(status, []byte(`"digest"`)) {
		t.Fatalf("status: %s, %v", status, err)
	}
}

func TestAReportedFactNeedsTheReporterOption(t *testing.T) {
	e := openEngine(t, fixtures(t))
	read := []byte(`{"principal": "Node::\"gpu-h1\"", "action": "read", "resource": "Checkpoint::\"ckpt-epoch-7\"", "context": {"verified": true}}`)
	if d, _ := e.Decide(read, DryRun); d.Allowed() {
		t.Fatal("a fact from a caller that is not a reporter was accepted")
	}
	if d, _ := e.Decide(read, DryRun, FactReporter); !d.Allowed() {
		t.Fatalf("as a reporter: %+v", d)
	}
}

func TestTheReaderReturnsTheSealedBytes(t *testing.T) {
	dir := fixtures(t)
	e := openEngine(t, dir)
	want, _ := os.ReadFile(filepath.Join(dir, "epoch-7.ckpt"))
	r, err := e.OpenReader(Object{Path: filepath.Join(dir, "epoch-7.ckpt"), ID: objectID, Node: "gpu-a1"})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Size() != size {
		t.Fatalf("size %d", r.Size())
	}
	got, err := io.ReadAll(r)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("ReadAll: %d bytes, %v", len(got), err)
	}
	p := make([]byte, 16)
	if n, err := r.ReadAt(p, chunk-8); n != 16 || err != nil || !bytes.Equal(p, want[chunk-8:chunk+8]) {
		t.Fatalf("ReadAt: %d, %v", n, err)
	}
	if n, err := r.ReadAt(p, size-4); n != 4 || err != io.EOF {
		t.Fatalf("ReadAt at the end: %d, %v", n, err)
	}
	if pos, err := r.Seek(-100, io.SeekEnd); pos != size-100 || err != nil {
		t.Fatalf("Seek: %d, %v", pos, err)
	}
	h := sha256.New()
	if _, err := r.Seek(0, io.SeekStart); err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(h, io.NewSectionReader(r, 0, r.Size())); err != nil {
		t.Fatal(err)
	}
	if sum := sha256.Sum256(want); !bytes.Equal(h.Sum(nil), sum[:]) {
		t.Fatal("streamed hash differs")
	}
}

func TestATamperedChunkFailsMidReadAndBlocksTheNode(t *testing.T) {
	dir := fixtures(t)
	e := openEngine(t, dir)
	want, _ := os.ReadFile(filepath.Join(dir, "epoch-7.ckpt"))
	r, err := e.OpenReader(Object{Path: filepath.Join(dir, "tampered.ckpt"), ID: objectID, Node: "gpu-a1"})
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(r)
	if !errors.Is(err, ErrIntegrityFailure) || !strings.Contains(err.Error(), "chunk 2") {
		t.Fatalf("want an integrity failure at chunk 2, got %v", err)
	}
	if !bytes.Equal(got, want[:2*chunk]) {
		t.Fatalf("%d bytes handed out; want exactly the %d verified ones", len(got), 2*chunk)
	}
	if _, err := r.ReadAt(make([]byte, 1), 0); !errors.Is(err, ErrIntegrityFailure) {
		t.Fatalf("a failed reader still reads: %v", err)
	}
	r.Close()
	d, _ := e.Decide([]byte(allow))
	if d.Allowed() || d.Reasons[0].Policy != "security.blocked-node" {
		t.Fatalf("gpu-a1 is not blocked: %+v", d)
	}
	if _, err := e.OpenReader(Object{Path: filepath.Join(dir, "epoch-7.ckpt"), ID: objectID, Node: "gpu-a1"}); !errors.Is(err, ErrDenied) {
		t.Fatalf("a blocked node got a reader: %v", err)
	}
}

func TestVerifyReportsAndBlocksThroughThePolicies(t *testing.T) {
	dir := fixtures(t)
	e := openEngine(t, dir)
	report, err := e.Verify(Object{Path: filepath.Join(dir, "epoch-7.ckpt"), ID: objectID, Node: "gpu-h1"})
	if err != nil || !bytes.Contains(report, []byte(`"verified":true`)) {
		t.Fatalf("verify: %s, %v", report, err)
	}
	_, err = e.Verify(Object{Path: filepath.Join(dir, "tampered.ckpt"), ID: objectID, Node: "gpu-h1"})
	var perr *Error
	if !errors.As(err, &perr) || perr.Status != StatusIntegrityFailure || !bytes.Contains(perr.Report, []byte(`"block_node"`)) {
		t.Fatalf("tampered: %v", err)
	}
}

func TestAReadNamesItsPodAndAMalformedOneIsRefused(t *testing.T) {
	dir := fixtures(t)
	e := openEngine(t, dir)
	tampered := filepath.Join(dir, "tampered.ckpt")
	_, err := e.Verify(Object{Path: tampered, ID: objectID, Node: "gpu-h1", Reader: &Pod{Namespace: "train", Name: "Bad_Name"}})
	var perr *Error
	if !errors.As(err, &perr) || perr.Status != StatusInvalidArgument || !strings.HasPrefix(perr.Message, "reader.name: ") {
		t.Fatalf("malformed pod: %v", err)
	}
	pod := &Pod{Namespace: "train", Name: "llm-0", UID: "3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b"}
	_, err = e.Verify(Object{Path: tampered, ID: objectID, Node: "gpu-h1", Reader: pod})
	if !errors.As(err, &perr) || perr.Status != StatusIntegrityFailure || !bytes.Contains(perr.Report, []byte(`"stop":"reader"`)) {
		t.Fatalf("tampered: %v", err)
	}
}

func TestMisuseIsAnErrorNotACrash(t *testing.T) {
	e, err := Open(Options{})
	if err != nil {
		t.Fatal(err)
	}
	e.Close()
	if err := e.Close(); !errors.Is(err, ErrStaleHandle) {
		t.Fatalf("double close: %v", err)
	}
	if _, err := e.Decide([]byte(allow)); !errors.Is(err, ErrStaleHandle) {
		t.Fatalf("closed engine: %v", err)
	}
	e, _ = Open(Options{})
	defer e.Close()
	if _, err := e.Decide([]byte("{\"principal\": \"\xff\"}")); !errors.Is(err, ErrNotUTF8) {
		t.Fatalf("non-UTF-8: %v", err)
	}
	if _, err := e.Decide([]byte(`{`)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("malformed: %v", err)
	}
	if _, err := Open(Options{PolicyDir: "/tmp/\xfe"}); !errors.Is(err, ErrNotUTF8) {
		t.Fatalf("non-UTF-8 path: %v", err)
	}
	if _, err := Open(Options{PolicyDir: "a\x00b"}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("NUL in a path: %v", err)
	}
}

func TestAnEngineIsSharedByGoroutines(t *testing.T) {
	e := openEngine(t, fixtures(t))
	var wg sync.WaitGroup
	var mu sync.Mutex
	allows := 0
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				req := allow
				if i%2 == 1 {
					req = hot
				}
				d, err := e.Decide([]byte(req))
				if err != nil {
					t.Error(err)
					return
				}
				if d.Allowed() {
					mu.Lock()
					allows++
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	if allows != 100 {
		t.Fatalf("%d allows of 200, want 100", allows)
	}
}

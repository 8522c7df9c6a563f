//! The entry points called as C would call them, with the misuse C allows: null and
//! stale handles, null pointers, non-UTF-8 strings, double frees, random bytes.

use std::ffi::{CStr, CString, c_char};
use std::ptr::{null, null_mut};

use serde_json::Value;

use super::*;

#[path = "../tests/ffi/fixtures.rs"]
mod fixtures;

fn last_error() -> String {
    // SAFETY: probity_last_error returns a NUL-terminated string valid until the next failure.
    unsafe { CStr::from_ptr(probity_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

fn open(policy_dir: Option<&str>, state_dir: Option<&str>) -> ProbityEngine {
    let p = policy_dir.map(c);
    let s = state_dir.map(c);
    let mut e = ProbityEngine { id: 0 };
    // SAFETY: NUL-terminated strings or NULL, and a local out parameter.
    let status = unsafe {
        probity_engine_open(
            p.as_ref().map_or(null(), |p| p.as_ptr()),
            s.as_ref().map_or(null(), |s| s.as_ptr()),
            0,
            &mut e,
        )
    };
    assert_eq!(status, ProbityStatus::Ok, "{}", last_error());
    e
}

/// Decides `request`; the status and the JSON (freed).
fn decide(e: ProbityEngine, request: &[u8], flags: u32) -> (ProbityStatus, Option<Value>) {
    let mut out = null_mut();
    let mut len = 0;
    // SAFETY: a live slice and local out parameters.
    let status = unsafe {
        probity_decide(
            e,
            request.as_ptr(),
            request.len(),
            flags,
            &mut out,
            &mut len,
        )
    };
    (status, take(out, len))
}

fn take(out: *mut u8, len: usize) -> Option<Value> {
    if out.is_null() {
        return None;
    }
    // SAFETY: the library returned `len` bytes at `out`, live until freed below.
    let v = serde_json::from_slice(unsafe { std::slice::from_raw_parts(out, len) }).unwrap();
    assert_eq!(probity_free(out), ProbityStatus::Ok);
    Some(v)
}

const ALLOW: &[u8] = br#"{"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""}"#;
const HOT: &[u8] = br#"{"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-hot1\""}"#;

fn cluster_engine() -> ProbityEngine {
    let e = open(None, None);
    load_cluster(e);
    e
}

/// Loads the test cluster's facts into `e`.
fn load_cluster(e: ProbityEngine) {
    let cluster = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/entities/cluster.json"
    ))
    .unwrap();
    let mut n = 0;
    // SAFETY: a live slice and a local out parameter.
    let status = unsafe { probity_upsert_entities(e, cluster.as_ptr(), cluster.len(), &mut n) };
    assert_eq!(status, ProbityStatus::Ok, "{}", last_error());
    assert!(n > 10);
}

#[test]
fn decide_answers_allow_and_deny_with_obligations_as_json() {
    let e = cluster_engine();
    let (status, d) = decide(e, ALLOW, 0);
    assert_eq!(status, ProbityStatus::Ok);
    assert_eq!(d.unwrap()["decision"], "allow");
    let (status, d) = decide(e, HOT, 0);
    assert_eq!(status, ProbityStatus::Ok);
    let d = d.unwrap();
    assert_eq!(d["decision"], "deny");
    assert_eq!(d["obligations"][0]["kind"], "migrate");
    assert_eq!(probity_engine_close(e), ProbityStatus::Ok);
}

#[test]
fn a_reported_fact_needs_the_reporter_flag() {
    let e = cluster_engine();
    let read = br#"{"principal": "Node::\"gpu-a1\"", "action": "read", "resource": "Checkpoint::\"ckpt-epoch-7\"", "context": {"verified": true}}"#;
    let (_, d) = decide(e, read, PROBITY_DECIDE_DRY_RUN);
    let d = d.unwrap();
    assert_eq!(d["decision"], "deny", "{d}");
    assert!(d.to_string().contains("verified"), "{d}");
    let (_, d) = decide(
        e,
        read,
        PROBITY_DECIDE_DRY_RUN | PROBITY_DECIDE_FACT_REPORTER,
    );
    assert_eq!(d.unwrap()["decision"], "allow");
    let (status, _) = decide(e, read, 0x80);
    assert_eq!(status, ProbityStatus::InvalidArgument);
    assert!(
        last_error().contains("unknown flags 0x80"),
        "{}",
        last_error()
    );
    probity_engine_close(e);
}

#[test]
fn stale_null_and_foreign_handles_are_refused() {
    let e = open(None, None);
    assert_eq!(probity_engine_close(e), ProbityStatus::Ok);
    let (status, d) = decide(e, ALLOW, 0);
    assert_eq!(status, ProbityStatus::StaleHandle);
    assert!(d.is_none());
    assert_eq!(
        probity_engine_close(e),
        ProbityStatus::StaleHandle,
        "double close"
    );
    assert_eq!(
        probity_engine_close(ProbityEngine { id: 0 }),
        ProbityStatus::StaleHandle
    );
    assert!(last_error().contains("null"), "{}", last_error());
    assert_eq!(
        probity_reader_close(ProbityReader { id: e.id }),
        ProbityStatus::StaleHandle
    );
    assert!(
        last_error().contains("an engine handle"),
        "{}",
        last_error()
    );
}

#[test]
fn null_pointers_and_bad_strings_are_refused_with_their_status() {
    let e = open(None, None);
    let mut out = null_mut();
    let mut len = 0;
    // SAFETY: null request with a length is refused before use.
    let status = unsafe { probity_decide(e, null(), 5, 0, &mut out, &mut len) };
    assert_eq!(status, ProbityStatus::NullPointer);
    assert_eq!(last_error(), "request is NULL");
    // SAFETY: a null out parameter is refused before use.
    let status = unsafe { probity_decide(e, ALLOW.as_ptr(), ALLOW.len(), 0, null_mut(), &mut len) };
    assert_eq!(status, ProbityStatus::NullPointer);
    let (status, _) = decide(e, b"{\"principal\": \"\xff\"}", 0);
    assert_eq!(status, ProbityStatus::NotUtf8);
    let (status, _) = decide(e, b"{\"principal\": ", 0);
    assert_eq!(status, ProbityStatus::InvalidArgument);
    assert!(last_error().contains("line 1"), "{}", last_error());
    let bad_dir = b"/tmp/\xff\0";
    let mut e2 = ProbityEngine { id: 7 };
    // SAFETY: a NUL-terminated byte string and a local out parameter.
    let status =
        unsafe { probity_engine_open(bad_dir.as_ptr().cast::<c_char>(), null(), 0, &mut e2) };
    assert_eq!(status, ProbityStatus::NotUtf8);
    assert_eq!(e2.id, 0, "the out parameter is cleared on failure");
    probity_engine_close(e);
}

#[test]
fn a_bad_policy_directory_is_a_policy_error_that_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/../../policies");
    copy_dir(std::path::Path::new(src), tmp.path());
    std::fs::write(
        tmp.path().join("security/broken.cedar"),
        "permit (principal, action, resource) when { 1 + };",
    )
    .unwrap();
    let dir = c(tmp.path().to_str().unwrap());
    let mut e = ProbityEngine { id: 0 };
    // SAFETY: a NUL-terminated string and a local out parameter.
    let status = unsafe { probity_engine_open(dir.as_ptr(), null(), 0, &mut e) };
    assert_eq!(status, ProbityStatus::PolicyInvalid);
    assert!(last_error().contains("broken.cedar"), "{}", last_error());
}

#[test]
fn an_audit_policy_allows_through_the_c_abi_and_keeps_its_obligation_apart() {
    let tmp = tempfile::tempdir().unwrap();
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/../../policies");
    copy_dir(std::path::Path::new(src), tmp.path());
    let config = tmp.path().join("probity.toml");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("\n[modes]\n\"thermal.zone-power-ceiling\" = \"audit\"\n");
    std::fs::write(&config, text).unwrap();
    let e = open(Some(tmp.path().to_str().unwrap()), None);
    load_cluster(e);
    let (status, d) = decide(e, HOT, 0);
    assert_eq!(status, ProbityStatus::Ok);
    let d = d.unwrap();
    assert_eq!(d["decision"], "allow", "{d}");
    assert_eq!(d["obligations"], serde_json::json!([]), "{d}");
    assert_eq!(d["audit"][0]["policy"], "thermal.zone-power-ceiling", "{d}");
    assert_eq!(d["audit"][0]["obligations"][0]["kind"], "migrate", "{d}");
    assert_eq!(probity_engine_close(e), ProbityStatus::Ok);
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&target).unwrap();
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

#[test]
fn batch_status_and_entity_removal_answer_json() {
    let e = cluster_engine();
    let batch = [b"[".as_slice(), ALLOW, b",", HOT, b"]"].concat();
    let mut out = null_mut();
    let mut len = 0;
    // SAFETY: a live slice and local out parameters.
    let status =
        unsafe { probity_decide_batch(e, batch.as_ptr(), batch.len(), 0, &mut out, &mut len) };
    assert_eq!(status, ProbityStatus::Ok, "{}", last_error());
    let d = take(out, len).unwrap();
    assert_eq!(d["decisions"][0]["decision"], "allow");
    assert_eq!(d["decisions"][1]["decision"], "deny");

    // SAFETY: local out parameters.
    let status = unsafe { probity_engine_status(e, &mut out, &mut len) };
    assert_eq!(status, ProbityStatus::Ok);
    let s = take(out, len).unwrap();
    assert!(s["policies"].as_u64().unwrap() > 10);
    let before = s["entities"].as_u64().unwrap();

    let uids = br#"["Node::\"gpu-a1\""]"#;
    // SAFETY: a live slice.
    let status = unsafe { probity_remove_entities(e, uids.as_ptr(), uids.len()) };
    assert_eq!(status, ProbityStatus::Ok, "{}", last_error());
    // SAFETY: local out parameters.
    unsafe { probity_engine_status(e, &mut out, &mut len) };
    assert_eq!(
        take(out, len).unwrap()["entities"].as_u64().unwrap(),
        before - 1
    );
    // A node the store no longer holds is a finding: the schedule is denied.
    assert_eq!(decide(e, ALLOW, 0).1.unwrap()["decision"], "deny");
    assert_eq!(probity_engine_reload(e), ProbityStatus::InvalidArgument);
    probity_engine_close(e);
}

#[test]
fn the_version_strings_are_static() {
    // SAFETY: a static NUL-terminated string.
    let v = unsafe { CStr::from_ptr(probity_version()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    assert_eq!(probity_abi_version(), PROBITY_ABI_VERSION);
}

struct Sealed {
    _tmp: tempfile::TempDir,
    f: fixtures::Fixtures,
    engine: ProbityEngine,
}

fn sealed() -> Sealed {
    let tmp = tempfile::tempdir().unwrap();
    let f = fixtures::make(
        tmp.path(),
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")),
    );
    let engine = open(None, Some(f.state.to_str().unwrap()));
    let cluster = std::fs::read(&f.cluster).unwrap();
    // SAFETY: a live slice; the count is not wanted.
    let status =
        unsafe { probity_upsert_entities(engine, cluster.as_ptr(), cluster.len(), null_mut()) };
    assert_eq!(status, ProbityStatus::Ok, "{}", last_error());
    Sealed {
        _tmp: tmp,
        f,
        engine,
    }
}

fn open_reader(
    s: &Sealed,
    path: &std::path::Path,
    node: Option<&str>,
) -> (ProbityStatus, ProbityReader) {
    let path = c(path.to_str().unwrap());
    let id = c(fixtures::OBJECT_ID);
    let node = node.map(c);
    let mut r = ProbityReader { id: 0 };
    // SAFETY: NUL-terminated strings or NULL, and a local out parameter.
    let status = unsafe {
        probity_reader_open(
            s.engine,
            path.as_ptr(),
            null(),
            null(),
            id.as_ptr(),
            node.as_ref().map_or(null(), |n| n.as_ptr()),
            &mut r,
        )
    };
    (status, r)
}

fn read_at(r: ProbityReader, offset: u64, buf: &mut [u8]) -> (ProbityStatus, usize) {
    let mut n = 0;
    // SAFETY: a live mutable slice and a local out parameter.
    let status = unsafe { probity_reader_read_at(r, offset, buf.as_mut_ptr(), buf.len(), &mut n) };
    (status, n)
}

#[test]
fn a_verified_reader_returns_the_bytes_and_refuses_a_tampered_chunk() {
    let s = sealed();
    let data = fixtures::content();
    let (status, r) = open_reader(&s, &s.f.object, Some("gpu-a1"));
    assert_eq!(status, ProbityStatus::Ok, "{}", last_error());
    let mut size = 0;
    // SAFETY: a local out parameter.
    let status = unsafe { probity_reader_size(r, &mut size) };
    assert_eq!(status, ProbityStatus::Ok);
    assert_eq!(size as usize, fixtures::SIZE);
    let mut all = vec![0u8; fixtures::SIZE + 10];
    let mut n = 0;
    // SAFETY: a live mutable slice and a local out parameter.
    let status = unsafe { probity_reader_read(r, all.as_mut_ptr(), all.len(), &mut n) };
    assert_eq!(status, ProbityStatus::Ok);
    assert_eq!(n, fixtures::SIZE);
    assert_eq!(&all[..n], &data[..]);
    let mut small = [0u8; 16];
    assert_eq!(read_at(r, 65530, &mut small), (ProbityStatus::Ok, 16));
    assert_eq!(&small, &data[65530..65546]);
    let mut pos = 9;
    // SAFETY: a local out parameter.
    let status = unsafe { probity_reader_seek(r, 0, PROBITY_SEEK_CUR, &mut pos) };
    assert_eq!(status, ProbityStatus::Ok);
    assert_eq!(
        pos as usize,
        fixtures::SIZE,
        "read_at left the position alone"
    );
    // SAFETY: a null position is allowed.
    let status = unsafe { probity_reader_seek(r, -1, PROBITY_SEEK_SET, null_mut()) };
    assert_eq!(status, ProbityStatus::InvalidArgument);
    assert_eq!(probity_reader_close(r), ProbityStatus::Ok);
    assert_eq!(probity_reader_close(r), ProbityStatus::StaleHandle);

    // The tampered copy: bytes before chunk 2 read, chunk 2 fails, the node is blocked.
    let (status, r) = open_reader(&s, &s.f.tampered, Some("gpu-a1"));
    assert_eq!(status, ProbityStatus::Ok, "{}", last_error());
    let mut n = 0;
    // SAFETY: a live mutable slice and a local out parameter.
    let status = unsafe { probity_reader_read(r, all.as_mut_ptr(), all.len(), &mut n) };
    assert_eq!(status, ProbityStatus::IntegrityFailure);
    assert_eq!(
        n,
        2 * fixtures::CHUNK as usize,
        "the verified chunks before the bad one"
    );
    assert!(last_error().contains("chunk 2"), "{}", last_error());
    assert_eq!(
        read_at(r, 0, &mut small).0,
        ProbityStatus::IntegrityFailure,
        "poisoned"
    );
    probity_reader_close(r);
    let (_, d) = decide(s.engine, ALLOW, 0);
    assert!(d.unwrap().to_string().contains("security.blocked-node"));
    // A blocked node gets no reader, even of the intact object.
    let (status, r) = open_reader(&s, &s.f.object, Some("gpu-a1"));
    assert_eq!(status, ProbityStatus::Denied);
    assert_eq!(r.id, 0);
    assert!(
        last_error().contains("security.blocked-node"),
        "{}",
        last_error()
    );
    probity_engine_close(s.engine);
}

#[test]
fn verify_reports_and_blocks_through_the_policies() {
    let s = sealed();
    let verify = |path: &std::path::Path, node: &str| {
        let path = c(path.to_str().unwrap());
        let id = c(fixtures::OBJECT_ID);
        let node = c(node);
        let mut out = null_mut();
        let mut len = 0;
        // SAFETY: NUL-terminated strings or NULL, and local out parameters.
        let status = unsafe {
            probity_verify(
                s.engine,
                path.as_ptr(),
                null(),
                id.as_ptr(),
                null(),
                node.as_ptr(),
                &mut out,
                &mut len,
            )
        };
        (status, take(out, len))
    };
    let (status, report) = verify(&s.f.object, "gpu-h1");
    assert_eq!(status, ProbityStatus::Ok, "{}", last_error());
    let report = report.unwrap();
    assert_eq!(report["verified"], true);
    assert_eq!(report["chunks"], 5);
    assert_eq!(report["decision"]["decision"], "allow");
    let (status, report) = verify(&s.f.tampered, "gpu-a1");
    assert_eq!(status, ProbityStatus::IntegrityFailure);
    let report = report.unwrap();
    assert_eq!(report["failure_kind"], "chunk-mismatch");
    assert_eq!(report["decision"]["obligations"][0]["kind"], "block_node");
    let (status, report) = verify(&s.f.object, "gpu-a1");
    assert_eq!(status, ProbityStatus::Denied, "a blocked node may not read");
    assert_eq!(report.unwrap()["verified"], true);
    probity_engine_close(s.engine);
}

#[test]
fn verification_without_a_state_directory_is_refused() {
    let e = open(None, None);
    let path = c("/nonexistent");
    let id = c("x");
    let mut r = ProbityReader { id: 0 };
    // SAFETY: NUL-terminated strings or NULL, and a local out parameter.
    let status = unsafe {
        probity_reader_open(
            e,
            path.as_ptr(),
            null(),
            null(),
            id.as_ptr(),
            null(),
            &mut r,
        )
    };
    assert_eq!(status, ProbityStatus::InvalidArgument);
    assert!(last_error().contains("state directory"), "{}", last_error());
    probity_engine_close(e);
}

#[test]
fn a_writable_pinned_key_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let s = sealed();
    std::fs::set_permissions(&s.f.public_key, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (status, _) = open_reader(&s, &s.f.object, None);
    assert_eq!(status, ProbityStatus::InvalidArgument);
    assert!(
        last_error().contains("writable by group and others (mode 0666)"),
        "{}",
        last_error()
    );
    probity_engine_close(s.engine);
}

/// Mutated requests through `probity_decide`: never a panic; a status and, on failure,
/// a message and no buffer.
#[test]
fn mutated_requests_never_panic_or_leak() {
    let e = cluster_engine();
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for round in 0..2000 {
        let seed = if round % 2 == 0 { ALLOW } else { HOT };
        let mut input = seed.to_vec();
        match next() % 3 {
            0 => input.truncate((next() as usize) % (seed.len() + 1)),
            1 => {
                let i = (next() as usize) % input.len();
                input[i] ^= 1 << (next() % 8);
            }
            _ => {
                let i = (next() as usize) % input.len();
                input.insert(i, (next() % 256) as u8);
            }
        }
        let (status, d) = decide(e, &input, 0);
        assert_ne!(status, ProbityStatus::Internal, "{}", last_error());
        match status {
            ProbityStatus::Ok => assert!(d.is_some()),
            _ => {
                assert!(d.is_none());
                assert!(!last_error().is_empty());
            }
        }
    }
    probity_engine_close(e);
}

/// The issue: the C ABI names the reading pod, and a block the read causes records it
/// with what must stop; a malformed pod is refused naming the field.
#[test]
fn verify_as_a_named_pod_records_the_reader_in_the_block() {
    let s = sealed();
    let verify = |namespace: Option<&str>, name: Option<&str>, uid: Option<&str>| {
        let path = c(s.f.tampered.to_str().unwrap());
        let id = c(fixtures::OBJECT_ID);
        let node = c("gpu-a1");
        let (namespace, name, uid) = (namespace.map(c), name.map(c), uid.map(c));
        let ptr = |s: &Option<CString>| s.as_ref().map_or(null(), |s| s.as_ptr());
        let mut out = null_mut();
        let mut len = 0;
        // SAFETY: NUL-terminated strings or NULL, and local out parameters.
        let status = unsafe {
            probity_verify_as(
                s.engine,
                path.as_ptr(),
                null(),
                id.as_ptr(),
                null(),
                node.as_ptr(),
                ptr(&namespace),
                ptr(&name),
                ptr(&uid),
                &mut out,
                &mut len,
            )
        };
        (status, take(out, len))
    };
    let (status, report) = verify(Some("train"), Some("Bad_Name"), None);
    assert_eq!(status, ProbityStatus::InvalidArgument);
    assert!(report.is_none());
    assert!(
        last_error().starts_with("reader.name: "),
        "{}",
        last_error()
    );
    let (status, _) = verify(None, Some("llm-0"), None);
    assert_eq!(status, ProbityStatus::InvalidArgument);
    assert!(
        last_error().contains("reader_namespace"),
        "{}",
        last_error()
    );
    let uid = "3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b";
    let (status, _) = verify(Some("train"), Some("llm-0"), Some(uid));
    assert_eq!(status, ProbityStatus::IntegrityFailure, "{}", last_error());
    let blocked = ENGINES.get(s.engine.id).unwrap().engine.blocked_nodes();
    let record = &blocked["gpu-a1"];
    let reader = record.reader.as_ref().unwrap();
    assert_eq!(
        (
            reader.namespace.as_str(),
            reader.name.as_str(),
            reader.uid.as_deref()
        ),
        ("train", "llm-0", Some(uid))
    );
    assert_eq!(record.stop.as_deref(), Some("reader"));
    probity_engine_close(s.engine);
}

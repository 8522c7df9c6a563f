"""probity from Python: decide (an allow; a deny with its obligations), read a sealed object
through the file-like verified reader, and a tampered chunk that fails mid-read and blocks
the node.

Run by the Rust suite (tests/ffi/python.rs), which seals the fixtures and sets
PROBITY_TEST_FIXTURES and PROBITY_LIB. By hand:
    cargo build -p probity-ffi
    cargo run -p probity-ffi --example make_fixtures -- /tmp/probity-fixtures
    PROBITY_LIB=target/debug/libprobity.so PROBITY_TEST_FIXTURES=/tmp/probity-fixtures \\
        python3 -m pytest hooks/ffi/python
"""

import hashlib
import io
import json
import os
import shutil
import threading

import pytest

import probity

OBJECT_ID = "llm/epoch-7"
CHUNK = 64 * 1024
SIZE = 4 * CHUNK + 1000

ALLOW = {"principal": 'Workload::"train-1"', "action": "schedule", "resource": 'Node::"gpu-a1"'}
HOT = {"principal": 'Workload::"train-1"', "action": "schedule", "resource": 'Node::"gpu-hot1"'}


@pytest.fixture
def fixtures(tmp_path):
    source = os.environ.get("PROBITY_TEST_FIXTURES")
    if not source:
        pytest.fail("PROBITY_TEST_FIXTURES is not set: run through `cargo test -p probity-ffi` (see this file's doc)")
    # A copy per test: the state directory records blocks.
    target = tmp_path / "fixtures"
    shutil.copytree(source, target)
    return target


@pytest.fixture
def engine(fixtures):
    with probity.Engine(state_dir=fixtures / "state") as e:
        e.upsert_entities(json.loads((fixtures / "cluster.json").read_text()))
        yield e


def test_the_library_speaks_this_modules_abi():
    assert probity.version() == "0.1.0"


def test_decide_allows_and_denies_with_obligations(engine):
    assert engine.decide(ALLOW)["decision"] == "allow"
    deny = engine.decide(json.dumps(HOT))
    assert deny["decision"] == "deny"
    assert [r["policy"] for r in deny["reasons"]] == ["thermal.zone-power-ceiling"]
    assert deny["obligations"][0]["kind"] == "migrate"
    assert deny["obligations"][0]["target"] == 'Zone::"zone-hot"'


def test_a_batch_answers_in_order_and_status_names_the_set(engine):
    decisions = engine.decide_batch([ALLOW, HOT, ALLOW])
    assert [d["decision"] for d in decisions] == ["allow", "deny", "allow"]
    status = engine.status()
    assert status["policies"] > 10 and len(status["digest"]) == 64


def test_a_reported_fact_needs_the_reporter_flag(engine):
    read = {
        "principal": 'Node::"gpu-h1"',
        "action": "read",
        "resource": 'Checkpoint::"ckpt-epoch-7"',
        "context": {"verified": True},
    }
    refused = engine.decide(read, dry_run=True)
    assert refused["decision"] == "deny" and "verified" in json.dumps(refused)
    assert engine.decide(read, dry_run=True, fact_reporter=True)["decision"] == "allow"


def test_the_verified_reader_is_a_file(engine, fixtures):
    expected = (fixtures / "epoch-7.ckpt").read_bytes()
    with engine.open_reader(fixtures / "epoch-7.ckpt", OBJECT_ID, node="gpu-a1") as f:
        assert f.size == SIZE
        assert f.read(10) == expected[:10]
        assert f.tell() == 10
        buf = bytearray(CHUNK)
        assert f.readinto(buf) == CHUNK
        assert bytes(buf) == expected[10 : 10 + CHUNK]
        assert f.seek(-100, io.SEEK_END) == SIZE - 100
        assert f.read() == expected[-100:]
        assert f.read() == b""
        assert f.read_at(CHUNK - 8, 16) == expected[CHUNK - 8 : CHUNK + 8]
        assert f.tell() == SIZE
        f.seek(0)
        # What a loader does: buffered, streamed into a hash or a copy.
        digest = hashlib.sha256()
        with io.BufferedReader(f, buffer_size=1 << 20) as buffered:
            for block in iter(lambda: buffered.read(12345), b""):
                digest.update(block)
        assert digest.hexdigest() == hashlib.sha256(expected).hexdigest()
    assert f.closed
    with pytest.raises(ValueError):
        f.read(1)


def test_a_tampered_chunk_fails_mid_read_and_blocks_the_node(engine, fixtures):
    expected = (fixtures / "epoch-7.ckpt").read_bytes()
    got = bytearray()
    with engine.open_reader(fixtures / "tampered.ckpt", OBJECT_ID, node="gpu-a1") as f:
        with pytest.raises(probity.IntegrityFailure) as failure:
            while True:
                block = f.read(4096)
                if not block:
                    break
                got += block
        assert "chunk 2" in failure.value.message
        # Every byte handed out came from a verified chunk.
        assert bytes(got) == expected[: 2 * CHUNK]
        with pytest.raises(probity.IntegrityFailure):
            f.read_at(0, 1)
    blocked = engine.decide(ALLOW)
    assert [r["policy"] for r in blocked["reasons"]] == ["security.blocked-node"]
    with pytest.raises(probity.Denied):
        engine.open_reader(fixtures / "epoch-7.ckpt", OBJECT_ID, node="gpu-a1")


def test_verify_reports_and_a_failure_blocks_through_the_policies(engine, fixtures):
    report = engine.verify(fixtures / "epoch-7.ckpt", OBJECT_ID, node="gpu-h1")
    assert report["verified"] is True and report["chunks"] == 5
    assert report["decision"]["decision"] == "allow"
    with pytest.raises(probity.IntegrityFailure) as failure:
        engine.verify(fixtures / "tampered.ckpt", OBJECT_ID, node="gpu-h1")
    assert failure.value.report["failure_kind"] == "chunk-mismatch"
    assert failure.value.report["decision"]["obligations"][0]["kind"] == "block_node"
    with pytest.raises(probity.Denied):
        engine.verify(fixtures / "epoch-7.ckpt", OBJECT_ID, node="gpu-h1")


def test_a_read_names_its_pod_and_a_malformed_one_is_refused(engine, fixtures):
    with pytest.raises(probity.InvalidArgument) as bad:
        engine.verify(fixtures / "tampered.ckpt", OBJECT_ID, node="gpu-h1", reader={"namespace": "train", "name": "Bad_Name"})
    assert str(bad.value).startswith("reader.name: ")
    pod = {"namespace": "train", "name": "llm-0", "uid": "3f1c2a7e-5b4d-4e8f-9a0b-1c2d3e4f5a6b"}
    with pytest.raises(probity.IntegrityFailure) as failure:
        engine.verify(fixtures / "tampered.ckpt", OBJECT_ID, node="gpu-h1", reader=pod)
    assert failure.value.report["decision"]["obligations"][0]["parameters"] == {"stop": "reader"}


def test_misuse_is_an_exception_not_a_crash(fixtures):
    e = probity.Engine()
    e.close()
    e.close()  # idempotent in Python
    with pytest.raises(probity.StaleHandle):
        e.decide(ALLOW)
    with probity.Engine() as e:
        with pytest.raises(probity.InvalidArgument) as bad:
            e.decide(b'{"principal": ')
        assert "line 1" in bad.value.message
        with pytest.raises(probity.NotUtf8):
            e.decide(b'{"principal": "\xff"}')
        with pytest.raises(probity.InvalidArgument):
            e.open_reader(fixtures / "epoch-7.ckpt", OBJECT_ID)  # no state directory
    with pytest.raises(probity.NotUtf8):
        probity.Engine(policy_dir=b"/tmp/\xfe")


def test_an_engine_is_shared_by_threads(engine):
    answers = []

    def work():
        for i in range(50):
            answers.append(engine.decide(HOT if i % 2 else ALLOW)["decision"])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers.count("allow") == 100 and answers.count("deny") == 100

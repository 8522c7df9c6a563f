#!/usr/bin/env python3
"""Independent implementation of the encrypted object format (engine/keys/FORMAT.md).

Written from FORMAT.md alone, with python3-cryptography's AES-GCM and RFC 5649 key wrap, to
produce known-answer vectors for engine/keys/tests/keys/kat.rs. Every key, nonce prefix,
wrap nonce and plaintext is fixed, so the output is deterministic:

    python3 gen_vectors.py > vectors.json

Re-run only if the format version changes.
"""
import json
import struct

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.keywrap import aes_key_wrap_with_padding

MAGIC = b"PRBE"
FORMAT_VERSION = 1
KEY_ID = "dataset/kat"
DATA_KEYS = {v: bytes((v * 17 + i) % 256 for i in range(32)) for v in (2, 3)}


def fixed(seed, n):
    return bytes((seed * 97 + i * 31 + 7) % 256 for i in range(n))


def plaintext(n):
    return bytes((i * 31 + 7 + i // 256) % 256 for i in range(n))


def u16(v):
    return struct.pack(">H", v)


def u32(v):
    return struct.pack(">I", v)


def u64(v):
    return struct.pack(">Q", v)


def encrypt(object_id, segment_size, pt, object_key, prefix, wrap_nonce, sealed, wrap):
    key_id = KEY_ID.encode()
    oid = object_id.encode()
    header_len = 100 + len(key_id) + len(oid)
    head = (
        MAGIC
        + u16(FORMAT_VERSION)
        + u16(header_len)
        + u32(segment_size)
        + u64(len(pt))
        + prefix
        + u32(sealed)
        + u32(wrap)
        + u16(len(key_id))
        + key_id
        + u16(len(oid))
        + oid
        + wrap_nonce
    )
    # The wrapped object key: GCM under the wrap version's data key, AAD = header so far.
    wrapped = AESGCM(DATA_KEYS[wrap]).encrypt(wrap_nonce, object_key, head)
    assert len(wrapped) == 48
    out = head + wrapped
    assert len(out) == header_len

    n = max(1, -(-len(pt) // segment_size))
    gcm = AESGCM(object_key)
    for i in range(n):
        chunk = pt[i * segment_size:(i + 1) * segment_size]
        last = 1 if i == n - 1 else 0
        nonce = prefix + u32(i)
        aad = u16(len(oid)) + oid + u32(sealed) + u32(i) + bytes([last])
        out += prefix + gcm.encrypt(nonce, chunk, aad)
    assert len(out) == header_len + len(pt) + 24 * n
    return out


def main():
    seg = 64
    cases = [
        ("empty", "kat/empty", 0),
        ("one-byte", "kat/one-byte", 1),
        ("one-segment", "kat/one-segment", seg),
        ("one-segment-plus-one", "kat/one-segment-plus-one", seg + 1),
        ("several-segments", "kat/several", 3 * seg + 17),
        ("exact-multiple", "kat/exact-multiple", 4 * seg),
        ("utf8-object-id", "kat/\u00e9t\u00e9/0001", 2 * seg + 5),
    ]
    vectors = []
    for seed, (name, oid, n) in enumerate(cases, start=1):
        v = {
            "name": name,
            "object_id": oid,
            "segment_size": seg,
            "sealed_version": 3,
            "wrap_version": 3,
            "object_key": fixed(seed, 32),
            "nonce_prefix": fixed(seed + 100, 8),
            "wrap_nonce": fixed(seed + 200, 12),
            "plaintext": plaintext(n),
        }
        vectors.append(v)
    # A rewrapped object: sealed under version 2, its key wrapped under version 3.
    vectors.append(
        {
            "name": "rewrapped",
            "object_id": "kat/rewrapped",
            "segment_size": seg,
            "sealed_version": 2,
            "wrap_version": 3,
            "object_key": fixed(50, 32),
            "nonce_prefix": fixed(150, 8),
            "wrap_nonce": fixed(250, 12),
            "plaintext": plaintext(2 * seg + 9),
        }
    )
    for v in vectors:
        v["encrypted"] = encrypt(
            v["object_id"],
            v["segment_size"],
            v["plaintext"],
            v["object_key"],
            v["nonce_prefix"],
            v["wrap_nonce"],
            v["sealed_version"],
            v["wrap_version"],
        )
    kwp = []
    for seed in (1, 2):
        kek = fixed(seed + 300, 32)
        key = fixed(seed + 400, 32)
        kwp.append({"kek": kek, "key": key, "wrapped": aes_key_wrap_with_padding(kek, key)})

    def hexed(d):
        return {k: (v.hex() if isinstance(v, bytes) else v) for k, v in d.items()}

    print(
        json.dumps(
            {
                "format": FORMAT_VERSION,
                "generator": "testdata/keys/gen_vectors.py (python3-cryptography)",
                "key_id": KEY_ID,
                "data_keys": {str(v): k.hex() for v, k in DATA_KEYS.items()},
                "vectors": [hexed(v) for v in vectors],
                "kwp": [hexed(k) for k in kwp],
            },
            indent=1,
            ensure_ascii=False,
        )
    )


if __name__ == "__main__":
    main()

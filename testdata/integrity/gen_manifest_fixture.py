#!/usr/bin/env python3
"""Independent implementation of the manifest format (engine/src/integrity/manifest.rs docs).

Writes object-7chunks.bin (content), manifest-v1.bin (canonical encoding) and prints the
root and manifest digest that engine/tests/it/integrity.rs pins. Re-run only if the format
version changes.
"""
import hashlib, struct

def h(b): return hashlib.sha256(b).digest()

def mth(leaves):  # RFC 6962 section 2.1, inputs are the chunk SHA-256s
    n = len(leaves)
    if n == 0: return h(b"")
    if n == 1: return h(b"\x00" + leaves[0])
    k = 1
    while k * 2 < n: k *= 2
    return h(b"\x01" + mth(leaves[:k]) + mth(leaves[k:]))

content = bytes((i * 7 + i // 1024) % 251 for i in range(6 * 1024 + 500))
chunk = 1024
leaves = [h(content[i:i + chunk]) for i in range(0, len(content), chunk)]
oid = "testdata/known-answer".encode()
enc = b"PRBM" + struct.pack(">HBH", 1, 1, len(oid)) + oid
enc += struct.pack(">QQI", 42, len(content), chunk) + mth(leaves)
enc += struct.pack(">Q", len(leaves)) + b"".join(leaves)
open("object-7chunks.bin", "wb").write(content)
open("manifest-v1.bin", "wb").write(enc)
print("leaves", len(leaves))
print("root", mth(leaves).hex())
print("digest", h(enc).hex())

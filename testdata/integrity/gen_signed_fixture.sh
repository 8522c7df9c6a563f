#!/bin/sh
# Signs manifest-v1.bin's digest with a throwaway OpenSSL P-256 key (an independent signer:
# message = manifest digest, ECDSA with SHA-256) and writes signed-manifest-v1.bin and
# signer-public-key.hex (uncompressed point). The private key is deleted.
set -eu
cd "$(dirname "$0")"
tmp=$(mktemp -d)
openssl ecparam -genkey -name prime256v1 -noout -out "$tmp/k.pem"
openssl dgst -sha256 -binary manifest-v1.bin > "$tmp/digest.bin"
openssl dgst -sha256 -sign "$tmp/k.pem" -out "$tmp/sig.der" "$tmp/digest.bin"
openssl ec -in "$tmp/k.pem" -pubout -conv_form uncompressed -outform DER -out "$tmp/pub.der" 2>/dev/null
python3 - "$tmp" <<'PY'
import sys, struct, hashlib
tmp = sys.argv[1]
der = open(f"{tmp}/sig.der", "rb").read()
# SEQUENCE { INTEGER r, INTEGER s }
assert der[0] == 0x30
i = 2
ints = []
for _ in range(2):
    assert der[i] == 0x02
    n = der[i + 1]
    ints.append(int.from_bytes(der[i + 2:i + 2 + n], "big"))
    i += 2 + n
sig = b"".join(v.to_bytes(32, "big") for v in ints)
point = open(f"{tmp}/pub.der", "rb").read()[-65:]
assert point[0] == 4
manifest = open("manifest-v1.bin", "rb").read()
out = b"PRBS" + struct.pack(">HB", 1, 1) + hashlib.sha256(point).digest()
out += struct.pack(">H", 64) + sig + struct.pack(">Q", len(manifest)) + manifest
open("signed-manifest-v1.bin", "wb").write(out)
open("signer-public-key.hex", "w").write(point.hex() + "\n")
PY
rm -rf "$tmp"

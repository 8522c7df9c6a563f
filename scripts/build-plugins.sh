#!/usr/bin/env bash
# Builds every WebAssembly plugin the tests, scenarios and benchmarks use, as
# wasm32-wasip2 components, into target/plugins/<name>.wasm (gitignored):
#   - the example plugins (plugins/examples/*, members of the main workspace), and
#   - the hostile plugins (testdata/plugins/*, a workspace of their own), plus
#     testdata/plugins/not-wasm.wasm copied as is.
# The engine's plugin tests fail (they do not skip) when these files are missing:
# run this script before `cargo test`.
#
# Environment: PROBITY_PLUGIN_TARGET_DIR, the cargo target dir for the wasm builds
# (default target/plugins-build), kept apart from the host's so that the two builds
# never invalidate each other.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/target/plugins"
build="${PROBITY_PLUGIN_TARGET_DIR:-$root/target/plugins-build}"

if command -v rustup >/dev/null 2>&1; then
    rustup target add wasm32-wasip2 >/dev/null 2>&1 || rustup target add wasm32-wasip2
fi

# CARGO_TARGET_DIR would override --target-dir; the wasm builds keep their own.
unset CARGO_TARGET_DIR
# A 128 KiB shadow stack instead of Rust's 1 MiB default: a fresh instance per call
# resets (or faults in) every page it touched, so a small memory is a fast call.
export CARGO_TARGET_WASM32_WASIP2_RUSTFLAGS="${CARGO_TARGET_WASM32_WASIP2_RUSTFLAGS:-} -C link-arg=-zstack-size=131072"
cargo build --quiet --release --target wasm32-wasip2 --target-dir "$build" \
    --manifest-path "$root/Cargo.toml" -p power-spike -p thermal-headroom
cargo build --quiet --release --target wasm32-wasip2 --target-dir "$build" \
    --manifest-path "$root/testdata/plugins/Cargo.toml" --workspace

mkdir -p "$out"
for name in power-spike thermal-headroom looping memory-bomb trap malformed missing-import sneaky; do
    cp "$build/wasm32-wasip2/release/${name//-/_}.wasm" "$out/$name.wasm"
done
cp "$root/testdata/plugins/not-wasm.wasm" "$out/not-wasm.wasm"
echo "plugins built into $out:"
ls -1 "$out"

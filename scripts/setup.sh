#!/usr/bin/env bash
# Installs what Probity's tests and server need on a fresh Debian machine that has only
# the Rust toolchain (run as root). Idempotent: it installs only what is missing.
set -euo pipefail

packages=(softhsm2 opensc)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! rustup target list --installed | grep -qx wasm32-wasip2; then
  echo "setup: adding the wasm32-wasip2 target" >&2
  rustup target add wasm32-wasip2
fi

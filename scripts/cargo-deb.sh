#!/usr/bin/env bash
# Installs cargo-deb (from crates.io, pinned) once per machine into a cache outside the
# repository, and prints the path of its binary. scripts/setup.sh calls it, so that the
# test command's packaging tests find it; scripts/build-deb.sh calls it too.
set -euo pipefail
version=3.8.0
root="${PROBITY_TOOLS_CACHE:-/var/cache/probity/tools}/cargo-deb-$version"
if [ ! -x "$root/bin/cargo-deb" ]; then
  echo "setup: installing cargo-deb $version into $root (about 2 minutes, once)" >&2
  # A target directory of its own: never the workspace's.
  CARGO_TARGET_DIR="$root/build" cargo install cargo-deb --version "$version" --locked \
    --root "$root" --quiet >&2
  rm -rf "$root/build"
fi
echo "$root/bin/cargo-deb"

#!/usr/bin/env bash
# Builds the Debian packages probity and libprobity-dev from binaries already built,
# with cargo-deb (installed by scripts/setup.sh outside the repository).
#
#   bash scripts/build-deb.sh                  # release: cargo build --release first
#   bash scripts/build-deb.sh --profile dev    # the debug build the test command made
#
# Before cargo-deb, it stages what the package carries: the binaries without their
# debug sections, the man pages and shell completions (from the binary's own command
# definitions) and probity.pc filled in with the install paths. They go to <target>/<profile>/deb, where
# the metadata's "target/release/deb/..." assets find them. Prints the two .deb paths.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --output) out="$2"; shift 2 ;;
    *) echo "build-deb: unknown argument $1" >&2; exit 2 ;;
  esac
done
# Cargo's directory for the profile: "dev" builds into debug/.
case "$profile" in
  dev) dir=debug ;;
  *) dir="$profile" ;;
esac
target="${CARGO_TARGET_DIR:-target}"
build="$target/$dir"
out="${out:-$target/debian}"
cargo_deb="$(bash scripts/cargo-deb.sh)"

for artifact in probity libprobity.so libprobity.a probity.pc; do
  if [ ! -e "$build/$artifact" ]; then
    echo "build-deb: $build/$artifact is missing: build it first" \
         "(cargo build --profile $profile -p probity-cli -p probity-ffi)" >&2
    exit 1
  fi
done

staging="$build/deb"
rm -rf "$staging"
mkdir -p "$staging/man" "$staging/completions" "$staging/pkgconfig" "$staging/bin" "$staging/lib"
# Without debug sections (symbols kept, so backtraces still name functions): a debug
# build's are hundreds of MB, which lintian takes minutes and gigabytes to read.
strip --strip-debug -o "$staging/bin/probity" "$build/probity"
strip --strip-debug -o "$staging/lib/libprobity.so" "$build/libprobity.so"
strip --strip-debug -o "$staging/lib/libprobity.a" "$build/libprobity.a"
"$staging/bin/probity" man "$staging/man" >/dev/null
# Debian's policy: man pages compressed with gzip -9n (no name or time in the header).
gzip -9n "$staging"/man/*.1
"$staging/bin/probity" completions bash > "$staging/completions/probity.bash"
"$staging/bin/probity" completions zsh > "$staging/completions/_probity"
"$staging/bin/probity" completions fish > "$staging/completions/probity.fish"

# probity.pc for the installed paths: no rpath, the build's own private libraries.
native_libs="$(sed -n 's/^Libs.private: //p' "$build/probity.pc")"
sed -e '/^#/d' \
    -e 's|@PREFIX@|/usr|' \
    -e 's|@LIBDIR@|${prefix}/lib/x86_64-linux-gnu|' \
    -e 's|@INCLUDEDIR@|${prefix}/include|' \
    -e "s|@VERSION@|$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)|" \
    -e 's|@RPATH@||' \
    -e "s|@NATIVE_LIBS@|$native_libs|" \
    hooks/ffi/probity.pc.in > "$staging/pkgconfig/probity.pc"

mkdir -p "$out"
# --fast: gzip, not xz, for the 100 MB debug binary of the tests; the release package
# is compressed with xz.
compress=()
if [ "$profile" = dev ]; then
  compress=(--fast)
fi
for package in probity-cli probity-ffi; do
  "$cargo_deb" --no-build --profile "$profile" -p "$package" --output "$out" \
    "${compress[@]}" --quiet >&2
done
# The staged copies (about 570 MB for the debug build) are in the packages now.
rm -rf "$staging"
ls "$out"/probity_*.deb "$out"/libprobity-dev_*.deb | sort -u

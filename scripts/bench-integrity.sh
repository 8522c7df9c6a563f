#!/bin/sh
# Interleaved integrity measurements on a file in page cache (see BENCHMARKS.md, Integrity).
#   scripts/bench-integrity.sh FILE STATE_DIR [ROUNDS]
# Needs: cargo build --release -p probity --example integrity_bench; FILE sealed with
#   integrity_bench seal FILE STATE_DIR
# Prints one line per run: tool, wall seconds, user+sys CPU seconds.
set -eu
file=$1; state=$2; rounds=${3:-5}
bin=${CARGO_TARGET_DIR:-target}/release/examples/integrity_bench
cat "$file" > /dev/null   # warm the page cache
run() { label=$1; shift; /usr/bin/time -f "$label %e %U %S" "$@" >/dev/null 2>>"$state/times.txt"; }
: > "$state/times.txt"
i=0
while [ "$i" -lt "$rounds" ]; do
    run openssl openssl dgst -sha256 "$file"
    run verify-1 "$bin" verify "$file" "$state" 1 1
    run verify-2 "$bin" verify "$file" "$state" 2 1
    run plain "$bin" plain "$file" 1
    run reader "$bin" reader "$file" "$state" 1
    i=$((i + 1))
done
awk '{ w[$1] = w[$1] " " $2; c[$1] = c[$1] " " ($3 + $4) }
     END { for (k in w) print k, "wall:" w[k], "| cpu:" c[k] }' "$state/times.txt" | sort

#!/usr/bin/env bash
# The hot path's p99 at a fixed 10,000 decisions/s with a shadow set against without,
# in interleaved rounds: the issue "rolling out a policy safely" asks for at most 1.1x.
#
#   cargo build --release --workspace --bin probity --example loadgen
#   [PROBITY=BINARY] [LOADGEN=BINARY] bash scripts/bench-shadow.sh [ROUNDS=3] [SAMPLE_EVERY=1] [SECONDS=10]
#
# Each round starts a fresh server on the default policies and the test cluster, and one
# whose [policies] shadow is a copy of them with the zone ceiling in warn mode (so
# shadow decisions differ), deciding one request in SAMPLE_EVERY again (1: every one,
# the worst case). loadgen drives each at 10,000 requests/s over 8 connections (every
# answer checked). Prints loadgen's line per run, the median p99s and their ratio, and
# the shadow's counts. Every process it starts is stopped by its PID; all on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
rounds=${1:-3}
every=${2:-1}
seconds=${3:-10}
probity=${PROBITY:-$repo/target/release/probity}
loadgen=${LOADGEN:-$repo/target/release/examples/loadgen}
. "$repo/scripts/bench-lib.sh"
need_built "$probity" "$loadgen"

work=$(mktemp -d -p /dev/shm)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

cp -r "$repo/policies" "$work/next"
printf '\n[modes]\n"thermal.zone-power-ceiling" = "warn"\n' >> "$work/next/probity.toml"
cat > "$work/request.json" <<'JSON'
{"principal": "Workload::\"train-1\"", "action": "schedule", "resource": "Node::\"gpu-hot1\""}
JSON

# run NAME SHADOWED: one server, one loadgen run; prints "SHADOWED <loadgen line>".
run() {
  local name=$1 shadowed=$2 port shadow=""
  port=$(free_port)
  if [ "$shadowed" = shadowed ]; then
    shadow="shadow = \"$work/next\"
shadow_sample_every = $every"
  fi
  cat > "$work/$name.toml" <<TOML
[server]
socket = ""
listen = "127.0.0.1:$port"
insecure = true
[policies]
entities = "$repo/testdata/entities/cluster.json"
$shadow
[log]
level = "warn"
TOML
  start_server "$name" "$port"
  local line
  line=$("$loadgen" --tcp "127.0.0.1:$port" --path /v1/decide --body "$work/request.json" \
    --connections 8 --rate 10000 --duration "$seconds" --requests 200000 --expect '"deny"')
  if [ "$shadowed" = shadowed ]; then
    curl -s "http://127.0.0.1:$port/v1/policy/shadow" | python3 -c '
import json, sys
r = json.load(sys.stdin)
print("shadow: agreed %d disagreed %d dropped %d" % (r["agreed"], r["disagreed"], r["dropped"]), file=sys.stderr)'
  fi
  stop_server
  echo "$shadowed $line"
}

results=()
for r in $(seq 1 "$rounds"); do
  for mode in plain shadowed; do
    line=$(run "r$r-$mode" "$mode")
    echo "round $r $line"
    results+=("$line")
  done
done
printf '%s\n' "${results[@]}" | python3 -c '
import re, statistics, sys
p99 = {"plain": [], "shadowed": []}
for line in sys.stdin:
    mode = line.split()[0]
    if re.search(r"errors=([0-9]+)", line).group(1) != "0":
        sys.exit(f"a run had answers other than the live deny: {line.strip()}")
    p99[mode].append(float(re.search(r"p99=([0-9.]+)ms", line).group(1)))
a, b = statistics.median(p99["plain"]), statistics.median(p99["shadowed"])
print(f"median p99: without a shadow {a:.3f} ms, with one {b:.3f} ms, ratio {b / a:.2f}x")
'

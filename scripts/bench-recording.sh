#!/usr/bin/env bash
# Recorded denies per second through the server against unrecorded ones, in interleaved
# rounds: the issue "the audit trail reaches the SIEM" asks for >= 0.6x at 64 connections.
#
#   cargo build --release --workspace --bin probity --example loadgen
#   [STATE_ROOT=DIR] [PROBITY=BINARY] bash scripts/bench-recording.sh [ROUNDS=3] [CONNECTIONS=64] [SECONDS=8]
#
# Each round starts a fresh server without a state directory (nothing recorded) and one
# with it (every deny recorded in the chained decision log, fsynced per group commit,
# under STATE_ROOT, default /var/tmp), and drives each closed-loop with loadgen over
# CONNECTIONS connections (`rlhf-1` onto `gpu-a1`: every answer a deny; a run with any
# other answer fails). Prints loadgen's line per run, the median rates and their ratio.
# Every process it starts is stopped by its PID on exit; everything runs on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
rounds=${1:-3}
connections=${2:-64}
seconds=${3:-8}
probity=${PROBITY:-$repo/target/release/probity}
loadgen=$repo/target/release/examples/loadgen
. "$repo/scripts/bench-lib.sh"
need_built "$probity" "$loadgen"

work=$(mktemp -d -p /dev/shm)
state_root=$(mktemp -d -p "${STATE_ROOT:-/var/tmp}")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work" "$state_root"
}
trap cleanup EXIT

cat > "$work/request.json" <<'JSON'
{"principal": "Workload::\"rlhf-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""}
JSON

# run NAME RECORDED: one server, one loadgen run; prints "RECORDED <loadgen line>".
run() {
  local name=$1 recorded=$2 port state=""
  port=$(free_port)
  if [ "$recorded" = recorded ]; then
    state="[integrity]
state_dir = \"$state_root/$name\"
[limits]
recorded_per_second = 0"
  fi
  cat > "$work/$name.toml" <<TOML
[server]
socket = ""
listen = "127.0.0.1:$port"
insecure = true
[policies]
entities = "$repo/testdata/entities/cluster.json"
[log]
level = "warn"
$state
TOML
  start_server "$name" "$port"
  local line
  line=$("$loadgen" --tcp "127.0.0.1:$port" --path /v1/decide --body "$work/request.json" \
    --connections "$connections" --duration "$seconds" --requests 2000000 --expect '"deny"')
  stop_server
  echo "$recorded $line"
}

results=()
for r in $(seq 1 "$rounds"); do
  for mode in unrecorded recorded; do
    line=$(run "r$r-$mode" "$mode")
    echo "round $r $line"
    results+=("$line")
  done
done
printf '%s\n' "${results[@]}" | python3 -c '
import re, statistics, sys
rate = {"unrecorded": [], "recorded": []}
for line in sys.stdin:
    mode = line.split()[0]
    if re.search(r"errors=([0-9]+)", line).group(1) != "0":
        sys.exit(f"a run had answers other than a deny: {line.strip()}")
    rate[mode].append(float(re.search(r"throughput=([0-9.]+)/s", line).group(1)))
u, r = statistics.median(rate["unrecorded"]), statistics.median(rate["recorded"])
print(f"median: unrecorded {u:.0f}/s, recorded {r:.0f}/s, ratio {r / u:.2f}x")
'

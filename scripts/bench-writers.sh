#!/usr/bin/env bash
# Decisions through the server while node agents push facts: the issue "a store that
# takes a stream of facts" asks, with 8 writers at 5,000 updates/s, for at least 0.85x
# the decisions/s of the same run without writers and at most 1.5x its p99.
#
#   cargo build --release --workspace --bin probity --example loadgen --example large_store
#   [PROBITY=BINARY] [WRITES=requests|stream] [TICK=MS] bash scripts/bench-writers.sh [ROUNDS=3] [SECONDS=10] [RATE=5000] [CONNECTIONS=32]
#
# One server (embedded default policies; plain HTTP on a loopback port for decisions,
# so the figure is the engine's and not TLS's;
# the admin socket in the work directory for writes) holds the 110,107-entity store of
# BENCHMARKS.md (`large_store write`). Each round runs the same closed-loop decision load
# (CONNECTIONS connections, `schedule` requests of 4,096 workload/node pairs in turn)
# twice: alone, then beside a second load generator that posts one node's changed
# temperature at RATE updates/s over 8 connections of the admin socket (the updates
# `large_store mixed` makes): one request per update (WRITES=requests, the default), or
# each writer's updates as the lines of one `POST /v1/entities/stream` (WRITES=stream);
# with TICK=MS, stream writers wake every MS milliseconds and send the lines due by then
# in one write, as a relay forwarding its agents' reports would (loadgen --tick).
# Prints loadgen's lines and, per round and as medians, the ratio of decisions/s and of
# p99 with writers to without, and the rate the writers kept (a writer the server falls
# behind sends fewer updates than RATE). Every process it starts is stopped by its PID on
# exit.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
rounds=${1:-3}
seconds=${2:-10}
rate=${3:-5000}
connections=${4:-32}
writes=${WRITES:-requests}
case "$writes" in
  requests) write_path=/v1/entities; write_mode=() ;;
  stream) write_path=/v1/entities/stream; write_mode=(--stream ${TICK:+--tick "$TICK"}) ;;
  *) echo "WRITES is requests or stream, not $writes" >&2; exit 2 ;;
esac
probity=${PROBITY:-$repo/target/release/probity}
loadgen=$repo/target/release/examples/loadgen
large=$repo/target/release/examples/large_store
for b in "$probity" "$loadgen" "$large"; do
  [ -x "$b" ] || { echo "build first: $b is missing" >&2; exit 2; }
done
. "$repo/scripts/bench-lib.sh"

work=$(mktemp -d -p /dev/shm)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ -s "$work/probity.log" ]; then
    echo "server log (last lines):" >&2
    tail -n 20 "$work/probity.log" >&2
  fi
  rm -rf "$work"
}
trap cleanup EXIT
cd "$work"

"$large" write entities.json > /dev/null
"$large" lines . > /dev/null

port=$(free_port)
cat > probity.toml <<TOML
[server]
socket = "$work/probity.sock"
listen = "127.0.0.1:$port"
insecure = true
[policies]
entities = "$work/entities.json"
[log]
level = "warn"
TOML
"$probity" serve --config probity.toml > probity.log 2>&1 &
pids+=($!)
wait_port "$port"

decide() {
  "$loadgen" --tcp "127.0.0.1:$port" --path /v1/decide --bodies decide.jsonl \
    --connections "$connections" --duration "$seconds" --requests 100000000 \
    --expect '"decision"'
}

field() { echo "$1" | grep -oE "$2=[0-9.]+" | cut -d= -f2; }

ratios_rate=()
ratios_p99=()
kept=()
for r in $(seq 1 "$rounds"); do
  alone=$(decide)
  echo "round $r without writers: $alone"
  # The writers start first and stop after the decisions: the whole run is under them.
  "$loadgen" --unix "$work/probity.sock" --path "$write_path" ${write_mode[@]+"${write_mode[@]}"} \
    --bodies updates.jsonl --connections 8 --rate "$rate" --duration $((seconds + 3)) \
    --requests $((rate * (seconds + 3))) --warmup 10 > writers.out 2>&1 &
  writer=$!
  pids+=("$writer")
  sleep 1
  beside=$(decide)
  wait "$writer"
  echo "round $r with writers:    $beside"
  echo "round $r writers:         $(cat writers.out)"
  case "$(cat writers.out)" in
    *" errors=0 "*) ;;
    *) echo "round $r: an update failed" >&2; exit 1 ;;
  esac
  for line in "$alone" "$beside"; do
    case "$line" in
      *" errors=0 "*) ;;
      *) echo "round $r: a decision failed" >&2; exit 1 ;;
    esac
  done
  ratios_rate+=("$(python3 -c "print($(field "$beside" throughput) / $(field "$alone" throughput))")")
  ratios_p99+=("$(python3 -c "print($(field "$beside" p99) / $(field "$alone" p99))")")
  kept+=("$(field "$(cat writers.out)" throughput)")
  echo "round $r: decisions/s ${ratios_rate[-1]:0:5}x, p99 ${ratios_p99[-1]:0:5}x, writers kept ${kept[-1]}/s of $rate"
done
python3 - "${ratios_rate[*]}" "${ratios_p99[*]}" "${kept[*]}" "$writes${TICK:+, tick $TICK ms}" <<'PY'
import statistics, sys
rate = [float(x) for x in sys.argv[1].split()]
p99 = [float(x) for x in sys.argv[2].split()]
kept = [float(x) for x in sys.argv[3].split()]
print(f"median over {len(rate)} rounds ({sys.argv[4]}): decisions/s {statistics.median(rate):.2f}x, "
      f"p99 {statistics.median(p99):.2f}x (with writers / without); "
      f"writers kept {statistics.median(kept):.0f} updates/s")
PY

#!/usr/bin/env bash
# Decision latency at a fixed rate of recorded denies, with SIEM forwarding over TLS
# (RFC 5425, to a real rsyslog on loopback) off and on, in interleaved rounds.
#
#   cargo build --release --workspace --bin probity --example loadgen
#   [STATE_ROOT=DIR] bash scripts/bench-forwarding.sh [ROUNDS=3] [RATE=5000] [SECONDS=10]
#
# Each round starts a fresh server with a fresh state directory, without [siem] and
# then with it, and drives it with loadgen at RATE denies/s over 8 connections
# (`rlhf-1` onto `gpu-a1`, outside its dedicated zone: every answer a recorded deny;
# a run with any other answer fails). Prints loadgen's line per run, then the median
# p99 of each and their ratio. Every process it starts is stopped by its PID on exit;
# everything runs on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
rounds=${1:-3}
rate=${2:-5000}
seconds=${3:-10}
probity=${PROBITY:-$repo/target/release/probity}
loadgen=$repo/target/release/examples/loadgen
for b in "$probity" "$loadgen"; do
  [ -x "$b" ] || { echo "build first: $b is missing" >&2; exit 2; }
done

# The SIEM's side (rsyslog's files) lives in memory: a real SIEM does not share
# Probity's disk, and its writes here would slow the fsyncs being measured. The state
# directories (the decision log, fsynced per group commit) go under STATE_ROOT, by
# default a directory on the disk of /var/tmp; STATE_ROOT=/dev/shm measures the CPU
# cost alone.
work=$(mktemp -d -p /dev/shm)
state_root=$(mktemp -d -p "${STATE_ROOT:-/var/tmp}")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work" "$state_root"
}
trap cleanup EXIT
cd "$work"

# A CA and a certificate for 127.0.0.1, for rsyslog's gtls driver.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key \
  -out ca.pem -days 2 -subj "/CN=bench CA" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout siem.key \
  -out siem.csr -subj "/CN=localhost" 2>/dev/null
printf "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n" > siem.ext
openssl x509 -req -in siem.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out siem.pem \
  -days 2 -extfile siem.ext 2>/dev/null

. "$repo/scripts/bench-lib.sh"

siem_port=$(free_port)
mkdir -p rsyslog-work
cat > rsyslog.conf <<EOF
global(workDirectory="$work/rsyslog-work" maxMessageSize="64k"
       defaultNetstreamDriver="gtls" defaultNetstreamDriverCAFile="$work/ca.pem"
       defaultNetstreamDriverCertFile="$work/siem.pem" defaultNetstreamDriverKeyFile="$work/siem.key")
module(load="imtcp")
input(type="imtcp" port="$siem_port" address="127.0.0.1" ruleset="probity"
      streamDriver.name="gtls" streamDriver.mode="1" streamDriver.authMode="anon")
ruleset(name="probity") { action(type="omfile" file="$work/received.log") }
EOF
rsyslogd -n -f rsyslog.conf -i "$work/rsyslog.pid" > rsyslog.log 2>&1 &
pids+=($!)
wait_port "$siem_port"

cat > request.json <<'JSON'
{"principal": "Workload::\"rlhf-1\"", "action": "schedule", "resource": "Node::\"gpu-a1\""}
JSON

# config NAME PORT FORWARD: a server configuration with its own state directory.
config() {
  local siem=""
  if [ "$3" = on ]; then
    siem="[siem]
address = \"127.0.0.1:$siem_port\"
transport = \"tls\"
ca_file = \"$work/ca.pem\""
  fi
  rm -rf "$state_root/state-$1"
  cat > "$work/$1.toml" <<EOF
[server]
socket = ""
listen = "127.0.0.1:$2"
insecure = true
[policies]
entities = "$repo/testdata/entities/cluster.json"
[integrity]
state_dir = "$state_root/state-$1"
[limits]
recorded_per_second = 0
[log]
level = "warn"
$siem
EOF
}

run() {
  local name=$1 forward=$2 port
  port=$(free_port)
  config "$name" "$port" "$forward"
  "$probity" serve --config "$work/$name.toml" > "$work/$name.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  wait_port "$port"
  local line
  line=$("$loadgen" --tcp "127.0.0.1:$port" --path /v1/decide --body request.json \
    --connections 8 --rate "$rate" --duration "$seconds" --requests $((rate * seconds)) \
    --expect '"deny"')
  kill -TERM "$pid"
  wait "$pid" 2>/dev/null || true
  echo "$forward $line"
}

results=()
for r in $(seq 1 "$rounds"); do
  for forward in off on; do
    line=$(run "r$r-$forward" "$forward")
    echo "round $r forwarding $line"
    results+=("$line")
  done
done
printf '%s\n' "${results[@]}" | python3 -c '
import re, statistics, sys
p99 = {"off": [], "on": []}
for line in sys.stdin:
    mode = line.split()[0]
    if re.search(r"errors=([0-9]+)", line).group(1) != "0":
        sys.exit(f"a run had answers other than a deny: {line.strip()}")
    p99[mode].append(float(re.search(r"p99=([0-9.]+)ms", line).group(1)))
off, on = statistics.median(p99["off"]), statistics.median(p99["on"])
print(f"median p99: forwarding off {off:.3f} ms, on {on:.3f} ms, ratio {on / off:.2f}x")
'
echo "rsyslog received $(cat "$work/received.log" 2>/dev/null | wc -l) messages"

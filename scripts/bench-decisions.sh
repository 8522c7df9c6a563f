#!/usr/bin/env bash
# The sidecar against cedar-agent 0.2.0 on the same questions over loopback HTTP, and
# against its own /healthz, in interleaved rounds (the issue "decisions at the speed of
# the wire"):
#
#   cargo build --release -p probity-cli --example loadgen -p probity-server
#   CARGO_TARGET_DIR=/tmp/anchors-target cargo install cedar-agent --locked --root /tmp/anchors
#   [PROBITY=BINARY] [LOADGEN=BINARY] [CEDAR_AGENT=BINARY] bash scripts/bench-decisions.sh [ROUNDS=3] [SECONDS=8]
#   [PARSED_REQUEST_BYTES=N] bash scripts/bench-decisions.sh soak [SECONDS=600]
#
# Bodies come from scripts/bench-mix.py (its docstring gives the mix's proportions):
# the realistic mix (admission replicas, agents' comply, readers' read) and questions
# that never repeat (each with a workload of its own), the same questions for both
# servers. cedar-agent gets its policies through its API one by one; the ones its
# Cedar 2 parser refuses are listed (and then missing from its set: it does less work).
# Before measuring, the first 2,000 answers of each body file are compared between the
# two servers (allow or deny).
#
# Each round: loadgen closed loop over 8 connections on probity's /healthz, probity's
# mix, cedar-agent's mix, probity's unique questions, cedar-agent's; then probity's mix
# at a fixed 20,000/s over 8 connections (its p99). Every run is bounded by --duration
# and --requests; every process is stopped by its PID; all on 127.0.0.1.
#
# `soak`: probity alone, new questions each asked twice in a row (so each is stored, and
# the cache fills and evicts) at a fixed 5,000/s for SECONDS, its VmRSS and the decision
# cache's bytes every 30 s (the cache's budget holding memory flat), and the memo of
# parsed bodies' (`[limits] parsed_request_bytes`, PARSED_REQUEST_BYTES; 0 turns it off).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
probity=${PROBITY:-$repo/target/release/probity}
loadgen=${LOADGEN:-$repo/target/release/examples/loadgen}
agent=${CEDAR_AGENT:-/tmp/anchors/bin/cedar-agent}
. "$repo/scripts/bench-lib.sh"
need_built "$probity" "$loadgen"

mode=run
if [ "${1:-}" = soak ]; then
  mode=soak
  shift
fi
rounds=${1:-3}
seconds=${2:-8}
[ "$mode" = soak ] && seconds=${1:-600}

work=$(mktemp -d -p /dev/shm)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# The default policies but one: readers' `read` decisions carry what only a fact
# reporter may say (`verified`), and over plain TCP every caller is `anonymous`, whom
# `api.anonymous-read-only` refuses to let report. That forbid (of the `manage` action,
# which no question of the mix asks) is left out, and `anonymous` made a fact reporter,
# so that both servers answer the same questions over the same transport.
cp -r "$repo/policies" "$work/policies"
python3 - "$work/policies/api/manage.cedar" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
kept = [p for p in re.split(r"\n(?=@id\()", text) if '@id("api.anonymous-read-only")' not in p]
open(path, "w").write("\n".join(kept))
PY
pport=$(free_port)
cat > "$work/probity.toml" <<TOML
[server]
socket = ""
listen = "127.0.0.1:$pport"
insecure = true
[policies]
dir = "$work/policies"
entities = "$repo/testdata/entities/cluster.json"
[limits]
parsed_request_bytes = ${PARSED_REQUEST_BYTES:-8388608}
[auth.groups]
fact-reporters = ["anonymous"]
[log]
level = "warn"
TOML
"$probity" serve --config "$work/probity.toml" > "$work/probity.log" 2>&1 &
ppid=$!
pids+=("$ppid")
wait_port "$pport"

for u in Settings/active GpuModel/A100 GpuModel/H100 GpuModel/H200; do
  curl -sf "http://127.0.0.1:$pport/v1/entities/$u"
  echo
done > "$work/config-entities.jsonl"
blocked=$(curl -sf "http://127.0.0.1:$pport/v1/nodes/blocked" | python3 -c '
import json, sys
print(",".join(sorted(json.load(sys.stdin)["nodes"])))')
python3 "$repo/scripts/bench-mix.py" "$work" 200000 "$blocked"

rss() { awk '/VmRSS/ {print $2 " kB"}' "/proc/$ppid/status"; }
cache_bytes() {
  curl -sf "http://127.0.0.1:$pport/metrics" | awk '/^probity_(decision_cache_(bytes|evictions_total|hits_total|misses_total)|parsed_requests_bytes) / {printf "%s=%s ", $1, $2}'
}

if [ "$mode" = soak ]; then
  echo "soak: new questions, each asked twice, at 5,000/s for ${seconds}s; RSS at start $(rss)"
  "$loadgen" --tcp "127.0.0.1:$pport" --path /v1/decide --bodies "$work/probity-twice.ndjson" \
    --connections 8 --rate 5000 --duration "$seconds" --requests 100000000 --expect '"decision"' &
  lpid=$!
  pids+=("$lpid")
  for t in $(seq 30 30 "$seconds"); do
    sleep 30
    echo "t=${t}s rss=$(rss) $(cache_bytes)"
  done
  wait "$lpid"
  exit 0
fi

aport=$(free_port)
echo '[]' > "$work/empty.json"
"$agent" --addr 127.0.0.1 --port "$aport" --data "$work/agent-data.json" \
  --policies "$work/empty.json" --log-level warn > "$work/agent.log" 2>&1 &
pids+=("$!")
wait_port "$aport"
# Our policies through cedar-agent's API, one by one: which does Cedar 2 refuse?
python3 - "$work/policies" "$aport" <<'PY'
import glob, json, re, sys, urllib.request, urllib.error
repo, port = sys.argv[1], sys.argv[2]
loaded, refused = 0, []
for f in sorted(glob.glob(f"{repo}/**/*.cedar", recursive=True)):
    # One policy per entry: split before each line that starts with its @id.
    for p in re.split(r"\n(?=@id\()", open(f).read()):
        m = re.search(r'^@id\("([^"]+)"\)', p, re.M)
        if not m:
            continue
        body = json.dumps({"id": m.group(1), "content": p.strip()}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/policies", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            urllib.request.urlopen(req).read()
            loaded += 1
        except urllib.error.HTTPError as e:
            refused.append(f"{m.group(1)} ({f.split('/policies/')[-1]}): HTTP {e.code} {e.read()[:200]!r}")
print(f"cedar-agent loaded {loaded} policies; refused {len(refused)}:")
for r in refused:
    print("  " + r)
PY

# The same answer from both, on the first 2,000 questions of each file.
python3 - "$work" "$pport" "$aport" <<'PY'
import json, sys, urllib.request
work, pport, aport = sys.argv[1], sys.argv[2], sys.argv[3]
def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body.encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    return json.loads(urllib.request.urlopen(req).read())
for kind in ["mix", "unique"]:
    p_lines = open(f"{work}/probity-{kind}.ndjson").read().splitlines()[:2000]
    a_lines = open(f"{work}/agent-{kind}.ndjson").read().splitlines()[:2000]
    same = differ = errors = allows = 0
    shown = 0
    for p, a in zip(p_lines, a_lines):
        pd = post(pport, "/v1/decide", p)
        ad = post(aport, "/v1/is_authorized", a)
        if pd.get("errors"):
            errors += 1
        ok = pd["decision"] == "allow"
        allows += ok
        if ok == (ad["decision"] == "Allow"):
            same += 1
        else:
            differ += 1
            if shown < 3:
                shown += 1
                print(f"  differs: {p[:160]} -> probity {pd['decision']} {[r['policy'] for r in pd['reasons']]}, cedar-agent {ad['decision']}")
    print(f"{kind}: {same} same answers, {differ} different, {allows} allows, {errors} probity answers with errors (of {len(p_lines)})")
PY

# run LABEL ARGS...: one loadgen run, its line prefixed.
run() {
  local label=$1
  shift
  echo "$label $("$loadgen" "$@")"
}
for r in $(seq 1 "$rounds"); do
  run "round $r healthz" --tcp "127.0.0.1:$pport" --path /healthz --get \
    --connections 8 --duration "$seconds" --requests 2000000
  run "round $r probity-mix" --tcp "127.0.0.1:$pport" --path /v1/decide \
    --bodies "$work/probity-mix.ndjson" --connections 8 --duration "$seconds" \
    --requests 2000000 --expect '"decision"'
  run "round $r agent-mix" --tcp "127.0.0.1:$aport" --path /v1/is_authorized \
    --bodies "$work/agent-mix.ndjson" --connections 8 --duration "$seconds" \
    --requests 2000000 --expect '"decision"'
  run "round $r probity-unique" --tcp "127.0.0.1:$pport" --path /v1/decide \
    --bodies "$work/probity-unique.ndjson" --connections 8 --duration "$seconds" \
    --requests 200000 --expect '"decision"'
  run "round $r agent-unique" --tcp "127.0.0.1:$aport" --path /v1/is_authorized \
    --bodies "$work/agent-unique.ndjson" --connections 8 --duration "$seconds" \
    --requests 200000 --expect '"decision"'
  run "round $r probity-mix-20k" --tcp "127.0.0.1:$pport" --path /v1/decide \
    --bodies "$work/probity-mix.ndjson" --connections 8 --rate 20000 --duration "$seconds" \
    --requests 2000000 --expect '"decision"'
done
echo "probity: rss $(rss); $(cache_bytes)"

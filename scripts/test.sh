#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, the plugins, every crate's tests, then
# the policy checks and scenarios through the CLI exactly as an operator runs them.
set -euo pipefail
# A one-shot build: incremental caches would only take disk (2.4 GB of it).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
cd "$(dirname "$0")/.."

# The build, its test binaries and the tests' scratch (a Debian root among them) take
# about 9 GB at their peak; a control-plane build on a new machine 5 GB more while it
# runs. Said first, so that a full disk is not mistaken for a failing test.
free_gb=$(df -P --block-size=1G . | awk 'NR == 2 {print $4}')
if [ "${free_gb:-0}" -lt 12 ]; then
  echo "test.sh: warning: ${free_gb} GB free here; the suite needs about 9 GB (14 GB with a first control-plane build)" >&2
fi
bash scripts/setup.sh
# The machine's Go before any other (setup.sh says why).
if [ -x /usr/local/go/bin/go ]; then
  export PATH="/usr/local/go/bin:$PATH"
fi
bash scripts/build-plugins.sh
# The real control plane (kube-apiserver, kube-scheduler, kube-controller-manager, kubectl)
# and helm, built from their Go modules once per machine into a cache outside the
# repository (about 9 minutes the first time); probity-kube's tests run them.
PROBITY_KUBE_BIN="$(bash scripts/build-control-plane.sh)"
export PROBITY_KUBE_BIN
cargo build --workspace --all-targets
cargo test --workspace
# The binary the build above made: `cargo run -p` would resolve other features and
# rebuild the engine.
probity=target/debug/probity
"$probity" check policies
"$probity" test testdata/scenarios-plugins --policies policies \
    --plugins testdata/plugins/manifests/examples.toml
# Last, so that the run closes on the operator-facing summary line: "N passed, N failed".
"$probity" test testdata/scenarios

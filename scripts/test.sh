#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, the plugins, every crate's tests, then
# the policy checks and scenarios through the CLI exactly as an operator runs them.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
bash scripts/build-plugins.sh
cargo build --workspace --all-targets
cargo test --workspace
cargo run -q -p probity-cli -- check policies
cargo run -q -p probity-cli -- test testdata/scenarios-plugins --policies policies \
    --plugins testdata/plugins/manifests/examples.toml
# Last, so that the run closes on the operator-facing summary line: "N passed, N failed".
cargo run -q -p probity-cli -- test testdata/scenarios

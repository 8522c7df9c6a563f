#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, then every crate's tests, then the
# policy scenarios through the CLI exactly as an operator runs them.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
bash scripts/build-plugins.sh
cargo build --workspace --all-targets
cargo run -q -p probity-cli -- check policies
cargo run -q -p probity-cli -- test testdata/scenarios
cargo run -q -p probity-cli -- test testdata/scenarios-plugins --policies policies \
    --plugins testdata/plugins/manifests/examples.toml
cargo test --workspace

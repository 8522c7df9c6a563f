#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, then every crate's tests, then the
# policy scenarios through the CLI exactly as an operator runs them.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
cargo build --workspace --all-targets
cargo run -q -p probity-cli -- check policies
cargo run -q -p probity-cli -- test testdata/scenarios
cargo test --workspace

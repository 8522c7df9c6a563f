#!/usr/bin/env bash
# Runs Probity's main job: the sidecar server on the embedded default policies.
# Extra arguments go to `probity serve` (see `probity serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
exec cargo run --release -q -p probity-cli -- serve "$@"

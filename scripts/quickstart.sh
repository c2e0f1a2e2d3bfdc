#!/usr/bin/env bash
# Set up (if needed), then the CPU quickstart: SFT of a tiny Llama on 2-digit addition, then RL.
# Results: runs/quickstart/sft and runs/quickstart/rl (summary.json in each). Extra arguments go to
# both commands: scripts/quickstart.sh --set seed=3
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
skyrl="${SKYRL_VENV:-$ROOT/.venv}/bin/skyrl"
"$skyrl" sft recipes/quickstart.toml --overwrite "$@"
"$skyrl" rl recipes/quickstart.toml --overwrite "$@"

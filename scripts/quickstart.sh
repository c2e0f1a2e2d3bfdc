#!/usr/bin/env bash
# Set up (if needed), then the CPU quickstart: SFT of a tiny Llama on 3-digit addition, then RL.
# Results: runs/quickstart/sft and runs/quickstart/rl (summary.json in each).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
skyrl="${SKYRL_VENV:-$ROOT/.venv}/bin/skyrl"

run_stage() {  # run_stage STAGE ARGS...: skips a stage whose command has not landed yet
    local stage="$1"; shift
    if ! "$skyrl" "$stage" --help >/dev/null 2>&1; then
        echo "quickstart: 'skyrl $stage' is not available yet; skipped"
        return 0
    fi
    "$skyrl" "$stage" "$@"
}

run_stage sft recipes/quickstart.toml --overwrite
run_stage rl recipes/quickstart.toml --overwrite

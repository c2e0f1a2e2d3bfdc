#!/usr/bin/env bash
# The GPU check: every stage this machine can run (benchmarks/gpu_check.py: DeepSpeed SFT and RL-learner
# steps in bf16, INT4 fake-quant, the Tinker multi-LoRA pass, vLLM engines behind the router with the
# weight sync), one table of figures at the end, a non-zero exit if any stage failed. A stage whose
# dependency is missing is skipped and says why. Under 8 minutes on one GPU; a few on CPU.
#
#   scripts/gpu-check.sh                  run it (extra arguments go to benchmarks/gpu_check.py)
#   scripts/gpu-check.sh --fetch-wheels   on a machine that reaches PyPI: put DeepSpeed (built as a pure-Python
#                                         wheel) and the small packages a bare GPU machine lacks under
#                                         .gpu-check/wheels, to carry there (the machine has no network)
#
# On a machine without DeepSpeed (or pydantic, which the recipe schema needs), the carried wheels are
# installed without the network into .gpu-check/site, which goes first on PYTHONPATH. vLLM does not fit
# in what travels, so its stage runs only where vLLM is installed. PYTHON picks the interpreter
# (default: .venv/bin/python when there is one, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-check/wheels
SITE=.gpu-check/site
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# import name -> the distributions that provide it (with the dependencies a bare machine lacks)
declare -A CARRIED=(
  [deepspeed]="deepspeed hjson einops nvidia_ml_py"
  [pydantic]="pydantic pydantic_core annotated_types typing_inspection"
  [zstandard]="zstandard"
  [torchao]="torchao"
)

fetch_wheels() {
  mkdir -p "$WHEELS"
  "$PY" -m pip wheel --no-deps -w "$WHEELS" "deepspeed==0.19.8"
  "$PY" -m pip download --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" \
    pydantic pydantic-core annotated-types typing-inspection hjson einops nvidia-ml-py zstandard torchao==0.18.0
  du -sh "$WHEELS"
}

install_carried() {
  local module dists wheel dist missing=()
  for module in "${!CARRIED[@]}"; do
    "$PY" -c "import $module" 2>/dev/null && continue
    dists=${CARRIED[$module]}
    for dist in $dists; do
      wheel=$(ls "$WHEELS"/"${dist}"-*.whl 2>/dev/null | head -n1 || true)
      [ -n "$wheel" ] && missing+=("$wheel")
    done
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "gpu-check: installing carried wheels into $SITE: ${missing[*]##*/}"
  "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" "${missing[@]}" \
    || echo "gpu-check: the carried wheels did not install (built for CPython 3.12 x86_64); stages that need them fail"
}

if [ "${1:-}" = "--fetch-wheels" ]; then
  fetch_wheels
  exit 0
fi
if [ -d "$WHEELS" ]; then
  install_carried
fi
export PYTHONPATH="$PWD/$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
if ! command -v nvidia-smi >/dev/null 2>&1; then
  # CPU only: one OpenMP thread per process. On a shared 2-core machine (load ~12) OpenMP's spinning
  # threads made the CPU stages 13x slower (sft-tiny: 39 vs 529 tokens/s).
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
# DeepSpeed's compiled ops where skyrl's trainers cache them (skyrl_cli.plan.machine), built once per machine
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/skyrl/torch_extensions}"
exec "$PY" -m benchmarks.gpu_check "$@"

#!/usr/bin/env bash
# tinker-cookbook 0.5.8, in a virtual environment of its own as a user would install it, runs its
# own supervised-learning loop on its shipped example conversations against `skyrl tinker serve`
# (training only: --no-engines) on a tiny model with a local character tokenizer, and its loss falls.
#
#   scripts/tinker_cookbook_check.sh            # COOKBOOK_VENV=/tmp/cookbook-venv STEPS=16 PORT=18555
# About 5 GB and several minutes the first time (the cookbook pulls its own torch).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
COOKBOOK_VENV="${COOKBOOK_VENV:-/tmp/cookbook-venv}"
STEPS="${STEPS:-16}"
PORT="${PORT:-18555}"
WORK="$(mktemp -d /tmp/tinker-cookbook-check.XXXXXX)"
PY="$REPO/.venv/bin/python"

if [ ! -x "$COOKBOOK_VENV/bin/python" ] || ! "$COOKBOOK_VENV/bin/python" -c "import tinker_cookbook" 2>/dev/null; then
    python3.11 -m venv "$COOKBOOK_VENV"
    "$COOKBOOK_VENV/bin/pip" install -q "tinker-cookbook==0.5.8"
fi

CONV="$("$COOKBOOK_VENV/bin/python" -c 'import tinker_cookbook, pathlib; print(pathlib.Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl")')"
# A tiny Llama whose character tokenizer covers every character of the conversations.
"$PY" - "$CONV" "$WORK/model" <<'PYEOF'
import json, string, sys
sys.path.insert(0, ".")
from backends.models.loading import save_hf
from backends.models.tiny import build_tiny_model
from backends.models.tokenizer import build_char_tokenizer
from skyrl_contracts.schema import TinyModelInit
chars = set(string.printable)
for line in open(sys.argv[1]):
    for m in json.loads(line)["messages"]:
        chars |= set(m["content"])
tok = build_char_tokenizer(sorted(c for c in chars if len(c) == 1))
save_hf(build_tiny_model(TinyModelInit(hidden_size=128, layers=2, heads=4), tok, 0), tok, sys.argv[2])
PYEOF
cat > "$WORK/tinker.toml" <<TOML
name = "cookbook-check"
[model]
path = "$WORK/model"
[tinker]
port = $PORT
api_keys = ["tml-cookbook"]
TOML
cd "$REPO"
.venv/bin/skyrl tinker serve "$WORK/tinker.toml" --no-engines --run-dir "$WORK/run" > "$WORK/serve.log" 2>&1 &
SERVE=$!
trap 'kill -INT $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$PORT/api/v1/healthz" >/dev/null && break
    sleep 1
done
HF_HUB_OFFLINE=1 TINKER_API_KEY=tml-cookbook TINKER_TELEMETRY=0 \
    "$COOKBOOK_VENV/bin/python" "$REPO/scripts/tinker_cookbook_sl.py" "http://127.0.0.1:$PORT" "$WORK/model" "$WORK/cookbook-log" "$STEPS"

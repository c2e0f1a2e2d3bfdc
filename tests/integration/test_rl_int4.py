"""RL with INT4 rollouts on the real stack: the engines serve W4A16 exports (compressed-tensors,
vLLM CPU) of every policy version while the learner trains full-precision master weights under
INT4 fake-quant; ``train/logprob_diff`` stays at the size of the bf16 engine's rounding.

The learning figure (held-out accuracy rises; the gap is smaller with fake-quant on than off)
needs more steps than a test may take: it is ``benchmarks/bench_int4_rl.py`` (RESULTS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.cli_runs import events, run_skyrl
from tests.integration.test_rl import RECIPE as RL_RECIPE
from tests.recipes import merged, write_recipe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# test_rl.py's recipe (2 learner ranks, ZeRO-2) with INT4 rollouts; SFT stays in full precision
RECIPE = merged(RL_RECIPE, name="rlint4", quantization={"group_size": 32, "int4_qat": False, "int4_rollouts": True})


def quantization_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text()).get("quantization_config", {})


def test_rl_with_int4_rollouts_serves_every_version_as_w4a16(tmp_path):
    write_recipe(tmp_path / "recipe.toml", RECIPE)
    # the SFT stage stays full precision (int4_qat = false); the RL learner then trains under
    # fake-quant: the --set is the RL run's own, as a user would flip it for the RL stage
    run_skyrl("sft", "recipe.toml", "--quiet", cwd=tmp_path, timeout=600)
    proc = run_skyrl("rl", "recipe.toml", "--quiet", "--set", "quantization.int4_qat=true", cwd=tmp_path, timeout=600)
    run = tmp_path / "runs/rlint4/rl"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["int4_model"] == str(run / "int4"), proc.stdout[-2000:]

    quantizer_log = (run / "logs/quantizer.log").read_text()
    assert "INT4 PTQ export" in quantizer_log  # the setup job exported the initial policy first
    engine_log = (run / "logs/engine-0.log").read_text()
    assert "compressed-tensors" in engine_log or "compressed_tensors" in engine_log
    assert "INT4 fake-quant (group 32)" in (run / "logs/trainer.log").read_text()

    # the last version the engines served is W4A16, and int4/ is that version
    latest = int((run / "weights/LATEST").read_text())
    assert latest == 3
    for model_dir in (run / f"weights/v{latest}", run / "int4"):
        qcfg = quantization_config(model_dir)
        assert qcfg.get("format") == "pack-quantized", model_dir
    assert not (run / "final" / "config.json").read_text().count("quantization_config")  # final/: master weights

    diffs = [v for _, v in events(run, "train/logprob_diff")]
    assert len(diffs) == 3 and all(0 <= d < 0.05 for d in diffs), diffs

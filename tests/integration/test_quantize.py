"""The INT4 exports (QAT and PTQ) load in a real vLLM engine (CPU, compressed-tensors W4A16) and
their greedy output equals the fake-quant model's in transformers, token for token."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import (
    PATTERN_LOW,
    hf_greedy,
    inference_recipe,
    single_engine,
    train_pattern_policy,
)
from tests.recipes import tiny_recipe, write_recipe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMPTS = [[PATTERN_LOW + i for i in range(start, start + 5)] for start in (0, 7, 20, 30)]
NEW_TOKENS = 40


async def greedy(url: str, prompts, max_tokens: int):
    from backends.rollout.client import RolloutClient

    async with RolloutClient(url, max_retries=0) as client:
        outs = await asyncio.gather(*(client.generate(p, f"q{i}", max_tokens, 0.0) for i, p in enumerate(prompts)))
    return [c.token_ids for (c,) in outs]


def fake_quant_copy(model_dir, cfg):
    """The model of ``model_dir`` under INT4 fake-quant: what the export must reproduce."""
    import torch
    from transformers import AutoModelForCausalLM

    from backends.quant.fake_quant import prepare_qat

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prepare_qat(model, cfg)
    return model.eval()


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_model_dir):
    """``{"qat-32": (fake-quant model, int4 dir), "ptq-channel": ...}`` (method and group
    size): QAT trains the pattern under fake-quant; PTQ rounds the pattern trained in full precision."""
    import torch
    from transformers import AutoModelForCausalLM

    from backends.models.loading import load_hf, save_hf
    from backends.quant.export import export_rtn
    from backends.quant.fake_quant import prepare_qat
    from skyrl_contracts.schema import QuantizationConfig

    cfg = QuantizationConfig(int4_qat=True, group_size=32)
    root = tmp_path_factory.mktemp("int4")
    _, tokenizer = load_hf(tiny_model_dir)
    qat = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prepare_qat(qat, cfg)
    save_hf(train_pattern_policy(qat), tokenizer, root / "qat-final")
    full = train_pattern_policy(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    save_hf(full, tokenizer, root / "full")
    found = {}
    for name, src, group in (("qat-32", root / "qat-final", 32), ("ptq-channel", root / "full", "channel")):
        group_cfg = cfg.model_copy(update={"group_size": group})
        export_rtn(src, root / f"{name}-int4", group_cfg)
        found[name] = (fake_quant_copy(src, group_cfg), root / f"{name}-int4")
    return found


# QAT and PTQ go through the same export (export_rtn) and differ only in the weights rounded, so
# the engine serves QAT per group of 32 and PTQ per channel: both origins, both of vLLM's
# strategies (a group size is a number within one of them).
@pytest.mark.parametrize("export", ["qat-32", "ptq-channel"])
def test_vllm_serves_the_int4_export_with_the_fake_quant_greedy_output(exports, export, tmp_path):
    model, int4_dir = exports[export]
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    recipe = inference_recipe(engines=1)
    with single_engine(recipe, int4_dir, tmp_path) as url:
        served = asyncio.run(greedy(url, PROMPTS, NEW_TOKENS))
    assert served == expected
    # The pattern (next = previous + 1, cyclic) survives the quantization: the check means something.
    continues = [p[-1] + 1 - PATTERN_LOW for p in PROMPTS]
    assert sum(out[0] == PATTERN_LOW + c % 36 for out, c in zip(served, continues)) >= 3


PIPELINE_RECIPE = tiny_recipe(
    name="qpipe",
    seed=None,
    model={"init": {"intermediate_size": 256}},
    data={"train_size": 2000, "eval_size": 40},
    sft={"steps": 8, "batch_size": 32, "warmup_steps": 2, "eval_every": 0, "save_every": 4},
    trainer={"zero_stage": 3},
    quantization={"group_size": 32},
)


def test_skyrl_quantize_ptq_and_qat_under_zero3_from_the_sft_output(tmp_path):
    """The commands as a user runs them: `skyrl sft`, then `skyrl quantize --ptq` and `--int4-qat`
    (two ranks, ZeRO-3: the fake-quantized layers are partitioned and gathered like any other)."""
    import json

    import torch

    from backends.quant.export import export_rtn
    from skyrl_contracts.schema import QuantizationConfig
    from tests.integration.cli_runs import run_skyrl
    from tests.unit.test_quant import read_export

    recipe = tmp_path / "q.toml"
    write_recipe(recipe, PIPELINE_RECIPE)
    run_skyrl("sft", recipe, "--quiet", cwd=tmp_path)
    ptq = run_skyrl("quantize", recipe, "--ptq", "--quiet", cwd=tmp_path)
    assert "quantize done (INT4 PTQ): 14 INT4 layers" in ptq.stdout
    qat_dir = tmp_path / "qat"
    qat = run_skyrl("quantize", recipe, "--int4-qat", "--quiet", "--run-dir", qat_dir, cwd=tmp_path)
    assert "quantize done (INT4 QAT): held-out accuracy" in qat.stdout
    assert "INT4 fake-quant (group 32) on 14 Linear layers" in (qat_dir / "logs" / "trainer.log").read_text()
    summary = json.loads((qat_dir / "summary.json").read_text())
    assert summary["method"] == "qat" and summary["completed"] and summary["steps"] == 8
    assert 0 < summary["metrics"]["quant/size_ratio"] < 0.35
    # The export holds the codes of the trained master weights (those the fake-quant forward used).
    export_rtn(qat_dir / "final", tmp_path / "again", QuantizationConfig(group_size=32))
    exported, again = read_export(qat_dir / "int4"), read_export(tmp_path / "again")
    assert all(torch.equal(exported[n][0], again[n][0]) and torch.equal(exported[n][1], again[n][1]) for n in again)
    before = read_export(tmp_path / "runs" / "qpipe" / "quantize" / "int4")  # PTQ of the SFT output
    assert any(not torch.equal(before[n][0], exported[n][0]) for n in before)  # QAT trained them

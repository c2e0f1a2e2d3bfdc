"""Engine features on one real engine each: runtime LoRA adapter sync (speculative decoding:
tests/integration/test_speculative.py)."""

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

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# Runs of the cyclic pattern the trained policies continue (next id = previous + 1).
PATTERN_PROMPTS = [[PATTERN_LOW + i for i in range(start, start + 5)] for start in (0, 7, 20, 30)]


async def greedy(url: str, prompts, max_tokens: int, model: str = "policy"):
    from backends.rollout.client import RolloutClient

    async with RolloutClient(url, max_retries=0, model=model) as client:
        outs = await asyncio.gather(*(client.generate(p, f"g{i}", max_tokens, 0.0) for i, p in enumerate(prompts)))
    return [c for (c,) in outs]


def test_lora_adapter_reaches_the_engine(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from backends.inference.weight_sync import engine_weight_version, run_blocking, sync_lora_adapter
    from backends.models.lora import apply_lora, save_adapter
    from skyrl_contracts.schema import LoraConfig

    lora = LoraConfig(
        rank=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = train_pattern_policy(apply_lora(base, lora), steps=200, lr=1e-2)
    adapter_dir = save_adapter(peft_model, tmp_path / "adapter-1")
    expected = [hf_greedy(peft_model, p, 24) for p in PATTERN_PROMPTS]

    recipe = inference_recipe(engines=1, model={"lora": lora.model_dump()})
    with single_engine(recipe, tiny_model_dir, tmp_path) as url:
        plain_before = asyncio.run(greedy(url, PATTERN_PROMPTS, 24, model="policy"))
        run_blocking(sync_lora_adapter([url], "policy-lora", adapter_dir, 1))
        adapted = asyncio.run(greedy(url, PATTERN_PROMPTS, 24, model="policy-lora"))
        plain_after = asyncio.run(greedy(url, PATTERN_PROMPTS, 24, model="policy"))
        version = asyncio.run(engine_weight_version(url))
    assert [c.token_ids for c in adapted] == expected
    assert [c.token_ids for c in adapted] != [c.token_ids for c in plain_before]
    assert all(c.policy_versions == (1,) for c in adapted) and version == "1"
    # The base model is untouched: requests for "policy" still get the base weights.
    assert [c.token_ids for c in plain_after] == [c.token_ids for c in plain_before]

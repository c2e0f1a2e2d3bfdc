"""Engine features on one real engine each: speculative decoding (n-gram) with its metrics, and
runtime LoRA adapter sync."""

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


def test_ngram_speculative_decoding_is_lossless_and_reports_acceptance(tiny_model_dir, pattern_policy, tmp_path):
    from backends.inference.weight_sync import run_blocking, sync_weights
    from skyrl_cli.engines.metrics import MetricsScraper
    from skyrl_contracts.events import EventWriter, last_values, read_events

    model, weights = pattern_policy.model, pattern_policy.weights_dir
    recipe = inference_recipe(
        engines=1, speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    with single_engine(recipe, tiny_model_dir, tmp_path) as url:
        run_blocking(sync_weights([url], weights, 1))
        writer = EventWriter(tmp_path / "events.jsonl", "metrics")
        scraper = MetricsScraper([url], writer)
        scraper.scrape_once()  # baseline counters
        completions = asyncio.run(greedy(url, PATTERN_PROMPTS, 80))
        events = scraper.scrape_once()
        writer.log(1, events)
    for prompt, completion in zip(PATTERN_PROMPTS, completions):
        assert completion.token_ids == hf_greedy(model, prompt, 80)
    # The pattern repeats every 36 tokens, so n-gram lookup proposes the right continuation.
    print({k: round(v, 3) for k, v in events.items() if k.startswith("spec/")})
    assert events["spec/acceptance_rate"] > 0.5
    assert events["spec/mean_accepted_length"] > 2.0
    logged = last_values(read_events(tmp_path / "events.jsonl")[0])
    assert logged["spec/acceptance_rate"] == pytest.approx(events["spec/acceptance_rate"])
    assert logged["engine/gen_tokens_per_s"] > 0


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

"""LoRA in the RL stage on real engines.

- adapter sync: the versioned adapters the learner publishes (v0: peft's initial adapter, equal to
  the base model; v1: a trained one) load into a running engine with no pause, and its greedy
  completions equal transformers + peft with the same adapter, token for token; each completion's
  tokens carry the version of the adapter the request named; an unloaded version is no longer served;
- resume: a LoRA run on a tied model stopped after its step-2 checkpoint continues from it, and the
  engines are put on the resumed adapter (policy-v2, the checkpoint's) before generating again;
  trainer and engine logprobs agree to numerics throughout.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.integration.cli_runs import events, run_skyrl
from tests.integration.conftest import PATTERN_LOW, hf_greedy, inference_recipe, single_engine, train_pattern_policy
from tests.recipes import RL, SFT, SMALL, tiny_recipe, write_recipe

pytestmark = pytest.mark.integration

PROMPTS = [[PATTERN_LOW + i for i in range(start, start + 5)] for start in (0, 7, 20, 30)]
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


async def greedy(url: str, prompts, max_tokens: int, model: str):
    from backends.rollout.client import RolloutClient

    async with RolloutClient(url, max_retries=0, model=model) as client:
        outs = await asyncio.gather(*(client.generate(p, f"g{i}", max_tokens, 0.0) for i, p in enumerate(prompts)))
    return [c for (c,) in outs]


def test_adapter_versions_sync_and_match_transformers_peft(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from backends.inference.weight_sync import EngineAdapters, adapter_name, run_blocking
    from backends.models.lora import apply_lora, save_adapter
    from backends.rollout.client import RolloutError
    from skyrl_contracts.schema import LoraConfig

    lora = LoraConfig(rank=8, target_modules=ALL_LINEAR)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    base_greedy = [hf_greedy(base, p, 24) for p in PROMPTS]
    peft_model = apply_lora(base, lora)
    v0 = save_adapter(peft_model, tmp_path / "weights/v0")  # as the learner publishes it: B = 0
    peft_model = train_pattern_policy(peft_model, steps=200, lr=1e-2)
    v1 = save_adapter(peft_model, tmp_path / "weights/v1")
    expected = [hf_greedy(peft_model, p, 24) for p in PROMPTS]
    assert expected != base_greedy

    recipe = inference_recipe(engines=1, model={"lora": lora.model_dump()})
    with single_engine(recipe, tiny_model_dir, tmp_path) as url:
        plain = asyncio.run(greedy(url, PROMPTS, 24, "policy"))
        engines = EngineAdapters([url], tmp_path)
        run_blocking(engines.load(0, v0))
        at_v0 = asyncio.run(greedy(url, PROMPTS, 24, adapter_name(0)))
        run_blocking(engines.load(1, v1))
        at_v1 = asyncio.run(greedy(url, PROMPTS, 24, adapter_name(1)))
        again_v0 = asyncio.run(greedy(url, PROMPTS, 24, adapter_name(0)))  # both live: each request its own
        assert run_blocking(engines.retire({})) == [0]
        with pytest.raises(RolloutError, match="404|not exist|not found"):
            asyncio.run(greedy(url, PROMPTS[:1], 4, adapter_name(0)))
    assert [c.token_ids for c in at_v1] == expected
    # v0 (B = 0) is the base model. Compared with the engine's own base output: the random-init base
    # is nearly uniform, and bf16 engine vs fp32 transformers may break its near-ties differently.
    assert [c.token_ids for c in at_v0] == [c.token_ids for c in plain]
    assert [c.token_ids for c in again_v0] == [c.token_ids for c in at_v0]
    # The version of every token is the adapter's, though the engine's label says 1 since the load.
    assert all(c.policy_versions == (1,) for c in at_v1) and all(c.policy_versions == (0,) for c in again_v0)


RECIPE = tiny_recipe(
    SMALL,
    SFT,
    RL,
    name="rllora",
    model={
        # tied: LoRA adapters leave the embeddings and the head alone, and the base weights never reload
        "init": {"tie_embeddings": True},
        "lora": {"rank": 8, "alpha": 16, "target_modules": list(ALL_LINEAR)},
    },
    data={"eval_size": 16},
    rl={"init_from": "sft", "steps": 3, "learning_rate": 1e-3, "save_every": 1, "kl": {"coef": 0.01}},
)


def test_lora_run_resumes_onto_the_checkpoint_adapter(tmp_path):
    write_recipe(tmp_path / "recipe.toml", RECIPE)
    run = tmp_path / "runs/rllora/rl"
    run_skyrl("rl", "recipe.toml", "--run-dir", run, "--set", "rl.steps=2", "--quiet", cwd=tmp_path, timeout=900)
    first_engine_log = (run / "logs/engine-0.log").read_text()
    run_skyrl("rl", "recipe.toml", "--run-dir", run, "--resume", "--quiet", cwd=tmp_path, timeout=900)
    assert "at step 2" in (run / "logs/trainer.log").read_text().split("resumed from")[-1].splitlines()[0]
    # v0 (the initial adapter), 1, 2; after the resume first the checkpoint's adapter, then the next.
    assert [int(v) for _, v in events(run, "weights/version")] == [0, 1, 2, 2, 3]
    engine_log = (run / "logs/engine-0.log").read_text().removeprefix(first_engine_log)
    loaded = [
        line.split("name '")[1].split("'")[0] for line in engine_log.splitlines() if "Loaded new LoRA adapter" in line
    ]
    assert loaded[:2] == ["policy-v2", "policy-v3"], loaded
    assert json.loads((run / "weights/current.json").read_text())["lora_name"] == "policy-v3"
    # The engines sampled from the adapter the learner holds (a stale or missing one shows here).
    diffs = [v for _, v in events(run, "train/logprob_diff")]
    floor = events(run, "health/sync_gap_bound")[0][1]  # the engines' dtype's numerics, logged at start
    assert diffs and max(diffs) < floor, diffs
    assert not (run / "engine-model").exists()  # LoRA engines serve the base model itself
    assert [s for s, _ in events(run, "train/kl_ref")] == [1, 2, 3]  # the reference: the adapter disabled
    # final/: the adapter (no merged model unless model.lora.merge_final).
    assert (run / "final/adapter/adapter_model.safetensors").exists() and not (run / "final/config.json").exists()
    assert {p.name for p in (run / "weights").glob("v*")} <= {"v2", "v3"}

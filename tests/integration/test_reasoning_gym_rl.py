"""A reasoning-gym task on the real stack (vLLM engine + vllm-router + orchestrator + DeepSpeed
learner): the learner's batch holds the dataset's questions, the policy's sampled tokens under a
full loss mask, and rewards that are reasoning-gym's own ``score_answer`` on the ``<answer>`` tags.

The policy is a short SFT run on tagged demonstrations: it writes ``<answer>...</answer>``, so the
extraction and the scorer both act; 1-digit sums keep some of its answers right.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.cli_runs import events, run_skyrl
from tests.recipes import RL, SFT, SMALL, tiny_recipe, write_recipe

pytestmark = pytest.mark.integration

CONFIG = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ["+"],
    "allow_parentheses": False,
    "allow_negation": False,
}
RECIPE = tiny_recipe(
    SMALL,
    SFT,
    RL,
    name="rgtest",
    seed=2,
    data={"task": "reasoning_gym:basic_arithmetic", "digits": None, "train_size": 2000, "eval_size": 8},
    sft={"steps": 120, "warmup_steps": 10},
    rl={
        "init_from": "sft",
        "steps": 1,
        "prompts_per_step": 8,
        "samples_per_prompt": 4,
        "max_new_tokens": 20,
        "keep_batches": True,
    },
    trainer={"ranks": 1, "zero_stage": 0},
)
RECIPE["data"]["reasoning_gym"] = {"config": CONFIG}


def test_rl_batch_is_scored_by_reasoning_gym(tmp_path):
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    from backends.models.tokenizer import load_tokenizer

    write_recipe(tmp_path / "recipe.toml", RECIPE)
    run_skyrl("sft", "recipe.toml", "--quiet", cwd=tmp_path, timeout=900)
    run = tmp_path / "runs/rgtest/rl"
    run_skyrl("rl", "recipe.toml", "--run-dir", run, "--quiet", cwd=tmp_path, timeout=900)

    tokenizer = load_tokenizer(str(run / "engine-model"))
    samples = json.loads((run / "batches/step-0.json").read_text())["samples"]
    assert len(samples) == 8 * 4
    scorer = reasoning_gym.create_dataset("basic_arithmetic", **CONFIG, seed=0, size=1)
    tagged = 0
    for s in samples:
        prompt = tokenizer.decode(s["prompt_ids"], skip_special_tokens=False)
        question = prompt.split("<|user|>")[1].removesuffix("<|assistant|>")
        assert question.startswith("Calculate ") and question.endswith("."), prompt
        # the question's own sum is the answer reasoning-gym's entry holds
        expected = str(eval(question.removeprefix("Calculate ").removesuffix(".")))  # noqa: S307
        response = tokenizer.decode(s["response_ids"], skip_special_tokens=True)
        answer = extract_answer(response)
        tagged += answer is not None
        entry = {"question": question, "answer": expected, "metadata": {}}
        want = 0.0 if answer is None else scorer.score_answer(answer, entry)
        assert s["reward"] == pytest.approx(want), (question, response, s["reward"])
        assert s["loss_mask"] == [1] * len(s["response_ids"])  # one turn: every sampled token trains
        assert len(s["rollout_logprobs"]) == len(s["response_ids"]) and all(lp <= 0 for lp in s["rollout_logprobs"])
    assert tagged >= len(samples) // 2, "the SFT policy writes reasoning-gym's answer tags"
    assert any(s["reward"] == 1.0 for s in samples), "some answers are right"
    assert [v for _, v in events(run, "rollout/errors")] == [0.0]

"""A verifiers environment trained on the real stack (vLLM engine + router + orchestrator + one
learner rank): ``rl.environment = "verifiers:vf_echo"`` (tests/fixtures/vf_echo.py, a taskset
whose rubric rewards saying a word back), rolled out by verifiers' chat harness against the
orchestrator's endpoint. The learner's batch holds exactly the sampled tokens, each trajectory's
reward is what the rubric says of them, and nothing failed.

The policy is the random tiny model: what is tested is the path, not learning.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.integration.cli_runs import events, run_skyrl
from tests.recipes import RL, tiny_recipe, write_recipe

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
WORDS = ("cat", "dog", "sun", "pen")


def recipe(model_dir: Path) -> dict:
    return tiny_recipe(
        RL,
        name="vftest",
        data={"task": None, "digits": None, "train": "train.jsonl", "eval_size": 2},
        rl={
            "init_from": str(model_dir),
            "environment": "verifiers:vf_echo",
            "env_args": {"agent": {"harness": {"id": "null"}}},  # verifiers' chat loop, on this host
            "steps": 1,
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "max_new_tokens": 6,
            "keep_batches": True,
        },
        trainer={"ranks": 1},  # one learner rank: what is tested is the orchestrator's side
    )


def test_a_verifiers_env_trains_on_its_rollouts_and_rubric(tmp_path, tiny_model_dir):
    shutil.copy(FIXTURES / "vf_echo.py", tmp_path / "vf_echo.py")  # next to the recipe, as a user's
    rows = [{"prompt": f"say {w}", "answer": w} for w in WORDS * 2]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = write_recipe(tmp_path / "recipe.toml", recipe(tiny_model_dir))
    run = tmp_path / "run"
    run_skyrl("rl", path, "--run-dir", run, "--quiet", cwd=tmp_path, timeout=900)

    from backends.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(run / "engine-model"))
    samples = json.loads((run / "batches/step-0.json").read_text())["samples"]
    assert len({(s["prompt_uid"], s["index"]) for s in samples}) == len(samples) == 4  # one call each
    for s in samples:
        assert not s["error"] and s["num_turns"] == 1
        prompt = tokenizer.decode(s["prompt_ids"], skip_special_tokens=False)
        word = next(w for w in WORDS if f"say {w}" in prompt)
        assert s["loss_mask"] == [1] * len(s["response_ids"]) and s["response_ids"]
        assert all(lp <= 0 for lp in s["rollout_logprobs"]) and any(lp < 0 for lp in s["rollout_logprobs"])
        said = tokenizer.decode(s["response_ids"], skip_special_tokens=True)
        assert s["reward"] == float(said.strip() == word), (said, word, s["reward"])  # the rubric's verdict
    rubric = [v for _, v in events(run, "rollout/env/correct")]  # the rubric's reward, as a step metric
    assert rubric == [pytest.approx(sum(s["reward"] for s in samples) / 4)]
    assert len(events(run, "rollout/env/reply_chars")) == 1  # and its metric
    assert [v for _, v in events(run, "rollout/errors")] == [0.0]
    assert [v for _, v in events(run, "rollout/agent_calls_mean")] == [1.0]
    errors = run / "sample_errors.jsonl"
    assert not errors.exists() or not errors.read_text().strip(), errors.read_text()

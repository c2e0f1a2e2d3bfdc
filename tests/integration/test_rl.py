"""The RL stage end to end on the real stack: vLLM engine(s) + vllm-router + orchestrator + a
2-rank DeepSpeed learner on the tiny model.

- unified SFT + RL: ``skyrl rl --async`` on a recipe whose SFT output does not exist runs SFT first;
  no sample is trained beyond the staleness bound; engine and trainer logprobs agree;
- ``--resume``: a run stopped after its step-2 checkpoint continues from it, and the engines are put
  on the resumed weights before generating again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.cli_runs import events, run_skyrl
from tests.recipes import RL, SFT, SMALL, tiny_recipe, write_recipe

pytestmark = pytest.mark.integration


RECIPE = tiny_recipe(
    SMALL,
    SFT,
    RL,
    name="rltest",
    # tied like most small real models: the engines must serve the head the learner trains
    model={"init": {"tie_embeddings": True}},
    data={"eval_size": 16},
    rl={"init_from": "sft", "steps": 3, "save_every": 1, "async": {"max_staleness": 1}},
)


def skyrl(cwd: Path, *args):
    return run_skyrl(*args, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rl")
    write_recipe(root / "recipe.toml", RECIPE)
    return root


def test_async_rl_runs_sft_first_and_respects_the_staleness_bound(workdir):
    proc = skyrl(workdir, "rl", "recipe.toml", "--async", "--quiet")
    assert "running the recipe's SFT stage first" in proc.stderr
    assert (workdir / "runs/rltest/sft/final/config.json").exists()
    run = workdir / "runs/rltest/rl"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["async"] is True
    assert {"eval_accuracy_initial", "eval_accuracy_final"} <= set(summary)
    assert [s for s, _ in events(run, "train/policy_loss")] == [1, 2, 3]
    staleness = [v for _, v in events(run, "async/staleness_max", "trainer")]
    assert staleness and max(staleness) <= 1
    # The health check of the pipeline: on a batch sampled from the weights the trainer holds
    # (staleness 0; step 1's always is) engine and trainer logprobs agree to numerics, the bound of
    # the engines' dtype (skyrl_contracts.health), also after syncs of a tied model. A stale batch
    # differs by the policy's own change over the versions in between (what the off-policy
    # correction is for), and which steps are stale depends on how start-ups and steps interleave.
    on_policy = {step for step, value in events(run, "async/staleness_max", "trainer") if value == 0}
    diffs = {step: v for step, v in events(run, "train/logprob_diff") if step in on_policy}
    bound = events(run, "health/sync_gap_bound")[0][1]  # the floor of the engines' dtype, logged at start
    assert 1 in diffs and max(diffs.values()) < bound, diffs
    assert "health" not in summary
    assert json.loads((run / "engine-model/config.json").read_text())["tie_word_embeddings"] is False
    assert (run / "final/config.json").exists()
    assert "rl done: held-out accuracy" in proc.stdout


def test_resume_continues_from_the_checkpoint_on_the_engines(workdir):
    run = workdir / "runs/rltest/rl-resume"
    skyrl(workdir, "rl", "recipe.toml", "--run-dir", run, "--set", "rl.steps=2", "--quiet")
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-1", "step-2"]
    skyrl(workdir, "rl", "recipe.toml", "--run-dir", run, "--resume", "--quiet")
    trainer_log = (run / "logs/trainer.log").read_text()
    assert "at step 2" in trainer_log.split("resumed from")[-1].splitlines()[0]
    # The first run loaded versions 1 and 2; after the resume, the first thing the engines get is
    # the checkpoint's policy (version 2), then the next one.
    versions = [int(v) for _, v in events(run, "weights/version")]
    assert versions == [1, 2, 2, 3], versions
    steps = [s for s, _ in events(run, "train/policy_loss")]
    assert steps == [1, 2, 3]
    # sync steps are all on-policy: after each reload (of a tied model) the engines serve the
    # learner's weights to numerics
    bound = events(run, "health/sync_gap_bound")[0][1]
    assert max(v for _, v in events(run, "train/logprob_diff")) < bound


TWO_TURN_ENV = '''
from backends.rollout.environments import Environment, StepResult


class TwoTurns(Environment):
    """Ask, then ask again with an observation; reward 1 when both answers agree."""

    def reset(self, row):
        self.answers = []
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, response):
        self.answers.append(response)
        if len(self.answers) == 1:
            return StepResult(observation=[{"role": "user", "content": "="}], reward=0.0, done=False)
        return StepResult(reward=float(self.answers[0] == self.answers[1]), done=True)
'''


def test_custom_multi_turn_environment(workdir):
    (workdir / "two_turn_env.py").write_text(TWO_TURN_ENV)
    run = workdir / "runs/rltest/rl-env"
    skyrl(
        workdir,
        "rl",
        "recipe.toml",
        "--run-dir",
        run,
        "--quiet",
        "--set",
        "rl.environment=two_turn_env:TwoTurns",
        "--set",
        "rl.max_turns=2",
        "--set",
        "rl.steps=1",
    )
    assert [v for _, v in events(run, "rollout/turns_mean")] == [2.0]
    assert [v for _, v in events(run, "rollout/errors")] == [0.0]
    assert [s for s, _ in events(run, "train/policy_loss")] == [1]

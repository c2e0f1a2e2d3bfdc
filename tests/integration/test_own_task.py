"""The built-in `own_task` recipe, the "your own task" example, end to end: its JSONL files and its
reward module next to the recipe, run from another directory (paths and the module are found
relative to the recipe, not to where skyrl runs). SFT, then RL for 3 steps scored by
recipes/own_task/reward.py."""

from __future__ import annotations

import json

import pytest

from tests.integration.cli_runs import REPO, events, run_skyrl

pytestmark = pytest.mark.integration

RECIPE = REPO / "recipes" / "own_task.toml"
SMALL = ("--set", "data.eval_size=32", "--set", "model.init={hidden_size=64,layers=2,heads=2,intermediate_size=128}")


def test_own_task_sft_then_rl_with_the_users_reward(tmp_path):
    sft = run_skyrl(
        "sft",
        RECIPE,
        *SMALL,
        "--set",
        "sft.steps=20",
        "--set",
        "sft.eval_every=0",
        "--set",
        "sft.save_every=0",
        "--quiet",
        cwd=tmp_path,
        timeout=600,
    )
    assert "sft done:" in sft.stdout
    assert json.loads((tmp_path / "runs/own_task/sft/summary.json").read_text())["completed"] is True

    rl = run_skyrl(
        "rl", RECIPE, *SMALL, "--set", "rl.steps=3", "--set", "rl.eval_every=0", "--quiet", cwd=tmp_path, timeout=600
    )
    assert "rl done:" in rl.stdout
    run = tmp_path / "runs/own_task/rl"
    assert json.loads((run / "summary.json").read_text())["completed"] is True
    log = (run / "logs/orchestrator.log").read_text()
    assert f"user code: own_task.reward:score from {REPO / 'recipes/own_task/reward.py'}" in log
    assert [s for s, _ in events(run, "train/policy_loss")] == [1, 2, 3]
    rewards = events(run, "rollout/reward_mean")
    assert len(rewards) >= 3 and all(0.0 <= v <= 1.0 for _, v in rewards)
    assert [v for _, v in events(run, "rollout/errors")][-1] == 0  # every call of score() returned a number
    assert (run / "final/config.json").exists()

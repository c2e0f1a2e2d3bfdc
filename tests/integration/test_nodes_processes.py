"""The sbatch script of a two-node RL layout, checked by bash (``bash -n``) as well as read."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from skyrl_cli.plan.nodes import cluster_layout
from skyrl_cli.plan.slurm import sbatch_script
from tests.unit.test_nodes import check_sbatch_syntax, recipe, srun_command

pytestmark = pytest.mark.integration


def test_sbatch_script_for_a_two_node_rl_layout(tmp_path):
    r = recipe(
        {
            "nodes": 2,
            "trainer_nodes": 1,
            "inference_nodes": 1,
            "address": None,
            "slurm": {"partition": "gpu", "account": "proj", "time": "04:00:00", "setup": ["source /env/bin/activate"]},
        },
        trainer={"ranks": 4, "device": "cuda"},
        engines=4,
    )
    script = sbatch_script(
        r,
        "rl",
        cluster_layout(r),
        recipe_path=Path("/shared/recipes/my recipe.toml"),
        run_dir=Path("/shared/runs/mn/rl"),
        sets=["rl.steps=10"],
        async_mode=True,
        workdir=Path("/shared"),
        executable="/shared/.venv/bin/skyrl",
    )
    options = check_sbatch_syntax(script)
    assert options == {
        "job-name": "skyrl-mn-rl",
        "nodes": "2",
        "ntasks-per-node": "1",
        "gpus-per-node": "4",
        "partition": "gpu",
        "account": "proj",
        "time": "04:00:00",
        "output": "/shared/runs/mn/rl/logs/slurm-%j.log",
    }
    words = srun_command(script)
    assert "--nodes=2" in words and "--output=/shared/runs/mn/rl/logs/slurm-%j-node%n.log" in words
    assert words[-3:-1] == ["bash", "-c"]
    node = shlex.split(words[-1])
    assert node == [
        "/shared/.venv/bin/skyrl",
        "rl",
        "/shared/recipes/my recipe.toml",
        "--run-dir",
        "/shared/runs/mn/rl",
        "--set",
        "rl.steps=10",
        "--async",
        "--quiet",
        "--node-rank",
        "$SLURM_NODEID",  # expanded inside each task, not by the batch step
    ]
    assert "source /env/bin/activate" in script
    assert 'SKYRL_CLUSTER_ADDRESS="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in script

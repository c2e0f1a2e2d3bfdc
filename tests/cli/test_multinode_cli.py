"""`skyrl sft|rl` across nodes from the command line: --dry-run per node, --node-rank and Slurm's
SLURM_NODEID, --slurm (the sbatch script for a built-in recipe with a 2-node layout), and the
one-line refusals (a node with another recipe, a missing node 0 address, --node-rank without a layout)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.unit.test_nodes import check_sbatch_syntax, srun_command

from .conftest import REPO, SKYRL
from .test_recipes_cli import fetched_assets  # noqa: F401 (fixture)

RECIPE = """
name = "mncli"
[model]
init = { hidden_size = 64, layers = 2, heads = 2, intermediate_size = 128 }
tokenizer = "char"
[data]
task = "addition"
digits = 2
[sft]
steps = 5
batch_size = 32
[rl]
init_from = "sft"
prompts_per_step = 4
samples_per_prompt = 4
[inference]
engines = 2
[trainer]
ranks = 1
[cluster]
nodes = 3
trainer_nodes = 2
inference_nodes = 1
address = "127.0.0.1"
arrival_timeout_s = 20
"""


@pytest.fixture
def recipe_file(tmp_path):
    path = tmp_path / "mn.toml"
    path.write_text(RECIPE)
    return path


def test_dry_run_prints_what_every_node_runs(skyrl, recipe_file, tmp_path):
    result = skyrl("rl", recipe_file, "--dry-run", "--run-dir", tmp_path / "run")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["layout"]["nodes"] == 3
    per_node = {n["node"]: [p["name"] for p in n["processes"]] for n in data["nodes"]}
    assert per_node == {
        0: ["engine-model", "router", "orchestrator", "trainer"],
        1: ["trainer"],
        2: ["engine-0", "engine-1"],
    }
    assert data["nodes"][0]["engine_urls"] == ["http://<node-2-engine-0>", "http://<node-2-engine-1>"]
    trainer1 = data["nodes"][1]["processes"][0]["argv"]
    assert trainer1[trainer1.index("--node-rank") + 1] == "1"
    assert trainer1[trainer1.index("--rdzv-endpoint") + 1] == "127.0.0.1:29500"
    sft = json.loads(skyrl("sft", recipe_file, "--dry-run").out)
    assert [n["node"] for n in sft["nodes"]] == [0, 1]  # the inference-only node takes no part in SFT


def test_node_rank_from_the_flag_or_slurm(skyrl, recipe_file, monkeypatch):
    assert [n["node"] for n in json.loads(skyrl("rl", recipe_file, "--dry-run", "--node-rank", "2").out)["nodes"]] == [
        2
    ]
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert [n["node"] for n in json.loads(skyrl("rl", recipe_file, "--dry-run").out)["nodes"]] == [1]
    bad = skyrl("rl", recipe_file, "--dry-run", "--node-rank", "3")
    assert (bad.code, bad.err) == (2, "error: --node-rank = 3: the layout has nodes 0..2 (cluster.nodes = 3)\n")


def test_one_line_errors(skyrl, recipe_file, tmp_path):
    single = tmp_path / "single.toml"
    single.write_text(RECIPE.split("[cluster]")[0])
    result = skyrl("sft", single, "--node-rank", "1", "--dry-run")
    assert (result.code, result.err) == (
        2,
        "error: --node-rank 1: the recipe runs on one machine (it has no [cluster])\n",
    )
    result = skyrl("sft", recipe_file, "--set", "cluster.address=", "--run-dir", tmp_path / "r")
    assert result.code == 2 and result.err.startswith("error: cluster.address: set node 0's address")
    assert len(result.err.splitlines()) == 1
    result = skyrl("sft", recipe_file, "--set", "trainer.nnodes=2", "--set", "trainer.rdzv_endpoint='h:1'")
    assert result.code == 2 and "trainer.nnodes is derived from [cluster]" in result.err


def test_a_node_started_with_another_recipe_is_refused_at_the_rendezvous(recipe_file, tmp_path):
    run = tmp_path / "run"
    common = [str(SKYRL), "sft", str(recipe_file), "--run-dir", str(run), "--quiet"]
    node0 = subprocess.Popen([*common, "--node-rank", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node1 = subprocess.run(
        [*common, "--node-rank", "1", "--set", "sft.steps=6"], capture_output=True, text=True, timeout=60
    )
    out0, err0 = node0.communicate(timeout=60)
    expected = "were started with different recipes"
    assert node1.returncode == 2 and expected in node1.stderr, node1.stderr
    assert node0.returncode == 2 and expected in err0, err0
    assert len([line for line in err0.splitlines() if line.startswith("error:")]) == 1
    assert not (run / "logs" / "trainer.log").exists()  # refused before anything started


def test_slurm_dry_run_of_the_gsm8k_recipe_on_two_nodes(fetched_assets, tmp_path, monkeypatch):  # noqa: F811
    layout = ["--set", "cluster.nodes=2", "--set", "cluster.trainer_nodes=1", "--set", "cluster.inference_nodes=1"]
    slurm = [
        "--set",
        "cluster.slurm.partition=gpu",
        "--set",
        'cluster.slurm.time="02:00:00"',
    ]  # a TOML string, not a time
    args = [str(SKYRL), "rl", "recipes/gsm8k_qwen1.5b.toml", "--slurm", "--dry-run", "--async", *layout, *slurm]
    env = {"HOME": str(fetched_assets.parents[1]), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    options = check_sbatch_syntax(proc.stdout)
    assert options["nodes"] == "2" and options["partition"] == "gpu" and options["time"] == "02:00:00"
    assert options["gpus-per-node"] == "4"  # 4 trainer ranks on node 0, 4 engines on node 1
    node = srun_command(proc.stdout)[-1]
    assert node.startswith(f"{SKYRL} rl {REPO}/recipes/gsm8k_qwen1.5b.toml --run-dir {REPO}/runs/gsm8k_qwen1.5b/rl")
    assert " --set cluster.nodes=2 " in node and " --async " in node
    assert node.endswith('--node-rank "$SLURM_NODEID"')


def test_slurm_without_sbatch_writes_the_script(skyrl, recipe_file, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    run = tmp_path / "run"
    result = skyrl("sft", recipe_file, "--slurm", "--run-dir", run)
    script = run / "slurm" / "sft.sbatch"
    assert result.code == 0 and result.out.startswith(f"wrote {script}; sbatch is not on PATH here")
    assert check_sbatch_syntax(script.read_text())["nodes"] == "2"


def test_a_node_that_sees_no_node_0_says_the_run_directory_must_be_shared(recipe_file, tmp_path):
    run = tmp_path / "run"
    args = ["sft", recipe_file, "--run-dir", run, "--node-rank", "1", "--set", "cluster.arrival_timeout_s=2"]
    proc = subprocess.run([str(SKYRL), *map(str, args)], capture_output=True, text=True, timeout=60)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: node 0 did not appear within 2 s (cluster.arrival_timeout_s)")
    assert "the run directory must be on a shared file system" in errors[0]
    assert errors[0].endswith(f"node 0's log: {run}/logs")


def test_slurm_submits_with_sbatch_where_it_exists(skyrl, recipe_file, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"  # records what it was given and answers as sbatch does
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/sbatch.args\necho "Submitted batch job 4242"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    run = tmp_path / "run"
    result = skyrl("rl", recipe_file, "--slurm", "--run-dir", run, "--async")
    script = run / "slurm" / "rl.sbatch"
    assert result.code == 0 and result.out.startswith(f"Submitted batch job 4242 ({script})"), result.err
    assert (tmp_path / "sbatch.args").read_text().split() == [str(script)]
    assert check_sbatch_syntax(script.read_text())["nodes"] == "3"
    assert " --async " in srun_command(script.read_text())[-1]

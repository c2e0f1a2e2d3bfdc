"""Helpers shared by the run commands, and the run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyrl_cli.commands import common
from skyrl_contracts.errors import RecipeError, UsageError
from skyrl_contracts.rundir import RunDir, sft_output_dir
from skyrl_contracts.schema import Recipe

from .conftest import REPO


def test_load_for_run_accepts_a_builtin_name_and_overrides():
    recipe = common.load_for_run("quickstart", ["sft.steps=3"], "sft", gpu_count=0)
    assert recipe.sft.steps == 3


def test_load_for_run_needs_the_stage_section(tmp_path):
    path = tmp_path / "only_sft.toml"
    path.write_text('name = "t"\n[model]\ninit = {}\n[data]\ntask = "addition"\n[sft]\n')
    with pytest.raises(UsageError, match=rf"^recipe {path} has no \[rl\] section$"):
        common.load_for_run(str(path), None, "rl", gpu_count=0)


def test_load_for_run_reports_recipe_problems():
    with pytest.raises(RecipeError):
        common.load_for_run(str(REPO / "tests/recipes_broken/unknown_key.toml"), None, "sft", gpu_count=0)


def test_run_dir_default_and_override():
    recipe = common.load_for_run("quickstart", None, "rl", gpu_count=0)
    assert common.run_dir_for(recipe, "rl", None) == Path("runs/quickstart/rl")
    assert common.run_dir_for(recipe, "rl", Path("/x")) == Path("/x")
    assert sft_output_dir(recipe) == Path("runs/quickstart/sft/final")


def test_output_modes():
    assert common.output_mode(False, False) == "live"
    assert common.output_mode(True, False) == "quiet"
    assert common.output_mode(False, True) == "json"
    with pytest.raises(UsageError):
        common.output_mode(True, True)


def test_output_sinks_add_wandb_only_when_asked():
    recipe = common.load_for_run("quickstart", None, None, gpu_count=0)
    assert [s.name for s in common.output_sinks("quiet", recipe, Path("/tmp/x"), "sft").sinks] == ["summary"]
    online = common.load_for_run("quickstart", ['logging.wandb={mode="offline"}'], None, gpu_count=0)
    assert [s.name for s in common.output_sinks("json", online, Path("/tmp/x"), "sft").sinks] == ["json", "wandb"]


def test_prepare_run_dir_writes_the_contract_files(tmp_path):
    recipe = common.load_for_run("quickstart", None, "sft", gpu_count=0)
    run_dir = RunDir(tmp_path / "run").prepare(recipe, {"stage": "sft"}).root
    assert (run_dir / "logs").is_dir()
    assert Recipe.model_validate_json((run_dir / "recipe.resolved.json").read_text()) == recipe
    assert json.loads((run_dir / "plan.json").read_text()) == {"stage": "sft"}
    assert not list(run_dir.glob(".tmp-*"))


def test_prepare_run_dir_refuses_a_used_directory(tmp_path):
    recipe = common.load_for_run("quickstart", None, "sft", gpu_count=0)
    run_dir = RunDir(tmp_path).prepare(recipe).root
    (run_dir / "events.jsonl").write_text("")
    (run_dir / "checkpoints" / "step-1").mkdir(parents=True)
    with pytest.raises(UsageError, match="already holds a run; pass --resume"):
        RunDir(run_dir).prepare(recipe)
    RunDir(run_dir).prepare(recipe, resume=True)
    assert (run_dir / "checkpoints" / "step-1").exists()
    RunDir(run_dir).prepare(recipe, overwrite=True)
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "events.jsonl").exists()

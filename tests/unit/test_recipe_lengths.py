"""Lengths left unset follow the model (capped at 512); set ones must fit it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyrl_cli.plan.feasibility import load_feasible_recipe
from skyrl_cli.plan.inference import Machine, engine_specs
from skyrl_cli.recipe.lengths import LENGTH_CAP, config_positions, with_model_lengths
from skyrl_contracts.errors import RecipeError
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import Recipe

CPU2 = Machine(device="cpu", engine_cores=(0, 1), python="py")


def model_dir(root: Path, name: str, **config) -> Path:
    """A model directory that holds only a config.json (all that validation reads)."""
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return directory


def write_recipe(root: Path, body: str) -> Path:
    path = root / "r.toml"
    path.write_text('name = "mine"\n' + body)
    return path


def test_lengths_follow_a_local_model_with_fewer_positions(tmp_path):
    model_dir(tmp_path, "llama", max_position_embeddings=256)
    recipe = load_feasible_recipe(
        write_recipe(tmp_path, '[model]\npath = "llama"\n[data]\ntask = "addition"\n[sft]\n[rl]\n'), gpu_count=0
    )
    assert (recipe.data.max_length, recipe.inference.max_model_len) == (256, 256)
    # The run directory's resolved recipe, which every backend reads, carries the numbers.
    run_dir = RunDir(tmp_path / "run").prepare(recipe).root
    resolved = json.loads((run_dir / "recipe.resolved.json").read_text())
    assert (resolved["data"]["max_length"], resolved["inference"]["max_model_len"]) == (256, 256)


@pytest.mark.parametrize("positions, expected", [(128, 128), (512, 512), (4096, LENGTH_CAP)])
def test_a_tiny_model_caps_the_default_at_512(tmp_path, positions, expected):
    body = f'[model]\ninit = {{ max_position_embeddings = {positions} }}\ntokenizer = "char"\n[data]\ntask = "addition"\n[rl]\n'
    recipe = load_feasible_recipe(write_recipe(tmp_path, body), gpu_count=0)
    assert (recipe.data.max_length, recipe.inference.max_model_len) == (expected, expected)


def test_explicit_lengths_within_the_limit_are_kept(tmp_path):
    model_dir(tmp_path, "llama", max_position_embeddings=4096)
    body = '[model]\npath = "llama"\n[data]\ntask = "addition"\nmax_length = 1024\n[rl]\n[inference]\nmax_model_len = 2048\n'
    recipe = load_feasible_recipe(write_recipe(tmp_path, body), gpu_count=0)
    assert (recipe.data.max_length, recipe.inference.max_model_len) == (1024, 2048)


def test_the_served_length_follows_the_rl_checkpoint(tmp_path):
    model_dir(tmp_path, "base", max_position_embeddings=2048)
    model_dir(tmp_path, "ckpt", max_position_embeddings=128)
    body = '[model]\npath = "base"\n[data]\ntask = "addition"\n[rl]\ninit_from = "ckpt"\n[inference]\nmax_model_len = 200\n'
    path = write_recipe(tmp_path, body)
    with pytest.raises(RecipeError) as info:
        load_feasible_recipe(path, gpu_count=0)
    assert info.value.problems == [
        f"{path}:9: inference.max_model_len: 200 exceeds max_position_embeddings in ckpt/config.json (128)"
    ]
    recipe = load_feasible_recipe(path, ["inference.max_model_len=100"], gpu_count=0)
    assert recipe.inference.max_model_len == 100
    body = body.replace("max_model_len = 200\n", "")
    recipe = load_feasible_recipe(write_recipe(tmp_path, body), gpu_count=0)
    assert (recipe.data.max_length, recipe.inference.max_model_len) == (512, 128)


def test_a_config_without_the_key_keeps_the_cap(tmp_path):
    assert config_positions(model_dir(tmp_path, "no_key")) is None
    assert config_positions(tmp_path / "nothing") is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("[1, 2")
    assert config_positions(tmp_path / "bad") is None
    recipe = load_feasible_recipe(
        write_recipe(tmp_path, '[model]\npath = "no_key"\n[data]\ntask = "addition"\n[rl]\n'), gpu_count=0
    )
    assert recipe.inference.max_model_len == LENGTH_CAP


def test_with_model_lengths_leaves_a_resolved_recipe_alone(tmp_path):
    recipe = Recipe.model_validate(
        {
            "name": "t",
            "model": {"init": {"max_position_embeddings": 64}, "tokenizer": "char"},
            "data": {"task": "addition"},
            "rl": {"max_new_tokens": 8},
        }
    )
    resolved = with_model_lengths(recipe)
    assert (resolved.data.max_length, resolved.inference.max_model_len) == (64, 64)
    assert with_model_lengths(resolved) is resolved


def test_engines_of_a_recipe_built_in_code_get_the_models_length(tmp_path):
    directory = model_dir(tmp_path, "llama", max_position_embeddings=256)
    recipe = Recipe.model_validate(
        {"name": "t", "model": {"path": str(directory)}, "data": {"task": "addition"}, "rl": {}}
    )
    (spec,) = engine_specs(recipe, CPU2, [8100], str(directory))
    assert spec.argv[spec.argv.index("--max-model-len") + 1] == "256"

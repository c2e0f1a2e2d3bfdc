"""Recipe loading: overrides, every problem at once, semantic checks, resolved paths."""

import json
from pathlib import Path

import pytest

from skyrl_cli.plan.feasibility import load_feasible_recipe
from skyrl_cli.recipe.overrides import parse_override, parse_value
from skyrl_cli.recipe.validate import NOT_YET_IMPLEMENTED
from skyrl_contracts.errors import RecipeError
from skyrl_contracts.schema import Recipe

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.toml"

MINIMAL = """\
name = "t"

[model]
init = { hidden_size = 128 }

[data]
task = "addition"

[sft]
steps = 10
"""


def problems(path, sets=(), gpu_count=0) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load_feasible_recipe(path, sets, gpu_count=gpu_count)
    return info.value.problems


@pytest.fixture
def minimal(tmp_path) -> Path:
    path = tmp_path / "r.toml"
    path.write_text(MINIMAL)
    return path


def test_parse_value_is_toml_with_bare_strings():
    assert parse_value("10") == 10
    assert parse_value("3e-4") == 3e-4
    assert parse_value("true") is True
    assert parse_value('"x y"') == "x y"
    assert parse_value("[0, 1]") == [0, 1]
    assert parse_value('{ kind = "gspo" }') == {"kind": "gspo"}
    assert parse_value("reversal") == "reversal"
    assert parse_value("my_env:Env") == "my_env:Env"


def test_override_paths_use_toml_spelling():
    override, problem = parse_override("rl.async_.max_staleness=3")
    assert problem is None and override.path == ("rl", "async", "max_staleness")


def test_overrides_apply_before_validation(minimal):
    recipe = load_feasible_recipe(
        minimal, ["sft.steps=7", "data.task=reversal", "rl.async.max_staleness=5"], gpu_count=0
    )
    assert recipe.sft.steps == 7
    assert recipe.data.task == "reversal"
    assert recipe.rl.async_.max_staleness == 5  # a new [rl] table is created


def test_override_errors_name_set(minimal):
    assert problems(minimal, ["sft.lerning_rate=1e-3", "sft.steps=ten", "nokey"]) == [
        "--set: sft.lerning_rate: unknown key 'lerning_rate'; did you mean 'learning_rate'?",
        "--set: expects key.path=value, got 'nokey'",
        '--set: sft.steps: Input should be a valid integer, unable to parse string as an integer (got "ten")',
    ]


def test_override_below_a_value_is_refused(minimal):
    assert problems(minimal, ["sft.steps.x=1"]) == ["--set: sft.steps: sft.steps is a value, not a table"]


def test_all_problems_at_once_sorted_by_line(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text(
        MINIMAL.replace("steps = 10", "steps = 0\nwarmup_steps = -1\nlerning_rate = 1").replace('"addition"', '"x"')
    )
    assert problems(path) == [
        f'{path}:7: data.task: \'x\' is not a task: "addition", "reversal", "lookup" or "reasoning_gym:<dataset name>"',
        f"{path}:10: sft.steps: Input should be greater than 0 (got 0)",
        f"{path}:11: sft.warmup_steps: Input should be greater than or equal to 0 (got -1)",
        f"{path}:12: sft.lerning_rate: unknown key 'lerning_rate'; did you mean 'learning_rate'?",
    ]


def test_unknown_key_without_a_close_match_lists_the_keys(minimal):
    (message,) = problems(minimal, ["trainer.zzz=1"])
    assert message.startswith("--set: trainer.zzz: unknown key 'zzz'; valid keys: ranks, nnodes,")


def test_missing_recipe_file(tmp_path):
    assert problems(tmp_path / "nope.toml") == [f"recipe file not found: {tmp_path / 'nope.toml'}"]


def test_syntax_error_at_end_of_document(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('name = "t"\nx = [1,\n')
    (message,) = problems(path)
    assert message.startswith(f"{path}:") and "TOML syntax error" in message


def test_paths_resolve_against_the_recipe_directory(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    (tmp_path / "model").mkdir()
    path = tmp_path / "r.toml"
    path.write_text(
        'name = "t"\n[model]\npath = "model"\n[data]\ntrain = "data/train.jsonl"\n[sft]\n[rl]\ninit_from = "sft"\n'
    )
    recipe = load_feasible_recipe(path, gpu_count=0)
    assert recipe.model.path == str(tmp_path / "model")
    assert recipe.data.train == str(tmp_path / "data" / "train.jsonl")
    assert recipe.rl.init_from == "sft"


def test_rl_init_from_a_missing_checkpoint(minimal):
    assert problems(minimal, ["rl.init_from=ckpt/none"]) == ["--set: rl.init_from: file not found: ckpt/none"]


@pytest.mark.parametrize("entry", NOT_YET_IMPLEMENTED, ids=lambda e: e.path)
def test_not_yet_implemented_values_are_errors(entry):
    (message,) = problems(QUICKSTART, [entry.example])
    assert message == f"--set: {entry.path}: {entry.what} is not implemented yet; remove this setting"


def test_layout_against_the_gpu_count(minimal):
    cuda = ["trainer.device=cuda", "trainer.ranks=2"]
    assert problems(minimal, cuda, gpu_count=0) == ['--set: trainer.device: device = "cuda" but no GPU is visible']
    assert problems(minimal, cuda, gpu_count=1) == [
        "--set: trainer.ranks: the layout needs 2 GPUs (2 trainer ranks + 0 for 0 engines) but 1 is visible"
    ]
    assert load_feasible_recipe(minimal, cuda, gpu_count=2).trainer.ranks == 2
    assert problems(minimal, ["trainer.gpus=[3]"], gpu_count=2) == [
        "--set: trainer.gpus: GPU 3 does not exist (2 visible)"
    ]


def test_rl_sizes_that_cannot_work(minimal):
    assert problems(minimal, ["rl.samples_per_prompt=1", "rl.max_new_tokens=600", "inference.max_model_len=512"]) == [
        "--set: rl.samples_per_prompt: grpo needs at least 2 samples per prompt",
        "--set: rl.max_new_tokens: 600 leaves no room for the prompt in inference.max_model_len (512)",
    ]


def test_resolved_recipe_round_trips_through_json():
    recipe = load_feasible_recipe(QUICKSTART, gpu_count=0)
    text = json.dumps(recipe.model_dump(mode="json", by_alias=True))
    assert Recipe.model_validate_json(text) == recipe
    assert '"async"' in text


def test_a_missing_run_output_names_the_command_that_writes_it(minimal, tmp_path, monkeypatch):
    """Any missing runs/<run>/<stage>/final names `skyrl <stage> <run>` (and where to run it, if not here)."""
    minimal.write_text(MINIMAL + "\n[rl]\n")
    monkeypatch.chdir(tmp_path)
    assert problems(minimal, ["rl.init_from=runs/quickstart/rl/final"]) == [
        "--set: rl.init_from: file not found: runs/quickstart/rl/final; "
        "run `skyrl rl quickstart` first (it writes runs/quickstart/rl/final)"
    ]
    monkeypatch.chdir(tmp_path.parent)
    assert problems(minimal, ["rl.init_from=runs/my-run/sft/final/"]) == [
        "--set: rl.init_from: file not found: runs/my-run/sft/final/; "
        f"run `skyrl sft` on the recipe named 'my-run' in {tmp_path} first (it writes runs/my-run/sft/final there)"
    ]


@pytest.mark.parametrize("value", ["runs/quickstart/sft/checkpoints", "runs/quickstart/tinker/final", "models/final"])
def test_other_missing_paths_get_no_run_hint(minimal, value):
    minimal.write_text(MINIMAL + "\n[rl]\n")
    assert problems(minimal, [f"rl.init_from={value}"]) == [f"--set: rl.init_from: file not found: {value}"]


def test_a_data_file_of_an_unread_format_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "rows.csv").write_text("prompt,answer\n")
    (tmp_path / "rows.v2").mkdir()  # an HF dataset directory may have any name
    path = tmp_path / "r.toml"
    path.write_text('name = "t"\n[model]\ninit = {}\n[data]\ntrain = "rows.csv"\neval = "rows.v2"\n[sft]\n')
    assert problems(path) == [
        f"{path}:5: data.train: unsupported data file 'rows.csv' (use .jsonl, .parquet or an HF dataset directory)"
    ]


def test_an_environment_and_a_reward_function_together_are_refused(minimal):
    sets = ["rl.environment=mod:Env", "rl.reward=mod:score"]
    found = [p for p in problems(minimal, sets) if "not both" in p]
    assert found == [
        "--set: rl.reward: set rl.environment or rl.reward, not both (an environment computes its own reward)"
    ]

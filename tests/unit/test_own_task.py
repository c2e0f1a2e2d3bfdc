"""The `own_task` example recipe (recipes/own_task.toml + recipes/own_task/) and the code paths a
user's own files take: rows, the reward module next to the recipe, the held-out split."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.data.files import hold_out
from skyrl_cli.plan.feasibility import load_feasible_recipe
from skyrl_cli.recipe.validate import module_findable
from skyrl_contracts.errors import RecipeError

REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "recipes" / "own_task"


def test_reward_scores_sorted_letters_from_the_rows_prompt(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "recipes"))  # as the orchestrator's --import-path does
    from backends.rollout.rewards import load_reward_fn

    score = load_reward_fn("own_task.reward:score")
    row = {"prompt": "hbdca", "completion": "abcdh"}
    assert score("abcdh", row) == 1.0 and score(" abcdh\n", row) == 1.0
    assert score("abcd", row) == 0.0 and score("hbdca", row) == 0.0


def test_recipe_resolves_paths_and_finds_its_module_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the recipe's directory
    recipe = load_feasible_recipe(REPO / "recipes" / "own_task.toml", gpu_count=0)
    assert recipe.data.train == str(TASK / "train.jsonl") and recipe.rl.reward == "own_task.reward:score"
    assert module_findable("own_task.reward", [REPO / "recipes"])
    assert not module_findable("own_task.nope", [REPO / "recipes"]) and not module_findable("no_such_module_x", [])


def test_the_reward_module_is_looked_up_next_to_the_recipe_and_reported_with_its_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    text = (REPO / "recipes" / "own_task.toml").read_text().replace('"own_task/', f'"{TASK}/')
    recipe_path = elsewhere / "mine.toml"
    recipe_path.write_text(text.replace('reward = "own_task.reward:score"', 'reward = "my_reward:score"'))
    line = next(i for i, t in enumerate(recipe_path.read_text().splitlines(), 1) if t.startswith("reward ="))
    with pytest.raises(RecipeError) as caught:
        load_feasible_recipe(recipe_path, gpu_count=0)
    assert caught.value.problems == [
        f"{recipe_path}:{line}: rl.reward: cannot find module 'my_reward' (looked next to the recipe, in the current "
        "directory and in the installed packages)"
    ]
    (elsewhere / "my_reward.py").write_text("def score(response, row):\n    return 1.0\n")
    assert load_feasible_recipe(recipe_path, gpu_count=0).rl.reward == "my_reward:score"


def test_sft_and_rl_hold_out_the_same_rows_when_there_is_no_eval_file(tmp_path):
    from backends.data.sft import load_source
    from backends.rollout.orchestrator import load_rows as rl_rows

    recipe = load_feasible_recipe(REPO / "recipes" / "own_task.toml", ["data.eval_size=50"], gpu_count=0)
    data = recipe.data.model_copy(update={"eval": None})
    recipe = recipe.model_copy(update={"data": data})
    train, evals = rl_rows(recipe)
    sft = load_source(data, recipe.seed)
    assert len(evals) == 50 and len(train) == 3950  # held out, not trained on
    assert [c[0]["content"] for c in sft.eval] == [r["prompt"] for r in evals]
    assert [c[0]["content"] for c in sft.train] == [r["prompt"] for r in train]
    kept, held = hold_out(list(range(100)), 50, 0)
    assert len(held) == 10 and sorted(kept + held) == list(range(100))  # at most 10% of the rows

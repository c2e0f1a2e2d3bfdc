"""reasoning-gym datasets as built-in tasks (``data.task = "reasoning_gym:<name>"``): splits from the
recipe seed, disjoint and reproducible; the dataset's own ``score_answer`` on the ``<answer>`` tags;
mixtures by weight; names checked with a did-you-mean, at validate time without importing the package."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from backends.data.tasks import get_task, task_for
from skyrl_contracts.schema import DataConfig

REPO = Path(__file__).resolve().parents[2]
ARITHMETIC = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 2,
    "operators": ["+", "-"],
    "allow_parentheses": False,
    "allow_negation": False,
}


def data(task: str = "reasoning_gym:basic_arithmetic", **reasoning_gym) -> DataConfig:
    if task != "reasoning_gym:composite":
        reasoning_gym.setdefault("config", ARITHMETIC)
    return DataConfig(task=task, reasoning_gym=reasoning_gym)


def test_splits_are_disjoint_distinct_and_follow_the_recipe_options():
    task = task_for(data())
    train = task.make_rows(0, 3000, "train")
    evals = task.make_rows(0, 200, "eval")
    assert len(train) == 3000 and len(evals) == 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    assert len({r["prompt"] for r in evals}) == 200  # eval questions are distinct
    for row in train[:200]:
        expression = row["entry"]["metadata"]["expression"]
        assert expression.count(" ") == 2 and "*" not in expression and "(" not in expression  # the config acts
        assert row["prompt"] == row["entry"]["question"]
        assert row["answer"] == f"<answer>{row['entry']['answer']}</answer>"


def test_rows_are_reproducible_from_the_seed_across_processes():
    task = task_for(data())
    rows = task.make_rows(3, 50, "eval")
    assert rows == task.make_rows(3, 50, "eval")
    assert [r["prompt"] for r in rows] != [r["prompt"] for r in task.make_rows(4, 50, "eval")]
    # Another process (another hash seed) draws the same questions: the SFT and RL processes agree.
    probe = (
        "from backends.data.tasks import task_for; from skyrl_contracts.schema import DataConfig; "
        f"d = DataConfig(task='reasoning_gym:basic_arithmetic', reasoning_gym={{'config': {ARITHMETIC!r}}}); "
        "print([r['prompt'] for r in task_for(d).make_rows(3, 50, 'eval')])"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
        cwd=REPO,
    )
    assert out.stdout.strip() == repr([r["prompt"] for r in rows])


def test_reward_is_score_answer_on_the_tagged_answer():
    task = task_for(data())
    row = task.make_rows(0, 1, "eval")[0]
    right = row["entry"]["answer"]
    wrong = str(int(right) + 1)
    assert task.reward(f"<answer>{right}</answer>", row) == 1.0
    assert task.reward(f"7 and 8 make... <answer>{wrong}</answer> no: <answer> {right} </answer>", row) == 1.0
    assert task.reward(f"<answer>{wrong}</answer>", row) == 0.0
    assert task.reward(right, row) == 0.0  # no tags: reasoning-gym's extract_answer finds no answer
    assert task.reward("<answer></answer>", row) == 0.0
    # the demonstration is the tagged answer; the flawed one drops the tags
    assert task.demonstration(row)[-1] == {"role": "assistant", "content": f"<answer>{right}</answer>"}
    assert task.flawed_answer(row) == right and task.has_flaw()


def test_scoring_a_row_needs_no_options():
    """The RL environment's task comes from the name alone: a row carries what scores it."""
    row = task_for(data()).make_rows(0, 1, "train")[0]
    bare = get_task("reasoning_gym:basic_arithmetic")
    assert bare.reward(row["answer"], row) == 1.0
    assert bare.prompt(row) == [{"role": "user", "content": row["prompt"]}]


def test_system_prompt_is_reasoning_gyms():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    task = task_for(data(system_prompt="direct"))
    row = task.make_rows(0, 1, "eval")[0]
    assert task.prompt(row) == [
        {"role": "system", "content": SYSTEM_PROMPTS["direct"]},
        {"role": "user", "content": row["prompt"]},
    ]
    with pytest.raises(ValueError, match="is not one of reasoning_gym.utils.SYSTEM_PROMPTS"):
        task_for(data(system_prompt="terse")).make_rows(0, 1, "eval")


def test_a_mixture_follows_its_weights_and_scores_each_row_with_its_dataset():
    mixture = data(
        "reasoning_gym:composite",
        datasets={
            "basic_arithmetic": {"weight": 3, "config": ARITHMETIC},
            "spell_backward": {"weight": 1, "config": {"max_word_len": 5}},
        },
    )
    task = task_for(mixture)
    rows = task.make_rows(0, 2000, "train")
    counts = Counter(r["dataset"] for r in rows)
    assert 0.70 < counts["basic_arithmetic"] / len(rows) < 0.80, counts
    spelled = next(r for r in rows if r["dataset"] == "spell_backward")
    assert len(spelled["entry"]["answer"]) <= 5 and spelled["config"] == {"max_word_len": 5}
    for row in rows[:50]:
        assert task.reward(row["answer"], row) == 1.0
        assert task.reward("<answer>#</answer>", row) == 0.0
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in task.make_rows(0, 100, "eval")}


def test_sft_rows_give_the_char_tokenizer_every_character():
    from backends.data.sft import load_source

    source = load_source(data().model_copy(update={"train_size": 300, "eval_size": 30}), seed=0)
    chars = set(source.alphabet())
    assert set("<answer>/0123456789+-Calcute .") <= chars
    assert all(set(m["content"]) <= chars for conv in source.train + source.eval for m in conv)


def test_bad_names_and_options_fail_with_one_clear_line():
    with pytest.raises(
        ValueError, match=r"'basic_arithmetc' is not a reasoning-gym dataset; did you mean basic_arithmetic"
    ):
        get_task("reasoning_gym:basic_arithmetc").make_rows(0, 1, "eval")
    with pytest.raises(ValueError, match=r"data.reasoning_gym.config: .*'max_term'.*options: min_terms, max_terms"):
        task_for(data(config={"max_term": 2})).make_rows(0, 1, "eval")
    with pytest.raises(ValidationError, match="is not a task"):
        DataConfig(task="reasoning gym:basic_arithmetic")
    with pytest.raises(ValidationError, match="remove seed"):
        data(config={"seed": 1})
    with pytest.raises(ValidationError, match="needs its mixture"):
        DataConfig(task="reasoning_gym:composite")
    with pytest.raises(ValidationError, match="applies to task"):
        DataConfig(task="addition", reasoning_gym={})


def test_validate_names_close_matches_without_importing_reasoning_gym(tmp_path):
    """``skyrl recipes validate`` reads the names from the package's source: no import, no seconds."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        'name = "r"\n[model]\ninit = {}\ntokenizer = "char"\n[sft]\n'
        '[data]\ntask = "reasoning_gym:composite"\n'
        "[data.reasoning_gym.datasets.spell_backwards]\n[data.reasoning_gym.datasets.basic_arithmetic]\n"
    )
    probe = (
        "import sys\nfrom skyrl_cli.recipe.loader import load_recipe\nfrom skyrl_contracts.errors import RecipeError\n"
        "try:\n    load_recipe(sys.argv[1])\nexcept RecipeError as e:\n    print(*e.problems, sep='\\n')\n"
        "print('imported' if 'reasoning_gym' in sys.modules else 'not imported')"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, "r.toml"], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.splitlines() == [
        "r.toml:8: data.reasoning_gym.datasets.spell_backwards: 'spell_backwards' is not a reasoning-gym dataset; "
        "did you mean spell_backward?",
        "not imported",
    ]


def test_validate_names_the_install_command_when_the_package_is_missing(monkeypatch):
    import importlib.util

    from skyrl_cli.recipe import validate

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else real(name, *a)
    )
    (problem,) = validate.reasoning_gym_problems(data())
    assert problem.path == ("data", "task") and 'pip install "reasoning-gym' in problem.message

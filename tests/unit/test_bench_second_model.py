"""benchmarks/bench_second_model.py's pure parts: the judge's training rows are labelled by the
true sum, and each mode's recipe is recipes/distill.toml with exactly its one change."""

from __future__ import annotations

import sys
import tomllib
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_second_model as bench  # noqa: E402


def test_judge_rows_are_labelled_by_the_true_sum():
    rows = bench.judge_rows(7, 2000, "train")
    for row in rows:
        question, candidate = row["prompt"].split("=")
        a, b = question.split("+")
        assert row["completion"] == ("yes" if int(candidate) == int(a) + int(b) else "no")
    share = Counter(r["completion"] for r in rows)["yes"] / len(rows)
    assert 0.45 < share < 0.55
    assert bench.judge_rows(7, 50, "eval") == bench.judge_rows(7, 50, "eval")  # reproducible


def test_each_mode_changes_one_thing(tmp_path):
    base = tomllib.loads(bench.RECIPE.read_text())["rl"]
    recipes = {
        mode: tomllib.loads(bench.mode_recipe(mode, tmp_path / "judge", tmp_path).read_text()) for mode in bench.MODES
    }
    assert "distillation" not in recipes["rl"]["rl"] and "judge" not in recipes["rl"]["rl"]
    assert recipes["distill"]["rl"]["distillation"]["task_reward"] is False
    assert recipes["mix"]["rl"]["distillation"]["task_reward"] is True
    assert recipes["judge"]["rl"]["judge"] == {
        "model": str(tmp_path / "judge"),
        "template": "{question}{response}",
        "max_tokens": 4,
    }
    for recipe in recipes.values():
        same = {k: v for k, v in recipe["rl"].items() if k not in ("distillation", "judge", "init_from")}
        assert same == {k: v for k, v in base.items() if k not in ("distillation", "init_from")}
        assert recipe["rl"]["init_from"].endswith("runs/quickstart/sft/final")

"""Built-in tasks: deterministic rows, disjoint splits, exact-match reward."""

from __future__ import annotations

import pytest

from backends.data.tasks import exact_match, get_task, score


def test_addition_rows_are_fixed_width_and_correct():
    rows = get_task("addition", digits=3).make_rows(seed=0, n=50, split="train")
    assert len(rows) == 50
    for row in rows:
        left, right = row["prompt"].rstrip("=").split("+")
        assert len(left) == len(right) == 3 and row["prompt"].endswith("=")
        assert row["answer"] == str(int(left) + int(right))


def test_reversal_rows():
    rows = get_task("reversal", digits=5).make_rows(seed=1, n=20, split="eval")
    assert all(len(r["prompt"]) == 5 and r["answer"] == r["prompt"][::-1] for r in rows)


@pytest.mark.parametrize("name", ["addition", "reversal"])
def test_rows_are_deterministic_from_the_seed(name):
    task = get_task(name, digits=3)
    assert task.make_rows(7, 30, "train") == task.make_rows(7, 30, "train")
    assert task.make_rows(7, 30, "train") != task.make_rows(8, 30, "train")


@pytest.mark.parametrize("name", ["addition", "reversal"])
def test_train_and_eval_never_share_a_problem(name):
    task = get_task(name, digits=2)
    train = {r["prompt"] for r in task.make_rows(0, 5000, "train")}
    evals = task.make_rows(0, 500, "eval")
    assert not train & {r["prompt"] for r in evals}
    assert len({r["prompt"] for r in evals}) == len(evals)  # eval problems are distinct


def test_eval_split_is_capped_by_the_held_out_problem_space():
    task = get_task("addition", digits=1)  # 100 problems, about 10 held out
    evals = task.make_rows(0, 500, "eval")
    assert 0 < len(evals) <= 20


def test_reward_is_exact_match():
    task = get_task("addition")
    row = {"prompt": "007+123=", "answer": "130"}
    assert task.reward("130", row) == 1.0
    assert task.reward(" 130\n", row) == 1.0
    assert task.reward("1300", row) == 0.0
    assert task.reward("", row) == 0.0
    assert score("addition", "130", "130") == 1.0 and score(task, "13", "130") == 0.0
    assert exact_match("a", "b") == 0.0


def test_prompt_is_a_user_message():
    task = get_task("addition")
    assert task.prompt({"prompt": "007+123=", "answer": "130"}) == [{"role": "user", "content": "007+123="}]
    assert set("0123456789+=") == set(task.alphabet)


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown task 'mult'"):
        get_task("mult")

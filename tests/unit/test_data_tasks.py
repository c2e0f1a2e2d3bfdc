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


def test_flawed_demonstrations_drop_the_last_digit_of_long_sums_at_the_given_rate():
    from backends.data.tasks import flawed_demonstrations

    task = get_task("addition", digits=2)
    rows = task.make_rows(seed=3, n=4000, split="train")
    flawed = flawed_demonstrations(task, rows, 0.67, seed=3)
    long_rows = [(r, f) for r, f in zip(rows, flawed) if len(r["answer"]) == 3]
    changed = [f for r, f in long_rows if f != r]
    assert all(f["answer"] == r["answer"][:2] for r, f in long_rows if f != r)
    assert all(f == r for r, f in zip(rows, flawed) if len(r["answer"]) < 3)  # short sums never
    assert 0.62 < len(changed) / len(long_rows) < 0.72
    assert flawed == flawed_demonstrations(task, rows, 0.67, seed=3)  # seeded
    assert task.flawed_answer({"prompt": "99+01=", "answer": "100"}) == "10"
    assert not get_task("reversal").has_flaw() and task.has_flaw()


def test_the_recipe_check_knows_which_tasks_have_a_flaw():
    from backends.data.tasks import TASKS
    from skyrl_cli.recipe.validate import TASKS_WITH_A_FLAW

    assert {name for name in TASKS if get_task(name).has_flaw()} == TASKS_WITH_A_FLAW

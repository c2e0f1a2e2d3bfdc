"""The examples of docs/own-task.md are the example recipe's real files, and the code blocks marked
``<!-- run: tests/cli/test_docs_pages.py -->`` there run as the page says: the local check of the
reward, the ``SortAgain`` environment driven through the RL stage's episode loop, and the recipe
fragment that uses it, validated in a copy of the recipe."""

from __future__ import annotations

import asyncio
import math
import sys
import time
import tomllib

import pytest
import tomli_w

from tests.docs_blocks import DOCS, REPO, Block, blocks

PAGE = DOCS / "own-task.md"
TASK = REPO / "recipes" / "own_task"


def _block(lang: str, contains: str) -> Block:
    found = [b for b in blocks(PAGE) if b.lang == lang and contains in b.code]
    assert len(found) == 1, f"{PAGE.name}: {len(found)} {lang} blocks contain {contains!r}"
    return found[0]


def _run_marked(block: Block) -> bool:
    return block.marker == ("run", "tests/cli/test_docs_pages.py")


# ------------------------------------------------------------------------- the files shown as they are


def test_the_reward_shown_is_reward_py():
    assert _block("python", "def score(").code == (TASK / "reward.py").read_text()


def test_the_recipe_shown_is_own_task_toml():
    block = _block("toml", 'name = "own_task"')
    assert block.code == (REPO / "recipes" / "own_task.toml").read_text()
    assert block.option("in") == "recipes"


def test_the_rows_shown_are_the_first_rows_of_train_jsonl():
    shown = _block("text", '{"prompt": "acffe"').code.splitlines()
    assert shown == (TASK / "train.jsonl").read_text().splitlines()[: len(shown)]


# ------------------------------------------------------------------------------ the blocks that run


def test_the_local_check_of_the_reward_runs_from_the_repository_root(monkeypatch):
    block = _block("python", "from own_task.reward import score")
    assert _run_marked(block)
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m == "own_task" or m.startswith("own_task.")]:
        monkeypatch.delitem(sys.modules, name)
    exec(compile(block.code, block.where, "exec"), {"__name__": "docs_own_task_check"})
    assert sys.modules["own_task.reward"].__file__ == str(TASK / "reward.py")


def _sort_again():
    block = _block("python", "class SortAgain(Environment)")
    assert _run_marked(block)
    namespace: dict = {"__name__": "docs_sort_again"}
    exec(compile(block.code, block.where, "exec"), namespace)
    return namespace["SortAgain"]


def _episode(make_env, row, answers, max_turns=2, timeout_s=5.0):
    """``run_episode`` as the orchestrator calls it, with a model that writes ``answers`` in turn."""
    from backends.rollout.environments import TurnText, run_episode
    from backends.rollout.rewards import GuardedCaller

    seen = []

    async def generate(history, new_messages, tools):
        seen.append(list(new_messages))
        text = answers[len(seen) - 1]
        return TurnText(text, text)

    episode = asyncio.run(run_episode(make_env, row, generate, GuardedCaller(timeout_s), max_turns))
    return episode, seen


@pytest.mark.parametrize(
    ("answers", "reward", "turns"),
    [(["abcdh"], 1.0, 1), (["hbdca", "abcdh\n"], 0.5, 2), (["abcd", "hbdc"], 0.0, 2)],
)
def test_sort_again_scores_a_first_and_a_second_try(answers, reward, turns):
    episode, seen = _episode(_sort_again(), {"prompt": "hbdca", "completion": "abcdh"}, answers)
    assert (episode.error, episode.reward, episode.turns, episode.done) == (None, reward, turns, True)
    assert all(messages == [{"role": "user", "content": "hbdca"}] for messages in seen)  # asked again


def test_the_fragment_validates_in_a_copy_of_own_task_with_the_environment_next_to_it(tmp_path, monkeypatch):
    from backends.rollout.episodes.environment import environment_factory
    from skyrl_cli.commands.common import load_for_run
    from skyrl_cli.commands.recipes import copy_recipe

    fragment = _block("toml", 'environment = "own_task.retry:SortAgain"')
    assert _run_marked(fragment)
    monkeypatch.chdir(tmp_path)
    copy_recipe("own_task", tmp_path / "my_task.toml", False)
    (tmp_path / "own_task" / "retry.py").write_text(_block("python", "class SortAgain(Environment)").code)
    data = tomllib.loads((tmp_path / "my_task.toml").read_text())
    assert data["rl"].pop("reward") == "own_task.reward:score"  # "instead of reward = ..."
    data["rl"].update(tomllib.loads(fragment.code)["rl"])
    (tmp_path / "my_task.toml").write_text(tomli_w.dumps(data))
    recipe = load_for_run(str(tmp_path / "my_task.toml"), None, stage="rl", gpu_count=0)
    assert (recipe.rl.environment, recipe.rl.reward, recipe.rl.max_turns) == ("own_task.retry:SortAgain", None, 2)

    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])  # the orchestrator's --import-path
    for name in [m for m in sys.modules if m == "own_task" or m.startswith("own_task.")]:
        monkeypatch.delitem(sys.modules, name)
    make_env = environment_factory(recipe)
    assert make_env.__name__ == "SortAgain" and sys.modules["own_task.retry"].__file__ == str(
        tmp_path / "own_task" / "retry.py"
    )
    row = {"prompt": "ggaeh", "completion": "aeggh"}
    assert _episode(make_env, row, ["ggaeh", "aeggh"])[0].reward == 0.5


# ------------------------------------------------------------------------- what the page says of errors


def _reward_episode(score, timeout_s=5.0):
    from backends.rollout.environments import SingleTurnEnvironment

    return _episode(lambda: SingleTurnEnvironment(score), {"prompt": "hbdca"}, ["abcdh"], 1, timeout_s)[0]


def score(response, row):  # a reward named as the page's is, that overruns its timeout
    time.sleep(2)
    return 1.0


def test_the_error_records_the_page_quotes():
    text = PAGE.read_text()
    timed_out = _reward_episode(score, timeout_s=0.2)
    assert timed_out.error == "step: timeout: score took longer than 0.2 s (rl.reward_timeout_s)"
    assert "`step: timeout: score took longer than 5 s (rl.reward_timeout_s)`" in text

    for value, error in (
        ("0.5", "step: reward must be a number, got str"),
        (math.nan, "step: reward is not finite: nan"),
    ):
        episode = _reward_episode(lambda response, row, value=value: value)
        assert (episode.reward, episode.error) == (0.0, error)
        assert f"`{error}`" in text
    assert _reward_episode(lambda response, row: None).error == "step: reward must be a number, got NoneType"
    assert (_reward_episode(lambda response, row: True).reward, _reward_episode(lambda r, row: 1).error) == (1.0, None)

    def broken(response, row):
        raise ValueError("no answer")

    assert _reward_episode(broken).error == "step: ValueError: no answer"


def test_a_row_without_a_prompt_fails_the_sample_not_the_run():
    from backends.rollout.environments import SingleTurnEnvironment

    episode = _episode(lambda: SingleTurnEnvironment(lambda r, row: 1.0), {"question": "x"}, ["x"], 1)[0]
    assert episode.reward == 0.0 and episode.error.startswith("reset: ValueError: row needs 'prompt'")


def test_the_import_errors_the_page_quotes(monkeypatch):
    from backends.rollout.rewards import load_reward_fn
    from skyrl_contracts.errors import UsageError

    monkeypatch.setattr(sys, "path", [str(REPO / "recipes"), *sys.path])
    with pytest.raises(UsageError) as caught:
        load_reward_fn("own_task.reward:scor")
    assert f"UsageError: {caught.value}" in PAGE.read_text()

"""GSM8K rows (backends/data/gsm8k.py) and the two-turn environment of recipes/gsm8k_multiturn."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from backends.data.gsm8k import INSTRUCTION, final_answer, gsm8k_row
from backends.rollout.environments import TurnText, prompt_and_answer, run_episode
from backends.rollout.rewards import GuardedCaller, math_reward

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nIn all she sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def test_a_row_boxes_the_final_answer_and_drops_the_calculator_notes():
    row = gsm8k_row("How many clips?", SOLUTION)
    assert row["prompt"] == f"How many clips?\n{INSTRUCTION}"
    assert row["answer"] == "72"
    assert "<<" not in row["completion"] and row["completion"].endswith("The final answer is \\boxed{72}.")
    assert final_answer("... #### 1,234") == "1234"
    with pytest.raises(ValueError, match="####"):
        final_answer("no marker")
    # what the RL stage reads from the row, and what its reward makes of the SFT target
    messages, answer = prompt_and_answer(row)
    assert messages == [{"role": "user", "content": row["prompt"]}] and answer == "72"
    assert math_reward(row["completion"], answer) == 1.0
    assert math_reward("so the answer is \\boxed{71}", answer) == 0.0


@pytest.fixture
def retry_math(monkeypatch):
    monkeypatch.syspath_prepend(str(RECIPES))  # the orchestrator puts the recipe's directory first too
    from gsm8k_multiturn.retry import RetryMath

    yield RetryMath
    sys.modules.pop("gsm8k_multiturn.retry", None)


def _episode(env_cls, responses, max_turns=2):
    row = gsm8k_row("How many clips?", SOLUTION)
    seen = []

    async def generate(history, new_messages, tools):
        turn = sum(m["role"] == "assistant" for m in history)
        seen.append(list(new_messages))
        return TurnText(responses[turn], responses[turn])

    episode = asyncio.run(run_episode(env_cls, row, generate, GuardedCaller(10.0), max_turns))
    return episode, seen


def test_a_wrong_first_answer_gets_feedback_and_a_second_try(retry_math):
    episode, seen = _episode(retry_math, ["\\boxed{70}", "I rechecked: \\boxed{72}"])
    assert (episode.reward, episode.turns, episode.done, episode.error) == (1.0, 2, True, None)
    assert seen[1][0]["role"] == "user" and "not correct" in seen[1][0]["content"]


def test_a_right_first_answer_ends_the_episode_and_two_wrong_ones_score_zero(retry_math):
    assert _episode(retry_math, ["\\boxed{72}"])[0].turns == 1
    episode, _ = _episode(retry_math, ["\\boxed{1}", "\\boxed{2}"])
    assert (episode.reward, episode.turns, episode.done) == (0.0, 2, False)

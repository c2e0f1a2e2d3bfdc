"""Environments: built-in task / math / user reward / user multi-turn class, driven by run_episode
with a plain generate function; failures become per-episode error records."""

import asyncio
import time

import pytest

from backends.data.tasks import get_task
from backends.rollout.environments import (
    Environment,
    MathEnvironment,
    SingleTurnEnvironment,
    StepResult,
    TaskEnvironment,
    TurnText,
    prompt_and_answer,
    run_episode,
)
from backends.rollout.episodes.environment import environment_factory
from backends.rollout.rewards import GuardedCaller
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe


class GuessEnv(Environment):
    """Multi-turn: the model guesses a number; the environment answers higher/lower."""

    def reset(self, row):
        self.target = int(row["target"])
        return [{"role": "user", "content": "guess a number"}]

    def step(self, response):
        guess = int(response)
        if guess == self.target:
            return StepResult(reward=1.0, done=True, info={"guess": guess})
        hint = "higher" if guess < self.target else "lower"
        return StepResult(observation=[{"role": "user", "content": hint}], reward=-0.1, done=False)


class BrokenEnv(Environment):
    def reset(self, row):
        return [{"role": "user", "content": "hi"}]

    def step(self, response):
        raise RuntimeError("sandbox crashed")


class SlowEnv(BrokenEnv):
    def step(self, response):
        time.sleep(2)
        return StepResult(reward=1.0)


def user_reward(response, row):
    return float(response.strip().lower() == str(row["answer"]).lower())


def _recipe(**rl):
    return Recipe.model_validate(
        {"name": "t", "model": {"init": {}, "tokenizer": "char"}, "data": {"task": "addition"}, "rl": rl}
    )


def _scripted(responses, seen):
    async def generate(history, new_messages, tools):
        turn = sum(m["role"] == "assistant" for m in history)
        seen.append((turn, list(new_messages)))
        return TurnText(responses[turn], responses[turn])

    return generate


def _run(factory, row, responses, max_turns=4, timeout=5.0):
    seen = []
    ep = asyncio.run(run_episode(factory, row, _scripted(responses, seen), GuardedCaller(timeout), max_turns))
    return ep, seen


def test_multi_turn_episode_sums_rewards_and_feeds_observations():
    ep, seen = _run(GuessEnv, {"target": 7}, ["3", "9", "7"])
    assert ep.reward == pytest.approx(-0.1 - 0.1 + 1.0)
    assert (ep.turns, ep.done, ep.error) == (3, True, None)
    assert [msgs[0]["content"] for _, msgs in seen] == ["guess a number", "higher", "lower"]


def test_episode_stops_at_max_turns():
    ep, _ = _run(GuessEnv, {"target": 7}, ["1", "2", "3"], max_turns=2)
    assert (ep.turns, ep.done, ep.reward) == (2, False, pytest.approx(-0.2))


def test_step_exception_is_an_error_record_with_zero_reward():
    ep, _ = _run(BrokenEnv, {}, ["x"])
    assert ep.reward == 0.0 and ep.error == "step: RuntimeError: sandbox crashed"


def test_step_timeout_is_an_error_record():
    ep, _ = _run(SlowEnv, {}, ["x"], timeout=0.2)
    assert ep.reward == 0.0 and ep.error.startswith("step: timeout:")


def test_reward_value_that_is_not_a_number_is_an_error():
    env = lambda: SingleTurnEnvironment(lambda response, row: "yes")  # noqa: E731
    ep, _ = _run(env, {"prompt": "q", "answer": "a"}, ["a"])
    assert ep.reward == 0.0 and ep.error == "step: reward must be a number, got str"


def test_reset_error_ends_the_episode_before_generation():
    def bad_row_env():
        return MathEnvironment()

    ep, seen = _run(bad_row_env, {"text": "no prompt"}, ["1"])
    assert seen == [] and ep.error.startswith("reset: ValueError: row needs 'prompt'")


def test_task_environment_uses_the_task_prompt_and_exact_match():
    task = get_task("addition", 3)
    row = task.make_rows(seed=0, n=1, split="train")[0]
    ep, seen = _run(lambda: TaskEnvironment(task), row, [row["answer"]])
    assert seen[0][1] == task.prompt(row)
    assert ep.reward == 1.0
    ep, _ = _run(lambda: TaskEnvironment(task), row, ["0"])
    assert ep.reward == 0.0


def test_math_environment_with_answer_and_messages_rows():
    ep, _ = _run(MathEnvironment, {"prompt": "1/2 as a decimal?", "answer": "0.5"}, ["It is \\boxed{\\frac{1}{2}}"])
    assert ep.reward == 1.0
    row = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    ep, seen = _run(MathEnvironment, row, ["4"])
    assert ep.reward == 1.0 and seen[0][1] == [{"role": "user", "content": "2+2?"}]


def test_prompt_and_answer_row_forms():
    assert prompt_and_answer({"prompt": "q", "answer": 3}) == ([{"role": "user", "content": "q"}], "3")
    assert prompt_and_answer({"prompt": "q", "completion": "c"}) == ([{"role": "user", "content": "q"}], "c")
    assert prompt_and_answer({"prompt": "q", "completion": "c", "answer": "a"})[1] == "a"


def test_factory_prefers_user_environment_then_reward_then_task():
    assert environment_factory(_recipe(environment="tests.unit.test_rollout_environments:GuessEnv")) is GuessEnv
    env = environment_factory(_recipe(reward="tests.unit.test_rollout_environments:user_reward"))()
    assert isinstance(env, SingleTurnEnvironment)
    env.reset({"prompt": "capital of France?", "answer": "Paris"})
    assert env.step(" paris ").reward == 1.0
    assert isinstance(environment_factory(_recipe())(), TaskEnvironment)


def test_factory_rejects_bad_references():
    with pytest.raises(UsageError, match="not both"):
        environment_factory(
            _recipe(
                environment="tests.unit.test_rollout_environments:GuessEnv",
                reward="tests.unit.test_rollout_environments:user_reward",
            )
        )
    with pytest.raises(UsageError, match="must be a subclass"):
        environment_factory(_recipe(environment="tests.unit.test_rollout_environments:user_reward"))


class ClosingEnv(GuessEnv):
    """Counts on being closed; ``fail_in`` names the end-of-episode call that raises."""

    closed = []

    def __init__(self, fail_in=None):
        self.fail_in = fail_in

    def metrics(self):
        if self.fail_in == "metrics":
            raise RuntimeError("no numbers")
        return {"target": self.target, "label": "not a number"}

    def close(self):
        ClosingEnv.closed.append(self.fail_in)
        if self.fail_in == "close":
            raise RuntimeError("database gone")


@pytest.mark.parametrize("fail_in", [None, "metrics", "close"])
def test_metrics_then_close_end_every_episode_and_their_failure_is_the_episodes_error(fail_in):
    ClosingEnv.closed.clear()
    ep, _ = _run(lambda: ClosingEnv(fail_in), {"target": 3}, ["3"])
    assert ClosingEnv.closed == [fail_in]  # closed however it ends
    if fail_in is None:
        assert ep.error is None and ep.reward == 1.0 and ep.env_metrics == {"target": 3.0}
    else:
        assert ep.error.startswith(f"{fail_in}: ") and ep.reward == 0.0

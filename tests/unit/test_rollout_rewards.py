"""Rewards: math-verify answers, user functions from `module:function`, and the guard that turns
exceptions, bad values and timeouts into a per-sample error with reward 0."""

import asyncio
import threading

import pytest

from backends.rollout.rewards import (
    CallOutcome,
    GuardedCaller,
    as_reward,
    load_object,
    load_reward_fn,
    math_reward,
)
from skyrl_contracts.errors import UsageError


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("The answer is \\boxed{42}", "42", 1.0),
        ("so x = 0.5", "\\frac{1}{2}", 1.0),
        ("$\\frac{2}{4}$", "0.5", 1.0),
        ("I think 41", "42", 0.0),
        ("no number here", "42", 0.0),
        ("Paris", "Paris", 1.0),
    ],
)
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_math_reward_works_off_the_main_thread():
    # math-verify's default signal-based timeout raises in threads; ours is switched off
    out = GuardedCaller(timeout_s=30).call(math_reward, "\\boxed{3}", "3")
    assert out == CallOutcome(value=1.0)


def _raises(response, row):
    raise KeyError("answer")


def test_guard_turns_exceptions_into_error_records():
    out = as_reward(GuardedCaller(5).call(_raises, "x", {}))
    assert out.reward == 0.0
    assert out.error == "KeyError: 'answer'"


def test_guard_times_out_without_blocking():
    release = threading.Event()
    caller = GuardedCaller(timeout_s=0.2)
    try:
        out = as_reward(caller.call(lambda: release.wait(30) or 1.0))
        assert out.reward == 0.0 and out.error.startswith("timeout:")
        assert "0.2 s" in out.error

        # the async form does not stall the event loop meanwhile
        async def both():
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.01)

            t = asyncio.ensure_future(ticker())
            res = await caller.acall(lambda: release.wait(30) or 1.0)
            t.cancel()
            return res, ticks

        res, ticks = asyncio.run(both())
        assert res.error.startswith("timeout:") and ticks >= 5
    finally:
        release.set()  # let the abandoned daemon threads finish


@pytest.mark.parametrize(
    "value, reward, error",
    [
        (1, 1.0, None),
        (True, 1.0, None),
        (0.25, 0.25, None),
        (float("nan"), 0.0, "reward is not finite: nan"),
        ("1.0", 0.0, "reward must be a number, got str"),
        (None, 0.0, "reward must be a number, got NoneType"),
    ],
)
def test_as_reward_coerces_or_records(value, reward, error):
    out = as_reward(CallOutcome(value=value))
    assert (out.reward, out.error) == (reward, error)


def test_async_call_returns_value_and_errors():
    caller = GuardedCaller(5)
    assert asyncio.run(caller.acall(lambda a, b: a + b, 2, 3)).value == 5
    assert asyncio.run(caller.acall(_raises, "", {})).error == "KeyError: 'answer'"


def test_load_reward_fn_by_reference():
    fn = load_reward_fn("backends.rollout.rewards:math_reward")
    assert fn is math_reward


@pytest.mark.parametrize(
    "ref, message",
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("backends.rollout.rewards:nope", "has no attribute 'nope'"),
        ("missing_colon", "must look like 'module.path:name'"),
    ],
)
def test_load_object_errors_are_usage_errors(ref, message):
    with pytest.raises(UsageError, match=message):
        load_object(ref, "rl.reward")


def test_load_reward_fn_rejects_non_callable():
    with pytest.raises(UsageError, match="not callable"):
        load_reward_fn("skyrl_contracts.engine_api:SERVED_MODEL_NAME")  # a string

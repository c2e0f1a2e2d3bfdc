"""Reward functions and the guard every user-supplied call runs behind.

A reward (or environment step) that raises, returns something that is not a finite number, or runs
longer than ``rl.reward_timeout_s`` gives reward 0 and a one-line error record for that sample; it
never takes the run down. Calls run in daemon threads: Python cannot kill a thread, so a call that
never returns is abandoned (its thread keeps running in the background) but does not block the
rollout nor, being a daemon, the process exit. ``concurrent.futures`` pools are not used on purpose:
their worker threads are joined at interpreter exit, so one hung reward would hang shutdown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import inspect
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from skyrl_contracts.errors import UsageError

# A reward function: (model response text, the dataset row) -> reward.
RewardFn = Callable[[str, Mapping[str, Any]], float]


@dataclass(frozen=True)
class CallOutcome:
    value: Any = None
    error: str | None = None  # "timeout: ..." or "ExceptionType: message"; None when the call succeeded


@dataclass(frozen=True)
class RewardOutcome:
    reward: float
    error: str | None = None


def _start_in_daemon_thread(fn: Callable[..., Any], args: tuple, kwargs: dict) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - user code: every failure becomes a record
            future.set_exception(exc)

    threading.Thread(target=target, name=f"reward-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future


def describe_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class GuardedCaller:
    """Runs user code with a timeout and turns every failure into a ``CallOutcome.error``. An
    ``async def`` call that overruns is cancelled; a thread cannot be, and is abandoned."""

    def __init__(self, timeout_s: float, concurrency: int | None = None, timeout_key: str = "rl.reward_timeout_s"):
        self.timeout_s, self.timeout_key = float(timeout_s), timeout_key
        self.limit = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()

    def _timeout_message(self, fn: Callable) -> str:
        # A single-turn episode's step() is the user's reward function: the message names that.
        name = getattr(getattr(fn, "__self__", None), "step_name", None) or getattr(fn, "__qualname__", fn)
        return f"timeout: {name!s} took longer than {self.timeout_s:g} s ({self.timeout_key})"

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CallOutcome:
        """Blocking call (for synchronous code)."""
        future = _start_in_daemon_thread(fn, args, kwargs)
        try:
            return CallOutcome(value=future.result(timeout=self.timeout_s))
        except BaseException as exc:  # noqa: BLE001
            if not future.done():  # a TimeoutError the function raised itself is its own error
                return CallOutcome(error=self._timeout_message(fn))
            return CallOutcome(error=describe_error(exc))

    async def acall(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CallOutcome:
        """Awaitable call that keeps the event loop (and the other rollouts) running meanwhile: an
        ``async def`` function runs on the loop, any other in a daemon thread; at most ``limit``
        calls of this caller run at once (``rl.env_concurrency``)."""
        async with self.limit:
            return await self._acall(fn, *args, **kwargs)

    async def _acall(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CallOutcome:
        if inspect.iscoroutinefunction(fn):
            future = asyncio.ensure_future(fn(*args, **kwargs))
        else:
            future = asyncio.wrap_future(_start_in_daemon_thread(fn, args, kwargs))
        # asyncio.wait, not wait_for: a TimeoutError the function raises itself is its error, not a timeout
        done, _ = await asyncio.wait({future}, timeout=self.timeout_s)
        if not done:
            future.cancel()  # an async call stops here; a thread cannot be stopped and is abandoned
            return CallOutcome(error=self._timeout_message(fn))
        try:
            return CallOutcome(value=future.result())
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, asyncio.CancelledError):
                raise
            return CallOutcome(error=describe_error(exc))


def as_reward(outcome: CallOutcome) -> RewardOutcome:
    """A call's value as a reward: a finite real number (bools count), else 0 with an error."""
    if outcome.error is not None:
        return RewardOutcome(0.0, outcome.error)
    value = outcome.value
    if isinstance(value, bool) or isinstance(value, (int, float)):
        reward = float(value)
        if math.isfinite(reward):
            return RewardOutcome(reward)
        return RewardOutcome(0.0, f"reward is not finite: {reward!r}")
    if isinstance(value, (str, bytes)):  # float("1") would accept them: a bug in the reward, not a score
        return RewardOutcome(0.0, f"reward must be a number, got {type(value).__name__}")
    try:  # numpy / torch scalars
        reward = float(value)
    except (TypeError, ValueError):
        return RewardOutcome(0.0, f"reward must be a number, got {type(value).__name__}")
    if not math.isfinite(reward):
        return RewardOutcome(0.0, f"reward is not finite: {reward!r}")
    return RewardOutcome(reward)


def math_reward(response: str, answer: str) -> float:
    """1.0 when ``math-verify`` finds the response's final answer equal to ``answer``, else 0.0.

    math-verify's own timeouts use ``signal.alarm`` (main thread only); they are switched off here
    because every reward call already runs under ``GuardedCaller``'s timeout in a worker thread."""
    # lazy: math_verify (sympy, slow); only math rewards use it
    from math_verify import parse, verify

    gold = parse(str(answer), parsing_timeout=None)
    if not gold:  # plain strings that are not maths ("yes", "Paris"): exact match after trimming
        return float(response.strip() == str(answer).strip())
    predicted = parse(response, parsing_timeout=None)
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=None))


def import_user_module(name: str, what: str):
    """Import a module a recipe names; ``what`` (the key and value) leads the one-line error."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise UsageError(f"{what}: cannot import module {name!r} ({exc})") from exc


def load_object(ref: str, what: str) -> Any:
    """Resolve ``"package.module:attribute"`` (a recipe's reward / environment) with importlib."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{what} {ref!r} must look like 'module.path:name'")
    module = import_user_module(module_name, f"{what} {ref!r}")
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UsageError(f"{what} {ref!r}: module {module_name!r} has no attribute {attr!r}") from None


def load_reward_fn(ref: str) -> RewardFn:
    """A user reward ``module:function`` with signature ``fn(response: str, row: dict) -> float``."""
    fn = load_object(ref, "rl.reward")
    if not callable(fn):
        raise UsageError(f"rl.reward {ref!r} is not callable")
    return fn

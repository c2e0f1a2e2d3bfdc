"""Environments: what a trajectory sees and how it is scored, single- or multi-turn.

An episode is ``reset(row)`` -> the prompt messages, then for each model turn ``step(response)`` ->
(observation messages, reward, done). The rollout generator appends the model's response tokens as
trainable and the observation's tokens (rendered with the chat template) as non-trainable, and asks
the model again until ``done`` or ``rl.max_turns``. The episode's reward is the sum of its steps'.

Each trajectory gets its own instance (``EnvironmentFactory(row)``), so state lives on ``self``.
Every call into an environment (user code) goes through ``GuardedCaller``: an exception or a
timeout ends the episode with reward 0 and an error record instead of crashing the run.

Which environment a recipe gets (``environment_factory``): ``rl.environment`` (a user class),
else ``rl.reward`` (a user function on a single-turn episode), else the built-in task's exact-match
reward (``data.task``), else math answers checked with math-verify against the row's answer.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe

from .rewards import GuardedCaller, RewardFn, as_reward, load_object, load_reward_fn, math_reward

Message = dict[str, Any]
Messages = list[Message]


@dataclass
class StepResult:
    observation: Messages = field(default_factory=list)  # appended as non-trainable tokens (ignored when done)
    reward: float = 0.0
    done: bool = True
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One episode. Subclass it for a custom environment (``rl.environment = "module:Class"``); the
    class is instantiated with no arguments once per trajectory."""

    @abstractmethod
    def reset(self, row: Mapping[str, Any]) -> Messages:
        """The episode's prompt messages for a dataset row."""

    @abstractmethod
    def step(self, response: str) -> StepResult:
        """Score the model's turn; return the next observation unless ``done``."""


# ------------------------------------------------------------------------------ rows -> prompts


def prompt_and_answer(row: Mapping[str, Any], fmt: str = "auto") -> tuple[Messages, str | None]:
    """A row's prompt messages and reference answer.

    Accepted rows: ``{"prompt": str | messages, "answer": ...}``, ``prompt``/``completion``
    (the completion is the reference unless ``answer`` is given), or ``messages`` (everything
    before the last assistant turn is the prompt, that turn the reference)."""
    from backends.data.chat import split_reference, to_messages

    answer = row.get("answer")
    answer = None if answer is None else str(answer)
    if "messages" not in row and "completion" not in row:
        if "prompt" not in row:
            raise ValueError("row needs 'prompt' (and 'answer'), 'prompt'/'completion' or 'messages'")
        prompt = row["prompt"]
        return ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]), answer
    messages, reference = split_reference(to_messages(dict(row), fmt))
    return messages, answer if answer is not None else reference


class SingleTurnEnvironment(Environment):
    """Prompt from the row, one model turn, reward ``reward_fn(response, row)``, done."""

    def __init__(self, reward_fn: RewardFn, prompt_fn: Callable[[Mapping[str, Any]], Messages] | None = None):
        self._reward_fn = reward_fn
        self.step_name = getattr(reward_fn, "__qualname__", None)  # what a timeout message names
        self._prompt_fn = prompt_fn or (lambda row: prompt_and_answer(row)[0])
        self._row: Mapping[str, Any] | None = None

    def reset(self, row: Mapping[str, Any]) -> Messages:
        self._row = row
        return self._prompt_fn(row)

    def step(self, response: str) -> StepResult:
        assert self._row is not None, "step() before reset()"
        return StepResult(reward=self._reward_fn(response, self._row), done=True)


class TaskEnvironment(SingleTurnEnvironment):
    """A built-in task (``backends.data.tasks``): its prompt and its exact-match reward."""

    def __init__(self, task):
        super().__init__(reward_fn=task.reward, prompt_fn=task.prompt)
        self.task = task


def _row_math_reward(response: str, row: Mapping[str, Any]) -> float:
    _, answer = prompt_and_answer(row)
    if answer is None:
        raise ValueError("row has no 'answer' (or completion / assistant turn) to check against")
    return math_reward(response, answer)


class MathEnvironment(SingleTurnEnvironment):
    """Math answers: the response is correct when math-verify finds it equal to the row's answer."""

    def __init__(self):
        super().__init__(reward_fn=_row_math_reward)


# ------------------------------------------------------------------------------ recipe -> factory

EnvironmentFactory = Callable[[], Environment]


def environment_factory(recipe: Recipe) -> EnvironmentFactory:
    """A callable that builds a fresh environment per trajectory, as the recipe asks."""
    rl = recipe.rl
    if rl is None:
        raise UsageError("the recipe has no [rl] section")
    if rl.environment and rl.reward:
        raise UsageError("set rl.environment or rl.reward, not both (an environment computes its own reward)")
    if rl.environment:
        cls = load_object(rl.environment, "rl.environment")
        if not (inspect.isclass(cls) and issubclass(cls, Environment)):
            raise UsageError(
                f"rl.environment {rl.environment!r} must be a subclass of backends.rollout.environments.Environment"
            )
        return cls
    if rl.reward:
        fn = load_reward_fn(rl.reward)
        return lambda: SingleTurnEnvironment(fn)
    if recipe.data.task is not None:
        from backends.data.tasks import get_task

        task = get_task(recipe.data.task, recipe.data.digits)
        return lambda: TaskEnvironment(task)
    if rl.max_turns > 1:
        raise UsageError("rl.max_turns > 1 needs a multi-turn rl.environment")
    return MathEnvironment


# ------------------------------------------------------------------------------ guarded episode


@dataclass
class Episode:
    reward: float = 0.0  # sum of the step rewards (0 when an error ended the episode)
    turns: int = 0  # model turns taken
    done: bool = False  # the environment ended it (False: stopped at max_turns)
    error: str | None = None  # the first reset / step error, reward then 0
    step_infos: list[dict[str, Any]] = field(default_factory=list)


def messages_error(value: Any) -> str | None:
    """Why ``value`` is not a list of chat messages (``{"role": str, "content": str}``), or None.
    Checked before the chat template sees it: a malformed observation is the environment's error
    record, not a crash of the rollout."""
    if not isinstance(value, (list, tuple)):
        return f"messages must be a list of {{'role', 'content'}} dicts, got {type(value).__name__}"
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            return f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return f"message {i}: {key!r} must be a string, got {type(message.get(key)).__name__}"
    return None


# generate(new_messages, turn) -> the model's response text. The generator keeps the token
# context itself: at turn 0 ``new_messages`` is the prompt, later the observation to append.
Generate = Callable[[Messages, int], Awaitable[str]]


async def run_episode(
    make_env: EnvironmentFactory,
    row: Mapping[str, Any],
    generate: Generate,
    caller: GuardedCaller,
    max_turns: int,
) -> Episode:
    """Drive one trajectory: reset, then generate/step until done or ``max_turns``."""
    episode = Episode()
    built = await caller.acall(make_env)
    if built.error:
        episode.error = f"environment: {built.error}"
        return episode
    env: Environment = built.value
    reset = await caller.acall(env.reset, row)
    if reset.error or messages_error(reset.value):
        episode.error = f"reset: {reset.error or messages_error(reset.value)}"
        return episode
    new_messages: Messages = list(reset.value)
    total = 0.0
    for turn in range(max_turns):
        response = await generate(new_messages, turn)
        episode.turns = turn + 1
        stepped = await caller.acall(env.step, response)
        if stepped.error is None and not isinstance(stepped.value, StepResult):
            stepped = type(stepped)(error=f"step() must return StepResult, got {type(stepped.value).__name__}")
        if stepped.error:
            episode.error = f"step: {stepped.error}"
            episode.reward = 0.0
            return episode
        result: StepResult = stepped.value
        scored = as_reward(type(stepped)(value=result.reward))
        if scored.error:
            episode.error = f"step: {scored.error}"
            episode.reward = 0.0
            return episode
        total += scored.reward
        episode.step_infos.append(result.info)
        if result.done:
            episode.done = True
            break
        if messages_error(result.observation):
            episode.error, episode.reward = f"step: observation: {messages_error(result.observation)}", 0.0
            return episode
        new_messages = list(result.observation)
    episode.reward = total
    return episode

"""Environments: what a trajectory sees and how it is scored, single- or multi-turn, with tools.

An episode is ``reset(row)`` -> the prompt messages, then for each model turn ``step(response)`` ->
(observation messages, reward, done). The rollout generator appends the model's response tokens as
trainable and the observation's tokens (what the chat template writes after the model's turn) as
non-trainable, and asks the model again until ``done`` or ``rl.max_turns``. The episode's reward is
the sum of its steps'.

Tools: an environment whose ``tools()`` returns functions (or JSON schemas) has them shown to the
model through the chat template (``tools=``). A model turn that calls tools is not stepped: the
calls run (``backends.rollout.tools``) and their results, rendered as ``tool`` messages, are the
next observation; a turn without calls is the answer ``step`` scores. A failed call (malformed,
unknown tool, wrong arguments, raised, timed out) is an error text the model sees as the tool's
answer, counted per episode; with ``rl.tool_errors = "end"`` it ends the episode with reward 0.

``reset``, ``step``, ``tools`` and the tools themselves may be ``async def``: they then run on the
orchestrator's event loop (``asyncio.wait_for`` under the timeout), synchronous ones in threads;
at most ``rl.env_concurrency`` environment calls run at once.

Each trajectory gets its own instance (``EnvironmentFactory()``, then ``reset(row)``), so state lives on ``self``.
Every call into an environment (user code) goes through ``GuardedCaller``: an exception or a
timeout ends the episode with reward 0 and an error record instead of crashing the run.

Which environment a recipe gets is ``backends.rollout.episodes.environment.environment_factory``'s
choice: ``rl.environment`` (a user class), else ``rl.reward`` (a user function on a single-turn
episode), else the built-in task's environment (``data.task``: exact match, or the ``lookup``
task's tool environment), else math answers checked with math-verify against the row's answer.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Sequence

from backends.data.chat import split_reference, to_messages
from backends.rollout.tools import as_tool

from .rewards import GuardedCaller, RewardFn, as_reward, math_reward
from .tools import ToolCall, ToolResult, as_tools, call_tool, tool_message

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

    def tools(self) -> Sequence[Callable[..., Any] | Mapping[str, Any]]:
        """Tools the model may call in this episode (asked once, after ``reset``): functions whose
        type hints and docstring's ``Args:`` become their schema, or JSON schemas that ``call_tool``
        answers. Methods of the environment see the episode's state."""
        return ()

    def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        """The answer of a tool declared by JSON schema only (override it to declare such tools)."""
        raise NotImplementedError(f"tool {name!r} has a schema but the environment defines no call_tool")

    def metrics(self) -> Mapping[str, float]:
        """Numbers about the finished episode, averaged over a step's episodes into its metrics as
        ``rollout/env/<name>`` (asked once, after the last step, before ``close``)."""
        return {}

    def close(self) -> None:
        """Release what the episode holds (called once it ends, however it ends)."""


def declares_tools(make_env: "EnvironmentFactory") -> bool:
    """Whether the environments ``make_env`` builds may offer tools (their class overrides ``tools``)."""
    return inspect.isclass(make_env) and make_env.tools is not Environment.tools


# ------------------------------------------------------------------------------ rows -> prompts


def prompt_and_answer(row: Mapping[str, Any], fmt: str = "auto") -> tuple[Messages, str | None]:
    """A row's prompt messages and reference answer.

    Accepted rows: ``{"prompt": str | messages, "answer": ...}``, ``prompt``/``completion``
    (the completion is the reference unless ``answer`` is given), or ``messages`` (everything
    before the last assistant turn is the prompt, that turn the reference)."""
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


class LookupEnvironment(Environment):
    """The built-in ``lookup`` task (``backends.data.tasks.Lookup``): the value under the prompt's key
    is known to the episode's ``lookup`` tool only; the answer turn scores 1 when it is that value."""

    def reset(self, row: Mapping[str, Any]) -> Messages:
        self.key, self.value = row["prompt"][:-1], row["answer"]
        return [{"role": "user", "content": row["prompt"]}]

    def tools(self):
        return [self.lookup]

    def lookup(self, key: str) -> str:
        """The value stored under a key.

        Args:
            key: the key, as the question writes it
        """
        return self.value if key == self.key else "not found"

    def step(self, response: str) -> StepResult:
        return StepResult(reward=float(response.strip() == self.value), done=True)

    @classmethod
    def tool_schemas(cls) -> list[dict]:
        return [as_tool(cls.lookup).schema]


def _row_math_reward(response: str, row: Mapping[str, Any]) -> float:
    _, answer = prompt_and_answer(row)
    if answer is None:
        raise ValueError("row has no 'answer' (or completion / assistant turn) to check against")
    return math_reward(response, answer)


class MathEnvironment(SingleTurnEnvironment):
    """Math answers: the response is correct when math-verify finds it equal to the row's answer."""

    def __init__(self):
        super().__init__(reward_fn=_row_math_reward)


EnvironmentFactory = Callable[[], Environment]


# ------------------------------------------------------------------------------ guarded episode


@dataclass
class Episode:
    reward: float = 0.0  # sum of the step rewards (0 when an error ended the episode)
    turns: int = 0  # model turns taken
    done: bool = False  # the environment ended it (False: stopped at max_turns)
    error: str | None = None  # the first reset / step error, reward then 0
    step_infos: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: list[str] = field(default_factory=list)  # one line per failed call (the model saw it)
    env_metrics: dict[str, float] = field(default_factory=dict)  # Environment.metrics(), numbers only
    messages: Messages = field(default_factory=list)  # the conversation: prompt, raw model turns, observations

    def env_metric_info(self) -> dict[str, float]:
        """``env/<name>`` of each environment metric: what a sample carries into the step's
        ``rollout/env/<name>`` (``backends.rollout.trainer_feed.environment_metrics``)."""
        return {f"env/{key}": value for key, value in self.env_metrics.items()}

    def fail(self, error: str) -> "Episode":
        self.error, self.reward = error, 0.0
        return self


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


@dataclass(frozen=True)
class TurnText:
    text: str  # the turn decoded without special tokens: what ``step`` scores
    raw: str  # decoded with them, less the closing end-of-turn token: what tool calls are parsed from
    context_full: bool = False  # no token fit in the engines' context: no turn was taken


# generate(history, new_messages, tools) -> the model's turn. The generator keeps the token context
# itself: at turn 0 ``history`` is empty and ``new_messages`` the prompt; later ``history`` is the
# conversation so far (ending with the model's raw turn) and ``new_messages`` what follows it.
Generate = Callable[[Messages, Messages, Sequence[dict]], Awaitable[TurnText]]


@dataclass(frozen=True)
class ToolUse:
    """How an episode runs its model's tool calls: ``parser`` (``ToolCallParser``), ``timeout_s``
    (``rl.tool_timeout_s``) and whether a failed call ends the episode (``rl.tool_errors``)."""

    parser: Any
    timeout_s: float
    end_on_error: bool = False


async def run_episode(
    make_env: EnvironmentFactory,
    row: Mapping[str, Any],
    generate: Generate,
    caller: GuardedCaller,
    max_turns: int | None,
    tool_use: ToolUse | None = None,
) -> Episode:
    """Drive one trajectory: reset, then generate and step (or run its tool calls) until done or
    ``max_turns`` (None: until done; the engines' context length bounds it)."""
    episode = Episode()
    built = await caller.acall(make_env)
    if built.error:
        return episode.fail(f"environment: {built.error}")
    env: Environment = built.value
    try:
        return await drive_episode(env, episode, row, generate, caller, max_turns, tool_use)
    finally:
        await finish_episode(env, episode, caller)


async def finish_episode(env: Environment, episode: Episode, caller: GuardedCaller) -> None:
    """The environment's metrics, then its ``close``; a failure of either is the episode's error
    (reward 0, a record in ``sample_errors.jsonl``), as a failed ``step`` is: user code that raises
    costs its trajectory, never the run."""
    measured = await caller.acall(env.metrics)
    if measured.error is None and isinstance(measured.value, Mapping):
        episode.env_metrics = {
            str(k): float(v) for k, v in measured.value.items() if isinstance(v, (int, float)) and v == v
        }
    closed = await caller.acall(env.close)
    if episode.error is None and (measured.error or closed.error):
        episode.fail(f"metrics: {measured.error}" if measured.error else f"close: {closed.error}")


async def drive_episode(
    env: Environment,
    episode: Episode,
    row: Mapping[str, Any],
    generate: Generate,
    caller: GuardedCaller,
    max_turns: int | None,
    tool_use: ToolUse | None,
) -> Episode:
    reset = await caller.acall(env.reset, row)
    if reset.error or messages_error(reset.value):
        return episode.fail(f"reset: {reset.error or messages_error(reset.value)}")
    listed = await caller.acall(env.tools)
    if listed.error:
        return episode.fail(f"tools: {listed.error}")
    try:
        tools = as_tools(listed.value or ())
    except ValueError as exc:
        return episode.fail(f"tools: {exc}")
    if tools and tool_use is None:
        return episode.fail("tools: the environment offers tools but the run has no tool parser (rl.tool_parser)")
    schemas = [tool.schema for tool in tools.values()]
    new_messages: Messages = list(reset.value)
    total = 0.0
    for turn in itertools.count() if max_turns is None else range(max_turns):
        response = await generate(episode.messages, new_messages, schemas)
        if response.context_full:  # the episode ends unscored past its last turn, as a max_turns stop
            break
        episode.messages += [*new_messages, {"role": "assistant", "content": response.raw}]
        episode.turns = turn + 1
        if tools:
            parsed = tool_use.parser.parse(response.raw)
            if parsed.calls or parsed.error:
                new_messages = await run_tool_calls(env, tools, parsed, tool_use, caller, episode)
                if episode.error:
                    return episode
                continue
        stepped = await caller.acall(env.step, response.text)
        if stepped.error is None and not isinstance(stepped.value, StepResult):
            stepped = type(stepped)(error=f"step() must return StepResult, got {type(stepped.value).__name__}")
        if stepped.error:
            return episode.fail(f"step: {stepped.error}")
        result: StepResult = stepped.value
        scored = as_reward(type(stepped)(value=result.reward))
        if scored.error:
            return episode.fail(f"step: {scored.error}")
        total += scored.reward
        episode.step_infos.append(result.info)
        if result.done:
            episode.done = True
            break
        if messages_error(result.observation):
            return episode.fail(f"step: observation: {messages_error(result.observation)}")
        new_messages = list(result.observation)
    episode.reward = total
    return episode


async def run_tool_calls(env: Environment, tools, parsed, tool_use: ToolUse, caller: GuardedCaller, episode: Episode):
    """The ``tool`` messages answering a turn's calls (run concurrently, in the turn's order);
    failures are counted on ``episode`` and, with ``end_on_error``, end it."""
    fallback = env.call_tool if type(env).call_tool is not Environment.call_tool else None
    if parsed.error:  # the model sees the error; the record also shows what it wrote
        shown = parsed.content if len(parsed.content) <= 80 else parsed.content[:77] + "..."
        results = [ToolResult(ToolCall("?", None), f"error: {parsed.error}", f"{parsed.error}: {shown!r}")]
    else:

        async def one(call):
            async with caller.limit:
                return await call_tool(tools, call, tool_use.timeout_s, fallback)

        results = list(await asyncio.gather(*(one(call) for call in parsed.calls)))
    episode.tool_calls += len(parsed.calls) or 1
    for result in results:
        if result.error:
            episode.tool_errors.append(f"tool: {result.error}")
            if tool_use.end_on_error and episode.error is None:  # the first failure is the episode's error
                episode.fail(f"tool: {result.error} (rl.tool_errors = 'end')")
    return [tool_message(result) for result in results]

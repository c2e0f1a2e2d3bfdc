"""Environment episodes: the recipe's ``Environment`` driven turn by turn through the router.

Covers every episode that an ``Environment`` runs: the recipe's ``rl.environment``, a built-in
task's (with tools for ``lookup``), a reward function's single-turn wrapper and the math default
(``environment_factory``). Each trajectory keeps its token context
in a ``RolloutSession``; turn 0 of a group's trajectories is sampled together (``SharedFirstTurn``).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Mapping, Sequence

from backends.data.chat import continuation_text, encode_prompt, encode_text
from backends.data.tasks import get_task
from backends.rollout.environments import (
    Environment,
    EnvironmentFactory,
    MathEnvironment,
    SingleTurnEnvironment,
    TaskEnvironment,
    TurnText,
    run_episode,
)
from backends.rollout.judge import JudgedEnvironment
from backends.rollout.rewards import GuardedCaller, load_object, load_reward_fn
from backends.rollout.session import RolloutSession
from skyrl_contracts.episodes import turn_limit
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe

from .tools import tool_use

log = logging.getLogger("skyrl.orchestrator")


def encode_observation(tokenizer, history, messages, tools=()) -> list[int]:
    """Tokens of an environment observation appended after the model's turn, ending with the
    assistant's generation prompt: what the chat template writes after that turn when the
    observation follows it (``continuation_text``). A template that renders the history differently
    once more follows gets the observation's messages rendered alone, less a leading BOS."""
    text = continuation_text(tokenizer, history, messages, tools)
    if text is not None:
        return encode_text(tokenizer, text)
    if not encode_observation.warned:  # once per run: it holds for every observation of this template
        log.warning("the chat template rewrites the conversation before an observation; it is rendered alone")
        encode_observation.warned = True
    ids = encode_prompt(tokenizer, messages)
    if tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]:
        ids = ids[1:]
    return ids


encode_observation.warned = False


def environment_factory(recipe: Recipe, judge=None) -> EnvironmentFactory:
    """A callable that builds a fresh environment per trajectory, as the recipe asks. ``judge``:
    the ``backends.rollout.judge.Judge`` of ``rl.judge``, which then scores the environment the
    recipe would otherwise run (a built-in task's, or the math default)."""
    rl = recipe.rl
    if rl is None:
        raise UsageError("the recipe has no [rl] section")
    if judge is not None:
        base = environment_factory(recipe.model_copy(update={"rl": rl.model_copy(update={"judge": None})}))
        return lambda: JudgedEnvironment(judge, base())
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
        task = get_task(recipe.data.task, recipe.data.digits)
        if task.environment is not None:
            return task.environment
        return lambda: TaskEnvironment(task)
    return MathEnvironment


def step_timeout_s(recipe: Recipe, judge) -> float:
    """``rl.reward_timeout_s``; a judged step also waits for the judge's request and its retries."""
    inf = recipe.inference
    return recipe.rl.reward_timeout_s + (inf.request_timeout_s * (inf.max_retries + 1) if judge is not None else 0.0)


class EnvironmentEpisodes:
    """``EpisodeRunner`` for environments: reset, then a model turn and a step (or its tool calls)
    until done or the turn limit."""

    first_turn_wait_s = None  # every trajectory of a group reaches its first turn (or skips it)

    @classmethod
    def preflight(cls, recipe: Recipe) -> None:
        """Nothing before the run: the recipe's own code is imported when the orchestrator starts."""

    def __init__(self, recipe: Recipe, tokenizer, make_env: EnvironmentFactory | None = None, judge=None):
        """``make_env``: the environments to run (another library's, adapted); by default the
        recipe's (``environment_factory``). ``judge``: ``rl.judge``'s ``Judge``, the reward."""
        self.rl, self.tokenizer, self.judge = recipe.rl, tokenizer, judge
        self.make_env = make_env or environment_factory(recipe, judge)
        self.tool_use = tool_use(recipe, tokenizer, self.make_env)
        self.max_turns = turn_limit(recipe)
        self.caller = GuardedCaller(step_timeout_s(recipe, judge), self.rl.env_concurrency)
        self.eos = tokenizer.eos_token or ""
        self.client, self.stop_ids = None, []

    async def start(self, client, stop_ids: Sequence[int]) -> None:
        self.client, self.stop_ids = client, list(stop_ids)

    async def stop(self) -> None:
        return None

    def check_rows(self, rows: Sequence[Mapping[str, Any]], source: str) -> None:
        return None  # a row an environment cannot use fails its own episode (an error record)

    async def trajectory(self, row: Mapping[str, Any], session_id: str, temperature: float, first_turn=None, index=0):
        """One trajectory: ([its session], episode). ``first_turn``: the group's ``SharedFirstTurn``,
        which samples turn 0 of all its trajectories together. The session's router pin is always
        released."""
        session: RolloutSession | None = None

        async def generate(history, new_messages, tools):
            nonlocal session
            if not history:
                session = RolloutSession(self.client, encode_prompt(self.tokenizer, new_messages, tools), session_id)
                if first_turn is not None:
                    return self.decode(await first_turn.take(index, session))
            else:
                session.add_observation(encode_observation(self.tokenizer, history, new_messages, tools))
            completion = await session.generate(
                max_tokens=self.rl.max_new_tokens, temperature=temperature, stop_token_ids=self.stop_ids
            )
            return self.decode(completion)

        try:
            episode = await run_episode(self.make_env, row, generate, self.caller, self.max_turns, self.tool_use)
        finally:
            if session is not None:
                await session.finish()
        return ([session] if session is not None else []), episode

    def decode(self, completion) -> TurnText:
        if completion is None:
            return TurnText("", "", context_full=True)
        raw = self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)
        if self.eos and raw.endswith(self.eos):
            raw = raw[: -len(self.eos)]
        return TurnText(self.tokenizer.decode(completion.token_ids, skip_special_tokens=True), raw)

    def sample_info(self, episode, parts) -> dict[str, float]:
        info = episode.env_metric_info()
        if self.tool_use is not None:
            info |= {"tool_calls": episode.tool_calls, "tool_errors": len(episode.tool_errors)}
        return info

    def sample_turns(self, part, episode) -> int:
        return episode.turns

"""How one trajectory runs: one ``EpisodeRunner`` per episode kind, chosen once per run.

A kind is what ``skyrl_contracts.episodes.episode_kind`` says of the recipe (the same rule that
``skyrl recipes validate`` applies), and ``RUNNERS`` maps it to the class that runs it:

- ``environment.EnvironmentEpisodes``: an ``Environment`` (the recipe's class, a built-in task's,
  a reward function's single-turn wrapper or the math default) driven turn by turn through the
  router, with tool calls where it offers tools;
- ``agent.AgentEpisodes``: the recipe's agent program against the OpenAI-compatible endpoint, its
  recorded calls made into samples;
- ``skyrl_gym.SkyRLGymEpisodes``: a skyrl-gym environment (``BaseTextEnv``) made per trajectory;
- ``verifiers.VerifiersEpisodes``: a verifiers environment rolled out by verifiers against the
  endpoint, scored by its rubric.

A new kind of episode (another library's environments) is one module here with a class that
implements ``EpisodeRunner``, one entry in ``skyrl_contracts.episodes.EPISODE_RUNNERS`` (the kind's
name everywhere) and its rule in ``episode_kind``.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping, Protocol, Sequence

from skyrl_contracts.episodes import EPISODE_RUNNERS, episode_kind
from skyrl_contracts.schema import Recipe


class EpisodeRunner(Protocol):
    """Runs the trajectories of one run. Built when the orchestrator is (user code is imported
    then, so that code that cannot load fails the process before any engine work), ``start``-ed with
    the rollout client once the engines are up, ``stop``-ped at the end."""

    # How long a group's shared first turn waits for its next trajectory (``SharedFirstTurn``'s
    # ``wait_s``); None: for all of them, which an episode kind whose first turn always comes may do.
    first_turn_wait_s: float | None
    tool_use: Any  # ``ToolUse`` where tool calls are parsed, else None

    @classmethod
    def preflight(cls, recipe: Recipe) -> None:
        """Raise ``UsageError`` naming the key for what would fail this kind's runner, checked without
        engines or a tokenizer (``backends.rollout.episodes.preflight``: before any process starts)."""

    async def start(self, client, stop_ids: Sequence[int]) -> None: ...

    async def stop(self) -> None: ...

    def check_rows(self, rows: Sequence[Mapping[str, Any]], source: str) -> None:
        """Raise ``UsageError`` naming ``source`` (``data.train``, ``data.eval``), the row and the
        field where a row lacks what this kind's episodes need: before any engine work."""

    async def trajectory(
        self, row: Mapping[str, Any], session_id: str, temperature: float, first_turn=None, index: int = 0
    ) -> tuple[list, Any]:
        """(the samples' token records, ``RolloutSession``-like, and the ``Episode``)."""

    def sample_info(self, episode, parts: Sequence) -> dict[str, float]:
        """What each sample of a trajectory carries into ``Sample.info`` (the step's metrics read it)."""

    def sample_turns(self, part, episode) -> int:
        """The model turns a sample counts (``Sample.num_turns``)."""


# The agent endpoint's FastAPI costs 0.5 s of import that a run without agents need not pay: each
# kind's module is imported when a run takes it.
RUNNERS = EPISODE_RUNNERS


def runner_class(kind: str) -> type:
    module, _, name = RUNNERS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def episode_runner(recipe: Recipe, tokenizer, judge=None) -> EpisodeRunner:
    """The runner of this recipe's episodes, its user code imported; ``judge``: ``rl.judge``'s
    ``Judge`` (single-turn episodes only: ``skyrl recipes validate`` refuses it with the others)."""
    runner = runner_class(episode_kind(recipe))
    return runner(recipe, tokenizer, judge=judge) if judge is not None else runner(recipe, tokenizer)

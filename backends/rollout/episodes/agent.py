"""Agent episodes: the recipe's agent program (``rl.agent``) against the run's OpenAI-compatible
endpoint (``backends.rollout.agents.AgentServer``), its recorded calls made into samples.

An agent run builds no environment: the agent program is its episode. Its calls per trajectory are
capped where the recipe sets ``rl.max_turns`` (``skyrl_contracts.episodes.turn_limit``).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

from backends.rollout.agents import AgentServer, run_agent, samples_from_calls
from backends.rollout.environments import Episode
from backends.rollout.rewards import load_object
from skyrl_contracts.episodes import turn_limit
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe

from .tools import tool_use

# How long the first calls of a group's agent programs wait for the group's next first call, to be
# sampled as one request (SharedFirstTurn): an agent may call late, or never.
AGENT_FIRST_CALL_WAIT_S = 0.5


def load_agent(ref: str):
    """The recipe's black-box agent (``rl.agent``): an ``async def agent(row, endpoint)``."""
    agent = load_object(ref, "rl.agent")
    if not inspect.iscoroutinefunction(agent):
        raise UsageError(f"rl.agent {ref!r} must be an async function: async def agent(row, endpoint) -> reward")
    return agent


class AgentEpisodes:
    """``EpisodeRunner`` for agent programs. ``server`` exists from ``start`` to ``stop``."""

    first_turn_wait_s = AGENT_FIRST_CALL_WAIT_S
    server_class = AgentServer  # the endpoint the trajectories call (a subclass may add routes)

    @classmethod
    def preflight(cls, recipe: Recipe) -> None:
        """Nothing before the run: the recipe's own code is imported when the orchestrator starts."""

    def __init__(self, recipe: Recipe, tokenizer):
        self.recipe, self.rl, self.tokenizer = recipe, recipe.rl, tokenizer
        self.agent = load_agent(self.rl.agent)
        self.tool_use = tool_use(recipe, tokenizer)
        self.server: AgentServer | None = None

    async def start(self, client, stop_ids: Sequence[int]) -> None:
        self.server = self.server_class(
            client,
            self.tokenizer,
            self.tool_use.parser if self.tool_use else None,
            self.rl.max_new_tokens,
            stop_ids,
            self.rl.temperature,
            max_calls=turn_limit(self.recipe),
        )
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    def check_rows(self, rows: Sequence[Mapping[str, Any]], source: str) -> None:
        return None  # the agent program reads its rows; what it cannot use is its error record

    async def trajectory(self, row: Mapping[str, Any], session_id: str, temperature: float, first_turn=None, index=0):
        """(the samples built from the agent's recorded calls, episode). Evaluation (temperature 0)
        samples every call greedily, whatever the agent asks."""
        trajectory, endpoint = self.server.open(
            session_id, temperature if temperature == 0.0 else None, first_turn, index
        )
        try:
            outcome = await run_agent(self.agent, row, endpoint, self.rl.agent_timeout_s)
        finally:
            await self.server.close(session_id)
        parts = samples_from_calls(trajectory.calls)
        error = outcome.error or (None if parts else "agent: it made no call to the endpoint")
        episode = Episode(reward=0.0 if error else outcome.reward, turns=len(trajectory.calls), done=True, error=error)
        episode.step_infos.append(outcome.info)
        return parts, episode

    def sample_info(self, episode, parts) -> dict[str, float]:
        return {"agent_calls": episode.turns, "agent_samples": len(parts), **episode.env_metric_info()}

    def sample_turns(self, part, episode) -> int:
        return part.num_turns if part is not None else episode.turns

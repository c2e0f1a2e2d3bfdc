"""What kind of episode an RL recipe runs, and the turn limit that follows from it.

One home for the rule, read by the driver's validation (``skyrl recipes validate``, every stage
command) and by the orchestrator when it starts, so the two cannot disagree. It reads values, never
which keys a recipe stated: ``recipe.resolved.json`` holds every key, so presence means nothing
there. ``rl.max_turns`` is therefore optional in the schema; unset (null) has one meaning per kind:

- ``agent`` (``rl.agent``): the agent program's calls per trajectory are not capped (its
  ``rl.agent_timeout_s`` and the engines' context length bound it); set, a call past it gets a 400;
- ``environment`` (``rl.environment``, or a built-in task whose episodes call tools): 1, and a
  tool task needs 2 or more (the call, then the answer);
- ``single_turn`` (``rl.reward``, a built-in task without tools, or the math default): one answer
  is scored per episode, so a stated limit above 1 cannot act and is refused;
- ``skyrl_gym`` (``rl.environment = "skyrl_gym:<id>"`` or ``"skyrl_gym"``): the environment's
  ``done`` ends an episode, as in SkyRL's generator; set, it also stops at the limit. The
  environment is told the limit as SkyRL tells it (``extras["max_turns"]``, 1 when unset: SkyRL's
  ``generator.max_turns`` default);
- ``verifiers`` (``rl.environment = "verifiers:<env>"``): its rollouts call the endpoint as an
  agent does, so the limit caps their calls as it caps an agent's; it is also each seat's
  verifiers ``max_turns`` (a graceful stop that is still scored).
"""

from __future__ import annotations

from typing import Literal

from skyrl_contracts.schema import Recipe, environment_library

# "module:class" of each kind's runner (``backends.rollout.episodes.EpisodeRunner``), imported
# only when a run takes it. A new kind is one module there, one entry here, and the rule in
# ``episode_kind`` that says when a recipe runs it.
EPISODE_RUNNERS: dict[str, str] = {
    "environment": "backends.rollout.episodes.environment:EnvironmentEpisodes",
    "single_turn": "backends.rollout.episodes.environment:EnvironmentEpisodes",
    "agent": "backends.rollout.episodes.agent:AgentEpisodes",
    "skyrl_gym": "backends.rollout.episodes.skyrl_gym:SkyRLGymEpisodes",
    "verifiers": "backends.rollout.episodes.verifiers:VerifiersEpisodes",
}
EpisodeKind = Literal[tuple(EPISODE_RUNNERS)]

# Built-in tasks whose episodes call a tool (backends.data.tasks: a task with an environment); light
# on purpose, the driver does not import the data layer. Their SFT evaluation has no accuracy: it
# needs the tool loop.
TASKS_WITH_TOOLS = frozenset({"lookup"})


def episode_kind(recipe: Recipe) -> EpisodeKind:
    rl = recipe.rl
    if rl.agent is not None:
        return "agent"
    library = environment_library(rl.environment)
    if library is not None:
        return library[0]
    if rl.environment is not None or (rl.reward is None and recipe.data.task in TASKS_WITH_TOOLS):
        return "environment"
    return "single_turn"


def turn_limit(recipe: Recipe) -> int | None:
    """Model turns per episode; for an agent, calls per trajectory (None: not capped)."""
    rl = recipe.rl
    if rl.max_turns is not None or episode_kind(recipe) in ("agent", "skyrl_gym", "verifiers"):
        return rl.max_turns
    return 1


def turn_problems(recipe: Recipe) -> list[tuple[tuple[str, ...], str]]:
    """(key path, message) for each turn setting that cannot act with this recipe's episodes."""
    rl = recipe.rl
    if rl is None:
        return []
    kind = episode_kind(recipe)
    limit = turn_limit(recipe)
    if kind == "environment" and rl.environment is None and limit < 2:
        return [
            (
                ("rl", "max_turns"),
                f'task = "{recipe.data.task}" takes two model turns (the tool call, then the answer); '
                "set rl.max_turns = 2",
            )
        ]
    if kind == "single_turn" and limit > 1:
        scorer = (
            f"rl.reward ({rl.reward})"
            if rl.reward
            else (f'task = "{recipe.data.task}"' if recipe.data.task else "the default math check")
        )
        return [
            (
                ("rl", "max_turns"),
                f"rl.max_turns = {limit} cannot act: {scorer} scores one answer per episode; "
                "for several turns set rl.environment (a multi-turn environment) or rl.agent",
            )
        ]
    return []

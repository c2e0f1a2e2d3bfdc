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
  is scored per episode, so a stated limit above 1 cannot act and is refused.
"""

from __future__ import annotations

from typing import Literal

from skyrl_contracts.schema import Recipe

EpisodeKind = Literal["agent", "environment", "single_turn"]

# Built-in tasks whose episodes call a tool (backends.data.tasks: a task with an environment); light
# on purpose, the driver does not import the data layer. Their SFT evaluation has no accuracy: it
# needs the tool loop.
TASKS_WITH_TOOLS = frozenset({"lookup"})


def episode_kind(recipe: Recipe) -> EpisodeKind:
    rl = recipe.rl
    if rl.agent is not None:
        return "agent"
    if rl.environment is not None or (rl.reward is None and recipe.data.task in TASKS_WITH_TOOLS):
        return "environment"
    return "single_turn"


def turn_limit(recipe: Recipe) -> int | None:
    """Model turns per episode; for an agent, calls per trajectory (None: not capped)."""
    rl = recipe.rl
    if rl.max_turns is not None or episode_kind(recipe) == "agent":
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

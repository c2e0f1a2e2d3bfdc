"""skyrl-gym episodes: an environment written for SkyRL (``skyrl_gym.envs.BaseTextEnv``), made per
trajectory as SkyRL's generator makes it, driven through the same token path as our environments.

``rl.environment = "skyrl_gym:<id>"`` names a registered id (a built-in, or one a module in
``rl.environment_modules`` registers); a row's ``env_class`` column, where present, wins, as in
SkyRL; ``rl.environment = "skyrl_gym"`` takes every row's. SkyRL-format rows are read as they are:
``prompt`` (chat messages, or a string) is handed to ``init``, and every other column but
``env_class`` (``reward_spec``, ``extra_info``, ``data_source``, ...) is the environment's
``extras``, with ``max_turns`` added as SkyRL adds it. ``env_config`` is the recipe's
``[rl.env_config.<id>]`` (an omegaconf ``DictConfig``, as SkyRL hands it, so attribute access works).

Mapping onto our episodes (``backends.rollout.environments.run_episode``): ``init`` is the reset,
``step`` returns observations (appended as non-trainable tokens), a per-step reward (summed: the
episode's reward, as SkyRL sums a trajectory's per-step rewards for outcome estimators), ``done``
and ``metadata`` (kept per step); ``get_metrics()`` and the steps' numeric metadata become the
step's ``rollout/env/<name>`` metrics; ``close`` ends every episode. A tool group runs inside the
environment's ``step``, as in SkyRL: its calls and results are the model's turns and the
observations. ``postprocessed_action`` cannot act: the tokens the model sampled are what is trained
on (SkyRL itself warns that it breaks token-in-token-out), so it is logged once and ignored.
"""

from __future__ import annotations

import copy
import difflib
import logging
from typing import Any, Mapping, Sequence

from backends.rollout.environments import Environment, StepResult
from backends.rollout.rewards import import_user_module
from skyrl_contracts.episodes import turn_limit
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe, environment_library

from .environment import EnvironmentEpisodes

log = logging.getLogger("skyrl.orchestrator")
INSTALL = 'pip install "skyrl-gym>=0.4,<0.5"'
# What SkyRL's dataset loader takes out of a row before the rest becomes the environment's extras.
NOT_EXTRAS = ("prompt", "env_class")


def import_skyrl_gym():
    try:
        import skyrl_gym  # lazy: the error below names how to install it
    except ImportError as exc:
        raise UsageError(f"rl.environment = skyrl_gym:... needs the skyrl-gym package ({INSTALL}): {exc}") from exc
    return skyrl_gym


def registered_ids() -> list[str]:
    return sorted(import_skyrl_gym().registry)


def unregistered(env_id: str, where: str) -> str:
    """The one-line reason an id is not registered, with the ids that are (closest first)."""
    ids = registered_ids()
    close = difflib.get_close_matches(env_id, ids, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return (
        f"{where}: skyrl-gym has no environment {env_id!r}; {hint}registered: {', '.join(ids)} "
        "(register your own in a module listed in rl.environment_modules)"
    )


def row_env_class(row: Mapping[str, Any], default: str) -> str:
    env_class = row.get("env_class") or default
    if not env_class:
        raise ValueError("row has no 'env_class' column and rl.environment names no skyrl-gym id")
    return str(env_class)


def prompt_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and prompt:
        return [dict(m) for m in prompt]
    raise ValueError("row needs 'prompt': chat messages (SkyRL's format) or a string")


class SkyRLGymEnvironment(Environment):
    """One skyrl-gym environment as an ``Environment``: made at ``reset`` from the row."""

    warned_postprocessed = False

    def __init__(self, default_id: str, env_config: Mapping[str, Mapping[str, Any]], max_turns: int):
        self.default_id, self.env_config, self.max_turns = default_id, env_config, max_turns
        self.env = None
        self.step_metrics: dict[str, list[float]] = {}

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        from omegaconf import OmegaConf  # lazy: skyrl-gym's own dependency, there where it is

        skyrl_gym = import_skyrl_gym()
        env_class = row_env_class(row, self.default_id)  # registered: SkyRLGymEpisodes.check_rows
        extras = {k: copy.deepcopy(v) for k, v in row.items() if k not in NOT_EXTRAS}
        extras["max_turns"] = self.max_turns
        config = OmegaConf.create(dict(self.env_config.get(env_class, {})))
        self.env = skyrl_gym.make(env_class, env_config=config, extras=extras)
        prompt, _ = self.env.init(prompt_messages(row))
        return list(prompt)

    def step(self, response: str) -> StepResult:
        out = self.env.step(response)
        if out.get("postprocessed_action") is not None and not SkyRLGymEnvironment.warned_postprocessed:
            SkyRLGymEnvironment.warned_postprocessed = True
            log.warning("skyrl-gym: postprocessed_action is ignored (the sampled tokens are trained on)")
        metadata = dict(out.get("metadata") or {})
        for key, value in metadata.items():
            if isinstance(value, (int, float)):
                self.step_metrics.setdefault(str(key), []).append(float(value))
        return StepResult(
            observation=list(out.get("observations") or []),
            reward=out["reward"],
            done=bool(out["done"]),
            info=metadata,
        )

    def metrics(self) -> Mapping[str, float]:
        merged = {key: sum(values) / len(values) for key, values in self.step_metrics.items()}
        if self.env is not None:
            merged.update(self.env.get_metrics() or {})
        return merged

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


class SkyRLGymEpisodes(EnvironmentEpisodes):
    """``EpisodeRunner`` for skyrl-gym environments: ``EnvironmentEpisodes`` over the adapter."""

    @classmethod
    def preflight(cls, recipe: Recipe) -> None:
        """The recipe's modules imported (their ``skyrl_gym.register(...)`` calls run here) and every
        id it names registered."""
        rl = recipe.rl
        for module in rl.environment_modules:
            import_user_module(module, f"rl.environment_modules ({module})")
        _, default_id = environment_library(rl.environment)
        if default_id and default_id not in import_skyrl_gym().registry:
            raise UsageError(unregistered(default_id, f"rl.environment {rl.environment!r}"))
        for env_id in rl.env_config:
            if env_id not in import_skyrl_gym().registry:
                raise UsageError(unregistered(env_id, f"rl.env_config.{env_id}"))

    def __init__(self, recipe: Recipe, tokenizer):
        rl = recipe.rl
        self.preflight(recipe)
        _, default_id = environment_library(rl.environment)
        self.default_id = default_id
        # SkyRL tells the environment generator.max_turns, 1 by default; ours is rl.max_turns.
        told = turn_limit(recipe) or 1
        super().__init__(recipe, tokenizer, make_env=lambda: SkyRLGymEnvironment(default_id, rl.env_config, told))

    def check_rows(self, rows: Sequence[Mapping[str, Any]], source: str) -> None:
        """Every row has what its environment needs before any engine work: its prompt, and an
        ``env_class`` that is registered (or the recipe's id)."""
        registry = import_skyrl_gym().registry
        for index, row in enumerate(rows):
            try:
                prompt_messages(row)
                env_class = row_env_class(row, self.default_id)
            except ValueError as err:
                raise UsageError(f"{source} row {index}: {err}") from None
            if env_class not in registry:
                raise UsageError(unregistered(env_class, f"{source} row {index}: env_class"))

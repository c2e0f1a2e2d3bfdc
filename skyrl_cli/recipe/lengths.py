"""Sequence lengths that follow the model: ``data.max_length`` and ``inference.max_model_len``.

Left unset (``None`` in the schema), each is the model's ``max_position_embeddings`` capped at
``LENGTH_CAP`` (512, the fixed default both keys had before): a model with fewer positions (a
user's own checkpoint with 256) is never asked for more than it has, and a long-context model does
not make every sequence and KV cache long by default. ``with_model_lengths`` is the one place that
fills them in; the loader calls it, so ``recipe.resolved.json`` and every backend that reads it see
concrete numbers. An explicit value above the model's limit is a recipe error naming the key
(``length_problems``), found before SFT runs rather than when vLLM refuses it in the RL stage.

The limit comes from ``model.init.max_position_embeddings`` for a new tiny model, else from the
``config.json`` of ``model.path`` (read with the json module: validation stays light). The engines
serve ``rl.init_from``, so ``inference.max_model_len`` follows that checkpoint when it is a path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from skyrl_cli.recipe.validate import Problem, resolve_path
from skyrl_contracts.schema import Recipe

LENGTH_CAP = 512


@dataclass(frozen=True)
class ModelLimit:
    positions: int | None  # None: the model does not say (no config.json, or no such key in it)
    source: str  # where the limit comes from, as error messages name it


def config_positions(model_dir: Path) -> int | None:
    """``max_position_embeddings`` of a HF model directory's ``config.json``, if it has one."""
    try:
        value = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _directory_limit(value: str, base_dir: Path) -> ModelLimit:
    config = Path(value) / "config.json"
    return ModelLimit(config_positions(resolve_path(value, base_dir)), f"max_position_embeddings in {config}")


def trained_limit(recipe: Recipe, base_dir: Path) -> ModelLimit:
    """The limit of the model the recipe trains (SFT, and the RL stage's ``init_from = "sft"``)."""
    init = recipe.model.init
    if init is not None:
        return ModelLimit(init.max_position_embeddings, "model.init.max_position_embeddings")
    return _directory_limit(recipe.model.path, base_dir)


def served_limit(recipe: Recipe, base_dir: Path) -> ModelLimit:
    """The limit of the model the engines serve: ``rl.init_from`` when it is a checkpoint path."""
    if recipe.rl is not None and recipe.rl.init_from != "sft":
        return _directory_limit(recipe.rl.init_from, base_dir)
    return trained_limit(recipe, base_dir)


def default_length(limit: ModelLimit) -> int:
    return min(limit.positions or LENGTH_CAP, LENGTH_CAP)


def with_model_lengths(recipe: Recipe, base_dir: Path | None = None) -> Recipe:
    """The recipe with unset lengths filled in from the model (explicit ones are kept); relative
    model paths resolve against ``base_dir`` (default: the current directory)."""
    base = base_dir if base_dir is not None else Path.cwd()
    data, inference = recipe.data, recipe.inference
    if data.max_length is None:
        data = data.model_copy(update={"max_length": default_length(trained_limit(recipe, base))})
    if inference.max_model_len is None:
        inference = inference.model_copy(update={"max_model_len": default_length(served_limit(recipe, base))})
    if data is recipe.data and inference is recipe.inference:
        return recipe
    return recipe.model_copy(update={"data": data, "inference": inference})


def length_problems(recipe: Recipe, base_dir: Path) -> list[Problem]:
    """Explicit lengths above the model's limit (unset ones follow it)."""
    checks = [(("data", "max_length"), recipe.data.max_length, trained_limit(recipe, base_dir))]
    if recipe.rl is not None:
        checks.append((("inference", "max_model_len"), recipe.inference.max_model_len, served_limit(recipe, base_dir)))
    return [
        Problem(path, f"{value} exceeds {limit.source} ({limit.positions})")
        for path, value, limit in checks
        if value is not None and limit.positions is not None and value > limit.positions
    ]

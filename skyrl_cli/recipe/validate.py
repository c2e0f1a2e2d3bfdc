"""Checks beyond the schema: knobs accepted but not implemented yet, files that must exist, and
resource layouts this machine cannot hold.

Each check returns ``Problem``s (a key path and a message); ``skyrl_cli.recipe.loader`` adds the
file and line. ``NOT_YET_IMPLEMENTED`` is THE list of accepted-but-unimplemented values: when a
feature lands, delete its entry here (and its broken-recipe test, if any) in the same change.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from skyrl_cli.recipe.schema import Recipe


@dataclass(frozen=True)
class Problem:
    path: tuple[str | int, ...]
    message: str


@dataclass(frozen=True)
class NotYetImplemented:
    path: str  # dotted TOML key the message points at
    applies: Callable[[Recipe], bool]
    what: str
    example: str  # a --set that triggers it (the tests use it)


NOT_YET_IMPLEMENTED: tuple[NotYetImplemented, ...] = (
    NotYetImplemented("quantization.int4_qat", lambda r: r.quantization.int4_qat, "INT4 QAT", "quantization.int4_qat=true"),
    # LoRA trains in the SFT stage; the RL learner and the engines' adapter sync do not use it yet.
    NotYetImplemented(
        "model.lora", lambda r: r.model.lora is not None and r.rl is not None, "LoRA in the RL stage", "model.lora={rank=8}"
    ),
)


def not_yet_implemented(recipe: Recipe) -> list[Problem]:
    return [
        Problem(tuple(entry.path.split(".")), f"{entry.what} is not implemented yet; remove this setting")
        for entry in NOT_YET_IMPLEMENTED
        if entry.applies(recipe)
    ]


# ----------------------------------------------------------------------------------------- files

# Keys whose string value names a local file or directory (relative to the recipe's directory),
# with the values that are keywords instead of paths.
PATH_KEYS: dict[tuple[str, ...], frozenset[str]] = {
    ("model", "path"): frozenset(),
    ("model", "tokenizer"): frozenset({"auto", "char"}),
    ("data", "train"): frozenset(),
    ("data", "eval"): frozenset(),
    ("rl", "init_from"): frozenset({"sft"}),
    ("inference", "speculative", "model"): frozenset(),
}


def _get(data: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def resolve_path(value: str, base_dir: Path) -> Path:
    return (base_dir / Path(value).expanduser()).resolve()


def missing_files(data: dict[str, Any], base_dir: Path) -> list[Problem]:
    """Path-valued keys of the raw recipe data that name nothing on disk."""
    problems = []
    for path, keywords in PATH_KEYS.items():
        value = _get(data, path)
        if isinstance(value, str) and value not in keywords and not resolve_path(value, base_dir).exists():
            problems.append(Problem(path, f"file not found: {value}"))
    return problems


def with_absolute_paths(recipe: Recipe, base_dir: Path) -> Recipe:
    """The recipe with every path-valued key resolved against ``base_dir``."""
    data = recipe.model_dump(mode="json", by_alias=True, exclude_unset=False)
    for path, keywords in PATH_KEYS.items():
        value = _get(data, path)
        if isinstance(value, str) and value not in keywords:
            _get(data, path[:-1])[path[-1]] = str(resolve_path(value, base_dir))
    return Recipe.model_validate(data)


# ------------------------------------------------------------------------------------- resources


def visible_gpu_count() -> int:
    """GPUs this process may use, without importing torch: ``CUDA_VISIBLE_DEVICES`` if set, else
    the lines of ``nvidia-smi -L`` (0 when there is no nvidia-smi or it fails)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def layout_problems(recipe: Recipe, gpu_count: int) -> list[Problem]:
    """Resource layouts that cannot run with ``gpu_count`` visible GPUs (and other impossible sizes)."""
    problems: list[Problem] = []
    trainer, inference, rl, sft = recipe.trainer, recipe.inference, recipe.rl, recipe.sft
    world_size = trainer.ranks * trainer.nnodes

    on_gpu = trainer.device == "cuda" or (trainer.device == "auto" and gpu_count > 0)
    if trainer.device == "cuda" and gpu_count == 0:
        problems.append(Problem(("trainer", "device"), 'device = "cuda" but no GPU is visible'))
    elif on_gpu:
        for gpu in trainer.gpus or ():
            if gpu >= gpu_count:
                problems.append(Problem(("trainer", "gpus"), f"GPU {gpu} does not exist ({gpu_count} visible)"))
        engine_gpus = inference.engines * inference.tensor_parallel if rl is not None else 0
        needed = trainer.ranks + engine_gpus
        if needed > gpu_count:
            problems.append(
                Problem(
                    ("trainer", "ranks"),
                    f"the layout needs {needed} GPUs ({trainer.ranks} trainer ranks + {engine_gpus} for "
                    f"{inference.engines if rl else 0} engines) but {gpu_count} {'is' if gpu_count == 1 else 'are'} visible",
                )
            )

    if sft is not None and sft.batch_size < world_size:
        problems.append(
            Problem(("sft", "batch_size"), f"{sft.batch_size} sequences cannot be split over {world_size} trainer ranks")
        )
    if rl is not None:
        sequences = rl.prompts_per_step * rl.samples_per_prompt
        if sequences < world_size:
            problems.append(
                Problem(("rl", "prompts_per_step"), f"{sequences} sequences per step cannot be split over {world_size} trainer ranks")
            )
        if rl.advantage.kind in ("grpo", "rloo") and rl.samples_per_prompt < 2:
            problems.append(
                Problem(("rl", "samples_per_prompt"), f"{rl.advantage.kind} needs at least 2 samples per prompt")
            )
        if rl.max_new_tokens >= inference.max_model_len:
            problems.append(
                Problem(
                    ("rl", "max_new_tokens"),
                    f"{rl.max_new_tokens} leaves no room for the prompt in inference.max_model_len ({inference.max_model_len})",
                )
            )
    init = recipe.model.init
    if init is not None:
        if recipe.data.max_length > init.max_position_embeddings:
            problems.append(
                Problem(
                    ("data", "max_length"),
                    f"{recipe.data.max_length} exceeds model.init.max_position_embeddings ({init.max_position_embeddings})",
                )
            )
        if rl is not None and inference.max_model_len > init.max_position_embeddings:
            problems.append(
                Problem(
                    ("inference", "max_model_len"),
                    f"{inference.max_model_len} exceeds model.init.max_position_embeddings ({init.max_position_embeddings})",
                )
            )
    return problems

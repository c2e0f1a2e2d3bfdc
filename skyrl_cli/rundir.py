"""The run directory: where it is, and the files written before anything starts.

Layout (the machine-readable contract of a run, documented in README.md):
    recipe.resolved.json   the validated recipe (aliases as TOML keys, absolute paths)
    plan.json              the LaunchPlan
    logs/<process>.log     stdout+stderr of each process
    events.jsonl           MetricEvents (skyrl_cli.metrics.events)
    summary.json           final figures (skyrl_cli.metrics.summary)
    checkpoints/step-<n>/  and final/

Every JSON file here is written atomically (``skyrl_cli.atomic``: temporary file, fsync, rename), so a
reader never sees half of one; directories (checkpoints, final/) are published whole the same way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from skyrl_cli.atomic import write_json
from skyrl_cli.errors import UsageError
from skyrl_cli.recipe.schema import Recipe

RUNS_ROOT = Path("runs")
# Files whose presence means a run already happened in a directory.
# What a previous run leaves behind (deleted by --overwrite). The RL stage's exchange folders
# (batches, weights, control) and orchestrator state are included.
_RUN_MARKERS = (
    "events.jsonl", "checkpoints", "final", "summary.json",
    "batches", "weights", "control", "orchestrator_state", "eval_initial.json",
)  # fmt: skip


def default_run_dir(recipe: Recipe, stage: str, root: Path = RUNS_ROOT) -> Path:
    return root / recipe.name / stage


def resolve_run_dir(recipe: Recipe, stage: str, run_dir: str | os.PathLike | None, root: Path = RUNS_ROOT) -> Path:
    """``--run-dir`` if given, else ``runs/<name>/<stage>``."""
    return Path(run_dir) if run_dir is not None else default_run_dir(recipe, stage, root)


def sft_output_dir(recipe: Recipe, root: Path = RUNS_ROOT) -> Path:
    """Where ``rl.init_from = "sft"`` points: the final model of this recipe's SFT stage."""
    return default_run_dir(recipe, "sft", root) / "final"


# final/ is built at this name next to it (by the SFT trainer, or by the RL driver from the last
# checkpoint) and published whole (skyrl_cli.atomic.publish_dir); the trainers delete a leftover.
FINAL_TMP = ".tmp-final"

# A checkpoint directory is complete once its trainer state is in it: the trainer writes it last
# and renames the directory into place (backends.train.checkpoint). Listed here, without torch, for
# the CLI (interruption messages, publishing final/) and for the trainers.
CHECKPOINT_STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete ``checkpoints/step-<n>/``, oldest first (numeric order)."""
    root = Path(run_dir) / "checkpoints"
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / CHECKPOINT_STATE_FILE).is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint, or ``None``."""
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def recipe_json(recipe: Recipe) -> dict[str, Any]:
    """The form of ``recipe.resolved.json``: ``Recipe.model_validate_json`` reads it back."""
    return recipe.model_dump(mode="json", by_alias=True)


def prepare_run_dir(
    run_dir: str | os.PathLike,
    recipe: Recipe,
    plan: BaseModel | dict[str, Any] | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
) -> Path:
    """Create ``run_dir`` (and ``logs/``) and write ``recipe.resolved.json`` and ``plan.json``.

    A directory that already holds a run is refused unless ``resume`` (continue it) or ``overwrite``
    (start again: the old events, summary, checkpoints and final model are deleted)."""
    run_dir = Path(run_dir)
    used = [m for m in _RUN_MARKERS if (run_dir / m).exists()]
    if used and not (resume or overwrite):
        raise UsageError(
            f"run directory {run_dir} already holds a run; pass --resume to continue it, "
            "--overwrite to start again, or --run-dir to use another directory"
        )
    if used and overwrite and not resume:
        import shutil

        for marker in used:
            target = run_dir / marker
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "recipe.resolved.json", recipe_json(recipe))
    if plan is not None:
        write_json(run_dir / "plan.json", plan.model_dump(mode="json") if isinstance(plan, BaseModel) else plan)
    return run_dir

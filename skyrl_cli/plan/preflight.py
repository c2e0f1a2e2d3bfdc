"""The episode runner's checks of a recipe, run before anything starts. A library environment
(skyrl-gym, verifiers) is imported, looked up and, for verifiers, loaded and checked for what
cannot run beside a trainer; that needs the library, so it runs in a child process
(``backends.rollout.episodes.preflight``), as the orchestrator would run it, and only for recipes
that name one: other recipes pay nothing, and the driver imports no library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe, environment_library

# Loading a verifiers environment imports the library and the user's module (about 5 s on 2 cores);
# a hub environment may install its package first.
PREFLIGHT_TIMEOUT_S = 300


def needs_preflight(recipe: Recipe) -> bool:
    return recipe.rl is not None and environment_library(recipe.rl.environment) is not None


def environment_preflight(recipe: Recipe, recipe_path: Path) -> None:
    """Raise ``UsageError`` with the runner's own one-line reason, after the recipe file's name, where
    the recipe's library environment cannot run. The recipe's folder is searched first for its
    modules, then the current directory, as the orchestrator searches them."""
    if not needs_preflight(recipe):
        return
    code_dir = recipe_path.resolve().parent
    argv = [sys.executable, "-m", "backends.rollout.episodes.preflight", "--import-path", str(code_dir)]
    try:
        done = subprocess.run(
            argv, input=recipe.model_dump_json(by_alias=True), capture_output=True, text=True,
            timeout=PREFLIGHT_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise UsageError(
            f"{recipe_path}: rl.environment {recipe.rl.environment!r}: loading it took over {PREFLIGHT_TIMEOUT_S} s"
        ) from None
    if done.returncode == 0:
        return
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    reason = lines[-1] if lines else f"exit status {done.returncode}"
    if done.returncode == 2:
        raise UsageError(f"{recipe_path}: {reason}")
    raise UsageError(f"{recipe_path}: rl.environment {recipe.rl.environment!r}: loading it failed: {reason}")

"""Tiny real RL runs for the fault tests: a random-init tiny model as ``rl.init_from`` (no SFT
stage to wait for), one engine, one learner rank, a few steps; the recipe and any user code are
written by the test into its own directory and run with the ``skyrl`` console script."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from skyrl_contracts.events import iter_events
from tests.integration.cli_runs import run_skyrl
from tests.recipes import RL, tiny_recipe, write_recipe


def tiny_rl_recipe(folder: Path, init_from: Path, rl: dict | None = None, inference: dict | None = None) -> Path:
    """``folder/faults.toml``: a 2-step RL recipe on the addition task from the model at ``init_from``."""
    recipe = tiny_recipe(
        RL,
        name="faults",
        seed=0,
        data={"digits": 1, "eval_size": 8},
        rl={"init_from": str(init_from), "steps": 2, **(rl or {})},
        inference={"max_num_seqs": 16, **(inference or {})},
        trainer={"ranks": 1, "zero_stage": None},
    )
    return write_recipe(folder / "faults.toml", recipe)


def write_module(folder: Path, name: str, source: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(source))


def run(recipe: Path, *sets: str, check: bool = True, timeout: float = 420):
    """``skyrl rl RECIPE --quiet`` from the recipe's folder; the run directory is ``folder/run``."""
    args = [a for s in sets for a in ("--set", s)]
    return run_skyrl(
        "rl",
        recipe,
        *args,
        "--run-dir",
        recipe.parent / "run",
        "--quiet",
        cwd=recipe.parent,
        check=check,
        timeout=timeout,
    )


def last_metric(run_dir: Path, name: str) -> float | None:
    values = [e.value for e in iter_events(run_dir / "events.jsonl") if e.name == name]
    return values[-1] if values else None


def sample_errors(run_dir: Path) -> list[dict]:
    path = run_dir / "sample_errors.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

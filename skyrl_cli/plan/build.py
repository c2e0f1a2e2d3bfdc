"""``build_plan``: recipe + stage + CLI flags + machine facts -> ``LaunchPlan`` (pure; starts nothing).

Each stage has one planner in ``STAGE_PLANNERS``; the SFT stage is a single torchrun job. The RL
stage's planner (engines, router, orchestrator, trainer) is ``skyrl_cli.plan.rl``; it reuses
``skyrl_cli.plan.inference`` and ``skyrl_cli.plan.trainer``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from skyrl_cli.plan.feasibility import assert_feasible
from skyrl_cli.plan.machine import MachineFacts, detect_machine
from skyrl_cli.plan.model import LaunchPlan, PoolAttachment
from skyrl_cli.plan.pool import plan_pool
from skyrl_cli.plan.quantize import plan_quantize
from skyrl_cli.plan.rl import plan_rl
from skyrl_cli.plan.tinker import plan_tinker
from skyrl_cli.plan.trainer import trainer_resources, trainer_spec, world_size
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe

# (recipe, run_dir, resume, async_mode, machine, recipe_dir) -> plan. ``recipe_dir``: the recipe
# file's directory, where user code (rl.reward / rl.environment) is imported from first.
Planner = Callable[[Recipe, Path, bool, bool, MachineFacts, "Path | None"], LaunchPlan]


def plan_sft(
    recipe: Recipe, run_dir: Path, resume: bool, async_mode: bool, machine: MachineFacts, recipe_dir: Path | None = None
) -> LaunchPlan:
    if recipe.sft is None:
        raise UsageError("the recipe has no [sft] section")
    resources = trainer_resources(recipe, machine)
    trainer = trainer_spec(recipe, run_dir, machine, module="backends.train.sft", resume=resume, resources=resources)
    return LaunchPlan(
        stage="sft",
        run_dir=str(run_dir),
        device=resources.device,
        resume=resume,
        world_size=world_size(recipe),
        processes=(trainer,),
    )


def _plan_rl(
    recipe: Recipe, run_dir: Path, resume: bool, async_mode: bool, machine: MachineFacts, recipe_dir: Path | None = None
) -> LaunchPlan:
    return plan_rl(recipe, run_dir, resume, async_mode, machine, recipe_dir=recipe_dir)


def _plan_tinker(
    recipe: Recipe, run_dir: Path, resume: bool, async_mode: bool, machine: MachineFacts, recipe_dir: Path | None = None
) -> LaunchPlan:
    return plan_tinker(recipe, run_dir, machine)[0]


def _plan_quantize(
    recipe: Recipe, run_dir: Path, resume: bool, async_mode: bool, machine: MachineFacts, recipe_dir: Path | None = None
) -> LaunchPlan:
    return plan_quantize(recipe, run_dir, resume, machine)


def _plan_pool(
    recipe: Recipe, run_dir: Path, resume: bool, async_mode: bool, machine: MachineFacts, recipe_dir: Path | None = None
) -> LaunchPlan:
    return plan_pool(recipe, run_dir, machine, async_mode)


STAGE_PLANNERS: dict[str, Planner] = {
    "sft": plan_sft,
    "rl": _plan_rl,
    "tinker": _plan_tinker,
    "quantize": _plan_quantize,
    "pool": _plan_pool,  # skyrl engines up: a pool's folder in place of a run directory
}


def build_plan(
    recipe: Recipe,
    stage: str,
    run_dir: str | Path,
    resume: bool = False,
    async_mode: bool = False,
    machine: MachineFacts | None = None,
    recipe_dir: str | Path | None = None,
    pool: PoolAttachment | None = None,
) -> LaunchPlan:
    """The launch plan of ``stage``; ``machine`` defaults to this host's detected facts.
    ``recipe_dir``: the recipe file's directory (user code is imported from there first). A recipe
    this machine cannot run raises ``UsageError`` (``skyrl_cli.plan.feasibility``). ``pool``: the
    RL stage uses that engine pool's engines and router."""
    if stage not in STAGE_PLANNERS:
        raise UsageError(f"no planner for stage {stage!r}")
    if machine is None:
        machine = detect_machine()
    # The loader has run these checks with the same facts; this only guards a recipe built in code.
    assert_feasible(recipe, machine)
    code_dir = Path(recipe_dir).resolve() if recipe_dir is not None else None
    if pool is not None:
        if stage != "rl":
            raise UsageError(f"engine pools serve RL runs, not {stage}")

        return plan_rl(recipe, Path(run_dir).resolve(), resume, async_mode, machine, code_dir, pool=pool)
    return STAGE_PLANNERS[stage](recipe, Path(run_dir).resolve(), resume, async_mode, machine, code_dir)

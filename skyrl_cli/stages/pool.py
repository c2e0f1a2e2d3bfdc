"""RL on this machine with the engines of a running pool (``skyrl engines up``; ``skyrl rl --pool``).

The run takes the pool's lock for its whole length, loads its initial weights into the pool's
engines, starts its learner and orchestrator on the pool's warm ones when they fit, and leaves the
engines and the router running when it ends (``skyrl_cli.engines.pool`` is the pool itself).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from skyrl_cli.engines.pool import check_attached_model, choose_pool, leased
from skyrl_cli.engines.stack import attach_inference
from skyrl_cli.engines.standby import misfit, start_warm
from skyrl_cli.plan.pool import WARM_NAMES
from skyrl_cli.plan.rl import init_model_dir
from skyrl_contracts.errors import UsageError

if TYPE_CHECKING:
    from skyrl_cli.stages.request import StageRequest


def refuse_across_nodes(request: StageRequest) -> None:
    """A run across nodes starts its own engines: naming a pool there is a mistake, not a choice."""
    if request.pool not in ("auto", "none"):
        raise UsageError(
            f"--pool {request.pool}: engine pools are one machine's; a run across nodes starts its own engines"
        )


def pick_pool(requested: str, recipe, own_plan):
    """The engine pool the run uses (``skyrl_cli.engines.pool.choose_pool``) and, for --dry-run,
    why each other pool does not fit."""
    return choose_pool(requested, own_plan, recipe.inference.engines, init_model_dir(recipe))


def explain_choice(pool, not_fitting: list[str], plan) -> None:
    """For --dry-run: why the other pools do not fit, and what the chosen one serves the run."""
    using = f"using engine pool {pool.name} ({pool.path}); {pool_warm_use(pool, plan)}" if pool else None
    for line in [*not_fitting, using]:
        if line:
            typer.echo(line, err=True)


def pool_warm_use(pool, plan) -> str:
    """For --dry-run: which of the run's processes would go to the pool's warm ones, and why not."""
    words = []
    states = pool.warm_state()
    for spec in plan.processes:
        if spec.role not in WARM_NAMES:
            continue
        keeper = pool.warm.get(spec.role)
        why = "the pool keeps none" if keeper is None else misfit(keeper.spec, spec)
        words.append(f"{spec.name}: " + (f"its own ({why})" if why else f"the pool's warm one ({states[spec.role]})"))
    return "; ".join(words)


def held(pool, run_dir: Path):
    """The pool's lock for the run (a busy pool is refused in one line), or nothing without a pool."""
    return leased(pool, run_dir) if pool is not None else contextlib.nullcontext()


def attach_engines(supervisor, pool, recipe, plan, directory: Path, *, writer, step_fn, progress):
    """The pool's engines and router in place of the run's own (``attach_inference``), once the
    initial weights are loaded into them; the jobs that start beside the engines start meanwhile."""
    progress.phase = f"loading the initial weights into engine pool {pool.name}"
    attach_checks(pool, recipe)
    for spec in plan.start_order().beside_engines:  # the learner's start-up overlaps the weight load
        start_on_pool(supervisor, spec, pool)
    remote = [u for u in plan.engine_urls if u not in pool.engine_urls]
    return attach_inference(supervisor, pool, remote, directory, writer=writer, step_fn=step_fn)


def start_on_pool(supervisor, spec, pool) -> None:
    """A run's process on a pool: the learner and the orchestrator go to the pool's warm ones
    when they fit (``skyrl_cli.engines.standby``), everything else starts."""
    if pool is not None and spec.role in pool.warm:
        start_warm(supervisor, spec, pool.warm[spec.role].spec, pool.warm_folder(spec.role))
    else:
        supervisor.start(spec)


def attach_checks(pool, recipe) -> None:
    """What the pool's fit could not check before the SFT stage that ran first wrote the model."""
    check_attached_model(pool, init_model_dir(recipe))

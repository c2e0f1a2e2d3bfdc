"""`skyrl doctor [RECIPE]`: pre-flight checks of this machine (and of the recipe's layout on it),
one pass / fail line each with the fix; exit code 1 when any failed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Iterator, Optional

import typer

from skyrl_cli.commands import common
from skyrl_contracts.errors import SkyrlError

if TYPE_CHECKING:
    from skyrl_cli.doctor.checks import Check
    from skyrl_cli.plan.machine import MachineFacts
    from skyrl_contracts.schema import Recipe

# The recipe the smoke test takes its engine settings from when none is given.
SMOKE_RECIPE = "quickstart"
# vLLM starts in about 20 s on an idle 2-core machine (benchmarks/bench_engine_start.py); the whole
# smoke test took 141 s on one at load average 11. A run's plan waits up to 600 s for an engine.
SMOKE_TIMEOUT_S = 300.0


def _fixed_ports(recipe: Recipe) -> list[tuple[str, int]]:
    """Ports the recipe itself names (the planner picks the others free)."""
    fixed = [("router", recipe.inference.router.port)] if recipe.rl is not None and recipe.inference.router.port else []
    return fixed + ([("tinker server", recipe.tinker.port)] if recipe.tinker is not None else [])


def _ports(recipe: Recipe, machine: MachineFacts, layout_fits: bool) -> list[Check]:
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.doctor import layout

    if layout_fits:
        return layout.check_ports(recipe, machine)
    # Without a plan (the layout does not fit) the ports the recipe fixes are still checked.
    return layout.check_ports(recipe, machine, ports=_fixed_ports(recipe))


def recipe_checks(recipe: Recipe, machine: MachineFacts, base_dir: Path, quick: bool) -> Iterator[Check]:
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.doctor import layout, network
    from skyrl_cli.doctor.checks import skipped
    from skyrl_cli.plan.machine import gpu_memory
    from skyrl_contracts.rundir import RUNS_ROOT

    fits = layout.check_layout(recipe, machine, base_dir)
    yield from fits
    layout_fits = not any(check.failed for check in fits)
    if layout_fits:
        gpus = gpu_memory() if machine.gpus else []
        yield from layout.check_gpu_memory(recipe, machine, gpus)
        yield from layout.check_estimates(recipe, machine, base_dir, gpus)
    yield from _ports(recipe, machine, layout_fits)
    yield layout.check_disk(recipe, base_dir, RUNS_ROOT)
    if quick:
        yield skipped("collectives", "not checked (--quick)")
    elif layout_fits:
        yield network.check_collectives(recipe, machine)
    yield from network.check_rendezvous(recipe)
    yield from network.check_remote_engines(recipe)


def all_checks(
    recipe_arg: str | None, sets: list[str] | None, smoke: bool, smoke_timeout: float, quick: bool
) -> Iterator[Check]:
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.doctor.checks import skipped
    from skyrl_cli.doctor.environment import environment_checks
    from skyrl_cli.doctor.smoke import check_engine_smoke
    from skyrl_cli.plan.feasibility import feasibility_problems
    from skyrl_cli.plan.machine import detect_machine
    from skyrl_cli.recipe.loader import load_recipe
    from skyrl_cli.recipe.registry import resolve_recipe_arg

    machine = detect_machine()
    recipe = base_dir = None
    if recipe_arg is not None or smoke:  # a broken recipe is a usage error (exit 2), before any check
        path = resolve_recipe_arg(recipe_arg or SMOKE_RECIPE)
        recipe, base_dir = load_recipe(path, sets or ()), path.resolve().parent
    yield from environment_checks(len(machine.gpus), with_starts=not quick)
    if recipe_arg is not None:
        yield from recipe_checks(recipe, machine, base_dir, quick)
    if smoke:
        if feasibility_problems(recipe, machine, base_dir):
            yield skipped("engine smoke test", "not run: the recipe's layout does not fit this machine (see above)")
        else:
            yield check_engine_smoke(recipe, machine, base_dir, smoke_timeout)


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    def doctor(
        recipe: Annotated[
            Optional[str],
            typer.Argument(help="Recipe TOML file or built-in name to check this machine against.", metavar="RECIPE"),
        ] = None,
        set_: common.SetOpt = None,
        smoke: Annotated[
            bool, typer.Option("--smoke", help="Also start one real vLLM engine on the recipe's model and generate.")
        ] = False,
        smoke_timeout: Annotated[
            float, typer.Option("--smoke-timeout", min=1, help="Seconds the smoke test may take.")
        ] = SMOKE_TIMEOUT_S,
        quick: Annotated[
            bool, typer.Option("--quick", help="Skip the checks that start Python children (imports, gloo/NCCL).")
        ] = False,
        json_: Annotated[bool, typer.Option("--json", help="One JSON object per check.")] = False,
    ) -> None:
        """Pre-flight checks of this machine and the recipe's layout on it: one pass / fail line each, with the fix.

        Python and packages against the tested set, GPUs and their memory against the recipe's layout, its ports, disk space for its checkpoints, that DeepSpeed, vLLM and vllm-router import and start, gloo / NCCL and the recipe's hosts. Exit code 1 when any failed.
        """  # one line a paragraph: typer's rich help keeps a docstring's line breaks

        checks = []
        for check in all_checks(recipe, set_, smoke, smoke_timeout, quick):
            checks.append(check)
            typer.echo(json.dumps(check.as_dict()) if json_ else check.line())
        bad = [check.name for check in checks if check.failed]
        if bad:
            raise SkyrlError(
                f"{len(bad)} of {len(checks)} checks failed ({', '.join(dict.fromkeys(bad))}); the fix is under each"
            )
        if not json_:
            typer.echo(f"doctor: all {len(checks)} checks passed or did not apply")

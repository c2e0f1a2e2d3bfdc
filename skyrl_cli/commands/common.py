"""What every run command (``skyrl sft``, ``skyrl rl``, ``skyrl quantize``, ...) shares.

Options, as Typer ``Annotated`` types to put in a command's signature::

    from skyrl_cli.commands import common

    @app.command("sft")
    def sft(
        recipe: common.RecipeArg,
        set_: common.SetOpt = None,
        run_dir: common.RunDirOpt = None,
        dry_run: common.DryRunOpt = False,
        resume: common.ResumeOpt = False,
        overwrite: common.OverwriteOpt = False,
        quiet: common.QuietOpt = False,
        json_: common.JsonOpt = False,
        node_rank: common.NodeRankOpt = None,
        slurm: common.SlurmOpt = False,
    ) -> None:
        from skyrl_cli.stages.dispatch import run_stage

        # The recipe loaded and checked against this host (RecipeError: exit 2), the run directory
        # (--run-dir or runs/<name>/sft) and the output mode, for the stage layer to run.
        request = common.stage_request("sft", recipe, set_, run_dir, quiet=quiet, json_=json_, dry_run=dry_run,
                                       resume=resume, overwrite=overwrite, node_rank=node_rank, slurm=slurm)
        run_stage(request)  # skyrl_cli.stages: --slurm, this node's share across nodes, or this machine

A command that runs no ``Stage`` loads with ``load_for_run`` and ``run_dir_for`` itself, prints
``--dry-run`` with ``print_plan`` and runs a one-job plan with ``run_job`` (``skyrl quantize``).
Output modes (``skyrl_cli.stages.output``): "live" (rich live view on stderr + summary table),
"quiet" (summary table only), "json" (events as JSON lines on stdout, then ``{"summary": ...}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

# The stage layer's, under the names the commands use.
from skyrl_cli.stages.job import run_job as run_job
from skyrl_cli.stages.output import OutputMode
from skyrl_cli.stages.output import output_sinks as output_sinks
from skyrl_cli.stages.output import print_plan as print_plan
from skyrl_contracts.errors import UsageError

if TYPE_CHECKING:  # pydantic stays out of `skyrl --help`
    from skyrl_cli.plan.machine import MachineFacts
    from skyrl_cli.stages.request import StageRequest
    from skyrl_contracts.schema import Recipe

RecipeArg = Annotated[str, typer.Argument(help="Recipe TOML file, or the name of a built-in recipe.", metavar="RECIPE")]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--set", help="Override a recipe value, e.g. --set sft.steps=10 (repeatable).", metavar="KEY.PATH=VALUE"
    ),
]
RunDirOpt = Annotated[Optional[Path], typer.Option("--run-dir", help="Run directory (default: runs/<name>/<stage>).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the launch plan and exit; start nothing.")]
ResumeOpt = Annotated[
    bool, typer.Option("--resume", help="Continue from the newest complete checkpoint in the run directory.")
]
OverwriteOpt = Annotated[
    bool, typer.Option("--overwrite", help="Start again in a run directory that holds a previous run (deletes it).")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No live view; print the final summary only.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print metric events as JSON lines on stdout (for scripts).")]
GpusOpt = Annotated[
    Optional[int], typer.Option("--gpus", min=0, help="GPUs to check the layout against (default: those visible here).")
]
NodeRankOpt = Annotated[
    Optional[int],
    typer.Option(
        "--node-rank",
        min=0,
        help="This node's rank in a run across nodes (the recipe's cluster section); default: Slurm's SLURM_NODEID, else 0.",
    ),
]
SlurmOpt = Annotated[
    bool,
    typer.Option(
        "--slurm",
        help="Write an sbatch script that runs this command on every node of the recipe's cluster layout and submit it "
        "(with --dry-run: print it).",
    ),
]


def load_for_run(
    recipe: str,
    sets: list[str] | None,
    stage: str | None,
    gpu_count: int | None = None,
    machine: MachineFacts | None = None,
    preflight: bool = False,
) -> Recipe:
    """Resolve the recipe argument (file or built-in name), load it with the ``--set`` overrides and
    check that it has the section of the stage the command runs (``STAGE_SECTIONS``; other
    stages and ``None`` check nothing). The layout is checked against ``machine`` (give the one
    the plan is built for), else this host with ``gpu_count`` GPUs (``None``: the visible ones).
    ``preflight``: also the episode runner's checks of a library environment (a child process)."""
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.plan.feasibility import load_feasible_recipe
    from skyrl_cli.plan.preflight import environment_preflight
    from skyrl_cli.recipe.registry import resolve_recipe_arg

    path = resolve_recipe_arg(recipe)
    loaded = load_feasible_recipe(path, sets or (), gpu_count=gpu_count, machine=machine)
    section = STAGE_SECTIONS.get(stage or "")
    if section and getattr(loaded, section) is None:
        raise UsageError(f"recipe {path} has no [{section}] section")
    if preflight:
        environment_preflight(loaded, path)
    return loaded


# The recipe section each run command needs.
STAGE_SECTIONS = {"sft": "sft", "rl": "rl", "quantize": "quantization"}


def recipe_dir(recipe: str) -> Path:
    """The directory of the recipe argument's file: relative paths and user code are found there."""
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.recipe.registry import resolve_recipe_arg

    return resolve_recipe_arg(recipe).resolve().parent


def run_dir_for(recipe: Recipe, stage: str, run_dir: Path | None) -> Path:
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_contracts.rundir import resolve_run_dir

    return resolve_run_dir(recipe, stage, run_dir)


def output_mode(quiet: bool, json_: bool) -> OutputMode:
    if quiet and json_:
        raise UsageError("--quiet and --json exclude each other")
    return "json" if json_ else "quiet" if quiet else "live"


def stage_request(
    stage: str,
    recipe: str,
    sets: list[str] | None,
    run_dir: Path | None,
    *,
    quiet: bool,
    json_: bool,
    **options,
) -> StageRequest:
    """What ``skyrl sft|rl`` hands ``skyrl_cli.stages.dispatch.run_stage``: the recipe loaded and
    checked against this host, its run directory and the output mode; ``options``: the rest of the
    command's options (``StageRequest``'s fields)."""
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.plan.machine import detect_machine
    from skyrl_cli.stages.request import StageRequest

    mode = output_mode(quiet, json_)
    machine = detect_machine()  # one look at the host: validation and the plan see the same facts
    loaded = load_for_run(recipe, sets, stage, machine=machine, preflight=stage == "rl")
    return StageRequest(
        stage=stage,
        recipe_arg=recipe,
        sets=sets,
        recipe=loaded,
        machine=machine,
        directory=run_dir_for(loaded, stage, run_dir).resolve(),
        code_dir=recipe_dir(recipe),
        mode=mode,
        **options,
    )

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
    ) -> None:
        mode = common.output_mode(quiet, json_)
        machine = detect_machine()  # skyrl_cli.plan.machine: validation and the plan see the same facts
        loaded = common.load_for_run(recipe, set_, "sft", machine=machine)  # RecipeError (exit 2)
        directory = common.run_dir_for(loaded, "sft", run_dir).resolve()  # --run-dir or runs/<name>/sft
        plan = build_plan(loaded, "sft", directory, resume=resume, machine=machine)
        if dry_run:
            common.print_plan(plan, json_)
            return
        summary = run_sft(loaded, plan, directory, mode, resume=resume, overwrite=overwrite)
        # run_sft: RunDir(directory).prepare(...), common.output_sinks(mode, ...), the supervisor
        # starting the plan, and FollowedRun feeding the sinks until the trainer exits

Output modes: "live" (rich live view on stderr + summary table), "quiet" (summary table only),
"json" (events as JSON lines on stdout, then ``{"summary": ...}``). W&B is added in every mode when
the recipe's ``[logging.wandb]`` asks for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Optional

import typer

from skyrl_contracts.errors import UsageError

if TYPE_CHECKING:  # pydantic stays out of `skyrl --help`
    from skyrl_cli.plan.machine import MachineFacts
    from skyrl_contracts.schema import Recipe

OutputMode = Literal["live", "quiet", "json"]

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


def load_for_run(
    recipe: str,
    sets: list[str] | None,
    stage: str | None,
    gpu_count: int | None = None,
    machine: MachineFacts | None = None,
) -> Recipe:
    """Resolve the recipe argument (file or built-in name), load it with the ``--set`` overrides and
    check that it has the section of the stage the command runs (``STAGE_SECTIONS``; other
    stages and ``None`` check nothing). The layout is checked against ``machine`` (give the one
    the plan is built for), else this host with ``gpu_count`` GPUs (``None``: the visible ones)."""
    from skyrl_cli.plan.feasibility import load_feasible_recipe
    from skyrl_cli.recipe.registry import resolve_recipe_arg

    path = resolve_recipe_arg(recipe)
    loaded = load_feasible_recipe(path, sets or (), gpu_count=gpu_count, machine=machine)
    section = STAGE_SECTIONS.get(stage or "")
    if section and getattr(loaded, section) is None:
        raise UsageError(f"recipe {path} has no [{section}] section")
    return loaded


# The recipe section each run command needs.
STAGE_SECTIONS = {"sft": "sft", "rl": "rl", "quantize": "quantization"}


def recipe_dir(recipe: str) -> Path:
    """The directory of the recipe argument's file: relative paths and user code are found there."""
    from skyrl_cli.recipe.registry import resolve_recipe_arg

    return resolve_recipe_arg(recipe).resolve().parent


def run_dir_for(recipe: Recipe, stage: str, run_dir: Path | None) -> Path:
    from skyrl_contracts.rundir import resolve_run_dir

    return resolve_run_dir(recipe, stage, run_dir)


def output_mode(quiet: bool, json_: bool) -> OutputMode:
    if quiet and json_:
        raise UsageError("--quiet and --json exclude each other")
    return "json" if json_ else "quiet" if quiet else "live"


def output_sinks(mode: OutputMode, recipe: Recipe, run_dir: Path, title: str):
    """The sinks for an output mode, plus W&B if the recipe enables it (a ``SinkGroup``)."""
    from skyrl_cli.metrics.live import LiveView
    from skyrl_cli.metrics.sinks import JsonLinesSink, SinkGroup, SummaryPrinter
    from skyrl_cli.metrics.wandb_sink import wandb_sink_for
    from skyrl_contracts.rundir import recipe_json

    printer = SummaryPrinter(run_dir=run_dir)
    sinks = {"live": [LiveView(title), printer], "quiet": [printer], "json": [JsonLinesSink()]}[mode]
    wandb = wandb_sink_for(recipe.logging.wandb, f"{recipe.name}-{title}", run_dir, recipe_json(recipe))
    return SinkGroup(sinks + ([wandb] if wandb else []))


def print_plan(plan, json_: bool = False) -> None:
    """``--dry-run`` output: the plan as JSON (``--json``) or indented JSON for people."""
    data = plan.model_dump(mode="json") if hasattr(plan, "model_dump") else plan
    typer.echo(json.dumps(data) if json_ else json.dumps(data, indent=2))


def run_job(
    recipe: Recipe,
    plan,
    directory: Path,
    mode: OutputMode,
    *,
    stage: str,
    summary_extra: dict,
    resume: bool,
    overwrite: bool,
    interrupt_hints: dict | None = None,
    prepared: bool = False,
    watch=None,
) -> dict:
    """Run a one-job plan (the SFT trainer, the quantizer): prepare the run directory, start the job
    under the supervisor, follow its events live, write summary.json (with ``summary_extra``). A
    failed job raises ``LaunchError`` with the end of its log, a stop signal ``RunInterrupted``
    (``interrupt_hints``: what its message tells the user to run next). ``prepared``: the caller
    prepared the run directory (node 0 of a run across nodes, before the others join); ``watch``:
    called at every tick (``skyrl_cli.launch.nodes.Rendezvous.check``: a dead node ends the job)."""
    import time

    from skyrl_cli.launch.interrupts import reported
    from skyrl_cli.launch.supervisor import Supervisor, job_failure
    from skyrl_cli.metrics.follow import FollowedRun
    from skyrl_contracts.errors import LaunchError
    from skyrl_contracts.rundir import RunDir

    if not prepared:
        RunDir(directory).prepare(recipe, plan, resume=resume, overwrite=overwrite)
    sinks = output_sinks(mode, recipe, directory, title=stage)
    (spec,) = plan.processes
    started, started_at = time.monotonic(), time.time()
    with reported(stage, directory, **(interrupt_hints or {})), Supervisor(directory) as supervisor:
        proc = supervisor.start(spec)
        extra = {"stage": stage, "started_at": started_at, **summary_extra}
        with FollowedRun(directory, sinks, summary_extra=extra) as run:

            def tick() -> None:
                run.poll()
                if watch is not None:
                    watch()

            code = supervisor.wait_job(spec.name, on_tick=tick)
            run.summary_extra["wall_s"] = round(time.monotonic() - started, 1)
            if code != 0:
                raise LaunchError(job_failure(spec.role, code, proc.log_path))
    return run.summary or {}

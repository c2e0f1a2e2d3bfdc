"""What a running stage prints: the output modes and their sinks, the ``--dry-run`` plan, progress lines.

Output modes: "live" (rich live view on stderr + summary table), "quiet" (summary table only),
"json" (events as JSON lines on stdout, then ``{"summary": ...}``). W&B is added in every mode when
the recipe's ``[logging.wandb]`` asks for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import typer

if TYPE_CHECKING:  # pydantic stays out of `skyrl --help`
    from skyrl_contracts.schema import Recipe

OutputMode = Literal["live", "quiet", "json"]


def output_sinks(mode: OutputMode, recipe: Recipe, run_dir: Path, title: str):
    """The sinks for an output mode, plus W&B if the recipe enables it (a ``SinkGroup``)."""
    # lazy: skyrl --help imports this module; these stay out of it
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


def print_estimates(recipe: Recipe, machine, base_dir: Path) -> None:
    """``--dry-run`` output for people, on stderr (stdout is the plan's JSON): the memory of each
    process of the recipe as written on this host and, on a GPU type the roofline knows, the step time."""
    # lazy: skyrl --help imports this module; these stay out of it
    from skyrl_cli.plan.fit_text import hardware_here, recipe_estimates
    from skyrl_cli.plan.machine import gpu_memory

    hardware = hardware_here(recipe, machine, gpu_memory() if machine.gpus else [])
    lines, _ = recipe_estimates(recipe, hardware, machine, base_dir, propose=False)
    for line in lines:
        typer.echo(line, err=True)


def say(mode: OutputMode, line: str, always: bool = False) -> None:
    """A progress line on stderr; ``--json`` keeps stderr for errors unless ``always``."""
    if mode != "json" or always:
        typer.echo(line, err=True)

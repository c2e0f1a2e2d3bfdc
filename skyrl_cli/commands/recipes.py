"""`skyrl recipes ...`: list, show, copy, validate and export the schema of recipes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Annotated, Optional

import typer

from skyrl_cli.commands import common
from skyrl_cli.plan.roofline import DEFAULT_GPU_TYPE, GPU_TYPES
from skyrl_contracts.errors import RecipeError, UsageError


def ls() -> None:
    """List the built-in recipes: stages, hardware, time and expected result."""
    # lazy: rich; skyrl recipes validate and completions stay light
    from rich.console import Console
    from rich.table import Table

    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.recipe.registry import builtin_recipes

    table = Table(title="built-in recipes (skyrl recipes show NAME)")
    for column in ("name", "stages", "hardware", "time", "expected"):
        table.add_column(column, overflow="fold")
    for recipe in builtin_recipes():
        table.add_row(recipe.name, " + ".join(recipe.stages), recipe.hardware, recipe.time, recipe.expected)
    Console().print(table)


def show(name: Annotated[str, typer.Argument(help="Built-in recipe name.")]) -> None:
    """Print a built-in recipe's TOML."""
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.recipe.registry import builtin_path

    typer.echo(builtin_path(name).read_text(encoding="utf-8"), nl=False)


def cp(
    name: Annotated[str, typer.Argument(help="Built-in recipe name.")],
    dest: Annotated[Path, typer.Argument(help="Destination file (or directory).")],
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing file.")] = False,
) -> None:
    """Copy a built-in recipe to DEST to edit it (with its folder of data and code, if it has one)."""
    typer.echo(copy_recipe(name, dest, force))


GpuMemoryOpt = Annotated[
    Optional[float],
    typer.Option(
        "--gpu-memory",
        min=0.1,
        metavar="GIB",
        help="Memory of each GPU in GiB: print the memory and step-time estimates, refuse what does not fit, "
        "and propose the splits of --gpus GPUs that do (default with --gpu-type: that type's).",
    ),
]
GpuTypeOpt = Annotated[
    Optional[str],
    typer.Option(
        "--gpu-type",
        metavar="TYPE",
        help=f"GPU type of the step-time roofline: {', '.join(GPU_TYPES)} (default {DEFAULT_GPU_TYPE}); "
        "also sets --gpu-memory when that is not given.",
    ),
]


def validate(
    files: Annotated[list[str], typer.Argument(help="Recipe files (or built-in names).")],
    set_: common.SetOpt = None,
    gpus: common.GpusOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    gpu_type: GpuTypeOpt = None,
) -> None:
    """Check recipes and report every problem at once as file:line: key.path: message (exit 2).

    With --gpu-memory or --gpu-type: also the memory of every process, the step time on paper, what does not fit, and the splits that do.
    """  # one line a paragraph: typer's rich help keeps a docstring's line breaks
    problems: list[str] = []
    for file in files:
        try:
            if gpu_memory is not None or gpu_type is not None:
                _sized(file, set_, gpus, gpu_memory, gpu_type)
            else:
                common.load_for_run(file, set_, stage=None, gpu_count=gpus, preflight=True)
        except RecipeError as err:
            problems += err.problems
        except UsageError as err:
            problems.append(str(err))
        else:
            typer.echo(f"ok: {file}")
    if problems:
        raise RecipeError(problems)


# A machine with GPUs enough for any layout: the recipe is loaded against it, and then its layout is
# checked against the machine asked about (with the estimates, and proposals even when it does not fit).
ANY_LAYOUT_GPUS = 1024


def _sized(file: str, sets: list[str] | None, gpus: int | None, gpu_memory: float | None, gpu_type: str | None) -> None:
    """``validate --gpu-memory/--gpu-type``: the estimates and proposals printed, then what does not
    fit the machine raised as recipe problems."""
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.plan.feasibility import feasibility_problems
    from skyrl_cli.plan.fit import Hardware
    from skyrl_cli.plan.fit_text import recipe_estimates
    from skyrl_cli.plan.machine import detect_machine
    from skyrl_cli.plan.memory import GIB
    from skyrl_cli.plan.roofline import gpu_type_named
    from skyrl_cli.plan.trainer import trainer_device
    from skyrl_cli.recipe.loader import format_problems
    from skyrl_cli.recipe.registry import resolve_recipe_arg

    kind = gpu_type_named(gpu_type or DEFAULT_GPU_TYPE)
    if kind is None or (gpu_type is not None and gpu_type.lower() not in GPU_TYPES):
        raise UsageError(f"--gpu-type {gpu_type}: not a GPU type of the roofline ({', '.join(GPU_TYPES)})")
    machine = detect_machine(gpus)
    if not machine.gpus:
        raise UsageError("--gpu-memory and --gpu-type size a GPU machine: give --gpus N (none is visible here)")
    recipe = common.load_for_run(file, sets, stage=None, gpu_count=ANY_LAYOUT_GPUS, preflight=True)
    memory = gpu_memory if gpu_memory is not None else GPU_TYPES[kind].memory_gib
    hardware = Hardware(len(machine.gpus), int(memory * GIB), GPU_TYPES[kind], trainer_device(recipe, machine))
    path = resolve_recipe_arg(file)
    lines, misfits = recipe_estimates(recipe, hardware, machine, path.resolve().parent, propose=True)
    for line in lines:
        typer.echo(line)
    problems = feasibility_problems(recipe, machine, path.resolve().parent) + misfits
    if problems:
        raise RecipeError(format_problems(path, sets or (), problems))


def schema() -> None:
    """Print the JSON Schema of a recipe (for editor completion of TOML files)."""
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_contracts.schema import Recipe

    typer.echo(json.dumps(Recipe.model_json_schema(by_alias=True), indent=2))


def register(app: typer.Typer) -> None:
    sub = typer.Typer(help="Built-in recipes, recipe validation and the recipe JSON Schema.", no_args_is_help=True)
    for name, command in (("ls", ls), ("show", show), ("cp", cp), ("validate", validate), ("schema", schema)):
        sub.command(name)(command)
    app.add_typer(sub, name="recipes")


def copy_recipe(name: str, dest: Path, force: bool) -> str:
    """``skyrl recipes cp``: the recipe file, and its own folder (``recipes/<name>/``: data, reward
    code) next to the copy under the same name, so that its relative paths and module names keep
    working. Returns the line to print."""
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.recipe.registry import builtin_path

    source = builtin_path(name)
    # "sub/" names a folder even before it exists (it was written as a file called "sub").
    target = dest / source.name if dest.is_dir() or str(dest).endswith(("/", os.sep)) else dest
    folder = source.with_suffix("")
    folder_target = target.parent / folder.name if folder.is_dir() else None
    for existing in (target, folder_target):
        if existing is not None and existing.exists() and not force:
            raise UsageError(f"{existing} exists; pass --force to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    if folder_target is None:
        return f"copied {source.name} to {target}"
    if folder_target.resolve() != folder.resolve():
        shutil.copytree(
            folder, folder_target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True
        )
    return f"copied {source.name} to {target} and its files {folder.name}/ to {folder_target}"

"""`skyrl recipes ...`: list, show, copy, validate and export the schema of recipes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Annotated

import typer

from skyrl_cli.commands import common
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


def validate(
    files: Annotated[list[str], typer.Argument(help="Recipe files (or built-in names).")],
    set_: common.SetOpt = None,
    gpus: common.GpusOpt = None,
) -> None:
    """Check recipes and report every problem at once as file:line: key.path: message (exit 2)."""
    problems: list[str] = []
    for file in files:
        try:
            common.load_for_run(file, set_, stage=None, gpu_count=gpus, preflight=True)
        except RecipeError as err:
            problems += err.problems
        except UsageError as err:
            problems.append(str(err))
        else:
            typer.echo(f"ok: {file}")
    if problems:
        raise RecipeError(problems)


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

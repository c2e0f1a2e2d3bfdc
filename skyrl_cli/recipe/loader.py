"""Load a recipe file: TOML -> ``--set`` overrides -> schema -> semantic checks -> ``Recipe``.

Every problem is reported at once as one line ``file:line: key.path: message`` (``--set: ...`` for
a value that came from an override), raised as ``RecipeError`` (exit code 2). Paths in the returned
recipe are absolute (resolved against the recipe file's directory).

    recipe = load_recipe("recipes/quickstart.toml", sets=["sft.steps=10"], checks=[more_problems])

``checks`` are run on the validated recipe with the others, so their problems come in the same
list: ``skyrl_cli.plan.feasibility.load_feasible_recipe`` passes the machine checks that way
(the recipe layer imports nothing from the plan layer).
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterable

from pydantic import ValidationError

from skyrl_cli.recipe.keys import table_model, unknown_key_message
from skyrl_cli.recipe.lengths import length_problems, with_model_lengths
from skyrl_cli.recipe.locator import dotted, line_of, locate_keys
from skyrl_cli.recipe.overrides import Override, apply_overrides, parse_overrides
from skyrl_cli.recipe.validate import (
    Problem,
    agent_problems,
    data_problems,
    distillation_problems,
    environment_problems,
    judge_problems,
    loss_problems,
    missing_files,
    not_yet_implemented,
    user_code_problems,
    with_absolute_paths,
)
from skyrl_contracts.errors import RecipeError
from skyrl_contracts.schema import Recipe

_SET_LINE = 1 << 30  # --set problems sort after the file's
_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)$|\s*\(at end of document\)$")


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _schema_problems(error: ValidationError) -> list[Problem]:
    problems = []
    for item in error.errors():
        path = tuple(k for k in item["loc"] if isinstance(k, (str, int)))
        kind = item["type"]
        if kind == "extra_forbidden":
            model = table_model(path[:-1])
            message = unknown_key_message(model, str(path[-1])) if model else f"unknown key {path[-1]!r}"
        elif kind == "missing":
            message = "required key is missing"
        elif kind == "value_error":
            message = item["msg"].removeprefix("Value error, ")
        else:
            message = item["msg"]
            value = item.get("input")
            if isinstance(value, (str, int, float, bool)):
                message += f" (got {_toml_literal(value)})"
        problems.append(Problem(path, message))
    return problems


class _Formatter:
    """Turns problems into ``file:line: key.path: message`` lines."""

    def __init__(self, file: str, source: str, overrides: Iterable[Override]):
        self.file = file
        self.lines = locate_keys(source)
        self.overridden = [o.path for o in overrides]

    def __call__(self, problem: Problem) -> tuple[int, str]:
        key = f"{dotted(problem.path)}: " if problem.path else ""
        for path in self.overridden:
            if problem.path[: len(path)] == path:
                return (_SET_LINE, f"--set: {key}{problem.message}")
        line = line_of(self.lines, problem.path)
        return (line, f"{self.file}:{line}: {key}{problem.message}")


def _one_line(text: str) -> str:
    """``text`` with its control characters escaped: a value holding a newline (``name = "a\\nb"``)
    must not break the one-line-per-problem output."""
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)


def _raise(lines: list[tuple[int, str]]) -> None:
    lines.sort(key=lambda pair: pair[0])  # stable: schema order within one line
    raise RecipeError([_one_line(text) for _, text in lines])


def format_problems(path: str | os.PathLike, sets: Iterable[str], problems: list[Problem]) -> list[str]:
    """Problems found after loading (``skyrl_cli.plan.fit``: what does not fit a machine) as the
    loader's own ``file:line: key.path: message`` lines, in line order."""
    overrides, _ = parse_overrides(sets)
    fmt = _Formatter(str(path), Path(path).read_text(encoding="utf-8"), overrides)
    lines = sorted((fmt(p) for p in problems), key=lambda pair: pair[0])
    return [_one_line(text) for _, text in lines]


def load_recipe(
    path: str | os.PathLike,
    sets: Iterable[str] = (),
    checks: Iterable[Callable[[Recipe], list[Problem]]] = (),
) -> Recipe:
    """Load, override and validate a recipe file, then run ``checks`` on it (problems reported
    together). Lengths left to the model come back concrete (``skyrl_cli.recipe.lengths``)."""
    file = str(path)
    recipe_path = Path(path)
    try:
        found = recipe_path.is_file()
    except (OSError, ValueError):  # a name too long for the file system
        found = False
    if not found:
        raise RecipeError([f"recipe file not found: {file}"])
    raw = recipe_path.read_bytes()
    try:
        source = raw.decode("utf-8")
    except UnicodeDecodeError as err:  # TOML is UTF-8 by definition
        line = raw[: err.start].count(b"\n") + 1
        raise RecipeError(
            [f"{file}:{line}: not UTF-8 text (byte {raw[err.start]:#04x}); TOML files are UTF-8"]
        ) from None
    try:
        data = tomllib.loads(source)
    except tomllib.TOMLDecodeError as err:
        raise RecipeError([_syntax_error(file, str(err), source)]) from None

    overrides, set_problems = parse_overrides(sets)
    data = apply_overrides(data, overrides)
    fmt = _Formatter(file, source, overrides)
    base_dir = recipe_path.resolve().parent
    early = [(_SET_LINE, text) for text in set_problems]

    problems = missing_files(data, base_dir)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        _raise(early + [fmt(p) for p in _schema_problems(err) + problems])
    problems += not_yet_implemented(recipe)
    problems += user_code_problems(recipe, base_dir)
    problems += loss_problems(recipe)
    problems += data_problems(recipe)
    problems += agent_problems(recipe)
    problems += environment_problems(recipe)
    problems += distillation_problems(recipe, base_dir)
    problems += judge_problems(recipe)
    problems += length_problems(recipe, base_dir)
    recipe = with_model_lengths(recipe, base_dir)
    for check in checks:
        problems += check(recipe)
    if problems or early:
        _raise(early + [fmt(p) for p in problems])
    return with_absolute_paths(recipe, base_dir)


def _syntax_error(file: str, message: str, source: str) -> str:
    match = _TOML_POSITION.search(message)
    text = _TOML_POSITION.sub("", message)
    if match and match.group(1):
        return f"{file}:{match.group(1)}: TOML syntax error: {text} (column {match.group(2)})"
    return f"{file}:{max(1, len(source.splitlines()))}: TOML syntax error: {text}"

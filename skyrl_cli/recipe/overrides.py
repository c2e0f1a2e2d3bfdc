"""``--set key.path=value`` overrides, applied to the raw TOML data before validation.

The value is read as a TOML value (``10``, ``3e-4``, ``true``, ``"text"``, ``[0, 1]``,
``{ kind = "gspo" }``); text that is not valid TOML is taken as a bare string, so
``--set data.task=reversal`` works without shell-quoted quotes. Types are checked afterwards by the
schema like any other value; paths are checked here against the schema (did-you-mean on a typo).
"""

from __future__ import annotations

import copy
import tomllib
from dataclasses import dataclass
from typing import Any, Iterable

from skyrl_cli.recipe.keys import normalize_path
from skyrl_cli.recipe.locator import _parse_key


@dataclass(frozen=True)
class Override:
    path: tuple[str, ...]  # TOML spelling (aliases)
    value: Any
    text: str  # as given on the command line


def parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_override(text: str) -> tuple[Override | None, str | None]:
    """An ``Override``, or None and a message saying what is wrong with ``text``."""
    key, sep, raw = text.partition("=")
    parsed = _parse_key(key, 0) if sep else None
    if parsed is None or parsed[1] != len(key.rstrip()):
        return None, f"--set: expects key.path=value, got {text!r}"
    path, problem = normalize_path(tuple(parsed[0]))
    if problem:
        return None, f"--set: {'.'.join(path)}: {problem}"
    return Override(path, parse_value(raw.strip()), text), None


def parse_overrides(texts: Iterable[str]) -> tuple[list[Override], list[str]]:
    """Parse all ``--set`` arguments; returns the overrides and every problem found."""
    overrides, problems = [], []
    for text in texts:
        override, problem = parse_override(text)
        if problem:
            problems.append(problem)
        else:
            overrides.append(override)
    return overrides, problems


def _attribute_spelling(key: str) -> str | None:
    return "async_" if key == "async" else None


def apply_overrides(data: dict[str, Any], overrides: Iterable[Override]) -> dict[str, Any]:
    """A copy of ``data`` with the overrides applied (missing tables are created)."""
    out = copy.deepcopy(data)
    for override in overrides:
        table = out
        for key in override.path[:-1]:
            other = _attribute_spelling(key)
            if other and other in table:  # the recipe used the attribute name; keep one spelling
                table[key] = table.pop(other)
            if not isinstance(table.get(key), dict):
                table[key] = {}
            table = table[key]
        last = override.path[-1]
        other = _attribute_spelling(last)
        if other:
            table.pop(other, None)
        table[last] = override.value
    return out

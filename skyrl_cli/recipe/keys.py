"""The recipe's key tree as the TOML author sees it: table lookup, key names, did-you-mean.

TOML keys are the schema's aliases where one exists (``rl.async``, attribute ``async_``); both
spellings are accepted in paths and the alias is what messages show.
"""

from __future__ import annotations

import difflib
import types
import typing

from pydantic import BaseModel

from skyrl_contracts.schema import Recipe


def toml_key(model: type[BaseModel], name: str) -> str:
    field = model.model_fields[name]
    return field.alias or name


def toml_keys(model: type[BaseModel]) -> list[str]:
    return [toml_key(model, name) for name in model.model_fields]


def _attribute_name(model: type[BaseModel], key: str) -> str | None:
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return name
    return None


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The pydantic model inside an annotation like ``X``, ``X | None`` or ``Annotated[X, ...]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def table_model(path: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The schema model of the table at ``path`` (``()`` is the recipe), or None if it is not a table."""
    model: type[BaseModel] | None = Recipe
    for key in path:
        if model is None or not isinstance(key, str):
            return None
        name = _attribute_name(model, key)
        if name is None:
            return None
        model = _model_in(model.model_fields[name].annotation)
    return model


def unknown_key_message(model: type[BaseModel], key: str) -> str:
    valid = toml_keys(model)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"unknown key {key!r}; did you mean {close[0]!r}?"
    return f"unknown key {key!r}; valid keys: {', '.join(valid)}"


def normalize_path(path: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
    """Check a dotted key path against the schema.

    Returns the path with TOML spellings (aliases) and None, or the path so far and an error message
    (unknown key with a suggestion, or a key below a non-table value)."""
    model: type[BaseModel] | None = Recipe
    out: list[str] = []
    for key in path:
        if model is None:
            return tuple(out), f"{'.'.join(out)} is a value, not a table"
        name = _attribute_name(model, key)
        if name is None:
            return (*out, key), unknown_key_message(model, key)
        out.append(toml_key(model, name))
        model = _model_in(model.model_fields[name].annotation)
    return tuple(out), None

"""Every recipe key as a Markdown reference, generated from the schema (the docs site's
"Recipe keys" page is this, so it cannot drift from what the loader accepts).

One table per TOML table, in the order the schema declares them: key, type, default, what it does.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from skyrl_cli.recipe.keys import _model_in, toml_key
from skyrl_contracts.schema import Recipe


def type_text(annotation: object) -> str:
    """A short type as a recipe author writes values: ``int >= 1``, ``"grpo" | "rloo"``, ``table``."""
    if _model_in(annotation) is not None and typing.get_origin(annotation) is None:
        return "table"
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *meta = typing.get_args(annotation)
        bounds = [text for m in meta for text in _bounds(m)]
        return " ".join([type_text(base), *bounds]) if bounds else type_text(base)
    if origin is typing.Literal:
        return " | ".join(json.dumps(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        parts = [a for a in typing.get_args(annotation) if a is not type(None)]
        text = " | ".join(type_text(a) for a in parts)
        if _model_in(annotation) is not None:
            text = "table"
        return f"{text} (optional)" if len(parts) < len(typing.get_args(annotation)) else text
    if origin is tuple:
        (item, *_) = typing.get_args(annotation) or (str,)
        return f"list of {type_text(item)}"
    if origin is dict:
        return "table"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(meta: object) -> Iterator[str]:
    for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        value = getattr(meta, attr, None)
        if value is not None:
            yield f"{sign} {value}"
    for inner in getattr(meta, "metadata", ()):
        yield from _bounds(inner)
    pattern = getattr(meta, "pattern", None)
    if pattern == r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$":
        yield '("module:name")'


def field_type_text(field: FieldInfo) -> str:
    """The type with the bounds pydantic moved from ``Annotated[...]`` into the field's metadata."""
    bounds = [text for meta in field.metadata for text in _bounds(meta)]
    return " ".join([type_text(field.annotation), *bounds])


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    return text.split(". ", 1)[0].rstrip(".") + "." if text else ""


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "" if isinstance(value, BaseModel) else f"`{json.dumps(value)}`"
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "unset"
    value = list(field.default) if isinstance(field.default, tuple) else field.default
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def tables(model: type[BaseModel] = Recipe, prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """(dotted table name, model) for the recipe and every table below it, depth first."""
    yield prefix, model
    for name, field in model.model_fields.items():
        inner = _model_in(field.annotation)
        if inner is not None:
            key = toml_key(model, name)
            yield from tables(inner, f"{prefix}.{key}" if prefix else key)


def table_markdown(name: str, model: type[BaseModel]) -> str:
    title = f"`[{name}]`" if name else "Top level"
    lines = [f"## {title}", ""]
    if model.__doc__ and name:
        lines += [" ".join(model.__doc__.split()), ""]
    lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for attr, field in model.model_fields.items():
        key = toml_key(model, attr)
        full = f"{name}.{key}" if name else key
        inner = _model_in(field.annotation)
        kind = "table" if inner is not None else field_type_text(field)
        description = field.description or ""
        if inner is not None:
            description = description or _first_sentence(inner.__doc__ or "")
            description = f"{description} See [`[{full}]`](#{_anchor(full)}).".strip()
        lines.append(f"| `{full}` | {_cell(kind)} | {_cell(default_text(field))} | {_cell(description)} |")
    return "\n".join(lines) + "\n"


def _anchor(table: str) -> str:
    """The id MkDocs' toc extension gives the heading ``## `[table]` ``."""
    return table.replace(".", "").lower()


def markdown_reference() -> str:
    return "\n".join(table_markdown(name, model) for name, model in tables())

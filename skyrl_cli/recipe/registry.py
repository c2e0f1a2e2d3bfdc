"""Built-in recipes: the ``recipes/*.toml`` files of the repository.

They are found in the source tree (a checkout or an editable install) and otherwise where a wheel
installs them as data files (``<prefix>/share/skyrl-cli/recipes``, see ``[tool.setuptools.data-files]``
in pyproject.toml). Each recipe opens with a comment block; its first line is the purpose and the
lines ``# Hardware:``, ``# Time:``, ``# Expected:`` are shown by ``skyrl recipes ls``.
"""

from __future__ import annotations

import difflib
import re
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from pathlib import Path

from skyrl_contracts.errors import UsageError

_HEADER_FIELD = re.compile(r"^#\s*(Hardware|Time|Expected|Commands?)\s*:\s*(.*)$", re.IGNORECASE)


def recipes_dir() -> Path:
    candidates = [
        Path(__file__).resolve().parents[2] / "recipes",
        Path(sysconfig.get_path("data")) / "share" / "skyrl-cli" / "recipes",
        Path(sys.prefix) / "share" / "skyrl-cli" / "recipes",
    ]
    for candidate in candidates:
        if candidate.is_dir() and any(candidate.glob("*.toml")):
            return candidate
    return candidates[0]


@dataclass(frozen=True)
class BuiltinRecipe:
    name: str
    path: Path
    purpose: str
    hardware: str
    time: str
    expected: str
    stages: tuple[str, ...]


def parse_header(text: str) -> dict[str, str]:
    """The leading comment block: ``purpose`` (its first line) and the labelled fields, lower-cased.
    A field continues on following comment lines that are indented by more than ``#``+one space."""
    fields: dict[str, str] = {}
    current: str | None = None
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        match = _HEADER_FIELD.match(line)
        body = line[1:].strip()
        if match:
            current = match.group(1).lower()
            fields[current] = match.group(2).strip()
        elif "purpose" not in fields and body:
            fields["purpose"] = body
            current = "purpose"
        elif current and line.startswith("#   ") and body:
            fields[current] = f"{fields[current]} {body}".strip()
        else:
            current = None
    return fields


def _stages(text: str) -> tuple[str, ...]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return ()
    return tuple(stage for stage in ("sft", "rl", "tinker") if stage in data)


def builtin_recipes() -> list[BuiltinRecipe]:
    out = []
    for path in sorted(recipes_dir().glob("*.toml")):
        text = path.read_text(encoding="utf-8")
        header = parse_header(text)
        out.append(
            BuiltinRecipe(
                name=path.stem,
                path=path,
                purpose=header.get("purpose", ""),
                hardware=header.get("hardware", "?"),
                time=header.get("time", "?"),
                expected=header.get("expected", "?"),
                stages=_stages(text),
            )
        )
    return out


def builtin_path(name: str) -> Path:
    """The file of built-in recipe ``name`` (``quickstart`` or ``quickstart.toml``)."""
    stem = name.removesuffix(".toml")
    path = recipes_dir() / f"{stem}.toml"
    if path.is_file():
        return path
    names = [r.name for r in builtin_recipes()]
    close = difflib.get_close_matches(stem, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; built-in recipes: {', '.join(names) or 'none'}"
    raise UsageError(f"no built-in recipe named {stem!r}{hint}")


def resolve_recipe_arg(arg: str) -> Path:
    """A recipe argument is a file path, or else the name of a built-in recipe."""
    path = Path(arg)
    try:
        exists = path.exists()
    except (OSError, ValueError):  # a name too long for the file system: load_recipe says not found
        exists = True
    if exists or path.suffix == ".toml" or "/" in arg:
        return path
    return builtin_path(arg)

"""The code blocks of the docs site and the README, found so that tests can run or validate each.

A fenced block's language says what it is, and an HTML comment on the line just above it may say
how it is checked:

- ``toml``: a recipe, validated by the loader. ``<!-- recipe: based-on=NAME -->`` marks a fragment
  (merged onto the built-in recipe NAME, then validated); ``<!-- recipe: in=DIR -->`` validates a
  full recipe as if it sat in DIR (for the files it names); ``gpus=N`` validates it for a machine
  with N GPUs (``skyrl recipes validate --gpus N``), for settings refused on CPU.
- ``bash`` / ``console`` / ``sh``: commands. ``skyrl`` lines are run (``--dry-run`` added to
  ``sft``/``rl``/``quantize``; listing and validation commands as written) or, for commands that
  start servers or long jobs, parsed by the real CLI; other lines must name files that exist.
- ``python``: executed as written.
- ``<!-- run: tests/path.py -->`` above any block: a named test runs it (it must exist and read
  this page); ``text`` blocks are output and are not checked.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
_MARKER = re.compile(r"<!--\s*(?P<kind>[\w-]+):\s*(?P<value>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    marker: tuple[str, str] | None  # ("recipe", "based-on=quickstart"), ("run", "tests/..."), ...

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    def option(self, name: str) -> str | None:
        """``based-on`` of ``<!-- recipe: based-on=quickstart -->``."""
        if self.marker is None:
            return None
        for part in self.marker[1].split():
            key, _, value = part.partition("=")
            if key == name:
                return value
        return None


def pages() -> list[Path]:
    return sorted(DOCS.glob("**/*.md"))


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        found.append(
            Block(
                page=page,
                line=text.count("\n", 0, match.start()) + 1,
                lang=match.group("lang").lower(),
                code=textwrap.dedent(match.group("body")),
                marker=(marker.group("kind"), marker.group("value")) if marker else None,
            )
        )
    return found


def all_blocks(files: list[Path] | None = None) -> list[Block]:
    return [b for page in files or [*pages(), REPO / "README.md"] for b in blocks(page)]


def command_lines(code: str) -> list[str]:
    """The commands of a shell block: prompts and comments stripped, continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", code)
    lines = []
    for raw in joined.splitlines():
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            lines.append(line)
    return lines

"""Line numbers for dotted key paths of a TOML document.

``tomllib`` gives values but no positions, so this scans the source once and records the line where
each key path is defined: table headers ``[a.b]`` and ``[[a.b]]`` (array items as ``a.b.<index>``),
plain and dotted keys ``a.b = ...``, quoted keys. Keys inside an inline table (``x = { k = 1 }``)
or an array are not recorded: a lookup falls back to the longest recorded prefix, which is the line
of ``x``. Multi-line strings and arrays are skipped so that their contents never look like keys.
"""

from __future__ import annotations

import re

KeyPath = tuple[str | int, ...]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def dotted(path: KeyPath) -> str:
    """A key path as a TOML reader writes it: ``rl.loss.eps_low``, ``trainer.gpus[1]``."""
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


def _parse_key(text: str, pos: int) -> tuple[list[str], int] | None:
    """Parse a (dotted, maybe quoted) key at ``pos``; return its parts and the position after it."""
    parts: list[str] = []
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t":
            pos += 1
        if pos >= n:
            return None
        ch = text[pos]
        if ch in "\"'":
            end = pos + 1
            while end < n and text[end] != ch:
                end += 2 if (ch == '"' and text[end] == "\\") else 1
            if end >= n:
                return None
            raw = text[pos + 1 : end]
            parts.append(raw.encode().decode("unicode_escape") if ch == '"' and "\\" in raw else raw)
            pos = end + 1
        else:
            match = _BARE_KEY.match(text, pos)
            if not match:
                return None
            parts.append(match.group())
            pos = match.end()
        while pos < n and text[pos] in " \t":
            pos += 1
        if pos < n and text[pos] == ".":
            pos += 1
            continue
        return parts, pos


def _bracket_depth_change(text: str, in_string: str | None) -> tuple[int, str | None]:
    """Net change of ``[``/``{`` nesting over ``text`` (strings and comments skipped), and the
    multi-line string (``\"\"\"`` or ``'''``) still open at the end of the line, if any."""
    depth = 0
    i, n = 0, len(text)
    while i < n:
        if in_string:
            close = text.find(in_string, i)
            if close < 0:
                return depth, in_string
            i = close + 3
            in_string = None
            continue
        ch = text[i]
        if ch == "#":
            break
        if text.startswith('"""', i) or text.startswith("'''", i):
            in_string = text[i : i + 3]
            i += 3
            continue
        if ch in "\"'":
            i += 1
            while i < n and text[i] != ch:
                i += 2 if (ch == '"' and text[i] == "\\") else 1
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        i += 1
    return depth, in_string


def locate_keys(source: str) -> dict[KeyPath, int]:
    """Map every key path defined in ``source`` to its 1-based line number."""
    lines: dict[KeyPath, int] = {}
    array_counts: dict[KeyPath, int] = {}
    prefix: KeyPath = ()
    depth = 0  # open brackets of a value that continues on the next lines
    open_string: str | None = None
    for lineno, line in enumerate(source.splitlines(), start=1):
        if depth > 0 or open_string:
            change, open_string = _bracket_depth_change(line, open_string)
            depth = max(0, depth + change)
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("[["):
            parsed = _parse_key(stripped, 2)
            if parsed:
                table = tuple(parsed[0])
                index = array_counts.get(table, 0)
                array_counts[table] = index + 1
                lines.setdefault(table, lineno)
                prefix = (*table, index)
                lines[prefix] = lineno
            continue
        if stripped.startswith("["):
            parsed = _parse_key(stripped, 1)
            if parsed:
                prefix = tuple(parsed[0])
                lines[prefix] = lineno
            continue
        parsed = _parse_key(line, 0)
        if not parsed:
            continue
        parts, pos = parsed
        if pos >= len(line) or line[pos] != "=":
            continue
        path = (*prefix, *parts)
        for cut in range(len(prefix) + 1, len(path) + 1):  # dotted keys define their parents too
            lines.setdefault(path[:cut], lineno)
        lines[path] = lineno
        depth, open_string = _bracket_depth_change(line[pos + 1 :], None)
        depth = max(0, depth)
    return lines


def line_of(lines: dict[KeyPath, int], path: KeyPath, default: int = 1) -> int:
    """Line of ``path`` or of its longest recorded prefix (e.g. the inline table holding it)."""
    for cut in range(len(path), 0, -1):
        if path[:cut] in lines:
            return lines[path[:cut]]
    return default

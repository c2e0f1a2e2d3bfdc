"""Locks of DeepSpeed's one-time op builds that a killed build left behind.

DeepSpeed compiles its CPU ops (shm_comm, ...) on first use into ``TORCH_EXTENSIONS_DIR``,
guarded by torch's ``FileBaton``: a ``<op>/lock`` file that exists while a build runs and that
every other process waits on, silently, until it disappears. A build killed mid-way (Ctrl-C or
SIGKILL during the first run on a machine) never removes it, and every later run then hangs at
start-up with no output (seen: a trainer that sat 14 minutes before its first line). The
supervisor therefore removes, before it starts a process that builds ops, locks older than any
real build takes, and, at teardown, once all its processes are gone, the locks made during its run.
"""

from __future__ import annotations

import time
from pathlib import Path

STALE_AFTER_S = 600.0  # a build takes 30-50 s on 2 cores; ten minutes is no build any more


def _locks(extensions_dir: str | Path) -> list[Path]:
    return sorted(Path(extensions_dir).glob("*/lock"))


def _remove(paths: list[Path]) -> list[Path]:
    removed = []
    for path in paths:
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def clear_stale_locks(
    extensions_dir: str | Path, now: float | None = None, older_than_s: float = STALE_AFTER_S
) -> list[Path]:
    """Remove build locks older than ``older_than_s``; returns what was removed."""
    now = time.time() if now is None else now
    return _remove([p for p in _locks(extensions_dir) if now - _mtime(p) > older_than_s])


def clear_locks_since(extensions_dir: str | Path, since: float) -> list[Path]:
    """Remove build locks made at or after ``since`` (call once the processes that could hold
    them are gone)."""
    return _remove([p for p in _locks(extensions_dir) if _mtime(p) >= since])


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")

"""Locks of DeepSpeed's one-time op builds that a killed build left behind.

DeepSpeed compiles its CPU ops (shm_comm, ...) on first use into ``TORCH_EXTENSIONS_DIR``,
guarded by torch's ``FileBaton``: a ``<op>/lock`` file that exists while a build runs and that
every other process waits on, silently, until it disappears. A build killed mid-way (Ctrl-C or
SIGKILL during the first run on a machine) never removes it, and every later run then hangs at
start-up with no output (seen: a trainer that sat 14 minutes before its first line). The
supervisor therefore removes, before it starts a process that builds ops and at teardown once its
processes are gone, the locks whose builder is dead: skyrl's trainers write their owner into the
locks they take (``skyrl_contracts.build_locks``). A lock whose owner lives is another run's build
in progress and is left alone (removing it failed that build: ``FileNotFoundError`` on its lock);
any lock older than a real build takes is removed too (no owner on this host, or a reused pid).
"""

from __future__ import annotations

import time
from pathlib import Path

from skyrl_cli.launch.pids import pid_alive
from skyrl_contracts.build_locks import owner_pid

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


def _abandoned(lock: Path, now: float, older_than_s: float) -> bool:
    """No build holds ``lock``: its owner on this host is dead, or it is older than any build."""
    pid = owner_pid(lock)
    if pid is not None and not pid_alive(pid):
        return True
    return now - _mtime(lock) > older_than_s


def clear_abandoned_locks(
    extensions_dir: str | Path, now: float | None = None, older_than_s: float = STALE_AFTER_S
) -> list[Path]:
    """Remove the build locks that no build holds (``_abandoned``); returns what was removed."""
    now = time.time() if now is None else now
    return _remove([p for p in _locks(extensions_dir) if _abandoned(p, now, older_than_s)])


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("-inf")  # gone already: _remove skips it

"""Running the real `skyrl` console script in integration tests, and reading its events back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKYRL = Path(sys.executable).parent / "skyrl"
ENV = {
    **os.environ,
    "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache/torch_extensions")),
}


def run_skyrl(
    *args, cwd: Path = REPO, check: bool = True, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``skyrl ARGS`` as a user runs it (``env`` added to its environment); raises with its output
    when it fails (``check``)."""
    proc = subprocess.run(
        [str(SKYRL), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**ENV, **(env or {})},
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"skyrl {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def events(run_dir: Path, name: str, process: str | None = None) -> list[tuple[int, float]]:
    """``(step, value)`` of every event called ``name`` (from ``process`` if given), in file order."""
    from skyrl_contracts.events import iter_events

    return [
        (e.step, e.value)
        for e in iter_events(run_dir / "events.jsonl")
        if e.name == name and (process is None or e.process == process)
    ]


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``: the supervisor's group leaders (one session each) and the reaper."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found

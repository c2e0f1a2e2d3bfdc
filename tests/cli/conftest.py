"""CLI test helpers: run `skyrl` in-process through its real entry point (error mapping included),
or as the installed console script in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKYRL = Path(sys.executable).parent / "skyrl"


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def skyrl(capsys):
    """``skyrl("recipes", "ls") -> Result`` through ``skyrl_cli.app.main`` in this process."""
    from skyrl_cli.app import main

    def run(*args: str) -> Result:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def run_console_script(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> Result:
    """The installed ``skyrl`` console script in a subprocess."""
    proc = subprocess.run(
        [str(SKYRL), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=60,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)

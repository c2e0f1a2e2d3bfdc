"""One line of ``skyrl doctor``: what was checked, what was found, and the fix when it failed."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Literal, Sequence

Status = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def line(self) -> str:
        text = f"{self.status:<4}  {self.name}: {self.detail}"
        return f"{text}\n      fix: {self.fix}" if self.failed and self.fix else text

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


def passed(name: str, detail: str) -> Check:
    return Check(name, "pass", detail)


def failed(name: str, detail: str, fix: str) -> Check:
    return Check(name, "fail", detail, fix)


def skipped(name: str, detail: str) -> Check:
    return Check(name, "skip", detail)


@dataclass(frozen=True)
class ChildResult:
    ok: bool
    output: str  # the last line of stdout on success, the end of stderr (or the timeout) otherwise


def run_child(argv: Sequence[str], timeout_s: float, env: dict[str, str] | None = None) -> ChildResult:
    """Run a child process with a time limit: heavy imports stay out of the doctor's own process
    and a hanging one is reported, not waited on."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return ChildResult(False, f"no answer within {timeout_s:.0f} s")
    except OSError as err:
        return ChildResult(False, str(err))
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or [
            f"exit code {proc.returncode}"
        ]
        return ChildResult(False, tail[0].strip())
    lines = proc.stdout.strip().splitlines()
    return ChildResult(True, lines[-1].strip() if lines else "")


def python_child(code: str, timeout_s: float, env: dict[str, str] | None = None) -> ChildResult:
    return run_child([sys.executable, "-c", code], timeout_s, env)

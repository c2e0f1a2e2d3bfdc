"""What a stop signal (Ctrl-C = SIGINT, SIGTERM, SIGHUP) does to the driver: the one home of it.

- ``stop_signals_raise()``: inside it, the first stop signal raises ``Interrupted`` in the main
  thread wherever the driver is (starting engines, waiting on a job, polling events), so every
  ``with`` block on the way out runs its teardown: the supervisor kills its process groups,
  ``FollowedRun`` writes summary.json with ``completed: false``. Later signals only print a note:
  a second Ctrl-C must not cut the teardown short and leave engines behind (the teardown is
  bounded: SIGTERM, a grace period, SIGKILL). Re-entrant: ``skyrl_cli.app.main`` installs it for
  the whole command and the ``Supervisor`` for library users; an inner use changes nothing.
- ``Interrupted`` is a ``BaseException`` but not a ``KeyboardInterrupt`` on purpose: Typer turns a
  KeyboardInterrupt into exit code 130 whatever the signal was (and, run as ``app.main`` runs it,
  returns that code instead of exiting), and a sink's ``except Exception`` must not swallow it.
- ``deferred()``: a critical section (start a process and register it for teardown; the teardown
  itself) during which a stop signal is held and raised at its end.
- ``reported(stage, run_dir)``: around a stage's run: turns the interruption into ``RunInterrupted``
  (exit code 128 + the signal number: 130 for SIGINT, 143 for SIGTERM), whose message is the run's
  last line: where it stopped and where its last complete checkpoint is; marks summary.json.

Light on purpose (``skyrl --help`` imports it): the run directory helpers are imported when needed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from skyrl_contracts.errors import RunInterrupted

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
RESUME_HINT = "resume with --resume"
RESTART_HINT = "start again with --overwrite"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Interrupted(BaseException):
    """Raised in the main thread by the first stop signal (see the module docstring)."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(signal_name(self.signum))

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for "ended by signal N"


class _State:
    installed = False
    received: int | None = None  # the first stop signal of this command
    deferring = 0
    pending: int | None = None  # a signal held by deferred()


_state = _State()


def _on_stop_signal(signum, frame) -> None:
    if _state.received is not None:
        print(f"skyrl: {signal_name(signum)} again: still stopping the run's processes", file=sys.stderr, flush=True)
        return
    _state.received = signum
    if _state.deferring:
        _state.pending = signum
        return
    raise Interrupted(signum)


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Within: the first stop signal raises ``Interrupted``; nested uses and other threads (Python
    handles signals in the main thread only) change nothing."""
    if _state.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS}
    _state.installed, _state.received, _state.pending = True, None, None
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        _state.installed, _state.received, _state.pending = False, None, None


@contextmanager
def deferred() -> Iterator[None]:
    """A stop signal arriving inside is raised when the (outermost) section ends. Main thread only
    (signals are handled there): another thread's section must neither hold the main thread's
    signal nor receive it (the engine-recovery thread starts processes too)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1
        if not _state.deferring and _state.pending is not None:
            signum, _state.pending = _state.pending, None
            raise Interrupted(signum)


# ------------------------------------------------------------------------------ reporting


@dataclass
class StageProgress:
    """What a stage is doing, for the interruption message (``None``: nothing worth naming)."""

    phase: str | None = None


def shown_path(path: Path) -> str:
    """``path`` relative to the current directory when it lies below it, else absolute."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def interruption_message(
    stage: str,
    signame: str,
    step: int,
    phase: str | None,
    checkpoint: Path | None,
    resume_hint: str = RESUME_HINT,
    restart_hint: str = RESTART_HINT,
) -> str:
    """The last line of an interrupted run, e.g. ``sft interrupted (SIGINT) at step 120; last
    complete checkpoint: runs/x/sft/checkpoints/step-100 (resume with --resume)``."""
    where = " ".join(p for p in (f"at step {step}" if step else "", f"during {phase}" if phase else "") if p)
    head = f"{stage} interrupted ({signame}) {where or 'before the first step'}"
    if checkpoint is None:
        return f"{head}; no complete checkpoint yet ({restart_hint})"
    return f"{head}; last complete checkpoint: {shown_path(checkpoint)} ({resume_hint})"


def mark_summary(run_dir: Path, stage: str, signame: str, started: float) -> dict:
    """summary.json of this run with ``"interrupted": SIGNAL``; written from the events when the
    run stopped before its follower wrote one (e.g. while the engines were starting)."""
    # lazy: skyrl --help imports this module; these stay out of it
    from skyrl_cli.metrics.summary import write_summary
    from skyrl_contracts.atomic import write_json
    from skyrl_contracts.rundir import RunDir

    path = RunDir(run_dir).summary
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict) or summary.get("time", 0) < started:  # absent, or a previous run's
        summary = write_summary(run_dir, {"stage": stage, "completed": False})
    summary["interrupted"] = signame
    write_json(path, summary)
    return summary


def interruption_error(
    stage: str, run_dir: Path, signum: int, progress: StageProgress, started: float, **hints
) -> RunInterrupted:
    # lazy: skyrl --help imports this module; these stay out of it
    from skyrl_contracts.rundir import RunDir

    signame = signal_name(signum)
    summary = mark_summary(Path(run_dir), stage, signame, started)
    step = int(summary.get("steps") or 0)
    message = interruption_message(stage, signame, step, progress.phase, RunDir(run_dir).latest_checkpoint(), **hints)
    return RunInterrupted(message, exit_code=128 + signum)


@contextmanager
def reported(stage: str, run_dir: str | os.PathLike, **hints: str) -> Iterator[StageProgress]:
    """Around a stage's run (after its run directory is prepared): an interruption inside becomes
    ``RunInterrupted``. ``hints``: ``resume_hint`` / ``restart_hint`` for the message."""
    progress = StageProgress()
    started = time.time()
    try:
        yield progress
    except (Interrupted, KeyboardInterrupt) as exc:  # KeyboardInterrupt: no handler installed (library use)
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        with deferred():  # writing summary.json must not be cut short by the next Ctrl-C
            error = interruption_error(stage, Path(run_dir), signum, progress, started, **hints)
        raise error from None

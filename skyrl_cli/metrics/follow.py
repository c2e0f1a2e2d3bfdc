"""Following a run: tail ``events.jsonl`` and feed the sinks, then write ``summary.json``.

    sinks = SinkGroup([...])                      # or skyrl_cli.commands.common.output_sinks(...)
    with FollowedRun(run_dir, sinks) as follower:  # starts the sinks
        supervisor.wait_job("trainer", on_tick=follower.poll)
    # on exit: last poll, summary.json written, sinks closed (the summary goes to them)

or, without a supervisor: ``follow_events(run_dir, sinks, stop_condition=lambda: proc.poll() is not None)``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from skyrl_cli.metrics.sinks import Sink, SinkGroup
from skyrl_cli.metrics.summary import write_summary
from skyrl_contracts.events import read_events
from skyrl_contracts.rundir import RunDir


class EventFollower:
    """Reads new complete lines of ``events.jsonl`` on every ``poll()`` and hands them to a sink."""

    def __init__(self, run_dir: str | os.PathLike, sink: Sink):
        self.path = RunDir(run_dir).events
        self.sink = sink if isinstance(sink, SinkGroup) else SinkGroup([sink])
        self.offset = 0

    def poll(self) -> int:
        events, self.offset = read_events(self.path, self.offset)
        self.sink.handle(events)
        return len(events)


class FollowedRun:
    """Context manager: start sinks; on exit poll a last time, write summary.json, close the sinks."""

    def __init__(self, run_dir: str | os.PathLike, sinks: Sink, summary_extra: Mapping[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.follower = EventFollower(run_dir, sinks)
        self.summary_extra = dict(summary_extra or {})
        self.summary: dict[str, Any] | None = None

    def poll(self) -> int:
        return self.follower.poll()

    def __enter__(self) -> "FollowedRun":
        self.follower.sink.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.poll()
            self.summary = write_summary(self.run_dir, {**self.summary_extra, "completed": exc_type is None})
        finally:
            self.follower.sink.close(self.summary)


def follow_events(
    run_dir: str | os.PathLike,
    sinks: Sink,
    stop_condition: Callable[[], bool],
    interval_s: float = 0.5,
    summary_extra: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Feed new events to ``sinks`` until ``stop_condition()`` is true; returns the summary."""
    with FollowedRun(run_dir, sinks, summary_extra) as run:
        while not stop_condition():
            run.poll()
            time.sleep(interval_s)
    return run.summary

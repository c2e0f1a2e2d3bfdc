"""Metric sinks: where events go while a run is followed.

A sink has ``start()``, ``handle(events)`` and ``close(summary)``. ``SinkGroup`` feeds several and
disables a sink that raises, with one warning on stderr: a failing sink never stops a run.
The rich live view is ``skyrl_cli.metrics.live.LiveView``, W&B is
``skyrl_cli.metrics.wandb_sink.WandbSink``; ``events.jsonl`` itself is written by the processes.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Iterable, Sequence, TextIO

from skyrl_cli.metrics.summary import headline_table
from skyrl_contracts.events import MetricEvent


class Sink:
    """Base sink: every method is optional."""

    name = "sink"

    def start(self) -> None:
        pass

    def handle(self, events: Sequence[MetricEvent]) -> None:
        pass

    def close(self, summary: dict[str, Any] | None = None) -> None:
        pass


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


class SinkGroup(Sink):
    """Fans events out to sinks; one that raises is dropped with one warning, the others go on."""

    name = "sinks"

    def __init__(self, sinks: Iterable[Sink], warn: Callable[[str], None] = _warn):
        self.sinks = list(sinks)
        self._warn = warn

    def _each(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as err:  # noqa: BLE001 - a sink must never stop the run
                self.sinks.remove(sink)
                self._warn(f"metrics sink {sink.name!r} failed and is disabled: {type(err).__name__}: {err}")
                if method != "close":
                    try:
                        sink.close(None)
                    except Exception:  # noqa: BLE001
                        pass

    def start(self) -> None:
        self._each("start")

    def handle(self, events: Sequence[MetricEvent]) -> None:
        if events:
            self._each("handle", events)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self._each("close", summary)


class JsonLinesSink(Sink):
    """``--json``: each event as one JSON line on stdout, then ``{"summary": {...}}``."""

    name = "json"

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream

    def _out(self) -> TextIO:
        return self.stream or sys.stdout

    def handle(self, events: Sequence[MetricEvent]) -> None:
        out = self._out()
        out.write("".join(e.to_json() + "\n" for e in events))
        out.flush()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary is not None:
            self._out().write(json.dumps({"summary": summary}) + "\n")
            self._out().flush()


class SummaryPrinter(Sink):
    """Prints the headline figures when the run ends (default and ``--quiet`` modes); the rest is
    in ``summary.json`` and ``skyrl runs show``."""

    name = "summary"

    def __init__(self, console: Any = None, run_dir: Any = None):
        self.console = console
        self.run_dir = run_dir

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary is None:
            return
        # lazy: rich; skyrl recipes validate and completions stay light
        from rich.console import Console

        (self.console or Console()).print(headline_table(summary, self.run_dir))

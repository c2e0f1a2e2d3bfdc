"""MetricEvent: the one record every process writes and every sink reads.

A run's ``events.jsonl`` holds one JSON object per line:
``{"time": <unix seconds>, "step": <int>, "process": <str>, "name": <str>, "value": <float>}``.
Writers append whole lines and flush, so a reader tailing the file (the driver's live view) never
sees half a record from a healthy writer; a torn last line after a crash is skipped by the reader.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping


@dataclass(frozen=True)
class MetricEvent:
    time: float
    step: int
    process: str
    name: str
    value: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> "MetricEvent":
        raw = json.loads(line)
        return cls(float(raw["time"]), int(raw["step"]), str(raw["process"]), str(raw["name"]), float(raw["value"]))


class EventWriter:
    """Appends events of one process to a JSONL file (shared by all processes of a run)."""

    def __init__(self, path: str | os.PathLike, process: str):
        self.path = Path(path)
        self.process = process
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND writes of one line are atomic enough across processes for lines < PIPE_BUF-ish
        # sizes; we write each batch as a single write() call.
        self._fh = open(self.path, "a", buffering=1, encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float], now: float | None = None) -> None:
        stamp = time.time() if now is None else now
        lines = [
            MetricEvent(stamp, int(step), self.process, name, float(value)).to_json()
            for name, value in metrics.items()
            if value is not None and math.isfinite(float(value))
        ]
        if lines:
            self._fh.write("\n".join(lines) + "\n")
            self._fh.flush()

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "EventWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_events(path: str | os.PathLike, offset: int = 0) -> tuple[list[MetricEvent], int]:
    """Events from byte ``offset`` on, and the offset after the last complete line."""
    events: list[MetricEvent] = []
    p = Path(path)
    if not p.exists():
        return events, offset
    with open(p, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n")
    if end < 0:
        return events, offset
    for line in data[: end + 1].splitlines():
        try:
            events.append(MetricEvent.from_json(line.decode("utf-8")))
        except (ValueError, KeyError, UnicodeDecodeError):
            continue
    return events, offset + end + 1


def iter_events(path: str | os.PathLike) -> Iterator[MetricEvent]:
    events, _ = read_events(path)
    yield from events


def last_values(events: Iterable[MetricEvent]) -> dict[str, float]:
    """The latest value of each metric name (later events win)."""
    out: dict[str, float] = {}
    for e in events:
        out[e.name] = e.value
    return out

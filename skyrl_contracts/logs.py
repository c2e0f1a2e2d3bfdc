"""One logging path for every launched process: Python ``logging`` to stderr, which the supervisor
writes to ``logs/<process>.log`` with stdout, in one format everywhere. A process's machine-readable
answer (a child's JSON result line) stays on stdout as ``print``; everything said to a reader is a
log record."""

from __future__ import annotations

import logging
import os
import re
import time

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_LOGGERS = ("httpx",)  # one line per request otherwise


def setup_process_logging(level: int = logging.INFO) -> None:
    """Call first in a process's ``main``; later calls change nothing (``logging.basicConfig``)."""
    logging.basicConfig(level=level, format=FORMAT)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


class StartupClock:
    """Where a launched process's start-up goes, as laps from the moment the process was created
    (so the interpreter and the module-level imports count too, which timing from ``main`` would
    miss). ``line`` is the one log line a reader sees ("learner ready ... in 16.2 s (imports 12.5 s,
    ...)"); ``figures`` the same laps as ``startup/<process>/<lap>_s`` metrics for events.jsonl."""

    def __init__(self, process: str):
        self.process = process
        self.origin = process_created_at()
        self.last = self.origin
        self.laps: list[tuple[str, float]] = []
        self._now = time.time

    def lap(self, name: str) -> None:
        now = self._now()
        self.laps.append((name, now - self.last))
        self.last = now

    @property
    def total_s(self) -> float:
        return self.last - self.origin

    def line(self, what: str) -> str:
        laps = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.laps)
        return f"{what} in {self.total_s:.1f} s ({laps})"

    def figures(self) -> dict[str, float]:
        out = {f"startup/{self.process}/{metric_word(name)}_s": round(s, 3) for name, s in self.laps}
        out[f"startup/{self.process}_s"] = round(self.total_s, 3)
        return out


def metric_word(text: str) -> str:
    """``"recipe, data and tokenizer"`` -> ``"recipe_data_and_tokenizer"``: a lap as a metric name."""
    return "_".join(re.findall(r"[a-z0-9]+", text.lower()))


def process_created_at() -> float:
    """This process's creation time (epoch seconds) from Linux's ``/proc``; elsewhere, now. A warm
    process that an engine pool started long before the run counts from its hand-over instead
    (``SKYRL_STARTED_AT``, set in the job's environment: ``skyrl_contracts.standby``)."""
    if os.environ.get("SKYRL_STARTED_AT"):
        return float(os.environ["SKYRL_STARTED_AT"])
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()

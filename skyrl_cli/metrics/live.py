"""The rich live view: a progress bar with ETA and the run's key figures, updated from events.

Progress: the total comes from ``progress/total_steps``; the current step is ``progress/step`` when
a process logs it, else the highest step of any ``train/*`` event. A row is shown only once its
metric has been seen; a metric logged by several processes (e.g. each engine's KV-cache use) shows
the mean of their latest values.
"""

from __future__ import annotations

from typing import Any, Sequence

from skyrl_cli.metrics.sinks import Sink
from skyrl_cli.metrics.summary import SPECULATIVE_FIGURES, speculative_text
from skyrl_contracts.events import MetricEvent
from skyrl_contracts.health import SYNC_GAP, SYNC_GAP_BOUND, sync_gap_message

# (label, metric name, format)
ROWS: tuple[tuple[str, str, str], ...] = (
    ("rollout tokens/s", "rollout/tokens_per_s", "{:,.0f}"),
    ("training tokens/s", "train/tokens_per_s", "{:,.0f}"),
    ("loss", "train/loss", "{:.4f}"),
    ("learning rate", "train/lr", "{:.2e}"),
    ("reward", "rollout/reward_mean", "{:.3f}"),
    ("eval accuracy", "eval/accuracy", "{:.3f}"),
    ("eval loss", "eval/loss", "{:.4f}"),
    ("KV-cache use", "engine/kv_cache_usage", "{:.0%}"),
    ("staleness", "async/staleness_mean", "{:.2f}"),
    # Failed samples (reward 0; records in sample_errors.jsonl) and retried requests, run totals.
    ("sample errors", "rollout/errors", "{:,.0f}"),
    ("request retries", "rollout/retries", "{:,.0f}"),
)


class MetricBoard:
    """The latest value of each metric per process, the step and the total steps."""

    def __init__(self) -> None:
        self.latest: dict[str, dict[str, float]] = {}
        self.step = 0
        self.total: int | None = None
        self._explicit_step = False
        self.notice: str | None = None  # one health line (skyrl_contracts.health), from its first event

    def update(self, events: Sequence[MetricEvent]) -> None:
        for e in events:
            self.latest.setdefault(e.name, {})[e.process] = e.value
            if e.name == SYNC_GAP and self.notice is None:
                self.notice = sync_gap_message(e.step, e.value, self.value(SYNC_GAP_BOUND) or float("nan"))
            if e.name == "progress/total_steps":
                self.total = int(e.value)
            elif e.name == "progress/step":
                self.step, self._explicit_step = int(e.value), True
            elif e.name.startswith("train/") and not self._explicit_step:
                self.step = max(self.step, e.step)

    def value(self, name: str) -> float | None:
        per_process = self.latest.get(name)
        if not per_process:
            return None
        return sum(per_process.values()) / len(per_process)

    def rows(self) -> list[tuple[str, str]]:
        out = []
        for label, name, fmt in ROWS:
            value = self.value(name)
            if value is not None:
                out.append((label, fmt.format(value)))
        # The engines' speculative-decoding totals, zeros included, once they report any.
        figures = {name: self.value(f"spec/{name}") for name in SPECULATIVE_FIGURES}
        if figures["drafts"] is not None:
            out.append(("speculation", speculative_text({k: v for k, v in figures.items() if v is not None})))
        return out


class LiveView(Sink):
    """Default output mode: a live progress bar and figure table on the terminal (stderr)."""

    name = "live"

    def __init__(self, title: str, console: Any = None, refresh_per_second: float = 4):
        self.title = title
        self.console = console
        self.refresh_per_second = refresh_per_second
        self.board = MetricBoard()
        self._live = None

    def start(self) -> None:
        # lazy: rich; skyrl recipes validate and completions stay light
        from rich.console import Console
        from rich.live import Live
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        console = self.console or Console(stderr=True)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
        )
        self._task = self._progress.add_task(self.title, total=None)
        self._live = Live(self._render(), console=console, refresh_per_second=self.refresh_per_second)
        self._live.start()

    def _render(self):
        # lazy: rich; skyrl recipes validate and completions stay light
        from rich.console import Group
        from rich.table import Table

        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim")
        grid.add_column(justify="right")
        for label, text in self.board.rows():
            grid.add_row(label, text)
        if self.board.notice is None:
            return Group(self._progress, grid)
        # lazy: rich; skyrl recipes validate and completions stay light
        from rich.text import Text

        return Group(self._progress, grid, Text(f"warning: {self.board.notice}", style="bold red"))

    def handle(self, events: Sequence[MetricEvent]) -> None:
        self.board.update(events)
        if self._live is None:
            return
        self._progress.update(self._task, total=self.board.total, completed=self.board.step)
        self._live.update(self._render())

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

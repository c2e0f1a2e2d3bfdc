"""``summary.json``: the final figures of a run, computed from its ``events.jsonl``.

{"steps": 1200, "elapsed_s": 131.2, "time": 1767000000.0,
 "metrics": {"eval/accuracy": 0.86, "train/loss": 0.02, ...},          # last value of each
 "throughput": {"train/tokens_per_s": {"mean": 50123.0, "last": 51010.0}, ...},   # every */..._per_s
 "health": {"sync_gap_steps_over_bound": 3, ..., "message": "..."},   # only when a check fired
 ...extra}                                                              # given by the command
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterable, Mapping

from skyrl_contracts.atomic import write_json
from skyrl_contracts.events import MetricEvent, iter_events, last_values
from skyrl_contracts.health import sync_gap_health
from skyrl_contracts.rundir import RunDir


def summarize(events: Iterable[MetricEvent]) -> dict[str, Any]:
    events = list(events)
    per_second: dict[str, list[float]] = {}
    for e in events:
        if e.name.endswith("_per_s"):
            per_second.setdefault(e.name, []).append(e.value)
    # Training metrics are logged every few steps; an evaluation also marks a step that was trained
    # (an SFT run stopped by sft.stop_at_accuracy at step 475 logged train/ last at 470).
    train_steps = [e.step for e in events if e.name.startswith(("train/", "eval/"))]
    summary = {
        "steps": max(train_steps or [e.step for e in events] or [0]),
        "elapsed_s": round(events[-1].time - events[0].time, 3) if events else 0.0,
        "time": time.time(),
        "metrics": last_values(events),
        "throughput": {name: {"mean": sum(v) / len(v), "last": v[-1]} for name, v in sorted(per_second.items())},
    }
    health = sync_gap_health(events)
    if health is not None:
        summary["health"] = health
    return summary


def write_summary(run_dir: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write ``run_dir/summary.json`` atomically and return it."""
    paths = RunDir(run_dir)
    summary = {**summarize(iter_events(paths.events)), **(extra or {})}
    write_json(paths.summary, summary)
    return summary


def summary_table(summary: Mapping[str, Any]):
    """A rich table of the final figures (metrics, then throughput means)."""
    from rich.table import Table

    table = Table(
        title=f"summary ({summary.get('steps', 0)} steps, {summary.get('elapsed_s', 0):.0f} s)", show_header=False
    )
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for name, value in sorted(summary.get("metrics", {}).items()):
        if not name.endswith("_per_s") and not name.startswith("progress/"):
            table.add_row(name, f"{value:.6g}")
    for name, figures in summary.get("throughput", {}).items():
        table.add_row(f"{name} (mean)", f"{figures['mean']:,.1f}")
    return table

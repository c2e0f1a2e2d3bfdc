"""Run directories under a folder, one ``RUN`` argument resolved, and what a run is at a glance.

A run directory is any folder holding ``events.jsonl`` or ``recipe.resolved.json`` (``RunDir``'s
contract); ``skyrl sft`` / ``skyrl rl`` put them at ``runs/<name>/<stage>`` unless ``--run-dir``.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_cli.metrics.summary import summarize
from skyrl_contracts.errors import UsageError
from skyrl_contracts.events import MetricEvent, iter_events
from skyrl_contracts.rundir import RUNS_ROOT, RunDir

# A run without summary.json whose events.jsonl changed this recently is taken to be running: the
# engines' metrics scraper and the trainers write every few seconds, while a killed run (SIGKILL,
# a crash of the driver) leaves no summary and stops writing.
RUNNING_WITHIN_S = 120.0
# The engines' metrics scraper may log once more while the run tears down after summary.json: only
# events later than this after the summary's time mean a new launch (--resume) is writing.
SUMMARY_LAG_S = 15.0
# The final figures ``skyrl runs ls`` shows, first present wins per column.
HEADLINE = (
    ("accuracy", ("eval/accuracy",)),
    ("reward", ("rollout/reward_mean",)),
    ("loss", ("train/loss", "train/policy_loss")),
)


@dataclass(frozen=True)
class RunInfo:
    """A run at a glance: from ``summary.json`` once it ended, from its events so far before."""

    path: Path
    name: str
    stage: str
    status: str  # done | running | failed | interrupted (SIG...) | unfinished (no summary, no recent events)
    steps: int
    wall_s: float
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def metrics(self) -> dict[str, float]:
        return self.summary.get("metrics", {})

    def headline(self) -> dict[str, float | None]:
        return {label: next((self.metrics[n] for n in names if n in self.metrics), None) for label, names in HEADLINE}


def is_run_dir(path: Path) -> bool:
    run = RunDir(path)
    return run.events.is_file() or run.resolved_recipe.is_file()


def find_runs(root: Path = RUNS_ROOT) -> list[Path]:
    """Every run directory under ``root`` (``root`` itself included), sorted by path; a run's own
    subfolders (checkpoints, weights, ...) are not searched."""
    found = []
    for current, dirs, _ in os.walk(root):
        if is_run_dir(Path(current)):
            found.append(Path(current))
            dirs.clear()
        else:
            dirs.sort()
    return sorted(found)


def resolve_run(arg: str | os.PathLike, root: Path = RUNS_ROOT) -> Path:
    """A ``RUN`` argument: a run directory, or a path under ``root`` (``quickstart/rl``), or a
    folder under ``root`` holding exactly one run (``quickstart`` when only its SFT stage ran)."""
    for candidate in (Path(arg), root / arg):
        if candidate.is_dir():
            runs = find_runs(candidate)
            if len(runs) == 1:
                return runs[0]
            if len(runs) > 1:
                names = ", ".join(str(r) for r in runs)
                raise UsageError(f"{candidate} holds {len(runs)} runs ({names}); name one of them")
    raise UsageError(f"no run directory at {arg} (nor under {root}/); `skyrl runs ls` lists the runs under {root}/")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _ended_summary(run: RunDir, events: list[MetricEvent]) -> dict[str, Any] | None:
    """summary.json when it belongs to the events there: a resumed run keeps the summary of the
    launch it continues until it ends itself, and appends newer events meanwhile. (The events' own
    times, not file times: a copied run directory keeps them.)"""
    summary = _read_json(run.summary)
    newest = max((e.time for e in events), default=0.0)
    if summary is None or float(summary.get("time", 0)) + SUMMARY_LAG_S < newest:
        return None
    return summary


def _status(summary: dict[str, Any] | None, run: RunDir, now: float) -> str:
    if summary is not None:
        if summary.get("interrupted"):
            return f"interrupted ({summary['interrupted']})"
        return "done" if summary.get("completed") else "failed"
    try:
        recent = now - run.events.stat().st_mtime < RUNNING_WITHIN_S
    except OSError:
        recent = now - run.root.stat().st_mtime < RUNNING_WITHIN_S  # prepared, no event yet
    return "running" if recent else "unfinished"


def run_info(path: Path, now: float | None = None) -> RunInfo:
    """``path``'s name (the recipe's), stage, status, steps, wall time and final figures."""
    run = RunDir(path)
    events = list(iter_events(run.events))
    ended = _ended_summary(run, events)
    summary = ended if ended is not None else summarize(events)
    recipe = _read_json(run.resolved_recipe) or {}
    plan = _read_json(run.plan) or {}
    return RunInfo(
        path=path,
        name=str(recipe.get("name") or path.parent.name),
        stage=str(summary.get("stage") or plan.get("stage") or path.name),
        status=_status(ended, run, time.time() if now is None else now),
        steps=int(summary.get("steps") or 0),
        wall_s=float(summary.get("wall_s") or summary.get("elapsed_s") or 0.0),
        summary=summary,
    )


def short_labels(paths: list[Path]) -> list[str]:
    """The shortest trailing parts of each path that tell the runs apart (``sync``, ``async``;
    ``a/rl``, ``b/rl``), for legends and table columns."""
    parts = [Path(os.path.abspath(p)).parts for p in paths]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


# Per-update, per-engine and progress figures repeat the run-level ones in more detail.
_DETAIL = re.compile(r"^(train/update\d+/|engine/\d+/|progress/)")


def final_rows(infos: list[RunInfo], names: list[str] | None = None) -> list[tuple[str, list[float | None]]]:
    """``(metric, value of each run)`` for a table of final figures: ``names``, or every run-level
    metric any run has, then the throughput means."""
    if names is None:
        names = sorted({n for info in infos for n in info.metrics if not _DETAIL.match(n) and not n.endswith("_per_s")})
        means = sorted({n for info in infos for n in info.summary.get("throughput", {}) if not _DETAIL.match(n)})
    else:
        means = []
    rows = [(name, [info.metrics.get(name) for info in infos]) for name in names]
    for name in means:
        rows.append(
            (f"{name} (mean)", [info.summary.get("throughput", {}).get(name, {}).get("mean") for info in infos])
        )
    return rows

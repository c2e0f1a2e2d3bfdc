"""Metric curves from a run's ``events.jsonl``, against step and against wall time.

A curve is one metric of one process (a metric that several processes log, such as each engine's
``engine/kv_cache_usage``, gives one curve each). Wall time is seconds since the run's first
event. A run in progress gives the curves of its complete lines so far.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

from skyrl_contracts.events import MetricEvent, iter_events
from skyrl_contracts.rundir import RunDir


@dataclass
class Curve:
    name: str
    process: str
    steps: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # seconds since the run's first event
    values: list[float] = field(default_factory=list)

    def by_step(self) -> tuple[list[int], list[float]]:
        """One point per step, the mean of its values: the engines' scraper logs several samples
        under the same policy version."""
        sums: dict[int, list[float]] = defaultdict(list)
        for step, value in zip(self.steps, self.values):
            sums[step].append(value)
        steps = sorted(sums)
        return steps, [sum(sums[s]) / len(sums[s]) for s in steps]


@dataclass(frozen=True)
class Panel:
    """One plot of the report: the first metrics of ``names`` a run has, on one axis."""

    title: str
    names: tuple[str, ...]


# What a user looks at first after an SFT or RL run (each panel is drawn against step and wall time).
REPORT_PANELS = (
    Panel("reward", ("rollout/reward_mean",)),
    Panel("held-out accuracy", ("eval/accuracy",)),
    Panel("loss", ("train/loss", "train/policy_loss", "eval/loss")),
    Panel("KL", ("train/approx_kl", "train/kl_ref")),
    Panel("logprob diff, trainer vs engine", ("train/logprob_diff",)),
    Panel("throughput (tokens/s)", ("train/tokens_per_s", "rollout/tokens_per_s", "engine/gen_tokens_per_s")),
    Panel(
        "staleness (policy versions)", ("async/staleness_mean", "async/staleness_max", "rollout/batch_staleness_mean")
    ),
    Panel("engine KV cache use", ("engine/kv_cache_usage",)),
)


def curves_of(events: list[MetricEvent]) -> dict[str, list[Curve]]:
    """Curves by metric name, one per process that logged it, in file order."""
    start = min((e.time for e in events), default=0.0)
    by_key: dict[tuple[str, str], Curve] = {}
    for e in events:
        curve = by_key.get((e.name, e.process))
        if curve is None:
            curve = by_key[(e.name, e.process)] = Curve(e.name, e.process)
        curve.steps.append(e.step)
        curve.times.append(e.time - start)
        curve.values.append(e.value)
    out: dict[str, list[Curve]] = defaultdict(list)
    for curve in by_key.values():
        out[curve.name].append(curve)
    return dict(out)


def load_curves(run_dir: str | os.PathLike) -> dict[str, list[Curve]]:
    return curves_of(list(iter_events(RunDir(run_dir).events)))


def panel_curves(panel: Panel, curves: dict[str, list[Curve]]) -> list[tuple[str, Curve]]:
    """``(legend label, curve)`` of each of the panel's metrics in ``curves``; the process is
    named only where several log the metric."""
    found = []
    for name in panel.names:
        for curve in curves.get(name, []):
            label = name if len(curves[name]) == 1 else f"{name} [{curve.process}]"
            found.append((label, curve))
    return found


def metric_panels(names: list[str]) -> tuple[Panel, ...]:
    """One panel per metric (``skyrl runs compare --metric NAME``)."""
    return tuple(Panel(name, (name,)) for name in names)

"""``summary.json``: the final figures of a run, computed from its ``events.jsonl``.

{"steps": 1200, "elapsed_s": 131.2, "time": 1767000000.0,
 "wall_s": 216.0, "startup_s": 76.1, "training_s": 139.9,              # when the command gave started_at
 "metrics": {"eval/accuracy": 0.86, "train/loss": 0.02, ...},          # last value of each
 "throughput": {"train/tokens_per_s": {"mean": 50123.0, "last": 51010.0}, ...},   # every */..._per_s
 "health": {"sync_gap_steps_over_bound": 3, ..., "message": "..."},   # only when a check fired
                                                                       # (skyrl_contracts.health.run_health)
 "speculative": {"method": "ngram", "num_speculative_tokens": 3,       # when the engines speculate
                 "drafts": 412, "draft_tokens": 1236, "accepted_tokens": 830,
                 "acceptance_rate": 0.67, "mean_accepted_length": 3.01},
 ...extra}                                                              # given by the command
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterable, Mapping

from skyrl_contracts.atomic import write_json
from skyrl_contracts.events import MetricEvent, iter_events, last_values
from skyrl_contracts.health import run_health
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
    health = run_health(events, summary["metrics"])
    if health is not None:
        summary["health"] = health
    speculative = speculative_figures(summary["metrics"])
    if speculative:
        summary["speculative"] = speculative
    return summary


# The run totals of speculative decoding (skyrl_cli.engines.metrics) under their summary.json names.
SPECULATIVE_FIGURES = ("drafts", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length")


def speculative_figures(metrics: Mapping[str, float]) -> dict[str, float]:
    """The last ``spec/*`` totals of a run; empty when its engines did not speculate."""
    return {name: metrics[f"spec/{name}"] for name in SPECULATIVE_FIGURES if f"spec/{name}" in metrics}


def speculative_text(speculative: Mapping[str, Any]) -> str:
    """One line: the method, then the totals, zeros included (``ngram, k=3: 0 drafts ...``)."""
    head = str(speculative.get("method", "on"))
    if "num_speculative_tokens" in speculative:
        head += f", k={speculative['num_speculative_tokens']}"
    if "drafts" not in speculative:
        return f"{head}: no figures from the engines (their /metrics were not scraped)"
    drafts = speculative["drafts"]
    text = (
        f"{head}: {drafts:,.0f} drafts, {speculative.get('draft_tokens', 0):,.0f} draft tokens, "
        f"{speculative.get('accepted_tokens', 0):,.0f} accepted"
    )
    if drafts == 0:
        return text + " (nothing proposed: no speed-up)"
    return (
        f"{text} ({speculative.get('acceptance_rate', 0):.0%}), "
        f"{speculative.get('mean_accepted_length', 1):.2f} tokens/step"
    )


def time_split(events: Iterable[MetricEvent], started_at: float, wall_s: float) -> dict[str, float]:
    """``wall_s`` (the command's wall time) split at the moment training began: the last
    ``progress/total_steps`` event, which each training process logs once it is ready to step (for
    RL both the learner and the orchestrator, so start-up ends when the later of them is ready)."""
    ready = [e.time for e in events if e.name == "progress/total_steps" and e.time >= started_at]
    if not ready:
        return {}
    startup = min(max(ready) - started_at, wall_s)
    return {"startup_s": round(startup, 1), "training_s": round(wall_s - startup, 1)}


def write_summary(run_dir: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write ``run_dir/summary.json`` atomically and return it."""
    paths = RunDir(run_dir)
    events = list(iter_events(paths.events))
    summarized = summarize(events)
    summary = {**summarized, **(extra or {})}
    if "speculative" in summarized and "speculative" in (extra or {}):  # the recipe's method + the totals
        summary["speculative"] = {**extra["speculative"], **summarized["speculative"]}
    if "started_at" in summary and "wall_s" in summary:
        summary.update(time_split(events, summary["started_at"], summary["wall_s"]))
    write_json(paths.summary, summary)
    return summary


def summary_table(summary: Mapping[str, Any]):
    """Every final figure (metrics, then throughput means): ``skyrl runs show``."""
    # lazy: rich; skyrl recipes validate and completions stay light
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


# The figures the end-of-run table shows when the run has them, in this order (label, metric).
HEADLINE_METRICS = (
    ("train loss", "train/loss"),
    ("eval loss", "eval/loss"),
    ("mean reward", "rollout/reward_mean"),
    ("tool calls / episode", "rollout/tool_calls_mean"),
    ("tool errors / episode", "rollout/tool_errors_mean"),
)
HEADLINE_THROUGHPUT = (("rollout tokens/s", "rollout/tokens_per_s"), ("training tokens/s", "train/tokens_per_s"))


def wall_time_text(summary: Mapping[str, Any]) -> str:
    """``216 s (start-up 76 s, training 140 s)``: the command's wall time, split where known."""
    wall = summary.get("wall_s", summary.get("elapsed_s", 0.0))
    if "startup_s" in summary:
        return f"{wall:.0f} s (start-up {summary['startup_s']:.0f} s, training {summary['training_s']:.0f} s)"
    return f"{wall:.0f} s"


def accuracy_text(summary: Mapping[str, Any]) -> str | None:
    if "eval_accuracy_final" in summary:
        return f"{summary['eval_accuracy_initial']:.3f} -> {summary['eval_accuracy_final']:.3f}"
    value = summary.get("metrics", {}).get("eval/accuracy")
    return None if value is None else f"{value:.3f}"


def outcome_text(summary: Mapping[str, Any]) -> str:
    steps = summary.get("steps", 0)
    if not summary.get("completed", True):
        return f"stopped at step {steps}"
    if summary.get("metrics", {}).get("progress/stopped_early"):
        return f"stopped early at step {steps} (accuracy target reached)"
    return f"finished, {steps} steps"


def headline_rows(summary: Mapping[str, Any], run_dir: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """The end-of-run table a person reads (at most about 15 rows): the outcome, accuracy, a few
    losses, throughput, wall time, health and where the model and the rest of the figures are."""
    metrics = summary.get("metrics", {})
    rows = [("outcome", outcome_text(summary))]
    accuracy = accuracy_text(summary)
    if accuracy is not None:
        rows.append(("held-out accuracy", accuracy))
    rows += [(label, f"{metrics[name]:.4g}") for label, name in HEADLINE_METRICS if name in metrics]
    throughput = summary.get("throughput", {})
    rows += [(label, f"{throughput[name]['mean']:,.0f}") for label, name in HEADLINE_THROUGHPUT if name in throughput]
    if "wall_s" in summary:  # a run that failed before its end has no wall time of its own
        rows.append(("wall time", wall_time_text(summary)))
    if "speculative" in summary:
        rows.append(("speculative decoding", speculative_text(summary["speculative"])))
    if "health" in summary:
        rows.append(("health", str(summary["health"].get("message", "a check fired"))))
    for label, key in (("model", "final_model"), ("INT4 model", "int4_model"), ("INT4 export", "output")):
        if key in summary and os.path.exists(summary[key]):  # the path a run would write, if it got there
            rows.append((label, shown_path(summary[key])))
    if run_dir is not None:
        rows.append(("all figures", f"skyrl runs show {shown_path(run_dir)} (summary.json)"))
    return rows


def shown_path(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it is below it (shorter in a terminal)."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if relative.startswith("..") else relative


def headline_table(summary: Mapping[str, Any], run_dir: str | os.PathLike | None = None):
    # lazy: rich; skyrl recipes validate and completions stay light
    from rich.table import Table

    table = Table(title=f"{summary.get('stage', 'run')} summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    for label, value in headline_rows(summary, run_dir):
        table.add_row(label, value)
    return table

"""The tables of `skyrl bench routing` (``skyrl_cli.commands.bench``): simulated sweeps and live levels."""

from __future__ import annotations

BASELINE = "consistent_hash"  # the release's default policy: the ratio column is against it
LIVE_COLUMNS = (
    "policy",
    "routed by",
    "gen tok/s",
    "traj/s",
    "step s",
    "preempt",
    "prefix hit",
    "CV running",
    "p50 group s",
    "p90 group s",
)


def _fmt(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def render_tables(rows, console, baseline: str = BASELINE) -> None:
    # lazy: rich; skyrl recipes validate and completions stay light
    from rich.table import Table

    levels = list(dict.fromkeys((r.pressure, r.kv_ratio, r.kv_capacity) for r in rows))
    for label, ratio, capacity in levels:
        level_rows = [r for r in rows if r.pressure == label]
        has_baseline = any(r.policy == baseline for r in level_rows)
        table = Table(
            title=f"KV pressure {label}: KV cache {capacity:,} tokens per replica "
            f"({ratio:g} x working set), mean of {level_rows[0].seeds} seed(s)",
            title_justify="left",
        )
        table.add_column("policy", no_wrap=True)
        table.add_column("gen tok/s", justify="right", no_wrap=True)
        if has_baseline:
            table.add_column(
                "vs CH" if baseline == "consistent_hash" else f"vs {baseline}", justify="right", no_wrap=True
            )
        for name in ("traj/s", "step s", "preempt", "prefix hit", "CV running", "p50 group s", "p90 group s"):
            table.add_column(name, justify="right", no_wrap=True)
        best = max(r.metrics["gen_tokens_per_s"] for r in level_rows)
        for r in level_rows:
            m = r.metrics
            tok = _fmt(m["gen_tokens_per_s"])
            cells = [r.policy, f"[bold]{tok}[/bold]" if m["gen_tokens_per_s"] == best else tok]
            if has_baseline:
                cells.append("1.00x" if r.policy == baseline else f"{r.speedup_vs[baseline]:.2f}x")
            cells += [
                _fmt(m["trajectories_per_s"], 3),
                _fmt(m["step_time_s"], 1),
                _fmt(m["preemptions"], 1),
                f"{m['prefix_hit_rate']:.1%}",
                _fmt(m["running_cv"], 2),
                _fmt(m["group_latency_p50_s"]),
                _fmt(m["group_latency_p90_s"]),
            ]
            table.add_row(*cells)
        console.print(table)


def render_live_level(level: dict, console, *, engines: int, repeats: int, calibrate: bool) -> None:
    """One pressure level of the live benchmark (``skyrl_cli.routing.live_bench``): medians per policy,
    with the simulated figures and each run's fitted step cost under ``calibrate``."""
    # lazy: rich; skyrl recipes validate and completions stay light
    from rich.table import Table

    capacity, label = level["kv_capacity"], level["pressure"]
    table = Table(
        title=f"live: {engines} CPU engines, KV pressure {label} ({capacity:,} KV tokens per "
        f"engine = {capacity / level['working_set']:.2f} x working set), median of {repeats} run(s) per policy",
        title_justify="left",
    )
    columns = list(LIVE_COLUMNS) + (["sim tok/s", "sim / live"] if calibrate else [])
    for name in columns:
        table.add_column(name, justify="left" if name in ("policy", "routed by") else "right", no_wrap=True)
    for r in level["results"]:
        cells = [
            r["policy"],
            r["routed_by"],
            _fmt(r["gen_tokens_per_s"]),
            _fmt(r["trajectories_per_s"], 3),
            _fmt(r["step_time_s"], 2),
            _fmt(r["preemptions"]),
            f"{r['prefix_hit_rate']:.1%}",
            _fmt(r["running_cv"], 2),
            _fmt(r["group_latency_p50_s"], 2),
            _fmt(r["group_latency_p90_s"], 2),
        ]
        if calibrate:
            cells += [_fmt(r["sim_gen_tokens_per_s"]), f"{r['sim_over_live']:.2f}"]
        table.add_row(*cells)
    console.print(table)
    if calibrate:
        _print_fits(level, console)


def _print_fits(level: dict, console) -> None:
    for r in level["results"]:
        for run in r["runs"]:
            fit, cost = run["fitted"], run["fitted"]["cost"]
            console.print(
                f"  {r['policy']}: live {run['gen_tokens_per_s']:.0f} tok/s, simulated "
                f"{run['simulated']['gen_tokens_per_s']:.0f}; fitted step {cost['base_s'] * 1e3:.2f} ms + "
                f"{cost['per_seq_s'] * 1e3:.3f} ms/seq + {cost['per_prefill_token_s'] * 1e6:.1f} us/prefill token + "
                f"{cost['per_kv_token_s'] * 1e9:.2f} ns/KV token, {fit['request_overhead_s'] * 1e3:.1f} ms/request "
                f"outside the engine (max fit error {fit['max_relative_error']:.0%})"
            )

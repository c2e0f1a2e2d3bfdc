"""`skyrl bench ...`: benchmarks a user runs on their own workload shape.

`skyrl bench routing` compares routing policies under KV-cache pressure: simulated at cluster scale
by default, replayed against real vLLM engines behind vllm-router with ``--live``, and the two
compared with ``--calibrate``. The simulator lives in ``backends.routing`` and is imported inside
the command, so ``skyrl --help`` stays light.
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from skyrl_cli.errors import UsageError

BASELINE = "consistent_hash"  # the release's default policy: the ratio column is against it


def _fmt(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def render_tables(rows, console, baseline: str = BASELINE) -> None:
    from rich.table import Table

    levels = list(dict.fromkeys((r.pressure, r.kv_ratio, r.kv_capacity) for r in rows))
    for label, ratio, capacity in levels:
        level_rows = [r for r in rows if r.pressure == label]
        has_baseline = any(r.policy == baseline for r in level_rows)
        table = Table(title=f"KV pressure {label}: KV cache {capacity:,} tokens per replica "
                            f"({ratio:g} x working set), mean of {level_rows[0].seeds} seed(s)",
                      title_justify="left")
        table.add_column("policy", no_wrap=True)
        table.add_column("gen tok/s", justify="right", no_wrap=True)
        if has_baseline:
            table.add_column("vs CH" if baseline == "consistent_hash" else f"vs {baseline}", justify="right", no_wrap=True)
        for name in ("traj/s", "step s", "preempt", "prefix hit", "CV running", "p50 group s", "p90 group s"):
            table.add_column(name, justify="right", no_wrap=True)
        best = max(r.metrics["gen_tokens_per_s"] for r in level_rows)
        for r in level_rows:
            m = r.metrics
            tok = _fmt(m["gen_tokens_per_s"])
            cells = [r.policy, f"[bold]{tok}[/bold]" if m["gen_tokens_per_s"] == best else tok]
            if has_baseline:
                cells.append("1.00x" if r.policy == baseline else f"{r.speedup_vs[baseline]:.2f}x")
            cells += [_fmt(m["trajectories_per_s"], 3), _fmt(m["step_time_s"], 1), _fmt(m["preemptions"], 1),
                      f"{m['prefix_hit_rate']:.1%}", _fmt(m["running_cv"], 2), _fmt(m["group_latency_p50_s"]),
                      _fmt(m["group_latency_p90_s"])]
            table.add_row(*cells)
        console.print(table)


def register(app: typer.Typer) -> None:
    bench = typer.Typer(help="Benchmarks on your own workload shape.", no_args_is_help=True)

    @bench.command("routing")
    def routing(
        replicas: int = typer.Option(8, "--replicas", min=1, help="Inference replicas (engines)."),
        trajectories: int = typer.Option(256, "--trajectories", min=1,
                                         help="Trajectories generating at once (rounded to whole groups)."),
        turns: float = typer.Option(40.0, "--turns", min=1, help="Mean model turns per trajectory."),
        group_size: int = typer.Option(8, "--group-size", min=1, help="GRPO samples per prompt."),
        steps: int = typer.Option(4, "--steps", min=1, help="Trainer steps simulated."),
        trainer_step_s: float = typer.Option(60.0, "--trainer-step-s", min=0, help="Simulated trainer step, seconds."),
        staleness: int = typer.Option(4, "--staleness", min=0, help="Max policy versions generation runs ahead."),
        pressure: str = typer.Option("low,moderate,high", "--pressure",
                                     help="KV pressure levels: low, moderate, high, or numbers (KV capacity / working set)."),
        policies: Optional[str] = typer.Option(None, "--policies",
                                               help="Comma-separated policies (default: all)."),
        seed: int = typer.Option(0, "--seed", help="First seed."),
        repeats: int = typer.Option(3, "--repeats", min=1, help="Seeds per cell (paired across policies)."),
        as_json: bool = typer.Option(False, "--json", help="Print results as JSON instead of tables."),
        plot: Optional[str] = typer.Option(None, "--plot", help="Write a PNG: throughput and p90 latency vs KV pressure."),
        live: bool = typer.Option(False, "--live", help="Replay a small workload on real vLLM engines behind vllm-router."),
        calibrate: bool = typer.Option(False, "--calibrate",
                                       help="Run the live replay and the simulator fitted to the engines; compare."),
        run_dir: Optional[str] = typer.Option(None, "--run-dir", help="Where --live/--calibrate write logs and results."),
    ) -> None:
        """Compare routing policies under KV-cache pressure (simulated; --live / --calibrate on real engines)."""
        from rich.console import Console

        from backends.routing import sweep as sw
        from backends.routing.policies import DEFAULT_POLICIES

        try:
            levels = sw.parse_pressures(pressure)
            names = sw.parse_policies(policies) if policies else list(DEFAULT_POLICIES)
        except ValueError as err:
            raise UsageError(str(err)) from None
        if live or calibrate:
            from backends.routing import live as live_mode

            try:
                report = live_mode.run_from_cli(policies=names if policies else None, calibrate=calibrate,
                                                seed=seed, run_dir=run_dir, as_json=as_json)
            except ValueError as err:
                raise UsageError(str(err)) from None
            if as_json:
                typer.echo(json.dumps(report, indent=2))
            return

        workload = sw.with_overrides(
            sw.WorkloadSpec(), group_size=group_size, max_inflight_groups=max(1, round(trajectories / group_size)),
            turns_mean=turns, trainer_steps=steps, trainer_step_s=trainer_step_s, max_staleness=staleness)
        config = sw.SweepConfig(replicas=replicas, workload=workload, policies=tuple(names), pressures=tuple(levels),
                                seeds=tuple(range(seed, seed + repeats)))
        try:
            workload.validate()
            sw.kv_capacity_for(config, levels[0][1])
        except ValueError as err:
            raise UsageError(str(err)) from None

        console = Console(stderr=as_json)
        if not console.is_terminal:
            console.width = max(console.width, 132)  # piped to a file: keep whole table rows on one line
        total = len(levels) * len(names) * repeats
        done = [0]
        with console.status(f"simulating {total} runs...") as status:
            def progress(result) -> None:
                done[0] += 1
                status.update(f"simulating: {done[0]}/{total} ({result.label}, {result.policy})")

            rows = sw.run_sweep(config, on_result=progress)
        if as_json:
            typer.echo(json.dumps(sw.sweep_to_json(config, rows), indent=2))
        else:
            console.print(
                f"[bold]Simulated fully-async GRPO[/bold]: {replicas} replicas, "
                f"{workload.max_inflight_trajectories} trajectories in flight ({workload.max_inflight_groups} groups of "
                f"{workload.group_size}), ~{workload.turns_mean:g} turns, {workload.groups_per_step} groups per step, "
                f"{steps} steps of {trainer_step_s:g} s, staleness {staleness}.")
            render_tables(rows, console)
        if plot:
            from backends.routing.plot import plot_sweep

            path = plot_sweep(rows, plot)
            console.print(f"plot written to {path}")

    app.add_typer(bench, name="bench")

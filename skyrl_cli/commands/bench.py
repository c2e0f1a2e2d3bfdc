"""`skyrl bench ...`: benchmarks a user runs on their own workload shape.

`skyrl bench routing` compares routing policies under KV-cache pressure: simulated at cluster scale
by default, replayed against real vLLM engines behind vllm-router with ``--live``, and the two
compared with ``--calibrate``. The simulator and the live benchmark's replay loop live in
``skyrl_cli.routing`` and are imported inside the command, so ``skyrl --help`` stays light; the
engines and the router of ``--live`` are started here, from the launch plan, by the supervisor
(``SupervisedCluster``, handed to ``skyrl_cli.routing.live_bench`` as its ``LiveCluster``).
"""

from __future__ import annotations

import json

import typer

from skyrl_cli.commands.bench_tables import render_live_level, render_tables
from skyrl_contracts.errors import UsageError


# ------------------------------------------------------------------------------------------- live
def _routing_live(names, pressure, seed, calibrate, repeats, run_dir, as_json) -> None:
    # lazy: rich; skyrl recipes validate and completions stay light
    from rich.console import Console

    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.routing import sweep as sw
    from skyrl_cli.routing.cluster import start_cluster
    from skyrl_cli.routing.live_bench import (
        LIVE_ENGINES,
        LiveBenchConfig,
        run_live_bench,
    )

    levels = sw.parse_pressures(pressure) if pressure else [("moderate", sw.PRESSURE_LEVELS["moderate"])]
    repeats = repeats or (2 if calibrate else 1)
    console = Console(stderr=as_json)
    if not console.is_terminal:
        console.width = max(console.width, 150)
    config = LiveBenchConfig(policies=names, levels=levels, seed=seed, calibrate=calibrate, repeats=repeats)
    report = run_live_bench(
        config,
        run_dir or "runs/bench-routing",
        lambda request: start_cluster(request, console.print),
        say=console.print,
        on_level=lambda level: render_live_level(
            level, console, engines=LIVE_ENGINES, repeats=repeats, calibrate=calibrate
        ),
    )
    if as_json:
        typer.echo(json.dumps(report, indent=2))


# ------------------------------------------------------------------------------------------- simulated
def _routing_simulated(config, as_json: bool, plot: str | None) -> None:
    # lazy: rich; skyrl recipes validate and completions stay light
    from rich.console import Console

    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.routing import sweep as sw

    workload = config.workload
    console = Console(stderr=as_json)
    if not console.is_terminal:
        console.width = max(console.width, 132)  # piped to a file: keep whole table rows on one line
    total = len(config.pressures) * len(config.policies) * len(config.seeds)
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
            f"[bold]Simulated fully-async GRPO[/bold]: {config.replicas} replicas, "
            f"{workload.max_inflight_trajectories} trajectories in flight ({workload.max_inflight_groups} groups of "
            f"{workload.group_size}), ~{workload.turns_mean:g} turns, {workload.groups_per_step} groups per step, "
            f"{workload.trainer_steps} steps of {workload.trainer_step_s:g} s, staleness {workload.max_staleness}."
        )
        render_tables(rows, console)
    if plot:
        _write_plot(rows, plot, console)


def _write_plot(rows, plot: str, console) -> None:
    try:
        # lazy: matplotlib; skyrl --help and the light commands stay light
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.routing.plot import plot_sweep

    path = plot_sweep(rows, plot)
    console.print(f"plot written to {path}")


def _sweep_config(
    names,
    levels,
    replicas,
    trajectories,
    turns,
    group_size,
    groups_per_step,
    steps,
    trainer_step_s,
    staleness,
    seed,
    repeats,
):
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.routing import sweep as sw

    workload = sw.with_overrides(
        sw.WorkloadSpec(),
        group_size=group_size,
        max_inflight_groups=max(1, round(trajectories / group_size)),
        turns_mean=turns,
        groups_per_step=groups_per_step,
        trainer_steps=steps,
        trainer_step_s=trainer_step_s,
        max_staleness=staleness,
    )
    config = sw.SweepConfig(
        replicas=replicas,
        workload=workload,
        policies=tuple(names),
        pressures=tuple(levels),
        seeds=tuple(range(seed, seed + (repeats or 3))),
    )
    try:
        workload.validate()
        sw.kv_capacity_for(config, levels[0][1])
    except ValueError as err:
        raise UsageError(str(err)) from None
    return config


# ------------------------------------------------------------------------------------------- command
def routing(
    replicas: int = typer.Option(8, "--replicas", min=1, help="Inference replicas (engines)."),
    trajectories: int = typer.Option(
        256, "--trajectories", min=1, help="Trajectories generating at once (rounded to whole groups)."
    ),
    turns: float = typer.Option(40.0, "--turns", min=1, help="Mean model turns per trajectory."),
    group_size: int = typer.Option(8, "--group-size", min=1, help="GRPO samples per prompt."),
    groups_per_step: int = typer.Option(16, "--groups-per-step", min=1, help="Groups the trainer consumes per step."),
    steps: int = typer.Option(4, "--steps", min=1, help="Trainer steps simulated."),
    trainer_step_s: float = typer.Option(60.0, "--trainer-step-s", min=0, help="Simulated trainer step, seconds."),
    staleness: int = typer.Option(4, "--staleness", min=0, help="Max policy versions generation runs ahead."),
    pressure: str | None = typer.Option(
        None,
        "--pressure",
        help="KV pressure levels: low, moderate, high, or numbers (KV capacity / working set); "
        "default low,moderate,high (simulated), moderate (--live).",
    ),
    policies: str | None = typer.Option(None, "--policies", help="Comma-separated policies (default: all)."),
    seed: int = typer.Option(0, "--seed", help="First seed."),
    repeats: int | None = typer.Option(
        None,
        "--repeats",
        min=1,
        help="Simulated: seeds per cell, paired across policies (default 3). "
        "--live: replays per policy, medians reported (default 1; 2 with --calibrate).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print results as JSON instead of tables."),
    plot: str | None = typer.Option(None, "--plot", help="Write a PNG: throughput and p90 latency vs KV pressure."),
    live: bool = typer.Option(False, "--live", help="Replay a small workload on real vLLM engines behind vllm-router."),
    calibrate: bool = typer.Option(
        False, "--calibrate", help="Run the live replay and the simulator fitted to the engines; compare."
    ),
    run_dir: str | None = typer.Option(
        None,
        "--run-dir",
        help="Where --live/--calibrate keep the model, logs and results (default runs/bench-routing).",
    ),
) -> None:
    """Compare routing policies under KV-cache pressure (simulated; --live / --calibrate on real engines)."""
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.routing import sweep as sw
    from skyrl_cli.routing.policies import DEFAULT_POLICIES

    try:
        levels = sw.parse_pressures(pressure or "low,moderate,high")
        names = sw.parse_policies(policies) if policies else list(DEFAULT_POLICIES)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if live or calibrate:
        _routing_live(names, pressure, seed, calibrate, repeats, run_dir, as_json)
        return
    config = _sweep_config(
        names,
        levels,
        replicas,
        trajectories,
        turns,
        group_size,
        groups_per_step,
        steps,
        trainer_step_s,
        staleness,
        seed,
        repeats,
    )
    _routing_simulated(config, as_json, plot)


def register(app: typer.Typer) -> None:
    bench = typer.Typer(help="Benchmarks on your own workload shape.", no_args_is_help=True)
    bench.command("routing")(routing)
    app.add_typer(bench, name="bench")

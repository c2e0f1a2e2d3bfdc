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

from skyrl_cli.atomic import write_json
from skyrl_cli.errors import LaunchError, UsageError

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


# ------------------------------------------------------------------------------------------- live
# Two tiny-model CPU engines, each on its own core; the workload is backends.routing.live.LIVE_WORKLOAD.
LIVE_ENGINES = 2
LIVE_MODEL = {"hidden_size": 128, "layers": 2, "heads": 4, "max_position_embeddings": 2048}
LIVE_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*=?.,"
LIVE_MAX_NUM_SEQS = 64
CPU_BLOCK_SIZE = 128           # vLLM's KV block on CPU
CPU_MAX_BATCHED_TOKENS = 2048  # vLLM's default token budget per step for the CPU OpenAI server


def _live_recipe(policy: str, kv_cache_bytes: int, max_model_len: int):
    from skyrl_cli.recipe.schema import Recipe

    router_policy = policy if policy in ("round_robin", "consistent_hash", "sticky_least_loaded") else "round_robin"
    return Recipe.model_validate({
        "name": "bench-routing",
        "model": {"init": LIVE_MODEL, "tokenizer": "char"},
        "data": {"task": "addition"},
        "rl": {},
        "inference": {"engines": LIVE_ENGINES, "kv_cache_bytes": kv_cache_bytes, "max_model_len": max_model_len,
                      "max_num_seqs": LIVE_MAX_NUM_SEQS, "router": {"policy": router_policy}},
    })


def _build_live_model(model_dir):
    """The tiny random model and its character tokenizer; returns the token ids prompts may use."""
    from pathlib import Path

    from backends.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(LIVE_ALPHABET)
    if not (Path(model_dir) / "config.json").exists():
        from backends.models.loading import save_hf
        from backends.models.tiny import build_tiny_llama
        from skyrl_cli.recipe.schema import TinyModelInit

        save_hf(build_tiny_llama(TinyModelInit(**LIVE_MODEL), tokenizer, seed=0), tokenizer, model_dir)
    return [tokenizer.convert_tokens_to_ids(c) for c in LIVE_ALPHABET]


def _summarize_live_runs(policy: str, runs: list[dict]) -> dict:
    """Median over repeated replays of one policy (and of their simulations), with every run kept."""
    from statistics import median

    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    summary = {"policy": policy, "routed_by": runs[0]["routed_by"], "runs": runs}
    summary.update({k: median(r[k] for r in runs) for k in keys})
    if "simulated" in runs[0]:
        summary["sim_gen_tokens_per_s"] = median(r["simulated"]["gen_tokens_per_s"] for r in runs)
        summary["sim_over_live"] = summary["sim_gen_tokens_per_s"] / summary["gen_tokens_per_s"]
    return summary


def _run_live(*, policies, levels, seed, calibrate, repeats, run_dir, console) -> dict:
    """Start 2 CPU engines per pressure level, replay the live workload once per policy (vllm-router for
    the policies it has, client-side routing for ours), and with ``calibrate`` fit the simulator to the
    engines and simulate the same runs. Everything started here is torn down on the way out."""
    import asyncio
    import os
    from pathlib import Path

    import httpx
    from rich.table import Table

    from backends.routing import calibrate as cal
    from backends.routing import live as lv
    from backends.routing.policies import make_policy
    from backends.routing.simulator import SimConfig, simulate
    from backends.routing.workload import working_set_per_replica
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import Machine, all_engine_urls, engine_specs, engine_url, router_spec
    from skyrl_cli.plan.machine import find_free_ports

    root = Path(run_dir or "runs/bench-routing")
    root.mkdir(parents=True, exist_ok=True)
    token_pool = _build_live_model(root / "model")
    spec = lv.LIVE_WORKLOAD
    cores = tuple(sorted(os.sched_getaffinity(0)))
    machine = Machine(device="cpu", engine_cores=cores)
    kv_bytes_per_token = 2 * LIVE_MODEL["layers"] * LIVE_MODEL["hidden_size"] * 2  # K and V, bf16
    working_set = working_set_per_replica(spec, 0, LIVE_ENGINES)
    report: dict = {"workload": spec.__dict__, "engines": LIVE_ENGINES, "model": LIVE_MODEL, "levels": []}

    for label, ratio in levels:
        kv_tokens = max(int(ratio * working_set), spec.max_context + CPU_BLOCK_SIZE)
        kv_tokens = -(-kv_tokens // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE
        recipe = _live_recipe("round_robin", kv_tokens * kv_bytes_per_token, spec.max_context + CPU_BLOCK_SIZE)
        level_dir = root / f"pressure-{label}"
        *ports, router_port, prom_port = find_free_ports(LIVE_ENGINES + 2)
        engines = engine_specs(recipe, machine, ports, str(root / "model"))
        urls = all_engine_urls(recipe, machine, ports)
        router_url = engine_url(machine, router_port)
        level: dict = {"pressure": label, "kv_ratio": ratio, "results": []}
        with Supervisor(level_dir) as sup:
            console.print(f"[bold]live, KV pressure {label}[/bold]: starting {LIVE_ENGINES} CPU engines ...")
            for engine in engines:
                sup.start(engine)
            sup.wait_ready([e.name for e in engines])
            capacity = lv.kv_capacity_from_log(level_dir / "logs" / f"{engines[0].name}.log") or kv_tokens
            level["kv_capacity"] = capacity
            level["working_set"] = working_set

            async def run_policy(http, policy: str, router_state: dict) -> dict:
                fitted = None
                if calibrate:
                    # Measured right before the run it predicts: on a shared machine the cost drifts.
                    await lv.reset_engines(http, urls)
                    console.print(f"measuring the engines' step cost before the {policy} run ...")
                    fitted = await cal.measure_engines(http, urls, token_pool, seed)
                await lv.reset_engines(http, urls)
                if make_policy(policy, urls).router_policy is not None:
                    router = router_spec(_live_recipe(policy, 1, 1), machine, urls, router_port, prom_port)
                    if router_state.get("started"):
                        sup.restart("router", router)
                    else:
                        sup.start(router)
                        router_state["started"] = True
                    await asyncio.to_thread(sup.wait_ready, ["router"])
                    target = lv.RouterTarget(http, router_url)
                else:
                    target = lv.ClientSideTarget(http, urls, make_policy(policy, urls, [capacity] * len(urls)))
                console.print(f"replaying the workload with {policy} ({target.routed_by}) ...")
                result = (await lv.replay(spec, seed, policy, target, urls, token_pool, http)).to_dict()
                if fitted is not None:
                    sim = simulate(SimConfig(
                        policy=policy, replicas=LIVE_ENGINES, kv_capacity=capacity, cost=fitted.cost, workload=spec,
                        seed=seed, max_num_seqs=LIVE_MAX_NUM_SEQS, max_num_batched_tokens=CPU_MAX_BATCHED_TOKENS,
                        block_size=CPU_BLOCK_SIZE, request_overhead_s=fitted.request_overhead_s))
                    result["simulated"] = sim.to_dict()
                    result["fitted"] = fitted.to_dict()
                return result

            async def session():
                router_state: dict = {}
                runs: dict[str, list[dict]] = {p: [] for p in policies}
                async with lv.http_client() as http:
                    for rep in range(repeats):
                        # Rotate the order so that no policy always runs first (machine load drifts).
                        order = policies[rep % len(policies):] + policies[:rep % len(policies)]
                        for policy in order:
                            run = await run_policy(http, policy, router_state)
                            runs[policy].append(run)
                            with open(root / "live-runs.jsonl", "a") as fh:  # kept even if a later run fails
                                fh.write(json.dumps({"pressure": label, "repeat": rep, **run}) + "\n")
                for policy in policies:
                    level["results"].append(_summarize_live_runs(policy, runs[policy]))

            try:
                asyncio.run(session())
            except (httpx.HTTPError, OSError) as err:
                dead = [name for name, code in sup.poll().items() if code is not None]
                raise LaunchError(f"live replay failed: {type(err).__name__}: {err}; "
                                  f"{'exited: ' + ', '.join(dead) if dead else 'no process exited'} "
                                  f"(logs in {level_dir / 'logs'}; runs so far in {root / 'live-runs.jsonl'})") from err
        report["levels"].append(level)

        table = Table(title=f"live: {LIVE_ENGINES} CPU engines, KV pressure {label} ({capacity:,} KV tokens per "
                            f"engine = {capacity / working_set:.2f} x working set), median of {repeats} run(s) per policy",
                      title_justify="left")
        columns = ["policy", "routed by", "gen tok/s", "traj/s", "step s", "preempt", "prefix hit", "CV running",
                   "p50 group s", "p90 group s"]
        if calibrate:
            columns += ["sim tok/s", "sim / live"]
        for name in columns:
            table.add_column(name, justify="left" if name in ("policy", "routed by") else "right", no_wrap=True)
        for r in level["results"]:
            cells = [r["policy"], r["routed_by"], _fmt(r["gen_tokens_per_s"]), _fmt(r["trajectories_per_s"], 3),
                     _fmt(r["step_time_s"], 2), _fmt(r["preemptions"]), f"{r['prefix_hit_rate']:.1%}",
                     _fmt(r["running_cv"], 2), _fmt(r["group_latency_p50_s"], 2), _fmt(r["group_latency_p90_s"], 2)]
            if calibrate:
                cells += [_fmt(r["sim_gen_tokens_per_s"]), f"{r['sim_over_live']:.2f}"]
            table.add_row(*cells)
        console.print(table)
        if calibrate:
            for r in level["results"]:
                for run in r["runs"]:
                    fit, cost = run["fitted"], run["fitted"]["cost"]
                    console.print(
                        f"  {r['policy']}: live {run['gen_tokens_per_s']:.0f} tok/s, simulated "
                        f"{run['simulated']['gen_tokens_per_s']:.0f}; fitted step {cost['base_s'] * 1e3:.2f} ms + "
                        f"{cost['per_seq_s'] * 1e3:.3f} ms/seq + {cost['per_prefill_token_s'] * 1e6:.1f} us/prefill token + "
                        f"{cost['per_kv_token_s'] * 1e9:.2f} ns/KV token, {fit['request_overhead_s'] * 1e3:.1f} ms/request "
                        f"outside the engine (max fit error {fit['max_relative_error']:.0%})")
    out = root / ("calibration.json" if calibrate else "live.json")
    write_json(out, report)
    console.print(f"results written to {out}")
    return report


def register(app: typer.Typer) -> None:
    bench = typer.Typer(help="Benchmarks on your own workload shape.", no_args_is_help=True)

    @bench.command("routing")
    def routing(
        replicas: int = typer.Option(8, "--replicas", min=1, help="Inference replicas (engines)."),
        trajectories: int = typer.Option(256, "--trajectories", min=1,
                                         help="Trajectories generating at once (rounded to whole groups)."),
        turns: float = typer.Option(40.0, "--turns", min=1, help="Mean model turns per trajectory."),
        group_size: int = typer.Option(8, "--group-size", min=1, help="GRPO samples per prompt."),
        groups_per_step: int = typer.Option(16, "--groups-per-step", min=1, help="Groups the trainer consumes per step."),
        steps: int = typer.Option(4, "--steps", min=1, help="Trainer steps simulated."),
        trainer_step_s: float = typer.Option(60.0, "--trainer-step-s", min=0, help="Simulated trainer step, seconds."),
        staleness: int = typer.Option(4, "--staleness", min=0, help="Max policy versions generation runs ahead."),
        pressure: Optional[str] = typer.Option(
            None, "--pressure", help="KV pressure levels: low, moderate, high, or numbers (KV capacity / working set); "
            "default low,moderate,high (simulated), moderate (--live)."),
        policies: Optional[str] = typer.Option(None, "--policies",
                                               help="Comma-separated policies (default: all)."),
        seed: int = typer.Option(0, "--seed", help="First seed."),
        repeats: Optional[int] = typer.Option(
            None, "--repeats", min=1, help="Simulated: seeds per cell, paired across policies (default 3). "
            "--live: replays per policy, medians reported (default 1; 2 with --calibrate)."),
        as_json: bool = typer.Option(False, "--json", help="Print results as JSON instead of tables."),
        plot: Optional[str] = typer.Option(None, "--plot", help="Write a PNG: throughput and p90 latency vs KV pressure."),
        live: bool = typer.Option(False, "--live", help="Replay a small workload on real vLLM engines behind vllm-router."),
        calibrate: bool = typer.Option(False, "--calibrate",
                                       help="Run the live replay and the simulator fitted to the engines; compare."),
        run_dir: Optional[str] = typer.Option(None, "--run-dir",
                                              help="Where --live/--calibrate keep the model, logs and results "
                                                   "(default runs/bench-routing)."),
    ) -> None:
        """Compare routing policies under KV-cache pressure (simulated; --live / --calibrate on real engines)."""
        from rich.console import Console

        from backends.routing import sweep as sw
        from backends.routing.policies import DEFAULT_POLICIES

        try:
            levels = sw.parse_pressures(pressure or "low,moderate,high")
            names = sw.parse_policies(policies) if policies else list(DEFAULT_POLICIES)
        except ValueError as err:
            raise UsageError(str(err)) from None
        if live or calibrate:
            live_levels = sw.parse_pressures(pressure) if pressure else [("moderate", sw.PRESSURE_LEVELS["moderate"])]
            console = Console(stderr=as_json)
            if not console.is_terminal:
                console.width = max(console.width, 150)
            report = _run_live(policies=names, levels=live_levels, seed=seed, calibrate=calibrate,
                               repeats=repeats or (2 if calibrate else 1), run_dir=run_dir, console=console)
            if as_json:
                typer.echo(json.dumps(report, indent=2))
            return

        workload = sw.with_overrides(
            sw.WorkloadSpec(), group_size=group_size, max_inflight_groups=max(1, round(trajectories / group_size)),
            turns_mean=turns, groups_per_step=groups_per_step, trainer_steps=steps, trainer_step_s=trainer_step_s, max_staleness=staleness)
        config = sw.SweepConfig(replicas=replicas, workload=workload, policies=tuple(names), pressures=tuple(levels),
                                seeds=tuple(range(seed, seed + (repeats or 3))))
        try:
            workload.validate()
            sw.kv_capacity_for(config, levels[0][1])
        except ValueError as err:
            raise UsageError(str(err)) from None

        console = Console(stderr=as_json)
        if not console.is_terminal:
            console.width = max(console.width, 132)  # piped to a file: keep whole table rows on one line
        total = len(levels) * len(names) * len(config.seeds)
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
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
            from backends.routing.plot import plot_sweep

            path = plot_sweep(rows, plot)
            console.print(f"plot written to {path}")

    app.add_typer(bench, name="bench")

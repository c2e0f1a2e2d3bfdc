"""`skyrl engines up|status|down`: engine pools, a recipe's vLLM engines and router that outlive
runs (``skyrl_cli.engines.pool``). `skyrl rl` uses a free pool that fits its recipe (``--pool``)."""

from __future__ import annotations

import json
import time
from typing import Annotated, Optional

import typer

from skyrl_cli.commands import common
from skyrl_contracts.errors import UsageError

AsyncOpt = Annotated[bool, typer.Option("--async", help="Engines as skyrl rl --async starts them (for --async runs).")]


def up(
    recipe: common.RecipeArg,
    name: Annotated[Optional[str], typer.Option("--name", help="The pool's name (default: the recipe's name).")] = None,
    async_mode: AsyncOpt = False,
    warm: Annotated[
        bool,
        typer.Option(
            "--warm/--no-warm",
            help="Also keep a warm learner and orchestrator (started, their imports done) for the runs.",
        ),
    ] = True,
    set_: common.SetOpt = None,
    dry_run: common.DryRunOpt = False,
    json_: common.JsonOpt = False,
) -> None:
    """Start the engines and router of RECIPE's RL stage as a pool and return once they serve.

    The pool also keeps the recipe's learner (its torchrun ranks) and orchestrator started and
    imported (--no-warm: not), so a run that fits skips their start-up as well as the engines'."""
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.engines.pool import check_name, pools_dir, prepare_pool_dir, start_pool
    from skyrl_cli.plan.feasibility import assert_feasible
    from skyrl_cli.plan.machine import detect_machine
    from skyrl_cli.plan.pool import model_signature, plan_pool
    from skyrl_cli.plan.rl import init_model_dir

    machine = detect_machine()
    loaded = common.load_for_run(recipe, set_, "rl", machine=machine)
    assert_feasible(loaded, machine)
    pool_name = check_name(name or loaded.name)
    if dry_run:
        common.print_plan(plan_pool(loaded, pools_dir() / pool_name, machine, async_mode, warm), json_)
        return
    started = time.monotonic()
    path = prepare_pool_dir(pool_name)
    plan = plan_pool(loaded, path, machine, async_mode, warm)
    pool, problems = start_pool(plan, pool_name, loaded.name, model_signature(init_model_dir(loaded)))
    for problem in problems:
        typer.echo(f"warning: {problem}", err=True)
    if json_:
        typer.echo(json.dumps(pool.to_json()))
        return
    kept = " and ".join(p.spec.name for p in pool.warm.values())
    typer.echo(
        f"engine pool {pool.name}: {len(pool.engines)} engine(s) {', '.join(pool.engine_urls)}, router {pool.router_url}"
        f"{''.join(f', {p.spec.name} {u}' for p, u in zip(pool.auxiliaries, pool.auxiliary_engine_urls))}"
        f"{', ' + kept if kept else ''}, up in {time.monotonic() - started:.0f} s; skyrl rl uses it when it fits "
        f"(skyrl engines down {pool.name} stops it)"
    )


def status(json_: common.JsonOpt = False) -> None:
    """The pools on this machine: engines (the auxiliary models' too), router, warm processes, health, the weights they serve, who uses them, since when."""
    # lazy: rich; skyrl recipes validate and completions stay light
    from rich.console import Console
    from rich.table import Table

    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.engines.pool import health, list_pools, pools_dir, served_version

    pools = list_pools()
    rows = []
    for pool in pools:
        holder = pool.holder()
        rows.append(
            {
                "name": pool.name,
                "recipe": pool.recipe,
                "engines": [
                    {"url": u, "pid": p.pid, "healthy": health(u), "weight_version": served_version(u)}
                    for u, p in zip(pool.engine_urls, pool.engines)
                ],
                "auxiliaries": [
                    {"name": p.spec.name, "url": u, "pid": p.pid, "healthy": health(u)}
                    for p, u in zip(pool.auxiliaries, pool.auxiliary_engine_urls)
                ],
                "router": {
                    "url": pool.router_url,
                    "pid": pool.router.pid,
                    "healthy": health(pool.router_url, "/liveness"),
                },
                "warm": {pool.warm[role].spec.name: s for role, s in pool.warm_state().items()},
                "model": pool.served_model,
                "weight_sync": pool.weight_sync,
                "async": pool.async_mode,
                "in_use_by": holder.get("run_dir") if holder else None,
                "since": pool.created_at,
            }
        )
    if json_:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    if not rows:
        typer.echo(f"no engine pools (in {pools_dir()}); skyrl engines up RECIPE starts one")
        return
    table = Table(title="engine pools (skyrl engines down NAME stops one)")
    for column in ("pool", "engines", "router", "warm", "serves", "in use by", "up since"):
        table.add_column(column, overflow="fold")
    for row in rows:
        engines = "\n".join(
            [f"{e['url']} {'ok' if e['healthy'] else 'DOWN'} v{e['weight_version']}" for e in row["engines"]]
            + [f"{a['name']} {a['url']} {'ok' if a['healthy'] else 'DOWN'}" for a in row["auxiliaries"]]
        )
        router = f"{row['router']['url']} {'ok' if row['router']['healthy'] else 'DOWN'}"
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["since"]))
        table.add_row(
            f"{row['name']} ({row['recipe']})",
            engines,
            router,
            "\n".join(f"{name.removeprefix('warm-')} {s}" for name, s in row["warm"].items()) or "-",
            row["model"],
            row["in_use_by"] or "-",
            since,
        )
    Console().print(table)


def down(
    name: Annotated[Optional[str], typer.Argument(help="The pool to stop (default: the only one).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Stop every pool.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Stop it even while a run uses it.")] = False,
) -> None:
    """Stop a pool's engines and router and remove its folder."""
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.engines.pool import get_pool, list_pools, stop_pool

    pools = list_pools()
    if all_:
        targets = pools
    elif name is not None:
        targets = [get_pool(name)]
    elif len(pools) == 1:
        targets = pools
    else:
        names = ", ".join(p.name for p in pools) or "none"
        raise UsageError(f"name the pool to stop (pools: {names}), or pass --all")
    for pool in targets:
        stop_pool(pool, force=force)
        typer.echo(f"stopped engine pool {pool.name}")


def register(app: typer.Typer) -> None:
    sub = typer.Typer(help="Engine pools: vLLM engines and a router that outlive runs.", no_args_is_help=True)
    sub.command("up")(up)
    sub.command("status")(status)
    sub.command("down")(down)
    app.add_typer(sub, name="engines")

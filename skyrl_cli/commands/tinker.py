"""`skyrl tinker serve RECIPE`: a Tinker-API server for the official `tinker` SDK (multi-LoRA).

Starts ``inference.engines`` vLLM engines with runtime LoRA behind vllm-router (sampling), then the
API server with the multi-LoRA trainer on the recipe's ``[model]`` (``model.path``), and serves
until Ctrl-C / SIGTERM. The storage (SQLite + PEFT checkpoints) survives restarts.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from skyrl_cli.commands import common
from skyrl_contracts.errors import LaunchError, UsageError

NoEnginesOpt = Annotated[
    bool, typer.Option("--no-engines", help="Start no vLLM engines: training and checkpoints only, sampling refused.")
]


def register(app: typer.Typer) -> None:
    tinker_app = typer.Typer(
        help="Self-hosted Tinker-API server (official tinker SDK, multi-LoRA).", no_args_is_help=True
    )

    @tinker_app.command("serve")
    def serve(
        recipe: common.RecipeArg,
        set_: common.SetOpt = None,
        run_dir: common.RunDirOpt = None,
        dry_run: common.DryRunOpt = False,
        no_engines: NoEnginesOpt = False,
        json_: common.JsonOpt = False,
    ) -> None:
        """Serve the Tinker API from the recipe's \\[tinker] section until stopped (Ctrl-C).

        Point the SDK at it: tinker.ServiceClient(base_url="http://HOST:PORT", api_key="tml-...").
        Writes runs/<name>/tinker/ (or --run-dir): server.json, logs/, storage/ (unless tinker.storage_dir).
        """
        # lazy: command implementation; skyrl --help stays fast
        from skyrl_cli.plan.machine import detect_machine
        from skyrl_cli.plan.tinker import plan_tinker

        machine = detect_machine()
        loaded = common.load_for_run(recipe, set_, "tinker", machine=machine)
        if loaded.tinker is None:
            raise UsageError(f"recipe {recipe} has no [tinker] section")
        directory = common.run_dir_for(loaded, "tinker", run_dir).resolve()
        plan, config = plan_tinker(loaded, directory, machine, engines=not no_engines)
        keys = list(loaded.tinker.api_keys) + [
            k for k in os.environ.get(loaded.tinker.api_keys_env, "").split(",") if k.strip()
        ]
        if dry_run:
            common.print_plan(plan, json_)
            return
        if not keys:
            raise UsageError(
                f"no API keys: set tinker.api_keys or {loaded.tinker.api_keys_env}=tml-... (the SDK requires the tml- prefix)"
            )
        if not all(k.strip().startswith("tml-") for k in keys):
            raise UsageError(f"{loaded.tinker.api_keys_env}: every key must start with tml- (the SDK refuses others)")
        serve_plan(loaded, plan, config, directory)

    app.add_typer(tinker_app, name="tinker")


def serve_plan(recipe, plan, config: dict, directory) -> None:
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.engines.stack import launch_inference  # light: httpx only
    from skyrl_cli.launch.supervisor import Supervisor, failure_message
    from skyrl_cli.plan.tinker import SERVER_NAME
    from skyrl_contracts.atomic import write_json
    from skyrl_contracts.rundir import RunDir

    RunDir(directory).prepare(recipe, plan, resume=True)  # storage/ of earlier starts is kept
    write_json(directory / "server.json", config)
    order = plan.start_order()
    engines, routers = order.engines, order.router
    (server,) = [p for p in order.after_router if p.name == SERVER_NAME]
    with Supervisor(directory) as supervisor:
        stack = None
        if engines:
            typer.echo(f"tinker: starting {len(engines)} vLLM engine(s) with runtime LoRA", err=True)
            stack = launch_inference(
                supervisor, engines, routers[0], plan.engine_urls, plan.router_url, directory, metrics_period_s=None
            )
        try:
            supervisor.start(server)
            supervisor.wait_ready([server.name])
            t = recipe.tinker
            typer.echo(
                f"tinker: serving {config['base_model']} on http://{t.host}:{t.port} "
                f"(base_url for tinker.ServiceClient; keys: tinker.api_keys / {t.api_keys_env}); Ctrl-C stops",
                err=True,
            )
            code = supervisor.wait_job(server.name, fatal_services=[r.name for r in routers])
            if code != 0:
                raise LaunchError(
                    failure_message(
                        f"the tinker server failed (exit code {code})", supervisor.processes[server.name].log_path, 25
                    )
                )
        finally:
            if stack is not None:
                stack.stop()

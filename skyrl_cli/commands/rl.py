"""`skyrl rl RECIPE [--async]`: RL with vLLM engines behind vllm-router and a DeepSpeed learner."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Annotated

import typer

from skyrl_cli.commands import cluster, common
from skyrl_contracts.errors import UsageError
from skyrl_contracts.rundir import CHECKPOINT_MODEL, RunDir

AsyncOpt = Annotated[
    bool,
    typer.Option(
        "--async", help="Fully-async RL: generation runs ahead of training up to rl.async.max_staleness versions."
    ),
]
PoolOpt = Annotated[
    str,
    typer.Option(
        "--pool",
        help="Engines from a running pool (skyrl engines up): auto = the first free one that fits, else the run's "
        "own; none = always its own; or a pool's name.",
    ),
]


def register(app: typer.Typer) -> None:
    @app.command("rl")
    def rl(
        recipe: common.RecipeArg,
        async_mode: AsyncOpt = False,
        set_: common.SetOpt = None,
        run_dir: common.RunDirOpt = None,
        dry_run: common.DryRunOpt = False,
        resume: common.ResumeOpt = False,
        overwrite: common.OverwriteOpt = False,
        quiet: common.QuietOpt = False,
        json_: common.JsonOpt = False,
        pool_name: PoolOpt = "auto",
        node_rank: cluster.NodeRankOpt = None,
        slurm: cluster.SlurmOpt = False,
    ) -> None:
        """Reinforcement learning from the recipe's rl section (GRPO family), sync or fully async.

        Starts rl.init_from: "sft" is this recipe's SFT output (SFT runs first when it has not).
        Writes runs/<name>/rl/ (or --run-dir): events.jsonl, logs/, checkpoints/, final/, summary.json.
        """
        from skyrl_cli.plan.build import build_plan
        from skyrl_cli.plan.machine import detect_machine

        mode = common.output_mode(quiet, json_)
        machine = detect_machine()  # one look at the host: validation and the plan see the same facts
        loaded = common.load_for_run(recipe, set_, "rl", machine=machine)
        directory = common.run_dir_for(loaded, "rl", run_dir).resolve()
        if slurm:
            cluster.slurm(loaded, "rl", recipe, directory, set_, async_mode=async_mode, resume=resume, dry_run_=dry_run)
            return
        node = cluster.node_run(loaded, node_rank, need_address=not dry_run)
        if node is not None:  # across nodes: engine pools are one machine's, so none is used
            if pool_name not in ("auto", "none"):
                raise UsageError(
                    f"--pool {pool_name}: engine pools are one machine's; a run across nodes starts its own engines"
                )
            opts = dict(resume=resume, async_mode=async_mode, machine=machine, code_dir=common.recipe_dir(recipe))
            if dry_run:
                cluster.dry_run(loaded, "rl", node, directory, node_rank_flag=node_rank, json_=json_, **opts)
                return
            summary = run_rl_on_node(loaded, node, directory, mode, overwrite=overwrite, **opts)
            if summary is not None and mode != "json":
                typer.echo(final_line(summary, directory))
            return

        def plan_with(pool=None):
            return build_plan(
                loaded,
                "rl",
                directory,
                resume=resume,
                async_mode=async_mode,
                machine=machine,
                recipe_dir=common.recipe_dir(recipe),
                pool=pool,
            )

        plan = plan_with()
        pool, not_fitting = pick_pool(pool_name, loaded, plan)
        if pool is not None:
            plan = plan_with(pool.attachment())
        if dry_run:
            common.print_plan(plan, json_)
            if not json_:
                using = f"using engine pool {pool.name} ({pool.path}); {pool_warm_use(pool, plan)}" if pool else None
                for line in [*not_fitting, using]:
                    if line:
                        typer.echo(line, err=True)
            return
        from skyrl_cli.engines.stack import check_remote_engines  # light: httpx only

        check_remote_engines(loaded.inference.urls)  # before the SFT stage, engines or trainer start
        with held(pool, directory):  # from before an SFT stage that runs first: no run takes it meanwhile
            if pool is not None and mode != "json":
                typer.echo(f"rl: using engine pool {pool.name} (--pool none for engines of the run's own)", err=True)
            ensure_initial_policy(loaded, mode)
            summary = run_rl(loaded, plan, directory, mode, resume=resume, overwrite=overwrite, pool=pool)
        if mode != "json":
            typer.echo(final_line(summary, directory))
            if "health" in summary:
                typer.echo(f"warning: {summary['health']['message']}", err=True)


def pool_warm_use(pool, plan) -> str:
    """For --dry-run: which of the run's processes would go to the pool's warm ones, and why not."""
    from skyrl_cli.engines.standby import misfit
    from skyrl_cli.plan.pool import WARM_NAMES

    words = []
    states = pool.warm_state()
    for spec in plan.processes:
        if spec.role not in WARM_NAMES:
            continue
        keeper = pool.warm.get(spec.role)
        why = "the pool keeps none" if keeper is None else misfit(keeper.spec, spec)
        words.append(f"{spec.name}: " + (f"its own ({why})" if why else f"the pool's warm one ({states[spec.role]})"))
    return "; ".join(words)


def held(pool, run_dir: Path):
    """The pool's lock for the run (a busy pool is refused in one line), or nothing without a pool."""
    import contextlib

    from skyrl_cli.engines.pool import leased

    return leased(pool, run_dir) if pool is not None else contextlib.nullcontext()


def pick_pool(requested: str, recipe, own_plan):
    """The engine pool the run uses (``skyrl_cli.engines.pool.choose_pool``) and, for --dry-run,
    why each other pool does not fit."""
    from skyrl_cli.engines.pool import choose_pool
    from skyrl_cli.plan.rl import init_model_dir

    return choose_pool(requested, own_plan, recipe.inference.engines, init_model_dir(recipe))


def ensure_initial_policy(recipe, mode) -> None:
    """``init_from = "sft"``: run the recipe's SFT stage first when its output does not exist."""
    from skyrl_cli.plan.rl import init_model_dir

    init = init_model_dir(recipe)
    if (init / "config.json").exists():
        return
    if recipe.rl.init_from != "sft":
        raise UsageError(f"rl.init_from: no model at {init}")
    if recipe.sft is None:
        raise UsageError('rl.init_from = "sft" but the recipe has no [sft] section and no SFT output exists')
    from skyrl_cli.commands.sft import run_sft
    from skyrl_cli.plan.build import build_plan

    typer.echo(f"rl: no SFT output at {init}; running the recipe's SFT stage first", err=True)
    sft_dir = init.parent
    # --resume: an SFT stage that a Ctrl-C stopped continues from its newest checkpoint (the trainer
    # starts at step 0 when there is none), instead of training again over its checkpoints.
    again = "the same skyrl rl command continues it"
    run_sft(
        recipe,
        build_plan(recipe, "sft", sft_dir, resume=True),
        sft_dir,
        mode,
        resume=True,
        overwrite=False,
        interrupt_hints={"resume_hint": again, "restart_hint": again},
    )


class NodeHooks:
    """What node 0 of an RL run across nodes adds to ``_run_rl``: it tells the other nodes when the
    engines' model is made, waits for their engines before the router starts and re-plans with
    them, and watches the nodes while the jobs run."""

    def __init__(self, rdv, replan):
        self.rdv, self.replan_fn = rdv, replan

    def after_setup(self) -> None:
        self.rdv.set(phase="setup-done")

    def replan(self):
        plan = self.replan_fn()
        self.rdv.set(phase="running")
        return plan

    def watch(self) -> None:
        self.rdv.check()


def run_rl_on_node(recipe, node, directory: Path, mode, *, resume, overwrite, async_mode, machine, code_dir):
    """One node's share of an RL run across nodes (``skyrl_cli.commands.cluster``): node 0 runs the
    stage as on one machine with the other nodes' engines (the summary is its); the others start
    their engines and trainer ranks and run until node 0 ends the run (None)."""
    from skyrl_cli.plan.inference import ENGINE_READY_TIMEOUT_S
    from skyrl_cli.plan.rl import init_model_dir
    from skyrl_contracts.atomic import write_json

    opts = dict(resume=resume, async_mode=async_mode, machine=machine, code_dir=code_dir)
    if node.rank != 0:
        cluster.run_peer(recipe, "rl", node, directory, mode, **opts)
        return None
    init = init_model_dir(recipe)
    if not (init / "config.json").exists():
        first = (
            "run skyrl sft with the same recipe first (on the trainer nodes)" if recipe.rl.init_from == "sft" else ""
        )
        raise UsageError(f"rl.init_from: no model at {init}" + (f"; {first}" if first else ""))
    from skyrl_cli.engines.stack import check_remote_engines  # light: httpx only

    check_remote_engines(recipe.inference.urls)  # engines outside the layout, as on one machine
    recording, replaying = cluster.replaying_ports(machine)
    plan = cluster.plan_here(recipe, "rl", node, directory, **{**opts, "machine": recording})
    run_dir = RunDir(directory).prepare(recipe, plan, resume=resume, overwrite=overwrite)
    clear_exchange(run_dir)
    with cluster.rendezvous(recipe, "rl", node, directory, resume=resume, async_mode=async_mode) as rdv:
        cluster.say(mode, f"rl: node 0 of {node.layout.nodes}: waiting for the other nodes in {directory}")
        rdv.join()

        def replan():
            urls = cluster.gather_engines(rdv, node.layout, ENGINE_READY_TIMEOUT_S)
            final = cluster.plan_here(
                recipe, "rl", node, directory, **{**opts, "machine": replaying()}, remote_urls=urls
            )
            write_json(run_dir.plan, final.model_dump(mode="json"))
            cluster.say(mode, f"rl: engines of the other nodes: {', '.join(urls) or 'none'}")
            return final

        with rdv.blaming_nodes():
            return _run_rl(recipe, plan, run_dir, directory, mode, None, nodes=NodeHooks(rdv, replan))


def clear_exchange(run_dir: RunDir) -> None:
    """Batches, stop requests and the LATEST pointer belong to the processes of one launch: a
    resumed learner republishes the policy it restarts from, and nothing stale may be read first."""
    from skyrl_contracts.atomic import remove_leftovers

    for folder in (run_dir.batches, run_dir.control):
        shutil.rmtree(folder, ignore_errors=True)
    for pointer in (run_dir.latest_weights, run_dir.current_weights):  # engines start on v0
        pointer.unlink(missing_ok=True)
    # A killed learner's half-written version (a whole model copy); nothing else writes here yet.
    remove_leftovers(run_dir.weights)


def run_rl(recipe, plan, directory: Path, mode, *, resume: bool, overwrite: bool, pool=None) -> dict:
    """``pool``: an engine pool (``skyrl_cli.engines.pool.Pool``, ``held`` by the caller) whose
    engines and router the run uses and leaves running."""
    run_dir = RunDir(directory).prepare(recipe, plan, resume=resume, overwrite=overwrite)
    clear_exchange(run_dir)
    return _run_rl(recipe, plan, run_dir, directory, mode, pool)


def _run_rl(recipe, plan, run_dir: RunDir, directory: Path, mode, pool, nodes: NodeHooks | None = None) -> dict:
    from skyrl_cli.engines.stack import attach_inference, launch_inference  # light: httpx only
    from skyrl_cli.launch.interrupts import reported
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.metrics.follow import FollowedRun
    from skyrl_contracts.events import EventWriter

    sinks = common.output_sinks(mode, recipe, directory, title="rl --async" if plan.async_mode else "rl")
    order = plan.start_order()  # the one statement of what starts when
    started, started_at = time.monotonic(), time.time()
    step = lambda: run_dir.latest_weights_version() or 0  # noqa: E731
    with (
        reported("rl", directory) as progress,
        Supervisor(directory) as supervisor,
        EventWriter(run_dir.events, "inference") as writer,
    ):
        run_setup_jobs(supervisor, order.setup, progress)
        if nodes is not None:
            nodes.after_setup()
        if pool is None:
            progress.phase = "engine start-up"
            (router,) = order.router
            before_router = None
            if nodes is not None:

                def before_router():  # the other nodes' engines: the plan's router and jobs get them
                    nonlocal plan, order
                    progress.phase = "waiting for the other nodes' engines"
                    plan = nodes.replan()
                    order = plan.start_order()
                    progress.phase = "engine start-up"
                    return plan.engine_urls, order.router[0]

            stack = launch_inference(
                supervisor,
                order.engines,
                router,
                plan.engine_urls,
                plan.router_url,
                directory,
                writer=writer,
                step_fn=step,
                early_jobs=order.beside_engines,
                before_router=before_router,
            )
        else:
            progress.phase = f"loading the initial weights into engine pool {pool.name}"
            attach_checks(pool, recipe)
            for spec in order.beside_engines:  # the learner's start-up overlaps the weight load
                start_on_pool(supervisor, spec, pool)
            remote = [u for u in plan.engine_urls if u not in pool.engine_urls]
            stack = attach_inference(supervisor, pool, remote, directory, writer=writer, step_fn=step)
        try:  # the engine-recovery thread stops before the supervisor's teardown, also on Ctrl-C
            extra = {
                "stage": "rl",
                "async": plan.async_mode,
                "final_model": str(run_dir.final),
                "started_at": started_at,
                **({"pool": pool.name} if pool is not None else {}),
            }
            with FollowedRun(directory, sinks, summary_extra=extra) as run:
                run_jobs(supervisor, plan, order, stack, run, progress, watch=nodes.watch if nodes else None, pool=pool)
                progress.phase = "publishing the final model"
                publish_final_model(run_dir)
                if publish_final_int4(run_dir, recipe):
                    run.summary_extra["int4_model"] = str(run_dir.int4)
                run.summary_extra.update(initial_and_final_accuracy(run_dir))
                run.summary_extra["wall_s"] = round(time.monotonic() - started, 1)
        finally:
            stack.stop()
    return run.summary or {}


def start_on_pool(supervisor, spec, pool) -> None:
    """A run's process on a pool: the learner and the orchestrator go to the pool's warm ones
    when they fit (``skyrl_cli.engines.standby``), everything else starts."""
    from skyrl_cli.engines.standby import start_warm

    if pool is not None and spec.role in pool.warm:
        start_warm(supervisor, spec, pool.warm[spec.role].spec, pool.warm_folder(spec.role))
    else:
        supervisor.start(spec)


def attach_checks(pool, recipe) -> None:
    """What the pool's fit could not check before the SFT stage that ran first wrote the model."""
    from skyrl_cli.engines.pool import check_attached_model
    from skyrl_cli.plan.rl import init_model_dir

    check_attached_model(pool, init_model_dir(recipe))


def run_setup_jobs(supervisor, setup, progress) -> None:
    """Setup jobs (``engine-model/``, or the INT4 export the engines start from), each to its end."""
    for spec in setup:
        progress.phase = f"setup: {spec.name}"
        supervisor.start(spec)
        supervisor.wait_jobs([spec.name])


def run_jobs(supervisor, plan, order, stack, run, progress, watch=None, pool=None) -> None:
    """Start the orchestrator and the learner (on a pool, its warm ones when they fit) and wait for
    both: the first one to fail (or be killed) raises ``LaunchError`` at once, naming it and its log."""
    from skyrl_contracts.errors import LaunchError

    def tick() -> None:
        run.poll()
        trainer = next(p for p in plan.processes if p.role == "trainer")
        # The orchestrator's last work after the learner's exit is the final evaluation.
        progress.phase = "training" if supervisor.processes[trainer.name].returncode is None else "the final evaluation"
        gave_up = stack.recovery.gave_up() if stack.recovery is not None else None
        if gave_up:
            raise LaunchError(gave_up)
        if watch is not None:  # across nodes: a node that died or failed ends the run here
            watch()

    jobs = [p.name for p in (*order.beside_engines, *order.after_router) if p.kind == "job"]
    for spec in order.after_router:
        start_on_pool(supervisor, spec, pool)
    # Engines and the router that die come back (stack.recovery); without it the router may not die.
    fatal = [] if stack.recovery is not None else [p.name for p in plan.processes if p.role == "router"]
    supervisor.wait_jobs(jobs, on_tick=tick, fatal_services=fatal)


def publish_final_model(run_dir: RunDir) -> None:
    """``final/``: the newest checkpoint's HF model (the learner checkpoints its last step).

    Built next to it and published whole, so a crash here keeps the previous ``final/``."""
    from skyrl_contracts.atomic import publish_dir

    newest = run_dir.latest_checkpoint()
    if newest is None:
        return
    shutil.rmtree(run_dir.final_tmp, ignore_errors=True)
    shutil.copytree(newest / CHECKPOINT_MODEL, run_dir.final_tmp)
    publish_dir(run_dir.final_tmp, run_dir.final)


def publish_final_int4(run_dir: RunDir, recipe) -> bool:
    """INT4 rollouts: ``int4/`` (the initial policy's export the engines started from) becomes the
    last version they served, the learner's W4A16 export of its final weights."""
    from skyrl_contracts.atomic import publish_dir

    version = run_dir.latest_weights_version()
    if recipe.quantization is None or not recipe.quantization.int4_rollouts or version is None:
        return False
    shutil.rmtree(run_dir.int4_tmp, ignore_errors=True)
    shutil.copytree(run_dir.weights_version(version), run_dir.int4_tmp)
    publish_dir(run_dir.int4_tmp, run_dir.int4)
    return True


def initial_and_final_accuracy(run_dir: RunDir) -> dict:
    from skyrl_contracts.events import iter_events

    accuracy = [e for e in iter_events(run_dir.events) if e.name == "eval/accuracy"]
    if not accuracy:
        return {}
    initial = run_dir.initial_accuracy()
    if initial is None:  # a run that evaluated its initial policy before eval_initial.json existed
        initial = accuracy[0].value
    final = max(accuracy, key=lambda e: (e.step, e.time)).value
    return {"eval_accuracy_initial": initial, "eval_accuracy_final": final, "eval_accuracy_gain": final - initial}


def final_line(summary: dict, directory: Path) -> str:
    from skyrl_cli.metrics.summary import wall_time_text

    parts = []
    if "eval_accuracy_final" in summary:
        parts.append(
            f"held-out accuracy {summary['eval_accuracy_initial']:.3f} -> {summary['eval_accuracy_final']:.3f}"
        )
    for key, label in (("rollout/tokens_per_s", "rollout tokens/s"), ("train/tokens_per_s", "training tokens/s")):
        figure = summary.get("throughput", {}).get(key)
        if figure:
            parts.append(f"{figure['mean']:,.0f} {label}")
    if "wall_s" in summary:
        parts.append(f"wall time {wall_time_text(summary)}")
    return f"rl done: {', '.join(parts)}; model: {RunDir(directory).final}"

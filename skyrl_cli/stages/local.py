"""A stage on this machine with processes of its own: the SFT trainer, or RL's engines, router,
orchestrator and learner (``pool.py`` swaps the engines and the router for a pool's; node 0 of a
run across nodes, ``nodes.py``, runs RL here with the other nodes' engines added)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from skyrl_cli.engines.stack import check_remote_engines, launch_inference
from skyrl_cli.launch.interrupts import reported
from skyrl_cli.launch.supervisor import Supervisor
from skyrl_cli.metrics.follow import FollowedRun
from skyrl_cli.plan.build import build_plan
from skyrl_cli.plan.rl import init_model_dir
from skyrl_cli.recipe.validate import run_output_hint
from skyrl_cli.stages.job import run_job
from skyrl_cli.stages.output import output_sinks, print_estimates, print_plan
from skyrl_cli.stages.pool import attach_engines, explain_choice, held, pick_pool, start_on_pool
from skyrl_cli.stages.results import initial_and_final_accuracy, publish_final_int4, publish_final_model
from skyrl_contracts.atomic import remove_leftovers
from skyrl_contracts.auxiliary import auxiliary_models
from skyrl_contracts.errors import LaunchError, UsageError
from skyrl_contracts.events import EventWriter
from skyrl_contracts.rundir import RunDir

if TYPE_CHECKING:
    from skyrl_cli.stages.request import StageRequest

# --------------------------------------------------------------------------------------------- SFT


def sft_here(request: StageRequest) -> dict | None:
    """SFT on this machine; None after ``--dry-run`` printed the plan."""
    plan = request.plan()
    if request.dry_run:
        print_plan(plan, request.json_)
        if not request.json_:
            print_estimates(request.recipe, request.machine, request.code_dir)
        return None
    return run_sft(
        request.recipe, plan, request.directory, request.mode, resume=request.resume, overwrite=request.overwrite
    )


def run_sft(
    recipe, plan, directory, mode, *, resume: bool, overwrite: bool, interrupt_hints: dict | None = None
) -> dict:
    """The SFT trainer as a job (``run_job``); returns the summary."""
    extra = {"final_model": str(RunDir(directory).final)}
    return run_job(
        recipe,
        plan,
        directory,
        mode,
        stage="sft",
        summary_extra=extra,
        resume=resume,
        overwrite=overwrite,
        interrupt_hints=interrupt_hints,
    )


# ---------------------------------------------------------------------------------------------- RL


def rl_here(request: StageRequest) -> dict | None:
    """RL on this machine, with its own engines or a pool's (``--pool``); None after ``--dry-run``."""
    plan = request.plan()
    pool, not_fitting = pick_pool(request.pool, request.recipe, plan)
    if pool is not None:
        plan = request.plan(pool.attachment())
    if request.dry_run:
        print_plan(plan, request.json_)
        if not request.json_:
            explain_choice(pool, not_fitting, plan)
            print_estimates(request.recipe, request.machine, request.code_dir)
        return None

    check_remote_engines(request.recipe.inference.urls)  # before the SFT stage, engines or trainer start
    with held(pool, request.directory):  # from before an SFT stage that runs first: no run takes it meanwhile
        if pool is not None and request.mode != "json":
            typer.echo(f"rl: using engine pool {pool.name} (--pool none for engines of the run's own)", err=True)
        ensure_initial_policy(request.recipe, request.mode)
        ensure_auxiliary_models(request.recipe)
        return run_rl(
            request.recipe,
            plan,
            request.directory,
            request.mode,
            resume=request.resume,
            overwrite=request.overwrite,
            pool=pool,
        )


def ensure_initial_policy(recipe, mode) -> None:
    """``init_from = "sft"``: run the recipe's SFT stage first when its output does not exist."""
    init = init_model_dir(recipe)
    if (init / "config.json").exists():
        return
    if recipe.rl.init_from != "sft":
        raise UsageError(f"rl.init_from: no model at {init}")
    if recipe.sft is None:
        raise UsageError('rl.init_from = "sft" but the recipe has no [sft] section and no SFT output exists')

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


def ensure_auxiliary_models(recipe) -> None:
    """A teacher or judge that validation let through because this recipe's SFT stage writes it
    (``skyrl_cli.recipe.validate.written_by_own_sft``) must be there once that stage has run."""
    for model in auxiliary_models(recipe):
        path = Path(model.model)
        if not (path / "config.json").is_file():
            raise UsageError(f"{model.dotted()}: no model at {path}{run_output_hint(path)}")


def clear_exchange(run_dir: RunDir) -> None:
    """Batches, stop requests and the LATEST pointer belong to the processes of one launch: a
    resumed learner republishes the policy it restarts from, and nothing stale may be read first."""
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
    return run_prepared_rl(recipe, plan, run_dir, directory, mode, pool)


def run_prepared_rl(recipe, plan, run_dir: RunDir, directory: Path, mode, pool, nodes=None) -> dict:
    """An RL run in a prepared run directory, from its setup jobs to ``final/``; returns the summary.
    ``nodes``: node 0 of a run across nodes, its ``skyrl_cli.stages.nodes.NodeHooks`` (not imported
    here: that module runs this one)."""
    sinks = output_sinks(mode, recipe, directory, title="rl --async" if plan.async_mode else "rl")
    started, started_at = time.monotonic(), time.time()
    step = lambda: run_dir.latest_weights_version() or 0  # noqa: E731
    with (
        reported("rl", directory) as progress,
        Supervisor(directory) as supervisor,
        EventWriter(run_dir.events, "inference") as writer,
    ):
        run_setup_jobs(supervisor, plan.start_order().setup, progress)
        if nodes is not None:
            nodes.after_setup()
        if pool is None:
            stack, plan = start_own_engines(
                supervisor, plan, directory, writer=writer, step_fn=step, progress=progress, nodes=nodes
            )
        else:
            stack = attach_engines(
                supervisor, pool, recipe, plan, directory, writer=writer, step_fn=step, progress=progress
            )
        try:  # the engine-recovery thread stops before the supervisor's teardown, also on Ctrl-C
            extra = {
                "stage": "rl",
                "async": plan.async_mode,
                "final_model": str(run_dir.final),
                "started_at": started_at,
                **({"pool": pool.name} if pool is not None else {}),
                **speculative_extra(recipe),
            }
            with FollowedRun(directory, sinks, summary_extra=extra) as run:
                watch = nodes.watch if nodes else None
                run_jobs(supervisor, plan, stack, run, progress, watch=watch, pool=pool)
                if stack.scraper is not None:  # the engines' last figures, before the summary
                    stack.scraper.flush()
                progress.phase = "publishing the final model"
                publish_final_model(run_dir)
                if publish_final_int4(run_dir, recipe):
                    run.summary_extra["int4_model"] = str(run_dir.int4)
                run.summary_extra.update(initial_and_final_accuracy(run_dir))
                run.summary_extra["wall_s"] = round(time.monotonic() - started, 1)
        finally:
            stack.stop()
    return run.summary or {}


def speculative_extra(recipe) -> dict:
    """summary.json's ``speculative`` entry as the recipe sets it (the engines' totals join it)."""
    spec = recipe.inference.speculative
    if spec is None:
        return {}
    return {"speculative": {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}}


def start_own_engines(supervisor, plan, directory: Path, *, writer, step_fn, progress, nodes):
    """The run's own engines and router (``launch_inference``); returns them and the plan the run
    goes on with: node 0 of a run across nodes re-plans with the other nodes' engines before its
    router starts, so the router and the jobs get them."""
    order = plan.start_order()  # the one statement of what starts when
    progress.phase = "engine start-up"
    (router,) = order.router
    before_router = None
    if nodes is not None:

        def before_router():
            nonlocal plan
            progress.phase = "waiting for the other nodes' engines"
            plan = nodes.replan()
            progress.phase = "engine start-up"
            return plan.engine_urls, plan.start_order().router[0]

    stack = launch_inference(
        supervisor,
        order.engines,
        router,
        plan.engine_urls,
        plan.router_url,
        directory,
        writer=writer,
        step_fn=step_fn,
        early_jobs=order.beside_engines,
        before_router=before_router,
        auxiliaries=order.auxiliaries,
    )
    return stack, plan


def run_setup_jobs(supervisor, setup, progress) -> None:
    """Setup jobs (``engine-model/``, or the INT4 export the engines start from), each to its end."""
    for spec in setup:
        progress.phase = f"setup: {spec.name}"
        supervisor.start(spec)
        supervisor.wait_jobs([spec.name])


def run_jobs(supervisor, plan, stack, run, progress, watch=None, pool=None) -> None:
    """Start the orchestrator and the learner (on a pool, its warm ones when they fit) and wait for
    both: the first one to fail (or be killed) raises ``LaunchError`` at once, naming it and its log."""

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

    order = plan.start_order()
    jobs = [p.name for p in (*order.beside_engines, *order.after_router) if p.kind == "job"]
    for spec in order.after_router:
        start_on_pool(supervisor, spec, pool)
    # Engines (the policy's and the auxiliary models': a teacher, a judge) and the router that die
    # come back (stack.recovery); without it neither the router nor an auxiliary engine may die.
    fatal = []
    if stack.recovery is None:
        fatal = [p.name for p in plan.processes if p.role in ("router", "auxiliary")]
    supervisor.wait_jobs(jobs, on_tick=tick, fatal_services=fatal)

"""A one-job plan (the SFT trainer, the quantizer) run to its end under the supervisor."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from skyrl_cli.launch.interrupts import reported
from skyrl_cli.stages.output import OutputMode, output_sinks
from skyrl_contracts.errors import LaunchError

if TYPE_CHECKING:  # pydantic stays out of `skyrl --help`
    from skyrl_contracts.schema import Recipe


def run_job(
    recipe: Recipe,
    plan,
    directory: Path,
    mode: OutputMode,
    *,
    stage: str,
    summary_extra: dict,
    resume: bool,
    overwrite: bool,
    interrupt_hints: dict | None = None,
    prepared: bool = False,
    watch=None,
) -> dict:
    """Run a one-job plan (the SFT trainer, the quantizer): prepare the run directory, start the job
    under the supervisor, follow its events live, write summary.json (with ``summary_extra``). A
    failed job raises ``LaunchError`` with the end of its log, a stop signal ``RunInterrupted``
    (``interrupt_hints``: what its message tells the user to run next). ``prepared``: the caller
    prepared the run directory (node 0 of a run across nodes, before the others join); ``watch``:
    called at every tick (``skyrl_cli.launch.nodes.Rendezvous.check``: a dead node ends the job)."""
    # lazy: skyrl --help imports this module; these stay out of it
    from skyrl_cli.launch.supervisor import Supervisor, job_failure
    from skyrl_cli.metrics.follow import FollowedRun
    from skyrl_contracts.rundir import RunDir

    if not prepared:
        RunDir(directory).prepare(recipe, plan, resume=resume, overwrite=overwrite)
    sinks = output_sinks(mode, recipe, directory, title=stage)
    (spec,) = plan.processes
    started, started_at = time.monotonic(), time.time()
    with reported(stage, directory, **(interrupt_hints or {})), Supervisor(directory) as supervisor:
        proc = supervisor.start(spec)
        extra = {"stage": stage, "started_at": started_at, **summary_extra}
        with FollowedRun(directory, sinks, summary_extra=extra) as run:

            def tick() -> None:
                run.poll()
                if watch is not None:
                    watch()

            code = supervisor.wait_job(spec.name, on_tick=tick)
            run.summary_extra["wall_s"] = round(time.monotonic() - started, 1)
            if code != 0:
                raise LaunchError(job_failure(spec.role, code, proc.log_path))
    return run.summary or {}

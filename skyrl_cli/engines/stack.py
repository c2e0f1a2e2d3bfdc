"""Bring up the inference side of a run under a supervisor: engines, then the router, then the
recovery loop and the metrics scraper.

The caller passes the ProcessSpecs built by ``skyrl_cli.plan.inference`` (``engine_specs``,
``router_spec``) and the run's ``skyrl_cli.launch.supervisor.Supervisor``::

    with Supervisor(run_dir) as sup:
        stack = launch_inference(sup, engines, router, engine_urls, router_url, run_dir, writer=writer)
        try:
            ...  # rollouts through stack.router_url, admin calls to stack.engine_urls
        finally:
            stack.stop()

Engines start together (each loads its own copy; on CPU each is pinned to its own core), are
labelled with the current weights (version "0", or what ``weights/current.json`` records when a run
resumes), and only then does the router start, so it never sees an unready worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from backends.inference.weight_sync import bring_up_to_date, read_current_weights, run_blocking
from skyrl_cli.engines.metrics import MetricsScraper
from skyrl_cli.engines.pool import adopt, load_run_weights
from skyrl_cli.engines.recovery import EngineRecovery
from skyrl_cli.launch.supervisor import Supervisor
from skyrl_cli.plan.model import ProcessSpec
from skyrl_contracts.errors import LaunchError
from skyrl_contracts.events import EventWriter


@dataclass
class InferenceStack:
    engine_names: list[str]
    engine_urls: list[str]  # local engines, then remote ones
    router_url: str
    auxiliaries: dict[str, str] = field(default_factory=dict)  # auxiliary engine process name -> url
    recovery: EngineRecovery | None = None
    scraper: MetricsScraper | None = None

    def stop(self) -> None:
        if self.scraper is not None:
            self.scraper.stop()
        if self.recovery is not None:
            self.recovery.stop(timeout_s=5.0)


def check_remote_engines(urls: Sequence[str], timeout_s: float = 5.0) -> None:
    """Every remote engine (``inference.urls``) answers ``GET /health`` with 200, else a one-line
    ``LaunchError`` naming it: checked before anything starts, instead of the router waiting out
    its worker start-up timeout and the run failing later with a less direct message."""
    # lazy: httpx; the CLI's light commands avoid it
    import httpx

    for url in urls:
        try:
            status = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).status_code
        except httpx.HTTPError as err:
            reason = f"{type(err).__name__}: {str(err) or 'no answer'}"
        else:
            if status == 200:
                continue
            reason = f"HTTP {status}"
        raise LaunchError(
            f"inference.urls: the engine at {url} does not answer GET /health ({reason}); "
            "start it, or remove it from inference.urls"
        )


def launch_inference(
    supervisor: Supervisor,
    engine_specs: Sequence[ProcessSpec],
    router_spec: ProcessSpec,
    engine_urls: Sequence[str],
    router_url: str,
    run_dir: str | os.PathLike,
    *,
    writer: EventWriter | None = None,
    step_fn: Callable[[], int] = lambda: 0,
    recover: bool = True,
    metrics_period_s: float | None = 5.0,
    early_jobs: Sequence[ProcessSpec] = (),
    before_router: Callable[[], tuple[Sequence[str], ProcessSpec]] | None = None,
    auxiliaries: Sequence[ProcessSpec] = (),
) -> InferenceStack:
    """``engine_urls``: one per engine spec (same order), then any remote engines. ``early_jobs``
    (ProcessSpecs) start right after the engines, before they are ready; one that fails meanwhile
    ends the wait with its own error. ``before_router``: called once the local engines are ready;
    returns the engine URLs and router spec to use instead (node 0 of a run across nodes: with the
    engines the other nodes reported meanwhile). ``auxiliaries``: the engines of the models served beside
    the policy (a teacher, a judge: ``skyrl_contracts.auxiliary``), started and waited ready with the policy's; never labelled, routed or recovered (the run ends
    when one dies: ``skyrl_cli.stages.local.run_jobs``)."""
    names = [spec.name for spec in engine_specs]
    for spec in (*engine_specs, *auxiliaries):
        supervisor.start(spec)
    for spec in early_jobs:
        supervisor.start(spec)
    supervisor.wait_ready([*names, *(spec.name for spec in auxiliaries)], watch_jobs=[spec.name for spec in early_jobs])
    if before_router is not None:
        engine_urls, router_spec = before_router()
    run_blocking(bring_up_to_date(list(engine_urls), read_current_weights(run_dir)))
    supervisor.start(router_spec)
    supervisor.wait_ready([router_spec.name])
    stack = InferenceStack(names, list(engine_urls), router_url.rstrip("/"), auxiliary_urls(auxiliaries))
    return watch(stack, supervisor, run_dir, router_spec.name, writer, step_fn, recover, metrics_period_s)


def attach_inference(
    supervisor: Supervisor,
    pool,
    remote_urls: Sequence[str],
    run_dir: str | os.PathLike,
    *,
    writer: EventWriter | None = None,
    step_fn: Callable[[], int] = lambda: 0,
    recover: bool = True,
    metrics_period_s: float | None = 5.0,
) -> InferenceStack:
    """The inference side of a run on an engine pool (``skyrl_cli.engines.pool.Pool``, held by the
    run): its processes adopted (its auxiliary models' engines too), the run's initial weights loaded
    (not into those), then watched as a run's own."""
    names, router_name = adopt(supervisor, pool)
    load_run_weights(pool, run_dir)
    if remote_urls:
        run_blocking(bring_up_to_date(list(remote_urls), read_current_weights(run_dir)))
    auxiliaries = auxiliary_urls(p.spec for p in pool.auxiliaries)
    stack = InferenceStack(names, [*pool.engine_urls, *remote_urls], pool.router_url, auxiliaries)
    return watch(stack, supervisor, run_dir, router_name, writer, step_fn, recover, metrics_period_s)


def auxiliary_urls(specs: Iterable[ProcessSpec]) -> dict[str, str]:
    """Auxiliary engines' process names -> their URLs (where their readiness check asks)."""
    return {spec.name: spec.ready.url.rsplit("/", 1)[0] for spec in specs}


def watch(
    stack: InferenceStack,
    supervisor: Supervisor,
    run_dir: str | os.PathLike,
    router_name: str,
    writer: EventWriter | None,
    step_fn: Callable[[], int],
    recover: bool,
    metrics_period_s: float | None,
) -> InferenceStack:
    """Start the recovery loop and the metrics scraper of a stack whose processes run."""
    if recover:
        local = dict(zip(stack.engine_names, stack.engine_urls))
        remote = list(stack.engine_urls[len(stack.engine_names) :])
        stack.recovery = EngineRecovery(
            supervisor,
            local,
            stack.router_url,
            run_dir,
            remote_urls=remote,
            writer=writer,
            step_fn=step_fn,
            router_name=router_name,
            auxiliaries=stack.auxiliaries,
        ).start()
    if writer is not None and metrics_period_s:
        stack.scraper = MetricsScraper(stack.engine_urls, writer, stack.router_url, metrics_period_s, step_fn).start()
    return stack

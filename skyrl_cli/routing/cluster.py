"""The live routing benchmark's processes: the engines of one pressure level started from the launch
plan by the supervisor, and vllm-router put in front of them with each policy in turn."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from skyrl_cli.launch.supervisor import Supervisor
from skyrl_cli.plan.inference import Machine, all_engine_urls, engine_specs, engine_url, router_spec
from skyrl_cli.plan.model import ProcessSpec
from skyrl_contracts.ports import find_free_ports
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import Recipe


class SupervisedCluster:
    """The started, ready engines of one pressure level, and vllm-router in front of them on demand."""

    def __init__(
        self,
        supervisor: Supervisor,
        machine: Machine,
        engines: Sequence[ProcessSpec],
        engine_urls: Sequence[str],
        router_port: int,
        prometheus_port: int,
        run_dir: RunDir,
        recipe: Recipe,
    ):
        """``recipe``: the level's (its router settings; ``start_router`` sets the policy)."""
        self.recipe = recipe
        self.supervisor = supervisor
        self.machine = machine
        self.engines = engines
        self.engine_urls = engine_urls
        self.router_port = router_port
        self.prometheus_port = prometheus_port
        self.router_url = engine_url(machine, router_port)
        self.run_dir = run_dir
        self._router_started = False

    async def start_router(self, policy: str) -> None:
        """Start vllm-router with ``policy`` in front of the engines (restarting a running one); return once ready."""
        inference = self.recipe.inference
        router = inference.router.model_copy(update={"policy": policy})
        recipe = self.recipe.model_copy(update={"inference": inference.model_copy(update={"router": router})})
        router = router_spec(recipe, self.machine, self.engine_urls, self.router_port, self.prometheus_port)
        if self._router_started:
            self.supervisor.restart("router", router)
        else:
            self.supervisor.start(router)
            self._router_started = True
        await asyncio.to_thread(self.supervisor.wait_ready, ["router"])

    def dead_processes(self) -> list[str]:
        return [name for name, code in self.supervisor.poll().items() if code is not None]

    def engine_log(self, index: int) -> Path:
        return self.run_dir.log(self.engines[index].name)


@contextmanager
def start_cluster(request, say: Callable[[str], None] = print) -> Iterator[SupervisedCluster]:
    """The engines of one pressure level (``skyrl_cli.routing.live_bench.ClusterRequest``), each on its
    own core, started and ready; everything started is torn down on the way out."""
    recipe = request.recipe
    machine = Machine(device="cpu", engine_cores=tuple(sorted(os.sched_getaffinity(0))))
    *ports, router_port, prometheus_port = find_free_ports(recipe.inference.engines + 2)
    engines = engine_specs(recipe, machine, ports, str(request.model_dir))
    urls = all_engine_urls(recipe, machine, ports)
    with Supervisor(request.run_dir.root) as sup:
        say(f"[bold]live, KV pressure {request.label}[/bold]: starting {len(engines)} CPU engines ...")
        for engine in engines:
            sup.start(engine)
        sup.wait_ready([e.name for e in engines])
        yield SupervisedCluster(
            sup, machine, engines, urls, router_port, prometheus_port, request.run_dir, request.recipe
        )

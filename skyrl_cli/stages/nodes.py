"""``skyrl sft|rl`` across nodes: what one node does.

The same command runs on every node (``skyrl_cli.plan.nodes`` says what each node runs). Node 0
prepares the run directory and runs the stage as on one machine, with the other nodes' engines
added once they reported them; the other nodes start their share (engines, trainer ranks), report
their engines' URLs and run until node 0 ends the run. ``skyrl_cli.launch.nodes`` is how they meet
and watch each other through the shared run directory.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING

from skyrl_cli.engines.stack import check_remote_engines
from skyrl_cli.launch.interrupts import reported
from skyrl_cli.launch.nodes import Rendezvous
from skyrl_cli.launch.supervisor import Supervisor, job_failure
from skyrl_cli.plan.feasibility import assert_feasible
from skyrl_cli.plan.inference import ENGINE_READY_TIMEOUT_S
from skyrl_cli.plan.nodes import (
    TRAINER_IFNAME_VARS,
    NodeContext,
    cluster_address,
    cluster_layout,
    detect_own_address,
    interface_of,
    node_rank,
    plan_cluster,
    plan_node,
    slurm_rank,
)
from skyrl_cli.plan.rl import init_model_dir
from skyrl_cli.stages.job import run_job
from skyrl_cli.stages.local import clear_exchange, run_prepared_rl
from skyrl_cli.stages.output import print_plan, say
from skyrl_contracts.atomic import write_json
from skyrl_contracts.errors import LaunchError, UsageError
from skyrl_contracts.rundir import RunDir, recipe_hash

if TYPE_CHECKING:
    from skyrl_cli.stages.request import StageRequest


@dataclasses.dataclass
class NodeRun:
    """One node's view of a run across nodes."""

    layout: object  # skyrl_cli.plan.nodes.Layout
    context: object  # skyrl_cli.plan.nodes.NodeContext

    @property
    def rank(self) -> int:
        return self.context.rank


def node_run(recipe, node_rank_flag: int | None, *, need_address: bool = True) -> NodeRun | None:
    """The layout and this node's place in it, or None for a run on one machine (where
    ``--node-rank`` is refused: it would act on nothing)."""
    layout = cluster_layout(recipe)
    if layout is None:
        if node_rank_flag is not None and node_rank_flag != 0:
            raise UsageError(f"--node-rank {node_rank_flag}: the recipe runs on one machine (it has no [cluster])")
        return None
    rank = node_rank(recipe, layout, node_rank_flag, os.environ)
    if not need_address:
        address = layout.address or os.environ.get("SKYRL_CLUSTER_ADDRESS") or "<node-0>"
        return NodeRun(layout, NodeContext(rank, address, address if rank == 0 else f"<node-{rank}>"))
    address = cluster_address(layout, os.environ)
    own = detect_own_address(address, rank, os.environ)
    # The user's own choice of interface for the collectives wins (child_env adds the plan's on top).
    chosen = any(os.environ.get(var) for var in TRAINER_IFNAME_VARS)
    return NodeRun(layout, NodeContext(rank, address, own, None if chosen else interface_of(own)))


def dry_run(request: StageRequest, node: NodeRun) -> None:
    """Every node's plan (``--node-rank``: that node's only)."""
    shown = [node.rank] if request.node_rank is not None or slurm_rank(os.environ)[1] is not None else None
    data = plan_cluster(
        request.recipe,
        request.stage,
        node.layout,
        node.context.address,
        request.directory,
        resume=request.resume,
        async_mode=request.async_mode,
        machine=request.machine,
        recipe_dir=request.code_dir,
        nodes=shown,
    )
    print_plan(data, request.json_)


def rendezvous(request: StageRequest, node: NodeRun):
    layout = node.layout
    peers = None
    if node.rank == 0:
        peers = list(range(1, layout.stage_nodes(request.stage)))
    return Rendezvous(
        request.directory,
        node.rank,
        layout.stage_nodes(request.stage),
        recipe_hash(request.recipe),
        request.stage,
        {"resume": request.resume, "async": request.async_mode},
        arrival_timeout_s=layout.arrival_timeout_s,
        heartbeat_timeout_s=layout.heartbeat_timeout_s,
        peers=peers,
    )


def plan_here(request: StageRequest, node: NodeRun, *, machine=None, remote_urls=None):
    """This node's plan, for ``machine`` (default: the request's look at this host)."""
    machine = request.machine if machine is None else machine
    assert_feasible(request.recipe, machine)
    return plan_node(
        request.recipe,
        request.stage,
        node.layout,
        node.context,
        request.directory,
        resume=request.resume,
        async_mode=request.async_mode,
        machine=machine,
        recipe_dir=request.code_dir,
        remote_urls=remote_urls,
    )


def replaying_ports(machine):
    """``machine`` whose port finder records the ports it hands out, and a copy that hands the same
    ones out again: node 0 re-plans with the other nodes' engines and its own processes, already
    started, keep their ports."""
    taken: list[int] = []

    def record(n: int) -> list[int]:
        ports = list(machine.port_finder(n))
        taken.extend(ports)
        return ports

    def replay(n: int) -> list[int]:
        ports, taken[:] = taken[:n], taken[n:]
        return ports

    return dataclasses.replace(machine, port_finder=record), lambda: dataclasses.replace(machine, port_finder=replay)


# ------------------------------------------------------------------------------------ node 0's share


def run_sft_on_node(request: StageRequest, node: NodeRun) -> dict | None:
    """One node's share of an SFT run across nodes: node 0 prepares the run directory, meets the
    others and runs its trainer ranks as on one machine (the summary is its); the other nodes run
    theirs (None)."""
    if not node.layout.trains(node.rank):
        say(
            request.mode,
            f"sft: node {node.rank} does not train (cluster.trainer_nodes = {node.layout.trainer_nodes}); nothing to run",
            always=True,
        )
        return None
    if node.rank != 0:
        run_peer(request, node)
        return None
    directory = request.directory
    plan = plan_here(request, node)
    RunDir(directory).prepare(request.recipe, plan, resume=request.resume, overwrite=request.overwrite)
    with rendezvous(request, node) as rdv:
        say(request.mode, f"sft: node 0 of {node.layout.trainer_nodes}: waiting for the other nodes in {directory}")
        rdv.join()
        rdv.set(phase="running")
        extra = {"final_model": str(RunDir(directory).final), "nodes": node.layout.trainer_nodes}
        with rdv.blaming_nodes():
            return run_job(
                request.recipe,
                plan,
                directory,
                request.mode,
                stage="sft",
                summary_extra=extra,
                resume=request.resume,
                overwrite=request.overwrite,
                prepared=True,
                watch=rdv.check,
            )


class NodeHooks:
    """What node 0 of an RL run across nodes adds to ``run_prepared_rl``: it tells the other nodes
    when the engines' model is made, waits for their engines before the router starts and re-plans
    with them, and watches the nodes while the jobs run."""

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


def run_rl_on_node(request: StageRequest, node: NodeRun) -> dict | None:
    """One node's share of an RL run across nodes: node 0 runs the stage as on one machine with the
    other nodes' engines (the summary is its); the others start their engines and trainer ranks and
    run until node 0 ends the run (None)."""
    if node.rank != 0:
        run_peer(request, node)
        return None
    recipe, directory, mode = request.recipe, request.directory, request.mode
    init = init_model_dir(recipe)
    if not (init / "config.json").exists():
        first = (
            "run skyrl sft with the same recipe first (on the trainer nodes)" if recipe.rl.init_from == "sft" else ""
        )
        raise UsageError(f"rl.init_from: no model at {init}" + (f"; {first}" if first else ""))

    check_remote_engines(recipe.inference.urls)  # engines outside the layout, as on one machine
    recording, replaying = replaying_ports(request.machine)
    plan = plan_here(request, node, machine=recording)
    run_dir = RunDir(directory).prepare(recipe, plan, resume=request.resume, overwrite=request.overwrite)
    clear_exchange(run_dir)
    with rendezvous(request, node) as rdv:
        say(mode, f"rl: node 0 of {node.layout.nodes}: waiting for the other nodes in {directory}")
        rdv.join()

        def replan():
            urls = gather_engines(rdv, node.layout, ENGINE_READY_TIMEOUT_S)
            final = plan_here(request, node, machine=replaying(), remote_urls=urls)
            write_json(run_dir.plan, final.model_dump(mode="json"))
            say(mode, f"rl: engines of the other nodes: {', '.join(urls) or 'none'}")
            return final

        with rdv.blaming_nodes():
            return run_prepared_rl(recipe, plan, run_dir, directory, mode, None, nodes=NodeHooks(rdv, replan))


def gather_engines(rdv, layout, timeout_s: float) -> list[str]:
    """Node 0: the engine URLs every inference node reported, in node order."""
    urls: list[str] = []
    for peer in range(1, layout.nodes):
        if layout.serves(peer):
            marker = rdv.wait_for(peer, ("ready", "running"), "its engines ready", timeout_s)
            urls += marker.engines
    return urls


# ---------------------------------------------------------------------------------- a node's share


def run_peer(request: StageRequest, node: NodeRun) -> None:
    """A node other than node 0: join, start this node's processes once node 0 is ready for them,
    report its engines, and run until node 0 ends the run (or this node's job ends, when it only trains)."""
    stage, directory, mode = request.stage, request.directory, request.mode
    paths = RunDir(directory)
    with rendezvous(request, node) as rdv:
        say(mode, f"{stage}: node {node.rank} of {node.layout.nodes}: waiting for node 0 in {directory}")
        rdv.join()
        waiting = ("setup-done", "ready", "running") if stage == "rl" else ("running",)
        rdv.wait_for(0, waiting, "the run directory ready", node.layout.arrival_timeout_s + 600)
        plan = plan_here(request, node)
        say(
            mode,
            f"{stage}: node {node.rank} runs {', '.join(p.name for p in plan.processes)} (logs: {paths.node_logs(node.rank)})",
        )
        write_json(paths.node_logs(node.rank) / "plan.json", plan.model_dump(mode="json"))
        with (
            rdv.blaming_nodes(),
            reported(stage, directory),
            Supervisor(directory, logs_dir=paths.node_logs(node.rank)) as supervisor,
        ):
            engines = [p for p in plan.processes if p.role == "engine"]
            jobs = [p for p in plan.processes if p.kind == "job"]
            for spec in (*engines, *jobs):
                supervisor.start(spec)
            wait_ready_watching(supervisor, [e.name for e in engines], rdv, [j.name for j in jobs])
            rdv.set(phase="ready", engines=list(plan.engine_urls))
            restarts: dict[str, int] = {}
            while True:
                for job in jobs:
                    proc = supervisor.processes[job.name]
                    if proc.returncode not in (None, 0):
                        raise LaunchError(job_failure(job.name, proc.returncode, proc.log_path))
                if rdv.coordinator_finished():
                    break
                if not engines and all(supervisor.processes[j.name].returncode == 0 for j in jobs):
                    break  # a trainer-only node whose ranks finished
                for spec in engines:  # node 0 takes a dead engine out of its router and back in
                    proc = supervisor.processes[spec.name]
                    if proc.returncode is not None and restarts.get(spec.name, 0) < 10:
                        restarts[spec.name] = restarts.get(spec.name, 0) + 1
                        say(mode, f"{stage}: node {node.rank}: {spec.name} exited ({proc.returncode}); restarting it")
                        supervisor.restart(spec.name)
                time.sleep(0.5)
    say(mode, f"{stage} done on node {node.rank} (node 0 holds the run's results in {directory})", always=True)


def wait_ready_watching(supervisor, names, rdv, watch_jobs=()) -> None:
    """``supervisor.wait_ready`` in short slices, checking the other nodes between them."""
    deadline = time.monotonic() + ENGINE_READY_TIMEOUT_S
    while True:
        try:
            supervisor.wait_ready(names, timeout_s=2.0, watch_jobs=watch_jobs)
            return
        except LaunchError as err:
            if not str(err).startswith("timed out waiting") or time.monotonic() > deadline:
                raise
        rdv.check()

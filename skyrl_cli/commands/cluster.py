"""``skyrl sft|rl`` across nodes: the ``--node-rank`` and ``--slurm`` options and what one node does.

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
from pathlib import Path
from typing import Annotated, Optional

import typer

NodeRankOpt = Annotated[
    Optional[int],
    typer.Option(
        "--node-rank",
        min=0,
        help="This node's rank in a run across nodes (the recipe's cluster section); default: Slurm's SLURM_NODEID, else 0.",
    ),
]
SlurmOpt = Annotated[
    bool,
    typer.Option(
        "--slurm",
        help="Write an sbatch script that runs this command on every node of the recipe's cluster layout and submit it "
        "(with --dry-run: print it).",
    ),
]


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
    from skyrl_cli.plan.nodes import (
        TRAINER_IFNAME_VARS,
        NodeContext,
        cluster_address,
        cluster_layout,
        detect_own_address,
        interface_of,
        node_rank,
    )
    from skyrl_contracts.errors import UsageError

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


def dry_run(
    loaded, stage: str, node: NodeRun, directory: Path, *, node_rank_flag, resume, async_mode, machine, code_dir, json_
):
    """Every node's plan (``--node-rank``: that node's only)."""
    from skyrl_cli.commands import common
    from skyrl_cli.plan.nodes import plan_cluster, slurm_rank

    shown = [node.rank] if node_rank_flag is not None or slurm_rank(os.environ)[1] is not None else None
    data = plan_cluster(
        loaded,
        stage,
        node.layout,
        node.context.address,
        directory,
        resume=resume,
        async_mode=async_mode,
        machine=machine,
        recipe_dir=code_dir,
        nodes=shown,
    )
    common.print_plan(data, json_)


def slurm(loaded, stage: str, recipe_arg: str, directory: Path, sets, *, async_mode, resume, dry_run_: bool) -> None:
    """``--slurm``: print (``--dry-run``) or write and submit the sbatch script."""
    import shutil
    import subprocess

    from skyrl_cli.plan.nodes import cluster_layout
    from skyrl_cli.plan.slurm import sbatch_script
    from skyrl_cli.recipe.registry import resolve_recipe_arg
    from skyrl_contracts.errors import LaunchError, UsageError
    from skyrl_contracts.rundir import RunDir

    layout = cluster_layout(loaded)
    if layout is None or layout.legacy:
        raise UsageError("--slurm: the recipe needs a [cluster] section (nodes, trainer_nodes, inference_nodes)")
    script = sbatch_script(
        loaded,
        stage,
        layout,
        recipe_path=resolve_recipe_arg(recipe_arg).resolve(),
        run_dir=directory,
        sets=list(sets or ()),
        async_mode=async_mode,
        resume=resume,
        workdir=Path.cwd(),
    )
    if dry_run_:
        typer.echo(script, nl=False)
        return
    path = RunDir(directory).slurm_script(stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        typer.echo(f"wrote {path}; sbatch is not on PATH here: submit it with `sbatch {path}` on the cluster")
        return
    proc = subprocess.run([sbatch, str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise LaunchError(f"sbatch {path} failed: {why[-1] if why else f'exit code {proc.returncode}'}")
    typer.echo(f"{proc.stdout.strip()} ({path}); per-node logs: {RunDir(directory).logs}/slurm-<job>-node<k>.log")


def rendezvous(loaded, stage: str, node: NodeRun, directory: Path, *, resume: bool, async_mode: bool):
    from skyrl_cli.launch.nodes import Rendezvous
    from skyrl_contracts.rundir import recipe_hash

    layout = node.layout
    peers = None
    if node.rank == 0:
        peers = list(range(1, layout.stage_nodes(stage)))
    return Rendezvous(
        directory,
        node.rank,
        layout.stage_nodes(stage),
        recipe_hash(loaded),
        stage,
        {"resume": resume, "async": async_mode},
        arrival_timeout_s=layout.arrival_timeout_s,
        heartbeat_timeout_s=layout.heartbeat_timeout_s,
        peers=peers,
    )


def plan_here(loaded, stage, node: NodeRun, directory, *, resume, async_mode, machine, code_dir, remote_urls=None):
    from skyrl_cli.plan.feasibility import assert_feasible
    from skyrl_cli.plan.nodes import plan_node

    assert_feasible(loaded, machine)
    return plan_node(
        loaded,
        stage,
        node.layout,
        node.context,
        directory,
        resume=resume,
        async_mode=async_mode,
        machine=machine,
        recipe_dir=code_dir,
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


# ---------------------------------------------------------------------------------- a node's share


def run_peer(loaded, stage: str, node: NodeRun, directory: Path, mode, *, resume, async_mode, machine, code_dir):
    """A node other than node 0: join, start this node's processes once node 0 is ready for them,
    report its engines, and run until node 0 ends the run (or this node's job ends, when it only trains)."""
    from skyrl_cli.launch.interrupts import reported
    from skyrl_cli.launch.supervisor import Supervisor, job_failure
    from skyrl_contracts.errors import LaunchError
    from skyrl_contracts.rundir import RunDir

    paths = RunDir(directory)
    with rendezvous(loaded, stage, node, directory, resume=resume, async_mode=async_mode) as rdv:
        say(mode, f"{stage}: node {node.rank} of {node.layout.nodes}: waiting for node 0 in {directory}")
        rdv.join()
        waiting = ("setup-done", "ready", "running") if stage == "rl" else ("running",)
        rdv.wait_for(0, waiting, "the run directory ready", node.layout.arrival_timeout_s + 600)
        plan = plan_here(
            loaded, stage, node, directory, resume=resume, async_mode=async_mode, machine=machine, code_dir=code_dir
        )
        say(
            mode,
            f"{stage}: node {node.rank} runs {', '.join(p.name for p in plan.processes)} (logs: {paths.node_logs(node.rank)})",
        )
        from skyrl_contracts.atomic import write_json

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
    from skyrl_cli.plan.inference import ENGINE_READY_TIMEOUT_S
    from skyrl_contracts.errors import LaunchError

    deadline = time.monotonic() + ENGINE_READY_TIMEOUT_S
    while True:
        try:
            supervisor.wait_ready(names, timeout_s=2.0, watch_jobs=watch_jobs)
            return
        except LaunchError as err:
            if not str(err).startswith("timed out waiting") or time.monotonic() > deadline:
                raise
        rdv.check()


def gather_engines(rdv, layout, timeout_s: float) -> list[str]:
    """Node 0: the engine URLs every inference node reported, in node order."""
    urls: list[str] = []
    for peer in range(1, layout.nodes):
        if layout.serves(peer):
            marker = rdv.wait_for(peer, ("ready", "running"), "its engines ready", timeout_s)
            urls += marker.engines
    return urls


def say(mode, line: str, always: bool = False) -> None:
    if mode != "json" or always:
        typer.echo(line, err=True)

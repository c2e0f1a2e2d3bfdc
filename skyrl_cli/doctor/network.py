"""Can the recipe's processes reach each other: a gloo (CPU) or NCCL (GPU) all-reduce between two
local processes as the trainer ranks do it, the multi-node rendezvous, and remote engines."""

from __future__ import annotations

import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

from skyrl_cli.doctor.checks import Check, failed, passed, run_child
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.nodes import NodeContext, cluster_layout, node_rank, node_recipe
from skyrl_cli.plan.trainer import trainer_device
from skyrl_contracts.errors import UsageError
from skyrl_contracts.ports import find_free_ports
from skyrl_contracts.schema import Recipe

COLLECTIVE_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 5.0

# One rank of the all-reduce: what torchrun's workers do first (env:// there, tcp:// here).
ALL_REDUCE = """
import datetime, sys
import torch, torch.distributed as dist
backend, url, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
device = "cpu"
if backend == "nccl":
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
dist.init_process_group(backend, init_method=url, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
value = torch.ones(1, device=device)
dist.all_reduce(value)
dist.destroy_process_group()
assert value.item() == world, value.item()
print(f"{backend} all-reduce over {world} processes on {device.split(':')[0]}")
"""


def check_collectives(recipe: Recipe, machine: MachineFacts) -> Check:
    """gloo between two CPU processes, or NCCL across (up to) two GPUs, over this host's loopback."""
    cuda = trainer_device(recipe, machine) == "cuda"
    backend, world = ("nccl", min(2, len(machine.gpus))) if cuda else ("gloo", 2)
    (port,) = find_free_ports(1)
    url = f"tcp://{machine.host}:{port}"
    argv = [sys.executable, "-c", ALL_REDUCE, backend, url]
    with ThreadPoolExecutor(world) as pool:
        results = list(
            pool.map(lambda rank: run_child([*argv, str(rank), str(world)], COLLECTIVE_TIMEOUT_S), range(world))
        )
    bad = [r for r in results if not r.ok]
    if bad:
        fix = (
            "check the NCCL install (NCCL_DEBUG=INFO shows why) and that no other job holds the GPUs"
            if cuda
            else "check that loopback TCP works (firewall) and that torch.distributed imports"
        )
        return failed(backend, bad[0].output, fix)
    return passed(backend, results[0].output)


def _connect(host: str, port: int) -> str | None:
    """None when ``host:port`` accepts a TCP connection, else why not."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as err:
        return err.strerror or str(err)


def check_rendezvous(recipe: Recipe) -> list[Check]:
    """Multi-node: node 0 hosts the rendezvous (its address must be this host's), other nodes connect.
    With ``[cluster]`` the trainer's view comes from the layout (``skyrl_cli.plan.nodes``), this
    node's rank from Slurm's environment (else 0), node 0's address from the recipe or
    ``SKYRL_CLUSTER_ADDRESS``."""
    trainer = recipe.trainer
    if recipe.cluster is not None:
        layout = cluster_layout(recipe)
        address = layout.address or os.environ.get("SKYRL_CLUSTER_ADDRESS", "").strip()
        if not address:
            return [failed("rendezvous", "cluster.address is unset", "set it, or SKYRL_CLUSTER_ADDRESS (Slurm)")]
        try:
            rank = node_rank(recipe, layout, None, os.environ)
        except UsageError as err:
            return [failed("rendezvous", str(err), "run the check on a node of the layout")]
        trainer = node_recipe(recipe, layout, NodeContext(rank, address, address), "sft").trainer
        if not layout.trains(rank) or layout.trainer_nodes == 1:
            return [passed("rendezvous", f"node {rank} of {layout.nodes}: no rendezvous across nodes to check")]
    if trainer.nnodes == 1:
        return []
    host, _, port_text = trainer.rdzv_endpoint.rpartition(":")
    if trainer.node_rank == 0:
        try:
            with socket.socket() as sock:
                sock.bind((host, 0))
        except OSError as err:
            return [
                failed(
                    "rendezvous",
                    f"{host} is not an address of this host ({err.strerror})",
                    "run node_rank 0 on the host trainer.rdzv_endpoint names, or change it",
                )
            ]
        return [passed("rendezvous", f"node 0 of {trainer.nnodes}: hosts {trainer.rdzv_endpoint}")]
    why = _connect(host, int(port_text))
    if why:
        return [
            failed(
                "rendezvous",
                f"{trainer.rdzv_endpoint}: {why}",
                f"start node 0 first, and open TCP port {port_text} between the nodes",
            )
        ]
    return [passed("rendezvous", f"node {trainer.node_rank} of {trainer.nnodes}: {trainer.rdzv_endpoint} answers")]


def check_remote_engines(recipe: Recipe) -> list[Check]:
    checks = []
    for url in recipe.inference.urls if recipe.rl is not None else ():
        try:
            code = httpx.get(f"{url.rstrip('/')}/health", timeout=CONNECT_TIMEOUT_S).status_code
            why = None if code == 200 else f"/health answered {code}"
        except httpx.HTTPError as err:
            why = f"{type(err).__name__}: {err}"
        host = urlsplit(url).hostname
        if why:
            checks.append(
                failed("remote engine", f"{url}: {why}", f"start the engine on {host} or remove it from inference.urls")
            )
        else:
            checks.append(passed("remote engine", f"{url} is healthy"))
    return checks

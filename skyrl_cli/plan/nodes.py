"""Runs across nodes: which node runs what (pure; starts nothing).

The layout is the recipe's ``[cluster]`` (or, for SFT only, the older ``trainer.nnodes`` /
``trainer.node_rank`` / ``trainer.rdzv_endpoint``, read as "every node trains")::

    nodes = N             node ranks 0..N-1
    trainer_nodes = k     nodes 0..k-1 run trainer.ranks trainer ranks each (default: all)
    inference_nodes = m   nodes N-m..N-1 run inference.engines engines each (default: all)

Node 0 is the coordinator: it prepares the run directory, hosts the trainer's rendezvous (torchrun,
``cluster.address:cluster.port``) and, in an RL run, runs the router and the orchestrator, which
reach every node's engines at the URLs those nodes report in the run directory
(``skyrl_cli.launch.nodes``). Why this shape:

- Trainer nodes first and inference nodes last: torchrun's node ranks are then the first k node
  ranks as they are (no second numbering), and node 0, which hosts the rendezvous, always trains.
- One count per role instead of a list of node ids: every layout we were asked for (split, both on
  every node, one trainer node and many engine nodes) is two numbers, and the Slurm script asks
  for N identical nodes anyway.
- ``inference.engines`` stays what it always was, the engines of one machine: across nodes it is
  per inference node.
- The node rank is not in the recipe (every node runs the same file, so the recipe hash
  ``skyrl_contracts.rundir.recipe_hash`` agrees); it comes from ``--node-rank`` or Slurm
  (``SLURM_NODEID``), see ``node_rank``.

``node_recipe`` is the recipe as one node's planner sees it (trainer.nnodes / node_rank /
rdzv_endpoint derived, inference.engines the engines of this node); ``plan_node`` builds that
node's ``LaunchPlan`` and ``plan_cluster`` every node's, for ``--dry-run``.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.model import LaunchPlan
from skyrl_cli.plan.rl import peer_engine_specs, plan_rl, rl_trainer_spec
from skyrl_cli.plan.trainer import trainer_resources, trainer_spec, world_size
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import ClusterConfig, Recipe

COORDINATOR, TRAINER, INFERENCE = "coordinator", "trainer", "inference"
ADDRESS_ENV = "SKYRL_CLUSTER_ADDRESS"  # node 0's address when cluster.address is unset (the --slurm script)
NODE_ADDRESS_ENV = "SKYRL_NODE_ADDRESS"  # this node's address as the others reach it (default: detected)
# Slurm's per-task variables, first found wins: the node's index within the job, then the task's.
SLURM_RANK_VARS = ("SLURM_NODEID", "SLURM_PROCID")


@dataclass(frozen=True)
class Layout:
    nodes: int
    trainer_nodes: int
    inference_nodes: int
    address: str | None  # node 0's address, None: from the environment at run time
    port: int
    arrival_timeout_s: float
    heartbeat_timeout_s: float
    legacy: bool = False  # from trainer.nnodes (SFT only), not [cluster]

    def trains(self, node: int) -> bool:
        return node < self.trainer_nodes

    def serves(self, node: int) -> bool:
        return node >= self.nodes - self.inference_nodes

    def roles(self, node: int, stage: str) -> tuple[str, ...]:
        """What ``node`` does in ``stage`` ("sft" runs no engines)."""
        roles = [COORDINATOR] if node == 0 else []
        if self.trains(node):
            roles.append(TRAINER)
        if stage == "rl" and self.serves(node):
            roles.append(INFERENCE)
        return tuple(roles)

    def stage_nodes(self, stage: str) -> int:
        """Nodes that take part in ``stage``: an SFT stage needs only the trainer nodes (the
        inference-only nodes are the last ones, so they are left out of the allocation)."""
        return self.trainer_nodes if stage == "sft" else self.nodes

    @property
    def overlap(self) -> bool:
        """Whether some node both trains and serves (its GPUs are shared between the two)."""
        return self.trainer_nodes + self.inference_nodes > self.nodes


def cluster_layout(recipe: Recipe) -> Layout | None:
    """The recipe's node layout, or None for a run on one machine."""
    cluster = recipe.cluster
    if cluster is not None:
        return Layout(
            nodes=cluster.nodes,
            trainer_nodes=cluster.nodes if cluster.trainer_nodes is None else cluster.trainer_nodes,
            inference_nodes=cluster.nodes if cluster.inference_nodes is None else cluster.inference_nodes,
            address=cluster.address,
            port=cluster.port,
            arrival_timeout_s=cluster.arrival_timeout_s,
            heartbeat_timeout_s=cluster.heartbeat_timeout_s,
        )
    trainer = recipe.trainer
    if trainer.nnodes > 1:
        host, _, port = trainer.rdzv_endpoint.rpartition(":")

        base = ClusterConfig(nodes=2)  # the timeouts' defaults
        return Layout(
            nodes=trainer.nnodes,
            trainer_nodes=trainer.nnodes,
            inference_nodes=0,
            address=host or None,
            port=int(port) if port.isdigit() else base.port,
            arrival_timeout_s=base.arrival_timeout_s,
            heartbeat_timeout_s=base.heartbeat_timeout_s,
            legacy=True,
        )
    return None


@dataclass(frozen=True)
class NodeContext:
    """Where one node stands: its rank, node 0's address and its own (as the other nodes reach it)."""

    rank: int
    address: str
    own_address: str
    # The network interface that carries ``own_address``: the trainer ranks' gloo / NCCL sockets
    # bind it (a host name that resolves to 127.0.1.1, as on many installs, otherwise sends the
    # peers to loopback). None: left to torch (or the user set GLOO_SOCKET_IFNAME).
    interface: str | None = None


def slurm_rank(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    """(the variable, this node's rank) from Slurm's environment, or (None, None) outside Slurm."""
    for var in SLURM_RANK_VARS:
        if env.get(var, "").strip().isdigit():
            return var, int(env[var])
    return None, None


def node_rank(recipe: Recipe, layout: Layout, flag: int | None, env: Mapping[str, str]) -> int:
    """This node's rank: ``--node-rank``, else Slurm's ``SLURM_NODEID`` (``SLURM_PROCID``), else
    ``trainer.node_rank`` (the older ``trainer.nnodes`` recipes), else 0."""
    source, rank = "--node-rank", flag
    if rank is None:
        source, rank = slurm_rank(env)
    if rank is None:
        source, rank = "trainer.node_rank", recipe.trainer.node_rank if layout.legacy else 0
    key = "trainer.nnodes" if layout.legacy else "cluster.nodes"
    if not 0 <= rank < layout.nodes:
        raise UsageError(f"{source} = {rank}: the layout has nodes 0..{layout.nodes - 1} ({key} = {layout.nodes})")
    return rank


def cluster_address(layout: Layout, env: Mapping[str, str]) -> str:
    """Node 0's address: ``cluster.address``, else ``$SKYRL_CLUSTER_ADDRESS``."""
    address = layout.address or env.get(ADDRESS_ENV, "").strip()
    if not address:
        raise UsageError(
            f"cluster.address: set node 0's address (a host name or IP the other nodes reach), or {ADDRESS_ENV} "
            "in the environment (the --slurm script sets it to the job's first node)"
        )
    return address


def detect_own_address(address: str, rank: int, env: Mapping[str, str]) -> str:
    """This node's address as the others reach it: ``$SKYRL_NODE_ADDRESS``, node 0's own address on
    node 0, else the source address of this host's route to node 0 (a UDP socket's ``connect``
    sends nothing; it only picks the interface)."""
    if env.get(NODE_ADDRESS_ENV, "").strip():
        return env[NODE_ADDRESS_ENV].strip()
    if rank == 0:
        return address
    try:
        target = socket.gethostbyname(address)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((target, 9))
            return sock.getsockname()[0]
    except OSError as err:
        raise UsageError(
            f"cluster.address = {address!r}: this node finds no route to it ({err.strerror or err}); "
            f"set {NODE_ADDRESS_ENV} to this node's address"
        ) from None


def interface_of(address: str) -> str | None:
    """The name of this host's interface whose IPv4 address is ``address`` (None if none is)."""
    # lazy: fcntl is POSIX-only; skyrl recipes validate imports this module on any OS
    import fcntl

    SIOCGIFADDR = 0x8915
    try:
        wanted = socket.gethostbyname(address)
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == wanted:
                return name
    return None


TRAINER_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def node_recipe(recipe: Recipe, layout: Layout, node: NodeContext, stage: str) -> Recipe:
    """The recipe as node ``node.rank``'s planner sees it: the trainer's torchrun node count, rank
    and rendezvous from the layout, and ``inference.engines`` the engines this node starts. Only the
    planner sees it; every process reads the recipe as written (``recipe.resolved.json``)."""
    trainer_update: dict = {}
    if layout.trains(node.rank) and layout.trainer_nodes > 1:
        trainer_update = {
            "nnodes": layout.trainer_nodes,
            "node_rank": node.rank,
            "rdzv_endpoint": f"{node.address}:{layout.port}",
        }
    elif layout.legacy:
        trainer_update = {"node_rank": node.rank}
    update: dict = {"trainer": recipe.trainer.model_copy(update=trainer_update)}
    if stage == "rl":
        engines = recipe.inference.engines if layout.serves(node.rank) else 0
        update["inference"] = recipe.inference.model_copy(update={"engines": engines})
    return recipe.model_copy(update=update)


def engine_seed_offset(recipe: Recipe, layout: Layout, rank: int) -> int:
    """Engines on the inference nodes before ``rank``: each engine samples with a seed of its own."""
    first = layout.nodes - layout.inference_nodes
    return max(0, rank - first) * recipe.inference.engines


def remote_placeholders(recipe: Recipe, layout: Layout) -> list[str]:
    """The engines of nodes 1..N-1 as node 0's plan shows them before they reported their URLs."""
    return [
        f"http://<node-{node}-engine-{index}>"
        for node in range(1, layout.nodes)
        if layout.serves(node)
        for index in range(recipe.inference.engines)
    ]


def plan_node(
    recipe: Recipe,
    stage: str,
    layout: Layout,
    node: NodeContext,
    run_dir: Path,
    *,
    resume: bool = False,
    async_mode: bool = False,
    machine: MachineFacts,
    recipe_dir: Path | None = None,
    remote_urls: Sequence[str] | None = None,
) -> LaunchPlan:
    """Node ``node.rank``'s processes in ``stage``. ``remote_urls``: the other nodes' engines as
    they reported them (node 0, RL); None: placeholders (``--dry-run``)."""
    if stage not in ("sft", "rl"):
        raise UsageError(f"skyrl {stage} runs on one machine; [cluster] is for skyrl sft and skyrl rl")
    if stage == "rl" and layout.legacy:
        raise UsageError(
            f"trainer.nnodes = {layout.nodes}: RL across nodes takes its layout from a [cluster] section "
            "(nodes, trainer_nodes, inference_nodes, address); see docs/multi-node.md"
        )
    roles = layout.roles(node.rank, stage)
    mine = node_recipe(recipe, layout, node, stage)
    facts = dataclasses.replace(machine, host=node.own_address)
    common = {"node": node.rank, "nodes": layout.nodes, "roles": roles, "resume": resume, "run_dir": str(run_dir)}
    if stage == "rl" and node.rank == 0:
        urls = list(remote_urls) if remote_urls is not None else remote_placeholders(recipe, layout)
        plan = plan_rl(mine, run_dir, resume, async_mode, facts, recipe_dir, remote_urls=urls, nccl_host=node.address)
        return with_interface(plan.model_copy(update=common), layout, node)
    processes = []
    device = "cpu"
    if stage == "rl" and layout.serves(node.rank):
        offset = engine_seed_offset(recipe, layout, node.rank)
        engines, device = peer_engine_specs(mine, run_dir, facts, async_mode, offset, layout.trains(node.rank))
        processes += engines
    if layout.trains(node.rank):
        resources = trainer_resources(mine, facts)
        device = resources.device
        if stage == "sft":
            processes.append(trainer_spec(mine, run_dir, facts, resume=resume, resources=resources))
        else:
            processes.append(rl_trainer_spec(mine, run_dir, facts, resume, node.address))
    plan = LaunchPlan(
        stage=stage,
        device=device,
        async_mode=async_mode,
        world_size=world_size(recipe),
        engine_urls=tuple(u for p in processes if p.role == "engine" for u in _engine_url(p)),
        processes=tuple(processes),
        **common,
    )
    return with_interface(plan, layout, node)


def with_interface(plan: LaunchPlan, layout: Layout, node: NodeContext) -> LaunchPlan:
    """Trainer ranks spread over nodes open their collectives on ``node.interface``."""
    if node.interface is None or layout.trainer_nodes < 2:
        return plan
    extra = dict.fromkeys(TRAINER_IFNAME_VARS, node.interface)
    processes = tuple(
        p.model_copy(update={"env": {**p.env, **extra}}) if p.role == "trainer" else p for p in plan.processes
    )
    return plan.model_copy(update={"processes": processes})


def _engine_url(spec) -> list[str]:
    url = spec.ready.url or ""
    return [url.removesuffix("/health")] if url else []


def plan_cluster(
    recipe: Recipe,
    stage: str,
    layout: Layout,
    address: str,
    run_dir: Path,
    *,
    resume: bool = False,
    async_mode: bool = False,
    machine: MachineFacts,
    recipe_dir: Path | None = None,
    nodes: Sequence[int] | None = None,
) -> dict:
    """Every node's plan (or those of ``nodes``), for ``--dry-run``: the other nodes' addresses
    are not known here, so their engines show as ``<node-k>`` and node 0's router lists placeholders."""
    shown = range(layout.stage_nodes(stage)) if nodes is None else nodes
    plans = []
    for rank in shown:
        own = address if rank == 0 else f"<node-{rank}>"
        context = NodeContext(rank=rank, address=address, own_address=own)
        plan = plan_node(
            recipe,
            stage,
            layout,
            context,
            run_dir,
            resume=resume,
            async_mode=async_mode,
            machine=machine,
            recipe_dir=recipe_dir,
        )
        plans.append(plan.model_dump(mode="json"))
    return {"layout": dataclasses.asdict(layout) | {"address": address}, "nodes": plans}

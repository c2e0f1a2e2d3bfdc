"""The trainer part of a launch plan: one ``torchrun`` job running a ``backends.train`` module.

    torchrun --nproc-per-node R --nnodes N --node-rank K --rdzv-endpoint HOST:PORT \\
        -m backends.train.sft --run-dir DIR [--resume]

torchrun is started as ``python -m torch.distributed.run`` with the same interpreter as the driver.
The rendezvous is torchrun's static one: on one node a free local port, across nodes the recipe's
``trainer.rdzv_endpoint`` with ``trainer.node_rank`` (run the same command on every node).

Environment, and why:
- ``OMP_NUM_THREADS``: the cores given to the trainer divided by its ranks (or
  ``trainer.threads_per_rank``); without it every rank starts one thread per core and they fight.
- ``DS_ACCELERATOR=cpu`` on CPU: DeepSpeed's accelerator without probing for CUDA.
- ``TORCH_EXTENSIONS_DIR``: a fixed cache, so DeepSpeed compiles its CPU ops once per machine.
- ``CUDA_VISIBLE_DEVICES`` on GPUs: the trainer's GPUs (the engines get the others).
- ``HF_HUB_OFFLINE=1``: never reach for the hub at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.model import ProcessSpec
from skyrl_contracts.schema import Recipe

TRAINER_NAME = "trainer"


@dataclass(frozen=True)
class TrainerResources:
    device: Literal["cpu", "cuda"]
    cores: tuple[int, ...]  # CPU cores of the trainer (all of them on GPU machines: data loading)
    gpus: tuple[int, ...]  # GPU ids, one per local rank
    threads_per_rank: int


RDZV_FLAG = "--rdzv-endpoint"  # torchrun's rendezvous: a launch's own port (skyrl_cli.engines.standby)


def trainer_node_count(recipe: Recipe) -> int:
    """Nodes that run trainer ranks: ``cluster.trainer_nodes`` (default: every node of the
    ``[cluster]``), else ``trainer.nnodes``."""
    cluster = recipe.cluster
    if cluster is not None:
        return cluster.nodes if cluster.trainer_nodes is None else cluster.trainer_nodes
    return recipe.trainer.nnodes


def world_size(recipe: Recipe) -> int:
    """Trainer processes over all nodes: the count every global batch is split over."""
    return recipe.trainer.ranks * trainer_node_count(recipe)


def trainer_device(recipe: Recipe, machine: MachineFacts) -> Literal["cpu", "cuda"]:
    device = recipe.trainer.device
    if device == "auto":
        return "cuda" if machine.gpus else "cpu"
    return device


def trainer_gpus(recipe: Recipe, machine: MachineFacts) -> tuple[int, ...]:
    """The trainer's GPU ids on a GPU machine: ``trainer.gpus``, else the first ``trainer.ranks``."""
    trainer = recipe.trainer
    return tuple(trainer.gpus) if trainer.gpus is not None else tuple(machine.gpus[: trainer.ranks])


def trainer_resources(recipe: Recipe, machine: MachineFacts, cores: Sequence[int] | None = None) -> TrainerResources:
    """Devices and threads of the trainer; ``cores`` restricts it to part of the CPU (the RL stage
    gives the rest to the engines). The layout fits the machine: ``skyrl_cli.plan.feasibility``
    checked it (``build_plan`` asserts it)."""
    trainer = recipe.trainer
    device = trainer_device(recipe, machine)
    cores = tuple(cores if cores is not None else machine.cpu_cores)
    gpus = trainer_gpus(recipe, machine) if device == "cuda" else ()
    threads = trainer.threads_per_rank or max(1, len(cores) // trainer.ranks)
    return TrainerResources(device, cores, gpus, threads)


def rendezvous_endpoint(recipe: Recipe, machine: MachineFacts, port: int | None = None) -> str:
    if recipe.trainer.rdzv_endpoint:
        return recipe.trainer.rdzv_endpoint
    return f"{machine.host}:{port if port is not None else machine.free_ports(1)[0]}"


def trainer_spec(
    recipe: Recipe,
    run_dir: str | Path,
    machine: MachineFacts,
    *,
    module: str = "backends.train.sft",
    resume: bool = False,
    resources: TrainerResources | None = None,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    name: str = TRAINER_NAME,
) -> ProcessSpec:
    """The torchrun job that runs ``python -m <module> --run-dir DIR [--resume] [extra_args]``."""
    trainer = recipe.trainer
    res = resources or trainer_resources(recipe, machine)
    endpoint = rendezvous_endpoint(recipe, machine, port)
    argv = [
        machine.python,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(trainer.ranks),
        "--nnodes",
        str(trainer.nnodes),
        "--node-rank",
        str(trainer.node_rank),
        RDZV_FLAG,
        endpoint,
        "-m",
        module,
        "--run-dir",
        str(run_dir),
    ]
    if resume:
        argv.append("--resume")
    argv += list(extra_args)
    env = {
        "OMP_NUM_THREADS": str(res.threads_per_rank),
        "TORCH_EXTENSIONS_DIR": machine.torch_extensions_dir,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    if res.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        devices = tuple(f"cpu:{c}" for c in res.cores)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in res.gpus)
        devices = tuple(f"cuda:{g}" for g in res.gpus)
    local_port = int(endpoint.rsplit(":", 1)[1]) if not trainer.rdzv_endpoint else None
    return ProcessSpec(
        name=name,
        role="trainer",
        argv=tuple(argv),
        env=env,
        devices=devices,
        ports=(local_port,) if local_port is not None else (),
        kind="job",
    )

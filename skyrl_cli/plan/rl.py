"""The RL stage's plan: vLLM engines, vllm-router, the orchestrator and the torchrun learner.

The plan lists the processes; ``skyrl_cli.stages.local.run_rl`` starts them: setup jobs to their end
(``engine-model/``, or the INT4 export), the engines with the learner beside them
(``start_with_engines``; with NCCL it waits for them), the router, then the orchestrator. The
orchestrator and the learner meet in the run directory (``skyrl_contracts.exchange``), so the
plan only has to give both the same run directory, the initial policy and the URLs.

Devices. On GPUs the trainer takes ``trainer.gpus`` (default: the first ``trainer.ranks`` GPUs) and
the engines the GPUs after them (``tensor_parallel`` each); a layout the machine cannot hold never
gets here (``skyrl_cli.plan.feasibility`` refuses it when the recipe is loaded). On CPU the engines are bound one core each (round robin) and the trainer ranks share
all cores: on a 2-core machine generation and training then compete for the cores, which is why the
async mode's gain shows in its benchmark with a fixed-time trainer, not on the quickstart's clock.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Mapping, Sequence

from skyrl_cli.plan.inference import (
    Machine,
    all_engine_urls,
    auxiliary_engine_specs,
    engine_dtype,
    engine_specs,
    engine_url,
    router_spec,
)
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.model import LaunchPlan, PoolAttachment, ProcessSpec
from skyrl_cli.plan.quantize import ptq_spec
from skyrl_cli.plan.trainer import trainer_device, trainer_gpus, trainer_resources, trainer_spec, world_size
from skyrl_cli.plan.weight_sync import select_weight_sync, vllm_weight_transfer_available
from skyrl_contracts.auxiliary import auxiliary_models
from skyrl_contracts.errors import UsageError
from skyrl_contracts.rundir import RUNS_ROOT, RunDir, sft_output_dir
from skyrl_contracts.schema import Recipe
from skyrl_contracts.transports import DEFAULT_TRANSPORT, TRANSPORTS, EngineModel, TransportName

ORCHESTRATOR_NAME = "orchestrator"
LEARNER_MODULE = "backends.train.rl_learner"
ORCHESTRATOR_ENV = {
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


def init_model_dir(recipe: Recipe, runs_root: Path | None = None) -> Path:
    """The initial policy: this recipe's SFT output for ``init_from = "sft"``, else the path given
    (already made absolute by the recipe loader)."""
    if recipe.rl.init_from == "sft":
        return sft_output_dir(recipe, runs_root or RUNS_ROOT).resolve()
    return Path(recipe.rl.init_from).resolve()


def inference_machine(recipe: Recipe, machine: MachineFacts, device: str) -> Machine:
    if device == "cuda":
        taken = set(trainer_gpus(recipe, machine))
        return Machine(
            "cuda",
            engine_cores=machine.cpu_cores,
            engine_gpus=tuple(g for g in machine.gpus if g not in taken),
            python=machine.python,
            host=machine.host,
        )
    return Machine(
        "cpu", engine_cores=machine.cpu_cores, python=machine.python, host=machine.host, cpu_bf16=machine.cpu_bf16
    )


def orchestrator_spec(
    run_dir: Path,
    init_from: Path,
    router_url: str,
    engine_urls: list[str],
    machine: MachineFacts,
    async_mode: bool,
    recipe_dir: Path | None = None,
    weight_sync: str = DEFAULT_TRANSPORT,
    resume: bool = False,
    auxiliary_urls: Mapping[str, Sequence[str]] | None = None,
) -> ProcessSpec:
    """``auxiliary_urls``: the engines of each auxiliary model (a teacher, a judge). ``recipe_dir``: put first on the orchestrator's import path, so that ``rl.reward`` /
    ``rl.environment`` modules are found next to the recipe, like its files (then the directory
    skyrl runs in, which ``python -m`` puts on the path, then the installed packages)."""
    argv = [
        machine.python,
        "-m",
        "backends.rollout.orchestrator",
        "--run-dir",
        str(run_dir),
        "--init-from",
        str(init_from),
        "--router-url",
        router_url,
        "--engine-urls",
        ",".join(engine_urls),
        "--weight-sync",
        weight_sync,
    ]
    for name, urls in (auxiliary_urls or {}).items():
        argv += ["--auxiliary-urls", f"{name}={','.join(urls)}"]
    if async_mode:
        argv.append("--async")
    if not resume:  # starts on v0 at once (backends.rollout.orchestrator.Orchestrator.first_version)
        argv.append("--fresh")
    if recipe_dir is not None:
        argv += ["--import-path", str(recipe_dir)]
    return ProcessSpec(
        name=ORCHESTRATOR_NAME, role="orchestrator", argv=tuple(argv), env=dict(ORCHESTRATOR_ENV), kind="job"
    )


ENGINE_MODEL_JOB = "engine-model"
UNTIE_MODULE = "backends.models.tied"


def engine_model_setup(
    weight_sync: str, run_dir: Path, init_from: Path, machine: MachineFacts
) -> tuple[tuple[ProcessSpec, ...], Path]:
    """The model the engines start from, and the setup job that makes it. Returns (setup jobs, model),
    by the transport's ``engine_model`` (``skyrl_contracts.transports``)."""
    return ENGINE_MODELS[TRANSPORTS[weight_sync].engine_model](run_dir, init_from, machine)


def as_is_engine_model(run_dir: Path, init_from: Path, machine: MachineFacts) -> tuple[tuple[ProcessSpec, ...], Path]:
    """``init_from`` itself: its weights never reload (the versions are adapters), so nothing to make."""
    return (), init_from


def int4_engine_model(run_dir: Path, init_from: Path, machine: MachineFacts) -> tuple[tuple[ProcessSpec, ...], Path]:
    """The engines serve W4A16 from the start: a setup job exports the initial policy into ``int4/``
    (every later version comes from the learner, exported)."""
    spec = ptq_spec(run_dir, str(init_from), machine)
    spec = spec.model_copy(update={"kind": "setup", "argv": (*spec.argv, "--setup")})
    return (spec,), RunDir(run_dir).int4


def untied_engine_model(run_dir: Path, init_from: Path, machine: MachineFacts) -> tuple[tuple[ProcessSpec, ...], Path]:
    """``engine-model/``, links to ``init_from``'s files, with a tied model served untied
    (``backends.models.tied``: vLLM's in-place reload keeps a tied head at its first weights).
    The job decides at run time, when an SFT stage that runs first has written ``init_from``.
    The learner's exports write a tied head out too, so every version the engines reload carries it."""
    served = RunDir(run_dir).engine_model
    argv = (machine.python, "-m", UNTIE_MODULE, "--src", str(init_from), "--out", str(served))
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return (ProcessSpec(name=ENGINE_MODEL_JOB, role="setup", argv=argv, env=env, kind="setup"),), served


EngineModelSetup = Callable[[Path, Path, MachineFacts], tuple[tuple[ProcessSpec, ...], Path]]
ENGINE_MODELS: dict[EngineModel, EngineModelSetup] = {
    "init_from": as_is_engine_model,
    "int4_export": int4_engine_model,
    "untied": untied_engine_model,
}


def rl_weight_sync(recipe: Recipe, machine: MachineFacts) -> TransportName:
    """How this recipe's policy versions reach its engines on ``machine`` (``select_weight_sync``)."""
    device = trainer_device(recipe, machine)
    return select_weight_sync(recipe, device, device == "cuda" and vllm_weight_transfer_available())


def plan_rl(
    recipe: Recipe,
    run_dir: Path,
    resume: bool,
    async_mode: bool,
    machine: MachineFacts,
    recipe_dir: Path | None = None,
    pool: PoolAttachment | None = None,
    remote_urls: Sequence[str] = (),
    nccl_host: str | None = None,
) -> LaunchPlan:
    """``pool``: use a running engine pool's engines, router and auxiliary models' engines (``skyrl
    engines up``) instead of starting them; the setup job still makes the model this run loads into
    them. Across nodes (``skyrl_cli.plan.nodes.plan_node``, node 0): ``remote_urls`` are the other nodes' engines,
    used like ``inference.urls``, and ``nccl_host`` the address the NCCL group opens on."""
    if recipe.rl is None:
        raise UsageError("the recipe has no [rl] section")
    if recipe.trainer.nnodes > 1 and recipe.cluster is None:
        # Every node would start its own engines, router and orchestrator: the layout of an RL run
        # across nodes is the [cluster] section's (skyrl_cli.plan.nodes).
        raise UsageError(
            f"trainer.nnodes = {recipe.trainer.nnodes}: RL across nodes takes its layout from a [cluster] section "
            "(nodes, trainer_nodes, inference_nodes, address); see docs/multi-node.md"
        )
    inf = recipe.inference
    init_from = init_model_dir(recipe)
    device = trainer_device(recipe, machine)
    inf_machine = inference_machine(recipe, machine, device)
    weight_sync = rl_weight_sync(recipe, machine)
    auxiliaries = auxiliary_models(recipe)
    ports = machine.free_ports(inf.engines + 4 + sum(m.engines.engines for m in auxiliaries))
    engine_ports, auxiliary_ports = ports[: inf.engines], iter(ports[inf.engines + 4 :])
    router_port, prometheus_port, rdzv_port, nccl_port = ports[inf.engines : inf.engines + 4]
    router_port = inf.router.port or router_port  # the recipe's fixed port, else a free one
    setup, served = engine_model_setup(weight_sync, run_dir, init_from, machine)
    if pool is None:
        engines = engine_specs(recipe, inf_machine, engine_ports, str(served), async_mode, weight_sync)
        urls = [*all_engine_urls(recipe, inf_machine, engine_ports), *remote_urls]
        inference = (*engines, router_spec(recipe, inf_machine, urls, router_port, prometheus_port))
        router_url = engine_url(inf_machine, router_port)
    else:
        urls = [*pool.engine_urls, *(u.rstrip("/") for u in inf.urls)]
        inference, router_url = (), pool.router_url
    auxiliary, auxiliary_urls = [], {}
    if pool is not None:  # the pool's auxiliary models' engines (skyrl_cli.engines.pool.fit_problem: they match)
        auxiliaries, auxiliary_urls = (), dict(pool.auxiliary_urls)
    for index, model in enumerate(auxiliaries):
        own = [next(auxiliary_ports) for _ in range(model.engines.engines)]
        auxiliary += auxiliary_engine_specs(
            recipe, inf_machine, model, own, model.model, before=auxiliaries[:index], async_mode=async_mode
        )
        auxiliary_urls[model.name] = tuple(engine_url(inf_machine, port) for port in own)
    trainer = rl_trainer_spec(
        recipe, run_dir, machine, resume, nccl_host or machine.host, urls, port=rdzv_port, nccl_port=nccl_port
    )
    orchestrator = orchestrator_spec(
        run_dir, init_from, router_url, urls, machine, async_mode, recipe_dir, weight_sync, resume, auxiliary_urls
    )
    return LaunchPlan(
        stage="rl",
        run_dir=str(run_dir),
        device=device,
        resume=resume,
        async_mode=async_mode,
        world_size=world_size(recipe),
        engine_urls=tuple(urls),
        router_url=router_url,
        auxiliary_urls=auxiliary_urls,
        processes=(*setup, *inference, *auxiliary, orchestrator, trainer),
        weight_sync=weight_sync,
        pool=pool.name if pool is not None else None,
    )


def rl_trainer_spec(
    recipe: Recipe,
    run_dir: Path,
    machine: MachineFacts,
    resume: bool,
    nccl_host: str,
    engine_urls: Sequence[str] = (),
    *,
    port: int | None = None,
    nccl_port: int | None = None,
) -> ProcessSpec:
    """The torchrun learner (``backends.train.rl_learner``); on a node other than node 0 of a run
    across nodes, its share of the ranks (the engine URLs and NCCL address only matter to rank 0)."""
    init_from = init_model_dir(recipe)
    device = trainer_device(recipe, machine)
    inf_machine = inference_machine(recipe, machine, device)
    weight_sync = rl_weight_sync(recipe, machine)
    transport = TRANSPORTS[weight_sync]
    if transport.nccl_group and nccl_port is None:
        nccl_port = recipe.cluster.port + 1 if recipe.cluster is not None else machine.free_ports(1)[0]
    trainer = trainer_spec(
        recipe,
        run_dir,
        machine,
        module=LEARNER_MODULE,
        resume=resume,
        resources=trainer_resources(recipe, machine),
        port=port,
        extra_args=(
            "--init-from",
            str(init_from),
            "--engine-dtype",
            engine_dtype(recipe, inf_machine),
            *learner_sync_args(recipe, weight_sync, list(engine_urls), nccl_host, nccl_port or 0),
        ),
    )
    return trainer.model_copy(update={"start_with_engines": transport.start_with_engines})


def peer_engine_specs(
    recipe: Recipe, run_dir: Path, machine: MachineFacts, async_mode: bool, seed_offset: int, trains_here: bool
) -> tuple[list[ProcessSpec], str]:
    """The engines of a node other than node 0 (``recipe.inference.engines`` of them, as
    ``skyrl_cli.plan.nodes.node_recipe`` set it), serving what node 0's setup job made in the shared
    run directory; and the node's device. On GPUs a node that does not train gives every GPU to its
    engines."""
    device = trainer_device(recipe, machine)
    inf_machine = inference_machine(recipe, machine, device)
    if device == "cuda" and not trains_here:
        inf_machine = dataclasses.replace(inf_machine, engine_gpus=tuple(machine.gpus))
    weight_sync = rl_weight_sync(recipe, machine)
    _, served = engine_model_setup(weight_sync, run_dir, init_model_dir(recipe), machine)
    ports = machine.free_ports(recipe.inference.engines)
    specs = engine_specs(recipe, inf_machine, ports, str(served), async_mode, weight_sync, seed_offset)
    return specs, device


def learner_sync_args(
    recipe: Recipe, weight_sync: str, engine_urls: list[str], host: str, port: int
) -> tuple[str, ...]:
    """The learner's transport (``backends.train.publish``); for one with an NCCL group also where rank 0
    opens it (``host:port``, the rendezvous of the trainer's sender and every engine worker) and the
    engines whose transfer routes it drives."""
    if not TRANSPORTS[weight_sync].nccl_group:
        return ("--weight-sync", weight_sync)
    return (
        "--weight-sync",
        weight_sync,
        "--engine-urls",
        ",".join(engine_urls),
        "--tensor-parallel",
        str(recipe.inference.tensor_parallel),
        "--nccl-address",
        f"{host}:{port}",
    )

"""The RL stage's plan: vLLM engines, vllm-router, the orchestrator and the torchrun learner.

The plan lists the processes; ``skyrl_cli.commands.rl.run_rl`` starts them: setup jobs to their end
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

from pathlib import Path

from skyrl_cli.plan.inference import Machine, all_engine_urls, engine_dtype, engine_specs, engine_url, router_spec
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.model import LaunchPlan, PoolAttachment, ProcessSpec
from skyrl_cli.plan.trainer import trainer_device, trainer_gpus, trainer_resources, trainer_spec, world_size
from skyrl_cli.plan.weight_sync import select_weight_sync, vllm_weight_transfer_available
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe

ORCHESTRATOR_NAME = "orchestrator"
LEARNER_MODULE = "backends.train.rl_learner"


def init_model_dir(recipe: Recipe, runs_root: Path | None = None) -> Path:
    """The initial policy: this recipe's SFT output for ``init_from = "sft"``, else the path given
    (already made absolute by the recipe loader)."""
    from skyrl_contracts.rundir import RUNS_ROOT, sft_output_dir

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
    weight_sync: str = "disk",
) -> ProcessSpec:
    """``recipe_dir``: put first on the orchestrator's import path, so that ``rl.reward`` /
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
    if async_mode:
        argv.append("--async")
    if recipe_dir is not None:
        argv += ["--import-path", str(recipe_dir)]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return ProcessSpec(name=ORCHESTRATOR_NAME, role="orchestrator", argv=tuple(argv), env=env, kind="job")


ENGINE_MODEL_JOB = "engine-model"
UNTIE_MODULE = "backends.models.tied"


def engine_model_setup(
    weight_sync: str, run_dir: Path, init_from: Path, machine: MachineFacts
) -> tuple[tuple[ProcessSpec, ...], Path]:
    """The model the engines start from, and the setup job that makes it. Returns (setup jobs, model).

    By the plan's ``weight_sync``:
    - "lora": ``init_from`` itself (its weights never reload; versions are adapters).
    - "int4" (``quantization.int4_rollouts``): the engines serve W4A16 from the start; a setup job exports
      the initial policy into ``int4/`` (every later version comes from the learner, exported).
    - Otherwise ``engine-model/``, links to ``init_from``'s files, with a tied model served untied
      (``backends.models.tied``: vLLM's in-place reload keeps a tied head at its first weights).
      The job decides at run time, when an SFT stage that runs first has written ``init_from``.
    Both exports write a tied head out, so every version the engines reload carries it."""
    from skyrl_cli.plan.quantize import ptq_spec
    from skyrl_contracts.rundir import RunDir

    if weight_sync == "lora":
        return (), init_from
    if weight_sync == "int4":
        spec = ptq_spec(run_dir, str(init_from), machine)
        spec = spec.model_copy(update={"kind": "setup", "argv": (*spec.argv, "--setup")})
        return (spec,), RunDir(run_dir).int4
    served = RunDir(run_dir).engine_model
    argv = (machine.python, "-m", UNTIE_MODULE, "--src", str(init_from), "--out", str(served))
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return (ProcessSpec(name=ENGINE_MODEL_JOB, role="setup", argv=argv, env=env, kind="setup"),), served


def rl_weight_sync(recipe: Recipe, machine: MachineFacts) -> str:
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
) -> LaunchPlan:
    """``pool``: use a running engine pool's engines and router (``skyrl engines up``) instead of
    starting them; the setup job still makes the model this run loads into them."""
    if recipe.rl is None:
        raise UsageError("the recipe has no [rl] section")
    if recipe.trainer.nnodes > 1:
        # Every node would start its own engines, router and orchestrator: refused until the plan
        # says what each node of an RL run runs (SFT across nodes works: same command on each node).
        raise UsageError(
            f"trainer.nnodes = {recipe.trainer.nnodes}: RL across nodes is not supported yet (skyrl sft is); "
            "run skyrl rl on one node (trainer.nnodes = 1); engines on other machines can join through inference.urls"
        )
    inf = recipe.inference
    init_from = init_model_dir(recipe)
    device = trainer_device(recipe, machine)
    inf_machine = inference_machine(recipe, machine, device)
    weight_sync = rl_weight_sync(recipe, machine)
    ports = machine.free_ports(inf.engines + 4)
    engine_ports, (router_port, prometheus_port, rdzv_port, nccl_port) = ports[: inf.engines], ports[inf.engines :]
    router_port = inf.router.port or router_port  # the recipe's fixed port, else a free one
    setup, served = engine_model_setup(weight_sync, run_dir, init_from, machine)
    if pool is None:
        engines = engine_specs(recipe, inf_machine, engine_ports, str(served), async_mode, weight_sync)
        urls = all_engine_urls(recipe, inf_machine, engine_ports)
        inference = (*engines, router_spec(recipe, inf_machine, urls, router_port, prometheus_port))
        router_url = engine_url(inf_machine, router_port)
    else:
        urls = [*pool.engine_urls, *(u.rstrip("/") for u in inf.urls)]
        inference, router_url = (), pool.router_url
    trainer = trainer_spec(
        recipe,
        run_dir,
        machine,
        module=LEARNER_MODULE,
        resume=resume,
        resources=trainer_resources(recipe, machine),
        port=rdzv_port,
        extra_args=(
            "--init-from",
            str(init_from),
            "--engine-dtype",
            engine_dtype(recipe, inf_machine),
            *learner_sync_args(recipe, weight_sync, urls, machine.host, nccl_port),
        ),
    )
    # With NCCL the learner opens its group with the engines at start-up, so it waits for them.
    trainer = trainer.model_copy(update={"start_with_engines": weight_sync != "nccl"})
    orchestrator = orchestrator_spec(run_dir, init_from, router_url, urls, machine, async_mode, recipe_dir, weight_sync)
    return LaunchPlan(
        stage="rl",
        run_dir=str(run_dir),
        device=device,
        resume=resume,
        async_mode=async_mode,
        world_size=world_size(recipe),
        engine_urls=tuple(urls),
        router_url=router_url,
        processes=(*setup, *inference, orchestrator, trainer),
        weight_sync=weight_sync,
        pool=pool.name if pool is not None else None,
    )


def learner_sync_args(
    recipe: Recipe, weight_sync: str, engine_urls: list[str], host: str, port: int
) -> tuple[str, ...]:
    """The learner's transport (``backends.train.publish``); for NCCL also where rank 0 opens the group
    (``host:port``, the rendezvous of the trainer's sender and every engine worker) and the engines
    whose transfer routes it drives."""
    if weight_sync != "nccl":
        return ("--weight-sync", weight_sync)
    return (
        "--weight-sync",
        "nccl",
        "--engine-urls",
        ",".join(engine_urls),
        "--tensor-parallel",
        str(recipe.inference.tensor_parallel),
        "--nccl-address",
        f"{host}:{port}",
    )

"""An engine pool's plan (``skyrl engines up``): the recipe's RL engines and router, to outlive the
command, and what a later run must match to use them.

A pool is the inference half of an RL plan (``skyrl_cli.plan.rl``): the same engine, router and
auxiliary-model engine specs (a teacher, a judge: served as they are, never weight-synced), built
by the same functions from the same recipe, with the pool's folder in place of a run directory. The engines start from ``<pool>/engine-model`` (the recipe's initial policy, served
untied); a run that attaches loads its own initial weights into them, so the pool fits any run
whose engines would have been started with the same flags (``engine_signature``) on a model of
the same shape (``model_signature``): a run's own model never needs to be the pool's.

Pools serve full-weight (disk) and LoRA runs. Not INT4 rollouts (the engines would serve a
quantized export from start-up) and not the NCCL weight sync (its group with the trainer opens
when the engines start): those runs start their own engines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from skyrl_cli.plan.inference import auxiliary_engine_specs, engine_specs, engine_url, router_spec
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.model import LaunchPlan, ProcessSpec
from skyrl_cli.plan.rl import ORCHESTRATOR_ENV, engine_model_setup, inference_machine, init_model_dir, rl_weight_sync
from skyrl_cli.plan.trainer import trainer_device, trainer_resources, trainer_spec
from skyrl_contracts.auxiliary import auxiliary_models
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe
from skyrl_contracts.transports import TRANSPORTS

POOL_STAGE = "pool"
SERVE_MODULE = "backends.inference.serve"
STANDBY_MODULE = "backends.standby"
KEEPER_MODULE = "skyrl_cli.engines.keeper"
# The pool's warm processes: keeper name (its folder and log in the pool) per role of a run's process.
WARM_NAMES = {"trainer": "warm-learner", "orchestrator": "warm-orchestrator"}
# Engine settings that differ between two plans of the same engines: where they listen, their
# sampling seed, the model directory they boot from, the core they are pinned to, and whether they
# die with the command that started them (a pool's do not).
_PER_LAUNCH_FLAGS = ("--port", "--seed")
_PER_LAUNCH_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "SKYRL_DIE_WITH_PARENT")
# config.json keys that do not change what weights the engines hold.
_MODEL_NOISE = ("_name_or_path", "torch_dtype", "dtype", "transformers_version", "tie_word_embeddings")


def unpoolable(weight_sync: str) -> str | None:
    """Why a run with this weight sync cannot use a pool; None when it can."""
    return TRANSPORTS[weight_sync].pool_refusal


def plan_pool(
    recipe: Recipe, pool_dir: Path, machine: MachineFacts, async_mode: bool = False, warm: bool = True
) -> LaunchPlan:
    """The setup job, engines and router of a pool in ``pool_dir``, for ``recipe``'s RL stage, the
    engines of its auxiliary models (``[rl.distillation]``'s teacher, ``[rl.judge]``), and
    with ``warm`` the keepers of its warm learner and orchestrator (``warm_keeper_specs``)."""
    if recipe.rl is None:
        raise UsageError("skyrl engines up: the recipe has no [rl] section (a pool serves RL runs)")
    if recipe.inference.engines == 0:
        raise UsageError("inference.engines = 0: a pool needs local engines (inference.urls are started elsewhere)")
    weight_sync = rl_weight_sync(recipe, machine)
    why = unpoolable(weight_sync)
    if why:
        raise UsageError(f"skyrl engines up: {why}")
    init_from = init_model_dir(recipe)
    if not (init_from / "config.json").is_file():
        raise UsageError(f"rl.init_from: no model at {init_from} (the engines start from it; run skyrl sft first)")
    inf = recipe.inference
    inf_machine = inference_machine(recipe, machine, trainer_device(recipe, machine))
    models = auxiliary_models(recipe)
    ports = machine.free_ports(inf.engines + 2 + sum(m.engines.engines for m in models))
    engine_ports, (router_port, prometheus_port) = ports[: inf.engines], ports[inf.engines : inf.engines + 2]
    auxiliary_ports = iter(ports[inf.engines + 2 :])
    router_port = inf.router.port or router_port
    setup, served = engine_model_setup(weight_sync, pool_dir, init_from, machine)
    engines = [
        detach(spec) for spec in engine_specs(recipe, inf_machine, engine_ports, str(served), async_mode, weight_sync)
    ]
    urls = [engine_url(inf_machine, p) for p in engine_ports]
    router = router_spec(recipe, inf_machine, urls, router_port, prometheus_port)
    auxiliary, auxiliary_urls = [], {}
    for index, model in enumerate(models):  # as plan_rl places them: the same cores or GPUs
        own = [next(auxiliary_ports) for _ in range(model.engines.engines)]
        specs = auxiliary_engine_specs(
            recipe, inf_machine, model, own, model.model, before=models[:index], async_mode=async_mode
        )
        auxiliary += [detach(spec) for spec in specs]
        auxiliary_urls[model.name] = tuple(engine_url(inf_machine, port) for port in own)
    keepers = warm_keeper_specs(recipe, pool_dir, machine) if warm else ()
    return LaunchPlan(
        stage=POOL_STAGE,
        run_dir=str(pool_dir),
        device=trainer_device(recipe, machine),
        async_mode=async_mode,
        engine_urls=tuple(urls),
        router_url=engine_url(inf_machine, router_port),
        auxiliary_urls=auxiliary_urls,
        processes=(*setup, *engines, *auxiliary, router, *keepers),
        weight_sync=weight_sync,
    )


def warm_keeper_specs(recipe: Recipe, pool_dir: Path, machine: MachineFacts) -> tuple[ProcessSpec, ProcessSpec]:
    """The keepers (``skyrl_cli.engines.keeper``) of the pool's warm learner and orchestrator
    (``backends.standby``). The learner's is the recipe's own torchrun command with the standby as
    its module, the orchestrator's the plain interpreter with the orchestrator's environment: each
    started as a run of this recipe would start it, so its runs fit (``skyrl_cli.engines.standby``)."""
    preload = ["--preload", "peft"] if recipe.model.lora is not None else []
    if recipe.quantization is not None and recipe.quantization.int4_qat:
        preload += ["--preload", "torchao"]
    learner = trainer_spec(
        recipe,
        pool_dir,
        machine,
        module=STANDBY_MODULE,
        resources=trainer_resources(recipe, machine),
        extra_args=("--kind", "learner", *preload),
        name=WARM_NAMES["trainer"],
    )
    orchestrator = ProcessSpec(
        name=WARM_NAMES["orchestrator"],
        role="orchestrator",
        argv=(machine.python, "-m", STANDBY_MODULE, "--kind", "orchestrator"),
        env=dict(ORCHESTRATOR_ENV),
    )
    return keeper_of(learner, pool_dir, machine), keeper_of(orchestrator, pool_dir, machine)


def keeper_of(standby: ProcessSpec, pool_dir: Path, machine: MachineFacts) -> ProcessSpec:
    """The keeper that runs ``standby``'s command, generation after generation, in ``pool_dir/<name>``."""
    argv = (
        machine.python,
        "-m",
        KEEPER_MODULE,
        "--dir",
        str(pool_dir / standby.name),
        "--pool",
        str(pool_dir),
        "--",
        *standby.argv,
    )
    return standby.model_copy(update={"argv": argv, "kind": "service", "ports": (), "start_with_engines": False})


def detach(spec: ProcessSpec) -> ProcessSpec:
    """An engine that outlives the command that starts it (no ``SKYRL_DIE_WITH_PARENT``)."""
    env = {k: v for k, v in spec.env.items() if k != "SKYRL_DIE_WITH_PARENT"}
    return spec.model_copy(update={"env": env})


def engine_signature(spec: ProcessSpec) -> dict[str, Any]:
    """An engine's flags and environment without what differs per launch (port, seed, model
    directory, core binding): two engines with equal signatures can serve the same runs."""
    argv = list(spec.argv)
    masked = []
    skip = False
    for i, word in enumerate(argv):
        if skip:
            masked.append("*")
            skip = False
        elif word in _PER_LAUNCH_FLAGS:
            masked.append(word)
            skip = True
        elif i > 0 and argv[i - 1] == SERVE_MODULE:
            masked.append("<model>")  # the positional model directory
        else:
            masked.append(word)
    env = {k: v for k, v in spec.env.items() if k not in _PER_LAUNCH_ENV}
    return {"argv": masked, "env": env}


def model_signature(model_dir: str | Path) -> dict[str, Any]:
    """The shape of a model as the engines hold it: its config.json without names, dtypes and the
    tied flag (engines serve a tied model untied)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {k: v for k, v in config.items() if k not in _MODEL_NOISE}


def first_difference(pool: dict[str, Any], run: dict[str, Any]) -> str | None:
    """``"--max-model-len: pool 512, this run 256"``: the first setting that differs, else None."""
    if pool.get("argv") is not None and run.get("argv") is not None:
        for flag, a, b in _flag_pairs(pool["argv"], run["argv"]):
            if a != b:
                return f"{flag}: pool {a}, this run {b}"
        keys = sorted(set(pool.get("env", {})) | set(run.get("env", {})))
        for key in keys:
            a, b = pool.get("env", {}).get(key), run.get("env", {}).get(key)
            if a != b:
                return f"{key}: pool {a}, this run {b}"
        return None
    for key in sorted(set(pool) | set(run)):
        if pool.get(key) != run.get(key):
            return f"{key}: pool {pool.get(key)}, this run {run.get(key)}"
    return None


def _flag_pairs(a: list[str], b: list[str]) -> list[tuple[str, str | None, str | None]]:
    """Per option name (``--dtype``), its value in ``a`` and in ``b`` (``"on"`` for a bare flag)."""

    def options(argv: list[str]) -> dict[str, str]:
        out, i = {}, 0
        while i < len(argv):
            if argv[i].startswith("--"):
                has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
                out[argv[i]] = argv[i + 1] if has_value else "on"
                i += 2 if has_value else 1
            else:
                i += 1
        return out

    left, right = options(a), options(b)
    return [(k, left.get(k), right.get(k)) for k in sorted(set(left) | set(right))]


def served_model(spec: ProcessSpec) -> str:
    """The model directory an engine serves (the positional argument after the serve module)."""
    argv = list(spec.argv)
    return argv[argv.index(SERVE_MODULE) + 1]


def auxiliary_difference(pool: dict[str, list[ProcessSpec]], run: dict[str, list[ProcessSpec]]) -> str | None:
    """The first difference between a pool's auxiliary models and a run's (each: model name -> its
    engines' specs): a model only one of them serves, fewer engines in the pool, another model
    directory, other engine settings; None when the pool serves the run's."""
    for name in sorted(set(pool) | set(run)):
        if name not in pool:
            return f"the run serves a {name} and the pool does not (skyrl engines up on a recipe with it starts one)"
        if name not in run:
            return f"the pool serves a {name} and the run does not"
        mine, theirs = pool[name], run[name]
        if len(mine) < len(theirs):
            return f"{name} engines: pool {len(mine)}, this run {len(theirs)}"
        a, b = served_model(mine[0]), served_model(theirs[0])
        if Path(a).resolve() != Path(b).resolve():
            return f"{name} model: pool {a}, this run {b}"
        difference = first_difference(engine_signature(mine[0]), engine_signature(theirs[0]))
        if difference:
            return f"{name} engines started with other settings ({difference})"
    return None

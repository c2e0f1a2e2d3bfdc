"""The Tinker server's plan: vLLM engines with runtime LoRA behind vllm-router, then the API server.

Engines are the RL stage's (``skyrl_cli.plan.inference``) with LoRA on: ``--max-lora-rank`` the
smallest vLLM rank holding ``tinker.max_lora_rank``, ``--max-loras`` = ``tinker.max_live_adapters``
(adapters in one engine batch). The API server (``python -m backends.tinker.server``) holds the
multi-LoRA trainer and reads ``<run dir>/server.json``, which this module writes the content of
(the recipe's API keys, as in ``recipe.resolved.json``, and the name of the variable with more).
"""

from __future__ import annotations

from pathlib import Path

from skyrl_cli.plan.inference import (
    Machine,
    all_engine_urls,
    engine_specs,
    engine_url,
    router_spec,
)
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.model import LaunchPlan, ProcessSpec, ReadinessCheck
from skyrl_contracts.engine_api import SERVED_MODEL_NAME
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import LoraConfig, Recipe

SERVER_NAME = "tinker-server"
SERVER_READY_TIMEOUT_S = 300.0


def base_model_name(recipe: Recipe) -> str:
    assert recipe.tinker is not None and recipe.model.path is not None
    return recipe.tinker.base_model or Path(recipe.model.path).name


def storage_dir(recipe: Recipe, run_dir: Path) -> Path:
    if recipe.tinker.storage_dir:
        return Path(recipe.tinker.storage_dir).resolve()
    return run_dir / "storage"


def engine_recipe(recipe: Recipe) -> Recipe:
    """The recipe as the engine planner sees it: LoRA on, at the server's maximum rank."""
    model = recipe.model.model_copy(update={"lora": LoraConfig(rank=recipe.tinker.max_lora_rank)})
    return recipe.model_copy(update={"model": model})


def with_max_loras(spec: ProcessSpec, count: int) -> ProcessSpec:
    argv = list(spec.argv)
    index = argv.index("--max-loras")
    argv[index + 1] = str(count)
    return spec.model_copy(update={"argv": tuple(argv)})


def server_config(recipe: Recipe, run_dir: Path, sample_url: str | None, engine_urls: list[str]) -> dict:
    t = recipe.tinker
    return {
        "base_model": base_model_name(recipe),
        "model_dir": str(Path(recipe.model.path).resolve()),
        "storage_dir": str(storage_dir(recipe, run_dir)),
        "host": t.host,
        "port": t.port,
        "api_keys": list(t.api_keys),
        "api_keys_env": t.api_keys_env,
        "max_lora_rank": t.max_lora_rank,
        "max_live_adapters": t.max_live_adapters,
        "max_request_bytes": t.max_request_bytes,
        "max_datums_per_request": t.max_datums_per_request,
        "max_sequence_tokens": t.max_sequence_tokens or recipe.inference.max_model_len or 512,
        "max_batch_tokens": t.max_batch_tokens,
        "long_poll_s": t.long_poll_s,
        "sample_url": sample_url,
        "engine_urls": engine_urls,
        "served_base_name": SERVED_MODEL_NAME,
    }


def plan_tinker(recipe: Recipe, run_dir: Path, machine: MachineFacts, engines: bool = True) -> tuple[LaunchPlan, dict]:
    """(plan, server config). ``engines=False``: no engines, sampling is refused (training only)."""
    if recipe.tinker is None:
        raise UsageError("the recipe has no [tinker] section")
    if recipe.model.path is None:
        raise UsageError("tinker serve needs model.path (a local HF model directory with its tokenizer)")
    inf = recipe.inference
    processes: list[ProcessSpec] = []
    urls: list[str] = []
    sample_url = None
    router_url = None
    if engines:
        erecipe = engine_recipe(recipe)
        inf_machine = Machine(
            "cpu" if not machine.gpus else "cuda",
            engine_cores=machine.cpu_cores,
            engine_gpus=machine.gpus,
            python=machine.python,
            host=machine.host,
            cpu_bf16=machine.cpu_bf16,
        )
        ports = machine.free_ports(inf.engines + 2)
        engine_ports, (router_port, prometheus_port) = ports[: inf.engines], ports[inf.engines :]
        router_port = inf.router.port or router_port  # the recipe's fixed port, else a free one
        specs = [
            with_max_loras(s, recipe.tinker.max_live_adapters)
            for s in engine_specs(erecipe, inf_machine, engine_ports, str(Path(recipe.model.path).resolve()))
        ]
        urls = all_engine_urls(erecipe, inf_machine, engine_ports)
        router = router_spec(erecipe, inf_machine, urls, router_port, prometheus_port)
        router_url = engine_url(inf_machine, router_port)
        processes += [*specs, router]
        sample_url = router_url
    config = server_config(recipe, run_dir, sample_url, urls)
    env = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not machine.gpus:
        # The trainer's threads: the cores the engines do not take (one each). More threads than
        # free cores made a pass 10-20x slower on a busy 2-core machine (OpenMP threads spin).
        local_engines = inf.engines if engines else 0
        env["OMP_NUM_THREADS"] = str(max(1, len(machine.cpu_cores) - local_engines))
    server = ProcessSpec(
        name=SERVER_NAME,
        role="server",
        argv=(machine.python, "-m", "backends.tinker.server", "--config", str(run_dir / "server.json")),
        env=env,
        ports=(recipe.tinker.port,),
        ready=ReadinessCheck(
            url=f"http://{recipe.tinker.host}:{recipe.tinker.port}/api/v1/healthz", timeout_s=SERVER_READY_TIMEOUT_S
        ),
        kind="job",
    )
    processes.append(server)
    plan = LaunchPlan(
        stage="tinker",
        run_dir=str(run_dir),
        device="cpu" if not machine.gpus else "cuda",
        engine_urls=tuple(urls),
        router_url=router_url,
        processes=tuple(processes),
    )
    return plan, config

"""How an RL run gets each policy version into the engines (``inference.weight_sync``), decided
once, when the plan is made, and recorded in it (``LaunchPlan.weight_sync``):

- ``"nccl"``: trainer rank 0 broadcasts the weights into every engine with vLLM's NCCL weight
  transfer (``backends.inference.nccl_sync``). Needs the trainer on CUDA, local CUDA engines
  (remote ones, ``inference.urls``, are not in the NCCL group), full weights on rank 0 (ZeRO 0-2:
  ZeRO-3 partitions them over the ranks) and a vLLM that has the weight-transfer engine.
- ``"disk"``: safetensors in ``weights/v<k>/`` and an engine reload (``backends.inference.weight_sync``):
  everywhere, and the fallback when the NCCL group cannot be set up at run time.
- ``"delta"``: files too, each version the lossless delta of its bits against the version before
  (``backends.inference.transports.delta``), applied and checked inside the engines; every
  ``inference.full_version_every``-th version whole. Needs the engines this tool starts (their worker
  extension), full weights (not LoRA) and no INT4 rollouts.
- ``"lora"``: with ``[model.lora]`` each version is an adapter loaded under its own name, whatever
  the key says (an adapter is a fraction of the weights; there is nothing to broadcast).
- ``"int4"``: with ``quantization.int4_rollouts`` each version is its W4A16 export, reloaded from
  disk like ``"disk"``.

``"auto"`` (the default) is "nccl" where all of its conditions hold, else "disk". An explicit
``"nccl"`` that cannot hold is a recipe error (``weight_sync_problems``), never a silent disk run.

This module only decides; what each transport means to the plan and the workers is its entry in
``skyrl_contracts.transports.TRANSPORTS``, read by the name chosen here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.trainer import trainer_device
from skyrl_cli.recipe.validate import Problem
from skyrl_contracts.schema import Recipe
from skyrl_contracts.transports import TransportName

KEY = ("inference", "weight_sync")
# The files of vLLM that the NCCL path uses: the trainer-side engine and the engines' HTTP routes.
VLLM_TRANSFER_FILES = ("distributed/weight_transfer/nccl_engine.py", "entrypoints/rl/online/api_router.py")


def vllm_weight_transfer_available() -> bool:
    """Whether the installed vLLM has the NCCL weight transfer and its routes, found without
    importing vLLM (it imports torch; the CLI stays light)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    root = Path(next(iter(spec.submodule_search_locations)))
    return all((root / f).is_file() for f in VLLM_TRANSFER_FILES)


def nccl_obstacles(recipe: Recipe, device: str, transfer_available: bool) -> list[str]:
    """Why the NCCL path cannot run for ``recipe`` with the trainer on ``device`` (none: it can)."""
    why = []
    if device != "cuda":
        why.append("the trainer runs on CPU; the NCCL weight sync needs CUDA")
    if recipe.model.lora is not None:
        why.append('LoRA RL syncs adapters, not weights; remove the key or set it to "auto"')
    if recipe.trainer.zero_stage == 3:
        why.append(
            "ZeRO-3 partitions the weights over the ranks, so rank 0 cannot send them; use trainer.zero_stage <= 2"
        )
    if recipe.inference.urls:
        why.append("remote engines (inference.urls) are not in the trainer's NCCL group")
    if recipe.quantization is not None and recipe.quantization.int4_rollouts:
        why.append("INT4 rollouts re-export every version as W4A16, which the engines reload from disk")
    if not transfer_available:
        why.append("the installed vLLM has no NCCL weight transfer (vllm.distributed.weight_transfer)")
    return why


def select_weight_sync(recipe: Recipe, device: str, transfer_available: bool) -> TransportName:
    """The run's one choice of transport: both the learner (``backends.train.publish``) and the
    orchestrator (``backends.rollout.orchestrator.engine_weights``) act on it, nothing else."""
    if recipe.model.lora is not None:
        return "lora"
    if recipe.quantization is not None and recipe.quantization.int4_rollouts:
        return "int4"
    if recipe.inference.weight_sync in ("disk", "delta"):
        return recipe.inference.weight_sync
    return "disk" if nccl_obstacles(recipe, device, transfer_available) else "nccl"


def delta_obstacles(recipe: Recipe) -> list[str]:
    """Why the delta weight sync cannot run for ``recipe`` (none: it can)."""
    why = []
    if recipe.model.lora is not None:
        why.append('LoRA RL syncs adapters, not weights; remove the key or set it to "auto"')
    if recipe.quantization is not None and recipe.quantization.int4_rollouts:
        why.append("INT4 rollouts reload a W4A16 export of every version; deltas of it are not written")
    if recipe.inference.urls:
        why.append("remote engines (inference.urls) do not run the worker extension that applies deltas")
    return why


def weight_sync_problems(
    recipe: Recipe, machine: MachineFacts, transfer_available: bool | None = None
) -> list[Problem]:
    """An explicit ``inference.weight_sync`` that cannot run here, and ``full_version_every`` where no
    delta is written (RL stage only)."""
    if recipe.rl is None:
        return []
    inference = recipe.inference
    # by value: a recipe re-validated from its resolved dump states every key
    default = type(inference).model_fields["full_version_every"].default
    if inference.full_version_every != default and inference.weight_sync in ("disk", "nccl"):
        why = 'applies to inference.weight_sync = "delta" only; remove this key'
        return [Problem(("inference", "full_version_every"), why)]
    if inference.weight_sync == "delta":
        why = delta_obstacles(recipe)
        return [Problem(KEY, f'"delta": {why[0]}')] if why else []
    if inference.weight_sync != "nccl":
        return []
    available = vllm_weight_transfer_available() if transfer_available is None else transfer_available
    why = nccl_obstacles(recipe, trainer_device(recipe, machine), available)
    return [Problem(KEY, f'"nccl": {why[0]}')] if why else []

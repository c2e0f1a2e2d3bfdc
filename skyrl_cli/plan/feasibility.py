"""Can this recipe start on this machine? The one home of the checks that ``skyrl sft`` and
``skyrl rl`` would otherwise only meet while planning or starting processes: the GPU and CPU layout,
batches that must split over the trainer ranks, and models or adapters vLLM cannot serve.

The loader runs ``feasibility_problems`` with the machine facts the planner uses
(``skyrl_cli.plan.machine.MachineFacts``; ``skyrl recipes validate --gpus N`` replaces the GPUs), and
with the device split the planner uses (``skyrl_cli.plan.trainer``), so ``recipes validate`` and
``--dry-run`` refuse the same recipes with the same ``file:line: key: message`` lines. The planner
only re-asserts them (``assert_feasible``) for recipes built in code; it is never the first to notice.
A whole recipe is checked, whichever stage runs: an RL stage that cannot start is reported before its
SFT stage trains.
"""

from __future__ import annotations

import os
from typing import Iterable

from skyrl_cli.errors import UsageError
from skyrl_cli.plan.inference import VLLM_HEAD_SIZES, VLLM_LORA_RANKS
from skyrl_cli.plan.machine import MachineFacts, detect_machine
from skyrl_cli.plan.trainer import trainer_device, world_size
from skyrl_cli.recipe.locator import dotted
from skyrl_cli.recipe.schema import Recipe
from skyrl_cli.recipe.validate import Problem


def load_feasible_recipe(
    path: str | os.PathLike,
    sets: Iterable[str] = (),
    gpu_count: int | None = None,
    machine: MachineFacts | None = None,
) -> Recipe:
    """``skyrl_cli.recipe.loader.load_recipe`` with the checks against ``machine`` (default: this
    host's facts, with GPUs 0..``gpu_count``-1 when ``gpu_count`` is given) in the same report."""
    from skyrl_cli.recipe.loader import load_recipe

    facts = machine if machine is not None else detect_machine(gpu_count)
    return load_recipe(path, sets, checks=[lambda recipe: feasibility_problems(recipe, facts)])


def feasibility_problems(recipe: Recipe, machine: MachineFacts) -> list[Problem]:
    """Every reason ``recipe`` cannot start on ``machine`` (lengths already resolved, see
    ``skyrl_cli.recipe.lengths``)."""
    problems = _core_problems(recipe, machine) + _device_problems(recipe, machine)
    return problems + _batch_problems(recipe) + _rl_problems(recipe) + _serving_problems(recipe)


def assert_feasible(recipe: Recipe, machine: MachineFacts) -> None:
    problems = feasibility_problems(recipe, machine)
    if problems:
        raise UsageError("\n".join(f"{dotted(p.path)}: {p.message}" for p in problems))


def _local_engines(recipe: Recipe) -> int:
    return recipe.inference.engines if recipe.rl is not None else 0


def _core_problems(recipe: Recipe, machine: MachineFacts) -> list[Problem]:
    if machine.cpu_cores:
        return []
    problems = [Problem(("trainer", "ranks"), "no CPU cores left for the trainer")]
    if _local_engines(recipe) and trainer_device(recipe, machine) == "cpu":
        problems.append(Problem(("inference", "engines"), "no CPU cores left for the inference engines"))
    return problems


def _device_problems(recipe: Recipe, machine: MachineFacts) -> list[Problem]:
    """GPUs: the trainer's ranks plus ``engines x tensor_parallel`` must fit the visible ones; on
    CPU (no GPU visible, or ``trainer.device = "cpu"``) the engines run on CPU too, one core each."""
    trainer, inference = recipe.trainer, recipe.inference
    gpu_count, engines = len(machine.gpus), _local_engines(recipe)
    if trainer_device(recipe, machine) == "cpu":
        if engines and inference.tensor_parallel > 1:
            why = "no GPU is visible" if not gpu_count else 'trainer.device = "cpu"'
            return [Problem(("inference", "tensor_parallel"), f"{inference.tensor_parallel} GPUs per engine, but the engines run on CPU ({why})")]
        return []
    if gpu_count == 0:
        return [Problem(("trainer", "device"), 'device = "cuda" but no GPU is visible')]
    problems = [
        Problem(("trainer", "gpus"), f"GPU {gpu} does not exist ({gpu_count} visible)")
        for gpu in trainer.gpus or ()
        if gpu not in machine.gpus
    ]
    engine_gpus = engines * inference.tensor_parallel
    needed = trainer.ranks + engine_gpus
    if needed > gpu_count:
        problems.append(
            Problem(
                ("trainer", "ranks"),
                f"the layout needs {needed} GPUs ({trainer.ranks} trainer ranks + {engine_gpus} for {engines} engines) "
                f"but {gpu_count} {'is' if gpu_count == 1 else 'are'} visible",
            )
        )
    return problems


def _batch_problems(recipe: Recipe) -> list[Problem]:
    """Global batches are split over every trainer rank, so each needs at least one sequence per rank."""
    sft, world = recipe.sft, world_size(recipe)
    if sft is not None and sft.batch_size < world:
        return [Problem(("sft", "batch_size"), f"{sft.batch_size} sequences cannot be split over {world} trainer ranks")]
    return []


def _rl_problems(recipe: Recipe) -> list[Problem]:
    rl, world = recipe.rl, world_size(recipe)
    if rl is None:
        return []
    problems = []
    sequences = rl.prompts_per_step * rl.samples_per_prompt
    if sequences < world:
        problems.append(Problem(("rl", "prompts_per_step"), f"{sequences} sequences per step cannot be split over {world} trainer ranks"))
    if rl.advantage.kind in ("grpo", "rloo") and rl.samples_per_prompt < 2:
        problems.append(Problem(("rl", "samples_per_prompt"), f"{rl.advantage.kind} needs at least 2 samples per prompt"))
    per_slice = rl.prompts_per_step // rl.mini_batches * rl.samples_per_prompt
    if rl.mini_batches > rl.prompts_per_step:
        why = f"{rl.mini_batches} mini-batches of whole groups need at least as many prompts per step ({rl.prompts_per_step})"
        problems.append(Problem(("rl", "mini_batches"), why))
    elif rl.mini_batches > 1 and per_slice < world:  # one mini-batch is the whole step: checked above
        problems.append(Problem(("rl", "mini_batches"), f"a mini-batch of {per_slice} sequences cannot be split over {world} trainer ranks"))
    max_model_len = recipe.inference.max_model_len
    if max_model_len is not None and rl.max_new_tokens >= max_model_len:
        why = f"{rl.max_new_tokens} leaves no room for the prompt in inference.max_model_len ({max_model_len})"
        problems.append(Problem(("rl", "max_new_tokens"), why))
    return problems


def _serving_problems(recipe: Recipe) -> list[Problem]:
    """What the RL stage's vLLM engines would refuse minutes into the run."""
    if recipe.rl is None:
        return []
    problems = []
    init, lora = recipe.model.init, recipe.model.lora
    if init is not None and init.hidden_size // init.heads not in VLLM_HEAD_SIZES:
        why = (
            f"head size hidden_size / heads = {init.hidden_size // init.heads} cannot be served by vLLM "
            f"(supported: {', '.join(map(str, VLLM_HEAD_SIZES))}); change hidden_size or heads"
        )
        problems.append(Problem(("model", "init", "heads"), why))
    if lora is not None and lora.rank > VLLM_LORA_RANKS[-1]:
        problems.append(Problem(("model", "lora", "rank"), f"{lora.rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}"))
    return problems

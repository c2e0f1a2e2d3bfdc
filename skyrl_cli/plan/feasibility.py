"""Can this recipe start on this machine? The one home of the checks that ``skyrl sft`` and
``skyrl rl`` would otherwise only meet while planning or starting processes: the GPU and CPU layout,
batches that must split over the trainer ranks, models or adapters vLLM cannot serve, and speculative
decoding where it is wrong or cannot start (``skyrl_cli.plan.speculative``).

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
from pathlib import Path
from typing import Iterable

from skyrl_cli.plan.inference import VLLM_HEAD_SIZES, VLLM_LORA_RANKS
from skyrl_cli.plan.machine import MachineFacts, detect_machine
from skyrl_cli.plan.nodes import cluster_layout
from skyrl_cli.plan.shape import LLAMA_LIKE, ModelShape, config_json, shape_at
from skyrl_cli.plan.speculative import speculative_problems
from skyrl_cli.plan.trainer import trainer_device, world_size
from skyrl_cli.plan.weight_sync import weight_sync_problems
from skyrl_cli.recipe.loader import load_recipe
from skyrl_cli.recipe.locator import dotted
from skyrl_cli.recipe.validate import Problem, resolve_path
from skyrl_contracts.auxiliary import TEACHER, auxiliary_models
from skyrl_contracts.errors import UsageError
from skyrl_contracts.losses import ADVANTAGE_KINDS
from skyrl_contracts.schema import FULL_PRECISION_LAYERS, Recipe


def load_feasible_recipe(
    path: str | os.PathLike,
    sets: Iterable[str] = (),
    gpu_count: int | None = None,
    machine: MachineFacts | None = None,
) -> Recipe:
    """``skyrl_cli.recipe.loader.load_recipe`` with the checks against ``machine`` (default: this
    host's facts, with GPUs 0..``gpu_count``-1 when ``gpu_count`` is given) in the same report."""
    facts = machine if machine is not None else detect_machine(gpu_count)
    base_dir = Path(path).resolve().parent
    return load_recipe(path, sets, checks=[lambda recipe: feasibility_problems(recipe, facts, base_dir)])


def feasibility_problems(recipe: Recipe, machine: MachineFacts, base_dir: Path | None = None) -> list[Problem]:
    """Every reason ``recipe`` cannot start on ``machine`` (lengths already resolved, see
    ``skyrl_cli.recipe.lengths``); relative model paths resolve against ``base_dir`` (default: the
    current directory)."""
    problems = _core_problems(recipe, machine) + _device_problems(recipe, machine)
    base_dir = base_dir or Path.cwd()
    problems += (
        _batch_problems(recipe) + _rl_problems(recipe) + _serving_problems(recipe) + lora_problems(recipe, base_dir)
    )
    problems += auxiliary_problems(recipe, machine, base_dir)
    problems += speculative_problems(recipe, machine, base_dir)
    return problems + quantization_problems(recipe, base_dir) + weight_sync_problems(recipe, machine)


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
            return [
                Problem(
                    ("inference", "tensor_parallel"),
                    f"{inference.tensor_parallel} GPUs per engine, but the engines run on CPU ({why})",
                )
            ]
        return []
    if gpu_count == 0:
        return [Problem(("trainer", "device"), 'device = "cuda" but no GPU is visible')]
    problems = [
        Problem(("trainer", "gpus"), f"GPU {gpu} does not exist ({gpu_count} visible)")
        for gpu in trainer.gpus or ()
        if gpu not in machine.gpus
    ]
    engine_gpus = engines * inference.tensor_parallel
    auxiliaries = auxiliary_models(recipe)
    needed = trainer.ranks + engine_gpus + sum(m.gpus for m in auxiliaries)

    layout = cluster_layout(recipe)
    if layout is not None and engines and not layout.overlap:
        # Across nodes with no node that both trains and serves: each node holds one of the two.
        visible = f"{gpu_count} {'is' if gpu_count == 1 else 'are'} visible"
        if trainer.ranks > gpu_count:
            problems.append(
                Problem(("trainer", "ranks"), f"a trainer node needs {trainer.ranks} GPUs (one per rank) but {visible}")
            )
        if engine_gpus > gpu_count:
            why = f"{engines} engines x tensor_parallel {inference.tensor_parallel}"
            problems.append(
                Problem(("inference", "engines"), f"an inference node needs {engine_gpus} GPUs ({why}) but {visible}")
            )
        return problems
    if needed > gpu_count:
        problems.append(
            Problem(
                ("trainer", "ranks"),
                f"the layout needs {needed} GPUs ({trainer.ranks} trainer ranks + {engine_gpus} for {engines} engines"
                + "".join(f" + {m.gpus} for the {m.name}'s engines" for m in auxiliaries)
                + f") but {gpu_count} {'is' if gpu_count == 1 else 'are'} visible",
            )
        )
    return problems


def auxiliary_problems(recipe: Recipe, machine: MachineFacts, base_dir: Path) -> list[Problem]:
    """What the engines of an auxiliary model (a teacher, a judge) would refuse: GPUs on a CPU run,
    a head size vLLM cannot serve, and for a teacher fewer positions than a trajectory holds
    (``inference.max_model_len``: it scores whole trajectories)."""
    problems = []
    for model in auxiliary_models(recipe):
        tp = model.engines.tensor_parallel
        if trainer_device(recipe, machine) == "cpu" and tp > 1:
            why = f"{tp} GPUs per {model.name} engine, but the engines run on CPU"
            problems.append(Problem((*model.key, "tensor_parallel"), why))
        shape = shape_at(model.model, recipe, base_dir)
        config = config_json(resolve_path(model.model, base_dir)) or {}
        positions, length = config.get("max_position_embeddings"), recipe.inference.max_model_len
        if model.name == TEACHER and isinstance(positions, int) and length is not None and positions < length:
            why = (
                f"the teacher has {positions} positions, fewer than a trajectory may hold (inference.max_model_len = "
                f"{length}); lower inference.max_model_len to {positions}"
            )
            problems.append(Problem(model.model_key, why))
        if shape is not None and shape.head_dim not in VLLM_HEAD_SIZES:
            sizes = ", ".join(map(str, VLLM_HEAD_SIZES))
            why = f"the {model.name}'s head size {shape.head_dim} cannot be served by vLLM (supported: {sizes})"
            problems.append(Problem(model.model_key, why))
    return problems


def _batch_problems(recipe: Recipe) -> list[Problem]:
    """Global batches are split over every trainer rank, so each needs at least one sequence per rank."""
    sft, world = recipe.sft, world_size(recipe)
    if sft is not None and sft.batch_size < world:
        return [
            Problem(("sft", "batch_size"), f"{sft.batch_size} sequences cannot be split over {world} trainer ranks")
        ]
    return []


def _rl_problems(recipe: Recipe) -> list[Problem]:
    rl, world = recipe.rl, world_size(recipe)
    if rl is None:
        return []
    problems = []
    sequences = rl.prompts_per_step * rl.samples_per_prompt
    if sequences < world:
        problems.append(
            Problem(
                ("rl", "prompts_per_step"), f"{sequences} sequences per step cannot be split over {world} trainer ranks"
            )
        )
    if ADVANTAGE_KINDS[rl.advantage.kind].group_baseline and rl.samples_per_prompt < 2:
        problems.append(
            Problem(("rl", "samples_per_prompt"), f"{rl.advantage.kind} needs at least 2 samples per prompt")
        )
    per_slice = rl.prompts_per_step // rl.mini_batches * rl.samples_per_prompt
    if rl.mini_batches > rl.prompts_per_step:
        why = f"{rl.mini_batches} mini-batches of whole groups need at least as many prompts per step ({rl.prompts_per_step})"
        problems.append(Problem(("rl", "mini_batches"), why))
    elif rl.mini_batches > 1 and per_slice < world:  # one mini-batch is the whole step: checked above
        problems.append(
            Problem(
                ("rl", "mini_batches"),
                f"a mini-batch of {per_slice} sequences cannot be split over {world} trainer ranks",
            )
        )
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
        problems.append(
            Problem(("model", "lora", "rank"), f"{lora.rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
        )
    return problems


# ------------------------------------------------------------------------------------------ LoRA

# The Linear layers of a Llama-like decoder that vLLM serves LoRA adapters on (its LoRA layers wrap
# the attention and MLP projections; embeddings and lm_head take none).
VLLM_LORA_LLAMA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _model_type(recipe: Recipe, base_dir: Path) -> str | None:
    """The architecture of the recipe's model (``config.json``'s model_type); None when unknown."""
    if recipe.model.init is not None:
        return recipe.model.init.arch
    model_type = (config_json(resolve_path(recipe.model.path, base_dir)) or {}).get("model_type")
    return model_type if isinstance(model_type, str) else None  # a hand-edited config may hold anything


def lora_problems(recipe: Recipe, base_dir: Path) -> list[Problem]:
    """LoRA settings the trainer (ZeRO-3) or, in the RL stage, vLLM's engines cannot run."""
    lora = recipe.model.lora
    if lora is None or (recipe.sft is None and recipe.rl is None):
        return []
    problems = []
    if recipe.trainer.zero_stage == 3:
        problems.append(
            Problem(
                ("trainer", "zero_stage"),
                "3: LoRA trains with ZeRO stages 0-2 (peft's frozen base "
                "weights under ZeRO-3 are not supported); use 0, 1 or 2",
            )
        )
    if recipe.rl is not None and _model_type(recipe, base_dir) in LLAMA_LIKE:
        unserved = [t for t in lora.target_modules if t.split(".")[-1] not in VLLM_LORA_LLAMA_MODULES]
        if unserved:
            why = (
                f"{', '.join(unserved)}: vLLM serves LoRA adapters only on {', '.join(VLLM_LORA_LLAMA_MODULES)} "
                "of this architecture; remove the others"
            )
            problems.append(Problem(("model", "lora", "target_modules"), why))
    return problems


# ------------------------------------------------------------------------------------ quantization


def llama_linear_inputs(shape: ModelShape) -> dict[str, int]:
    """Input width of every decoder Linear layer of a Llama-like model, by module name."""
    widths = {name: n_in for name, (n_in, _) in shape.linear_layers().items()}
    return {f"model.layers.{i}.{name}": width for i in range(shape.layers) for name, width in widths.items()}


def _target_problems(recipe: Recipe, base_dir: Path) -> list[Problem]:
    quant = recipe.quantization
    kept = [t for t in quant.targets if t.split(".")[-1] in FULL_PRECISION_LAYERS]
    if kept:
        return [
            Problem(
                ("quantization", "targets"),
                f"{', '.join(kept)} stays in full precision (the W4A16 export "
                "quantizes the decoder's Linear layers); remove it",
            )
        ]
    # what skyrl quantize starts from: quantization.init_from, "sft" being the recipe's own model
    shape = shape_at(quant.init_from, recipe, base_dir)
    if shape is None:  # an architecture we do not know: the quantizer checks it at its start
        return []
    chosen = {name: width for name, width in llama_linear_inputs(shape).items() if quant.selects(name)}
    if not chosen:
        return [
            Problem(
                ("quantization", "targets"),
                f"{list(quant.targets)} select no Linear layer of the model "
                "(its layers: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)",
            )
        ]
    bad: dict[int, list[str]] = {}
    for name, width in chosen.items():
        layer = name.rsplit(".", 1)[-1]
        if not quant.divides(width) and layer not in bad.setdefault(width, []):
            bad[width].append(layer)
    return [
        Problem(
            ("quantization", "group_size"),
            f"{quant.group_size} does not divide the input width {width} of {', '.join(layers)}",
        )
        for width, layers in sorted(bad.items())
        if layers
    ]


def quantization_problems(recipe: Recipe, base_dir: Path) -> list[Problem]:
    """What INT4 quantization (a ``[quantization]`` section) cannot do with this recipe."""
    quant = recipe.quantization
    if quant is None:
        return []
    problems = []
    # A section that only configures `skyrl quantize` (which quantizes a full checkpoint, the SFT
    # output) does not act in a LoRA run; int4_qat and int4_rollouts would, on all weights.
    if recipe.model.lora is not None and (quant.int4_qat or quant.int4_rollouts):
        on = "int4_qat" if quant.int4_qat else "int4_rollouts"
        problems.append(
            Problem(
                ("model", "lora"),
                f"quantization.{on} trains or serves all weights under INT4, not LoRA adapters; "
                f"remove model.lora or set quantization.{on} = false",
            )
        )
    # with [rl] the section also acts there (int4_qat, int4_rollouts); init_from is skyrl quantize's,
    # which says itself when there is no model to quantize
    if quant.init_from == "sft" and recipe.sft is None and recipe.rl is None:
        why = '"sft" is this recipe\'s SFT output, but the recipe has no [sft] section; give a checkpoint directory'
        problems.append(Problem(("quantization", "init_from"), why))
    if quant.int4_rollouts and recipe.rl is None:
        problems.append(
            Problem(
                ("quantization", "int4_rollouts"),
                "INT4 rollouts act in the RL stage and the recipe has no [rl] section",
            )
        )
    return problems + _target_problems(recipe, base_dir)

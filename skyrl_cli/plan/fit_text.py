"""The estimates as people read them: the block ``skyrl recipes validate --gpu-memory``,
``--dry-run`` and ``skyrl doctor`` print (``skyrl_cli.plan.fit`` computes it)."""

from __future__ import annotations

from pathlib import Path

from skyrl_cli.plan.fit import Estimate, Hardware, estimate, memory_problems, proposals
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.memory import GIB
from skyrl_cli.plan.roofline import GPU_TYPES, gpu_type_named
from skyrl_cli.plan.shape import ModelShape, trained_shape
from skyrl_cli.plan.trainer import trainer_device
from skyrl_cli.recipe.validate import Problem
from skyrl_contracts.schema import Recipe


def _gib(value: int) -> str:
    return f"{value / GIB:.1f}"


def hardware_line(hardware: Hardware) -> str:
    if hardware.device != "cuda":
        return "on CPU (memory in RAM; no roofline)"
    size = f"{hardware.gib:g} GiB" if hardware.gib is not None else "unknown memory"
    where = f"on {hardware.gpus} GPU{'s' if hardware.gpus != 1 else ''} of {size}"
    gpu = hardware.gpu
    if gpu is None:
        return where + " (no roofline: GPU type unknown)"
    rates = f"{gpu.bf16_flops / 1e12:g} TFLOP/s bf16, {gpu.memory_bytes_per_s / 1e12:g} TB/s, {gpu.link} {gpu.link_bytes_per_s / 1e9:g} GB/s"
    return f"{where} (roofline: {gpu.name}, {rates})"


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.2f} B" if parameters >= 1e8 else f"{parameters / 1e6:.2f} M"


def shape_line(shape: ModelShape) -> str:
    return (
        f"model: {shape.model_type}, {_count(shape.parameters())} parameters ({shape.layers} layers, "
        f"hidden {shape.hidden}, {shape.kv_heads} KV heads of {shape.head_dim})"
    )


def _verdict(need: int, hardware: Hardware) -> str:
    if hardware.gpu_bytes is None or hardware.device != "cuda":
        return ""
    return f" of {hardware.gib:g}: fits" if need <= hardware.gpu_bytes else f" of {hardware.gib:g}: DOES NOT FIT"


def trainer_lines(est: Estimate, hardware: Hardware) -> list[str]:
    lines = []
    for fit in est.trainers:
        setup, memory = fit.setup, fit.memory
        head = (
            f"{fit.stage} trainer rank ({setup.ranks} rank{'s' if setup.ranks > 1 else ''}, ZeRO-{setup.zero_stage}, "
            f"micro-batch {setup.micro_batch_tokens} tokens): {_gib(memory.peak)} GiB{_verdict(memory.peak, hardware)}"
        )
        parts = " + ".join(f"{name} {_gib(value)}" for name, value in memory.parts())
        lines += [head, f"  at {memory.peak_phase}: {parts}"]
        if not setup.gradient_checkpointing:
            lines.append(
                f"  activations with trainer.gradient_checkpointing = true: {_gib(memory.activations_checkpointed)}"
            )
    return lines


def engine_lines(est: Estimate, hardware: Hardware) -> list[str]:
    """A line for the policy's engines, then one for each auxiliary model's (a teacher, a judge)."""
    lines = []
    if est.engine is not None:
        layout = est.layout
        asks = f" (the recipe runs up to {est.engine_asks} on an engine)"
        lines.append(_engine_line("", layout.engines, layout.tensor_parallel, est.engine, hardware) + asks)
    for aux in est.auxiliaries:
        engines = aux.model.engines
        lines.append(_engine_line(f"{aux.model.name} ", engines.engines, engines.tensor_parallel, aux.memory, hardware))
    return lines


def _engine_line(kind: str, engines: int, tensor_parallel: int, engine, hardware: Hardware) -> str:
    plural = "s" if engines > 1 else ""
    where = f"{engines} {kind}engine{plural} x tensor parallel {tensor_parallel}"
    if hardware.device != "cuda":
        where = f"{engines} {kind}engine{plural} on CPU"
    return (
        f"{where}: weights {_gib(engine.weights)} GiB{' a GPU' if hardware.device == 'cuda' else ''}, KV cache {_gib(engine.kv_cache)} GiB = "
        f"{engine.tokens:,} tokens = {engine.trajectories:,} trajectories of {engine.trajectory_tokens} tokens at once"
    )


def step_lines(est: Estimate) -> list[str]:
    lines = []
    if est.sft_step_s is not None:
        lines.append(f"sft step (roofline): {est.sft_step_s:.1f} s")
    step = est.step
    if step is not None:
        lines.append(
            f"rl step (roofline, every response at max_new_tokens): generation {step.generation_s:.1f} s + "
            f"training {step.training_s:.1f} s + weight sync ({est.transport}) {step.sync_s:.2f} s = "
            f"{step.sync_mode_s:.1f} s; with --async {step.async_s:.1f} s"
        )
    return lines


def estimate_block(title: str, shape: ModelShape, est: Estimate, hardware: Hardware) -> list[str]:
    """The recipe's processes: one line a process, its parts under it, then the step time."""
    body = [shape_line(shape), *trainer_lines(est, hardware), *engine_lines(est, hardware), *step_lines(est)]
    return [f"{title} {hardware_line(hardware)}", *(f"  {line}" for line in body)]


def _split(est: Estimate) -> list[str]:
    layout, rank = est.layout, est.largest_rank
    engines = f"{layout.engines} x {layout.tensor_parallel}" if layout.engines else "-"
    micro = " / ".join(str(tokens) for tokens in (layout.sft_micro_batch, layout.rl_micro_batch) if tokens is not None)
    trajectories = f"{est.engine.trajectories:,}" if est.engine is not None else "-"
    step = f"{est.ranking_s:.1f}"
    overlapped = f"{est.step.async_s:.1f}" if est.step is not None else "-"
    return [
        str(layout.trainer_gpus),
        engines,
        str(layout.zero_stage),
        micro,
        "yes" if layout.gradient_checkpointing else "-",
        _gib(rank.memory.peak),
        trajectories,
        step,
        overlapped,
    ]


SPLIT_COLUMNS = (
    "trainer GPUs",
    "engines x TP",
    "ZeRO",
    "micro-batch",
    "checkpointing",
    "rank GiB",
    "engine traj",
    "step s",
    "async s",
)


def proposal_block(proposals: list[Estimate], hardware: Hardware, stages: list[str], rl_on_engines: bool) -> list[str]:
    """The splits that fit as a table, fastest first."""
    where = f"{hardware.gpus} GPU{'s' if hardware.gpus != 1 else ''} of {hardware.gib:g} GiB"
    if not proposals:
        why = (
            " (the RL stage needs a GPU for the trainer and one for an engine)"
            if rl_on_engines and hardware.gpus < 2
            else ""
        )
        return [f"splits of {where}: none fits{why}"]
    micro = " / ".join(stages)
    columns = [c if c != "micro-batch" else f"{micro} micro-batch" for c in SPLIT_COLUMNS]
    rows = [columns, *(_split(p) for p in proposals)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    table = ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return [f"splits of {where} that fit, fastest first:", *table]


def recipe_estimates(
    recipe: Recipe, hardware: Hardware, machine: MachineFacts, base_dir: Path, propose: bool
) -> tuple[list[str], list[Problem]]:
    """The estimate block of ``recipe`` as written (and, with ``propose``, the splits of
    ``hardware`` that fit), and what of it does not fit ``hardware``."""
    shape = trained_shape(recipe, base_dir)
    if shape is None:
        why = "no config.json of a Llama-family model (llama, mistral, qwen2, qwen3) to read it from"
        return [f"estimates: none, the model's shape is unknown ({why})"], []
    est = estimate(recipe, shape, hardware)
    lines = estimate_block(f"estimates for {recipe.name}", shape, est, hardware)
    if propose:
        stages = [stage for stage in ("sft", "rl") if getattr(recipe, stage) is not None]
        splits = proposals(recipe, shape, hardware, machine, base_dir)
        lines += proposal_block(splits, hardware, stages, est.layout.engines > 0)
    return lines, memory_problems(recipe, est, hardware)


def hardware_here(recipe: Recipe, machine: MachineFacts, listed: list[tuple[int, str, float, float]]) -> Hardware:
    """This host as the estimates see it: the trainer's device, and on GPUs the smallest memory
    and the type of the visible ones (``listed``: ``skyrl_cli.plan.machine.gpu_memory()``)."""
    if trainer_device(recipe, machine) != "cuda":
        return Hardware(0, None, None, "cpu")
    visible = [gpu for gpu in listed if gpu[0] in machine.gpus]
    if not visible:
        return Hardware(len(machine.gpus), None, None)
    kind = gpu_type_named(visible[0][1])
    total = min(gpu[2] for gpu in visible)
    return Hardware(len(machine.gpus), int(total * GIB), GPU_TYPES[kind] if kind else None)

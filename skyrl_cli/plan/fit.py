"""Will the recipe fit a machine of N GPUs of M GiB, and which splits of it would: the recipe's
settings fed to the memory estimates (``skyrl_cli.plan.memory``) and the roofline
(``skyrl_cli.plan.roofline``).

``estimate`` sizes every process of the recipe as written (or of a ``Layout`` of it);
``memory_problems`` says what does not fit, as recipe problems naming the key to change;
``proposals`` tries the splits of one node (trainer GPUs, engines x tensor parallel, ZeRO stage,
the largest micro-batch under the recipe's that fits) and ranks those that fit by the roofline's
step time. ``skyrl recipes validate --gpu-memory``, ``--dry-run`` and ``skyrl doctor`` print them
(``skyrl_cli.plan.fit_text``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from skyrl_cli.plan.feasibility import feasibility_problems
from skyrl_cli.plan.inference import Machine, auxiliary_model_len, engine_dtype
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.memory import (
    GIB,
    EngineMemory,
    RankMemory,
    TrainerSetup,
    engine_memory,
    engine_weight_bytes,
    kv_bytes_per_token,
    lora_parameters,
    trainer_rank_memory,
)
from skyrl_cli.plan.roofline import (
    Generation,
    GpuType,
    StepTime,
    Training,
    generation_seconds,
    sync_seconds,
    training_seconds,
)
from skyrl_cli.plan.shape import ModelShape, shape_at
from skyrl_cli.plan.trainer import world_size
from skyrl_cli.plan.weight_sync import select_weight_sync
from skyrl_cli.recipe.validate import Problem
from skyrl_contracts.auxiliary import TEACHER, AuxiliaryModel, auxiliary_models
from skyrl_contracts.episodes import turn_limit
from skyrl_contracts.schema import Recipe

MAX_TENSOR_PARALLEL = 8  # one node's GPUs


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpu_bytes: int | None  # None: unknown, figures without a verdict
    gpu: GpuType | None  # None: no roofline
    device: str = "cuda"

    @property
    def gib(self) -> float | None:
        return None if self.gpu_bytes is None else self.gpu_bytes / GIB


@dataclass(frozen=True)
class Layout:
    """The settings a split changes: ``trainer.ranks``, ``inference.engines`` and
    ``inference.tensor_parallel``, ``trainer.zero_stage``, each stage's ``max_tokens_per_microbatch``,
    ``trainer.gradient_checkpointing``."""

    trainer_gpus: int
    engines: int
    tensor_parallel: int
    zero_stage: int
    sft_micro_batch: int | None
    rl_micro_batch: int | None
    gradient_checkpointing: bool = False

    @classmethod
    def of(cls, recipe: Recipe) -> Layout:
        sft, rl = recipe.sft, recipe.rl
        return cls(
            trainer_gpus=recipe.trainer.ranks,
            engines=recipe.inference.engines if rl is not None else 0,
            tensor_parallel=recipe.inference.tensor_parallel,
            zero_stage=recipe.trainer.zero_stage,
            sft_micro_batch=sft.max_tokens_per_microbatch if sft is not None else None,
            rl_micro_batch=rl.max_tokens_per_microbatch if rl is not None else None,
            gradient_checkpointing=recipe.trainer.gradient_checkpointing,
        )

    def applied(self, recipe: Recipe) -> Recipe:
        """``recipe`` with this layout's settings."""
        trainer = recipe.trainer.model_copy(
            update={
                "ranks": self.trainer_gpus,
                "zero_stage": self.zero_stage,
                "gradient_checkpointing": self.gradient_checkpointing,
            }
        )
        update: dict = {"trainer": trainer}
        if recipe.rl is not None:
            update["rl"] = recipe.rl.model_copy(update={"max_tokens_per_microbatch": self.rl_micro_batch})
            update["inference"] = recipe.inference.model_copy(
                update={"engines": self.engines, "tensor_parallel": self.tensor_parallel}
            )
        if recipe.sft is not None:
            update["sft"] = recipe.sft.model_copy(update={"max_tokens_per_microbatch": self.sft_micro_batch})
        return recipe.model_copy(update=update)


@dataclass(frozen=True)
class TrainerFit:
    stage: str  # "sft" or "rl"
    setup: TrainerSetup
    memory: RankMemory


@dataclass(frozen=True)
class AuxiliaryFit:
    """One GPU of an auxiliary model's engine (a teacher, a judge: ``skyrl_contracts.auxiliary``)."""

    model: AuxiliaryModel
    memory: EngineMemory


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    trainers: tuple[TrainerFit, ...]
    engine: EngineMemory | None
    engine_asks: int  # trajectories the recipe lets one engine run at once
    transport: str | None
    step: StepTime | None  # the RL stage's
    sft_step_s: float | None
    auxiliaries: tuple[AuxiliaryFit, ...] = ()  # those whose model's shape is on disk

    def trainer(self, stage: str) -> TrainerFit | None:
        return next((t for t in self.trainers if t.stage == stage), None)

    @property
    def largest_rank(self) -> TrainerFit:
        return max(self.trainers, key=lambda t: t.memory.peak)

    @property
    def ranking_s(self) -> float:
        """What proposals are ranked by: the RL step (sync mode), else the SFT step."""
        if self.step is not None:
            return self.step.sync_mode_s
        return self.sft_step_s or 0.0


# ------------------------------------------------------------------------------------ the settings


def weight_bytes(recipe: Recipe, hardware: Hardware) -> int:
    """Bytes a trained weight takes: bf16 on GPUs unless model.dtype says float32; fp32 on CPU."""
    if recipe.model.dtype == "auto":
        return 2 if hardware.device == "cuda" else 4
    return 2 if recipe.model.dtype == "bfloat16" else 4


def engine_bytes(recipe: Recipe, hardware: Hardware) -> int:
    dtype = engine_dtype(recipe, Machine(device=hardware.device))
    return 2 if dtype == "bfloat16" else 4


def longest_sequence(recipe: Recipe, stage: str) -> int:
    return recipe.data.max_length if stage == "sft" else recipe.inference.max_model_len


def micro_batch_tokens(recipe: Recipe, stage: str) -> int:
    """The largest micro-batch in tokens, padding included: the token budget, or one sequence when
    it is longer; SFT's fixed micro-batches hold ``micro_batch_size`` sequences."""
    longest = longest_sequence(recipe, stage)
    if stage == "sft" and recipe.sft.micro_batching == "fixed":
        return recipe.sft.micro_batch_size * longest
    budget = recipe.sft.max_tokens_per_microbatch if stage == "sft" else recipe.rl.max_tokens_per_microbatch
    return max(budget, longest)


def trainer_setup(recipe: Recipe, stage: str, hardware: Hardware) -> TrainerSetup:
    lora, quant = recipe.model.lora, recipe.quantization
    reference = stage == "rl" and recipe.rl.kl.coef > 0 and lora is None
    return TrainerSetup(
        ranks=world_size(recipe),
        zero_stage=recipe.trainer.zero_stage,
        micro_batch_tokens=micro_batch_tokens(recipe, stage),
        weight_bytes=weight_bytes(recipe, hardware),
        lora_rank=lora.rank if lora is not None else None,
        lora_targets=tuple(lora.target_modules) if lora is not None else (),
        int4_qat=quant is not None and quant.int4_qat,
        reference_copy=reference,
        gradient_checkpointing=recipe.trainer.gradient_checkpointing,
        device="cuda" if hardware.device == "cuda" else "cpu",
        data_examples=data_examples(recipe, stage),
    )


def data_examples(recipe: Recipe, stage: str) -> int:
    """Examples an SFT rank holds: a built-in task's train split (a file's rows are not read here:
    0). The RL learner holds only the batches the orchestrator sends."""
    generated = recipe.data.task is not None and recipe.data.train is None
    return recipe.data.train_size if stage == "sft" and generated else 0


def _int4_group(recipe: Recipe, shape: ModelShape) -> int | None:
    quant = recipe.quantization
    if quant is None or not quant.int4_rollouts:
        return None
    return shape.hidden if quant.group_size == "channel" else quant.group_size


def response_tokens(recipe: Recipe) -> int:
    """Tokens a trajectory generates at most: every turn's ``max_new_tokens``, within max_model_len."""
    turns = turn_limit(recipe) or 1
    return min(turns * recipe.rl.max_new_tokens, recipe.inference.max_model_len - 1)


# -------------------------------------------------------------------------------------- estimates


def _engine(recipe: Recipe, shape: ModelShape, hardware: Hardware) -> EngineMemory | None:
    inference = recipe.inference
    if recipe.rl is None or not inference.engines:
        return None
    dtype, group = engine_bytes(recipe, hardware), _int4_group(recipe, shape)
    if hardware.device == "cpu":  # a fixed KV cache (inference.kv_cache_bytes), no share of a GPU
        weights = engine_weight_bytes(shape, dtype, group)
        kv = kv_bytes_per_token(shape, dtype)
        return EngineMemory(weights + inference.kv_cache_bytes, weights, 0, kv, inference.max_model_len)
    if hardware.gpu_bytes is None:
        return None
    return engine_memory(
        shape,
        hardware.gpu_bytes,
        inference.gpu_memory_utilization,
        inference.tensor_parallel,
        inference.max_model_len,
        dtype,
        group,
    )


def _auxiliary(recipe: Recipe, model: AuxiliaryModel, hardware: Hardware) -> AuxiliaryFit | None:
    """An auxiliary model's engine as the plan starts it (``auxiliary_engine_specs``): its dtype,
    its length; None when its shape is unknown (not on disk yet) or the GPU's memory is."""
    shape = shape_at(model.model, recipe, Path.cwd())  # the loader made the path absolute
    if shape is None:
        return None
    stated = model.engines.dtype
    dtype = engine_bytes(recipe, hardware) if stated == "auto" else (4 if stated == "float32" else 2)
    length = auxiliary_model_len(recipe, model, model.model)
    if hardware.device == "cpu":
        weights = engine_weight_bytes(shape, dtype)
        kv_cache = recipe.inference.kv_cache_bytes
        return AuxiliaryFit(
            model, EngineMemory(weights + kv_cache, weights, 0, kv_bytes_per_token(shape, dtype), length)
        )
    if hardware.gpu_bytes is None:
        return None
    util, tp = recipe.inference.gpu_memory_utilization, model.engines.tensor_parallel
    return AuxiliaryFit(model, engine_memory(shape, hardware.gpu_bytes, util, tp, length, dtype))


def _engine_asks(recipe: Recipe) -> int:
    inference, rl = recipe.inference, recipe.rl
    trajectories = rl.prompts_per_step * rl.samples_per_prompt
    per_engine = math.ceil(min(inference.max_concurrency, trajectories) / max(1, inference.engines))
    return min(inference.max_num_seqs, per_engine)


def version_bytes(recipe: Recipe, shape: ModelShape, transport: str, hardware: Hardware) -> int:
    """Bytes one policy version moves to the engines."""
    if transport == "lora":
        lora = recipe.model.lora
        return weight_bytes(recipe, hardware) * lora_parameters(shape, lora.rank, tuple(lora.target_modules))
    return engine_weight_bytes(shape, engine_bytes(recipe, hardware), _int4_group(recipe, shape))


@dataclass(frozen=True)
class RlStepWork:
    """One RL step's work for the roofline: the generation, the training, the weight sync."""

    generation: Generation
    training: Training
    transport: str
    version_bytes: int


def rl_step_work(
    recipe: Recipe,
    shape: ModelShape,
    hardware: Hardware,
    engine: EngineMemory,
    asks: int,
    *,
    lengths: tuple[int, int] | None = None,
    transport: str | None = None,
) -> RlStepWork:
    """``lengths``: a trajectory's (prompt, response) tokens, by default the worst case the recipe
    allows (every response ``max_new_tokens`` a turn, every trajectory ``max_model_len``);
    ``transport``: by default the one a GPU run selects."""
    rl, inference = recipe.rl, recipe.inference
    trajectories = rl.prompts_per_step * rl.samples_per_prompt
    if lengths is None:
        response = response_tokens(recipe)
        lengths = (inference.max_model_len - response, response)
    generation = Generation(
        trajectories=trajectories,
        prompt_tokens=lengths[0],
        response_tokens=lengths[1],
        engines=inference.engines,
        tensor_parallel=inference.tensor_parallel,
        concurrency=max(1, min(asks, engine.trajectories)),
        weight_bytes=engine.weights,
        kv_bytes_per_token=engine.kv_per_token,
        parameters=shape.parameters(),
    )
    setup = trainer_setup(recipe, "rl", hardware)
    updates = rl.mini_batches * rl.epochs
    tokens = trajectories * sum(lengths)
    extra = (1 if rl.kl.coef > 0 else 0) + (1 if rl.loss.ratio == "proximal" and updates > 1 else 0)
    training = _training(recipe, shape, setup, tokens, updates=updates, passes=rl.epochs, extra_forwards=extra)
    transport = transport or select_weight_sync(recipe, "cuda", transfer_available=True)
    return RlStepWork(generation, training, transport, version_bytes(recipe, shape, transport, hardware))


def _rl_step(recipe: Recipe, shape: ModelShape, hardware: Hardware, engine: EngineMemory, asks: int) -> StepTime:
    work, gpu = rl_step_work(recipe, shape, hardware, engine, asks), hardware.gpu
    return StepTime(
        generation_seconds(work.generation, gpu),
        training_seconds(work.training, gpu),
        sync_seconds(work.transport, work.version_bytes, gpu),
    )


def _training(
    recipe: Recipe,
    shape: ModelShape,
    setup: TrainerSetup,
    tokens: int,
    *,
    updates: int,
    passes: int,
    extra_forwards: int,
) -> Training:
    """A stage's step for the roofline: ``tokens`` trained ``passes`` times in ``updates`` optimizer
    steps; gradient checkpointing runs each trained pass's forward once more, in the backward."""
    if setup.gradient_checkpointing:
        extra_forwards += passes
    return Training(
        tokens=tokens,
        parameters=shape.parameters(),
        trained=_trained(shape, setup),
        gpus=world_size(recipe),
        zero_stage=setup.zero_stage,
        weight_bytes=setup.weight_bytes,
        updates=updates,
        micro_batches=math.ceil(tokens * passes / world_size(recipe) / setup.micro_batch_tokens),
        extra_forwards=extra_forwards,
        lora=recipe.model.lora is not None,
        passes=passes,
    )


def _trained(shape: ModelShape, setup: TrainerSetup) -> int:
    if setup.lora_rank is None:
        return shape.parameters()
    return lora_parameters(shape, setup.lora_rank, setup.lora_targets)


def _sft_step(recipe: Recipe, shape: ModelShape, hardware: Hardware) -> float:
    setup = trainer_setup(recipe, "sft", hardware)
    tokens = recipe.sft.batch_size * recipe.data.max_length
    training = _training(recipe, shape, setup, tokens, updates=1, passes=1, extra_forwards=0)
    return training_seconds(training, hardware.gpu)


def estimate(recipe: Recipe, shape: ModelShape, hardware: Hardware) -> Estimate:
    """Every process of ``recipe`` as written on ``hardware``."""
    stages = [stage for stage in ("sft", "rl") if getattr(recipe, stage) is not None]
    trainers = []
    for stage in stages:
        setup = trainer_setup(recipe, stage, hardware)
        memory = trainer_rank_memory(shape, setup)  # on CPU: resident memory (setup.device)
        trainers.append(TrainerFit(stage, setup, memory))
    engine = _engine(recipe, shape, hardware)
    asks = _engine_asks(recipe) if recipe.rl is not None else 0
    roofline = hardware.gpu is not None and hardware.device == "cuda"
    step = _rl_step(recipe, shape, hardware, engine, asks) if roofline and engine is not None else None
    return Estimate(
        layout=Layout.of(recipe),
        trainers=tuple(trainers),
        engine=engine,
        engine_asks=asks,
        transport=select_weight_sync(recipe, hardware.device, transfer_available=True) if recipe.rl else None,
        step=step,
        sft_step_s=_sft_step(recipe, shape, hardware) if roofline and recipe.sft is not None else None,
        auxiliaries=tuple(fit for m in auxiliary_models(recipe) if (fit := _auxiliary(recipe, m, hardware))),
    )


# --------------------------------------------------------------------------------- what does not fit


def _gib(value: int) -> str:
    return f"{value / GIB:.1f}"


def _trainer_problem(fit: TrainerFit, hardware: Hardware, recipe: Recipe) -> Problem:
    memory, setup = fit.memory, fit.setup
    batch = memory.activations + memory.logits
    if batch > memory.model_states:
        fixed = fit.stage == "sft" and recipe.sft.micro_batching == "fixed"
        key = (fit.stage, "micro_batch_size" if fixed else "max_tokens_per_microbatch")
    else:
        key = ("trainer", "zero_stage")
    why = (
        f"a trainer rank of the {fit.stage.upper()} stage needs {_gib(memory.peak)} GiB but a GPU has "
        f"{hardware.gib:g} GiB (model states {_gib(memory.model_states)} with ZeRO-{setup.zero_stage} over "
        f"{setup.ranks} rank{'s' if setup.ranks > 1 else ''}, activations {_gib(memory.activations)} and logits "
        f"{_gib(memory.logits)} for a micro-batch of {setup.micro_batch_tokens} tokens"
        + (f", KL reference {_gib(memory.reference)}" if memory.reference else "")
        + ")"
    )
    return Problem(key, why)


def memory_problems(recipe: Recipe, est: Estimate, hardware: Hardware) -> list[Problem]:
    """What of ``est`` does not fit a GPU of ``hardware`` (nothing when its memory is unknown)."""
    if hardware.gpu_bytes is None or hardware.device != "cuda":
        return []
    problems = [_trainer_problem(t, hardware, recipe) for t in est.trainers if t.memory.peak > hardware.gpu_bytes]
    util = recipe.inference.gpu_memory_utilization
    if est.engine is not None:
        keys = (("inference", "tensor_parallel"), ("inference", "max_model_len"))
        problems += _engine_problems(est.engine, "an engine", keys, util, hardware)
    for aux in est.auxiliaries:  # a teacher scores whole trajectories: its length is inference.max_model_len
        length = ("inference", "max_model_len") if aux.model.name == TEACHER else aux.model.model_key
        keys = ((*aux.model.key, "tensor_parallel"), length)
        problems += _engine_problems(aux.memory, f"a {aux.model.name} engine", keys, util, hardware)
    return problems


def _engine_problems(
    engine: EngineMemory, what: str, keys: tuple[tuple[str, ...], tuple[str, ...]], util: float, hardware: Hardware
) -> list[Problem]:
    """An engine GPU whose weights do not fit its share of the GPU (``keys[0]``: the tensor
    parallelism that would split them), or whose KV cache cannot hold one trajectory (``keys[1]``)."""
    if engine.weights + engine.reserve > engine.budget:
        why = (
            f"{what} GPU's weights ({_gib(engine.weights)} GiB) and vLLM's reserve ({_gib(engine.reserve)}) "
            f"exceed the {_gib(engine.budget)} GiB that gpu_memory_utilization {util} gives it of {hardware.gib:g} GiB"
        )
        return [Problem(keys[0], why)]
    if engine.trajectories < 1:
        why = (
            f"{engine.trajectory_tokens} tokens do not fit the KV cache {what} has left "
            f"({_gib(engine.kv_cache)} GiB: {engine.tokens} tokens)"
        )
        return [Problem(keys[1], why)]
    return []


# -------------------------------------------------------------------------------------- proposals


def _tensor_parallel_sizes(shape: ModelShape, gpus: int) -> list[int]:
    """Sizes vLLM accepts: dividing the attention heads, within the node."""
    return [tp for tp in range(1, min(gpus, MAX_TENSOR_PARALLEL) + 1) if shape.heads % tp == 0]


def _candidates(recipe: Recipe, shape: ModelShape, gpus: int) -> list[Layout]:
    written = Layout.of(recipe)
    stages = (0, 1, 2) if recipe.model.lora is not None else (0, 1, 2, 3)  # LoRA: ZeRO 0-2
    layouts = []
    for checkpointing in (False, True) if not written.gradient_checkpointing else (True,):
        layouts += _splits(replace(written, gradient_checkpointing=checkpointing), shape, gpus, stages)
    return layouts


def _splits(written: Layout, shape: ModelShape, gpus: int, stages: tuple[int, ...]) -> list[Layout]:
    """Every split of ``gpus`` between the trainer and the engines, at each ZeRO stage."""
    layouts = []
    for zero in stages:
        if written.engines == 0:  # SFT only, or RL on remote engines: every GPU trains
            layouts += [replace(written, trainer_gpus=t, zero_stage=zero) for t in range(1, gpus + 1)]
            continue
        for tp in _tensor_parallel_sizes(shape, gpus - 1):
            for trainer_gpus in range(1, gpus - tp + 1):
                engines = (gpus - trainer_gpus) // tp
                layouts.append(
                    replace(written, trainer_gpus=trainer_gpus, engines=engines, tensor_parallel=tp, zero_stage=zero)
                )
    return layouts


def _fitted(recipe: Recipe, shape: ModelShape, hardware: Hardware, layout: Layout) -> Estimate | None:
    """The layout with each stage's micro-batch halved until its trainer rank fits (down to one
    sequence); None when a rank or an engine still does not fit."""
    for stage in ("sft", "rl"):
        if getattr(recipe, stage) is None:
            continue
        field = f"{stage}_micro_batch"
        while True:
            candidate = layout.applied(recipe)
            rank = trainer_rank_memory(shape, trainer_setup(candidate, stage, hardware))
            if rank.peak <= hardware.gpu_bytes:
                break
            tokens = getattr(layout, field)
            if stage == "sft" and recipe.sft.micro_batching == "fixed" or tokens <= longest_sequence(recipe, stage):
                return None
            layout = replace(layout, **{field: max(tokens // 2, longest_sequence(recipe, stage))})
    candidate = layout.applied(recipe)
    est = estimate(candidate, shape, hardware)
    if memory_problems(candidate, est, hardware):
        return None
    return est


def _micro_tokens(layout: Layout) -> int:
    return (layout.sft_micro_batch or 0) + (layout.rl_micro_batch or 0)


def proposals(
    recipe: Recipe, shape: ModelShape, hardware: Hardware, machine: MachineFacts, base_dir: Path, limit: int = 5
) -> list[Estimate]:
    """The splits of one node of ``hardware`` that fit, fastest first, each with the ZeRO stage that
    needs the least memory a rank among the fastest (the roofline does not tell 0, 1 and 2 apart)."""
    if hardware.gpu_bytes is None or recipe.cluster is not None or recipe.trainer.nnodes > 1:
        return []
    fits = []
    beside = sum(m.gpus for m in auxiliary_models(recipe))  # a teacher's and a judge's GPUs stay theirs
    for layout in _candidates(recipe, shape, hardware.gpus - beside):
        if feasibility_problems(layout.applied(recipe), machine, base_dir):  # batches that cannot split, ...
            continue
        est = _fitted(recipe, shape, hardware, layout)
        if est is not None:
            fits.append(est)
    # at equal time the larger micro-batches (fewer, better-filled kernels), then the least memory
    fits.sort(key=lambda e: (round(e.ranking_s, 1), -_micro_tokens(e.layout), e.largest_rank.memory.peak))
    best: dict[tuple[int, int, int], Estimate] = {}  # one row a split of the GPUs: its best ZeRO stage
    for est in fits:
        best.setdefault((est.layout.trainer_gpus, est.layout.engines, est.layout.tensor_parallel), est)
    return list(best.values())[:limit]

"""Memory of each process of a run, from the model's shape and the settings that size it: a trainer
rank (DeepSpeed ZeRO model states, activations of the largest micro-batch, framework buffers) and a
vLLM engine's GPU (weights, the KV cache left, the trajectories that fit in it at once).

Pure arithmetic on numbers (no recipe, no torch): ``skyrl_cli.plan.fit`` feeds it a recipe's
settings, and a benchmark can call ``trainer_rank_memory`` with the settings of a run it measured
and compare ``RankMemory.peak`` (or any part) with the measured peak.

What is counted, per trainer rank, with P parameters, T of them trained (all, or LoRA's), N ranks,
w bytes per weight (2 in bf16, the trainer's dtype on GPUs) -- DeepSpeed 0.19 as
``backends.train.engine`` configures it (a torch AdamW, bf16 mixed precision, default buckets):

==========  =====================  ======================  ========================  =================
ZeRO        weights                gradients (w bytes)     fp32 gradients + master   Adam (2 x fp32)
==========  =====================  ======================  ========================  =================
0           w P                    w T                     8 T                       8 T
1           w P                    w T                     8 T / N                   8 T / N
2           w P                    w T / N                 8 T / N                   8 T / N
3           w P / N                w T / N                 4 T / N + the step's 4    8 T / N
==========  =====================  ======================  ========================  =================

ZeRO-2's row is DeepSpeed's own estimator's (``estimate_zero2_model_states_mem_needs``: 2 P + 18 P / N);
ZeRO-3 keeps its fp32 gradients one sub-group (``sub_group_size``, 1e9 elements) at a time during
the optimizer step and gathers the largest module's weights and gradients (4 bytes a parameter of
it, the estimator's ``largest_layer_memory``) in forward and backward. In fp32 (w = 4) ZeRO-0 and
ZeRO-3 keep no separate fp32 gradients or master weights; ZeRO-1/2 copy them all the same. CPU
offload (DeepSpeed's ``cpu_offload``; the trainer does not offload, the estimators have it) leaves
the weights only (and, offloading the parameters too under ZeRO-3, the gathered module).

Activations are the tensors autograd saves for backward, per token of the largest micro-batch,
counted for the HF Llama/Qwen decoder layer with SDPA attention (checked against torch's
saved-tensor hooks in ``tests/unit/test_memory_estimates.py``), plus the logits of the loss.

The peak is the largest of three moments of a step, each with what is alive then
(``RankMemory.phases``: the start of backward, the gradient reduction, the optimizer step), and
each with a transient that the model states do not count:

- backward: the embedding's gradient (and a tied head's, held from the start of backward until the
  embedding adds its own) is computed whole before it is accumulated or reduced, whatever the stage;
- the reduction (several ranks, ZeRO 0-2, once backward is done): DeepSpeed flattens the gradients
  it reduces into one more copy (``allreduce_bucket``: up to ``reduce_bucket_size`` elements, all of
  them at 2 and 4 ranks); ZeRO-1/2 build their fp32 gradient partition only later, at the step;
- the step: AdamW's temporaries: on CUDA torch's foreach path keeps one fp32 copy of every tensor
  stepped at once (the sqrt of the second moments); on CPU its single-tensor path keeps two of the
  largest tensor (ZeRO-1/2 step one flat partition; ZeRO-3 one sub-group). ZeRO-2 with fp32
  weights holds one gradient partition then: it flattens it into its fp32 copy and lets it go.

Measured on CPU, each phase's resident peak of a 2-rank ZeRO-0/1/2 step of the Qwen2.5-0.5B shape
and the SmolLM2-135M shape at 2 and 4 ranks (benchmarks/RESULTS.md, "Memory estimates against CPU
runs"); on GPUs the same code runs (NCCL instead of gloo), not yet measured there.

On CPU (``TrainerSetup.device = "cpu"``: a rank's resident memory, checked against runs by
``benchmarks/bench_memory_estimates.py``) three things differ from a GPU: the process itself
(interpreter, libraries; an SFT rank's tokenized data) takes the place of CUDA's context
(``TRAINER_CPU_RUNTIME_BYTES``, ``CPU_BYTES_PER_EXAMPLE``);
DeepSpeed's reduction bucket takes RAM only as far as gradients are copied into it (an untouched
``torch.empty`` page is not resident), and ZeRO-1/2 fill it after the micro-batch's activations
are gone; and glibc keeps freed tensors below its mmap threshold in its heap, so the activations
and ZeRO-3's gathered weights leave pages behind (``allocator``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from skyrl_cli.plan.shape import ModelShape

GIB = 2**30

# CUDA context with torch's kernels loaded (about 0.5 GiB on an H100) and NCCL's communicator
# buffers (about 0.5 GiB): constants, not measured here.
TRAINER_CUDA_RESERVE_BYTES = 1 * GIB
# A CPU trainer rank (SFT or RL learner) besides its tensors and its dataset: the interpreter,
# torch, DeepSpeed, transformers (0.29 GB imported), gloo, the tokenizer, the run's own objects.
# With a few tens of MB of tensors, 2 ranks, ZeRO-2 (2-core AMD EPYC, Python 3.11, torch 2.9,
# DeepSpeed 0.19), ranks peaked at: the quickstart's RL learner 0.55 GB, the quickstart's SFT
# (100,000 sums) 0.61 GB, tests/integration/test_sft.py's SFT run (2,000 sums) 0.49 GB:
#   python benchmarks/bench_memory_estimates.py --sizes quickstart --stages 2 --rl
TRAINER_CPU_RUNTIME_BYTES = 453 * 2**20
# Each example of a built-in task's train split an SFT rank holds tokenized (Python lists): the
# two SFT runs above, 98,000 examples apart, peaked 0.08 GB apart.
CPU_BYTES_PER_EXAMPLE = 800
# What glibc keeps of a micro-batch's freed activations on CPU, as a share of them: they are below
# its mmap threshold (which it raises to 32 MiB after the first large frees), and the gradients and
# Adam states allocated among them fragment its heap. Under ZeRO-3 the weights gathered for each
# module in forward and again in backward stay behind the same way (2 x the model's weights). With
# glibc's threshold held at 128 KiB (MALLOC_MMAP_THRESHOLD_=131072, which halves the quickstart's
# tokens/s) the SmolLM2-135M shape's ranks peaked 0.5 (ZeRO-0) to 1.6 GB (ZeRO-3) lower. Fitted on
# that shape at ZeRO 0-3, 2 ranks, 512-token micro-batches; the Qwen2.5-0.5B shape's one-rank RL
# runs (benchmarks/RESULTS.md: 17.21 GB ZeRO-2, 13.02 GB stage 0) are then 1.03x and 1.08x the estimate:
#   python benchmarks/bench_memory_estimates.py --sizes smollm2-135m
CPU_KEPT_ACTIVATIONS = 0.6
# DeepSpeed defaults the trainer's config leaves as they are (deepspeed/runtime/zero/config.py):
# reduce_bucket_size (elements), stage3_prefetch_bucket_size and sub_group_size.
DEEPSPEED_REDUCE_BUCKET = 500_000_000
DEEPSPEED_PREFETCH_BUCKET = 50_000_000
DEEPSPEED_SUB_GROUP = 1_000_000_000
# The loss's logits at backward's peak, bytes per token per vocabulary entry: the fp32 log-softmax
# saved for backward (4), the gradient coming into it (4) and its gradient (4). The loss upcasts
# bf16 logits to fp32 (backends.train.microbatch).
LOGITS_BYTES_PER_VOCAB = 12
# What vLLM takes on each GPU besides weights and KV cache, inside gpu_memory_utilization: the
# profile run's activations, CUDA graphs, NCCL and the CUDA context. A constant, not measured here.
ENGINE_RESERVE_BYTES = 2 * GIB
# INT4 W4A16 (compressed-tensors pack-quantized, symmetric): half a byte a weight, plus a bf16 scale
# per group of input columns.
INT4_WEIGHT_BYTES = 0.5
SCALE_BYTES = 2

Offload = Literal["none", "optimizer", "optimizer+parameters"]


@dataclass(frozen=True)
class TrainerSetup:
    """What a trainer rank's memory depends on besides the model's shape."""

    ranks: int  # data-parallel world size: what ZeRO partitions over
    zero_stage: int
    micro_batch_tokens: int  # the largest micro-batch, padding included
    weight_bytes: int = 2  # 2: bf16 (the trainer on GPUs), 4: fp32
    lora_rank: int | None = None  # LoRA: only adapters train
    lora_targets: tuple[str, ...] = ()
    int4_qat: bool = False  # fake-quantized weight copies saved for backward
    reference_copy: bool = False  # a frozen copy of the model for the KL term (RL, without LoRA)
    gradient_checkpointing: bool = False  # trainer.gradient_checkpointing
    offload: Offload = "none"  # the trainer does not offload; for comparison with DeepSpeed's estimators
    device: Literal["cuda", "cpu"] = "cuda"  # cpu: resident memory of a CPU rank (see the module's doc)
    data_examples: int = 0  # CPU: tokenized examples a rank holds (an SFT stage's built-in train split)


def lora_parameters(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters: ``rank x (in + out)`` for every targeted Linear layer of every layer."""
    chosen = [io for name, io in shape.linear_layers().items() if name.split(".")[-1] in targets]
    return shape.layers * sum(rank * (n_in + n_out) for n_in, n_out in chosen)


def layer_activation_bytes(shape: ModelShape, weight_bytes: int = 2) -> int:
    """Bytes one decoder layer saves for backward per token, in 16-bit elements x ``weight_bytes``:
    two RMSNorms (the fp32 input and the normalized output: 3 h each), the inputs of the attention
    and MLP projections (h each), q, k, v and SDPA's output (attention + 2 kv + attention), o_proj's
    input (attention), the MLP's gate, up, activation and product (4 intermediate)."""
    elements = 8 * shape.hidden + 3 * shape.attention + 2 * shape.kv + 4 * shape.intermediate
    return weight_bytes * elements


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one trainer rank's GPU, by part. ``peak`` is what it needs at once."""

    weights: int
    gradients: int
    fp32_gradients: int
    master_weights: int
    optimizer: int
    zero3_gathered: int  # ZeRO-3: the largest module's weights and gradients, gathered
    zero3_step: int  # ZeRO-3: fp32 gradients of one sub-group during the optimizer step
    reference: int
    activations: int
    logits: int
    qat_copies: int
    buckets: int  # DeepSpeed's gradient reduction bucket (ZeRO-3: and its prefetch bucket)
    reserve: int = field(default=TRAINER_CUDA_RESERVE_BYTES)  # CUDA + NCCL; on CPU the process itself
    activations_checkpointed: int = 0  # what the activations would be with gradient checkpointing
    reduction_buckets: int = 0  # CPU, ZeRO-1/2: the bucket, resident only once activations are gone
    allocator: int = 0  # CPU: freed tensors glibc keeps in its heap
    embedding_gradients: int = 0  # backward: the embedding's (and a tied head's) gradient, whole
    reduce_copy: int = 0  # several ranks, ZeRO 0-2: the gradients flattened to reduce them
    optimizer_temps: int = 0  # the step: AdamW's temporaries
    zero_stage: int = 0
    weight_bytes: int = 2
    device: str = "cuda"

    @property
    def model_states(self) -> int:
        """What DeepSpeed's ``estimate_zero*_model_states_mem_needs`` count: weights, gradients,
        master weights and optimizer states (ZeRO-3: with the gathered module, or the step's fp32
        gradients when those are more)."""
        states = self.weights + self.gradients + self.fp32_gradients + self.master_weights + self.optimizer
        return states + max(self.zero3_gathered, self.zero3_step)

    def phases(self) -> dict[str, list[tuple[str, int]]]:
        """The moments of a step whose largest total is the peak, each ``(name, bytes)`` of what is
        alive then: backward's start (the activations) with the embedding's gradient, the gradient
        reduction on several ranks (ZeRO 0-2; empty otherwise), and the optimizer step."""
        states = [
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("fp32 gradients", self.fp32_gradients),
            ("master weights", self.master_weights),
            ("Adam states", self.optimizer),
        ]
        rest = [
            ("KL reference", self.reference),
            ("freed, kept by malloc", self.allocator),
            ("CUDA + NCCL" if self.device == "cuda" else "Python, libraries, data", self.reserve),
        ]
        backward = [
            ("ZeRO-3 gathered", self.zero3_gathered),
            ("activations", self.activations),
            ("logits", self.logits),
            ("QAT copies", self.qat_copies),
            ("embedding gradient", self.embedding_gradients),
            ("DeepSpeed buckets", self.buckets),
        ]
        # ZeRO-1/2 make their fp32 gradient partition only at the step
        reduced = [part for part in states if self.zero_stage == 0 or part[0] != "fp32 gradients"]
        reduction = [("DeepSpeed buckets", self.buckets + self.reduction_buckets), ("reduction copy", self.reduce_copy)]
        # ZeRO-2 flattens fp32 gradients into its fp32 partition and lets them go: one copy at the step
        stepped = [
            part for part in states if not (self.zero_stage == 2 and self.weight_bytes == 4) or part[0] != "gradients"
        ]
        step = [
            ("ZeRO-3 gathered", max(self.zero3_gathered, self.zero3_step)),
            ("DeepSpeed buckets", self.buckets),
            ("AdamW temporaries", self.optimizer_temps),
        ]
        return {
            "the start of backward": states + backward + rest,
            "the gradient reduction": reduced + reduction + rest if self.reduce_copy else [],
            "the optimizer step": stepped + step + rest,
        }

    def _peak_moment(self) -> tuple[str, list[tuple[str, int]], int]:
        """The moment with the largest total (the first of equal ones), its parts and that total."""
        totals = [(name, parts, sum(value for _, value in parts)) for name, parts in self.phases().items()]
        return max(totals, key=lambda moment: moment[2])

    @property
    def peak_phase(self) -> str:
        return self._peak_moment()[0]

    @property
    def peak(self) -> int:
        return self._peak_moment()[2]

    def parts(self) -> list[tuple[str, int]]:
        """``(name, bytes)`` of each part of the peak that is not zero, in the order a reader adds them up."""
        return [(name, value) for name, value in self._peak_moment()[1] if value]


def _model_states(shape: ModelShape, setup: TrainerSetup, trained: int) -> dict[str, int]:
    n, stage, w, params = setup.ranks, setup.zero_stage, setup.weight_bytes, shape.parameters()
    mixed = w < 4  # bf16 weights: fp32 master weights and gradients beside them
    # ZeRO-1/2 clone each rank's partition into the optimizer's own fp32 copy and flatten its gradient
    # into another, whatever the weights' dtype (stage_1_and_2.py, single_partition_of_fp32_groups):
    # fp32 weights get both too. ZeRO-3 uses fp32 weights as they are; stage 0 steps them in place.
    # Measured on the Qwen2.5-0.5B shape, fp32, one rank: ZeRO-2 17.2 GB, stage 0 13.0 GB
    # (benchmarks/RESULTS.md, "The 0.5B recipe's shape end to end").
    fp32_copy = mixed or stage in (1, 2)
    states = {
        "weights": w * params // (n if stage == 3 else 1),
        "gradients": w * trained // (n if stage >= 2 else 1),
        "fp32_gradients": 4 * trained // (1 if stage == 0 else n) if fp32_copy and stage < 3 else 0,
        "master_weights": 4 * trained // (1 if stage == 0 else n) if fp32_copy else 0,
        "optimizer": 8 * trained // (1 if stage == 0 else n),
        "zero3_gathered": 0,
        "zero3_step": 0,
    }
    if stage == 3:
        states["zero3_gathered"] = 4 * shape.largest_module_parameters()
        states["zero3_step"] = 4 * min(DEEPSPEED_SUB_GROUP, trained // n) if mixed else 0
    if setup.offload != "none":  # gradients, master weights and optimizer states live in CPU memory
        states.update(gradients=0, fp32_gradients=0, master_weights=0, optimizer=0, zero3_step=0)
        if setup.offload == "optimizer+parameters":
            states["weights"] = 0
    return states


def _buckets(shape: ModelShape, setup: TrainerSetup, trained: int) -> int:
    """DeepSpeed's gradient reduction bucket: ZeRO-1 stages it in fp32, ZeRO-2 in the weights' dtype
    (both allocate the whole ``reduce_bucket_size``; on CPU only the part gradients are copied
    into is resident); ZeRO-3 fills one up to the trained parameters and prefetches the next
    modules' weights into another."""
    if setup.zero_stage == 0:
        return 0
    if setup.zero_stage == 3:
        reduce = 0 if setup.offload != "none" else min(DEEPSPEED_REDUCE_BUCKET, trained)
        # on CPU the prefetched weights are the model's at most (no bucket is allocated for them)
        prefetch = (
            min(DEEPSPEED_PREFETCH_BUCKET, shape.parameters()) if setup.device == "cpu" else DEEPSPEED_PREFETCH_BUCKET
        )
        return setup.weight_bytes * (reduce + prefetch)
    if setup.offload != "none":
        return 0
    elements = min(DEEPSPEED_REDUCE_BUCKET, trained) if setup.device == "cpu" else DEEPSPEED_REDUCE_BUCKET
    return (4 if setup.zero_stage == 1 else setup.weight_bytes) * elements


def _device_parts(shape: ModelShape, setup: TrainerSetup, activations: int, buckets: int) -> dict[str, int]:
    """Where the device changes a rank's parts. On a GPU: DeepSpeed's buckets as allocated, and the
    default reserve (CUDA and NCCL). On CPU: the process itself instead of CUDA's reserve
    (``TRAINER_CPU_RUNTIME_BYTES``), the bucket of ZeRO-1/2 once the activations are gone (the
    reduction), and what glibc keeps of freed tensors: a share of the activations and, under
    ZeRO-3, the weights gathered in forward and again in backward."""
    if setup.device != "cpu":
        return {"buckets": buckets}
    gathered = 2 * setup.weight_bytes * shape.parameters() if setup.zero_stage == 3 else 0
    kept = int(CPU_KEPT_ACTIVATIONS * activations) + gathered
    reduced_after_backward = setup.zero_stage in (1, 2)
    return {
        "buckets": 0 if reduced_after_backward else buckets,
        "reduction_buckets": buckets if reduced_after_backward else 0,
        "allocator": kept,
        "reserve": TRAINER_CPU_RUNTIME_BYTES + CPU_BYTES_PER_EXAMPLE * setup.data_examples,
        "device": "cpu",
    }


def _transients(shape: ModelShape, setup: TrainerSetup, trained: int) -> dict[str, int]:
    """What a step allocates for a moment besides the model states (see the module's doc)."""
    full, n, stage, w = setup.lora_rank is None, setup.ranks, setup.zero_stage, setup.weight_bytes
    offloaded = setup.offload != "none"
    # the embedding trains in a full fine-tune only; a tied head adds its gradient to the same matrix
    embedding = w * shape.vocab * shape.hidden * (2 if shape.tied else 1) if full else 0
    reduce = 0
    if n > 1 and stage <= 2 and not offloaded:
        reduce = (4 if stage == 1 else w) * min(DEEPSPEED_REDUCE_BUCKET, trained)
    if offloaded:
        stepped = 0  # the optimizer steps in CPU memory
    elif stage == 0:
        stepped = trained
    elif stage == 3:
        stepped = min(DEEPSPEED_SUB_GROUP, trained // n)
    else:
        stepped = trained // n
    if setup.device == "cpu":  # torch's single-tensor AdamW: two temporaries of one tensor at a time
        largest = min(trained, shape.largest_module_parameters()) if stage == 0 else stepped
        temps = 2 * 4 * largest
    else:  # the foreach path: one fp32 temporary of everything stepped together
        temps = 4 * stepped
    return {
        "embedding_gradients": embedding,
        "reduce_copy": reduce,
        "optimizer_temps": temps,
        "zero_stage": stage,
        "weight_bytes": w,
    }


def activation_bytes(shape: ModelShape, setup: TrainerSetup, checkpointed: bool) -> int:
    """Saved activations of the largest micro-batch (without the logits). Checkpointed: each layer's
    input, and one layer's activations recomputed at a time during backward."""
    w, tokens = setup.weight_bytes, setup.micro_batch_tokens
    layer = layer_activation_bytes(shape, w)
    if setup.lora_rank is not None:  # the adapter's down-projection output, saved for its up-projection
        layer += w * setup.lora_rank * len([n for n in shape.linear_layers() if n.split(".")[-1] in setup.lora_targets])
    final_norm = 3 * w * shape.hidden
    per_token = shape.layers * w * shape.hidden + layer if checkpointed else shape.layers * layer
    return tokens * (per_token + final_norm)


def trainer_rank_memory(shape: ModelShape, setup: TrainerSetup) -> RankMemory:
    """Each part of one trainer rank's GPU memory (``RankMemory``) for ``shape`` under ``setup``."""
    full = setup.lora_rank is None
    trained = shape.parameters() if full else lora_parameters(shape, setup.lora_rank, setup.lora_targets)
    w, tokens = setup.weight_bytes, setup.micro_batch_tokens
    qat_layers = 1 if setup.gradient_checkpointing else shape.layers
    activations = activation_bytes(shape, setup, setup.gradient_checkpointing)
    return RankMemory(
        **_model_states(shape, setup, trained),
        reference=w * shape.parameters() if setup.reference_copy else 0,
        activations=activations,
        activations_checkpointed=activation_bytes(shape, setup, True),
        logits=tokens * LOGITS_BYTES_PER_VOCAB * shape.vocab,
        qat_copies=w * shape.layer_linear_parameters() * qat_layers if setup.int4_qat else 0,
        **_device_parts(shape, setup, activations, _buckets(shape, setup, trained)),
        **_transients(shape, setup, trained),
    )


# ------------------------------------------------------------------------------------------ engines


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """KV cache bytes one token takes on each GPU of an engine: keys and values (2) of every layer,
    for the key/value heads that GPU holds (vLLM splits them over tensor parallel ranks and
    replicates them when there are fewer heads than ranks)."""
    heads_per_gpu = max(1, shape.kv_heads // tensor_parallel)
    return 2 * shape.layers * heads_per_gpu * shape.head_dim * dtype_bytes


def engine_weight_bytes(shape: ModelShape, dtype_bytes: int, int4_group: int | None = None) -> int:
    """The weights an engine loads. ``int4_group``: the decoder's Linear layers in W4A16 with a
    scale per group of that many input columns (the embeddings, head and norms stay in ``dtype_bytes``)."""
    linear = shape.layers * shape.layer_linear_parameters()
    rest = shape.parameters() - linear
    if int4_group is None:
        return dtype_bytes * shape.parameters()
    return int(linear * (INT4_WEIGHT_BYTES + SCALE_BYTES / int4_group)) + dtype_bytes * rest


@dataclass(frozen=True)
class EngineMemory:
    """One GPU of an engine (tensor parallel: each of its GPUs holds the same)."""

    budget: int  # gpu_memory_utilization x the GPU's memory
    weights: int  # this GPU's share
    reserve: int
    kv_per_token: int  # bytes a token takes in this GPU's KV cache
    trajectory_tokens: int  # the longest trajectory: prompt and every turn (inference.max_model_len)

    @property
    def kv_cache(self) -> int:
        return max(0, self.budget - self.weights - self.reserve)

    @property
    def tokens(self) -> int:
        """Tokens the engine's KV cache holds at once."""
        return self.kv_cache // self.kv_per_token

    @property
    def trajectories(self) -> int:
        """Trajectories of ``trajectory_tokens`` that fit in the KV cache at once."""
        return self.tokens // self.trajectory_tokens


def engine_memory(
    shape: ModelShape,
    gpu_bytes: int,
    utilization: float,
    tensor_parallel: int,
    trajectory_tokens: int,
    dtype_bytes: int = 2,
    int4_group: int | None = None,
) -> EngineMemory:
    """vLLM on ``tensor_parallel`` GPUs of ``gpu_bytes``: the weights split over them, the reserve,
    and the KV cache that is left of ``utilization`` of each GPU."""
    return EngineMemory(
        budget=int(utilization * gpu_bytes),
        weights=engine_weight_bytes(shape, dtype_bytes, int4_group) // tensor_parallel,
        reserve=ENGINE_RESERVE_BYTES,
        kv_per_token=kv_bytes_per_token(shape, dtype_bytes, tensor_parallel),
        trajectory_tokens=trajectory_tokens,
    )

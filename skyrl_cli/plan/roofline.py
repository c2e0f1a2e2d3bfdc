"""Step time on paper: a roofline from the GPU type's peak FLOPs and memory bandwidth, for ranking
the splits of a machine (``skyrl_cli.plan.fit``), not for predicting a run to the second.

- Generation: each decode step reads an engine GPU's weights and the KV cache of the sequences it
  runs (bandwidth bound at these batch sizes), or computes 2 FLOPs a parameter a sequence, whichever
  takes longer; prefill computes 2 FLOPs a parameter a prompt token.
- Training: 6 FLOPs a parameter a token (forward 2, backward 4; LoRA 4: no weight gradients of the
  base), 2 for each extra forward (the KL reference, the proximal policy's logprobs), at ``TRAIN_MFU``
  of the trainer GPUs' peak; plus ZeRO's collectives over the GPUs' link.
- Weight sync: the policy's bytes over the link (NCCL broadcast) or written and read back at
  ``DISK_BYTES_PER_S`` (disk, delta, LoRA adapters, INT4 exports).

The worst case the recipe allows: every trajectory as long as ``inference.max_model_len``, every
response ``max_new_tokens`` a turn. Not counted: the orchestrator, rewards, dynamic sampling's
extra batches, engine pauses and preemptions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuType:
    name: str
    memory_gib: float  # the nominal size; nvidia-smi reports a little less on some (an H100: 79.6 GiB)
    bf16_flops: float  # dense BF16 tensor-core peak, FLOP/s
    memory_bytes_per_s: float
    link: str
    link_bytes_per_s: float  # between two GPUs of one node, each direction
    source: str


# The vendors' datasheets (dense figures: the sparse ones are twice these).
GPU_TYPES = {
    "h100": GpuType("H100 SXM", 80, 989e12, 3.35e12, "NVLink", 450e9, "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    "h200": GpuType("H200 SXM", 141, 989e12, 4.8e12, "NVLink", 450e9, "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    "a100": GpuType(
        "A100 SXM", 80, 312e12, 2.039e12, "NVLink", 300e9, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)"
    ),
    "l40s": GpuType("L40S", 48, 362e12, 864e9, "PCIe 4.0 x16", 32e9, "NVIDIA L40S datasheet"),
    "4090": GpuType(
        "RTX 4090", 24, 165e12, 1008e9, "PCIe 4.0 x16", 32e9, "NVIDIA Ada Lovelace architecture whitepaper, appendix A"
    ),
}
DEFAULT_GPU_TYPE = "h100"

# Model FLOPs utilization of training (HF models under DeepSpeed ZeRO at these sizes): an assumption,
# not measured here.
TRAIN_MFU = 0.35
# Share of peak memory bandwidth a decode step reaches, and of peak FLOPs prefill reaches: assumptions.
DECODE_BANDWIDTH_SHARE = 0.7
PREFILL_MFU = 0.5
# A local NVMe SSD, writing then reading a weight version: an assumption.
DISK_BYTES_PER_S = 2e9


def gpu_type_named(text: str) -> str | None:
    """The key of ``GPU_TYPES`` that a GPU's name (nvidia-smi's) or a key names; None if none."""
    lowered = text.lower()
    if lowered in GPU_TYPES:
        return lowered
    return next((key for key in GPU_TYPES if key in lowered), None)


@dataclass(frozen=True)
class Generation:
    """One RL step's generation on ``engines`` engines of ``tensor_parallel`` GPUs each."""

    trajectories: int
    prompt_tokens: int  # per trajectory
    response_tokens: int  # per trajectory, every turn
    engines: int
    tensor_parallel: int
    concurrency: int  # trajectories one engine runs at once
    weight_bytes: int  # one engine GPU's share
    kv_bytes_per_token: int  # one engine GPU's
    parameters: int


def generation_seconds(work: Generation, gpu: GpuType) -> float:
    waves = math.ceil(work.trajectories / (work.engines * work.concurrency))
    context = work.prompt_tokens + work.response_tokens / 2  # the mean over a response
    read = work.weight_bytes + work.concurrency * context * work.kv_bytes_per_token
    per_gpu_flops = 2 * work.parameters / work.tensor_parallel * work.concurrency
    decode_step = max(
        read / (gpu.memory_bytes_per_s * DECODE_BANDWIDTH_SHARE), per_gpu_flops / (gpu.bf16_flops * TRAIN_MFU)
    )
    prefill = 2 * work.parameters * work.prompt_tokens * work.trajectories
    prefill_s = prefill / (work.engines * work.tensor_parallel * gpu.bf16_flops * PREFILL_MFU)
    return waves * work.response_tokens * decode_step + prefill_s


@dataclass(frozen=True)
class Training:
    """One optimizer stage's step on ``gpus`` trainer GPUs."""

    tokens: int
    parameters: int
    trained: int
    gpus: int
    zero_stage: int
    weight_bytes: int
    updates: int  # optimizer steps a step makes
    micro_batches: int  # per rank, over the step
    extra_forwards: int = 0  # forwards without gradients over every token (reference, proximal policy)
    lora: bool = False
    passes: int = 1  # epochs over the tokens


def training_seconds(work: Training, gpu: GpuType) -> float:
    per_token = (4 if work.lora else 6) * work.parameters * work.passes + 2 * work.parameters * work.extra_forwards
    compute = work.tokens * per_token / (work.gpus * gpu.bf16_flops * TRAIN_MFU)
    if work.gpus == 1:
        return compute
    ring = (work.gpus - 1) / work.gpus  # a ring collective moves this share of the bytes each way
    traffic = work.updates * 2 * work.weight_bytes * work.trained  # reduce-scatter + all-gather (all-reduce)
    if work.zero_stage == 3:  # the weights gathered in forward and again in backward, every micro-batch
        traffic += work.micro_batches * 2 * work.weight_bytes * work.parameters
    return compute + traffic * ring / gpu.link_bytes_per_s


def sync_seconds(transport: str, version_bytes: int, gpu: GpuType) -> float:
    if transport == "nccl":
        return version_bytes / gpu.link_bytes_per_s
    return 2 * version_bytes / DISK_BYTES_PER_S


@dataclass(frozen=True)
class StepTime:
    generation_s: float
    training_s: float
    sync_s: float

    @property
    def sync_mode_s(self) -> float:
        """``skyrl rl``: generation, then training, then the weight sync."""
        return self.generation_s + self.training_s + self.sync_s

    @property
    def async_s(self) -> float:
        """``skyrl rl --async``: generation overlaps training."""
        return max(self.generation_s, self.training_s) + self.sync_s

"""DeepSpeed engine setup shared by the SFT trainer, the RL learner and the benchmarks.

- Device: CUDA with NCCL when the recipe (or "auto") says so and a GPU is visible, else the CPU
  accelerator with gloo (``DS_ACCELERATOR=cpu`` is set by the planner).
- Optimizer: a torch ``AdamW`` instance handed to ``deepspeed.initialize``; a config optimizer
  would make DeepSpeed compile cpu_adam / fused_adam first (about 50 s on CPU).
- Gradient accumulation is ours (``managed_gradient_accumulation: false``): every ``backward`` only
  accumulates, ``step()`` is the boundary, so the number of micro-batches may change from step to
  step (dynamic micro-batching). The caller scales each micro-batch loss itself and calls
  ``engine.backward(loss, scale_wrt_gas=False)``; see ``train_step``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from backends.train.microbatch import MicroBatch, token_nll_sum
from skyrl_contracts.build_locks import write_owner
from skyrl_contracts.ports import find_free_ports


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(preference: str) -> str:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def die_with_launcher() -> None:
    """A torchrun worker asks the kernel for SIGTERM when torchrun dies. torchrun starts each
    worker in a session of its own, so the supervisor's kill of torchrun's process group never
    reaches them, and a torchrun killed outright (SIGKILL, OOM) would leave its ranks training on."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # it died before the request: nothing would send the signal
        os.kill(os.getpid(), signal.SIGTERM)


def own_build_locks() -> None:
    """Make the lock of every op build this process does say who holds it (the host and pid,
    ``skyrl_contracts.build_locks``): the driver then removes it at once if this process dies
    mid-build, and another run's teardown leaves it while the build goes on."""
    from torch.utils import file_baton  # lazy: torch's cpp_extension holds the same class

    acquire = file_baton.FileBaton.try_acquire
    if getattr(acquire, "writes_owner", False):
        return

    def try_acquire(self) -> bool:
        taken = acquire(self)
        if taken:
            write_owner(self.lock_file_path)
        return taken

    try_acquire.writes_owner = True
    file_baton.FileBaton.try_acquire = try_acquire


def init_distributed(preference: str = "auto") -> Dist:
    """Join the torchrun process group (a plain ``python`` run is a world of one)."""
    own_build_locks()  # the CPU accelerator builds its shm_comm op here on a machine's first run
    # lazy: deepspeed (logs on import); the learner's "imports" lap imports it, not this module
    import deepspeed

    die_with_launcher()
    kind = resolve_device(preference)
    for key, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, default)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(find_free_ports(1)[0])
    deepspeed.init_distributed(dist_backend="nccl" if kind == "cuda" else "gloo", verbose=False)
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    return Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank, device)


def leave_distributed(completed: bool) -> None:
    """End a trainer process: every rank waits for the others (rank 0 may still be writing the
    final model or its INT4 export), the process groups are destroyed, and a completed run then
    leaves with ``os._exit(0)``. Without the wait a rank that finished first tore its groups down
    while its peer still held connections, and even after ``destroy_process_group`` a gloo worker
    thread kept alive by DeepSpeed's group handles was sometimes destroyed unjoined during
    interpreter shutdown ("terminate called without an active exception": SIGABRT after a run
    that had finished and published everything). Exiting past the interpreter's teardown is safe
    here because the outputs are already published atomically and the event log closed; a failed
    run keeps the normal exit, so its traceback and exit code reach torchrun."""
    if not torch.distributed.is_initialized():
        return
    if completed:
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if completed:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def deepspeed_config(zero_stage: int, grad_clip: float, bf16: bool) -> dict:
    zero: dict = {"stage": zero_stage}
    if zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": 1,  # nominal: micro-batches are token-budgeted by us
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def make_engine(
    model,
    *,
    lr: float,
    weight_decay: float,
    lr_lambda: Callable[[int], float],
    zero_stage: int,
    grad_clip: float,
    bf16: bool,
    gradient_checkpointing: bool = False,
    betas: tuple[float, float] = (0.9, 0.999),
):
    """``deepspeed.initialize`` with a torch AdamW over the trainable parameters and a LambdaLR
    (``gradient_checkpointing``: ``trainer.gradient_checkpointing``, see ``checkpoint_activations``)."""
    own_build_locks()
    # lazy: deepspeed (logs on import); the learner's "imports" lap imports it, not this module
    import deepspeed

    if gradient_checkpointing:
        checkpoint_activations(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
        config=deepspeed_config(zero_stage, grad_clip, bf16),
    )
    return engine, scheduler


def checkpoint_activations(model) -> None:
    """transformers' gradient checkpointing on every decoder layer of ``model`` (a LoRA-wrapped one
    too). Non-reentrant: the recomputation needs no input that requires grad, so a LoRA model with
    frozen embeddings is checkpointed without ``enable_input_require_grads``, and it composes with
    DeepSpeed's ZeRO hooks; the KV cache is off, as checkpointing requires."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False


def all_reduce_sum(values: Sequence[float], device) -> list[float]:
    """Sum of each value over all ranks (one collective for the whole list)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_gather_list(items: list) -> list:
    """Every rank's list, concatenated in rank order (the same result on all ranks)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(items)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def train_step(engine, micro_batches: Sequence[MicroBatch], global_loss_tokens: int, world_size: int) -> float:
    """One optimizer step over this rank's micro-batches; returns this rank's summed NLL.

    Each micro-batch's loss is its token-summed NLL * world_size / (loss tokens of the whole global
    batch): DeepSpeed averages gradients over ranks, so the update is the gradient of the global
    token-mean loss, whatever the packing. All ranks must pass the same number of micro-batches."""
    scale = world_size / max(1, global_loss_tokens)
    nll_total = 0.0
    for mb in micro_batches:
        nll = token_nll_sum(engine, mb.to(engine.device))
        engine.backward(nll * scale, scale_wrt_gas=False)
        nll_total += float(nll.detach())
    engine.step()
    return nll_total


def grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if hasattr(norm, "item") else norm)

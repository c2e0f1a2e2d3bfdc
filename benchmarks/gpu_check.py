"""The GPU check (``scripts/gpu-check.sh`` runs it): every stage this machine can run, each timed,
one table at the end, exit 1 if any stage failed. A stage whose dependency is missing is skipped
and says why; on a machine without CUDA the CPU-capable stages run on CPU with small settings.

Stages:
  sft-tiny       the tiny Llama, SFT steps with dynamic micro-batching (DeepSpeed; bf16 on CUDA)
  sft-0.5b       Qwen2.5-0.5B (local weights, else random weights from its config), the same (CUDA only);
                 on CUDA both SFT stages print the planner's memory estimate beside the measured peak
  rl-learner     the real RL learner (backends.train.rl_learner) on synthetic batches: its steps and
                 the disk publish of each version (the disk weight sync's trainer half)
  int4-qat       INT4 fake-quant (torchao) SFT steps on the tiny model
  tinker-lora    the Tinker server's batched multi-LoRA forward/backward, 4 adapters in one pass
  tied-sync      tied Llama / Qwen2 / Qwen3: the learner's published version and the engines' starting
                 copy (head written out, served untied) give the tied model's logprobs exactly
  delta-sync     the delta weight sync's round trip at the 0.5B size (no vLLM): AdamW steps at lr 1e-6,
                 each bf16 version taken, written whole and as a delta, read back and applied, bit-exact
  vllm           an engine behind vllm-router (where vLLM is installed): rollout tokens/s, the
                 disk weight sync per step, NCCL (needs a second GPU: NCCL refuses two ranks on one
                 device), and the engine-vs-trainer logprob gap

``python -m benchmarks.gpu_check [--only STAGE ...] [--scale 1.0]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "benchmarks" / "model_configs"
LOCAL_05B = Path.home() / ".cache" / "skyrl" / "models" / "Qwen2.5-0.5B-Instruct"


class Skip(Exception):
    """A stage this machine cannot run; the message says why."""


@dataclass
class Outcome:
    stage: str
    status: str  # ok | skipped | FAILED
    seconds: float = 0.0
    figures: dict[str, str] = field(default_factory=dict)
    note: str = ""


def has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def device():
    import torch

    return torch.device("cuda", 0) if cuda() else torch.device("cpu")


def reset_peak() -> None:
    import torch

    if cuda():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> str:
    """Peak GPU memory since ``reset_peak`` (CUDA), else the process's peak RSS so far."""
    import torch

    if cuda():
        return f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB GPU"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB RSS (CPU, process peak)"


# ------------------------------------------------------------------------------ models and data


def tiny_model_dir(out: Path) -> Path:
    """A tiny random-init Llama with a character tokenizer, saved as an HF model directory."""
    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    tokenizer = build_char_tokenizer("0123456789+=abcdefghijklmnopqrstuvwxyz ")
    model = build_tiny_model(
        TinyModelInit(hidden_size=256, layers=4, heads=4, max_position_embeddings=1024), tokenizer, 0
    )
    return save_hf(model, tokenizer, out)


def qwen_05b(dtype):
    """Qwen2.5-0.5B-Instruct: the fetched weights when present, else random weights from its config."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (LOCAL_05B / "config.json").exists() and any(LOCAL_05B.glob("*.safetensors")):
        return AutoModelForCausalLM.from_pretrained(str(LOCAL_05B), dtype=dtype), "fetched weights"
    config = Qwen2Config(**json.loads((CONFIGS / "qwen2.5-0.5b-instruct.json").read_text()))
    return AutoModelForCausalLM.from_config(config, dtype=dtype), "random weights from its config"


def random_examples(n: int, vocab: int, min_len: int, max_len: int, seed: int = 0):
    """Sequences of uneven lengths (what dynamic micro-batching is for), loss on their second half."""
    import random

    from backends.data.chat import Example

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        out.append(Example(input_ids=ids, loss_mask=[0] * (length // 2) + [1] * (length - length // 2)))
    return out


# ------------------------------------------------------------------------------ SFT stages


def train_engine(model, bf16: bool):
    """DeepSpeed ZeRO-2 over a torch AdamW, or plain PyTorch when DeepSpeed is missing."""
    import torch

    model.train()  # from_pretrained returns eval mode, where gradient checkpointing is off

    if has("deepspeed"):
        from backends.train.engine import init_distributed, make_engine

        init_distributed("cuda" if cuda() else "cpu")
        engine, _ = make_engine(
            model.to(device()),
            lr=1e-4,
            weight_decay=0.0,
            lr_lambda=lambda s: 1.0,
            zero_stage=2,
            grad_clip=1.0,
            bf16=bf16,
        )
        return engine, "DeepSpeed ZeRO-2"
    return PlainEngine(
        model.to(device()), torch.optim.AdamW(model.parameters(), lr=1e-4)
    ), "plain PyTorch (no DeepSpeed)"


class PlainEngine:
    """The three calls of a DeepSpeed engine that ``backends.train.engine.train_step`` makes."""

    def __init__(self, module, optimizer):
        self.module, self.optimizer, self.device = module, optimizer, next(module.parameters()).device

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss, scale_wrt_gas=False):
        loss.backward()

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def memory_estimate(model, micro, kind: str, bf16: bool) -> dict[str, str]:
    """The planner's estimate of this trainer rank (``skyrl_cli.plan.memory``: ZeRO-2 on one rank, the
    largest micro-batch in tokens, gradient checkpointing as the model has it) beside the measured
    peak, on CUDA. The estimate's CUDA and NCCL reserve is left out: ``max_memory_allocated``
    counts what torch's allocator handed out, not the context."""
    import torch

    from skyrl_cli.plan.memory import TrainerSetup, trainer_rank_memory
    from skyrl_cli.plan.shape import ModelShape

    if not cuda() or not kind.startswith("DeepSpeed"):
        return {}
    shape = ModelShape.from_config(model.config.to_dict())
    if shape is None:
        return {"estimate": f"none: {model.config.model_type} is not a Llama-like decoder"}
    setup = TrainerSetup(
        ranks=1,
        zero_stage=2,
        micro_batch_tokens=max(mb.input_ids.numel() for mb in micro),
        weight_bytes=2 if bf16 else 4,
        gradient_checkpointing=bool(getattr(model, "is_gradient_checkpointing", False)),
    )
    estimate = trainer_rank_memory(shape, setup)
    allocated = estimate.peak - estimate.reserve
    return {
        "estimate": (
            f"{allocated / 2**30:.2f} GiB allocated at {estimate.peak_phase} "
            f"(+{estimate.reserve / 2**30:.1f} GiB CUDA and NCCL reserve)"
        ),
        "measured / estimate": f"{torch.cuda.max_memory_allocated() / allocated:.2f}",
    }


def sft_steps(engine, examples, steps: int, max_tokens: int, pad_id: int = 0, estimate=None) -> dict[str, str]:
    """``steps`` optimizer steps over ``examples`` with dynamic micro-batching; the first step is a
    warm-up (kernels, allocator) and not timed. ``estimate(micro)``: more figures, after the steps."""
    import torch

    from backends.train.engine import train_step
    from backends.train.microbatch import rank_micro_batches
    from backends.train.packing import dynamic_layout

    layout = dynamic_layout([len(e.input_ids) for e in examples], 1, max_tokens, "padding_free")
    micro = rank_micro_batches(examples, layout, 0, pad_id)
    loss_tokens = sum(mb.loss_tokens for mb in micro)
    tokens = sum(len(e.input_ids) for e in examples)
    train_step(engine, micro, loss_tokens, 1)
    reset_peak()
    started = time.perf_counter()
    for _ in range(steps):
        nll = train_step(engine, micro, loss_tokens, 1)
    if cuda():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    return {
        "train tokens/s": f"{tokens * steps / elapsed:,.0f}",
        "step": f"{elapsed / steps * 1000:.0f} ms ({len(micro)} micro-batches, {tokens:,} tokens)",
        "peak memory": peak_memory(),
        **(estimate(micro) if estimate is not None else {}),
        "loss": f"{nll / loss_tokens:.3f}",
    }


def stage_sft_tiny(ctx) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    bf16 = cuda()
    model = AutoModelForCausalLM.from_pretrained(str(ctx.tiny), dtype="bfloat16" if bf16 else "float32")
    engine, kind = train_engine(model, bf16)
    n, max_len = (256, 1024) if cuda() else (max(2, int(8 * ctx.scale)), 128)
    examples = random_examples(n, model.config.vocab_size, 16, max_len)
    estimate = partial(memory_estimate, model, kind=kind, bf16=bf16)
    figures = sft_steps(engine, examples, ctx.steps, 16384 if cuda() else 512, estimate=estimate)
    return {"trainer": f"{kind}, {'bf16' if bf16 else 'fp32'}", **figures}


def stage_sft_05b(ctx) -> dict[str, str]:
    import torch

    if not cuda():
        raise Skip("no CUDA: a 0.5B model's SFT step is minutes on these CPU cores")
    model, source = qwen_05b(torch.bfloat16)
    model.gradient_checkpointing_enable()
    engine, kind = train_engine(model, True)
    examples = random_examples(64, model.config.vocab_size, 64, 1024)
    figures = sft_steps(
        engine, examples, ctx.steps, 16384, estimate=partial(memory_estimate, model, kind=kind, bf16=True)
    )
    return {
        "model": f"Qwen2.5-0.5B ({source}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B)",
        "trainer": f"{kind}, bf16",
        **figures,
    }


# ------------------------------------------------------------------------------ RL learner


def learner_run_dir(root: Path, model_dir: Path, steps: int, prompts: int, samples: int, max_response: int):
    """A run directory as ``skyrl rl`` lays it out, with the recipe and ``steps`` synthetic batches."""
    import random

    from skyrl_contracts.atomic import write_json
    from skyrl_contracts.exchange import RunExchange
    from skyrl_contracts.rundir import RunDir, recipe_json
    from skyrl_contracts.samples import Sample
    from skyrl_contracts.schema import Recipe

    recipe = Recipe.model_validate(
        {
            "name": "gpu-check",
            "model": {"path": str(model_dir)},
            "data": {"task": "addition"},
            "rl": {
                "init_from": str(model_dir),
                "steps": steps,
                "prompts_per_step": prompts,
                "samples_per_prompt": samples,
                "max_new_tokens": max_response,
                "save_every": 0,
                "mini_batches": 2,
                "eval_every": 0,
            },
            "trainer": {"ranks": 1, "zero_stage": 2},
        }
    )
    paths = RunDir(root)
    write_json(paths.resolved_recipe, recipe_json(recipe))
    rng, exchange = random.Random(0), RunExchange(root)
    for step in range(steps):
        batch = []
        for p in range(prompts):
            prompt = [rng.randrange(3, 40) for _ in range(32)]
            for i in range(samples):
                n = rng.randint(8, max_response)
                batch.append(
                    Sample(
                        f"s{step}p{p}",
                        i,
                        prompt,
                        [rng.randrange(3, 40) for _ in range(n)],
                        [1] * n,
                        [-3.0] * n,
                        reward=float(rng.random() < 0.5),
                        policy_versions=(step,),
                    ).to_dict()
                )
        exchange.write_batch(step, {"step": step, "samples": batch})
    return recipe


def stage_rl_learner(ctx) -> dict[str, str]:
    """The learner as ``skyrl rl`` starts it with ``--weight-sync nccl`` but no engine to send to:
    where vLLM is missing, its NCCL set-up must fail over to the disk path (one line) and train on."""
    from backends.train.rl_learner import Learner, NcclTarget
    from skyrl_contracts.events import iter_events
    from skyrl_contracts.ports import find_free_ports

    if not has("deepspeed"):
        raise Skip(
            "no DeepSpeed: the RL learner is a DeepSpeed process (carry it: scripts/gpu-check.sh --fetch-wheels)"
        )
    run_dir = ctx.tmp / "rl-run"
    steps = max(2, ctx.steps)
    learner_run_dir(run_dir, ctx.tiny, steps, 16 if cuda() else max(1, int(2 * ctx.scale)), 4, 256 if cuda() else 48)
    reset_peak()
    # On CUDA with vLLM an absent engine would leave the NCCL rendezvous waiting: ask for NCCL only elsewhere.
    exercised = not (cuda() and has("vllm"))
    nccl = NcclTarget(("http://127.0.0.1:9",), 1, f"127.0.0.1:{find_free_ports(1)[0]}") if exercised else None
    learner = Learner(run_dir, ctx.tiny, resume=False, weight_sync="nccl" if nccl else "disk", nccl=nccl)
    fell_back = nccl is not None and learner.sender is None
    learner.run()
    if exercised and not fell_back:
        raise RuntimeError("the learner set up NCCL with no engine to send to")
    series: dict[str, list[float]] = {}
    for event in iter_events(run_dir / "events.jsonl"):
        series.setdefault(event.name, []).append(event.value)
    mean = lambda key: sum(series[key][1:]) / len(series[key][1:])  # noqa: E731 - the first step is a warm-up
    return {
        "learner": f"{steps} steps, 2 updates each, {'bf16' if cuda() else 'fp32'}",
        "train tokens/s": f"{mean('train/tokens_per_s'):,.0f}",
        "publish (disk) per step": f"{mean('timing/publish_weights_s') * 1000:.0f} ms (tiny model, safetensors)",
        "NCCL fallback": ("asked for NCCL, set-up failed, fell back to disk" if fell_back else "FAILED to fall back")
        if exercised
        else "not exercised (CUDA and vLLM here: the vllm stage runs NCCL)",
        "peak memory": peak_memory(),
    }


# ------------------------------------------------------------------------------ later issues' PyTorch parts


def stage_int4_qat(ctx) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    if not has("torchao"):
        raise Skip("no torchao: INT4 fake-quant is torchao's QAT")
    from backends.quant.fake_quant import prepare_qat
    from skyrl_contracts.schema import QuantizationConfig

    model = AutoModelForCausalLM.from_pretrained(str(ctx.tiny), dtype="float32")
    layers = prepare_qat(model, QuantizationConfig(group_size=32))
    engine, kind = train_engine(model, False)
    n, max_len = (128, 256) if cuda() else (max(2, int(8 * ctx.scale)), 128)
    figures = sft_steps(
        engine, random_examples(n, model.config.vocab_size, 16, max_len), ctx.steps, 8192 if cuda() else 512
    )
    return {"trainer": f"{kind}, fp32, {len(layers)} fake-quantized Linear layers", **figures}


def stage_tinker_lora(ctx) -> dict[str, str]:
    import numpy as np
    import torch

    from backends.tinker.lora_engine import DatumIn, LoraEngine, WorkItem

    engine = LoraEngine(ctx.tiny, max_rank=16, max_adapters=4, device=str(device()))
    ids = [f"tenant-{i}" for i in range(4)]
    for k, model_id in enumerate(ids):
        engine.create_adapter(model_id, 8, LoraEngine.modules_for(True, True, False), seed=k)
    n, length = (32, 512) if cuda() else (max(1, int(2 * ctx.scale)), 64)
    rng = np.random.default_rng(0)

    def item(model_id):
        datums = []
        for _ in range(n):
            toks = rng.integers(3, 40, length).tolist()
            datums.append(DatumIn(toks, toks[1:] + [0], {"weights": np.ones(length, dtype=np.float32)}))
        return WorkItem(model_id, datums, "cross_entropy", {})

    items = [item(m) for m in ids]
    engine.run(items, with_grad=True)  # warm-up
    reset_peak()
    timed = {}
    for name, batches in (("batched", [items]), ("one adapter at a time", [[i] for i in items])):
        started = time.perf_counter()
        for batch in batches:
            engine.run(batch, with_grad=True)
        if cuda():
            torch.cuda.synchronize()
        timed[name] = time.perf_counter() - started
    tokens = 4 * n * length
    return {
        "fwd+bwd tokens/s": f"{tokens / timed['batched']:,.0f} batched over 4 adapters vs {tokens / timed['one adapter at a time']:,.0f} one at a time",
        "ratio": f"{timed['one adapter at a time'] / timed['batched']:.2f}x",
        "peak memory": peak_memory(),
    }


# ------------------------------------------------------------------------------ tied heads


def stage_tied_sync(ctx) -> dict[str, str]:
    """Tied Llama / Qwen2 / Qwen3 models on this device: the version the learner publishes for the
    engines (``save_for_engines``, head written out) and the engines' starting copy
    (``write_untied_copy``) load untied in transformers and give the tied model's logprobs exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    from backends.inference.sync_check import fixed_sequence, moved_policy, transformers_logprobs
    from backends.models.loading import save_hf
    from backends.models.tied import save_for_engines, tied_head, write_untied_copy
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    dev = device()
    dtype = torch.bfloat16 if cuda() else torch.float32
    tokenizer = build_char_tokenizer("0123456789+=abcdefghijklmnopqrstuvwxyz ")
    figures = {}
    for arch in ("llama", "qwen2", "qwen3"):
        init = TinyModelInit(arch=arch, hidden_size=256, layers=2, heads=4, tie_embeddings=True)
        initial = save_hf(build_tiny_model(init, tokenizer, 0), tokenizer, ctx.tmp / f"tied-{arch}" / "initial")
        write_untied_copy(initial, ctx.tmp / f"tied-{arch}" / "engine-model")
        moved = moved_policy(AutoModelForCausalLM.from_pretrained(str(initial), dtype=dtype)).to(dev).eval()
        save_for_engines(moved, tokenizer, ctx.tmp / f"tied-{arch}" / "v1")
        ids = fixed_sequence(moved.config.vocab_size)
        initial_model = AutoModelForCausalLM.from_pretrained(str(initial), dtype=dtype).to(dev).eval()
        gaps = []
        for reference, exported in ((moved, "v1"), (initial_model, "engine-model")):
            loaded = AutoModelForCausalLM.from_pretrained(str(ctx.tmp / f"tied-{arch}" / exported), dtype=dtype)
            loaded = loaded.to(dev).eval()
            if tied_head(loaded) is not None:
                raise AssertionError(f"{arch}: {exported} loads tied")
            pairs = zip(transformers_logprobs(reference, ids), transformers_logprobs(loaded, ids))
            gaps.append(max(abs(a - b) for a, b in pairs))
        if max(gaps) > 0:
            raise AssertionError(f"{arch}: exported weights give other logprobs ({gaps})")
        figures[arch] = (
            f"version and engine copy equal the tied model ({str(dtype).split('.')[-1]}, {dev}): gap {max(gaps):.1e}"
        )
    return figures


# ------------------------------------------------------------------------------ delta weight sync


def stage_delta_sync(ctx) -> dict[str, str]:
    """The delta weight sync's round trip at the 0.5B recipe's size, without vLLM: Qwen2.5-0.5B in
    fp32 master weights, ``ctx.steps`` Adam steps at the recipe's RL learning rate (1e-6) on an LM
    loss; each version taken for bf16 engines (``engine_state``, device to host), written whole and as
    a delta, then read back whole and applied to the version before (what an engine does), checked
    bit for bit."""
    import statistics

    import torch

    from backends.inference.deltas import apply_delta, as_ints, read_full, write_delta
    from backends.models.tied import engine_state, save_engine_state

    dev = device()
    model, source = qwen_05b(torch.float32)
    model.to(dev).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    examples = random_examples(8, model.config.vocab_size, 64, 256)
    rows: dict[str, list[float]] = {
        k: [] for k in ("take", "whole_w", "delta_w", "whole_r", "apply", "bytes", "changed")
    }
    previous = engine_state(model, dtype="bfloat16")
    for step in range(max(ctx.steps, 3)):
        batch = torch.tensor([examples[step % len(examples)].input_ids], device=dev)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        current = engine_state(model, dtype="bfloat16")
        t1 = time.perf_counter()
        whole, delta = ctx.tmp / f"delta-whole-{step}", ctx.tmp / f"delta-{step}"
        save_engine_state(model, None, whole, current)
        t2 = time.perf_counter()
        delta.mkdir(parents=True)
        stats = write_delta(delta, step + 1, step, 0, previous, current)
        t3 = time.perf_counter()
        read_full(whole)
        t4 = time.perf_counter()
        applied = apply_delta(delta, step, previous)
        t5 = time.perf_counter()
        if any(not torch.equal(as_ints(applied[k]), as_ints(current[k])) for k in current):
            raise AssertionError(f"step {step}: the applied delta differs from the version")
        for key, value in zip(
            rows, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, stats.delta_bytes, stats.changed_fraction)
        ):
            rows[key].append(value)
        previous = current
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "model": f"Qwen2.5-0.5B ({source}), AdamW lr 1e-6, {len(rows['take'])} versions, bf16 engines",
        "version whole": f"{stats.full_bytes / 1e6:.0f} MB; delta {med['bytes'] / 1e6:.1f} MB (median), elements changed {med['changed']:.4f}",
        "learner": f"take {med['take']:.2f} s, write whole {med['whole_w']:.2f} s, write delta {med['delta_w']:.2f} s",
        "engine side": f"read whole {med['whole_r']:.2f} s, apply + check delta {med['apply']:.2f} s (bit-exact)",
    }


# ------------------------------------------------------------------------------ vLLM


def stage_vllm(ctx) -> dict[str, str]:
    if not has("vllm"):
        raise Skip("vLLM is not installed here")
    from benchmarks.gpu_check_vllm import run_vllm_stage

    return run_vllm_stage(ctx)


# ------------------------------------------------------------------------------ driver


STAGES: dict[str, Callable] = {
    "sft-tiny": stage_sft_tiny,
    "sft-0.5b": stage_sft_05b,
    "rl-learner": stage_rl_learner,
    "int4-qat": stage_int4_qat,
    "tinker-lora": stage_tinker_lora,
    "tied-sync": stage_tied_sync,
    "delta-sync": stage_delta_sync,
    "vllm": stage_vllm,
}


@dataclass
class Context:
    tmp: Path
    tiny: Path
    steps: int
    scale: float


def run_stage(name: str, fn: Callable, ctx: Context) -> Outcome:
    print(f"== {name}", flush=True)
    started = time.perf_counter()
    try:
        figures = fn(ctx)
    except Skip as skip:
        print(f"   skipped: {skip}", flush=True)
        return Outcome(name, "skipped", time.perf_counter() - started, note=str(skip))
    except Exception as err:  # noqa: BLE001 - one failed stage must not hide the others
        traceback.print_exc()
        return Outcome(name, "FAILED", time.perf_counter() - started, note=f"{type(err).__name__}: {err}"[:300])
    outcome = Outcome(name, "ok", time.perf_counter() - started, figures)
    for key, value in figures.items():
        print(f"   {key}: {value}", flush=True)
    return outcome


def machine_line() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if cuda() else "no CUDA"
    ds = "deepspeed " + __import__("deepspeed").__version__ if has("deepspeed") else "no DeepSpeed"
    vllm = "vLLM installed" if has("vllm") else "no vLLM"
    return f"torch {torch.__version__}, {gpu}, {os.cpu_count()} CPUs, {ds}, {vllm}, python {sys.version.split()[0]}"


def print_table(outcomes: list[Outcome], total_s: float) -> None:
    print("\n" + "=" * 100)
    print(f"gpu-check: {machine_line()}")
    print(f"{'stage':<12} {'status':<8} {'time':>7}  figures / reason")
    for o in outcomes:
        lines = [f"{k}: {v}" for k, v in o.figures.items()] or [o.note]
        print(f"{o.stage:<12} {o.status:<8} {o.seconds:>6.1f}s  {lines[0]}")
        for line in lines[1:]:
            print(f"{'':<30} {line}")
    failed = [o.stage for o in outcomes if o.status == "FAILED"]
    print(
        f"total {total_s:.0f} s; {len(outcomes) - len(failed)} of {len(outcomes)} stages passed or skipped"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=list(STAGES), help="run only these stages (repeatable)")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per training stage (default: 5 on CUDA, 2 on CPU)"
    )
    parser.add_argument("--scale", type=float, default=1.0, help="CPU batch sizes x this")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    print(f"gpu-check: {machine_line()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="skyrl-gpu-check-"))
    try:
        ctx = Context(tmp, tiny_model_dir(tmp / "tiny"), args.steps or (5 if cuda() else 2), args.scale)
        outcomes = [run_stage(n, STAGES[n], ctx) for n in (args.only or STAGES)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(outcomes, time.perf_counter() - started)
    return 1 if any(o.status == "FAILED" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Adapter sync vs full-weight sync: the time from "the learner has a new policy" to "every engine
serves it", for the same model on the same engine.

- baseline (full weights): the learner writes the whole model (``save_pretrained``, what
  ``weights/v<k>/`` holds without LoRA) and the engine reloads it (``sync_weights``: pause in keep
  mode, ``reload_weights``, label, resume);
- subject (LoRA): the learner writes the adapter only (``weights/v<k>/`` with LoRA) and the engine
  loads it under a new versioned name (``EngineAdapters.load``: ``/v1/load_lora_adapter``, label, no
  pause), after unloading the previous version (``retire``), as the RL orchestrator does.

One engine is started once, with LoRA enabled (``--max-loras 2``, the sync plan's); baseline and
subject alternate within each repetition on the same engine; the weights change between versions
(a perturbation of every trainable tensor), so no path can skip work. Timings are end to end
(write + sync), and the sync alone; the median ratio (adapter / full) is printed last.

    python benchmarks/bench_lora_sync.py                              # quickstart-size model, 7 reps
    python benchmarks/bench_lora_sync.py --hidden 512 --layers 8 --rank 16 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_model(out: Path, hidden: int, layers: int):
    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    tokenizer = build_char_tokenizer("0123456789+=")
    heads = max(1, hidden // 32)  # head size 32: one vLLM serves
    model = build_tiny_model(
        TinyModelInit(hidden_size=hidden, layers=layers, heads=heads, intermediate_size=4 * hidden), tokenizer, 0
    )
    save_hf(model, tokenizer, out)
    return model, tokenizer


def perturb(model, trainable_only: bool) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad or not trainable_only:
                p.add_(torch.randn_like(p) * 1e-3)


def full_sync(url, model, work: Path, version: int) -> tuple[float, float]:
    from backends.inference.weight_sync import run_blocking, sync_weights

    t0 = time.perf_counter()
    out = work / f"full-v{version}"
    model.save_pretrained(out, safe_serialization=True)
    t1 = time.perf_counter()
    run_blocking(sync_weights([url], out, version))
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def adapter_sync(engines, peft_model, work: Path, version: int) -> tuple[float, float]:
    from backends.inference.weight_sync import run_blocking
    from backends.models.lora import save_adapter

    t0 = time.perf_counter()
    out = save_adapter(peft_model, work / f"adapter-v{version}")
    t1 = time.perf_counter()
    run_blocking(engines.load(version, out))
    run_blocking(engines.retire({}))  # the previous version, idle: unloaded as the orchestrator does
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()

    from backends.inference.weight_sync import EngineAdapters
    from backends.models.lora import apply_lora
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import Machine, engine_specs, engine_url
    from skyrl_cli.recipe.lengths import with_model_lengths
    from skyrl_contracts.ports import find_free_ports
    from skyrl_contracts.schema import LoraConfig, Recipe

    work = Path(tempfile.mkdtemp(prefix="bench-lora-sync-"))
    full_model, _ = build_model(work / "base", args.hidden, args.layers)
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, target_modules=ALL_LINEAR)
    peft_model = apply_lora(build_model(work / "unused", args.hidden, args.layers)[0], lora)
    n_full = sum(p.numel() for p in full_model.parameters())
    n_lora = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    recipe = with_model_lengths(
        Recipe.model_validate(
            {
                "name": "bench",
                "model": {"path": str(work / "base"), "lora": lora.model_dump()},
                "data": {"task": "addition"},
                "rl": {},
                "inference": {"engines": 1},
            }
        )
    )
    cores = tuple(sorted(os.sched_getaffinity(0)))
    machine = Machine(device="cpu", engine_cores=cores)
    (port,) = find_free_ports(1)
    (spec,) = engine_specs(recipe, machine, [port], str(work / "base"))
    print(
        f"model: Llama hidden {args.hidden}, {args.layers} layers, {n_full:,} parameters; LoRA rank {args.rank} on "
        f"all linear layers, {n_lora:,} parameters ({n_lora / n_full:.1%}); 1 engine, {len(cores)} cores, {spec.env.get('VLLM_CPU_OMP_THREADS_BIND')} bound"
    )
    with Supervisor(work / "run") as sup:
        sup.start(spec)
        sup.wait_ready([spec.name])
        url = engine_url(machine, port)
        engines = EngineAdapters([url], work / "run")
        adapter_sync(engines, peft_model, work, 0)  # warm-up of both paths
        full_sync(url, full_model, work, 0)
        ratios, sync_ratios = [], []
        for rep in range(1, args.reps + 1):
            perturb(full_model, trainable_only=False)
            perturb(peft_model, trainable_only=True)
            full_total, full_only = full_sync(url, full_model, work, rep)
            lora_total, lora_only = adapter_sync(engines, peft_model, work, rep)
            ratios.append(lora_total / full_total)
            sync_ratios.append(lora_only / full_only)
            print(
                f"  rep {rep}: full weights {full_total * 1e3:7.1f} ms (engine {full_only * 1e3:6.1f})  "
                f"adapter {lora_total * 1e3:7.1f} ms (engine {lora_only * 1e3:6.1f})  ratio {ratios[-1]:.2f}"
            )
    print(f"median engine-only ratio adapter / full-weight sync: {statistics.median(sync_ratios):.2f}x")
    print(f"median sync time ratio (write + engine load) adapter / full weights: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()

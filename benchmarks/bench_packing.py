"""Dynamic micro-batching vs fixed-count micro-batches: training tokens/s on a long-tailed length mix.

Same model (the quickstart's tiny Llama), same data, same global batch, same DeepSpeed engine
(ZeRO-2, 2 CPU ranks under torchrun); only the micro-batch layout differs:

- fixed:   every rank takes every 2nd sequence, ``--micro-batch-size`` sequences per micro-batch,
           right-padded to the longest in the micro-batch (the baseline);
- dynamic: tokens balanced across ranks, sorted padded micro-batches up to ``--max-tokens``, equal
           micro-batch counts through zero-weight padding micro-batches (the trainer's CPU default);
- dynamic padding-free: the same budget, sequences concatenated in one row (shown to justify the
           CPU default: sdpa then computes the full (sum L)^2 attention).

Modes alternate within each repetition (machine noise hits all of them); the median tokens/s ratio
against fixed is printed last.

    python benchmarks/bench_packing.py                 # 5 repetitions x 4 steps per mode
    python benchmarks/bench_packing.py --reps 3 --steps 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("fixed", "dynamic", "dynamic-padding-free")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per mode per repetition")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per optimizer step (global)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="fixed mode: sequences per micro-batch")
    p.add_argument("--max-tokens", type=int, default=2048, help="dynamic mode: token budget per micro-batch")
    p.add_argument("--overhead-tokens", type=int, default=None, help="dynamic mode: cost of one more micro-batch")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def long_tailed_lengths(n: int, seed: int, lo: int = 16, hi: int = 512) -> list[int]:
    """Log-normal lengths (median about 60 tokens, a tail to ``hi``), like SFT chat data."""
    import random

    rng = random.Random(seed)
    return [max(lo, min(hi, int(rng.lognormvariate(4.1, 0.8)))) for _ in range(n)]


def synthetic_batch(step: int, batch_size: int, vocab: int):
    import random

    from backends.data.chat import Example

    rng = random.Random(1000 + step)
    out = []
    for length in long_tailed_lengths(batch_size, seed=step):
        ids = tuple(rng.randrange(3, vocab) for _ in range(length))
        prompt = length // 3
        out.append(Example(ids, tuple(int(i >= prompt) for i in range(length))))
    return out


def worker(args) -> None:
    import logging

    import deepspeed
    import torch.distributed as dist

    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from backends.train.engine import init_distributed, make_engine, train_step
    from backends.train.microbatch import rank_micro_batches
    from backends.train.packing import dynamic_layout, fixed_layout
    from skyrl_contracts.schema import TinyModelInit

    deepspeed.utils.logger.setLevel(logging.WARNING)
    d = init_distributed("cpu")
    tokenizer = build_char_tokenizer("0123456789+=abcdefghijklmnopqrstuvwxyz")
    init = TinyModelInit(hidden_size=128, layers=4, heads=4, intermediate_size=512, max_position_embeddings=512)
    model = build_tiny_model(init, tokenizer, seed=0)
    engine, _ = make_engine(
        model, lr=1e-4, weight_decay=0.0, lr_lambda=lambda s: 1.0, zero_stage=2, grad_clip=1.0, bf16=False
    )
    pad = tokenizer.pad_token_id

    def layout_for(mode, lengths):
        if mode == "fixed":
            return fixed_layout(len(lengths), d.world_size, args.micro_batch_size)
        kind = "padding_free" if mode == "dynamic-padding-free" else "padded"
        extra = {} if args.overhead_tokens is None else {"overhead_tokens": args.overhead_tokens}
        return dynamic_layout(lengths, d.world_size, args.max_tokens, kind, **extra)

    def run(mode, first_step):
        tokens, efficiency, micro = 0, [], []
        dist.barrier()
        start = time.perf_counter()
        for step in range(first_step, first_step + args.steps):
            batch = synthetic_batch(step, args.batch_size, len(tokenizer))
            lengths = [len(ex) for ex in batch]
            layout = layout_for(mode, lengths)
            mbs = rank_micro_batches(batch, layout, d.rank, pad)
            train_step(engine, mbs, sum(ex.loss_tokens for ex in batch), d.world_size)
            tokens += sum(lengths)
            efficiency.append(layout.packing_efficiency(lengths))
            micro.append(layout.num_microbatches)
        dist.barrier()
        return tokens / (time.perf_counter() - start), statistics.mean(efficiency), statistics.mean(micro)

    run("dynamic", 10_000)  # warm-up (allocator, first-call costs)
    results = {m: [] for m in MODES}
    for rep in range(args.reps):
        order = MODES if rep % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            results[mode].append(run(mode, rep * args.steps))  # the same batches for every mode
        if d.is_main:
            line = "  ".join(f"{m}: {results[m][-1][0]:,.0f} tok/s" for m in MODES)
            print(f"rep {rep + 1}/{args.reps}: {line}", flush=True)
    if d.is_main:
        report(args, results)
    dist.destroy_process_group()


def report(args, results) -> None:
    fixed = [r[0] for r in results["fixed"]]
    print()
    print(
        f"long-tailed lengths (log-normal, 16..512 tokens), global batch {args.batch_size}, {args.ranks} ranks ZeRO-2, "
        f"fixed micro_batch_size {args.micro_batch_size}, dynamic max_tokens {args.max_tokens}"
    )
    print(f"{'mode':<22}{'tokens/s (median)':>20}{'packing eff.':>14}{'micro-batches/step':>20}{'ratio vs fixed':>16}")
    for mode in MODES:
        tps = [r[0] for r in results[mode]]
        ratios = [a / b for a, b in zip(tps, fixed)]
        print(
            f"{mode:<22}{statistics.median(tps):>20,.0f}{results[mode][0][1]:>14.1%}"
            f"{results[mode][0][2]:>20.1f}{statistics.median(ratios):>15.2f}x"
        )
    ratios = [a / b for a, b in zip([r[0] for r in results["dynamic"]], fixed)]
    print(
        f"\ndynamic / fixed tokens/s: median {statistics.median(ratios):.2f}x over {len(ratios)} repetitions "
        f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x)"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    threads = max(1, (os.cpu_count() or 1) // args.ranks)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions")),
        "PYTHONPATH": str(REPO),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.ranks),
        __file__,
        "--worker",
        *(argv if argv is not None else sys.argv[1:]),
    ]
    return subprocess.call(cmd, env=env, cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())

"""Rollout speed with INT4: vLLM generation tokens/s of the W4A16 export against the same model in
16 bits, same requests, at sizes where decoding reads more weights than the caches hold.

Per size, a random-init Llama (the char tokenizer; the weights' values do not change the work) is
saved in full precision and exported as INT4 W4A16 by round-to-nearest (``export_rtn``, what
``skyrl quantize --ptq`` and ``quantization.int4_rollouts`` serve). Both checkpoints are served at
once by one vLLM engine each, started by the RL stage's plan functions (``engine_specs``: the
recipe's dtype, here the engines' 16-bit type), so the idle one costs both the same. For every
repetition and concurrency the two engines take turns on the same requests: ``--concurrency``
sessions of ``--max-tokens`` tokens each, eos ignored, temperature 1. The INT4 / 16-bit ratio of
the median tokens/s is printed last per size and concurrency.

    python benchmarks/bench_int4_speed.py                       # 50M and 120M, concurrency 1 and 16
    python benchmarks/bench_int4_speed.py --sizes 10M --reps 5

``build_pair`` and ``run_side_by_side`` are also the INT4 figure of ``scripts/gpu-check.sh``'s vLLM
stage (a 1B model on a GPU there: ``benchmarks/gpu_check_vllm.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> (hidden, layers, heads, intermediate): Llama shapes whose Linear widths group 128 divides
# (vLLM's usual INT4 group; the CPU kernel needs multiples of 32) and whose head size vLLM serves.
SIZES = {
    "10M": (256, 10, 4, 1024),
    "50M": (512, 12, 8, 2048),
    "120M": (768, 12, 12, 3072),
    "350M": (1024, 24, 16, 4096),
    "1B": (2048, 16, 16, 8192),  # the GPU check's (scripts/gpu-check.sh)
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["50M", "120M"], choices=sorted(SIZES))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--group-size", default="128", help="32, 64, 128 or channel")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def build_pair(size: str, out: Path, group_size) -> tuple[Path, Path, int]:
    """The full-precision model directory, its INT4 export, and the parameter count."""
    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from backends.quant.export import export_rtn
    from skyrl_contracts.schema import QuantizationConfig, TinyModelInit

    hidden, layers, heads, intermediate = SIZES[size]
    init = TinyModelInit(hidden_size=hidden, layers=layers, heads=heads, intermediate_size=intermediate)
    tokenizer = build_char_tokenizer(string.digits + string.ascii_lowercase + " +-*=?.,")
    model = build_tiny_model(init, tokenizer, seed=0)
    params = sum(p.numel() for p in model.parameters())
    full = save_hf(model, tokenizer, out / f"{size}-full")
    export_rtn(full, out / f"{size}-int4", QuantizationConfig(group_size=group_size))
    return full, out / f"{size}-int4", params


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(7, 43) for _ in range(15)] for _ in range(n)]


async def tokens_per_s(url: str, batch: list[list[int]], max_tokens: int, tag: str, temperature: float = 1.0) -> float:
    """Generated tokens per second of ``batch`` sent at once, every answer ``max_tokens`` long."""
    from backends.rollout.client import RolloutClient

    async with RolloutClient(url, max_concurrency=len(batch), timeout_s=1200) as client:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(client.generate(p, f"{tag}-{i}", max_tokens, temperature, ignore_eos=True) for i, p in enumerate(batch))
        )
        seconds = time.perf_counter() - started
    generated = sum(len(c.token_ids) for choices in results for c in choices)
    assert generated == len(batch) * max_tokens, generated
    return generated / seconds


def _recipe(model_dir: Path, on_gpu: bool):
    from skyrl_cli.recipe.lengths import with_model_lengths
    from skyrl_contracts.schema import Recipe

    inference = {"engines": 1, "max_model_len": 512, "max_num_seqs": 64, "kv_cache_bytes": 256 * 2**20}
    if on_gpu:
        inference["gpu_memory_utilization"] = 0.2
    recipe = {"name": "int4-speed", "model": {"path": str(model_dir)}, "data": {"task": "addition"}, "rl": {}}
    return with_model_lengths(Recipe.model_validate({**recipe, "inference": inference}))


def run_side_by_side(
    sides: dict[str, Path], work: Path, concurrency: list[int], max_tokens: int, reps: int, engine_gpu: int | None
) -> dict[tuple[str, int], list[float]]:
    """``{(side, concurrency): [tokens/s per repetition]}``: one engine per side, all up at once,
    taking turns on the same requests (on ``engine_gpu`` when given, else each on every CPU core:
    only one generates at a time)."""
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import Machine, engine_specs, engine_url
    from skyrl_contracts.ports import find_free_ports

    if engine_gpu is not None:
        machine = Machine("cuda", engine_gpus=(engine_gpu,))
    else:
        machine = Machine(device="cpu", engine_cores=tuple(sorted(os.sched_getaffinity(0))))
    ports = find_free_ports(len(sides))
    specs, urls = [], {}
    for port, (side, model_dir) in zip(ports, sides.items()):  # each engine on every core (or the GPU)
        (spec,) = engine_specs(_recipe(model_dir, engine_gpu is not None), machine, [port], str(model_dir))
        specs.append(spec.model_copy(update={"name": f"engine-{side}"}))
        urls[side] = engine_url(machine, port)
    figures: dict[tuple[str, int], list[float]] = {}
    with Supervisor(work) as sup:
        for spec in specs:
            sup.start(spec)
        sup.wait_ready([s.name for s in specs])
        for side, url in urls.items():  # warm-up: first requests build kernels for their shapes
            for n in concurrency:
                asyncio.run(tokens_per_s(url, prompts(n, seed=-1), 4, f"warm-{side}-{n}"))
        for rep in range(reps):
            for n in concurrency:
                order = list(urls) if rep % 2 == 0 else list(urls)[::-1]
                for side in order:
                    rate = asyncio.run(tokens_per_s(urls[side], prompts(n, seed=rep), max_tokens, f"r{rep}-{side}-{n}"))
                    figures.setdefault((side, n), []).append(rate)
                    print(f"  rep {rep} concurrency {n:3d} {side:5s} {rate:9.1f} tokens/s", flush=True)
    return figures


def main(argv=None) -> None:
    args = parse_args(argv)
    group_size = args.group_size if args.group_size == "channel" else int(args.group_size)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-int4-speed-"))
    from backends.quant.export import weights_bytes
    from skyrl_cli.plan.machine import cpu_has_native_bf16

    print(
        f"engines in {'bf16' if cpu_has_native_bf16() else 'fp32 (no native bf16 on this CPU)'}; INT4 group {group_size}"
    )
    lines = []
    for size in args.sizes:
        full, int4, params = build_pair(size, out, group_size)
        print(
            f"{size}: {params / 1e6:.1f}M parameters, INT4 export {weights_bytes(int4) / weights_bytes(full):.3f}x the fp32 files"
        )
        figures = run_side_by_side(
            {"16bit": full, "int4": int4}, out / f"serve-{size}", args.concurrency, args.max_tokens, args.reps, None
        )
        for n in args.concurrency:
            base, quant = statistics.median(figures[("16bit", n)]), statistics.median(figures[("int4", n)])
            lines.append(
                f"{size} ({params / 1e6:.0f}M), concurrency {n}: INT4 {quant:.1f} vs 16-bit {base:.1f} tokens/s "
                f"(medians of {args.reps}): {quant / base:.2f}x"
            )
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()

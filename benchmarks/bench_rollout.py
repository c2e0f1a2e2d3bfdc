"""Rollout throughput: vLLM engines behind vllm-router vs transformers ``generate`` in one process.

The workload is one RL rollout batch: ``--prompts`` prompts x ``--samples`` samples, temperature
1.0, with the quickstart-sized tiny Llama (hidden 128, 4 layers). Response lengths are fixed by the
benchmark (eos ignored on both sides, so both produce the same tokens):

- ``--lengths fixed``: every response is ``--max-tokens`` long (transformers' best case);
- ``--lengths uniform``: response lengths uniform in [1, ``--max-tokens``], like sampled responses
  that end at eos. transformers' batch runs until its longest sequence ends, so only the tokens
  before each sequence's end count as rollout tokens; engines stop each sequence at its length.

- baseline: transformers ``generate`` in this process, all sequences in one batch (KV cache on,
  fp32 like the CPU trainer, all cores): what a user without vLLM would get.
- subject:  the same prompts through the router with the rollout client (one session per
  trajectory, concurrency = all requests), for each engine count in ``--engines`` (the planner's
  layout: one core per engine).

Baseline and subject alternate within each repetition; the median tokens/s ratio (engines /
transformers) is printed last, one line per engine count.

    python benchmarks/bench_rollout.py                       # 5 repetitions, 1 and 2 engines
    python benchmarks/bench_rollout.py --reps 3 --engines 2
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (GRPO group size)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--lengths", choices=("fixed", "uniform"), default="fixed")
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--grouped",
        action="store_true",
        help="one request with n=samples per prompt (default: one session per trajectory)",
    )
    return p.parse_args(argv)


def build_model(out_dir: Path) -> Path:
    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    tokenizer = build_char_tokenizer(string.digits + string.ascii_lowercase + " +-*=?.,")
    model = build_tiny_model(TinyModelInit(hidden_size=128, layers=4, heads=4), tokenizer, seed=0)
    return save_hf(model, tokenizer, out_dir)


def make_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(7, 43) for _ in range(length - 1)] for _ in range(n)]


def response_lengths(n: int, max_tokens: int, kind: str, seed: int = 1) -> list[int]:
    if kind == "fixed":
        return [max_tokens] * n
    rng = random.Random(seed)
    return [rng.randint(1, max_tokens) for _ in range(n)]


def transformers_tokens_per_s(model, prompts, samples: int, lengths: list[int]) -> float:
    import torch

    max_tokens = max(lengths)
    ids = torch.tensor(prompts)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            num_return_sequences=samples,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=0,
        )
    seconds = time.perf_counter() - started
    assert out.shape == (len(prompts) * samples, ids.shape[1] + max_tokens), out.shape
    return sum(lengths) / seconds  # a sequence's tokens after its own end are padding


async def engine_rollout(
    router_url: str, prompts, samples: int, lengths: list[int], rep: int, grouped: bool = False
) -> float:
    """``lengths[i * samples + j]``: the response length of sample j of prompt i."""
    from backends.rollout.client import RolloutClient

    if grouped:  # one request per prompt, n samples (single-turn tasks can do this; fixed lengths only)
        requests = [(p, f"r{rep}-p{i}", samples, max(lengths)) for i, p in enumerate(prompts)]
    else:  # one session per trajectory (what multi-turn rollouts need)
        requests = [
            (p, f"r{rep}-p{i}-s{j}", 1, lengths[i * samples + j]) for i, p in enumerate(prompts) for j in range(samples)
        ]
    async with RolloutClient(router_url, max_concurrency=len(requests), timeout_s=600) as client:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(client.generate(p, sid, length, 1.0, n=n, ignore_eos=True) for p, sid, n, length in requests)
        )
        seconds = time.perf_counter() - started
        await asyncio.gather(*(client.finish_session(sid) for sid in {r[1] for r in requests}))
    generated = sum(len(c.token_ids) for choices in results for c in choices)
    assert generated == sum(r[2] * r[3] for r in requests), generated
    return generated / seconds


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from skyrl_cli.engines.stack import launch_inference
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import Machine, all_engine_urls, engine_specs, engine_url, router_spec
    from skyrl_contracts.schema import Recipe

    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    model_dir = build_model(work / "model")
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = make_prompts(args.prompts, args.prompt_len)
    lengths = response_lengths(args.prompts * args.samples, args.max_tokens, args.lengths)
    if args.grouped and args.lengths != "fixed":
        raise SystemExit("--grouped needs --lengths fixed (one length per request)")
    cores = tuple(sorted(os.sched_getaffinity(0)))
    print(
        f"workload: {args.prompts} prompts x {args.samples} samples x {args.lengths} lengths <= {args.max_tokens} tokens "
        f"({'n samples per request' if args.grouped else 'one session per trajectory'}), "
        f"tiny Llama (hidden 128, 4 layers), {len(cores)} cores, torch threads {torch.get_num_threads()}"
    )
    summary = []
    for n_engines in args.engines:
        recipe = Recipe.model_validate(
            {
                "name": "bench",
                "model": {"path": str(model_dir)},
                "data": {"task": "addition"},
                "rl": {},
                "inference": {"engines": n_engines, "max_num_seqs": 256, "kv_cache_bytes": 256 * 2**20},
            }
        )
        machine = Machine(device="cpu", engine_cores=cores)
        *ports, router_port, prometheus_port = free_ports(n_engines + 2)
        urls = all_engine_urls(recipe, machine, ports)
        with Supervisor(work / f"run-{n_engines}") as sup:
            stack = launch_inference(
                sup,
                engine_specs(recipe, machine, ports, str(model_dir)),
                router_spec(recipe, machine, urls, router_port, prometheus_port),
                urls,
                engine_url(machine, router_port),
                work / f"run-{n_engines}",
                recover=False,
                metrics_period_s=None,
            )
            asyncio.run(engine_rollout(stack.router_url, prompts[:4], 1, [8] * 4, rep=-1))  # warm-up
            ratios = []
            for rep in range(args.reps):
                hf = transformers_tokens_per_s(hf_model, prompts, args.samples, lengths)
                eng = asyncio.run(engine_rollout(stack.router_url, prompts, args.samples, lengths, rep, args.grouped))
                ratios.append(eng / hf)
                print(
                    f"  {n_engines} engine(s) rep {rep}: engines {eng:8.0f} tok/s  transformers {hf:8.0f} tok/s  ratio {eng / hf:5.2f}"
                )
            stack.stop()
        summary.append((n_engines, statistics.median(ratios)))
    for n_engines, ratio in summary:
        print(f"median rollout tokens/s ratio, {n_engines} engine(s) via router / transformers generate: {ratio:.2f}x")


if __name__ == "__main__":
    main()

"""The vLLM stage of ``benchmarks.gpu_check``: the tiny model served by one engine behind
vllm-router, started from the same plan functions as ``skyrl rl`` (``skyrl_cli.plan.inference``).

Figures: rollout tokens/s through the router (64 sessions x 64 tokens, temperature 1); the disk
weight sync per step (the trainer's safetensors export, then pause / reload / label / resume);
the NCCL weight sync per step where a second GPU holds the engine (NCCL refuses two ranks of one
group on one device, so a one-GPU machine skips it and says so); the engine-vs-trainer logprob gap
(mean |engine logprob - transformers logprob| over the sampled tokens, same weights); the same gap
after one weight sync of a tied model, served untied as the RL stage serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path


def _recipe(model_dir: Path, on_gpu: bool):
    from skyrl_cli.recipe.lengths import with_model_lengths
    from skyrl_contracts.schema import Recipe

    inference = {"engines": 1, "max_model_len": 512, "max_num_seqs": 64, "max_concurrency": 64}
    if on_gpu:
        inference["gpu_memory_utilization"] = 0.2
    return with_model_lengths(
        Recipe.model_validate(
            {
                "name": "gpu-check",
                "model": {"path": str(model_dir)},
                "data": {"task": "addition"},
                "rl": {"init_from": str(model_dir)},
                "inference": inference,
            }
        )
    )


@contextlib.contextmanager
def serving(model_dir: Path, run_dir: Path, engine_gpu: int | None, weight_sync: str):
    """One engine (on ``engine_gpu``, else a CPU core) and the router; yields (engine, router) URLs."""
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import Machine, engine_specs, engine_url, router_spec
    from skyrl_contracts.ports import find_free_ports

    on_gpu = engine_gpu is not None
    machine = Machine("cuda", engine_gpus=(engine_gpu,)) if on_gpu else Machine("cpu", engine_cores=(0,))
    recipe = _recipe(model_dir, on_gpu)
    port, router_port, prom_port = find_free_ports(3)
    (engine,) = engine_specs(recipe, machine, [port], str(model_dir), weight_sync=weight_sync)
    url = engine_url(machine, port)
    router = router_spec(recipe, machine, [url], router_port, prom_port)
    with Supervisor(run_dir) as sup:
        sup.start(engine)
        sup.wait_ready([engine.name])
        sup.start(router)
        sup.wait_ready([router.name])
        yield url, engine_url(machine, router_port)


async def _rollouts(router_url: str, sessions: int, tokens: int):
    from backends.rollout.client import RolloutClient

    prompts = [[5 + (i * 7 + j) % 30 for j in range(12)] for i in range(sessions)]
    async with RolloutClient(router_url, max_retries=1) as client:
        await client.generate(prompts[0], "warm-up", 8, 1.0)
        started = time.perf_counter()
        done = await asyncio.gather(
            *(client.generate(p, f"s{i}", tokens, 1.0, ignore_eos=True) for i, p in enumerate(prompts))
        )
        elapsed = time.perf_counter() - started
    completions = [c[0] for c in done]
    return prompts, completions, sum(len(c.token_ids) for c in completions) / elapsed


def logprob_gap(model, prompts, completions) -> float:
    """Mean |engine - transformers| logprob of the sampled tokens (temperature 1: the same distribution)."""
    import torch

    diffs = []
    with torch.no_grad():
        for prompt, c in zip(prompts, completions):
            ids = torch.tensor([list(prompt) + list(c.token_ids)], device=model.device)
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
            ours = logp[len(prompt) - 1 : -1].gather(1, ids[0, len(prompt) :, None])[:, 0]
            diffs.append((ours.cpu() - torch.tensor(c.logprobs)).abs())
    return float(torch.cat(diffs).mean())


def disk_sync_per_step(model, tokenizer, url: str, out: Path, steps: int = 3) -> tuple[float, float]:
    """(export seconds, engine sync seconds) per step, each step a new version of the weights."""
    import torch

    from backends.inference.weight_sync import run_blocking, sync_weights
    from backends.models.loading import save_hf

    export = sync = 0.0
    for version in range(1, steps + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0 + 1e-4)
        t0 = time.perf_counter()
        weights = save_hf(model, tokenizer, out / f"v{version}")
        t1 = time.perf_counter()
        run_blocking(sync_weights([url], weights, version))
        export, sync = export + t1 - t0, sync + time.perf_counter() - t1
    return export / steps, sync / steps


def nccl_sync_per_step(model, url: str, steps: int = 3) -> float:
    from backends.inference.nccl_sync import NcclWeightSync
    from skyrl_contracts.ports import find_free_ports

    (port,) = find_free_ports(1)
    syncer = NcclWeightSync([url], 1, model, "127.0.0.1", port)
    try:
        syncer.sync(100)  # warm-up: the first broadcast sets up the buffers
        started = time.perf_counter()
        for version in range(101, 101 + steps):
            syncer.sync(version)
        return (time.perf_counter() - started) / steps
    finally:
        syncer.close()


def run_vllm_stage(ctx) -> dict[str, str]:
    import torch

    from backends.models.loading import load_hf

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    model, tokenizer = load_hf(ctx.tiny)
    model = model.to("cuda:0" if gpus else "cpu")
    engine_gpu = (1 if gpus >= 2 else 0) if gpus else None
    mode = "nccl" if gpus >= 2 else "disk"
    figures = {
        "engine": f"tiny model, {'GPU ' + str(engine_gpu) if gpus else 'CPU core 0'}, trainer copy on {'GPU 0' if gpus else 'CPU'}"
    }
    with serving(ctx.tiny, ctx.tmp / "vllm-run", engine_gpu, mode) as (url, router_url):
        prompts, completions, tokens_per_s = asyncio.run(_rollouts(router_url, 64, 64))
        figures["rollout tokens/s"] = f"{tokens_per_s:,.0f} (64 sessions x 64 tokens through the router)"
        figures["logprob gap"] = (
            f"{logprob_gap(model, prompts, completions):.4f} mean |engine - trainer| (same weights)"
        )
        export_s, sync_s = disk_sync_per_step(model, tokenizer, url, ctx.tmp / "weights")
        figures["weight sync (disk)"] = (
            f"{(export_s + sync_s) * 1000:.0f} ms per step (export {export_s * 1000:.0f} + reload {sync_s * 1000:.0f})"
        )
        if mode == "nccl":
            figures["weight sync (NCCL)"] = f"{nccl_sync_per_step(model, url) * 1000:.0f} ms per step"
        else:
            why = "one GPU: NCCL refuses two ranks of one group on one device" if gpus else "no CUDA"
            figures["weight sync (NCCL)"] = f"skipped ({why})"
    figures["tied round trip"] = tied_round_trip(ctx, engine_gpu)
    figures["INT4 generation"] = int4_generation(ctx, engine_gpu)
    return figures


def int4_generation(ctx, engine_gpu: int | None) -> str:
    """INT4 (W4A16, group 128) against 16-bit generation tokens/s, same model and requests
    (``benchmarks.bench_int4_speed``): a ~1B Llama on a GPU, where decoding at low concurrency is
    bound by reading the weights; the 10M one on CPU, to exercise the path."""
    import statistics

    from benchmarks.bench_int4_speed import build_pair, run_side_by_side

    size = "1B" if engine_gpu is not None else "10M"
    full, int4, params = build_pair(size, ctx.tmp / "int4-speed", 128)
    figures = run_side_by_side({"16bit": full, "int4": int4}, ctx.tmp / "int4-speed-run", [1, 32], 128, 3, engine_gpu)
    ratios = []
    for n in (1, 32):
        quant, base = statistics.median(figures[("int4", n)]), statistics.median(figures[("16bit", n)])
        ratios.append(f"concurrency {n}: {quant:,.0f} vs {base:,.0f} tokens/s ({quant / base:.2f}x)")
    return f"{params / 1e9:.2f}B parameters, INT4 vs 16-bit: " + "; ".join(ratios)


def tied_round_trip(ctx, engine_gpu: int | None) -> str:
    """A tied model served as the RL stage serves it (``engine-model/``, untied), one disk sync of a
    moved copy, the engine's prompt logprobs against transformers' (``backends.inference.sync_check``)."""
    from backends.inference.sync_check import round_trip
    from backends.models.loading import save_hf
    from backends.models.tied import write_untied_copy
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    tokenizer = build_char_tokenizer("0123456789+=abcdefghijklmnopqrstuvwxyz ")
    init = TinyModelInit(hidden_size=256, layers=2, heads=4, tie_embeddings=True)
    model_dir = save_hf(build_tiny_model(init, tokenizer, 0), tokenizer, ctx.tmp / "tied" / "model")
    served = ctx.tmp / "tied" / "engine-model"
    write_untied_copy(model_dir, served)
    with serving(served, ctx.tmp / "tied-run", engine_gpu, "disk") as (url, _router):
        result = round_trip(url, model_dir, ctx.tmp / "tied")
    return f"max {result['max_abs_diff']:.1e}, mean {result['mean_abs_diff']:.1e} |engine - transformers| after one sync (Llama, tied)"

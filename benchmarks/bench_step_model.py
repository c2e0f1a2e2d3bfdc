"""The planner's step-time model (``skyrl_cli.plan.roofline``) against the phases a finished RL run
measured, on this CPU (#47).

The roofline ranks GPU splits from datasheet peaks and stated efficiencies (``TRAIN_MFU``,
``DECODE_BANDWIDTH_SHARE``, ``PREFILL_MFU``, ``DISK_BYTES_PER_S``). Here the peaks are this machine's,
measured first with the run's own threads: a matrix product in the engines' dtype on one core (an
engine's), one in the trainer's dtype on a rank's threads, and a copy of a large tensor (memory
bandwidth). The work is the run's own, from its ``recipe.resolved.json``, ``plan.json`` and
``events.jsonl``: the mean prompt and response tokens of a trajectory it sampled (not the worst case
the planner assumes), its weight-sync transport. Each phase is compared with the median of the
run's steps after the first (``timing/generate_s``; ``timing/forward_backward_s`` +
``timing/optimizer_s``; ``timing/publish_weights_s`` + ``timing/sync_weights_s``), and the ratio
measured / model is printed. The roofline has no optimizer term: its share of the measured training
is printed too.

    python benchmarks/bench_step_model.py --run-dir runs/quickstart/rl [--run-dir DIR ...]

A 0.5B run to point it at: ``benchmarks/bench_shape_phases.py --model /tmp/q05 --steps 3 --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.run_watch import per_step  # noqa: E402
from skyrl_cli.plan.fit import Hardware, estimate, rl_step_work  # noqa: E402
from skyrl_cli.plan.roofline import (  # noqa: E402
    GpuType,
    generation_seconds,
    sync_seconds,
    training_seconds,
)
from skyrl_cli.plan.shape import ModelShape, config_json  # noqa: E402
from skyrl_contracts.schema import Recipe  # noqa: E402


def matmul_flops(dtype: str, threads: int, n: int = 1024, seconds: float = 3.0) -> float:
    """FLOP/s of ``n x n`` matrix products in ``dtype`` on ``threads`` threads: the best of 6 timed
    rounds over about ``seconds`` (a core's bf16 rate with AMX varied 2x between single rounds)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=getattr(torch, dtype)), torch.randn(n, n, dtype=getattr(torch, dtype))
    torch.mm(a, b)
    best = 0.0
    for _ in range(6):
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds / 6:
            torch.mm(a, b)
            count += 1
        best = max(best, 2 * n**3 * count / (time.perf_counter() - started))
    return best


def copy_bytes_per_s(threads: int, mib: int = 512) -> float:
    """Bytes read and written per second copying a ``mib`` MiB tensor (the best of 5)."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.numel() * 4 / (time.perf_counter() - started))
    return best


def run_threads(plan: dict) -> tuple[int, str, str]:
    """(a trainer rank's threads, the trainer's dtype, the engines' dtype) as the run's plan set them."""
    trainer = next(p for p in plan["processes"] if p["role"] == "trainer")
    engine = next(p for p in plan["processes"] if p["role"] == "engine")
    argv = engine["argv"]
    engine_dtype = argv[argv.index("--dtype") + 1] if "--dtype" in argv else "bfloat16"
    return int(trainer["env"].get("OMP_NUM_THREADS", "1")), "float32", engine_dtype


def measured_phases(run_dir: Path) -> dict[str, float]:
    """Medians over the run's steps after the first (its first carries start-up)."""
    steps = [row for step, row in sorted(per_step(run_dir).items()) if step >= 2 and "timing/generate_s" in row]
    if not steps:
        raise SystemExit(f"{run_dir}: no step after the first with timing/generate_s in events.jsonl")

    def median(*names: str) -> float:
        return statistics.median(sum(row.get(n, 0.0) for n in names) for row in steps)

    return {
        "generation": median("timing/generate_s"),
        "training": median("timing/forward_backward_s", "timing/optimizer_s"),
        "optimizer": median("timing/optimizer_s"),
        "weight sync": median("timing/publish_weights_s", "timing/sync_weights_s"),
        "response tokens": median("rollout/response_len"),
        "trajectory tokens": median("rollout/tokens_per_trajectory"),
        "steps": len(steps),
    }


def compare(run_dir: Path) -> None:
    recipe = Recipe.model_validate(json.loads((run_dir / "recipe.resolved.json").read_text()))
    plan = json.loads((run_dir / "plan.json").read_text())
    # the trained model's shape (a tied head once: the engines' copy is untied, the planner's shape is not)
    config = config_json(run_dir / "final") or config_json(Path(recipe.rl.init_from))
    shape = ModelShape.from_config(config) if config else None
    if shape is None:
        raise SystemExit(f"{run_dir}: no Llama-like config.json in final/ or at rl.init_from")
    threads, trainer_dtype, engine_dtype = run_threads(plan)
    measured = measured_phases(run_dir)
    bandwidth = copy_bytes_per_s(1)
    engine_cpu = GpuType("one core", 0, matmul_flops(engine_dtype, 1), bandwidth, "memory", bandwidth, "measured")
    rank_cpu = GpuType(
        f"{threads} cores",
        0,
        matmul_flops(trainer_dtype, threads),
        copy_bytes_per_s(threads),
        "memory",
        bandwidth,
        "measured",
    )
    hardware = Hardware(gpus=0, gpu_bytes=None, gpu=None, device="cpu")
    written = estimate(recipe, shape, hardware)
    response = round(measured["response tokens"])
    work = rl_step_work(
        recipe,
        shape,
        hardware,
        written.engine,
        written.engine_asks,
        lengths=(round(measured["trajectory tokens"]) - response, response),
        transport=plan.get("weight_sync") or written.transport,
    )
    model = {
        "generation": generation_seconds(work.generation, engine_cpu),
        "training": training_seconds(work.training, rank_cpu),
        "weight sync": sync_seconds(work.transport, work.version_bytes, rank_cpu),
    }
    print(f"\n{run_dir}: {shape.parameters() / 1e6:.1f}M parameters, {measured['steps']} steps measured")
    print(
        f"  this CPU: {engine_dtype} matmul {engine_cpu.bf16_flops / 1e9:.1f} GFLOP/s on one core, "
        f"{trainer_dtype} {rank_cpu.bf16_flops / 1e9:.1f} GFLOP/s on {threads} thread(s), "
        f"copy {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"  work: {work.generation.trajectories} trajectories of {work.generation.prompt_tokens} + "
        f"{work.generation.response_tokens} tokens, {work.generation.concurrency} at once an engine; "
        f"{work.training.tokens} trained tokens, {work.training.updates} updates; sync {work.transport}"
    )
    print(f"  {'phase':<12} {'measured s':>11} {'model s':>9} {'measured / model':>17}")
    for phase, predicted in model.items():
        print(f"  {phase:<12} {measured[phase]:>11.3f} {predicted:>9.3f} {measured[phase] / predicted:>17.2f}")
    share = measured["optimizer"] / measured["training"] if measured["training"] else 0.0
    print(f"  the optimizer step, which the model leaves out: {share:.0%} of the measured training")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, action="append", required=True, help="a finished skyrl rl run")
    for run_dir in parser.parse_args().run_dir:
        compare(run_dir)


if __name__ == "__main__":
    main()

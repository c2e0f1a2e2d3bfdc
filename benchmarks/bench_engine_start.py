"""One CPU vLLM engine's start-up: the model in the EngineCore process (uni executor, what the CPU
launch plan does for sync RL), its EngineCore forked from the API server (``fork``, the plan's) or
spawned (``spawn``, vLLM's CPU platform's choice), vs vLLM's CPU default (``mp``: a separate worker
process, multiprocess executor, which ``--async`` keeps); and ``fork-compiled``: the plan's engine
with vLLM's sampler helpers compiled by torch.compile (inductor and g++) at the first request, as
they are for a model with a real vocabulary (without ``SKYRL_EAGER_SAMPLER_MAX_VOCAB``).

Subject and baseline alternate in the same run (A B A B ...). Per start: seconds from the process
start to ``/health`` answering 200, the processes the engine runs as, the first request's time (4
prompts x 8 tokens with logprobs, as a rollout asks), and the time of a fixed generation (256
prompts x 8 tokens, temperature 1, logprobs) so that the faster start is not paid for with slower
serving. Prints the medians and the ratios last.

    python benchmarks/bench_engine_start.py [--reps 3] [--model DIR]   # default: a quickstart-size tiny Llama
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from skyrl_cli.launch.supervisor import Supervisor  # noqa: E402
from skyrl_cli.plan.inference import EAGER_SAMPLER_ENV, Machine, engine_specs, engine_url  # noqa: E402
from skyrl_cli.recipe.lengths import with_model_lengths  # noqa: E402
from skyrl_contracts.ports import find_free_ports  # noqa: E402
from skyrl_contracts.schema import Recipe  # noqa: E402

MODES = ("fork", "fork-compiled", "spawn", "mp")


def quickstart_size_model(out: Path) -> Path:
    from bench_tinker import build_model  # benchmarks/ is on sys.path when this file runs

    return build_model(out, hidden=128, layers=4)  # the quickstart's model.init (1M parameters)


def engine_spec(model: Path, mode: str):
    recipe = with_model_lengths(Recipe.model_validate({"name": "b", "model": {"path": str(model)}, "tinker": {}}))
    machine = Machine("cpu", engine_cores=(0,))
    (port,) = find_free_ports(1)
    (spec,) = engine_specs(recipe, machine, [port], str(model))
    if mode == "fork-compiled":
        env = {k: v for k, v in spec.env.items() if k != EAGER_SAMPLER_ENV}
        spec = spec.model_copy(update={"env": env})
    if mode in ("spawn", "mp"):  # the EngineCore spawned, as vLLM's CPU platform has it
        env = {k: v for k, v in spec.env.items() if k != "SKYRL_ENGINE_CORE_START"}
        spec = spec.model_copy(update={"env": env})
    if mode == "mp":  # vLLM's CPU default: what the plan's settings replace
        argv = list(spec.argv)
        i = argv.index("--distributed-executor-backend")
        del argv[i : i + 2]
        env = {k: v for k, v in spec.env.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        spec = spec.model_copy(update={"argv": tuple(argv), "env": env})
    return spec, engine_url(machine, port)


def process_count(pid: int) -> int:
    """The engine's process tree (its API server and every descendant)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return 1 + sum(process_count(int(c)) for c in children)


def one_start(model: Path, mode: str, work: Path) -> dict:
    spec, url = engine_spec(model, mode)
    prompts = [[7 + (i + k) % 30 for k in range(12)] for i in range(256)]
    body = {"model": "policy", "prompt": prompts, "max_tokens": 8, "temperature": 1.0, "logprobs": 1}
    started = time.monotonic()
    with Supervisor(work / f"{mode}-{time.time_ns()}") as sup:
        proc = sup.start(spec)
        sup.wait_ready([spec.name], timeout_s=600)
        ready_s = time.monotonic() - started
        processes = process_count(proc.popen.pid)
        t0 = time.monotonic()
        httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompts[:4]}, timeout=300).raise_for_status()
        first_s = time.monotonic() - t0
        t0 = time.monotonic()
        httpx.post(f"{url}/v1/completions", json=body, timeout=300).raise_for_status()
        generate_s = time.monotonic() - t0
    return {"ready_s": ready_s, "first_s": first_s, "generate_s": generate_s, "processes": processes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-engine-start-") as scratch:
        measure(args, Path(scratch))


def measure(args, work: Path) -> None:
    model = args.model or quickstart_size_model(work / "model")
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in MODES:
            r = one_start(model, mode, work)
            results[mode].append(r)
            print(
                f"rep {rep} {mode}: ready {r['ready_s']:.1f} s, {r['processes']} processes, "
                f"first request {r['first_s']:.2f} s, 256 x 8 tokens in {r['generate_s']:.3f} s",
                flush=True,
            )
    med = {
        m: {k: statistics.median(r[k] for r in results[m]) for k in ("ready_s", "first_s", "generate_s")} for m in MODES
    }
    for mode in MODES:
        ready = [r["ready_s"] for r in results[mode]]
        print(
            f"{mode}: ready median {med[mode]['ready_s']:.1f} s ({min(ready):.1f}-{max(ready):.1f}), "
            f"first request median {med[mode]['first_s']:.2f} s, generation median {med[mode]['generate_s']:.3f} s"
        )
    print(
        f"fork / fork-compiled: ready + first request "
        f"{(med['fork']['ready_s'] + med['fork']['first_s']) / (med['fork-compiled']['ready_s'] + med['fork-compiled']['first_s']):.2f}x, "
        f"generation time {med['fork']['generate_s'] / med['fork-compiled']['generate_s']:.2f}x"
    )
    for mode in ("fork", "spawn"):
        print(
            f"{mode} / mp: start-up {med[mode]['ready_s'] / med['mp']['ready_s']:.2f}x, "
            f"generation time {med[mode]['generate_s'] / med['mp']['generate_s']:.2f}x (below 1: {mode} faster)"
        )


if __name__ == "__main__":
    main()

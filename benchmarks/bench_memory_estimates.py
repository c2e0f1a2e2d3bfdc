"""The memory estimates (``skyrl_cli.plan.memory``, what ``skyrl sft --dry-run`` prints) against what
runs on this CPU: each trainer rank's peak resident memory in a short ``skyrl sft`` run with 2 ranks
at every ZeRO stage, on several model sizes, and the engine's KV-cache capacity that vLLM logs at
start in a short ``skyrl rl`` run from the SFT run's model.

- sizes: the quickstart's own model (``recipes/quickstart.toml``, ~1M parameters) and random-init
  models with a real model's config (``make_shape_model.py``): SmolLM2-135M and Qwen2.5-0.5B;
- the recipe: the quickstart's, on that model, with a token budget the batch fills (so the largest
  micro-batch is the budget the estimate assumes) and a few steps;
- a case whose estimate (2 ranks) does not fit the memory available now is refused, not run; a
  run that leaves less than ``LOW_FREE_BYTES`` free is stopped, and its peak is a lower bound;
- a rank's peak: the kernel's high-water mark of its resident set (``VmHWM``), read while it runs
  (``run_watch.ProcessMemory``); the estimate: ``RankMemory.peak`` on CPU for the run's resolved
  recipe.

Prints a table, estimate against measured per case, and exits 1 when a case is off by more than 10%.

    python benchmarks/bench_memory_estimates.py                         # every size, stages 0-3
    python benchmarks/bench_memory_estimates.py --sizes quickstart --stages 2 --rl
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its neighbours import
from run_watch import ProcessMemory, work_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.toml"
CONFIGS = REPO / "benchmarks" / "model_configs"
# size -> the config make_shape_model.py builds (None: the quickstart's own model.init)
SIZES = {
    "quickstart": None,
    "smollm2-135m": CONFIGS / "smollm2-135m-instruct.json",
    "qwen2.5-0.5b": CONFIGS / "qwen2.5-0.5b-instruct.json",
}
TOLERANCE = 0.10
# Left free for everything else on the machine when deciding whether a case fits (the run is
# stopped anyway if it goes over, below).
HEADROOM_BYTES = 2**30
# A run is stopped when the machine has less than this free (before the kernel's OOM killer picks a
# process, maybe not the run's): what it reached is then at least its peak.
LOW_FREE_BYTES = 600 * 2**20
# vLLM's start-up line: "CPU KV cache size: 65,536 tokens, Maximum concurrency ..."
KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--stages", nargs="+", type=int, choices=(0, 1, 2, 3), default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=2, help="SFT steps a case runs")
    p.add_argument("--budget", type=int, default=512, help="sft.max_tokens_per_microbatch (the batch fills it)")
    p.add_argument("--rl", action="store_true", help="also an RL run per size (ZeRO-2): the learner and the KV cache")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--skyrl", default=str(Path(sys.executable).with_name("skyrl")))
    return p.parse_args(argv)


@dataclass
class Case:
    size: str
    stage: str  # "sft" or "rl"
    zero: int
    estimate: int  # bytes, one rank
    measured: list[int]  # each rank's peak, bytes (empty: refused)
    note: str = ""
    failed: bool = False
    stopped: bool = False  # out of memory: the measured peaks are lower bounds
    phase: str = ""  # when the estimate peaks (RankMemory.peak_phase)

    @property
    def ratio(self) -> float | None:
        if not self.measured or (self.stopped and max(self.measured) <= self.estimate * (1 + TOLERANCE)):
            return None  # stopped short of the estimate (and its 10%): no verdict either way
        return max(self.measured) / self.estimate


# ------------------------------------------------------------------------------ recipes


def shape_model(size: str, out: Path) -> Path | None:
    """The size's model directory, built once into ``out`` (None: the quickstart's model.init)."""
    config = SIZES[size]
    if config is None:
        return None
    model = out / f"model-{size}"
    if not (model / "config.json").exists():
        script = REPO / "benchmarks" / "make_shape_model.py"
        subprocess.run(
            [sys.executable, str(script), "--config", str(config), "--out", str(model)], check=True, cwd=REPO
        )
    return model


def write_recipe(size: str, model: Path | None, args, out: Path) -> Path:
    """The quickstart recipe on ``model``: a few SFT steps whose batch fills the token budget on
    both ranks (each rank's share, budget / 8 sums of ~12 tokens, is 1.5 budgets), no evaluation."""
    import tomli_w

    recipe = tomllib.loads(QUICKSTART.read_text())
    recipe["name"] = f"memory-{size}"
    if model is not None:
        recipe["model"] = {"path": str(model)}
    # the final evaluation: a few sums, not 500; no sequence longer than the budget, so that the
    # largest micro-batch the estimate assumes (the budget, or one sequence of data.max_length /
    # inference.max_model_len when that is longer) is the budget the batch fills
    recipe["data"].update(eval_size=16, max_length=args.budget)
    recipe.setdefault("inference", {})["max_model_len"] = args.budget
    recipe["sft"].update(
        steps=args.steps,
        batch_size=2 * args.budget // 8,
        max_tokens_per_microbatch=args.budget,
        warmup_steps=0,
        eval_every=0,
        save_every=0,
    )
    # a slice of the RL batch (32 x 8 samples in 4 mini-batches over 2 ranks: 32 of ~20 tokens) fills it too
    recipe["rl"].update(steps=2, eval_every=0, save_every=0, max_tokens_per_microbatch=args.budget)
    path = out / f"{size}.toml"
    path.write_text(tomli_w.dumps(recipe))
    return path


# ------------------------------------------------------------------------------ estimates


def estimate(recipe_path: Path, stage: str, sets: list[str]):
    """The estimate ``skyrl <stage> --dry-run`` prints for this recipe on this CPU: the trainer
    rank's ``RankMemory`` and the engine's ``EngineMemory``."""
    from skyrl_cli.plan.fit import Hardware
    from skyrl_cli.plan.fit import estimate as estimate_recipe
    from skyrl_cli.plan.shape import trained_shape
    from skyrl_cli.recipe.loader import load_recipe

    recipe = load_recipe(recipe_path, sets)
    shape = trained_shape(recipe, recipe_path.parent)
    est = estimate_recipe(recipe, shape, Hardware(gpus=0, gpu_bytes=None, gpu=None, device="cpu"))
    return est.trainer(stage).memory, est.engine


def available_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available - HEADROOM_BYTES


# ------------------------------------------------------------------------------ runs


class RunFailed(Exception):
    pass


class StopWhenMemoryRunsOut(ProcessMemory):
    """``ProcessMemory`` that also stops the run (SIGTERM to ``skyrl``) when the machine's free memory
    falls under ``LOW_FREE_BYTES``."""

    def __init__(self, proc: subprocess.Popen):
        super().__init__(proc.pid)
        self.proc, self.stopped = proc, False

    def look(self) -> None:
        import psutil  # lazy: as ProcessMemory

        super().look()
        if not self.stopped and psutil.virtual_memory().available < LOW_FREE_BYTES:
            self.stopped = True
            self.proc.terminate()


def run_stage(args, stage: str, recipe: Path, run_dir: Path, sets: list[str]) -> tuple[list[int], bool]:
    """``skyrl <stage>`` as a user runs it; each trainer rank's peak resident bytes, and whether the
    run was stopped because memory ran out."""
    argv = [args.skyrl, stage, str(recipe), "--run-dir", str(run_dir), "--overwrite", "--quiet"]
    for item in sets:
        argv += ["--set", item]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    with StopWhenMemoryRunsOut(proc) as memory:
        output, _ = proc.communicate()
    role = "trainer rank" if stage == "sft" else "learner rank"
    peaks = [rss for name, _, rss in memory.peaks() if name == role]
    if proc.returncode != 0 and not memory.stopped:
        raise RunFailed(f"{' '.join(argv)} failed (exit {proc.returncode}):\n" + "\n".join(output.splitlines()[-12:]))
    return peaks, memory.stopped


def measure(args, size: str, stage: str, zero: int, recipe: Path, run_dir: Path, sets: list[str]) -> Case:
    sets = [*sets, f"trainer.zero_stage={zero}", "trainer.ranks=2"]
    rank, _ = estimate(recipe, stage, sets)
    phase = rank.peak_phase
    if 2 * rank.peak > available_bytes():
        free = available_bytes() / 1e9
        why = f"refused: 2 ranks x {rank.peak / 1e9:.2f} GB > {free:.1f} GB free"
        return Case(size, stage, zero, rank.peak, [], why, phase=phase)
    started = time.monotonic()
    try:
        peaks, stopped = run_stage(args, stage, recipe, run_dir, sets)
    except RunFailed as failure:  # the other cases still run; this one counts as off
        print(failure, file=sys.stderr)
        return Case(size, stage, zero, rank.peak, [], "FAILED (see above)", failed=True, phase=phase)
    took = f"{time.monotonic() - started:.0f} s"
    if stopped:
        note = f"stopped after {took}: out of memory (at least)"
        return Case(size, stage, zero, rank.peak, peaks, note, stopped=True, phase=phase)
    return Case(size, stage, zero, rank.peak, peaks, took, phase=phase)


def kv_cache_tokens(run_dir: Path) -> int | None:
    """The KV cache's capacity the engine logged at start (vLLM's own count)."""
    found = KV_TOKENS.search((run_dir / "logs" / "engine-0.log").read_text())
    return int(found.group(1).replace(",", "")) if found else None


def engine_case(size: str, recipe: Path, run_dir: Path, sets: list[str]) -> dict:
    _, engine = estimate(recipe, "rl", sets)
    logged = kv_cache_tokens(run_dir)
    return {"size": size, "estimate": engine.tokens, "vllm": logged}


def run_size(args, size: str, out: Path) -> tuple[list[Case], list[dict]]:
    model = shape_model(size, out)
    recipe = write_recipe(size, model, args, out)
    cases, engines = [], []
    for zero in args.stages:
        case = measure(args, size, "sft", zero, recipe, out / f"{size}-sft-{zero}", [])
        print(row(case), flush=True)
        cases.append(case)
    if args.rl:
        sft_dir = next((out / f"{size}-sft-{c.zero}" for c in cases if c.measured and not c.stopped), None)
        if sft_dir is not None:
            sets = [f"rl.init_from={sft_dir / 'final'}"]
            case = measure(args, size, "rl", 2, recipe, out / f"{size}-rl", sets)
            print(row(case), flush=True)
            cases.append(case)
            if case.measured:
                engines.append(engine_case(size, recipe, out / f"{size}-rl", [*sets, "trainer.zero_stage=2"]))
    return cases, engines


# ------------------------------------------------------------------------------ report


def row(case: Case) -> str:
    measured = ", ".join(f"{b / 1e9:.3f}" for b in case.measured) or "-"
    ratio = f"{case.ratio:.3f}x" if case.ratio is not None else "-"
    estimate = f"{case.estimate / 1e9:.3f} (at {case.phase})"
    return f"  {case.size:14s} {case.stage:4s} ZeRO-{case.zero}  {estimate:>36s}  {measured:>14s}  {ratio:>7s}  {case.note}"


def off(ratio: float | None) -> bool:
    return ratio is not None and abs(ratio - 1) > TOLERANCE


def main(argv=None) -> int:
    args = parse_args(argv)
    cases, engines = [], []
    print("trainer rank peak resident memory, GB (estimate; measured per rank; the larger / estimate):")
    with work_dir(args.out, "skyrl-memory-") as out:
        for size in args.sizes:
            more, kv = run_size(args, size, out)
            cases += more
            engines += kv
    print("\nengine KV cache, tokens (estimate; what vLLM logged at start):")
    for engine in engines:
        ratio = engine["vllm"] / engine["estimate"] if engine["vllm"] else None
        print(f"  {engine['size']:14s} {engine['estimate']:>10,d} {engine['vllm'] or 0:>10,d}  {ratio or 0:.3f}x")
        engine["ratio"] = ratio
    if args.json:
        args.json.write_text(json.dumps({"ranks": [vars(c) for c in cases], "engines": engines}, indent=1))
    bad = [c for c in cases if c.failed or off(c.ratio)] + [e for e in engines if off(e["ratio"]) or e["vllm"] is None]
    if bad:
        print(f"\n{len(bad)} case(s) off by more than {TOLERANCE:.0%}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""RL with INT4 rollouts on the quickstart: does it learn, and does INT4 QAT in the learner shrink
the engine-vs-trainer logprob gap? Three RL runs per seed from the same SFT model, side by side:

- ``bf16 rollouts``: the baseline (engines serve the full-precision policy);
- ``INT4, fake-quant off``: engines serve the W4A16 export of every version, the learner trains
  plain full-precision weights (the numerics differ by INT4 rounding);
- ``INT4, fake-quant on``: the same engines, the learner under INT4 fake-quant (QAT), so it
  computes its logprobs with the numerics the engines sample with.

Runs the README's commands (``skyrl sft``, then ``skyrl rl`` with ``--set`` overrides) and prints
per run the held-out accuracy before and after RL (the orchestrator's evaluation through the
engines, i.e. of the INT4 policy where the engines serve INT4) and the mean of
``train/logprob_diff`` over the steps (mean |engine logprob - trainer logprob| per token), the
step time (the run's training time over its steps: generation, training, weight sync with the
INT4 re-export, evaluations) and the rollout tokens/s; last, the ratio of the gap with fake-quant
on to off and of each INT4 variant's step time to the bf16 rollouts'.

    python benchmarks/bench_int4_rl.py                   # seed 0
    python benchmarks/bench_int4_rl.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int4 import RECIPE, run_seeds, skyrl  # noqa: E402  (one runner for both INT4 benchmarks)

VARIANTS = {
    "bf16 rollouts": [],
    "INT4, fake-quant off": ["quantization.int4_rollouts=true", "quantization.int4_qat=false"],
    "INT4, fake-quant on": ["quantization.int4_rollouts=true", "quantization.int4_qat=true"],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="extra --set for every stage"
    )
    p.add_argument("--out", type=Path, default=None, help="where the run directories go (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def mean_event(run_dir: Path, name: str) -> float:
    from skyrl_contracts.events import iter_events

    values = [e.value for e in iter_events(run_dir / "events.jsonl") if e.name == name]
    return statistics.fmean(values) if values else float("nan")


def one_seed(seed: int, args, out: Path) -> dict:
    flags = [a for s in [f"seed={seed}", *args.sets] for a in ("--set", s)]
    sft = out / "sft"
    skyrl("sft", RECIPE, *flags, "--run-dir", sft, "--overwrite", cwd=out)
    init = ["--set", f"rl.init_from={sft / 'final'}"]
    runs = {}
    for name, sets in VARIANTS.items():
        run_dir = out / name.replace(" ", "-").replace(",", "")
        variant = [a for s in sets for a in ("--set", s)]
        summary = skyrl("rl", RECIPE, *flags, *init, *variant, "--run-dir", run_dir, "--overwrite", cwd=out)
        runs[name] = {
            "accuracy_initial": summary.get("eval_accuracy_initial"),
            "accuracy_final": summary.get("eval_accuracy_final"),
            "logprob_diff_mean": mean_event(run_dir, "train/logprob_diff"),
            "wall_s": summary.get("wall_s"),
            "step_s": summary["training_s"] / summary["steps"],
            "rollout_tokens_per_s": mean_event(run_dir, "rollout/tokens_per_s"),
        }
        r = runs[name]
        print(
            f"seed {seed} {name:22s} held-out accuracy {r['accuracy_initial']:.3f} -> {r['accuracy_final']:.3f}  "
            f"mean logprob diff {r['logprob_diff_mean']:.4f}  step {r['step_s']:.2f} s  "
            f"rollout {r['rollout_tokens_per_s']:.0f} tokens/s  {r['wall_s']:.0f} s",
            flush=True,
        )
    return {"seed": seed, "runs": runs}


def main(argv=None) -> None:
    args = parse_args(argv)
    results = run_seeds(one_seed, args, "bench-int4-rl-")
    for name in VARIANTS:
        finals = [r["runs"][name]["accuracy_final"] for r in results]
        gaps = [r["runs"][name]["logprob_diff_mean"] for r in results]
        print(
            f"{name:22s} final accuracy {min(finals):.3f}-{max(finals):.3f}  mean logprob diff "
            f"{min(gaps):.4f}-{max(gaps):.4f} over {len(results)} seed(s)"
        )
    ratios = [
        r["runs"]["INT4, fake-quant on"]["logprob_diff_mean"] / r["runs"]["INT4, fake-quant off"]["logprob_diff_mean"]
        for r in results
    ]
    print(f"logprob gap with INT4 rollouts, fake-quant on / off: {statistics.median(ratios):.2f}x (median over seeds)")
    for name in list(VARIANTS)[1:]:
        steps = [r["runs"][name]["step_s"] / r["runs"]["bf16 rollouts"]["step_s"] for r in results]
        print(f"RL step time, {name} / bf16 rollouts: {statistics.median(steps):.2f}x (median over seeds)")


if __name__ == "__main__":
    main()

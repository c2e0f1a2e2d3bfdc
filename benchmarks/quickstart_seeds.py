"""A CPU recipe over several seeds: SFT, then RL (sync and/or --async) from each seed's SFT model.

Runs exactly the README's commands one after another (``skyrl sft`` / ``skyrl rl`` on
``recipes/quickstart.toml`` or ``--recipe``, each with ``--set seed=N``), the RL runs of a seed starting from that
seed's SFT model, and prints per seed: SFT held-out accuracy and wall time, RL accuracy before ->
after and wall time for each mode; then the min / median / max of each column. Wall times are the
commands' own (``summary.json`` ``wall_s``: start-up, engines, evaluation included).

    python benchmarks/quickstart_seeds.py                          # seeds 0-4, sync and --async
    python benchmarks/quickstart_seeds.py --seeds 0 1 --modes sync --set rl.mini_batches=1
    python benchmarks/quickstart_seeds.py --json results.json      # also write every figure
    python benchmarks/quickstart_seeds.py --recipe recipes/tool_use.toml --modes sync

A recipe whose SFT stage measures no accuracy (a tool task: its accuracy needs the tool loop) has
no SFT accuracy column; its RL "before" is the SFT policy's accuracy (the RL stage's first evaluation).

Every stage's run directory is kept under ``--out`` (default: a temporary folder) for inspection.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart.toml"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", type=Path, default=RECIPE)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--modes", nargs="+", choices=["sync", "async"], default=["sync", "async"])
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="extra --set for every run"
    )
    p.add_argument(
        "--rl-set", dest="rl_sets", action="append", default=[], metavar="KEY=VALUE", help="extra --set for the RL runs"
    )
    p.add_argument("--reuse-sft", action="store_true", help="keep an SFT model already under --out")
    p.add_argument("--tag", default="", help="suffix of the RL run directories (to compare settings on one --out)")
    p.add_argument("--out", type=Path, default=None, help="where the run directories go")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--skyrl", default=str(Path(sys.executable).with_name("skyrl")))
    return p.parse_args(argv)


def run_stage(args, stage: str, run_dir: Path, sets: list[str], extra: list[str] = ()) -> dict:
    argv = [args.skyrl, stage, str(args.recipe), "--run-dir", str(run_dir), "--overwrite", "--quiet", *extra]
    for item in sets:
        argv += ["--set", item]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-5:])
        raise SystemExit(f"{' '.join(argv)} failed (exit {done.returncode}):\n{tail}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.setdefault("wall_s", round(time.monotonic() - started, 1))
    return summary


def one_seed(args, seed: int, out: Path) -> dict:
    sets = [f"seed={seed}", *args.sets]
    sft_dir = out / f"seed{seed}" / "sft"
    if args.reuse_sft and (sft_dir / "summary.json").exists() and (sft_dir / "final" / "config.json").exists():
        sft = json.loads((sft_dir / "summary.json").read_text())
    else:
        sft = run_stage(args, "sft", sft_dir, sets)
    row = {"seed": seed, "sft_accuracy": sft["metrics"].get("eval/accuracy"), "sft_s": sft["wall_s"]}
    if row["sft_accuracy"] is None:
        del row["sft_accuracy"]
    for mode in args.modes:
        rl = run_stage(
            args,
            "rl",
            out / f"seed{seed}" / f"rl-{mode}{args.tag}",
            sets + [f"rl.init_from={sft_dir / 'final'}", *args.rl_sets],
            ["--async"] if mode == "async" else [],
        )
        row[f"{mode}_before"] = rl["eval_accuracy_initial"]
        row[f"{mode}_after"] = rl["eval_accuracy_final"]
        row[f"{mode}_s"] = rl["wall_s"]
    return row


def table(rows: list[dict]) -> str:
    columns = [c for c in rows[0] if c != "seed"]
    lines = ["seed  " + "  ".join(f"{c:>13}" for c in columns)]
    for r in rows:
        lines.append(
            f"{r['seed']:>4}  "
            + "  ".join(
                f"{r[c]:>13.3f}" if c.endswith(("accuracy", "before", "after")) else f"{r[c]:>13.1f}" for c in columns
            )
        )
    for name, fn in (("min", min), ("med", statistics.median), ("max", max)):
        lines.append(f"{name:>4}  " + "  ".join(f"{fn(r[c] for r in rows):>13.3f}" for c in columns))
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="skyrl-seeds-"))
    rows = []
    for seed in args.seeds:
        rows.append(one_seed(args, seed, out))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    for mode in args.modes:
        gains = [r[f"{mode}_after"] - r[f"{mode}_before"] for r in rows]
        print(
            f"{mode}: RL gain min {min(gains):+.3f} median {statistics.median(gains):+.3f} max {max(gains):+.3f}; "
            f"final accuracy mean {statistics.mean(r[f'{mode}_after'] for r in rows):.3f}"
        )
    sft = [r["sft_accuracy"] for r in rows if "sft_accuracy" in r]
    if sft:
        print(f"SFT band: {min(sft):.3f}-{max(sft):.3f} ({(max(sft) - min(sft)) * 100:.1f} points)")
    totals = [r["sft_s"] + sum(r[f"{m}_s"] for m in args.modes[:1]) for r in rows]
    print(f"SFT + first RL mode wall time: {min(totals):.0f}-{max(totals):.0f} s; run directories: {out}")
    if args.json:
        args.json.write_text(json.dumps({"sets": args.sets, "rl_sets": args.rl_sets, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

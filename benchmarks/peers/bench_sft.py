"""SFT side by side: ``skyrl sft`` vs TRL's ``SFTTrainer`` (default, padding-free, packing).

Same tiny model directory (the quickstart's ``model.init``, saved once), tokenizer, demonstrations
(exported to JSONL for TRL), batch size, learning rate and schedule (skyrl's AdamW and LambdaLR
handed to TRL), steps and held-out evaluation (skyrl's ``eval_accuracy`` and the task's checker on
the same 500 rows). skyrl runs as its recipe says (torchrun, 2 ranks, ZeRO-2, 1 thread each); TRL
as its user would on this machine (one process, torch's threads over the 2 cores). The sides
alternate within each repetition (A B C D A B C D) so they share the machine's load.

Per run: training tokens/s (real tokens, evaluation excluded), wall time from the launch to the
first evaluation at ``--target`` held-out accuracy, final accuracy, wall time, peak resident memory
of the whole process tree, load average. Ratios (skyrl / TRL variant) are printed last.

    python benchmarks/peers/bench_sft.py                      # 2 repetitions, the recipe's 800 steps (long: 3-9 min
                                                              # per side per 300 steps at load ~10 on 2 cores)
    python benchmarks/peers/bench_sft.py --reps 1 --steps 300 --target 0.1 --trl-threads 1 \
        --sides skyrl trl-default trl-padding_free --set data.train_size=38400      # RESULTS.md (~17 min)
    python benchmarks/peers/bench_sft.py --quick              # smoke check: 1 repetition, 60 steps
    python benchmarks/peers/bench_sft.py --sides skyrl trl-default --reps 3 --json sft.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from common import SFT_VARIANTS, fmt, machine, ratio, sft_spec, spread, table, write_spec  # noqa: E402
from skyrl_side import SKYRL, accuracy_curve, peers_env, peers_python, prepare, run_measured, skyrl_events, time_to  # noqa: E402

SIDES = ("skyrl", *(f"trl-{v}" for v in SFT_VARIANTS))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--steps", type=int, default=None, help="SFT steps (default: the recipe's)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--target", type=float, default=0.40, help="held-out accuracy whose wall time is compared")
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="recipe override (both sides)"
    )
    p.add_argument("--work", type=Path, default=None, help="work folder (default: a new temporary one)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--trl-threads", type=int, default=None, help="torch threads of the TRL process (default: torch's, all cores)"
    )
    p.add_argument("--quick", action="store_true", help="1 repetition of 60 steps, evaluation every 30")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.eval_every = 1, args.steps or 60, 30
    return args


def stage_sets(args) -> list[str]:
    """The overrides both sides run under (skyrl: --set; TRL: through spec.json)."""
    sets = [*args.sets, f"sft.eval_every={args.eval_every}", "sft.save_every=0", "sft.warmup_steps=" + str(args.warmup)]
    return sets + ([f"sft.steps={args.steps}"] if args.steps else [])


def run_skyrl(recipe_file: Path, sets: list[str], work: Path, rep: int) -> dict:
    run_dir = work / f"skyrl-sft-{rep}"
    argv = [SKYRL, "sft", str(recipe_file), "--run-dir", str(run_dir), "--overwrite", "--quiet"]
    for item in sets:
        argv += ["--set", item]
    m = run_measured(argv, work / f"skyrl-sft-{rep}.log")
    events = skyrl_events(run_dir)
    rates = [v for _, _, v in events.get("train/tokens_per_s", [])]
    return {
        **m,
        "curve": accuracy_curve(events, m["launched"]),
        "tokens_per_s": statistics.median(rates) if rates else None,
    }


def run_trl(variant: str, spec_file: Path, work: Path, rep: int, threads: int | None) -> dict:
    out = work / f"trl-{variant}-{rep}.json"
    argv = [peers_python(), str(HERE / "trl_sft.py"), "--spec", str(spec_file), "--variant", variant, "--out", str(out)]
    m = run_measured(argv, work / f"trl-{variant}-{rep}.log", peers_env(threads))
    return {**json.loads(out.read_text()), **m}


def summarise(runs: dict[str, list[dict]], target: float) -> list[dict]:
    rows = []
    for side, results in runs.items():
        to_target = [time_to(r["curve"], target) for r in results]
        rows.append(
            {
                "side": side,
                "tokens_per_s": spread([r["tokens_per_s"] for r in results])["median"],
                "to_target_s": spread(to_target)["median"],
                "reached": f"{sum(t is not None for t in to_target)}/{len(results)}",
                "final_acc": spread([r["curve"][-1][2] for r in results])["median"],
                "wall_s": spread([r["wall_s"] for r in results])["median"],
                "rss_mb": spread([r["peak_rss_bytes"] / 2**20 for r in results])["median"],
                "load": spread([r["load"]["median"] for r in results])["median"],
            }
        )
    return rows


def ratio_lines(rows: list[dict]) -> list[str]:
    by = {r["side"]: r for r in rows}
    if "skyrl" not in by:
        return []
    s = by["skyrl"]
    lines = []
    for side, r in by.items():
        if side != "skyrl":
            lines.append(
                f"skyrl / {side}: training tokens/s {fmt(ratio(s['tokens_per_s'], r['tokens_per_s']))}x, "
                f"wall time to target {fmt(ratio(s['to_target_s'], r['to_target_s']))}x (lower is faster), "
                f"peak memory {fmt(ratio(s['rss_mb'], r['rss_mb']))}x"
            )
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="peers-sft-"))
    args.warmup = min(100, (args.steps or 10**9) // 8)
    sets = stage_sets(args)
    recipe, recipe_file, paths = prepare(work, sets)
    spec = sft_spec(recipe, args.target)
    spec_file = work / "spec.json"
    write_spec(spec_file, spec, None, paths)
    print(f"{machine()}; {spec}; work folder {work}", flush=True)
    runs: dict[str, list[dict]] = {side: [] for side in args.sides}
    for rep in range(args.reps):
        for side in args.sides:
            r = (
                run_skyrl(recipe_file, sets, work, rep)
                if side == "skyrl"
                else run_trl(side[4:], spec_file, work, rep, args.trl_threads)
            )
            runs[side].append(r)
            print(
                f"rep {rep} {side}: tokens/s {fmt(r['tokens_per_s'], 0)}, to {args.target:.2f}: {fmt(time_to(r['curve'], args.target), 1)} s, "
                f"final {r['curve'][-1][2]:.3f}, wall {r['wall_s']:.1f} s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB, "
                f"load {fmt(r['load']['median'])}",
                flush=True,
            )
    rows = summarise(runs, args.target)
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine(), "spec": spec.__dict__, "runs": runs, "summary": rows}, indent=1)
        )
    columns = [
        ("side", "side", 0),
        ("tokens_per_s", "tokens/s", 0),
        ("to_target_s", f"s to {args.target:.2f}", 1),
        ("reached", "reached", 0),
        ("final_acc", "final acc", 3),
        ("wall_s", "wall s", 1),
        ("rss_mb", "peak MiB", 0),
        ("load", "load", 2),
    ]
    print(table(rows, columns))
    print("\n".join(ratio_lines(rows)))


if __name__ == "__main__":
    main()

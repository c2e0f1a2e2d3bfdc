"""GRPO side by side: ``skyrl rl`` (sync and ``--async``) vs TRL's ``GRPOTrainer`` (transformers generation).

Both start from the same SFT checkpoint (``skyrl sft`` of the quickstart on the shared initial
model, run once, or ``--sft-model``) and use the same training prompts (exported to JSONL for TRL),
group size, prompts per step, reward (the task's exact match), learning rate, PPO clip range,
updates per step (skyrl ``rl.mini_batches`` = TRL ``steps_per_generation``) and number of samples.
Held-out accuracy: greedy, on the same 500 rows, scored by the task's checker (skyrl through its
engines, TRL through ``backends.train.evaluate``). The sides alternate within each repetition.

``skyrl-pool-sync`` / ``skyrl-pool-async`` run on an engine pool (``skyrl engines up``, started
once before the repetitions and not timed, as a user keeps one running between runs; before each
run the pools' warm learner and orchestrator are ready again); the other skyrl sides start their
own engines (``--pool none``). On a pool, peak RSS counts the ``skyrl rl`` command alone: the
engines, the learner and the orchestrator are the pool's processes.

Per run: wall time from the launch to the first evaluation >= the run's initial accuracy + 10
points, samples/s over the whole command, final accuracy after the same samples, the start-up
(launch -> first evaluation), peak memory of the process tree, load average; for skyrl the phase
medians its processes log (train, weight publish / sync, evaluation, waiting). Ratios last.

    python benchmarks/peers/bench_grpo.py                  # 2 repetitions x (sync, async, TRL), the recipe's 40 steps
    python benchmarks/peers/bench_grpo.py --reps 2 --steps 12 --trl-threads 1   # RESULTS.md (~14 min + the SFT once)
    python benchmarks/peers/bench_grpo.py --quick          # 1 repetition of 6 steps
    python benchmarks/peers/bench_grpo.py --sft-model runs/quickstart/sft/final --reps 3
    python benchmarks/peers/bench_grpo.py --no-sft --steps 4 --sides skyrl-sync skyrl-async trl \
        --set model.init.hidden_size=576 --set model.init.layers=10 --set model.init.heads=9 \
        --set model.init.intermediate_size=2304 --set rl.max_new_tokens=48 --set data.eval_size=64   # cold, 50M
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from common import fmt, machine, ratio, rl_spec, spread, table, write_spec  # noqa: E402
from skyrl_side import (
    SKYRL,
    accuracy_curve,
    peers_env,
    peers_python,
    phases,
    prepare,
    run_measured,
    skyrl_events,
    time_to,
)  # noqa: E402

# skyrl-pool-*: on an engine pool started before the repetitions (skyrl engines up, not timed: the
# engines a user keeps running between runs); skyrl-sync / -async start their own (--pool none).
SIDES = ("skyrl-sync", "skyrl-async", "skyrl-pool-sync", "skyrl-pool-async", "trl")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the recipe's)")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--gain", type=float, default=0.10, help="accuracy gain whose wall time is compared")
    p.add_argument(
        "--sft-model",
        type=Path,
        default=None,
        help="an SFT output of the shared initial model (default: run skyrl sft once)",
    )
    p.add_argument(
        "--no-sft",
        action="store_true",
        help="start RL from the shared initial model itself (random init: for the larger --set model.init "
        "sizes, where SFT would take hours on CPU; compare the same steps and samples, not a gain)",
    )
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="recipe override (both sides)"
    )
    p.add_argument("--trl-threads", type=int, default=None, help="torch threads of the TRL process (default: torch's)")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="1 repetition of 6 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.steps = 1, args.steps or 6
    return args


def sft_model(args, recipe_file: Path, work: Path, initial: Path) -> Path:
    if args.sft_model:
        return args.sft_model.resolve()
    if args.no_sft:
        return initial
    run_dir = work / "sft"
    if not (run_dir / "final" / "config.json").exists():
        print("training the shared SFT checkpoint once (skyrl sft) ...", flush=True)
        run_measured(
            [
                SKYRL,
                "sft",
                str(recipe_file),
                "--run-dir",
                str(run_dir),
                "--overwrite",
                "--quiet",
                *sum((["--set", s] for s in args.sets), []),
            ],
            work / "sft.log",
        )
    return run_dir / "final"


def export_rl_rows(recipe, work: Path) -> str:
    from backends.rollout.orchestrator import load_rows

    path = work / "rl_train.jsonl"
    if not path.exists():
        train, _ = load_rows(recipe)
        prompts = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in train]
        path.write_text("".join(json.dumps(r) + "\n" for r in prompts))
    return str(path)


def pools_env(work: Path) -> dict:
    return {"SKYRL_POOLS_DIR": str(work / "pools")}


def start_pool(mode: str, recipe_file: Path, sets: list[str], work: Path) -> str:
    """``skyrl engines up`` for the pool sides (once, before the repetitions); returns its name."""
    name = f"bench-{mode}"
    argv = [SKYRL, "engines", "up", str(recipe_file), "--name", name, *(["--async"] if mode == "async" else [])]
    for item in sets:
        argv += ["--set", item]
    m = run_measured(argv, work / f"pool-{mode}.log", pools_env(work))
    print(f"engine pool {name}: up in {m['wall_s']:.1f} s (not counted in the runs)", flush=True)
    return name


def wait_pools_warm(work: Path, timeout_s: float = 300.0) -> None:
    """Before each run: every pool's warm learner and orchestrator ready again. A pool's keepers
    start the next generation when a run ends; their imports would otherwise run during the next
    side's run (whichever side it is), which a user who keeps a pool between runs does not see."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(
            [SKYRL, "engines", "status", "--json"],
            capture_output=True,
            text=True,
            env={**os.environ, **pools_env(work)},
        ).stdout
        states = [s for line in out.splitlines() if line.strip() for s in json.loads(line)["warm"].values()]
        if all(s == "warm" for s in states):
            return
        time.sleep(0.5)
    raise SystemExit(f"the engine pools' warm processes were not ready again within {timeout_s:.0f} s")


def stop_pools(work: Path) -> None:
    run_measured([SKYRL, "engines", "down", "--all", "--force"], work / "pools-down.log", pools_env(work))


def run_skyrl(
    side: str, recipe_file: Path, sets: list[str], work: Path, rep: int, samples_per_step: int, pool: str = "none"
) -> dict:
    mode = side.rsplit("-", 1)[1]
    run_dir = work / f"{side}-{rep}"
    argv = [
        SKYRL,
        "rl",
        str(recipe_file),
        "--run-dir",
        str(run_dir),
        "--overwrite",
        "--quiet",
        "--pool",
        pool,
        *(["--async"] if mode == "async" else []),
    ]
    for item in sets:
        argv += ["--set", item]
    m = run_measured(argv, work / f"{side}-{rep}.log", pools_env(work))
    events = skyrl_events(run_dir)
    steps = phases(run_dir, m["launched"], samples_per_step)
    if mode == "async":  # generation overlaps training: its window is not one phase of the step
        steps = {k: v for k, v in steps.items() if k not in ("generate_s", "rest_s", "rollout_tok_s")}
    return {**m, "curve": accuracy_curve(events, m["launched"]), "phases": steps}


def run_trl(spec_file: Path, work: Path, rep: int, threads: int | None, mini_batches: int) -> dict:
    out = work / f"trl-grpo-{rep}.json"
    argv = [peers_python(), str(HERE / "trl_grpo.py"), "--spec", str(spec_file), "--out", str(out)]
    m = run_measured(argv, work / f"trl-grpo-{rep}.log", peers_env(threads))
    result = {**json.loads(out.read_text()), **m}
    result["curve"] = [(t, step // mini_batches, acc) for t, step, acc in result["curve"]]  # optimizer -> RL steps
    return result


def measures(r: dict, gain: float, samples: int) -> dict:
    curve = r["curve"]
    return {
        "start_s": curve[0][0],
        "initial": curve[0][2],
        "final": curve[-1][2],
        "wall_s": r["wall_s"],
        "to_gain_s": time_to(curve, curve[0][2] + gain),
        "samples_per_s": samples / r["wall_s"],
        "rss_mb": r["peak_rss_bytes"] / 2**20,
        "load": r["load"]["median"],
    }


def summarise(runs: dict[str, list[dict]], gain: float, samples: int) -> list[dict]:
    rows = []
    for side, results in runs.items():
        per = [measures(r, gain, samples) for r in results]
        row = {"side": side, "reached": f"{sum(m['to_gain_s'] is not None for m in per)}/{len(per)}"}
        for key in per[0]:
            s = spread([m[key] for m in per])
            row[key], row[key + "_range"] = s["median"], (s["min"], s["max"])
        rows.append(row)
    return rows


def ratio_lines(rows: list[dict], gain: float) -> list[str]:
    by = {r["side"]: r for r in rows}
    if "trl" not in by:
        return []
    t = by["trl"]
    return [
        f"{side} / trl: wall time to +{gain * 100:.0f} points {fmt(ratio(r['to_gain_s'], t['to_gain_s']))}x (below 1: skyrl faster), "
        f"samples/s {fmt(ratio(r['samples_per_s'], t['samples_per_s']))}x, start-up {fmt(ratio(r['start_s'], t['start_s']))}x, "
        f"final accuracy {fmt(r['final'], 3)} vs {fmt(t['final'], 3)}"
        for side, r in by.items()
        if side != "trl"
    ]


def setup(args):
    work = args.work or Path(tempfile.mkdtemp(prefix="peers-grpo-"))
    init_sets = [s for s in args.sets if s.startswith("model.init.")]  # the initial model's shape
    args.sets = [s for s in args.sets if s not in init_sets]
    recipe, recipe_file, paths = prepare(work, args.sets, init_sets)
    init_from = sft_model(args, recipe_file, work, Path(paths["model_dir"]))
    sets = [
        *args.sets,
        f"rl.init_from={init_from}",
        f"rl.eval_every={args.eval_every}",
        *([f"rl.steps={args.steps}"] if args.steps else []),
    ]
    recipe, recipe_file, paths = prepare(work, sets)
    spec = rl_spec(recipe)
    paths = {**paths, "sft_model_dir": str(init_from), "rl_train_jsonl": export_rl_rows(recipe, work)}
    write_spec(work / "spec.json", None, spec, paths)
    return work, recipe_file, sets, spec


def main(argv=None) -> None:
    args = parse_args(argv)
    work, recipe_file, sets, spec = setup(args)
    print(f"{machine()}; {spec}; work folder {work}", flush=True)
    samples = spec.steps * spec.samples_per_step
    runs: dict[str, list[dict]] = {side: [] for side in args.sides}
    pools = {
        side: start_pool(side.rsplit("-", 1)[1], recipe_file, sets, work)
        for side in args.sides
        if side.startswith("skyrl-pool-")
    }
    try:
        for rep in range(args.reps):
            for side in args.sides:
                if pools:
                    wait_pools_warm(work)
                if side == "trl":
                    r = run_trl(work / "spec.json", work, rep, args.trl_threads, spec.mini_batches)
                else:
                    r = run_skyrl(side, recipe_file, sets, work, rep, spec.samples_per_step, pools.get(side, "none"))
                runs[side].append(r)
                report(rep, side, r, args.gain, samples)
    finally:
        if pools:
            stop_pools(work)
    finish(args, runs, spec, samples)


def report(rep: int, side: str, r: dict, gain: float, samples: int) -> None:
    m = measures(r, gain, samples)
    print(
        f"rep {rep} {side}: start-up {m['start_s']:.1f} s, accuracy {m['initial']:.3f} -> {m['final']:.3f}, "
        f"+{gain * 100:.0f} points at {fmt(m['to_gain_s'], 1)} s, {m['samples_per_s']:.1f} samples/s, wall {m['wall_s']:.1f} s, "
        f"peak RSS {m['rss_mb']:.0f} MiB, load {fmt(m['load'])} {r.get('phases', '')}",
        flush=True,
    )


def finish(args, runs: dict[str, list[dict]], spec, samples: int) -> None:
    rows = summarise(runs, args.gain, samples)
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine(), "spec": spec.__dict__, "runs": runs, "summary": rows}, indent=1)
        )
    columns = [
        ("side", "side", 0),
        ("start_s", "start-up s", 1),
        ("initial", "initial", 3),
        ("final", "final", 3),
        ("to_gain_s", f"s to +{args.gain * 100:.0f} pts", 1),
        ("reached", "reached", 0),
        ("samples_per_s", "samples/s", 1),
        ("wall_s", "wall s", 1),
        ("rss_mb", "peak MiB", 0),
        ("load", "load", 2),
    ]
    print(table(rows, columns))
    print("\n".join(ratio_lines(rows, args.gain)))


if __name__ == "__main__":
    main()

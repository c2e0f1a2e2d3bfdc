"""Fully-async vs sync RL throughput with the training time per step held fixed.

The workload is the real RL rollout side of ``skyrl rl``: one vLLM engine behind vllm-router, the
real orchestrator process (rollouts, rewards, buffer, weight sync with pause/reload/resume) on the
quickstart task. The learner is simulated: it reads each batch from the run directory, sleeps
``--train-s`` seconds, and publishes the next policy version (the same weights, so each weight
sync costs what a real one costs). A simulated learner keeps the comparison honest on 2 cores,
where a real trainer and the engine would fight for the same cores and async would look worse or
better for reasons that have nothing to do with scheduling.

For each repetition the sync run (staleness 0) and the async run (``--staleness``) alternate. The
clock runs from the moment the first batch is ready to the last version's publication, so start-up
and the initial evaluation are outside it. Printed: trajectories/s of each, the async/sync ratio
(median), the measured generation time per batch T_gen, and the ideal
(T_gen + T_train) / max(T_gen, T_train).

    python benchmarks/bench_async.py                  # 3 repetitions, 6 steps, T_train 2 s
    python benchmarks/bench_async.py --reps 1 --steps 4 --train-s 1.0
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--train-s", type=float, default=2.0, help="simulated training time per step")
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    return p.parse_args(argv)


def build_model(out: Path) -> Path:
    from backends.data.tasks import get_task
    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    tokenizer = build_char_tokenizer(get_task("addition").alphabet)
    model = build_tiny_model(
        TinyModelInit(hidden_size=128, layers=4, heads=4, intermediate_size=512), tokenizer, seed=0
    )
    return save_hf(model, tokenizer, out)


def simulated_learner(run_dir: Path, model_dir: Path, steps: int, train_s: float, marks: dict) -> None:
    """Batch k in, sleep, version k+1 out (the same weights)."""
    from skyrl_contracts.exchange import RunExchange

    exchange = RunExchange(run_dir)

    def publish(version: int) -> None:
        with exchange.publish_weights(version) as out:
            for f in model_dir.iterdir():
                shutil.copy2(f, out / f.name)

    publish(0)
    for step in range(steps):
        exchange.read_batch(step, timeout_s=600)
        if step == 0:
            marks["start"] = time.monotonic()
        marks.setdefault("ready", []).append(time.monotonic())
        time.sleep(train_s)
        publish(step + 1)
    marks["end"] = time.monotonic()


def run_once(model_dir: Path, root: Path, args, async_mode: bool) -> dict:
    from skyrl_cli.engines.stack import launch_inference
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.build import build_plan
    from skyrl_cli.recipe.loader import load_recipe
    from skyrl_contracts.rundir import RunDir

    sets = [
        f"rl.init_from={model_dir}",
        f"rl.steps={args.steps}",
        f"rl.prompts_per_step={args.prompts}",
        f"rl.samples_per_prompt={args.samples}",
        f"rl.max_new_tokens={args.max_tokens}",
        "rl.eval_every=0",
        "rl.save_every=0",
        "data.eval_size=8",
        f"rl.async.max_staleness={args.staleness}",
        "inference.engines=1",
    ]
    recipe = load_recipe(REPO / "recipes" / "quickstart.toml", sets)
    run_dir = root / ("async" if async_mode else "sync")
    shutil.rmtree(run_dir, ignore_errors=True)
    plan = build_plan(recipe, "rl", run_dir, async_mode=async_mode)
    RunDir(run_dir).prepare(recipe, plan, overwrite=True)
    (orchestrator,) = [p for p in plan.processes if p.role == "orchestrator"]
    engines = [p for p in plan.processes if p.role == "engine"]
    (router,) = [p for p in plan.processes if p.role == "router"]
    marks: dict = {}
    with Supervisor(run_dir) as sup:
        launch_inference(
            sup, engines, router, plan.engine_urls, plan.router_url, run_dir, recover=False, metrics_period_s=None
        )
        learner = threading.Thread(
            target=simulated_learner, args=(run_dir, model_dir, args.steps, args.train_s, marks), daemon=True
        )
        learner.start()
        sup.start(orchestrator)
        code = sup.wait_job(orchestrator.name, tick_s=0.1)
        learner.join(timeout=60)
        if code != 0 or "end" not in marks:
            raise SystemExit(f"orchestrator failed ({code}); see {run_dir / 'logs'}")
    trajectories = (args.steps - 1) * args.prompts * args.samples  # batch 0 is before the clock
    wall = marks["end"] - marks["start"] - args.train_s  # both end with one training step after the last batch
    gaps = [b - a for a, b in zip(marks["ready"], marks["ready"][1:])]
    return {"traj_per_s": trajectories / wall, "wall_s": wall, "step_s": statistics.median(gaps)}


def main(argv=None) -> None:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-async-"))
    try:
        model_dir = build_model(root / "model")
        ratios, t_gens = [], []
        for rep in range(args.reps):
            sync = run_once(model_dir, root, args, async_mode=False)
            asyn = run_once(model_dir, root, args, async_mode=True)
            t_gen = max(0.0, sync["step_s"] - args.train_s)  # sync step = generation + training (+ sync)
            ratios.append(asyn["traj_per_s"] / sync["traj_per_s"])
            t_gens.append(t_gen)
            print(
                f"rep {rep + 1}: sync {sync['traj_per_s']:.1f} traj/s (step {sync['step_s']:.2f} s), "
                f"async S={args.staleness} {asyn['traj_per_s']:.1f} traj/s (step {asyn['step_s']:.2f} s), "
                f"ratio {ratios[-1]:.2f}",
                flush=True,
            )
        t_gen = statistics.median(t_gens)
        ideal = (t_gen + args.train_s) / max(t_gen, args.train_s) if t_gen > 0 else float("nan")
        print(f"T_gen {t_gen:.2f} s, T_train {args.train_s:.2f} s; ideal (T_gen + T_train) / max = {ideal:.2f}")
        print(
            f"async/sync trajectories/s (median of {args.reps}): {statistics.median(ratios):.2f}  (ideal {ideal:.2f})"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

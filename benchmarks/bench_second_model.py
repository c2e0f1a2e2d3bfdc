"""A second model in the run, measured (#44): RL on the task reward, on-policy distillation from a
teacher, the mix of both, and RL on a judge model's verdicts, side by side from the same student.

    skyrl sft quickstart && skyrl rl quickstart            # the student and the teacher, once
    python benchmarks/bench_second_model.py --seeds 0 1 2 [--modes rl distill mix judge] [--json out.json]

The student is the quickstart's SFT policy (``runs/quickstart/sft``: it copies its sloppy
demonstrations, held-out accuracy about 0.5); the teacher the quickstart's RL policy
(``runs/quickstart/rl``: about 1.0). Every mode runs ``recipes/distill.toml``'s RL stage with one
change, for each seed (``--set seed=S``: the seed of sampling, data order and the held-out split):

- ``rl``: without ``[rl.distillation]`` (the quickstart's RL stage from the same student);
- ``distill``: as written (pure distillation, ``task_reward = false``);
- ``mix``: ``task_reward = true`` (the teacher's per-token term plus GRPO's);
- ``judge``: without ``[rl.distillation]``, the reward a judge's verdict (``[rl.judge]``): a model of
  the quickstart's shape trained here by ``skyrl sft`` to answer "yes" or "no" to ``57+68=125``
  (half right, a quarter the student's flaw of dropping the last digit, a quarter one digit
  changed); its held-out accuracy is printed. The judge's agreement with the exact-match check
  (``judge/agreement``) and the exact-match accuracy of the responses it judged held out
  (``eval/reference_accuracy``) are what the judge path is measured by.

Prints, per mode, the held-out exact-match accuracy at the first and last evaluations and at each
evaluation between (median and range over the seeds), the step at which it first reached 0.9, and
the wall time of the whole run (start-up included). The runs go to a temporary directory removed
at the end (``--out`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_watch import work_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "distill.toml"
MODES = ("rl", "distill", "mix", "judge")
JUDGE_TEMPLATE = "{question}{response}"  # "57+68=" + "125": the judge reads the sum as written


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="to every run")
    p.add_argument("--judge-steps", type=int, default=800, help="SFT steps of the judge")
    p.add_argument("--judge", type=Path, default=None, help="an SFT run directory of the judge to reuse (its final/)")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: removed at the end)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--skyrl", default=str(Path(sys.executable).parent / "skyrl"))
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------ the judge


def judge_rows(seed: int, n: int, split: str) -> list[dict]:
    """``57+68=125`` -> ``yes``; half the candidates right, a quarter the student's flaw (the last
    digit dropped), a quarter one digit changed."""
    from backends.data.tasks import get_task  # lazy: the data layer imports torch-free, but only this needs it

    rng = random.Random(f"judge:{seed}:{split}")
    rows = []
    for row in get_task("addition", 2).make_rows(seed, n, split):
        answer, draw = row["answer"], rng.random()
        if draw < 0.5:
            candidate = answer
        elif draw < 0.75 and len(answer) > 1:
            candidate = answer[:-1]
        else:
            i = rng.randrange(len(answer))
            candidate = answer[:i] + rng.choice([d for d in "0123456789" if d != answer[i]]) + answer[i + 1 :]
        rows.append({"prompt": row["prompt"] + candidate, "completion": "yes" if candidate == answer else "no"})
    return rows


def train_judge(args, out: Path) -> tuple[Path, float]:
    """The judge's SFT run; (its final model, its held-out accuracy)."""
    data = out / "judge-data"
    data.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 40000), ("eval", 500)):
        rows = judge_rows(1000, n, split)
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = out / "adder-judge.toml"
    recipe.write_text(
        'name = "adder-judge"\nseed = 0\n[model]\n'
        'init = { arch = "llama", hidden_size = 128, layers = 4, heads = 4, intermediate_size = 512 }\n'
        f'tokenizer = "char"\n[data]\ntrain = "{data / "train.jsonl"}"\neval = "{data / "eval.jsonl"}"\n'
        f"eval_size = 500\n[sft]\nsteps = {args.judge_steps}\nbatch_size = 128\nlearning_rate = 3e-3\n"
        "warmup_steps = 100\ngrad_clip = 1.0\neval_every = 100\nsave_every = 400\n[trainer]\nranks = 2\n"
    )
    run_dir = out / "judge-sft"
    argv = [args.skyrl, "sft", str(recipe), "--run-dir", str(run_dir), "--overwrite", "--quiet"]
    subprocess.run(argv, check=True)
    return run_dir / "final", last(run_dir, "eval/accuracy")


# ------------------------------------------------------------------------------------ the runs


def mode_recipe(mode: str, judge_dir: Path | None, out: Path) -> Path:
    """``recipes/distill.toml`` changed for ``mode`` (see the module's docstring)."""
    import tomli_w  # lazy: a dev dependency, only this script writes TOML

    recipe = tomllib.loads(RECIPE.read_text())
    rl = recipe["rl"]
    if mode in ("rl", "judge"):
        del rl["distillation"]
    if mode == "mix":
        rl["distillation"]["task_reward"] = True
    if mode == "judge":
        rl["judge"] = {"model": str(judge_dir), "template": JUDGE_TEMPLATE, "max_tokens": 4}
    recipe["name"] = f"second-model-{mode}"
    # run:<run>/<stage> resolves against the directory skyrl runs in (REPO): make it explicit here
    for section, key in (("rl", "init_from"), ("distillation", "teacher")):
        table = rl if section == "rl" else rl.get("distillation")
        if table and str(table[key]).startswith("run:"):
            table[key] = str(REPO / "runs" / table[key][4:] / "final")
    path = out / f"{mode}.toml"
    path.write_text(tomli_w.dumps(recipe))
    return path


def events_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def series(run_dir: Path, name: str) -> dict[int, float]:
    return {e["step"]: e["value"] for e in events_of(run_dir) if e["name"] == name}


def last(run_dir: Path, name: str) -> float:
    values = series(run_dir, name)
    return values[max(values)] if values else float("nan")


def run_mode(args, mode: str, seed: int, recipe: Path, out: Path) -> dict:
    run_dir = out / f"{mode}-s{seed}"
    argv = [args.skyrl, "rl", str(recipe), "--run-dir", str(run_dir), "--overwrite", "--quiet", "--set", f"seed={seed}"]
    for item in args.sets:
        argv += ["--set", item]
    started = time.monotonic()
    subprocess.run(argv, check=True, cwd=REPO)
    wall = time.monotonic() - started
    accuracy = series(run_dir, "eval/reference_accuracy" if mode == "judge" else "eval/accuracy")
    figures = {"mode": mode, "seed": seed, "wall_s": wall, "accuracy": accuracy}
    if mode == "judge":
        agreement = list(series(run_dir, "judge/agreement").values())
        figures |= {
            "judge_accuracy": series(run_dir, "eval/accuracy"),
            "agreement": statistics.mean(agreement) if agreement else None,
            "unparsed": last(run_dir, "judge/unparsed"),
            "verdicts": last(run_dir, "judge/verdicts"),
        }
    if mode in ("distill", "mix"):
        figures["reverse_kl"] = series(run_dir, "distill/reverse_kl")
    return figures


def spread(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def first_step_at(accuracy: dict[int, float], level: float) -> int | None:
    return next((step for step in sorted(accuracy) if accuracy[step] >= level), None)


def report(results: list[dict], judge_eval: float | None) -> None:
    if judge_eval is not None:
        print(f"judge: held-out accuracy of its yes/no verdicts after SFT {judge_eval:.3f}")
    for mode in MODES:
        runs = [r for r in results if r["mode"] == mode]
        if not runs:
            continue
        steps = sorted(set.intersection(*(set(r["accuracy"]) for r in runs)))
        print(f"{mode}: {len(runs)} seeds, wall {spread([r['wall_s'] for r in runs])} s")
        for step in steps:
            print(f"  step {step:3d}: held-out exact-match accuracy {spread([r['accuracy'][step] for r in runs])}")
        reached = [first_step_at(r["accuracy"], 0.9) for r in runs]
        print(f"  first evaluation at >= 0.9: steps {reached}")
        if mode == "judge":
            print(f"  judge agreement with exact match (training samples): {spread([r['agreement'] for r in runs])}")
            print(
                f"  judge replies without a verdict: {[r['unparsed'] for r in runs]} of {[r['verdicts'] for r in runs]} parsed"
            )
        if mode in ("distill", "mix"):
            kl = [(r["reverse_kl"][min(r["reverse_kl"])], r["reverse_kl"][max(r["reverse_kl"])]) for r in runs]
            print(f"  distill/reverse_kl first -> last batch: {', '.join(f'{a:.3f} -> {b:.3f}' for a, b in kl)}")


def main(argv=None) -> None:
    args = parse_args(argv)
    for stage in ("sft", "rl"):
        if not (REPO / "runs" / "quickstart" / stage / "final" / "config.json").is_file():
            sys.exit(f"runs/quickstart/{stage}/final is missing: run `skyrl {stage} quickstart` in {REPO} first")
    results, judge_eval = [], None
    with work_dir(args.out, "skyrl-second-model-") as out:
        judge_dir = None
        if "judge" in args.modes and args.judge is not None:
            judge_dir, judge_eval = args.judge / "final", last(args.judge, "eval/accuracy")
        elif "judge" in args.modes:
            judge_dir, judge_eval = train_judge(args, out)
        for seed in args.seeds:
            for mode in args.modes:  # interleaved: a slow spell of the machine touches every mode
                results.append(run_mode(args, mode, seed, mode_recipe(mode, judge_dir, out), out))
                print(f"done: {mode} seed {seed} in {results[-1]['wall_s']:.0f} s", flush=True)
    report(results, judge_eval)
    if args.json:
        args.json.write_text(json.dumps({"judge_eval_accuracy": judge_eval, "runs": results}, indent=1))


if __name__ == "__main__":
    main()

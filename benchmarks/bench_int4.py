"""INT4 W4A16 on the quickstart task: held-out accuracy served by vLLM for the full-precision SFT
model, its INT4 PTQ export (round-to-nearest) and its INT4 QAT export, side by side in one run.

Runs the README's commands (``skyrl sft``, ``skyrl quantize --ptq``, ``skyrl quantize --int4-qat``)
on ``recipes/quickstart.toml`` with ``--set`` overrides, then serves each of the three checkpoints
in turn on one vLLM engine and scores greedy answers to the recipe's held-out prompts (exact match,
the task's reward). Prints the accuracies, the recovery (QAT - PTQ) / (full - PTQ) and the size of
each export against the full-precision weights (safetensors bytes).

    python benchmarks/bench_int4.py                                   # the quickstart, clean demos
    python benchmarks/bench_int4.py --set model.init.hidden_size=256  # a larger tiny model
    python benchmarks/bench_int4.py --qat-set sft.steps=200 --qat-set sft.learning_rate=1e-3

Greedy decoding is deterministic, so one run gives each accuracy; ``--seeds`` repeats the whole
pipeline with other recipe seeds and prints the median recovery last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart.toml"
# Clean demonstrations: the quickstart's sloppy teacher caps full precision near 0.5 by design
# (RL fixes it), which would hide what quantization costs.
BASE_SETS = ["data.flawed_demos=0"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="extra --set for every stage"
    )
    p.add_argument(
        "--qat-set",
        dest="qat_sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra --set for --int4-qat",
    )
    p.add_argument("--out", type=Path, default=None, help="where the run directories go (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def skyrl(*args, cwd: Path) -> dict:
    """One skyrl command (quiet); returns its summary.json."""
    cmd = [str(Path(sys.executable).parent / "skyrl"), *map(str, args), "--quiet"]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    run_dir = Path(args[args.index("--run-dir") + 1])
    return json.loads((run_dir / "summary.json").read_text())


def pipeline(seed: int, args, out: Path) -> dict[str, Path]:
    """SFT, then PTQ and QAT of its output: the three model directories."""
    sets = [f"seed={seed}", *BASE_SETS, *args.sets]
    flags = [a for s in sets for a in ("--set", s)]
    sft, ptq, qat = out / "sft", out / "ptq", out / "qat"
    init = ["--set", f"quantization.init_from={sft / 'final'}"]
    skyrl("sft", RECIPE, *flags, "--run-dir", sft, "--overwrite", cwd=out)
    skyrl("quantize", RECIPE, "--ptq", *flags, *init, "--run-dir", ptq, "--overwrite", cwd=out)
    qat_flags = [a for s in args.qat_sets for a in ("--set", s)]
    skyrl("quantize", RECIPE, "--int4-qat", *flags, *init, *qat_flags, "--run-dir", qat, "--overwrite", cwd=out)
    return {"full": sft / "final", "ptq": ptq / "int4", "qat": qat / "int4"}


def eval_items(model_dir: Path, sets: list[str]):
    from backends.data.sft import build_sft_data, load_source
    from backends.models.tokenizer import load_tokenizer
    from skyrl_cli.recipe.loader import load_recipe

    recipe = load_recipe(RECIPE, sets)
    tokenizer = load_tokenizer(str(model_dir))
    data = build_sft_data(load_source(recipe.data, recipe.seed), tokenizer, recipe.data)
    return recipe, data, tokenizer


async def served_accuracy(url: str, data, tokenizer) -> float:
    from backends.rollout.client import RolloutClient

    async with RolloutClient(url, max_retries=2) as client:
        prompts = [list(it.prompt_ids) for it in data.eval_items]
        done = []
        for start in range(0, len(prompts), 64):
            done += await client.generate_batch(prompts[start : start + 64], f"eval-{start}", data.max_new_tokens, 0.0)
    texts = tokenizer.batch_decode([c.token_ids for c in done], skip_special_tokens=True)
    return sum(data.scorer(t, it) for t, it in zip(texts, data.eval_items)) / len(data.eval_items)


def serve_and_score(model_dir: Path, recipe, data, tokenizer, work: Path) -> float:
    """Held-out accuracy of ``model_dir`` on one vLLM engine (the engines' dtype of the recipe)."""
    import os

    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import Machine, engine_specs, engine_url
    from skyrl_cli.plan.machine import cpu_has_native_bf16
    from skyrl_contracts.ports import find_free_ports

    machine = Machine(device="cpu", engine_cores=tuple(sorted(os.sched_getaffinity(0))), cpu_bf16=cpu_has_native_bf16())
    (port,) = find_free_ports(1)
    (spec,) = engine_specs(recipe, machine, [port], str(model_dir))
    with Supervisor(work) as sup:
        sup.start(spec)
        sup.wait_ready([spec.name])
        return asyncio.run(served_accuracy(engine_url(machine, port), data, tokenizer))


def one_seed(seed: int, args, out: Path) -> dict:
    from backends.quant.export import weights_bytes

    dirs = pipeline(seed, args, out)
    recipe, data, tokenizer = eval_items(dirs["full"], [f"seed={seed}", *BASE_SETS, *args.sets])
    acc = {name: serve_and_score(d, recipe, data, tokenizer, out / f"serve-{name}") for name, d in dirs.items()}
    size = {name: weights_bytes(d) / weights_bytes(dirs["full"]) for name, d in dirs.items()}
    lost = acc["full"] - acc["ptq"]
    recovery = (acc["qat"] - acc["ptq"]) / lost if lost > 0 else float("nan")
    print(
        f"seed {seed}: held-out accuracy (vLLM, {len(data.eval_items)} prompts) full {acc['full']:.3f}  "
        f"PTQ {acc['ptq']:.3f}  QAT {acc['qat']:.3f}  recovery {recovery:.2f}  size PTQ {size['ptq']:.3f}x "
        f"QAT {size['qat']:.3f}x",
        flush=True,
    )
    return {"seed": seed, "accuracy": acc, "size_ratio": size, "recovery": recovery}


def run_seeds(one_seed, args, prefix: str) -> list[dict]:
    """``one_seed(seed, args, folder)`` for every ``--seeds``, each in its own folder under
    ``--out`` (default: a new temporary one); the results also go to ``--json`` when given."""
    out = args.out or Path(tempfile.mkdtemp(prefix=prefix))
    results = []
    for seed in args.seeds:
        (out / f"seed-{seed}").mkdir(parents=True, exist_ok=True)
        results.append(one_seed(seed, args, (out / f"seed-{seed}").resolve()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    results = run_seeds(one_seed, args, "bench-int4-")
    recoveries = [r["recovery"] for r in results]
    print(f"size ratio INT4 export / full precision: {statistics.median(r['size_ratio']['qat'] for r in results):.3f}x")
    print(
        f"median recovery (QAT - PTQ) / (full - PTQ) over {len(results)} seed(s): {statistics.median(recoveries):.2f}"
    )


if __name__ == "__main__":
    main()

"""INT4 W4A16 on the quickstart task: what round-to-nearest (PTQ) loses, and how much of it
quantization-aware training (QAT) recovers against a fair control, all served by vLLM.

Per seed, with the README's commands on ``recipes/quickstart.toml`` and ``--set`` overrides:

1. ``skyrl sft``: the start (full precision), and ``skyrl quantize --ptq`` of it: the PTQ loss.
2. From the start, the same extra training twice (``--qat-set``: the ``[sft]`` settings of both):
   ``skyrl quantize --int4-qat`` (QAT, exported as INT4) and ``skyrl sft`` in full precision (the
   control), then ``skyrl quantize --ptq`` of the control. Both arms train the same steps on the
   same batches, so what differs is only whether training saw the quantization.
3. Each of the five checkpoints served in turn on one vLLM engine, greedy answers to the recipe's
   held-out prompts scored by the task's reward (exact match).

Recovery = (QAT - control PTQ) / (control - control PTQ): the share of the quantization loss of
the equally trained model that QAT wins back. Size: safetensors bytes of the QAT export / of the
control's full-precision weights.

    python benchmarks/bench_int4.py                        # the narrow model, seeds 0 1 2
    python benchmarks/bench_int4.py --model quickstart --seeds 0
    python benchmarks/bench_int4.py --seeds 3 --set quantization.group_size=32 --qat-set sft.steps=800

The default model (``--model narrow``) is where round-to-nearest hurts: the quickstart's Llama at
hidden 32 (one head, MLP 128), trained 2000 steps, quantized per channel. It cannot fit 2-digit
addition with room to spare (held-out ~0.95 where hidden 64 and up reach 1.0), so it decides a
quarter of its answers by logit margins under 2, and per-channel rounding moves a margin by ~1
(RESULTS.md, "INT4 W4A16"). The quickstart's own model (hidden 128) answers with margins of ~8 and
loses nothing. The extra training defaults to 500 steps at lr 1e-3 (``--qat-set`` replaces them).

Greedy decoding is deterministic, so one run gives each accuracy; ``--seeds`` repeats the whole
pipeline with other recipe seeds and prints the spread last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart.toml"
# Clean demonstrations: the quickstart's sloppy teacher caps full precision near 0.5 by design
# (RL fixes it), which would hide what quantization costs.
BASE_SETS = ["data.flawed_demos=0"]
ARMS = ("full", "ptq", "control", "control-ptq", "qat")
MODELS = {
    "narrow": [
        "model.init.hidden_size=32",
        "model.init.heads=1",
        "model.init.intermediate_size=128",
        "sft.steps=2000",
        "quantization.group_size=channel",
    ],
    "quickstart": [],
}
EXTRA_TRAINING = ["sft.steps=500", "sft.warmup_steps=50", "sft.learning_rate=1e-3", "sft.eval_every=100"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--model", choices=sorted(MODELS), default="narrow", help="the setting (see above)")
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="extra --set for every stage"
    )
    p.add_argument(
        "--qat-set",
        dest="qat_sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the extra training's --set, QAT (--int4-qat) and its full-precision control alike "
        f"(default: {' '.join(EXTRA_TRAINING)})",
    )
    p.add_argument("--out", type=Path, default=None, help="where the run directories go (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    args.sets = [*MODELS[args.model], *args.sets]
    args.qat_sets = args.qat_sets or EXTRA_TRAINING
    return args


def flags(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def skyrl(*args, cwd: Path) -> dict:
    """One skyrl command (quiet); returns its summary.json."""
    cmd = [str(Path(sys.executable).parent / "skyrl"), *map(str, args), "--quiet"]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    run_dir = Path(args[args.index("--run-dir") + 1])
    return json.loads((run_dir / "summary.json").read_text())


def continued_recipe(model_dir: Path, out: Path) -> Path:
    """The quickstart recipe training ``model_dir`` (its weights and tokenizer) instead of a new
    random-init model: the control's ``skyrl sft`` starts where QAT starts."""
    import tomli_w

    data = tomllib.loads(RECIPE.read_text())
    data["model"] = {**{k: v for k, v in data["model"].items() if k != "init"}, "path": str(model_dir)}
    data["model"]["tokenizer"] = "auto"
    out.write_text(tomli_w.dumps(data))
    return out


def pipeline(seed: int, args, out: Path) -> dict[str, Path]:
    """The five model directories of one seed (``ARMS``)."""
    sets = [f"seed={seed}", *BASE_SETS, *args.sets]
    extra = flags(args.qat_sets)
    start = out / "sft" / "final"
    skyrl("sft", RECIPE, *flags(sets), "--run-dir", out / "sft", "--overwrite", cwd=out)

    def quantize(method: str, source: Path, run_dir: Path, *more: str) -> Path:
        init = ["--set", f"quantization.init_from={source}"]
        skyrl("quantize", RECIPE, method, *flags(sets), *init, *more, "--run-dir", run_dir, "--overwrite", cwd=out)
        return run_dir / "int4"

    control_sets = [s for s in sets if not s.startswith("model.init")]  # the model is the start's
    control = continued_recipe(start, out / "control.toml")
    skyrl("sft", control, *flags(control_sets), *extra, "--run-dir", out / "control", "--overwrite", cwd=out)
    return {
        "full": start,
        "ptq": quantize("--ptq", start, out / "ptq"),
        "control": out / "control" / "final",
        "control-ptq": quantize("--ptq", out / "control" / "final", out / "control-ptq"),
        "qat": quantize("--int4-qat", start, out / "qat", *extra),
    }


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


def recovery(acc: dict[str, float]) -> float:
    """(QAT - control PTQ) / (control - control PTQ); NaN where rounding the control lost nothing."""
    lost = acc["control"] - acc["control-ptq"]
    return (acc["qat"] - acc["control-ptq"]) / lost if lost > 0 else float("nan")


def one_seed(seed: int, args, out: Path) -> dict:
    from backends.quant.export import weights_bytes

    dirs = pipeline(seed, args, out)
    recipe, data, tokenizer = eval_items(dirs["full"], [f"seed={seed}", *BASE_SETS, *args.sets])
    acc = {arm: serve_and_score(dirs[arm], recipe, data, tokenizer, out / f"serve-{arm}") for arm in ARMS}
    size = weights_bytes(dirs["qat"]) / weights_bytes(dirs["control"])
    result = {"seed": seed, "accuracy": acc, "ptq_loss": acc["full"] - acc["ptq"], "recovery": recovery(acc)}
    result["size_ratio"] = size
    print(
        f"seed {seed}: held-out accuracy (vLLM, {len(data.eval_items)} prompts) start {acc['full']:.3f} -> PTQ "
        f"{acc['ptq']:.3f}; after the extra training: control {acc['control']:.3f} -> PTQ {acc['control-ptq']:.3f}, "
        f"QAT {acc['qat']:.3f}; recovery {result['recovery']:.2f}; size {size:.3f}x",
        flush=True,
    )
    return result


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


def spread(values: list[float]) -> str:
    return f"{min(values):.3f} .. {max(values):.3f} (median {statistics.median(values):.3f})"


def main(argv=None) -> None:
    args = parse_args(argv)
    results = run_seeds(one_seed, args, "bench-int4-")
    n = len(results)
    losses = [r["ptq_loss"] for r in results]
    recoveries = [r["recovery"] for r in results]
    print(
        f"PTQ loss (start - its PTQ) over {n} seed(s): {spread(losses)}; >= 0.05 on {sum(x >= 0.05 for x in losses)} of {n}"
    )
    print(f"size ratio INT4 QAT export / full precision: {spread([r['size_ratio'] for r in results])}")
    print(
        f"recovery (QAT - control PTQ) / (control - control PTQ) over {n} seed(s): {spread(recoveries)}; "
        f">= 0.8 on {sum(x >= 0.8 for x in recoveries)} of {n}"
    )


if __name__ == "__main__":
    main()

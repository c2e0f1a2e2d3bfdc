"""How the RL step's costs grow with model size: ``skyrl rl`` phases for tiny Llamas of ~1M, ~10M and
~50M parameters, next to one in-process ``transformers.generate`` of the same rollout batch.

For each size a random-init model (char tokenizer of the quickstart task) is saved once and a short
sync ``skyrl rl`` run starts from it (the quickstart's 32 prompts x 8 samples; responses up to
``--max-new-tokens``). From the run's events, medians over its steps: step interval (between
learner steps), generation (the orchestrator's wait for a full batch, sync mode), training,
weight publish (learner) and sync (engines), evaluation, the rest (exchange and scheduling gaps =
interval - generation - train - publish - sync), rollout tokens/s, and the start-up (launch ->
first evaluation). Then ``transformers.generate`` of the same 256 samples x the run's mean
response length (fp32, KV cache, all cores), alternating with the skyrl run. The last lines give,
per size, engine tokens/s / transformers tokens/s: where it passes 1, the engine path wins.

    python benchmarks/peers/bench_scaling.py                         # 1M, 10M, 50M; 4 steps, 8 tokens
    python benchmarks/peers/bench_scaling.py --max-new-tokens 64     # longer responses
    python benchmarks/peers/bench_scaling.py --quick                 # 1M and 10M, 2 steps
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from common import RECIPE, derived_recipe_text, fmt, machine, table  # noqa: E402
from skyrl_side import SKYRL, phases, run_measured  # noqa: E402

SIZES = {  # name: (hidden, layers, heads, intermediate)
    "1M": (128, 4, 4, 512),
    "10M": (320, 6, 5, 1280),
    "50M": (576, 10, 9, 2304),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument(
        "--eval-size", type=int, default=64, help="held-out prompts per evaluation (kept small: random models)"
    )
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--hf-threads", type=int, default=None, help="torch threads for transformers.generate (default: torch's)"
    )
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.steps = ["1M", "10M"], 2
    return args


def build(size: str, work: Path) -> tuple[Path, int]:
    from backends.data.tasks import get_task
    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    hidden, layers, heads, inter = SIZES[size]
    tokenizer = build_char_tokenizer(get_task("addition", 2).alphabet)
    model = build_tiny_model(
        TinyModelInit(hidden_size=hidden, layers=layers, heads=heads, intermediate_size=inter), tokenizer, seed=0
    )
    out = save_hf(model, tokenizer, work / f"model-{size}")
    return out, sum(p.numel() for p in model.parameters())


def transformers_rate(model_dir: Path, samples: int, prompts: int, length: int, threads: int | None = None) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    from benchmarks.bench_rollout import make_prompts, transformers_tokens_per_s

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return transformers_tokens_per_s(model, make_prompts(prompts, 8), samples, [length] * prompts * samples)


def one_size(args, size: str, work: Path) -> dict:
    model_dir, n_params = build(size, work)
    recipe = work / f"recipe-{size}.toml"
    recipe.write_text(derived_recipe_text(RECIPE.read_text(), str(model_dir)))
    run_dir = work / f"rl-{size}"
    sets = [
        f"rl.init_from={model_dir}",
        f"rl.steps={args.steps}",
        "rl.eval_every=0",
        f"rl.max_new_tokens={args.max_new_tokens}",
        f"data.eval_size={args.eval_size}",
        "rl.save_every=0",
    ]
    argv = [
        SKYRL,
        "rl",
        str(recipe),
        "--run-dir",
        str(run_dir),
        "--overwrite",
        "--quiet",
        *sum((["--set", s] for s in sets), []),
    ]
    m = run_measured(argv, work / f"rl-{size}.log")
    row = {
        "size": size,
        "params_m": n_params / 1e6,
        **phases(run_dir, m["launched"]),
        "wall_s": m["wall_s"],
        "load": m["load"]["median"],
    }
    length = max(1, round(row["response_len"] or args.max_new_tokens))
    row["hf_tok_s"] = transformers_rate(model_dir, 8, 32, length, args.hf_threads)
    row["hf_generate_s"] = 256 * length / row["hf_tok_s"]
    row["engine_vs_hf"] = row["rollout_tok_s"] / row["hf_tok_s"] if row["rollout_tok_s"] else None
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="peers-scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"{machine()}; {args.steps} sync RL steps of 32 x 8 samples, responses <= {args.max_new_tokens} tokens; work folder {work}",
        flush=True,
    )
    rows = []
    for size in args.sizes:
        rows.append(one_size(args, size, work))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1
            )
        )
    columns = [
        ("size", "model", 0),
        ("params_m", "params M", 1),
        ("start_s", "start-up s", 1),
        ("interval_s", "step s", 2),
        ("generate_s", "generate s", 2),
        ("hf_generate_s", "hf generate s", 2),
        ("train_s", "train s", 2),
        ("publish_s", "publish s", 3),
        ("sync_s", "sync s", 3),
        ("rest_s", "rest s", 3),
        ("eval_s", "eval s", 2),
        ("response_len", "resp len", 1),
        ("load", "load", 1),
    ]
    print(table(rows, columns))
    for r in rows:
        print(
            f"{r['size']} ({r['params_m']:.1f}M): engine rollout tokens/s / transformers.generate tokens/s = {fmt(r['engine_vs_hf'])}x "
            f"({fmt(r['rollout_tok_s'], 0)} vs {fmt(r['hf_tok_s'], 0)})"
        )


if __name__ == "__main__":
    main()

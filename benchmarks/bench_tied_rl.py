"""RL on a user's own tied-embedding model, next to the same model untied.

A new user's first model is usually tied (``tie_word_embeddings``) and has a real BPE tokenizer, not
the quickstart's character one. This builds such a model directory the way a user has one (a Llama
with a ``tokenizers``-trained BPE tokenizer with merges, saved with ``save_pretrained``), once tied and
once untied from the same seed, and runs the quickstart's task and schedule on each: ``skyrl sft`` then
``skyrl rl`` (sync, ``--steps``), exactly as a user runs them. Per run it prints the trainer-vs-engine
logprob gap on the policy's own samples (``train/logprob_diff``: every sync step is on-policy) at
steps 1, 30 and the last, its max over the run, the held-out accuracy before -> after RL, and whether
the run's health check (``skyrl_contracts.health``) fired; then the ratio tied / untied of the
mean gap, the baseline being the untied model run in the same invocation.

    python benchmarks/bench_tied_rl.py                      # seeds 0 1 2, tied and untied, 60 RL steps
    python benchmarks/bench_tied_rl.py --seeds 0 --variants tied --steps 30
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.toml"
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>")


def bpe_tokenizer(vocab_size: int = 96, seed: int = 0):
    """A BPE tokenizer with merges, trained by ``tokenizers`` on addition prompts and answers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    from backends.models.tokenizer import CHAR_CHAT_TEMPLATE

    rng = random.Random(seed)
    texts = []
    for _ in range(20000):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        texts += [f"{a}+{b}=", str(a + b)]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False)
    )
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=list(SPECIALS[4:]),
        chat_template=CHAR_CHAT_TEMPLATE,
    )


def user_model(out_dir: Path, tied: bool, seed: int = 0) -> Path:
    """The quickstart's model shape (hidden 128, 4 layers) as a user's own directory."""
    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from skyrl_contracts.schema import TinyModelInit

    tokenizer = bpe_tokenizer()
    init = TinyModelInit(hidden_size=128, layers=4, heads=4, intermediate_size=512, tie_embeddings=tied)
    return save_hf(build_tiny_model(init, tokenizer, seed), tokenizer, out_dir)


def recipe_for(model_dir: Path, out: Path) -> Path:
    recipe = tomllib.loads(QUICKSTART.read_text())
    recipe["model"] = {"path": str(model_dir), "tokenizer": "auto"}
    recipe.pop("quantization", None)
    path = out / "recipe.toml"
    path.write_text(tomli_w.dumps(recipe))
    return path


def run(skyrl: str, stage: str, recipe: Path, run_dir: Path, sets: list[str]) -> dict:
    argv = [skyrl, stage, str(recipe), "--run-dir", str(run_dir), "--overwrite", "--quiet"]
    for item in sets:
        argv += ["--set", item]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(argv)} failed ({done.returncode}):\n" + "\n".join((done.stdout + done.stderr).splitlines()[-8:])
        )
    return json.loads((run_dir / "summary.json").read_text())


def gaps(run_dir: Path) -> dict[int, float]:
    from skyrl_contracts.events import iter_events

    return {e.step: e.value for e in iter_events(run_dir / "events.jsonl") if e.name == "train/logprob_diff"}


def one(args, variant: str, seed: int, out: Path) -> dict:
    where = out / variant / f"seed{seed}"
    where.mkdir(parents=True, exist_ok=True)
    recipe = recipe_for(user_model(where / "model", variant == "tied"), where)
    sft = run(args.skyrl, "sft", recipe, where / "sft", [f"seed={seed}"])
    rl = run(
        args.skyrl,
        "rl",
        recipe,
        where / "rl",
        [f"seed={seed}", f"rl.init_from={where / 'sft' / 'final'}", f"rl.steps={args.steps}"],
    )
    per_step = gaps(where / "rl")
    mid = min(30, args.steps)
    return {
        "variant": variant,
        "seed": seed,
        "sft_accuracy": sft["metrics"]["eval/accuracy"],
        "before": rl["eval_accuracy_initial"],
        "after": rl["eval_accuracy_final"],
        "gap_1": per_step.get(1),
        f"gap_{mid}": per_step.get(mid),
        "gap_last": per_step.get(args.steps),
        "gap_mean": statistics.mean(per_step.values()),
        "gap_max_step": max(per_step.values()),
        "health_fired": "health" in rl,
        "rl_wall_s": rl.get("wall_s"),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", choices=["tied", "untied"], default=["untied", "tied"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--skyrl", default=str(Path(sys.executable).with_name("skyrl")))
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="skyrl-tied-"))
    rows = []
    for seed in args.seeds:
        for variant in args.variants:
            rows.append(one(args, variant, seed, out))
            print(json.dumps(rows[-1]), flush=True)
    for variant in args.variants:
        mine = [r for r in rows if r["variant"] == variant]
        if mine:
            print(
                f"{variant}: mean gap {min(r['gap_mean'] for r in mine):.2e}-{max(r['gap_mean'] for r in mine):.2e}, "
                f"worst step {max(r['gap_max_step'] for r in mine):.2e}, RL gain "
                + ", ".join(f"{r['after'] - r['before']:+.3f}" for r in mine)
                + f", health fired in {sum(r['health_fired'] for r in mine)}/{len(mine)}"
            )
    by = {v: statistics.mean(r["gap_mean"] for r in rows if r["variant"] == v) for v in args.variants}
    if {"tied", "untied"} <= set(by):
        print(f"tied / untied mean on-policy gap: {by['tied'] / by['untied']:.2f}x; run directories: {out}")


if __name__ == "__main__":
    main()

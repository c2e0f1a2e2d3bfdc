"""Writes train.jsonl and eval.jsonl of the own_task recipe: sort 5 letters from a-h.

    python recipes/own_task/make_data.py        # the committed files are its output (seed 0)

A row is {"prompt": "hbdca", "completion": "abcdh"}: SFT trains on prompt -> completion, RL rolls
out the prompt and scores the response with reward.py. No prompt of eval.jsonl is in train.jsonl.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

LETTERS, LENGTH = "abcdefgh", 5
TRAIN_ROWS, EVAL_ROWS, SEED = 4000, 200, 0


def row(rng: random.Random) -> dict:
    prompt = "".join(rng.choice(LETTERS) for _ in range(LENGTH))
    return {"prompt": prompt, "completion": "".join(sorted(prompt))}


def main() -> None:
    rng = random.Random(SEED)
    evals: dict[str, dict] = {}
    while len(evals) < EVAL_ROWS:  # distinct held-out prompts
        r = row(rng)
        evals.setdefault(r["prompt"], r)
    train = []
    while len(train) < TRAIN_ROWS:  # i.i.d. draws outside the held-out prompts (repeats allowed)
        r = row(rng)
        if r["prompt"] not in evals:
            train.append(r)
    here = Path(__file__).resolve().parent
    for name, rows in (("train.jsonl", train), ("eval.jsonl", list(evals.values()))):
        with open(here / name, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"wrote {len(rows)} rows to {here / name}")


if __name__ == "__main__":
    main()

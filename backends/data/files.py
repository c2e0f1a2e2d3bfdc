"""Rows from local files: JSONL, parquet, or an HF dataset directory (``datasets.save_to_disk``)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path


def load_rows(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
    """All rows (or the first ``limit``) of a JSONL file, a parquet file or an HF dataset directory."""
    p = Path(path)
    if p.is_dir():
        # lazy: datasets (seconds); only a saved-dataset directory needs it
        import datasets

        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if len(ds) != 1:
                raise ValueError(f"{p} holds several splits ({', '.join(ds)}); point at one split's directory")
            ds = next(iter(ds.values()))
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
        return [dict(r) for r in ds]
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet") and not p.is_file():  # the recipe check saw it: gone since
        raise ValueError(f"{p}: data file not found (moved or deleted after the run was started?)")
    if suffix in (".jsonl", ".json"):
        rows = []
        with open(p, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{p}:{lineno}: not a JSON line: {err.msg}") from None
                if limit is not None and len(rows) >= limit:
                    break
        return rows
    if suffix == ".parquet":
        # lazy: pyarrow; only parquet files need it
        import pyarrow.parquet as pq

        rows = pq.read_table(p).to_pylist()
        return rows[:limit] if limit is not None else rows
    raise ValueError(f"{p}: unsupported data file (use .jsonl, .parquet or an HF dataset directory)")


def hold_out(rows: list, eval_size: int, seed: int) -> tuple[list, list]:
    """(train, held-out) when the recipe names no eval file: a seeded subset of at most
    ``eval_size`` rows and at most 10% of them, removed from training. The SFT stage and the RL
    stage both call it, so they evaluate on the same rows and never train on them."""
    k = min(eval_size, len(rows) // 10)
    held = set(random.Random(f"{seed}:heldout").sample(range(len(rows)), k))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]

"""Learning-rate schedules as pure multipliers of the peak rate (for ``torch.optim.lr_scheduler.LambdaLR``)."""

from __future__ import annotations

import math
from functools import partial
from typing import Callable


def lr_factor(step: int, *, warmup: int, total: int, kind: str = "cosine", min_ratio: float = 0.0) -> float:
    """Multiplier of the peak rate for optimizer step ``step`` (0-based): linear warm-up from
    1/warmup to 1 over ``warmup`` steps, then ``kind`` decay to ``min_ratio`` at step ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if kind == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {kind!r}")


def schedule(warmup: int, total: int, kind: str, min_ratio: float) -> Callable[[int], float]:
    return partial(lr_factor, warmup=warmup, total=total, kind=kind, min_ratio=min_ratio)

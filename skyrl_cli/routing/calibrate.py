"""Fit the simulator's step cost to real engines, and compare simulated with measured throughput.

Measuring: for each shape (m concurrent streams, prompt P tokens, D generated tokens with
``ignore_eos``), m closed-loop streams per engine send such requests back to back for a couple of
seconds on every engine at once, so the engines, the client and the cores are as busy as during the
live replay, and the mean request latency is kept (an average over many requests: single timings on
a shared 2-core machine scatter by 2-4x). In steady state a step holds m decoding sequences and, on
average, m/D newly admitted prompts, so under the simulator's model a request takes

    c0 + c1 * m + per_prefill_token * m*P + D * (base + per_seq * m) + per_kv_token * (D*m*P + m*D*(D-1)/2)

which is linear in (c0, c1, base, per_prefill_token, per_seq, per_kv_token); a non-negative
least-squares fit on relative errors gives them. ``c0 + c1`` (HTTP, JSON, the client and the API
server handling one request) becomes the simulator's ``request_overhead_s``. The decode points vary
m, the prefill points P with D = 1, the mixed points both.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import httpx
import numpy as np

from skyrl_cli.routing.engine_model import StepCost
from skyrl_cli.routing.live import post
from skyrl_contracts.engine_api import GENERATE_PATH, SERVED_MODEL_NAME

# (concurrent requests m, prompt tokens P, generated tokens D)
DECODE_SHAPES = [(1, 16, 32), (4, 16, 32), (8, 16, 32), (16, 16, 32)]
PREFILL_SHAPES = [(1, 128, 1), (1, 512, 1), (1, 960, 1)]
CONTEXT_SHAPES = [(4, 400, 16), (8, 600, 32)]
WINDOW_S = 2.5


@dataclass(frozen=True)
class FittedCost:
    cost: StepCost
    request_overhead_s: float
    points: list[dict]  # shape, measured and fitted seconds
    max_relative_error: float

    def to_dict(self) -> dict:
        return {
            "cost": asdict(self.cost),
            "request_overhead_s": self.request_overhead_s,
            "points": self.points,
            "max_relative_error": self.max_relative_error,
        }


def features(m: int, prompt: int, decode: int) -> list[float]:
    """Coefficients of (c0, c1, base, per_prefill_token, per_seq, per_kv_token) in a batch's time."""
    return [1.0, m, decode, m * prompt, decode * m, decode * m * prompt + m * decode * (decode - 1) / 2]


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 for a handful of columns: drop the most negative one and refit."""
    active = list(range(a.shape[1]))
    while True:
        x_active, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (x_active >= 0).all() or len(active) == 1:
            x = np.zeros(a.shape[1])
            x[active] = np.maximum(x_active, 0)
            return x
        active.pop(int(np.argmin(x_active)))


def fit_step_cost(measured: Sequence[tuple[tuple[int, int, int], float]]) -> FittedCost:
    shapes = [shape for shape, _ in measured]
    seconds = np.array([t for _, t in measured])
    a = np.array([features(*s) for s in shapes]) / seconds[:, None]  # relative errors
    x = nnls(a, np.ones(len(shapes)))
    c0, c1, base, prefill, per_seq, per_kv = (float(v) for v in x)
    fitted = np.array([features(*s) for s in shapes]) @ x
    points = [
        {"m": m, "prompt": p, "decode": d, "measured_s": float(t), "fitted_s": float(f)}
        for (m, p, d), t, f in zip(shapes, seconds, fitted)
    ]
    return FittedCost(
        StepCost(base, prefill, per_seq, per_kv), c0 + c1, points, float(np.max(np.abs(fitted / seconds - 1)))
    )


async def _closed_loop_latency(
    http: httpx.AsyncClient,
    url: str,
    shape: tuple[int, int, int],
    rng: np.random.Generator,
    token_pool: np.ndarray,
    model: str,
    window_s: float,
) -> float:
    """Mean latency of requests of ``shape`` sent back to back by m streams for ``window_s`` seconds."""
    m, prompt, decode = shape
    deadline = time.monotonic() + window_s
    latencies: list[float] = []

    async def stream() -> None:
        while True:
            body = {
                "token_ids": [int(t) for t in rng.choice(token_pool, prompt)],
                "model": model,
                "sampling_params": {
                    "max_tokens": decode,
                    "min_tokens": decode,
                    "ignore_eos": True,
                    "temperature": 1.0,
                    "detokenize": False,
                },
            }
            start = time.monotonic()
            response = await post(http, f"{url}{GENERATE_PATH}", json=body)
            response.raise_for_status()
            latencies.append(time.monotonic() - start)
            if time.monotonic() >= deadline:
                return

    await asyncio.gather(*(stream() for _ in range(m)))
    return float(np.mean(latencies))


async def measure_engines(
    http: httpx.AsyncClient,
    engine_urls: Sequence[str],
    token_pool: Sequence[int],
    seed: int = 0,
    model: str = SERVED_MODEL_NAME,
    window_s: float = WINDOW_S,
) -> FittedCost:
    """Measure every shape on all engines at once (random prompts: no prefix-cache hits) and fit.

    On a shared machine the cost drifts with what else runs, so callers measure right before the
    run they want to predict (about 25 s with the default window)."""
    rng = np.random.default_rng([seed, 424242])
    pool = np.asarray(token_pool, dtype=np.int64)
    urls = [u.rstrip("/") for u in engine_urls]
    await _closed_loop_latency(http, urls[0], (2, 32, 8), rng, pool, model, 0.5)  # warm-up: one-off costs
    measured = []
    for shape in DECODE_SHAPES + PREFILL_SHAPES + CONTEXT_SHAPES:
        latencies = await asyncio.gather(
            *(_closed_loop_latency(http, u, shape, rng, pool, model, window_s) for u in urls)
        )
        measured.append((shape, float(np.mean(latencies))))
    return fit_step_cost(measured)

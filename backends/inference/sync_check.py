"""One weight-sync round trip against a running engine: does it serve what the trainer published?

``python -m backends.inference.sync_check --engine-url URL --model DIR --scratch DIR`` (the engine
serves ``DIR``, or the untied copy the RL stage starts engines from):

1. a moved policy: ``DIR``'s weights plus seeded noise on every tensor (a tied model stays tied,
   so its head moves with its embedding, as training moves it);
2. published as the learner publishes a version for the engines (``backends.models.tied.save_for_engines``,
   a tied head written out, in ``--engine-dtype`` when given) and loaded through the disk sync
   (``sync_weights``);
3. the engine's prompt logprobs of a fixed sequence against transformers' on the moved weights.

Prints one JSON line: ``{"max_abs_diff", "mean_abs_diff", "tied", "tokens"}``. A sync that leaves any
part of the policy behind is off by the noise's effect, orders of magnitude above the numerics
(fp32 engines agree to ~1e-6; see ``SYNC_GAP_FLOORS`` in ``skyrl_contracts.health``). Used by
``skyrl doctor --smoke`` and the tied/untied sync matrix test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backends.inference.weight_sync import run_blocking, sync_weights
from backends.models.tied import save_for_engines
from skyrl_contracts.engine_api import SERVED_MODEL_NAME

NOISE = 0.5  # in units of each tensor's own std: far above rounding, small enough to stay a model
SEQUENCE_LEN = 24


def fixed_sequence(vocab: int, length: int = SEQUENCE_LEN) -> list[int]:
    """Token ids spread over the vocabulary (past the first few, usually special), the same every time."""
    low = min(8, vocab - 1)
    return [low + (7 * i + 3) % (vocab - low) for i in range(length)]


def moved_policy(model, seed: int = 0):
    """``model`` with every floating tensor moved by ``NOISE`` of its std (in place; returns it)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # each shared (tied) parameter once
            scale = float(param.float().std()) if param.numel() > 1 else 1.0
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * NOISE * (scale or 1.0)
            param.add_(noise.to(param.dtype))
    return model


def transformers_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, computed in fp32 on the model's device."""
    on = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=on)).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:], device=on).unsqueeze(1)).squeeze(1).tolist()


def engine_logprobs(
    url: str, ids: list[int], model_name: str = SERVED_MODEL_NAME, timeout_s: float = 60.0
) -> list[float]:
    """The engine's prompt logprobs of ``ids`` (positions 1..), temperature 1 (no processing)."""
    body = {"model": model_name, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    response.raise_for_status()
    per_position = response.json()["choices"][0]["prompt_logprobs"][1:]
    return [float(entry[str(token)]["logprob"]) for entry, token in zip(per_position, ids[1:])]


def gap(engine: list[float], reference: list[float]) -> tuple[float, float]:
    diffs = [abs(a - b) for a, b in zip(engine, reference)]
    return max(diffs), sum(diffs) / len(diffs)


def round_trip(
    engine_url: str, model_dir: Path, scratch: Path, version: str = "sync-check", engine_dtype: str | None = None
) -> dict:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    moved = moved_policy(model)
    weights = scratch / "moved"
    tied = save_for_engines(moved, tokenizer, weights, dtype=engine_dtype)
    run_blocking(sync_weights([engine_url], weights, version))
    ids = fixed_sequence(min(moved.config.get_text_config().vocab_size, len(tokenizer)))
    worst, mean = gap(engine_logprobs(engine_url, ids), transformers_logprobs(moved, ids))
    return {"max_abs_diff": worst, "mean_abs_diff": mean, "tied": tied, "tokens": len(ids) - 1}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m backends.inference.sync_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--engine-url", required=True)
    parser.add_argument("--model", required=True, type=Path, help="the model directory the engine was started from")
    parser.add_argument("--scratch", required=True, type=Path, help="where the moved policy is written")
    parser.add_argument(
        "--engine-dtype", default=None, help="the engine's dtype, which the learner writes its versions in"
    )
    args = parser.parse_args(argv)
    result = round_trip(args.engine_url, args.model, args.scratch, engine_dtype=args.engine_dtype)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""A tiny model directory for the driver's own uses (``skyrl doctor --smoke``, ``skyrl bench routing
--live``), built in a child process (``python -m backends.models.tiny``) so that the driver never
imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from skyrl_contracts.errors import LaunchError
from skyrl_contracts.schema import TinyModelInit


def build_tiny_model_dir(
    init: TinyModelInit, alphabet: str, out: str | Path, timeout_s: float = 300.0, seed: int = 0
) -> list[int]:
    """Save a tiny ``init`` model with a character tokenizer of ``alphabet`` at ``out``; returns the
    token ids of the alphabet's characters. ``LaunchError`` names the child's last line on failure."""
    argv = [
        sys.executable,
        "-m",
        "backends.models.tiny",
        "--init",
        init.model_dump_json(),
        "--alphabet",
        alphabet,
        "--out",
        str(out),
        "--seed",
        str(seed),
    ]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"building the tiny model took more than {timeout_s:.0f} s") from None
    if done.returncode != 0:
        last = ([line for line in done.stderr.splitlines() if line.strip()] or [f"exit code {done.returncode}"])[-1]
        raise LaunchError(f"building the tiny model failed: {last.strip()}")
    return list(json.loads(done.stdout.strip().splitlines()[-1])["alphabet_ids"])

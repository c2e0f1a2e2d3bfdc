"""`skyrl --help` and `skyrl recipes validate` must not import the heavy stack."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO

HEAVY = ("torch", "vllm", "deepspeed", "transformers", "wandb", "peft", "torchao", "matplotlib")

PROBE = """
import json, sys
from skyrl_cli.app import main
try:
    main({args!r})
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["recipes", "validate", "recipes/quickstart.toml"],
        ["recipes", "ls"],
        ["completions", "bash"],
        ["runs", "ls"],
        ["doctor", "recipes/quickstart.toml", "--quick"],
    ],
    ids=" ".join,
)
def test_cli_imports_nothing_heavy(args):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=args, heavy=set(HEAVY))],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    loaded = json.loads(proc.stderr.strip().splitlines()[-1])
    assert loaded == [], f"`skyrl {' '.join(args)}` imported {loaded}"

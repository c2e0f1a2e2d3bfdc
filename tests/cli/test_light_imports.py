"""`skyrl --help` and `skyrl recipes validate` must not import the heavy stack."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO, run_console_script

HEAVY = (
    *("torch", "vllm", "deepspeed", "transformers", "wandb", "peft", "torchao", "matplotlib"),
    *("reasoning_gym", "skyrl_gym", "verifiers"),  # the environment libraries: checked without importing them
)

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
        ["recipes", "validate", "recipes/reasoning_gym.toml"],
        ["recipes", "validate", "recipes/environments/skyrl_gym.toml"],
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


@pytest.mark.parametrize(
    "args, says",
    [
        (("rl", "recipes/quickstart.toml", "--bogus"), "No such option: --bogus"),
        (("sft",), "Missing argument 'RECIPE'"),
        (("no-such-command",), "No such command 'no-such-command'"),
        (("rll",), "Did you mean 'rl'?"),
        (("rl", "recipes/quickstart.toml", "--dry-rn"), "Possible options: --dry-run"),
        ((), "Usage: skyrl"),  # bare: the help, as a usage error
    ],
)
def test_usage_errors_of_the_console_script_are_usage_errors(args, says):
    """Exit 2 with click's message, not "internal error" (typer 0.29 vendors its own click)."""
    result = run_console_script(*args)
    assert result.code == 2, (result.code, result.err)
    shown = result.err + result.out  # bare `skyrl` shows its help on stdout
    assert says in shown and "internal error" not in shown and "Traceback" not in shown

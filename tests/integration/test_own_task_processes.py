"""The `own_task` example's committed rows are what its make_data.py writes (run as a user runs it)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from backends.data.files import load_rows
from tests.unit.test_own_task import TASK

pytestmark = pytest.mark.integration


def test_committed_rows_are_make_data_output_and_the_splits_are_disjoint(tmp_path):
    copy = tmp_path / "own_task"
    shutil.copytree(TASK, copy, ignore=shutil.ignore_patterns("*.jsonl", "__pycache__"))
    subprocess.run([sys.executable, str(copy / "make_data.py")], check=True, capture_output=True)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (copy / name).read_text() == (TASK / name).read_text(), f"{name} is not make_data.py's output"
    train, evals = load_rows(TASK / "train.jsonl"), load_rows(TASK / "eval.jsonl")
    assert (len(train), len(evals)) == (4000, 200)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    assert all(r["completion"] == "".join(sorted(r["prompt"])) for r in train + evals)

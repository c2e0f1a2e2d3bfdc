"""A shortened quickstart through the real pipeline: SFT on the flawed demonstrations, then RL that
must raise held-out accuracy (the quickstart's own recipe, fewer steps and a smaller eval split).

SFT runs 500 of the recipe's 800 steps: by then the model has learned two-digit sums and copies
the sloppy teacher, so greedy accuracy sits near the share of two-digit sums; 10 RL steps with
4 mini-batches each then teach it to finish three-digit sums (measured: +0.4 or more within 10
steps in the full quickstart, see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json

import pytest

from tests.integration.cli_runs import events
from tests.integration.conftest import RL_STDOUT

pytestmark = pytest.mark.integration


def test_shortened_quickstart_rl_raises_held_out_accuracy(shortened_quickstart_sft, shortened_quickstart_rl):
    sft_dir, rl_dir = shortened_quickstart_sft, shortened_quickstart_rl
    sft_accuracy = events(sft_dir, "eval/accuracy")[-1][1]
    assert 0.2 < sft_accuracy < 0.75, f"SFT should have learned the sums and copied the flaw: {sft_accuracy}"

    stdout = (rl_dir / RL_STDOUT).read_text()
    summary = json.loads((rl_dir / "summary.json").read_text())
    assert summary["completed"] is True
    assert summary["eval_accuracy_initial"] == pytest.approx(sft_accuracy, abs=0.05)  # engines serve the SFT model
    assert summary["eval_accuracy_final"] >= summary["eval_accuracy_initial"] + 0.10, summary
    # The end of the run, as printed: a short table and one wall time split into what it counts.
    rows = [line for line in stdout.splitlines() if line.count("│") >= 3]
    assert 5 <= len(rows) <= 15, stdout
    assert "train/update" not in stdout and "held-out accuracy" in stdout
    assert 0 < summary["startup_s"] < summary["wall_s"] and summary["training_s"] > 0
    assert f"{summary['wall_s']:.0f} s (start-up {summary['startup_s']:.0f} s" in stdout
    clip = [v for _, v in events(rl_dir, "train/update4/clip_frac")]
    assert len(clip) == 10 and max(clip) > 0.0  # four updates a step, and the clip acted

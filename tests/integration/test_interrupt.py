"""Ctrl-C in the middle of a real `skyrl rl` (engine + router + orchestrator + 2-rank learner): the
command exits 130 with a last line naming the step and the last complete checkpoint, leaves no
process behind and marks summary.json ``completed: false``."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from skyrl_contracts.rundir import RunDir
from tests.integration.cli_runs import ENV, SKYRL, children, events
from tests.integration.conftest import wait_groups_gone
from tests.recipes import RL, merged, tiny_recipe, write_recipe

pytestmark = pytest.mark.integration

RECIPE = tiny_recipe(RL, name="sigtest", data={"eval_size": 8}, rl={"steps": 40, "save_every": 1})


def wait_for_training(driver: subprocess.Popen, run: Path, out: Path, timeout_s: float = 420) -> None:
    """Until the learner has logged a step and written a complete checkpoint."""
    deadline = time.monotonic() + timeout_s
    while not (events(run, "train/policy_loss") and RunDir(run).latest_checkpoint()):
        assert driver.poll() is None, f"skyrl rl ended early ({driver.returncode}):\n{out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "training did not start in time"
        time.sleep(0.5)


def test_sigint_during_rl_training_exits_130_with_the_checkpoint_and_no_process_left(tmp_path, tiny_model_dir):
    write_recipe(tmp_path / "recipe.toml", merged(RECIPE, rl={"init_from": str(tiny_model_dir)}))
    run, out = tmp_path / "runs/sigtest/rl", tmp_path / "out.txt"
    with open(out, "w") as sink:
        driver = subprocess.Popen(
            [str(SKYRL), "rl", "recipe.toml", "--quiet"], cwd=tmp_path, env=ENV, stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        wait_for_training(driver, run, out)
        groups = children(driver.pid)
        driver.send_signal(signal.SIGINT)
        code = driver.wait(timeout=90)
    finally:
        if driver.poll() is None:
            driver.kill()
    text = out.read_text()
    assert code == 130, text[-3000:]
    assert len(groups) >= 5, groups  # engine, router, orchestrator, trainer, reaper
    assert not wait_groups_gone(groups), "processes left behind"
    last = text.strip().splitlines()[-1]
    match = re.fullmatch(
        r"rl interrupted \(SIGINT\) at step (\d+) during training; last complete checkpoint: (\S+) \(resume with --resume\)",
        last,
    )
    assert match, last
    assert Path(match.group(2)) == RunDir(run).latest_checkpoint().relative_to(tmp_path)
    assert int(match.group(1)) < 40 and "Traceback" not in text
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is False and summary["interrupted"] == "SIGINT"

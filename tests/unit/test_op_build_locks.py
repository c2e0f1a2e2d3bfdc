"""Stale locks of DeepSpeed's op builds are cleared (a killed first build hung every later run)."""

from __future__ import annotations

import os
import sys
import time

from skyrl_cli.launch.op_builds import clear_locks_since, clear_stale_locks
from skyrl_cli.launch.supervisor import Supervisor
from skyrl_cli.plan.model import ProcessSpec


def lock(ext, op: str, age_s: float):
    path = ext / op / "lock"
    path.parent.mkdir(parents=True)
    path.touch()
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_only_locks_older_than_any_build_are_stale(tmp_path):
    old, fresh = lock(tmp_path, "shm_comm", 3600), lock(tmp_path, "cpu_adam", 5)
    assert clear_stale_locks(tmp_path) == [old]
    assert fresh.exists() and not old.exists()


def test_locks_made_during_a_run_are_cleared_after_it(tmp_path):
    before, during = lock(tmp_path, "a", 100), lock(tmp_path, "b", 0)
    assert clear_locks_since(tmp_path, time.time() - 10) == [during]
    assert before.exists()


def test_the_supervisor_clears_them_around_a_process_that_builds_ops(tmp_path):
    ext = tmp_path / "ext"
    stale = lock(ext, "shm_comm", 3600)
    spec = ProcessSpec(
        name="job",
        role="trainer",
        kind="job",
        argv=(sys.executable, "-c", "pass"),
        env={"TORCH_EXTENSIONS_DIR": str(ext)},
    )
    with Supervisor(tmp_path / "run") as supervisor:
        supervisor.start(spec)
        assert not stale.exists()
        killed_build = lock(ext, "cpu_adam", 0)  # as if the job died mid-build
        supervisor.wait_job("job")
    assert not killed_build.exists()

"""Stale locks of DeepSpeed's op builds are cleared (a killed first build hung every later run)."""

from __future__ import annotations

import os
import time

from skyrl_cli.launch.op_builds import clear_locks_since, clear_stale_locks


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

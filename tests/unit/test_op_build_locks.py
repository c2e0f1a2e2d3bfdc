"""Locks of DeepSpeed's op builds that no build holds are cleared (a killed first build hung every
later run), and a lock another run's build holds is not (removing it failed that build)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from skyrl_cli.launch.op_builds import clear_abandoned_locks
from skyrl_contracts.build_locks import owner_pid, owner_text


def lock(ext, op: str, age_s: float, owner: str = ""):
    path = ext / op / "lock"
    path.parent.mkdir(parents=True)
    path.write_text(owner)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_an_unowned_lock_is_cleared_only_once_older_than_any_build(tmp_path):
    old, fresh = lock(tmp_path, "shm_comm", 3600), lock(tmp_path, "cpu_adam", 5)
    assert clear_abandoned_locks(tmp_path) == [old]
    assert fresh.exists() and not old.exists()


def test_a_lock_whose_builder_died_is_cleared_at_once(tmp_path):
    died = lock(tmp_path, "shm_comm", 0, f"{socket.gethostname()} {dead_pid()}\n")
    assert clear_abandoned_locks(tmp_path) == [died]


def test_a_lock_held_by_a_live_build_or_on_another_host_is_left(tmp_path):
    live = lock(tmp_path, "shm_comm", 0, owner_text())  # this test is the builder, alive
    elsewhere = lock(tmp_path, "cpu_adam", 0, f"another-host {dead_pid()}\n")
    assert clear_abandoned_locks(tmp_path) == []
    assert live.exists() and elsewhere.exists()
    assert owner_pid(live) == os.getpid() and owner_pid(elsewhere) is None


def test_a_trainer_process_writes_its_owner_into_the_locks_it_takes(tmp_path):
    from torch.utils.file_baton import FileBaton

    from backends.train.engine import own_build_locks

    own_build_locks()
    own_build_locks()  # once is enough: not wrapped twice
    baton = FileBaton(str(tmp_path / "lock"))
    assert baton.try_acquire()
    assert owner_pid(tmp_path / "lock") == os.getpid()
    assert not FileBaton(str(tmp_path / "lock")).try_acquire()  # still exclusive
    baton.release()
    assert not (tmp_path / "lock").exists()

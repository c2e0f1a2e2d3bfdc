"""A supervisor that adopts an engine pool's processes leaves them running at its teardown (real
processes: the engine and the trainer are sleepers)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from skyrl_cli.launch.pids import pid_alive
from skyrl_cli.launch.supervisor import Supervisor
from skyrl_cli.plan.model import ProcessSpec

pytestmark = pytest.mark.integration


def test_adopted_and_detached_processes_outlive_the_supervisor(tmp_path):
    sleeper = (sys.executable, "-c", "import time; time.sleep(60)")
    outside = subprocess.Popen(list(sleeper), start_new_session=True)
    seen = []
    try:
        with Supervisor(tmp_path, on_detached=seen.append) as sup:
            sup.adopt(ProcessSpec(name="engine-0", role="engine", argv=sleeper), outside.pid, tmp_path / "pool.log")
            own = sup.start(ProcessSpec(name="job", role="trainer", argv=sleeper, kind="job"))
            assert sup.poll() == {"engine-0": None, "job": None}
            restarted = sup.restart("engine-0")  # what the engine recovery does to a dead engine
            assert restarted.detached and restarted.popen.pid != outside.pid
            assert restarted.log_path == tmp_path / "pool.log"
            assert [p.spec.name for p in seen] == ["engine-0"]  # the pool's state file follows it
        assert not pid_alive(own.popen.pid)  # the run's own process is torn down
        assert pid_alive(restarted.popen.pid)  # the pool's is not
        assert outside.wait(timeout=15) is not None  # the restart replaced the adopted one
    finally:
        for pid in (outside.pid, *(p.popen.pid for p in seen)):
            try:
                os.killpg(pid, 9)
            except ProcessLookupError:
                pass

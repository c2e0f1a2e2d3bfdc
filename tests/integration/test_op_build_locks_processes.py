"""The supervisor clears stale locks of DeepSpeed's op builds around a real process that builds ops."""

from __future__ import annotations

import sys

import pytest

from skyrl_cli.launch.supervisor import Supervisor
from skyrl_cli.plan.model import ProcessSpec
from tests.unit.test_op_build_locks import lock

pytestmark = pytest.mark.integration


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

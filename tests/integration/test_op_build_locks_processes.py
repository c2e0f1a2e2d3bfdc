"""The supervisor clears the locks of DeepSpeed's op builds that no build holds around a real
process, and leaves the lock of a build that another run is doing."""

from __future__ import annotations

import sys

import pytest

from skyrl_cli.launch.supervisor import Supervisor
from skyrl_cli.plan.model import ProcessSpec
from skyrl_contracts.build_locks import owner_text
from tests.unit.test_op_build_locks import lock

pytestmark = pytest.mark.integration

# A trainer that takes a build lock the way torch does, says it holds it, and dies mid-build.
DIES_MID_BUILD = """
import os, sys
from skyrl_contracts.build_locks import write_owner
path = os.path.join(sys.argv[1], "cpu_adam", "lock")
os.makedirs(os.path.dirname(path))
os.close(os.open(path, os.O_CREAT | os.O_EXCL))
write_owner(path)
os._exit(1)
"""


def test_the_supervisor_clears_abandoned_locks_and_leaves_another_runs_build(tmp_path):
    ext = tmp_path / "ext"
    stale = lock(ext, "shm_comm", 3600)
    another_run = lock(ext, "fused_adam", 0, owner_text())  # this test process: a live build
    spec = ProcessSpec(
        name="job",
        role="trainer",
        kind="job",
        argv=(sys.executable, "-c", DIES_MID_BUILD, str(ext)),
        env={"TORCH_EXTENSIONS_DIR": str(ext)},
    )
    with Supervisor(tmp_path / "run") as supervisor:
        supervisor.start(spec)
        assert not stale.exists()
        supervisor.wait_job("job")
        assert (ext / "cpu_adam" / "lock").exists()  # left by the dead build until the teardown
    assert not (ext / "cpu_adam" / "lock").exists()
    assert another_run.exists()

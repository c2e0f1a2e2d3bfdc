"""What the fault-injection suite (tests/faults) relies on, checked cheaply with real processes: job
waits that stop at the first failed job, the router's restart, and torchrun workers that die with
their launcher."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from skyrl_cli.launch.supervisor import Supervisor
from skyrl_cli.plan.model import ProcessSpec
from skyrl_contracts.errors import LaunchError

pytestmark = pytest.mark.integration


def _job(name: str, code: str) -> ProcessSpec:
    return ProcessSpec(name=name, role="orchestrator", argv=(sys.executable, "-c", code), kind="job")


def test_wait_jobs_stops_at_the_first_killed_job_while_another_waits(tmp_path):
    waiting = _job("learner", "import time; time.sleep(600)")
    killed = _job("orchestrator", "import os, signal, time; time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)")
    with Supervisor(tmp_path) as sup:
        for spec in (killed, waiting):
            sup.start(spec)
        started = time.monotonic()
        with pytest.raises(LaunchError) as info:
            sup.wait_jobs(["orchestrator", "learner"], tick_s=0.05)
    assert time.monotonic() - started < 5
    assert str(info.value) == f"the orchestrator was killed by SIGKILL; log: {tmp_path / 'logs/orchestrator.log'}"


def test_wait_jobs_returns_once_all_succeed_in_any_order(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start(_job("a", "pass"))
        sup.start(_job("b", "import time; time.sleep(0.5)"))
        sup.wait_jobs(["b", "a"], tick_s=0.05)
        assert sup.poll() == {"a": 0, "b": 0}


def test_the_router_is_restarted_when_it_exits(tmp_path):
    from skyrl_cli.engines.recovery import EngineRecovery

    flag = tmp_path / "second-start"
    # The first start exits at once (a killed router); the restart keeps running.
    code = f"import pathlib, sys, time\np = pathlib.Path({str(flag)!r})\nif not p.exists():\n    p.write_text('x'); sys.exit(-9)\ntime.sleep(600)"
    router = ProcessSpec(name="router", role="router", argv=(sys.executable, "-c", code))
    with Supervisor(tmp_path) as sup:
        sup.start(router)
        deadline = time.monotonic() + 10
        while sup.poll()["router"] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        recovery = EngineRecovery(sup, {}, "http://127.0.0.1:9", tmp_path, router_name="router", max_restarts=1)
        try:
            assert recovery.check_once() == ["router"]
            assert sup.poll()["router"] is None and recovery.restarts == {"router": 1}
            assert recovery.gave_up() is None
            sup.processes["router"].popen.kill()
            sup.processes["router"].popen.wait()
            assert recovery.check_once() == []  # max_restarts reached: no more restarts
            assert recovery.gave_up() == f"router died after 1 restarts; log: {tmp_path / 'logs/router.log'}"
        finally:
            recovery.stop()


def test_a_torchrun_worker_dies_with_its_launcher(tmp_path):
    """torchrun starts workers in sessions of their own: killing torchrun must still end them."""
    import os
    import signal
    import subprocess

    pytest.importorskip("torch")
    pid_file = tmp_path / "worker.pid"
    worker = (
        "import os, pathlib, sys, time\n"
        "from backends.train.engine import die_with_launcher\n"
        f"die_with_launcher(); pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(600)\n"
    )
    launcher = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True); time.sleep(600)\n"
    )
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test"}
    proc = subprocess.Popen([sys.executable, "-c", launcher], env=env, cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "the worker never started"
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() < deadline, "the worker outlived its launcher"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        if pid_file.exists() and pid_file.read_text() and Path(f"/proc/{pid_file.read_text()}").exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)  # a worker the test found alive

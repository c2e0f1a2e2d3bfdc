"""The supervisor starts, watches and always tears down process groups (real processes, no mocks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from skyrl_cli.launch.pids import pid_alive
from skyrl_cli.launch.supervisor import Supervisor
from skyrl_cli.plan.model import ProcessSpec, ReadinessCheck
from skyrl_contracts.errors import LaunchError

pytestmark = pytest.mark.integration


# A process that spawns a grandchild and writes both pids, then sleeps: teardown must reach both.
PARENT_WITH_CHILD = textwrap.dedent(
    """
    import subprocess, sys, time, pathlib
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pathlib.Path(sys.argv[1]).write_text(f"{child.pid}")
    time.sleep(600)
    """
)


def _wait_for_file(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def _service(name: str, *argv: str, url: str | None = None) -> ProcessSpec:
    return ProcessSpec(
        name=name, role="engine", argv=(sys.executable, *argv), ready=ReadinessCheck(url=url, timeout_s=5)
    )


def test_shutdown_kills_children_of_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    with Supervisor(tmp_path) as sup:
        proc = sup.start(_service("svc", "-c", PARENT_WITH_CHILD, str(pid_file)))
        child_pid = int(_wait_for_file(pid_file))
        assert pid_alive(proc.popen.pid) and pid_alive(child_pid)
    assert not pid_alive(proc.popen.pid)
    time.sleep(0.2)
    assert not pid_alive(child_pid)


def test_job_exit_code_and_log(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start(
            ProcessSpec(
                name="job",
                role="trainer",
                kind="job",
                argv=(sys.executable, "-c", "print('hello'); raise SystemExit(3)"),
            )
        )
        assert sup.wait_job("job", tick_s=0.05) == 3
    assert "hello" in (tmp_path / "logs" / "job.log").read_text()


def test_dead_service_fails_the_job_wait(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start(_service("svc", "-c", "print('boom'); raise SystemExit(1)"))
        sup.start(
            ProcessSpec(
                name="job", role="trainer", kind="job", argv=(sys.executable, "-c", "import time; time.sleep(30)")
            )
        )
        with pytest.raises(LaunchError, match="(?s)svc died.*boom"):
            sup.wait_job("job", tick_s=0.05)


def test_not_ready_before_exit_reports_log_tail(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start(_service("svc", "-c", "print('bad flag'); raise SystemExit(2)", url="http://127.0.0.1:9/health"))
        with pytest.raises(LaunchError, match="(?s)exited before it was ready.*bad flag"):
            sup.wait_ready(["svc"])


def test_a_job_started_beside_services_that_fails_ends_their_readiness_wait(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start(_service("svc", "-c", "import time; time.sleep(30)", url="http://127.0.0.1:9/health"))
        sup.start(
            ProcessSpec(
                name="job",
                role="trainer",
                kind="job",
                argv=(sys.executable, "-c", "print('no model'); raise SystemExit(4)"),
            )
        )
        started = time.monotonic()
        with pytest.raises(LaunchError, match="(?s)job.*no model"):
            sup.wait_ready(["svc"], timeout_s=20, watch_jobs=["job"])
        assert time.monotonic() - started < 10  # not the readiness timeout


def test_a_watched_job_that_finishes_cleanly_does_not_end_the_wait(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start(_service("svc", "-c", "import time; time.sleep(30)"))  # no URL: ready at once
        sup.start(ProcessSpec(name="job", role="trainer", kind="job", argv=(sys.executable, "-c", "pass")))
        sup.wait_job("job", tick_s=0.05)
        sup.wait_ready(["svc"], watch_jobs=["job"])


def test_driver_killed_with_sigkill_takes_its_processes_along(tmp_path):
    pid_file = tmp_path / "child.pid"
    driver = textwrap.dedent(
        f"""
        import sys, time
        from skyrl_cli.launch.supervisor import Supervisor
        from skyrl_cli.plan.model import ProcessSpec
        with Supervisor({str(tmp_path)!r}) as sup:
            sup.start(ProcessSpec(name="svc", role="engine", argv=(sys.executable, "-c", {PARENT_WITH_CHILD!r}, {str(pid_file)!r})))
            time.sleep(600)
        """
    )
    drv = subprocess.Popen([sys.executable, "-c", driver])
    child_pid = int(_wait_for_file(pid_file))
    drv.send_signal(signal.SIGKILL)
    drv.wait()
    deadline = time.monotonic() + 15
    while pid_alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    # The grandchild ignores its parent's death; only the reaper's killpg reaches it.
    assert not pid_alive(child_pid)
    leader_pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(int(p), str(pid_file))]
    assert not [p for p in leader_pids if pid_alive(p)]


def _cmdline_has(pid: int, needle: str) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_a_started_process_sees_the_mapped_devices(tmp_path):
    out = tmp_path / "seen"
    script = f"import os, pathlib; pathlib.Path({str(out)!r}).write_text(os.environ['CUDA_VISIBLE_DEVICES'])"
    spec = ProcessSpec(
        name="gpu-job",
        role="trainer",
        argv=(sys.executable, "-c", script),
        env={"CUDA_VISIBLE_DEVICES": "1"},
        kind="job",
    )
    with Supervisor(tmp_path, base_env={**os.environ, "CUDA_VISIBLE_DEVICES": "5,7"}) as sup:
        sup.start(spec)
        assert sup.wait_job("gpu-job") == 0
    assert out.read_text() == "7"

"""No engine process survives its driver: SIGKILL of the driver, a failed start, and (in the shared
fixture's teardown) a normal exit. Each test starts its own single engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.integration.conftest import cpu_machine, free_ports, inference_recipe, wait_groups_gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

DRIVER = textwrap.dedent(
    """
    import sys, time
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import engine_specs
    from tests.integration.conftest import cpu_machine, inference_recipe

    run_dir, model_dir, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    (spec,) = engine_specs(inference_recipe(engines=1), cpu_machine(), [port], model_dir)
    with Supervisor(run_dir) as sup:
        proc = sup.start(spec)
        sup.wait_ready([spec.name], timeout_s=180)
        print("READY", proc.popen.pid, flush=True)
        time.sleep(600)
    """
)


def _engine_pids_for(needle: str) -> list[int]:
    """Engine API-server processes whose command line contains ``needle`` (their spawned EngineCore
    and worker children are covered by the process-group checks)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "backends.inference.serve" in cmdline and needle in cmdline:
                pids.append(int(entry))
    return pids


def test_sigkilled_driver_leaves_no_engine_process(tiny_model_dir, tmp_path):
    (port,) = free_ports(1)
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path), str(tiny_model_dir), str(port)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    try:
        line = driver.stdout.readline()
        assert line.startswith("READY"), f"driver did not start an engine: {line!r}; see {tmp_path}/logs"
        engine_pgid = int(line.split()[1])
        # vLLM's EngineCore is a child in the engine's group: kill the driver and nothing else.
        assert wait_groups_gone([engine_pgid], timeout_s=0.5) == [engine_pgid]
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        assert wait_groups_gone([engine_pgid], timeout_s=30) == [], "engine process group survived the driver"
    finally:
        if driver.poll() is None:
            driver.kill()
    assert _engine_pids_for(f"--port {port}") == []


def test_failed_engine_start_leaves_nothing(tmp_path):
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import engine_specs
    from skyrl_contracts.errors import LaunchError

    (port,) = free_ports(1)
    missing = tmp_path / "no-such-model"
    (spec,) = engine_specs(inference_recipe(engines=1), cpu_machine(), [port], str(missing))
    started = time.monotonic()
    with pytest.raises(LaunchError, match="engine-0 exited before it was ready"):
        with Supervisor(tmp_path) as sup:
            proc = sup.start(spec)
            sup.wait_ready([spec.name], timeout_s=120)
    assert time.monotonic() - started < 120
    assert wait_groups_gone([proc.popen.pid], timeout_s=15) == []
    assert _engine_pids_for(str(missing)) == []

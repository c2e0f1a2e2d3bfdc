"""Interrupted runs say so: a stop signal becomes exit code 128 + N and a last line naming the step
and the last complete checkpoint (``skyrl_cli.launch.interrupts``).

The signal tests run a real driver through ``skyrl_cli.app.main`` in a subprocess, with a command
that runs a sleeping job under the supervisor inside ``reported(...)``: the same code path as
``skyrl sft``, without torch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from skyrl_cli.launch.interrupts import Interrupted, interruption_message, reported
from skyrl_contracts.errors import RunInterrupted

from .conftest import REPO


def make_run_dir(run_dir: Path, steps: tuple[int, ...] = (), partial: tuple[int, ...] = (), events_at: int = 0) -> Path:
    for step in steps:
        (run_dir / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step-{step}" / "trainer_state.json").write_text("{}")
    for step in partial:  # no trainer_state.json: a checkpoint being written
        (run_dir / "checkpoints" / f"step-{step}").mkdir(parents=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    if events_at:
        record = {"time": time.time(), "step": events_at, "process": "trainer", "name": "train/loss", "value": 0.5}
        (run_dir / "events.jsonl").write_text(json.dumps(record) + "\n")
    return run_dir


def test_message_names_step_phase_and_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "runs/x/sft/checkpoints/step-100"
    assert interruption_message("sft", "SIGINT", 120, None, ckpt) == (
        "sft interrupted (SIGINT) at step 120; last complete checkpoint: runs/x/sft/checkpoints/step-100 (resume with --resume)"
    )
    assert interruption_message("rl", "SIGTERM", 0, "engine start-up", None) == (
        "rl interrupted (SIGTERM) during engine start-up; no complete checkpoint yet (start again with --overwrite)"
    )
    assert interruption_message("rl", "SIGINT", 3, "the final evaluation", Path("/elsewhere/step-3")) == (
        "rl interrupted (SIGINT) at step 3 during the final evaluation; last complete checkpoint: /elsewhere/step-3 "
        "(resume with --resume)"
    )
    assert interruption_message("sft", "SIGINT", 0, None, None, restart_hint="again").endswith(
        "before the first step; no complete checkpoint yet (again)"
    )


@pytest.mark.parametrize(
    ("raised", "code", "name"), [(Interrupted(signal.SIGTERM), 143, "SIGTERM"), (KeyboardInterrupt(), 130, "SIGINT")]
)
def test_reported_maps_the_signal_to_exit_code_and_marks_the_summary(tmp_path, raised, code, name):
    run_dir = make_run_dir(tmp_path / "run", steps=(2,), events_at=3)
    with pytest.raises(RunInterrupted) as caught:
        with reported("sft", run_dir):
            raise raised
    assert caught.value.exit_code == code
    assert str(caught.value).startswith(f"sft interrupted ({name}) at step 3; last complete checkpoint: ")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] is False and summary["interrupted"] == name and summary["steps"] == 3


DRIVER = textwrap.dedent(
    """
    import sys
    from skyrl_cli.app import app, main
    from skyrl_cli.launch.interrupts import reported
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.model import ProcessSpec

    @app.command("sleepjob")
    def sleepjob(run_dir: str) -> None:
        with reported("sft", run_dir), Supervisor(run_dir) as sup:
            sup.start(ProcessSpec(name="trainer", role="trainer", kind="job",
                                  argv=(sys.executable, "-c", "import time; time.sleep(600)")))
            print("started", flush=True)
            sup.wait_job("trainer", tick_s=0.05)

    main(sys.argv[1:])
    """
)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _group_alive(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signalled_driver_exits_128_plus_n_with_the_message_and_no_child_left(tmp_path, sig, code):
    run_dir = make_run_dir(tmp_path / "run", steps=(2, 4), partial=(6,), events_at=5)
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, "sleepjob", str(run_dir)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert driver.stdout.readline().strip() == "started"
    groups = _children(driver.pid)  # the job's group leader and the reaper
    assert len(groups) == 2, groups
    driver.send_signal(sig)
    _, err = driver.communicate(timeout=30)
    assert driver.returncode == code, err
    assert err.strip().splitlines()[-1] == (
        f"sft interrupted ({sig.name}) at step 5; last complete checkpoint: run/checkpoints/step-4 (resume with --resume)"
    )
    assert "Traceback" not in err
    assert not [g for g in groups if _group_alive(g)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] is False and summary["interrupted"] == sig.name


def test_a_deferred_section_in_another_thread_does_not_hold_the_main_threads_signal():
    import threading

    from skyrl_cli.launch.interrupts import deferred, stop_signals_raise

    inside, release = threading.Event(), threading.Event()

    def worker() -> None:
        with deferred():
            inside.set()
            release.wait(10)

    with stop_signals_raise():
        thread = threading.Thread(target=worker)
        thread.start()
        inside.wait(10)
        try:
            with pytest.raises(Interrupted):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises here at once
        finally:
            release.set()
            thread.join()

"""An engine pool's warm processes, run: a keeper's generations (with a stand-in for torchrun that
speaks the hand-over protocol), a run's supervision of the generation it takes, and how the exit
code of a process that is not the run's child is read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skyrl_cli.engines import standby as warm
from skyrl_cli.engines.standby import Generation, StandbyJob, state
from skyrl_cli.launch.pids import pid_alive
from skyrl_cli.launch.supervisor import Supervisor
from skyrl_cli.plan.model import ProcessSpec
from skyrl_contracts.atomic import write_json
from skyrl_contracts.standby import CURRENT_FILE, EXIT_FILE, Job, gen_dir, mark, ready_marker, taken_marker

pytestmark = pytest.mark.integration

# A stand-in for the standby's torchrun: marks its ranks ready, waits for the job, marks it taken,
# appends a line to the job's log and exits with the code the job's argv asks for.
FAKE_TORCHRUN = r"""
import json, os, sys, time
from pathlib import Path
gen = Path(sys.argv[sys.argv.index("--gen-dir") + 1])
print("fake torchrun up", flush=True)
for rank in (0, 1):
    (gen / f"ready-{rank}").write_text("{}")
while not (gen / "job.json").exists():
    if not gen.is_dir():
        sys.exit(0)
    time.sleep(0.02)
job = json.loads((gen / "job.json").read_text())
(gen / "taken-0").write_text("{}")
with open(job["log"], "a") as fh:
    fh.write("rank 0 ran the job\n")
if job["argv"][0] == "hang":
    time.sleep(120)
print("torchrun's own summary of the job", flush=True)
sys.exit(int(job["argv"][0]))
"""


def fake_torchrun_argv(tmp_path: Path) -> list[str]:
    script = tmp_path / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN)
    return [sys.executable, str(script), "--rdzv-endpoint", "127.0.0.1:1"]


def wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.fixture
def keeper(tmp_path):
    learner_dir, pool = tmp_path / "pool" / "warm-learner", tmp_path / "pool"
    learner_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "skyrl_cli.engines.keeper", "--dir", str(learner_dir), "--pool", str(pool)]
    proc = subprocess.Popen([*argv, "--", *fake_torchrun_argv(tmp_path)], start_new_session=True)
    yield proc, learner_dir, pool
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    current = Generation.current(learner_dir)
    if current is not None:
        os.killpg(current.agent_pid, signal.SIGKILL)


def job_for(run: Path, code: str) -> Job:
    (run / "logs").mkdir(parents=True, exist_ok=True)
    return Job(module="m", argv=[code], cwd=str(run), env={}, log=str(run / "logs" / "trainer.log"), run_dir=str(run))


def test_the_keeper_starts_a_fresh_generation_after_each_run_once_the_pool_is_free(keeper, tmp_path):
    proc, learner_dir, pool = keeper
    first = wait_for(lambda: Generation.current(learner_dir))
    wait_for(lambda: first.ready_ranks(2) == 2)
    assert state(learner_dir, 2) == "warm"
    write_json(pool / "holder.json", {"run_dir": "r1", "pid": os.getpid()})  # a run holds the pool
    job_for(tmp_path / "r1", "3").write(first.folder)
    assert StandbyJob(first).wait(timeout=20) == 3  # the keeper's record of torchrun's exit code
    log = (tmp_path / "r1" / "logs" / "trainer.log").read_text()
    assert "rank 0 ran the job" in log and "torchrun's own summary" in log  # a failure's summary reaches the run
    time.sleep(1.0)
    assert json.loads((learner_dir / CURRENT_FILE).read_text())["gen"] == 0  # none while the run holds the pool
    (pool / "holder.json").unlink()
    second = wait_for(lambda: (g := Generation.current(learner_dir)) and g.gen == 1 and g)
    job_for(tmp_path / "r2", "0").write(second.folder)
    assert StandbyJob(second).wait(timeout=20) == 0
    third = wait_for(lambda: (g := Generation.current(learner_dir)) and g.gen == 2 and g)
    assert not gen_dir(learner_dir, 0).exists() and gen_dir(learner_dir, 1).exists()  # the one before last goes
    proc.send_signal(signal.SIGTERM)  # skyrl engines down
    assert proc.wait(timeout=20) == 0
    assert not pid_alive(third.agent_pid) and not (learner_dir / CURRENT_FILE).exists()


def test_a_run_tears_down_the_generation_it_took_and_the_keeper_replaces_it(keeper, tmp_path):
    _, learner_dir, pool = keeper
    generation = wait_for(lambda: Generation.current(learner_dir))
    run = tmp_path / "run"
    spec = ProcessSpec(
        name="trainer",
        role="trainer",
        kind="job",
        argv=("py", "-m", "torch.distributed.run", "--rdzv-endpoint", "h:1", "-m", "mod", "hang"),
    )
    with Supervisor(run) as supervisor:
        taken = warm.start_warm(supervisor, spec, keeper_spec(tmp_path), learner_dir)
        assert taken.popen.pid == generation.agent_pid  # handed over, not started
        job = Job.read(generation.folder)
        assert job.module == "mod" and job.argv == ["hang"] and job.log == str(run / "logs" / "trainer.log")
        assert float(job.env["SKYRL_STARTED_AT"]) <= time.time()  # its start-up clock starts at the hand-over
        wait_for(lambda: taken_marker(generation.folder, 0).exists())
        assert taken.returncode is None
    assert not pid_alive(generation.agent_pid)  # the run's teardown reached it
    assert "(run by a warm process of the engine pool" in (run / "logs" / "trainer.log").read_text()
    assert wait_for(lambda: (g := Generation.current(learner_dir)) and g.gen == 1)


def keeper_spec(tmp_path: Path) -> ProcessSpec:
    """A keeper whose torchrun matches the test's trainer spec (only the port differs)."""
    argv = ("keeper", "--", "py", "-m", "torch.distributed.run", "--rdzv-endpoint", "h:9", "-m", "standby")
    return ProcessSpec(name="learner", role="trainer", argv=argv)


def test_a_run_starts_its_own_learner_when_no_generation_waits(tmp_path):
    pool = tmp_path / "pool"
    (pool / "learner").mkdir(parents=True)
    sleeper = ("py", "-m", "torch.distributed.run", "--rdzv-endpoint", "h:1", "-m", "mod")
    spec = ProcessSpec(name="trainer", role="trainer", kind="job", argv=(sys.executable, "-c", "pass", *sleeper))
    with Supervisor(tmp_path / "run") as supervisor:
        started = warm.start_warm(supervisor, spec, keeper_spec(tmp_path), pool / "warm-learner")
        assert isinstance(started.popen, subprocess.Popen)  # its own process
        assert started.popen.wait(timeout=20) == 0


def test_the_exit_code_of_a_generation_comes_from_the_keepers_record(tmp_path, monkeypatch):
    folder = tmp_path / "gen-0"
    folder.mkdir()
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    job = StandbyJob(Generation(0, folder, done.pid))
    monkeypatch.setattr(warm, "EXIT_CODE_WAIT_S", 0.2)
    assert job.poll() is None  # exited, the keeper's record not written yet
    time.sleep(0.3)
    assert job.poll() == warm.UNKNOWN_EXIT  # the keeper was gone: "failed", never "succeeded"
    write_json(folder / EXIT_FILE, {"code": 0})
    assert StandbyJob(Generation(0, folder, done.pid)).poll() == 1  # 0, but no rank took the job
    mark(taken_marker(folder, 0))
    assert StandbyJob(Generation(0, folder, done.pid)).poll() == 0
    write_json(folder / EXIT_FILE, {"code": -9})
    assert StandbyJob(Generation(0, folder, done.pid)).poll() == -9
    mark(ready_marker(folder, 1))
    assert Generation(0, folder, done.pid).ready_ranks(2) == 1

"""Fault injection into real ``skyrl`` runs: start the driver as a user does, find a process of its
plan, kill it at a seeded point, and check what the user is left with (the message, the exit code,
the processes, the checkpoints).

The kill point is drawn from ``random.Random(seed)`` (a number of learner steps, then a delay), so
each seed hits a different phase of the run and the same one every time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from skyrl_contracts.rundir import CHECKPOINT_MODEL, CHECKPOINT_STATE_FILE, RunDir
from tests.integration.cli_runs import ENV, SKYRL, events
from tests.integration.conftest import wait_groups_gone
from tests.integration.test_interrupt import children

# What a failing run must never print unless SKYRL_DEBUG is set.
TRACEBACK = "Traceback (most recent call last)"


_STARTED: list["Driver"] = []


@dataclass
class Driver:
    """A ``skyrl`` command running in the background, its stdout and stderr in files."""

    popen: subprocess.Popen
    cwd: Path
    out: Path
    err: Path
    groups: set[int] = field(default_factory=set)  # every process group it was seen to lead

    @classmethod
    def start(cls, cwd: Path, *args, tag: str = "run") -> "Driver":
        out, err = cwd / f"{tag}.stdout", cwd / f"{tag}.stderr"
        with open(out, "w") as o, open(err, "w") as e:
            popen = subprocess.Popen([str(SKYRL), *map(str, args)], cwd=cwd, env=ENV, stdout=o, stderr=e)
        driver = cls(popen, cwd, out, err)
        _STARTED.append(driver)
        return driver

    @staticmethod
    def stop_all() -> None:
        """SIGTERM (the driver's own clean teardown) every driver a failed test left running."""
        while _STARTED:
            driver = _STARTED.pop()
            if driver.popen.poll() is None:
                driver.popen.terminate()
                try:
                    driver.popen.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    driver.popen.kill()

    @property
    def stdout(self) -> str:
        return self.out.read_text()

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    def note_groups(self) -> None:
        """Remember the process groups the driver leads now (its supervisor's children, the reaper)."""
        if self.popen.poll() is None:
            self.groups.update(children(self.popen.pid))

    def alive(self, what: str) -> None:
        assert self.popen.poll() is None, f"skyrl ended early ({self.popen.returncode}) {what}:\n{self.stderr[-3000:]}"

    def wait(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()  # a hung driver fails the test; its groups are reaped below
            self.popen.wait()
            raise AssertionError(f"skyrl did not exit within {timeout_s:.0f} s:\n{self.stderr[-3000:]}")

    def leftovers(self, run_dir: Path) -> list[int]:
        """Process groups, and processes naming ``run_dir``, still alive once the driver has exited
        (the reaper gets a grace period)."""
        groups = wait_groups_gone(sorted(self.groups), timeout_s=20)
        deadline = time.monotonic() + 10
        while (stray := processes_mentioning(str(run_dir))) and time.monotonic() < deadline:
            time.sleep(0.2)
        return groups + stray


def wait_until(driver: Driver, ready, what: str, timeout_s: float = 600, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    noted = 0.0
    while not ready():
        driver.alive(f"while waiting for {what}")
        if time.monotonic() - noted > 1.0:  # a scan of /proc: not at every poll of a fast one
            driver.note_groups()
            noted = time.monotonic()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def plan_argv(run_dir: Path, name: str) -> list[str]:
    plan = json.loads(RunDir(run_dir).plan.read_text())
    (spec,) = [p for p in plan["processes"] if p["name"] == name]
    return spec["argv"]


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").rstrip("\0")
        return raw.split("\0") if raw else []
    except OSError:
        return []


def leader_pid(driver: Driver, run_dir: Path, name: str) -> int:
    """The pid of the plan's process ``name`` (a child of the driver leading its own group)."""
    argv = plan_argv(run_dir, name)
    # A script's command line starts with its interpreter; vllm-router rewrites its own to this.
    renamed = ["vllm::router"] if Path(argv[0]).name == "vllm-router" else None
    found = [pid for pid in children(driver.popen.pid) if _cmdline(pid) in (argv, renamed) or _cmdline(pid)[1:] == argv]
    assert len(found) == 1, f"{name}: {found} (argv {argv})"
    return found[0]


def rank_pid(leader: int, rank: int) -> int:
    """The torchrun worker of global ``rank`` under the torchrun ``leader`` (its child; its env says
    RANK). torchrun starts each worker in a session of its own, outside the leader's group."""
    for pid in children(leader):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} under torchrun {leader}")


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (a run directory: trainer ranks, which
    torchrun puts in sessions of their own, are found this way and not by their group)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and text in " ".join(_cmdline(int(entry))):
            try:
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                found.append(int(entry))
    return found


def seeded_kill_point(seed: int, steps: int) -> tuple[int, float]:
    """(learner steps to wait for, then seconds to wait): a different phase for each seed (a step
    of the tiny model takes 0.5-1 s here, so the delay lands anywhere in the next step), and always
    at least 2 steps before the end."""
    rng = random.Random(seed)
    return rng.randint(1, steps - 3), rng.uniform(0.0, 0.6)


def kill(pid: int) -> float:
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def assert_clean_failure(driver: Driver, code: int, run_dir: Path, *expected: str) -> str:
    """Non-zero exit, an ``error:`` line holding every ``expected`` text, no traceback, no process
    left behind. Returns the message."""
    stderr = driver.stderr
    assert code != 0, stderr[-3000:]
    assert TRACEBACK not in stderr, stderr[-3000:]
    message = "\n".join(error_lines(stderr))
    for text in expected:
        assert text in message, f"{text!r} not in:\n{stderr[-3000:]}"
    assert not driver.leftovers(run_dir), "processes left behind"
    return message


def assert_checkpoint_intact(run_dir: Path, step: int | None = None) -> Path:
    """The newest complete checkpoint loads: its trainer state and its HF model's weights; nothing
    named like a checkpoint is half-written (a directory without its state file is never selected)."""
    import torch
    from safetensors.torch import load_file

    paths = RunDir(run_dir)
    latest = paths.latest_checkpoint()
    assert latest is not None, "no complete checkpoint"
    state = json.loads((latest / CHECKPOINT_STATE_FILE).read_text())
    if step is not None:
        assert state["step"] == step and latest == paths.checkpoint(step), (state, latest)
    weights = load_file(latest / CHECKPOINT_MODEL / "model.safetensors")
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
    for child in paths.checkpoints.iterdir():
        if child.name.startswith("step-"):
            assert (child / CHECKPOINT_STATE_FILE).is_file(), f"{child} is named like a checkpoint but incomplete"
    return latest


def losses(run_dir: Path, name: str) -> dict[int, float]:
    """The last value logged for each step (a resumed run logs its steps after the resume point again)."""
    return dict(events(run_dir, name))


_SFT_STRAIGHT: dict[str, tuple[Path, Path]] = {}


def sft_straight_run(tmp_path_factory) -> tuple[Path, Path]:
    """(recipe, run dir) of one uninterrupted ``skyrl sft`` of tests/integration/test_sft.py's
    RESUMABLE recipe (16 steps, checkpoints every 4, keep_last 2), run once per session: the final
    loss a faulted and resumed run of it must reach."""
    from tests.integration.cli_runs import run_skyrl
    from tests.integration.test_sft import RESUMABLE
    from tests.recipes import write_recipe

    if "run" not in _SFT_STRAIGHT:
        root = tmp_path_factory.mktemp("sft-straight")
        recipe = write_recipe(root / "resumable.toml", RESUMABLE)
        run_skyrl("sft", recipe, "--run-dir", root / "run", "--quiet", cwd=root)
        _SFT_STRAIGHT["run"] = (recipe, root / "run")
    return _SFT_STRAIGHT["run"]

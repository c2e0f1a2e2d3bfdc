"""Storage faults in real SFT runs (issue #17, "Storage"):

- the run directory's file system fills up while a checkpoint is written (a small tmpfs, filled
  with a ballast file once the previous checkpoint is complete): a one-line message naming the
  checkpoint and the run directory, no partial checkpoint left, the previous one intact, and once
  space is freed ``--resume`` reaches the uninterrupted run's final loss;
- an unwritable run directory (a read-only mount; a path through a file): a one-line error naming
  the path before anything starts;
- the recipe's JSONL file gets a corrupt line, or disappears after the recipe was checked: a message
  naming the file (and the line); the previous checkpoint intact; resumable once it is fixed.

Mounting needs root (CI and the development machines run as root); those cases skip otherwise.

    .venv/bin/python -m pytest -q -m faults tests/faults/test_storage_faults.py
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from skyrl_contracts.rundir import RunDir
from tests.faults.harness import (
    TRACEBACK,
    Driver,
    assert_checkpoint_intact,
    assert_clean_failure,
    losses,
    sft_straight_run,
    wait_until,
)
from tests.integration.cli_runs import run_skyrl
from tests.integration.test_sft import long_tailed_rows, one_step_recipe

pytestmark = pytest.mark.faults  # the real runs are marked integration one by one


TMPFS_MB = 64


@pytest.fixture(scope="module")
def sft_straight(tmp_path_factory):
    return sft_straight_run(tmp_path_factory)


@contextlib.contextmanager
def tmpfs(path: Path, size_mb: int, *options: str):
    """A tmpfs of ``size_mb`` at ``path``, unmounted afterwards whatever happens."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    opts = ",".join((f"size={size_mb}m", *options))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path, leave: int) -> Path:
    """A ballast file that leaves ``leave`` bytes free on ``directory``'s file system."""
    ballast = directory / "ballast"
    with open(ballast, "wb") as fh:
        fh.truncate(0)
        free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
        chunk = b"\0" * (1 << 20)
        remaining = free - leave
        while remaining > 0:
            remaining -= fh.write(chunk[: min(len(chunk), remaining)])
        fh.flush()
        os.fsync(fh.fileno())
    return ballast


@pytest.mark.integration
def test_disk_full_during_a_checkpoint_keeps_the_previous_one_and_resumes(tmp_path, sft_straight):
    recipe, straight = sft_straight
    checkpoint = sum(f.stat().st_size for f in RunDir(straight).checkpoint(16).rglob("*") if f.is_file())
    with tmpfs(tmp_path / "mnt", TMPFS_MB) as mnt:
        # Room for step-4, logs and events, not for step-8 as well (checkpoints are all one size).
        ballast = fill(mnt, leave=int(1.5 * checkpoint) + (1 << 20))
        run = mnt / "run"
        driver = Driver.start(tmp_path, "sft", recipe, "--run-dir", run, "--quiet")
        paths = RunDir(run)
        wait_until(driver, lambda: paths.latest_checkpoint() is not None, "checkpoint step-4", poll_s=0.1)
        code = driver.wait(timeout_s=300)
        message = assert_clean_failure(
            driver,
            code,
            run,
            "checkpoint step-8 not written: No space left on device",
            "step-4 is intact",
            "trainer.log",
        )
        assert str(run) in message
        assert_checkpoint_intact(run, 4)
        assert not [p.name for p in paths.checkpoints.iterdir() if p.name.startswith(".tmp-")], (
            "partial checkpoint left"
        )

        ballast.unlink()
        run_skyrl("sft", recipe, "--run-dir", run, "--resume", "--quiet", cwd=tmp_path)
        resumed, reference = losses(run, "train/loss"), losses(straight, "train/loss")
        assert max(resumed) == 16 and resumed[16] == pytest.approx(reference[16], abs=1e-6)
        print(f"\nfaults figure disk full: {message.splitlines()[0]!r}; final loss {resumed[16]} vs {reference[16]}")


def write_rows(path: Path, n: int = 200) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in long_tailed_rows(n)))
    return path


def assert_refused_before_start(proc, path_text: str) -> None:
    """Exit 2 with exactly one ``error:`` line naming the path; nothing was started."""
    assert proc.returncode == 2, proc.stderr
    assert TRACEBACK not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: run directory ") and path_text in lines[0], lines
    assert "is not writable" in lines[0]


def test_read_only_run_directory_is_refused_before_anything_starts(tmp_path):
    recipe = one_step_recipe(tmp_path, write_rows(tmp_path / "train.jsonl"))
    with tmpfs(tmp_path / "ro", 4) as mnt:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        proc = run_skyrl("sft", recipe, "--run-dir", mnt / "run", "--quiet", cwd=tmp_path, check=False)
    assert_refused_before_start(proc, str(mnt / "run"))
    assert "Read-only file system" in proc.stderr


def test_run_directory_under_a_file_is_refused_before_anything_starts(tmp_path):
    recipe = one_step_recipe(tmp_path, write_rows(tmp_path / "train.jsonl"))
    (tmp_path / "a-file").write_text("not a directory\n")
    proc = run_skyrl("sft", recipe, "--run-dir", tmp_path / "a-file/run", "--quiet", cwd=tmp_path, check=False)
    assert_refused_before_start(proc, str(tmp_path / "a-file"))
    assert not (tmp_path / "a-file").is_dir()


@pytest.mark.integration
def test_corrupt_or_vanished_data_file_names_it_and_resumes_once_fixed(tmp_path):
    train = write_rows(tmp_path / "train.jsonl")
    good = train.read_text()
    base = (
        one_step_recipe(tmp_path, train)
        .read_text()
        .replace("steps = 1\n", "steps = 4\n")
        .replace("save_every = 0", "save_every = 2")
    )
    recipe = tmp_path / "data.toml"
    recipe.write_text(base)
    run = tmp_path / "run"
    run_skyrl("sft", recipe, "--run-dir", run, "--quiet", "--set", "sft.steps=2", cwd=tmp_path)
    assert_checkpoint_intact(run, 2)

    lines = good.splitlines(keepends=True)
    train.write_text("".join(lines[:6]) + '{"prompt": "abc", "completion"\n' + "".join(lines[6:]))
    driver = Driver.start(tmp_path, "sft", recipe, "--run-dir", run, "--resume", "--quiet", tag="corrupt")
    code = driver.wait(timeout_s=300)
    assert_clean_failure(driver, code, run, f"{train}:7: not a JSON line", "trainer.log")
    assert_checkpoint_intact(run, 2)

    train.write_text(good)
    driver = Driver.start(tmp_path, "sft", recipe, "--run-dir", run, "--resume", "--quiet", tag="vanished")
    log = RunDir(run).log("trainer")
    starts = log.read_text().count("start: ")
    # The recipe check saw the file; it goes away once the trainer is being started.
    wait_until(driver, lambda: log.read_text().count("start: ") > starts, "the trainer's start", poll_s=0.02)
    train.unlink()
    code = driver.wait(timeout_s=300)
    assert_clean_failure(driver, code, run, f"{train}: data file not found", "trainer.log")
    assert_checkpoint_intact(run, 2)

    train.write_text(good)
    run_skyrl("sft", recipe, "--run-dir", run, "--resume", "--quiet", cwd=tmp_path)
    assert max(losses(run, "train/loss")) == 4
    assert_checkpoint_intact(run, 4)

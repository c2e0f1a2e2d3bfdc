"""SIGKILL of one process of a real run (issue #17, "Processes"), at a seeded point:

- RL (engine + router + orchestrator + 2-rank learner, sync so that the data order is fixed): a
  killed engine or router comes back by itself and the run completes; a killed learner rank or
  orchestrator stops the run within seconds with a message naming it and its log, and ``--resume``
  completes it from the last complete checkpoint with the same prompts at every step as an
  uninterrupted run;
- SFT: a rank killed while a checkpoint is being written stops the run; the half-written checkpoint
  is never selected, and ``--resume`` reaches the uninterrupted run's final loss.

Every case: no traceback, no process left behind, the newest complete checkpoint loads.

Like every real-run fault test, these run with ``SKYRL_FAULTS=1`` (tests/faults/conftest.py); the
RL cases start the whole stack twice each (10 minutes on 2 quiet cores, 20 on busy ones):

    SKYRL_FAULTS=1 .venv/bin/python -m pytest -q -m faults tests/faults/test_process_faults.py
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from skyrl_contracts.rundir import RunDir
from tests.faults.harness import (
    Driver,
    assert_checkpoint_intact,
    assert_clean_failure,
    kill,
    leader_pid,
    losses,
    rank_pid,
    seeded_kill_point,
    sft_straight_run,
    wait_until,
)
from tests.integration.cli_runs import events, run_skyrl
from tests.integration.conftest import build_tiny_model
from tests.recipes import RL, merged, tiny_recipe, write_recipe

pytestmark = [pytest.mark.faults, pytest.mark.integration]


STEPS = 8
RL_RECIPE = tiny_recipe(
    RL, name="faults", data={"eval_size": 8}, rl={"steps": STEPS, "save_every": 2, "reward": "fault_reward:reward"}
)
# A reward the random-init model earns now and then (3-digit addition gives it none: every
# advantage would be 0 and no step would change the weights, so any two runs would match).
REWARD = """
def reward(response, row):
    return sum(c in "13579" for c in response) / 4
"""
# How long a run may take to stop after one of its jobs was killed (teardown included).
STOP_WITHIN_S = 45.0
FIGURES: dict[str, dict] = {}  # measured per case, printed at the end of the module


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rl-faults")
    model = build_tiny_model(root / "model")
    write_recipe(root / "recipe.toml", merged(RL_RECIPE, rl={"init_from": str(model)}))
    (root / "fault_reward.py").write_text(REWARD)
    return root


@pytest.fixture(scope="module", autouse=True)
def report_figures():
    yield
    for case, figures in FIGURES.items():
        print(f"\nfaults figure {case}: {figures}")


def batch_prompts(run_dir: Path) -> dict[int, str]:
    """The prompts of every training batch, from the orchestrator's log (the last run's wins)."""
    text = RunDir(run_dir).log("orchestrator").read_text()
    return {int(k): uids for k, uids in re.findall(r"batch (\d+): prompts (.+)$", text, re.MULTILINE)}


@pytest.fixture(scope="module")
def straight(workdir) -> Path:
    """An uninterrupted run: the data order and the final loss the faulted runs are held to."""
    run = workdir / "straight"
    run_skyrl("rl", "recipe.toml", "--run-dir", run, "--quiet", cwd=workdir, timeout=900)
    assert sorted(batch_prompts(run)) == list(range(STEPS))
    return run


def start_rl(workdir: Path, run: Path, seed: int) -> Driver:
    driver = Driver.start(workdir, "rl", "recipe.toml", "--run-dir", run, "--quiet", tag=run.name)
    steps, delay = seeded_kill_point(seed, STEPS)
    wait_until(driver, lambda: len(events(run, "train/policy_loss")) >= steps, f"{steps} learner steps")
    time.sleep(delay)
    driver.alive("before the kill")
    driver.note_groups()
    return driver


def target_pid(driver: Driver, run: Path, target: str) -> int:
    if target == "trainer rank 1":
        return rank_pid(leader_pid(driver, run, "trainer"), 1)
    return leader_pid(driver, run, target)


def check_resumed(workdir: Path, run: Path, straight: Path, case: str) -> None:
    """``--resume`` continues from the newest checkpoint with orchestrator state and completes,
    on the same prompts at every step as the uninterrupted run."""
    expected = RunDir(run).latest_rl_checkpoint()
    run_skyrl("rl", "recipe.toml", "--run-dir", run, "--resume", "--quiet", cwd=workdir, timeout=900)
    resumed_line = RunDir(run).log("trainer").read_text().split("resumed from ")[-1].splitlines()[0]
    if expected is not None:
        assert resumed_line.startswith(str(expected)), resumed_line
    assert sorted(losses(run, "train/policy_loss")) == list(range(1, STEPS + 1))
    assert_checkpoint_intact(run, STEPS)
    assert batch_prompts(run) == batch_prompts(straight), "the resumed run trained other prompts"
    final, reference = losses(run, "train/policy_loss")[STEPS], losses(straight, "train/policy_loss")[STEPS]
    FIGURES[case].update(
        resumed_from=expected and expected.name,
        final_loss=final,
        straight_final_loss=reference,
        final_weights_max_abs_diff=weights_diff(run, straight),
    )


def weights_diff(run: Path, other: Path) -> float:
    """The largest difference between the final models of two runs (0.0: the same weights)."""
    from safetensors.torch import load_file

    a, b = (load_file(RunDir(r).final / "model.safetensors") for r in (run, other))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize(
    "target, seed, expected",
    [
        ("orchestrator", 11, "the orchestrator was killed by SIGKILL; log: "),
        ("trainer rank 1", 12, "the trainer failed (exit code 1): rank 1 (pid "),
    ],
)
def test_killed_job_stops_the_run_and_resume_completes_it(workdir, straight, target, seed, expected):
    run = workdir / f"kill-{target.replace(' ', '-')}"
    driver = start_rl(workdir, run, seed)
    pid = target_pid(driver, run, target)
    killed_at = kill(pid)
    code = driver.wait(timeout_s=120)
    stopped_s = time.monotonic() - killed_at
    log = "orchestrator.log" if target == "orchestrator" else "trainer.log"
    message = assert_clean_failure(driver, code, run, expected, log)
    stopped_at = max(losses(run, "train/policy_loss"))
    assert stopped_at < STEPS, "the kill came after the last step"
    if target == "trainer rank 1":
        assert f"(pid {pid}) was killed by SIGKILL" in message, message
    else:
        assert message == f"error: the orchestrator was killed by SIGKILL; log: {RunDir(run).log('orchestrator')}"
    assert stopped_s < STOP_WITHIN_S, f"the run took {stopped_s:.1f} s to stop"
    assert_checkpoint_intact(run)
    FIGURES[target] = {
        "seed": seed,
        "killed_after_step": stopped_at,
        "stopped_s": round(stopped_s, 1),
        "message": error_first_line(message),
    }
    check_resumed(workdir, run, straight, target)


def error_first_line(message: str) -> str:
    return message.splitlines()[0] if message else ""


@pytest.mark.parametrize(
    "target, seed, counter", [("router", 21, "router/restarts"), ("engine-0", 22, "engine/restarts")]
)
def test_killed_service_comes_back_and_the_run_completes(workdir, straight, target, seed, counter):
    run = workdir / f"kill-{target}"
    driver = start_rl(workdir, run, seed)
    kill(leader_pid(driver, run, target))
    code = driver.wait(timeout_s=900)
    assert code == 0, driver.stderr[-3000:]
    assert not driver.leftovers(run), "processes left behind"
    restarts = [v for _, v in events(run, counter)]
    assert restarts and max(restarts) >= 1, f"no {counter} event"
    assert sorted(losses(run, "train/policy_loss")) == list(range(1, STEPS + 1))
    assert_checkpoint_intact(run, STEPS)
    assert batch_prompts(run) == batch_prompts(straight)
    recovery_s = [
        v for _, v in events(run, "timing/router_recovery_s" if target == "router" else "timing/engine_recovery_s")
    ]
    FIGURES[target] = {"seed": seed, "restarts": max(restarts), "recovery_s": [round(v, 1) for v in recovery_s]}


# ------------------------------------------------------------------------------------------ SFT


def test_sft_rank_killed_mid_checkpoint_resumes_to_the_same_loss(tmp_path, sft_straight):
    recipe, straight_run = sft_straight
    run = tmp_path / "run"
    driver = Driver.start(tmp_path, "sft", recipe, "--run-dir", run, "--quiet")
    paths = RunDir(run)
    # After step-4 is complete, the moment step-8 starts being written (its .tmp- directory).
    wait_until(driver, lambda: paths.latest_checkpoint() is not None, "checkpoint step-4", poll_s=0.05)
    pid = rank_pid(leader_pid(driver, run, "trainer"), 1)  # found first: a /proc scan is slow on a busy machine
    driver.note_groups()
    tmp = paths.checkpoints / ".tmp-step-8"
    while not tmp.exists():
        driver.alive("before checkpoint step-8")
        time.sleep(0.002)
    kill(pid)
    code = driver.wait(timeout_s=120)
    assert_clean_failure(driver, code, run, f"rank 1 (pid {pid}) was killed by SIGKILL", "trainer.log")
    assert_checkpoint_intact(run, 4)  # the half-written step-8 is not selected

    run_skyrl("sft", recipe, "--run-dir", run, "--resume", "--quiet", cwd=tmp_path)
    assert "resumed from" in paths.log("trainer").read_text()
    resumed, reference = losses(run, "train/loss"), losses(straight_run, "train/loss")
    assert max(resumed) == max(reference) == 16
    assert resumed[16] == pytest.approx(reference[16], abs=1e-6)
    assert sorted(p.name for p in paths.checkpoints.iterdir()) == ["step-12", "step-16"]
    FIGURES["sft rank 1 mid-checkpoint"] = {"final_loss": resumed[16], "straight_final_loss": reference[16]}


@pytest.fixture(scope="module")
def sft_straight(tmp_path_factory):
    return sft_straight_run(tmp_path_factory)


def test_sft_launcher_killed_leaves_no_rank_behind_and_resumes(tmp_path, sft_straight):
    """torchrun itself SIGKILLed: its ranks, each in a session of its own, must not train on."""
    recipe, straight_run = sft_straight
    run = tmp_path / "run"
    driver = Driver.start(tmp_path, "sft", recipe, "--run-dir", run, "--quiet")
    wait_until(driver, lambda: RunDir(run).latest_checkpoint() is not None, "checkpoint step-4", poll_s=0.05)
    driver.note_groups()
    kill(leader_pid(driver, run, "trainer"))
    code = driver.wait(timeout_s=120)
    message = assert_clean_failure(driver, code, run, "the trainer was killed by SIGKILL", "trainer.log")
    assert message == f"error: the trainer was killed by SIGKILL; log: {RunDir(run).log('trainer')}"  # one line
    assert_checkpoint_intact(run)
    run_skyrl("sft", recipe, "--run-dir", run, "--resume", "--quiet", cwd=tmp_path)
    assert losses(run, "train/loss")[16] == pytest.approx(losses(straight_run, "train/loss")[16], abs=1e-6)

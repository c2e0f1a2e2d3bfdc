"""Engine pools on the real stack: ``skyrl engines up``, then RL runs one after the other on the same
engine processes, each on its own initial weights and each with a fresh generation of the pool's
warm learner; a second run refused while one holds the pool; an engine and the teacher's engine
killed mid-run restarted by the run, detached, and left to the pool; a warm learner killed mid-run
failing that run in one line and replaced by the pool.

The recipe distills from a teacher (``rl.distillation``, the perturbed copy of the SFT model below):
the pool keeps the teacher's engine too, and every run uses it instead of starting one.

How a test knows the engines served the run's own model: in a sync run every step is on-policy, so
the trainer's and the engines' logprobs of the same samples agree (``train/logprob_diff``) only if
the engines hold the weights the learner starts from. The second run starts from another model
than the first run ended with (a perturbed copy): engines still serving the first run's weights
would show a gap of the order of the perturbation's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from skyrl_cli.launch.pids import pid_alive
from tests.integration.cli_runs import ENV, SKYRL, events, run_skyrl
from tests.recipes import RL, SFT, SMALL, merged, tiny_recipe, write_recipe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

RECIPE = tiny_recipe(
    SMALL,
    SFT,
    RL,
    name="pooltest",
    data={"eval_size": 16},
    rl={"init_from": "sft", "steps": 2},
    trainer={"zero_stage": None},
)
POOL = "itest"
# The pool's recipe once the teacher exists (recipes are checked against the files they name).
WITH_TEACHER = merged(RECIPE, rl={"distillation": {"teacher": "other-model"}})


def skyrl(workdir: Path, *args, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_skyrl(*args, cwd=workdir, check=check, timeout=timeout, env={"SKYRL_POOLS_DIR": str(workdir / "pools")})


def perturbed_copy(src: Path, dst: Path, scale: float = 0.5) -> Path:
    """The model at ``src`` with every weight moved by ``scale`` of its own spread: another policy."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        generator = torch.Generator().manual_seed(0)
        moved = {
            k: (v + scale * v.float().std().nan_to_num() * torch.randn(v.shape, generator=generator)).to(v.dtype)
            for k, v in tensors.items()
        }
        save_file(moved, shard, metadata={"format": "pt"})
    return dst


def pool_state(workdir: Path) -> dict:
    return json.loads((workdir / "pools" / POOL / "pool.json").read_text())


def engine_pids(workdir: Path) -> list[int]:
    return [e["pid"] for e in pool_state(workdir)["engines"]]


def teacher_pids(workdir: Path) -> list[int]:
    return [e["pid"] for e in pool_state(workdir)["auxiliaries"] if e["spec"]["name"].startswith("teacher-")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pool")
    write_recipe(root / "recipe.toml", RECIPE)
    skyrl(root, "sft", "recipe.toml", "--quiet")
    perturbed_copy(root / "runs" / "pooltest" / "sft" / "final", root / "other-model")
    write_recipe(root / "recipe.toml", WITH_TEACHER)
    started = time.monotonic()
    skyrl(root, "engines", "up", "recipe.toml", "--name", POOL)
    print(f"engines up: {time.monotonic() - started:.1f} s")
    yield root
    skyrl(root, "engines", "down", POOL, "--force", check=False)


def test_two_runs_one_after_the_other_use_the_same_engines_each_on_its_own_weights(workdir):
    before = engine_pids(workdir) + teacher_pids(workdir)
    first = skyrl(workdir, "rl", "recipe.toml", "--run-dir", "r1", "--quiet")
    assert f"using engine pool {POOL}" in first.stderr
    second = skyrl(workdir, "rl", "recipe.toml", "--run-dir", "r2", "--quiet", "--set", "rl.init_from=other-model")
    assert f"using engine pool {POOL}" in second.stderr
    assert engine_pids(workdir) + teacher_pids(workdir) == before  # no engine was started for either run
    (teacher_url,) = [a["url"] for a in pool_status(workdir)["auxiliaries"]]
    for run in ("r1", "r2"):
        plan = json.loads((workdir / run / "plan.json").read_text())
        assert plan["auxiliary_urls"] == {"teacher": [teacher_url]}  # the pool's teacher, none of its own
        assert not [p for p in plan["processes"] if p["role"] == "auxiliary"]
        assert len(events(workdir / run, "distill/reverse_kl")) == 2
        summary = json.loads((workdir / run / "summary.json").read_text())
        assert summary["pool"] == POOL and summary["completed"] is True
        assert "health" not in summary, summary["health"]  # no sync gap between trainer and engines
        gap = [v for step, v in events(workdir / run, "train/logprob_diff") if step == 1]
        assert gap and gap[0] < 0.05, f"{run}: the engines did not serve the run's own initial weights: {gap}"
    # Each run's learner and orchestrator were warm generations of the pool's, fresh ones for each run.
    agents = [warm_pid(workdir / run, process) for run in ("r1", "r2") for process in ("trainer", "orchestrator")]
    assert all(agents) and len(set(agents)) == 4, agents
    # r1's generation was warm from `engines up`: counted from the hand-over, nothing was left to
    # import (r2's may still have been importing: the keeper starts it once r1 lets go of the pool).
    for process, ready in (("trainer", "learner ready: "), ("orchestrator", "orchestrator ready ")):
        log = (workdir / "r1" / "logs" / f"{process}.log").read_text()
        imports = float(re.search(ready + r".*\(imports ([\d.]+) s", log).group(1))
        assert imports < 2.0, log[-3000:]
    # The runs left no process of theirs behind, and the pool serves on, with its next learner warm.
    status = pool_status(workdir)
    assert status["in_use_by"] is None and all(e["healthy"] for e in status["engines"])
    assert status["router"]["healthy"]
    assert not any(pid_alive(pid) for pid in agents)
    wait_until_warm(workdir)


def pool_status(workdir: Path) -> dict:
    return json.loads(skyrl(workdir, "engines", "status", "--json").stdout.splitlines()[0])


def warm_pid(run_dir: Path, process: str = "trainer") -> int | None:
    """The pid of the pool generation that ran this run's process (torchrun's for the learner: its log says)."""
    found = re.search(
        r"run by a warm process of the engine pool, pid (\d+)", (run_dir / "logs" / f"{process}.log").read_text()
    )
    return int(found.group(1)) if found else None


def rank_of(pid: int) -> str | None:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)
    return env.get("RANK")


def wait_until_warm(workdir: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = json.loads(skyrl(workdir, "engines", "status", "--json").stdout.splitlines()[0])
        if status["warm"] and all(state == "warm" for state in status["warm"].values()):
            return
        time.sleep(1)
    raise AssertionError(f"the pool's next generations are not warm: {status['warm']}")


def long_run_past_its_first_step(workdir: Path, run_dir: str, steps: int = 40) -> subprocess.Popen:
    """A run of ``steps`` steps, once it has trained one. 40 are long enough (a step takes about a
    second here) that a kill lands mid-run, not in its last step."""
    env = {**ENV, "SKYRL_POOLS_DIR": str(workdir / "pools")}
    argv = [str(SKYRL), "rl", "recipe.toml", "--run-dir", run_dir, "--quiet", "--set", f"rl.steps={steps}"]
    run = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not events(workdir / run_dir, "train/policy_loss") and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)
    assert run.poll() is None, "the run ended before its first step was trained"
    return run


def test_a_warm_learner_killed_mid_run_fails_that_run_in_one_line_and_the_pool_gets_a_new_one(workdir):
    wait_until_warm(workdir)
    run = long_run_past_its_first_step(workdir, "r5")
    agent = warm_pid(workdir / "r5")
    workers = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout.split()
    (rank,) = [int(pid) for pid in workers if rank_of(int(pid)) == "1"]
    os.kill(rank, signal.SIGKILL)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 1
    assert f"error: the trainer failed (exit code 1): rank 1 (pid {rank}) was killed by SIGKILL" in err, err[-2000:]
    wait_until_warm(workdir)  # the keeper replaced the generation once the run let go of the pool


def test_a_second_run_is_refused_while_the_pool_is_in_use(workdir, monkeypatch):
    from skyrl_cli.engines.pool import get_pool, leased

    monkeypatch.setenv("SKYRL_POOLS_DIR", str(workdir / "pools"))
    with leased(get_pool(POOL), workdir / "holder-run"):
        refused = skyrl(workdir, "rl", "recipe.toml", "--run-dir", "r3", "--pool", POOL, check=False, timeout=60)
        planned = skyrl(workdir, "rl", "recipe.toml", "--dry-run", "--run-dir", "r3", check=False, timeout=60)
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert f"engine pool '{POOL}' is in use by the run in {workdir / 'holder-run'}" in line
    assert not (workdir / "r3" / "events.jsonl").exists()  # refused before anything ran
    assert planned.returncode == 0 and "in use by" in planned.stderr and "using engine pool" not in planned.stderr


def test_an_engine_and_the_teacher_killed_mid_run_are_restarted_by_the_run_and_stay_in_the_pool(workdir):
    (old,) = engine_pids(workdir)
    (old_teacher,) = teacher_pids(workdir)
    # 10 steps: a step the kills land in waits for the teacher (its requests wait out the restart).
    run = long_run_past_its_first_step(workdir, "r4", steps=10)
    for pid in (old, old_teacher):
        os.killpg(pid, signal.SIGKILL)  # the engine and its EngineCore
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    ((new,), (new_teacher,)) = engine_pids(workdir), teacher_pids(workdir)
    for before, after in ((old, new), (old_teacher, new_teacher)):
        assert after != before and os.path.exists(f"/proc/{after}")  # restarted, and still running after the run
    assert [v for _, v in events(workdir / "r4", "engine/restarts")], "the run did not record the restart"
    assert [v for _, v in events(workdir / "r4", "auxiliary/restarts")] == [1.0], "no (or more) teacher restarts"
    assert max(step for step, _ in events(workdir / "r4", "train/policy_loss")) == 10
    # Every step was scored by the teacher: its requests waited out the restart instead of failing.
    assert len(events(workdir / "r4", "distill/reverse_kl")) == 10
    errors = workdir / "r4" / "sample_errors.jsonl"
    assert not errors.exists() or "teacher" not in errors.read_text()
    status = pool_status(workdir)
    assert all(e["healthy"] for e in status["engines"]) and all(a["healthy"] for a in status["auxiliaries"])

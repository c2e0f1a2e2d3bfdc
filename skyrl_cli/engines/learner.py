"""A run's side of an engine pool's warm learner (``skyrl_contracts.standby`` states the protocol).

A run on a pool whose keeper has a generation waiting hands its learner job to it instead of
starting torchrun: the job is the run's own learner command (module and arguments after
torchrun's ``-m``), its environment and log. It fits only when the run would have started torchrun
exactly as the pool did (ranks, nodes, threads, devices: ``learner_signature``), because those are
fixed when the ranks start. A run that does not fit, or finds no generation waiting (the keeper is
gone, or still between runs), starts its own learner as without a pool.

The run then supervises the generation's torchrun as its own job (``Supervisor.take_over``): torn
down with the run, told to the reaper, its exit code read from the keeper's ``exit.json``.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_cli.launch.supervisor import ManagedProcess, Supervisor, child_env, pid_alive
from skyrl_cli.plan.model import ProcessSpec
from skyrl_cli.plan.pool import LEARNER_NAME, first_difference
from skyrl_contracts.standby import (
    CURRENT_FILE,
    EXIT_FILE,
    JOB_FILE,
    STARTED_AT_ENV,
    Job,
    gen_dir,
    read_json,
    ready_marker,
    taken_marker,
)

EXIT_CODE_WAIT_S = 3.0  # between torchrun's exit and the keeper's record of its code
UNKNOWN_EXIT = 1  # the keeper was gone when torchrun exited: "failed", as AdoptedProcess says
RDZV_FLAG = "--rdzv-endpoint"


def split_torchrun(argv: tuple[str, ...] | list[str]) -> tuple[list[str], str, list[str]]:
    """``torchrun ... -m MODULE ARGS`` -> (the launcher part, MODULE, ARGS)."""
    argv = list(argv)
    start = argv.index("torch.distributed.run") + 1
    i = argv.index("-m", start)
    return argv[:i], argv[i + 1], argv[i + 2 :]


def learner_signature(argv: tuple[str, ...] | list[str], env: dict[str, str]) -> dict[str, Any]:
    """How torchrun starts the ranks, without the rendezvous port (each launch's own): two
    learners with equal signatures run in the same processes alike."""
    launcher, _, _ = split_torchrun(argv)
    masked = [("*" if i > 0 and launcher[i - 1] == RDZV_FLAG else w) for i, w in enumerate(launcher)]
    return {"argv": masked, "env": dict(env)}


def keeper_torchrun(keeper: ProcessSpec) -> list[str]:
    """The standby's torchrun command inside the keeper's (after its ``--``)."""
    argv = list(keeper.argv)
    return argv[argv.index("--") + 1 :]


def misfit(keeper: ProcessSpec, trainer: ProcessSpec) -> str | None:
    """Why a run's learner cannot be handed to the pool's warm learner; None when it can."""
    difference = first_difference(
        learner_signature(keeper_torchrun(keeper), keeper.env), learner_signature(trainer.argv, trainer.env)
    )
    return difference


@dataclass
class Generation:
    """The keeper's current generation, as ``current.json`` and its folder describe it."""

    gen: int
    folder: Path
    agent_pid: int

    @classmethod
    def current(cls, learner_dir: Path) -> "Generation | None":
        raw = read_json(learner_dir / CURRENT_FILE)
        if raw is None:
            return None
        found = cls(int(raw["gen"]), gen_dir(learner_dir, int(raw["gen"])), int(raw["agent_pid"]))
        return found if pid_alive(found.agent_pid) else None

    def free(self) -> bool:
        return not (self.folder / JOB_FILE).exists()

    def ready_ranks(self, ranks: int) -> int:
        return sum(ready_marker(self.folder, r).exists() for r in range(ranks))


def state(learner_dir: Path, ranks: int) -> str:
    """For ``skyrl engines status``: "warm (2/2 ranks)", "starting (1/2 ranks)", "in use", "off"."""
    generation = Generation.current(learner_dir)
    if generation is None:
        return "off"
    if not generation.free():
        return "in use"
    ready = generation.ready_ranks(ranks)
    return f"{'warm' if ready == ranks else 'starting'} ({ready}/{ranks} ranks)"


def wait_warm(learner_dir: Path, ranks: int, timeout_s: float, keeper_alive) -> str | None:
    """Block until every rank of the current generation is ready; why not, else None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        generation = Generation.current(learner_dir)
        if generation is not None and generation.ready_ranks(ranks) == ranks:
            return None
        if generation is None and not keeper_alive():
            return "its keeper exited"
        time.sleep(0.25)
    return f"not warm after {timeout_s:.0f} s"


class StandbyJob:
    """The ``Popen`` surface (pid, poll, wait) of a generation running this run's learner: its
    torchrun is the keeper's child, so the exit code comes from the keeper's ``exit.json``."""

    def __init__(self, generation: Generation):
        self.pid = generation.agent_pid
        self.folder = generation.folder
        self._exited_at: float | None = None
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        if pid_alive(self.pid):
            return None
        recorded = read_json(self.folder / EXIT_FILE)
        if recorded is not None:
            # A generation that ended before any rank took the job (it failed while waiting) did
            # not run this run's learner, whatever its code.
            taken = taken_marker(self.folder, 0).exists()
            self._code = int(recorded["code"]) if taken else (int(recorded["code"]) or UNKNOWN_EXIT)
            return self._code
        self._exited_at = self._exited_at or time.monotonic()
        if time.monotonic() - self._exited_at > EXIT_CODE_WAIT_S:
            self._code = UNKNOWN_EXIT
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return code


def start_learner(
    supervisor: Supervisor, spec: ProcessSpec, keeper: ProcessSpec | None, pool_dir: Path
) -> ManagedProcess:
    """The run's learner: handed to the pool's waiting generation when it fits, else started."""
    generation = Generation.current(pool_dir / LEARNER_NAME) if keeper is not None else None
    if generation is None or not generation.free() or misfit(keeper, spec) is not None:
        return supervisor.start(spec)
    _, module, args = split_torchrun(spec.argv)
    log_path = supervisor.logs_dir / f"{spec.name}.log"
    env = child_env(supervisor.base_env, spec.env)
    env[STARTED_AT_ENV] = repr(time.time())
    job = Job(module=module, argv=args, cwd=os.getcwd(), env=env, log=str(log_path), run_dir=str(supervisor.run_dir))
    return supervisor.take_over(spec, StandbyJob(generation), log_path, lambda: job.write(generation.folder))

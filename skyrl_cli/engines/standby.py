"""A run's side of an engine pool's warm processes (``skyrl_contracts.standby`` states the protocol).

A pool keeps a generation of the recipe's learner (torchrun and its ranks) and of its
orchestrator started and imported. A run on the pool hands each of those jobs to the waiting
generation instead of starting the process: the job is the run's own command (module and
arguments after ``-m``), its environment and log. It fits only when the run would have started the
process exactly as the pool did (for the learner: ranks, nodes, threads, devices;
``launch_signature``), because those are fixed when the process starts. A run that does not fit,
or finds no generation waiting (the keeper is gone, or still between runs), starts its own
process as without a pool.

The run then supervises the generation as its own job (``Supervisor.take_over``): torn down with
the run, told to the reaper, its exit code read from the keeper's ``exit.json``.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from skyrl_cli.launch.pids import pid_alive
from skyrl_cli.launch.supervisor import ManagedProcess, Supervisor, child_env
from skyrl_cli.plan.model import ProcessSpec
from skyrl_cli.plan.pool import first_difference
from skyrl_cli.plan.trainer import RDZV_FLAG
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

EXIT_CODE_WAIT_S = 3.0  # between the generation's exit and the keeper's record of its code
UNKNOWN_EXIT = 1  # the keeper was gone when the generation exited: "failed", as AdoptedProcess says


def split_command(argv: tuple[str, ...] | list[str]) -> tuple[list[str], str, list[str]]:
    """``python [-m torch.distributed.run FLAGS] -m MODULE ARGS`` -> (the launcher, MODULE, ARGS)."""
    argv = list(argv)
    start = argv.index("torch.distributed.run") + 1 if "torch.distributed.run" in argv else 1
    i = argv.index("-m", start)
    return argv[:i], argv[i + 1], argv[i + 2 :]


def launch_signature(argv: tuple[str, ...] | list[str], env: dict[str, str]) -> dict[str, Any]:
    """How a process is started, without torchrun's rendezvous port (each launch's own): two
    commands with equal signatures run their module in the same kind of process."""
    launcher, _, _ = split_command(argv)
    masked = [("*" if i > 0 and launcher[i - 1] == RDZV_FLAG else w) for i, w in enumerate(launcher)]
    return {"argv": masked, "env": dict(env)}


def kept_command(keeper: ProcessSpec) -> list[str]:
    """The standby's command inside the keeper's (after its ``--``)."""
    argv = list(keeper.argv)
    return argv[argv.index("--") + 1 :]


def misfit(keeper: ProcessSpec, spec: ProcessSpec) -> str | None:
    """The first launch setting in which a run's process differs from the pool's warm one; None
    when the job can be handed over."""
    return first_difference(launch_signature(kept_command(keeper), keeper.env), launch_signature(spec.argv, spec.env))


def ranks_of(keeper: ProcessSpec) -> int:
    """How many processes a generation has: torchrun's ranks, else one."""
    command = kept_command(keeper)
    return int(command[command.index("--nproc-per-node") + 1]) if "--nproc-per-node" in command else 1


@dataclass
class Generation:
    """A keeper's current generation, as ``current.json`` and its folder describe it."""

    gen: int
    folder: Path
    agent_pid: int  # the generation's process (torchrun, or the standby itself)

    @classmethod
    def current(cls, folder: Path) -> "Generation | None":
        raw = read_json(folder / CURRENT_FILE)
        if raw is None:
            return None
        found = cls(int(raw["gen"]), gen_dir(folder, int(raw["gen"])), int(raw["agent_pid"]))
        return found if pid_alive(found.agent_pid) else None

    def free(self) -> bool:
        return not (self.folder / JOB_FILE).exists()

    def ready_ranks(self, ranks: int) -> int:
        return sum(ready_marker(self.folder, r).exists() for r in range(ranks))


def state(folder: Path, ranks: int) -> str:
    """For ``skyrl engines status``: "warm", "starting (1/2)", "in use", "off"."""
    generation = Generation.current(folder)
    if generation is None:
        return "off"
    if not generation.free():
        return "in use"
    ready = generation.ready_ranks(ranks)
    return "warm" if ready == ranks else f"starting ({ready}/{ranks})"


def wait_warm(folder: Path, ranks: int, timeout_s: float, keeper_alive: Callable[[], bool]) -> str | None:
    """Block until every process of the current generation is ready; why not, else None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        generation = Generation.current(folder)
        if generation is not None and generation.ready_ranks(ranks) == ranks:
            return None
        if generation is None and not keeper_alive():
            return "its keeper exited"
        time.sleep(0.25)
    return f"not warm after {timeout_s:.0f} s"


class StandbyJob:
    """The ``Popen`` surface (pid, poll, wait) of a generation running this run's job: it is the
    keeper's child, so the exit code comes from the keeper's ``exit.json``."""

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
            # A generation that ended before it took the job (it failed while waiting) did not run
            # this run's job, whatever its code.
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


def start_warm(supervisor: Supervisor, spec: ProcessSpec, keeper: ProcessSpec | None, folder: Path) -> ManagedProcess:
    """``spec`` handed to the pool's waiting generation in ``folder`` when it fits, else started."""
    generation = Generation.current(folder) if keeper is not None else None
    if generation is None or not generation.free() or misfit(keeper, spec) is not None:
        return supervisor.start(spec)
    _, module, args = split_command(spec.argv)
    log_path = supervisor.logs_dir / f"{spec.name}.log"
    env = child_env(supervisor.base_env, spec.env)
    env[STARTED_AT_ENV] = repr(time.time())
    job = Job(module=module, argv=args, cwd=os.getcwd(), env=env, log=str(log_path), run_dir=str(supervisor.run_dir))
    return supervisor.take_over(spec, StandbyJob(generation), log_path, lambda: job.write(generation.folder))

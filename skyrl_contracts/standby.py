"""Warm processes: how a run hands its learner and orchestrator jobs to an engine pool's standbys.

A cold RL learner spends most of its start-up before its first line of work: torchrun imports
torch, then every rank imports torch, DeepSpeed and transformers (12.5 of 16.2 s on 2 busy cores,
benchmarks/RESULTS.md, #30); the orchestrator imports transformers for its tokenizer (1-4 s). An
engine pool keeps one generation of each warm: processes started as a run would start them,
their imports done, waiting for a job. A run that fits writes the job once; the process (every
rank of it) takes it, moves its output to the run's log, and runs the job's ``main`` as a fresh
process would. The generation then ends with the job, and the pool's keeper starts the next one
once the run has let go of the pool, so each run gets processes no other run has touched.

Three sides share a folder per warm process, ``<pool>/warm-learner/`` and
``<pool>/warm-orchestrator/``, and only through these names (standard library only, as every
contract in ``skyrl_contracts``):

- the keeper (``skyrl_cli.engines.keeper``) starts generation N in ``gen-<N>/``, records it in
  ``current.json`` (``{"gen": N, "agent_pid": pid}``) and, when the generation exits, its exit
  code in ``gen-<N>/exit.json``;
- each process or rank (``backends.standby``) marks ``ready-<rank>`` once its imports are done,
  waits for ``job.json`` and marks ``taken-<rank>`` when it starts it;
- the run (``skyrl_cli.engines.standby``) writes ``job.json`` (a ``Job``) exactly once.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from skyrl_contracts.atomic import write_json

CURRENT_FILE = "current.json"
JOB_FILE = "job.json"
EXIT_FILE = "exit.json"
AGENT_LOG = "agent.log"
# The environment key that moves a warm process's start-up clock to its hand-over: its own
# creation time is the pool's, long before the run (skyrl_contracts.logs.process_created_at).
STARTED_AT_ENV = "SKYRL_STARTED_AT"


@dataclass(frozen=True)
class Job:
    """What a rank runs: ``importlib.import_module(module).main(argv)`` in ``cwd`` with ``env``
    over its own environment (torchrun's rank variables stay), output appended to ``log``."""

    module: str
    argv: list[str]
    cwd: str
    env: dict[str, str]
    log: str
    run_dir: str

    def write(self, gen_dir: Path) -> None:
        write_json(gen_dir / JOB_FILE, asdict(self))

    @classmethod
    def read(cls, gen_dir: Path) -> "Job | None":
        try:
            raw = json.loads((gen_dir / JOB_FILE).read_text())
        except (OSError, ValueError):
            return None
        return cls(**raw)


def gen_dir(learner_dir: Path, gen: int) -> Path:
    return learner_dir / f"gen-{gen}"


def mark(path: Path) -> None:
    write_json(path, {"pid": os.getpid(), "at": time.time()})


def ready_marker(gen: Path, rank: int | str) -> Path:
    return gen / f"ready-{rank}"


def taken_marker(gen: Path, rank: int | str) -> Path:
    return gen / f"taken-{rank}"


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

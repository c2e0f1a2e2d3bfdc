"""A warm process of an engine pool: ``python -m backends.standby --kind learner|orchestrator --gen-dir DIR``.

The learner's ranks run it under torchrun, the orchestrator as a plain process. Each imports what
its kind needs before its first line of work (the learner: torch, DeepSpeed, transformers and the
model classes; the orchestrator: transformers' tokenizers and the rollout client), says so with
``ready-<rank>``, and waits for the run's ``job.json``. It then becomes the run's process: its
output goes to the run's log, the job's directory, environment and import path replace its own
(torchrun's rank variables stay), and the job's ``main`` runs exactly as in a fresh process, so
what it does and how it ends (an exception's traceback and exit code, a completed learner's
``os._exit(0)``) reach the launcher unchanged. The hand-over protocol is
``skyrl_contracts.standby``; the pool's keepers start these processes.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from pathlib import Path

from skyrl_contracts.logs import setup_process_logging
from skyrl_contracts.standby import Job, mark, ready_marker, taken_marker

JOB_POLL_S = 0.05
# What each kind imports before its first step, in the order it would (the rest of transformers
# and DeepSpeed is pulled in by these).
PRELOAD = {
    "learner": (
        "torch",
        "torch.distributed",
        "deepspeed",
        "transformers",
        "backends.train.rl_learner",
        "backends.train.rl.step",
        "backends.train.engine",
        "backends.train.publish",
        "backends.train.checkpoint",
        "backends.models.loading",
        "backends.models.tokenizer",
        "backends.quant.fake_quant",
        # transformers' lazy modules, imported on a model's first load
        "transformers.models.llama.modeling_llama",
        "transformers.models.qwen2.modeling_qwen2",
        "transformers.models.qwen3.modeling_qwen3",
        # deepspeed.initialize's optimizer check imports its Muon optimizer, which calls
        # torch.compile at import (torch._dynamo and inductor): 2.6 s of a cold learner's
        # "deepspeed engine" lap
        "deepspeed.runtime.zero.muon.muon_optimizer",
    ),
    "orchestrator": (
        "transformers",  # 1.2-4.3 s of a cold orchestrator's "recipe, data and tokenizer" lap
        "transformers.tokenization_utils_fast",
        "backends.rollout.orchestrator",
        "backends.models.tokenizer",
        "backends.data.tasks",
    ),
}
# Imported only when the pool's recipe uses them (``--preload``): LoRA's peft, QAT's torchao.
OPTIONAL = ("peft", "torchao")


def preload(names: tuple[str, ...] | list[str]) -> None:
    """Import every module named that this installation has (one that another DeepSpeed or
    transformers version moved is only not warmed)."""
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            if not err.name or not (name == err.name or name.startswith(err.name + ".")):
                raise  # the module exists and one of its own imports failed: the job would fail too


def wait_for_job(gen: Path) -> Job | None:
    """The run's job, or None once the generation's folder is gone (the pool was stopped)."""
    while True:
        job = Job.read(gen)
        if job is not None:
            return job
        if not gen.is_dir():
            return None
        time.sleep(JOB_POLL_S)


def become(job: Job, started_in: str) -> None:
    """This process, from here on, as the run's process would start: the run's directory (also
    first on the import path, where ``python -m`` put the standby's), environment and log
    (appended to by every rank, as torchrun's shared output would be)."""
    os.chdir(job.cwd)
    if sys.path and sys.path[0] in (started_in, ""):
        sys.path[0] = job.cwd
    os.environ.update(job.env)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(job.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.standby", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", required=True, choices=sorted(PRELOAD))
    parser.add_argument("--gen-dir", required=True, type=Path)
    parser.add_argument("--run-dir", type=Path, help="the pool's folder (unused: the job names the run's)")
    parser.add_argument("--preload", action="append", default=[], choices=OPTIONAL)
    args = parser.parse_args(argv)

    setup_process_logging()
    started_in = os.getcwd()
    started = time.monotonic()
    preload([*PRELOAD[args.kind], *args.preload])
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # lazy: backends.train.engine imports torch; only a learner's ranks (under torchrun) need it
        from backends.train.engine import die_with_launcher

        die_with_launcher()  # an idle rank must not outlive a torchrun that was killed
    rank = os.environ.get("RANK", "0")
    mark(ready_marker(args.gen_dir, rank))
    logging.getLogger(__name__).info(
        "%s %s warm in %.1f s; waiting for a run", args.kind, rank, time.monotonic() - started
    )
    job = wait_for_job(args.gen_dir)
    if job is None:
        return 0
    become(job, started_in)
    mark(taken_marker(args.gen_dir, rank))
    sys.argv = [job.module, *job.argv]
    return importlib.import_module(job.module).main(job.argv) or 0


if __name__ == "__main__":
    sys.exit(main())

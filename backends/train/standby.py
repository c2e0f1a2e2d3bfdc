"""A warm learner rank: ``torchrun ... -m backends.train.standby --gen-dir DIR [--preload peft]``.

Each rank imports what a learner needs before its first line of work (torch, DeepSpeed,
transformers and the model classes, the learner's own modules), says so with ``ready-<rank>``,
and waits for the run's ``job.json``. It then becomes the run's learner rank: its output goes to
the run's log, the job's environment goes over its own (torchrun's rank variables stay), and the
learner's ``main`` runs exactly as under a fresh torchrun, so what it does and how it ends (an
exception's traceback and exit code, a completed run's ``os._exit(0)``) reach torchrun unchanged.
The hand-over protocol is ``skyrl_contracts.standby``; the pool's keeper starts these groups.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from pathlib import Path

from skyrl_contracts.standby import Job, mark, ready_marker, taken_marker

JOB_POLL_S = 0.05
# What every learner imports before its first step, in the order a learner would (the rest of
# transformers and DeepSpeed is pulled in by these); the model classes are transformers' lazy
# modules, imported on a model's first load.
PRELOAD = (
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
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    # deepspeed.initialize's optimizer check imports its Muon optimizer, which calls torch.compile
    # at import (torch._dynamo and inductor): 2.6 s of a cold learner's "deepspeed engine" lap.
    "deepspeed.runtime.zero.muon.muon_optimizer",
)
# Imported only when the pool's recipe uses them (``--preload``): LoRA's peft, QAT's torchao.
OPTIONAL = ("peft", "torchao")


def preload(extra: list[str]) -> None:
    """Import every module of ``PRELOAD`` and ``extra`` that this installation has (a module that
    another DeepSpeed or transformers version moved is only not warmed)."""
    import importlib.util

    for name in (*PRELOAD, *extra):
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # its parent package is missing
            found = False
        if found:
            importlib.import_module(name)
    from transformers import AutoModelForCausalLM  # noqa: F401  (resolves transformers' lazy auto classes)


def wait_for_job(gen: Path) -> Job | None:
    """The run's job, or None once the generation's folder is gone (the pool was stopped)."""
    while True:
        job = Job.read(gen)
        if job is not None:
            return job
        if not gen.is_dir():
            return None
        time.sleep(JOB_POLL_S)


def become(job: Job) -> None:
    """This process, from here on, as the run's learner rank would start: the run's directory,
    environment and log (appended to by every rank, as torchrun's shared output would be)."""
    os.chdir(job.cwd)
    os.environ.update(job.env)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(job.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.train.standby", description=__doc__.splitlines()[0])
    parser.add_argument("--gen-dir", required=True, type=Path)
    parser.add_argument("--run-dir", type=Path, help="the pool's folder (unused: the job names the run's)")
    parser.add_argument("--preload", action="append", default=[], choices=OPTIONAL)
    args = parser.parse_args(argv)
    from skyrl_contracts.logs import setup_process_logging

    setup_process_logging()
    started = time.monotonic()
    preload(args.preload)
    from backends.train.engine import die_with_launcher

    die_with_launcher()  # an idle rank must not outlive a torchrun that was killed
    rank = os.environ.get("RANK", "0")
    mark(ready_marker(args.gen_dir, rank))
    logging.getLogger(__name__).info("rank %s warm in %.1f s; waiting for a run", rank, time.monotonic() - started)
    job = wait_for_job(args.gen_dir)
    if job is None:
        return 0
    become(job)
    mark(taken_marker(args.gen_dir, rank))
    sys.argv = [job.module, *job.argv]
    return importlib.import_module(job.module).main(job.argv) or 0


if __name__ == "__main__":
    sys.exit(main())

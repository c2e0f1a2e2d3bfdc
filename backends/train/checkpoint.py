"""Checkpoints: HF model + DeepSpeed trainer state + data position, never visible half-written.

Layout of ``<run_dir>/checkpoints/step-<n>/``::

    model/                 HF safetensors model + tokenizer (LoRA: merged weights, adapter in adapter/)
    deepspeed/state/       engine.save_checkpoint: module, optimizer (per-rank ZeRO shards), scheduler
    rng/rank-<r>.pt        RNG states of every rank
    trainer_state.json     {"step": n, ...}: written last

All ranks write into ``checkpoints/.tmp-step-<n>/``; after a barrier rank 0 fsyncs it and
publishes it as ``step-<n>`` (``skyrl_contracts.atomic.publish_dir``), so a directory named ``step-<n>``
is always complete and on disk. Old checkpoints beyond ``keep_last`` are renamed to ``.trash-*``
before deletion for the same reason. At start-up ``remove_leftovers`` deletes the ``.tmp-*`` /
``.trash-*`` of a killed run and puts back an ``.old-*`` that a publish killed mid-way left.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from skyrl_contracts import atomic

# The one checkpoint lister lives with the run directory, light enough for the CLI (no torch).
from skyrl_contracts.rundir import CHECKPOINT_MODEL, RunDir
from skyrl_contracts.rundir import CHECKPOINT_STATE_FILE as STATE_FILE

DS_TAG = "state"
_FULL_BYTES = 1 << 20  # less than this left: the write failed for want of space


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (a full disk, an I/O error): its partial directory is
    gone, the previous checkpoint is untouched. The trainer's last log line; the driver shows it."""


def _write_failed(err: Exception, tmp: Path, final: Path, paths: RunDir) -> CheckpointError:
    """The error for a failed checkpoint write, after deleting the partial directory (which on a
    full disk frees what it took). torch.save and safetensors do not raise OSError on a full disk
    (``RuntimeError: ... unexpected pos``, ``SafetensorError: ... os error 28``): the free space
    measured before the clean-up tells it."""
    try:
        free = shutil.disk_usage(paths.root).free
    except OSError:
        free = None
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(err, OSError) and err.strerror:
        reason = err.strerror
    elif (free is not None and free < _FULL_BYTES) or "os error 28" in str(err):
        reason = "No space left on device"
    else:
        reason = f"{type(err).__name__}: {err}"
    previous = paths.latest_checkpoint()
    kept = f"{previous.name} is intact" if previous else "no earlier checkpoint"
    where = f"{free / 2**20:.1f} MiB were free in {paths.root}" if free is not None else str(paths.root)
    return CheckpointError(f"checkpoint {final.name} not written: {reason} ({where}); {kept}; resume with --resume")


def remove_leftovers(run_dir: str | os.PathLike) -> None:
    """Clean up after a killed run (rank 0, before training starts): partial or discarded
    checkpoints, and a half-published ``final/`` (the SFT trainer's, or the RL driver's, which only
    publishes after this process has exited)."""
    paths = RunDir(run_dir)
    atomic.remove_leftovers(paths.checkpoints)
    shutil.rmtree(paths.final_tmp, ignore_errors=True)
    atomic.recover_dir(paths.final)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    engine,
    run_dir: str | os.PathLike,
    step: int,
    state: dict,
    export_model: Callable[[Path], None],
    keep_last: int,
) -> Path:
    """Collective: every rank calls it. ``export_model(dir)`` writes the HF model (itself collective
    under ZeRO-3; only rank 0 writes files). Returns the checkpoint path."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    paths = RunDir(run_dir)
    final = paths.checkpoint(step)
    tmp = final.with_name(f"{atomic.TMP_PREFIX}{final.name}")
    try:
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
        _barrier()
        engine.save_checkpoint(str(tmp / "deepspeed"), tag=DS_TAG, save_latest=False)
        export_model(tmp / CHECKPOINT_MODEL)
        torch.save(rng_state(), tmp / "rng" / f"rank-{rank}.pt")
        _barrier()
        if rank == 0:
            atomic.write_json(tmp / STATE_FILE, {**state, "step": step})
            atomic.publish_dir(tmp, final)
    except Exception as err:  # noqa: BLE001 - any failed write: no partial directory stays behind
        raise _write_failed(err, tmp, final, paths) from err
    if rank == 0:
        for _, old in paths.complete_checkpoints()[:-keep_last]:
            atomic.discard_dir(old)
    _barrier()
    return final


def load_checkpoint(engine, path: str | os.PathLike) -> dict:
    """Restore engine, optimizer, scheduler and this rank's RNG; returns the trainer state."""
    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    engine.load_checkpoint(
        str(path / "deepspeed"), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    rng_file = path / "rng" / f"rank-{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / STATE_FILE).read_text())

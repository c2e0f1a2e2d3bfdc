"""Orchestrator <-> trainer exchange through the run directory, with atomic renames.

Works the same on one machine and on a shared file system across nodes:

- ``batches/step-<k>.json``: the k-th training batch (k from 0), written by the orchestrator.
- ``weights/v<k>/``: the policy after k optimizer steps (HF safetensors + config; with LoRA the
  PEFT adapter only: adapter_config.json + adapter_model.safetensors), written by the trainer's rank 0; ``v0`` is the initial policy. ``weights/LATEST`` names the newest version.
- ``control/stop``: written by either side to ask the other to stop (e.g. after a failure).
- NCCL weight sync (``backends.inference.nccl_sync``): ``weights/v<k>/`` holds only
  ``transfer.json`` (the weights come over NCCL); the orchestrator pauses the engines and writes
  ``control/transfer-v<k>.ready``, the learner broadcasts and writes ``control/transfer-v<k>.done``
  (``{"seconds": s}`` or ``{"error": why}``), the orchestrator labels the version and resumes.

Every file or directory appears complete or not at all (``skyrl_contracts.atomic``: written under a
``.tmp-`` name in the same directory, fsynced and renamed into place).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from skyrl_contracts.atomic import atomic_dir, write_json, write_text
from skyrl_contracts.rundir import RunDir


class StopRequested(Exception):
    """The other side asked to stop (``control/stop`` exists)."""


class RunExchange:
    def __init__(self, run_dir: str | os.PathLike):
        self.paths = RunDir(run_dir)
        self.run_dir = self.paths.root

    # ------------------------------------------------------------------ batches
    def batch_path(self, step: int) -> Path:
        return self.paths.batch(step)

    def write_batch(self, step: int, batch: dict[str, Any]) -> Path:
        path = self.batch_path(step)
        write_json(path, batch, indent=None)
        return path

    def read_batch(self, step: int, timeout_s: float | None = None, poll_s: float = 0.05) -> dict[str, Any]:
        path = self.batch_path(step)
        self._wait_for(path.exists, f"batch {step}", timeout_s, poll_s)
        return json.loads(path.read_text())

    def drop_batch(self, step: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.batch_path(step).unlink()

    # ------------------------------------------------------------------ weights
    def weights_dir(self, version: int) -> Path:
        return self.paths.weights_version(version)

    @contextlib.contextmanager
    def publish_weights(self, version: int) -> Iterator[Path]:
        """Write the weights of ``version`` into the yielded dir; it appears atomically, then LATEST."""
        with atomic_dir(self.weights_dir(version)) as tmp:
            yield tmp
        write_text(self.paths.latest_weights, str(version))

    def latest_version(self) -> int | None:
        return self.paths.latest_weights_version()

    def wait_version(self, version: int, timeout_s: float | None = None, poll_s: float = 0.05) -> Path:
        def published() -> bool:
            latest = self.latest_version()
            return latest is not None and latest >= version

        self._wait_for(published, f"weights v{version}", timeout_s, poll_s)
        return self.weights_dir(self.latest_version())

    def prune_weights_before(self, version: int, keep: Iterable[int] = ()) -> None:
        """Delete published versions older than ``version`` (the one the engines now serve), but
        not those in ``keep`` (LoRA adapters still loaded: an engine may read their files again).

        Never anything newer: the learner renames a new version into place before it updates
        LATEST, so a newer directory may exist that LATEST does not name yet.
        """
        kept = set(keep)
        for published, path in self.paths.weight_versions():
            if published < version and published not in kept:
                shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ delta repairs
    def request_full_weights(self, version: int) -> None:
        """Ask the learner for ``version`` whole: the engines could not rebuild it from its delta."""
        write_json(self.paths.full_weights_request(), {"version": version}, indent=None)

    def full_weights_requested(self) -> int | None:
        try:
            return int(json.loads(self.paths.full_weights_request().read_text())["version"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @contextlib.contextmanager
    def publish_full_weights(self, version: int) -> Iterator[Path]:
        """Write the full copy of ``version`` into the yielded dir; it appears atomically, and the
        request is answered."""
        with atomic_dir(self.paths.full_weights(version)) as tmp:
            yield tmp
        with contextlib.suppress(FileNotFoundError):
            self.paths.full_weights_request().unlink()

    def wait_full_weights(self, newer_than: int, timeout_s: float, poll_s: float = 0.1) -> tuple[int, Path]:
        """(version, dir) of the first full copy of a version >= ``newer_than`` to appear."""
        found: list[tuple[int, Path]] = []

        def answered() -> bool:
            found[:] = [(v, p) for v, p in self.full_weight_copies() if v >= newer_than]
            return bool(found)

        self._wait_for(answered, f"a full copy of weights v{newer_than}", timeout_s, poll_s)
        return found[0]

    def full_weight_copies(self) -> list[tuple[int, Path]]:
        if not self.paths.weights.is_dir():
            return []
        copies = []
        for path in self.paths.weights.iterdir():
            name = path.name.removeprefix("full-v")
            if path.name.startswith("full-v") and name.isdigit() and path.is_dir():
                copies.append((int(name), path))
        return sorted(copies)

    # ------------------------------------------------------------------ NCCL transfers
    def publish_transfer(self, version: int) -> None:
        """Announce ``version`` as one that comes over NCCL: a ``weights/v<k>/`` with no weights."""
        with self.publish_weights(version) as out:
            write_json(out / self.paths.transfer_marker(version).name, {"via": "nccl", "version": version})

    def is_transfer(self, version: int) -> bool:
        return self.paths.transfer_marker(version).exists()

    def mark_transfer_ready(self, version: int) -> None:
        write_text(self.paths.transfer_ready(version), str(version))

    def wait_transfer_ready(self, version: int, timeout_s: float | None = None) -> None:
        self._wait_for(self.paths.transfer_ready(version).exists, f"engines paused for v{version}", timeout_s, 0.01)

    def finish_transfer(self, version: int, outcome: dict[str, Any]) -> None:
        write_json(self.paths.transfer_done(version), outcome, indent=None)

    def wait_transfer_done(self, version: int, timeout_s: float | None = None) -> dict[str, Any]:
        """The learner's outcome for ``version``; both handshake files are removed once read."""
        done = self.paths.transfer_done(version)
        self._wait_for(done.exists, f"NCCL transfer of v{version}", timeout_s, 0.01)
        outcome = json.loads(done.read_text())
        for path in (self.paths.transfer_ready(version), done):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return outcome

    # ------------------------------------------------------------------ control
    def request_stop(self, reason: str) -> None:
        write_text(self.paths.stop_request, reason)

    def stop_reason(self) -> str | None:
        try:
            return self.paths.stop_request.read_text()
        except FileNotFoundError:
            return None

    def _wait_for(self, ready: Callable[[], bool], what: str, timeout_s: float | None, poll_s: float) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not ready():
            reason = self.stop_reason()
            if reason is not None:
                raise StopRequested(reason)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what} in {self.run_dir}")
            time.sleep(poll_s)

"""Files, as lossless deltas: each version written as the XOR of its bits against the version before,
compressed (``backends.inference.deltas``), every ``inference.full_version_every``-th version and the
first one whole. The engines apply a delta themselves (``backends.inference.delta_worker``) and
check every tensor before loading it.

Where an engine cannot get a version from the files (a delta corrupted or gone), it keeps serving
the version it had, and the orchestrator asks the learner for the version whole: rank 0 holds the
tensors of the newest version it published (the base of its next delta), and a thread of its
answers the request from memory with ``weights/full-v<k>/`` while the learner trains; the version
after a repair is written whole, so no later delta's chain runs through the broken file.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from pathlib import Path

from backends.inference.deltas import DeltaStats, chain, write_delta
from backends.inference.weight_sync import (
    CurrentWeights,
    DeltaRefused,
    EngineWeights,
    WeightSyncResult,
    record_current_weights,
    sync_policy_version,
)
from skyrl_contracts.exchange import RunExchange

log = logging.getLogger(__name__)
REPAIR_POLL_S = 0.2
REPAIR_TIMEOUT_S = 600.0  # the learner writes a whole version from memory (seconds; minutes at 7B on a slow disk)


class DeltaPublisher:
    """The learner's side. Every rank calls ``publish`` (gathering the weights is a collective under
    ZeRO-3); rank 0 writes."""

    def __init__(self, exchange, dist, export, full_every: int):
        self.exchange, self.dist, self.export, self.full_every = exchange, dist, export, full_every
        self.held: tuple[int, dict] | None = None  # (version, tensors) last published
        self.full_version: int | None = None
        self.whole_next = False
        self.last: dict[str, float] = {}
        if dist.is_main:
            threading.Thread(target=self.serve_repairs, name="delta-repairs", daemon=True).start()

    def publish(self, version: int) -> float | None:
        tensors = self.export.engine_tensors()
        if not self.dist.is_main:
            return None
        held = self.held
        whole = (
            held is None
            or self.whole_next
            or held[0] != version - 1
            or version - self.full_version >= self.full_every
        )  # fmt: skip
        t0 = time.perf_counter()
        with self.exchange.publish_weights(version) as out:
            if whole:
                self.whole_next = False
                self.export.write_engine_tensors(out, tensors)
                stats = None
            else:
                stats = write_delta(out, version, held[0], self.full_version, held[1], tensors)
        if whole:
            self.full_version = version
        self.held = (version, tensors)
        self.last = version_metrics(stats, tensors, time.perf_counter() - t0)
        return None

    def metrics(self) -> dict[str, float]:
        return self.last

    def serve_repairs(self) -> None:
        """Answer the orchestrator's requests for a version whole, from the tensors held."""
        while True:
            time.sleep(REPAIR_POLL_S)
            wanted, held = self.exchange.full_weights_requested(), self.held
            if wanted is None or held is None or held[0] < wanted:
                continue
            try:
                with self.exchange.publish_full_weights(held[0]) as out:
                    self.export.write_engine_tensors(out, held[1])
                self.whole_next = True
                log.warning("wrote weights v%d whole on the orchestrator's request", held[0])
            except OSError as err:  # the next request tries again; the orchestrator times out meanwhile
                log.error("could not write weights v%d whole: %s", held[0], err)


def version_metrics(stats: DeltaStats | None, tensors: dict, seconds: float) -> dict[str, float]:
    """What the step's metrics say of the version just written: its bytes whole and as written."""
    whole = float(sum(t.numel() * t.element_size() for t in tensors.values()))
    figures = {"weights/full_bytes": whole, "timing/weights_write_s": seconds}
    if stats is None:
        return {**figures, "weights/written_bytes": whole, "weights/delta": 0.0}
    return {
        **figures,
        "weights/written_bytes": float(stats.delta_bytes),
        "weights/delta": 1.0,
        "weights/changed_fraction": stats.changed_fraction,
    }


class DeltaEngineWeights(EngineWeights):
    """The orchestrator's side: ``load`` through the engines' worker extension; a version no engine
    could get from its files comes whole from the learner (``RunExchange.request_full_weights``)."""

    def __init__(self, engine_urls, run_dir, *, reset_prefix_cache: bool = False):
        super().__init__(engine_urls, run_dir, reset_prefix_cache=reset_prefix_cache)
        self.exchange = RunExchange(run_dir)
        self.current: Path | None = None

    async def load(self, version: int, weights_dir) -> WeightSyncResult:
        record_current_weights(self.run_dir, CurrentWeights(str(weights_dir), str(version)))
        try:
            result = await sync_policy_version(
                self.engine_urls, weights_dir, version, reset_prefix_cache=self.reset_prefix_cache
            )
            self.current = Path(weights_dir)
        except DeltaRefused as err:
            log.warning("%s; asking the learner for v%d whole", err, version)
            self.exchange.request_full_weights(version)
            got, whole = await asyncio.to_thread(self.exchange.wait_full_weights, version, REPAIR_TIMEOUT_S)
            record_current_weights(self.run_dir, CurrentWeights(str(whole), str(got)))
            result = await sync_policy_version(self.engine_urls, whole, got, reset_prefix_cache=self.reset_prefix_cache)
            self.current = whole
        for _, path in self.exchange.full_weight_copies():
            if path != self.current:
                shutil.rmtree(path, ignore_errors=True)
        return result

    def held(self) -> frozenset[int]:
        """The versions the current one is rebuilt from (its last whole version and the deltas
        since): an engine restarted now reads them."""
        if self.current is None or not self.current.name.startswith("v"):
            return frozenset()
        return frozenset(chain(self.current))


def publisher(exchange, dist, export, recipe, first_version, sender):
    return DeltaPublisher(exchange, dist, export, recipe.inference.full_version_every)


def engine_loader(recipe, run_dir, engine_urls):
    return DeltaEngineWeights(engine_urls, run_dir, reset_prefix_cache=recipe.rl.async_.reset_prefix_cache)

"""Policy versions into the engines: the weight watcher's side of a sync."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Mapping

from backends.inference.weight_sync import NoEngineReachable

log = logging.getLogger("skyrl.orchestrator")
ENGINES_BACK_TIMEOUT_S = 900.0  # an engine restart (start-up ~20 s, minutes on a busy machine)


class EngineSync:
    """Every engine onto a version the learner published, through the plan's loader
    (``EngineWeightLoader``); older published versions the engines no longer hold are deleted.

    LoRA: versions that no request in flight names are unloaded before the load (so no more than
    ``--max-loras`` are ever loaded) and again after it (the previous one, once idle); a version
    still in use keeps its adapter and directory until a later sync finds it idle."""

    def __init__(self, engines, exchange, events):
        self.engines, self.exchange, self.events = engines, exchange, events

    async def start(self, version: int, in_flight: Mapping[str, int]) -> str:
        """The run's first version: loaded, or (the engines started on it) only labelled."""
        if version > 0 or self.engines.loads_initial_version:  # LoRA: v0 is an adapter too
            return await self.load(version, in_flight)
        await self.engines.label_initial()
        return self.engines.model_name(version)

    async def load(self, version: int, in_flight: Mapping[str, int]) -> str:
        """Load ``version``; returns the model name requests sample it with."""
        t0 = time.perf_counter()
        await self.engines.retire(in_flight)
        result = await self.load_when_reachable(version)
        await self.engines.retire(in_flight)
        log.info("engines on policy version %d (%.3f s)", version, result.seconds)
        self.events.log(version, {"timing/sync_weights_s": time.perf_counter() - t0, "weights/version": version})
        self.exchange.prune_weights_before(version, keep=self.engines.held())
        return self.engines.model_name(version)

    async def load_when_reachable(self, version: int, timeout_s: float = ENGINES_BACK_TIMEOUT_S):
        """``engines.load``, again every few seconds while no engine answers: engine recovery is
        restarting them (a single engine that died), and the run goes on once one is back."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await self.engines.load(version, self.exchange.weights_dir(version))
            except NoEngineReachable as err:
                if time.monotonic() > deadline:
                    raise
                log.warning("%s; waiting for engine recovery", err)
                await asyncio.sleep(2.0)

"""Both sides of each weight transport, one module per transport, named as it is in
``skyrl_contracts.transports.TRANSPORTS`` (which holds what the driver must know of each). A
transport module defines the two functions of ``TransportSides``; ``publishers`` is machinery they
share, not a transport.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence, cast

from skyrl_contracts.transports import TRANSPORTS

if TYPE_CHECKING:
    from backends.inference.transports.publishers import WeightPublisher
    from backends.inference.weight_sync import EngineWeightLoader

SIDES = ("publisher", "engine_loader")


class TransportSides(Protocol):
    def publisher(self, exchange, dist, export, recipe, first_version: int, sender) -> WeightPublisher:
        """The learner's side (``backends.train.publish.weight_publisher``). ``export``: the learner's
        ``HFExporter``; ``sender``: rank 0's NCCL sender, None on other ranks or where the group could
        not be set up."""

    def engine_loader(self, recipe, run_dir: Path, engine_urls: Sequence[str]) -> EngineWeightLoader:
        """The orchestrator's side (``backends.rollout.orchestrator.engine_weights``)."""


def transport_module(name: str) -> TransportSides:
    """Transport ``name``'s module, imported on first use so that a process loads its run's only."""
    return cast(TransportSides, importlib.import_module(TRANSPORTS[name].module))

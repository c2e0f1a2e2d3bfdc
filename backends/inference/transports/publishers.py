"""The learner-side machinery the transports share: a version published as files, and NCCL with
its first version as files. Every rank calls ``publish`` for every version: under ZeRO-3 gathering
the weights is a collective that every rank joins while rank 0 writes (``HFExporter``); the
learner's barrier follows."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

Writer = Callable[[Path | None], None]  # writes one version into the directory (rank 0) or joins the gather (None)


class WeightPublisher(Protocol):
    def publish(self, version: int) -> float | None:
        """Make ``version`` available to the engines; the seconds of a transfer, None for files."""

    def metrics(self) -> dict[str, float]:
        """Figures of the last ``publish`` for the step's metrics (rank 0; empty where none)."""


class FilePublisher:
    """A version as files in ``weights/v<k>/``, published whole: rank 0 writes, the other ranks join
    the gather where the writer needs one (``collective``: ZeRO-3 full-weight exports)."""

    def __init__(self, exchange, dist, write: Writer, collective: bool):
        self.exchange, self.dist, self.write, self.collective = exchange, dist, write, collective

    def publish(self, version: int) -> float | None:
        if self.dist.is_main:
            with self.exchange.publish_weights(version) as out:
                self.write(out)
        elif self.collective:
            self.write(None)
        return None

    def metrics(self) -> dict[str, float]:
        return {}


class NcclFirstVersionAsFiles:
    """NCCL for every version but the starting one, which goes as files: it is what a restarted
    engine or a resumed run loads (``weights/current.json``)."""

    def __init__(self, sender, files: FilePublisher, first_version: int):
        self.sender, self.files, self.first_version = sender, files, first_version

    def publish(self, version: int) -> float | None:
        if version == self.first_version or self.sender is None:  # no sender on ranks > 0
            return self.files.publish(version)
        return self.sender.publish(version)

    def metrics(self) -> dict[str, float]:
        return {}


def full_weights_gather(recipe) -> bool:
    """Whether exporting the full weights is a collective: ZeRO-3 partitions them over the ranks."""
    return recipe.trainer.zero_stage == 3

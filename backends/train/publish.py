"""The learner's side of the weight sync: one ``WeightPublisher`` per transport, chosen once from the
plan's ``weight_sync`` (``skyrl_cli.plan.weight_sync``; the orchestrator picks the matching engine
loader from the same value, ``backends.rollout.orchestrator.engine_weights``).

    "disk"  the HF model (a tied head written out) in weights/v<k>/, which the engines reload
    "int4"  the W4A16 export of each version in weights/v<k>/ (quantization.int4_rollouts)
    "lora"  the PEFT adapter alone in weights/v<k>/, loaded under a versioned name
    "nccl"  rank 0 broadcasts into the engines (backends.inference.nccl_sync); the starting version,
            and every version when the group could not be set up, goes as "disk" files

Every rank calls ``publish`` for every version: under ZeRO-3 gathering the weights is a collective
that every rank joins while rank 0 writes (``HFExporter``); the learner's barrier follows.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable, Protocol

Writer = Callable[[Path | None], None]  # writes one version into the directory (rank 0) or joins the gather (None)


class WeightPublisher(Protocol):
    def publish(self, version: int) -> float | None:
        """Make ``version`` available to the engines; the seconds of a transfer, None for files."""


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


class NcclFirstVersionAsFiles:
    """NCCL for every version but the starting one, which goes as files: it is what a restarted
    engine or a resumed run loads (``weights/current.json``)."""

    def __init__(self, sender, files: FilePublisher, first_version: int):
        self.sender, self.files, self.first_version = sender, files, first_version

    def publish(self, version: int) -> float | None:
        if version == self.first_version or self.sender is None:  # no sender on ranks > 0
            return self.files.publish(version)
        return self.sender.publish(version)


def weight_publisher(
    weight_sync: str, exchange, dist, export, recipe, first_version: int, sender=None
) -> WeightPublisher:
    """The plan's transport as a publisher. ``export``: the learner's ``HFExporter`` (``for_engines``:
    the HF model with a tied head written out; ``int4_for_engines``: its W4A16 export; ``adapter``:
    the PEFT adapter). ``sender``: rank 0's NCCL sender, None on other ranks or where it could not be
    set up (every version then goes as files)."""
    collective = recipe.trainer.zero_stage == 3
    if weight_sync == "lora":
        return FilePublisher(exchange, dist, export.adapter, collective=False)
    if weight_sync == "int4":
        return FilePublisher(exchange, dist, partial(export.int4_for_engines, cfg=recipe.quantization), collective)
    files = FilePublisher(exchange, dist, export.for_engines, collective)
    if weight_sync == "nccl":
        return NcclFirstVersionAsFiles(sender, files, first_version)
    return files

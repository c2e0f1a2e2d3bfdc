"""The learner's side of the weight sync: the plan's transport (``--weight-sync NAME``, chosen by
``skyrl_cli.plan.weight_sync``) as a ``WeightPublisher``, built by that transport's module
(``backends.inference.transports.<name>.publisher``; the orchestrator takes the engine side of the
same module, ``backends.rollout.orchestrator.engine_weights``). Every rank calls ``publish`` for
every version (``backends.inference.transports.publishers``).
"""

from __future__ import annotations

from backends.inference.transports import transport_module
from backends.inference.transports.publishers import WeightPublisher


def weight_publisher(
    weight_sync: str, exchange, dist, export, recipe, first_version: int, sender=None
) -> WeightPublisher:
    """The plan's transport as a publisher. ``export``: the learner's ``HFExporter`` (``for_engines``:
    the HF model with a tied head written out; ``int4_for_engines``: its W4A16 export; ``adapter``:
    the PEFT adapter). ``sender``: rank 0's NCCL sender, None on other ranks or where it could not be
    set up (every version then goes as files)."""
    return transport_module(weight_sync).publisher(exchange, dist, export, recipe, first_version, sender)

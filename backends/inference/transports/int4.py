"""INT4 rollouts (``quantization.int4_rollouts``): each version is the learner's W4A16 export in
``weights/v<k>/``, which the engines reload as they reload full weights (``disk``)."""

from __future__ import annotations

from functools import partial

from backends.inference.transports import disk
from backends.inference.transports.publishers import FilePublisher, full_weights_gather


def publisher(exchange, dist, export, recipe, first_version, sender):
    write = partial(export.int4_for_engines, cfg=recipe.quantization)
    return FilePublisher(exchange, dist, write, full_weights_gather(recipe))


engine_loader = disk.engine_loader

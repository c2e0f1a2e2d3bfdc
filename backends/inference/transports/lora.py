"""LoRA (``[model.lora]``): each version is the PEFT adapter alone in ``weights/v<k>/``, which the
engines load under a versioned name beside the base they never reload."""

from __future__ import annotations

from backends.inference.transports.publishers import FilePublisher
from backends.inference.weight_sync import EngineAdapters


def publisher(exchange, dist, export, recipe, first_version, sender):
    # Adapters are whole on every rank (LoRA runs ZeRO 0-2): rank 0 writes, nobody gathers.
    return FilePublisher(exchange, dist, export.adapter, collective=False)


def engine_loader(recipe, run_dir, engine_urls):
    return EngineAdapters(engine_urls, run_dir)

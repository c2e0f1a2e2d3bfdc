"""Full weights as files: the learner's HF export (a tied head written out) in ``weights/v<k>/``,
which every engine reloads in place. Runs everywhere, and is what the others fall back to."""

from __future__ import annotations

from backends.inference.transports.publishers import FilePublisher, full_weights_gather
from backends.inference.weight_sync import EngineWeights


def publisher(exchange, dist, export, recipe, first_version, sender):
    return FilePublisher(exchange, dist, export.for_engines, full_weights_gather(recipe))


def engine_loader(recipe, run_dir, engine_urls):
    return EngineWeights(engine_urls, run_dir, reset_prefix_cache=recipe.rl.async_.reset_prefix_cache)

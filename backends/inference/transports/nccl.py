"""NCCL (``backends.inference.nccl_sync``): rank 0 broadcasts each version into the engines between
their pause and resume. The starting version, and every version when the group could not be set
up, goes as ``disk`` files, which the engine side reloads as ``disk`` does."""

from __future__ import annotations

from backends.inference.nccl_sync import NcclEngineWeights
from backends.inference.transports import disk
from backends.inference.transports.publishers import NcclFirstVersionAsFiles
from skyrl_contracts.exchange import RunExchange


def publisher(exchange, dist, export, recipe, first_version, sender):
    files = disk.publisher(exchange, dist, export, recipe, first_version, sender)
    return NcclFirstVersionAsFiles(sender, files, first_version)


def engine_loader(recipe, run_dir, engine_urls):
    reset = recipe.rl.async_.reset_prefix_cache
    return NcclEngineWeights(engine_urls, run_dir, RunExchange(run_dir), reset_prefix_cache=reset)

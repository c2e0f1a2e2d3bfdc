"""Getting a new policy into every engine, and recording which policy that is.

Disk path (CPU, and the fallback everywhere): the trainer writes HF safetensors into a directory;
each engine is then driven directly (the router does not forward admin routes):

    POST /pause?mode=keep          in-flight requests freeze with their KV cache
    POST /collective_rpc           {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
    POST /reset_prefix_cache       only when asked (cached KV was computed by the old weights)
    POST /update_weight_version    {"new_version": "<v>"}: every token sampled from now on carries it
    POST /resume                   frozen requests continue, under the new weights

Engines are synced concurrently. An engine that cannot be reached (it died; recovery restarts it
and brings it to the current weights itself) is reported, not fatal; an engine that answers with
an error is (a bad weights directory must not pass silently). A paused engine is always resumed,
also when the reload fails.

This disk path is the only one RL runs use today, on GPUs too: the NCCL broadcast in
``backends.inference.nccl_sync`` is written but not wired in yet, and ``sync_lora_adapter`` waits
for LoRA in the RL stage (refused by validation until then).

``record_current_weights`` / ``read_current_weights`` keep ``<run_dir>/weights/current.json`` (the
latest synced directory and version) so the recovery loop can bring a restarted engine up to date.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import httpx

from skyrl_cli.atomic import write_json
from skyrl_cli.errors import SkyrlError
from skyrl_cli.rundir import RunDir

log = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 300.0


class WeightSyncError(SkyrlError):
    """An engine refused a weight update, or no engine could be reached."""


@dataclass(frozen=True)
class WeightSyncResult:
    version: str
    seconds: float  # wall time of the whole sync (engines in parallel)
    engine_seconds: dict[str, float] = field(default_factory=dict)  # per reachable engine
    unreachable: tuple[str, ...] = ()

    @property
    def synced(self) -> tuple[str, ...]:
        return tuple(self.engine_seconds)


async def _post(http: httpx.AsyncClient, url: str, path: str, json_body: dict | None = None) -> dict:
    response = await http.post(f"{url}{path}", json=json_body)
    if response.status_code != 200:
        raise WeightSyncError(f"{url}{path}: HTTP {response.status_code}: {response.text[:500]}")
    try:
        return response.json()
    except ValueError:
        return {}


async def _paused(http: httpx.AsyncClient, url: str, update: Callable[[], Awaitable[None]]) -> None:
    """Run ``update`` on one engine between ``pause?mode=keep`` and ``resume``."""
    await _post(http, url, "/pause?mode=keep")
    try:
        await update()
    finally:
        await _post(http, url, "/resume")


async def _for_each_engine(
    engine_urls: Sequence[str],
    version: str,
    update_one: Callable[[httpx.AsyncClient, str], Awaitable[None]],
    http: httpx.AsyncClient | None,
    timeout_s: float,
) -> WeightSyncResult:
    own_client = http is None
    http = http or httpx.AsyncClient(timeout=timeout_s)
    started = time.perf_counter()
    engine_seconds: dict[str, float] = {}
    unreachable: list[str] = []

    async def one(url: str) -> None:
        t0 = time.perf_counter()
        try:
            await _paused(http, url, lambda: update_one(http, url))
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as err:
            log.warning("weight sync: %s unreachable (%s); recovery will update it", url, err)
            unreachable.append(url)
            return
        engine_seconds[url] = time.perf_counter() - t0

    try:
        results = await asyncio.gather(*(one(u) for u in engine_urls), return_exceptions=True)
    finally:
        if own_client:
            await http.aclose()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0] if isinstance(errors[0], WeightSyncError) else WeightSyncError(str(errors[0]))
    if engine_urls and len(unreachable) == len(engine_urls):
        raise WeightSyncError(f"weight sync to version {version}: no engine reachable ({', '.join(unreachable)})")
    result = WeightSyncResult(version, time.perf_counter() - started, engine_seconds, tuple(unreachable))
    log.info("weight sync to version %s: %.3f s over %d engine(s)", version, result.seconds, len(engine_seconds))
    return result


async def sync_weights(
    engine_urls: Sequence[str],
    weights_dir: str | os.PathLike,
    version: str | int,
    *,
    reset_prefix_cache: bool = False,
    http: httpx.AsyncClient | None = None,
    timeout_s: float = ADMIN_TIMEOUT_S,
) -> WeightSyncResult:
    """Disk path: every engine reloads the safetensors in ``weights_dir`` and labels them ``version``."""
    weights_path = str(Path(weights_dir).resolve())
    version = str(version)

    async def update(client: httpx.AsyncClient, url: str) -> None:
        await _post(
            client, url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights_path}}
        )
        if reset_prefix_cache:
            await _post(client, url, "/reset_prefix_cache")
        await _post(client, url, "/update_weight_version", {"new_version": version})

    return await _for_each_engine(engine_urls, version, update, http, timeout_s)


async def sync_lora_adapter(
    engine_urls: Sequence[str],
    lora_name: str,
    adapter_dir: str | os.PathLike,
    version: str | int,
    *,
    http: httpx.AsyncClient | None = None,
    timeout_s: float = ADMIN_TIMEOUT_S,
) -> WeightSyncResult:
    """LoRA: load (or replace in place) the adapter saved in ``adapter_dir`` under ``lora_name``.

    Engines must run with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (the
    launch plan sets both when the recipe has ``[model.lora]``); requests select the adapter with
    ``model = lora_name``.
    """
    adapter_path = str(Path(adapter_dir).resolve())
    version = str(version)

    async def update(client: httpx.AsyncClient, url: str) -> None:
        await _post(
            client,
            url,
            "/v1/load_lora_adapter",
            {"lora_name": lora_name, "lora_path": adapter_path, "load_inplace": True},
        )
        await _post(client, url, "/update_weight_version", {"new_version": version})

    return await _for_each_engine(engine_urls, version, update, http, timeout_s)


async def set_weight_version(
    engine_urls: Sequence[str], version: str | int, http: httpx.AsyncClient | None = None
) -> None:
    """Label the engines' current weights (e.g. "0" for the initial policy) without reloading."""
    async with httpx.AsyncClient(timeout=ADMIN_TIMEOUT_S) if http is None else _borrowed(http) as client:
        await asyncio.gather(
            *(_post(client, u, "/update_weight_version", {"new_version": str(version)}) for u in engine_urls)
        )


async def engine_weight_version(url: str, http: httpx.AsyncClient | None = None) -> str:
    async with httpx.AsyncClient(timeout=30) if http is None else _borrowed(http) as client:
        response = await client.get(f"{url}/weight_info")
        response.raise_for_status()
        return str(response.json()["weight_version"])


class _borrowed:
    """``async with`` over a caller's client without closing it."""

    def __init__(self, client: httpx.AsyncClient):
        self.client = client

    async def __aenter__(self) -> httpx.AsyncClient:
        return self.client

    async def __aexit__(self, *exc) -> None:
        return None


def run_blocking(coro):
    """Run one of the coroutines above from synchronous code (a trainer, a recovery thread)."""
    return asyncio.run(coro)


# ------------------------------------------------------------------------------ current weights


@dataclass(frozen=True)
class CurrentWeights:
    path: str  # directory with the safetensors (or the LoRA adapter)
    version: str
    lora_name: str | None = None


def record_current_weights(run_dir: str | os.PathLike, current: CurrentWeights) -> None:
    """Atomically write ``weights/current.json``; call it *before* syncing the engines, so an engine
    restarted meanwhile reads the newer weights (see ``backends.inference.recovery``)."""
    record = {"path": current.path, "version": current.version, "lora_name": current.lora_name}
    write_json(RunDir(run_dir).current_weights, record, indent=None)


def read_current_weights(run_dir: str | os.PathLike) -> CurrentWeights | None:
    try:
        raw = json.loads(RunDir(run_dir).current_weights.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return CurrentWeights(str(raw["path"]), str(raw["version"]), raw.get("lora_name"))


async def bring_up_to_date(engine_urls: Sequence[str], current: CurrentWeights | None) -> WeightSyncResult | None:
    """Load ``current`` (the latest synced weights) into freshly started engines."""
    if current is None:
        await set_weight_version(engine_urls, "0")
        return None
    if current.lora_name:
        return await sync_lora_adapter(engine_urls, current.lora_name, current.path, current.version)
    return await sync_weights(engine_urls, current.path, current.version)


class EngineWeights:
    """The orchestrator's view of the engines' weights: label the initial policy, load a published
    version. ``weights/current.json`` is recorded before each load, so an engine that the recovery
    loop restarts meanwhile loads the same version (``backends.inference.recovery``)."""

    def __init__(self, engine_urls: Sequence[str], run_dir: str | os.PathLike, *, reset_prefix_cache: bool = False):
        self.engine_urls = list(engine_urls)
        self.run_dir = run_dir
        self.reset_prefix_cache = reset_prefix_cache

    async def label_initial(self) -> None:
        await set_weight_version(self.engine_urls, "0")

    async def load(self, version: int, weights_dir: str | os.PathLike) -> WeightSyncResult:
        record_current_weights(self.run_dir, CurrentWeights(str(weights_dir), str(version)))
        return await sync_weights(self.engine_urls, weights_dir, version, reset_prefix_cache=self.reset_prefix_cache)

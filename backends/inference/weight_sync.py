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

NCCL path (GPUs, ``inference.weight_sync``): the same pause (keep) -> new weights -> version
label -> resume sequence, with the new weights broadcast by trainer rank 0 instead of reloaded
from disk (``sync_transferred`` here, driven by ``backends.inference.nccl_sync.NcclEngineWeights``).

LoRA (``model.lora``): each policy version is a PEFT adapter directory, loaded under its own name
(``adapter_name(k)`` = ``policy-v<k>``) with ``/v1/load_lora_adapter`` and no pause: a request
names the adapter it samples with, so in-flight requests finish on the version they asked for and
every token of a request comes from exactly that version. ``EngineAdapters`` unloads an old version
once no request in flight names it (``/v1/unload_lora_adapter``); only then may its directory go.

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
from typing import Awaitable, Callable, Iterable, Mapping, Protocol, Sequence

import httpx

from skyrl_contracts.atomic import write_json
from skyrl_contracts.engine_api import SERVED_MODEL_NAME
from skyrl_contracts.errors import SkyrlError
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.transports import DELTA_MANIFEST

log = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 300.0


class WeightSyncError(SkyrlError):
    """An engine refused a weight update, or no engine could be reached."""


class NoEngineReachable(WeightSyncError):
    """Every engine was unreachable (all being restarted by engine recovery): try again later."""


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
    pause: bool = True,
) -> WeightSyncResult:
    """``update_one`` on every engine concurrently, between pause and resume when ``pause`` (an
    update that replaces weights requests are using); an update that adds weights under a new
    name (a versioned LoRA adapter) needs none."""
    own_client = http is None
    http = http or httpx.AsyncClient(timeout=timeout_s)
    started = time.perf_counter()
    engine_seconds: dict[str, float] = {}
    unreachable: list[str] = []

    async def one(url: str) -> None:
        t0 = time.perf_counter()
        try:
            if pause:
                await _paused(http, url, lambda: update_one(http, url))
            else:
                await update_one(http, url)
        except (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as err:
            # NetworkError, not only ConnectError: an engine killed during its update resets the
            # connection (ReadError), which used to fail the whole run instead of waiting for it.
            log.warning("weight sync: %s unreachable (%s: %s); recovery will update it", url, type(err).__name__, err)
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
        first = errors[0]
        raise first if isinstance(first, WeightSyncError) else WeightSyncError(f"{type(first).__name__}: {first}")
    if engine_urls and len(unreachable) == len(engine_urls):
        raise NoEngineReachable(f"weight sync to version {version}: no engine reachable ({', '.join(unreachable)})")
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
    """Disk path: every engine reloads the safetensors in ``weights_dir`` and labels them ``version``
    (a delta version, which a restarted engine of a delta run may be brought to, goes through
    ``sync_policy_version``)."""
    if (Path(weights_dir) / DELTA_MANIFEST).is_file():
        return await sync_policy_version(
            engine_urls, weights_dir, version, reset_prefix_cache=reset_prefix_cache, http=http, timeout_s=timeout_s
        )
    weights_path = str(Path(weights_dir).resolve())

    async def reload(client: httpx.AsyncClient, url: str) -> None:
        await _post(
            client, url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights_path}}
        )

    return await _load_and_label(engine_urls, str(version), reload, reset_prefix_cache, http, timeout_s)


async def _load_and_label(
    engine_urls: Sequence[str],
    version: str,
    load: Callable[[httpx.AsyncClient, str], Awaitable[None]],
    reset_prefix_cache: bool,
    http: httpx.AsyncClient | None,
    timeout_s: float,
) -> WeightSyncResult:
    """``load`` new weights into every engine between pause and resume, then reset the prefix cache
    where asked and label the weights ``version``."""

    async def update(client: httpx.AsyncClient, url: str) -> None:
        await load(client, url)
        if reset_prefix_cache:
            await _post(client, url, "/reset_prefix_cache")
        await _post(client, url, "/update_weight_version", {"new_version": version})

    return await _for_each_engine(engine_urls, version, update, http, timeout_s)


class DeltaRefused(WeightSyncError):
    """An engine could not get a delta version from its files (``backends.inference.delta_worker``):
    it keeps the version it had, and the version must come whole."""


async def sync_policy_version(
    engine_urls: Sequence[str],
    weights_dir: str | os.PathLike,
    version: str | int,
    *,
    reset_prefix_cache: bool = False,
    http: httpx.AsyncClient | None = None,
    timeout_s: float = ADMIN_TIMEOUT_S,
) -> WeightSyncResult:
    """Delta path: every engine's workers load ``weights_dir`` (a delta or a full version) through
    the worker extension, which checks it before vLLM loads it; ``DeltaRefused`` where one could not."""
    weights_path = str(Path(weights_dir).resolve())
    version = str(version)

    async def load(client: httpx.AsyncClient, url: str) -> None:
        rpc = {"method": "load_policy_version", "kwargs": {"path": weights_path, "version": version}}
        answers = (await _post(client, url, "/collective_rpc", rpc)).get("results") or [None]
        refused = [a for a in answers if not (isinstance(a, dict) and a.get("ok"))]
        if refused:
            why = refused[0].get("error") if isinstance(refused[0], dict) else f"answered {refused[0]!r}"
            raise DeltaRefused(f"{url}: v{version}: {why}")

    return await _load_and_label(engine_urls, version, load, reset_prefix_cache, http, timeout_s)


async def sync_transferred(
    engine_urls: Sequence[str],
    version: str | int,
    transfer: Callable[[], Awaitable[None]],
    *,
    reset_prefix_cache: bool = False,
    http: httpx.AsyncClient | None = None,
    timeout_s: float = ADMIN_TIMEOUT_S,
) -> WeightSyncResult:
    """NCCL path: pause every engine, run ``transfer`` once (it fills all engines at the same time:
    one broadcast), then label every engine ``version`` and resume them (also after a failure).
    Every engine is in the NCCL group, so one that cannot be reached fails the sync."""
    version = str(version)
    own_client = http is None
    http = http or httpx.AsyncClient(timeout=timeout_s)
    started = time.perf_counter()

    async def each(path: str, body: dict | None = None) -> None:
        await asyncio.gather(*(_post(http, url, path, body) for url in engine_urls))

    try:
        try:  # an engine paused before another refused to pause is resumed too
            await each("/pause?mode=keep")
            await transfer()
            if reset_prefix_cache:
                await each("/reset_prefix_cache")
            await each("/update_weight_version", {"new_version": version})
        finally:
            await each("/resume")
    finally:
        if own_client:
            await http.aclose()
    seconds = time.perf_counter() - started
    log.info("NCCL weight sync to version %s: %.3f s over %d engine(s)", version, seconds, len(engine_urls))
    return WeightSyncResult(version, seconds, {url: seconds for url in engine_urls})


async def sync_lora_adapter(
    engine_urls: Sequence[str],
    lora_name: str,
    adapter_dir: str | os.PathLike,
    version: str | int,
    *,
    load_inplace: bool = True,
    http: httpx.AsyncClient | None = None,
    timeout_s: float = ADMIN_TIMEOUT_S,
) -> WeightSyncResult:
    """LoRA: load (or, with ``load_inplace``, replace) the adapter saved in ``adapter_dir`` under
    ``lora_name``, and label the engines' weights ``version``.

    Engines must run with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (the
    launch plan sets both when the recipe has ``[model.lora]``); requests select the adapter with
    ``model = lora_name``. Replacing an adapter in place changes weights that in-flight requests
    use, so the engines are paused for it; a new name (``load_inplace=False``, the RL stage's
    versioned adapters) is loaded with no pause.
    """
    adapter_path = str(Path(adapter_dir).resolve())
    version = str(version)

    async def update(client: httpx.AsyncClient, url: str) -> None:
        await _post(
            client,
            url,
            "/v1/load_lora_adapter",
            {"lora_name": lora_name, "lora_path": adapter_path, "load_inplace": load_inplace},
        )
        await _post(client, url, "/update_weight_version", {"new_version": version})

    return await _for_each_engine(engine_urls, version, update, http, timeout_s, pause=load_inplace)


async def unload_lora_adapter(
    engine_urls: Sequence[str], lora_name: str, http: httpx.AsyncClient | None = None
) -> None:
    """``/v1/unload_lora_adapter`` on every engine. Clean-up, so best effort: an engine that died,
    or was restarted and only has the current adapter, is skipped with a warning."""

    async def one(client: httpx.AsyncClient, url: str) -> None:
        try:
            await _post(client, url, "/v1/unload_lora_adapter", {"lora_name": lora_name})
        except (httpx.HTTPError, WeightSyncError) as err:
            log.warning("unload of adapter %s on %s: %s", lora_name, url, err)

    async with httpx.AsyncClient(timeout=ADMIN_TIMEOUT_S) if http is None else _borrowed(http) as client:
        await asyncio.gather(*(one(client, u) for u in engine_urls))


async def unload_policy_adapters(engine_urls: Sequence[str]) -> list[str]:
    """Unload every policy adapter (``policy-v<N>``) the engines hold: an engine pool's engines
    still have the last adapter of the run before, under a name the next run will load again.
    Returns the names unloaded."""
    names: set[str] = set()
    async with httpx.AsyncClient(timeout=ADMIN_TIMEOUT_S) as client:
        for url in engine_urls:
            response = await client.get(f"{url}/v1/models")
            if response.status_code == 200:
                names |= {m["id"] for m in response.json().get("data", []) if adapter_version(m["id"]) is not None}
        for name in sorted(names):
            await unload_lora_adapter(engine_urls, name, http=client)
    return sorted(names)


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
    restarted meanwhile reads the newer weights (see ``skyrl_cli.engines.recovery``)."""
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
    if current.lora_name:  # a fresh engine has no adapter of that name: nothing to replace, no pause
        return await sync_lora_adapter(
            engine_urls, current.lora_name, current.path, current.version, load_inplace=False
        )
    return await sync_weights(engine_urls, current.path, current.version)


class EngineWeightLoader(Protocol):
    """The orchestrator's side of the weight sync, one class per transport (``backends.rollout.orchestrator.engine_weights``,
    chosen by the plan's ``weight_sync``; the learner's side is ``backends.train.publish``)."""

    loads_initial_version: bool  # True: v0 is loaded like every version; False: the engines started on it

    async def label_initial(self) -> None:
        """Label the engines' own weights version 0 (``loads_initial_version`` False)."""

    def model_name(self, version: int) -> str:
        """What a rollout request names to sample from ``version``."""

    async def load(self, version: int, weights_dir: str | os.PathLike) -> WeightSyncResult:
        """Every engine onto ``version`` (published in ``weights_dir``)."""

    async def retire(self, in_flight: Mapping[str, int]) -> list[int]:
        """Versions unloaded now that no request in flight names them."""

    def held(self) -> frozenset[int]:
        """Versions whose directories the engines may still read."""


class EngineWeights:
    """The orchestrator's view of the engines' weights: label the initial policy, load a published
    version. ``weights/current.json`` is recorded before each load, so an engine that the recovery
    loop restarts meanwhile loads the same version (``skyrl_cli.engines.recovery``)."""

    loads_initial_version = False  # v0 is the engines' own weights: labelled, not loaded

    def __init__(self, engine_urls: Sequence[str], run_dir: str | os.PathLike, *, reset_prefix_cache: bool = False):
        self.engine_urls = list(engine_urls)
        self.run_dir = run_dir
        self.reset_prefix_cache = reset_prefix_cache

    async def label_initial(self) -> None:
        await set_weight_version(self.engine_urls, "0")

    def model_name(self, version: int) -> str:
        """What a rollout request names to sample from ``version``: full weights have one name."""
        return SERVED_MODEL_NAME

    async def load(self, version: int, weights_dir: str | os.PathLike) -> WeightSyncResult:
        record_current_weights(self.run_dir, CurrentWeights(str(weights_dir), str(version)))
        return await sync_weights(self.engine_urls, weights_dir, version, reset_prefix_cache=self.reset_prefix_cache)

    async def retire(self, in_flight: Mapping[str, int]) -> list[int]:
        """Versions unloaded now: none, full weights keep no version beside the current one."""
        return []

    def held(self) -> frozenset[int]:
        """Versions whose directories the engines may still read: none once a reload is done."""
        return frozenset()


# ------------------------------------------------------------------------------ LoRA versions

ADAPTER_PREFIX = f"{SERVED_MODEL_NAME}-v"


def adapter_name(version: int) -> str:
    """The engines' name for policy version ``version`` as a LoRA adapter."""
    return f"{ADAPTER_PREFIX}{int(version)}"


def adapter_version(model: str) -> int | None:
    """The version an adapter name stands for (``policy-v7`` -> 7); None for any other model name."""
    if not model.startswith(ADAPTER_PREFIX):
        return None
    rest = model[len(ADAPTER_PREFIX) :]
    return int(rest) if rest.isdigit() else None


def retirable(loaded: Iterable[int], current: int | None, in_flight: Mapping[str, int]) -> list[int]:
    """Loaded versions that may be unloaded: not the current one, and no request in flight names them."""
    return sorted(v for v in loaded if v != current and in_flight.get(adapter_name(v), 0) <= 0)


class EngineAdapters:
    """``EngineWeights`` for LoRA: every version (v0 too, peft's zero-initialised adapter, equal to
    the base model) is an adapter loaded under ``adapter_name(version)`` with no pause; versions that
    no in-flight request names are unloaded by ``retire``. Within the staleness bound at most
    ``max_staleness + 2`` (async) or 2 (sync) are loaded at once, the ``--max-loras`` of the launch
    plan (past it a request would wait for an engine slot, not fail)."""

    loads_initial_version = True  # v0 is an adapter too: loaded like every other version

    def __init__(self, engine_urls: Sequence[str], run_dir: str | os.PathLike):
        self.engine_urls = list(engine_urls)
        self.run_dir = run_dir
        self.loaded: set[int] = set()
        self.current: int | None = None

    def model_name(self, version: int) -> str:
        return adapter_name(version)

    async def load(self, version: int, adapter_dir: str | os.PathLike) -> WeightSyncResult:
        name = adapter_name(version)
        record_current_weights(self.run_dir, CurrentWeights(str(adapter_dir), str(version), lora_name=name))
        result = await sync_lora_adapter(self.engine_urls, name, adapter_dir, version, load_inplace=False)
        self.loaded.add(version)
        self.current = version
        return result

    async def retire(self, in_flight: Mapping[str, int]) -> list[int]:
        """Unload every version but the current one that no request in flight names; returns them
        (their directories may go now, not before: an engine reads an adapter's files again when
        its LoRA cache evicted it)."""
        gone = retirable(self.loaded, self.current, in_flight)
        for version in gone:
            await unload_lora_adapter(self.engine_urls, adapter_name(version))
            self.loaded.discard(version)
        return gone

    def held(self) -> frozenset[int]:
        return frozenset(self.loaded)

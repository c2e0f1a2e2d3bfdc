"""GPU fast path of the weight sync: trainer rank 0 broadcasts its weights into every engine over
NCCL with vLLM's weight-transfer engine, instead of writing safetensors and having engines reload.

The group is the trainer's sender (rank 0) plus every engine worker: engine ``i`` with tensor
parallelism ``tp`` occupies ranks ``1 + i*tp .. (i+1)*tp``. Engines must have been started with
``--weight-transfer-config '{"backend": "nccl"}'`` (the launch plan does when it chose this path,
``skyrl_cli.plan.weight_sync``). Not available on CPU (vLLM's weight-transfer engines need CUDA).

Who does what. The learner's rank 0 is the sender, so it opens the group at start-up
(``open_weight_syncer``) and drives the data plane (``/start_weight_update``, ``/update_weights``
concurrently with its broadcast, ``/finish_weight_update``). The orchestrator keeps the control
plane it has on the disk path, so versions and pause/resume are identical on both paths
(``NcclEngineWeights``): for each version, through the run directory (``skyrl_contracts.exchange``)::

    learner                                   orchestrator
    weights/v<k>/transfer.json, LATEST = k -> sees k: /pause?mode=keep on every engine
                                           <- control/transfer-v<k>.ready
    broadcast (NCCL) + transfer routes
    control/transfer-v<k>.done             -> /update_weight_version k, /resume on every engine

In-flight requests freeze with their KV cache across the broadcast and continue under the new
weights, and every token records the version it was sampled with, as on the disk path. The
learner waits for the engines to be paused before it sends, and does not train on while it sends
(the broadcast reads the weights the next step would change).

Fallback: when the group cannot be set up (``open_weight_syncer``), the learner logs one line and
publishes every version as files; the orchestrator loads a version without ``transfer.json`` from
disk, so nothing else changes. A transfer that fails once the group is up fails the run, as an
engine that refuses a reload does on the disk path.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import httpx

from backends.inference.weight_sync import (
    ADMIN_TIMEOUT_S,
    EngineWeights,
    WeightSyncError,
    WeightSyncResult,
    sync_transferred,
)
from backends.models.tied import tied_head

log = logging.getLogger(__name__)


class _FanOutClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over HTTP, for several engines at once.

    Every call goes to all engines concurrently: the NCCL calls behind ``init_weight_transfer_engine``
    and ``update_weights`` only return once every rank has joined, so a sequential loop would
    deadlock.
    """

    def __init__(
        self,
        engine_urls: Sequence[str],
        tensor_parallel: int,
        timeout_s: float = 600.0,
        transport: httpx.BaseTransport | None = None,
    ):
        self.engine_urls = list(engine_urls)
        self.tensor_parallel = tensor_parallel
        self.http = httpx.Client(timeout=timeout_s, transport=transport)
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.engine_urls)))

    def _post_all(self, path: str, bodies: Sequence[dict[str, Any] | None]) -> None:
        def post(url: str, body: dict[str, Any] | None) -> None:
            response = self.http.post(f"{url}{path}", json=body)
            if response.status_code != 200:
                raise WeightSyncError(f"{url}{path}: HTTP {response.status_code}: {response.text[:500]}")

        futures = [self.pool.submit(post, u, b) for u, b in zip(self.engine_urls, bodies)]
        for future in futures:
            future.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        bodies = [
            {"init_info": {**init_info, "rank_offset": 1 + i * self.tensor_parallel}}
            for i in range(len(self.engine_urls))
        ]
        self._post_all("/init_weight_transfer_engine", bodies)

    def start_weight_update(self) -> None:
        self._post_all("/start_weight_update", [None] * len(self.engine_urls))

    def update_weights(self, update_info: Any) -> None:
        self._post_all("/update_weights", [{"update_info": update_info}] * len(self.engine_urls))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._post_all("/finish_weight_update", [body] * len(self.engine_urls))

    def pause(self) -> None:
        self._post_all("/pause?mode=keep", [None] * len(self.engine_urls))

    def resume(self) -> None:
        self._post_all("/resume", [None] * len(self.engine_urls))

    def set_version(self, version: str) -> None:
        self._post_all("/update_weight_version", [{"new_version": version}] * len(self.engine_urls))

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.http.close()


def engine_weight_source(module, module_source):
    """vLLM's ``ModuleSource`` over ``module``, plus the head of a tied model under its own name:
    the engines serve tied models untied (``backends.models.tied``), and ``named_parameters`` names
    a shared parameter once, as the embedding. ``module_source``: vLLM's class (imported by the caller)."""
    pair = tied_head(module)
    if pair is None:
        return module_source(module)

    class WithExplicitHead(module_source):
        def metadata(self):
            meta = super().metadata()
            embedding = next(m for m in meta if m.name == pair.embedding)
            return [*meta, type(embedding)(pair.head, embedding.dtype, embedding.shape)]

        def __iter__(self):
            for name, tensor in super().__iter__():
                yield name, tensor
                if name == pair.embedding:
                    embedding = tensor
            yield pair.head, embedding

    return WithExplicitHead(module)


class NcclWeightSync:
    """Broadcast a torch module's weights into the engines. Construct on trainer rank 0 only, with
    the module whose ``named_parameters`` carry HF names (unwrap DeepSpeed / peft first)."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        tensor_parallel: int,
        module,
        master_address: str,
        master_port: int,
        transport: httpx.BaseTransport | None = None,
    ):
        # lazy: vllm (imports torch); the orchestrator imports this module without it
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        self.client = _FanOutClient(engine_urls, tensor_parallel, transport=transport)
        init_info = NCCLTrainerInitInfo(
            master_address=master_address,
            master_port=master_port,
            world_size=1 + len(engine_urls) * tensor_parallel,
            rank=0,
        )
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
            init_info, client=self.client, source=engine_weight_source(module, ModuleSource)
        )

    def send(self) -> float:
        """The data plane alone (the engines already paused): broadcast, engines load; seconds."""
        started = time.perf_counter()
        self.engine.send_weights()
        return time.perf_counter() - started

    def sync(self, version: str | int) -> WeightSyncResult:
        """Standalone sync (checks and benchmarks, no orchestrator): pause, send, label, resume."""
        started = time.perf_counter()
        self.client.pause()
        try:
            self.engine.send_weights()
            self.client.set_version(str(version))
        finally:
            self.client.resume()
        seconds = time.perf_counter() - started
        log.info("NCCL weight sync to version %s: %.3f s", version, seconds)
        return WeightSyncResult(str(version), seconds, {u: seconds for u in self.client.engine_urls})

    def close(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            self.client.close()


def nccl_missing() -> str | None:
    """What this process lacks for the NCCL path, or None. Checked first because vLLM asks the
    engines to join the group before it opens the trainer's end: a trainer that fails only then
    leaves the engines waiting in the rendezvous until it times out."""
    # lazy: torch; the orchestrator imports this module without it
    import torch
    import torch.distributed as tdist

    if not torch.cuda.is_available():
        return "CUDA is not available to the trainer"
    if not tdist.is_nccl_available():
        return "this torch build has no NCCL"
    return None


def open_weight_syncer(
    device: str,
    engine_urls: Sequence[str],
    tensor_parallel: int,
    module,
    master_address: str,
    master_port: int,
    transport: httpx.BaseTransport | None = None,
) -> tuple[NcclWeightSync | None, str | None]:
    """(the NCCL syncer, None) on CUDA, or (None, why not): use the disk path."""
    if device != "cuda":
        return None, f"the trainer runs on {device}"
    missing = nccl_missing()
    if missing:  # found before any engine is asked to join a group that could not form
        return None, missing
    try:
        return NcclWeightSync(engine_urls, tensor_parallel, module, master_address, master_port, transport), None
    except Exception as err:  # noqa: BLE001 - any setup failure falls back to the disk path
        return None, f"{type(err).__name__}: {err}"


def make_weight_syncer(
    device: str,
    engine_urls: Sequence[str],
    tensor_parallel: int,
    module,
    master_address: str,
    master_port: int,
    transport: httpx.BaseTransport | None = None,
) -> NcclWeightSync | None:
    """``open_weight_syncer`` that says the fallback in one warning line (none on CPU, where the
    disk path is the only one)."""
    syncer, why = open_weight_syncer(
        device, engine_urls, tensor_parallel, module, master_address, master_port, transport
    )
    if syncer is None and device == "cuda":
        log.warning("NCCL weight transfer unavailable (%s); weights go through the disk path", why)
    return syncer


class NcclPublisher:
    """The learner's rank 0 side of a version that goes over NCCL (see the module docstring)."""

    def __init__(self, exchange, syncer: NcclWeightSync, timeout_s: float = 3600.0):
        self.exchange, self.syncer, self.timeout_s = exchange, syncer, timeout_s

    def publish(self, version: int) -> float:
        """Announce ``version``, wait for the engines to be paused, send; the send's seconds."""
        self.exchange.publish_transfer(version)
        self.exchange.wait_transfer_ready(version, self.timeout_s)
        try:
            seconds = self.syncer.send()
        except BaseException as err:
            self.exchange.finish_transfer(version, {"error": f"{type(err).__name__}: {err}"})
            raise
        self.exchange.finish_transfer(version, {"seconds": seconds})
        return seconds

    def close(self) -> None:
        self.syncer.close()


class NcclEngineWeights(EngineWeights):
    """``EngineWeights`` for the NCCL path: a version the learner announces as a transfer is
    received between pause and resume (the learner sends it), a version published as files (the
    initial or resumed one, or all of them after the learner fell back) is reloaded from disk.

    ``weights/current.json`` is only written for versions published as files. An engine that dies
    takes its ranks out of the NCCL group: the next transfer fails and so does the run (resume it
    with ``--resume``; recovery cannot bring a restarted engine back into the group)."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        run_dir: str | os.PathLike,
        exchange,
        *,
        reset_prefix_cache: bool = False,
        timeout_s: float = ADMIN_TIMEOUT_S,
        http: httpx.AsyncClient | None = None,
    ):
        super().__init__(engine_urls, run_dir, reset_prefix_cache=reset_prefix_cache)
        self.exchange, self.timeout_s, self.http = exchange, timeout_s, http
        self.last_transfer_s: float | None = None  # the learner's send time of the last NCCL version

    async def load(self, version: int, weights_dir) -> WeightSyncResult:
        if not self.exchange.is_transfer(version):
            self.last_transfer_s = None
            return await super().load(version, weights_dir)

        async def transfer() -> None:
            self.exchange.mark_transfer_ready(version)
            outcome = await asyncio.to_thread(self.exchange.wait_transfer_done, version, self.timeout_s)
            if "error" in outcome:
                raise WeightSyncError(
                    f"NCCL weight transfer of version {version} failed in the trainer: {outcome['error']}"
                )
            self.last_transfer_s = float(outcome["seconds"])

        return await sync_transferred(
            self.engine_urls,
            version,
            transfer,
            reset_prefix_cache=self.reset_prefix_cache,
            http=self.http,
            timeout_s=self.timeout_s,
        )

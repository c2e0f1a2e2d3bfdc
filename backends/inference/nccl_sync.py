"""GPU fast path of the weight sync: trainer rank 0 broadcasts its weights into every engine over
NCCL with vLLM's weight-transfer engine, instead of writing safetensors and having engines reload.

The group is the trainer's sender (rank 0) plus every engine worker: engine ``i`` with tensor
parallelism ``tp`` occupies ranks ``1 + i*tp .. (i+1)*tp``. Engines must have been started with
``--weight-transfer-config '{"backend": "nccl"}'`` (the launch plan does on GPUs). Each sync is the
same control sequence as the disk path: pause (keep) -> transfer -> version label -> resume, so
in-flight requests continue under the new weights and every token records the version it was
sampled with.

NOT REACHABLE YET: nothing calls this module; every RL run, on GPUs too, syncs weights through
the disk path (``backends.inference.weight_sync``: safetensors + engine reload). Wiring it into the
learner and the orchestrator (with the disk path as the fallback) is the GPU-path issue. Not
available on CPU either way (vLLM's weight-transfer engines need CUDA).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import httpx

from backends.inference.weight_sync import WeightSyncError, WeightSyncResult

log = logging.getLogger(__name__)


class _FanOutClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over HTTP, for several engines at once.

    Every call goes to all engines concurrently: the NCCL calls behind ``init_weight_transfer_engine``
    and ``update_weights`` only return once every rank has joined, so a sequential loop would
    deadlock.
    """

    def __init__(self, engine_urls: Sequence[str], tensor_parallel: int, timeout_s: float = 600.0):
        self.engine_urls = list(engine_urls)
        self.tensor_parallel = tensor_parallel
        self.http = httpx.Client(timeout=timeout_s)
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
    ):
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        self.client = _FanOutClient(engine_urls, tensor_parallel)
        init_info = NCCLTrainerInitInfo(
            master_address=master_address,
            master_port=master_port,
            world_size=1 + len(engine_urls) * tensor_parallel,
            rank=0,
        )
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
            init_info, client=self.client, source=ModuleSource(module)
        )

    def sync(self, version: str | int) -> WeightSyncResult:
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


def make_weight_syncer(device: str, engine_urls: Sequence[str], tensor_parallel: int, module, master_address: str, master_port: int):
    """The NCCL syncer on CUDA, or ``None`` (use the disk path) on CPU or when NCCL setup fails."""
    if device != "cuda":
        return None
    try:
        return NcclWeightSync(engine_urls, tensor_parallel, module, master_address, master_port)
    except Exception as err:  # noqa: BLE001 - any setup failure falls back to the disk path
        log.warning("NCCL weight transfer unavailable (%s); using the disk path", err)
        return None

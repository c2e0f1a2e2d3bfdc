"""An in-process Tinker server on the tiny model for the fuzz and isolation tests: the real
``TinkerService`` (LoRA engine on a 1-layer model), a stand-in sampler (no vLLM), FastAPI's
TestClient, and a ``World`` of objects (session, model, checkpoints, samplers, futures) per key.

The helpers of ``test_tinker_app`` (keys, protobuf bodies, ``wait``, ``new_model``) and the tiny
model of ``test_tinker_lora_engine`` are reused, not copied.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

from fastapi.testclient import TestClient

from backends.tinker.app import create_app
from backends.tinker.service import ServerConfig, TinkerService
from backends.tinker.wire import Sampled
from tests.unit.test_tinker_app import PROTO, A, B, fb_body, new_model, wait

C = {"X-API-Key": "tml-c"}  # the well-behaved client's key: nothing else uses it
KEYS = frozenset({"tml-a", "tml-b", "tml-c"})
LONG_POLL_S = 0.5
MAX_REQUEST_BYTES = 64 * 1024

__all__ = ["A", "B", "C", "PROTO", "World", "build_world", "fb_body", "new_model", "served", "wait"]


class FakeSampler:
    """Deterministic samples (each token the previous + 1), so that asample runs all the way."""

    def __init__(self) -> None:
        self.jobs = []

    async def sample(self, job):
        self.jobs.append(job)
        last = job.prompt[-1]
        sequences = [
            Sampled([(last + i + k + 1) % 40 for k in range(job.max_tokens)], [-1.0] * job.max_tokens, "length")
            for i in range(job.num_samples)
        ]
        prompt_logprobs = [None] + [-0.5] * (len(job.prompt) - 1) if job.prompt_logprobs else None
        return sequences, prompt_logprobs

    async def aclose(self) -> None:
        pass


class ErrorLog(logging.Handler):
    """Every ERROR the server logs (an unhandled exception in a route or a scheduler round)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()} {r.exc_info[1]!r}" if r.exc_info else r.getMessage() for r in self.records]


@contextlib.contextmanager
def served(tmp_path, model_dir, **overrides):
    """(TestClient, service, error log) of a server with the real engine and a fake sampler."""
    options = dict(
        base_model="tiny",
        model_dir=str(model_dir),
        storage_dir=str(tmp_path / "storage"),
        api_keys=KEYS,
        max_request_bytes=MAX_REQUEST_BYTES,
        max_sequence_tokens=64,
        max_live_adapters=8,
        max_lora_rank=16,
        long_poll_s=LONG_POLL_S,
        sample_url="http://sampler.invalid",  # never reached: the fake sampler is set first
        max_samples_per_request=8,
    )
    options.update(overrides)
    service = TinkerService(ServerConfig(**options))
    service.sampler = FakeSampler()
    errors = ErrorLog()
    logger = logging.getLogger("backends.tinker")
    logger.addHandler(errors)
    service.start()
    service.scheduler.ready.wait(120)
    try:
        with TestClient(create_app(service)) as http:
            yield http, service, errors
    finally:
        logger.removeHandler(errors)
        service.stop()


@dataclass
class World:
    """One key's objects, each made through the API."""

    headers: dict
    session_id: str
    model_id: str
    run_id: str
    weights_path: str  # tinker://run/weights/w1 (save_state)
    sampler_path: str  # tinker://run/sampler_weights/s1
    sampler_id: str  # a sampling session on sampler_path
    futures: dict[str, str] = field(default_factory=dict)  # kind -> a finished future's request_id

    @property
    def ids(self) -> dict[str, str]:
        return {
            "session": self.session_id,
            "model": self.model_id,
            "run": self.run_id,
            "sampler": self.sampler_id,
            "weights_path": self.weights_path,
            "sampler_path": self.sampler_path,
            **{f"future_{k}": v for k, v in self.futures.items()},
        }


def _future(http, headers, path, body):
    r = http.post(path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    rid = r.json()["request_id"]
    result = wait(http, rid, headers)
    assert "error" not in result, result
    return rid, result


def build_world(http, headers) -> World:
    model_id, session = new_model(http, headers)
    run_id = model_id.replace(":", "_")
    r = http.post("/api/v1/forward_backward", content=fb_body(model_id, seq_id=1), headers={**headers, **PROTO})
    assert r.status_code == 200, r.text
    fb_rid = r.json()["request_id"]
    opt_rid, _ = _future(
        http, headers, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
    )
    assert "loss_fn_outputs" in wait(http, fb_rid, headers)
    _, saved = _future(http, headers, "/api/v1/save_weights", {"model_id": model_id, "seq_id": 3, "path": "w1"})
    _, sampler_saved = _future(
        http, headers, "/api/v1/save_weights_for_sampler", {"model_id": model_id, "seq_id": 4, "path": "s1"}
    )
    r = http.post(
        "/api/v1/create_sampling_session",
        json={"session_id": session, "sampling_session_seq_id": 0, "model_path": sampler_saved["path"]},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    sampler_id = r.json()["sampling_session_id"]
    sample_rid, _ = _future(
        http,
        headers,
        "/api/v1/asample",
        {
            "sampling_session_id": sampler_id,
            "seq_id": 0,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 3},
        },
    )
    return World(
        headers,
        session,
        model_id,
        run_id,
        saved["path"],
        sampler_saved["path"],
        sampler_id,
        {"forward_backward": fb_rid, "optim_step": opt_rid, "sample": sample_rid},
    )

"""The API's checks through FastAPI's TestClient: auth, isolation, malformed and oversized bodies
get a 4xx naming the problem, refused features are named. The trainer is a stand-in (nothing here
reaches a model)."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
tinker = pytest.importorskip("tinker")
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from backends.tinker.app import create_app
from backends.tinker.service import ServerConfig, TinkerService

A = {"X-API-Key": "tml-a"}
B = {"X-API-Key": "tml-b"}
PROTO = {"Content-Type": "application/x-protobuf"}


class FakeEngine:
    vocab_size = 100

    def __init__(self):
        self.adapters = {}

    def create_adapter(self, model_id, rank, modules, seed=None):
        self.adapters[model_id] = (rank, tuple(modules))

    def optim_step(self, model_id, *args):
        return {"grad_norm:mean": 0.0}

    def drop_adapter(self, model_id):
        self.adapters.pop(model_id, None)

    def save(self, model_id, out_dir, with_optimizer):
        out_dir.mkdir(parents=True, exist_ok=True)  # like LoraEngine.save: the directory may exist
        (out_dir / "adapter_model.safetensors").write_bytes(b"not really")
        return out_dir


@pytest.fixture
def client(tmp_path):
    config = ServerConfig(
        base_model="tiny",
        model_dir=str(tmp_path / "model"),
        storage_dir=str(tmp_path / "st"),
        api_keys=frozenset({"tml-a", "tml-b"}),
        max_request_bytes=4096,
        max_sequence_tokens=64,
        max_live_adapters=2,
        max_lora_rank=16,
        long_poll_s=2.0,
    )
    service = TinkerService(config, engine_factory=FakeEngine)
    service.start()
    service.scheduler.ready.wait(10)
    with TestClient(create_app(service)) as http:
        yield http
    service.stop()


def wait(http, rid, headers=A):
    for _ in range(50):
        body = http.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=headers).json()
        if body.get("type") != "try_again":
            return body
    raise AssertionError("future never finished")


def new_model(http, headers=A, rank=8):
    session = http.post("/api/v1/create_session", json={"sdk_version": "0.38.0"}, headers=headers).json()["session_id"]
    r = http.post(
        "/api/v1/create_model",
        headers=headers,
        json={"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": rank}},
    )
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["request_id"], str)
    assert wait(http, r.json()["request_id"], headers) == {"model_id": f"{session}:train:0", "type": "create_model"}
    return f"{session}:train:0", session


def fb_body(model_id, seq_id=1, tokens=(1, 2, 3), loss_fn="cross_entropy", inputs=None):
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens)), loss_fn_inputs=inputs or {"target_tokens": list(tokens)}
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def test_handshake_and_auth(client):
    assert client.get("/api/v1/healthz").json() == {"status": "ok"}
    assert client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}).status_code == 401
    assert (
        client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers={"X-API-Key": "tml-c"}).status_code
        == 401
    )
    config = client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers=A)
    assert config.status_code == 200 and config.json()["pjwt_auth_enabled"] is False
    old = client.post("/api/v1/client/config", json={"sdk_version": "0.24.1"}, headers=A)
    assert old.status_code == 400 and "tinker>=0.38,<0.39" in old.json()["detail"]
    session = client.post("/api/v1/create_session", json={"sdk_version": "0.38.0"}, headers=A).json()
    assert "sampling is refused" in session["warning_message"]
    sid = session["session_id"]
    assert client.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=A).json() == {
        "type": "session_heartbeat"
    }
    assert client.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=B).status_code == 404
    assert client.post("/api/v1/telemetry", json={"events": []}, headers=A).json() == {"status": "accepted"}
    assert (
        client.post(f"/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"}}, headers=A).status_code
        == 200
    )
    caps = client.get("/api/v1/get_server_capabilities", headers=A).json()
    assert caps["supported_models"][0]["model_name"] == "tiny"


def test_models_are_private_to_their_key(client):
    model_id, session = new_model(client)
    info = client.post("/api/v1/get_info", json={"model_id": model_id}, headers=A).json()
    assert info["model_data"]["model_name"] == "tiny" and info["lora_rank"] == 8 and info["model_data"]["tokenizer_id"]
    assert client.post("/api/v1/get_info", json={"model_id": model_id}, headers=B).status_code == 404
    r = client.post("/api/v1/forward_backward", content=fb_body(model_id), headers={**B, **PROTO})
    assert r.status_code == 404
    r = client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}}, headers=B)
    assert r.status_code == 404
    r = client.post(
        "/api/v1/create_model",
        headers=B,
        json={"session_id": session, "model_seq_id": 1, "base_model": "tiny", "lora_config": {"rank": 8}},
    )
    assert r.status_code == 404
    # futures too
    rid = client.post(
        "/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}}, headers=A
    ).json()["request_id"]
    assert client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=B).status_code == 404
    assert "metrics" in wait(client, rid)
    assert client.get(f"/api/v1/sessions/{session}", headers=A).json()["training_run_ids"] == [
        model_id.replace(":", "_")
    ]
    assert client.get(f"/api/v1/sessions/{session}", headers=B).status_code == 404
    assert client.get("/api/v1/training_runs", headers=B).json()["training_runs"] == []
    assert len(client.get("/api/v1/training_runs", headers=A).json()["training_runs"]) == 1


def test_seq_id_dedup_returns_the_same_future(client):
    model_id, _ = new_model(client)
    body = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    first = client.post("/api/v1/optim_step", json=body, headers=A).json()["request_id"]
    again = client.post("/api/v1/optim_step", json=body, headers=A).json()["request_id"]
    assert first == again
    assert wait(client, first) == wait(client, again)


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/api/v1/create_model", "not json", 400, "not valid JSON"),
        ("/api/v1/create_model", [1, 2], 400, "JSON object"),
        ("/api/v1/create_model", {"session_id": "x"}, 400, "model_seq_id"),
        ("/api/v1/optim_step", {"model_id": "nope", "seq_id": 0, "adam_params": {}}, 400, "seq_id"),
        (
            "/api/v1/optim_step",
            {"model_id": "nope", "seq_id": 1, "adam_params": {"learning_rate": -1}},
            400,
            "learning_rate",
        ),
        ("/api/v1/optim_step", {"model_id": "nope", "seq_id": 1, "adam_params": {}}, 404, "not found"),
        ("/api/v1/retrieve_future", {"request_id": "abc"}, 400, "malformed request_id"),
        ("/api/v1/retrieve_future", {"request_id": "999999"}, 404, "not found"),
        ("/api/v1/load_weights", {"path": "tinker://a/b", "optimizer": False}, 400, "three segments"),
        ("/api/v1/load_weights", {"path": "tinker://a/weights/../x", "optimizer": False}, 400, "three segments"),
        ("/api/v1/load_weights", {"path": "tinker://r/weights/x", "optimizer": False}, 404, "not found"),
        ("/api/v1/create_sampling_session", {"session_id": "s", "base_model": "tiny"}, 404, "session s not found"),
        (
            "/api/v1/asample",
            {"prompt": {"chunks": []}, "sampling_params": {}, "base_model": "tiny"},
            400,
            "without inference engines",
        ),
        ("/api/v1/save_weights_external", {}, 400, "not supported"),
        ("/api/v1/forward", {}, 400, "forward_only"),
        ("/api/v1/copy_weights", {}, 400, "copy_weights is not supported"),
        ("/api/v1/create_custom_loss", {}, 400, "custom losses"),
    ],
)
def test_malformed_and_refused_requests(client, path, body, status, message):
    content = body if isinstance(body, str) else json.dumps(body)
    r = client.post(path, content=content, headers={**A, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert message in r.json()["detail"]


def test_create_model_refusals(client):
    session = client.post("/api/v1/create_session", json={}, headers=A).json()["session_id"]

    def create(**kw):
        body = {"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 8}, **kw}
        return client.post("/api/v1/create_model", json=body, headers=A)

    assert "not served here" in create(base_model="other/model").json()["detail"]
    assert "LoRA adapters only" in create(lora_config=None).json()["detail"]
    assert "above this server's maximum 16" in create(lora_config={"rank": 64}).json()["detail"]
    assert (
        "trains nothing"
        in create(lora_config={"rank": 8, "train_attn": False, "train_mlp": False, "train_unembed": False}).json()[
            "detail"
        ]
    )
    assert "adamw only" in create(optimizer_config={"type": "dimuon"}).json()["detail"]
    assert create().status_code == 200
    assert create(model_seq_id=1).status_code == 200
    full = create(model_seq_id=2)
    assert full.status_code == 400 and "adapter slots" in full.json()["detail"]


def test_forward_backward_checks(client):
    model_id, _ = new_model(client)
    r = client.post("/api/v1/forward_backward", json={"model_id": model_id}, headers=A)
    assert r.status_code == 415 and "x-protobuf" in r.json()["detail"]
    r = client.post("/api/v1/forward_backward", content=b"\xff\xfe garbage", headers={**A, **PROTO})
    assert r.status_code == 400
    r = client.post(
        "/api/v1/forward_backward", content=fb_body(model_id, loss_fn="stable_reinforce"), headers={**A, **PROTO}
    )
    assert r.status_code == 400 and "'stable_reinforce' is not supported" in r.json()["detail"]
    r = client.post("/api/v1/forward_backward", content=fb_body(model_id, tokens=(1, 2, 500)), headers={**A, **PROTO})
    assert r.status_code == 400 and "token ids" in r.json()["detail"]
    r = client.post(
        "/api/v1/forward_backward",
        content=fb_body(model_id, inputs={"target_tokens": [1, 2, 3], "logprobs": [0.0] * 3}),
        headers={**A, **PROTO},
    )
    assert r.status_code == 400 and "not used by 'cross_entropy'" in r.json()["detail"]
    big = fb_body(model_id, tokens=tuple(range(60)))
    r = client.post("/api/v1/forward_backward", content=big * 10, headers={**A, **PROTO})
    assert r.status_code == 413
    r = client.post("/api/v1/forward_backward", content=b"x", headers={**A, **PROTO, "Content-Encoding": "br"})
    assert r.status_code == 415


def test_retrieve_future_long_polls_then_says_try_again(client):
    model_id, _ = new_model(client)
    # seq 5 waits for seqs 1..4 (GAP_WAIT_S): the poll answers try_again after long_poll_s
    rid = client.post(
        "/api/v1/optim_step", json={"model_id": model_id, "seq_id": 5, "adam_params": {}}, headers=A
    ).json()["request_id"]
    started = time.monotonic()
    body = client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=A).json()
    assert body == {"type": "try_again", "request_id": rid, "queue_state": "active"}
    assert 1.5 < time.monotonic() - started < 10
    assert "metrics" in wait(client, rid)  # after the gap wait it runs anyway


def test_checkpoint_routes(client):
    model_id, _ = new_model(client)
    run_id = model_id.replace(":", "_")
    rid = client.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "c1"}, headers=A).json()[
        "request_id"
    ]
    assert wait(client, rid) == {"path": f"tinker://{run_id}/weights/c1", "type": "save_weights"}
    rid = client.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 2, "path": "c1"}, headers=A).json()[
        "request_id"
    ]
    assert "exists" in wait(client, rid)["error"]
    bad = client.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 3, "path": "../x"}, headers=A)
    assert bad.status_code == 400 and "checkpoint name" in bad.json()["detail"]
    listed = client.get(f"/api/v1/training_runs/{run_id}/checkpoints", headers=A).json()["checkpoints"]
    assert [c["tinker_path"] for c in listed] == [f"tinker://{run_id}/weights/c1"]
    run = client.get(f"/api/v1/training_runs/{run_id}", headers=A).json()
    assert run["last_checkpoint"]["checkpoint_id"] == "weights/c1" and run["lora_rank"] == 8
    info = client.post("/api/v1/weights_info", json={"tinker_path": f"tinker://{run_id}/weights/c1"}, headers=A).json()
    assert info["lora_rank"] == 8
    assert client.delete(f"/api/v1/training_runs/{run_id}/checkpoints/weights/c1", headers=B).status_code == 404
    assert client.delete(f"/api/v1/training_runs/{run_id}/checkpoints/weights/c1", headers=A).status_code == 200
    assert client.get(f"/api/v1/training_runs/{run_id}/checkpoints", headers=A).json()["checkpoints"] == []
    r = client.post(
        "/api/v1/load_weights",
        json={"path": f"tinker://{run_id}/weights/c1", "optimizer": True, "model_id": model_id, "seq_id": 4},
        headers=A,
    )
    assert r.status_code == 404


def test_a_session_without_heartbeats_ends_and_frees_its_adapters(tmp_path):
    config = ServerConfig(
        base_model="tiny",
        model_dir=str(tmp_path / "model"),
        storage_dir=str(tmp_path / "st"),
        api_keys=frozenset({"tml-a"}),
        session_timeout_s=0.4,
    )
    service = TinkerService(config, engine_factory=FakeEngine)
    service.start()
    service.scheduler.ready.wait(10)
    try:
        with TestClient(create_app(service)) as http:
            model_id, session = new_model(http)
            assert model_id in service.scheduler.engine.adapters
            deadline = time.monotonic() + 10
            while service.store.model(model_id)["state"] != "unloaded" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert service.store.model(model_id)["state"] == "unloaded"
            assert model_id not in service.scheduler.engine.adapters
            assert service.store.session(session)["finished"] == 1
            r = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}}, headers=A)
            assert r.status_code == 400 and "heartbeat" in r.json()["detail"]
    finally:
        service.stop()


def test_decoding_a_body_does_not_stall_other_clients(client, monkeypatch):
    """A forward_backward body is decoded in a worker thread: while a slow decode runs (a big zstd
    body takes most of a second), another client's request is answered at once."""
    import threading

    from backends.tinker import routes_training

    model_id, _ = new_model(client)
    decode = routes_training.decode_forward_backward

    def slow_decode(*args, **kwargs):
        time.sleep(1.5)
        return decode(*args, **kwargs)

    monkeypatch.setattr(routes_training, "decode_forward_backward", slow_decode)
    slow = threading.Thread(
        target=client.post,
        args=("/api/v1/forward_backward",),
        kwargs={"content": fb_body(model_id), "headers": {**A, **PROTO}},
    )
    slow.start()
    time.sleep(0.3)  # the slow request is decoding by now
    started = time.monotonic()
    r = client.post("/api/v1/create_session", json={"sdk_version": "0.38.0"}, headers=B)
    answered_in = time.monotonic() - started
    slow.join()
    assert r.status_code == 200 and answered_in < 0.6, answered_in


def test_the_scheduler_and_the_long_polls_keep_nothing_of_finished_work(client):
    """A server runs for weeks: an unloaded model leaves no place in the scheduler's order, and a
    long-poll that finds its future finished on its second look leaves no wake-up event behind."""
    import asyncio
    import dataclasses

    from backends.tinker.routes_futures import _wait_for
    from backends.tinker.store import PENDING

    service = client.app.state.api.service
    model_id, _ = new_model(client)
    for seq in (1, 2):
        rid = client.post(
            "/api/v1/optim_step", json={"model_id": model_id, "seq_id": seq, "adam_params": {}}, headers=A
        ).json()["request_id"]
        wait(client, rid)
    assert service.scheduler.last_seq[model_id] == 2
    wait(client, client.post("/api/v1/unload_model", json={"model_id": model_id}, headers=A).json()["request_id"])
    assert model_id not in service.scheduler.last_seq

    seen_pending = dataclasses.replace(service.store.future(int(rid)), status=PENDING)  # as a poll saw it first
    assert asyncio.run(_wait_for(client.app.state.api, int(rid), seen_pending)).status != PENDING
    assert int(rid) not in service.notifier.events

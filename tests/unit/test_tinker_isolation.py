"""Isolation between API keys, as a matrix over every route the app serves.

For each route that takes an id (session, model, sampler, future, checkpoint path, training run),
key B's request carrying key A's id is answered exactly as the same request carrying a random id
of the same shape: same status, same body keys, same message once the id is masked. Listing
routes never show another key's objects. Checkpoint paths never reach outside the storage
directory (``..``, absolute paths, URL-encoded forms, symlinks).

``CASES`` maps every route of ``app.routes`` to its case; a new route without one fails
``test_every_route_has_a_case``.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("tinker")

from fastapi.routing import APIRoute

from tests.unit.test_tinker_lora_engine import model_dir  # noqa: F401 - the tiny model fixture
from tests.unit.tinker_served import PROTO, A, B, World, build_world, fb_body, served

ALL = ("GET", "POST", "PUT", "DELETE")


@dataclass
class Req:
    method: str
    url: str
    json: dict | None = None
    content: bytes | None = None
    proto: bool = False


class Ids:
    """A world's ids, or random ids of the same shape (what "an id that does not exist" is)."""

    def __init__(self, world: World | None):
        if world is None:
            session = uuid.uuid4().hex[:20]
            model = f"{session}:train:0"
            run = model.replace(":", "_")
            self.session, self.model, self.run, self.sampler = session, model, run, f"{session}:sample:0"
            self.weights_path = f"tinker://{run}/weights/w1"
            self.sampler_path = f"tinker://{run}/sampler_weights/s1"
            self.futures = {k: str(10**9 + i) for i, k in enumerate(("forward_backward", "optim_step", "sample"))}
        else:
            self.session, self.model, self.run, self.sampler = (
                world.session_id,
                world.model_id,
                world.run_id,
                world.sampler_id,
            )
            self.weights_path, self.sampler_path, self.futures = world.weights_path, world.sampler_path, world.futures

    def all(self) -> list[str]:
        return [
            self.weights_path,
            self.sampler_path,
            self.model,
            self.sampler,
            self.run,
            self.session,
            *self.futures.values(),
        ]


# ------------------------------------------------------------------------------------ cases
# A case takes (ids: the foreign or random ids, own: B's own World) and returns the requests to
# send with key B; it runs twice, once with A's ids and once with random ones.

PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
SAMPLING = {"max_tokens": 2}


def _no_id(reason: str):
    return ("no id", reason)


def _listing(url: str):
    return ("listing", url)


CASES: dict[str, object] = {
    "/api/v1/healthz": _no_id("health, no auth"),
    "/api/v1/client/config": _no_id("handshake"),
    "/api/v1/client/dynamic_config": _no_id("handshake"),
    "/api/v1/get_server_capabilities": _no_id("server-wide"),
    "/api/v1/create_session": _no_id("creates a new id"),
    "/api/v1/auth/token": _no_id("refused feature, takes no id"),
    "/api/v1/create_custom_loss": _no_id("refused feature, takes no id"),
    "/api/v1/sessions": _listing("/api/v1/sessions"),
    "/api/v1/training_runs": _listing("/api/v1/training_runs"),
    "/api/v1/checkpoints": _listing("/api/v1/checkpoints"),
    "/api/v1/telemetry": lambda ids, own: [Req("POST", "/api/v1/telemetry", {"events": [], "session_id": ids.session})],
    "/api/v1/session_heartbeat": lambda ids, own: [
        Req("POST", "/api/v1/session_heartbeat", {"session_id": ids.session})
    ],
    "/api/v1/sessions/{session_id}/finish": lambda ids, own: [
        Req("POST", f"/api/v1/sessions/{ids.session}/finish", {"reason": {"type": "success"}})
    ],
    "/api/v1/sessions/{session_id}": lambda ids, own: [Req("GET", f"/api/v1/sessions/{ids.session}")],
    "/api/v1/create_model": lambda ids, own: [
        Req(
            "POST",
            "/api/v1/create_model",
            {"session_id": ids.session, "model_seq_id": 5, "base_model": "tiny", "lora_config": {"rank": 4}},
        )
    ],
    "/api/v1/get_info": lambda ids, own: [Req("POST", "/api/v1/get_info", {"model_id": ids.model})],
    "/api/v1/forward_backward": lambda ids, own: [
        Req("POST", "/api/v1/forward_backward", content=fb_body(ids.model, seq_id=100), proto=True)
    ],
    "/api/v1/optim_step": lambda ids, own: [
        Req("POST", "/api/v1/optim_step", {"model_id": ids.model, "seq_id": 100, "adam_params": {}})
    ],
    "/api/v1/save_weights": lambda ids, own: [
        Req("POST", "/api/v1/save_weights", {"model_id": ids.model, "seq_id": 100, "path": "x"})
    ],
    "/api/v1/save_weights_for_sampler": lambda ids, own: [
        Req("POST", "/api/v1/save_weights_for_sampler", {"model_id": ids.model, "seq_id": 100, "path": "x"}),
        Req(
            "POST",
            "/api/v1/save_weights_for_sampler",
            {"model_id": ids.model, "seq_id": 101, "sampling_session_seq_id": 7},
        ),
    ],
    "/api/v1/load_weights": lambda ids, own: [
        # one foreign id at a time, the rest B's own
        Req("POST", "/api/v1/load_weights", {"model_id": ids.model, "seq_id": 100, "path": own.weights_path}),
        Req("POST", "/api/v1/load_weights", {"model_id": own.model_id, "seq_id": 100, "path": ids.weights_path}),
        Req("POST", "/api/v1/load_weights", {"session_id": ids.session, "model_seq_id": 9, "path": own.weights_path}),
        Req(
            "POST", "/api/v1/load_weights", {"session_id": own.session_id, "model_seq_id": 9, "path": ids.weights_path}
        ),
        Req(
            "POST",
            "/api/v1/load_weights",
            {"session_id": own.session_id, "model_seq_id": 9, "path": ids.sampler_path, "optimizer": False},
        ),
    ],
    "/api/v1/unload_model": lambda ids, own: [Req("POST", "/api/v1/unload_model", {"model_id": ids.model})],
    "/api/v1/forward": lambda ids, own: [Req("POST", "/api/v1/forward", {"model_id": ids.model})],
    "/api/v1/save_weights_external": lambda ids, own: [
        Req("POST", "/api/v1/save_weights_external", {"model_id": ids.model, "path": "x", "seq_id": 100})
    ],
    "/api/v1/copy_weights": lambda ids, own: [
        Req(m, "/api/v1/copy_weights", {"source_path": ids.weights_path}) for m in ALL
    ],
    "/api/v1/retrieve_futures": lambda ids, own: [
        Req(m, "/api/v1/retrieve_futures", {"session_id": ids.session}) for m in ALL
    ],
    "/api/v1/join_sampling_session": lambda ids, own: [
        Req(m, "/api/v1/join_sampling_session", {"sampling_session_id": ids.sampler}) for m in ALL
    ],
    "/api/v1/cancel_future": lambda ids, own: [
        Req(m, "/api/v1/cancel_future", {"request_id": ids.futures["optim_step"]}) for m in ALL
    ],
    "/api/v1/training_runs/{run_id}/publish": lambda ids, own: [
        Req(m, f"/api/v1/training_runs/{ids.run}/publish") for m in ALL
    ],
    "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish": lambda ids, own: [
        Req(m, f"/api/v1/training_runs/{ids.run}/checkpoints/weights/w1/publish") for m in ALL
    ],
    "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl": lambda ids, own: [
        Req(m, f"/api/v1/training_runs/{ids.run}/checkpoints/weights/w1/ttl") for m in ALL
    ],
    "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls": lambda ids, own: [
        Req(m, f"/api/v1/training_runs/{ids.run}/checkpoints/sampler_weights/s1/external_weights_urls") for m in ALL
    ],
    "/api/v1/create_sampling_session": lambda ids, own: [
        Req("POST", "/api/v1/create_sampling_session", {"session_id": ids.session, "base_model": "tiny"}),
        Req(
            "POST",
            "/api/v1/create_sampling_session",
            {"session_id": own.session_id, "sampling_session_seq_id": 3, "model_path": ids.sampler_path},
        ),
    ],
    "/api/v1/samplers/{sampler_id}": lambda ids, own: [Req("GET", f"/api/v1/samplers/{ids.sampler}")],
    "/api/v1/asample": lambda ids, own: [
        Req(
            "POST",
            "/api/v1/asample",
            {"sampling_session_id": ids.sampler, "seq_id": 50, "prompt": PROMPT, "sampling_params": SAMPLING},
        ),
        Req("POST", "/api/v1/asample", {"model_path": ids.sampler_path, "prompt": PROMPT, "sampling_params": SAMPLING}),
        Req("POST", "/api/v1/asample", {"model_path": ids.weights_path, "prompt": PROMPT, "sampling_params": SAMPLING}),
    ],
    "/api/v1/retrieve_future": lambda ids, own: [
        Req("POST", "/api/v1/retrieve_future", {"request_id": rid, "allow_metadata_only": True})
        for rid in ids.futures.values()
    ],
    "/api/v1/training_runs/{run_id}": lambda ids, own: [Req("GET", f"/api/v1/training_runs/{ids.run}")],
    "/api/v1/training_runs/{run_id}/checkpoints": lambda ids, own: [
        Req("GET", f"/api/v1/training_runs/{ids.run}/checkpoints")
    ],
    "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}": lambda ids, own: [
        Req("DELETE", f"/api/v1/training_runs/{ids.run}/checkpoints/weights/w1"),
        Req("DELETE", f"/api/v1/training_runs/{ids.run}/checkpoints/sampler_weights/s1"),
    ],
    "/api/v1/weights_info": lambda ids, own: [
        Req("POST", "/api/v1/weights_info", {"tinker_path": ids.weights_path}),
        Req("POST", "/api/v1/weights_info", {"tinker_path": ids.sampler_path}),
    ],
}


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, model_dir):  # noqa: F811 - the imported fixture
    with served(tmp_path_factory.mktemp("iso"), model_dir) as (http, service, errors):
        yield http, service, build_world(http, A), build_world(http, B), errors


def app_routes(http) -> dict[str, set[str]]:
    return {r.path: set(r.methods) for r in http.app.routes if isinstance(r, APIRoute)}


def send(http, req: Req, headers=B):
    extra = dict(PROTO) if req.proto else {}
    if req.json is not None:
        return http.request(req.method, req.url, json=req.json, headers={**headers, **extra})
    return http.request(req.method, req.url, content=req.content, headers={**headers, **extra})


def shape(response, ids: list[str]) -> tuple:
    """(status, body keys, message with every id masked): what may not differ between a foreign
    and an absent id."""
    try:
        body = response.json()
    except ValueError:
        return response.status_code, None, response.text
    if not isinstance(body, dict):
        return response.status_code, type(body).__name__, body
    text = str(body.get("detail", body))
    for value in sorted(ids, key=len, reverse=True):  # a path holds its run id: the longer first
        text = re.sub(rf"(?<![\w:]){re.escape(value)}(?![\w:])", "<ID>", text)
    return response.status_code, sorted(body), text


# ------------------------------------------------------------------------------------- tests


def test_every_route_has_a_case(worlds):
    http = worlds[0]
    routes = app_routes(http)
    assert set(routes) == set(CASES), (
        f"routes without a case: {sorted(set(routes) - set(CASES))}; cases of no route: {sorted(set(CASES) - set(routes))}"
    )
    own = worlds[3]
    for path, case in CASES.items():
        if isinstance(case, tuple):
            continue
        methods = {r.method for r in case(Ids(None), own)}
        assert methods == routes[path], (
            f"{path}: the case covers {sorted(methods)}, the route serves {sorted(routes[path])}"
        )


@pytest.mark.parametrize("path", [p for p, c in CASES.items() if callable(c)])
def test_a_foreign_id_is_answered_as_an_absent_one(worlds, path):
    http, _, world_a, world_b, _ = worlds
    foreign, absent = Ids(world_a), Ids(None)
    masked = foreign.all() + absent.all()
    for theirs, random in zip(CASES[path](foreign, world_b), CASES[path](absent, world_b), strict=True):
        got, expected = send(http, theirs), send(http, random)
        assert shape(got, masked) == shape(expected, masked), (theirs, got.text, expected.text)
        assert got.status_code != 200 or path in ("/api/v1/telemetry",), (theirs, got.text)


def test_listings_show_only_the_callers_objects(worlds):
    http, _, world_a, world_b, _ = worlds
    listings = {path: case[1] for path, case in CASES.items() if isinstance(case, tuple) and case[0] == "listing"}
    for url in listings.values():
        mine, theirs = http.get(url, headers=A), http.get(url, headers=B)
        assert mine.status_code == theirs.status_code == 200
        for owner, other, text in ((world_a, world_b, mine.text), (world_b, world_a, theirs.text)):
            shown = [i for i in (other.session_id, other.run_id, other.weights_path, other.sampler_path) if i in text]
            assert not shown, f"{url} shows another key's {shown}"
        own_ids = {"/api/v1/sessions": world_a.session_id}.get(url, world_a.run_id)
        assert own_ids in mine.text, (url, mine.text)  # the listing is not just empty


def test_foreign_requests_left_the_owners_objects_alone(worlds):
    """Run last in this module (pytest keeps file order): nothing B sent changed A's objects."""
    http, service, world_a, _, errors = worlds
    assert service.store.session(world_a.session_id)["finished"] == 0
    assert service.store.model(world_a.model_id)["state"] == "live"
    listed = {c["tinker_path"] for c in http.get("/api/v1/checkpoints", headers=A).json()["checkpoints"]}
    assert {world_a.weights_path, world_a.sampler_path} <= listed
    assert http.get(f"/api/v1/samplers/{world_a.sampler_id}", headers=A).status_code == 200
    assert not errors.messages()


# ------------------------------------------------------------------------ checkpoint escapes

ESCAPES = [
    "tinker://../weights/w1",
    "tinker://{run}/weights/..",
    "tinker://{run}/weights/../../../etc",
    "tinker://{run}/../weights/w1",
    "tinker://{run}/weights/%2e%2e",
    "tinker://{run}%2F..%2F..%2Fetc/weights/w1",
    "tinker:///etc/weights/passwd",
    "tinker://{run}/weights//etc/passwd",
    "tinker://{run}/weights/w1/../../s1",
    "/etc/passwd",
    "{storage}/checkpoints/{run}/weights/w1",
    "file://{storage}/checkpoints/{run}/weights/w1",
    "tinker://{run}/weights/w1\x00",
    "tinker://{run}/weights/.w1",
    "tinker://{run}/weights/-w1",
    "tinker://{run}/weights/w1 ",
    "tinker://{run}/Weights/w1",
]


def _escape_requests(path: str, world: World) -> list[Req]:
    return [
        Req("POST", "/api/v1/load_weights", {"session_id": world.session_id, "model_seq_id": 20, "path": path}),
        Req("POST", "/api/v1/load_weights", {"model_id": world.model_id, "seq_id": 200, "path": path}),
        Req("POST", "/api/v1/weights_info", {"tinker_path": path}),
        Req(
            "POST",
            "/api/v1/create_sampling_session",
            {"session_id": world.session_id, "sampling_session_seq_id": 20, "model_path": path},
        ),
        Req("POST", "/api/v1/asample", {"model_path": path, "prompt": PROMPT, "sampling_params": SAMPLING}),
    ]


@pytest.mark.parametrize("template", ESCAPES)
def test_checkpoint_paths_cannot_leave_the_storage_directory(worlds, template):
    http, service, world_a, _, _ = worlds
    path = template.format(run=world_a.run_id, storage=service.storage)
    for req in _escape_requests(path, world_a):
        r = send(http, req, headers=A)
        assert r.status_code in (400, 404), (req, r.status_code, r.text)
        assert isinstance(r.json()["detail"], str) and r.json()["detail"]


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/training_runs/%2E%2E/checkpoints/weights/w1",
        "/api/v1/training_runs/{run}/checkpoints/weights/%2E%2E",
        "/api/v1/training_runs/{run}/checkpoints/..%2F..%2F..%2Fetc/w1",
        "/api/v1/training_runs/{run}/checkpoints/weights/..%2Fs1",
        "/api/v1/training_runs/{run}/checkpoints/weights/%252e%252e",
        "/api/v1/training_runs/..%2F{run}/checkpoints/weights/w1",
    ],
)
def test_delete_cannot_reach_outside_a_checkpoint(worlds, url):
    http, service, world_a, _, _ = worlds
    before = sorted(p.relative_to(service.storage) for p in service.storage.rglob("*"))
    r = http.delete(url.format(run=world_a.run_id), headers=A)
    assert r.status_code in (400, 404, 405), (url, r.status_code, r.text)
    assert sorted(p.relative_to(service.storage) for p in service.storage.rglob("*")) == before


def test_a_checkpoint_symlinked_out_of_storage_is_refused(tmp_path, model_dir):  # noqa: F811
    """A checkpoint directory replaced by a symlink to somewhere else (storage copied around, or
    tampered with) is neither loaded from nor deleted through."""
    outside = tmp_path / "outside"
    with served(tmp_path, model_dir) as (http, service, _):
        world = build_world(http, A)
        row = service.store.checkpoint(world.run_id, "weights", "w1")
        ckpt = Path(row["dir"])
        outside.parent.mkdir(parents=True, exist_ok=True)
        ckpt.rename(outside)  # a real checkpoint, now outside the storage directory
        ckpt.symlink_to(outside, target_is_directory=True)
        r = http.post(
            "/api/v1/load_weights",
            json={"session_id": world.session_id, "model_seq_id": 1, "path": world.weights_path},
            headers=A,
        )
        assert r.status_code == 404 and "outside the storage directory" in r.json()["detail"], r.text
        r = http.post(
            "/api/v1/create_sampling_session",
            json={"session_id": world.session_id, "sampling_session_seq_id": 9, "model_path": world.weights_path},
            headers=A,
        )
        assert r.status_code == 404 and "outside the storage directory" in r.json()["detail"], r.text
        r = http.delete(f"/api/v1/training_runs/{world.run_id}/checkpoints/weights/w1", headers=A)
        assert r.status_code in (200, 404)
        assert (outside / "adapter_model.safetensors").exists()  # nothing outside was deleted

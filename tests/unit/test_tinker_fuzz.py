"""Generated requests against every route of the Tinker API (hypothesis), in-process, while a
well-behaved client trains beside the fuzzer.

Requests: each route's valid body (with live ids of several keys) broken one way (a field dropped,
added, or replaced by a wrong type, a huge or negative number, NaN, an id of another kind, a
string of junk), whole bodies of junk (deep nesting, bad UTF-8, truncated JSON), forward_backward
protobufs with random fields, truncated or corrupt, zstd bodies (truncated, several frames,
bombs that expand past ``tinker.max_request_bytes``), wrong content types and encodings, other
keys or none, unknown routes and methods. Every answer is a 2xx or a 4xx whose ``detail`` is a
message (never a 500 from an unhandled exception: TestClient re-raises those), none takes longer
than the long-poll bound, the server logs no error, and the well-behaved client's every request
succeeds.

Then the findings of these runs, one test each (``test_finding_*``), and a check that a wrong
type in any field of any body is answered 400 naming that field.

    .venv/bin/python -m pytest -q tests/unit/test_tinker_fuzz.py
    SKYRL_FUZZ_EXAMPLES=5000 SKYRL_FUZZ_RANDOM=1 .venv/bin/python -m pytest -q tests/unit/test_tinker_fuzz.py
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import quote

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("tinker")
zstandard = pytest.importorskip("zstandard")

from fastapi.routing import APIRoute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker.proto import tinker_public_pb2 as pb

from backends.tinker.wire import WireError, decompress
from tests.unit.test_tinker_lora_engine import model_dir  # noqa: F401 - the tiny model fixture
from tests.unit.tinker_served import (
    LONG_POLL_S,
    MAX_REQUEST_BYTES,
    PROTO,
    A,
    B,
    C,
    build_world,
    fb_body,
    new_model,
    served,
    wait,
)

EXAMPLES = int(os.environ.get("SKYRL_FUZZ_EXAMPLES", "20"))  # per route, and for forward_backward x 10
RANDOM = os.environ.get("SKYRL_FUZZ_RANDOM", "") not in ("", "0")  # new examples each run (CI: the same ones)
SLACK_S = 10.0  # on top of the long poll: a busy 2-core machine
PER_ROUTE = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    suppress_health_check=list(HealthCheck),
)
FUZZ = settings(
    max_examples=EXAMPLES * 10,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    suppress_health_check=list(HealthCheck),
)
SEQ = [7, 20, 11, 33, 9, 25, 14, 30, 8, 19]
JSON_CT = {"Content-Type": "application/json"}


# ---------------------------------------------------------------------------------- the server


@dataclass
class Live:
    http: object
    service: object
    errors: object
    worlds: dict  # "A", "B", "C" -> World
    routes: dict[str, set[str]]

    def ids(self, kind: str) -> list[str]:
        return [w.ids[kind] for w in self.worlds.values() if kind in w.ids]


@pytest.fixture(scope="module")
def live(tmp_path_factory, model_dir):  # noqa: F811 - the imported fixture
    with served(tmp_path_factory.mktemp("fuzz"), model_dir) as (http, service, errors):
        worlds = {name: build_world(http, h) for name, h in (("A", A), ("B", B), ("C", C))}
        routes = {r.path: set(r.methods) for r in http.app.routes if isinstance(r, APIRoute)}
        yield Live(http, service, errors, worlds, routes)


class GoodClient(threading.Thread):
    """Key C's training loop (forward_backward, optim_step, now and then a sampler save and a
    sample), each request checked, while the fuzzer runs."""

    def __init__(self, live: Live):
        super().__init__(daemon=True)
        self.http, world = live.http, live.worlds["C"]
        self.model_id, self.session_id = world.model_id, world.session_id
        self.seq = 5  # build_world used 1..4
        self.stopping = threading.Event()
        self.rounds, self.slowest, self.losses = 0, 0.0, []
        self.failure: str | None = None

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.round()
        except BaseException as err:  # noqa: BLE001 - reported by check()
            self.failure = f"{type(err).__name__}: {err}"

    def post(self, url, **kw):
        started = time.monotonic()
        r = self.http.post(url, headers={**C, **kw.pop("headers", {})}, **kw)
        self.slowest = max(self.slowest, time.monotonic() - started)
        assert r.status_code == 200, (url, r.status_code, r.text)
        return r.json()

    def result(self, rid: str) -> dict:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            body = self.post("/api/v1/retrieve_future", json={"request_id": rid})
            if body.get("type") != "try_again":
                assert "error" not in body, body
                return body
        raise AssertionError(f"future {rid} never finished")

    def round(self) -> None:
        # as the SDK does: without heartbeats a search longer than tinker's session timeout (300 s;
        # SKYRL_FUZZ_EXAMPLES=500) ended this client's session under it
        self.post("/api/v1/session_heartbeat", json={"session_id": self.session_id, "type": "session_heartbeat"})
        fb = self.post("/api/v1/forward_backward", content=fb_body(self.model_id, self.seq, SEQ), headers=PROTO)
        opt = self.post(
            "/api/v1/optim_step",
            json={"model_id": self.model_id, "seq_id": self.seq + 1, "adam_params": {"learning_rate": 1e-2}},
        )
        self.seq += 2
        loss = self.result(fb["request_id"])["metrics"]["loss:sum"]
        assert math.isfinite(loss), loss
        self.losses.append(loss)
        assert "metrics" in self.result(opt["request_id"])
        if self.rounds % 3 == 2:
            saved = self.post(
                "/api/v1/save_weights_for_sampler",
                json={"model_id": self.model_id, "seq_id": self.seq, "path": f"good-{self.seq}"},
            )
            self.seq += 1
            path = self.result(saved["request_id"])["path"]
            sample = self.post(
                "/api/v1/asample",
                json={
                    "model_path": path,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": SEQ[:4]}]},
                    "sampling_params": {"max_tokens": 3},
                },
            )
            assert len(self.result(sample["request_id"])["sequences"]) == 1
        self.rounds += 1

    def check(self, min_rounds: int = 2) -> None:
        assert self.failure is None, self.failure
        assert self.rounds >= min_rounds, f"the well-behaved client only did {self.rounds} rounds"
        assert self.slowest < LONG_POLL_S + SLACK_S, self.slowest


@contextlib.contextmanager
def beside_a_good_client(live: Live):
    good = GoodClient(live)
    good.start()
    try:
        yield good
    finally:
        good.stopping.set()
        good.join(timeout=120)
    assert not good.is_alive(), "the well-behaved client hangs"
    good.check()


# ---------------------------------------------------------------------------- the strategies

NASTY_STRINGS = [
    "",
    " ",
    "..",
    "../../etc/passwd",
    "/etc/passwd",
    "%2e%2e",
    "a" * 300,
    "\x00",
    "\ud800",
    "é\u202e",
    "0",
    "-1",
    "1_0",
    " 1",
    "1e3",
    "0x10",
    "\u0661\u0662",  # Arabic-Indic digits, which int() takes
    "9" * 40,
    "tinker://",
    "tinker://a/b",
    "tinker://a/weights/b/c",
    "null",
]
UTF8_STRINGS = [t for t in NASTY_STRINGS if "\ud800" not in t]  # what protobuf strings can hold
HUGE_INTS = [2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30), -1, 0]
NASTY_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(HUGE_INTS),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324]),
    st.sampled_from(NASTY_STRINGS),
    st.text(max_size=20),
    st.lists(st.integers(-3, 300), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.just([[[[[]]]]]),
)


def weighted(*pairs):
    """One of the strategies, chosen with the given weights."""
    choices = [s for w, s in pairs for _ in range(w)]
    return st.sampled_from(range(len(choices))).flatmap(lambda i: choices[i])


def an_id(live: Live, kind: str):
    """Mostly key A's id of this kind, else another key's, one of another kind, a random one, junk."""
    own = live.worlds["A"].ids.get(kind, "x")
    others = [i for w in live.worlds.values() for i in w.ids.values()]
    random_shape = {  # fixed: a strategy must draw the same way every time (hypothesis replays it)
        "session": "0123456789abcdef0123",
        "model": "0123456789abcdef0123:train:0",
        "run": "0123456789abcdef0123_train_0",
        "sampler": "0123456789abcdef0123:sample:0",
    }.get(kind, str(10**9))
    return weighted(
        (6, st.just(own)),
        (2, st.sampled_from(live.ids(kind) or [own])),
        (1, st.sampled_from(others)),
        (1, st.just(random_shape)),
        (1, st.sampled_from(NASTY_STRINGS)),
        (1, st.text(max_size=12)),
    )


def _choose(draw, options: list):
    """One of ``options`` (the first without ``draw``: the templates' plain variant)."""
    return draw(st.sampled_from(options)) if draw else options[0]


def _number(draw, low: int, high: int) -> int:
    return draw(st.integers(low, high)) if draw else low


def _seq(draw) -> int:
    if not draw:
        return 1
    return draw(weighted((4, st.integers(1, 60)), (1, st.sampled_from(HUGE_INTS)), (1, st.integers())))


PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}


def _templates(pick, draw=None) -> dict:
    """A valid body per JSON route, with ids from ``pick(kind)``: what the fuzzer breaks."""
    session, model = pick("session"), pick("model")
    adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0}
    name = _choose(draw, ["f1", "f2", "w1", "s1"])
    return {
        "/api/v1/client/config": {"sdk_version": "0.38.0"},
        "/api/v1/client/dynamic_config": {"sdk_version": "0.38.0"},
        "/api/v1/telemetry": {"events": [{"event": "x"}], "session_id": session, "sdk_version": "0.38.0"},
        "/api/v1/create_session": {"tags": ["t"], "user_metadata": {"k": "v"}, "sdk_version": "0.38.0"},
        "/api/v1/session_heartbeat": {"session_id": session, "type": "session_heartbeat"},
        "/api/v1/sessions/{session_id}/finish": {"reason": {"type": "success"}, "detail": "done"},
        "/api/v1/create_model": {
            "session_id": session,
            "model_seq_id": _number(draw, 0, 40),
            "base_model": "tiny",
            "user_metadata": {"k": "v"},
            "lora_config": {"rank": 4, "seed": 1, "train_unembed": True, "train_mlp": True, "train_attn": True},
            "optimizer_config": {"type": "adamw"},
        },
        "/api/v1/get_info": {"model_id": model, "type": "get_info"},
        "/api/v1/optim_step": {"model_id": model, "seq_id": _seq(draw), "adam_params": adam},
        "/api/v1/save_weights": {"model_id": model, "seq_id": _seq(draw), "path": name, "overwrite": True},
        "/api/v1/save_weights_for_sampler": _choose(
            draw,
            [
                {"model_id": model, "seq_id": _seq(draw), "path": name},
                {"model_id": model, "seq_id": _seq(draw), "sampling_session_seq_id": 3, "kind": "snapshot"},
            ],
        ),
        "/api/v1/load_weights": _choose(
            draw,
            [
                {"model_id": model, "seq_id": _seq(draw), "path": pick("weights_path"), "optimizer": True},
                {
                    "session_id": session,
                    "model_seq_id": _number(draw, 0, 40),
                    "path": pick("sampler_path"),
                    "optimizer": False,
                    "base_model": "tiny",
                    "optimizer_config": {"type": "adamw"},
                },
            ],
        ),
        "/api/v1/unload_model": {"model_id": model},
        "/api/v1/create_sampling_session": _choose(
            draw,
            [
                {"session_id": session, "sampling_session_seq_id": 1, "base_model": "tiny"},
                {"session_id": session, "sampling_session_seq_id": 2, "model_path": pick("sampler_path")},
            ],
        ),
        "/api/v1/asample": {
            "sampling_session_id": pick("sampler"),
            "seq_id": _number(draw, 0, 40),
            "num_samples": 2,
            "prompt": PROMPT,
            "sampling_params": {"max_tokens": 3, "seed": 1, "stop": [5], "temperature": 1.0, "top_k": -1, "top_p": 1},
            "prompt_logprobs": True,
            "topk_prompt_logprobs": 0,
            "type": "sample",
        },
        "/api/v1/retrieve_future": {
            "request_id": pick(_choose(draw, ["future_optim_step", "future_forward_backward", "future_sample"])),
            "allow_metadata_only": True,
        },
        "/api/v1/weights_info": {"tinker_path": pick(_choose(draw, ["weights_path", "sampler_path"]))},
    }


def _paths(value, prefix=()):
    """Every (path, value) inside a JSON value (the root excluded)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, sub in items:
        yield (*prefix, key), sub
        yield from _paths(sub, (*prefix, key))


def _set(body, path, value=None, delete=False):
    target = body
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return body


RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b"[" * 5000,
            b'{"a":' * 5000,
            b"\xff\xfe\x00{",
            b"\xef\xbb\xbf{}",
            b"{} trailing",
            b"NaN",
            b'{"session_id": NaN}',
            b'{"request_id": Infinity}',
            b"x" * (MAX_REQUEST_BYTES + 1),
        ]
    ),
)


@st.composite
def json_body(draw, body):
    """``body`` as it is, or broken one way; returns (bytes, what was done)."""
    how = draw(st.sampled_from(["valid", "valid", "drop", "extra", "replace", "replace", "replace", "whole", "raw"]))
    body = copy.deepcopy(body)
    paths = [p for p, _ in _paths(body)]
    if how == "raw":
        return draw(RAW_BODIES), how
    if how == "whole":
        body = draw(NASTY_VALUES)
    elif how == "drop" and paths:
        _set(body, draw(st.sampled_from(paths)), delete=True)
    elif how == "extra":
        holders = [()] + [p for p, v in _paths(body) if isinstance(v, dict)]
        where = draw(st.sampled_from(holders))
        target = body
        for key in where:
            target = target[key]
        target[draw(st.text(max_size=10))] = draw(NASTY_VALUES)
    elif how == "replace" and paths:
        path = draw(st.sampled_from(paths))
        _set(body, path, draw(NASTY_VALUES))
        how = f"replace {'.'.join(map(str, path))}"
    return json.dumps(body, allow_nan=True).encode(), how


# What a generated forward_backward message gets wrong: nothing (it must be accepted), one thing,
# or everything it can.
FB_FLAWS = [
    "none",
    "model_id",
    "seq_id",
    "loss_fn",
    "datums",
    "tokens",
    "chunk",
    "input_names",
    "dtype",
    "length",
    "values",
    "shape",
    "dense",
    "sparse",
    "config",
]


class Flaws:
    """Draws a valid choice, or a wild one where the message is to be wrong."""

    def __init__(self, draw, flaw: str):
        self.draw, self.flaw = draw, flaw

    def __call__(self, aspect: str, valid, wild):
        if self.flaw in ("all", aspect):
            return self.draw(wild)
        return self.draw(valid) if isinstance(valid, st.SearchStrategy) else valid


def _tensor(pick: Flaws, n: int, name: str) -> pb.Tensor:
    t = pb.Tensor()
    t.dtype = pick("dtype", 2 if name == "target_tokens" else 1, st.sampled_from([0, 1, 2, 3, 4, 99]))
    np_dtype = {1: np.float32, 2: np.int64, 3: np.int32}.get(t.dtype, np.float32)
    length = pick("length", n, st.integers(0, n + 3))
    values = pick(
        "values",
        st.lists(st.integers(0, 30), min_size=length, max_size=length),
        st.lists(
            st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.integers(-(2**31), 2**31 - 1)),
            min_size=length,
            max_size=length,
        ),
    )
    array = np.asarray(values, dtype=np.float64)
    with np.errstate(all="ignore"):
        array = array.astype(np_dtype)
    shape = pick(
        "shape",
        st.sampled_from([[length], [1, length]]),
        st.lists(st.sampled_from([-1, 0, 1, 2, 3, 2**31, 2**32, 2**62, -(2**62)]), max_size=3),
    )
    t.shape.extend(shape)
    if pick("sparse", False, st.booleans()):
        csr = t.sparse_csr
        csr.values = array.tobytes()
        csr.crow_indices = np.asarray(pick.draw(st.lists(st.integers(-2, length + 2), max_size=4)), np.int64).tobytes()
        cols = pick.draw(st.lists(st.integers(-2, length + 2), min_size=length, max_size=length))
        csr.col_indices = np.asarray(cols, np.int64).tobytes()
    else:
        raw = array.tobytes()
        t.dense = raw[: pick("dense", len(raw), st.integers(0, len(raw)))]
    return t


INPUT_NAMES = ["target_tokens", "weights", "logprobs", "advantages", "clip_low_threshold", "clip_high_threshold"]
LOSSES = ["cross_entropy", "ppo", "cispo", "importance_sampling", "dro", "gspo", "custom", ""]
NEEDS = {"cross_entropy": ["target_tokens", "weights"]}  # the others: the RL losses' inputs


@st.composite
def fb_message(draw, pick_id):
    flaw = draw(weighted((4, st.just("none")), (8, st.sampled_from(FB_FLAWS[1:])), (2, st.just("all"))))
    pick = Flaws(draw, flaw)
    msg = pb.ForwardBackwardRequest()
    model_id = pick_id("model").encode("utf-8", "surrogatepass").decode("utf-8", "replace")  # protobuf: UTF-8
    msg.model_id = pick("model_id", model_id, st.sampled_from(UTF8_STRINGS + ["x:train:0"]))
    msg.seq_id = pick("seq_id", st.integers(1, 60), st.integers(-(2**31), 2**31 - 1))
    msg.loss_fn = pick("loss_fn", st.sampled_from(LOSSES[:4]), st.one_of(st.sampled_from(LOSSES), st.text(max_size=8)))
    msg.forward_only = draw(st.booleans())
    for _ in range(pick("datums", st.integers(1, 2), st.sampled_from([0, 5, 40]))):
        datum = msg.data.add()
        tokens = pick(
            "tokens",
            st.lists(st.integers(0, 40), min_size=1, max_size=8),
            st.one_of(
                st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8),
                st.lists(st.integers(0, 40), min_size=65, max_size=80),
                st.just([]),
            ),
        )
        chunk = datum.model_input.add()
        kind = pick("chunk", "text", st.sampled_from(["odd", "image", "empty"]))
        if kind == "image":
            chunk.image.data, chunk.image.format = b"\x89PNG", "png"
        elif kind != "empty":
            raw = np.asarray(tokens, np.int32).tobytes()
            chunk.encoded_text.tokens = raw if kind == "text" else raw + b"\x01"
        wanted = NEEDS.get(msg.loss_fn, ["target_tokens", "logprobs", "advantages"])
        names = pick(
            "input_names",
            wanted,
            st.lists(st.one_of(st.sampled_from(INPUT_NAMES), st.text(max_size=6)), max_size=4, unique=True),
        )
        for name in names:
            datum.loss_fn_inputs[name].CopyFrom(_tensor(pick, len(tokens), name))
    keys = pick("config", [], st.lists(st.sampled_from(["clip_low_threshold", "clip_high_threshold", "x"]), max_size=2))
    for key in keys:
        value = draw(st.floats(allow_nan=True, allow_infinity=True))
        where = draw(st.sampled_from(["v1", "v2", "text"]))
        if where == "v1":
            msg.loss_fn_config[key] = value
        elif where == "v2":
            msg.loss_fn_config_v2[key].number = value
        else:
            msg.loss_fn_config_v2[key].text = draw(st.text(max_size=5))
    return msg.SerializeToString(), flaw


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def zstd_bomb(expanded: int) -> bytes:
    """A small zstd frame (no content size in its header) of ``expanded`` zero bytes."""
    chunk = bytes(1 << 20)
    cobj = zstandard.ZstdCompressor(level=3).compressobj()
    parts = [cobj.compress(chunk) for _ in range(expanded >> 20)]
    return b"".join(parts) + cobj.flush()


BOMB = zstd_bomb(64 * MAX_REQUEST_BYTES)


@st.composite
def fb_body_bytes(draw, pick):
    """A forward_backward body and its Content-Encoding: protobuf, broken or not, zstd or not."""
    data, flaw = draw(fb_message(pick))
    how = draw(
        weighted(
            (6, st.sampled_from(["plain", "zstd", "zstd-frames"])),
            (3, st.sampled_from(["truncate", "flip", "zstd-cut", "zstd-junk", "bomb", "junk"])),
        )
    )
    body, encoding, done = _transform(draw, data, how)
    return body, encoding, f"{done}, flaw {flaw}", flaw == "none" and done in ("plain", "zstd", "zstd-frames")


def _transform(draw, data: bytes, how: str):
    if how == "truncate" and data:
        return data[: draw(st.integers(0, len(data) - 1))], None, how
    if how == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :], None, how
    if how == "zstd":
        return _zstd(data), "zstd", how
    if how == "zstd-cut":
        packed = _zstd(data)
        return packed[: draw(st.integers(0, len(packed) - 1))], "zstd", how
    if how == "zstd-frames":
        cut = draw(st.integers(0, len(data)))
        return _zstd(data[:cut]) + _zstd(data[cut:]), "zstd", how
    if how == "zstd-junk":
        return _zstd(data) + draw(st.binary(min_size=1, max_size=8)), "zstd", how
    if how == "bomb":
        return BOMB, "zstd", how
    if how == "junk":
        return draw(st.binary(max_size=64)), draw(st.sampled_from([None, "zstd"])), how
    return data, None, how


@dataclass
class Request:
    method: str
    url: str
    headers: dict = field(default_factory=dict)
    content: bytes = b""
    how: str = ""


HEADERS_KEY = weighted(
    (30, st.just(A)),
    (1, st.just(B)),
    (1, st.just({})),
    (1, st.just({"X-API-Key": "tml-wrong"})),
    (1, st.just({"X-API-Key": ""})),
    (1, st.just({"Authorization": "Bearer tml-a"})),
)
CONTENT_TYPES = [
    "application/json",
    "application/x-protobuf",
    "text/plain",
    "application/json; charset=utf-16",
    "multipart/form-data; boundary=x",
    "",
]
ENCODINGS = ["zstd", "gzip", "identity", "br", "zstd, identity", "ZSTD", ""]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
UNKNOWN_PATHS = st.one_of(
    st.sampled_from(
        [
            "/",
            "/api/v1",
            "/api/v1/",
            "/api/v2/healthz",
            "/api/v1/create_model/",
            "/api/v1/healthz/x",
            "/api/v1/sessions/x/y/z",
            "/API/V1/HEALTHZ",
            "/api/v1/retrieve_future/../healthz",
            "/api/v1//create_model",
            "/api/v1/%00",
        ]
    ),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_/.%0123456789", max_size=30).map(lambda s: "/api/v1/" + s),
)


def _fill(template: str, pick, draw) -> str:
    out = template
    for param, kind in (("{session_id}", "session"), ("{run_id}", "run"), ("{sampler_id}", "sampler")):
        if param in out:
            value = pick(kind)
            safe = draw(st.sampled_from(["", ":", "/:%"]))
            out = out.replace(param, quote(value.encode("utf-8", "surrogatepass"), safe=safe) or "x")
    out = out.replace("{kind}", draw(st.sampled_from(["weights", "sampler_weights", "x", "..", "%2e%2e"])))
    return out.replace(
        "{name}", quote(draw(st.sampled_from(["w1", "s1", "..", "a" * 200, "x"] + NASTY_STRINGS[:8])), safe="")
    )


@st.composite
def any_request(draw, live: Live, path: str | None):
    """A request to route ``path`` (None: to no route), broken or not."""

    def pick(kind):
        return draw(an_id(live, kind))

    headers = dict(draw(HEADERS_KEY))
    if path is None:
        return Request(draw(st.sampled_from(METHODS)), draw(UNKNOWN_PATHS), headers, b"{}", "unknown route")
    methods = sorted(live.routes[path])
    method = draw(weighted((8, st.sampled_from(methods)), (1, st.sampled_from(METHODS))))
    url = _fill(path, pick, draw)
    if path == "/api/v1/training_runs":
        limit = draw(st.sampled_from(["20", "0", "1001", "-1", "abc", "1e3", "9" * 30, "", "1.5"]))
        offset = draw(st.sampled_from(["0", "-1", "9" * 30, "2", "x"]))
        url += draw(st.sampled_from([f"?limit={limit}&offset={offset}", f"?limit={limit}", "", "?limit=1&limit=2"]))
    if path == "/api/v1/forward_backward":
        content, encoding, how, _ = draw(fb_body_bytes(pick))
        headers["Content-Type"] = draw(
            weighted((8, st.just("application/x-protobuf")), (1, st.sampled_from(CONTENT_TYPES)))
        )
        encoding = draw(weighted((8, st.just(encoding)), (1, st.sampled_from(ENCODINGS))))
    else:
        template = _templates(pick, draw).get(path, {})
        content, how = draw(json_body(template))
        headers["Content-Type"] = draw(weighted((8, st.just("application/json")), (1, st.sampled_from(CONTENT_TYPES))))
        encoding = draw(weighted((10, st.none()), (1, st.sampled_from(ENCODINGS))))
    if encoding:
        headers["Content-Encoding"] = encoding
    if draw(st.booleans()):
        headers["Accept"] = draw(st.sampled_from(["application/x-protobuf", "application/json", "*/*", "text/html"]))
    return Request(method, url, headers, content, how)


# --------------------------------------------------------------------------------- the checks


ANSWERS: Counter = Counter()  # (route template or "unknown", status) of every fuzzed request


def _route_of(live: Live, url: str) -> str:
    path = url.split("?")[0]
    for template in live.routes:
        pattern = "^" + re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, path):
            return template
    return "unknown"


def check_answer(live: Live, req: Request) -> int:
    started = time.monotonic()
    r = live.http.request(req.method, req.url, headers=req.headers, content=req.content, follow_redirects=False)
    elapsed = time.monotonic() - started
    ANSWERS[(_route_of(live, req.url), r.status_code)] += 1
    where = f"{req.method} {req.url} ({req.how}) -> {r.status_code} {r.text[:300]}"
    assert elapsed < LONG_POLL_S + SLACK_S, f"{where}: took {elapsed:.1f} s"
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, where
    if r.status_code >= 400 and req.method != "HEAD":
        detail = r.json().get("detail")
        assert isinstance(detail, str) and detail.strip(), where
    return r.status_code


def check_server_is_fine(live: Live) -> None:
    assert live.service.scheduler.is_alive(), "the scheduler thread died"
    assert live.http.get("/api/v1/healthz").json() == {"status": "ok"}
    assert not live.errors.messages(), live.errors.messages()


# ---------------------------------------------------------------------------------- the tests


# Routes that read no JSON body: GET/DELETE ones, and those refused by name before any parsing.
ROUTES_WITHOUT_BODY = {"/api/v1/forward_backward"} | {
    f"/api/v1/{name}"
    for name in (
        "copy_weights",
        "create_custom_loss",
        "retrieve_futures",
        "join_sampling_session",
        "cancel_future",
        "auth/token",
        "forward",
        "save_weights_external",
    )
}


def test_every_route_has_a_body_to_break(live):
    """A new route gets a template here (or is one that takes no JSON body), so that it is fuzzed
    with a body that gets past parsing."""
    templates = _templates(lambda kind: live.worlds["A"].ids.get(kind, "x"))
    no_body = {p for p, methods in live.routes.items() if methods <= {"GET", "DELETE"} or "{run_id}" in p}
    missing = set(live.routes) - set(templates) - no_body - ROUTES_WITHOUT_BODY
    assert not missing, f"routes without a fuzz template: {sorted(missing)}"


def report(title: str) -> None:
    """What the fuzzer got back, per status and per route (shown with ``-s``)."""
    statuses = Counter()
    for (_, status), count in ANSWERS.items():
        statuses[status] += count
    print(f"\n{title}: {sum(ANSWERS.values())} requests; statuses {dict(sorted(statuses.items()))}")
    for route in sorted({r for r, _ in ANSWERS}):
        print(f"  {route}: {dict(sorted((s, c) for (r, s), c in ANSWERS.items() if r == route))}")


def test_fuzz_forward_backward_bodies(live):
    """Before the every-route fuzzing (which may end key A's session): on a model of its own, a
    message with nothing wrong must be accepted, whatever else is generated."""
    model_id, _ = new_model(live.http, A)

    def pick(kind):
        return model_id if kind == "model" else live.worlds["A"].ids[kind]

    @FUZZ
    @given(body=fb_body_bytes(pick))
    def one(body):
        content, encoding, how, valid = body
        headers = {**A, **PROTO, **({"Content-Encoding": encoding} if encoding else {})}
        status = check_answer(live, Request("POST", "/api/v1/forward_backward", headers, content, how))
        assert status == 200 or not valid, (how, status)

    ANSWERS.clear()
    with beside_a_good_client(live) as good:
        one()
    check_server_is_fine(live)
    report(f"forward_backward bodies (the well-behaved client did {good.rounds} rounds)")
    statuses = {status for (_, status) in ANSWERS}
    assert 200 in statuses and 400 in statuses, statuses  # some bodies get all the way, some do not


def fuzz_route(live: Live, path: str | None) -> None:
    @PER_ROUTE
    @given(req=any_request(live, path))
    def one(req):
        check_answer(live, req)

    one()


def test_fuzz_every_route(live):
    """Each route in turn (and unknown ones), ``SKYRL_FUZZ_EXAMPLES`` requests each."""
    ANSWERS.clear()
    with beside_a_good_client(live) as good:
        for path in [*sorted(live.routes), None]:
            fuzz_route(live, path)
    check_server_is_fine(live)
    report(f"every route (the well-behaved client did {good.rounds} rounds)")
    for path in live.routes:  # each route answered more than one way
        assert len({status for (route, status) in ANSWERS if route == path}) >= 2 or EXAMPLES < 10, path


WRONG_TYPE_ROUTES = sorted(
    {
        "/api/v1/create_session",
        "/api/v1/session_heartbeat",
        "/api/v1/sessions/{session_id}/finish",
        "/api/v1/create_model",
        "/api/v1/get_info",
        "/api/v1/optim_step",
        "/api/v1/save_weights",
        "/api/v1/save_weights_for_sampler",
        "/api/v1/load_weights",
        "/api/v1/unload_model",
        "/api/v1/create_sampling_session",
        "/api/v1/asample",
        "/api/v1/retrieve_future",
        "/api/v1/weights_info",
        "/api/v1/client/config",
    }
)
# Fields whose value is free-form (any JSON), so no value has the wrong type.
UNIONS = {("sampling_params", "stop")}  # str | list[str] | list[int]
FREE_FORM = {("user_metadata", "k"), ("reason", "type"), ("events", 0, "event")}


@pytest.mark.parametrize("path", WRONG_TYPE_ROUTES)
def test_a_wrong_type_in_any_field_is_a_400_naming_it(live, path):
    body = _templates(lambda kind: live.worlds["A"].ids[kind])[path]
    url = path.replace("{session_id}", live.worlds["A"].session_id)
    unnamed = []
    for leaf, value in list(_paths(body)):
        if leaf in FREE_FORM or leaf[-1] == "type":  # "type" tags the SDK's unions; not read here
            continue
        wrong = {"x": [1]} if isinstance(value, list) else [{"x": 1}]
        broken = _set(copy.deepcopy(body), leaf, wrong)
        r = live.http.post(url, content=json.dumps(broken), headers={**A, **JSON_CT})
        named = leaf
        while isinstance(named[-1], int) and leaf[:-1] in UNIONS:  # pydantic names the union, not the item
            named = named[:-1]
        dotted = ".".join(map(str, named))
        if not (r.status_code == 400 and dotted in r.json()["detail"]):
            unnamed.append((dotted, r.status_code, r.text[:200]))
    assert not unnamed, unnamed


# ------------------------------------------------------------------------------- the findings
# Each was an unhandled exception (a 500), a hang, or a request wrongly accepted, found by the
# fuzzer above; each test fails without its fix in backends/tinker/.


def _fb_with_tensor(model_id: str, shape, dense: bytes = b"", sparse: tuple | None = None) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([5, 6, 7], np.int32).tobytes()
    tensor = datum.loss_fn_inputs["target_tokens"]
    tensor.dtype = pb.DTYPE_INT64
    tensor.shape.extend(shape)
    if sparse is None:
        tensor.dense = dense
    else:
        tensor.sparse_csr.crow_indices = np.asarray(sparse[0], np.int64).tobytes()
        tensor.sparse_csr.col_indices = np.asarray(sparse[1], np.int64).tobytes()
        tensor.sparse_csr.values = np.asarray(sparse[2], np.int64).tobytes()
    return msg.SerializeToString()


def _fb_with_config(model_id: str, key: str, value: float, v2: bool) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="ppo")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([5, 6, 7], np.int32).tobytes()
    for name, values, dtype in (
        ("target_tokens", np.array([6, 7, 8], np.int64), pb.DTYPE_INT64),
        ("logprobs", np.zeros(3, np.float32), pb.DTYPE_FLOAT32),
        ("advantages", np.ones(3, np.float32), pb.DTYPE_FLOAT32),
    ):
        tensor = datum.loss_fn_inputs[name]
        tensor.dtype, tensor.dense = dtype, values.tobytes()
        tensor.shape.append(3)
    if v2:
        msg.loss_fn_config_v2[key].number = value
    else:
        msg.loss_fn_config[key] = value
    return msg.SerializeToString()


def _post(live, url, body, headers=None):
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    return live.http.post(url, content=content, headers={**A, **JSON_CT, **(headers or {})})


FINDINGS = {
    # request_id beyond SQLite's integer: OverflowError in the lookup
    "request_id over 2**63": (
        lambda live: _post(live, "/api/v1/retrieve_future", {"request_id": "9" * 30}),
        400,
        "request_id",
    ),
    # int() takes "1_0", " 1" and other scripts' digits: another future than the one named
    "request_id with an underscore": (
        lambda live: _post(live, "/api/v1/retrieve_future", {"request_id": "1_0"}),
        400,
        "request_id",
    ),
    "request_id in Arabic-Indic digits": (
        lambda live: _post(live, "/api/v1/retrieve_future", {"request_id": "\u0661"}),
        400,
        "request_id",
    ),
    # offset beyond SQLite's integer: OverflowError
    "training_runs offset over 2**63 (found by the random search)": (
        lambda live: live.http.get("/api/v1/training_runs?offset=" + "9" * 30, headers=A),
        400,
        "offset",
    ),
    # FastAPI's own 422 had a list as detail, unlike every other error of the API
    "training_runs limit not a number": (
        lambda live: live.http.get("/api/v1/training_runs?limit=abc", headers=A),
        400,
        "limit",
    ),
    # json.loads raises RecursionError (not a JSONDecodeError) past ~1000 levels
    "deeply nested JSON array": (lambda live: _post(live, "/api/v1/create_session", b"[" * 5000), 400, "JSON"),
    "deeply nested JSON object": (lambda live: _post(live, "/api/v1/create_session", b'{"a":' * 5000), 400, "JSON"),
    # a sparse tensor's shape was allocated as given: MemoryError, or ValueError when negative
    "sparse tensor of 10**13 columns": (
        lambda live: _post(
            live,
            "/api/v1/forward_backward",
            _fb_with_tensor(live.worlds["A"].model_id, [1, 10**13], sparse=([0, 0], [], [])),
            PROTO,
        ),
        400,
        "shape",
    ),
    "sparse tensor of -1 rows": (
        lambda live: _post(
            live,
            "/api/v1/forward_backward",
            _fb_with_tensor(live.worlds["A"].model_id, [-1, 3], sparse=([], [], [])),
            PROTO,
        ),
        400,
        "shape",
    ),
    "sparse tensor of negative shape": (
        lambda live: _post(
            live,
            "/api/v1/forward_backward",
            _fb_with_tensor(live.worlds["A"].model_id, [1, -5], sparse=([0, 0], [], [])),
            PROTO,
        ),
        400,
        "shape",
    ),
    # np.prod of the shape wraps around in int64 and equals the element count: reshape failed
    "dense tensor whose shape product overflows": (
        lambda live: _post(
            live, "/api/v1/forward_backward", _fb_with_tensor(live.worlds["A"].model_id, [2**32, 2**32]), PROTO
        ),
        400,
        "shape",
    ),
    # -1 dimensions: their product matched the element count, then reshape refused two of them
    "dense tensor with -1 dimensions (found by the random search)": (
        lambda live: _post(
            live,
            "/api/v1/forward_backward",
            _fb_with_tensor(live.worlds["A"].model_id, [-1, -1, 3], dense=np.array([6, 7, 8], np.int64).tobytes()),
            PROTO,
        ),
        400,
        "shape",
    ),
    # NaN or infinite clip thresholds were accepted and poisoned the adapter with NaN
    "NaN in loss_fn_config": (
        lambda live: _post(
            live,
            "/api/v1/forward_backward",
            _fb_with_config(live.worlds["A"].model_id, "clip_low_threshold", math.nan, False),
            PROTO,
        ),
        400,
        "clip_low_threshold",
    ),
    "infinity in loss_fn_config_v2": (
        lambda live: _post(
            live,
            "/api/v1/forward_backward",
            _fb_with_config(live.worlds["A"].model_id, "clip_high_threshold", math.inf, True),
            PROTO,
        ),
        400,
        "clip_high_threshold",
    ),
    # found by the long search: a double beyond float32 (v2 numbers are doubles) failed the whole
    # scheduler round ("value cannot be converted to type float without overflow")
    "loss_fn_config_v2 beyond float32": (
        lambda live: _post(
            live,
            "/api/v1/forward_backward",
            _fb_with_config(live.worlds["A"].model_id, "clip_high_threshold", 1e300, True),
            PROTO,
        ),
        400,
        "float32",
    ),
    # a truncated zstd body was decoded as its prefix (a shorter, different request)
    "truncated zstd body": (
        lambda live: _post(
            live,
            "/api/v1/forward_backward",
            _zstd(fb_body(live.worlds["A"].model_id, seq_id=90))[:-4],
            {**PROTO, "Content-Encoding": "zstd"},
        ),
        400,
        "truncated",
    ),
    # bytes after the first zstd frame were dropped without a word
    "zstd body with junk after its frame": (
        lambda live: _post(
            live,
            "/api/v1/forward_backward",
            _zstd(fb_body(live.worlds["A"].model_id, seq_id=90)) + b"junk",
            {**PROTO, "Content-Encoding": "zstd"},
        ),
        400,
        "zstd",
    ),
    # millions of empty frames (9 bytes each, no output) held the event loop for many seconds
    "zstd body of 2000 empty frames": (
        lambda live: _post(live, "/api/v1/forward_backward", _zstd(b"") * 2000, {**PROTO, "Content-Encoding": "zstd"}),
        400,
        "frames",
    ),
    # a sampler seq id so long that the sampler id is over the id length limit (unusable)
    "sampling_session_seq_id over 2**31": (
        lambda live: _post(
            live,
            "/api/v1/create_sampling_session",
            {"session_id": live.worlds["A"].session_id, "sampling_session_seq_id": 10**250, "base_model": "tiny"},
        ),
        400,
        "sampling_session_seq_id",
    ),
    # torch's manual_seed overflowed in the trainer: a failed future naming no field
    "lora seed over 2**64": (
        lambda live: _post(
            live,
            "/api/v1/create_model",
            {
                "session_id": live.worlds["A"].session_id,
                "model_seq_id": 30,
                "base_model": "tiny",
                "lora_config": {"rank": 4, "seed": 10**30},
            },
        ),
        400,
        "lora_config.seed",
    ),
    # Starlette's bare "Not Found" / "Method Not Allowed" did not say which route
    "unknown route": (lambda live: live.http.post("/api/v1/nope", headers=A), 404, "/api/v1/nope"),
    "wrong method": (lambda live: live.http.delete("/api/v1/create_model", headers=A), 405, "DELETE"),
    # found by the long search (SKYRL_FUZZ_EXAMPLES=200): an id ending in an encoded slash was
    # redirected (307, no body) to the path without it, "tinker://" cut to "tinker:/"
    "id ending in an encoded slash": (
        lambda live: live.http.get("/api/v1/samplers/tinker%3A%2F%2F", headers=A),
        404,
        "/api/v1/samplers/tinker://",
    ),
    "trailing slash": (lambda live: live.http.post("/api/v1/create_model/", headers=A), 404, "/api/v1/create_model/"),
}


@pytest.mark.parametrize("name", sorted(FINDINGS))
def test_finding(live, name):
    send, status, needle = FINDINGS[name]
    r = send(live)
    assert r.status_code == status, (name, r.status_code, r.text)
    detail = r.json()["detail"]
    assert isinstance(detail, str) and needle in detail, (name, detail)
    assert set(r.json()) == {"detail", "error"}, r.json()


def test_finding_a_zstd_body_of_several_frames_is_read_whole():
    """Only the first frame was read: the rest of the body was dropped without a word."""
    assert decompress(_zstd(b"hello") + _zstd(b" world"), "zstd", 100) == b"hello world"


def test_finding_a_zstd_bomb_is_stopped_while_it_expands():
    """A body that expands to 64x the limit is refused after at most about the limit has been
    decompressed: bounded memory and time, whatever the expanded size."""
    import psutil

    proc = psutil.Process()
    bomb = zstd_bomb(2**30)  # 1 GiB of zeros in ~40 KB
    before = proc.memory_info().rss
    started = time.monotonic()
    with pytest.raises(WireError) as err:
        decompress(bomb, "zstd", 2**20)
    assert err.value.status == 413
    assert time.monotonic() - started < 2.0
    assert proc.memory_info().rss - before < 64 * 2**20


def test_finding_an_unreadable_checkpoint_is_a_clear_error(tmp_path, model_dir):  # noqa: F811
    """A checkpoint whose files are garbage (a disk fault, a copy cut short): safetensors' and
    pickle's errors were not caught, so the client got "internal error in the LoRA engine"."""
    with served(tmp_path, model_dir) as (http, service, errors):
        world = build_world(http, A)
        ckpt = service.storage / "checkpoints" / world.run_id / "weights" / "w1"
        for name, optimizer in (("adapter_model.safetensors", False), ("optimizer.pt", True)):
            saved = (ckpt / name).read_bytes()
            (ckpt / name).write_bytes(b"\x00garbage" * 8)
            r = http.post(
                "/api/v1/load_weights",
                json={
                    "model_id": world.model_id,
                    "seq_id": 10 + optimizer,
                    "path": world.weights_path,
                    "optimizer": optimizer,
                },
                headers=A,
            )
            result = wait(http, r.json()["request_id"])
            assert "unreadable" in result.get("error", "") and result["category"] == "User", result
            (ckpt / name).write_bytes(saved)
        assert not errors.messages()


def test_finding_a_failed_round_frees_the_models_it_was_creating(tmp_path, model_dir):  # noqa: F811
    """An unexpected exception in the trainer failed the round's futures but left a create-via-load
    (or create) model 'pending' for ever, holding an adapter slot that was never given back."""
    with served(tmp_path, model_dir, max_live_adapters=2) as (http, service, errors):
        world = build_world(http, A)

        def broken_load(*args, **kwargs):
            raise RuntimeError("injected engine fault")

        service.scheduler.engine.load = broken_load
        for seq in (1, 2):  # twice: with one slot left, the second only fits if the first gave it back
            r = http.post(
                "/api/v1/load_weights",
                json={"session_id": world.session_id, "model_seq_id": seq, "path": world.weights_path},
                headers=A,
            )
            assert r.status_code == 200, r.text
            assert "internal error" in wait(http, r.json()["request_id"])["error"]
            assert service.store.model(f"{world.session_id}:train:{seq}")["state"] == "failed"
        assert [r.getMessage() for r in errors.records] == ["a scheduler round failed"] * 2

"""Prompt logprobs through ``asample`` (``compute_logprobs``, ``topk_prompt_logprobs``,
``prompt_logprobs_last_n``): the request the server sends to vLLM, how it reads vLLM's answer, the
protobuf result as the SDK decodes it, and the 400s that name the field. The engine behind the
sampler is a stand-in that answers like vLLM's ``/v1/completions`` from a fixed distribution."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
tinker = pytest.importorskip("tinker")
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response

from backends.tinker.app import create_app
from backends.tinker.sampling import Gate, SampleJob, Sampler, _prompt_scores
from backends.tinker.service import ServerConfig, TinkerService
from backends.tinker.wire import PromptScores, Sampled, encode_sample_result, proto_result_as_json

KEY = {"X-API-Key": "tml-a"}
VOCAB = 50


def model_logprobs(prev: int) -> np.ndarray:
    """The stand-in model's next-token logprobs after token ``prev``: peaked at prev + 1."""
    logits = -0.7 * ((np.arange(VOCAB) - (prev + 1)) % VOCAB).astype(np.float64)
    return logits - np.log(np.exp(logits).sum())


def vllm_prompt_logprobs(prompt: list[int], k: int) -> list:
    """What vLLM answers for ``prompt_logprobs = k``: None, then per position the k most likely
    tokens and the prompt token (rank 1 = most likely), keyed by the token id as a string."""
    out: list = [None]
    for position in range(1, len(prompt)):
        lp = model_logprobs(prompt[position - 1])
        order = np.argsort(-lp, kind="stable")
        rank = {int(t): r + 1 for r, t in enumerate(order)}
        keep = [int(t) for t in order[:k]] + [prompt[position]]
        out.append(
            {str(t): {"logprob": float(lp[t]), "rank": rank[t], "decoded_token": chr(65 + t % 26)} for t in keep}
        )
    return out


class FakeVllm:
    def __init__(self):
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        choice = {"text": "x", "token_ids": [5], "logprobs": {"token_logprobs": [-0.25]}, "finish_reason": "length"}
        if body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(body["prompt"], body["prompt_logprobs"])
        return httpx.Response(200, json={"choices": [choice] * body.get("n", 1)})


class FakeEngine:
    vocab_size = VOCAB

    def create_adapter(self, *args, **kwargs):
        pass

    def drop_adapter(self, model_id):
        pass


@pytest.fixture
def served(tmp_path):
    config = ServerConfig(
        base_model="tiny",
        model_dir=str(tmp_path / "model"),
        storage_dir=str(tmp_path / "st"),
        api_keys=frozenset({"tml-a"}),
        max_sequence_tokens=64,
        long_poll_s=2.0,
    )
    service = TinkerService(config, engine_factory=FakeEngine)
    vllm = FakeVllm()
    service.sampler = Sampler("http://engine", ["http://engine"])
    service.sampler.http = httpx.AsyncClient(transport=httpx.MockTransport(vllm))
    service.start()
    service.scheduler.ready.wait(10)
    with TestClient(create_app(service)) as http:
        yield http, vllm
    service.stop()


def asample(http, prompt, num_samples=1, max_tokens=1, **fields) -> httpx.Response:
    """An ``asample`` body as the SDK 0.38 builds it (``SampleRequest``), on the base model."""
    request = types.SampleRequest(
        base_model="tiny",
        num_samples=num_samples,
        prompt=types.ModelInput.from_ints(prompt),
        sampling_params=types.SamplingParams(max_tokens=max_tokens),
        **fields,
    )
    return http.post("/api/v1/asample", content=request.model_dump_json(), headers=KEY)


def result(http, response) -> bytes:
    assert response.status_code == 200, response.text
    rid = response.json()["request_id"]
    for _ in range(50):
        r = http.post(
            "/api/v1/retrieve_future",
            json={"request_id": rid},
            headers={**KEY, "Accept": "application/x-protobuf"},
        )
        if r.headers["content-type"].startswith("application/x-protobuf"):
            return r.content
        assert r.json().get("type") == "try_again", r.text
    raise AssertionError("future never finished")


PROMPT = [3, 4, 9, 10, 11, 30, 2]


def expected(prompt, position) -> np.ndarray:
    return model_logprobs(prompt[position - 1])


def test_compute_logprobs_request_as_the_sdk_sends_it(served):
    """``compute_logprobs``: max_tokens=1, prompt_logprobs=true; the server asks vLLM for the prompt
    token's logprob only (prompt_logprobs=0) and answers them position by position, NaN first."""
    http, vllm = served
    resp = deserialize_sample_response(result(http, asample(http, PROMPT, prompt_logprobs=True)))
    assert len(vllm.bodies) == 1  # one request: the scoring one is the sample too
    assert vllm.bodies[0]["prompt_logprobs"] == 0 and vllm.bodies[0]["max_tokens"] == 1
    lps = resp.prompt_logprobs
    assert lps[0] is None and len(lps) == len(PROMPT)
    for position in range(1, len(PROMPT)):
        assert lps[position] == pytest.approx(expected(PROMPT, position)[PROMPT[position]], rel=1e-6)
    assert resp.topk_prompt_logprobs is None


def test_topk_prompt_logprobs(served):
    http, vllm = served
    k = 3
    data = result(http, asample(http, PROMPT, prompt_logprobs=True, topk_prompt_logprobs=k))
    assert vllm.bodies[-1]["prompt_logprobs"] == k
    resp = deserialize_sample_response(data)
    topk = resp.topk_prompt_logprobs
    assert topk[0] is None and len(topk) == len(PROMPT)
    for position in range(1, len(PROMPT)):
        lp = expected(PROMPT, position)
        best = np.argsort(-lp, kind="stable")[:k]
        assert [
            t for t, _ in topk[position]
        ] == best.tolist()  # the k best, best first, the prompt token only if among them
        assert [v for _, v in topk[position]] == pytest.approx(lp[best].tolist(), rel=1e-6)
        assert resp.prompt_logprobs[position] == pytest.approx(lp[PROMPT[position]], rel=1e-6)
    as_json = proto_result_as_json("sample", data)
    assert as_json["topk_prompt_logprobs"][0] is None
    assert [t for t, _ in as_json["topk_prompt_logprobs"][1]] == [t for t, _ in topk[1]]

    # top-k without prompt_logprobs: the top k only
    alone = deserialize_sample_response(result(http, asample(http, PROMPT, topk_prompt_logprobs=2)))
    assert alone.prompt_logprobs is None and [len(r or []) for r in alone.topk_prompt_logprobs][1:] == [2] * 6


def test_prompt_logprobs_last_n(served):
    http, _ = served
    fields = {"prompt_logprobs": True, "topk_prompt_logprobs": 2, "prompt_logprobs_last_n": 2}
    resp = deserialize_sample_response(result(http, asample(http, PROMPT, **fields)))
    assert [v is None for v in resp.prompt_logprobs] == [True] * 5 + [False] * 2
    assert [v is None for v in resp.topk_prompt_logprobs] == [True] * 5 + [False] * 2
    assert resp.prompt_logprobs[-1] == pytest.approx(expected(PROMPT, 6)[PROMPT[6]], rel=1e-6)


def test_one_token_prompt(served):
    http, _ = served
    resp = deserialize_sample_response(result(http, asample(http, [7], prompt_logprobs=True, topk_prompt_logprobs=4)))
    assert resp.prompt_logprobs == [None] and resp.topk_prompt_logprobs == [None]


@pytest.mark.parametrize(
    "prompt, fields, message",
    [
        ([], {"prompt_logprobs": True}, "prompt: empty prompt"),
        (
            PROMPT,
            {"prompt_logprobs": True, "topk_prompt_logprobs": 21},
            "topk_prompt_logprobs: must be between 0 and 20",
        ),
        (
            PROMPT,
            {"prompt_logprobs": True, "topk_prompt_logprobs": -1},
            "topk_prompt_logprobs: must be between 0 and 20",
        ),
        (PROMPT, {"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n: needs prompt_logprobs"),
        (
            PROMPT,
            {"prompt_logprobs": True, "prompt_logprobs_last_n": 7},
            "prompt_logprobs_last_n: must be between 1 and",
        ),
        (
            PROMPT,
            {"prompt_logprobs": True, "prompt_logprobs_last_n": 0},
            "prompt_logprobs_last_n: must be between 1 and",
        ),
        ([1], {"prompt_logprobs": True, "prompt_logprobs_last_n": 1}, "prompt_logprobs_last_n: must be between 1 and"),
        (PROMPT, {"topk_sample_logprobs": 2}, "topk_sample_logprobs is not supported"),
        ([3, VOCAB], {"prompt_logprobs": True}, f"prompt token ids must be in 0..{VOCAB - 1}"),
    ],
)
def test_malformed_prompt_logprob_requests(served, prompt, fields, message):
    http, vllm = served
    r = asample(http, prompt, **fields)
    assert r.status_code == 400, r.text
    assert message in r.json()["detail"]
    assert not vllm.bodies  # refused before it reached an engine


def test_vllm_answer_read_position_by_position():
    """The prompt token outside the top k (vLLM lists k + 1 entries then) is left out of the top k;
    a position vLLM did not score is None."""
    job = SampleJob("m", None, [1, 2, 3], 1, 1, 1.0, 1.0, -1, None, None, True, 1, None)
    entries = [
        None,
        {"2": {"logprob": -3.0, "rank": 4}, "7": {"logprob": -0.1, "rank": 1}},
        {"3": {"logprob": -0.2, "rank": 1}},
    ]
    scores = _prompt_scores(job, entries)
    assert scores == PromptScores([None, -3.0, -0.2], [None, [(7, -0.1)], [(3, -0.2)]], 1)
    assert _prompt_scores(job, [None, None, entries[2]]).logprobs == [None, None, -0.2]

    data = encode_sample_result([Sampled([5], [-0.25], "length")], scores)
    resp = deserialize_sample_response(data)
    assert resp.topk_prompt_logprobs == [None, [(7, pytest.approx(-0.1))], [(3, pytest.approx(-0.2))]]
    assert encode_sample_result([Sampled([5], None, "stop")], None) == encode_sample_result(
        [Sampled([5], None, "stop")], PromptScores(None, None)
    )


def test_prompt_scored_by_a_request_of_its_own(served):
    """Several samples, or more than one token: the prompt is scored by a one-token request (alone
    on the engines), and the samples come from a request without prompt logprobs."""
    http, vllm = served
    data = result(
        http, asample(http, PROMPT, num_samples=3, max_tokens=4, prompt_logprobs=True, topk_prompt_logprobs=2)
    )
    scoring, sampling = vllm.bodies
    assert (scoring["n"], scoring["max_tokens"], scoring["prompt_logprobs"]) == (1, 1, 2)
    assert (sampling["n"], sampling["max_tokens"], "prompt_logprobs" in sampling) == (3, 4, False)
    resp = deserialize_sample_response(data)
    assert len(resp.sequences) == 3 and resp.prompt_logprobs[0] is None and len(resp.topk_prompt_logprobs[1]) == 2


def test_gate_runs_a_prompt_scoring_request_alone():
    async def scenario() -> list[str]:
        gate, events = Gate(), []

        async def together(name, delay):
            async with gate.together():
                events.append(f"{name} in")
                await asyncio.sleep(delay)
                events.append(f"{name} out")

        async def alone(name):
            async with gate.alone():
                events.append(f"{name} in")
                await asyncio.sleep(0.02)
                events.append(f"{name} out")

        first = [asyncio.create_task(together("a", 0.05)), asyncio.create_task(together("b", 0.03))]
        await asyncio.sleep(0.01)
        scoring = [asyncio.create_task(alone("s1")), asyncio.create_task(alone("s2"))]
        await asyncio.sleep(0.01)
        late = asyncio.create_task(together("c", 0.01))  # arrives while s1, s2 wait: goes after them
        await asyncio.gather(*first, *scoring, late)
        return events

    events = asyncio.run(scenario())
    assert events[:2] == ["a in", "b in"]  # together: at once
    for name in ("s1", "s2"):
        start = events.index(f"{name} in")
        assert start > max(events.index("a out"), events.index("b out"))  # after those in flight
        assert events[start + 1] == f"{name} out"  # alone: nothing else in between
        assert events.index("c in") > start  # held back while waiting and running

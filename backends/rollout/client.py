"""Async rollout client: token ids in, sampled token ids + their sampling logprobs out, through the
vllm-router.

Why ``/inference/v1/generate`` rather than ``/v1/completions``: both take token ids, but only the
generate route reports, per choice, which weight version sampled which tokens
(``weight_versions``: spans of output positions). Under fully async RL a weight update can land in
the middle of a response (engines pause in ``keep`` mode), and the trainer needs to know that to
account staleness; with ``/v1/completions`` we could only read the version before and after the
request and guess. It also skips detokenization (``output_mode = tokens``). The exception is
``generate_batch`` (many different prompts in one ``/v1/completions`` request), for evaluation at a
fixed policy version: each request costs an engine's API server ~7-10 ms on a CPU, so 500 greedy
eval prompts took 3.4-6.9 s one request each and 0.33 s as one batch (tiny quickstart model).

Logprobs are those of the distribution each token was sampled from: engines run with
``--logprobs-mode processed_logprobs`` (after temperature; see ``skyrl_cli.plan.inference``).

Routing: every request carries ``X-Session-ID``; the router (``sticky_least_loaded`` by default)
keeps every turn of a session on one engine, whose prefix cache then holds the session's context.
``finish_session`` releases the pin (``RolloutSession`` does it in a ``finally``).

LoRA (``model.lora``): the model a request names is a versioned adapter (``policy-v<k>``), and the
tokens of a request are all sampled by that adapter, whatever the engine's weight-version label
says meanwhile (it is the newest adapter loaded, which a request that named an older one does not
use). So for an adapter the spans come from its name (``adapter_spans``), not from the engine.
``in_flight`` counts requests per model name, so that an old adapter is unloaded only once no
request uses it (``backends.inference.weight_sync.EngineAdapters.retire``).

Failures: a connection error, a timeout, a 5xx or a 429 is retried with exponential backoff and
jitter, up to ``max_retries`` times. Before a retry the session's pin is released, so a session
pinned to an engine that died is placed on a live one (its cached prefix died with the engine
anyway). Other 4xx errors are bugs in the request and raise at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence

import httpx

from backends.inference.weight_sync import adapter_version
from skyrl_contracts.engine_api import GENERATE_PATH, SERVED_MODEL_NAME
from skyrl_contracts.errors import SkyrlError

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class RolloutError(SkyrlError):
    """A generation request failed for good (after its retries, or a bad request)."""


@dataclass(frozen=True)
class WeightSpan:
    """Output tokens ``[start, end)`` were sampled with the weights labelled ``version``."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # sampling logprob of each token in token_ids
    finish_reason: str  # "stop" (eos / stop token), "length" (max_tokens), "abort"
    weight_spans: tuple[WeightSpan, ...] = ()

    @property
    def weight_versions(self) -> tuple[str, ...]:
        """Every version label that sampled some of these tokens, in order of appearance."""
        return tuple(dict.fromkeys(s.version for s in self.weight_spans))

    @property
    def policy_versions(self) -> tuple[int, ...]:
        """The numeric versions (labels the orchestrator gave with ``sync_weights``)."""
        return tuple(int(v) for v in self.weight_versions if v.lstrip("-").isdigit())


def parse_generate_response(body: dict) -> list[Completion]:
    """The choices of a ``/inference/v1/generate`` response, in index order."""
    completions = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        token_ids = list(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(entry["logprob"]) for entry in content]
        if len(logprobs) != len(token_ids):
            raise RolloutError(
                f"engine returned {len(logprobs)} logprobs for {len(token_ids)} tokens (request logprobs=0?)"
            )
        spans = tuple(
            WeightSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in choice.get("weight_versions") or ()
        )
        completions.append(Completion(token_ids, logprobs, choice.get("finish_reason") or "stop", spans))
    return completions


def adapter_spans(completions: list[Completion], model: str) -> list[Completion]:
    """Completions of a request that named ``model``: for a versioned LoRA adapter, one span of its
    version over all tokens (the adapter sampled every one of them); unchanged for any other name."""
    version = adapter_version(model)
    if version is None:
        return completions
    return [
        replace(c, weight_spans=(WeightSpan(str(version), 0, len(c.token_ids)),) if c.token_ids else ())
        for c in completions
    ]


def parse_completions_response(body: dict) -> list[Completion]:
    """The choices of a ``/v1/completions`` response (``return_token_ids``, ``logprobs = 0``), in
    index order. No weight spans: that route does not report them."""
    completions = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        token_ids = list(choice.get("token_ids") or [])
        logprobs = [float(x) for x in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
        if len(logprobs) != len(token_ids):
            raise RolloutError(f"engine returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
        completions.append(Completion(token_ids, logprobs, choice.get("finish_reason") or "stop"))
    return completions


class RolloutClient:
    """One per orchestrator process; use as ``async with RolloutClient(url) as client``."""

    def __init__(
        self,
        router_url: str,
        *,
        max_concurrency: int = 64,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        model: str = SERVED_MODEL_NAME,
        max_model_len: int | None = None,
    ):
        self.router_url = router_url.rstrip("/")
        self.model = model
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_model_len = max_model_len
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency),
        )
        self.retries = 0  # retried requests so far (a metric)
        self.in_flight: Counter[str] = Counter()  # requests under way per model name (LoRA unloads)

    @classmethod
    def from_recipe(cls, router_url: str, recipe, model: str = SERVED_MODEL_NAME) -> "RolloutClient":
        inf = recipe.inference
        return cls(
            router_url,
            max_concurrency=inf.max_concurrency,
            timeout_s=inf.request_timeout_s,
            max_retries=inf.max_retries,
            model=model,
            max_model_len=inf.max_model_len,
        )

    async def __aenter__(self) -> "RolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -------------------------------------------------------------------------- generation
    async def generate(
        self,
        prompt_ids: Sequence[int],
        session_id: str,
        max_tokens: int,
        temperature: float = 1.0,
        n: int = 1,
        *,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
        ignore_eos: bool = False,
        model: str | None = None,
    ) -> list[Completion]:
        """``n`` samples continuing ``prompt_ids`` (``temperature = 0``: greedy; then n must be 1)."""
        if not prompt_ids:
            raise RolloutError("empty prompt")
        sampling = self._sampling(max_tokens, temperature, n, top_p, stop_token_ids, seed, ignore_eos)
        sampling["detokenize"] = False
        model = model or self.model
        body = {"token_ids": [int(t) for t in prompt_ids], "sampling_params": sampling, "model": model}
        with self.counted(model):
            response = await self._post_with_retries(GENERATE_PATH, body, session_id)
        completions = adapter_spans(parse_generate_response(response), model)
        if len(completions) != n:
            raise RolloutError(f"asked for {n} samples, engine returned {len(completions)}")
        return completions

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        session_id: str,
        max_tokens: int,
        temperature: float = 1.0,
        *,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
        model: str | None = None,
    ) -> list[Completion]:
        """One sample continuing each of ``prompts`` (in order), as one request. The completions carry
        no weight spans: use it where the policy version cannot change meanwhile (evaluation)."""
        if not prompts or any(not p for p in prompts):
            raise RolloutError("empty prompt")
        body = {
            **self._sampling(max_tokens, temperature, 1, top_p, stop_token_ids, seed, False),
            "prompt": [[int(t) for t in p] for p in prompts],
            "return_token_ids": True,
            "model": model or self.model,
        }
        with self.counted(body["model"]):
            completions = parse_completions_response(await self._post_with_retries(COMPLETIONS_PATH, body, session_id))
        if len(completions) != len(prompts):
            raise RolloutError(f"asked for {len(prompts)} completions, engine returned {len(completions)}")
        return completions

    @contextlib.contextmanager
    def counted(self, model: str):
        """``in_flight[model]`` while a request is under way. Entered with no await between reading
        the model name and counting it, so an unload never misses a request about to be sent."""
        self.in_flight[model] += 1
        try:
            yield
        finally:
            self.in_flight[model] -= 1
            if self.in_flight[model] <= 0:
                del self.in_flight[model]

    @staticmethod
    def _sampling(max_tokens, temperature, n, top_p, stop_token_ids, seed, ignore_eos) -> dict:
        sampling = {
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            "top_p": float(top_p),
            "n": int(n),
            "logprobs": 0,  # the sampled token's own logprob
        }
        if stop_token_ids:
            sampling["stop_token_ids"] = [int(t) for t in stop_token_ids]
        if seed is not None:
            sampling["seed"] = int(seed)
        if ignore_eos:
            sampling["ignore_eos"] = True
        return sampling

    async def _post_with_retries(self, path: str, body: dict, session_id: str) -> dict:
        headers = {"X-Session-ID": session_id}
        attempt = 0
        while True:
            failure: str
            try:
                async with self._semaphore:
                    response = await self._http.post(f"{self.router_url}{path}", json=body, headers=headers)
                if response.status_code == 200:
                    return response.json()
                if response.status_code not in RETRY_STATUS:
                    raise RolloutError(f"{path}: HTTP {response.status_code}: {response.text[:500]}")
                failure = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.TransportError as err:  # connection refused / reset, timeouts
                failure = f"{type(err).__name__}: {err}"
            if attempt >= self.max_retries:
                raise RolloutError(f"generate for session {session_id} failed after {attempt + 1} attempts: {failure}")
            attempt += 1
            self.retries += 1
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * (0.5 + random.random())
            log.warning("generate (session %s) failed (%s); retry %d in %.2f s", session_id, failure, attempt, delay)
            await self.finish_session(session_id)  # let the router re-place the session
            await asyncio.sleep(delay)

    # -------------------------------------------------------------------------- sessions
    async def finish_session(self, session_id: str) -> bool:
        """Release the session's engine pin on the router. Best effort: never raises."""
        try:
            response = await self._http.post(
                f"{self.router_url}/finish_session", params={"session_id": session_id}, timeout=10.0
            )
            return response.status_code == 200
        except httpx.HTTPError as err:
            log.warning("finish_session %s failed: %s", session_id, err)
            return False

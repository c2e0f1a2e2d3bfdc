"""Sampling on vLLM engines with runtime LoRA adapters (the RL stage's inference layer).

A sampler checkpoint (a PEFT directory) becomes a vLLM adapter named after it; it is loaded on
every engine (``/v1/load_lora_adapter``, which the router does not forward) the first time a
sample asks for it, so engines that restart with the server pick their adapters up again. Samples
go through ``sample_url`` (the router, or a single engine) as ``/v1/completions`` with the prompt
as token ids and ``model`` = the adapter name (or the engines' base-model name), so samples of
many adapters share the engines' batches.

Prompt logprobs (``prompt_logprobs``, ``topk_prompt_logprobs``; ``compute_logprobs`` is a sample
with ``max_tokens=1`` and ``prompt_logprobs``) come from the same request's prefill: vLLM's
``prompt_logprobs = k`` gives at every prompt position the prompt token's logprob and the k most
likely tokens'. They are the model's own distribution (vLLM scores prompt tokens before any
sampling processor: no temperature, top-k or top-p), in the engines' dtype. The prompt is scored
by a request of its own (``n=1``, one token) that runs alone on the engines (``Gate``: a vLLM 0.32
bug with LoRA); with ``max_tokens=1`` and one sample that request is the sample too.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from backends.tinker.wire import PromptScores, Sampled

log = logging.getLogger(__name__)


class SamplingError(RuntimeError):
    pass


def adapter_name(run_id: str, kind: str, name: str, created: float) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{run_id}.{kind}.{name}.{int(created * 1000)}")


@dataclass(frozen=True)
class SampleJob:
    model: str  # adapter name or the base model's served name
    adapter_dir: str | None
    prompt: Sequence[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: object
    prompt_logprobs: bool
    topk_prompt_logprobs: int = 0  # the k most likely tokens at every prompt position (0: none)
    prompt_logprobs_last_n: int | None = None  # score only the last n prompt tokens

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_logprobs or self.topk_prompt_logprobs > 0


class Sampler:
    def __init__(self, sample_url: str, engine_urls: Sequence[str], timeout_s: float = 120.0):
        self.sample_url = sample_url.rstrip("/")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.http = httpx.AsyncClient(timeout=timeout_s)
        self._loaded: dict[str, set[str]] = {}  # adapter name -> engines that hold it
        self._locks: dict[str, asyncio.Lock] = {}
        self._gate = Gate()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def ensure_adapter(self, name: str, adapter_dir: str) -> None:
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            have = self._loaded.setdefault(name, set())
            missing = [u for u in self.engine_urls if u not in have]

            async def load(url: str) -> None:
                body = {"lora_name": name, "lora_path": adapter_dir, "load_inplace": True}
                response = await self.http.post(f"{url}/v1/load_lora_adapter", json=body)
                if response.status_code != 200:
                    raise SamplingError(f"engine {url} refused adapter {name}: {response.text[:300]}")
                have.add(url)

            await asyncio.gather(*(load(u) for u in missing))

    async def sample(self, job: SampleJob) -> tuple[list[Sampled], PromptScores | None]:
        try:
            return await self._sample(job)
        except SamplingError as err:
            if job.adapter_dir is None or "404" not in str(err):
                raise
            # an engine restarted (recovery) and lost its runtime adapters: load them again
            self._loaded.pop(job.model, None)
            return await self._sample(job)

    async def _sample(self, job: SampleJob) -> tuple[list[Sampled], PromptScores | None]:
        if job.adapter_dir is not None:
            await self.ensure_adapter(job.model, job.adapter_dir)
        body: dict = {
            "model": job.model,
            "prompt": list(job.prompt),
            "max_tokens": job.max_tokens,
            "temperature": job.temperature,
            "top_p": job.top_p,
            "top_k": job.top_k,
            "logprobs": 0,
            "return_token_ids": True,
        }
        if job.seed is not None:
            body["seed"] = job.seed
        stop = job.stop
        if isinstance(stop, str):
            body["stop"] = [stop]
        elif isinstance(stop, list) and stop and all(isinstance(s, int) for s in stop):
            body["stop_token_ids"] = stop
        elif isinstance(stop, list) and stop:
            body["stop"] = stop
        prompt_scores = None
        if job.scores_prompt:
            # the prompt's scores from a request of its own (n=1, one token), alone on the engines
            scoring = dict(body, n=1, max_tokens=1, prompt_logprobs=job.topk_prompt_logprobs)
            async with self._gate.alone():
                choice = (await self._post(scoring))["choices"][0]
            prompt_scores = _prompt_scores(job, choice.get("prompt_logprobs"))
            if job.num_samples == 1 and job.max_tokens == 1:  # compute_logprobs: that was the sample too
                return [_sampled(choice)], prompt_scores
        # Greedy and several samples: vLLM wants n=1 per request then.
        if job.temperature > 0 or job.num_samples == 1:
            bodies = [dict(body, n=job.num_samples)]
        else:
            bodies = [dict(body, n=1) for _ in range(job.num_samples)]
        async with self._gate.together():
            responses = await asyncio.gather(*(self._post(b) for b in bodies))
        sequences = [_sampled(choice) for response in responses for choice in response["choices"]]
        return sequences, prompt_scores

    async def _post(self, body: dict) -> dict:
        try:
            response = await self.http.post(f"{self.sample_url}/v1/completions", json=body)
        except httpx.HTTPError as err:
            raise SamplingError(f"engine unreachable at {self.sample_url}: {err}") from None
        if response.status_code != 200:
            raise SamplingError(f"engine answered {response.status_code}: {response.text[:300]}")
        return response.json()


def _sampled(choice: dict) -> Sampled:
    tokens = [int(t) for t in choice.get("token_ids") or []]
    lps = (choice.get("logprobs") or {}).get("token_logprobs")
    logprobs = [float(x) if x is not None else float("nan") for x in lps] if lps is not None else None
    if logprobs is not None and len(logprobs) != len(tokens):
        logprobs = None
    reason = "length" if choice.get("finish_reason") == "length" else "stop"
    return Sampled(tokens, logprobs, reason)


class Gate:
    """Requests that may share the engines' batches (``together``), and requests that must be alone
    in them (``alone``: it waits for those in flight to finish, and holds new ones back until done).

    Prompt logprobs need ``alone``: vLLM 0.32 computes them with the LoRA ``lm_head`` mapping of the
    batch's sampling rows (one per request), not of the prompt's rows, so a prompt scored in a batch
    of several requests kills the engine (``einsum(): subscript b has size 2 ... size 9``, seen with
    two concurrent ``compute_logprobs``) or, when the counts happen to agree, applies other requests'
    adapters to its rows. Alone, its one row of the mapping holds for all its positions. Every
    request to the engines goes through this server's ``Sampler``, so the gate sees them all."""

    def __init__(self):
        self._changed = asyncio.Condition()
        self._together = 0
        self._alone = False
        self._waiting_alone = 0

    @asynccontextmanager
    async def together(self):
        async with self._changed:
            await self._changed.wait_for(lambda: not self._alone and not self._waiting_alone)
            self._together += 1
        try:
            yield
        finally:
            async with self._changed:
                self._together -= 1
                self._changed.notify_all()

    @asynccontextmanager
    async def alone(self):
        async with self._changed:
            self._waiting_alone += 1
            try:
                await self._changed.wait_for(lambda: not self._alone and not self._together)
            finally:
                self._waiting_alone -= 1
            self._alone = True
        try:
            yield
        finally:
            async with self._changed:
                self._alone = False
                self._changed.notify_all()


def _prompt_scores(job: SampleJob, entries) -> PromptScores:
    """vLLM's per-position ``{token_id: {logprob, rank, ...}}`` (None at position 0) as the logprob
    of each prompt token and, with ``topk_prompt_logprobs = k``, the k most likely tokens. vLLM
    lists the prompt token too, also when it is not among the k: it is left out then."""
    prompt = list(job.prompt)
    k = job.topk_prompt_logprobs
    first = len(prompt) - job.prompt_logprobs_last_n if job.prompt_logprobs_last_n else 0
    logprobs: list[float | None] = []
    topk: list[list[tuple[int, float]] | None] = []
    for position, token in enumerate(prompt):
        entry = entries[position] if entries and position < len(entries) else None
        if not entry or position < first:
            logprobs.append(None)
            topk.append(None)
            continue
        item = entry.get(str(token)) or entry.get(token)
        logprobs.append(float(item["logprob"]) if item else None)
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].get("rank") or math.inf, -float(kv[1]["logprob"])))
        topk.append([(int(t), float(v["logprob"])) for t, v in ranked[:k]])
    return PromptScores(logprobs if job.prompt_logprobs else None, topk if k > 0 else None, k)

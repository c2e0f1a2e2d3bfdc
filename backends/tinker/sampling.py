"""Sampling on vLLM engines with runtime LoRA adapters (the RL stage's inference layer).

A sampler checkpoint (a PEFT directory) becomes a vLLM adapter named after it; it is loaded on
every engine (``/v1/load_lora_adapter``, which the router does not forward) the first time a
sample asks for it, so engines that restart with the server pick their adapters up again. Samples
go through ``sample_url`` (the router, or a single engine) as ``/v1/completions`` with the prompt
as token ids and ``model`` = the adapter name (or the engines' base-model name), so samples of
many adapters share the engines' batches.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from backends.tinker.wire import Sampled

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


class Sampler:
    def __init__(self, sample_url: str, engine_urls: Sequence[str], timeout_s: float = 120.0):
        self.sample_url = sample_url.rstrip("/")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.http = httpx.AsyncClient(timeout=timeout_s)
        self._loaded: dict[str, set[str]] = {}  # adapter name -> engines that hold it
        self._locks: dict[str, asyncio.Lock] = {}

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

    async def sample(self, job: SampleJob) -> tuple[list[Sampled], list[float | None] | None]:
        try:
            return await self._sample(job)
        except SamplingError as err:
            if job.adapter_dir is None or "404" not in str(err):
                raise
            # an engine restarted (recovery) and lost its runtime adapters: load them again
            self._loaded.pop(job.model, None)
            return await self._sample(job)

    async def _sample(self, job: SampleJob) -> tuple[list[Sampled], list[float | None] | None]:
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
        # Greedy and several samples: vLLM wants n=1 per request then.
        if job.temperature > 0 or job.num_samples == 1:
            bodies = [dict(body, n=job.num_samples)]
        else:
            bodies = [dict(body, n=1) for _ in range(job.num_samples)]
        if job.prompt_logprobs:
            bodies[0]["prompt_logprobs"] = 0
        responses = await asyncio.gather(*(self._post(b) for b in bodies))
        sequences: list[Sampled] = []
        prompt_logprobs = None
        for index, response in enumerate(responses):
            for choice in response["choices"]:
                tokens = [int(t) for t in choice.get("token_ids") or []]
                lps = (choice.get("logprobs") or {}).get("token_logprobs")
                logprobs = [float(x) if x is not None else float("nan") for x in lps] if lps is not None else None
                if logprobs is not None and len(logprobs) != len(tokens):
                    logprobs = None
                reason = "length" if choice.get("finish_reason") == "length" else "stop"
                sequences.append(Sampled(tokens, logprobs, reason))
                if index == 0 and job.prompt_logprobs and prompt_logprobs is None:
                    prompt_logprobs = _prompt_logprobs(list(job.prompt), choice.get("prompt_logprobs"))
        return sequences, prompt_logprobs

    async def _post(self, body: dict) -> dict:
        try:
            response = await self.http.post(f"{self.sample_url}/v1/completions", json=body)
        except httpx.HTTPError as err:
            raise SamplingError(f"engine unreachable at {self.sample_url}: {err}") from None
        if response.status_code != 200:
            raise SamplingError(f"engine answered {response.status_code}: {response.text[:300]}")
        return response.json()


def _prompt_logprobs(prompt: list[int], entries) -> list[float | None]:
    """vLLM's per-position ``{token_id: {logprob, ...}}`` as the logprob of each prompt token."""
    out: list[float | None] = []
    for position, token in enumerate(prompt):
        entry = entries[position] if entries and position < len(entries) else None
        if not entry:
            out.append(None)
            continue
        item = entry.get(str(token)) or entry.get(token)
        out.append(float(item["logprob"]) if item else None)
    return out

"""Requests to an auxiliary model's engines (a teacher, a judge: ``skyrl_contracts.auxiliary``): to the
engine with the fewest requests in flight, at most ``max_concurrency`` at once, retried like a
rollout request (connection errors, timeouts, 5xx, 429) with jittered exponential backoff. A
request that still fails, or one the engine refuses, raises the caller's error class."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Sequence

import httpx

log = logging.getLogger("skyrl.orchestrator")

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


def shorten(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class AuxiliaryEngines:
    """``post(path, body)``: the JSON answer of one of ``urls``. ``name`` leads error messages and
    warnings ("teacher", "judge"); ``error``: the exception class raised when no answer comes."""

    def __init__(
        self,
        name: str,
        urls: Sequence[str],
        error: type[Exception],
        *,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_concurrency: int = 64,
    ):
        if not urls:
            raise ValueError(f"a {name} needs at least one engine URL")
        self.name, self.error = name, error
        self.urls = [u.rstrip("/") for u in urls]
        self.in_flight = {u: 0 for u in self.urls}
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    @staticmethod
    def settings(recipe) -> dict:
        """The keyword arguments the recipe's rollout client settings give (``[inference]``)."""
        inf = recipe.inference
        return {
            "timeout_s": inf.request_timeout_s,
            "max_retries": inf.max_retries,
            "max_concurrency": inf.max_concurrency,
        }

    async def aclose(self) -> None:
        await self.http.aclose()

    async def post(self, path: str, body: dict) -> dict:
        attempt = 0
        while True:
            url = min(self.urls, key=lambda u: self.in_flight[u])
            self.in_flight[url] += 1
            try:
                async with self._semaphore:
                    response = await self.http.post(f"{url}{path}", json=body)
                if response.status_code == 200:
                    return response.json()
                if response.status_code not in RETRY_STATUS:
                    raise self.error(f"{self.name} {url}: HTTP {response.status_code}: {shorten(response.text, 300)}")
                failure = f"HTTP {response.status_code}"
            except httpx.TransportError as err:
                failure = f"{type(err).__name__}: {err}"
            finally:
                self.in_flight[url] -= 1
            if attempt >= self.max_retries:
                raise self.error(f"{self.name} {url}: no answer after {attempt + 1} attempts: {failure}")
            attempt += 1
            delay = self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random())
            log.warning("%s %s failed (%s); retry %d in %.2f s", self.name, url, failure, attempt, delay)
            await asyncio.sleep(delay)

"""Requests to an auxiliary model's engines (a teacher, a judge: ``skyrl_contracts.auxiliary``): to the
engine with the fewest requests in flight, at most ``max_concurrency`` at once, retried like a
rollout request (connection errors, timeouts, 5xx, 429) with jittered exponential backoff. A
request that still fails, or one the engine refuses (another 4xx: at once), raises the caller's
error class.

An engine that dies is restarted by the run's engine recovery (``skyrl_cli.engines.recovery``:
about 12-25 s on CPU, minutes on GPUs). Meanwhile a request that cannot reach it (connection
refused, reset, or cut off) goes to another engine of the model; when none of them can be reached,
the request waits for one, retrying with backoff capped at ``MAX_BACKOFF_S``, for up to
``OUTAGE_S`` (``outage_s``) without counting against ``max_retries``: a restart delays the model's
answers instead of failing them. An engine that refused a connection is passed over for
``DOWN_S`` while another one answers."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Sequence

import httpx

log = logging.getLogger("skyrl.orchestrator")

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
# How long a request waits while no engine of the model can be reached: longer than a restart by
# engine recovery on CPU (12-25 s) and on GPUs (model load, graph capture: minutes). A model whose
# engines stay down past it fails the request; a run whose recovery gives up ends before.
OUTAGE_S = 300.0
MAX_BACKOFF_S = 5.0  # the cap of the backoff between the tries of a request that waits for an engine
DOWN_S = 5.0  # how long an engine that refused a connection is passed over while another answers
OUTAGE_LOG_S = 10.0  # one warning per this many seconds while requests wait
# The engine cannot be reached, or went away mid-request: it is down (dead, or restarting).
UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


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
        outage_s: float = OUTAGE_S,
    ):
        if not urls:
            raise ValueError(f"a {name} needs at least one engine URL")
        self.name, self.error = name, error
        self.urls = [u.rstrip("/") for u in urls]
        self.in_flight = {u: 0 for u in self.urls}
        self.down: dict[str, float] = {}  # url -> when it last could not be reached
        self.max_retries, self.backoff_s, self.outage_s = max_retries, backoff_s, outage_s
        self._outage_logged = float("-inf")
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

    def _is_down(self, url: str, now: float) -> bool:
        return now - self.down.get(url, float("-inf")) < DOWN_S

    def _pick(self) -> str:
        """The engine with the fewest requests in flight, among those not down if any."""
        now = time.monotonic()
        up = [u for u in self.urls if not self._is_down(u, now)]
        return min(up or self.urls, key=lambda u: self.in_flight[u])

    async def post(self, path: str, body: dict) -> dict:
        attempt, waits, waiting_since = 0, 0, None
        while True:
            url = self._pick()
            self.in_flight[url] += 1
            unreachable = False
            try:
                async with self._semaphore:
                    response = await self.http.post(f"{url}{path}", json=body)
                self.down.pop(url, None)
                if response.status_code == 200:
                    return response.json()
                if response.status_code not in RETRY_STATUS:
                    raise self.error(f"{self.name} {url}: HTTP {response.status_code}: {shorten(response.text, 300)}")
                failure = f"HTTP {response.status_code}"
            except UNREACHABLE as err:
                failure, unreachable = f"{type(err).__name__}: {err}", True
                self.down[url] = time.monotonic()
            except httpx.TransportError as err:
                failure = f"{type(err).__name__}: {err}"
            finally:
                self.in_flight[url] -= 1
            now = time.monotonic()
            if unreachable and all(self._is_down(u, now) for u in self.urls):
                # No engine of the model can be reached: wait for the recovery to bring one back.
                waiting_since = waiting_since if waiting_since is not None else now
                if now - waiting_since >= self.outage_s:
                    raise self.error(
                        f"{self.name}: no engine could be reached for {now - waiting_since:.1f} s "
                        f"(last: {url}: {failure})"
                    )
                waits += 1
                delay = min(MAX_BACKOFF_S, max(self.backoff_s, 0.05) * 2 ** (waits - 1)) * (0.5 + random.random())
                if now - self._outage_logged >= OUTAGE_LOG_S:
                    self._outage_logged = now
                    log.warning(
                        "%s: no engine can be reached (%s: %s); requests wait up to %.0f s for one to come back",
                        self.name,
                        url,
                        failure,
                        self.outage_s,
                    )
                await asyncio.sleep(delay)
                continue
            waiting_since = None
            if attempt >= self.max_retries:
                raise self.error(f"{self.name} {url}: no answer after {attempt + 1} attempts: {failure}")
            attempt += 1
            delay = self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random())
            log.warning("%s %s failed (%s); retry %d in %.2f s", self.name, url, failure, attempt, delay)
            await asyncio.sleep(delay)

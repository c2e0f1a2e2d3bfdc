"""A fault proxy for the network tests: an HTTP server that forwards every request to one real engine
and, on the generation routes only, answers a seeded fraction of them with a 5xx or holds them back
first (a slow engine). Health checks and admin calls (weight reloads, version labels) pass through
untouched, so the router keeps the engine in rotation and weight syncs work.

    with FaultProxy(engine_url, fail_fraction=0.2, delay_fraction=0.1, delay_s=6) as proxy:
        ... inference.urls = [proxy.url] ...
        proxy.failed, proxy.delayed, proxy.forwarded   # what it did

An ASGI app (uvicorn, in a thread) forwarding with httpx: both are dependencies of the project.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx

GENERATION_PATHS = ("/inference/v1/generate", "/v1/completions")
# Headers that describe one hop's connection or body encoding, not the message.
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"})


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        fail_fraction: float = 0.0,
        fail_status: int = 503,
        delay_fraction: float = 0.0,
        delay_s: float = 0.0,
        seed: int = 0,
    ):
        self.upstream = upstream.rstrip("/")
        self.fail_fraction, self.fail_status = fail_fraction, fail_status
        self.delay_fraction, self.delay_s = delay_fraction, delay_s
        self.rng = random.Random(seed)
        self.failed = self.delayed = self.forwarded = 0
        self.url = ""
        self._server = None
        self._thread: threading.Thread | None = None

    def _fault(self, path: str) -> str | None:
        if path not in GENERATION_PATHS:
            return None
        draw = self.rng.random()
        if draw < self.fail_fraction:
            return "fail"
        if draw < self.fail_fraction + self.delay_fraction:
            return "delay"
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        fault = self._fault(scope["path"])
        if fault == "fail":
            self.failed += 1
            await _answer(send, self.fail_status, [(b"content-type", b"text/plain")], b"injected fault")
            return
        if fault == "delay":
            self.delayed += 1
            await asyncio.sleep(self.delay_s)
        query = scope.get("query_string", b"").decode()
        url = f"{self.upstream}{scope['path']}" + (f"?{query}" if query else "")
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k.decode().lower() not in HOP_HEADERS]
        try:
            async with httpx.AsyncClient(timeout=None) as client:
                response = await client.request(scope["method"], url, content=body, headers=headers)
        except httpx.HTTPError as err:  # the client of a delayed request gave up meanwhile, or the engine is gone
            await _answer(send, 502, [(b"content-type", b"text/plain")], str(err).encode())
            return
        self.forwarded += 1
        out = [(k.encode(), v.encode()) for k, v in response.headers.items() if k.lower() not in HOP_HEADERS]
        await _answer(send, response.status_code, out, response.content)

    def __enter__(self) -> "FaultProxy":
        import uvicorn

        from skyrl_contracts.ports import find_free_ports

        (port,) = find_free_ports(1)
        config = uvicorn.Config(
            self, host="127.0.0.1", port=port, log_level="warning", lifespan="off", access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="fault-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "the fault proxy did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


async def _answer(send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

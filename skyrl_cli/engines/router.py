"""vllm-router's control routes: worker membership and loads (synchronous; used by the recovery
loop and the driver, not on the rollout hot path)."""

from __future__ import annotations

import time

import httpx

from skyrl_contracts.errors import SkyrlError


class RouterAdmin:
    def __init__(self, router_url: str, timeout_s: float = 10.0):
        self.url = router_url.rstrip("/")
        self.http = httpx.Client(timeout=timeout_s)

    def _check(self, response: httpx.Response, what: str) -> httpx.Response:
        if response.status_code >= 300:
            raise SkyrlError(f"router {what}: HTTP {response.status_code}: {response.text[:300]}")
        return response

    def list_workers(self) -> list[str]:
        return [
            u.rstrip("/") for u in self._check(self.http.get(f"{self.url}/list_workers"), "list_workers").json()["urls"]
        ]

    def add_worker(self, worker_url: str) -> None:
        self._check(self.http.post(f"{self.url}/add_worker", params={"url": worker_url}), f"add_worker {worker_url}")

    def remove_worker(self, worker_url: str) -> None:
        self._check(
            self.http.post(f"{self.url}/remove_worker", params={"url": worker_url}), f"remove_worker {worker_url}"
        )

    def ensure_worker(self, worker_url: str, timeout_s: float = 30.0) -> None:
        """Put ``worker_url`` in rotation, whether or not the router still lists it (its own health
        checker may or may not have dropped a worker that died), and wait until it is listed."""
        url = worker_url.rstrip("/")
        if url not in self.list_workers():
            try:
                self.add_worker(url)
            except SkyrlError:
                if url not in self.list_workers():  # added concurrently: fine; otherwise a real failure
                    raise
        self.wait_for_workers([url], timeout_s)

    def get_loads(self) -> dict:
        return self._check(self.http.get(f"{self.url}/get_loads"), "get_loads").json()

    def wait_for_workers(self, worker_urls, timeout_s: float = 30.0) -> None:
        """Block until every url is in the rotation (membership changes apply asynchronously)."""
        wanted = {u.rstrip("/") for u in worker_urls}
        deadline = time.monotonic() + timeout_s
        while not wanted <= set(self.list_workers()):
            if time.monotonic() > deadline:
                raise SkyrlError(f"router never listed {sorted(wanted - set(self.list_workers()))}")
            time.sleep(0.2)

    def close(self) -> None:
        self.http.close()

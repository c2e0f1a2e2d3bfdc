"""Engine recovery: a dead engine is noticed, taken out of the router, restarted with the current
weights, and put back; the run goes on.

A local engine counts as dead when its process exited or its ``/health`` failed
``health_failures`` times in a row (a hung engine is killed and restarted the same way). Then:

1. ``/remove_worker`` on the router: no new session is placed on it. Requests in flight on it fail
   and the rollout client retries them; its retry releases the session pin first, so the router
   places the session on a live engine.
2. The supervisor restarts the process (same spec: same port, core and flags) and waits for
   ``/health``.
3. The engine loads the current weights (``<run_dir>/weights/current.json``, the latest synced
   directory and version) through the normal reload path; if a newer sync was recorded meanwhile,
   it loads that too.
4. ``/add_worker``: back in rotation.

Remote engines (``inference.urls``) cannot be restarted from here: they are removed while their
health fails and brought up to date and added back when it passes again.

The supervisor is passed in (duck-typed: ``poll()``, ``restart(name)``, ``wait_ready([name],
timeout_s)``) because backends do not import the launch layer. Restarts happen on the recovery
thread, which must live as long as the run (the supervisor's children get PR_SET_PDEATHSIG tied to
the thread that started them).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Mapping, Sequence

import httpx

from backends.inference.router import RouterAdmin
from backends.inference.weight_sync import bring_up_to_date, read_current_weights, run_blocking
from skyrl_cli.metrics.events import EventWriter

log = logging.getLogger(__name__)


class EngineRecovery:
    def __init__(
        self,
        supervisor,
        engines: Mapping[str, str],
        router_url: str,
        run_dir: str | os.PathLike,
        *,
        remote_urls: Sequence[str] = (),
        period_s: float = 1.0,
        health_failures: int = 3,
        ready_timeout_s: float = 600.0,
        max_restarts: int = 10,
        writer: EventWriter | None = None,
        step_fn: Callable[[], int] = lambda: 0,
    ):
        self.supervisor = supervisor
        self.engines = dict(engines)  # process name -> url
        self.remote_urls = [u.rstrip("/") for u in remote_urls]
        self.router = RouterAdmin(router_url)
        self.run_dir = run_dir
        self.period_s = period_s
        self.health_failures = health_failures
        self.ready_timeout_s = ready_timeout_s
        self.max_restarts = max_restarts
        self.writer = writer
        self.step_fn = step_fn
        self.restarts: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._removed_remote: set[str] = set()
        self._http = httpx.Client(timeout=5.0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.recovering = threading.Event()  # set while an engine is being brought back

    # ------------------------------------------------------------------ checks
    def _healthy(self, url: str) -> bool:
        try:
            return self._http.get(f"{url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _dead(self, name: str, url: str) -> bool:
        if self.supervisor.poll().get(name) is not None:
            return True
        if self._healthy(url):
            self._failures[name] = 0
            return False
        self._failures[name] = self._failures.get(name, 0) + 1
        return self._failures[name] >= self.health_failures

    def check_once(self) -> list[str]:
        """One pass over all engines; returns the names of local engines recovered in it."""
        recovered = []
        for name, url in self.engines.items():
            if self._stop.is_set():
                break
            if self.restarts.get(name, 0) >= self.max_restarts or not self._dead(name, url):
                continue
            if self._recover_local(name, url):
                recovered.append(name)
        for url in self.remote_urls:
            self._check_remote(url)
        return recovered

    # ------------------------------------------------------------------ actions
    def _remove(self, url: str) -> None:
        try:
            self.router.remove_worker(url)
        except Exception as err:  # noqa: BLE001 - the router may already have dropped it
            log.warning("router remove_worker %s: %s", url, err)

    def _load_current_weights(self, url: str) -> None:
        while True:
            current = read_current_weights(self.run_dir)
            run_blocking(bring_up_to_date([url], current))
            if read_current_weights(self.run_dir) == current:
                return

    def _recover_local(self, name: str, url: str) -> bool:
        self.recovering.set()
        started = time.monotonic()
        self.restarts[name] = self.restarts.get(name, 0) + 1
        log.warning("engine %s (%s) is down; restarting (restart %d)", name, url, self.restarts[name])
        try:
            self._remove(url)
            self.supervisor.restart(name)
            self.supervisor.wait_ready([name], timeout_s=self.ready_timeout_s)
            self._load_current_weights(url)
            self.router.ensure_worker(url)
        except Exception as err:  # noqa: BLE001 - try again at the next pass
            log.error("recovery of %s failed: %s", name, err)
            return False
        finally:
            self.recovering.clear()
        self._failures[name] = 0
        seconds = time.monotonic() - started
        log.warning("engine %s is back after %.1f s", name, seconds)
        if self.writer is not None:
            self.writer.log(
                self.step_fn(), {"engine/restarts": float(sum(self.restarts.values())), "timing/engine_recovery_s": seconds}
            )
        return True

    def _check_remote(self, url: str) -> None:
        healthy = self._healthy(url)
        if not healthy and url not in self._removed_remote:
            log.warning("remote engine %s is unhealthy; removing it from the router", url)
            self._remove(url)
            self._removed_remote.add(url)
        elif healthy and url in self._removed_remote:
            try:
                self._load_current_weights(url)
                self.router.ensure_worker(url)
                self._removed_remote.discard(url)
                log.warning("remote engine %s is back in the router", url)
            except Exception as err:  # noqa: BLE001
                log.error("re-adding remote engine %s failed: %s", url, err)

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check_once()
            except Exception as err:  # noqa: BLE001 - the loop must survive anything
                log.error("engine recovery loop: %s", err)

    def start(self) -> "EngineRecovery":
        self._thread = threading.Thread(target=self._run, name="engine-recovery", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self._http.close()
        self.router.close()

"""Engine recovery: a dead engine is noticed, taken out of the router, restarted with the current
weights, and put back; the run goes on.

A local engine counts as dead when its process exited or its ``/health`` failed
``health_failures`` times in a row (a hung engine is killed and restarted the same way). Then:

1. ``/remove_worker`` on the router: no new session is placed on it. Requests in flight on it fail
   and the rollout client retries them; its retry releases the session pin first, so the router
   places the session on a live engine.
2. The supervisor restarts the process (same spec: same port, core and flags) and waits for
   ``/health``. Engines found dead in the same pass (several killed at once) are all restarted
   before any is waited for, so their start-ups overlap.
3. The engine loads the current weights (``<run_dir>/weights/current.json``, the latest synced
   directory and version) through the normal reload path; if a newer sync was recorded meanwhile,
   it loads that too.
4. ``/add_worker``: back in rotation.

The router (``router_name``, a local process) is watched the same way: when it exits it is
restarted with the same spec (same port, every engine in its worker list), engines that are down
are taken out again, and rollouts, which retry, go on through it. ``gave_up()`` says when the router
or every local engine has died more than ``max_restarts`` times: the run cannot go on then.

The engines of the auxiliary models (``auxiliaries``: a teacher's ``teacher-<i>``, a judge's
``judge-<i>``; ``skyrl_contracts.auxiliary``) are watched the same way and restarted with the same
spec, but they are behind no router and hold no policy weights: nothing is removed, loaded or
added. The orchestrator's requests to them wait out the restart
(``backends.rollout.auxiliary.OUTAGE_S``). Their restarts count in ``engine/restarts`` (all
restarts of engines) and ``auxiliary/restarts`` (theirs alone), with ``timing/engine_recovery_s``.
``gave_up()`` also says when an auxiliary model has no engine left (each of them died
``max_restarts`` times): its requests could never be answered.

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

from backends.inference.weight_sync import bring_up_to_date, read_current_weights, run_blocking
from skyrl_cli.engines.router import RouterAdmin
from skyrl_cli.launch.supervisor import Supervisor
from skyrl_contracts.auxiliary import model_of
from skyrl_contracts.events import EventWriter

log = logging.getLogger(__name__)


class EngineRecovery:
    def __init__(
        self,
        supervisor: Supervisor,
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
        router_name: str | None = None,
        auxiliaries: Mapping[str, str] | None = None,
    ):
        self.supervisor = supervisor
        self.router_name = router_name
        self.engines = dict(engines)  # process name -> url
        self.auxiliaries = dict(auxiliaries or {})  # process name (<model>-<i>) -> url
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
        """One pass over the router and all engines; returns the names of local processes
        recovered in it. Engines found dead in the same pass (an OOM kill of several) are all
        restarted first, then each waited for: their start-ups overlap."""
        recovered = [self.router_name] if self._check_router() else []
        dead = []
        for name, url in [*self.engines.items(), *self.auxiliaries.items()]:
            if self._stop.is_set():
                break
            if self.restarts.get(name, 0) < self.max_restarts and self._dead(name, url):
                dead.append((name, url))
        try:
            restarted = [(name, url, self._restart(name, url)) for name, url in dead]
            for name, url, started in restarted:
                if started is not None and self._bring_back(name, url, started):
                    recovered.append(name)
        finally:
            self.recovering.clear()
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

    def _restart(self, name: str, url: str) -> float | None:
        """Take a dead engine out of the router (a policy engine) and start it again; when it was
        started (``time.monotonic()``), or None when that failed (tried again at the next pass)."""
        self.recovering.set()
        started = time.monotonic()
        self.restarts[name] = self.restarts.get(name, 0) + 1
        what = "auxiliary engine" if name in self.auxiliaries else "engine"
        log.warning("%s %s (%s) is down; restarting (restart %d)", what, name, url, self.restarts[name])
        try:
            if name in self.engines:
                self._remove(url)
            self.supervisor.restart(name)
        except Exception as err:  # noqa: BLE001 - try again at the next pass
            log.error("recovery of %s failed: %s", name, err)
            return None
        return started

    def _bring_back(self, name: str, url: str, started: float) -> bool:
        """Wait for a restarted engine; a policy engine then loads the current weights and goes back
        into the router (an auxiliary model's has neither: it serves its model as it started)."""
        try:
            self.supervisor.wait_ready([name], timeout_s=self.ready_timeout_s)
            if name in self.engines:
                self._load_current_weights(url)
                self.router.ensure_worker(url)
        except Exception as err:  # noqa: BLE001 - try again at the next pass
            log.error("recovery of %s failed: %s", name, err)
            return False
        self._failures[name] = 0
        seconds = time.monotonic() - started
        log.warning(
            "%s %s is back after %.1f s", "auxiliary engine" if name in self.auxiliaries else "engine", name, seconds
        )
        if self.writer is not None:
            metrics = {"engine/restarts": self._engine_restarts(), "timing/engine_recovery_s": seconds}
            if name in self.auxiliaries:
                metrics["auxiliary/restarts"] = float(sum(self.restarts.get(n, 0) for n in self.auxiliaries))
            self.writer.log(self.step_fn(), metrics)
        return True

    def _engine_restarts(self) -> float:
        """``engine/restarts``: the run's restarts of engines, the policy's and the auxiliary models'."""
        return float(sum(count for name, count in self.restarts.items() if name != self.router_name))

    def _check_router(self) -> bool:
        """Restart the router if its process exited; True when it was brought back."""
        name = self.router_name
        if name is None or self._stop.is_set() or self.supervisor.poll().get(name) is None:
            return False
        if self.restarts.get(name, 0) >= self.max_restarts:
            return False
        self.recovering.set()
        started = time.monotonic()
        self.restarts[name] = self.restarts.get(name, 0) + 1
        log.warning("router %s exited; restarting (restart %d)", name, self.restarts[name])
        try:
            self.supervisor.restart(name)
            self.supervisor.wait_ready([name], timeout_s=self.ready_timeout_s)
            for url in self.engines.values():  # it starts with all of them in rotation
                if not self._healthy(url):
                    self._remove(url)
        except Exception as err:  # noqa: BLE001 - try again at the next pass
            log.error("recovery of the router failed: %s", err)
            return False
        finally:
            self.recovering.clear()
        seconds = time.monotonic() - started
        log.warning("router %s is back after %.1f s", name, seconds)
        if self.writer is not None:
            self.writer.log(
                self.step_fn(), {"router/restarts": float(self.restarts[name]), "timing/router_recovery_s": seconds}
            )
        return True

    def gave_up(self) -> str | None:
        """Why the run cannot go on (the router, every local engine, or every engine of one
        auxiliary model is down and was restarted ``max_restarts`` times already); None while it can."""
        poll = self.supervisor.poll()
        exhausted = [
            n
            for n in (self.router_name, *self.engines, *self.auxiliaries)
            if n is not None and poll.get(n) is not None and self.restarts.get(n, 0) >= self.max_restarts
        ]
        lost = [self.router_name] if self.router_name in exhausted else []
        if self.engines and set(self.engines) <= set(exhausted):
            lost += list(self.engines)
        for names in auxiliary_models(self.auxiliaries).values():
            if set(names) <= set(exhausted):
                lost += names
        if lost:
            logs = ", ".join(str(self.supervisor.processes[n].log_path) for n in lost)
            return f"{', '.join(lost)} died after {self.max_restarts} restarts; log: {logs}"
        return None

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


def auxiliary_models(names) -> dict[str, list[str]]:
    """Auxiliary engine process names by their model: ``teacher-0``, ``teacher-1`` -> ``teacher``."""
    models: dict[str, list[str]] = {}
    for name in names:
        models.setdefault(model_of(name), []).append(name)
    return models

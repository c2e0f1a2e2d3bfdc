"""Engine pools: a recipe's vLLM engines and router that outlive a run (``skyrl engines up``), so
that the runs after the first skip vLLM's start-up (20-26 s of two processes importing torch and
vLLM on CPU; minutes on GPUs: weights, graph capture).

A pool lives in ``<pools>/<name>/`` (``SKYRL_POOLS_DIR``, default ``~/.cache/skyrl/pools``):

- ``pool.json``: what ``skyrl engines status`` shows and a run needs: the specs, pids, URLs and logs
  of the engines, the auxiliary models' engines (a teacher, a judge) and the router, the engines'
  flags and model shape (what a run must match, ``skyrl_cli.plan.pool``), since when;
- ``engine-model/``: the model the engines booted from; ``logs/``: their output;
- ``lock``: held (``flock``) by the run using the pool, so two runs never share one; ``holder.json``
  says which run.

A run that attaches (``skyrl rl`` finds a pool that fits, or ``--pool NAME``) takes the lock, adopts
the pool's processes into its supervisor (watched and restarted by the run's engine recovery, as its
own would be, but never torn down with it), loads its own initial weights into the engines and
clears their prefix caches (LoRA: unloads the previous run's adapters). When it ends, the pool
keeps running, serving whatever the run left loaded, until the next run loads its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import httpx

from backends.inference.weight_sync import (
    CurrentWeights,
    engine_weight_version,
    record_current_weights,
    run_blocking,
    set_weight_version,
    sync_weights,
    unload_policy_adapters,
)
from skyrl_cli.engines.standby import Generation, ranks_of, state, wait_warm
from skyrl_cli.launch.pids import pid_alive
from skyrl_cli.launch.supervisor import ManagedProcess, Supervisor
from skyrl_cli.plan.model import LaunchPlan, PoolAttachment, ProcessSpec
from skyrl_cli.plan.pool import (
    WARM_NAMES,
    auxiliary_difference,
    engine_signature,
    first_difference,
    model_signature,
    unpoolable,
)
from skyrl_contracts.atomic import write_json
from skyrl_contracts.auxiliary import model_of
from skyrl_contracts.errors import LaunchError, UsageError
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.transports import DEFAULT_TRANSPORT, TRANSPORTS

POOL_FILE = "pool.json"
WARM_TIMEOUT_S = 300.0
HOLDER_FILE = "holder.json"
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def pools_dir() -> Path:
    if os.environ.get("SKYRL_POOLS_DIR"):
        return Path(os.environ["SKYRL_POOLS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "skyrl" / "pools"


def check_name(name: str) -> str:
    if not name or not set(name) <= NAME_CHARS or name.startswith("."):
        raise UsageError(f"--name: {name!r} is not a pool name (letters, digits, '-', '_', '.')")
    return name


@dataclass
class PoolProcess:
    spec: ProcessSpec
    pid: int
    log: str

    def alive(self) -> bool:
        return pid_alive(self.pid)


@dataclass
class Pool:
    """A pool as ``pool.json`` describes it."""

    name: str
    path: Path
    recipe: str
    created_at: float
    async_mode: bool
    weight_sync: str
    served_model: str
    model_signature: dict[str, Any]
    engines: list[PoolProcess]
    router: PoolProcess
    router_url: str
    # The engines of the recipe's auxiliary models (a teacher: teacher-0, ...; a judge: judge-0, ...),
    # never weight-synced; a run attaches only when they match its own (``fit_problem``).
    auxiliaries: list[PoolProcess] = field(default_factory=list)
    # The keepers of the pool's warm processes (skyrl_cli.engines.standby), by the role of the run's
    # process each takes over ("trainer", "orchestrator"); a role without one starts its own.
    warm: dict[str, PoolProcess] = field(default_factory=dict)

    @property
    def engine_urls(self) -> list[str]:
        return [p.spec.ready.url.rsplit("/", 1)[0] for p in self.engines]

    def auxiliary_specs(self) -> dict[str, list[ProcessSpec]]:
        """The auxiliary models' engine specs by model name (``teacher``: [teacher-0, ...])."""
        models: dict[str, list[ProcessSpec]] = {}
        for p in self.auxiliaries:
            models.setdefault(model_of(p.spec.name), []).append(p.spec)
        return models

    @property
    def auxiliary_engine_urls(self) -> list[str]:
        """Each auxiliary engine's URL, in ``auxiliaries``' order."""
        return [p.spec.ready.url.rsplit("/", 1)[0] for p in self.auxiliaries]

    @property
    def auxiliary_urls(self) -> dict[str, tuple[str, ...]]:
        """The auxiliary models' engine URLs by model name, as a run's orchestrator takes them."""
        urls: dict[str, tuple[str, ...]] = {}
        for p, url in zip(self.auxiliaries, self.auxiliary_engine_urls):
            urls[model_of(p.spec.name)] = (*urls.get(model_of(p.spec.name), ()), url)
        return urls

    def attachment(self) -> PoolAttachment:
        return PoolAttachment(
            name=self.name,
            engine_urls=tuple(self.engine_urls),
            router_url=self.router_url,
            auxiliary_urls=self.auxiliary_urls,
        )

    def processes(self) -> list[PoolProcess]:
        """The engines (the policy's, the auxiliary models') and the router: what a run adopts and
        its engine recovery restarts."""
        return [*self.engines, *self.auxiliaries, self.router]

    def alive(self) -> bool:
        """Some process of the pool still runs (a dead engine is the using run's to restart)."""
        return any(p.alive() for p in self.processes())

    def warm_folder(self, role: str) -> Path:
        return self.path / self.warm[role].spec.name

    def warm_state(self) -> dict[str, str]:
        """Each warm process's state for ``skyrl engines status``: {"trainer": "warm", ...}."""
        return {role: state(self.warm_folder(role), ranks_of(p.spec)) for role, p in self.warm.items()}

    def to_json(self) -> dict[str, Any]:
        def proc(p: PoolProcess) -> dict[str, Any]:
            return {"spec": p.spec.model_dump(mode="json"), "pid": p.pid, "log": p.log}

        return {
            "name": self.name,
            "recipe": self.recipe,
            "created_at": self.created_at,
            "async_mode": self.async_mode,
            "weight_sync": self.weight_sync,
            "served_model": self.served_model,
            "model_signature": self.model_signature,
            "engines": [proc(p) for p in self.engines],
            "router": proc(self.router),
            "router_url": self.router_url,
            "auxiliaries": [proc(p) for p in self.auxiliaries],
            "warm": {role: proc(p) for role, p in self.warm.items()},
        }

    @classmethod
    def read(cls, path: Path) -> "Pool":
        raw = json.loads((path / POOL_FILE).read_text())

        def proc(d: dict[str, Any]) -> PoolProcess:
            return PoolProcess(ProcessSpec.model_validate(d["spec"]), int(d["pid"]), str(d["log"]))

        return cls(
            name=raw["name"],
            path=path,
            recipe=raw["recipe"],
            created_at=float(raw["created_at"]),
            async_mode=bool(raw["async_mode"]),
            weight_sync=raw["weight_sync"],
            served_model=raw["served_model"],
            model_signature=raw["model_signature"],
            engines=[proc(d) for d in raw["engines"]],
            router=proc(raw["router"]),
            router_url=raw["router_url"],
            auxiliaries=[proc(d) for d in raw.get("auxiliaries", [])],
            warm={role: proc(d) for role, d in raw.get("warm", {}).items()},
        )

    def write(self) -> None:
        write_json(self.path / POOL_FILE, self.to_json())

    def holder(self) -> dict[str, Any] | None:
        """The run using the pool (its run directory and pid), or None when it is free."""
        holder = live_holder(self.path)
        return holder if holder is not None and lock_held(self.path) else None


def live_holder(path: Path) -> dict[str, Any] | None:
    """The pool's ``holder.json`` when the run it names still runs (read without the lock: the
    warm processes' keepers poll it, ``skyrl_cli.engines.keeper``)."""
    try:
        holder = json.loads((path / HOLDER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return holder if pid_alive(int(holder.get("pid", 0))) else None


def list_pools(root: Path | None = None) -> list[Pool]:
    root = root or pools_dir()
    found = []
    for path in sorted(root.glob(f"*/{POOL_FILE}")) if root.is_dir() else []:
        try:
            found.append(Pool.read(path.parent))
        except (OSError, ValueError, KeyError):
            continue  # a pool being written, or one from another skyrl version
    return found


def get_pool(name: str, root: Path | None = None) -> Pool:
    path = (root or pools_dir()) / check_name(name)
    if not (path / POOL_FILE).is_file():
        known = ", ".join(p.name for p in list_pools(root)) or "none"
        raise UsageError(f"no engine pool named {name!r} (pools: {known}; skyrl engines up RECIPE starts one)")
    return Pool.read(path)


# ------------------------------------------------------------------------------------------ up / down


def start_pool(plan: LaunchPlan, name: str, recipe_name: str, model_sig: dict[str, Any]) -> tuple[Pool, list[str]]:
    """Run the plan's setup job, start its engines and router detached, wait until they serve,
    then the keepers of its warm processes (when the plan has them) until their first generations
    are warm, and write ``pool.json``. An engine or router failure stops what was started and
    raises ``LaunchError``; a warm process that does not get warm is stopped and said (the second
    value: one line each): the pool serves without it, and runs start their own."""
    path = Path(plan.run_dir)
    setup = [p for p in plan.processes if p.kind == "setup"]
    engines = [p for p in plan.processes if p.role == "engine"]
    auxiliaries = [p for p in plan.processes if p.role == "auxiliary"]
    (router,) = [p for p in plan.processes if p.role == "router"]
    keepers = [p for p in plan.processes if p.role in WARM_NAMES]
    with Supervisor(path) as supervisor:
        try:
            # The auxiliary models' engines need no engine model: their start-up overlaps the setup job.
            started_auxiliaries = [supervisor.start(spec, detached=True) for spec in auxiliaries]
            for spec in setup:
                supervisor.start(spec)
                supervisor.wait_jobs([spec.name])
            started = [supervisor.start(spec, detached=True) for spec in engines]
            supervisor.wait_ready([p.spec.name for p in (*started, *started_auxiliaries)])
            run_blocking(set_weight_version(list(plan.engine_urls), "0"))
            router_proc = supervisor.start(router, detached=True)
            supervisor.wait_ready([router.name])
            warm, problems = start_keepers(supervisor, keepers, path)
        except BaseException:
            for proc in supervisor.processes.values():
                if proc.detached:
                    supervisor.stop(proc.spec.name, grace_s=5.0)
            raise
    served = engines[0].argv
    pool = Pool(
        name=name,
        path=path,
        recipe=recipe_name,
        created_at=time.time(),
        async_mode=plan.async_mode,
        weight_sync=plan.weight_sync or DEFAULT_TRANSPORT,
        served_model=served[served.index("backends.inference.serve") + 1],
        model_signature=model_sig,
        engines=[PoolProcess(p.spec, p.popen.pid, str(p.log_path)) for p in started],
        router=PoolProcess(router_proc.spec, router_proc.popen.pid, str(router_proc.log_path)),
        router_url=plan.router_url or "",
        auxiliaries=[PoolProcess(p.spec, p.popen.pid, str(p.log_path)) for p in started_auxiliaries],
        warm=warm,
    )
    pool.write()
    return pool, problems


def start_keepers(
    supervisor: Supervisor, keepers: list[ProcessSpec], path: Path
) -> tuple[dict[str, PoolProcess], list[str]]:
    """Start the warm processes' keepers detached (their imports overlap), wait for each first
    generation; the ones that got warm by role, and a line for each that did not (stopped)."""
    warm, problems = {}, []
    started = [supervisor.start(spec, detached=True) for spec in keepers]
    for proc in started:
        why = wait_warm(path / proc.spec.name, ranks_of(proc.spec), WARM_TIMEOUT_S, partial(keeper_running, proc))
        if why is None:
            warm[proc.spec.role] = PoolProcess(proc.spec, proc.popen.pid, str(proc.log_path))
        else:
            supervisor.stop(proc.spec.name, grace_s=5.0)
            problems.append(f"{proc.spec.name} did not start ({why}); runs start their own (log: {proc.log_path})")
    return warm, problems


def keeper_running(proc: ManagedProcess) -> bool:
    return proc.returncode is None


def prepare_pool_dir(name: str, root: Path | None = None) -> Path:
    """A fresh folder for pool ``name``; an old one whose processes are all gone is cleared."""
    path = (root or pools_dir()) / check_name(name)
    if (path / POOL_FILE).is_file():
        old = Pool.read(path)
        if old.alive():
            raise UsageError(f"engine pool {name!r} is already up (skyrl engines down {name} first, or --name OTHER)")
        stop_pool(old, force=True, grace_s=5.0)  # a warm process's keeper may outlive the engines
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def stop_pool(pool: Pool, force: bool = False, grace_s: float = 10.0) -> None:
    holder = pool.holder()
    if holder is not None and not force:
        raise UsageError(
            f"engine pool {pool.name!r} is in use by the run in {holder.get('run_dir')} (pid {holder.get('pid')}); "
            "stop that run first, or pass --force"
        )
    pids = [p.pid for p in [*pool.processes(), *pool.warm.values()] if p.alive()]
    for role in pool.warm:
        generation = Generation.current(pool.warm_folder(role))
        if generation is not None:  # a keeper's generation leads a session of its own
            pids.append(generation.agent_pid)
    for pid in pids:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        _signal_group(pid, signal.SIGKILL)
    shutil.rmtree(pool.path, ignore_errors=True)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # each process leads its own session (the supervisor starts them so)


# -------------------------------------------------------------------------------------- the lock


def lock_held(path: Path) -> bool:
    """Whether some process holds the pool's lock (tried without taking it for long)."""
    with open(path / "lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


@contextlib.contextmanager
def leased(pool: Pool, run_dir: Path) -> Iterator[Pool]:
    """Hold the pool for one run: a second run is refused in one line while this one lasts. The
    lock is the kernel's (``flock``), so a run that dies in any way releases it."""
    with open(pool.path / "lock", "a+") as fh:  # closing it releases the flock
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = pool.holder() or {}
            raise UsageError(
                f"engine pool {pool.name!r} is in use by the run in {holder.get('run_dir', '?')} "
                f"(pid {holder.get('pid', '?')}); wait for it to end, start another pool "
                "(skyrl engines up RECIPE --name OTHER), or --pool none for engines of this run's own"
            ) from None
        write_json(pool.path / HOLDER_FILE, {"run_dir": str(run_dir), "pid": os.getpid(), "since": time.time()})
        try:
            yield pool
        finally:
            with contextlib.suppress(OSError):
                (pool.path / HOLDER_FILE).unlink()


# ------------------------------------------------------------------------------------------- fit


def fit_problem(pool: Pool, run_plan: LaunchPlan, engines_needed: int, init_model: Path) -> str | None:
    """Why ``pool`` cannot serve a run whose own plan is ``run_plan`` (its engines as it would
    start them); None when it fits. ``init_model`` is checked when it exists (an SFT stage that
    runs first writes it later: the run checks again when it attaches)."""
    why = unpoolable(run_plan.weight_sync or DEFAULT_TRANSPORT)
    if why:
        return why
    if not pool.alive():
        return "its processes have all exited (skyrl engines down, then up again)"
    if pool.weight_sync != run_plan.weight_sync:
        return f"weight sync: pool {pool.weight_sync}, this run {run_plan.weight_sync}"
    if pool.async_mode != run_plan.async_mode:
        wanted = "skyrl engines up RECIPE --async" if run_plan.async_mode else "skyrl engines up RECIPE"
        return f"its engines are set up for {'--async' if pool.async_mode else 'sync'} runs ({wanted} starts one for this run)"
    if len(pool.engines) < engines_needed:
        return f"inference.engines: pool {len(pool.engines)}, this run {engines_needed}"
    own = [p for p in run_plan.processes if p.role == "engine"]
    if own:
        difference = first_difference(engine_signature(pool.engines[0].spec), engine_signature(own[0]))
        if difference:
            return f"engines started with other settings ({difference})"
    run_auxiliaries: dict[str, list[ProcessSpec]] = {}
    for spec in run_plan.processes:
        if spec.role == "auxiliary":
            run_auxiliaries.setdefault(model_of(spec.name), []).append(spec)
    difference = auxiliary_difference(pool.auxiliary_specs(), run_auxiliaries)
    if difference:
        return difference
    if (init_model / "config.json").is_file():
        difference = first_difference(pool.model_signature, model_signature(init_model))
        if difference:
            return f"another model shape ({difference})"
        if TRANSPORTS[pool.weight_sync].adapters and Path(pool.served_model).resolve() != init_model.resolve():
            return f"LoRA runs need the pool's base model ({pool.served_model}), not {init_model}"
    return None


def choose_pool(
    requested: str, run_plan: LaunchPlan, engines_needed: int, init_model: Path
) -> tuple[Pool | None, list[str]]:
    """The pool a run uses and why the others do not fit (``--dry-run`` prints both).

    ``requested``: "none" (start own engines), "auto" (the first free pool that fits, else own
    engines) or a pool's name (it must fit and be free, else ``UsageError``)."""
    if requested == "none":
        return None, []
    if requested != "auto":
        pool = get_pool(requested)
        why = fit_problem(pool, run_plan, engines_needed, init_model)
        if why:
            raise UsageError(f"--pool {requested}: the pool does not fit this run: {why}")
        return pool, []
    reasons = []
    for pool in list_pools():
        why = fit_problem(pool, run_plan, engines_needed, init_model)
        holder = pool.holder() if why is None else None
        if holder is not None:
            why = f"in use by the run in {holder.get('run_dir')}"
        if why is None:
            return pool, reasons
        reasons.append(f"pool {pool.name}: {why}")
    return None, reasons


# ---------------------------------------------------------------------------------------- attach


def adopt(supervisor: Supervisor, pool: Pool) -> tuple[list[str], str]:
    """Put the pool's processes (its auxiliary models' engines too) under the run's supervisor
    (watched, restarted, not torn down); a restart is written back to ``pool.json``. Returns (the
    policy's engine names, router name)."""

    def follow(proc: ManagedProcess) -> None:
        for entry in pool.processes():
            if entry.spec.name == proc.spec.name:
                entry.pid = proc.popen.pid
        pool.write()

    supervisor.on_detached = follow
    for entry in pool.processes():
        supervisor.adopt(entry.spec, entry.pid, Path(entry.log))
    return [p.spec.name for p in pool.engines], pool.router.spec.name


def load_run_weights(pool: Pool, run_dir: Path) -> None:
    """The run's initial policy into the pool's engines, prefix caches cleared (the cached KV is
    the previous policy's). Full weights: the run's ``engine-model/`` as version "0", recorded
    first so that an engine the recovery restarts meanwhile loads it too. LoRA: the previous run's
    adapters unloaded (the orchestrator loads this run's v0 adapter)."""
    urls = pool.engine_urls
    if TRANSPORTS[pool.weight_sync].adapters:
        run_blocking(unload_policy_adapters(urls))
        run_blocking(set_weight_version(urls, "0"))
        return
    model = RunDir(run_dir).engine_model
    if not (model / "config.json").is_file():
        raise LaunchError(f"no engine model at {model} to load into engine pool {pool.name!r}")
    record_current_weights(run_dir, CurrentWeights(str(model), "0"))
    run_blocking(sync_weights(urls, model, "0", reset_prefix_cache=True))


def check_attached_model(pool: Pool, init_model: Path) -> None:
    """The check ``fit_problem`` could not make at plan time when the SFT stage ran first."""
    difference = first_difference(pool.model_signature, model_signature(init_model))
    if difference:
        raise UsageError(
            f"engine pool {pool.name!r} serves another model shape ({difference}); --pool none starts this run's own engines"
        )


def health(url: str, path: str = "/health") -> bool:
    try:
        return httpx.get(f"{url}{path}", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def served_version(url: str) -> str | None:
    try:
        return run_blocking(engine_weight_version(url))
    except (httpx.HTTPError, ValueError, KeyError):
        return None

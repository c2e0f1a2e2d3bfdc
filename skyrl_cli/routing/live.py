"""Live replay: the simulator's workload, sent over HTTP to real vLLM engines.

The same ``WorkloadSpec`` and seed give the same trajectories as in the simulator (turn counts,
prompt / response / observation lengths, environment delays); the same ``GroupScheduler`` drives
them (concurrency, staleness bound, a trainer that sleeps ``trainer_step_s`` per step). Each turn
sends the session's whole token context to ``/inference/v1/generate`` with ``ignore_eos`` so that
the response has exactly the planned length, then appends the tokens the engine returned and the
observation, so the next turn's prompt extends this one (what the prefix cache can reuse).
Prompt and observation tokens are random ids from ``token_pool``, distinct per trajectory.

Routing is done either by vllm-router (``RouterTarget``: ``X-Session-ID`` header,
``/finish_session``) for the policies it implements, or client-side by one of our policy objects
(``ClientSideTarget``, requests go straight to the chosen engine) for those it does not
(``sticky_kv_repin``: vllm-router 0.1.17 has no policy that weighs session context against KV
capacity, so it cannot be expressed there; client-side it also skips the router hop, ~2 ms).

Measured: client-side generated tokens, trajectories, step and group times; engine-side from each
engine's ``/metrics``: preemptions, prefix-cache hits / queries (tokens), and the running requests
per engine sampled every ``sample_interval_s`` (CV across engines, as in the simulator).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import httpx
import numpy as np

from skyrl_cli.engines.metrics import EngineSnapshot, Interval, coefficient_of_variation, parse_prometheus
from skyrl_cli.routing.policies import RoutingPolicy
from skyrl_cli.routing.workload import GroupScheduler, Trajectory, WorkloadSpec, sample_group
from skyrl_contracts.engine_api import GENERATE_PATH, SERVED_MODEL_NAME

# A workload 2 CPU engines with a tiny model get through in well under a minute per policy: 16
# trajectories in flight, ~8 turns, contexts up to 1k tokens, short environment steps.
LIVE_WORKLOAD = WorkloadSpec(
    group_size=4,
    groups_per_step=2,
    trainer_steps=4,
    max_inflight_groups=4,
    max_staleness=1,
    trainer_step_s=1.0,
    turns_mean=8,
    turns_cv=0.5,
    prompt_mean=128,
    response_mean=48,
    observation_mean=48,
    length_sigma=0.5,
    max_response=128,
    max_context=1024,
    env_latency_mean_s=0.05,
)


@dataclass
class LiveResult:
    policy: str
    routed_by: str  # "vllm-router" or "client"
    makespan_s: float
    steps: int
    step_time_s: float
    gen_tokens_per_s: float
    trajectories_per_s: float
    preemptions: float
    prefix_hit_rate: float
    running_cv: float
    group_latency_p50_s: float
    group_latency_p90_s: float
    generated_tokens: int
    requests: int
    trajectories_finished: int
    engine_generated_tokens: float  # from the engines' counters (cross-check of the client count)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------- targets
class RouterTarget:
    """Requests through vllm-router, which picks the engine from the session id."""

    routed_by = "vllm-router"

    def __init__(self, http: httpx.AsyncClient, router_url: str):
        self.http = http
        self.url = router_url.rstrip("/")

    async def generate(self, session_id: str, body: dict, prompt_tokens: int) -> dict:
        response = await post(self.http, f"{self.url}{GENERATE_PATH}", json=body, headers={"X-Session-ID": session_id})
        response.raise_for_status()
        return response.json()

    async def finish(self, session_id: str) -> None:
        await post(self.http, f"{self.url}/finish_session", params={"session_id": session_id})


class ClientSideTarget:
    """Requests straight to the engine one of our ``RoutingPolicy`` objects picks."""

    routed_by = "client"

    def __init__(self, http: httpx.AsyncClient, engine_urls: Sequence[str], policy: RoutingPolicy):
        self.http = http
        self.urls = [u.rstrip("/") for u in engine_urls]
        self.policy = policy

    async def generate(self, session_id: str, body: dict, prompt_tokens: int) -> dict:
        worker = self.policy.route(session_id, prompt_tokens)
        response = await post(self.http, f"{self.urls[worker]}{GENERATE_PATH}", json=body)
        response.raise_for_status()
        out = response.json()
        generated = len(out["choices"][0].get("token_ids") or [])
        self.policy.on_response(session_id, worker, prompt_tokens + generated)
        return out

    async def finish(self, session_id: str) -> None:
        self.policy.finish_session(session_id)


# ---------------------------------------------------------------------------------------------- engines
async def engine_snapshot(http: httpx.AsyncClient, url: str) -> EngineSnapshot:
    try:
        response = await http.get(f"{url.rstrip('/')}/metrics")
    except (httpx.ReadError, httpx.RemoteProtocolError):  # a dropped pooled connection: see http_client
        response = await http.get(f"{url.rstrip('/')}/metrics")
    response.raise_for_status()
    return EngineSnapshot.from_metrics(parse_prometheus(response.text), time.monotonic())


async def reset_engines(http: httpx.AsyncClient, engine_urls: Sequence[str], timeout_s: float = 60.0) -> None:
    """Wait until no request runs or waits anywhere, then empty every prefix cache (a cold start per policy)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snaps = [await engine_snapshot(http, u) for u in engine_urls]
        if all(s.running == 0 and s.waiting == 0 for s in snaps):
            break
        if time.monotonic() > deadline:
            raise TimeoutError("engines still busy from a previous run")
        await asyncio.sleep(0.2)
    for url in engine_urls:
        response = await post(http, f"{url.rstrip('/')}/reset_prefix_cache")
        response.raise_for_status()


_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def kv_capacity_from_log(log_path: str | Path) -> int | None:
    """The engine's KV capacity in tokens, as vLLM logs it at start-up (``CPU KV cache size: N tokens``)."""
    try:
        matches = _KV_TOKENS.findall(Path(log_path).read_text(errors="replace"))
    except OSError:
        return None
    return int(matches[-1].replace(",", "")) if matches else None


# ---------------------------------------------------------------------------------------------- replay
class _Replay:
    def __init__(
        self,
        spec: WorkloadSpec,
        seed: int,
        target,
        engine_urls: Sequence[str],
        token_pool: Sequence[int],
        http: httpx.AsyncClient,
        sample_interval_s: float,
        model: str,
    ):
        self.spec = spec
        self.seed = seed
        self.target = target
        self.engine_urls = list(engine_urls)
        self.pool = np.asarray(token_pool, dtype=np.int64)
        self.http = http
        self.sample_interval_s = sample_interval_s
        self.model = model
        self.scheduler = GroupScheduler(spec)
        self.t0 = 0.0
        self.generated = 0
        self.requests = 0
        self.trajectories_finished = 0
        self.group_latencies: list[float] = []
        self.step_end_s: list[float] = []
        self.running_samples: list[list[float]] = []
        self.tasks: set[asyncio.Task] = set()
        self.done = asyncio.Event()
        self.trainer_wakeup = asyncio.Event()
        self.failure: BaseException | None = None

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()
            self.done.set()

    def _launch(self) -> None:
        for group in self.scheduler.start_groups():
            self._spawn(self._run_group(group))

    async def _run_group(self, group: int) -> None:
        start = self._now()
        await asyncio.gather(*(self._run_trajectory(t) for t in sample_group(self.spec, self.seed, group)))
        self.group_latencies.append(self._now() - start)
        self.scheduler.group_finished(group)
        self._launch()
        self.trainer_wakeup.set()

    async def _run_trajectory(self, trajectory: Trajectory) -> None:
        rng = np.random.default_rng([self.seed, trajectory.group, trajectory.repetition, 1])
        context = [int(t) for t in rng.choice(self.pool, trajectory.prompts[0])]
        session = trajectory.session_id
        try:
            for t in range(trajectory.turns):
                tokens = trajectory.responses[t]
                body = {
                    "token_ids": context,
                    "model": self.model,
                    "sampling_params": {
                        "max_tokens": tokens,
                        "min_tokens": tokens,
                        "ignore_eos": True,
                        "temperature": 1.0,
                        "detokenize": False,
                    },
                }
                self.requests += 1
                out = await self.target.generate(session, body, len(context))
                generated = [int(x) for x in out["choices"][0].get("token_ids") or []]
                if not self.done.is_set():
                    self.generated += len(generated)
                context += generated
                if t + 1 < trajectory.turns:
                    observation = trajectory.prompts[t + 1] - trajectory.prompts[t] - trajectory.responses[t]
                    context += [int(x) for x in rng.choice(self.pool, observation)]
                    await asyncio.sleep(trajectory.env_delays[t])
            if not self.done.is_set():
                self.trajectories_finished += 1
        finally:
            await self.target.finish(session)

    async def _trainer(self) -> None:
        while not self.scheduler.done:
            if self.scheduler.take_batch() is None:
                self.trainer_wakeup.clear()
                await self.trainer_wakeup.wait()
                continue
            await asyncio.sleep(self.spec.trainer_step_s)
            self.scheduler.step_done()
            self.step_end_s.append(self._now())
            self._launch()
        self.done.set()

    async def _sampler(self) -> None:
        while not self.done.is_set():
            try:
                snaps = await asyncio.gather(*(engine_snapshot(self.http, u) for u in self.engine_urls))
                self.running_samples.append([s.running for s in snaps])
            except httpx.HTTPError:
                pass  # a missed sample is not worth failing the run
            try:
                await asyncio.wait_for(self.done.wait(), self.sample_interval_s)
            except asyncio.TimeoutError:
                pass

    async def run(self, policy: str) -> LiveResult:
        before = await asyncio.gather(*(engine_snapshot(self.http, u) for u in self.engine_urls))
        self.t0 = time.monotonic()
        self._launch()
        trainer = asyncio.get_running_loop().create_task(self._trainer())
        sampler = asyncio.get_running_loop().create_task(self._sampler())
        try:
            await self.done.wait()
        finally:
            makespan = self._now()
            for task in list(self.tasks) + [trainer]:
                task.cancel()
            await asyncio.gather(*self.tasks, trainer, return_exceptions=True)
            self.done.set()
            await sampler
        if self.failure is not None:
            raise self.failure
        after = await asyncio.gather(*(engine_snapshot(self.http, u) for u in self.engine_urls))
        intervals = [Interval.between(a, b) for a, b in zip(before, after)]
        queries = sum(i.prefix_queries for i in intervals)
        latencies = np.array(self.group_latencies) if self.group_latencies else np.array([float("nan")])
        cvs = [coefficient_of_variation(s) for s in self.running_samples if sum(s) > 0]
        steps = self.scheduler.steps_done
        return LiveResult(
            policy=policy,
            routed_by=self.target.routed_by,
            makespan_s=makespan,
            steps=steps,
            step_time_s=makespan / max(steps, 1),
            gen_tokens_per_s=self.generated / makespan,
            trajectories_per_s=self.trajectories_finished / makespan,
            preemptions=sum(i.preemptions for i in intervals),
            prefix_hit_rate=sum(i.prefix_hits for i in intervals) / queries if queries else 0.0,
            running_cv=float(np.mean(cvs)) if cvs else 0.0,
            group_latency_p50_s=float(np.percentile(latencies, 50)),
            group_latency_p90_s=float(np.percentile(latencies, 90)),
            generated_tokens=self.generated,
            requests=self.requests,
            trajectories_finished=self.trajectories_finished,
            engine_generated_tokens=sum(i.generation_tokens for i in intervals),
        )


async def replay(
    spec: WorkloadSpec,
    seed: int,
    policy: str,
    target,
    engine_urls: Sequence[str],
    token_pool: Sequence[int],
    http: httpx.AsyncClient,
    *,
    sample_interval_s: float = 0.25,
    model: str = SERVED_MODEL_NAME,
) -> LiveResult:
    """Run the workload once through ``target`` and measure it (engines should be idle and cold)."""
    spec.validate()
    return await _Replay(spec, seed, target, engine_urls, token_pool, http, sample_interval_s, model).run(policy)


def http_client(concurrency: int = 256, timeout_s: float = 120.0) -> httpx.AsyncClient:
    # uvicorn closes idle keep-alive connections after 5 s; reusing one just as it does fails with a
    # ReadError, so pooled connections are dropped well before that.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0),
    )


async def post(http: httpx.AsyncClient, url: str, **kwargs) -> httpx.Response:
    """POST with one retry when the server dropped a pooled connection under us (a benchmark request
    that is sent twice only costs time)."""
    try:
        return await http.post(url, **kwargs)
    except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
        return await http.post(url, **kwargs)

"""Discrete-event simulation of fully-async RL generation on N replicas behind a routing policy.

The driver is ``workload.GroupScheduler`` (concurrency, staleness bound, trainer consuming finished
groups; the live replay uses the same one) on a simulated clock: the trainer trains for
``trainer_step_s`` while generation goes on, and the run ends when ``trainer_steps`` steps are
done. Each trajectory is one router session: its turns go wherever the policy sends them, the
environment delay separates turns, and ``finish_session`` is called when it ends.

The replicas are ``engine_model.Replica``; the events are replica run ends, turn arrivals, trainer
step ends and metric samples, in one heap.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from skyrl_cli.routing.engine_model import Replica, ReplicaSpec, Request, StepCost
from skyrl_cli.routing.policies import make_policy
from skyrl_cli.routing.workload import GroupScheduler, Trajectory, WorkloadSpec, sample_group

_RUN_END, _ARRIVAL, _TRAINER_DONE, _SAMPLE = 0, 1, 2, 3


@dataclass(frozen=True)
class SimConfig:
    policy: str
    replicas: int = 8
    kv_capacity: int = 400_000  # tokens per replica
    cost: StepCost = field(default_factory=StepCost)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    request_overhead_s: float = 0.0  # client + HTTP time per turn outside the engine (calibration)
    seed: int = 0
    sample_interval_s: float = 1.0
    drain: bool = False  # after the last step, finish every started trajectory
    check_invariants: bool = False  # assert the KV bookkeeping after every event (tests)


@dataclass
class SimResult:
    policy: str
    replicas: int
    kv_capacity: int
    makespan_s: float
    steps: int
    step_time_s: float
    gen_tokens_per_s: float
    trajectories_per_s: float
    preemptions: int
    prefix_hit_rate: float
    running_cv: float
    group_latency_p50_s: float
    group_latency_p90_s: float
    generated_tokens: int
    prefill_tokens: int
    trajectories_finished: int
    trajectories_started: int
    requests: int
    events: int
    wall_s: float
    label: str = ""  # pressure level name, set by the sweep

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Group:
    index: int
    start_s: float
    remaining: int
    end_s: float = 0.0


class Simulation:
    def __init__(self, config: SimConfig):
        config.workload.validate()
        if config.kv_capacity < config.workload.max_context + 1:
            raise ValueError(
                f"kv_capacity ({config.kv_capacity}) must hold one full context ({config.workload.max_context} tokens)"
            )
        self.config = config
        self.spec = config.workload
        replica_spec = ReplicaSpec(
            config.kv_capacity, config.max_num_seqs, config.max_num_batched_tokens, config.block_size
        )
        self.replicas = [Replica(i, replica_spec, config.cost) for i in range(config.replicas)]
        workers = [f"http://replica-{i}:8000" for i in range(config.replicas)]
        self.policy = make_policy(config.policy, workers, [config.kv_capacity] * config.replicas)
        self._events: list = []
        self._seq = 0
        self.now = 0.0
        self.scheduler = GroupScheduler(self.spec)
        self.groups: dict[int, _Group] = {}
        self.step_end_s: list[float] = []
        self.trajectories: list[Trajectory] = []
        self.trajectories_finished = 0
        self.requests = 0
        self.samples_running: list[list[int]] = []
        self.events = 0

    # ------------------------------------------------------------------ events
    def _push(self, at_s: float, kind: int, a=None, b=None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at_s, self._seq, kind, a, b))

    def _push_run(self, replica: Replica, end_s: float | None) -> None:
        if end_s is not None:
            self._push(end_s, _RUN_END, replica, replica.run_version)

    # ------------------------------------------------------------------ driver
    def _launch_groups(self) -> None:
        for index in self.scheduler.start_groups():
            trajectories = sample_group(self.spec, self.config.seed, index)
            self.groups[index] = _Group(index, self.now, len(trajectories))
            for trajectory in trajectories:
                trajectory.replicas = []
                self.trajectories.append(trajectory)
                self._push(self.now + self.config.request_overhead_s, _ARRIVAL, trajectory)

    def _maybe_train(self) -> None:
        if self.scheduler.take_batch() is not None:
            self._push(self.now + self.spec.trainer_step_s, _TRAINER_DONE)

    def _on_trainer_done(self) -> None:
        self.scheduler.step_done()
        self.step_end_s.append(self.now)
        self._launch_groups()
        self._maybe_train()

    def _on_arrival(self, trajectory: Trajectory) -> None:
        t = trajectory.turn
        session = trajectory.session_id
        request = Request(session, trajectory.prompts[t], trajectory.responses[t], self.now, trajectory)
        index = self.policy.route(session, request.prompt)
        trajectory.replicas.append(index)
        replica = self.replicas[index]
        self.requests += 1
        if replica.enqueue(request):
            self._push_run(replica, replica.cut_run(self.now))
        elif not replica.busy:
            self._push_run(replica, replica.schedule(self.now))

    def _on_run_end(self, replica: Replica, version: int) -> None:
        if version != replica.run_version or not replica.busy:
            return  # the run was cut short; a newer event ends it
        for request in replica.finish_run(self.now):
            trajectory: Trajectory = request.owner
            self.policy.on_response(request.session, replica.index, request.prompt + request.response)
            trajectory.turn += 1
            if trajectory.turn < trajectory.turns:
                delay = trajectory.env_delays[trajectory.turn - 1] + self.config.request_overhead_s
                self._push(self.now + delay, _ARRIVAL, trajectory)
            else:
                self._on_trajectory_done(trajectory)
        self._push_run(replica, replica.schedule(self.now))
        if self.config.check_invariants:
            self._check(replica)

    def _on_trajectory_done(self, trajectory: Trajectory) -> None:
        self.policy.finish_session(trajectory.session_id)
        self.trajectories_finished += 1
        group = self.groups[trajectory.group]
        group.remaining -= 1
        if group.remaining == 0:
            group.end_s = self.now
            self.scheduler.group_finished(group.index)
            self._launch_groups()
            self._maybe_train()

    def _on_sample(self) -> None:
        self.samples_running.append([len(r.running) for r in self.replicas])
        self._push(self.now + self.config.sample_interval_s, _SAMPLE)

    def _check(self, replica: Replica) -> None:
        cap = replica.spec.kv_capacity
        assert replica.running_kv + replica.cached <= cap, "KV cache over capacity"
        if replica.busy:
            # The whole planned run fits: its last step's KV stays within capacity.
            headroom = replica._headroom(len(replica.running))
            assert replica.running_kv + len(replica.running) * replica.run_steps <= headroom, "run overflows KV"
        assert replica.cached == sum(replica.cache.values()), "cache accounting drifted"
        assert replica.base_sum == sum(r.base for r in replica.running), "running KV accounting drifted"

    def _done(self) -> bool:
        if not self.scheduler.done:
            return False
        return not self.config.drain or self.trajectories_finished == len(self.trajectories)

    # ------------------------------------------------------------------ main loop
    def run(self) -> SimResult:
        wall = time.perf_counter()
        self._launch_groups()
        self._push(0.0, _SAMPLE)
        events = self._events
        while not self._done():
            if len(events) <= 1:  # only the sampler is left: nothing can make progress
                raise RuntimeError(
                    f"simulation stalled at t={self.now:.1f}s "
                    f"(steps {self.scheduler.steps_done}/{self.spec.trainer_steps})"
                )
            at_s, _, kind, a, b = heapq.heappop(events)
            self.now = at_s
            self.events += 1
            if kind == _RUN_END:
                self._on_run_end(a, b)
            elif kind == _ARRIVAL:
                self._on_arrival(a)
            elif kind == _TRAINER_DONE:
                self._on_trainer_done()
            else:
                self._on_sample()
        return self._result(time.perf_counter() - wall)

    def _result(self, wall_s: float) -> SimResult:
        makespan = self.step_end_s[-1] if self.step_end_s else self.now
        if self.config.drain:
            makespan = self.now
        stats = [r.stats for r in self.replicas]
        generated = sum(s.generated_tokens for s in stats)
        prompt = sum(s.prompt_tokens for s in stats)
        running = np.asarray(self.samples_running, dtype=float)
        means = running.mean(axis=1) if running.size else np.zeros(0)
        busy = means > 0
        cv = float((running[busy].std(axis=1) / means[busy]).mean()) if busy.any() else 0.0
        latencies = np.array([g.end_s - g.start_s for g in self.groups.values() if g.remaining == 0])
        p50, p90 = np.percentile(latencies, [50, 90]) if latencies.size else (float("nan"),) * 2
        return SimResult(
            policy=self.config.policy,
            replicas=self.config.replicas,
            kv_capacity=self.config.kv_capacity,
            makespan_s=makespan,
            steps=self.scheduler.steps_done,
            step_time_s=makespan / max(self.scheduler.steps_done, 1),
            gen_tokens_per_s=generated / makespan if makespan > 0 else 0.0,
            trajectories_per_s=self.trajectories_finished / makespan if makespan > 0 else 0.0,
            preemptions=sum(s.preemptions for s in stats),
            prefix_hit_rate=sum(s.cached_tokens for s in stats) / prompt if prompt else 0.0,
            running_cv=cv,
            group_latency_p50_s=float(p50),
            group_latency_p90_s=float(p90),
            generated_tokens=generated,
            prefill_tokens=sum(s.prefill_tokens for s in stats),
            trajectories_finished=self.trajectories_finished,
            trajectories_started=len(self.trajectories),
            requests=self.requests,
            events=self.events,
            wall_s=wall_s,
        )


def simulate(config: SimConfig) -> SimResult:
    return Simulation(config).run()

"""The workload: fully-async GRPO over multi-turn agentic trajectories.

A *group* is one task instance sampled ``group_size`` times; each sample is a *trajectory* (one
router session, id ``f"{instance}_{repetition}"`` as SkyRL sends it). A trajectory alternates model
turns and environment steps: turn t sends the whole conversation so far (task prompt, earlier
responses and observations) and generates a response; the environment then takes some seconds and
returns an observation that is appended before the next turn. Contexts only grow, so turn t's
prompt starts with turn t-1's prompt plus its response: the prefix a cache can reuse.

Every group is drawn from its own generator seeded with ``(seed, group index)``, so all policies see
the identical sequence of trajectories (paired comparison) however they interleave.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkloadSpec:
    """Shape of the RL workload. Lengths are in tokens, times in seconds."""

    group_size: int = 8  # GRPO samples per task instance
    groups_per_step: int = 16  # groups the trainer consumes per step (batch)
    trainer_steps: int = 4  # simulated training steps (the run ends after the last)
    max_inflight_groups: int = 32  # generation concurrency (parallel generation workers)
    max_staleness: int = 4  # policy versions generation may run ahead of training
    trainer_step_s: float = 60.0  # simulated trainer step (the release's benchmark used 60 s)
    turns_mean: float = 40.0  # mean model turns per trajectory
    turns_cv: float = 0.5  # coefficient of variation of the turn count (gamma distributed)
    prompt_mean: int = 2000  # system + task prompt, per group
    response_mean: int = 250  # tokens generated per turn (log-normal)
    observation_mean: int = 250  # environment observation tokens per turn (log-normal)
    length_sigma: float = 0.6  # log-normal sigma of response and observation lengths
    max_response: int = 2048  # max_tokens per turn
    max_context: int = 32768  # a trajectory ends when its context would exceed this
    env_latency_mean_s: float = 2.0  # environment step between turns (log-normal, sigma 0.5)

    @property
    def max_inflight_trajectories(self) -> int:
        return self.max_inflight_groups * self.group_size

    def validate(self) -> None:
        for name in (
            "group_size",
            "groups_per_step",
            "trainer_steps",
            "max_inflight_groups",
            "prompt_mean",
            "response_mean",
            "max_response",
            "max_context",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.turns_mean < 1:
            raise ValueError("turns_mean must be at least 1")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if self.prompt_mean * 2 >= self.max_context:
            raise ValueError("max_context must leave room for turns after the prompt")


@dataclass
class Trajectory:
    """One sampled trajectory: per-turn prompt and response lengths and the environment delays."""

    group: int
    repetition: int
    prompts: list[int]  # prompt tokens of turn t (whole context so far)
    responses: list[int]  # tokens generated at turn t
    env_delays: list[float]  # seconds of environment work after turn t (len = turns - 1)
    turn: int = 0  # next turn to run
    replicas: list[int] | None = None  # where each turn ran (filled by the simulator)

    @property
    def session_id(self) -> str:
        return f"{self.group}_{self.repetition}"

    @property
    def turns(self) -> int:
        return len(self.prompts)

    @property
    def generated_tokens(self) -> int:
        return sum(self.responses)


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size) -> np.ndarray:
    # Parameterised by its mean: E[exp(N(mu, sigma))] = exp(mu + sigma^2 / 2).
    return rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma, size)


def sample_group(spec: WorkloadSpec, seed: int, group: int) -> list[Trajectory]:
    """The ``group_size`` trajectories of task instance ``group`` (deterministic in seed and group)."""
    rng = np.random.default_rng([seed, group])
    prompt = max(1, int(round(_lognormal(rng, spec.prompt_mean, 0.3, None))))
    shape = 1.0 / (spec.turns_cv**2) if spec.turns_cv > 0 else None
    trajectories = []
    for rep in range(spec.group_size):
        if shape is None:
            turns = int(round(spec.turns_mean))
        else:
            turns = int(round(rng.gamma(shape, spec.turns_mean / shape)))
        turns = max(1, turns)
        responses = np.clip(
            np.rint(_lognormal(rng, spec.response_mean, spec.length_sigma, turns)), 1, spec.max_response
        )
        observations = np.maximum(1, np.rint(_lognormal(rng, spec.observation_mean, spec.length_sigma, turns)))
        delays = (
            _lognormal(rng, spec.env_latency_mean_s, 0.5, turns) if spec.env_latency_mean_s > 0 else np.zeros(turns)
        )
        prompts_out: list[int] = []
        responses_out: list[int] = []
        context = prompt
        for t in range(turns):
            response = int(min(responses[t], spec.max_context - context))
            if response < 1:
                break
            prompts_out.append(context)
            responses_out.append(response)
            context += response + int(observations[t])
        trajectories.append(
            Trajectory(group, rep, prompts_out, responses_out, [float(d) for d in delays[: len(prompts_out) - 1]])
        )
    return trajectories


def working_set_per_replica(spec: WorkloadSpec, seed: int, replicas: int, sample_groups: int = 64) -> float:
    """KV-cache tokens a replica needs to keep every session it serves resident.

    Estimated as (in-flight trajectories / replicas) x the turn-weighted mean context length of a
    trajectory (what its cache entry holds on an average turn). KV pressure levels are KV capacity
    as a fraction of this figure: above 1 the working set fits, below 1 sessions evict each other.
    """
    contexts, turns = 0.0, 0
    for group in range(sample_groups):
        for trajectory in sample_group(spec, seed + 7919, group):  # separate draws: not the run's own groups
            contexts += sum(p + r for p, r in zip(trajectory.prompts, trajectory.responses))
            turns += trajectory.turns
    mean_context = contexts / max(turns, 1)
    return spec.max_inflight_trajectories / replicas * mean_context


class GroupScheduler:
    """The fully-async driver's bookkeeping, shared by the simulator and the live replay (no clock).

    Up to ``max_inflight_groups`` groups generate at once; group g may start only while
    g < (steps_done + max_staleness + 1) * groups_per_step, so no group is consumed more than
    ``max_staleness`` policy versions after it started; the trainer takes the first
    ``groups_per_step`` finished groups (completion order) per step; nothing new starts after the
    last step.
    """

    def __init__(self, spec: WorkloadSpec):
        self.spec = spec
        self.next_group = 0
        self.inflight = 0
        self.steps_done = 0
        self.trainer_busy = False
        self.finished: deque[int] = deque()

    @property
    def done(self) -> bool:
        return self.steps_done >= self.spec.trainer_steps

    def start_groups(self) -> list[int]:
        """Indices of the groups that may start now (and are counted as started)."""
        started = []
        window = (self.steps_done + self.spec.max_staleness + 1) * self.spec.groups_per_step
        while not self.done and self.inflight < self.spec.max_inflight_groups and self.next_group < window:
            started.append(self.next_group)
            self.next_group += 1
            self.inflight += 1
        return started

    def group_finished(self, group: int) -> None:
        self.inflight -= 1
        self.finished.append(group)

    def take_batch(self) -> list[int] | None:
        """The groups of the next trainer step, when the trainer is idle and enough have finished."""
        if self.trainer_busy or self.done or len(self.finished) < self.spec.groups_per_step:
            return None
        self.trainer_busy = True
        return [self.finished.popleft() for _ in range(self.spec.groups_per_step)]

    def step_done(self) -> None:
        self.trainer_busy = False
        self.steps_done += 1

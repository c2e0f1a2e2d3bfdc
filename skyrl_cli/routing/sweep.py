"""Policies x KV-pressure levels, each cell averaged over seeds: what ``skyrl bench routing`` prints.

A pressure level is the KV capacity of a replica as a fraction of the working set it would have to
hold (``workload.working_set_per_replica``): ``low`` = 1.5 (everything fits with room to spare),
``moderate`` = 0.75, ``high`` = 0.5. The release set pressure through gpu_memory_utilization
0.90 / 0.75 / 0.62, i.e. KV capacities of roughly 1 : 0.5-0.75 : 0.1-0.5 depending on the GPU; our
levels (1 : 0.5 : 0.33) sit inside that range. Numbers can be given instead of names.
Every policy runs the same seeds, so each seed is a paired comparison on identical trajectories.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from skyrl_cli.routing.engine_model import StepCost
from skyrl_cli.routing.policies import DEFAULT_POLICIES, POLICIES
from skyrl_cli.routing.simulator import SimConfig, SimResult, simulate
from skyrl_cli.routing.workload import WorkloadSpec, working_set_per_replica

PRESSURE_LEVELS = {"low": 1.5, "moderate": 0.75, "high": 0.5}

# Averaged over seeds in the table; the rest are reported from the sum over seeds or not at all.
MEAN_METRICS = (
    "step_time_s",
    "gen_tokens_per_s",
    "trajectories_per_s",
    "preemptions",
    "prefix_hit_rate",
    "running_cv",
    "group_latency_p50_s",
    "group_latency_p90_s",
    "makespan_s",
)


def parse_pressures(text: str | Sequence[str]) -> list[tuple[str, float]]:
    """``"low,moderate,high"`` or ``"0.6,1.2"`` -> [(label, capacity / working set)]."""
    items = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    if not items:
        raise ValueError("no pressure level given")
    levels = []
    for item in items:
        if item in PRESSURE_LEVELS:
            levels.append((item, PRESSURE_LEVELS[item]))
            continue
        try:
            ratio = float(item)
        except ValueError:
            raise ValueError(
                f"unknown pressure level {item!r}: use {', '.join(PRESSURE_LEVELS)} or a number "
                "(KV capacity / working set, e.g. 0.6)"
            ) from None
        if ratio <= 0:
            raise ValueError(f"pressure {item!r} must be a positive number")
        levels.append((f"{ratio:g}", ratio))
    return levels


def parse_policies(text: str | Sequence[str]) -> list[str]:
    names = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise ValueError(f"unknown routing policy {', '.join(unknown) or '(none)'}; choose from {', '.join(POLICIES)}")
    return names


@dataclass(frozen=True)
class SweepConfig:
    replicas: int = 8
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    cost: StepCost = field(default_factory=StepCost)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    pressures: tuple[tuple[str, float], ...] = tuple(PRESSURE_LEVELS.items())
    seeds: tuple[int, ...] = (0, 1, 2)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192


@dataclass
class SweepRow:
    pressure: str
    kv_ratio: float  # KV capacity / working set
    kv_capacity: int  # tokens per replica
    policy: str
    seeds: int
    metrics: dict[str, float]  # mean over seeds of MEAN_METRICS
    speedup_vs: dict[str, float]  # gen tokens/s ratio against each other policy, mean of per-seed ratios
    per_seed: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def kv_capacity_for(config: SweepConfig, ratio: float) -> int:
    working_set = working_set_per_replica(config.workload, 0, config.replicas)
    # A replica must hold at least one whole context, whatever the pressure.
    return max(int(ratio * working_set), config.workload.max_context + 1)


def run_sweep(config: SweepConfig, on_result: Callable[[SimResult], None] | None = None) -> list[SweepRow]:
    rows: list[SweepRow] = []
    for label, ratio in config.pressures:
        capacity = kv_capacity_for(config, ratio)
        results: dict[str, list[SimResult]] = {}
        for policy in config.policies:
            results[policy] = []
            for seed in config.seeds:
                sim = SimConfig(
                    policy=policy,
                    replicas=config.replicas,
                    kv_capacity=capacity,
                    cost=config.cost,
                    workload=config.workload,
                    seed=seed,
                    max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                )
                result = simulate(sim)
                result.label = label
                results[policy].append(result)
                if on_result is not None:
                    on_result(result)
        for policy, runs in results.items():
            metrics = {m: float(np.mean([getattr(r, m) for r in runs])) for m in MEAN_METRICS}
            speedup = {
                other: float(
                    np.mean(
                        [
                            a.gen_tokens_per_s / b.gen_tokens_per_s
                            for a, b in zip(runs, results[other])
                            if b.gen_tokens_per_s > 0
                        ]
                    )
                )
                for other in config.policies
                if other != policy
            }
            rows.append(
                SweepRow(label, ratio, capacity, policy, len(runs), metrics, speedup, [r.to_dict() for r in runs])
            )
    return rows


def sweep_to_json(config: SweepConfig, rows: list[SweepRow]) -> dict:
    return {
        "config": {
            "replicas": config.replicas,
            "workload": asdict(config.workload),
            "cost": asdict(config.cost),
            "policies": list(config.policies),
            "pressures": [{"label": label, "kv_ratio": ratio} for label, ratio in config.pressures],
            "seeds": list(config.seeds),
            "working_set_per_replica": working_set_per_replica(config.workload, 0, config.replicas),
        },
        "results": [row.to_dict() for row in rows],
    }


def with_overrides(workload: WorkloadSpec, **changes) -> WorkloadSpec:
    """A copy of ``workload`` with the non-None ``changes`` applied."""
    return replace(workload, **{k: v for k, v in changes.items() if v is not None})

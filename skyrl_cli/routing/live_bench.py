"""The live routing benchmark (``skyrl bench routing --live / --calibrate``): the replay loop.

Per KV-pressure level: size the engines' KV cache from the workload's working set, have the caller
start ``LIVE_ENGINES`` CPU engines (``start_cluster``), then replay ``skyrl_cli.routing.live``'s
workload once per policy and repeat (the order rotated each repeat, so that no policy always runs
first while the machine's load drifts), through vllm-router for the policies it has and
client-side for ours. With ``calibrate`` the engines' step cost is measured right before each run
and the simulator, fitted to it, simulates the same run. Every run is appended to
``live-runs.jsonl`` as it finishes (kept if a later one fails); each policy is summarised by the
median of its runs; the report goes to ``live.json`` (``calibration.json`` with ``calibrate``).

The processes of each level come from ``start_cluster`` (``skyrl_cli.routing.cluster`` for the
command; the unit tests hand in a fake one).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING

import httpx

from skyrl_cli.launch.tiny_model import build_tiny_model_dir
from skyrl_cli.routing import calibrate as cal
from skyrl_cli.routing import live as lv
from skyrl_cli.routing.policies import make_policy
from skyrl_cli.routing.simulator import SimConfig, simulate
from skyrl_cli.routing.workload import WorkloadSpec, working_set_per_replica
from skyrl_contracts.atomic import write_json
from skyrl_contracts.errors import LaunchError
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import Recipe, TinyModelInit

if TYPE_CHECKING:
    from skyrl_cli.routing.cluster import SupervisedCluster

# Two tiny-model CPU engines, each on its own core; the workload is skyrl_cli.routing.live.LIVE_WORKLOAD.
LIVE_ENGINES = 2
LIVE_MODEL = {"hidden_size": 128, "layers": 2, "heads": 4, "max_position_embeddings": 2048}
LIVE_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*=?.,"
LIVE_MAX_NUM_SEQS = 64
CPU_BLOCK_SIZE = 128  # vLLM's KV block on CPU
CPU_MAX_BATCHED_TOKENS = 2048  # vLLM's default token budget per step for the CPU OpenAI server
KV_BYTES_PER_TOKEN = 2 * LIVE_MODEL["layers"] * LIVE_MODEL["hidden_size"] * 2  # K and V, bf16
ROUTER_POLICIES = ("round_robin", "consistent_hash", "sticky_least_loaded")  # what the recipe's router takes


# ------------------------------------------------------------------------------------ the contract
@dataclass(frozen=True)
class LiveBenchDir:
    """The benchmark's directory: the model, one run directory per level, the runs and the report."""

    root: Path

    @property
    def model(self) -> Path:
        return self.root / "model"

    def level(self, label: str) -> RunDir:
        """Where one pressure level's processes live (``logs/<process>.log``)."""
        return RunDir(self.root / f"pressure-{label}")

    @property
    def runs(self) -> Path:
        return self.root / "live-runs.jsonl"

    def report(self, calibrate: bool) -> Path:
        return self.root / ("calibration.json" if calibrate else "live.json")


@dataclass(frozen=True)
class ClusterRequest:
    """What to start for one pressure level: ``recipe.inference.engines`` engines serving ``model_dir``
    with the recipe's KV cache, their logs under ``run_dir``."""

    label: str
    run_dir: RunDir
    model_dir: Path
    recipe: Recipe


StartCluster = Callable[[ClusterRequest], AbstractContextManager["SupervisedCluster"]]


@dataclass(frozen=True)
class LiveBenchConfig:
    policies: Sequence[str]
    levels: Sequence[tuple[str, float]]  # (label, KV capacity / working set)
    seed: int = 0
    calibrate: bool = False
    repeats: int = 1
    workload: WorkloadSpec = lv.LIVE_WORKLOAD


# ------------------------------------------------------------------------------------ pieces
def live_recipe(policy: str, kv_cache_bytes: int, max_model_len: int) -> Recipe:
    """The engines' (and the router's) recipe; a policy vllm-router lacks gets round_robin (unused)."""
    router_policy = policy if policy in ROUTER_POLICIES else "round_robin"
    return Recipe.model_validate(
        {
            "name": "bench-routing",
            "model": {"init": LIVE_MODEL, "tokenizer": "char"},
            "data": {"task": "addition"},
            "rl": {},
            "inference": {
                "engines": LIVE_ENGINES,
                "kv_cache_bytes": kv_cache_bytes,
                "max_model_len": max_model_len,
                "max_num_seqs": LIVE_MAX_NUM_SEQS,
                "router": {"policy": router_policy},
            },
        }
    )


def build_live_model(model_dir: str | Path) -> list[int]:
    """The tiny random model and its character tokenizer; returns the token ids prompts may use."""
    return build_tiny_model_dir(TinyModelInit(**LIVE_MODEL), LIVE_ALPHABET, model_dir)


def kv_tokens_for(spec: WorkloadSpec, ratio: float, working_set: float) -> int:
    """KV tokens per engine at a pressure ratio: at least one whole context, in whole CPU blocks."""
    kv_tokens = max(int(ratio * working_set), spec.max_context + CPU_BLOCK_SIZE)
    return -(-kv_tokens // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE


def rotated(policies: Sequence[str], repeat: int) -> list[str]:
    """The order of one repeat: shifted by one each time, so that no policy always runs first."""
    policies = list(policies)
    shift = repeat % len(policies)
    return policies[shift:] + policies[:shift]


def summarize_runs(policy: str, runs: list[dict]) -> dict:
    """Median over repeated replays of one policy (and of their simulations), with every run kept."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    summary = {"policy": policy, "routed_by": runs[0]["routed_by"], "runs": runs}
    summary.update({k: median(r[k] for r in runs) for k in keys})
    if "simulated" in runs[0]:
        summary["sim_gen_tokens_per_s"] = median(r["simulated"]["gen_tokens_per_s"] for r in runs)
        summary["sim_over_live"] = summary["sim_gen_tokens_per_s"] / summary["gen_tokens_per_s"]
    return summary


def append_run(path: Path, record: dict) -> None:
    with open(path, "a") as fh:  # one line per run, kept even if a later run fails
        fh.write(json.dumps(record) + "\n")


def replay_failure(err: BaseException, cluster: "SupervisedCluster", level_dir: RunDir, runs: Path) -> LaunchError:
    """The error a failed replay ends the benchmark with: which processes exited, where their logs are."""
    dead = cluster.dead_processes()
    return LaunchError(
        f"live replay failed: {type(err).__name__}: {err}; "
        f"{'exited: ' + ', '.join(dead) if dead else 'no process exited'} "
        f"(logs in {level_dir.logs}; runs so far in {runs})"
    )


# ------------------------------------------------------------------------------------ one level
class _LevelReplay:
    """The repeats of every policy on one level's cluster (one asyncio session)."""

    def __init__(
        self,
        config: LiveBenchConfig,
        cluster: "SupervisedCluster",
        capacity: int,
        token_pool: Sequence[int],
        label: str,
        runs_path: Path,
        say: Callable[[str], None],
    ):
        self.config = config
        self.cluster = cluster
        self.urls = list(cluster.engine_urls)
        self.capacity = capacity
        self.token_pool = token_pool
        self.label = label
        self.runs_path = runs_path
        self.say = say

    async def session(self) -> dict[str, list[dict]]:
        runs: dict[str, list[dict]] = {p: [] for p in self.config.policies}
        async with lv.http_client() as http:
            for rep in range(self.config.repeats):
                for policy in rotated(self.config.policies, rep):
                    run = await self.run_policy(http, policy)
                    runs[policy].append(run)
                    append_run(self.runs_path, {"pressure": self.label, "repeat": rep, **run})
        return runs

    async def run_policy(self, http: httpx.AsyncClient, policy: str) -> dict:
        cfg = self.config
        fitted = None
        if cfg.calibrate:
            # Measured right before the run it predicts: on a shared machine the cost drifts.
            await lv.reset_engines(http, self.urls)
            self.say(f"measuring the engines' step cost before the {policy} run ...")
            fitted = await cal.measure_engines(http, self.urls, self.token_pool, cfg.seed)
        await lv.reset_engines(http, self.urls)
        target = await self._target(http, policy)
        self.say(f"replaying the workload with {policy} ({target.routed_by}) ...")
        result = (await lv.replay(cfg.workload, cfg.seed, policy, target, self.urls, self.token_pool, http)).to_dict()
        if fitted is not None:
            result["simulated"] = self._simulate(policy, fitted).to_dict()
            result["fitted"] = fitted.to_dict()
        return result

    async def _target(self, http: httpx.AsyncClient, policy: str):
        if make_policy(policy, self.urls).router_policy is not None:
            await self.cluster.start_router(policy)
            return lv.RouterTarget(http, self.cluster.router_url)
        return lv.ClientSideTarget(http, self.urls, make_policy(policy, self.urls, [self.capacity] * len(self.urls)))

    def _simulate(self, policy: str, fitted: cal.FittedCost):
        cfg = self.config
        return simulate(
            SimConfig(
                policy=policy,
                replicas=LIVE_ENGINES,
                kv_capacity=self.capacity,
                cost=fitted.cost,
                workload=cfg.workload,
                seed=cfg.seed,
                max_num_seqs=LIVE_MAX_NUM_SEQS,
                max_num_batched_tokens=CPU_MAX_BATCHED_TOKENS,
                block_size=CPU_BLOCK_SIZE,
                request_overhead_s=fitted.request_overhead_s,
            )
        )


# ------------------------------------------------------------------------------------ the benchmark
def run_live_bench(
    config: LiveBenchConfig,
    root: str | Path,
    start_cluster: StartCluster,
    *,
    say: Callable[[str], None] = print,
    on_level: Callable[[dict], None] | None = None,
) -> dict:
    """Run every level (``on_level`` gets each one's results as it finishes), write the report, return it.
    Everything ``start_cluster`` starts for a level is torn down (its context exits) before the next."""
    out = LiveBenchDir(Path(root))
    out.root.mkdir(parents=True, exist_ok=True)
    token_pool = build_live_model(out.model)
    spec = config.workload
    working_set = working_set_per_replica(spec, 0, LIVE_ENGINES)
    report: dict = {"workload": spec.__dict__, "engines": LIVE_ENGINES, "model": LIVE_MODEL, "levels": []}
    for label, ratio in config.levels:
        level = _run_level(config, out, label, ratio, working_set, token_pool, start_cluster, say)
        report["levels"].append(level)
        if on_level is not None:
            on_level(level)
    path = out.report(config.calibrate)
    write_json(path, report)
    say(f"results written to {path}")
    return report


def _run_level(
    config: LiveBenchConfig,
    out: LiveBenchDir,
    label: str,
    ratio: float,
    working_set: float,
    token_pool: Sequence[int],
    start_cluster: StartCluster,
    say: Callable[[str], None],
) -> dict:
    spec = config.workload
    kv_tokens = kv_tokens_for(spec, ratio, working_set)
    recipe = live_recipe("round_robin", kv_tokens * KV_BYTES_PER_TOKEN, spec.max_context + CPU_BLOCK_SIZE)
    request = ClusterRequest(label=label, run_dir=out.level(label), model_dir=out.model, recipe=recipe)
    level: dict = {"pressure": label, "kv_ratio": ratio, "results": []}
    with start_cluster(request) as cluster:
        capacity = lv.kv_capacity_from_log(cluster.engine_log(0)) or kv_tokens
        level["kv_capacity"] = capacity
        level["working_set"] = working_set
        replay = _LevelReplay(config, cluster, capacity, token_pool, label, out.runs, say)
        try:
            runs = asyncio.run(replay.session())
        except (httpx.HTTPError, OSError) as err:
            raise replay_failure(err, cluster, request.run_dir, out.runs) from err
    level["results"] = [summarize_runs(policy, runs[policy]) for policy in config.policies]
    return level

"""The live routing benchmark's loop (skyrl_cli.routing.live_bench) with a fake cluster and a fake replay:
rotation over repeats, medians, the JSON files, calibration, and a failed replay's error."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from skyrl_cli.routing import calibrate as cal
from skyrl_cli.routing import live as lv
from skyrl_cli.routing import live_bench as lb
from skyrl_cli.routing.engine_model import StepCost
from skyrl_contracts.errors import LaunchError

ROUTER_POLICY, CLIENT_POLICY = "consistent_hash", "sticky_kv_repin"  # one through vllm-router, one client-side


class FakeCluster:
    def __init__(self, request: lb.ClusterRequest, dead=()):
        self.request = request
        self.engine_urls = ["http://engine-0", "http://engine-1"]
        self.router_url = "http://router"
        self.routers: list[str] = []
        self.dead = list(dead)
        log = request.run_dir.log("engine-0")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("INFO ... CPU KV cache size: 4,096 tokens\n")

    async def start_router(self, policy: str) -> None:
        self.routers.append(policy)

    def dead_processes(self) -> list[str]:
        return self.dead

    def engine_log(self, index: int) -> Path:
        return self.request.run_dir.log(f"engine-{index}")


class Harness:
    """Fake cluster per level, a replay that returns canned figures (or fails on a chosen call)."""

    def __init__(self, monkeypatch, fail_on: int | None = None, dead=()):
        self.clusters: list[FakeCluster] = []
        self.replays: list[tuple[str, str]] = []  # (policy, routed_by) in call order
        self.fail_on = fail_on
        self.dead = dead
        self.torn_down = 0
        monkeypatch.setattr(lb, "build_live_model", lambda model_dir: [1, 2, 3])
        monkeypatch.setattr(lv, "reset_engines", self._reset)
        monkeypatch.setattr(lv, "replay", self._replay)

    @contextmanager
    def start_cluster(self, request):
        cluster = FakeCluster(request, self.dead)
        self.clusters.append(cluster)
        try:
            yield cluster
        finally:
            self.torn_down += 1

    async def _reset(self, http, urls):
        assert list(urls) == ["http://engine-0", "http://engine-1"]

    async def _replay(self, spec, seed, policy, target, urls, token_pool, http):
        if self.fail_on is not None and len(self.replays) == self.fail_on:
            raise httpx.ConnectError("connection refused")
        self.replays.append((policy, target.routed_by))
        n = sum(1 for p, _ in self.replays if p == policy)  # 1, 2, 3 ... per policy
        figures = {"gen_tokens_per_s": 100.0 * n, "steps": n, "prefix_hit_rate": 0.5}
        return _Result({"policy": policy, "routed_by": target.routed_by, **figures})


class _Result:
    def __init__(self, d):
        self.d = d

    def to_dict(self):
        return dict(self.d)


def _config(**kw):
    defaults = {"policies": [ROUTER_POLICY, CLIENT_POLICY, "round_robin"], "levels": [("moderate", 0.78)], "repeats": 3}
    return lb.LiveBenchConfig(**{**defaults, **kw})


def test_rotated_order():
    assert [lb.rotated("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]


def test_summary_is_the_median_of_the_runs():
    runs = [{"routed_by": "client", "gen_tokens_per_s": v, "ok": True, "note": "x"} for v in (300.0, 100.0, 200.0)]
    summary = lb.summarize_runs("p", runs)
    assert summary["gen_tokens_per_s"] == 200.0 and summary["policy"] == "p" and summary["routed_by"] == "client"
    assert summary["runs"] == runs and "ok" not in summary and "note" not in summary
    sim = [{**r, "simulated": {"gen_tokens_per_s": 2 * r["gen_tokens_per_s"]}} for r in runs]
    assert lb.summarize_runs("p", sim)["sim_over_live"] == pytest.approx(2.0)


def test_repeats_rotate_and_every_run_is_written(tmp_path, monkeypatch):
    h = Harness(monkeypatch)
    levels_seen = []
    report = lb.run_live_bench(_config(), tmp_path, h.start_cluster, say=lambda s: None, on_level=levels_seen.append)

    policies = _config().policies
    assert [p for p, _ in h.replays] == [p for r in range(3) for p in lb.rotated(policies, r)]
    assert dict(h.replays)[CLIENT_POLICY] == "client" and dict(h.replays)[ROUTER_POLICY] == "vllm-router"
    # vllm-router is (re)started before each run of a policy it implements, never for a client-side one
    assert h.clusters[0].routers == [p for p, by in h.replays if by == "vllm-router"]
    assert h.torn_down == 1

    lines = [json.loads(line) for line in (tmp_path / "live-runs.jsonl").read_text().splitlines()]
    assert [(x["repeat"], x["policy"]) for x in lines] == [(r, p) for r in range(3) for p in lb.rotated(policies, r)]
    assert all(x["pressure"] == "moderate" for x in lines)

    (level,) = report["levels"]
    assert levels_seen == [level]
    assert level["kv_capacity"] == 4096  # read from the engine's log
    assert [r["policy"] for r in level["results"]] == policies
    assert all(r["gen_tokens_per_s"] == 200.0 and len(r["runs"]) == 3 for r in level["results"])
    assert json.loads((tmp_path / "live.json").read_text()) == json.loads(json.dumps(report))
    assert not (tmp_path / "calibration.json").exists()


def test_cluster_request_sizes_the_kv_cache_in_whole_blocks(tmp_path, monkeypatch):
    h = Harness(monkeypatch)
    lb.run_live_bench(
        _config(levels=[("low", 1.5), ("high", 0.25)], repeats=1), tmp_path, h.start_cluster, say=lambda s: None
    )
    assert [c.request.label for c in h.clusters] == ["low", "high"] and h.torn_down == 2
    assert [c.request.run_dir.root for c in h.clusters] == [tmp_path / "pressure-low", tmp_path / "pressure-high"]
    for cluster in h.clusters:
        inf = cluster.request.recipe.inference
        tokens = inf.kv_cache_bytes // lb.KV_BYTES_PER_TOKEN
        assert tokens % lb.CPU_BLOCK_SIZE == 0 and tokens >= lv.LIVE_WORKLOAD.max_context + lb.CPU_BLOCK_SIZE
        assert inf.engines == lb.LIVE_ENGINES and cluster.request.model_dir == tmp_path / "model"


def test_calibrate_measures_before_each_run_and_simulates_it(tmp_path, monkeypatch):
    h = Harness(monkeypatch)
    measured = []

    async def measure(http, urls, token_pool, seed):
        measured.append(len(h.replays))
        return cal.FittedCost(StepCost(), request_overhead_s=0.01, points=[], max_relative_error=0.1)

    monkeypatch.setattr(cal, "measure_engines", measure)
    said = []
    report = lb.run_live_bench(
        _config(policies=[CLIENT_POLICY], calibrate=True, repeats=2), tmp_path, h.start_cluster, say=said.append
    )
    assert measured == [0, 1]
    (result,) = report["levels"][0]["results"]
    assert all("simulated" in run and "fitted" in run for run in result["runs"])
    assert result["sim_over_live"] == pytest.approx(result["sim_gen_tokens_per_s"] / result["gen_tokens_per_s"])
    assert (tmp_path / "calibration.json").exists() and not (tmp_path / "live.json").exists()
    assert said[-1] == f"results written to {tmp_path / 'calibration.json'}"


def test_a_failed_replay_names_the_dead_process_and_the_logs(tmp_path, monkeypatch):
    h = Harness(monkeypatch, fail_on=1, dead=["engine-1"])
    with pytest.raises(LaunchError) as err:
        lb.run_live_bench(_config(repeats=1), tmp_path, h.start_cluster, say=lambda s: None)
    message = str(err.value)
    assert "live replay failed: ConnectError" in message and "exited: engine-1" in message
    assert str(tmp_path / "pressure-moderate" / "logs") in message and str(tmp_path / "live-runs.jsonl") in message
    assert h.torn_down == 1
    assert len((tmp_path / "live-runs.jsonl").read_text().splitlines()) == 1  # the run before the failure is kept


def test_no_process_exited_is_said_too(tmp_path, monkeypatch):
    h = Harness(monkeypatch, fail_on=0)
    with pytest.raises(LaunchError, match="no process exited"):
        lb.run_live_bench(_config(repeats=1), tmp_path, h.start_cluster, say=lambda s: None)

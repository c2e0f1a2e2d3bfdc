"""Routing simulator: the replica model's KV bookkeeping, and whole runs (conservation, completion, determinism)."""

import pytest

from skyrl_cli.routing.engine_model import Replica, ReplicaSpec, Request, StepCost
from skyrl_cli.routing.simulator import SimConfig, Simulation, simulate
from skyrl_cli.routing.workload import WorkloadSpec, sample_group, working_set_per_replica

COST = StepCost(base_s=0.01, per_prefill_token_s=1e-4, per_seq_s=1e-3, per_kv_token_s=1e-6)

# Small enough for a unit test, long enough to overflow a small KV cache.
SMALL = WorkloadSpec(
    group_size=4,
    groups_per_step=2,
    trainer_steps=2,
    max_inflight_groups=4,
    max_staleness=1,
    trainer_step_s=5.0,
    turns_mean=6,
    prompt_mean=300,
    response_mean=60,
    observation_mean=60,
    max_response=200,
    max_context=2048,
    env_latency_mean_s=0.5,
)


def run_to_end(policy: str, kv_capacity: int, seed: int = 0, replicas: int = 3, block_size: int = 16):
    sim = Simulation(
        SimConfig(
            policy=policy,
            replicas=replicas,
            kv_capacity=kv_capacity,
            cost=COST,
            workload=SMALL,
            seed=seed,
            drain=True,
            check_invariants=True,
            block_size=block_size,
        )
    )
    return sim, sim.run()


# ---------------------------------------------------------------------------------------- step cost
def test_steps_within_inverts_run_time():
    for prefill, batch, kv in [(0, 1, 0), (5000, 7, 12345), (100, 64, 10**6)]:
        for elapsed in [0.0, 0.003, 0.05, 1.7, 30.0]:
            k = COST.steps_within(prefill, batch, kv, elapsed)
            assert k >= 1 and COST.run_time(prefill, batch, kv, k) >= elapsed
            assert k == 1 or COST.run_time(prefill, batch, kv, k - 1) < elapsed


def test_run_time_adds_up_step_by_step():
    prefill, batch, kv, steps = 300, 3, 1000, 5
    by_step = COST.per_prefill_token_s * prefill + sum(
        COST.base_s + COST.per_seq_s * batch + COST.per_kv_token_s * (kv + j * batch) for j in range(steps)
    )
    assert COST.run_time(prefill, batch, kv, steps) == pytest.approx(by_step)


# ---------------------------------------------------------------------------------------- replica
def test_single_request_timing_and_cache_entry():
    replica = Replica(0, ReplicaSpec(kv_capacity=10_000, block_size=1), COST)
    replica.enqueue(Request("s", prompt=500, response=20, arrival_s=0.0))
    end = replica.schedule(0.0)
    assert end == pytest.approx(COST.run_time(500, 1, 500, 20))  # one run: prefill, then 20 decode steps
    finished = replica.finish_run(end)
    assert [r.session for r in finished] == ["s"]
    assert replica.cache == {"s": 520} and replica.running_kv == 0
    assert replica.stats.generated_tokens == 20 and replica.stats.prefill_tokens == 500


def test_next_turn_reuses_the_cached_prefix():
    replica = Replica(0, ReplicaSpec(kv_capacity=10_000, block_size=1), COST)
    replica.enqueue(Request("s", 500, 20, 0.0))
    replica.finish_run(replica.schedule(0.0))
    replica.enqueue(Request("s", 520 + 80, 10, 1.0))  # previous context + an observation
    replica.schedule(1.0)
    assert replica.stats.cached_tokens == 520 and replica.stats.prefill_tokens == 500 + 80
    assert "s" not in replica.cache  # the entry is now the running request's KV


def test_cache_hits_are_whole_blocks():
    replica = Replica(0, ReplicaSpec(kv_capacity=10_000, block_size=128), COST)
    replica.enqueue(Request("s", 500, 20, 0.0))
    replica.finish_run(replica.schedule(0.0))  # cached: 520 tokens = 4 full blocks + 8
    replica.enqueue(Request("s", 600, 10, 1.0))
    replica.schedule(1.0)
    assert replica.stats.cached_tokens == 512


def test_admission_waits_for_kv_and_lru_evicts_tail_first():
    replica = Replica(0, ReplicaSpec(kv_capacity=1000, block_size=1), COST)
    replica._cache_put("old", 300)
    replica._cache_put("new", 300)
    replica.enqueue(Request("a", 600, 50, 0.0))
    replica.schedule(0.0)
    assert [r.session for r in replica.running] == ["a"]
    # 601 running + 600 cached > 1000: the least recently used entry loses its tail first.
    assert replica.cache == {"old": 99, "new": 300}
    replica.enqueue(Request("b", 600, 50, 0.0))  # does not fit next to "a": waits
    end = replica.cut_run(0.0) or replica.run_start_s + COST.run_time(600, 1, 600, replica.run_steps)
    replica.finish_run(end)
    replica.schedule(end)
    assert [r.session for r in replica.running] == ["a"] and [r.session for r in replica.waiting] == ["b"]


def test_preemption_takes_the_last_admitted_and_keeps_its_progress():
    replica = Replica(0, ReplicaSpec(kv_capacity=1000, block_size=1), COST)
    replica.enqueue(Request("a", 400, 500, 0.0))
    replica.enqueue(Request("b", 400, 500, 0.0))
    end = replica.schedule(0.0)
    assert len(replica.running) == 2
    assert replica.run_steps == (1000 - 800) // 2  # runs until the cache is full
    replica.finish_run(end)
    assert replica.running_kv == 1000
    replica.schedule(end)  # no room for the next step: preempt "b"
    assert [r.session for r in replica.running] == ["a"] and replica.waiting[0].session == "b"
    assert replica.stats.preemptions == 1
    b = replica.waiting[0]
    assert b.generated == 100 and b.context == 500  # resumes after recomputing 500 tokens
    assert replica.running_kv + replica.cached <= 1000


# ---------------------------------------------------------------------------------------- workload
def test_workload_is_deterministic_per_group_and_respects_max_context():
    a, b = sample_group(SMALL, 3, 7), sample_group(SMALL, 3, 7)
    assert [t.prompts for t in a] == [t.prompts for t in b]
    assert [t.prompts for t in a] != [t.prompts for t in sample_group(SMALL, 4, 7)]
    for t in a:
        assert t.session_id.startswith("7_") and len(t.env_delays) == t.turns - 1
        assert all(p + r <= SMALL.max_context for p, r in zip(t.prompts, t.responses))
        assert all(later > earlier for earlier, later in zip(t.prompts, t.prompts[1:]))  # contexts only grow
    assert working_set_per_replica(SMALL, 0, 2) == pytest.approx(2 * working_set_per_replica(SMALL, 0, 4))


# ---------------------------------------------------------------------------------------- whole runs
@pytest.mark.parametrize("policy", ["round_robin", "consistent_hash", "sticky_least_loaded", "sticky_kv_repin"])
def test_every_trajectory_finishes_and_tokens_are_conserved_under_pressure(policy):
    # 2.5k tokens per replica: a handful of contexts; check_invariants asserts after every event that
    # running + cached KV never exceeds capacity and the running sums match the requests.
    sim, result = run_to_end(policy, kv_capacity=2_500)
    assert result.preemptions > 0  # the pressure path is exercised
    assert result.trajectories_finished == result.trajectories_started == len(sim.trajectories)
    assert all(t.turn == t.turns and len(t.replicas) == t.turns for t in sim.trajectories)
    # Every response token is generated exactly once, preemptions notwithstanding.
    assert result.generated_tokens == sum(t.generated_tokens for t in sim.trajectories)
    stats = [r.stats for r in sim.replicas]
    assert sum(s.prompt_tokens for s in stats) == sum(s.cached_tokens + s.prefill_tokens for s in stats)
    assert all(not r.running and not r.waiting for r in sim.replicas)
    assert result.steps == SMALL.trainer_steps


def test_sticky_hit_rate_matches_the_ceiling_without_eviction():
    # One replica, room for everything: turn t reuses turn t-1's whole context, so the cached tokens
    # are exactly the sum over later turns of (previous prompt + previous response).
    sim, result = run_to_end("sticky_least_loaded", kv_capacity=10**6, replicas=1, block_size=1)
    expected = sum(p + r for t in sim.trajectories for p, r in zip(t.prompts[:-1], t.responses[:-1]))
    total = sum(sum(t.prompts) for t in sim.trajectories)
    assert result.preemptions == 0
    assert result.prefix_hit_rate == pytest.approx(expected / total)


def test_same_seed_same_result_other_seed_other_result():
    def key(result):
        d = result.to_dict()
        d.pop("wall_s")
        return d

    a, b = run_to_end("sticky_kv_repin", 4_000, seed=5)[1], run_to_end("sticky_kv_repin", 4_000, seed=5)[1]
    assert key(a) == key(b)
    assert key(a) != key(run_to_end("sticky_kv_repin", 4_000, seed=6)[1])


def test_staleness_bound_limits_groups_started():
    sim = Simulation(SimConfig(policy="consistent_hash", replicas=2, kv_capacity=10**5, cost=COST, workload=SMALL))
    result = sim.run()
    # Group g may start only once g < (steps_done + staleness + 1) * groups_per_step; the run stops
    # after the last step, so at most (steps + staleness) * groups_per_step groups ever started.
    bound = (SMALL.trainer_steps + SMALL.max_staleness) * SMALL.groups_per_step
    assert result.trajectories_started <= bound * SMALL.group_size
    assert result.steps == SMALL.trainer_steps and result.step_time_s >= SMALL.trainer_step_s


def test_capacity_below_one_context_is_rejected():
    with pytest.raises(ValueError, match="must hold one full context"):
        simulate(SimConfig(policy="round_robin", kv_capacity=1000, workload=SMALL))

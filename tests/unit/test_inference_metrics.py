"""Engine / router metrics parsing and the events derived from them (hand-computed values)."""

from __future__ import annotations

import math

import pytest

from skyrl_cli.engines.metrics import (
    EngineSnapshot,
    Interval,
    SpecTotals,
    coefficient_of_variation,
    engine_events,
    parse_prometheus,
    router_events,
    spec_decode_stats,
)

# The shape of vLLM 0.32's /metrics (names, labels, counter suffixes), values chosen by hand.
ENGINE_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="policy"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="policy"} 1.0
# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="policy",reason="capacity"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="policy"} 0.25
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="policy"} 2.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="policy"} 400.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="policy"} 300.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="policy"} 1000.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="policy"} 10.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="policy"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="policy"} 15.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="policy",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="policy",position="1"} 7.0
"""


def snapshot(text: str = ENGINE_METRICS, now: float = 100.0) -> EngineSnapshot:
    return EngineSnapshot.from_metrics(parse_prometheus(text), now)


def test_parse_sums_label_sets_and_keeps_names_apart():
    values = parse_prometheus(ENGINE_METRICS)
    assert values["vllm:num_requests_waiting"] == 1.0  # not mixed with ..._by_reason
    assert values["vllm:num_requests_waiting_by_reason"] == 7.0
    assert values["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == 15.0
    assert values["vllm:generation_tokens_total"] == 1000.0


def test_snapshot_fields():
    s = snapshot()
    assert (s.running, s.waiting, s.kv_cache_usage, s.preemptions) == (3.0, 1.0, 0.25, 2.0)
    assert (s.prefix_queries, s.prefix_hits, s.generation_tokens) == (400.0, 300.0, 1000.0)
    assert (s.spec_drafts, s.spec_draft_tokens, s.spec_accepted_tokens) == (10.0, 30.0, 15.0)


def test_missing_metrics_read_as_zero():
    s = EngineSnapshot.from_metrics({}, 0.0)
    assert s.running == 0.0 and s.spec_drafts == 0.0


def later(**changes) -> EngineSnapshot:
    base = snapshot()
    fields = {**base.__dict__, **changes}
    return EngineSnapshot(**fields)


def test_interval_counts_increments_and_engine_restarts():
    prev = snapshot(now=100.0)
    cur = later(time=102.0, generation_tokens=1500.0, preemptions=5.0, prefix_queries=500.0, prefix_hits=380.0)
    iv = Interval.between(prev, cur)
    assert iv.seconds == 2.0 and iv.generation_tokens == 500.0 and iv.preemptions == 3.0
    assert (iv.prefix_queries, iv.prefix_hits) == (100.0, 80.0)
    restarted = later(time=104.0, generation_tokens=40.0)  # counter went backwards: engine restarted
    assert Interval.between(cur, restarted).generation_tokens == 40.0


def test_spec_decode_stats():
    # 10 verification steps proposing 3 tokens each (30), 15 accepted:
    # acceptance 0.5, 1 + 15/10 = 2.5 tokens per step.
    assert spec_decode_stats(30, 10, 15) == {"spec/acceptance_rate": 0.5, "spec/mean_accepted_length": 2.5}
    # Speculation on, nothing proposed: zeros, not nothing (acceptance 0, one token per step).
    assert spec_decode_stats(0, 0, 0) == {"spec/acceptance_rate": 0.0, "spec/mean_accepted_length": 1.0}


def test_snapshot_knows_whether_the_engine_speculates():
    assert snapshot().speculative
    assert not EngineSnapshot.from_metrics({"vllm:num_requests_running": 1.0}, 0.0).speculative
    zeros = {f"vllm:spec_decode_num_{n}_total": 0.0 for n in ("drafts", "draft_tokens", "accepted_tokens")}
    assert EngineSnapshot.from_metrics(zeros, 0.0).speculative


def test_coefficient_of_variation():
    assert coefficient_of_variation([4, 4]) == 0.0
    assert coefficient_of_variation([0, 0]) == 0.0
    assert coefficient_of_variation([2, 6]) == pytest.approx(0.5)  # std 2 / mean 4


def test_engine_events_aggregate_over_engines():
    a0, b0 = snapshot(now=100.0), snapshot(now=100.0)
    a1 = later(
        time=102.0, running=2.0, kv_cache_usage=0.5, generation_tokens=1200.0, prefix_queries=500.0, prefix_hits=350.0
    )
    b1 = later(
        time=102.0,
        running=6.0,
        kv_cache_usage=0.1,
        generation_tokens=1600.0,
        spec_drafts=20.0,
        spec_draft_tokens=60.0,
        spec_accepted_tokens=45.0,
    )
    intervals = {0: Interval.between(a0, a1), 1: Interval.between(b0, b1)}
    totals = SpecTotals()
    for iv in intervals.values():
        totals.add(iv)
    events = engine_events({0: a1, 1: b1}, intervals, totals)
    assert events["engine/running"] == 8.0
    assert events["engine/kv_cache_usage"] == pytest.approx(0.3)
    assert events["engine/running_cv"] == pytest.approx(0.5)
    assert events["engine/gen_tokens_per_s"] == pytest.approx(100.0 + 300.0)  # 200/2 s + 600/2 s
    assert events["engine/1/gen_tokens_per_s"] == pytest.approx(300.0)
    assert events["engine/prefix_cache_hit_rate"] == pytest.approx(50 / 100)  # (50 + 0) / (100 + 0)
    assert events["engine/preemptions"] == 0.0
    # Only engine 1 speculated in the interval: 30 proposed, 30 accepted, 10 steps.
    assert (events["spec/drafts"], events["spec/draft_tokens"], events["spec/accepted_tokens"]) == (10, 30, 30)
    assert events["spec/acceptance_rate"] == pytest.approx(1.0)
    assert events["spec/mean_accepted_length"] == pytest.approx(4.0)


def test_speculating_engines_report_zero_drafts_and_others_nothing():
    idle = later(time=102.0)  # speculating engine, no counter moved
    events = engine_events({0: idle}, {0: Interval.between(snapshot(), idle)}, SpecTotals())
    assert {k: v for k, v in events.items() if k.startswith("spec/")} == {
        "spec/drafts": 0.0,
        "spec/draft_tokens": 0.0,
        "spec/accepted_tokens": 0.0,
        "spec/acceptance_rate": 0.0,
        "spec/mean_accepted_length": 1.0,
    }
    plain = later(time=102.0, speculative=False)
    assert not any(k.startswith("spec/") for k in engine_events({0: plain}, {0: None}, SpecTotals()))


def test_spec_totals_are_run_totals_across_scrapes_and_restarts():
    totals = SpecTotals()
    s0, s1 = snapshot(now=0.0), later(time=5.0, spec_drafts=14.0, spec_draft_tokens=42.0, spec_accepted_tokens=21.0)
    totals.add(Interval.between(s0, s1))  # 4 drafts, 12 tokens, 6 accepted
    restarted = later(time=10.0, spec_drafts=2.0, spec_draft_tokens=6.0, spec_accepted_tokens=6.0)
    totals.add(Interval.between(s1, restarted))  # counters went backwards: the new totals are the increment
    assert (totals.drafts, totals.draft_tokens, totals.accepted_tokens) == (6.0, 18.0, 12.0)
    assert totals.events()["spec/acceptance_rate"] == pytest.approx(12 / 18)
    assert totals.events()["spec/mean_accepted_length"] == pytest.approx(1 + 12 / 6)


def test_first_scrape_has_gauges_but_no_rates():
    events = engine_events({0: snapshot()}, {0: None})
    assert events["engine/running"] == 3.0 and "engine/gen_tokens_per_s" not in events
    assert engine_events({}, {}) == {}


def test_engine_indices_survive_a_failed_scrape():
    events = engine_events({1: snapshot()}, {1: None})
    assert "engine/1/running" in events and "engine/0/running" not in events


def test_router_events_skip_engines_without_a_load():
    loads = {"workers": [{"worker": "http://h:1", "load": -1}, {"worker": "http://h:2/", "load": 5}]}
    assert router_events(loads, ["http://h:1", "http://h:2"]) == {"router/workers": 2.0, "router/load/1": 5.0}
    assert math.isclose(router_events({}, [])["router/workers"], 0.0)

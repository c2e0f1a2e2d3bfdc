"""Routing policies: what each sends where, and the sticky bookkeeping (pins, release, re-pinning)."""

import pytest

from skyrl_cli.routing.policies import DEFAULT_POLICIES, POLICIES, make_policy

WORKERS = [f"http://w{i}:8000" for i in range(4)]


def test_registry_and_unknown_policy():
    assert set(DEFAULT_POLICIES) <= set(POLICIES)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("nope", WORKERS)


def test_round_robin_cycles_regardless_of_session():
    policy = make_policy("round_robin", WORKERS)
    assert [policy.route("same", 10) for _ in range(6)] == [0, 1, 2, 3, 0, 1]


def test_consistent_hash_is_sticky_without_bookkeeping():
    policy = make_policy("consistent_hash", WORKERS)
    first = {f"s{i}": policy.route(f"s{i}", 10) for i in range(50)}
    policy.finish_session("s0")  # nothing to release: the ring decides
    assert all(policy.route(s, 999) == w for s, w in first.items())
    assert len(set(first.values())) == len(WORKERS)


def test_sticky_least_loaded_spreads_new_sessions_and_sticks():
    policy = make_policy("sticky_least_loaded", WORKERS)
    placed = [policy.route(f"s{i}", 100) for i in range(4)]
    assert sorted(placed) == [0, 1, 2, 3]  # one new session per worker
    assert policy.active_sessions == [1, 1, 1, 1]
    for i, worker in enumerate(placed):  # later turns stick, whatever their size
        assert policy.route(f"s{i}", 5000) == worker
    assert policy.active_sessions == [1, 1, 1, 1]  # repeated turns are not new sessions


def test_finish_session_releases_capacity():
    policy = make_policy("sticky_least_loaded", WORKERS)
    placed = {f"s{i}": policy.route(f"s{i}", 100) for i in range(8)}
    assert policy.active_sessions == [2, 2, 2, 2]
    policy.finish_session("s5")
    freed = placed["s5"]
    assert policy.active_sessions[freed] == 1
    assert policy.route("new", 100) == freed  # the only worker below the others
    policy.finish_session("never-seen")  # unknown session: no-op
    assert sum(policy.active_sessions) == 8
    for s in list(placed) + ["new"]:
        policy.finish_session(s)
    assert policy.active_sessions == [0, 0, 0, 0] and policy.pinned_tokens == [0, 0, 0, 0]


def test_pinned_tokens_follow_requests_and_responses():
    policy = make_policy("sticky_least_loaded", WORKERS)
    w = policy.route("s", 1000)
    assert policy.pinned_tokens[w] == 1000
    policy.on_response("s", w, 1300)
    assert policy.pinned_tokens[w] == 1300
    policy.route("s", 1500)
    assert policy.pinned_tokens[w] == 1500
    policy.finish_session("s")
    assert policy.pinned_tokens[w] == 0


def test_sticky_kv_repin_behaves_like_sticky_least_loaded_without_overload():
    ours = make_policy("sticky_kv_repin", WORKERS, [10_000] * 4)
    sll = make_policy("sticky_least_loaded", WORKERS, [10_000] * 4)
    for turn in range(5):
        for i in range(12):
            assert ours.route(f"s{i}", 100 + 50 * turn) == sll.route(f"s{i}", 100 + 50 * turn)
    assert ours.moves == 0


def test_sticky_kv_repin_moves_a_session_off_an_overloaded_worker():
    ours = make_policy("sticky_kv_repin", WORKERS[:2], [20_000, 20_000])
    home = {s: ours.route(s, 1000) for s in "abc"}
    heavy = 0 if ours.active_sessions[0] == 2 else 1
    light = 1 - heavy
    x, y = [s for s, w in home.items() if w == heavy]
    ours.on_response(x, heavy, 15_000)  # the heavy worker's sessions grew ...
    ours.on_response(y, heavy, 6_000)  # ... beyond its KV capacity (21k > 20k)
    assert ours.route(y, 6_200) == light or ours.moves == 1  # the first to come back moves
    assert ours.moves == 1
    assert ours.active_sessions == ([1, 2] if heavy == 0 else [2, 1])
    assert ours.pinned_tokens == [sum(p.context_tokens for p in ours.pins.values() if p.worker == w) for w in (0, 1)]
    assert ours.route(x, 15_200) == heavy  # no longer overloaded: x stays
    assert ours.route(y, 6_500) == light  # and y sticks to its new home
    assert ours.moves == 1


def test_sticky_kv_repin_stays_when_no_worker_has_room():
    ours = make_policy("sticky_kv_repin", WORKERS[:2], [10_000, 10_000])
    home = {s: ours.route(s, 1000) for s in "abcd"}
    for s, w in home.items():
        ours.on_response(s, w, 6000)  # both workers at 12k pinned > 10k
    assert all(ours.route(s, 6500) == w for s, w in home.items())
    assert ours.moves == 0

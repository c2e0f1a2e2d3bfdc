"""Consistent-hash ring (as vllm-router's consistent_hash) and rendezvous tie-breaking."""

from collections import Counter

from skyrl_cli.routing.hashring import VIRTUAL_NODES_PER_WORKER, ConsistentHashRing, hash64, rendezvous_pick

WORKERS = [f"http://10.0.0.{i}:8000" for i in range(8)]
KEYS = [f"{instance}_{rep}" for instance in range(1250) for rep in range(8)]  # SkyRL session ids


def test_hash_is_stable_across_calls_and_processes():
    # A fixed value: Python's hash() is salted per process, ours must not be.
    assert hash64("task-17_3") == hash64("task-17_3")
    assert hash64("a") != hash64("b")
    assert hash64("abc") == int.from_bytes(__import__("hashlib").blake2b(b"abc", digest_size=8).digest(), "little")


def test_ring_has_160_virtual_nodes_per_worker():
    ring = ConsistentHashRing(WORKERS)
    assert VIRTUAL_NODES_PER_WORKER == 160
    assert len(ring._points) == 160 * len(WORKERS)


def test_assignment_is_stable():
    a, b = ConsistentHashRing(WORKERS), ConsistentHashRing(list(reversed(WORKERS)))
    assert all(a.lookup(k) == b.lookup(k) for k in KEYS[:2000])  # independent of insertion order


def test_keys_spread_over_all_workers():
    ring = ConsistentHashRing(WORKERS)
    counts = Counter(ring.lookup(k) for k in KEYS)
    mean = len(KEYS) / len(WORKERS)
    assert set(counts) == set(WORKERS)
    # 160 virtual nodes keep every arc within ~10% of 1/N; 10k keys add ~3% sampling noise.
    assert max(counts.values()) / mean < 1.3
    assert min(counts.values()) / mean > 0.7


def test_adding_a_worker_moves_about_one_nth_of_keys_all_to_it():
    ring = ConsistentHashRing(WORKERS)
    before = {k: ring.lookup(k) for k in KEYS}
    new = "http://10.0.0.99:8000"
    ring.add(new)
    moved = [k for k in KEYS if ring.lookup(k) != before[k]]
    assert all(ring.lookup(k) == new for k in moved)
    assert 0.6 / 9 < len(moved) / len(KEYS) < 1.5 / 9


def test_removing_a_worker_moves_only_its_keys():
    ring = ConsistentHashRing(WORKERS)
    before = {k: ring.lookup(k) for k in KEYS}
    gone = WORKERS[3]
    ring.remove(gone)
    moved = [k for k in KEYS if ring.lookup(k) != before[k]]
    assert set(moved) == {k for k, w in before.items() if w == gone}
    assert 0.6 / 8 < len(moved) / len(KEYS) < 1.5 / 8


def test_rendezvous_pick_is_deterministic_and_spreads():
    assert rendezvous_pick("s1", WORKERS) == rendezvous_pick("s1", list(reversed(WORKERS)))
    counts = Counter(rendezvous_pick(k, WORKERS) for k in KEYS[:4000])
    assert len(counts) == len(WORKERS) and max(counts.values()) < 2 * 4000 / len(WORKERS)

"""Hashing used by the routing policies: a consistent-hash ring and rendezvous tie-breaking.

The ring mirrors vllm-router's ``consistent_hash`` policy: every worker is placed on the ring at 160
virtual nodes (``"{worker}:{i}"``), a key goes to the first virtual node clockwise from its hash.
vllm-router hashes with mcrouter's furc/murmur hash; we use the first 8 bytes of BLAKE2b. Any
well-mixed 64-bit hash gives the same load statistics: the imbalance comes from the ring
structure (arc lengths) and from sampling sessions, not from the particular hash function.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Sequence

VIRTUAL_NODES_PER_WORKER = 160


def hash64(key: str) -> int:
    """A stable (not per-process salted) 64-bit hash of a string."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


class ConsistentHashRing:
    """Maps keys to workers; adding or removing one of N workers moves about 1/N of the keys."""

    def __init__(self, workers: Sequence[str], virtual_nodes: int = VIRTUAL_NODES_PER_WORKER):
        if not workers:
            raise ValueError("a hash ring needs at least one worker")
        self.virtual_nodes = virtual_nodes
        self.workers: list[str] = []
        self._points: list[tuple[int, str]] = []
        self._hashes: list[int] = []
        for worker in workers:
            self.add(worker)

    def _rebuild_index(self) -> None:
        self._points.sort()
        self._hashes = [h for h, _ in self._points]

    def add(self, worker: str) -> None:
        if worker in self.workers:
            return
        self.workers.append(worker)
        self._points.extend((hash64(f"{worker}:{i}"), worker) for i in range(self.virtual_nodes))
        self._rebuild_index()

    def remove(self, worker: str) -> None:
        self.workers.remove(worker)
        self._points = [p for p in self._points if p[1] != worker]
        self._rebuild_index()

    def lookup(self, key: str) -> str:
        """The worker owning ``key``: first virtual node at or after its hash, wrapping around."""
        i = bisect.bisect_left(self._hashes, hash64(key))
        return self._points[i % len(self._points)][1]


def rendezvous_pick(key: str, candidates: Sequence[str]) -> str:
    """Highest-random-weight choice among ``candidates``: deterministic per key (vllm-router's tie-break)."""
    return max(candidates, key=lambda worker: hash64(f"{key}:{worker}"))

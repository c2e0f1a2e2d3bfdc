"""Routing policies, written as a router sees the world.

A policy only uses what a router in front of the engines can know: the session id and size of each
request it forwards, the size of each response it relays, ``/finish_session`` calls, and static
facts about the workers (their URLs and KV-cache capacity, which vLLM publishes in ``/metrics``). It
never peeks into an engine's scheduler, so every policy here could run inside vllm-router.

``round_robin``, ``consistent_hash`` and ``sticky_least_loaded`` follow vllm-router 0.1.x;
``sticky_kv_repin`` is ours (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from skyrl_cli.routing.hashring import ConsistentHashRing, rendezvous_pick


class RoutingPolicy:
    """Base class: ``route`` picks a worker index for one request of a session."""

    name = "base"
    # The vllm-router --policy that behaves the same, or None when the router has no equivalent.
    router_policy: str | None = None

    def __init__(self, workers: Sequence[str], kv_capacity_tokens: Sequence[int] | None = None):
        if not workers:
            raise ValueError("a policy needs at least one worker")
        self.workers = list(workers)
        self.kv_capacity_tokens = list(kv_capacity_tokens) if kv_capacity_tokens else None

    def route(self, session_id: str, prompt_tokens: int) -> int:
        raise NotImplementedError

    def on_response(self, session_id: str, worker: int, context_tokens: int) -> None:
        """The router relayed a response; the session's context is now ``context_tokens`` long."""

    def finish_session(self, session_id: str) -> None:
        """The client called ``/finish_session``: the trajectory is over."""


class RoundRobin(RoutingPolicy):
    name = "round_robin"
    router_policy = "round_robin"

    def __init__(self, workers, kv_capacity_tokens=None):
        super().__init__(workers, kv_capacity_tokens)
        self._next = 0

    def route(self, session_id: str, prompt_tokens: int) -> int:
        worker = self._next
        self._next = (self._next + 1) % len(self.workers)
        return worker


class ConsistentHash(RoutingPolicy):
    """Session key hashed onto a ring of 160 virtual nodes per worker; no notion of load."""

    name = "consistent_hash"
    router_policy = "consistent_hash"

    def __init__(self, workers, kv_capacity_tokens=None):
        super().__init__(workers, kv_capacity_tokens)
        self.ring = ConsistentHashRing(self.workers)
        self._index = {url: i for i, url in enumerate(self.workers)}

    def route(self, session_id: str, prompt_tokens: int) -> int:
        return self._index[self.ring.lookup(session_id)]


@dataclass
class _Pin:
    worker: int
    context_tokens: int = 0


class StickyPolicy(RoutingPolicy):
    """Shared bookkeeping of the sticky policies: session pins, active sessions and pinned tokens per worker."""

    def __init__(self, workers, kv_capacity_tokens=None):
        super().__init__(workers, kv_capacity_tokens)
        self.pins: dict[str, _Pin] = {}
        self.active_sessions = [0] * len(self.workers)
        # Sum over a worker's active sessions of their last known context length: the KV-cache
        # demand the worker will see when those sessions come back for their next turn.
        self.pinned_tokens = [0] * len(self.workers)

    def choose_new(self, session_id: str, prompt_tokens: int) -> int:
        raise NotImplementedError

    def route(self, session_id: str, prompt_tokens: int) -> int:
        pin = self.pins.get(session_id)
        if pin is None:
            worker = self.choose_new(session_id, prompt_tokens)
            pin = self.pins[session_id] = _Pin(worker)
            self.active_sessions[worker] += 1
        self._set_context(pin, prompt_tokens)
        return pin.worker

    def _set_context(self, pin: _Pin, tokens: int) -> None:
        self.pinned_tokens[pin.worker] += tokens - pin.context_tokens
        pin.context_tokens = tokens

    def on_response(self, session_id: str, worker: int, context_tokens: int) -> None:
        pin = self.pins.get(session_id)
        if pin is not None:
            self._set_context(pin, context_tokens)

    def finish_session(self, session_id: str) -> None:
        pin = self.pins.pop(session_id, None)
        if pin is not None:
            self.active_sessions[pin.worker] -= 1
            self.pinned_tokens[pin.worker] -= pin.context_tokens

    def _tie_break(self, session_id: str, candidates: list[int]) -> int:
        if len(candidates) == 1:
            return candidates[0]
        url = rendezvous_pick(session_id, [self.workers[i] for i in candidates])
        return self.workers.index(url)


class StickyLeastLoaded(StickyPolicy):
    """vllm-router's sticky_least_loaded: a new session goes to the worker with the fewest active
    sessions (ties by rendezvous hash of the session id) and stays there until ``finish_session``."""

    name = "sticky_least_loaded"
    router_policy = "sticky_least_loaded"

    def choose_new(self, session_id: str, prompt_tokens: int) -> int:
        least = min(self.active_sessions)
        return self._tie_break(session_id, [i for i, n in enumerate(self.active_sessions) if n == least])


class StickyKvRepin(StickyLeastLoaded):
    """Ours: sticky_least_loaded, plus re-pinning of sessions away from replicas whose KV cache they overflow.

    Stickiness is worth something only while the session's prefix is still cached. A router knows the
    context length of every session (it forwards the requests and relays the responses) and each
    replica's KV capacity, so it knows each replica's *pinned demand*: the sum of its active sessions'
    contexts. Session counts can be equal while pinned demand differs several-fold (30 sessions on
    their 35th turn against 30 on their 2nd). Once a replica's pinned demand exceeds its KV capacity,
    its LRU cache evicts the prefixes of the sessions that are waiting on their environment, just
    before they come back: those sessions recompute their whole context every turn, the replica slows
    down, its sessions live longer, and it stays overloaded (the cliff sticky_least_loaded cannot see).

    So: new sessions go where sticky_least_loaded sends them. A later turn sticks, unless its replica
    is overloaded (pinned demand above capacity) and another replica still has room for the session's
    context; then the session moves to the one of those with the fewest active sessions. A move costs
    one recomputation of a prefix that the overloaded replica was likely to have evicted anyway, and
    the session's later turns hit the cache at its new home. When every replica is overloaded or none
    is, nothing moves and the policy is sticky_least_loaded.
    """

    name = "sticky_kv_repin"
    router_policy = None  # not in vllm-router 0.1.x; live mode routes it client-side

    def __init__(self, workers, kv_capacity_tokens=None):
        super().__init__(workers, kv_capacity_tokens)
        self.moves = 0

    def route(self, session_id: str, prompt_tokens: int) -> int:
        pin = self.pins.get(session_id)
        if pin is not None and self.kv_capacity_tokens is not None:
            capacity = self.kv_capacity_tokens
            home = pin.worker
            if self.pinned_tokens[home] > capacity[home]:
                roomy = [
                    i
                    for i in range(len(self.workers))
                    if i != home and self.pinned_tokens[i] + prompt_tokens <= capacity[i]
                ]
                if roomy:
                    fewest = min(self.active_sessions[i] for i in roomy)
                    target = self._tie_break(session_id, [i for i in roomy if self.active_sessions[i] == fewest])
                    self._move(pin, target)
        return super().route(session_id, prompt_tokens)

    def _move(self, pin: _Pin, target: int) -> None:
        self.active_sessions[pin.worker] -= 1
        self.pinned_tokens[pin.worker] -= pin.context_tokens
        pin.worker, pin.context_tokens = target, 0
        self.active_sessions[target] += 1
        self.moves += 1


POLICIES: dict[str, Callable[..., RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobin, ConsistentHash, StickyLeastLoaded, StickyKvRepin)
}
DEFAULT_POLICIES = ("round_robin", "consistent_hash", "sticky_least_loaded", "sticky_kv_repin")


def make_policy(name: str, workers: Sequence[str], kv_capacity_tokens: Sequence[int] | None = None) -> RoutingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}") from None
    return factory(workers, kv_capacity_tokens)

"""A model of one vLLM replica: continuous batching, a KV cache with prefix caching, preemption.

What it keeps from vLLM's (v1) scheduler, because routing outcomes hinge on it:

- KV cache of ``kv_capacity`` tokens. A running request holds its whole context (prompt + tokens
  generated so far) and needs one more slot per decode step.
- Prefix caching: when a request finishes (or is preempted) its KV is not freed but kept as a
  cache entry for its session, evictable in LRU order (tail first, so a partly evicted entry still
  serves a shorter prefix). The next turn of the session on this replica reuses the entry's tokens
  instead of recomputing them. Caches are per replica: a session that moves loses its prefix.
- Each engine step first reserves a slot for every running request; if the cache (after evicting
  every cached entry) cannot, the most recently admitted request is preempted: its KV goes back to
  the cache as an ordinary entry, it goes to the front of the waiting queue and later recomputes
  its context (minus whatever of it is still cached). No new requests are admitted in a step that
  preempted. Otherwise waiting requests are admitted first-come first-served while their whole
  context fits, the batch has a free sequence slot and the step's prefill token budget lasts (the
  first request is always taken: a long prompt is one long step here instead of several chunks,
  which costs the same time).
- Step time: ``base + per_prefill_token * prefill_tokens + per_seq * running + per_kv_token *
  kv_tokens_attended``: a fixed launch cost, compute-bound prefill, and memory-bound decode whose
  cost grows with the batch and with the context it attends over.

KV is counted in tokens, with half a block of slack per running request for its partly filled last
block; cache hits are whole blocks. No chunking (see above) and no block-level sharing between
sessions (identical task prompts of one group are not deduplicated) are the simplifications.

Speed: between two events nothing changes the batch, so the replica jumps over runs of identical
decode steps in one event (until the first request finishes, the cache fills, or a new request
arrives and must join at the next step boundary). A request's KV is ``base + n`` where ``n`` is the
replica's step counter, so the total KV of the batch is a running sum plus ``n * batch`` and no
per-request work is done per step.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """Engine step time, seconds: base + per_prefill_token*P + per_seq*running + per_kv_token*KV."""

    base_s: float = 0.012
    per_prefill_token_s: float = 4e-5
    per_seq_s: float = 2.5e-4
    per_kv_token_s: float = 2e-8

    def run_time(self, prefill_tokens: int, batch: int, kv_tokens: int, steps: int) -> float:
        """Time of ``steps`` steps of a fixed batch whose first step also prefills ``prefill_tokens``
        and whose KV grows by ``batch`` tokens per step from ``kv_tokens``."""
        per_step = self.base_s + self.per_seq_s * batch + self.per_kv_token_s * kv_tokens
        growth = self.per_kv_token_s * batch
        return self.per_prefill_token_s * prefill_tokens + steps * per_step + growth * steps * (steps - 1) / 2

    def steps_within(self, prefill_tokens: int, batch: int, kv_tokens: int, elapsed_s: float) -> int:
        """Fewest steps (>= 1) whose run time reaches ``elapsed_s``: the next step boundary after it."""
        per_step = self.base_s + self.per_seq_s * batch + self.per_kv_token_s * kv_tokens
        growth = self.per_kv_token_s * batch
        remaining = elapsed_s - self.per_prefill_token_s * prefill_tokens
        if remaining <= 0:
            return 1
        # Solve growth/2 k^2 + (per_step - growth/2) k = remaining for k, then round up.
        a, b = growth / 2, per_step - growth / 2
        k = remaining / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * remaining)) / (2 * a)
        k = max(1, math.ceil(k - 1e-9))
        while k > 1 and self.run_time(prefill_tokens, batch, kv_tokens, k - 1) >= elapsed_s:
            k -= 1
        while self.run_time(prefill_tokens, batch, kv_tokens, k) < elapsed_s:
            k += 1
        return k


@dataclass(frozen=True)
class ReplicaSpec:
    kv_capacity: int  # tokens of KV cache
    max_num_seqs: int = 256  # vLLM --max-num-seqs
    max_num_batched_tokens: int = 8192  # prefill token budget per step
    block_size: int = 16  # KV block (vLLM: 16 on GPUs, 128 on CPU): cache hits are whole blocks


class Request:
    """One model turn of one trajectory, as the replica sees it."""

    __slots__ = (
        "session",
        "prompt",
        "response",
        "generated",
        "n0",
        "base",
        "finish_step",
        "arrival_s",
        "owner",
        "alive",
    )

    def __init__(self, session: str, prompt: int, response: int, arrival_s: float, owner=None):
        self.session = session
        self.prompt = prompt  # prompt tokens of this turn
        self.response = response  # tokens to generate
        self.generated = 0  # tokens generated before the current admission (kept on preemption)
        self.n0 = 0  # replica step counter at the current admission
        self.base = 0  # KV while running = base + replica.n
        self.finish_step = 0
        self.arrival_s = arrival_s
        self.owner = owner  # the trajectory, for the simulator
        self.alive = False  # running (entries in the finish heap of a preempted request go stale)

    @property
    def context(self) -> int:
        return self.prompt + self.generated


@dataclass
class ReplicaStats:
    prompt_tokens: int = 0  # context tokens of every admission (recomputations included)
    cached_tokens: int = 0  # of which served from the prefix cache
    prefill_tokens: int = 0  # of which computed
    generated_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0


class Replica:
    def __init__(self, index: int, spec: ReplicaSpec, cost: StepCost):
        self.index = index
        self.spec = spec
        self.cost = cost
        self.n = 0  # engine steps completed
        self.running: list[Request] = []  # admission order (the last is preempted first)
        self.base_sum = 0  # sum of running requests' base
        self.waiting: deque[Request] = deque()
        self.cache: OrderedDict[str, int] = OrderedDict()  # session -> cached tokens, LRU first
        self.cached = 0  # tokens in self.cache
        self._finish_heap: list[tuple[int, int, Request]] = []
        self._tie = 0
        self.stats = ReplicaStats()
        # The run in progress: steps planned, its start, its shape, and a version to cancel its event.
        self.busy = False
        self.run_start_s = 0.0
        self.run_steps = 0
        self.run_prefill = 0
        self.run_kv = 0
        self.run_version = 0

    # ------------------------------------------------------------------ views
    @property
    def running_kv(self) -> int:
        return self.base_sum + self.n * len(self.running)

    # ------------------------------------------------------------------ cache
    def _evict_to_fit(self, reserved: int) -> None:
        """Evict LRU cache entries (tail first) until ``reserved + cached <= capacity``."""
        excess = reserved + self.cached - self.spec.kv_capacity
        while excess > 0 and self.cache:
            session, tokens = next(iter(self.cache.items()))
            if tokens <= excess:
                del self.cache[session]
                self.cached -= tokens
                excess -= tokens
            else:
                self.cache[session] = tokens - excess
                self.cached -= excess
                excess = 0

    def _cache_put(self, session: str, tokens: int) -> None:
        old = self.cache.pop(session, 0)
        self.cached += tokens - old
        self.cache[session] = tokens

    def _cache_hit(self, entry: int, context: int) -> int:
        """Tokens of ``context`` served by a cache entry of ``entry`` tokens: whole blocks only, and
        the last prompt token is always computed."""
        bs = self.spec.block_size
        return min(entry, context - 1) // bs * bs

    def _headroom(self, batch: int) -> int:
        """KV tokens usable by ``batch`` running requests: each one's last block is on average half empty."""
        return self.spec.kv_capacity - batch * (self.spec.block_size // 2)

    # ------------------------------------------------------------------ scheduling
    def enqueue(self, request: Request) -> bool:
        """Queue a request; True when a busy replica should cut its run to admit it at the next step."""
        self.waiting.append(request)
        return self.busy and len(self.waiting) == 1 and len(self.running) < self.spec.max_num_seqs

    def finish_run(self, now_s: float) -> list[Request]:
        """Account for the steps of the run that just ended; returns the requests that finished."""
        steps = self.run_steps
        batch = len(self.running)
        self.stats.busy_s += now_s - self.run_start_s
        self.stats.steps += steps
        self.stats.generated_tokens += batch * steps
        self.n += steps
        self.busy = False
        # The batch grew into cached entries during the run: evict them now (no lookup happened meanwhile).
        self._evict_to_fit(self.running_kv + self.spec.kv_capacity - self._headroom(len(self.running)))
        finished: list[Request] = []
        heap = self._finish_heap
        while heap and heap[0][0] <= self.n:
            _, _, request = heapq.heappop(heap)
            if not request.alive or request.finish_step != self.n:
                continue  # stale entry of a preempted (or re-admitted) request
            request.alive = False
            self.base_sum -= request.base
            self.running.remove(request)
            self._cache_put(request.session, request.prompt + request.response)
            finished.append(request)
        return finished

    def _preempt_last(self) -> None:
        victim = self.running.pop()
        victim.alive = False
        kv = victim.base + self.n
        self.base_sum -= victim.base
        victim.generated += self.n - victim.n0
        self._cache_put(victim.session, kv)
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1

    def _admit(self, request: Request) -> int:
        """Move the head of the queue into the batch; returns its prefill tokens."""
        self.waiting.popleft()
        context = request.context
        entry = self.cache.pop(request.session, 0)
        self.cached -= entry
        hit = self._cache_hit(entry, context)
        request.n0 = self.n
        request.base = context - self.n
        request.finish_step = self.n + request.response - request.generated
        request.alive = True
        self.base_sum += request.base
        self.running.append(request)
        self._tie += 1
        heapq.heappush(self._finish_heap, (request.finish_step, self._tie, request))
        self.stats.prompt_tokens += context
        self.stats.cached_tokens += hit
        self.stats.prefill_tokens += context - hit
        return context - hit

    def schedule(self, now_s: float) -> float | None:
        """Plan the next run of steps; returns when it ends, or None when there is nothing to run."""
        capacity = self.spec.kv_capacity
        preempted = False
        while self.running and self.running_kv + len(self.running) > self._headroom(len(self.running)):
            self._preempt_last()
            preempted = True
        prefill = 0
        budget_left_waiting = False  # the step's token budget, not KV, stopped admissions
        if not preempted:
            while self.waiting and len(self.running) < self.spec.max_num_seqs:
                request = self.waiting[0]
                context = request.context
                # Whole context plus one decode slot for everyone, cached entries being evictable
                # (its own entry is reused, so it is not double counted).
                if self.running_kv + context + len(self.running) + 1 > self._headroom(len(self.running) + 1):
                    break
                uncached = context - self._cache_hit(self.cache.get(request.session, 0), context)
                if prefill and prefill + uncached > self.spec.max_num_batched_tokens:
                    budget_left_waiting = True
                    break
                prefill += self._admit(request)
        if not self.running:
            return None
        batch = len(self.running)
        kv = self.running_kv
        self._evict_to_fit(kv + batch + (capacity - self._headroom(batch)))
        heap = self._finish_heap
        while not heap[0][2].alive or heap[0][2].finish_step != heap[0][0]:
            heapq.heappop(heap)
        until_finish = heap[0][0] - self.n
        until_full = (self._headroom(batch) - kv) // batch
        # A request left waiting for token budget joins at the very next step.
        steps = 1 if budget_left_waiting else max(1, min(until_finish, until_full))
        self.busy = True
        self.run_start_s = now_s
        self.run_steps = steps
        self.run_prefill = prefill
        self.run_kv = kv
        self.run_version += 1
        return now_s + self.cost.run_time(prefill, batch, kv, steps)

    def cut_run(self, now_s: float) -> float | None:
        """A request arrived during a run: end the run at the first step boundary after ``now_s``.
        Returns the new end time, or None when the run already ends then."""
        steps = self.cost.steps_within(self.run_prefill, len(self.running), self.run_kv, now_s - self.run_start_s)
        if steps >= self.run_steps:
            return None
        self.run_steps = steps
        self.run_version += 1
        return self.run_start_s + self.cost.run_time(self.run_prefill, len(self.running), self.run_kv, steps)

"""Fully-async group buffer: a staleness bound, capacity returned by dropped groups, resumable state.

Versions and batches. Policy version v is the weights after v training steps (v = 0: the initial
weights). Training batch k (the k-th batch taken, from 0) is trained on version k, so a group whose
generation was admitted at version ``sv`` has staleness ``k - sv`` when it is trained.

Admission (capacity, as in SkyRL / AReaL): generation may start a group only while
``consumed + buffered + running < (S + v + 1) * B`` (S = max_staleness, B = groups per batch,
v = latest published version, consumed = B * batches taken). Dropped groups leave the count, so
their capacity goes back to generation and a run with many zero-variance groups cannot deadlock.
S = 0 is the synchronous schedule: B groups, train, B groups, ...

Hard bound. The capacity rule alone bounds staleness only on average: a slow group admitted early
can finish after newer groups were trained. So every group has a deadline ``sv + S`` (the last
batch that may train it) and ``take`` serves groups earliest-deadline-first, and takes batch k only
when, for every later batch index d, the groups still waiting (buffered or running) with deadline
<= d fit into batches k+1..d. When a straggler is about to miss its deadline the trainer waits for
it instead of training past it. Admission keeps this feasible, so no group is ever trained with
staleness > S (the proof is the EDF argument; ``test_rollout_buffer`` checks it on random schedules).

Partial batches. A batch never holds more than B groups. Sync dynamic sampling (``take_batch(
partial_after_drops=n)``) cuts a batch short once more than n groups were dropped since the last
one, under the same rule: up to B buffered groups, earliest deadlines first, only when every group
still waiting stays feasible. At S = 0 that means waiting for the groups admitted at the current
version; meanwhile no group is admitted that the cut would have to wait for, so the bound does stop
sampling. After ``close`` the buffered groups are drained B at a time and later ones are not kept.
Dynamic sampling (DAPO's filter: groups whose rewards are all equal teach nothing) is this drop;
its expected oversampling is ``1 / (1 - z)`` with zero-variance fraction ``z = p^n + (1 - p)^n``
(accuracy p, n samples per prompt), e.g. 1.75x at n = 8, p = 0.9.

``StalenessController`` is the pure bookkeeping (deterministic, unit-testable); ``AsyncGroupBuffer``
wraps it and a ``PromptSampler`` for the orchestrator's asyncio generation workers and trainer feed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Iterable

from .batch import Group, generation_span_s, staleness

# ------------------------------------------------------------------------------ prompt order


@dataclass(frozen=True)
class PromptRef:
    epoch: int
    index: int  # row index in the training rows

    @property
    def uid(self) -> str:
        """Unique across epochs: the group key and the prefix of its router session ids."""
        return f"{self.epoch}-{self.index}"

    @staticmethod
    def parse(uid: str) -> "PromptRef":
        epoch, index = uid.split("-")
        return PromptRef(int(epoch), int(index))


class PromptSampler:
    """Epoch-wise seeded permutations of the training rows; remembers which prompts are finished
    (trained or dropped) so a resumed run neither retrains nor regenerates them, while prompts
    that were in flight at the checkpoint are drawn again."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        if num_rows <= 0:
            raise ValueError("no training rows to sample prompts from")
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self.consumed_total = 0
        self.dropped_total = 0
        self._consumed: set[str] = set()
        self._dropped: set[str] = set()
        self._outstanding: dict[str, PromptRef] = {}
        self._requeued: deque[PromptRef] = deque()
        self._start_epoch(0)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._pos = 0
        self._order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)

    def next(self) -> PromptRef:
        if self._requeued:
            ref = self._requeued.popleft()
        else:
            while True:
                if self._pos >= self.num_rows:
                    self._start_epoch(self.epoch + 1)
                ref = PromptRef(self.epoch, self._order[self._pos])
                self._pos += 1
                if ref.uid not in self._consumed and ref.uid not in self._dropped and ref.uid not in self._outstanding:
                    break
        self._outstanding[ref.uid] = ref
        return ref

    def mark_consumed(self, uid: str) -> None:
        self._outstanding.pop(uid, None)
        self._consumed.add(uid)
        self.consumed_total += 1

    def mark_dropped(self, uid: str) -> None:
        self._outstanding.pop(uid, None)
        self._dropped.add(uid)
        self.dropped_total += 1

    def requeue(self, uid: str) -> None:
        """A prompt whose generation failed: draw it again next."""
        ref = self._outstanding.pop(uid, None) or PromptRef.parse(uid)
        self._requeued.append(ref)

    def state_dict(self, unconsumed: Iterable[str] = ()) -> dict[str, Any]:
        """JSON-able state. ``unconsumed``: uids marked consumed that the checkpoint's model has not
        trained on yet (prefetched batches); they are treated as in flight."""
        pending = set(unconsumed)
        open_refs = [*self._outstanding.values(), *self._requeued, *(PromptRef.parse(u) for u in pending)]
        resume_epoch = min([self.epoch, *(r.epoch for r in open_refs)])
        keep = lambda uids: sorted(u for u in uids if u not in pending and PromptRef.parse(u).epoch >= resume_epoch)  # noqa: E731
        return {
            "num_rows": self.num_rows,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": resume_epoch,
            "consumed": keep(self._consumed),
            "dropped": keep(self._dropped),
            "consumed_total": self.consumed_total - len(pending & self._consumed),
            "dropped_total": self.dropped_total,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "PromptSampler":
        sampler = cls(int(state["num_rows"]), int(state["seed"]), bool(state.get("shuffle", True)))
        sampler._start_epoch(int(state["epoch"]))
        sampler._consumed = set(state["consumed"])
        sampler._dropped = set(state["dropped"])
        sampler.consumed_total = int(state.get("consumed_total", len(sampler._consumed)))
        sampler.dropped_total = int(state.get("dropped_total", len(sampler._dropped)))
        return sampler


# ------------------------------------------------------------------------------ staleness bookkeeping


class StalenessController:
    """Admission, drop and earliest-deadline batch selection; no waiting, no locks."""

    def __init__(self, batch_groups: int, max_staleness: int, version: int = 0, batches_taken: int | None = None):
        if batch_groups <= 0 or max_staleness < 0:
            raise ValueError("batch_groups must be > 0 and max_staleness >= 0")
        self.B = batch_groups
        self.S = max_staleness
        self.version = version
        self.batches_taken = version if batches_taken is None else batches_taken
        self.dropped_total = 0
        self.dropped_since_take = 0
        self.partial_after_drops: int | None = None  # the drop bound of sync dynamic sampling (None: off)
        self._running: Counter[int] = Counter()  # start_version -> groups generating
        self._ready: list[Group] = []

    # -- generation side
    @property
    def running(self) -> int:
        return sum(self._running.values())

    @property
    def buffered(self) -> int:
        return len(self._ready)

    @property
    def capacity(self) -> int:
        limit = (self.S + self.version + 1) * self.B
        return limit - (self.batches_taken * self.B + self.buffered + self.running)

    def can_start(self) -> bool:
        """Capacity, and while a partial batch is due no group that would hold it up: otherwise the
        slot of every dropped group would be refilled at once (at S = 0 the new group is due in the
        very batch the trainer waits to cut) and the drop bound would never stop sampling."""
        if self.capacity <= 0:
            return False
        return not self.partial_due or self._can_take(1, extra_running=(self.version,))

    def start(self) -> int:
        """Admit one group; returns its start version. Raises when ``can_start()`` is False."""
        if not self.can_start():
            raise RuntimeError("no generation capacity (check can_start before start)")
        self._running[self.version] += 1
        return self.version

    def _release(self, start_version: int) -> None:
        if self._running[start_version] <= 0:
            raise RuntimeError(f"no running group was admitted at version {start_version}")
        self._running[start_version] -= 1
        if not self._running[start_version]:
            del self._running[start_version]

    def finish(self, group: Group, keep: bool = True) -> None:
        """A group finished generating; ``keep=False`` drops it (its capacity returns)."""
        self._release(group.start_version)
        if keep:
            self._ready.append(group)
        else:
            self.dropped_total += 1
            self.dropped_since_take += 1

    def abort(self, start_version: int) -> None:
        """A group's generation failed (or finished after close): free its slot."""
        self._release(start_version)

    # -- trainer side
    def _deadline(self, start_version: int) -> int:
        return start_version + self.S

    def _ordered_ready(self) -> list[Group]:
        return sorted(self._ready, key=lambda g: g.start_version)  # stable: arrival order breaks ties

    def _feasible_after(self, remaining_versions: list[int], next_batch: int) -> bool:
        """Can groups with these start versions all be trained by their deadlines, in batches
        next_batch, next_batch + 1, ...?"""
        waiting = 0
        for deadline in sorted(self._deadline(v) for v in remaining_versions):
            waiting += 1
            if waiting > (deadline - next_batch + 1) * self.B:
                return False
        return True

    def _can_take(self, min_groups: int, extra_running: tuple[int, ...] = ()) -> bool:
        """At least ``min_groups`` are buffered, and taking up to B of them now (earliest deadlines
        first) leaves every group still waiting (plus ``extra_running``) feasible."""
        if self.buffered < min_groups:
            return False
        if not self.running and not extra_running:
            return True  # everything is in hand: earliest deadlines first is the best there is
        rest = self._ordered_ready()[self.B :]
        remaining = [g.start_version for g in rest] + list(self._running.elements()) + list(extra_running)
        return self._feasible_after(remaining, self.batches_taken + 1)

    @property
    def partial_due(self) -> bool:
        """More groups than ``partial_after_drops`` were dropped since the last batch and some are
        buffered: sync dynamic sampling stops sampling and trains on fewer than B groups."""
        bound = self.partial_after_drops
        return bound is not None and self.dropped_since_take > bound and self.buffered > 0

    def batch_ready(self) -> bool:
        return self._can_take(self.B)

    def partial_ready(self) -> bool:
        """A batch of up to B groups may be cut now: ``partial_due`` and, as for a full batch,
        nothing still waiting would miss its deadline (else the trainer waits for the running ones)."""
        return self.partial_due and self._can_take(1)

    def _pop(self, n: int) -> list[Group]:
        ordered = self._ordered_ready()
        batch, self._ready = ordered[:n], ordered[n:]
        self.batches_taken += 1
        self.dropped_since_take = 0
        return batch

    def take(self, *, partial: bool = False) -> list[Group]:
        """The next training batch (batch index ``batches_taken``), earliest deadlines first: B
        groups once ``batch_ready()``; with ``partial=True`` also up to B once ``partial_ready()``."""
        if not (self.batch_ready() or (partial and self.partial_ready())):
            raise RuntimeError("batch not ready (check batch_ready / partial_ready before take)")
        return self._pop(self.B)

    def drain(self) -> list[Group]:
        """At most B buffered groups, earliest deadlines first, without waiting for running ones
        (the buffer is closed: groups finishing later are never trained). A subset of a feasible set
        stays feasible, so the drained batches keep the bound too. Empty when nothing is buffered."""
        return self._pop(self.B) if self._ready else []

    def publish(self, version: int) -> None:
        """The trainer published new weights."""
        if version < self.version:
            raise ValueError(f"policy version went back from {self.version} to {version}")
        self.version = version


# ------------------------------------------------------------------------------ asyncio buffer


@dataclass
class TakenBatch:
    step: int  # batch index = the policy version it is trained on
    groups: list[Group]
    staleness_mean: float
    staleness_max: int
    dropped_since_last: int  # zero-variance groups dropped since the previous batch
    wait_s: float  # time the trainer waited for this batch

    def metrics(self) -> dict[str, float]:
        span = generation_span_s(self.groups)
        return {
            **({"timing/generate_s": span} if span is not None else {}),
            # versions between each group's first token and the step it is handed over for (the
            # learner's async/staleness_* count from each sample's oldest token to the step it trains)
            "rollout/batch_staleness_mean": self.staleness_mean,
            "rollout/batch_staleness_max": float(self.staleness_max),
            "async/dropped_groups": float(self.dropped_since_last),
            "timing/wait_for_generation_buffer_s": self.wait_s,
        }


class AsyncGroupBuffer:
    """The orchestrator's meeting point of generation workers and the trainer feed (one event loop).

    generation worker::

        while (slot := await buffer.start_group()) is not None:
            ref, version = slot                      # the prompt to roll out, the admitting version
            try:
                group = await generate(ref, version)  # Group(ref.uid, samples, start_version=version)
            except Exception:
                await buffer.abort_group(ref, version); continue
            await buffer.finish_group(group)

    trainer feed::

        batch = await buffer.take_batch()            # waits; None once closed and drained
        ... train on batch.groups (step batch.step) ...
        await buffer.publish_version(batch.step + 1)
        state = buffer.state_dict()                  # JSON, into the checkpoint
    """

    def __init__(
        self,
        sampler: PromptSampler,
        batch_groups: int,
        max_staleness: int,
        *,
        drop_zero_variance: bool = False,
        version: int = 0,
    ):
        self.sampler = sampler
        self.controller = StalenessController(batch_groups, max_staleness, version=version)
        self.drop_zero_variance = drop_zero_variance
        self._cond = asyncio.Condition()
        self._closed = False
        self._taken_uids: dict[int, list[str]] = {}
        self.generation_blocked_s = 0.0  # time generation waited for capacity (staleness bound)
        self.last_batch_partial = False  # the last batch was cut short (closed, or the drop bound)

    # -- generation side
    async def start_group(self) -> tuple[PromptRef, int] | None:
        async with self._cond:
            began = time.monotonic()
            await self._cond.wait_for(lambda: self._closed or self.controller.can_start())
            self.generation_blocked_s += time.monotonic() - began
            if self._closed:
                return None
            return self.sampler.next(), self.controller.start()

    async def finish_group(self, group: Group) -> bool:
        """Returns False when the group was dropped (all rewards equal, dynamic sampling on) or the
        buffer is closed (no batch waits for it: its prompt stays in flight, drawn again on resume)."""
        async with self._cond:
            if self._closed:
                self.controller.abort(group.start_version)
                self._cond.notify_all()
                return False
            keep = not (self.drop_zero_variance and group.all_rewards_equal())
            self.controller.finish(group, keep=keep)
            if not keep:
                self.sampler.mark_dropped(group.prompt_uid)
            self._cond.notify_all()
            return keep

    async def abort_group(self, ref: PromptRef, start_version: int) -> None:
        async with self._cond:
            self.controller.abort(start_version)
            self.sampler.requeue(ref.uid)
            self._cond.notify_all()

    # -- trainer side
    async def take_batch(self, *, partial_after_drops: int | None = None) -> TakenBatch | None:
        """The next batch of at most B groups (waits). ``partial_after_drops``: the bound of sync
        dynamic sampling: once more groups than this were dropped since the last batch, generation
        stops admitting groups the cut would have to wait for, and up to B buffered groups are
        taken as soon as that leaves every running group able to meet its deadline (see
        ``StalenessController.partial_ready``). The bound stays set until the next call."""
        c = self.controller
        async with self._cond:
            if c.partial_after_drops != partial_after_drops:
                c.partial_after_drops = partial_after_drops
                self._cond.notify_all()  # a lifted bound may re-open admission
            began = time.monotonic()
            await self._cond.wait_for(lambda: self._closed or c.batch_ready() or c.partial_ready())
            step, dropped = c.batches_taken, c.dropped_since_take
            self.last_batch_partial = not c.batch_ready()
            if c.batch_ready() or c.partial_ready():
                groups = c.take(partial=True)
            else:  # closed: train on what is left, B groups at a time, if anything
                groups = c.drain()
                if not groups:
                    return None
            for g in groups:
                self.sampler.mark_consumed(g.prompt_uid)
            self._taken_uids[step] = [g.prompt_uid for g in groups]
            for old in [k for k in self._taken_uids if k < step - 2 * (c.S + 2)]:
                del self._taken_uids[old]
            mean, worst = staleness(groups, step)
            self._cond.notify_all()  # taking frees capacity
            return TakenBatch(step, groups, mean, worst, dropped, time.monotonic() - began)

    async def publish_version(self, version: int) -> None:
        async with self._cond:
            self.controller.publish(version)
            self._cond.notify_all()

    async def close(self) -> None:
        """Stop admitting and wake every waiter: ``start_group`` returns None, ``take_batch``
        returns what is buffered, B groups at a time (then None); groups finishing later are not
        kept."""
        async with self._cond:
            self._closed = True
            self._cond.notify_all()

    def fill(self) -> dict[str, float]:
        c = self.controller
        return {
            "async/buffer_groups": float(c.buffered),
            "async/running_groups": float(c.running),
            "async/capacity": float(max(c.capacity, 0)),
            "async/generation_blocked_s": self.generation_blocked_s,
        }

    # -- checkpoint
    def state_dict(self, trained_batches: int | None = None) -> dict[str, Any]:
        """JSON-able state for a checkpoint whose model has trained ``trained_batches`` batches
        (default: every batch taken). Groups buffered or in flight are not saved: their prompts
        are drawn again after a resume; dropped prompts are not."""
        c = self.controller
        trained = c.batches_taken if trained_batches is None else trained_batches
        pending = [u for k, uids in self._taken_uids.items() if k >= trained for u in uids]
        return {
            "version": trained,
            "batch_groups": c.B,
            "max_staleness": c.S,
            "dropped_groups": c.dropped_total,
            "sampler": self.sampler.state_dict(unconsumed=pending),
        }

    @classmethod
    def from_state(
        cls, state: dict[str, Any], batch_groups: int, max_staleness: int, *, drop_zero_variance: bool = False
    ) -> "AsyncGroupBuffer":
        """Resume (batch size and staleness come from the current recipe; they may change)."""
        buffer = cls(
            PromptSampler.from_state(state["sampler"]),
            batch_groups,
            max_staleness,
            drop_zero_variance=drop_zero_variance,
            version=int(state["version"]),
        )
        buffer.controller.dropped_total = int(state.get("dropped_groups", 0))
        return buffer

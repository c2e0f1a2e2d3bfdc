"""Dynamic micro-batching: pure functions from sequence lengths to a per-rank micro-batch layout.

One optimizer step's global batch (sequence lengths, indexed 0..n-1) is laid out as
``StepLayout.per_rank[rank] -> micro-batches -> indices``:

1. ``balance_across_ranks``: longest-processing-time greedy. Sequences sorted by length (descending)
   go one by one to the data-parallel rank holding the fewest tokens, so every rank gets about the
   same number of TOKENS (not sequences).
2. Per rank, sequences are packed into micro-batches under a token budget ``max_tokens``:
   - ``pack_padded``: sorted by length, contiguous runs with ``count * longest <= max_tokens`` (the
     padded size), chosen to minimise padded slots plus a per-micro-batch overhead. Neighbouring
     lengths are close, so right-padding wastes little, and the attention cost stays ``sum(L^2)``. Used where attention has no variable-length kernel (CPU
     sdpa/eager: a block-diagonal mask over one packed row still costs ``(sum L)^2``).
   - ``pack_padding_free``: first-fit decreasing with ``sum(lengths) <= max_tokens``; the sequences
     are concatenated in one row with restarting position ids (flash-attention varlen on GPUs).
   A sequence longer than the budget gets a micro-batch of its own; sequences are never split.
3. Every rank runs the same number of micro-batches (``num_microbatches``): the ranks with fewer run
   zero-weight padding micro-batches, because ZeRO-2/3 gradient reduction is collective per backward.

``fixed_layout`` is the baseline: rank r takes every world_size-th sequence, ``micro_batch_size``
sequences per micro-batch, in data order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal, Sequence

Layout = Literal["padded", "padding_free"]
MicroBatches = tuple[tuple[int, ...], ...]


def _by_length_desc(indices: Sequence[int], lengths: Sequence[int]) -> list[int]:
    return sorted(indices, key=lambda i: (-lengths[i], i))


def balance_across_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices per rank with near-equal token sums (ties go to the lower rank)."""
    heap = [(0, rank) for rank in range(world_size)]
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in _by_length_desc(range(len(lengths)), lengths):
        load, rank = heapq.heappop(heap)
        shards[rank].append(i)
        heapq.heappush(heap, (load + lengths[i], rank))
    return shards


MICROBATCH_OVERHEAD_TOKENS = 128  # fixed cost of one more micro-batch (launches, weight reads), in token slots


def pack_padded(
    indices: Sequence[int], lengths: Sequence[int], max_tokens: int, overhead_tokens: int = MICROBATCH_OVERHEAD_TOKENS
) -> list[list[int]]:
    """Micro-batches whose padded size (count x longest) fits ``max_tokens``, with the least total
    cost ``sum(count x longest) + overhead_tokens x micro-batches``.

    Sorted by length, the best micro-batches are contiguous runs, so an exact dynamic programme over
    the run boundaries finds them (each run is bounded by the budget, so it is cheap)."""
    order = _by_length_desc(indices, lengths)
    n = len(order)
    best = [0] + [float("inf")] * n  # best[j]: cost of packing order[:j]
    cut = [0] * (n + 1)
    for i in range(n):  # a run starting at i: its longest is order[i]
        longest = lengths[order[i]]
        for j in range(i + 1, n + 1):
            size = (j - i) * longest
            if size > max_tokens and j > i + 1:
                break
            cost = best[i] + size + overhead_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i
    batches, j = [], n
    while j > 0:
        batches.append(order[cut[j] : j])
        j = cut[j]
    return batches[::-1]


def pack_padding_free(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: micro-batches whose token sum fits ``max_tokens``."""
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in _by_length_desc(indices, lengths):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                batches[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            batches.append([i])
            loads.append(lengths[i])
    return batches


def computed_tokens(micro_batch: Sequence[int], lengths: Sequence[int], layout: Layout) -> int:
    """Token slots the model computes for a micro-batch (padding included)."""
    if not micro_batch:
        return 0
    if layout == "padding_free":
        return sum(lengths[i] for i in micro_batch)
    return len(micro_batch) * max(lengths[i] for i in micro_batch)


@dataclass(frozen=True)
class StepLayout:
    per_rank: tuple[MicroBatches, ...]
    layout: Layout

    @property
    def world_size(self) -> int:
        return len(self.per_rank)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches every rank runs (the most any rank needs)."""
        return max((len(mbs) for mbs in self.per_rank), default=0)

    def padding_microbatches(self, rank: int | None = None) -> int:
        """Zero-weight micro-batches run to keep ranks in step (one rank, or all ranks)."""
        ranks = range(self.world_size) if rank is None else (rank,)
        return sum(self.num_microbatches - len(self.per_rank[r]) for r in ranks)

    def rank_tokens(self, lengths: Sequence[int]) -> list[int]:
        return [sum(lengths[i] for mb in mbs for i in mb) for mbs in self.per_rank]

    def packing_efficiency(self, lengths: Sequence[int]) -> float:
        """Real tokens / computed token slots over all ranks (1.0: no padding at all)."""
        real = sum(self.rank_tokens(lengths))
        slots = sum(computed_tokens(mb, lengths, self.layout) for mbs in self.per_rank for mb in mbs)
        return real / slots if slots else 1.0

    def rank_imbalance(self, lengths: Sequence[int]) -> float:
        """Most tokens on one rank / mean tokens per rank (1.0: perfectly balanced)."""
        tokens = self.rank_tokens(lengths)
        mean = sum(tokens) / len(tokens) if tokens else 0
        return max(tokens) / mean if mean else 1.0


def dynamic_layout(
    lengths: Sequence[int],
    world_size: int,
    max_tokens: int,
    layout: Layout = "padded",
    overhead_tokens: int = MICROBATCH_OVERHEAD_TOKENS,
) -> StepLayout:
    shards = balance_across_ranks(lengths, world_size)
    if layout == "padding_free":
        per_rank = [pack_padding_free(shard, lengths, max_tokens) for shard in shards]
    else:
        per_rank = [pack_padded(shard, lengths, max_tokens, overhead_tokens) for shard in shards]
    return StepLayout(tuple(tuple(tuple(mb) for mb in mbs) for mbs in per_rank), layout)


def fixed_layout(n: int, world_size: int, micro_batch_size: int) -> StepLayout:
    """The baseline: strided shards in data order, ``micro_batch_size`` sequences per micro-batch, padded."""
    per_rank = []
    for rank in range(world_size):
        shard = list(range(rank, n, world_size))
        per_rank.append(tuple(tuple(shard[k : k + micro_batch_size]) for k in range(0, len(shard), micro_batch_size)))
    return StepLayout(tuple(per_rank), "padded")

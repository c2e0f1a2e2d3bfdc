"""Dynamic sampling for the synchronous loop (DAPO's filter).

Groups whose rewards are all equal have zero group-relative advantage: they cost a training pass
and teach nothing. With ``rl.dynamic_sampling.enabled`` the step keeps sampling batches of
``prompts_per_step`` prompts, keeps the informative groups, and stops when it holds
``prompts_per_step`` of them or after ``1 + max_extra_batches`` batches; in that case it says so
and trains on what it has (possibly fewer groups; none at all means the step is skipped).

Expected oversampling is ``1 / (1 - z)`` with zero-variance fraction ``z = p^n + (1 - p)^n``
(accuracy p, n samples per prompt), e.g. 1.75x at n = 8, p = 0.9.

The fully-async loop does the same filtering in ``buffer.AsyncGroupBuffer`` (no batch bound
there: the dropped capacity simply goes back to generation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from .batch import Group


@dataclass
class FilledBatch:
    groups: list[Group]  # at most prompts_per_step informative groups (all groups when disabled)
    generated_groups: int  # groups sampled this step
    dropped: list[Group] = field(default_factory=list)  # zero-variance groups
    surplus: list[Group] = field(default_factory=list)  # informative groups beyond the target (unused)
    batches: int = 0
    bound_hit: bool = False
    message: str | None = None  # set when the bound stopped sampling short of the target

    @property
    def dropped_fraction(self) -> float:
        return len(self.dropped) / self.generated_groups if self.generated_groups else 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/dynamic_sampling_dropped_frac": self.dropped_fraction,
            "rollout/dynamic_sampling_batches": float(self.batches),
            "rollout/groups_kept": float(len(self.groups)),
        }


class BatchFiller:
    """Accumulates sampled batches until the step's groups are full or the bound is hit. Pure:
    the caller samples (sync or async) while ``needs_more``."""

    def __init__(self, target_groups: int, max_extra_batches: int, enabled: bool = True):
        self.target = target_groups
        self.max_batches = 1 + max_extra_batches
        self.enabled = enabled
        self._kept: list[Group] = []
        self._dropped: list[Group] = []
        self._generated = 0
        self._batches = 0

    @property
    def batches(self) -> int:
        return self._batches

    @property
    def needs_more(self) -> bool:
        if self._batches == 0:
            return True
        if not self.enabled:
            return False
        return len(self._kept) < self.target and self._batches < self.max_batches

    def add(self, groups: Iterable[Group]) -> None:
        self._batches += 1
        for group in groups:
            self._generated += 1
            if self.enabled and group.all_rewards_equal():
                self._dropped.append(group)
            else:
                self._kept.append(group)

    def result(self) -> FilledBatch:
        kept, surplus = self._kept[: self.target], self._kept[self.target :]
        if not self.enabled:
            kept, surplus = self._kept, []
        out = FilledBatch(kept, self._generated, list(self._dropped), surplus, self._batches)
        if self.enabled and len(kept) < self.target:
            out.bound_hit = True
            out.message = (
                f"dynamic sampling: {len(kept)}/{self.target} groups with varying rewards after "
                f"{self._batches} batches (rl.dynamic_sampling.max_extra_batches = {self.max_batches - 1}); "
                + ("training on those" if kept else "skipping this step")
                + f"; {len(self._dropped)}/{self._generated} groups had all-equal rewards"
            )
        return out


def fill_batch(
    sample_batch: Callable[[int], list[Group]], target_groups: int, max_extra_batches: int, enabled: bool = True
) -> FilledBatch:
    """Synchronous convenience: ``sample_batch(batch_number)`` returns one batch of groups."""
    filler = BatchFiller(target_groups, max_extra_batches, enabled)
    while filler.needs_more:
        filler.add(sample_batch(filler.batches))
    return filler.result()

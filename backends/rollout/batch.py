"""Group records of generation and the buffer; the trajectory record they hold, ``Sample``, is the
orchestrator's and the learner's contract (``skyrl_contracts.samples``).

A ``Group`` is the ``samples_per_prompt`` trajectories of one prompt; its ``start_version`` is the
policy version when generation of the group was admitted (what the staleness bound counts).
Records round-trip through plain JSON so the orchestrator can hand batches to the trainer ranks
through the run directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from skyrl_contracts.samples import Sample


def generation_span_s(groups: Iterable[Group]) -> float | None:
    """Seconds from the first of ``groups`` starting generation to the last one finishing: the
    batch's generation phase (with async overlap, the span its groups were generated over). None
    when any group was not timed."""
    groups = list(groups)
    if not groups or any(g.started_s <= 0.0 or g.finished_s <= 0.0 for g in groups):
        return None
    return max(g.finished_s for g in groups) - min(g.started_s for g in groups)


def rewards_all_equal(rewards: Sequence[float]) -> bool:
    """True when a group carries no learning signal for group-relative advantages (DAPO filter).

    Exact comparison on purpose: rewards are computed, not measured, and equal rewards are equal
    floats; the advantage estimators apply the same rule."""
    return len(rewards) == 0 or max(rewards) == min(rewards)


@dataclass
class Group:
    prompt_uid: str
    samples: list[Sample]
    start_version: int  # policy version when this group's generation was admitted
    # time.monotonic() when its generation started and ended (0.0: not timed, e.g. a record read back)
    started_s: float = 0.0
    finished_s: float = 0.0

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    def all_rewards_equal(self) -> bool:
        return rewards_all_equal(self.rewards)

    @property
    def oldest_version(self) -> int:
        """The oldest weights that produced any token of the group (bounded by start_version)."""
        return min([self.start_version, *(v for s in self.samples for v in s.policy_versions)])

    @property
    def policy_versions(self) -> tuple[int, ...]:
        return tuple(sorted({v for s in self.samples for v in s.policy_versions}))

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_uid": self.prompt_uid,
            "start_version": self.start_version,
            "samples": [s.to_dict() for s in self.samples],
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Group":
        return cls(raw["prompt_uid"], [Sample.from_dict(s) for s in raw["samples"]], int(raw["start_version"]))


def flatten(groups: Iterable[Group]) -> list[Sample]:
    return [s for g in groups for s in g.samples]


def staleness(groups: Sequence[Group], trained_version: int) -> tuple[float, int]:
    """(mean, max) of ``trained_version - start_version`` over the groups of one training batch."""
    if not groups:
        return 0.0, 0
    ages = [trained_version - g.start_version for g in groups]
    return sum(ages) / len(ages), max(ages)

"""PPO mini-batches: how one RL step's batch is cut into policy updates.

A step trains ``epochs`` passes over its batch, each pass ``mini_batches`` optimizer steps over
one slice. Slices hold whole groups (every sample of a prompt): the group-normalised advantages
of a group then sum to zero inside each update, so no update is pushed by one half of a group
alone. The partition is the same in every epoch (as verl and OpenRLHF do without shuffling), so
the "old" logprobs of each slice are computed once, before the first update.
"""

from __future__ import annotations

from typing import Sequence


def group_slices(group_ids: Sequence[str], mini_batches: int) -> list[list[int]]:
    """Sample indices of each mini-batch: whole groups in batch order, each group in the slice its
    midpoint falls in, so slices are as equal in sample count as group boundaries allow. Fewer
    slices when there are fewer groups (a partial batch of dynamic sampling); never an empty one."""
    if mini_batches <= 0:
        raise ValueError("mini_batches must be > 0")
    groups: dict[str, list[int]] = {}
    for i, gid in enumerate(group_ids):
        groups.setdefault(gid, []).append(i)
    total = len(group_ids)
    slices: list[list[int]] = [[] for _ in range(mini_batches)]
    done = 0
    for members in groups.values():
        slices[min(int((done + len(members) / 2) * mini_batches / total), mini_batches - 1)].extend(members)
        done += len(members)
    return [s for s in slices if s]

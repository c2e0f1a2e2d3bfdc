"""What the driver must know of each policy loss (``rl.loss.kind``) and advantage estimator
(``rl.advantage.kind``) without torch: which ``rl.loss`` keys act with a kind, a reduction a kind
imposes, whether an estimator's statistics are per group.

One home for these facts, read by the recipe check (``skyrl_cli.recipe.validate``) and by the
learner (``backends.train.rl``), so the two cannot disagree. The formulas live in the learner's own
tables keyed alike (``backends.train.rl.losses.POLICY_LOSSES``, ``backends.train.rl.advantages.
ESTIMATORS``); a new kind is one entry here and one there (the schema's ``rl.loss.kind`` and
``rl.advantage.kind`` accept the keys of these tables: ``LossKindName``, ``AdvantageKindName``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

Reduction = Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"]

# rl.loss keys that bound the policy ratio: they cannot act while the ratio is exactly 1.
RATIO_BOUNDS = ("eps_low", "eps_high", "dual_clip_c")


@dataclass(frozen=True)
class LossKind:
    extra_keys: frozenset[str] = frozenset()  # rl.loss keys that act with the kinds listing them only
    ignores: Mapping[str, str] = field(default_factory=dict)  # keys other kinds read, this one not -> why
    forced_reduction: Reduction | None = None  # reduces this way whatever rl.loss.reduction says


LOSS_KINDS: dict[str, LossKind] = {
    "ppo_clip": LossKind(),
    "dual_clip": LossKind(extra_keys=frozenset({"dual_clip_c"})),
    "gspo": LossKind(
        ignores={"reduction": "gspo always averages per sequence (the paper's 1/|y|); reduction does not apply"},
        forced_reduction="sequence_mean",
    ),
    "cispo": LossKind(
        ignores={"eps_low": "cispo truncates its weight above only (1 + eps_high); eps_low does not apply"}
    ),
}


@dataclass(frozen=True)
class AdvantageKind:
    # One scalar per sample from its group's rewards (not, as REINFORCE++, per token over the batch):
    # the group statistics count each trajectory once, however many samples an agent left of it.
    group_baseline: bool


ADVANTAGE_KINDS: dict[str, AdvantageKind] = {
    "grpo": AdvantageKind(group_baseline=True),
    "rloo": AdvantageKind(group_baseline=True),
    "reinforce_pp": AdvantageKind(group_baseline=False),
}


def loss_reduction(kind: str, stated: Reduction) -> Reduction:
    """The reduction a loss of ``kind`` applies when the recipe states ``stated``."""
    return LOSS_KINDS[kind].forced_reduction or stated


def inert_loss_keys(kind: str) -> dict[str, str]:
    """The ``rl.loss`` keys that cannot act with ``kind``, each with why."""
    owned_elsewhere = {key for other in LOSS_KINDS.values() for key in other.extra_keys} - LOSS_KINDS[kind].extra_keys
    inert = {
        key: f"{key} applies to kind = {_owners(key)} only (kind is {_quoted(kind)})" for key in sorted(owned_elsewhere)
    }
    return {**inert, **LOSS_KINDS[kind].ignores}


def _owners(key: str) -> str:
    return " or ".join(_quoted(kind) for kind, spec in LOSS_KINDS.items() if key in spec.extra_keys)


def _quoted(kind: str) -> str:
    return f'"{kind}"'


LossKindName = Literal[tuple(LOSS_KINDS)]
AdvantageKindName = Literal[tuple(ADVANTAGE_KINDS)]

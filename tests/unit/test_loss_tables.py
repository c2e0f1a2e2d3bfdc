"""The loss and advantage tables: the driver's light facts (``skyrl_contracts.losses``) and the
learner's formulas (``backends.train.rl``) name exactly the schema's kinds, and the facts hold."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from backends.train.rl.advantages import ESTIMATORS, compute_advantages
from backends.train.rl.losses import POLICY_LOSSES
from skyrl_cli.recipe.validate import loss_problems
from skyrl_contracts.losses import (
    ADVANTAGE_KINDS,
    LOSS_KINDS,
    RATIO_BOUNDS,
    Reduction,
    inert_loss_keys,
    loss_reduction,
)
from skyrl_contracts.schema import AdvantageConfig, PolicyLossConfig, Recipe


def schema_kinds(section) -> set[str]:
    return set(get_args(section.model_fields["kind"].annotation))


def test_every_loss_kind_has_one_entry_in_each_table():
    assert set(LOSS_KINDS) == set(POLICY_LOSSES) == schema_kinds(PolicyLossConfig)


def test_every_advantage_kind_has_one_entry_in_each_table():
    assert set(ADVANTAGE_KINDS) == set(ESTIMATORS) == schema_kinds(AdvantageConfig)


def test_loss_facts_name_schema_keys_and_reductions():
    fields = set(PolicyLossConfig.model_fields)
    assert set(RATIO_BOUNDS) <= fields
    assert set(get_args(Reduction)) == set(get_args(PolicyLossConfig.model_fields["reduction"].annotation))
    for kind, spec in LOSS_KINDS.items():
        assert spec.extra_keys <= fields, kind
        assert set(spec.ignores) <= fields, kind
        assert spec.forced_reduction in (None, *get_args(Reduction)), kind
        # a kind that forces its reduction says why a stated one cannot act, and only then
        assert (spec.forced_reduction is not None) == ("reduction" in spec.ignores), kind


def test_inert_keys_per_kind():
    assert inert_loss_keys("ppo_clip") == {
        "dual_clip_c": 'dual_clip_c applies to kind = "dual_clip" only (kind is "ppo_clip")'
    }
    assert inert_loss_keys("dual_clip") == {}
    assert set(inert_loss_keys("gspo")) == {"dual_clip_c", "reduction"}
    assert inert_loss_keys("cispo")["eps_low"].startswith("cispo truncates its weight above only")


@pytest.mark.parametrize("kind", sorted(LOSS_KINDS))
def test_forced_reduction_wins_over_the_stated_one(kind):
    forced = LOSS_KINDS[kind].forced_reduction
    for stated in get_args(Reduction):
        assert loss_reduction(kind, stated) == (forced or stated)


def rl_recipe(loss: dict) -> Recipe:
    # two updates per step: the clip keys can act, so only the kind decides what is refused
    return Recipe.model_validate(
        {"name": "x", "model": {"init": {}}, "data": {"task": "addition"}, "rl": {"mini_batches": 2, "loss": loss}}
    )


@pytest.mark.parametrize("kind", sorted(LOSS_KINDS))
def test_recipe_check_refuses_exactly_the_inert_keys_stated(kind):
    stated = {"eps_low": 0.1, "eps_high": 0.3, "dual_clip_c": 2.0, "reduction": "sequence_mean"}
    problems = loss_problems(rl_recipe({"kind": kind, **stated}))
    assert {p.path[-1]: p.message for p in problems} == inert_loss_keys(kind)
    assert loss_problems(rl_recipe({"kind": kind})) == []


@pytest.mark.parametrize("kind", sorted(ADVANTAGE_KINDS))
def test_group_baseline_means_a_group_ignores_the_others(kind):
    """The fact the step relies on to count a trajectory once: with a group baseline, a group's
    advantages do not depend on the rest of the batch."""
    mask = torch.ones((4, 3))
    config = AdvantageConfig(kind=kind)
    alone = compute_advantages(torch.tensor([1.0, 0.0]), ["p", "p"], mask[:2], config)
    with_others = compute_advantages(torch.tensor([1.0, 0.0, 5.0, 5.0]), ["p", "p", "q", "q"], mask, config)[:2]
    assert torch.equal(alone, with_others) == ADVANTAGE_KINDS[kind].group_baseline

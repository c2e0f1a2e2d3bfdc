"""Advantage estimators against hand-computed values (zero-variance and singleton groups included)."""

import math

import pytest
import torch

from backends.train.rl.advantages import (
    broadcast_to_tokens,
    compute_advantages,
    group_index,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from skyrl_contracts.schema import AdvantageConfig

# groups: "a" = [1, 0, 0, 1] (mean .5, unbiased std sqrt(1/3)), "b" = [1, 1] (zero variance), "c" = [3] (alone)
IDS = ["a", "a", "b", "a", "b", "a", "c"]
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 3.0])


def test_group_index_is_dense_first_seen():
    assert group_index(IDS).tolist() == [0, 0, 1, 0, 1, 0, 2]


def test_grpo_std_normalised_by_hand():
    adv = grpo_advantages(REWARDS, group_index(IDS), std_normalize=True, eps=0.0)
    z = 0.5 / math.sqrt(1 / 3)  # 0.8660
    # "c" alone: mean 0, std 1 (verl) -> its raw reward 3
    assert adv.tolist() == pytest.approx([z, -z, 0.0, -z, 0.0, z, 3.0], abs=1e-6)


def test_grpo_without_std_is_mean_centred():
    adv = grpo_advantages(REWARDS, group_index(IDS), std_normalize=False)
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.0, -0.5, 0.0, 0.5, 3.0])


def test_grpo_zero_variance_group_gives_exact_zeros():
    adv = grpo_advantages(torch.tensor([0.7, 0.7, 0.7]), torch.tensor([0, 0, 0]), std_normalize=True)
    assert torch.equal(adv, torch.zeros(3))


def test_rloo_leave_one_out_by_hand():
    # group x = [2, 0, 1]: 2 - mean(0,1) = 1.5; 0 - mean(2,1) = -1.5; 1 - mean(2,0) = 0
    # group y = [1, 0, 0, 1]: 1 - 1/3 = 2/3; 0 - 2/3 = -2/3; z = [5] alone: baseline 0 -> 5
    rewards = torch.tensor([2.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 5.0])
    ids = ["x", "x", "x", "y", "y", "y", "y", "z"]
    adv = rloo_advantages(rewards, group_index(ids))
    assert adv.tolist() == pytest.approx([1.5, -1.5, 0.0, 2 / 3, -2 / 3, -2 / 3, 2 / 3, 5.0], abs=1e-6)


def test_reinforce_pp_whitens_token_returns_over_batch():
    # returns on masked tokens: 1, 1 (row 0), 0 (row 1); mean 2/3, unbiased var 1/3
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask, eps=0.0)
    s = math.sqrt(1 / 3)
    expected = [[(1 / 3) / s, (1 / 3) / s, 0.0], [(-2 / 3) / s, 0.0, 0.0]]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)


def test_reinforce_pp_all_equal_rewards_is_zero():
    adv = reinforce_pp_advantages(torch.tensor([1.0, 1.0]), torch.tensor([[1, 1], [1, 0]]))
    assert torch.equal(adv, torch.zeros(2, 2))


def test_broadcast_respects_mask():
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[0, 1, 1], [1, 1, 0]]))
    assert out.tolist() == [[0.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]


@pytest.mark.parametrize("kind", ["grpo", "rloo", "reinforce_pp"])
def test_compute_advantages_is_zero_outside_mask(kind):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]])
    adv = compute_advantages(torch.tensor([1.0, 0.0, 0.5, 1.0]), ["p", "p", "q", "q"], mask, AdvantageConfig(kind=kind))
    assert adv.shape == (4, 3)
    assert torch.all(adv[mask == 0] == 0)


def test_compute_advantages_grpo_matches_estimator():
    mask = torch.ones(4, 2)
    adv = compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), ["p", "p", "q", "q"], mask, AdvantageConfig())
    z = 0.5 / math.sqrt(0.5) / (1 + 0)  # group p = [1, 0]: mean .5, unbiased std sqrt(.5)
    assert adv[:, 0].tolist() == pytest.approx([z, -z, 0.0, 0.0], abs=1e-5)


def test_equal_rewards_that_do_not_average_exactly_still_give_zero():
    # mean of ten 0.1s is not exactly 0.1 in float32; std-normalising the ulp error would give +-1
    rewards = torch.full((10,), 0.1)
    adv = grpo_advantages(rewards, torch.zeros(10, dtype=torch.long), std_normalize=True)
    assert torch.equal(adv, torch.zeros(10))
    assert torch.equal(rloo_advantages(rewards, torch.zeros(10, dtype=torch.long)), torch.zeros(10))


def test_singleton_groups_keep_their_raw_reward_as_verl():
    # verl's GRPO for a group of one: mean 0, std 1 -> (r - 0) / (1 + eps); RLOO: baseline 0 -> r
    rewards = torch.tensor([0.5, -2.0, 0.0])
    index = torch.tensor([0, 1, 2])
    eps = 1e-6
    assert grpo_advantages(rewards, index, std_normalize=True, eps=eps).tolist() == pytest.approx(
        [0.5 / (1 + eps), -2.0 / (1 + eps), 0.0], abs=1e-6
    )
    assert grpo_advantages(rewards, index, std_normalize=False).tolist() == pytest.approx([0.5, -2.0, 0.0])
    assert rloo_advantages(rewards, index).tolist() == pytest.approx([0.5, -2.0, 0.0])
    mask = torch.tensor([[1, 1], [1, 0], [0, 1]])
    adv = compute_advantages(rewards, ["a", "b", "c"], mask, AdvantageConfig(kind="rloo"))
    assert torch.equal(adv, torch.tensor([[0.5, 0.5], [-2.0, 0.0], [0.0, 0.0]]))

"""Off-policy correction (truncated IS, sequence masking) and the logprob-difference health metric."""

import math

import pytest
import torch

from backends.train.rl.losses import LossNormalizer, merge_metrics
from backends.train.rl.off_policy import logprob_diff_metrics, off_policy_correction
from skyrl_contracts.schema import OffPolicyConfig

LN = math.log


def _case():
    """old - rollout log ratios: row 0 [ln 3, ln .5], row 1 [ln 1.2, (masked, huge)]."""
    rollout = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    old = rollout + torch.tensor([[LN(3.0), LN(0.5)], [LN(1.2), 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return old, rollout, mask, LossNormalizer.from_masks([mask])


def test_token_level_truncated_is():
    old, rollout, mask, norm = _case()
    out = off_policy_correction(old, rollout, mask, OffPolicyConfig(token_is_cap=2.0), norm)
    assert torch.allclose(out.is_weights, torch.tensor([[2.0, 0.5], [1.2, 0.0]]), atol=1e-6)
    assert torch.equal(out.loss_mask, mask)
    m = out.metrics
    assert m["off_policy/token_is_capped_frac"] == pytest.approx(1 / 3)
    assert m["off_policy/is_ratio_mean"] == pytest.approx((3 + 0.5 + 1.2) / 3, abs=1e-6)
    assert m["off_policy/is_ratio_max"] == pytest.approx(3.0)
    assert m["off_policy/is_ratio_min"] == pytest.approx(0.5)


def test_sequence_level_truncated_is_replaces_token_level():
    old, rollout, mask, norm = _case()
    out = off_policy_correction(old, rollout, mask, OffPolicyConfig(token_is_cap=2.0, seq_is_cap=1.4), norm)
    # products: row 0 = 3 * .5 = 1.5 -> capped 1.4; row 1 = 1.2 (masked token excluded)
    assert torch.allclose(out.is_weights, torch.tensor([[1.4, 1.4], [1.2, 0.0]]), atol=1e-6)
    assert out.metrics["off_policy/seq_is_capped_frac"] == pytest.approx(0.5)
    assert "off_policy/token_is_capped_frac" not in out.metrics


def test_geometric_sequence_mask():
    old, rollout, mask, norm = _case()
    cfg = OffPolicyConfig(token_is_cap=None, mask_low=0.9, mask_high=1.21)
    out = off_policy_correction(old, rollout, mask, cfg, norm)
    # geometric means: row 0 sqrt(1.5) = 1.2247 > 1.21 -> masked; row 1 = 1.2 -> kept
    assert out.is_weights is None
    assert torch.equal(out.loss_mask, torch.tensor([[0.0, 0.0], [1.0, 0.0]]))
    assert out.metrics["off_policy/seq_masked_frac"] == pytest.approx(0.5)
    low = off_policy_correction(old, rollout, mask, OffPolicyConfig(token_is_cap=None, mask_low=1.22), norm)
    assert torch.equal(low.loss_mask, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_no_correction_configured():
    old, rollout, mask, norm = _case()
    out = off_policy_correction(old, rollout, mask, OffPolicyConfig(token_is_cap=None), norm)
    assert out.is_weights is None and torch.equal(out.loss_mask, mask)
    assert "off_policy/is_ratio_mean" in out.metrics  # the distribution is always reported


def test_correction_metrics_split_invariant():
    g = torch.Generator().manual_seed(1)
    rollout = -torch.rand(5, 4, generator=g) * 2
    old = rollout + 0.4 * torch.randn(5, 4, generator=g)
    mask = (torch.arange(4)[None] < torch.tensor([4, 2, 0, 3, 1])[:, None]).float()
    norm = LossNormalizer.from_masks([mask])
    cfg = OffPolicyConfig(token_is_cap=1.5, mask_low=0.8, mask_high=1.25)
    whole = off_policy_correction(old, rollout, mask, cfg, norm)
    parts: dict = {}
    weights, masks = [], []
    for rows in torch.arange(5).split([2, 3]):
        out = off_policy_correction(old[rows], rollout[rows], mask[rows], cfg, norm)
        merge_metrics(parts, out.metrics)
        weights.append(out.is_weights)
        masks.append(out.loss_mask)
    assert torch.allclose(torch.cat(weights), whole.is_weights)
    assert torch.equal(torch.cat(masks), whole.loss_mask)
    assert parts == pytest.approx(whole.metrics)


def test_logprob_diff_metric():
    trainer = torch.tensor([[-1.0, -2.0, -9.0]])
    rollout = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = logprob_diff_metrics(trainer, rollout, mask, LossNormalizer.from_masks([mask]))
    assert m == pytest.approx({"train/logprob_diff": 0.75, "train/logprob_diff_max": 1.0})

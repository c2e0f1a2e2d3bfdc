"""Tinker's losses with sum semantics, against values worked out by hand."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from backends.tinker.losses import LossInputError, check_loss, datum_loss


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_cross_entropy_is_a_plain_weighted_sum_also_with_negative_weights():
    logp = t(-1.0, -2.0, -0.5).requires_grad_()
    loss = datum_loss("cross_entropy", logp, {"weights": t(1.0, -0.5, 2.0)}, {})
    # -(1*-1 + -0.5*-2 + 2*-0.5) = -(-1 + 1 - 1) = 1
    assert loss.sum().item() == pytest.approx(1.0)
    loss.sum().backward()
    assert logp.grad.tolist() == [-1.0, 0.5, -2.0]  # d/dlogp = -weights: no division by sum(weights)


def test_cross_entropy_without_weights_counts_every_token():
    assert datum_loss("cross_entropy", t(-1.0, -3.0), {}, {}).sum().item() == pytest.approx(4.0)


def test_importance_sampling():
    logp = t(math.log(0.5), math.log(0.2))
    inputs = {"logprobs": t(math.log(0.25), math.log(0.4)), "advantages": t(2.0, -1.0)}
    # ratios 2.0 and 0.5: -(2*2 + 0.5*-1) = -3.5
    assert datum_loss("importance_sampling", logp, inputs, {}).sum().item() == pytest.approx(-3.5, rel=1e-6)


def test_ppo_clips_the_ratio_with_the_config_thresholds():
    logp = t(math.log(0.5), math.log(0.2), math.log(0.3)).requires_grad_()
    inputs = {"logprobs": t(math.log(0.25), math.log(0.4), math.log(0.3)), "advantages": t(2.0, -1.0, 1.0)}
    loss = datum_loss("ppo", logp, inputs, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    # token 0: r=2, A=2: min(4, 1.2*2=2.4) = 2.4; token 1: r=0.5, A=-1: min(-0.5, 0.8*-1=-0.8) = -0.8;
    # token 2: r=1, A=1: 1.  loss = -(2.4 - 0.8 + 1) = -2.6
    assert loss.tolist() == pytest.approx([-2.4, 0.8, -1.0], rel=1e-6)
    loss.sum().backward()
    # clipped tokens get no gradient; the unclipped one gets -A * r = -1
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -1.0], abs=1e-6)


def test_ppo_defaults_and_per_token_thresholds():
    logp = t(math.log(0.5))
    base = {"logprobs": t(math.log(0.25)), "advantages": t(1.0)}
    assert datum_loss("ppo", logp, base, {}).item() == pytest.approx(-1.2)  # default high 1.2
    per_token = dict(base, clip_high_threshold=t(1.5))
    assert datum_loss("ppo", logp, per_token, {}).item() == pytest.approx(-1.5)


def test_cispo_weights_logp_by_the_detached_clipped_ratio():
    logp = t(math.log(0.5), math.log(0.2)).requires_grad_()
    inputs = {"logprobs": t(math.log(0.25), math.log(0.4)), "advantages": t(2.0, -1.0)}
    loss = datum_loss("cispo", logp, inputs, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    # weights clip(2)=1.2 and clip(0.5)=0.8: -(1.2*log0.5*2 + 0.8*log0.2*-1)
    expected = -(1.2 * math.log(0.5) * 2 + 0.8 * math.log(0.2) * -1)
    assert loss.sum().item() == pytest.approx(expected, rel=1e-6)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-2.4, 0.8], rel=1e-6)  # clipped tokens keep a gradient


def test_check_loss_names_what_does_not_fit():
    check_loss("cross_entropy", {}, {"target_tokens", "weights"})
    with pytest.raises(LossInputError, match="stable_reinforce.*not supported"):
        check_loss("stable_reinforce", {}, {"target_tokens"})
    with pytest.raises(LossInputError, match="unknown loss_fn 'nope'"):
        check_loss("nope", {}, {"target_tokens"})
    with pytest.raises(LossInputError, match=r"needs loss_fn_inputs \['advantages'\]"):
        check_loss("ppo", {}, {"target_tokens", "logprobs"})
    with pytest.raises(LossInputError, match=r"\['mask'\] are not used"):
        check_loss("cross_entropy", {}, {"target_tokens", "mask"})
    with pytest.raises(LossInputError, match="loss_fn_config keys"):
        check_loss("cross_entropy", {"clip_low_threshold": 0.5}, {"target_tokens"})
    with pytest.raises(LossInputError, match="must be a number"):
        check_loss("ppo", {"clip_low_threshold": "x"}, {"target_tokens", "logprobs", "advantages"})

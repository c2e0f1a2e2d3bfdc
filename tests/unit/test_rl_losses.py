"""Policy losses, reductions and KL against hand-computed values; the loss and gradient of any
micro-batch split of a mini-batch equal those of the whole mini-batch."""

import math

import pytest
import torch

from backends.train.rl.losses import (
    LossNormalizer,
    kl_estimate,
    kl_loss,
    merge_metrics,
    policy_loss,
    reduce_loss,
)
from skyrl_contracts.schema import PolicyLossConfig

LN = math.log


def _ppo_case():
    """Ratios r (new/old) and advantages chosen so each token's PPO branch is known by hand.

    row 0 (A=+1): r=1.5 -> clipped to 1.28, loss -1.28 | r=0.5 -> loss -0.5 | masked token
    row 1 (A=-1): r=1.5 -> loss 1.5 | r=0.5 -> clipped to 0.8, loss 0.8 | r=1.1 -> loss 1.1
    """
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    log_r = torch.tensor([[LN(1.5), LN(0.5), 0.0], [LN(1.5), LN(0.5), LN(1.1)]])
    new = (old + log_r).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return new, old, adv, mask


def _cfg(**kw):
    return PolicyLossConfig(**{"eps_low": 0.2, "eps_high": 0.28, **kw})


@pytest.mark.parametrize(
    "reduction, expected",
    [
        ("token_mean", (-1.28 - 0.5 + 1.5 + 0.8 + 1.1) / 5),
        ("sequence_mean", ((-1.28 - 0.5) / 2 + (1.5 + 0.8 + 1.1) / 3) / 2),
        ("seq_mean_token_sum_norm", ((-1.28 - 0.5) / 4 + (1.5 + 0.8 + 1.1) / 4) / 2),
    ],
)
def test_ppo_clip_reductions_by_hand(reduction, expected):
    new, old, adv, mask = _ppo_case()
    norm = LossNormalizer.from_masks([mask], max_seq_len=4)
    loss, metrics = policy_loss(new, old, adv, mask, _cfg(reduction=reduction), norm)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["train/clip_frac"] == pytest.approx(2 / 5)
    assert metrics["train/clip_frac_low"] == pytest.approx(1 / 5)  # row 1, r=0.5, A<0
    assert metrics["train/clip_frac_high"] == pytest.approx(1 / 5)  # row 0, r=1.5, A>0
    assert metrics["train/ratio_max"] == pytest.approx(1.5)
    assert metrics["train/ratio_min"] == pytest.approx(0.5)
    assert metrics["train/ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5)
    k3 = lambda r: r - 1 - LN(r)  # noqa: E731
    assert metrics["train/approx_kl"] == pytest.approx((2 * k3(1.5) + 2 * k3(0.5) + k3(1.1)) / 5, abs=1e-6)


def test_ppo_clip_gradient_zero_on_clipped_tokens():
    new, old, adv, mask = _ppo_case()
    loss, _ = policy_loss(new, old, adv, mask, _cfg(), LossNormalizer.from_masks([mask]))
    loss.backward()
    # d(-r A)/d logp = -r A on unclipped tokens, 0 on clipped and masked ones; / 5 tokens
    expected = torch.tensor([[0.0, -0.5, 0.0], [1.5, 0.0, 1.1]]) / 5
    assert torch.allclose(new.grad, expected, atol=1e-6)


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 2)
    new = torch.tensor([[LN(4.0), LN(4.0)]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    norm = LossNormalizer.from_masks([mask])
    ppo, _ = policy_loss(new, old, adv, mask, _cfg(kind="ppo_clip"), norm)
    dual, m = policy_loss(new, old, adv, mask, _cfg(kind="dual_clip", dual_clip_c=3.0), norm)
    # A=-1, r=4: PPO loss max(4, 1.28) = 4, dual clip caps at c * |A| = 3; A=+1, r=4: -1.28 either way
    assert ppo.item() == pytest.approx((4.0 - 1.28) / 2)
    assert dual.item() == pytest.approx((3.0 - 1.28) / 2)
    assert m["train/dual_clip_frac"] == pytest.approx(0.5)


def test_gspo_uses_sequence_geometric_ratio_and_token_gradients():
    old = torch.zeros(1, 3)
    # masked third token has a huge ratio that must not enter the sequence ratio
    new = torch.tensor([[LN(2.0), 0.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.full((1, 3), -1.0)
    norm = LossNormalizer.from_masks([mask])
    loss, m = policy_loss(new, old, adv, mask, _cfg(kind="gspo"), norm)
    s = math.sqrt(2.0)  # exp(mean(ln 2, 0))
    # A=-1: -min(-s, -1.28) = s on each token; token mean = s
    assert loss.item() == pytest.approx(s, abs=1e-6)
    loss.backward()
    # value s, gradient d s*exp(lp - sg(lp)) / d lp_t = s, over 2 tokens
    assert torch.allclose(new.grad, torch.tensor([[s / 2, s / 2, 0.0]]), atol=1e-6)
    assert m["train/ratio_max"] == pytest.approx(s)
    # positive advantage: the sequence ratio is clipped at 1.28 and the gradient vanishes
    new2 = new.detach().clone().requires_grad_(True)
    loss2, m2 = policy_loss(new2, old, -adv, mask, _cfg(kind="gspo"), norm)
    assert loss2.item() == pytest.approx(-1.28)
    loss2.backward()
    assert torch.all(new2.grad == 0)
    assert m2["train/clip_frac"] == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["ppo_clip", "dual_clip", "gspo"])
def test_clip_fractions_count_only_the_active_bound(kind):
    # r:  1.5  0.5  1.5  0.5  1.5  0.5  1.0   (gspo: one token per row, so r is the sequence ratio)
    # A:  +1   -1   -1   +1    0    0   +1
    # the lower bound acts on (0.5, A<0) only, the upper on (1.5, A>0) only; A = 0 is never clipped
    r = [1.5, 0.5, 1.5, 0.5, 1.5, 0.5, 1.0]
    old = torch.zeros(7, 1)
    new = torch.tensor([[LN(x)] for x in r])
    adv = torch.tensor([[1.0], [-1.0], [-1.0], [1.0], [0.0], [0.0], [1.0]])
    mask = torch.ones(7, 1)
    _, m = policy_loss(new, old, adv, mask, _cfg(kind=kind), LossNormalizer.from_masks([mask]))
    assert m["train/clip_frac_low"] == pytest.approx(1 / 7)
    assert m["train/clip_frac_high"] == pytest.approx(1 / 7)
    assert m["train/clip_frac"] == pytest.approx(2 / 7)


def test_gspo_reduces_per_sequence_whatever_the_configured_reduction():
    # row 0: log r = (ln 2, 0), A = -1: s = sqrt 2 (below the clip for A<0), token loss s, 2 tokens
    # row 1: log r = ln 1.1 on its one token, A = +1: s = 1.1 < 1.28, token loss -1.1
    old = torch.zeros(2, 2)
    start = torch.tensor([[LN(2.0), 0.0], [LN(1.1), 3.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0]])
    norm = LossNormalizer.from_masks([mask], max_seq_len=8)
    s = math.sqrt(2.0)
    for reduction in ("token_mean", "sequence_mean", "seq_mean_token_sum_norm"):
        new = start.clone().requires_grad_(True)
        loss, _ = policy_loss(new, old, adv, mask, _cfg(kind="gspo", reduction=reduction), norm)
        # the paper: mean over sequences of each sequence's token mean (token_mean would give (2s - 1.1) / 3)
        assert loss.item() == pytest.approx((s - 1.1) / 2, abs=1e-6), reduction
        loss.backward()
        # row 0: d(s * exp(lp - sg lp)) = s per token, / 2 tokens / 2 sequences; row 1: -1.1 / 1 / 2
        assert torch.allclose(new.grad, torch.tensor([[s / 4, s / 4], [-0.55, 0.0]]), atol=1e-6), reduction


def test_cispo_truncates_the_weight_above_only():
    lp = torch.tensor([[-0.1, -0.2, -0.3, -0.4]], requires_grad=True)
    old = lp.detach() - torch.tensor([[LN(1.5), LN(0.5), LN(1.1), LN(2.0)]])  # r = 1.5, 0.5, 1.1, 2.0
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, m = policy_loss(lp, old, adv, mask, _cfg(kind="cispo"), LossNormalizer.from_masks([mask]))
    # weights sg(min(r, 1.28)) = 1.28, 0.5 (no lower bound), 1.1, 1.28; loss = -A w lp
    assert loss.item() == pytest.approx((1.28 * 0.1 + 0.5 * 0.2 + 1.1 * 0.3 - 1.28 * 0.4) / 4, abs=1e-6)
    loss.backward()
    # truncated tokens keep a gradient (unlike PPO), scaled by the truncated weight
    assert torch.allclose(lp.grad, -torch.tensor([[1.28, 0.5, 1.1, -1.28]]) / 4, atol=1e-6)
    # truncation does not depend on the sign of A: r = 1.5 (A>0) and r = 2.0 (A<0)
    assert m["train/clip_frac_high"] == pytest.approx(2 / 4)
    assert m["train/clip_frac_low"] == 0.0
    assert m["train/clip_frac"] == pytest.approx(2 / 4)


def test_is_weights_scale_token_losses():
    new, old, adv, mask = _ppo_case()
    norm = LossNormalizer.from_masks([mask])
    w = torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, _ = policy_loss(new, old, adv, mask, _cfg(), norm, is_weights=w)
    assert loss.item() == pytest.approx((-1.28 * 2 - 0.5 + 1.5 + 0.8 + 0.0) / 5, abs=1e-6)


def test_empty_rows_do_not_count_as_sequences():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # second row: a padding micro-batch row
    norm = LossNormalizer.from_masks([mask])
    assert (norm.tokens, norm.sequences) == (2.0, 1.0)
    loss = reduce_loss(torch.tensor([[1.0, 3.0], [7.0, 7.0]]), mask, "sequence_mean", norm)
    assert loss.item() == pytest.approx(2.0)


def test_all_masked_micro_batch_gives_zero_with_graph():
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3)
    loss, metrics = policy_loss(lp, lp.detach(), torch.ones(2, 3), mask, _cfg(), LossNormalizer(10.0, 4.0))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(lp.grad == 0)
    assert "train/ratio_max" not in metrics


@pytest.mark.parametrize(
    "estimator, expected",
    [("k1", [1.0, -1.0]), ("k2", [0.5, 0.5]), ("k3", [math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1])],
)
def test_kl_estimators_by_hand(estimator, expected):
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -1.0]])
    assert kl_estimate(lp, ref, estimator).tolist()[0] == pytest.approx(expected, abs=1e-6)


def test_kl_loss_masked_and_scaled():
    lp = torch.tensor([[-1.0, -2.0, -5.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = kl_loss(
        lp, ref, mask, coef=0.1, estimator="k2", reduction="token_mean", normalizer=LossNormalizer.from_masks([mask])
    )
    assert loss.item() == pytest.approx(0.1 * 0.5)
    assert m["train/kl_ref"] == pytest.approx(0.5)
    loss.backward()
    # d/dlp 0.5 (lp - ref)^2 = lp - ref = [1, -1, masked]; * 0.1 / 2 tokens
    assert torch.allclose(lp.grad, torch.tensor([[0.05, -0.05, 0.0]]))


# ------------------------------------------------------------------ micro-batch split invariance

SPLITS = [[6], [1, 1, 1, 1, 1, 1], [2, 1, 3], [4, 2]]


def _random_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=g) * 3
    new = old + (torch.rand(B, T, generator=g) - 0.5)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    lengths = torch.tensor([7, 3, 0, 5, 1, 6])  # row 2: nothing to learn (e.g. padding)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    ref = old + 0.3 * torch.randn(B, T, generator=g)
    isw = torch.rand(B, T, generator=g) * 2
    return new, old, adv, mask, ref, isw


@pytest.mark.parametrize("kind", ["ppo_clip", "dual_clip", "gspo", "cispo"])
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"])
def test_sum_over_micro_batches_equals_whole_batch(kind, reduction):
    new, old, adv, mask, ref, isw = _random_batch()
    cfg = _cfg(kind=kind, reduction=reduction)

    def run(sizes):
        lp = new.clone().requires_grad_(True)
        # the normaliser comes from the whole mini-batch, however it is split
        norm = LossNormalizer.from_masks([mask], max_seq_len=7)
        total = torch.zeros(())
        metrics: dict = {}
        for rows in torch.arange(6).split(sizes):
            loss, m = policy_loss(lp[rows], old[rows], adv[rows], mask[rows], cfg, norm, is_weights=isw[rows])
            kl, km = kl_loss(
                lp[rows], ref[rows], mask[rows], coef=0.05, estimator="k3", reduction=reduction, normalizer=norm
            )
            (loss + kl).backward()  # gradient accumulation, as the learner does
            total = total + (loss + kl).detach()
            merge_metrics(metrics, {**m, **km})
        return total, lp.grad, metrics

    whole_loss, whole_grad, whole_metrics = run([6])
    for sizes in SPLITS[1:]:
        loss, grad, metrics = run(sizes)
        assert loss.item() == pytest.approx(float(whole_loss), abs=1e-6)
        assert torch.allclose(grad, whole_grad, atol=1e-6)
        assert metrics.keys() == whole_metrics.keys()
        for key, value in whole_metrics.items():
            assert metrics[key] == pytest.approx(value, abs=1e-6), key

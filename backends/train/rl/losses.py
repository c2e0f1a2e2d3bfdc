"""Policy losses, KL-to-reference loss and loss reductions, normalised over the whole mini-batch.

Why a global normaliser: with dynamic micro-batching the same mini-batch is cut into a different
number of micro-batches every step (and across data-parallel ranks). If each micro-batch divided by
its own token count, the gradient would depend on the cut. Instead the caller computes one
``LossNormalizer`` for the mini-batch *before* splitting (every rank derives the same one from the
whole batch, which every rank reads), and every
micro-batch returns its *share*: ``sum(its terms) / global denominator``. Summing the shares
(gradient accumulation over micro-batches, then the data-parallel all-reduce SUM of gradients)
gives exactly the whole-batch loss. NOTE: DeepSpeed/DDP *average* gradients over ranks; multiply
each rank's share by the world size (or set the engine's gradient predivide accordingly) so the
average equals the sum.

Shapes: all token tensors are ``[B, T]`` (padded rows, any alignment) with ``mask`` 1 on tokens
that carry loss (the model's own response tokens; prompt, observation and padding tokens are 0).
Rows are whole sequences: a sequence is never split between micro-batches.

Metrics follow the same rule: values are shares of the mini-batch figure and are combined across
micro-batches and ranks by SUM, except keys ending in ``_max`` (MAX) and ``_min`` (MIN); see
``merge_metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Mapping

import torch

from skyrl_contracts.losses import Reduction, loss_reduction
from skyrl_contracts.schema import PolicyLossConfig

KlEstimator = Literal["k1", "k2", "k3"]

# exp() of a log-ratio beyond this overflows float32 / bf16 gradients long before it matters.
_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossNormalizer:
    """Denominators of one mini-batch over all its micro-batches and all data-parallel ranks."""

    tokens: float  # loss tokens (mask sum)
    sequences: float  # sequences with at least one loss token (padding rows do not count)
    max_seq_len: int | None = None  # seq_mean_token_sum_norm: the constant Dr.GRPO divides by

    @classmethod
    def from_masks(cls, masks: Iterable[torch.Tensor], max_seq_len: int | None = None) -> "LossNormalizer":
        """From the loss masks of every micro-batch of this rank's share of the mini-batch."""
        tokens = 0.0
        sequences = 0.0
        for mask in masks:
            tokens += float(mask.sum())
            sequences += float((mask.sum(dim=-1) > 0).sum())
        return cls(tokens, sequences, max_seq_len)


def reduce_loss(
    token_losses: torch.Tensor, mask: torch.Tensor, reduction: Reduction, normalizer: LossNormalizer
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss.

    - token_mean: sum of masked token losses / mini-batch loss tokens.
    - sequence_mean: per-sequence mean over its own tokens, summed / mini-batch sequences.
    - seq_mean_token_sum_norm (Dr.GRPO): per-sequence token sum / max_seq_len, summed / sequences.
    """
    mask = mask.to(token_losses.dtype)
    masked = token_losses * mask
    if reduction == "token_mean":
        return masked.sum() / max(normalizer.tokens, 1.0)
    if reduction == "sequence_mean":
        per_seq = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
        return per_seq.sum() / max(normalizer.sequences, 1.0)
    if reduction == "seq_mean_token_sum_norm":
        if not normalizer.max_seq_len:
            raise ValueError("seq_mean_token_sum_norm needs LossNormalizer.max_seq_len")
        per_seq = masked.sum(dim=-1) / float(normalizer.max_seq_len)
        return per_seq.sum() / max(normalizer.sequences, 1.0)
    raise ValueError(f"unknown loss reduction {reduction!r}")


def token_share(values: torch.Tensor, mask: torch.Tensor, normalizer: LossNormalizer) -> float:
    """This micro-batch's share of a token-mean metric."""
    return float((values.detach() * mask).sum()) / max(normalizer.tokens, 1.0)


def sequence_share(per_seq: torch.Tensor, seq_mask: torch.Tensor, normalizer: LossNormalizer) -> float:
    """This micro-batch's share of a per-sequence-mean metric (``seq_mask`` [B]: rows that count)."""
    return float((per_seq.detach() * seq_mask).sum()) / max(normalizer.sequences, 1.0)


def masked_extreme(values: torch.Tensor, mask: torch.Tensor, kind: Literal["max", "min"]) -> float | None:
    """Max / min of the masked entries (None when nothing is masked in)."""
    picked = values.detach()[mask.bool()]
    if picked.numel() == 0:
        return None
    return float(picked.max() if kind == "max" else picked.min())


def merge_metrics(into: dict[str, float], new: Mapping[str, float | None]) -> dict[str, float]:
    """Combine one micro-batch's metrics into the running mini-batch figures (in place)."""
    for key, value in new.items():
        if value is None:
            continue
        if key not in into:
            into[key] = float(value)
        elif key.endswith("_max"):
            into[key] = max(into[key], float(value))
        elif key.endswith("_min"):
            into[key] = min(into[key], float(value))
        else:
            into[key] += float(value)
    return into


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _token_ratio(logprobs: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio)


def _sequence_ratio(logprobs: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: the sequence's geometric mean ``exp(mean_t log r)`` as every token's value, with the
    gradient of each token's own logprob (GSPO-token)."""
    seq_log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    # value: the sequence ratio; gradient: d logprob of each token (sg = stop-gradient)
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()
    return torch.exp(token_log_ratio.clamp(max=_LOG_RATIO_CLAMP))


# token losses, the (low, high) clip masks and extra per-token indicators (metric name -> 0/1)
Surrogate = tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def _ppo_clip(
    ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig
) -> Surrogate:
    """``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``."""
    low, high = 1.0 - config.eps_low, 1.0 + config.eps_high
    r = ratio.detach()
    token_losses = -torch.min(ratio * advantages, ratio.clamp(low, high) * advantages)
    # the tokens whose gradient the clip removes: each bound is active for one sign of A only
    clip_low = ((r < low) & (advantages < 0)).to(r.dtype)
    clip_high = ((r > high) & (advantages > 0)).to(r.dtype)
    return token_losses, clip_low, clip_high, {}


def _dual_clip(
    ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig
) -> Surrogate:
    """ppo_clip, and for A < 0 the loss is capped at ``-c A`` (c = dual_clip_c)."""
    token_losses, clip_low, clip_high, _ = _ppo_clip(ratio, logprobs, advantages, config)
    cap = -advantages * config.dual_clip_c
    capped = ((advantages < 0) & (cap < token_losses)).to(ratio.dtype)
    token_losses = torch.where(advantages < 0, torch.min(token_losses, cap), token_losses)
    return token_losses, clip_low, clip_high, {"train/dual_clip_frac": capped}


def _cispo(
    ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig
) -> Surrogate:
    """``-sg(min(r, 1+eps_high)) * A * logprob`` (MiniMax-M1): truncated tokens still get a gradient;
    its clip_high counts the truncated tokens, either sign of A, and clip_low is 0."""
    r = ratio.detach()
    high = 1.0 + config.eps_high
    # MiniMax-M1 truncates the weight above only; below it is left alone (eps_low unused)
    token_losses = -advantages * r.clamp(max=high) * logprobs
    return token_losses, torch.zeros_like(r), (r > high).to(r.dtype), {}


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss kind: its ratio ``(logprobs, log_ratio, mask) -> r`` and its surrogate
    ``(r, logprobs, advantages, config) -> Surrogate``. What the driver must know of a kind too
    (keys that act, a forced reduction) is ``skyrl_contracts.losses.LOSS_KINDS``."""

    ratio: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    surrogate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossConfig], Surrogate]


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": PolicyLoss(_token_ratio, _ppo_clip),
    "dual_clip": PolicyLoss(_token_ratio, _dual_clip),
    "gspo": PolicyLoss(_sequence_ratio, _ppo_clip),
    "cispo": PolicyLoss(_token_ratio, _cispo),
}


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    normalizer: LossNormalizer,
    *,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy-gradient loss share of one micro-batch and its metric shares.

    logprobs: the current policy's token logprobs (with grad). old_logprobs: the logprobs the
    ratio is taken against (the trainer's own logprobs of the behaviour policy; in a single-update
    on-policy step they equal ``logprobs.detach()``). is_weights: optional detached off-policy
    weights (``off_policy.off_policy_correction``) multiplied into the token losses.

    kinds (``config.kind``): ``POLICY_LOSSES``, each a ratio and a surrogate (their docstrings);
    the reduction is ``config.reduction`` unless the kind forces one (gspo: ``sequence_mean``, the
    paper's mean over sequences of each sequence's token mean; ``skyrl_contracts.losses``).

    Metrics: ``train/clip_frac_low``: tokens where the lower bound acts (r < 1-eps_low, A < 0);
    ``train/clip_frac_high``: r > 1+eps_high, A > 0 (the tokens whose gradient the clip removes;
    for cispo: tokens whose weight is truncated, either sign of A, and low is 0);
    ``train/clip_frac`` = low + high; approx_kl (k3), ratio mean / min / max (gspo: the sequence
    ratio of each token).
    """
    kind = POLICY_LOSSES.get(config.kind)
    if kind is None:
        raise ValueError(f"unknown policy loss {config.kind!r}")
    mask = mask.to(logprobs.dtype)
    advantages = advantages.to(logprobs.dtype)
    ratio = kind.ratio(logprobs, _log_ratio(logprobs, old_logprobs), mask)
    token_losses, clip_low, clip_high, extra = kind.surrogate(ratio, logprobs, advantages, config)
    if is_weights is not None:
        token_losses = token_losses * is_weights.detach().to(token_losses.dtype)

    loss = reduce_loss(token_losses, mask, loss_reduction(config.kind, config.reduction), normalizer)
    ratio_value = ratio.detach()
    # k3 estimate of KL(pi_old || pi_new) from tokens sampled by pi_old: (r - 1) - log r >= 0
    approx_kl = (ratio_value - 1.0) - torch.log(ratio_value)
    metrics: dict[str, float | None] = {
        "train/policy_loss": float(loss.detach()),
        "train/clip_frac": token_share(clip_low + clip_high, mask, normalizer),
        "train/clip_frac_low": token_share(clip_low, mask, normalizer),
        "train/clip_frac_high": token_share(clip_high, mask, normalizer),
        "train/approx_kl": token_share(approx_kl, mask, normalizer),
        "train/ratio_mean": token_share(ratio_value, mask, normalizer),
        "train/ratio_max": masked_extreme(ratio_value, mask, "max"),
        "train/ratio_min": masked_extreme(ratio_value, mask, "min"),
        **{key: token_share(flags, mask, normalizer) for key, flags in extra.items()},
    }
    return loss, {k: v for k, v in metrics.items() if v is not None}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi (Schulman's k1/k2/k3)."""
    delta = (logprobs - ref_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # log pi/pi_ref
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta * delta
    if estimator == "k3":
        return torch.exp(-delta) + delta - 1.0  # (pi_ref/pi) - log(pi_ref/pi) - 1
    raise ValueError(f"unknown KL estimator {estimator!r}")


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float,
    estimator: KlEstimator,
    reduction: Reduction,
    normalizer: LossNormalizer,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``coef *`` the reduced KL-to-reference term (add it to the policy loss share)."""
    mask = mask.to(logprobs.dtype)
    kl = kl_estimate(logprobs, ref_logprobs.detach(), estimator)
    loss = coef * reduce_loss(kl, mask, reduction, normalizer)
    return loss, {"train/kl_ref": token_share(kl, mask, normalizer), "train/kl_loss": float(loss.detach())}

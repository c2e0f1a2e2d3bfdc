"""Off-policy correction against the rollout (engine) logprobs, and the train/inference health metric.

In fully-async RL a sample may come from weights up to S versions old, and even on-policy the
engine's numerics differ from the trainer's. With ``old`` = the trainer's logprobs of the sampled
tokens under the weights the PPO ratio is taken against, and ``rollout`` = the engine's logprobs of
the same tokens, the behaviour-policy ratio ``w = exp(old - rollout)`` corrects the gradient:

- token-level truncated IS (``token_is_cap``): weight each token by ``min(w_t, cap)``.
- sequence-level truncated IS (``seq_is_cap``): weight every token of a sequence by
  ``min(prod_t w_t, cap)``. When set it *replaces* the token-level weights (both at once would
  count the same ratio twice).
- geometric sequence masking (``mask_low`` / ``mask_high``): drop sequences whose geometric-mean
  ratio ``exp(mean_t log w_t)`` leaves the band (the rejection-sampling view: better to drop a
  sample the trainer considers impossible than to clip its weight).

All per-sequence decisions depend only on the sequence itself, so the result does not depend on
how the mini-batch is split into micro-batches. Metrics are shares of the mini-batch figure (see
``losses.merge_metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_contracts.schema import OffPolicyConfig

from .losses import LossNormalizer, masked_extreme, sequence_share, token_share

_LOG_CLAMP = 20.0


@dataclass(frozen=True)
class OffPolicyCorrection:
    is_weights: torch.Tensor | None  # [B, T] detached; multiply into token losses (policy_loss is_weights)
    loss_mask: torch.Tensor  # [B, T] the input mask with masked-out sequences zeroed
    metrics: dict[str, float]


def off_policy_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    config: OffPolicyConfig,
    normalizer: LossNormalizer,
) -> OffPolicyCorrection:
    """Truncated IS weights, sequence mask and ratio metrics for one micro-batch (or mini-batch).

    ``normalizer``: the mini-batch's denominators computed from the masks *before* correction
    (use the same one for the loss: a masked-out sequence then contributes zero, like a rejected
    sample, and the normaliser does not depend on the trainer's logprobs).
    """
    mask_f = mask.to(torch.float32)
    row_has_tokens = (mask_f.sum(-1) > 0).to(torch.float32)
    log_w = ((old_logprobs.detach() - rollout_logprobs).to(torch.float32) * mask_f).clamp(-_LOG_CLAMP, _LOG_CLAMP)
    w = torch.exp(log_w)
    metrics: dict[str, float | None] = {
        "off_policy/is_ratio_mean": token_share(w, mask_f, normalizer),
        "off_policy/is_ratio_max": masked_extreme(w, mask_f, "max"),
        "off_policy/is_ratio_min": masked_extreme(w, mask_f, "min"),
    }

    seq_log_w = log_w.sum(-1)
    geo_log_w = seq_log_w / mask_f.sum(-1).clamp(min=1.0)
    weights: torch.Tensor | None = None
    if config.seq_is_cap is not None:
        seq_w = torch.exp(seq_log_w.clamp(-_LOG_CLAMP, _LOG_CLAMP))
        metrics["off_policy/seq_is_capped_frac"] = sequence_share(
            (seq_w > config.seq_is_cap).float(), row_has_tokens, normalizer
        )
        weights = seq_w.clamp(max=config.seq_is_cap)[:, None].expand_as(mask_f) * mask_f
    elif config.token_is_cap is not None:
        metrics["off_policy/token_is_capped_frac"] = token_share((w > config.token_is_cap).float(), mask_f, normalizer)
        weights = w.clamp(max=config.token_is_cap) * mask_f

    keep = torch.ones_like(seq_log_w, dtype=torch.bool)
    if config.mask_low is not None or config.mask_high is not None:
        geo = torch.exp(geo_log_w)
        if config.mask_low is not None:
            keep &= geo >= config.mask_low
        if config.mask_high is not None:
            keep &= geo <= config.mask_high
        metrics["off_policy/seq_masked_frac"] = sequence_share((~keep).float(), row_has_tokens, normalizer)
    new_mask = mask * keep[:, None].to(mask.dtype)

    return OffPolicyCorrection(
        is_weights=None if weights is None else weights.detach(),
        loss_mask=new_mask,
        metrics={k: v for k, v in metrics.items() if v is not None},
    )


def logprob_diff_metrics(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, normalizer: LossNormalizer
) -> dict[str, float]:
    """Health check of the whole pipeline: mean (share) and max of |trainer - rollout| logprob
    over response tokens. Near 0 on-policy; a large value means the engine is not sampling from
    the weights the trainer holds (stale sync, wrong tokenizer/template, dtype mismatch)."""
    diff = (trainer_logprobs.detach() - rollout_logprobs).abs().to(torch.float32)
    mask_f = mask.to(torch.float32)
    out = {"train/logprob_diff": token_share(diff, mask_f, normalizer)}
    top = masked_extreme(diff, mask_f, "max")
    if top is not None:
        out["train/logprob_diff_max"] = top
    return out

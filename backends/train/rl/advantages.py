"""Advantage estimators over groups of outcome rewards (one scalar reward per sample).

Every estimator returns per-token advantages ``[N, T]`` that are zero outside the response mask:
GRPO and RLOO compute one scalar per sample from its group and broadcast it; REINFORCE++ whitens
the per-token returns over the whole batch (so it needs the mask to weight samples by length).

Conventions (as in SkyRL / verl, so figures compare):
- GRPO std is the unbiased group std; a zero-variance group (of two or more) gives exactly zero
  advantages.
- A group of one sample has no group baseline: verl takes mean 0 and std 1, so GRPO gives the raw
  reward ``r / (1 + eps)`` (``r`` without std_normalize). RLOO has no leave-one-out baseline
  either and likewise keeps the raw reward ``r`` (verl's RLOO does the same): plain REINFORCE
  for that sample, still an unbiased gradient, where a zero would silently discard it. Dynamic
  sampling drops such groups anyway (one reward is "all equal").
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch

from skyrl_contracts.schema import AdvantageConfig


def group_index(group_ids: Sequence[Hashable]) -> torch.Tensor:
    """Map arbitrary group keys (e.g. prompt uids) to dense indices 0..G-1, in first-seen order."""
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(key, len(dense)) for key in group_ids], dtype=torch.long)


def _group_stats(rewards: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size, group mean, unbiased group std), gathered back to the samples.

    A group whose rewards are all equal gets std 0 and a mean equal to that reward exactly (a
    float mean of equal values can be off by one ulp, which std-normalisation would blow up)."""
    num_groups = int(index.max()) + 1 if index.numel() else 0
    ones = torch.ones_like(rewards)
    size = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, index, ones)
    total = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, index, rewards)
    mean = total / size
    centred = rewards - mean[index]
    sq = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, index, centred * centred)
    var = sq / (size - 1).clamp(min=1)
    high = torch.full((num_groups,), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, index, rewards, "amax")
    low = torch.full((num_groups,), torch.inf, dtype=rewards.dtype).scatter_reduce(0, index, rewards, "amin")
    constant = high == low
    mean = torch.where(constant, high, mean)
    std = torch.where(constant, torch.zeros_like(var), var.sqrt())
    return size[index], mean[index], std[index]


def grpo_advantages(
    rewards: torch.Tensor, index: torch.Tensor, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: ``r - mean(group)``, divided by ``std(group) + eps`` when ``std_normalize``. Shape [N]."""
    rewards = rewards.to(torch.float32)
    size, mean, std = _group_stats(rewards, index)
    alone = size == 1  # no baseline: mean 0, std 1 (verl)
    mean = torch.where(alone, torch.zeros_like(mean), mean)
    std = torch.where(alone, torch.ones_like(std), std)
    adv = rewards - mean
    if std_normalize:
        # a zero-variance group has adv == 0 exactly; keep it 0 even with eps = 0 (no 0/0)
        adv = torch.where(std > 0, adv / (std + eps), torch.zeros_like(adv))
    return adv


def rloo_advantages(rewards: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """RLOO: ``r_i - mean of the other samples in the group`` = ``n/(n-1) * (r_i - mean)``; a sample
    alone in its group keeps its raw reward (baseline 0). Shape [N]."""
    rewards = rewards.to(torch.float32)
    size, mean, _ = _group_stats(rewards, index)
    adv = (rewards - mean) * size / (size - 1).clamp(min=1)
    return torch.where(size > 1, adv, rewards)


def reinforce_pp_advantages(rewards: torch.Tensor, response_mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++ (outcome reward, gamma = 1): every response token's return is the sample's reward;
    returns are whitened over all response tokens of the batch (token-weighted mean, unbiased
    variance), then masked. Shape [N, T]."""
    mask = response_mask.to(torch.float32)
    returns = rewards.to(torch.float32)[:, None] * mask
    n_tokens = mask.sum()
    if n_tokens < 2:
        return torch.zeros_like(mask)
    mean = returns.sum() / n_tokens
    var = (((returns - mean) * mask) ** 2).sum() / (n_tokens - 1)
    return (returns - mean) * torch.rsqrt(var + eps) * mask


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages [N] -> per-token [N, T], zero outside the mask."""
    return advantages.to(torch.float32)[:, None] * response_mask.to(torch.float32)


def _grpo(rewards: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, config: AdvantageConfig) -> torch.Tensor:
    return broadcast_to_tokens(grpo_advantages(rewards, index, std_normalize=config.std_normalize), mask)


def _rloo(rewards: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, config: AdvantageConfig) -> torch.Tensor:
    return broadcast_to_tokens(rloo_advantages(rewards, index), mask)


def _reinforce_pp(
    rewards: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, config: AdvantageConfig
) -> torch.Tensor:
    return reinforce_pp_advantages(rewards, mask)


def reverse_kl_advantages(
    teacher_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor, coef: float
) -> torch.Tensor:
    """On-policy distillation (``rl.distillation``), per token [N, T]: ``coef x (log p_teacher(y_t) -
    log p_policy(y_t))`` of each sampled token ``y_t``, the negative of the one-sample estimate of
    the reverse KL(policy || teacher) at that token; 0 outside ``mask`` (observations, tool results,
    padding). Added to the task reward's advantage, or alone (``task_reward = false``)."""
    gap = teacher_logprobs.to(torch.float32) - sampling_logprobs.to(torch.float32)
    return coef * gap * mask.to(torch.float32)


# rl.advantage.kind -> (rewards [N], dense group index [N], response mask [N, T], config) -> [N, T].
# What the driver and the step must know of a kind too is skyrl_contracts.losses.ADVANTAGE_KINDS.
ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AdvantageConfig], torch.Tensor]] = {
    "grpo": _grpo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
}


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    response_mask: torch.Tensor,
    config: AdvantageConfig,
) -> torch.Tensor:
    """The recipe's estimator (``rl.advantage``): rewards [N], group keys [N], mask [N, T] -> [N, T]."""
    index = group_ids if isinstance(group_ids, torch.Tensor) else group_index(group_ids)
    estimator = ESTIMATORS.get(config.kind)
    if estimator is None:  # the schema's Literal makes this unreachable; kept for custom callers
        raise ValueError(f"unknown advantage estimator {config.kind!r}")
    return estimator(rewards, index, response_mask, config)

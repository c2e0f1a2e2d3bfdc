"""Evaluation during training, sharded over the data-parallel ranks and summed with one all-reduce.

- ``eval_loss``: teacher-forced token-mean NLL on the held-out sequences.
- ``eval_accuracy``: greedy generation on the held-out prompts, scored by the task's reward
  (exact match). Prompts are sorted by length and batched, so equal-length prompts (the built-in
  tasks) need no padding; mixed lengths are left-padded.

Under ZeRO-3 every forward is collective (parameters are gathered on the fly), so all ranks run the
same number of forwards: padding micro-batches for the loss, ``synced_gpus`` and equal batch counts
for generation.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from backends.train.engine import Dist, all_reduce_sum
from backends.train.microbatch import collate, padding_microbatch, token_nll_sum
from backends.train.packing import dynamic_layout


@torch.no_grad()
def eval_loss(model, examples: Sequence, dist: Dist, max_tokens: int, pad_id: int) -> float:
    lengths = [len(ex) for ex in examples]
    layout = dynamic_layout(lengths, dist.world_size, max_tokens, "padded")
    mine = layout.per_rank[dist.rank]
    batches = [collate([examples[i] for i in mb], "padded", pad_id) for mb in mine]
    batches += [padding_microbatch(pad_id)] * layout.padding_microbatches(dist.rank)
    nll = sum(float(token_nll_sum(model, mb.to(dist.device))) for mb in batches)
    tokens = sum(mb.loss_tokens for mb in batches if not mb.is_padding)
    nll, tokens = all_reduce_sum([nll, tokens], dist.device)
    return nll / tokens if tokens else float("nan")


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def greedy_responses(
    model, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int, device, synced: bool = False
) -> list[str]:
    """Decoded greedy continuations (special tokens removed) of a batch of prompt token ids."""
    ids, mask = _left_padded(prompts, tokenizer.pad_token_id)
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        synced_gpus=synced,
    )
    return tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)


@torch.no_grad()
def eval_accuracy(
    model,
    tokenizer,
    items: Sequence,
    scorer: Callable[[str, object], float],
    max_new_tokens: int,
    dist: Dist,
    batch_size: int = 256,
    synced: bool = False,
) -> float:
    """Mean score of greedy responses to the held-out prompts (all ranks; same value everywhere)."""
    mine = sorted(items[dist.rank :: dist.world_size], key=lambda it: len(it.prompt_ids))
    n_batches = (
        math.ceil(math.ceil(len(items) / dist.world_size) / batch_size) if synced else math.ceil(len(mine) / batch_size)
    )
    was_training = model.training
    model.eval()
    total = 0.0
    for b in range(n_batches):
        chunk = mine[b * batch_size : (b + 1) * batch_size]
        if not chunk:  # ZeRO-3: keep generating in step with the other ranks, score nothing
            greedy_responses(model, tokenizer, [items[0].prompt_ids], max_new_tokens, dist.device, synced)
            continue
        responses = greedy_responses(
            model, tokenizer, [it.prompt_ids for it in chunk], max_new_tokens, dist.device, synced
        )
        total += sum(scorer(r, it) for r, it in zip(responses, chunk))
    model.train(was_training)
    total, count = all_reduce_sum([total, len(mine)], dist.device)
    return total / count if count else float("nan")

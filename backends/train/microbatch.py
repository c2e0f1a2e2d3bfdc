"""Micro-batch tensors from tokenized sequences, and the token-summed loss of one micro-batch.

Two layouts (see ``backends.train.packing``):
- ``padded``: one row per sequence, right-padded to the longest. No attention mask is needed: under
  causal attention a real token only sees earlier tokens, which are all real; pad positions carry no
  loss. This keeps sdpa on its fast causal path.
- ``padding_free``: all sequences in one row, position ids restarting at 0 for each; transformers
  derives a block-diagonal (per-sequence) causal mask from the position ids when the attention mask
  is None and no cache is used (verified for Llama with sdpa and eager in tests/unit/test_models.py).

Labels are pre-shifted: ``labels[t]`` is the target predicted at position t (``-100``: no loss), so
a sequence's last position never predicts the next packed sequence's first token.

The RL step (``backends.train.rl.step``) lays its rows out with the same pieces (``right_padded``,
``row_positions``, ``laid_out``), so SFT and RL micro-batches of the same tokens share ids and positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import torch

if TYPE_CHECKING:
    from backends.train.packing import StepLayout

IGNORE = -100

T = TypeVar("T")
B = TypeVar("B")


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [rows, T]
    position_ids: torch.Tensor  # [rows, T]
    labels: torch.Tensor  # [rows, T], IGNORE where no loss
    real_tokens: int  # tokens of actual sequences (padding excluded)
    is_padding: bool = False  # a zero-weight micro-batch that only keeps ranks in step

    @property
    def loss_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())

    def to(self, device) -> "MicroBatch":
        return MicroBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.labels.to(device),
            self.real_tokens,
            self.is_padding,
        )


def shifted_labels(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    """``labels[t] = input_ids[t + 1]`` where token t+1 is a loss target, else IGNORE (last: IGNORE)."""
    out = [ids if m else IGNORE for ids, m in zip(input_ids[1:], loss_mask[1:])]
    return out + [IGNORE] if input_ids else []


def collate(examples: Sequence, layout: str, pad_id: int) -> MicroBatch:
    """Tensors for a micro-batch of ``Example``s (``input_ids`` / ``loss_mask``)."""
    real = sum(len(ex.input_ids) for ex in examples)
    if layout == "padding_free":
        ids, pos, labels = [], [], []
        for ex in examples:
            ids += ex.input_ids
            pos += range(len(ex.input_ids))
            labels += shifted_labels(ex.input_ids, ex.loss_mask)
        as_row = lambda xs: torch.tensor([xs], dtype=torch.long)  # noqa: E731
        return MicroBatch(as_row(ids), as_row(pos), as_row(labels), real)
    ids = right_padded([ex.input_ids for ex in examples], pad_id)
    labels = right_padded([shifted_labels(ex.input_ids, ex.loss_mask) for ex in examples], IGNORE)
    return MicroBatch(ids, row_positions(ids), labels, real)


def right_padded(rows: Sequence[Sequence], fill, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``[len(rows), longest]``: each row from column 0, ``fill`` after its end (the ``padded``
    layout of every trainer: SFT labels and ids, RL masks, logprobs and advantages alike)."""
    out = torch.full((len(rows), max(len(r) for r in rows)), fill, dtype=dtype)
    for j, row in enumerate(rows):
        out[j, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def row_positions(ids: torch.Tensor) -> torch.Tensor:
    """Position ids of right-padded rows: 0.. in every row (pad positions never carry loss)."""
    rows, width = ids.shape
    return torch.arange(width, dtype=torch.long).expand(rows, width).contiguous()


def padding_microbatch(pad_id: int) -> MicroBatch:
    """One pad token, no loss: runs forward/backward with an all-zero gradient."""
    one = torch.tensor([[pad_id]], dtype=torch.long)
    return MicroBatch(one, torch.zeros_like(one), torch.full_like(one, IGNORE), 0, is_padding=True)


def rank_micro_batches(batch: Sequence, layout: StepLayout, rank: int, pad_id: int) -> list[MicroBatch]:
    """This rank's SFT micro-batches of a ``StepLayout`` over ``batch`` (see ``laid_out``)."""
    return laid_out(
        batch, layout, rank, lambda items: collate(items, layout.layout, pad_id), padding_microbatch(pad_id)
    )


def laid_out(
    batch: Sequence[T], layout: StepLayout, rank: int, collate_items: Callable[[list[T]], B], padding: B
) -> list[B]:
    """This rank's micro-batches of a ``StepLayout`` over ``batch``, each ``collate_items`` of its
    items, then ``padding`` repeated so that every rank runs ``layout.num_microbatches``."""
    mine = [collate_items([batch[i] for i in mb]) for mb in layout.per_rank[rank]]
    return mine + [padding] * layout.padding_microbatches(rank)


def forward_logits(model, mb: MicroBatch) -> torch.Tensor:
    # use_cache=False: with a cache, transformers skips the packed-sequence mask (and we never decode here)
    return model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits


def token_nll_sum(model, mb: MicroBatch) -> torch.Tensor:
    """Sum of the negative log-likelihood over the micro-batch's loss tokens (0 for padding, with a
    graph through every parameter so ZeRO's gradient hooks fire on every rank)."""
    logits = forward_logits(model, mb)
    if mb.is_padding:
        return logits.sum() * 0.0
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), mb.labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the label tokens, ``[rows, T]`` (0 where the label is IGNORE)."""
    safe = labels.clamp_min(0)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return logp.masked_fill(labels == IGNORE, 0.0)

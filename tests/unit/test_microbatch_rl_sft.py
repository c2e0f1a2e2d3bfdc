"""SFT and RL micro-batches of the same tokens are laid out alike: the RL step trains on the tokens
that SFT would, at the same positions, so a model's forward sees the same tensors in both trainers.

The loss side differs by design: SFT labels are pre-shifted (``labels[t]`` is token t+1), the RL
loss mask marks the token itself (its logprob is aligned with ``input_ids``)."""

from __future__ import annotations

import random

import pytest
import torch

from backends.data.chat import Example
from backends.train.microbatch import IGNORE, collate, laid_out, padding_microbatch, rank_micro_batches
from backends.train.packing import dynamic_layout
from backends.train.rl.step import collate_rows, padding_tensors, sample_rows
from skyrl_contracts.samples import Sample

PAD = 3


def _samples(seed: int, n: int = 9) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        prompt = [rng.randrange(4, 50) for _ in range(rng.randrange(1, 6))]
        response = [rng.randrange(4, 50) for _ in range(rng.randrange(1, 10))]
        mask = [rng.choice([0, 1]) for _ in response]
        logprobs = [-rng.random() for _ in response]
        out.append(Sample(f"0-{k // 3}", k % 3, prompt, response, mask, logprobs, 0.0, (0,)))
    return out


def _as_examples(samples: list[Sample]) -> list[Example]:
    return [
        Example(tuple(s.prompt_ids) + tuple(s.response_ids), (0,) * len(s.prompt_ids) + tuple(s.loss_mask))
        for s in samples
    ]


def _rows(samples: list[Sample]):
    width = max(len(s.response_ids) for s in samples)
    return sample_rows(samples, torch.randn(len(samples), width, generator=torch.Generator().manual_seed(0)))


def _assert_same_layout(rl, sft) -> None:
    for name in ("input_ids", "position_ids"):
        a, b = getattr(rl, name), getattr(sft, name)
        assert a.dtype == b.dtype == torch.long and a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.parametrize("seed", range(5))
def test_rl_rows_collate_to_the_sft_ids_and_positions(seed):
    samples = _samples(seed)
    rl, sft = collate_rows(_rows(samples), PAD), collate(_as_examples(samples), "padded", PAD)
    _assert_same_layout(rl, sft)
    for t in (rl.loss_mask, rl.rollout_logprobs, rl.advantages):
        assert t.dtype == torch.float32 and t.shape == rl.input_ids.shape
    # the token SFT predicts at t is the token whose RL logprob sits at t + 1
    assert torch.equal(sft.labels[:, :-1] != IGNORE, rl.loss_mask[:, 1:] > 0)
    assert torch.equal(sft.labels[:, :-1][sft.labels[:, :-1] != IGNORE], rl.input_ids[:, 1:][rl.loss_mask[:, 1:] > 0])
    assert not (sft.labels[:, -1] != IGNORE).any()
    # past each row's end: the pad id, and nothing that weighs in the RL loss
    pad = rl.input_ids == PAD
    assert not rl.loss_mask[pad].any() and not rl.rollout_logprobs[pad].any() and not rl.advantages[pad].any()


def test_padding_micro_batches_are_one_pad_token_without_loss():
    rl, sft = padding_tensors(PAD), padding_microbatch(PAD)
    _assert_same_layout(rl, sft)
    assert rl.input_ids.tolist() == [[PAD]] and sft.is_padding and sft.loss_tokens == 0
    assert all(t.tolist() == [[0.0]] for t in (rl.loss_mask, rl.rollout_logprobs, rl.advantages))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_rank_lays_out_rl_rows_and_sft_examples_alike(world_size):
    samples = _samples(7, n=12)
    rows, examples = _rows(samples), _as_examples(samples)
    layout = dynamic_layout([len(ex) for ex in examples], world_size, 24, "padded")
    for rank in range(world_size):
        rl = laid_out(rows, layout, rank, lambda items: collate_rows(items, PAD), padding_tensors(PAD))
        sft = rank_micro_batches(examples, layout, rank, PAD)
        assert len(rl) == len(sft) == layout.num_microbatches
        for a, b in zip(rl, sft):
            _assert_same_layout(a, b)

"""The loss normalisation makes the gradient independent of how a batch is packed."""

from __future__ import annotations

import random

import pytest
import torch

from backends.data.chat import Example
from backends.train.microbatch import IGNORE, collate, padding_microbatch, shifted_labels, token_nll_sum
from backends.train.packing import dynamic_layout, fixed_layout


def test_shifted_labels_predict_the_next_loss_token_only():
    assert shifted_labels([1, 5, 8, 9, 2], [0, 0, 0, 1, 1]) == [IGNORE, IGNORE, 9, 2, IGNORE]


def test_padding_free_collate_restarts_positions():
    a, b = Example((1, 4, 5), (0, 1, 1)), Example((1, 6), (0, 1))
    mb = collate([a, b], "padding_free", pad_id=0)
    assert mb.input_ids.tolist() == [[1, 4, 5, 1, 6]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.labels.tolist() == [[4, 5, IGNORE, 6, IGNORE]]
    assert mb.real_tokens == 5 and mb.loss_tokens == 3


def test_padded_collate_right_pads():
    a, b = Example((1, 4, 5), (0, 1, 1)), Example((1, 6), (0, 1))
    mb = collate([a, b], "padded", pad_id=0)
    assert mb.input_ids.tolist() == [[1, 4, 5], [1, 6, 0]]
    assert mb.labels.tolist() == [[4, 5, IGNORE], [6, IGNORE, IGNORE]]
    assert mb.real_tokens == 5


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).double()  # float64: compare layouts far below float32 noise


def _examples(n: int, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.choice([3, 4, 6, 9, 17, 30])
        ids = tuple(rng.randrange(1, 32) for _ in range(length))
        prompt = rng.randrange(1, length)
        out.append(Example(ids, tuple(int(i >= prompt) for i in range(length))))
    return out


def _gradient(model, micro_batches, global_loss_tokens):
    model.zero_grad()
    for mb in micro_batches:
        (token_nll_sum(model, mb) / global_loss_tokens).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize(
    "make_layout",
    [
        lambda lengths: dynamic_layout(lengths, 2, 40, "padded"),
        lambda lengths: dynamic_layout(lengths, 3, 25, "padding_free"),
        lambda lengths: fixed_layout(len(lengths), 2, 3),
    ],
    ids=["dynamic-padded", "dynamic-padding-free", "fixed"],
)
def test_gradient_does_not_depend_on_packing(model, make_layout):
    examples = _examples(12)
    total = sum(ex.loss_tokens for ex in examples)
    whole = _gradient(model, [collate(examples, "padded", 0)], total)
    layout = make_layout([len(ex) for ex in examples])
    micro_batches = [
        collate([examples[i] for i in mb], layout.layout, 0) for rank_mbs in layout.per_rank for mb in rank_mbs
    ] + [padding_microbatch(0)] * layout.padding_microbatches()
    packed = _gradient(model, micro_batches, total)
    assert torch.allclose(whole, packed, atol=1e-12, rtol=1e-9)


def test_padding_micro_batch_has_zero_gradient_everywhere(model):
    model.zero_grad()
    token_nll_sum(model, padding_microbatch(0)).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and float(g.abs().max()) == 0.0 for g in grads)

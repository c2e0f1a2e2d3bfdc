"""``trainer.gradient_checkpointing``: the same gradients with less saved, for a full model and a
LoRA-wrapped one, and the memory estimate counts it."""

from __future__ import annotations

import copy

import pytest
import torch

from backends.models.lora import apply_lora
from backends.models.tiny import build_tiny_model
from backends.models.tokenizer import build_char_tokenizer
from backends.train.engine import checkpoint_activations
from skyrl_contracts.schema import LoraConfig, Recipe, TinyModelInit
from tests.recipes import RL, TINY_INIT, tiny_recipe


def tiny_model(layers: int = 3):
    tokenizer = build_char_tokenizer("0123456789+=")
    return build_tiny_model(TinyModelInit(**{**TINY_INIT, "layers": layers}), tokenizer, seed=0)


def gradients_and_saved_bytes(model) -> tuple[dict[str, torch.Tensor], int]:
    """Each trainable parameter's gradient of a language-model loss, and the bytes autograd saved
    for backward in the forward."""
    model.train()
    ids = torch.randint(3, 14, (4, 32), generator=torch.Generator().manual_seed(0))
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return grads, sum(saved)


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointed_layers_give_the_same_gradients_and_save_less(lora):
    plain = tiny_model()
    if lora:
        plain = apply_lora(plain, LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    checkpointed = copy.deepcopy(plain)
    checkpoint_activations(checkpointed)
    expected, kept = gradients_and_saved_bytes(plain)
    got, kept_checkpointed = gradients_and_saved_bytes(checkpointed)
    assert expected.keys() == got.keys() and expected
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    assert kept_checkpointed < kept / 2, (kept_checkpointed, kept)


def test_the_estimate_counts_the_recipes_checkpointing():
    from skyrl_cli.plan.fit import Hardware, trainer_setup
    from skyrl_cli.plan.memory import trainer_rank_memory
    from skyrl_cli.plan.shape import ModelShape
    from skyrl_cli.recipe.lengths import with_model_lengths

    hardware = Hardware(gpus=1, gpu_bytes=None, gpu=None, device="cpu")
    shape = ModelShape.from_init(TinyModelInit(**TINY_INIT), "char")
    figures = {}
    for on in (False, True):
        recipe = with_model_lengths(Recipe.model_validate(tiny_recipe(RL, trainer={"gradient_checkpointing": on})))
        setup = trainer_setup(recipe, "rl", hardware)
        assert setup.gradient_checkpointing is on
        figures[on] = trainer_rank_memory(shape, setup)
    assert figures[True].activations == figures[False].activations_checkpointed < figures[False].activations

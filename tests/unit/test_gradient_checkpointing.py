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


def test_proposals_turn_checkpointing_on_only_where_nothing_fits_without_it():
    """gsm8k_multiturn on 4 GPUs of 24 GiB: no split fits its trainer ranks at any micro-batch
    without checkpointing (one 1536-token sequence already needs more); with it, some do. Its
    roofline step counts the recomputed forward, so a split that fits without it ranks first."""
    import json
    import tomllib

    from skyrl_cli.plan.fit import Hardware, estimate, proposals
    from skyrl_cli.plan.machine import MachineFacts
    from skyrl_cli.plan.roofline import GPU_TYPES
    from skyrl_cli.plan.shape import ModelShape
    from skyrl_cli.recipe.lengths import with_model_lengths
    from tests.docs_blocks import REPO

    # the recipe as written, without its model and data files (not on this machine)
    recipe = Recipe.model_validate(tomllib.loads((REPO / "recipes" / "gsm8k_multiturn.toml").read_text()))
    recipe = with_model_lengths(recipe)
    config = json.loads((REPO / "benchmarks" / "model_configs" / "qwen2.5-1.5b-instruct.json").read_text())
    shape = ModelShape.from_config(config)
    machine = MachineFacts(cpu_cores=(0,), gpus=(0, 1, 2, 3))
    small = proposals(recipe, shape, Hardware(4, 24 * 2**30, GPU_TYPES["4090"]), machine, REPO / "recipes")
    assert small and all(est.layout.gradient_checkpointing for est in small)
    large = proposals(recipe, shape, Hardware(4, 141 * 2**30, GPU_TYPES["h200"]), machine, REPO / "recipes")
    assert large and not large[0].layout.gradient_checkpointing
    on = recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"gradient_checkpointing": True})})
    h200 = Hardware(4, 141 * 2**30, GPU_TYPES["h200"])
    assert estimate(on, shape, h200).step.training_s > estimate(recipe, shape, h200).step.training_s

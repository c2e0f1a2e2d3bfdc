"""Tied output heads: found from the parameters, written out for the engines, served untied
(``backends.models.tied``), sent over NCCL as a weight of their own, kept in INT4 versions."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from backends.models.loading import save_hf
from backends.models.tied import (
    BODY_SHARD,
    HEAD_SHARD,
    INDEX,
    TiedHead,
    config_ties,
    save_for_engines,
    tied_head,
    write_untied_copy,
)
from backends.models.tiny import build_tiny_model
from backends.models.tokenizer import build_char_tokenizer
from skyrl_contracts.schema import TinyModelInit

ARCHS = ("llama", "qwen2", "qwen3")
IDS = torch.tensor([[1, 5, 8, 9, 10, 11, 3, 7]])


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("0123456789+=")


def tiny(tok, arch: str = "llama", tied: bool = True, seed: int = 0):
    init = TinyModelInit(arch=arch, hidden_size=32, layers=1, heads=2, intermediate_size=64, tie_embeddings=tied)
    return build_tiny_model(init, tok, seed).eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_the_tiny_builder_ties_or_not_as_asked(tok, arch):
    assert tied_head(tiny(tok, arch, tied=True)) == TiedHead("model.embed_tokens.weight", "lm_head.weight")
    assert tied_head(tiny(tok, arch, tied=False)) is None
    assert type(tiny(tok, arch)).__name__.lower().startswith(arch)


def test_a_module_that_is_no_language_model_has_no_tied_head():
    assert tied_head(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_a_version_for_the_engines_carries_the_head_and_loads_untied(tmp_path, tok, arch):
    model = tiny(tok, arch)
    assert save_for_engines(model, tok, tmp_path / "v1")
    config = json.loads((tmp_path / "v1/config.json").read_text())
    index = json.loads((tmp_path / "v1" / INDEX).read_text())["weight_map"]
    assert config["tie_word_embeddings"] is False and (tmp_path / "v1" / HEAD_SHARD).is_file()
    assert index["lm_head.weight"] == HEAD_SHARD and index["model.embed_tokens.weight"] == BODY_SHARD
    assert not (tmp_path / "v1/model.safetensors").exists()  # transformers would read it alone
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32).eval()
    assert tied_head(loaded) is None  # untied, both matrices explicit and equal
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.allclose(logits(loaded), logits(model), atol=1e-6)


@pytest.mark.parametrize("tied", (True, False))
def test_a_version_in_the_engines_dtype_holds_what_the_engine_would_round_to(tmp_path, tok, tied):
    """bf16 engines get a bf16 version from an fp32 learner: each tensor as the engine's own copy
    into its bf16 parameters would round it, the written-out head included, in half the bytes."""
    from safetensors.torch import load_file

    model = tiny(tok, tied=tied)
    save_for_engines(model, tok, tmp_path / "fp32")
    save_for_engines(model, tok, tmp_path / "bf16", dtype="bfloat16")
    written = {}
    for shard in (tmp_path / "bf16").glob("*.safetensors"):
        written.update(load_file(shard))
    expected = model.state_dict()  # a tied model's holds the head under its own name too
    assert set(written) == set(expected)
    for name, tensor in written.items():
        engine_param = torch.empty_like(expected[name], dtype=torch.bfloat16).copy_(expected[name])
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, engine_param), name
    fp32_bytes = sum(f.stat().st_size for f in (tmp_path / "fp32").glob("*.safetensors"))
    assert sum(t.nbytes for t in written.values()) * 2 == sum(t.nbytes for t in expected.values()) < fp32_bytes


def test_an_untied_version_is_the_plain_export(tmp_path, tok):
    assert not save_for_engines(tiny(tok, tied=False), tok, tmp_path / "v1")
    assert not (tmp_path / "v1" / HEAD_SHARD).exists() and not (tmp_path / "v1" / INDEX).exists()


def test_a_gathered_state_dict_supplies_the_head(tmp_path, tok):
    """ZeRO-3 hands the exporter a gathered state dict; the head comes from it, not the module."""
    model = tiny(tok)
    state = {k: v.clone() + (1.0 if k == "model.embed_tokens.weight" else 0.0) for k, v in model.state_dict().items()}
    gathered_embedding = state["model.embed_tokens.weight"]
    save_for_engines(model, tok, tmp_path / "v1", state_dict=state)  # transformers pops tied names from it
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32)
    assert torch.equal(loaded.lm_head.weight, gathered_embedding)
    assert torch.equal(loaded.model.embed_tokens.weight, gathered_embedding)


def test_the_engine_model_links_an_untied_model_unchanged(tmp_path, tok):
    src = save_hf(tiny(tok, tied=False), tok, tmp_path / "src")
    assert write_untied_copy(src, tmp_path / "engine-model") is False
    out = tmp_path / "engine-model"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    assert all((out / p.name).is_symlink() for p in src.iterdir())


def test_the_engine_model_of_a_tied_model_is_untied_without_copying_the_weights(tmp_path, tok):
    model = tiny(tok, "qwen3")
    src = save_hf(model, tok, tmp_path / "src")
    for _ in range(2):  # rebuilt at every launch, over the previous one
        assert write_untied_copy(src, tmp_path / "engine-model") is True
    out = tmp_path / "engine-model"
    assert (out / BODY_SHARD).is_symlink() and not (out / "config.json").is_symlink()
    assert json.loads((src / "config.json").read_text())["tie_word_embeddings"] is True  # the source is untouched
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert tied_head(loaded) is None and torch.allclose(logits(loaded), logits(model), atol=1e-6)
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_sharded_tied_model_keeps_its_shards_and_gains_the_head(tmp_path, tok):
    model = tiny(tok)
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    tok.save_pretrained(tmp_path / "src")
    assert len(list((tmp_path / "src").glob("*.safetensors"))) > 1
    write_untied_copy(tmp_path / "src", tmp_path / "engine-model")
    index = json.loads((tmp_path / "engine-model" / INDEX).read_text())["weight_map"]
    assert index["lm_head.weight"] == HEAD_SHARD and len(set(index.values())) > 2
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "engine-model", dtype=torch.float32).eval()
    assert torch.allclose(logits(loaded), logits(model), atol=1e-6)


def test_a_config_without_the_key_ties_as_its_architecture_does():
    assert config_ties({"model_type": "llama"}) is False
    assert config_ties({"model_type": "gemma"}) is True
    assert config_ties({"model_type": "llama", "tie_word_embeddings": True}) is True
    assert config_ties({"model_type": "x", "text_config": {"tie_word_embeddings": False}}) is False


def test_nccl_sends_the_tied_head_under_its_own_name(tok):
    from vllm.distributed.weight_transfer.base import ModuleSource

    from backends.inference.nccl_sync import engine_weight_source

    model = tiny(tok)
    source = engine_weight_source(model, ModuleSource)
    names = [m.name for m in source.metadata()]
    assert names[-1] == "lm_head.weight" and names.count("model.embed_tokens.weight") == 1
    sent = dict(iter(source))
    assert list(sent) == names and sent["lm_head.weight"] is sent["model.embed_tokens.weight"]
    assert [g for g, _ in source.iter_groups()]  # vLLM's order check passes
    assert type(engine_weight_source(tiny(tok, tied=False), ModuleSource)) is ModuleSource


def test_an_int4_version_for_the_engines_carries_the_head_in_full_precision(tmp_path, tok):
    from backends.quant.export import export_rtn
    from skyrl_contracts.schema import QuantizationConfig

    model = tiny(tok)
    src = save_hf(model, tok, tmp_path / "src")
    cfg = QuantizationConfig(group_size=32)
    export_rtn(src, tmp_path / "user", cfg)
    export_rtn(src, tmp_path / "engines", cfg, for_engines=True)
    assert not (tmp_path / "user" / HEAD_SHARD).exists()  # a user's export keeps the tie
    index = json.loads((tmp_path / "engines" / INDEX).read_text())["weight_map"]
    assert index["lm_head.weight"] == HEAD_SHARD
    assert json.loads((tmp_path / "engines/config.json").read_text())["tie_word_embeddings"] is False

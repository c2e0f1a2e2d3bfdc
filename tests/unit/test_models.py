"""The tiny model and its tokenizer: real HF format, packed-sequence attention, LoRA."""

from __future__ import annotations

import pytest
import torch

from backends.models.loading import load_hf, save_hf
from backends.models.tiny import build_tiny_model, padded_vocab_size
from backends.models.tokenizer import build_char_tokenizer
from skyrl_contracts.schema import LoraConfig, TinyModelInit

INIT = TinyModelInit(hidden_size=32, layers=2, heads=4, intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("0123456789+=")


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(INIT, tok, seed=0).eval()


def test_char_tokenizer_layout(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok("12+3", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4 and tok.decode(ids) == "12+3"
    assert tok.decode(tok("<|user|>7", add_special_tokens=False)["input_ids"], skip_special_tokens=True) == "7"


def test_vocab_is_padded(model, tok):
    assert padded_vocab_size(19) == 64
    assert model.config.vocab_size == padded_vocab_size(len(tok)) == 64


def test_same_seed_same_weights(tok, model):
    again = build_tiny_model(INIT, tok, seed=0)
    other = build_tiny_model(INIT, tok, seed=1)
    w = model.model.embed_tokens.weight
    assert torch.equal(w, again.model.embed_tokens.weight)
    assert not torch.equal(w, other.model.embed_tokens.weight)


def test_saved_model_and_tokenizer_load_with_transformers(tmp_path, model, tok):
    out = save_hf(model, tok, tmp_path / "m")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    loaded, loaded_tok = load_hf(out)
    ids = torch.tensor([tok("<bos><|user|>12+34=<|assistant|>", add_special_tokens=False)["input_ids"]])
    assert torch.allclose(model(ids).logits, loaded(ids).logits, atol=1e-6)
    assert loaded_tok.chat_template == tok.chat_template
    assert loaded_tok("12+34=")["input_ids"] == tok("12+34=")["input_ids"]
    assert loaded.generation_config.eos_token_id == tok.eos_token_id


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_restarting_position_ids_isolate_packed_sequences(tok, impl):
    """Padding-free packing relies on transformers deriving per-sequence masks from position ids."""
    m = build_tiny_model(INIT, tok, seed=0).eval()
    m.config._attn_implementation = impl
    a, b = torch.randint(3, 19, (1, 7)), torch.randint(3, 19, (1, 5))
    packed = m(
        input_ids=torch.cat([a, b], 1),
        position_ids=torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0),
        use_cache=False,
    ).logits
    assert torch.allclose(packed[:, :7], m(a, use_cache=False).logits, atol=1e-5)
    assert torch.allclose(packed[:, 7:], m(b, use_cache=False).logits, atol=1e-5)


def test_lora_adapter_save_and_merge(tmp_path, tok):
    from peft import PeftModel

    from backends.models.lora import apply_lora, merged_copy, save_adapter

    base = build_tiny_model(INIT, tok, seed=0)
    peft_model = apply_lora(base, LoraConfig(rank=4, alpha=8))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # make the adapter non-zero (lora_B starts at 0)
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ids = torch.randint(3, 19, (2, 9))
    expected = peft_model(ids).logits
    merged = merged_copy(peft_model)
    assert not hasattr(merged, "peft_config")
    assert torch.allclose(merged(ids).logits, expected, atol=1e-5)
    assert any("lora_" in n for n, _ in peft_model.named_parameters())  # the training model is untouched
    save_adapter(peft_model, tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(build_tiny_model(INIT, tok, seed=0), tmp_path / "adapter")
    assert torch.allclose(reloaded(ids).logits, expected, atol=1e-6)

"""A tiny random-init Llama-architecture model, built from the recipe's ``model.init``."""

from __future__ import annotations

from skyrl_cli.recipe.schema import TinyModelInit

VOCAB_MULTIPLE = 64  # embedding rows padded to a multiple of this (aligned matmuls, any engine accepts it)


def padded_vocab_size(n_tokens: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-n_tokens // multiple) * multiple


def tiny_llama_config(init: TinyModelInit, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=padded_vocab_size(len(tokenizer)),
        hidden_size=init.hidden_size,
        num_hidden_layers=init.layers,
        num_attention_heads=init.heads,
        num_key_value_heads=init.heads,
        intermediate_size=init.intermediate_size or 4 * init.hidden_size,
        max_position_embeddings=init.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def build_tiny_llama(init: TinyModelInit, tokenizer, seed: int):
    """Random-init ``LlamaForCausalLM``; the same ``seed`` gives the same weights on every rank."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    config = tiny_llama_config(init, tokenizer)
    devices = torch.random.fork_rng(devices=[])  # do not disturb the caller's RNG stream
    with devices:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model

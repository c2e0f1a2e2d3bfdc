"""A tiny random-init model shaped like a real family (Llama, Qwen2, Qwen3; tied or untied output
head), built from the recipe's ``model.init``."""

from __future__ import annotations

import argparse
import json

from backends.models.hf_dir import save_hf
from backends.models.tokenizer import build_char_tokenizer
from skyrl_contracts.schema import TinyModelInit

VOCAB_MULTIPLE = 64  # embedding rows padded to a multiple of this (aligned matmuls, any engine accepts it)

# transformers' config class of each ``model.init.arch``
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def padded_vocab_size(n_tokens: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-n_tokens // multiple) * multiple


def tiny_config(init: TinyModelInit, tokenizer):
    # lazy: transformers/torch; backends.models.loading imports this module without them
    import transformers

    config_class = getattr(transformers, CONFIG_CLASSES[init.arch])
    shape = dict(
        vocab_size=padded_vocab_size(len(tokenizer)),
        hidden_size=init.hidden_size,
        num_hidden_layers=init.layers,
        num_attention_heads=init.heads,
        num_key_value_heads=init.heads,
        intermediate_size=init.intermediate_size or 4 * init.hidden_size,
        max_position_embeddings=init.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=init.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    if init.arch == "qwen3":  # Qwen3 states head_dim on its own (it need not be hidden / heads)
        shape["head_dim"] = init.hidden_size // init.heads
    if init.arch != "llama":  # the Qwen configs default to sliding windows and a large rope base
        shape.update(use_sliding_window=False, max_window_layers=init.layers)
    return config_class(**shape)


def build_tiny_model(init: TinyModelInit, tokenizer, seed: int):
    """Random-init causal LM of ``init.arch``; the same ``seed`` gives the same weights on every rank."""
    # lazy: transformers/torch; backends.models.loading imports this module without them
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = tiny_config(init, tokenizer)
    devices = torch.random.fork_rng(devices=[])  # do not disturb the caller's RNG stream
    with devices:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model


def main(argv: list[str] | None = None) -> None:
    """``python -m backends.models.tiny --init JSON --alphabet CHARS --out DIR [--seed N]``: build a tiny
    model with a character tokenizer of ``CHARS`` and save it as an HF directory (the driver's way to
    get one without importing torch). Prints ``{"model_dir", "alphabet_ids"}`` as its last line."""
    parser = argparse.ArgumentParser(prog="python -m backends.models.tiny", description=main.__doc__.splitlines()[0])
    parser.add_argument("--init", required=True, help="model.init as JSON")
    parser.add_argument("--alphabet", required=True, help="the tokenizer's characters")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tokenizer = build_char_tokenizer(args.alphabet)
    save_hf(build_tiny_model(TinyModelInit.model_validate_json(args.init), tokenizer, args.seed), tokenizer, args.out)
    ids = [tokenizer.convert_tokens_to_ids(c) for c in args.alphabet]
    print(json.dumps({"model_dir": args.out, "alphabet_ids": ids}), flush=True)


if __name__ == "__main__":
    main()

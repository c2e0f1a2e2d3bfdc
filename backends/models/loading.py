"""The policy model and its tokenizer, from the recipe's ``[model]`` table, and HF-format saving.

Two sources: ``model.path`` (any local HF causal LM) or ``model.init`` (a tiny random-init Llama
with a character tokenizer built for the data). Either way the result saves as a real HF model
directory (``config.json``, ``model.safetensors``, tokenizer files) that transformers and vLLM load.
"""

from __future__ import annotations

import copy
import os

from backends.models.hf_dir import save_hf  # noqa: F401 - loading's callers save with it too
from backends.models.tiny import build_tiny_model
from backends.models.tokenizer import build_char_tokenizer, load_tokenizer
from skyrl_contracts.schema import ModelConfig


def load_tokenizer_for(model_cfg: ModelConfig, alphabet: str | None = None):
    """``"char"``: built from ``alphabet``; ``"auto"``: the model's own; else a local tokenizer path."""
    if model_cfg.tokenizer == "char":
        if not alphabet:
            raise ValueError('model.tokenizer = "char" needs the data\'s alphabet')
        return build_char_tokenizer(alphabet)
    if model_cfg.tokenizer == "auto":
        if model_cfg.path is None:
            raise ValueError('a new tiny model (model.init) needs model.tokenizer = "char" or a tokenizer path')
        return load_tokenizer(model_cfg.path)
    return load_tokenizer(model_cfg.tokenizer)


def torch_dtype(model_cfg: ModelConfig, device: str):
    """The dtype the trainer keeps the module in: bf16 on GPUs by default, fp32 on CPU."""
    # lazy: torch/transformers; backends.models is imported without them (orchestrator, tied)
    import torch

    if model_cfg.dtype == "bfloat16" or (model_cfg.dtype == "auto" and device == "cuda"):
        return torch.bfloat16
    return torch.float32


def load_model(model_cfg: ModelConfig, tokenizer, seed: int, attn_implementation: str = "sdpa"):
    """The policy model in fp32 (DeepSpeed casts it for bf16 training). LoRA is applied separately
    (``backends.models.lora.apply_lora``)."""
    # lazy: torch/transformers; backends.models is imported without them (orchestrator, tied)
    import torch

    if model_cfg.init is not None:
        model = build_tiny_model(model_cfg.init, tokenizer, seed)
        model.config._attn_implementation = attn_implementation
        return model
    # lazy: torch/transformers; backends.models is imported without them (orchestrator, tied)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_cfg.path, dtype=torch.float32, attn_implementation=attn_implementation
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    return model


def plain_copy(model, state_dict=None):
    """What ``save_hf(model, ...)`` then ``from_pretrained(dir, dtype="auto")`` gives, built in memory
    on the CPU: a fresh HF model of ``model``'s class and config holding its weights (``state_dict``:
    ZeRO-3's gathered tensors) in the dtype ``save_pretrained`` records, the module's own. Fresh
    layers are plain ``Linear``: a fake-quantized layer (``prepare_qat``) gives its master weights.
    Copies every tensor, so nothing done to the copy reaches ``model``."""
    # lazy: torch/transformers; backends.models is imported without them (orchestrator, tied)
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict() if state_dict is None else state_dict
    state = {name: t.detach().to("cpu", copy=True) for name, t in state.items()}
    config = copy.deepcopy(model.config)
    config.dtype = model.dtype  # what save_pretrained writes and dtype="auto" reads back
    fresh = type(model).from_pretrained(  # the class AutoModelForCausalLM reads from the saved config
        None,
        config=config,
        # the checkpoint's layout, as save_pretrained writes it: loading converts it like a file's
        state_dict=revert_weight_conversion(model, state),
        dtype="auto",
        generation_config=model.generation_config,  # a saved directory carries the model's own
    )
    return fresh.eval()


def load_hf(path: str | os.PathLike, dtype=None):
    """A saved model directory back as ``(model, tokenizer)`` (eval mode)."""
    # lazy: torch/transformers; backends.models is imported without them (orchestrator, tied)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path)

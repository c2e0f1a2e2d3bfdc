"""LoRA adapters with peft: wrap, save the adapter, and export merged weights.

Merging for export works on a copy, so training can continue with the adapter after a checkpoint.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

from skyrl_contracts.schema import LoraConfig

ADAPTER_DIR = "adapter"  # the adapter inside an exported model directory (checkpoints, final/)


def apply_lora(model, lora: LoraConfig):
    """The model wrapped with trainable LoRA adapters; base weights are frozen."""
    # lazy: peft; only LoRA runs import it (the standby pool preloads it on demand)
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def save_adapter(model, out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    model.save_pretrained(out)  # peft: adapter_config.json + adapter_model.safetensors
    return out


def merged_copy(model):
    """A plain transformers model with the adapters merged in (the training model is untouched)."""
    return copy.deepcopy(model).merge_and_unload()

"""Writing an HF model directory: its own module, so that both the model loaders
(``backends.models.loading``) and the tiny-model builder (``backends.models.tiny``) use it without
importing each other."""

from __future__ import annotations

import os
from pathlib import Path


def save_hf(model, tokenizer, out_dir: str | os.PathLike, state_dict=None) -> Path:
    """Write an HF model directory (safetensors) with the tokenizer; ``state_dict`` overrides the
    module's own tensors (ZeRO-3 gathered or LoRA-merged weights)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
